"""The suffix: the cloud side of split mode (DySCo). It holds the whole target once and runs, for
each session, layers [c, L) + norm + LM head from the cut-layer hidden states the edge sends.

Per session: the cut (fixed at open), sampling, and the KV cache of layers [c, L) only.
SuffixOpen prefills from the hidden sequence of the prompt and answers the first token;
each SuffixStep carries one hidden state and is answered with the next token (`SuffixToken`).

KV memory (common/prefix_cache.py): a session reserves the rows of layers [c, L) its prompt and
max_tokens may grow to within `kv_budget_bytes` (`busy` when it cannot fit, `too_large` for a
prompt over the whole budget). When it ends, the rows of its tokens (the prompt's ids come in
SuffixOpen.token_ids, the rest are the tokens it chose) stay cached, keyed by its cut and by the
prefix and dtype its hidden states came from. SuffixOpen.start asks it to reuse that many of them
and prefill only the hidden states that follow; when it holds fewer it answers
Ack(cached_tokens=what it holds) and opens nothing (common/protocol.py "Prefix caching"). Rows
are cached only where they are exact: the runner's kernels are chunk-invariant and decode calls
run ragged (a padded call, `paper_padding`, computes attention over another layout).

Ready steps (prefills too, so sessions that arrive together prefill in one batch) gather into
windows (window.py: `window_ms` / `max_size`; fifo and interleave take one step per window;
with `early_close` a window also closes as soon as every open session is in it). Windows form
here rather than in a dispatcher because the suffix is where the steps of every dispatcher meet.
The configured scheduler (planning.py) turns a window into runner calls, and the executor
(executor.py) runs them in ONE compute call per window. exact and dsb run multi-session decode
calls padded like the DySCo prototype unless `paper_padding` is off; cascade runs ragged.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import torch

from common import constraint, metrics, prefix_cache, protocol, sampling
from common.prefix_cache import PrefixCache
from common.protocol import Msg, ProtocolError
from common.runtime import Service, Session
from services.suffix.config import SuffixConfig
from services.suffix.executor import PHASES, Item, execute
from services.suffix.planning import SCHEDULERS, Request, RoundRobin, plan_window
from services.suffix.window import WindowBuilder, WindowConfig

HIDDEN_DTYPES = ("float16", "bfloat16", "float32")


class SuffixSession(Session):
    def __init__(self, sid: str, seq: int, cut: int, kv, sampling_cfg: protocol.Sampling,
                 logprobs: int | None = None, matcher: constraint.Matcher | None = None,
                 tokens: list[int] | None = None, tag: tuple = ()):
        super().__init__(sid, seq=seq)
        self.matcher = matcher     # the output constraint's state after the output so far
        self.cut = cut
        self.kv = kv
        self.sampling = sampling_cfg
        self.logprobs = logprobs   # alternatives per token; None = no logprobs
        self.tokens = tokens       # ids whose rows the KV holds; None = unknown (not cached)
        self.tag = tag             # what its rows are computed from besides the tokens
        self.last_token = -1       # the token it chose last: the next step's hidden state is its
        self.failed = False        # ended on a bug: its rows are not cached


@dataclass
class Pending:
    session: SuffixSession
    x: torch.Tensor        # hidden states [n, hidden], runner dtype
    ids: list[int]         # the tokens x is of (the session's tokens grow by them once done)
    ident: bytes
    msg: Msg
    arrival: float         # time.monotonic() when it became ready


class Suffix(Service):
    name = "suffix"

    def __init__(self, cfg: SuffixConfig, ctx=None):
        super().__init__(cfg, ctx)
        self.cfg: SuffixConfig = cfg
        if cfg.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler {cfg.scheduler!r} not one of {SCHEDULERS}")
        self.scheduler = cfg.scheduler
        one_at_a_time = cfg.scheduler in ("fifo", "interleave")
        self.builder = WindowBuilder(WindowConfig(0.0, 1) if one_at_a_time
                                     else WindowConfig(cfg.window_ms, cfg.max_size))
        self.padded = cfg.paper_padding and cfg.scheduler in ("exact", "dsb")
        self.rr = RoundRobin()
        self.runner = None
        self.kv_cache: PrefixCache | None = None
        self.pending: dict[str, Pending] = {}   # sid -> its waiting step (one per session)
        self.wakeup = asyncio.Event()
        self.last_end = 0.0                     # when the previous window's compute ended
        self.route(protocol.SuffixOpen, self.on_open)
        self.route(protocol.SuffixStep, self.on_step)
        self.route(protocol.Close, self.on_close)

    async def setup(self) -> None:
        from common import models
        from common.runner import LayerRangeRunner

        path = models.resolve_target(self.cfg.target)
        self.target_path = str(path)
        self.runner = await asyncio.to_thread(
            LayerRangeRunner, path, None, getattr(torch, self.cfg.dtype), self.cfg.threads or None,
            device=self.cfg.device)
        self.L = self.runner.num_layers
        self.log.info("suffix %s: %d layers, scheduler %s (window %.1f ms / %d%s)", path, self.L,
                      self.scheduler, self.builder.config.window_ms, self.builder.config.max_size,
                      ", padded" if self.padded else "")
        metrics.declare_suffix(self.name, self.scheduler)
        self.kv_cache = prefix_cache.for_service(self.runner, self.cfg, self.name,
                                                 exact=not self.padded)
        self.log.info(prefix_cache.describe(self.kv_cache, self.cfg))
        self.spawn_loop("window", self.loop())

    # --- requests -------------------------------------------------------------------------------
    def hidden(self, ref: protocol.TensorRef, frames) -> torch.Tensor:
        H = self.runner.hidden_size
        if ref.dtype not in HIDDEN_DTYPES:
            raise ProtocolError(protocol.BAD_TENSOR, f"hidden dtype {ref.dtype} not one of {HIDDEN_DTYPES}")
        if len(ref.shape) != 2 or ref.shape[1] != H or ref.shape[0] < 1:
            raise ProtocolError(protocol.BAD_TENSOR, f"hidden must be [n >= 1, {H}], got {ref.shape}")
        x = protocol.tensor_torch(ref, frames).to(self.runner.dtype)
        if not torch.isfinite(x).all():
            raise ProtocolError(protocol.BAD_TENSOR, "hidden holds non-finite values")
        return x

    async def on_open(self, ident: bytes, msg: protocol.SuffixOpen, frames) -> None:
        old = self.sessions.admit(msg)
        if old is not None:
            if await self.answer_retry(ident, old, msg):
                return
            raise ProtocolError(protocol.SESSION_EXISTS, f"session {msg.sid!r} is already open",
                                field="sid")
        if not 1 <= msg.cut <= self.L - 1:
            raise ProtocolError(protocol.BAD_FIELD, f"cut {msg.cut} outside [1, {self.L - 1}] "
                                                    f"for a {self.L}-layer model", field="cut")
        protocol.check_sampling(msg.sampling, self.runner.vocab_size)
        x = self.hidden(msg.hidden, frames)
        n = msg.start + x.shape[0]   # the prompt: `start` cached rows, then the hidden states
        if msg.token_ids and len(msg.token_ids) != n:
            raise ProtocolError(protocol.BAD_FIELD, f"token_ids holds {len(msg.token_ids)} ids, "
                                f"but start {msg.start} + {x.shape[0]} hidden states make a "
                                f"prompt of {n}", field="token_ids")
        if not msg.token_ids and msg.start != 0:
            raise ProtocolError(protocol.BAD_FIELD, f"open at position {msg.start} without "
                                f"token_ids: cached rows are found by the prompt's ids",
                                field="start")
        self.sessions.admit(msg, list(msg.token_ids) or n, self.runner.vocab_size)
        matcher = None
        if msg.constraint is not None:
            vocab = self.runner.vocab_size
            tok = await asyncio.to_thread(constraint.hf_tokenizer, self.target_path, vocab)
            matcher = constraint.Matcher(tok, msg.constraint, vocab)
            matcher.advance(list(msg.output))
        prompt = list(msg.token_ids) or [0] * n   # without ids: nothing reused (start 0)
        tag = (msg.hidden.dtype, msg.source)
        kv, hit = self.kv_cache.open(prompt, msg.max_tokens or self.cfg.kv_reserve_tokens,
                                     self.live_bytes(),
                                     self.kv_cache.space(msg.cut, self.L, tag),
                                     reuse=msg.start, need=msg.start)
        if kv is None:   # fewer cached rows than the edge reused: it computes from ours
            await self.send(ident, protocol.Ack(sid=msg.sid, seq=msg.seq, rid=msg.rid,
                                                cached_tokens=hit))
            return
        s = SuffixSession(msg.sid, msg.seq, msg.cut, kv, msg.sampling, msg.logprobs, matcher,
                          prompt[:hit] if msg.token_ids else None, tag)
        self.sessions.add(s)
        self.report_kv()
        self.enqueue(ident, s, msg, x, prompt[hit:])

    async def on_step(self, ident: bytes, msg: protocol.SuffixStep, frames) -> None:
        s = await self.next_step(ident, msg)
        if s is None:
            return
        if msg.start != s.kv.length():
            raise ProtocolError(protocol.BAD_FIELD, f"step at position {msg.start}, but session "
                                f"{msg.sid!r} holds {s.kv.length()} positions", field="start")
        x = self.hidden(msg.hidden, frames)
        if x.shape[0] != 1:
            raise ProtocolError(protocol.BAD_TENSOR, f"a decode step carries one hidden state "
                                f"[1, {self.runner.hidden_size}], got {list(x.shape)}",
                                field="hidden")
        self.enqueue(ident, s, msg, x, [s.last_token])

    def enqueue(self, ident: bytes, s: SuffixSession, msg: Msg, x: torch.Tensor,
                ids: list[int]) -> None:
        now = time.monotonic()
        s.seq, s.busy, s.reply = msg.seq, True, None
        self.pending[s.sid] = Pending(s, x, ids, ident, msg, now)
        self.builder.add(Request(s.sid, s.cut, x.shape[0], now), now)
        self.wakeup.set()

    def load(self) -> tuple[int, int, int]:
        """Reported in Pong for placement (services/dispatcher/placement.py): sessions, hidden
        positions waiting for a forward, KV bytes."""
        queued = sum(int(p.x.shape[0]) for p in self.pending.values())
        sessions = self.sessions.values()
        return len(sessions), queued, self.live_bytes()   # cached prefixes give way: not load

    def live_bytes(self) -> int:
        return sum(s.kv.nbytes() for s in self.sessions.values())

    def report_kv(self) -> None:
        metrics.KV_BYTES.labels(self.name).set(self.live_bytes() + self.kv_cache.cached_bytes)

    def session_dropped(self, s: SuffixSession) -> None:
        """A session ended: its queued step goes, and the rows of its tokens go to the prefix
        cache, unless it ended on a bug (its state may be half-updated)."""
        self.unqueue(s.sid)
        self.rr.drop(s.sid)
        if s.tokens is not None and not s.failed:
            self.kv_cache.put(s.tokens, s.kv, len(s.tokens), s.tag, self.live_bytes())
            self.kv_cache.fit(self.live_bytes())
        self.report_kv()

    def unqueue(self, sid: str) -> None:
        if self.pending.pop(sid, None) is not None:
            self.builder.pending = type(self.builder.pending)(
                (t, r) for t, r in self.builder.pending if r.sid != sid)

    # --- windows ------------------------------------------------------------------------------
    def take_window(self, now: float) -> list[Pending]:
        if self.scheduler == "interleave":
            ready = [r.sid for _, r in self.builder.pending]
            picked = self.rr.order(ready, limit=1)
            if not picked:
                return []
            sids = picked
            self.builder.pending = type(self.builder.pending)(
                (t, r) for t, r in self.builder.pending if r.sid not in picked)
        else:
            sids = [r.sid for r in self.builder.take(now)]
        return [self.pending.pop(sid) for sid in sids]

    async def next_window(self) -> list[Pending]:
        while True:
            now = time.monotonic()
            # nobody else can join when every open session is already waiting in the window
            full = (self.cfg.early_close and self.builder.pending
                    and len(self.builder.pending) == len(self.sessions)
                    and len(self.builder.pending) <= self.builder.config.max_size)
            if full or self.builder.ready(now):
                window = self.take_window(math.inf if full else now)
                if window:
                    return window
            deadline = self.builder.deadline()
            self.wakeup.clear()
            await self.idle("window", self.wakeup,
                            None if deadline is None else max(0.0, deadline - now))

    def plan(self, window: list[Pending], scheduler: str):
        reqs = [Request(p.session.sid, p.session.cut, p.x.shape[0], p.arrival) for p in window]
        return plan_window(scheduler, reqs, self.L, self.rr)

    def step(self, plan, window: list[Pending]):
        """Execute one window's plan and choose its tokens (on the compute thread): one
        (result, token, seconds, logprob or None) per member. A failure leaves every cache as it was, so the
        members can run again without the one that failed (Service.compute_each)."""
        t = time.perf_counter()
        starts = [p.session.kv.length() for p in window]
        advanced: list[constraint.Matcher] = []
        try:
            res = execute(self.runner, plan,
                          {p.session.sid: Item(p.session.kv, p.x) for p in window},
                          padded=self.padded)
            tokens = []
            for p in window:
                row, m = res.logits[p.session.sid], p.session.matcher
                if m is not None:   # choose from the constrained distribution p' ∝ p·m
                    row = constraint.apply(row, m.mask())
                tokens.append(sampling.sample(row, p.session.sampling, p.session.kv.length()))
                if m is not None:
                    m.advance([tokens[-1]])
                    advanced.append(m)
            lps = [None if p.session.logprobs is None else
                   sampling.token_logprob(res.logits[p.session.sid], t, p.session.logprobs)
                   for p, t in zip(window, tokens)]
        except BaseException:
            for p, n in zip(window, starts):
                p.session.kv.truncate(n)
            for m in advanced:   # the window runs again (or its members alone): undo its tokens
                m.rollback(1)
            raise
        dt = time.perf_counter() - t
        return [(res, token, dt, lp) for token, lp in zip(tokens, lps)]

    async def loop(self) -> None:
        sched = (self.name, self.scheduler)
        while True:
            window = await self.next_window()
            self.beat("window")
            start = time.monotonic()
            if self.last_end:
                metrics.SPLIT_IDLE_GAP.labels(*sched).observe(start - self.last_end)
            plan = self.plan(window, self.scheduler)   # on the loop: the round-robin is ours
            # a member rerun alone (after the window failed) is a one-call plan; "fifo" plans
            # it without moving the round-robin
            solo = {p.session.sid: self.plan([p], "fifo") for p in window}
            outs = await self.compute_each(
                lambda w: self.step(plan if len(w) == len(window) else solo[w[0].session.sid], w),  # noqa: B023 - called within this iteration
                window)
            self.last_end = time.monotonic()
            ok = [o for o in outs if not isinstance(o, Exception)]
            if ok:
                res = ok[0][0]
                cuts = [p.session.cut for p in window]
                metrics.SPLIT_WINDOW_SIZE.labels(*sched).observe(len(window))
                metrics.SPLIT_WINDOW_DEPTH.labels(*sched).observe(max(cuts) - min(cuts))
                metrics.SPLIT_CALLS_PER_STEP.labels(*sched).observe(res.calls)
                for phase in PHASES:
                    if res.seconds[phase]:
                        metrics.FORWARD.labels(self.name, phase).observe(res.seconds[phase])
                metrics.FORWARD_TOKENS.labels(self.name, "step").observe(
                    sum(p.x.shape[0] for p in window))
                metrics.FORWARD_SESSIONS.labels(self.name, "step").observe(len(window))
            for p, out in zip(window, outs):
                s = p.session
                if isinstance(out, ProtocolError):   # the constraint allows no token
                    await self.end_constrained(p.ident, p.msg, out)
                    continue
                if isinstance(out, Exception):
                    s.failed = True
                    await self.fail_session(p.ident, p.msg, "forward and sampling", out)
                    continue
                _, token, dt, lp = out
                if s.tokens is not None:
                    s.tokens += p.ids
                s.last_token = token
                metrics.QUEUE_TIME.labels(self.name).observe(start - p.arrival)
                metrics.SPLIT_TOKENS.labels(self.name, self.scheduler, str(s.cut)).inc()
                reply = protocol.SuffixToken(sid=s.sid, seq=p.msg.seq, rid=p.msg.rid,
                                             position=s.kv.length(), token=token, seconds=dt,
                                             queued=start - p.arrival, logprob=lp)
                s.reply, s.busy = (reply, []), False
                if not s.closed:
                    await self.send(p.ident, reply)
            self.report_kv()


def main(argv=None) -> None:
    Suffix.launch(SuffixConfig, argv)


if __name__ == "__main__":
    main()
