"""The verifier: the target model in the cloud.

It holds one KV cache per session and runs every session that has work in ONE ragged forward
pass per step (the engine loop below): prefills, cloud-only decode steps and speculative draft
batches of different sessions share the projections and MLPs, each attending to its own cache.

A session type decides what it feeds and what it does with the logits
(services/verifier/engine.py: `CloudSession`; services/verifier/spec.py: `SpecSession`); this
module is the I/O around them: admission, the handlers, and the loop.

KV memory (common/prefix_cache.py): each new session reserves its KV within a byte
budget, starting from the longest prefix of its prompt that a finished session left cached
(exact: the rows have the bits a prefill would compute); a session that cannot fit is refused
with `busy` before any work.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch

from common import constraint, metrics, prefix_cache, protocol, sampling
from common.prefix_cache import PrefixCache
from common.protocol import Msg, ProtocolError
from common.runtime import Service, check_token_ids
from services.verifier import spec_verify
from services.verifier.config import VerifierConfig
from services.verifier.engine import CloudSession, EngineSession, Work
from services.verifier.spec import MAX_Q_WIDTH, SpecSession



def queue_wait_s(queued: int, prompt: int, rate: float, max_s: float) -> float | None:
    """Seconds of prompt work queued ahead of a new session with `prompt` tokens, when it is
    over `max_s` (the session is refused); None to admit it. An empty queue always admits (a
    long prompt alone is served, however slowly), and so does a rate not yet measured."""
    if queued <= 0 or rate <= 0:
        return None
    wait = queued / rate
    return wait if wait + prompt / rate > max_s else None


class Verifier(Service):
    name = "verifier"

    def __init__(self, cfg: VerifierConfig, ctx=None):
        super().__init__(cfg, ctx)
        self.cfg: VerifierConfig = cfg
        self.runner = None
        self.kv_cache: PrefixCache | None = None
        self.prefill_rate = 0.0   # tokens per second of forwards with prompt work (EWMA)
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
        self.log.info(prefix_cache.describe(self.prefix_cache(), self.cfg))
        self.spawn_loop("engine", self.engine_loop())

    def prefix_cache(self) -> PrefixCache:
        """The KV budget and prefix cache over this verifier's runner (made on first use)."""
        if self.kv_cache is None:
            self.kv_cache = prefix_cache.for_service(self.runner, self.cfg, self.name)
        return self.kv_cache

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
        return len(sessions), queued, self.live_bytes()   # cached prefixes give way: not load

    def live_bytes(self) -> int:
        return sum(s.kv.nbytes() for s in self.sessions.values())

    def open_kv(self, prompt: list[int], new_tokens: int):
        """KV for a new session within the budget, holding the longest cached prefix of its
        prompt: (kv, reused rows); `busy` / `too_large` when it cannot fit, or when the prompt
        work queued ahead of it would keep it silent too long (queue_wait_s)."""
        queued = self.load()[1]
        own = len(prompt) - self.prefix_cache().match(prompt)[1]   # its rows not cached
        wait = queue_wait_s(queued, own, self.prefill_rate, self.cfg.max_queue_s)
        if wait is not None:
            raise ProtocolError(
                protocol.BUSY,
                f"verifier prefill queue full: {queued} tokens queued ahead, about {wait:.1f} s "
                f"at {self.prefill_rate:.0f} tokens/s (max_queue_s {self.cfg.max_queue_s:g}); "
                f"retry in about {max(1, round(wait))} s", retry_after_s=round(wait, 3))
        kv, hit = self.prefix_cache().open(prompt, new_tokens, self.live_bytes())
        self.report_kv()
        return kv, hit

    def report_kv(self) -> None:
        metrics.KV_BYTES.labels(self.name).set(self.live_bytes() + self.prefix_cache().cached_bytes)

    def session_dropped(self, s) -> None:
        """A session ended (closed, reaped, or finished generating): its committed rows go to
        the prefix cache, unless it ended on a bug (its state may be half-updated)."""
        if isinstance(s, EngineSession) and not s.failed:
            tokens, n = s.cacheable()
            self.prefix_cache().put(tokens, s.kv, n, live_bytes=self.live_bytes())
            self.prefix_cache().fit(self.live_bytes())
        self.report_kv()

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

    def session_kv(self, ident: bytes, msg: protocol.CloudGenerate | protocol.SpecOpen,
                   new_tokens: int):
        """(kv, reused rows) a new session starts with: the cache of the session it adopts
        (protocol ADOPT), which ends here, else one within the budget (open_kv)."""
        if not msg.adopt:
            return self.open_kv(msg.token_ids, new_tokens)
        old = self.sessions.get(msg.adopt)
        if not isinstance(old, EngineSession) or old.ident != ident or old.closed:
            raise ProtocolError(protocol.UNKNOWN_SESSION, f"adopt: no session {msg.adopt!r} of "
                                                          f"this client", field="adopt")
        if len(msg.token_ids) < 2:
            raise ProtocolError(protocol.BAD_FIELD, "adopt: token_ids needs two tokens at least",
                                field="token_ids")
        self.sessions.pop(msg.adopt)
        return old.kv, 0

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
        kv, hit = self.session_kv(ident, msg, msg.max_tokens)
        s = CloudSession(msg.sid, ident, msg.rid, msg.seq, kv, msg, cached=hit, matcher=matcher)
        s.adopting = bool(msg.adopt)
        self.add(s)

    async def on_spec_open(self, ident: bytes, msg: protocol.SpecOpen, frames) -> None:
        old = self.retried_open(ident, msg, SpecSession)
        if old is not None:
            if old.prefilled:
                await self.send(ident, old.open_ack())
            return
        protocol.check_sampling(msg.sampling, self.vocab_size)
        matcher = await self.matcher(msg)
        # room for what it may generate, and a tree round's nodes past the committed tokens
        kv, hit = self.session_kv(ident, msg, (msg.max_tokens or self.cfg.kv_reserve_tokens)
                                  + self.cfg.max_tree_nodes)
        s = SpecSession(msg.sid, ident, msg.rid, msg.seq, kv,
                        list(msg.token_ids), msg.sampling, msg.stream and self.cfg.stream_verify,
                        self.vocab_size, self.limits.max_tokens,
                        max_tree_nodes=self.cfg.max_tree_nodes, max_tree_depth=self.cfg.max_tree_depth,
                        logprobs=msg.logprobs, cached=hit, matcher=matcher)
        s.adopting = bool(msg.adopt)
        self.add(s)
        if s.prefilled:   # a one-token prompt, or every row cached: nothing to prefill
            await self.send(ident, s.open_ack())

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
        if phase != "decode" and dt > 0:
            rate = sum(len(w.token_ids) for _, w in step) / dt
            self.prefill_rate = rate if not self.prefill_rate else \
                0.7 * self.prefill_rate + 0.3 * rate
        metrics.FORWARD.labels(self.name, phase).observe(dt)
        metrics.FORWARD_TOKENS.labels(self.name, phase).observe(sum(len(w.token_ids) for _, w in step))
        metrics.FORWARD_SESSIONS.labels(self.name, phase).observe(len(step))
        return out

    async def end_session(self, s: EngineSession, what: str, exc: BaseException) -> None:
        """A bug while serving `s`: it alone ends, with `internal`; the loop goes on."""
        s.failed = True
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
                    self.session_dropped(s)
            self.report_kv()
            await asyncio.sleep(0)  # let the socket deliver new work between steps


def main(argv=None) -> None:
    Verifier.launch(VerifierConfig, argv)


if __name__ == "__main__":
    main()

