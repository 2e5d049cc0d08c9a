"""The verifier: the target model in the cloud.

It holds one KV cache per session and runs every session that has work in ONE ragged forward
pass per step (the engine loop below): prefills, cloud-only decode steps and speculative draft
batches of different sessions share the projections and MLPs, each attending to its own cache.

A session type decides what it feeds and what it does with the logits
(services/verifier/engine.py: `CloudSession`; services/verifier/spec.py: `SpecSession`); this
module is the I/O around them: admission, the handlers, and the loop.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch

from common import constraint, metrics, protocol, sampling
from common.protocol import Msg, ProtocolError
from common.runtime import Service, check_token_ids
from services.verifier import spec_verify
from services.verifier.config import VerifierConfig
from services.verifier.engine import CloudSession, EngineSession, Work
from services.verifier.spec import MAX_Q_WIDTH, SpecSession


class Verifier(Service):
    name = "verifier"

    def __init__(self, cfg: VerifierConfig, ctx=None):
        super().__init__(cfg, ctx)
        self.cfg: VerifierConfig = cfg
        self.runner = None
        self.wakeup = asyncio.Event()
        self.route(protocol.CloudGenerate, self.on_cloud_generate)
        self.route(protocol.SpecOpen, self.on_spec_open)
        self.route(protocol.DraftBatch, self.on_draft_batch)
        self.route(protocol.VerifyRequest, self.on_verify)
        self.route(protocol.Close, self.on_close)

    async def setup(self) -> None:
        from common import models
        from common.runner import LayerRangeRunner

        path = models.resolve_target(self.cfg.target)
        dtype = getattr(torch, self.cfg.dtype)
        self.runner = await asyncio.to_thread(
            LayerRangeRunner, path, None, dtype, self.cfg.threads or None,
            device=self.cfg.device)
        self.vocab_size = self.runner.vocab_size
        self.target_path = str(path)
        self.log.info("target %s loaded: %d layers, vocab %d", path, self.runner.num_layers,
                      self.vocab_size)
        metrics.declare_verifier(self.name)
        self.spawn_loop("engine", self.engine_loop())

    # --- admission and handlers ----------------------------------------------------------------
    def add(self, session: EngineSession) -> None:
        self.sessions.add(session)
        self.wakeup.set()

    def load(self) -> tuple[int, int, int]:
        """Reported in Pong for placement (services/dispatcher/placement.py): sessions, tokens
        waiting for a forward (a cloud session's pending tokens, a speculative one's prefill),
        KV bytes."""
        sessions = self.sessions.values()
        queued = sum(len(getattr(s, "pending", None) or getattr(s, "prefill", None) or ())
                     for s in sessions)
        return len(sessions), queued, sum(s.kv.nbytes() for s in sessions)

    def retried_open(self, ident: bytes, msg: Msg, kind: type) -> EngineSession | None:
        """Admission for an open; the session when `msg` repeats its open (its replies now go to
        `ident` and `msg.rid`: whoever asked last), None for a new session."""
        old = self.sessions.admit(msg, msg.token_ids, self.vocab_size)
        if old is None:
            return None
        if not isinstance(old, kind):   # same sid and seq, but another kind of session
            raise ProtocolError(protocol.SESSION_EXISTS, f"session {msg.sid!r} is already open",
                                field="sid")
        old.ident, old.rid = ident, msg.rid
        return old

    async def matcher(self, msg) -> constraint.Matcher | None:
        """The open message's output constraint, advanced over the output it already has (a
        replay's); None without one. A constraint that does not compile is BAD_FIELD."""
        if msg.constraint is None:
            return None
        tok = await asyncio.to_thread(constraint.hf_tokenizer, self.target_path, self.vocab_size)
        m = constraint.Matcher(tok, msg.constraint, self.vocab_size)
        start = len(msg.token_ids) if msg.constrained_from is None else msg.constrained_from
        m.advance(list(msg.token_ids[start:]))
        return m

    async def on_cloud_generate(self, ident: bytes, msg: protocol.CloudGenerate, frames) -> None:
        if self.retried_open(ident, msg, CloudSession) is not None:
            return   # the stream goes on, to whoever asked last
        matcher = await self.matcher(msg)
        self.add(CloudSession(msg.sid, ident, msg.rid, msg.seq, self.runner.new_kv(), msg,
                              matcher))

    async def on_spec_open(self, ident: bytes, msg: protocol.SpecOpen, frames) -> None:
        old = self.retried_open(ident, msg, SpecSession)
        if old is not None:
            if old.prefilled:
                await self.send(ident, protocol.Ack(sid=msg.sid, seq=msg.seq, rid=msg.rid))
            return
        protocol.check_sampling(msg.sampling, self.vocab_size)
        matcher = await self.matcher(msg)
        s = SpecSession(msg.sid, ident, msg.rid, msg.seq, self.runner.new_kv(),
                        list(msg.token_ids), msg.sampling, msg.stream and self.cfg.stream_verify,
                        self.vocab_size, self.limits.max_tokens,
                        max_tree_nodes=self.cfg.max_tree_nodes, max_tree_depth=self.cfg.max_tree_depth,
                        logprobs=msg.logprobs, matcher=matcher)
        self.add(s)
        if s.prefilled:   # a one-token prompt: nothing to prefill
            await self.send(ident, protocol.Ack(sid=msg.sid, seq=msg.seq, rid=msg.rid))

    def spec_session(self, ident: bytes, msg: Msg) -> SpecSession:
        s = self.sessions.get(msg.sid)
        if not isinstance(s, SpecSession):
            raise ProtocolError(protocol.UNKNOWN_SESSION, f"no speculative session {msg.sid!r}",
                                field="sid")
        s.ident, s.rid = ident, msg.rid   # replies follow the latest connection and channel
        return s

    async def on_draft_batch(self, ident: bytes, msg: protocol.DraftBatch, frames) -> None:
        s = self.spec_session(ident, msg)
        if not msg.token_ids:
            raise ProtocolError(protocol.BAD_FIELD, "empty draft batch", field="token_ids")
        check_token_ids(msg.token_ids, self.vocab_size)
        q_ids = q_probs = None
        if not s.greedy and not sampling.is_gumbel(s.sampling):   # gumbel: no q needed
            if msg.q_ids is None or msg.q_probs is None:
                raise ProtocolError(protocol.BAD_FIELD, "sampling needs q_ids and q_probs",
                                    field="q_ids")
            q_ids = protocol.tensor_numpy(msg.q_ids, frames)
            q_probs = protocol.tensor_numpy(msg.q_probs, frames).astype(np.float32)
            if q_ids.ndim == 2 and q_ids.shape[1] > MAX_Q_WIDTH:
                raise ProtocolError(protocol.TOO_LARGE, f"q wider than {MAX_Q_WIDTH}",
                                    field="q_ids")
            why = spec_verify.check_q(list(msg.token_ids), q_ids, q_probs, self.vocab_size)
            if why:
                raise ProtocolError(protocol.BAD_FIELD, why, field="q_probs")
            q_ids = q_ids.astype(np.int64)
        # acknowledge first: the dispatcher times batches by this Ack (its α/β fit)
        await self.send(ident, protocol.Ack(sid=msg.sid, seq=msg.seq, rid=msg.rid))
        s.on_batch(msg, q_ids, q_probs)
        await self.flush(s)

    async def on_verify(self, ident: bytes, msg: protocol.VerifyRequest, frames) -> None:
        s = self.spec_session(ident, msg)
        stored = s.on_verify(msg)
        if stored is not None:
            await self.send(ident, stored)
            return
        await self.flush(s)

    async def flush(self, s: SpecSession) -> None:
        """Send the results of every round `s` can resolve now; wake the loop for the rest."""
        for reply in s.resolve():
            await self.send(s.ident, reply)
        self.wakeup.set()

    # --- the engine loop ------------------------------------------------------------------------
    def plan_step(self) -> list[tuple[EngineSession, Work]]:
        budget = self.cfg.max_batch_tokens
        step = []
        # decode and verify work first, prompts with what is left: a long prompt is chunked to
        # the budget and never takes a step's whole budget from sessions already decoding
        for s in sorted(self.sessions.values(), key=lambda s: s.prefilling):
            if budget <= 0 or len(step) >= self.cfg.max_batch_sessions:
                break
            try:
                work = s.next_work(budget)
            except Exception as e:  # noqa: BLE001 - this session's bug ends this session only
                step.append((s, e))
                continue
            if work is not None and work.token_ids:
                step.append((s, work))
                budget -= len(work.token_ids)
        return step

    def run_step(self, step):
        from common.runner import Segment

        # While a speculative session is open a drafter drafts at the same time as we verify
        # (PipeSD drafts ahead); when it runs on this machine (the resource plan,
        # common/resources.py), its cores are not ours to spin on. Alone, we take them all.
        threads = self.cfg.threads
        if self.cfg.spec_threads and any(not isinstance(s, CloudSession)
                                         for s in self.sessions.values()):
            threads = self.cfg.spec_threads
        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

        segs = [Segment(s.kv, torch.tensor(w.token_ids, dtype=torch.long),
                        "all" if w.logits == "all" else "last", w.positions, w.ancestors)
                for s, w in step]
        t = time.perf_counter()
        out = self.runner.forward(segs, 0, self.runner.num_layers)
        dt = time.perf_counter() - t
        phase = step[0][1].phase if len({w.phase for _, w in step}) == 1 else "mixed"
        metrics.FORWARD.labels(self.name, phase).observe(dt)
        metrics.FORWARD_TOKENS.labels(self.name, phase).observe(sum(len(w.token_ids) for _, w in step))
        metrics.FORWARD_SESSIONS.labels(self.name, phase).observe(len(step))
        return out

    async def end_session(self, s: EngineSession, what: str, exc: BaseException) -> None:
        """A bug while serving `s`: it alone ends, with `internal`; the loop goes on."""
        await self.fail_session(s.ident, protocol.Close(sid=s.sid, seq=s.seq, rid=s.rid), what,
                                exc)

    async def engine_loop(self) -> None:
        """One ragged forward per step over every session with work. A failure is contained to
        the session it belongs to: its planning, its share of the forward (the batch is rerun
        without it, common/runtime.Service.compute_each) or its sampling."""
        while True:
            step = self.plan_step()
            for s, work in [(s, w) for s, w in step if isinstance(w, Exception)]:
                await self.end_session(s, "scheduling", work)
            step = [(s, w) for s, w in step if not isinstance(w, Exception)]
            if not step:
                self.wakeup.clear()
                await self.idle("engine", self.wakeup)
                continue
            self.beat("engine")
            outs = await self.compute_each(self.run_step, step)
            for (s, work), logits in zip(step, outs):
                if self.sessions.get(s.sid) is not s:
                    continue  # closed while the forward ran
                if isinstance(logits, Exception):
                    await self.end_session(s, "forward", logits)
                    continue
                try:
                    replies = s.consume(work, logits)
                except ProtocolError as e:   # the constraint allows no token: the request ends
                    await self.end_constrained(s.ident, protocol.Close(sid=s.sid, seq=s.seq,
                                                                       rid=s.rid), e)
                    continue
                except Exception as e:  # noqa: BLE001 - sampling, a malformed round, ...
                    await self.end_session(s, "sampling and verification", e)
                    continue
                for reply in replies:
                    await self.send(s.ident, reply)
                if isinstance(s, CloudSession) and s.closed:
                    self.sessions.pop(s.sid)
            metrics.KV_BYTES.labels(self.name).set(sum(s.kv.nbytes() for s in self.sessions.values()))
            await asyncio.sleep(0)  # let the socket deliver new work between steps


def main(argv=None) -> None:
    Verifier.launch(VerifierConfig, argv)


if __name__ == "__main__":
    main()
