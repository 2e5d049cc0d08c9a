"""The defaults against hand-tuning: the stack as `tandem up` starts it, next to the benchmarks'
hand-set configuration, in one run.

    tandem bench defaults [--quick] [--json PATH] [--configs planned,tuned,unplanned]
                          [--modes spec,split,cloud-only] [--max-tokens N] [--repeats R] [--bo]

Configurations, each the five services as local processes on ephemeral ports, all three
running at once (a waiting stack costs nothing but heartbeats) so that requests can be
interleaved:

  planned    what `tandem up` starts: stack.launcher.planned(), the resource plan of
             common/resources.py (threads and cores per service, passive waiting on shared cores)
  tuned      the benchmarks' hand-set configuration (bench spec / bench split): one thread per
             service, drafter + prefix + dispatcher pinned to core 0, verifier + suffix to core 1
  unplanned  the defaults before the plan: every service on every core with its libraries'
             default thread counts, OpenMP's default (spinning) wait policy
  passive    the same with OMP_WAIT_POLICY=PASSIVE (not run unless asked: --configs)

Per mode (spec with pipesd, split at the dispatcher's default cut, cloud-only) and configuration:
TPT (request wall time / tokens) and TTFT, medians over prompts x repeats, and each
configuration's ratio to `tuned`: the ratio of means over the same (prompt, repeat) pairs with a
95 % bootstrap confidence interval (scipy.stats.bootstrap, paired, BCa).  Requests of the
configurations are interleaved, the order reversed every other repeat, so drift in machine load
spreads over all of them.  The dispatcher's settings are the same everywhere; its BO autotuner
is off unless --bo (it explores for the first ~1500 accepted tokens, noise unrelated to threads).
The goals: planned TPT <= 1.1x the best hand-set configuration in each mode; planned
spec TTFT <= 2x planned cloud-only TTFT.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import warnings
from pathlib import Path

from bench.report import summary, table, write_json
from stack.launcher import SERVICES, Cluster, planned, run_dir
from common.progress import Progress

CONFIGS = ("planned", "tuned", "unplanned", "passive")
MODES = ("spec", "split", "cloud-only")
PROMPTS = {   # the shipped prompt kinds (tests/conftest.PROMPTS), as text: the dispatcher tokenises
    "plain": "The history of the printing press begins in",
    "chat": "Explain in two sentences why speculative decoding is lossless.",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
}
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY",
              "GOMP_SPINCOUNT", "TANDEM_THREADS", "TANDEM_CPUS",
              *(f"TANDEM_{s.upper()}_{f}" for s in SERVICES for f in ("THREADS", "CPUS")))
MODEL_SERVICES = ("verifier", "drafter", "prefix", "suffix")


def make_cluster(config: str, logdir: Path, dispatcher_flags: list[str]) -> Cluster:
    extra = {"dispatcher": list(dispatcher_flags)}
    if config == "planned":
        return planned(SERVICES, ephemeral=True, logdir=logdir, extra=extra)
    cores = sorted(os.sched_getaffinity(0))
    if config == "tuned":
        edge, cloud = [cores[0]], [cores[1 % len(cores)]]
        pin = {"drafter": edge, "prefix": edge, "dispatcher": edge,
               "verifier": cloud, "suffix": cloud}
        for s in MODEL_SERVICES:
            extra[s] = ["--threads", "1"]
        # as the benchmarks start them: the caller's environment, no thread settings of its own
        return Cluster(SERVICES, ephemeral=True, logdir=logdir, extra=extra, pin=pin,
                       env={k: None for k in THREAD_ENV})
    if config in ("unplanned", "passive"):
        env = {k: None for k in THREAD_ENV}
        if config == "passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        return Cluster(SERVICES, ephemeral=True, logdir=logdir, extra=extra, env=env)
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


def request(c, mode: str, prompt: str, n: int):
    kw = {"mode": mode}
    if mode == "spec":
        kw["policy"] = "pipesd"
    return c.complete(prompt, max_tokens=n, stop_at_eos=False, **kw)


def ratio_ci(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """mean(a) / mean(b) over paired samples, with a bootstrap confidence interval (BCa; the
    percentile interval when BCa is degenerate, e.g. with very few pairs)."""
    import numpy as np
    from scipy.stats import bootstrap

    a, b = np.asarray(a, float), np.asarray(b, float)
    point = float(a.mean() / b.mean())
    if len(a) < 2:
        return point, float("nan"), float("nan")

    def stat(x, y, axis=-1):
        return np.mean(x, axis=axis) / np.mean(y, axis=axis)

    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                r = bootstrap((a, b), stat, paired=True, vectorized=True, n_resamples=4999,
                              confidence_level=level, method=method, random_state=0)
            except ValueError:
                continue
        lo, hi = float(r.confidence_interval.low), float(r.confidence_interval.high)
        if math.isfinite(lo) and math.isfinite(hi):
            return point, lo, hi
    return point, float("nan"), float("nan")


def _ci(point, lo, hi) -> str:
    if not math.isfinite(lo):
        return f"{point:.2f}"
    return f"{point:.2f} [{lo:.2f}, {hi:.2f}]"


def result_rows(samples: dict, configs: list[str], modes: list[str], base: str = "tuned"
                ) -> list[dict]:
    """One row per (mode, configuration): medians, and ratios of means to `base` with CIs.
    samples[(config, mode)] = [{"key": (prompt, repeat), "tpt_ms", "ttft_ms"}, ...]"""
    rows = []
    for mode in modes:
        for config in configs:
            runs = samples.get((config, mode), [])
            if not runs:
                continue
            tpt, ttft = summary([r["tpt_ms"] for r in runs]), summary([r["ttft_ms"] for r in runs])
            row = {"mode": mode, "config": config, "n": len(runs),
                   "tpt_ms": tpt["median"], "tpt_ms_mean": tpt["mean"], "tpt_ms_iqr": tpt["iqr"],
                   "ttft_ms": ttft["median"], "ttft_ms_mean": ttft["mean"],
                   "identical_to_tuned": None, "runs": runs}
            ref = {r["key"]: r for r in samples.get((base, mode), [])}
            pairs = [(r, ref[r["key"]]) for r in runs if r["key"] in ref]
            if pairs and config != base:
                for key in ("tpt_ms", "ttft_ms"):
                    p, lo, hi = ratio_ci([x[key] for x, _ in pairs], [y[key] for _, y in pairs])
                    row[f"{key}_ratio"], row[f"{key}_ratio_ci"] = p, [lo, hi]
                    row[f"{key}_vs_{base}"] = _ci(p, lo, hi)
                row["identical_to_tuned"] = all(x["tokens"] == y["tokens"] for x, y in pairs)
            rows.append(row)
    return rows


def goals(rows: list[dict], base_configs=("tuned", "unplanned", "passive")) -> list[str]:
    """The goals, checked on these rows (a line each, met or not)."""
    out = []
    by = {(r["mode"], r["config"]): r for r in rows}
    for mode in MODES:
        mine = by.get((mode, "planned"))
        hand = [by[mode, c] for c in base_configs if (mode, c) in by]
        if not mine or not hand:
            continue
        best = min(hand, key=lambda r: r["tpt_ms_mean"])
        ratio = mine["tpt_ms_mean"] / best["tpt_ms_mean"]
        out.append(f"{mode}: planned TPT {mine['tpt_ms_mean']:.1f} ms = {ratio:.2f}x the best "
                   f"other configuration ({best['config']}, {best['tpt_ms_mean']:.1f} ms): "
                   f"{'met' if ratio <= 1.1 else 'NOT met'} (goal <= 1.1x, means)")
    spec, cloud = by.get(("spec", "planned")), by.get(("cloud-only", "planned"))
    if spec and cloud:
        ratio = spec["ttft_ms"] / cloud["ttft_ms"]
        out.append(f"planned spec TTFT {spec['ttft_ms']:.0f} ms = {ratio:.2f}x cloud-only's "
                   f"{cloud['ttft_ms']:.0f} ms: {'met' if ratio <= 2 else 'NOT met'} "
                   f"(goal <= 2x, medians)")
    return out


COLUMNS = [("mode", "mode"), ("config", "config"), ("n", "n"), ("tpt_ms", "TPT ms"),
           ("tpt_ms_iqr", "IQR"), ("ttft_ms", "TTFT ms"),
           ("tpt_ms_vs_tuned", "TPT / tuned [95% CI]"), ("ttft_ms_vs_tuned", "TTFT / tuned [95% CI]"),
           ("identical_to_tuned", "same tokens")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench defaults", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="planned and tuned only, 1 prompt, 1 warm-up, 2 repeats, 12 tokens: it "
                         "runs and reports (CI)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--configs", default="", help=f"of {', '.join(CONFIGS)} (default planned,tuned,"
                                                  "unplanned)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens per request (default 48)")
    ap.add_argument("--repeats", type=int, default=0, help="runs per prompt (default 4)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="unmeasured requests per mode first (default 2; quick 1)")
    ap.add_argument("--bo", action="store_true", help="leave pipesd's BO autotuner on")
    args = ap.parse_args(argv)
    configs = [c for c in (args.configs or ("planned,tuned" if args.quick else
                                            "planned,tuned,unplanned")).split(",") if c]
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    modes = [m for m in args.modes.split(",") if m]
    bad = sorted(set(configs) - set(CONFIGS)) + sorted(set(modes) - set(MODES))
    if bad or not configs or not modes:
        ap.error(f"unknown configurations or modes {bad}; configurations {CONFIGS}, modes {MODES}")
    n = args.max_tokens or (12 if args.quick else 48)
    repeats = args.repeats or (2 if args.quick else 4)
    kinds = ["chat"] if args.quick else list(PROMPTS)
    t0 = time.monotonic()
    from tandem import Client

    logroot = run_dir() / "bench-defaults"
    flags = ["--spec-bo", "true" if args.bo else "false"]
    samples: dict[tuple[str, str], list[dict]] = {}
    with contextlib.ExitStack() as stack:
        clusters, clients = {}, {}
        for config in configs:
            cl = make_cluster(config, logroot / config, flags)
            stack.callback(cl.stop_all)
            clusters[config] = cl
            if cl.shares:
                print(f"# {config}: " + cl.describe().replace("\n", "\n# "), flush=True)
            cl.start_all()
        for config, cl in clusters.items():
            cl.wait_ready(timeout=600)
            clients[config] = stack.enter_context(
                Client(cl.endpoint("dispatcher"), timeout_s=600))
        print(f"# bench defaults: {len(configs)} configurations x {len(modes)} modes x "
              f"{len(kinds)} prompts x {repeats} repeats, {n} tokens, {os.cpu_count()} cores, "
              f"BO {'on' if args.bo else 'off'}; started in {time.monotonic() - t0:.0f} s",
              flush=True)
        for config in configs:   # first-call costs (oneDNN packing, llama.cpp graphs) left out
            for mode in modes:
                for _ in range(warmup):
                    request(clients[config], mode, PROMPTS[kinds[0]], n)
        total = repeats * len(kinds) * len(modes) * len(configs)
        with Progress(total, "bench defaults", tick=True) as bar:
            for rep in range(repeats):
                for kind in kinds:
                    for mode in modes:
                        order = configs if (rep + kinds.index(kind)) % 2 == 0 else configs[::-1]
                        for config in order:
                            bar.stage(f"{mode} {config} {kind} rep {rep}")
                            r = request(clients[config], mode, PROMPTS[kind], n)
                            st = r.stats
                            run = {"key": (kind, rep), "prompt": kind, "repeat": rep,
                                   "tpt_ms": st["tpt_s"] * 1000, "ttft_ms": st["ttft_s"] * 1000,
                                   "tokens": list(r.token_ids)}
                            samples.setdefault((config, mode), []).append(run)
                            bar.write(f"  {mode:10s} {config:9s} {kind:5s} rep {rep}: TPT "
                                      f"{run['tpt_ms']:7.1f} ms  TTFT {run['ttft_ms']:7.1f} ms")
                            bar.advance()
        plan = {c: {n_: {"threads": s.threads, "cpus": list(s.cpus), "env": s.env}
                    for n_, s in cl.shares.items()} for c, cl in clusters.items() if cl.shares}

    base = "tuned" if "tuned" in configs else configs[0]
    rows = result_rows(samples, configs, modes, base=base)
    cols = [(k, h.replace("tuned", base)) for k, h in COLUMNS]
    cols = [(k.replace("tuned", base), h) for k, h in cols]
    print()
    print(f"# TPT = request wall time / tokens, TTFT = time to first token (medians); ratios: "
          f"mean over the same (prompt, repeat) pairs / {base}'s, 95% bootstrap CI")
    print(table(rows, cols))
    lines = goals(rows)
    for line in lines:
        print("# goal: " + line)
    print(f"# wall time {time.monotonic() - t0:.0f} s")
    for r in rows:
        for run in r["runs"]:
            run["key"] = list(run["key"])
            run.pop("tokens", None)
    write_json(args.json, "defaults", "loopback", rows, configs=configs, modes=modes,
               max_tokens=n, repeats=repeats, prompts=kinds, bo=args.bo, plan=plan,
               goals=lines, cores=sorted(os.sched_getaffinity(0)))
    # different thread counts sum in different orders: a near-tie may go the other way, so
    # differing tokens are reported (the "same tokens" column), not failed
    return 0


if __name__ == "__main__":
    sys.exit(main())
