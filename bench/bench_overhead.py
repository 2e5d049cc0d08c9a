"""What Tandem's plumbing costs: per-hop transport, end-to-end cloud-only vs the runner alone,
and each service's memory.

    python -m bench.bench_overhead [--quick] [--json PATH]

1. transport: a real Service (common/runtime.py) on tcp loopback answering hidden-state
   (576 fp16 values, split mode's per-token upload) and token messages; µs per round trip
   (sequential) and messages/s (pipelined, 64 in flight).
2. end to end: cloud-only time per token through SDK + dispatcher + verifier vs the
   LayerRangeRunner's own decode loop on the same number of threads (goal ≤ 1.05×).
3. RSS of each service process after the end-to-end run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import numpy as np
import zmq
import zmq.asyncio

from bench.report import summary, table, write_json
from common import protocol as p
from common.config import ServiceConfig
from common.launcher import Cluster, free_port
from common.runtime import Service


class Echo(Service):
    """Answers a Hidden with a SuffixToken and a SuffixToken with itself: the two message shapes
    of a split-mode decode step."""
    name = "echo"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.route(p.Hidden, self.on_hidden)
        self.route(p.SuffixToken, self.on_token)

    async def on_hidden(self, ident, msg, frames):
        await self.send(ident, p.SuffixToken(sid=msg.sid, rid=msg.rid, position=msg.start, token=1))

    async def on_token(self, ident, msg, frames):
        await self.send(ident, msg)


async def transport(n: int) -> list[dict]:
    svc = Echo(ServiceConfig(bind=f"tcp://127.0.0.1:{free_port()}", http_port=0))
    task = asyncio.get_running_loop().create_task(svc.serve())
    while not svc.ready:
        await asyncio.sleep(0.01)
    ctx = zmq.asyncio.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(svc.bound_endpoint)
    hidden = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float16)
    ref, buf = p.tensor_frame(hidden, 0)
    kinds = {"hidden_state (1.2 KB)": (p.Hidden(sid="s", cut=4, start=0, hidden=ref), [buf]),
             "token": (p.SuffixToken(sid="s", position=0, token=5), [])}
    rows = []
    limits = p.Limits()
    for kind, (msg, bufs) in kinds.items():
        frames = p.encode(msg, bufs)
        for _ in range(50):  # warm-up
            await s.send_multipart(frames)
            p.decode(await s.recv_multipart(), limits)
        rtts = []
        for _ in range(n):
            t = time.perf_counter()
            await s.send_multipart(frames)
            p.decode(await s.recv_multipart(), limits)
            rtts.append((time.perf_counter() - t) * 1e6)
        t = time.perf_counter()
        inflight, sent, got = 64, 0, 0
        while got < n:
            while sent < n and sent - got < inflight:
                await s.send_multipart(frames)
                sent += 1
            p.decode(await s.recv_multipart(), limits)
            got += 1
        rate = n / (time.perf_counter() - t)
        rows.append({"message": kind, "rtt_us": statistics.median(rtts),
                     "rtt_us_p99": float(np.percentile(rtts, 99)), "msgs_per_s": rate})
    s.close()
    svc.stop()
    await task
    return rows


def runner_alone(tokens: int, threads: int) -> float:
    import torch

    from common import models
    from common.runner import LayerRangeRunner, Segment
    torch.set_num_threads(threads)
    r = LayerRangeRunner(models.resolve_target(None), threads=threads)
    kv = r.new_kv()
    logits = r.forward([Segment(kv, torch.tensor([1, 504, 3458, 282, 4649, 314]))], 0, r.num_layers)[0]
    tok = int(logits[-1].argmax())
    t = time.perf_counter()
    for _ in range(tokens):
        logits = r.forward([Segment(kv, torch.tensor([tok]))], 0, r.num_layers)[0]
        tok = int(logits[-1].argmax())
    return (time.perf_counter() - t) / tokens


def end_to_end(tokens: int, reps: int, threads: int) -> tuple[list[float], dict]:
    from tandem import Client
    c = Cluster(services=("verifier", "dispatcher"), ephemeral=True,
                extra={"verifier": ["--threads", threads]},
                pin={"verifier": list(range(threads)), "dispatcher": [os.cpu_count() - 1]})
    c.start_all()
    try:
        c.wait_ready(180)
        tpts = []
        with Client(c.endpoint("dispatcher")) as cl:
            cl.complete("Warm up", max_tokens=8, stop_at_eos=False)
            for _ in range(reps):
                t = time.perf_counter()
                r = cl.complete("The history of the printing press begins", max_tokens=tokens,
                                stop_at_eos=False)
                # steady-state per-token time, excluding the prompt's prefill (TTFT)
                tpts.append((time.perf_counter() - t - r.stats["ttft_s"]) / (tokens - 1))
        rss = {}
        for name, proc in c.procs.items():
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS"):
                        rss[name] = int(line.split()[1]) * 1024
        return tpts, rss
    finally:
        c.stop_all()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer round trips and tokens")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--threads", type=int, default=1, help="verifier/runner torch threads")
    args = ap.parse_args(argv)
    n = 2000 if args.quick else 20000
    tokens, reps = (24, 3) if args.quick else (64, 5)

    import uvloop
    rows = uvloop.run(transport(n))
    print("\nTransport per hop (tcp loopback, real Service + DEALER client)")
    print(table(rows, [("message", "message"), ("rtt_us", "RTT µs (median)"),
                       ("rtt_us_p99", "RTT µs p99"), ("msgs_per_s", "msgs/s (64 in flight)")]))

    e2e, rss = end_to_end(tokens, reps, args.threads)
    alone = [runner_alone(tokens, args.threads) for _ in range(reps)]
    ratio = statistics.median(e2e) / statistics.median(alone)
    e2e_row = {"what": "cloud-only via SDK+dispatcher+verifier", **{
        f"ms_{k}": v * 1000 for k, v in summary(e2e).items() if k in ("median", "min", "max")}}
    alone_row = {"what": "runner alone (same threads)", **{
        f"ms_{k}": v * 1000 for k, v in summary(alone).items() if k in ("median", "min", "max")}}
    print(f"\nEnd to end, {tokens} tokens x {reps} reps, {args.threads} verifier thread(s)")
    print(table([e2e_row, alone_row], [("what", "path"), ("ms_median", "ms/token median"),
                                       ("ms_min", "min"), ("ms_max", "max")]))
    print(f"ratio end-to-end / runner alone: {ratio:.3f}  (goal <= 1.05)")
    print("\nRSS after the run: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in rss.items()))
    results = [{"kind": "transport", **r} for r in rows]
    results += [{"kind": "e2e", "e2e_ms_per_token": summary([x * 1000 for x in e2e]),
                 "runner_ms_per_token": summary([x * 1000 for x in alone]), "ratio": ratio},
                {"kind": "rss", "bytes": rss}]
    write_json(args.json, "overhead", "loopback", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
