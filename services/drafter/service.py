"""The drafter: the GGUF draft model at the edge, drafting continuously for every open session.

Protocol (DESIGN.md §3; all messages of a session share the dispatcher's channel rid):

    DraftOpen(token_ids, sampling)    -> Ack once the prompt is in the session's KV cache
    DraftRequest(until | n)           -> DraftTokens, one message per token, as each is drafted
    DraftRollback(seq=epoch, keep, append, until)   truncate, append the target's token, go on
    DraftRequest(tree=TreeRequest, until)  -> one DraftTokens per tree depth (parents, first_node;
                                      the last with tree_done), then a chain on the main path
    DraftRollback(..., path)          after a tree round: the accepted path becomes the context
    Close                             -> Ack; the context is freed

Streaming, not request/response: the dispatcher raises the session's limit (`until` = committed
+ lookahead) and the drafter keeps drafting up to it while verification is in flight (PipeSD's
proactive drafting); every token goes out the moment it exists, so the NAV trigger and the DP
batcher see it at once. One drafting loop serves all sessions round-robin, one token per step,
on the compute thread; handlers only change a session's state between steps, so a rollback never
races a decode. A token drafted in an old epoch (a rollback arrived during its step) is dropped.
"""

from __future__ import annotations

import asyncio
import math

from common import constraint, metrics, protocol
from common.tree_shape import Shape
from common.protocol import Msg, ProtocolError
from common.runtime import Service, Session
from services.drafter.config import DrafterConfig
from services.drafter.engine import (MAX_Q_WIDTH, DraftError, DraftModel, DraftSession,
                                     TreeDepth)


class DrafterSession(Session):
    """A session around the engine's DraftSession (`busy`: a step of it is on the compute
    thread)."""

    def __init__(self, sid: str, ident: bytes, rid: int, seq: int, draft: DraftSession):
        super().__init__(sid, ident, rid, seq)
        self.draft = draft
        self.prefilled = False
        self.epoch = 0           # seq of the last rollback: tags every DraftTokens
        self.limit = 0           # draft while len(context) < limit
        self.pending: list[Msg] = []   # rollbacks / requests that arrived during a step, in order
        self.tree: protocol.DraftRequest | None = None   # a tree round asked for / being grown
        self.tree_started = False
        self.tree_until = 0            # after the tree: draft its main path on up to this

    def wants_step(self) -> bool:
        return not self.closed and not self.busy and (
            not self.prefilled or self.tree is not None or len(self.draft.tokens) < self.limit)


class Drafter(Service):
    name = "drafter"

    def __init__(self, cfg: DrafterConfig, ctx=None):
        super().__init__(cfg, ctx)
        self.cfg: DrafterConfig = cfg
        self.model: DraftModel | None = None
        self.order: list[str] = []      # round-robin order of session ids
        self.turn = 0
        self.wakeup = asyncio.Event()
        self.route(protocol.DraftOpen, self.on_open)
        self.route(protocol.DraftRequest, self.on_request)
        self.route(protocol.DraftRollback, self.on_rollback)
        self.route(protocol.Close, self.on_close)

    async def setup(self) -> None:
        from common import models

        path = models.resolve_drafter(self.cfg.drafter)
        self.model = await asyncio.to_thread(DraftModel, str(path), self.cfg.threads,
                                             self.cfg.verbose_llama, self.cfg.context_pool)
        self.log.info("drafter %s loaded: vocab %d, trained context %d", path.name,
                      self.model.n_vocab, self.model.n_ctx_train)
        metrics.declare_drafter(self.name)
        self.spawn_loop("draft", self.draft_loop())

    async def teardown(self) -> None:
        # a step may still run on the compute thread (its session closed meanwhile): freeing
        # the model under it crashed the process; wait for it
        await asyncio.to_thread(self._compute_lock.acquire)
        try:
            for s in list(self.sessions.values()):
                self._free(s)
            if self.model is not None:
                self.model.close()
        finally:
            self._compute_lock.release()

    # --- handlers -------------------------------------------------------------------------------
    async def on_open(self, ident: bytes, msg: protocol.DraftOpen, frames) -> None:
        if self.sessions.admit(msg, msg.token_ids) is not None:
            return  # a retry of this open: the Ack follows the prefill
        if not 1 <= msg.top_k <= MAX_Q_WIDTH:
            raise ProtocolError(protocol.BAD_FIELD, f"top_k must be in [1, {MAX_Q_WIDTH}]",
                                field="top_k")
        s = msg.sampling
        protocol.check_sampling(s, self.model.n_vocab)
        if msg.max_tokens:
            need = len(msg.token_ids) + msg.max_tokens + 1
            n_ctx = 64 * math.ceil(need / 64)
        else:
            n_ctx = self.cfg.n_ctx
        if n_ctx > self.model.n_ctx_train:
            raise ProtocolError(protocol.TOO_LARGE, f"{n_ctx} positions > the drafter's trained "
                                                    f"context {self.model.n_ctx_train}")
        if msg.tree_nodes > self.cfg.max_tree_nodes:
            raise ProtocolError(protocol.TOO_LARGE, f"tree_nodes {msg.tree_nodes} > this "
                                f"drafter's max_tree_nodes {self.cfg.max_tree_nodes}",
                                field="tree_nodes")
        matcher = None
        if msg.constraint is not None:
            tok = await asyncio.to_thread(self.model.ll_tokenizer)
            matcher = constraint.Matcher(tok, msg.constraint, self.model.n_vocab)
        try:
            draft = self.model.session(list(msg.token_ids), n_ctx, s, msg.top_k,
                                       self.cfg.n_batch, msg.tree_nodes, features=msg.features,
                                       matcher=matcher, output_start=msg.constrained_from)
        except DraftError as e:
            raise ProtocolError(protocol.BAD_FIELD, str(e)) from None
        metrics.PROMPT_CACHE.labels(self.name, "hit").inc(draft.reused)
        metrics.PROMPT_CACHE.labels(self.name, "miss").inc(len(draft.tokens) - 1 - draft.reused)
        sess = DrafterSession(msg.sid, ident, msg.rid, msg.seq, draft)
        sess.limit = len(draft.tokens)
        self.sessions.add(sess)
        self.order.append(msg.sid)
        self.wakeup.set()

    async def on_request(self, ident: bytes, msg: protocol.DraftRequest, frames) -> None:
        s = self.sessions.find(msg)
        s.ident, s.rid = ident, msg.rid
        if msg.tree is not None:
            t = msg.tree
            if not s.draft.tree_nodes:
                raise ProtocolError(protocol.BAD_FIELD, "a tree round in a session opened "
                                    "without tree_nodes", field="tree")
            if t.max_nodes > s.draft.tree_nodes:
                raise ProtocolError(protocol.TOO_LARGE, f"tree.max_nodes {t.max_nodes} > the "
                                    f"session's tree_nodes {s.draft.tree_nodes}",
                                    field="tree.max_nodes")
        if s.busy:
            s.pending.append(msg)   # after the step, and after any rollback queued before it
        else:
            self._request(s, msg)

    def _request(self, s: DrafterSession, msg: protocol.DraftRequest) -> None:
        if msg.seq < s.epoch:        # sent before a rollback already applied
            return
        if msg.tree is not None:
            s.tree, s.tree_started, s.tree_until = msg, False, msg.until
            s.limit = len(s.draft.tokens)   # no chain step until the tree is done
            self.wakeup.set()
        elif s.tree is None:
            self._set_limit(s, msg.until, msg.n)
        else:
            s.tree_until = msg.until   # applies once the tree round is done

    async def on_rollback(self, ident: bytes, msg: protocol.DraftRollback, frames) -> None:
        s = self.sessions.find(msg)
        s.ident, s.rid = ident, msg.rid
        queued = [m.seq for m in s.pending if isinstance(m, protocol.DraftRollback)]
        if msg.seq <= max([s.epoch] + queued):
            return  # a retry of a rollback already applied (or queued)
        if s.busy:
            s.pending.append(msg)   # applied, in order, as soon as the step ends
        else:
            await self._apply_rollback(s, msg)

    async def _apply_rollback(self, s: DrafterSession, msg: protocol.DraftRollback) -> None:
        s.tree = None                  # a tree round in progress is abandoned
        try:
            s.draft.rollback(msg.keep, list(msg.append), list(msg.path))
        except DraftError as e:
            await self.error(s.ident, msg, protocol.BAD_FIELD, str(e),
                             field="path" if msg.path else "keep")
            return
        s.epoch = msg.seq
        s.limit = len(s.draft.tokens)
        self._set_limit(s, msg.until, 0)

    def _set_limit(self, s: DrafterSession, until: int, n: int) -> None:
        end = len(s.draft.tokens)
        want = until if until > 0 else end + n
        s.limit = min(want, end + self.cfg.max_lookahead, s.draft.n_ctx)
        if s.limit > end:
            self.wakeup.set()

    def session_dropped(self, s: DrafterSession) -> None:
        self.order.remove(s.sid)
        if not s.busy:
            self._free(s)   # else the step in flight frees it when it ends

    def _free(self, s: DrafterSession) -> None:
        s.closed = True
        s.draft.close()

    # --- the drafting loop ----------------------------------------------------------------------
    def _next(self) -> DrafterSession | None:
        n = len(self.order)
        for i in range(n):
            sid = self.order[(self.turn + i) % n]
            s = self.sessions[sid]
            if s.wants_step():
                self.turn = (self.turn + i + 1) % n
                return s
        return None

    async def draft_loop(self) -> None:
        while True:
            s = self._next()
            if s is None:
                self.wakeup.clear()
                await self.idle("draft", self.wakeup)
                continue
            self.beat("draft")
            try:
                await self._step(s)
            except Exception as e:  # noqa: BLE001 - one session's bug must not stop all drafting
                await self.fail_session(s.ident, protocol.DraftRequest(sid=s.sid, seq=s.epoch,
                                                                       rid=s.rid), "drafting", e)

    async def _step(self, s: DrafterSession) -> None:
        """One step of one session: its prefill, or one draft token, then a pending rollback."""
        s.busy = True
        epoch = s.epoch
        try:
            if not s.prefilled:
                seconds = await self.compute(s.draft.prefill)
                result = None
            elif s.tree is not None:
                if s.tree_started:
                    result = await self.compute(s.draft.tree_step)
                else:
                    s.tree_started = True
                    result = await self.compute(s.draft.tree_begin, Shape.of(s.tree.tree))
            else:
                result = await self.compute(s.draft.step)
        except DraftError as e:
            result = e
        finally:
            s.busy = False
        if s.closed:
            self._free(s)
            return
        if isinstance(result, DraftError):
            code = protocol.TOO_LARGE if "context full" in str(result) else protocol.INTERNAL
            if s.tree is not None and s.prefilled:
                code = protocol.TOO_LARGE if "context full" in str(result) else \
                    protocol.BAD_FIELD
                s.tree = None
                s.draft.tree_abort()
            await self.error(s.ident, protocol.DraftRequest(sid=s.sid, seq=s.epoch, rid=s.rid),
                             code, str(result))
            s.limit = len(s.draft.tokens)
            if not s.prefilled:   # a session that cannot hold its prompt is gone
                await self.drop_session(s.sid)
        elif not s.prefilled:
            s.prefilled = True
            metrics.FORWARD.labels(self.name, "prefill").observe(seconds)
            await self.send(s.ident, protocol.Ack(sid=s.sid, seq=s.open_seq, rid=s.rid))
        elif epoch == s.epoch and not any(isinstance(m, protocol.DraftRollback)
                                           for m in s.pending):
            metrics.FORWARD.labels(self.name, "draft").observe(result.seconds)
            if isinstance(result, TreeDepth):
                if result.done:
                    s.tree = None
                    self._set_limit(s, s.tree_until, 0)
                await self.send(s.ident, *self._tree_msg(s, result))
            else:
                await self.send(s.ident, *self._tokens_msg(s, result))
        while s.pending:
            m = s.pending.pop(0)
            if isinstance(m, protocol.DraftRollback):
                await self._apply_rollback(s, m)
            else:
                self._request(s, m)

    def _tree_msg(self, s: DrafterSession, d: TreeDepth) -> tuple[protocol.DraftTokens, list]:
        msg = protocol.DraftTokens(sid=s.sid, seq=s.epoch, rid=s.rid, start=d.start,
                                   token_ids=d.tokens, probs=d.probs, seconds=d.seconds,
                                   parents=d.parents, first_node=d.first_node,
                                   tree_done=d.done, rows=d.rows)
        buffers = []
        if d.q_ids is not None:
            msg.q_ids, ids = protocol.tensor_frame(d.q_ids, 0)
            msg.q_probs, probs = protocol.tensor_frame(d.q_probs, 1)
            buffers = [ids, probs]
        return msg, buffers

    def _tokens_msg(self, s: DrafterSession, d) -> tuple[protocol.DraftTokens, list]:
        msg = protocol.DraftTokens(sid=s.sid, seq=s.epoch, rid=s.rid, start=d.position,
                                   token_ids=[d.token], probs=[min(1.0, d.prob)],
                                   seconds=d.seconds)
        buffers = []
        if d.q_ids is not None:
            msg.q_ids, ids = protocol.tensor_frame(d.q_ids.reshape(1, -1), 0)
            msg.q_probs, probs = protocol.tensor_frame(d.q_probs.reshape(1, -1), 1)
            buffers = [ids, probs]
        if d.entropy is not None:
            msg.entropies, msg.margins = [min(100.0, d.entropy)], [d.margin]
        return msg, buffers


def main(argv=None) -> None:
    Drafter.launch(DrafterConfig, argv)


if __name__ == "__main__":
    main()
