"""Speculative-mode sessions on the verifier (DESIGN.md §3).

A `SpecSession` plugs into the verifier's engine loop, so the draft tokens of many sessions are
verified in one ragged forward pass. Its state, with C = committed tokens (prompt + output):

    KV cache   positions [0, C-1) always; the last committed token `t_last` (position C-1) is
               fed with the next draft tokens, so its logits row checks the first draft
    stream     received, unverified tokens at positions C, C+1, ... : the active round's drafts,
               then possibly a proactive round's tokens (the first one is its *guess* of the
               active round's bonus token, the rest are its drafts)
    decisions  position -> the target's token there and whether the stream token matched it,
               filled as soon as the logits row for a position and its token are both known

Rounds (ids from the dispatcher, increasing): the *active* round has start = C; behind it a
*chain* of proactive rounds, each drafted while the one before was being verified (`parent` =
that round's id; PipeSD sends one such round, the dispatcher may send more). When the active
round resolves (first rejected draft, or all drafts up to its NAV end accepted plus the bonus
token at `end`) the result goes back and C advances; the first proactive round is kept (and
becomes active) only if the round was fully accepted and the bonus equals that round's guess;
otherwise the whole chain is discarded with every row and KV entry past the new C - 1
(`kv.truncate`).

Streaming verification (`stream`): the forward runs over tokens as they arrive, rows are
checked at once, and a rejected draft resolves the round immediately (VerifyResult early=True)
without waiting for the NAV. Without it the forward runs at NAV time over the round (PipeSD).

Tree rounds (services/verifier/spec_tree.py): a round whose batches carry `parents` is a
token tree, verified at its NAV in one forward over all its nodes; its result names the accepted
path. Proactive rounds behind it (chains extending its main path) wait, as received, until it
resolves, and are then taken as if they arrived after its result: kept only if the whole main
path was accepted and the bonus equals their guess. In a `stream` session a tree round is
verified at its NAV too (no forward per batch, no early result): until the NAV a later batch
may still add the child the target wants, so no node can be rejected early.

Idempotency: a resent batch (same round, overlapping positions, same tokens) and a repeated NAV
are answered from state; a result is never computed twice. A round the session never had, a gap
or a changed token is an Error with a stable code. The KV cache changes only between forward
passes (`inflight` guards it), since the forward runs on the compute thread.

Constrained output (SpecOpen.constraint): every decision is made on the masked row, p' ∝ p·m,
with m the constraint's mask after the committed output and the stream's tokens before the
position (the ones the decision assumes accepted). A draft outside the mask has p'(x) = 0 and is
rejected; a position behind such a draft is never reached, so its row is left unmasked. The
matcher follows the stream lazily (`_masked`) and is reset to the committed output at every
result. A tree round is walked on masked rows: each after the committed output and the path
walked to it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from common import constraint, metrics, protocol, sampling
from common.protocol import Msg, ProtocolError
from services.verifier import spec_verify
from services.verifier.engine import EngineSession, Work
from services.verifier.spec_tree import TreeRound

KEEP_RESULTS = 256     # rounds whose results are remembered for repeated NAVs
MAX_CHAIN = 64         # proactive rounds a session may have behind its active one
MAX_Q_WIDTH = 64


@dataclass
class Entry:
    token: int
    round: int
    guess: bool                       # first token of a proactive round: its parent's bonus guess
    q_ids: np.ndarray | None = None   # sparse draft distribution (sampling)
    q_probs: np.ndarray | None = None


@dataclass
class Round:
    id: int
    parent: int
    base: int                 # position of its first token (a child's guess)
    start: int                # its first draft position (base, or base + 1 for a child)
    next: int                 # position after its last received token
    nav_end: int | None = None
    closed: bool = False      # no more tokens: its NAV or its child arrived


@dataclass
class Outcome:
    end: int       # position of the target's token (start + accepted)
    token: int
    full: bool     # every draft up to the NAV end accepted (the token is the bonus)


class SpecSession(EngineSession):

    def __init__(self, sid: str, ident: bytes, rid: int, seq: int, kv, prompt: list[int],
                 s: protocol.Sampling, stream: bool, vocab_size: int, max_stream: int = 4096,
                 max_tree_nodes: int = 64, max_tree_depth: int = 32,
                 logprobs: int | None = None, cached: int = 0,
                 matcher: constraint.Matcher | None = None):
        super().__init__(sid, ident, rid, seq, kv)
        self.matcher = matcher   # the output constraint's state after the committed output ...
        self.matched = 0         # ... and this many stream tokens
        self.sampling = s
        self.greedy = sampling.is_greedy(s)
        self.stream_verify = stream
        self.vocab_size = vocab_size
        self.max_stream = max_stream
        self.cached = cached                    # prompt rows the prefix cache filled
        self.committed = list(prompt)           # prompt + every token committed since
        self.prefill = list(prompt[cached:-1])
        self.prefilled = not self.prefill
        self.C = len(prompt)
        self.t_last = prompt[-1]
        self.stream: list[Entry] = []
        self.decisions: dict[int, spec_verify.Decision] = {}
        self.logprobs = logprobs   # alternatives per token; None = no logprobs computed
        self.lps: dict[int, protocol.TokenLogprob] = {}   # position -> its decided token's
        self.tail: torch.Tensor | None = None   # the row predicting position tail_pos
        self.tail_pos = -1
        self.active: Round | None = None
        self.chain: list[Round] = []    # proactive rounds behind the active one, in order
        self.results: OrderedDict[int, tuple[protocol.VerifyResult, Outcome]] = OrderedDict()
        self.discarded: set[int] = set()
        self.max_round = 0
        self.forwards = 0
        self.inflight = False
        self.feed_from = 0
        self.max_tree_nodes, self.max_tree_depth = max_tree_nodes, max_tree_depth
        self.tree: TreeRound | None = None   # the active round, when it is a tree
        self.behind_tree: list[tuple] = []   # ("batch", msg, q_ids, q_probs) / ("verify", msg)
        self.behind_ids: set[int] = set()    # rounds waiting there

    # --- engine loop ------------------------------------------------------------------------------
    @property
    def prefilling(self) -> bool:
        return bool(self.prefill)

    def next_work(self, budget: int) -> Work | None:
        if self.closed:
            return None
        if self.adopting:   # one token at least is prefilled: its forward sends the open's Ack
            del self.prefill[:self.take_over(self.C - 2)]
        if self.prefill:
            take = self.prefill[:budget]
            self.inflight = True
            return Work(take, "none", "prefill")
        if self.tree is not None:
            return self._tree_work()
        end = self._feed_end()
        if end < self.C:
            return None
        fed = self.kv.length()
        tokens, pos0 = [], fed
        if fed == self.C - 1:
            tokens.append(self.t_last)
        for p in range(max(fed, self.C), end):
            tokens.append(self.stream[p - self.C].token)
        tokens = tokens[:budget]
        if not tokens:
            return None
        self.inflight = True
        self.feed_from = pos0
        return Work(tokens, "all", "verify")

    def _tree_work(self) -> Work | None:
        """The whole tree in one forward, after its NAV: the root's token, then every node."""
        t = self.tree
        if t.nodes is None or t.fed:
            return None
        fed = self.kv.length()
        if fed == self.C and self.tail_pos == self.C:
            lead = []     # a streaming session fed the root's token already: its row is the tail
        elif fed == self.C - 1:
            lead = [self.t_last]
        else:
            raise RuntimeError(f"tree round {t.id}: cache holds {fed} tokens, {self.C} committed")
        positions, ancestors = t.attention(len(lead))
        t.fed = self.inflight = True
        return Work([*lead, *t.tokens], "all", "verify", positions, ancestors)

    def _feed_end(self) -> int:
        """Feed stream tokens at positions < this."""
        r = self.active
        if self.stream_verify:
            # everything up to the first mismatch (a rejected draft, or a proactive guess that
            # is not the bonus): nothing after it can be kept
            for p in range(self.C, self.C + len(self.stream)):
                d = self.decisions.get(p)
                if d is not None and not d.accepted:
                    return p
            return self.C + len(self.stream)
        if r is not None and r.nav_end is not None:
            return r.nav_end
        return self.C - 1   # nothing to feed (t_last waits for the NAV too)

    def consume(self, work: Work, logits: torch.Tensor) -> list[Msg]:
        self.inflight = False
        self.forwards += 1
        if work.phase == "prefill":
            del self.prefill[:len(work.token_ids)]
            if self.prefill:
                return []
            self.prefilled = True
            return [self.open_ack()]
        if work.ancestors is not None:
            return [self._commit_tree(logits), *self.resolve()]
        for i in range(logits.shape[0]):
            self._row(self.feed_from + i + 1, logits[i])
        return self.resolve()

    def open_ack(self) -> protocol.Ack:
        """The answer to the open, once the cache holds the prompt."""
        return protocol.Ack(sid=self.sid, seq=self.seq, rid=self.rid, cached_tokens=self.cached)

    def cacheable(self) -> tuple[list[int], int]:
        # rows [0, C - 1) are committed tokens; later ones may be unverified drafts
        return self.committed, min(self.kv.length(), self.C - 1)

    def _row(self, position: int, row: torch.Tensor) -> None:
        """A logits row for `position` arrived: decide the token there, or keep the row."""
        k = position - self.C
        if k < 0:
            return
        if k < len(self.stream) and position not in self.decisions:
            self._decide_at(position, self.stream[k], row)
        self.tail, self.tail_pos = row, position   # rows arrive in order: keep the newest

    def _decide_at(self, position: int, e: Entry, row: torch.Tensor) -> None:
        """Decide the token at `position`, and keep its log-probabilities when asked for."""
        d = self.decisions[position] = self._decide(position, e, self._masked(position, row))
        if self.logprobs is not None:
            self.lps[position] = sampling.token_logprob(row, d.token, self.logprobs)

    def _decide(self, position: int, e: Entry, row: torch.Tensor) -> spec_verify.Decision:
        if e.guess:   # the parent's bonus position: the target's own token, compared with the guess
            token = spec_verify.bonus(row, self.sampling, position)
            return spec_verify.Decision(token, token == e.token)
        return spec_verify.decide(row, e.token, self.sampling, position, e.q_ids, e.q_probs)

    def _masked(self, position: int, row: torch.Tensor) -> torch.Tensor:
        """The row for `position` under the constraint: -inf outside the mask after the
        committed output and the stream's tokens before `position`. Unmasked when one of those
        tokens is outside the constraint (the position is unreachable) or, past the first
        stream position, when the mask is empty (it is raised once the position is reached)."""
        if self.matcher is None:
            return row
        k = position - self.C
        if self.matched > k:
            self.matcher.rollback(self.matched - k)
            self.matched = k
        if self.matched < k:
            wanted = [e.token for e in self.stream[self.matched:k]]
            self.matched += self.matcher.advance_valid(wanted)
            if self.matched < k:
                return row
        try:
            return constraint.apply(row, self.matcher.mask())
        except ProtocolError:
            if k == 0:
                raise
            return row

    def _tree_mask(self):
        """The tree walk's row mask: the constraint's after the committed output and the walked
        path's tokens (each accepted under the mask, so the matcher always takes them)."""
        if self.matcher is None:
            return None
        self.matcher.rollback(self.matched)
        self.matched = 0

        def mask(path_tokens: list[int], row: torch.Tensor) -> torch.Tensor:
            self.matcher.advance(path_tokens[self.matched:])
            self.matched = len(path_tokens)
            return constraint.apply(row, self.matcher.mask())
        return mask

    def _advance_committed(self, tokens: list[int]) -> None:
        """The committed output grew by `tokens` (the stream's first ones, then the target's):
        the matcher holds the committed output alone again."""
        if self.matcher is None:
            return
        self.matcher.rollback(self.matched)
        self.matched = 0
        self.matcher.advance_valid(tokens)   # past the output's end (its EOS) nothing is kept

    # --- rounds -----------------------------------------------------------------------------------
    def _outcome(self, r: Round) -> Outcome | None:
        end = r.nav_end if r.nav_end is not None else r.next
        for p in range(r.start, end):
            d = self.decisions.get(p)
            if d is None:
                return None
            if not d.accepted:
                return Outcome(p, d.token, False)
        if r.nav_end is None:
            return None
        d = self.decisions.get(end)
        if d is not None:
            return Outcome(end, d.token, True)
        if self.tail is not None and self.tail_pos == end:
            token = spec_verify.bonus(self._masked(end, self.tail), self.sampling, end)
            if self.logprobs is not None:
                self.lps[end] = sampling.token_logprob(self.tail, token, self.logprobs)
            return Outcome(end, token, True)
        return None

    def resolve(self) -> list[Msg]:
        """Resolve every round that can be (the active one, then kept proactive ones...)."""
        out: list[Msg] = []
        while self.active is not None and not self.inflight:
            r = self.active
            o = self._outcome(r)
            if o is None:
                break
            out.append(self._commit(r, o))
        return out

    def _commit(self, r: Round, o: Outcome) -> protocol.VerifyResult:
        accepted = o.end - r.start
        new_c = o.end + 1
        child = self.chain[0] if self.chain else None
        kept = (o.full and child is not None and child.base == o.end
                and self.stream[o.end - self.C].guess and self.stream[o.end - self.C].token == o.token)
        early = r.nav_end is None
        lps = None if self.logprobs is None else [self.lps[p] for p in range(r.start, new_c)]
        self.committed += [self.stream[p - self.C].token for p in range(self.C, o.end)]
        self.committed.append(o.token)
        self._advance_committed([self.stream[p - self.C].token for p in range(self.C, o.end)]
                                + [o.token])
        if kept:
            del self.stream[:new_c - self.C]
            self.decisions = {p: d for p, d in self.decisions.items() if p >= new_c}
            self.lps = {p: lp for p, lp in self.lps.items() if p >= new_c}
            self.active = self.chain.pop(0)
        else:
            self.discarded.update(c.id for c in self.chain)
            self.chain = []
            self.active = None
            self.stream = []
            self.decisions, self.lps = {}, {}
            self.tail, self.tail_pos = None, -1
            if self.kv.length() > new_c - 1:
                self.kv.truncate(new_c - 1)
        self.C, self.t_last = new_c, o.token
        res = protocol.VerifyResult(sid=self.sid, seq=r.id, rid=self.rid, round=r.id, start=r.start,
                                    accepted=accepted, token=o.token, early=early,
                                    forwards=self.forwards, logprobs=lps)
        self.results[r.id] = (res, o)
        while len(self.results) > KEEP_RESULTS:
            self.results.popitem(last=False)
        if early:
            metrics.EARLY_REJECTS.labels("verifier").inc()
        return res

    def _commit_tree(self, rows: torch.Tensor) -> protocol.VerifyResult:
        """Walk the verified tree, keep the accepted path's K/V, answer, then take the rounds
        that waited behind it."""
        t = self.tree
        if rows.shape[0] == len(t.tokens):   # no root token fed: its row is the kept tail
            rows = torch.cat((self.tail[None].to(rows.dtype), rows))
        path, token = t.walk(rows, self.sampling, self._tree_mask())
        lps = None
        if self.logprobs is not None:   # token j of the path is predicted by its parent's row
            emitted = [t.tokens[i] for i in path] + [token]
            row_of = [0] + [i + 1 for i in path]
            lps = [sampling.token_logprob(rows[r], x, self.logprobs)
                   for r, x in zip(row_of, emitted)]
        self.kv.move_rows([t.start + i for i in path], t.start)   # root token at start - 1
        end = t.start + len(path)
        self.committed += [t.tokens[i] for i in path]
        self.committed.append(token)
        o = Outcome(end, token, path == t.main_path())
        self._advance_committed([t.tokens[i] for i in path] + [token])
        self.tree = None
        self.stream, self.decisions, self.lps = [], {}, {}
        self.tail, self.tail_pos = None, -1
        self.C, self.t_last = end + 1, token
        res = protocol.VerifyResult(sid=self.sid, seq=t.id, rid=self.rid, round=t.id,
                                    start=t.start, accepted=len(path), token=token,
                                    forwards=self.forwards, path=path, logprobs=lps)
        self.results[t.id] = (res, o)
        while len(self.results) > KEEP_RESULTS:
            self.results.popitem(last=False)
        behind, self.behind_tree, self.behind_ids = self.behind_tree, [], set()
        for item in behind:
            try:
                if item[0] == "batch":
                    self.on_batch(*item[1:])
                else:
                    self.on_verify(item[1])
            except ProtocolError:
                # a proactive round that does not fit the accepted path: nothing of it can be
                # kept, and the dispatcher learns that from this result
                self.discarded.add(item[1].round)
        return res

    # --- messages ---------------------------------------------------------------------------------
    def on_batch(self, msg: protocol.DraftBatch, q_ids, q_probs) -> None:
        """Take a batch of draft tokens; raises ProtocolError on an inconsistent one."""
        rid = msg.round
        if rid in self.results or rid in self.discarded:
            return   # late or resent batch of a finished round
        if msg.parents is not None:
            self._tree_batch(msg, q_ids, q_probs)
            return
        if self.tree is not None:
            if msg.parent == self.tree.id or msg.parent in self.behind_ids or rid in self.behind_ids:
                if len(self.behind_ids) >= MAX_CHAIN and rid not in self.behind_ids:
                    raise ProtocolError(protocol.TOO_LARGE, f"more than {MAX_CHAIN} proactive rounds")
                self.behind_tree.append(("batch", msg, q_ids, q_probs))
                self.behind_ids.add(rid)
                return
            raise ProtocolError(protocol.BAD_FIELD if rid > self.max_round else protocol.UNKNOWN_ROUND,
                                f"round {rid} (parent {msg.parent}) while tree round "
                                f"{self.tree.id} is unresolved", field="round")
        if self.active is not None and rid == self.active.id:
            self._append(self.active, msg, q_ids, q_probs)
        elif any(c.id == rid for c in self.chain):
            self._append(next(c for c in self.chain if c.id == rid), msg, q_ids, q_probs)
        elif rid > self.max_round:
            self._open(msg, q_ids, q_probs)
        else:
            raise ProtocolError(protocol.UNKNOWN_ROUND, self._rounds_text(rid))

    def _tree_batch(self, msg: protocol.DraftBatch, q_ids, q_probs) -> None:
        rid, t = msg.round, self.tree
        if msg.parent != 0:
            raise ProtocolError(protocol.BAD_FIELD, f"round {rid}: a proactive round is a chain "
                                                    f"(no parents)", field="parents")
        if t is not None and rid == t.id:
            t.append(msg, q_ids, q_probs, self.max_tree_nodes, self.max_tree_depth)
            return
        if rid <= self.max_round:
            raise ProtocolError(protocol.UNKNOWN_ROUND, self._rounds_text(rid))
        if self.active is not None or t is not None:
            raise ProtocolError(protocol.BAD_FIELD, f"round {rid} opened while round "
                                                    f"{(self.active or t).id} is unresolved")
        if msg.start != self.C:
            raise ProtocolError(protocol.BAD_FIELD, f"round {rid} starts at {msg.start}; "
                                                    f"{self.C} tokens are committed", field="start")
        if msg.first_node != 0:
            raise ProtocolError(protocol.BAD_FIELD, f"tree round {rid}'s first batch starts at "
                                                    f"node {msg.first_node}, not 0", field="first_node")
        t = TreeRound(rid, self.C)
        t.append(msg, q_ids, q_probs, self.max_tree_nodes, self.max_tree_depth)  # may refuse it
        self.tree, self.max_round = t, rid

    def _open(self, msg: protocol.DraftBatch, q_ids, q_probs) -> None:
        rid, parent = msg.round, msg.parent
        if parent == 0:
            if self.active is not None or self.tree is not None:
                raise ProtocolError(protocol.BAD_FIELD, f"round {rid} opened while round "
                                                        f"{(self.active or self.tree).id} is "
                                                        f"unresolved")
            if msg.start != self.C:
                raise ProtocolError(protocol.BAD_FIELD, f"round {rid} starts at {msg.start}; "
                                                        f"{self.C} tokens are committed")
            self.active = Round(rid, 0, self.C, self.C, self.C)
            self.max_round = rid
            self._append(self.active, msg, q_ids, q_probs)
        elif self.active is not None and parent == (self.chain or [self.active])[-1].id:
            last = (self.chain or [self.active])[-1]
            if msg.start != last.next:   # past it: the parent's last batch was lost (a gap)
                raise ProtocolError(protocol.UNKNOWN_ROUND if msg.start > last.next
                                    else protocol.BAD_FIELD,
                                    f"proactive round {rid} starts at {msg.start}, its parent "
                                    f"{parent} ends at {last.next}")
            if len(self.chain) >= MAX_CHAIN:
                raise ProtocolError(protocol.TOO_LARGE, f"more than {MAX_CHAIN} proactive rounds")
            last.closed = True
            r = Round(rid, parent, msg.start, msg.start + 1, msg.start)
            self.chain.append(r)
            self.max_round = rid
            self._append(r, msg, q_ids, q_probs)
        elif parent in self.results and self.active is None:
            # the parent resolved before its child's first batch arrived
            _, o = self.results[parent]
            self.max_round = rid
            if o.full and msg.start == o.end and msg.token_ids[0] == o.token and self.C == o.end + 1:
                self.active = Round(rid, parent, o.end, o.end + 1, o.end + 1)
                self._append(self.active, _skip_first(msg), _rows(q_ids, 1), _rows(q_probs, 1))
            else:
                self.discarded.add(rid)
        elif parent in self.results or parent in self.discarded:
            self.max_round = rid
            self.discarded.add(rid)   # its parent was rejected: nothing to keep
        else:
            raise ProtocolError(protocol.UNKNOWN_ROUND,
                                f"round {rid} names parent {parent}, which is not an open round "
                                f"of this session ({self._rounds_text(rid)})")

    def _append(self, r: Round, msg: protocol.DraftBatch, q_ids, q_probs) -> None:
        start, tokens = msg.start, list(msg.token_ids)
        if start > r.next:   # lost on the way: a gap the dispatcher cures by a replay
            raise ProtocolError(protocol.UNKNOWN_ROUND, f"round {r.id}: batch starts at {start}, "
                                                        f"expected {r.next} (a batch is missing)")
        skip = r.next - start
        for i in range(min(skip, len(tokens))):    # a resend overlaps what we have
            e = self.stream[start + i - self.C] if start + i >= self.C else None
            if e is not None and e.token != tokens[i]:
                raise ProtocolError(protocol.BAD_FIELD, f"round {r.id}: position {start + i} "
                                                        f"resent as {tokens[i]}, was {e.token}")
        new = tokens[skip:]
        if not new:
            return
        if r.closed:
            raise ProtocolError(protocol.BAD_FIELD, f"round {r.id} is closed (its NAV or a "
                                                    f"proactive round followed it)")
        if len(self.stream) + len(new) > self.max_stream:
            raise ProtocolError(protocol.TOO_LARGE, f"more than {self.max_stream} unverified tokens")
        for i, t in enumerate(new):
            j = skip + i
            e = Entry(t, r.id, guess=(r.parent != 0 and r.next + i == r.base),
                      q_ids=None if q_ids is None else q_ids[j],
                      q_probs=None if q_probs is None else q_probs[j])
            self.stream.append(e)
            position = self.C + len(self.stream) - 1
            if self.tail is not None and self.tail_pos == position and position not in self.decisions:
                self._decide_at(position, e, self.tail)
        r.next += len(new)

    def on_verify(self, msg: protocol.VerifyRequest) -> protocol.VerifyResult | None:
        """A NAV: returns a stored result for a repeated one, else None (the engine answers)."""
        rid = msg.round
        if rid in self.results:
            return self.results[rid][0]
        if rid in self.discarded:
            return None   # the dispatcher already knows from the parent's result
        if self.tree is not None and rid == self.tree.id:
            self.tree.close(msg.nodes)
            return None
        if msg.nodes:
            known = (rid in self.behind_ids or any(c.id == rid for c in self.chain)
                     or (self.active is not None and self.active.id == rid))
            raise ProtocolError(protocol.BAD_FIELD if known else protocol.UNKNOWN_ROUND,
                                f"NAV for {msg.nodes} nodes: round {rid} is not a tree round "
                                f"({self._rounds_text(rid)})", field="nodes")
        if rid in self.behind_ids:
            self.behind_tree.append(("verify", msg))
            return None
        r = None
        if self.active is not None and rid == self.active.id:
            r = self.active
        elif any(c.id == rid for c in self.chain):
            r = next(c for c in self.chain if c.id == rid)
        elif rid > self.max_round and self.active is None and self.tree is None and msg.end == self.C:
            # a zero-draft round: the target's next token alone
            r = self.active = Round(rid, 0, self.C, self.C, self.C)
            self.max_round = rid
        if r is None:
            raise ProtocolError(protocol.UNKNOWN_ROUND, self._rounds_text(rid))
        if msg.end != r.next or msg.end < r.start:
            raise ProtocolError(protocol.BAD_FIELD, f"round {rid}: NAV up to {msg.end}, but its "
                                                    f"tokens end at {r.next}")
        r.nav_end = msg.end
        r.closed = True
        return None

    def _rounds_text(self, rid: int) -> str:
        active = self.active or self.tree
        return (f"unknown round {rid}: active {active.id if active else None}, "
                f"proactive {[c.id for c in self.chain]}, latest {self.max_round}")


def _skip_first(msg: protocol.DraftBatch) -> protocol.DraftBatch:
    return protocol.DraftBatch(sid=msg.sid, seq=msg.seq, rid=msg.rid, round=msg.round,
                               start=msg.start + 1, token_ids=list(msg.token_ids[1:]),
                               parent=msg.parent)


def _rows(a, k: int):
    return None if a is None else a[k:]
