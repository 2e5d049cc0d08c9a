"""Controlled replay fleet for split mode (DySCo's multi-edge testbed, emulated).

Edge devices are replayed rather than run: each prompt is generated once with the full model and
its cut-layer hidden states at every position are recorded (`record`); a replayed session then
sends exactly the hidden states a real prefix would send, after sleeping the edge compute time
(`EdgeModel`: per-layer times measured on this machine). The suffix under test is a real service
process; the replay costs the driving process almost no CPU, so the suffix's scheduling is
measured without the edge competing for its core.

    rec = record(runner, prompt_ids, n_tokens, cuts)        # once, cached on disk
    peer = Peer(...)                                        # DEALER to the suffix
    s = await replay_session(peer, rec, cut, edge, "sid")   # -> SessionStats
    await poisson_fleet(peer, recs, worker_cuts, n_sessions, rate, edge, seed)
    await burst_fleet(peer, recs, cuts, edge)

Every returned token is checked against the recording (`mismatches`): the replay doubles as a
losslessness check of the suffix under load.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common import protocol
from common.runner import LayerRangeRunner, Segment


# --- recordings -----------------------------------------------------------------------------
@dataclass
class Recording:
    prompt: list[int]
    tokens: list[int]                 # the full model's greedy continuation
    hidden: dict[int, np.ndarray]     # cut -> float32 [len(prompt) + len(tokens) - 1, hidden]


@torch.inference_mode()
def record(runner: LayerRangeRunner, prompt: list[int], n_tokens: int, cuts,
           cache_dir: Path | None = None) -> Recording:
    """Greedy-generate `n_tokens` with the full model, then record the hidden state after layer
    c-1 for every position a session sends (prompt + all tokens but the last), for each cut."""
    cuts = sorted(set(cuts))
    key = hashlib.sha256(json.dumps([str(runner.config._name_or_path), prompt, n_tokens, cuts])
                         .encode()).hexdigest()[:16]
    path = cache_dir / f"rec-{key}.npz" if cache_dir else None
    if path is not None and path.is_file():
        z = np.load(path)
        return Recording(prompt, z["tokens"].tolist(), {c: z[f"h{c}"] for c in cuts})
    L = runner.num_layers
    kv = runner.new_kv(0, L)
    logits = runner.forward([Segment(kv, torch.tensor(prompt))], 0, L)[0]
    tokens = [int(logits.argmax())]
    while len(tokens) < n_tokens:
        logits = runner.forward([Segment(kv, torch.tensor(tokens[-1:]))], 0, L)[0]
        tokens.append(int(logits.argmax()))
    kv = runner.new_kv(0, max(cuts))
    x, a, hidden = torch.tensor(prompt + tokens[:-1]), 0, {}
    for c in cuts:
        x = runner.forward([Segment(kv, x)], a, c)[0]
        hidden[c] = x.float().numpy().copy()
        a = c
    rec = Recording(prompt, tokens, hidden)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, tokens=np.array(tokens), **{f"h{c}": h for c, h in hidden.items()})
    return rec


# --- the emulated edge ----------------------------------------------------------------------
@dataclass
class EdgeModel:
    """Edge compute time of a session at cut c: prefill c * (layer_s + n * layer_token_s),
    decode c * layer_s; plus an emulated one-way wire latency each way (beyond loopback)."""
    layer_s: float            # one decode token through one layer
    layer_token_s: float      # one prefill token through one layer (amortised)
    wire_s: float = 0.0       # extra one-way latency per message
    scale: float = 1.0        # edge speed relative to this machine (2 = twice as slow)

    def prefill(self, cut: int, n: int) -> float:
        return self.scale * cut * (self.layer_s + n * self.layer_token_s) + self.wire_s

    def decode(self, cut: int) -> float:
        return self.scale * cut * self.layer_s + self.wire_s


@torch.inference_mode()
def calibrate_edge(runner: LayerRangeRunner, layers: int = 8, prompt_len: int = 64) -> EdgeModel:
    """Per-layer decode and prefill times of this machine's runner (medians)."""
    def median(fn, reps=9):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[reps // 2]
    kv = runner.new_kv(0, layers)
    runner.forward([Segment(kv, torch.arange(prompt_len))], 0, layers)
    dec = median(lambda: (runner.forward([Segment(kv, torch.tensor([5]))], 0, layers),
                          kv.truncate(prompt_len)))
    def prefill():
        k = runner.new_kv(0, layers)
        runner.forward([Segment(k, torch.arange(prompt_len))], 0, layers)
    pre = median(prefill, 5)
    return EdgeModel(layer_s=dec / layers,
                     layer_token_s=max(0.0, pre / layers - dec / layers) / prompt_len)


# --- one replayed session -------------------------------------------------------------------
@dataclass
class SessionStats:
    sid: str
    cut: int
    arrival: float             # when the session was offered (Poisson clock), monotonic
    start: float = 0.0         # when a worker took it
    first: float = 0.0         # first token back
    released: float = 0.0      # decode began (after the fleet's barrier, if any)
    end: float = 0.0           # last token back
    tokens: int = 0
    mismatches: int = 0        # tokens that differ from the recording
    cloud_s: float = 0.0       # sum of SuffixToken.seconds (window steps this session was in)
    queued_s: float = 0.0      # sum of SuffixToken.queued
    errors: list[str] = field(default_factory=list)

    @property
    def latency(self) -> float:
        return self.end - self.arrival


def _frame(x: np.ndarray):
    ref, buf = protocol.tensor_frame(np.ascontiguousarray(x), 0)
    return ref, [buf]


async def replay_session(peer, rec: Recording, cut: int, edge: EdgeModel, sid: str,
                         n_tokens: int | None = None, arrival: float | None = None,
                         gap_s: float = 0.0, timeout: float = 600.0,
                         barrier: asyncio.Barrier | None = None,
                         on_release=None) -> SessionStats:
    """Open a suffix session from the recording at `cut` and decode `n_tokens` (default: all
    recorded), sleeping the edge's compute time (+ `gap_s`) before each hidden state. With a
    `barrier`, decoding starts once every session of the fleet has its first token, and the
    first session through calls `on_release()` (e.g. to snapshot the suffix's metrics)."""
    n = len(rec.tokens) if n_tokens is None else min(n_tokens, len(rec.tokens))
    h, P = rec.hidden[cut], len(rec.prompt)
    st = SessionStats(sid, cut, time.monotonic() if arrival is None else arrival)
    st.start = time.monotonic()
    ch = peer.channel()
    try:
        await asyncio.sleep(edge.prefill(cut, P))
        ref, bufs = _frame(h[:P])
        await ch.send(protocol.SuffixOpen(sid=sid, seq=0, cut=cut, start=0, hidden=ref), bufs)
        for k in range(n):
            msg, _ = await ch.recv(timeout)
            st.cloud_s += msg.seconds
            st.queued_s += msg.queued
            st.tokens += 1
            st.mismatches += msg.token != rec.tokens[k]
            if k == 0:
                st.first = time.monotonic()
                if barrier is not None and await barrier.wait() == 0 and on_release:
                    on_release()
                st.released = time.monotonic()
            if k == n - 1:
                break
            await asyncio.sleep(edge.decode(cut) + gap_s + edge.wire_s)
            ref, bufs = _frame(h[P + k: P + k + 1])
            await ch.send(protocol.SuffixStep(sid=sid, seq=k + 1, start=P + k, hidden=ref), bufs)
        st.end = time.monotonic()
    except Exception as e:  # noqa: BLE001 - a failed session is reported, the fleet goes on
        st.errors.append(f"{type(e).__name__}: {e}")
        if barrier is not None:
            barrier.abort()  # nobody waits forever for a session that will not come
        st.end = time.monotonic()
    finally:
        ch.close()
        try:
            await peer.request(protocol.Close(sid=sid), timeout=10)
        except Exception:  # noqa: BLE001
            pass
    return st


# --- fleets ---------------------------------------------------------------------------------
@dataclass
class FleetResult:
    sessions: list[SessionStats]
    wall_s: float

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sessions)

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_latency(self) -> float:
        return sum(s.latency for s in self.sessions) / len(self.sessions)

    @property
    def decode_throughput(self) -> float:
        """Tokens after each session's first, over the span from the start of decoding to the
        last end (prefill excluded; bursts start decoding together after a barrier)."""
        span = max(s.end for s in self.sessions) - min(s.released for s in self.sessions)
        return sum(s.tokens - 1 for s in self.sessions) / span if span > 0 else 0.0

    @property
    def achieved_concurrency(self) -> float:
        """Sessions in the system on average over the fleet's wall time (each from its arrival to
        its last token): the load actually reached, beside the nominal N."""
        return sum(s.latency for s in self.sessions) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mismatches(self) -> int:
        return sum(s.mismatches for s in self.sessions)

    @property
    def errors(self) -> list[str]:
        return [e for s in self.sessions for e in s.errors]


async def poisson_fleet(peer, recs: list[Recording], worker_cuts: list[int], n_sessions: int,
                        rate: float, edge: EdgeModel, seed: int, n_tokens: int | None = None,
                        tag: str = "p") -> FleetResult:
    """`n_sessions` sessions arriving as a Poisson process of `rate`/s, each served by the next
    free warm worker (a worker has a fixed cut); a session that finds none waits, and its
    latency counts from its arrival."""
    rng = random.Random(seed)
    free: asyncio.Queue[int] = asyncio.Queue()
    for c in rng.sample(worker_cuts, len(worker_cuts)):
        free.put_nowait(c)
    t0 = time.monotonic()
    arrivals, t = [], t0
    for _ in range(n_sessions):
        t += rng.expovariate(rate)
        arrivals.append(t)
    prompts = [rng.randrange(len(recs)) for _ in range(n_sessions)]

    async def one(i: int) -> SessionStats:
        await asyncio.sleep(max(0.0, arrivals[i] - time.monotonic()))
        cut = await free.get()
        try:
            return await replay_session(peer, recs[prompts[i]], cut, edge, f"{tag}-{i}",
                                        n_tokens, arrival=arrivals[i])
        finally:
            free.put_nowait(cut)
    sessions = await asyncio.gather(*[one(i) for i in range(n_sessions)])
    first = min(s.arrival for s in sessions)
    return FleetResult(list(sessions), max(s.end for s in sessions) - first)


async def burst_fleet(peer, recs: list[Recording], cuts: list[int], edge: EdgeModel,
                      n_tokens: int | None = None, tag: str = "b", on_release=None,
                      gap_s: float = 0.0) -> FleetResult:
    """One session per cut, all offered at once; decoding starts together once every session
    has prefilled (a synchronized burst: `decode_throughput` is its steady-state figure)."""
    t0 = time.monotonic()
    barrier = asyncio.Barrier(len(cuts))
    sessions = await asyncio.gather(*[
        replay_session(peer, recs[i % len(recs)], c, edge, f"{tag}-{i}", n_tokens, arrival=t0,
                       gap_s=gap_s, barrier=barrier, on_release=on_release)
        for i, c in enumerate(cuts)])
    return FleetResult(list(sessions), max(s.end for s in sessions) - t0)


# --- suffix metrics ---------------------------------------------------------------------------
def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value} (sums and counts are enough here)."""
    import urllib.request

    out = {}
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
    return out


def delta(before: dict, after: dict, prefix: str, *labels: str) -> float:
    """Change of the samples whose name starts with `prefix` and whose labels include every
    `labels` entry (e.g. 'phase="merge"')."""
    return sum(v - before.get(k, 0.0) for k, v in after.items()
               if k.startswith(prefix) and all(lb in k for lb in labels))
