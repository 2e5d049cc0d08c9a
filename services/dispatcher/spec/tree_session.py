"""One speculative session's token-tree rounds on the dispatcher (policies `tree` and
`tree-stream`). Pure: no I/O, no clock; the counterpart of session.SpecRounds for trees,
with the same actions and the same face to the session (tree_run.TreeRun).

A round: ask the drafter for a tree rooted at the committed prefix (AskTree, with the shape rule
from tree_policy.TreePolicy), forward each depth's nodes to the verifier as they arrive (one
DraftBatch per drafter message, in node order, `parents` + `first_node`), and when the drafter
says the tree is done send the NAV (`nodes` = the round's node count). The VerifyResult's `path`
(accepted node indices, root to leaf) commits those tokens and the target's token; the drafter
rolls back to that path (DraftRollback.path) and the next round is asked at once.

A tree with no node (nothing paid for itself), the last wanted position, or a lost drafter give
a zero round: a chain NAV with no drafts (the target's next token alone).

Proactive drafting (policies with `proactive`): once the tree is complete the drafter goes on
as a chain along its main path (Limit up to `proactive` tokens past it); those tokens form a
proactive chain round (`parent` = the tree round) whose first token is the guess of the tree's
bonus token, sent as they come in batches of `batch` and closed by its NAV at its length. It is
kept (and becomes the active round, with no rollback) only if the tree's whole main path was
accepted and the target's token equals the guess, as for chains; otherwise it is dropped (the
verifier drops it too) and the drafter rolls back to the accepted path. A kept chain round's
result commits its accepted drafts and the target's token, and the next tree is asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common import protocol, tree
from common.tree_shape import ROOT, check_parents
from services.dispatcher.spec.dp_batching import BatchPlanner
from services.dispatcher.spec.nav_trigger import DraftWindow, NavTrigger
from services.dispatcher.spec.session import (Draft, Emit, Hooks, Limit, Rollback, SendBatch,
                                              SendNav, SpecError, Stats)
from services.dispatcher.spec.tree_policy import TreePolicy


@dataclass
class AskTree:
    """Ask the drafter for round `round`'s tree (DraftRequest.tree) in epoch `epoch`."""
    round: int
    epoch: int
    request: protocol.TreeRequest
    until: int = 0


@dataclass
class TreeRound:
    id: int
    start: int                 # position of the root's children (= C when it was asked)
    limit: int                 # most nodes the drafter was allowed
    max_depth: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    sent: int = 0              # nodes transmitted
    closed: bool = False       # the NAV is sent

    main_len: int = 0          # nodes on its main path (known once the tree is done)

    @property
    def end(self) -> int:      # SpecRounds' face: a tree has no chain end
        return self.start


@dataclass
class ChainRound:
    """A proactive chain behind a tree round: tokens at base, base+1, ... (base: the guess of
    the tree's bonus token). Once kept it is the active round, its drafts from base + 1."""
    id: int
    parent: int
    base: int
    length: int                # tokens it takes before its NAV
    drafts: list[Draft] = field(default_factory=list)
    sent: int = 0
    closed: bool = False

    @property
    def start(self) -> int:
        return self.base + 1

    @property
    def end(self) -> int:
        return self.base + len(self.drafts)


class TreeRounds:
    def __init__(self, prompt_len: int, max_tokens: int, policy, tree: TreePolicy, shape,
                 hooks: Hooks | None = None, proactive: int = 0, batch: int = 4,
                 trigger: NavTrigger | None = None):
        """`shape(depth_left)` -> the protocol.TreeRequest of the next round; `proactive`:
        most tokens of the proactive chain drafted behind a complete tree (0 = none); `batch`:
        its tokens per DraftBatch; `trigger`: ends that chain earlier (a NAV trigger on its
        drafts' confidence, e.g. PipeSD's dual threshold), else it runs to `proactive`."""
        self.prompt_len = prompt_len
        self.C = prompt_len
        self.final = prompt_len + max_tokens
        self.policy = policy
        self.tree = tree
        self.shape = shape
        self.hooks = hooks or Hooks()
        self.rounds: list[TreeRound] = []
        self.drafts: list[Draft] = []      # SpecRounds' face: trees hold no chain drafts
        self.next_id = 1
        self.epoch = 0
        self.drafting = True
        self.stats = Stats()
        self.trigger = trigger or NavTrigger()   # the tree's shape ends a tree round; this
        #                                          ends a proactive chain round
        self.window = DraftWindow()
        self.planner = BatchPlanner()
        self.proactive = max(0, int(proactive)) if policy.proactive else 0
        self.batch = max(1, int(batch))

    # --- inputs -------------------------------------------------------------------------------
    def start(self) -> list:
        return self._next_round()

    def on_tree(self, start: int, first_node: int, tokens: list[int], parents: list[int],
                probs: list[float], done: bool, q_ids=None, q_probs=None) -> list:
        """One drafter message of the current epoch's tree round."""
        r = self.rounds[0] if self.rounds else None
        if r is None or r.closed or start != r.start or first_node != len(r.tokens):
            return []    # not the round being grown (a stale or repeated message)
        try:
            check_parents(parents, first_node, r.limit, r.max_depth, r.depths)
        except (ValueError, OverflowError) as e:
            raise SpecError(f"drafter tree for round {r.id}: {e}") from None
        for i, p in enumerate(parents):
            if any(r.parents[j] == p and r.tokens[j] == tokens[i] for j in range(len(r.tokens))):
                raise SpecError(f"drafter tree for round {r.id}: node {first_node + i} repeats "
                                f"a sibling's token {tokens[i]}")
            r.tokens.append(int(tokens[i]))
            r.parents.append(int(p))
            r.probs.append(float(probs[i]))
        out: list = []
        if tokens:
            drafts = [Draft(r.start + r.depths[first_node + i], int(t), float(probs[i]),
                            None if q_ids is None else q_ids[i],
                            None if q_probs is None else q_probs[i])
                      for i, t in enumerate(tokens)]
            out.append(SendBatch(r.id, 0, r.start, drafts, parents=list(parents),
                                 first_node=first_node))
            r.sent = len(r.tokens)
            self.stats.batches += 1
            self.hooks.batch(len(drafts))
        if done:
            out += self._nav(r, "tree")
            out += self._behind(r)
        return out

    def on_chain(self, d: Draft) -> list:
        """A chain token of the current epoch: the proactive round behind a tree, or the kept
        chain round being completed."""
        c = self.rounds[-1] if self.rounds else None
        if not isinstance(c, ChainRound) or c.closed or d.position != c.base + len(c.drafts):
            return []
        c.drafts.append(d)
        out: list = []
        reason = None
        if len(c.drafts) > 1:      # the guess is not a draft of this round
            reason = self.trigger.observe(d.prob, d.token, d.position - self.prompt_len)
        if reason is None and (len(c.drafts) >= c.length or d.position >= self.final - 2):
            reason = "length"
        if reason is not None or len(c.drafts) - c.sent >= self.batch:
            out.append(self._chain_batch(c))
        if reason is not None:
            c.closed = True
            self.stats.nav_reasons[reason] = self.stats.nav_reasons.get(reason, 0) + 1
            self.hooks.nav(reason)
            out.append(SendNav(c.id, c.end, reason))
        return out

    def _chain_batch(self, c: ChainRound) -> SendBatch:
        b = SendBatch(c.id, c.parent, c.base + c.sent, c.drafts[c.sent:])
        c.sent = len(c.drafts)
        self.stats.batches += 1
        self.hooks.batch(len(b.drafts))
        return b

    def _behind(self, r: TreeRound) -> list:
        """The proactive chain behind a complete tree (its main path's next tokens)."""
        r.main_len = len(_main_path(r.parents))
        base = r.start + r.main_len
        length = min(self.proactive, self.final - 1 - base)
        if not self.drafting or length < 2 or not r.tokens:
            return []
        self.rounds.append(ChainRound(self.next_id, r.id, base, length))
        self.next_id += 1
        self.trigger.reset()
        return [Limit(base + length)]

    def on_result(self, round_id: int, start: int, accepted: int, token: int,
                  early: bool = False, path: list[int] | None = None) -> list:
        path = list(path or [])
        if not self.rounds or round_id != self.rounds[0].id:
            if any(r.id == round_id for r in self.rounds) or round_id >= self.next_id:
                self.stats.unknown_results += 1
            else:
                self.stats.duplicate_results += 1
            return []
        r = self.rounds[0]
        if isinstance(r, ChainRound):
            return self._chain_result(r, start, accepted, token, early)
        if start != r.start or len(path) != accepted or not self._is_path(r, path):
            raise SpecError(f"result for tree round {r.id} (start {start}, accepted {accepted}, "
                            f"path {path}) does not fit what was sent (start {r.start}, "
                            f"{r.sent} nodes)")
        out: list = [Emit([r.tokens[i] for i in path] + [token])]
        self._count(r.sent, accepted, early, _width_per_depth(r.parents[:r.sent]))
        if r.sent:
            self.tree.observe_round(r.parents[:r.sent], r.probs[:r.sent], path)
        self.rounds.pop(0)
        self.C = r.start + accepted + 1
        child = self.rounds[0] if self.rounds else None
        if (child is not None and r.closed and path == _main_path(r.parents)
                and child.drafts and child.drafts[0].token == token):
            self.stats.proactive_kept += len(child.drafts)
            self.hooks.proactive("kept", len(child.drafts))
            if child.sent == 0:   # nothing of it went out: a plain chain round from C, its
                child.parent, child.sent = 0, 1   # guess committed (never sent)
            if child.closed and child.end <= child.base:
                self.rounds = []   # only the guess: nothing to verify, a new tree
            else:
                return out + self._unstall()
        elif child is not None:
            self.stats.proactive_discarded += len(child.drafts)
            self.hooks.proactive("discarded", len(child.drafts))
        self.rounds = []
        if self.drafting:
            self.epoch += 1
            self.stats.rollbacks += 1
            out.append(Rollback(self.epoch, r.start + accepted, [token], 0, path=path))
        return out + self._next_round()

    def _chain_result(self, c: ChainRound, start: int, accepted: int, token: int,
                      early: bool) -> list:
        n = len(c.drafts) - 1          # its drafts after the (committed) guess
        if start != c.start or not 0 <= accepted <= n or (accepted < n and
                                                          c.start + accepted >= c.base + c.sent):
            raise SpecError(f"result for chain round {c.id} (start {start}, accepted {accepted}) "
                            f"does not fit what was sent (start {c.start}, {n} drafts)")
        drafts = c.drafts[1:1 + accepted]
        out: list = [Emit([d.token for d in drafts] + [token])]
        self._count(c.sent - 1, accepted, early)
        self.rounds = []
        self.C = c.start + accepted + 1
        if self.drafting:
            self.epoch += 1
            self.stats.rollbacks += 1
            out.append(Rollback(self.epoch, c.start + accepted, [token], 0))
        return out + self._next_round()

    def _unstall(self) -> list:
        """A kept chain round whose drafter is gone: verify what it has."""
        c = self.rounds[0]
        if not self.drafting and not c.closed:
            return self._close_chain(c, "no_drafter")
        return []

    def _close_chain(self, c: ChainRound, reason: str) -> list:
        out: list = []
        c.closed = True
        self.stats.nav_reasons[reason] = self.stats.nav_reasons.get(reason, 0) + 1
        self.hooks.nav(reason)
        if c.sent < len(c.drafts):
            out.append(self._chain_batch(c))
        if c.parent and not c.sent:
            self.rounds.remove(c)   # an unsent proactive round is simply dropped
            return []
        return out + [SendNav(c.id, c.end, reason)]

    def _count(self, sent: int, accepted: int, early: bool,
               nodes_per_depth: list[int] | None = None) -> None:
        self.stats.round(sent, accepted, early)
        self.hooks.round(sent, accepted, early, nodes_per_depth)

    def drafter_lost(self) -> list:
        """No more nodes will come: verify what was sent, then zero rounds."""
        self.drafting = False
        out: list = []
        for r in list(self.rounds):
            if r.closed:
                continue
            if isinstance(r, ChainRound):
                out += self._close_chain(r, "no_drafter")
            else:
                out += self._nav(r, "no_drafter")
        return out

    def verifier_lost(self) -> list:
        """A new verifier session holds the C committed tokens: the round in flight is
        forgotten, the drafter goes back to them and a new round is asked."""
        self.rounds = []
        out: list = []
        if self.drafting:
            self.epoch += 1
            out.append(Rollback(self.epoch, self.C, [], 0))
        return out + self._next_round()

    def resync(self, committed: int, last_token: int) -> list:
        """The stream moved on without verification (edge-only): restart from `committed`."""
        self.C = committed
        self.rounds = []
        out: list = []
        if self.drafting:
            self.epoch += 1
            out.append(Rollback(self.epoch, committed - 1, [last_token], 0))
        return out + self._next_round()

    def edge_only(self) -> list:
        """The cloud is gone: the drafter goes back to the committed tokens and drafts a chain
        from there (speculative mode's degraded stream)."""
        self.rounds = []
        self.epoch += 1
        return [Rollback(self.epoch, self.C, [], self.final)]

    # --- internals ----------------------------------------------------------------------------
    def _is_path(self, r: TreeRound, path: list[int]) -> bool:
        """Each node a child of the one before, the first a root child, all sent."""
        prev = ROOT
        for i in path:
            if not 0 <= i < r.sent or r.parents[i] != prev:
                return False
            prev = i
        return True

    def _nav(self, r: TreeRound, reason: str) -> list:
        r.closed = True
        self.stats.nav_reasons[reason] = self.stats.nav_reasons.get(reason, 0) + 1
        self.hooks.nav(reason)
        if not r.tokens:        # nothing paid for itself: the target's next token alone
            return [SendNav(r.id, r.start, reason)]
        return [SendNav(r.id, 0, reason, nodes=len(r.tokens))]

    def _next_round(self) -> list:
        if self.rounds or self.C >= self.final:
            return []
        depth_left = self.final - 1 - self.C
        r = TreeRound(self.next_id, self.C, 0, 0)
        self.next_id += 1
        self.rounds.append(r)
        if not self.drafting or depth_left < 1:
            return self._nav(r, "length" if self.drafting else "no_drafter")
        req = self.shape(depth_left)
        r.limit, r.max_depth = req.max_nodes, req.max_depth
        return [AskTree(r.id, self.epoch, req)]


def _main_path(parents: list[int]) -> list[int]:
    """From the root, the lowest-index child each time."""
    path: list[int] = []
    want = ROOT
    while True:
        kid = next((i for i, p in enumerate(parents) if p == want), None)
        if kid is None:
            return path
        path.append(kid)
        want = kid


def _width_per_depth(parents: list[int]) -> list[int]:
    """Nodes at each depth of a tree (the metrics' `nodes_per_depth`)."""
    ds = tree.depths(parents)
    return [ds.count(d) for d in range(max(ds) + 1)] if ds else []
