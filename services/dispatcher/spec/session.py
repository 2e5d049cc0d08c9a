"""One speculative session's round bookkeeping on the dispatcher (DESIGN.md §3). Pure: no I/O,
no clock. The session (chain_run.ChainRun) feeds it drafter tokens and verifier results and
carries out the actions it returns (send a batch, send a NAV, emit tokens, roll the drafter back,
raise its limit).

Positions are absolute (prompt included). C = committed tokens. `drafts` holds the drafter's
tokens at positions C, C+1, ... of its current epoch. Rounds cover consecutive positions:

    rounds[0]   the verifier's active round: drafts from start = C; batches go out by the DP
                plan (or all at NAV); closed once its NAV trigger fires (the triggering token is
                included) and the NAV request is sent
    rounds[1:]  proactive rounds, each drafted while the NAV of the one before is in flight: its
                first token (at the previous round's end) is the guess of that round's bonus
                token, the rest are its drafts; sent in N̂-token batches tagged with parent =
                the previous round's id. PipeSD keeps one (depth 1); `depth` allows more.

Tokens drafted when no round may take them (the last round is closed and either proactive
drafting is off or `depth` proactive rounds exist) are held and assigned once a result frees a
slot.

On a result for rounds[0] with a accepted drafts and target token t at position e = start + a:
emit drafts[start:e] + [t]; C = e + 1. If the drafter's own token at e is t (only possible when
every draft was accepted), its later tokens stay valid: rounds[1] (if any) is kept and becomes
the active round, and no rollback is needed. Otherwise every proactive round is discarded and the
drafter rolls back to e tokens + [t] (a new epoch; tokens of older epochs are ignored by the
caller).
Results for rounds already resolved are duplicates (ignored); results for rounds this session
never sent are counted and ignored; a result that contradicts what was sent raises SpecError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.dispatcher.spec.dp_batching import BatchPlanner
from services.dispatcher.spec.nav_trigger import NavTrigger


class SpecError(RuntimeError):
    """The verifier's answer contradicts what this session sent."""


@dataclass(frozen=True)
class Policy:
    name: str
    trigger: str        # nav_trigger.make_trigger name
    dp: bool            # DP token batching while drafting (else one batch when the NAV fires)
    proactive: bool     # keep drafting and sending while a NAV is in flight
    stream: bool        # streaming verification with early reject on the verifier
    bo: bool            # BO autotuner moves (R1, R2) on live traffic
    tree: bool = False  # token-tree rounds (tree_session.TreeRounds) instead of chains


POLICIES = {
    "pipesd": Policy("pipesd", "pipesd", dp=True, proactive=True, stream=False, bo=True),
    "pipesd-stream": Policy("pipesd-stream", "pipesd", dp=True, proactive=True, stream=True,
                            bo=True),
    "vanilla": Policy("vanilla", "vanilla", dp=False, proactive=False, stream=False, bo=False),
    "hsl": Policy("hsl", "hsl", dp=False, proactive=False, stream=False, bo=False),
    "edgellm": Policy("edgellm", "edgellm", dp=False, proactive=False, stream=False, bo=False),
    # The oracle-trigger's rounds end at a draft the target rejects, so a proactive round behind
    # one is always discarded: it waits instead, and its drafter does not spend the edge core on
    # tokens it knows are lost (3-4 % of its TPT in an S1 run, the drafter sharing its core).
    "oracle-trigger": Policy("oracle-trigger", "oracle-trigger", dp=True, proactive=False,
                             stream=False, bo=False),
    # Token trees: the tree's shape ends a round (no NAV trigger); each depth's
    # nodes go out as they are drafted; knobs "cs" (cost scale) and "m" (max nodes)
    "tree": Policy("tree", "tree", dp=True, proactive=True, stream=False, bo=False, tree=True),
    "tree-stream": Policy("tree-stream", "tree", dp=True, proactive=True, stream=True, bo=False,
                          tree=True),
    # PipeSD with the dual threshold replaced by an online acceptance model and a stopping rule
    # priced by the link model (services/dispatcher/spec/learned_trigger.py); it tunes itself, so the
    # (R1, R2) autotuner has nothing to move (its knob k goes through bench/tuning.py's BO)
    "pipesd-learned": Policy("pipesd-learned", "pipesd-learned", dp=True, proactive=True,
                             stream=False, bo=False),
}


@dataclass
class Draft:
    position: int
    token: int
    prob: float
    q_ids: np.ndarray | None = None
    q_probs: np.ndarray | None = None
    entropy: float | None = None   # the drafter's distribution there (pipesd-learned's features)
    margin: float | None = None


@dataclass
class Round:
    id: int
    parent: int          # 0, or the round whose NAV was in flight when this one was drafted
    base: int            # position of its first token (a proactive round's guess)
    start: int           # first draft position
    end: int             # position after its last assigned token
    sent: int            # tokens at [base, sent) are transmitted
    closed: bool = False  # its NAV fired: no more tokens, NAV sent


# --- actions ---------------------------------------------------------------------------------
@dataclass
class SendBatch:
    round: int
    parent: int
    start: int
    drafts: list[Draft]
    parents: list[int] | None = None   # tree rounds: each node's parent (wire format)
    first_node: int = 0


@dataclass
class SendNav:
    round: int
    end: int
    reason: str
    nodes: int = 0     # tree rounds: verify nodes [0, nodes)


@dataclass
class Emit:
    tokens: list[int]
    logprobs: list | None = None   # the target's TokenLogprob per token, when asked for


@dataclass
class Rollback:
    epoch: int
    keep: int
    append: list[int]
    until: int
    path: list[int] = field(default_factory=list)   # after a tree round: its accepted path


@dataclass
class Limit:
    until: int


@dataclass
class Stats:
    rounds: int = 0
    draft_tokens: int = 0          # drafts sent for verification in resolved rounds
    accepted: int = 0
    batches: int = 0
    early_rejects: int = 0
    proactive_kept: int = 0        # tokens of proactive rounds that were kept
    proactive_discarded: int = 0
    rollbacks: int = 0
    duplicate_results: int = 0
    unknown_results: int = 0
    nav_reasons: dict = field(default_factory=dict)
    accepted_per_round: list = field(default_factory=list)

    def round(self, sent: int, accepted: int, early: bool) -> None:
        """One resolved verification round: `sent` drafts (or tree nodes), `accepted` of them."""
        self.rounds += 1
        self.draft_tokens += sent
        self.accepted += accepted
        self.early_rejects += int(early)
        self.accepted_per_round.append(accepted)


class Hooks:
    """Observers for metrics; the defaults do nothing."""

    def nav(self, reason: str) -> None: ...
    def batch(self, size: int) -> None: ...
    def replan(self, planner: BatchPlanner) -> None: ...
    def round(self, draft_tokens: int, accepted: int, early: bool,
              nodes_per_depth: list[int] | None = None) -> None: ...   # None: a chain
    def proactive(self, outcome: str, tokens: int) -> None: ...


class SpecRounds:

    def __init__(self, prompt_len: int, max_tokens: int, policy: Policy, trigger: NavTrigger,
                 planner: BatchPlanner, window, params, lookahead: int, hooks: Hooks | None = None,
                 depth: int = 1):
        """`window`: the shared DraftWindow (N̂); `params()` -> (alpha, beta, gamma) now;
        `lookahead`: how far past C the drafter may run; `depth`: proactive rounds allowed
        behind the active one (PipeSD: 1)."""
        self.prompt_len = prompt_len
        self.C = prompt_len
        self.final = prompt_len + max_tokens   # positions [prompt_len, final) are wanted
        self.policy = policy
        self.trigger = trigger
        self.planner = planner
        self.window = window
        self.params = params
        self.lookahead = max(1, lookahead)
        self.depth = max(1, depth)
        self.hooks = hooks or Hooks()
        self.drafts: list[Draft] = []
        self.rounds: list[Round] = []
        self.next_id = 1
        self.epoch = 0
        self.until = 0
        self.drafting = True
        self.stats = Stats()

    # --- inputs -------------------------------------------------------------------------------
    def start(self) -> list:
        """First actions after the sessions are opened: the drafter's limit (or a NAV)."""
        self.until = self._want_until()
        return [Limit(self.until)] + self._zero_round()

    def on_draft(self, d: Draft) -> list:
        """A drafter token of the current epoch."""
        if not self.drafting or d.position != self.C + len(self.drafts):
            return []   # a token we already have, or past a gap the caller should not send
        self.drafts.append(d)
        return self._assign()

    def on_result(self, round_id: int, start: int, accepted: int, token: int,
                  early: bool = False) -> list:
        if not self.rounds or round_id != self.rounds[0].id:
            if any(r.id == round_id for r in self.rounds) or round_id >= self.next_id:
                self.stats.unknown_results += 1   # never sent, or out of order: not ours to apply
            else:
                self.stats.duplicate_results += 1
            return []
        r = self.rounds[0]
        full = r.closed and accepted == r.end - r.start
        # a rejection names a draft that was sent; a full acceptance covers the whole NAV
        if start != r.start or accepted < 0 or (not full and r.start + accepted >= r.sent):
            raise SpecError(f"result for round {r.id} (start {start}, accepted {accepted}) does "
                            f"not fit what was sent (start {r.start}, sent up to {r.sent})")
        e = r.start + accepted
        out: list = [Emit([d.token for d in self.drafts[r.start - self.C:e - self.C]] + [token])]
        sent_drafts = r.sent - r.start
        self.stats.round(sent_drafts, accepted, early)
        self.hooks.round(sent_drafts, accepted, early)
        self.trigger.on_round(sent_drafts, accepted)
        if r.closed and r.end > r.start:
            self.window.record(r.end - r.start)
        consistent = e - self.C < len(self.drafts) and self.drafts[e - self.C].token == token
        self.rounds.pop(0)
        old_c, self.C = self.C, e + 1
        if consistent:
            self.drafts = self.drafts[self.C - old_c:]
            if self.rounds:
                child = self.rounds[0]     # kept; any rounds behind it still wait on it
                self.stats.proactive_kept += child.end - child.base
                self.hooks.proactive("kept", child.end - child.base)
                if child.sent == child.base:
                    # none of it reached the verifier and its guess is now committed: from
                    # here on it is a plain round starting at C (nothing can be behind it,
                    # since only a closed round, whose tokens all went out, has a child)
                    child.parent, child.base, child.sent = 0, child.start, child.start
            want = self._want_until()
            if want != self.until:
                self.until = want
                out.append(Limit(want))
        else:
            for child in self.rounds:
                self.stats.proactive_discarded += child.end - child.base
                self.hooks.proactive("discarded", child.end - child.base)
            self.rounds = []
            self.drafts = []
            self.trigger.reset()
            self.epoch += 1
            self.stats.rollbacks += 1
            self.until = self._want_until()
            if self.drafting:
                out.append(Rollback(self.epoch, e, [token], self.until))
        out += self._assign()
        out += self._unstall()
        out += self._zero_round()
        return out

    def drafter_lost(self) -> list:
        """No more drafts will come: verify what exists, then go on with zero-draft rounds (the
        target decodes alone)."""
        self.drafting = False
        out: list = []
        for r in list(self.rounds):
            if r.closed:
                continue
            if r.end == r.base:          # nothing in it yet: drop it
                self.rounds.remove(r)
                continue
            out += self._nav(r, "no_drafter")
        return out + self._zero_round()

    def verifier_lost(self) -> list:
        """The verifier session is gone and a new one holds the committed prefix (C tokens; see
        services/dispatcher/recovery.py): rounds in flight are forgotten and the drafts past C,
        still valid guesses, are assigned, sent and verified again as if just drafted. The
        drafter is not disturbed."""
        self.rounds = []
        self.trigger.reset()
        out: list = []
        if self.drafting:
            self.until = self._want_until()
            out.append(Limit(self.until))
        return out + self._assign() + self._unstall() + self._zero_round()

    def resync(self, committed: int, last_token: int) -> list:
        """The stream moved on without verification (edge-only, degraded): its `committed`
        tokens (the last one `last_token`) are fixed now and a fresh verifier session holds
        them. Everything past them is forgotten and the drafter restarts from exactly them (a
        new epoch; it re-evaluates the last token)."""
        self.C = committed
        self.drafts = []
        self.rounds = []
        self.trigger.reset()
        self.epoch += 1
        self.until = self._want_until()
        out: list = []
        if self.drafting:
            out.append(Rollback(self.epoch, committed - 1, [last_token], self.until))
        return out + self._zero_round()

    # --- internals ----------------------------------------------------------------------------
    def _want_until(self) -> int:
        """How far the drafter may run: C + lookahead (sequential policies: one round's cap),
        never onto the last wanted position, which is always the target's own token."""
        n = self.lookahead
        if not self.policy.proactive and self.trigger.max_length:
            n = min(n, self.trigger.max_length)
        return max(self.C, min(self.C + n, self.final - 1))

    def _slot(self) -> Round | None:
        """The round the next unassigned token goes to, created if needed; None = hold it."""
        if not self.rounds:
            r = Round(self.next_id, 0, self.C, self.C, self.C, self.C)
            self.next_id += 1
            self.rounds.append(r)
            alpha, beta, gamma = self.params()
            if self.planner.update(alpha, beta, gamma, self.window.value):
                self.hooks.replan(self.planner)
            return r
        last = self.rounds[-1]
        if not last.closed:
            return last
        if len(self.rounds) <= self.depth and self.policy.proactive:
            r = Round(self.next_id, last.id, last.end, last.end + 1, last.end, last.end)
            self.next_id += 1
            self.rounds.append(r)
            return r
        return None

    def _assign(self) -> list:
        out: list = []
        while True:
            assigned = self.rounds[-1].end if self.rounds else self.C
            if assigned >= self.C + len(self.drafts):
                return out
            r = self._slot()
            if r is None:
                return out
            p = r.end
            r.end += 1
            out += self._token(r, p)

    def _token(self, r: Round, p: int) -> list:
        if r.parent and p == r.base:
            return []    # the guess of the parent's bonus: travels with the child's first batch
        d = self.drafts[p - self.C]
        self.trigger.context(d.entropy, d.margin)
        reason = self.trigger.observe(d.prob, d.token, p - self.prompt_len)
        active = r is self.rounds[0]
        if reason is None and p >= self.final - 2:
            reason = "length"      # its bonus is the last token wanted
        if reason is None and active and p + 1 >= self.until:
            reason = "length"      # the drafter pauses here: verify what there is
        if reason is not None:
            return self._nav(r, reason)
        if active and self.policy.dp:
            k = p - r.start + 1
            n = self.planner.window or 1
            if self.planner.is_cut((k - 1) % n + 1):
                return [self._batch(r)]
        elif not active and r.end - r.sent >= max(1, self.window.value):
            return [self._batch(r)]   # proactive tokens go in N̂-token batches
        return []

    def _batch(self, r: Round) -> SendBatch:
        b = SendBatch(r.id, r.parent, r.sent, self.drafts[r.sent - self.C:r.end - self.C])
        r.sent = r.end
        self.stats.batches += 1
        self.hooks.batch(len(b.drafts))
        return b

    def _nav(self, r: Round, reason: str) -> list:
        r.closed = True
        self.trigger.round_closed()   # a no-op when the trigger itself fired
        self.stats.nav_reasons[reason] = self.stats.nav_reasons.get(reason, 0) + 1
        self.hooks.nav(reason)
        out: list = []
        if r.sent < r.end:
            out.append(self._batch(r))
        out.append(SendNav(r.id, r.end, reason))
        if not self.policy.proactive and r is self.rounds[0] and self.drafting:
            self.until = r.end     # sequential policies: the drafter waits for the result
            out.append(Limit(self.until))
        return out

    def _unstall(self) -> list:
        """rounds[0] is open but no token can join it (the drafter is gone or paused at its
        limit): verify it now, even with no draft at all (then it asks for the next token)."""
        r = self.rounds[0] if self.rounds else None
        if r is not None and not r.closed and (not self.drafting or r.end >= self.until):
            return self._nav(r, "length" if self.drafting else "no_drafter")
        return []

    def _zero_round(self) -> list:
        """A round with no drafts (the target's next token alone): when the drafter is gone, or
        when only the last wanted token is left."""
        if self.rounds or self.C >= self.final:
            return []
        if self.drafting and self.C < self.final - 1:
            return []
        r = Round(self.next_id, 0, self.C, self.C, self.C, self.C, closed=True)
        self.next_id += 1
        self.rounds.append(r)
        reason = "length" if self.drafting else "no_drafter"
        self.stats.nav_reasons[reason] = self.stats.nav_reasons.get(reason, 0) + 1
        self.hooks.nav(reason)
        return [SendNav(r.id, r.end, reason)]
