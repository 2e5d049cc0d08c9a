"""The verifier: the target model in the cloud.

It holds one KV cache per session and runs every session that has work in ONE ragged forward
pass per step (the engine loop below): prefills, cloud-only decode steps and speculative draft
batches of different sessions share the projections and MLPs, each attending to its own cache.

A session type decides what it feeds and what it does with the logits:
* `CloudSession` (cloud-only mode): prefill, then one token per step, streamed back.
* speculative sessions live in services/verifier/spec.py and plug into the same loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from common import metrics, protocol, sampling
from common.protocol import Msg, ProtocolError
from common.runtime import Service
from services.verifier.config import VerifierConfig


@dataclass
class Work:
    """What a session feeds into one step."""
    token_ids: list[int]
    logits: str          # "last" | "all" | "none" (prefill chunk whose logits nobody needs)
    phase: str           # metrics label: prefill | decode | verify


class EngineSession:
    """Base of per-session state in the engine loop."""

    def __init__(self, sid: str, ident: bytes, rid: int, seq: int, kv):
        self.sid = sid
        self.ident = ident
        self.rid = rid
        self.seq = seq
        self.kv = kv
        self.closed = False

    def next_work(self, budget: int) -> Work | None:
        raise NotImplementedError

    def consume(self, work: Work, logits: torch.Tensor) -> list[Msg]:
        """Handle the step's logits; return the messages to send to the session's peer."""
        raise NotImplementedError


class CloudSession(EngineSession):
    """Cloud-only generation: prefill (chunked), then autoregressive decode."""

    def __init__(self, sid, ident, rid, seq, kv, req: protocol.CloudGenerate):
        super().__init__(sid, ident, rid, seq, kv)
        self.pending = list(req.token_ids)   # tokens not yet in the cache
        self.sampling = req.sampling
        self.max_tokens = req.max_tokens
        self.eos = req.eos_token_id
        self.generated: list[int] = []

    def next_work(self, budget: int) -> Work | None:
        if not self.pending or self.closed:
            return None
        take = self.pending[:budget]
        last_chunk = len(take) == len(self.pending)
        phase = "decode" if self.generated else "prefill"
        return Work(take, "last" if last_chunk else "none", phase)

    def consume(self, work: Work, logits: torch.Tensor) -> list[Msg]:
        del self.pending[:len(work.token_ids)]
        if work.logits == "none":
            return []
        position = self.kv.length()
        token = sampling.sample(logits[-1], self.sampling, position)
        self.generated.append(token)
        done, reason = False, ""
        if self.eos is not None and token == self.eos:
            done, reason = True, "eos"
        elif len(self.generated) >= self.max_tokens:
            done, reason = True, "length"
        if not done:
            self.pending = [token]
        else:
            self.closed = True
        return [protocol.CloudTokens(sid=self.sid, seq=self.seq, rid=self.rid,
                                     index=len(self.generated) - 1, token_ids=[token], done=done,
                                     finish_reason=reason)]


class Verifier(Service):
    name = "verifier"

    def __init__(self, cfg: VerifierConfig):
        super().__init__(cfg)
        self.cfg: VerifierConfig = cfg
        self.runner = None
        self.sessions: dict[str, EngineSession] = {}
        self.wakeup = asyncio.Event()
        self.route(protocol.CloudGenerate, self.on_cloud_generate)
        self.route(protocol.Close, self.on_close)
        # speculative mode registers its handlers on this service
        from services.verifier import spec  # noqa: PLC0415
        spec.install(self)

    async def setup(self) -> None:
        from common import models  # noqa: PLC0415
        from common.runner import LayerRangeRunner  # noqa: PLC0415

        path = models.resolve_target(self.cfg.target)
        dtype = getattr(torch, self.cfg.dtype)
        self.runner = await asyncio.to_thread(
            LayerRangeRunner, path, None, dtype, self.cfg.threads or None,
            device=self.cfg.device)
        self.vocab_size = self.runner.vocab_size
        self.log.info("target %s loaded: %d layers, vocab %d", path, self.runner.num_layers,
                      self.vocab_size)
        metrics.declare_verifier(self.name)
        self.spawn_loop("engine", self.engine_loop())

    # --- admission ------------------------------------------------------------------------------
    def check_tokens(self, token_ids: list[int], what: str = "token_ids") -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ProtocolError(protocol.BAD_FIELD,
                                f"{what} holds ids outside the vocabulary [0, {self.vocab_size}): "
                                f"{bad[:5]}")

    def admit(self, msg: Msg, prompt: list[int]) -> bool:
        """Common checks for opening a session. False = a retry of an open already done."""
        old = self.sessions.get(msg.sid)
        if old is not None:
            if old.seq == msg.seq:
                return False  # idempotent retry: already open
            raise ProtocolError(protocol.SESSION_EXISTS, f"session {msg.sid!r} is already open")
        if not msg.sid:
            raise ProtocolError(protocol.BAD_FIELD, "sid must not be empty")
        if len(self.sessions) >= self.cfg.max_sessions:
            raise ProtocolError(protocol.BUSY,
                                f"{len(self.sessions)} sessions open (max_sessions)")
        if not prompt:
            raise ProtocolError(protocol.BAD_FIELD, "empty prompt")
        if len(prompt) > self.limits.max_prompt_tokens:
            raise ProtocolError(protocol.TOO_LARGE, f"prompt of {len(prompt)} tokens > "
                                                   f"max_prompt_tokens {self.limits.max_prompt_tokens}")
        self.check_tokens(prompt)
        return True

    def add(self, session: EngineSession) -> None:
        self.sessions[session.sid] = session
        metrics.SESSIONS.labels(self.name).set(len(self.sessions))
        self.wakeup.set()

    def drop(self, sid: str) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            s.closed = True
        metrics.SESSIONS.labels(self.name).set(len(self.sessions))

    async def on_cloud_generate(self, ident: bytes, msg: protocol.CloudGenerate, frames) -> None:
        if not self.admit(msg, msg.token_ids):
            old = self.sessions[msg.sid]
            if not isinstance(old, CloudSession):  # same sid and seq, but another kind of session
                raise ProtocolError(protocol.SESSION_EXISTS, f"session {msg.sid!r} is already open")
            old.ident, old.rid = ident, msg.rid    # a retry: the stream goes to whoever asked last
            return
        self.add(CloudSession(msg.sid, ident, msg.rid, msg.seq, self.runner.new_kv(), msg))

    def open_sessions(self):
        return list(self.sessions)

    def load(self) -> tuple[int, int, int]:
        """Reported in Pong for placement (services/dispatcher/placement.py): sessions, tokens
        waiting for a forward (a cloud session's pending tokens, a speculative one's prefill),
        KV bytes."""
        queued = sum(len(getattr(s, "pending", None) or getattr(s, "prefill", None) or ())
                     for s in self.sessions.values())
        return len(self.sessions), queued, sum(s.kv.nbytes() for s in self.sessions.values())

    async def drop_session(self, sid: str) -> None:
        self.drop(sid)

    # --- the engine loop ------------------------------------------------------------------------
    def plan_step(self) -> list[tuple[EngineSession, Work]]:
        budget = self.cfg.max_batch_tokens
        step = []
        for s in list(self.sessions.values()):
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
        from common.runner import Segment  # noqa: PLC0415

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
                        "all" if w.logits == "all" else "last") for s, w in step]
        t = time.perf_counter()
        out = self.runner.forward(segs, 0, self.runner.num_layers)
        dt = time.perf_counter() - t
        phase = step[0][1].phase if len({w.phase for _, w in step}) == 1 else "mixed"
        metrics.FORWARD.labels(self.name, phase).observe(dt)
        metrics.FORWARD_TOKENS.labels(self.name, phase).observe(sum(len(w.token_ids) for _, w in step))
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
                except Exception as e:  # noqa: BLE001 - sampling, a malformed round, ...
                    await self.end_session(s, "sampling and verification", e)
                    continue
                for reply in replies:
                    await self.send(s.ident, reply)
                if isinstance(s, CloudSession) and s.closed:
                    self.drop(s.sid)
            metrics.KV_BYTES.labels(self.name).set(sum(s.kv.nbytes() for s in self.sessions.values()))
            await asyncio.sleep(0)  # let the socket deliver new work between steps


def main(argv=None) -> None:
    Verifier.launch(VerifierConfig, argv)


if __name__ == "__main__":
    main()
