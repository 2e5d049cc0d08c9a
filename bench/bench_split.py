"""Split-mode schedulers side by side (DySCo's multi-edge evaluation, on this machine).

    python -m bench.bench_split [--quick] [--json PATH] [--sections poisson,clustered,context,...]

One suffix process per scheduler (fifo, interleave, exact, dsb, cascade; plus dsb with ragged
instead of padded batches for the context sweep), all pinned to one core and idle except the one
under test; the replay fleet (bench/replay.py) runs in this process on the other core, so the
edge never competes with the suffix. Edges are replayed from recorded cut-layer hidden states
with the edge compute time measured on this machine; every token is checked against the full
model's greedy output.

Sections:
  poisson    Poisson arrivals at mean concurrency N in {2, 4, 8} (Little's law: rate = N / W0,
             W0 = one session's latency alone), 16 warm workers at cuts 2..9 (two per cut),
             throughput and mean per-session latency over repeated trials (DySCo Table III).
  clustered  bursts of 8 sessions: 7 at one cut + 1 elsewhere, two clusters of 4, all spread
             (DySCo Table V).
  context    8 sessions at cuts 1..8 with prompts of 128 .. 2048 tokens: decode throughput and
             the suffix step breakdown private / shared / merge (DySCo Table VI).
  single     one real edge: prefix + suffix + dispatcher processes, a cut sweep with per-token
             edge forward, cloud forward and wire+overhead (DySCo Fig. 7/8); then replay with
             injected idle gaps between steps and the suffix step time they lead to (Fig. 9).
  wire       hidden states rounded to float16 / bfloat16 at every cut 1..L-1 vs float32:
             does greedy output stay identical?

Goals (DySCo Table III at N = 8): dsb >= +48 % throughput over exact and >= +275 % over fifo;
cascade >= dsb there and never below exact on clustered fleets. Reported, not asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import replay
from bench.bench_spec import reference_outputs
from bench.report import table, welch_t, write_json
from common import models
from stack.launcher import Cluster, run_dir
from common.progress import Progress
from common.runner import LayerRangeRunner
from services.suffix.planning import SCHEDULERS

PROMPTS = [  # short chat-like prompts (DySCo's WildGPT-4 range: 16-128 tokens)
    "Write a short poem about the sea at night, in four lines.",
    "Explain the difference between a list and a tuple in Python, with one example of each.",
    "What are three practical tips for staying focused while working from home? Keep it brief.",
    "Summarize the plot of a detective story in which the butler is innocent and the gardener "
    "is not, in a few sentences suitable for a book jacket.",
    "Translate into French: The train leaves at eight, so we should have breakfast early.",
    "Give me a recipe for a simple tomato soup with ingredients and steps.",
    "Why do leaves change colour in autumn? Answer for a ten-year-old.",
    "Draft a polite email asking a colleague to review a pull request by Friday, mentioning that "
    "the change touches the scheduler and the tests, and offering to walk them through it.",
]
PARAGRAPH = ("Split computing runs the first layers of a language model on an edge device and "
             "the rest in the cloud. The edge sends one hidden state per token; the cloud returns "
             "the next token. Many devices share the cloud, each cutting the model at its own "
             "depth, so the cloud must batch requests that arrive at different layers. ")


def long_prompt(tok, n: int) -> list[int]:
    ids, k = [], 0
    while len(ids) < n:
        k += 1
        ids = tok.encode(" ".join(f"Part {j}. {PARAGRAPH}" for j in range(k)))
    return ids[:n]


def pct(a: float, b: float) -> float:
    return 100.0 * (a / b - 1.0) if b else float("nan")


# --- suffix processes --------------------------------------------------------------------------
class Suffixes:
    """One suffix service per variant, pinned to `core`, each with a Peer from this process."""

    def __init__(self, variants: dict[str, list[str]], core: int | None, logdir: Path):
        self.clusters = {}
        for name, flags in variants.items():
            self.clusters[name] = Cluster(services=("suffix",), ephemeral=True,
                                          logdir=logdir / name, extra={"suffix": flags},
                                          pin={"suffix": [core]} if core is not None else None)
        self.peers = {}

    def start(self):
        for c in self.clusters.values():
            c.start_all()
        for c in self.clusters.values():
            c.wait_ready(timeout=300)

    async def connect(self):
        import zmq.asyncio

        from common.runtime import Peer

        self.ctx = zmq.asyncio.Context()
        for name, c in self.clusters.items():
            p = Peer(self.ctx, c.endpoint("suffix"), name=name, owner="bench", heartbeat_s=1.0,
                     timeout_s=60.0)
            assert await p.wait_up(30), f"suffix {name} not reachable"
            self.peers[name] = p

    def metrics(self, name: str) -> dict:
        return replay.scrape(self.clusters[name].procs["suffix"].url("/metrics"))

    def stop(self):
        for p in self.peers.values():
            p.close()
        for c in self.clusters.values():
            c.stop_all()


async def measured(sfx: Suffixes, name: str, coro_fn):
    """Run a fleet against suffix `name`; add the suffix's own per-window figures. The fleet
    function gets the peer and a `mark` callback: calling it restarts the metrics window there
    (bursts call it when decoding starts, so per-window figures cover decode steps only)."""
    snap = {"before": sfx.metrics(name)}

    def mark():
        snap["before"] = sfx.metrics(name)
    res = await coro_fn(sfx.peers[name], mark)
    before = snap["before"]
    await asyncio.sleep(0.3)  # let the last window's metrics land
    after = sfx.metrics(name)
    d = lambda prefix, *labels: replay.delta(before, after, prefix, *labels)  # noqa: E731
    windows = d("tandem_split_window_size_count")
    out = {"throughput": res.throughput, "decode_throughput": res.decode_throughput,
           "latency": res.mean_latency, "tokens": res.tokens, "mismatches": res.mismatches,
           "errors": len(res.errors), "wall_s": res.wall_s,
           "achieved_concurrency": res.achieved_concurrency,
           "windows": windows,
           "window_size": d("tandem_split_window_size_sum") / windows if windows else 0.0,
           "calls_per_step": d("tandem_split_forward_calls_per_step_sum") / windows if windows else 0.0,
           "idle_gap_ms": 1e3 * d("tandem_split_idle_gap_seconds_sum")
           / max(1.0, d("tandem_split_idle_gap_seconds_count"))}
    for phase in ("private", "shared", "merge"):
        out[f"{phase}_ms"] = 1e3 * d("tandem_forward_seconds_sum", f'phase="{phase}"') \
            / windows if windows else 0.0
    if res.errors:
        print(f"    ! {name}: {len(res.errors)} session errors, first: {res.errors[0]}", flush=True)
    return out


def aggregate(runs: list[dict]) -> dict:
    agg = {}
    for k in runs[0]:
        xs = [r[k] for r in runs]
        agg[k] = statistics.fmean(xs)
        agg[k + "_sd"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
    agg["trials"] = runs
    return agg


# --- sections ----------------------------------------------------------------------------------
async def section_poisson(a, sfx, recs, edge, w0, rng):
    print(f"\n== Poisson arrivals: 16 warm workers at cuts 2..9, {a.sessions} sessions x "
          f"{a.tokens} tokens, {a.trials} trial(s); W0 = {w0:.2f} s (one session alone) ==",
          flush=True)
    workers = [c for c in range(2, 10) for _ in range(2)]
    rows = []
    with Progress(len(a.loads) * a.trials * len(a.schedulers), "bench split: poisson",
                  tick=True) as bar:
        for load in a.loads:
            rate = load / w0
            runs = {s: [] for s in a.schedulers}
            for trial in range(a.trials):
                order = rng.sample(a.schedulers, len(a.schedulers))  # randomised, as the paper
                for s in order:
                    seed = 1000 * load + trial  # same arrivals and prompts for every scheduler
                    bar.stage(f"N={load} trial {trial} {s}")
                    r = await measured(sfx, s, lambda p, mark: replay.poisson_fleet(
                        p, recs, workers, a.sessions, rate, edge, seed, a.tokens,  # noqa: B023 - awaited within this iteration
                        tag=f"p{load}-{trial}-{s}"))  # noqa: B023 - awaited within this iteration
                    runs[s].append(r)
                    bar.write(f"  N={load} trial {trial} {s:10s} {r['throughput']:7.1f} tok/s  "
                              f"latency {r['latency']:6.2f} s  window {r['window_size']:.2f}  "
                              f"calls/step {r['calls_per_step']:.2f}")
                    bar.advance()
            for s in a.schedulers:
                agg = aggregate(runs[s])
                rows.append({"load": load, "scheduler": s, "rate_per_s": rate, **agg})
    base = {(r["load"], r["scheduler"]): r for r in rows}
    for r in rows:
        f, e = base.get((r["load"], "fifo")), base.get((r["load"], "exact"))
        r["vs_fifo_pct"] = pct(r["throughput"], f["throughput"]) if f else None
        r["vs_exact_pct"] = pct(r["throughput"], e["throughput"]) if e else None
        r["tok_s"] = f"{r['throughput']:.1f} ± {r['throughput_sd']:.1f}"
        r["lat_s"] = f"{r['latency']:.2f} ± {r['latency_sd']:.2f}"
        # latency against exact-match's at the same load: at N = 1 (unsaturated) the figure
        # that matters, since every scheduler keeps up with the arrivals there
        r["latency_vs_exact_pct"] = pct(r["latency"], e["latency"]) if e else None
        r["conc"] = r["rate_per_s"] * r["latency"]
        r["offered"] = r["rate_per_s"] * a.tokens  # tokens/s the arrivals ask for
    print(table(rows, [("load", "N"), ("offered", "offered tok/s"), ("scheduler", "scheduler"),
                       ("tok_s", "tok/s"),
                       ("lat_s", "latency s"), ("vs_fifo_pct", "vs fifo %"),
                       ("vs_exact_pct", "vs exact %"),
                       ("latency_vs_exact_pct", "latency vs exact %"), ("conc", "achieved N"),
                       ("achieved_concurrency", "sessions in system"),
                       ("window_size", "window"), ("calls_per_step", "calls/step"),
                       ("mismatches", "token diffs")]))
    return rows


async def section_clustered(a, sfx, recs, edge, rng):
    fleets = {"7@9+1@2": [9] * 7 + [2], "7@2+1@9": [2] * 7 + [9], "4@3+4@8": [3] * 4 + [8] * 4,
              "spread 2..9": list(range(2, 10))}
    if a.quick:
        del fleets["7@2+1@9"]
    print(f"\n== Fleets of 8, synchronized bursts, {a.tokens} tokens, {a.trials} trial(s); "
          f"decode throughput ==", flush=True)
    rows = []
    for fleet, cuts in fleets.items():
        runs = {s: [] for s in a.schedulers}
        for trial in range(a.trials):
            for s in rng.sample(a.schedulers, len(a.schedulers)):
                r = await measured(sfx, s, lambda p, mark: replay.burst_fleet(
                    p, recs, cuts, edge, a.tokens, tag=f"c{fleet}-{trial}-{s}".replace(" ", ""),  # noqa: B023 - awaited within this iteration
                    on_release=mark))
                runs[s].append(r)
                print(f"  {fleet} trial {trial} {s:10s} decode {r['decode_throughput']:6.1f} tok/s",
                      flush=True)
        for s in a.schedulers:
            rows.append({"fleet": fleet, "scheduler": s, **aggregate(runs[s])})
    base = {(r["fleet"], r["scheduler"]): r for r in rows}
    for r in rows:
        e = base.get((r["fleet"], "exact"))
        r["vs_exact_pct"] = pct(r["decode_throughput"], e["decode_throughput"]) if e else None
        r["t_vs_exact"] = welch_t([x["decode_throughput"] for x in r["trials"]],
                                  [x["decode_throughput"] for x in e["trials"]]) if e else None
        r["tok_s"] = f"{r['decode_throughput']:.1f} ± {r['decode_throughput_sd']:.1f}"
    print(table(rows, [("fleet", "fleet"), ("scheduler", "scheduler"), ("tok_s", "tok/s"),
                       ("vs_exact_pct", "vs exact %"), ("t_vs_exact", "Welch t"),
                       ("window_size", "window"), ("calls_per_step", "calls/step"),
                       ("merge_ms", "merge ms"), ("mismatches", "token diffs")]))
    return rows


async def section_context(a, sfx, tok, runner, edge, rng):
    variants = [v for v in ("exact", "dsb", "dsb-ragged", "cascade") if v in sfx.peers]
    cuts = list(range(1, 9))
    print(f"\n== Context length: 8 sessions at cuts 1..8 (shared tail {runner.num_layers - 8} "
          f"layers), {a.context_tokens} tokens; step breakdown per window ==", flush=True)
    rows = []
    for n in a.context_lengths:
        rec = replay.record(runner, long_prompt(tok, n), a.context_tokens, cuts, a.cache)
        runs = {v: [] for v in variants}
        for trial in range(a.context_trials):
            for v in rng.sample(variants, len(variants)):
                r = await measured(sfx, v, lambda p, mark: replay.burst_fleet(
                    p, [rec], cuts, edge, a.context_tokens, tag=f"x{n}-{trial}-{v}",  # noqa: B023 - awaited within this iteration
                    on_release=mark))
                runs[v].append(r)
                print(f"  ctx {n} {v:10s} decode {r['decode_throughput']:6.1f} tok/s  step "
                      f"private {r['private_ms']:.1f} shared {r['shared_ms']:.1f} merge "
                      f"{r['merge_ms']:.1f} ms", flush=True)
        for v in variants:
            rows.append({"context": n, "variant": v, **aggregate(runs[v])})
    base = {(r["context"], r["variant"]): r for r in rows}
    for r in rows:
        e = base.get((r["context"], "exact"))
        r["vs_exact_pct"] = pct(r["decode_throughput"], e["decode_throughput"]) if e else None
        step = r["private_ms"] + r["shared_ms"] + r["merge_ms"]
        r["merge_pct"] = 100 * r["merge_ms"] / step if step else 0.0
        r["tok_s"] = f"{r['decode_throughput']:.1f} ± {r['decode_throughput_sd']:.1f}"
    print(table(rows, [("context", "prompt"), ("variant", "scheduler"), ("tok_s", "decode tok/s"),
                       ("vs_exact_pct", "vs exact %"), ("private_ms", "private ms"),
                       ("shared_ms", "shared ms"), ("merge_ms", "merge ms"),
                       ("merge_pct", "merge %"), ("mismatches", "token diffs")]))
    return rows


async def section_idle(a, sfx, recs, edge):
    """One session alone, with an idle gap injected between its steps: the suffix's own step
    time (SuffixToken.seconds) against the gap (DySCo Fig. 9's controlled replay)."""
    rows = []
    print("\n== Idle gaps: one replayed session on the fifo suffix (no window timer), suffix "
          "step time vs injected gap ==", flush=True)
    for cut in (1, 12):
        for gap_ms in a.gaps:
            r = await measured(sfx, "fifo", lambda p, mark: replay.burst_fleet(
                p, recs[:1], [cut], edge, a.tokens, tag=f"g{cut}-{gap_ms}", on_release=mark,  # noqa: B023 - awaited within this iteration
                gap_s=gap_ms / 1e3))  # noqa: B023 - awaited within this iteration
            rows.append({"cut": cut, "gap_ms": gap_ms, "step_ms": r["private_ms"] + r["shared_ms"]})
    for r in rows:
        r["extra_ms"] = r["step_ms"] - next(x["step_ms"] for x in rows
                                           if x["cut"] == r["cut"] and x["gap_ms"] == 0)
    print(table(rows, [("cut", "cut"), ("gap_ms", "gap ms"), ("step_ms", "suffix step ms"),
                       ("extra_ms", "extra vs no gap ms")]))
    return rows


def section_single(a, logdir):
    """Real prefix + suffix + dispatcher: per-token edge forward, cloud forward, wire+overhead."""
    from tandem import Client

    print("\n== One real edge: prefix + suffix (cascade) + dispatcher, per-token breakdown ==",
          flush=True)
    cpus = os.sched_getaffinity(0)
    pin = {"prefix": [0], "suffix": [1], "dispatcher": [0]} if len(cpus) >= 2 else None
    c = Cluster(services=("prefix", "suffix", "dispatcher"), ephemeral=True, logdir=logdir,
                extra={"prefix": ["--threads", "1"], "suffix": ["--threads", "1"]}, pin=pin)
    rows = []
    c.start_all()
    try:
        c.wait_ready(timeout=300)
        with Client(c.endpoint("dispatcher"), timeout_s=300) as cl:
            cl.complete(PROMPTS[0], mode="split", cut=4, max_tokens=4)  # warm-up
            for cut in a.single_cuts:
                r = cl.complete(PROMPTS[1], mode="split", cut=cut, max_tokens=a.tokens,
                                stop_at_eos=False)
                s, n = r.stats, len(r.token_ids)
                rows.append({"cut": cut, "ms_per_token": 1e3 * s["duration_s"] / n,
                             "edge_ms": 1e3 * s["edge_forward_s"] / n,
                             "cloud_ms": 1e3 * s["cloud_forward_s"] / n,
                             "cloud_queue_ms": 1e3 * s["cloud_queue_s"] / n,
                             "wire_ms": 1e3 * s["wire_s"] / n})
    finally:
        c.stop_all()
    print(table(rows, [("cut", "cut"), ("ms_per_token", "ms/token"), ("edge_ms", "edge fwd"),
                       ("cloud_ms", "cloud fwd"), ("cloud_queue_ms", "cloud queue"),
                       ("wire_ms", "wire+overhead")]))
    return rows


@torch.inference_mode()
def section_wire(a, runner, tok):
    """Greedy tokens with the cut hidden state rounded to float16 / bfloat16, every cut, vs the
    float32 split (which equals the full model: tests/unit/test_split_executor.py)."""
    from services.prefix.service import run_prefixes
    from services.suffix.executor import Item, execute
    from services.suffix.planning import Request, plan_window

    L = runner.num_layers
    cuts = list(range(1, L))
    print(f"\n== Wire dtype: every cut 1..{L - 1}, {len(a.wire_prompts)} prompts x "
          f"{a.wire_tokens} tokens ==", flush=True)
    rows = []
    for dtype in ("float32", "float16", "bfloat16"):
        wire = getattr(torch, dtype)
        diffs = []
        for pi, prompt in enumerate(a.wire_prompts):
            ids = tok.encode(prompt)
            pk = [runner.new_kv(0, c) for c in cuts]
            sk = [runner.new_kv(c, L) for c in cuts]
            xs = [torch.tensor(ids)] * len(cuts)
            toks = [[] for _ in cuts]
            for _ in range(a.wire_tokens):
                hs = run_prefixes(runner, list(zip(pk, xs, cuts)))
                items = {str(c): Item(kv, h.to(wire).float()) for c, kv, h in zip(cuts, sk, hs)}
                plan = plan_window("cascade", [Request(str(c), c) for c in cuts], L)
                res = execute(runner, plan, items)
                for i, c in enumerate(cuts):
                    toks[i].append(int(res.logits[str(c)].argmax()))
                xs = [torch.tensor(t[-1:]) for t in toks]
            if dtype == "float32":
                rows.append({"prompt": pi, "ref": toks})
            else:
                ref = rows[pi]["ref"]
                for i, c in enumerate(cuts):
                    if toks[i] != ref[i]:
                        k = next(j for j, (x, y) in enumerate(zip(toks[i], ref[i])) if x != y)
                        diffs.append((c, pi, k))
        if dtype != "float32":
            total = len(cuts) * len(a.wire_prompts)
            print(f"  {dtype:9s}: {total - len({(c, p) for c, p, _ in diffs})}/{total} (cut, prompt) "
                  f"pairs identical to float32; differing (cut, prompt, first token): {diffs}",
                  flush=True)
            rows.append({"dtype": dtype, "pairs": total, "differing": diffs})
    return [r for r in rows if "dtype" in r]


# --- main ----------------------------------------------------------------------------------------
def parse(argv):
    ap = argparse.ArgumentParser(prog="bench_split", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small version, under 3 minutes")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--sections", default="", help="comma list of poisson,clustered,context,"
                    "single,idle,wire (default: all but wire; --quick: poisson,clustered,context)")
    ap.add_argument("--schedulers", default=",".join(SCHEDULERS))
    ap.add_argument("--loads", default="1,2,4,8",
                    help="mean concurrencies N (Little's law); N = 1 is the unsaturated point, "
                         "where latency, not throughput, tells the schedulers apart")
    ap.add_argument("--sessions", type=int, default=16, help="sessions per Poisson trial")
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per session")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--context-lengths", default="128,512,1024,2048")
    ap.add_argument("--context-tokens", type=int, default=32)
    ap.add_argument("--context-trials", type=int, default=2)
    ap.add_argument("--window-ms", type=float, default=8.0)
    ap.add_argument("--max-size", type=int, default=8)
    ap.add_argument("--edge-scale", type=float, default=1.0, help="edge slowness vs this machine")
    ap.add_argument("--wire-ms", type=float, default=0.0, help="extra one-way latency per message")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.sessions, a.trials = min(a.tokens, 16), min(a.sessions, 8), 1
        a.context_lengths, a.context_tokens, a.context_trials = "128,512", 8, 1
    a.sections = (a.sections or ("poisson,clustered,context" if a.quick else
                                 "poisson,clustered,context,single,idle")).split(",")
    a.schedulers = a.schedulers.split(",")
    a.loads = [int(x) for x in a.loads.split(",")]
    a.context_lengths = [int(x) for x in a.context_lengths.split(",")]
    a.single_cuts = [1, 5, 10, 15, 20, 25, 29]
    a.gaps = [0, 1, 2, 5, 10, 25]
    a.wire_prompts, a.wire_tokens = PROMPTS[:4], 32
    return a


async def run(a) -> dict:
    from transformers import AutoTokenizer

    t_start = time.monotonic()
    rng = random.Random(a.seed)
    target = models.resolve_target("bundled")
    tok = AutoTokenizer.from_pretrained(str(target))
    runner = LayerRangeRunner(target, threads=1)
    a.cache = run_dir() / "bench-cache"
    out = {"config": {k: v for k, v in vars(a).items() if k != "cache"}, "sections": {}}
    if "wire" in a.sections:
        out["sections"]["wire"] = section_wire(a, runner, tok)
    needs_fleet = {"poisson", "clustered", "context", "idle"} & set(a.sections)
    if not needs_fleet and "single" not in a.sections:
        return out
    cuts = list(range(1, 13))  # fleets use 2..9, the idle-gap replay 1 and 12
    print(f"recording {len(PROMPTS)} prompts x {a.tokens} tokens (cached in {a.cache}) ...",
          flush=True)
    recs = [replay.record(runner, tok.encode(p), a.tokens, cuts, a.cache) for p in PROMPTS]
    # The replay checks every token against these recordings (the project's own runner); the
    # recordings themselves are checked against transformers' generate(do_sample=False).
    hf = reference_outputs({i: tok.encode(p) for i, p in enumerate(PROMPTS)}, a.tokens)
    differ = [i for i, r in enumerate(recs) if r.tokens != hf[i]]
    out["recordings_identical_to_transformers"] = not differ
    out["recordings_differing_from_transformers"] = differ
    print(f"recordings vs transformers' generate(do_sample=False): "
          f"{len(recs) - len(differ)}/{len(recs)} identical", flush=True)
    edge = replay.calibrate_edge(runner)
    edge.scale, edge.wire_s = a.edge_scale, a.wire_ms / 1e3
    out["edge"] = vars(edge)
    print(f"edge model: {1e3 * edge.layer_s:.3f} ms/layer decode, "
          f"{1e6 * edge.layer_token_s:.1f} µs/layer/token prefill, scale {edge.scale}, "
          f"wire +{a.wire_ms} ms one-way", flush=True)
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-bench-split-{os.getpid()}"
    cpus = sorted(os.sched_getaffinity(0))
    if "single" in a.sections:
        out["sections"]["single"] = section_single(a, logdir / "single")
    if not needs_fleet:
        return out
    core = cpus[-1] if len(cpus) >= 2 else None
    common_flags = ["--threads", "1", "--window-ms", str(a.window_ms), "--max-size", str(a.max_size)]
    variants = {s: ["--scheduler", s, *common_flags] for s in a.schedulers}
    if "context" in a.sections and "dsb" in a.schedulers:
        variants["dsb-ragged"] = ["--scheduler", "dsb", "--paper-padding", "false", *common_flags]
    if "idle" in a.sections and "fifo" not in variants:
        variants["fifo"] = ["--scheduler", "fifo", *common_flags]
    sfx = Suffixes(variants, core, logdir)
    print(f"starting {len(variants)} suffix processes ({', '.join(variants)}) pinned to core "
          f"{core}; this process on {cpus[:-1] if core is not None else cpus}", flush=True)
    sfx.start()
    if core is not None:
        os.sched_setaffinity(0, cpus[:-1])
    try:
        await sfx.connect()
        first = "fifo" if "fifo" in sfx.peers else next(iter(sfx.peers))
        for s in sfx.peers:  # warm-up: first calls pay for allocation and lazy init
            await replay.burst_fleet(sfx.peers[s], recs, [2, 5, 9], edge, 4, tag=f"warm-{s}")
        alone = [(await replay.burst_fleet(sfx.peers[first], [r], [5], edge, a.tokens,
                                           tag=f"w0-{i}")).mean_latency
                 for i, r in enumerate(recs[:3])]
        w0 = statistics.fmean(alone)
        out["w0_s"] = w0
        print(f"ready after {time.monotonic() - t_start:.0f} s", flush=True)
        sections = {"poisson": lambda: section_poisson(a, sfx, recs, edge, w0, rng),
                    "clustered": lambda: section_clustered(a, sfx, recs, edge, rng),
                    "context": lambda: section_context(a, sfx, tok, runner, edge, rng),
                    "idle": lambda: section_idle(a, sfx, recs, edge)}
        for name, fn in sections.items():
            if name in a.sections:
                t = time.monotonic()
                out["sections"][name] = await fn()
                print(f"[{name}: {time.monotonic() - t:.0f} s]", flush=True)
    finally:
        sfx.stop()
        os.sched_setaffinity(0, cpus)
    out["goals"] = goals(out["sections"])
    out["wall_s"] = time.monotonic() - t_start
    return out


def goals(sections: dict) -> dict:
    g = {}
    rows = {(r["load"], r["scheduler"]): r for r in sections.get("poisson", [])}
    top = max((load for load, _ in rows), default=None)
    if top is not None and all((top, s) in rows for s in ("fifo", "exact", "dsb", "cascade")):
        tp = {s: rows[(top, s)]["throughput"] for s in ("fifo", "exact", "dsb", "cascade")}
        trials = {s: [x["throughput"] for x in rows[(top, s)]["trials"]] for s in tp}
        g[f"dsb_vs_exact_pct_at_N{top}"] = (pct(tp["dsb"], tp["exact"]), ">= +48",
                                             welch_t(trials["dsb"], trials["exact"]))
        g[f"dsb_vs_fifo_pct_at_N{top}"] = (pct(tp["dsb"], tp["fifo"]), ">= +275",
                                            welch_t(trials["dsb"], trials["fifo"]))
        g[f"cascade_vs_dsb_pct_at_N{top}"] = (pct(tp["cascade"], tp["dsb"]), ">= 0",
                                               welch_t(trials["cascade"], trials["dsb"]))
    for r in sections.get("clustered", []):
        if r["scheduler"] == "cascade":
            g[f"cascade_vs_exact_pct_{r['fleet']}"] = (r["vs_exact_pct"], ">= 0", r["t_vs_exact"])
    return g


def standard_fields(row: dict, recordings_ok: bool = True) -> dict:
    """The results' common names: scheduler, concurrency, throughput_tok_s,
    mean_latency_s, identical_to_reference (every token equal to the recording, and the
    recordings equal to transformers' greedy output), next to each section's own fields."""
    out = dict(row)
    if "variant" in row:
        out.setdefault("scheduler", row["variant"])
    for key in ("load", "fleet", "context"):
        if key in row:
            out.setdefault("concurrency", row[key])
            break
    if "throughput" in row:
        out.setdefault("throughput_tok_s", row["throughput"])
    if "latency" in row:
        out.setdefault("mean_latency_s", row["latency"])
    if "mismatches" in row:
        out.setdefault("identical_to_reference", row["mismatches"] == 0 and recordings_ok)
    return out


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    out = asyncio.run(run(a))
    if out.get("goals"):
        print("\n== Goals (DySCo Table III / V) ==")
        for k, (v, goal, t) in out["goals"].items():
            print(f"  {k:34s} {v:+8.1f} %   goal {goal:6s}  Welch t {t:.1f}")
    if "wall_s" in out:
        print(f"\ntotal {out['wall_s']:.0f} s")
    ok = out.get("recordings_identical_to_transformers", True)
    results = [{"section": k, "rows": [standard_fields(r, ok) for r in v]}
               for k, v in out["sections"].items()]
    write_json(a.json, "split", "quick" if a.quick else "full", results,
               **{k: v for k, v in out.items() if k != "sections"})
    differ = [r for part in results for r in part["rows"] if r.get("mismatches")]
    if not ok:
        print(f"\nrecordings {out['recordings_differing_from_transformers']} differ from "
              "transformers' generate(do_sample=False)")
        differ.append({"recordings": False})
    if differ:
        print(f"\n{len(differ)} conditions produced tokens that differ from the reference")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
