"""The prefix: the edge side of split mode (DySCo). It holds layers [0, c_max) of the target once
and serves sessions at any cut c <= c_max from that one resident copy (dyForward).

Per session: the cut, fixed at open, and the KV cache of layers [0, c). PrefixOpen prefills the
prompt through [0, c); each PrefixStep runs one new token through [0, c). Both answer with the
cut-layer hidden states (`Hidden`), in `wire_dtype` on the wire.

KV memory (common/prefix_cache.py): a session reserves the rows of layers [0, c) its prompt and
max_tokens may grow to within `kv_budget_bytes` (`busy` when it cannot fit, `too_large` for a
prompt over the whole budget). When it ends, the rows of its tokens stay cached for its cut; a
new session at that cut whose prompt starts with them (a chat's next turn) reuses them, at most
`max_cached` of them, and computes and sends the hidden states of the rest only: `Hidden.start`
says how many it reused (the suffix reuses as many, common/protocol.py "Prefix caching").

Steps of all sessions that are waiting run as one batched pass (`run_prefixes`): every session
starts at layer 0 and leaves the ragged batch at its own cut, so layer l runs once for all
sessions deeper than l.

Wire dtype: "auto" sends the compute dtype, which is lossless by construction (the suffix then
sees exactly the hidden state the full model computes). For the bundled fp32 target that is
float32, 2.3 KB per decode token; float16 halves it and kept greedy output identical to the full
model for every cut 1..29 on the prompts we measured (bench/bench_split.py --sections wire), but it
is not exact, so it is opt-in; bfloat16 changed tokens at 5 of 116 (cut, prompt) pairs.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import torch

from common import metrics, prefix_cache, protocol
from common.prefix_cache import PrefixCache
from common.protocol import Msg, ProtocolError
from common.runner import Segment
from common.runtime import Service, Session, check_token_ids
from services.prefix.config import PrefixConfig

WIRE_DTYPES = ("auto", "float16", "bfloat16", "float32")


def run_prefixes(runner, items: list[tuple[object, torch.Tensor, int]]) -> list[torch.Tensor]:
    """Advance each (kv, token_ids, cut) through layers [0, cut) in one ragged batch per distinct
    cut range; returns each item's hidden state after layer cut-1 ([n, hidden])."""
    out: list[torch.Tensor | None] = [None] * len(items)
    xs = [x for _, x, _ in items]
    active = list(range(len(items)))
    a = 0
    for c in sorted({cut for _, _, cut in items}):
        hs = runner.forward([Segment(items[i][0], xs[i]) for i in active], a, c)
        for i, h in zip(active, hs):
            xs[i] = h
            if items[i][2] == c:
                out[i] = h
        active = [i for i in active if items[i][2] > c]
        a = c
    return out  # type: ignore[return-value]


class PrefixSession(Session):
    def __init__(self, sid: str, seq: int, cut: int, kv, tokens: list[int]):
        super().__init__(sid, seq=seq)
        self.cut = cut
        self.kv = kv
        self.tokens = tokens   # the ids whose rows the KV holds (its prefix cache entry at the end)
        self.failed = False    # ended on a bug: its rows are not cached


@dataclass
class Work:
    session: PrefixSession
    x: torch.Tensor       # token ids
    start: int            # position of the first token
    ids: list[int]        # x as a list: appended to the session's tokens once computed
    ident: bytes
    msg: Msg


class Prefix(Service):
    name = "prefix"

    def __init__(self, cfg: PrefixConfig, ctx=None):
        super().__init__(cfg, ctx)
        self.cfg: PrefixConfig = cfg
        self.runner = None
        self.kv_cache: PrefixCache | None = None
        self.queue: list[Work] = []
        self.wakeup = asyncio.Event()
        self.route(protocol.PrefixOpen, self.on_open)
        self.route(protocol.PrefixStep, self.on_step)
        self.route(protocol.Close, self.on_close)

    async def setup(self) -> None:
        from common import models
        from common.runner import LayerRangeRunner

        path = models.resolve_target(self.cfg.target)
        L = json.loads((path / "config.json").read_text())["num_hidden_layers"]
        self.c_max = self.cfg.c_max or L - 1
        if not 1 <= self.c_max <= L - 1:
            raise ValueError(f"c_max {self.cfg.c_max} outside [1, {L - 1}] for a {L}-layer model")
        if self.cfg.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype {self.cfg.wire_dtype!r} not one of {WIRE_DTYPES}")
        dtype = getattr(torch, self.cfg.dtype)
        self.wire = dtype if self.cfg.wire_dtype == "auto" else getattr(torch, self.cfg.wire_dtype)
        self.runner = await asyncio.to_thread(
            LayerRangeRunner, path, (0, self.c_max), dtype, self.cfg.threads or None,
            device=self.cfg.device)
        self.log.info("prefix %s: layers [0, %d) of %d, wire %s", path, self.c_max, L, self.wire)
        metrics.declare_forward(self.name, ("prefill", "decode"))
        metrics.declare_kv(self.name)
        self.kv_cache = prefix_cache.for_service(self.runner, self.cfg, self.name)
        self.log.info(prefix_cache.describe(self.kv_cache, self.cfg))
        self.spawn_loop("step", self.loop())

    # --- requests -------------------------------------------------------------------------------
    async def on_open(self, ident: bytes, msg: protocol.PrefixOpen, frames) -> None:
        old = self.sessions.admit(msg, msg.token_ids, self.runner.vocab_size)
        if old is not None:
            if await self.answer_retry(ident, old, msg):
                return
            raise ProtocolError(protocol.SESSION_EXISTS, f"session {msg.sid!r} is already open",
                                field="sid")
        if not 1 <= msg.cut <= self.c_max:
            raise ProtocolError(protocol.BAD_FIELD, f"cut {msg.cut} outside [1, {self.c_max}]: "
                                f"this prefix holds layers [0, {self.c_max})", field="cut")
        prompt = list(msg.token_ids)
        kv, hit = self.kv_cache.open(prompt, msg.max_tokens or self.cfg.kv_reserve_tokens,
                                     self.live_bytes(), self.kv_cache.space(0, msg.cut),
                                     reuse=msg.max_cached)
        s = PrefixSession(msg.sid, msg.seq, msg.cut, kv, prompt[:hit])
        self.sessions.add(s)
        self.report_kv()
        self.enqueue(ident, s, msg, prompt[hit:])

    async def on_step(self, ident: bytes, msg: protocol.PrefixStep, frames) -> None:
        s = await self.next_step(ident, msg)
        if s is None:
            return
        check_token_ids([msg.token_id], self.runner.vocab_size, "token_id")
        self.enqueue(ident, s, msg, [msg.token_id])

    def enqueue(self, ident: bytes, s: PrefixSession, msg: Msg, ids: list[int]) -> None:
        s.seq, s.busy, s.reply = msg.seq, True, None
        self.queue.append(Work(s, torch.tensor(ids, dtype=torch.long), s.kv.length(), list(ids),
                               ident, msg))
        self.wakeup.set()

    def live_bytes(self) -> int:
        return sum(s.kv.nbytes() for s in self.sessions.values())

    def report_kv(self) -> None:
        metrics.KV_BYTES.labels(self.name).set(self.live_bytes() + self.kv_cache.cached_bytes)

    def session_dropped(self, s: PrefixSession) -> None:
        """A session ended: the rows of its tokens go to the prefix cache, for its cut, unless
        it ended on a bug (its state may be half-updated)."""
        if not s.failed:
            self.kv_cache.put(s.tokens, s.kv, len(s.tokens), live_bytes=self.live_bytes())
            self.kv_cache.fit(self.live_bytes())
        self.report_kv()

    # --- the step loop --------------------------------------------------------------------------
    def step(self, batch: list[Work]) -> list[tuple[torch.Tensor, float]]:
        """The batch's hidden states, each with the batch's compute time (on the compute thread)."""
        t = time.perf_counter()
        try:
            hs = run_prefixes(self.runner, [(w.session.kv, w.x, w.session.cut) for w in batch])
        except BaseException:
            # one cut range may have run before a later one failed: put every cache back, so
            # that the members can run again (Service.compute_each)
            for w in batch:
                w.session.kv.truncate(w.start)
            raise
        hs = [h.to(self.wire) for h in hs]
        dt = time.perf_counter() - t
        return [(h, dt) for h in hs]

    async def loop(self) -> None:
        """One batched forward per step over the queued work. A failure ends only the session
        it belongs to: the batch is rerun without it (Service.compute_each)."""
        while True:
            if not self.queue:
                self.wakeup.clear()
                await self.idle("step", self.wakeup)
                continue
            self.beat("step")
            n = self.cfg.max_batch_sessions
            batch = [w for w in self.queue[:n] if not w.session.closed]
            del self.queue[:n]
            if not batch:
                continue
            outs = await self.compute_each(self.step, batch)
            ok = [o for o in outs if not isinstance(o, Exception)]
            dt = ok[0][1] if ok else 0.0
            phases = {"prefill" if w.x.shape[0] > 1 else "decode" for w in batch}
            phase = phases.pop() if len(phases) == 1 else "mixed"
            metrics.FORWARD.labels(self.name, phase).observe(dt)
            metrics.FORWARD_TOKENS.labels(self.name, phase).observe(sum(w.x.shape[0] for w in batch))
            metrics.FORWARD_SESSIONS.labels(self.name, phase).observe(len(batch))
            for w, out in zip(batch, outs):
                s = w.session
                if isinstance(out, Exception):
                    s.failed = True
                    await self.fail_session(w.ident, w.msg, "forward", out)
                    continue
                s.tokens += w.ids
                h, dt = out
                ref, buf = protocol.tensor_frame(h, 0)
                reply = protocol.Hidden(sid=s.sid, seq=w.msg.seq, rid=w.msg.rid, cut=s.cut,
                                        start=w.start, hidden=ref, seconds=dt,
                                        source=self.instance)
                s.reply, s.busy = (reply, [buf]), False
                if not s.closed:
                    await self.send(w.ident, reply, [buf])
            self.report_kv()
            await asyncio.sleep(0)


def main(argv=None) -> None:
    Prefix.launch(PrefixConfig, argv)


if __name__ == "__main__":
    main()
