"""What Tandem's plumbing costs: per-hop transport, end-to-end cloud-only vs the runner alone,
and each service's memory.

    python -m bench.bench_overhead [--quick] [--json PATH]

1. transport: a real Service (common/runtime.py) on tcp loopback answering hidden-state
   (576 fp16 values, split mode's per-token upload) and token messages; µs per round trip
   (sequential) and messages/s (pipelined, 64 in flight).
2. end to end: cloud-only time per token through SDK + dispatcher + verifier vs the
   LayerRangeRunner's own decode loop on the same number of threads (goal ≤ 1.05×).
3. RSS of each service process after the end-to-end run.
4. gateway vs SDK: the same cloud-only streams (64 tokens, EOS ignored) through the SDK straight
   to the dispatcher and through the OpenAI-compatible gateway (`tandem serve api`, SSE over
   HTTP), interleaved request by request over several prompts and repetitions; TPT ratio
   gateway / SDK and TTFT difference, each with a 95 % paired bootstrap CI (goals: TPT <= 1.05x,
   TTFT overhead <= 5 ms).

    python -m bench.bench_overhead --parts gateway --reps 10   # part 4 alone
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

from bench.report import summary, table, write_json
from bench.traffic import sse_events
from common import protocol as p
from common.config import ServiceConfig
from stack.launcher import Cluster, free_port
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
            cl.complete("Warm up", mode="cloud-only", max_tokens=8, stop_at_eos=False)
            for _ in range(reps):
                t = time.perf_counter()
                r = cl.complete("The history of the printing press begins", mode="cloud-only",
                                max_tokens=tokens, stop_at_eos=False)
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


GATEWAY_PROMPTS = ("The history of the printing press begins",
                   "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                   "Once upon a time, in a village by the sea,",
                   "The three laws of thermodynamics state that")


def _sdk_stream(client, prompt: str, tokens: int) -> tuple[float, float, int]:
    """(TTFT s, TPT s, tokens) of one SDK stream, timed by the caller's clock."""
    t0 = time.perf_counter()
    first = None
    n = 0
    for chunk in client.generate(prompt, mode="cloud-only", max_tokens=tokens,
                                 stop_at_eos=False):
        if first is None:
            first = time.perf_counter()
        n += len(chunk.token_ids)
    end = time.perf_counter()
    return first - t0, (end - first) / max(n - 1, 1), n


def _gateway_stream(http, base: str, prompt: str, tokens: int) -> tuple[float, float, int]:
    """(TTFT s, TPT s, tokens) of one SSE stream from the gateway's /v1/completions."""
    body = {"model": "tandem", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    n = 0
    for event in sse_events(http, base, "completions", body):
        if first is None and event["choices"] and event["choices"][0]["text"]:
            first = time.perf_counter()
        if event.get("usage"):
            n = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    return first - t0, (end - first) / max(n - 1, 1), n


def diff_ci(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """mean(a - b) over paired samples, with a bootstrap CI (BCa, else percentile)."""
    import warnings

    from scipy.stats import bootstrap
    d = np.asarray(a, float) - np.asarray(b, float)
    point = float(d.mean())
    if len(d) < 2:
        return point, float("nan"), float("nan")
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                r = bootstrap((d,), np.mean, n_resamples=4999, confidence_level=level,
                              method=method, random_state=0)
            except ValueError:
                continue
        lo, hi = float(r.confidence_interval.low), float(r.confidence_interval.high)
        if np.isfinite(lo) and np.isfinite(hi):
            return point, lo, hi
    return point, float("nan"), float("nan")


def gateway_vs_sdk(tokens: int, reps: int, threads: int) -> dict:
    """Part 4: interleaved SDK and gateway streams on one cloud-only stack."""
    import httpx

    from bench.bench_defaults import ratio_ci
    from stack.observability import start_gateway
    from tandem import Client

    cores = os.cpu_count() or 1
    c = Cluster(services=("verifier", "dispatcher"), ephemeral=True,
                extra={"verifier": ["--threads", threads]},
                pin={"verifier": list(range(min(threads, cores))), "dispatcher": [cores - 1]})
    c.start_all()
    gateway = None
    try:
        c.wait_ready(180)
        import tempfile
        log = Path(tempfile.mkdtemp(prefix="tandem-bench-api-")) / "api.log"
        gateway, base = start_gateway(c.endpoint("dispatcher"), log)
        os.sched_setaffinity(gateway.pid, {cores - 1})   # beside the dispatcher, as on an edge box
        samples = {"sdk": [], "gateway": []}
        with Client(c.endpoint("dispatcher")) as cl, httpx.Client(timeout=300) as http:
            for _ in range(2):   # warm-up, both paths (tokenizer caches, first HTTP connection)
                _sdk_stream(cl, GATEWAY_PROMPTS[0], 8)
                _gateway_stream(http, base, GATEWAY_PROMPTS[0], 8)
            for rep in range(reps):
                for i, prompt in enumerate(GATEWAY_PROMPTS):
                    # interleaved, the order alternating so neither path always goes first
                    order = ("sdk", "gateway") if (rep + i) % 2 == 0 else ("gateway", "sdk")
                    for path in order:
                        ttft, tpt, n = (_sdk_stream(cl, prompt, tokens) if path == "sdk" else
                                        _gateway_stream(http, base, prompt, tokens))
                        if n != tokens:
                            raise RuntimeError(f"{path}: {n} tokens, expected {tokens}")
                        samples[path].append((ttft, tpt))
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(10)
        c.stop_all()
    sdk_ttft, sdk_tpt = (list(x) for x in zip(*samples["sdk"], strict=True))
    gw_ttft, gw_tpt = (list(x) for x in zip(*samples["gateway"], strict=True))
    tpt_ratio = ratio_ci(gw_tpt, sdk_tpt)
    ttft_diff = tuple(x * 1000 for x in diff_ci(gw_ttft, sdk_ttft))
    return {"pairs": len(sdk_tpt), "tokens": tokens,
            "sdk_tpt_ms": summary([x * 1000 for x in sdk_tpt]),
            "gateway_tpt_ms": summary([x * 1000 for x in gw_tpt]),
            "sdk_ttft_ms": summary([x * 1000 for x in sdk_ttft]),
            "gateway_ttft_ms": summary([x * 1000 for x in gw_ttft]),
            "tpt_ratio": tpt_ratio, "ttft_overhead_ms": ttft_diff}


def _ci_text(point: float, lo: float, hi: float, fmt: str) -> str:
    return (fmt.format(point) + (f" [{fmt.format(lo)}, {fmt.format(hi)}]"
                                 if np.isfinite(lo) else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer round trips and tokens")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--threads", type=int, default=1, help="verifier/runner torch threads")
    ap.add_argument("--parts", default="transport,e2e,gateway",
                    help="comma-separated: transport (1), e2e (2, 3), gateway (4)")
    ap.add_argument("--reps", type=int, default=0,
                    help="repetitions (default 5; 3 with --quick); part 4 runs each of its "
                         f"{len(GATEWAY_PROMPTS)} prompts this many times per path")
    args = ap.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    unknown = parts - {"transport", "e2e", "gateway"}
    if unknown:
        ap.error(f"unknown --parts {sorted(unknown)}")
    n = 2000 if args.quick else 20000
    tokens, reps = (24, 3) if args.quick else (64, 5)
    reps = args.reps or reps
    results: list[dict] = []

    if "gateway" in parts:
        g = gateway_vs_sdk(tokens, reps, args.threads)
        print(f"\nGateway vs SDK, cloud-only, {tokens} tokens, {g['pairs']} interleaved pairs "
              f"({len(GATEWAY_PROMPTS)} prompts x {reps}), {args.threads} verifier thread(s)")
        rows = [{"path": "SDK -> dispatcher", "tpt": g["sdk_tpt_ms"]["median"],
                 "ttft": g["sdk_ttft_ms"]["median"]},
                {"path": "HTTP -> gateway -> dispatcher", "tpt": g["gateway_tpt_ms"]["median"],
                 "ttft": g["gateway_ttft_ms"]["median"]}]
        print(table(rows, [("path", "path"), ("tpt", "TPT ms (median)"),
                           ("ttft", "TTFT ms (median)")]))
        r, d = g["tpt_ratio"], g["ttft_overhead_ms"]
        print(f"TPT gateway / SDK (ratio of means, 95% CI): {_ci_text(*r, '{:.3f}')}  "
              f"(goal <= 1.05: {'met' if r[0] <= 1.05 else 'not met'})")
        print(f"TTFT overhead gateway - SDK (mean ms, 95% CI): {_ci_text(*d, '{:.2f}')}  "
              f"(goal <= 5 ms: {'met' if d[0] <= 5 else 'not met'})")
        results.append({"kind": "gateway_vs_sdk", **g})
    if "transport" not in parts and "e2e" not in parts:
        write_json(args.json, "overhead", "loopback", results)
        return 0

    import uvloop
    if "transport" in parts:
        rows = uvloop.run(transport(n))
        print("\nTransport per hop (tcp loopback, real Service + DEALER client)")
        print(table(rows, [("message", "message"), ("rtt_us", "RTT µs (median)"),
                           ("rtt_us_p99", "RTT µs p99"), ("msgs_per_s", "msgs/s (64 in flight)")]))
        results += [{"kind": "transport", **r} for r in rows]
    if "e2e" not in parts:
        write_json(args.json, "overhead", "loopback", results)
        return 0

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
    results += [{"kind": "e2e", "e2e_ms_per_token": summary([x * 1000 for x in e2e]),
                 "runner_ms_per_token": summary([x * 1000 for x in alone]), "ratio": ratio},
                {"kind": "rss", "bytes": rss}]
    write_json(args.json, "overhead", "loopback", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
