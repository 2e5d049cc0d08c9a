"""The BO autotuner against grid and random search (PipeSD §5.2.3), on live traffic.

    python -m bench.bench_tuner [--quick] [--json PATH] [--scenario s1] [--budget 16]

One objective for all three searches: TPT(R1, R2) = mean time per accepted token of the `pipesd`
policy over the prompt set, each request sent with `nav_thresholds=(R1, R2)` (the dispatcher's own
tuner is neither used nor fed by those requests), through the same services and emulated link as
`bench spec`. Each search spends the same budget of evaluations (16, as the paper):

    grid    4 x 4 cell centres over log10 R1 x R2
    random  uniform in (log10 R1, R2), seeded
    bo      skopt GP + EI through services/dispatcher/spec/bo_tuner.BOTuner, exactly as it runs live

The searches run in a seeded random order. A search's best evaluation is biased low (the minimum
of noisy samples), so every search's chosen point, and the untuned default (0.90, 0.94), are then
re-measured together, interleaved, `--repeats` times: those re-measured TPTs are the result. The
goal: BO within 10 % of the best grid point after 16 samples. Welch's t compares each
chosen point's re-measured TPT with grid's (|t| > 2.5: significant).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from bench.bench_spec import encode_prompts, reference_outputs, spec_cluster
from bench.report import summary, table, welch_t, write_json
from services.dispatcher.spec.bo_tuner import DEFAULT_R1, DEFAULT_R2, bo_search, grid_search, random_search

SEARCHES = {"grid": grid_search, "random": random_search, "bo": bo_search}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_tuner", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="budget 6, 1 prompt, 16 tokens (< 3 min)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--scenario", default="s1", help="WAN scenario (bench spec's), or none")
    ap.add_argument("--drafter", default="bundled", help="bundled (Q4_0) | bundled-q4_1 | GGUF path")
    ap.add_argument("--budget", type=int, default=0, help="evaluations per search (default 16)")
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens per request (default 32)")
    ap.add_argument("--repeats", type=int, default=0,
                    help="re-measurements of each chosen point over the prompts (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    budget = args.budget or (6 if args.quick else 16)
    n = args.max_tokens or (16 if args.quick else 32)
    repeats = args.repeats or (2 if args.quick else 4)
    kinds = ["code"] if args.quick else ["plain", "chat", "code"]
    t_start = time.monotonic()
    prompts = encode_prompts(kinds)
    wrong: list[str] = []

    with spec_cluster(args.scenario, args.drafter, bo=False) as (c, _, note):
        ref = reference_outputs(prompts, n)

        def measure(r1: float, r2: float) -> float:
            """Mean TPT (s) over the prompt set at fixed thresholds; checks every output."""
            tpts = []
            for k, ids in prompts.items():
                r = c.complete(ids, mode="spec", policy="pipesd", max_tokens=n, stop_at_eos=False,
                               nav_thresholds=(r1, r2))
                if r.token_ids != ref[k]:
                    wrong.append(f"{k} at ({r1:.3g}, {r2:.3g})")
                tpts.append(r.stats["tpt_s"])
            return statistics.fmean(tpts)

        print(f"# bench_tuner: grid / random / BO, {budget} evaluations each, objective = mean "
              f"TPT of pipesd over {kinds} x {n} tokens; link {note}", flush=True)
        measure(DEFAULT_R1, DEFAULT_R2)   # warm-up
        order = list(SEARCHES)
        random.Random(args.seed).shuffle(order)
        found = {}
        for name in order:
            t = time.monotonic()
            calls = 0

            def objective(r1, r2, name=name):
                nonlocal calls
                calls += 1
                tpt = measure(r1, r2)
                print(f"  {name:6s} #{calls:2d} R1={r1:9.3g} R2={r2:6.3f}: {tpt * 1000:6.1f} ms",
                      flush=True)
                return tpt
            kw = {} if name == "grid" else {"seed": args.seed}
            res = SEARCHES[name](objective, budget, **kw)
            found[name] = {"search": name, "evaluations": len(res.evaluations),
                           "best_r1": res.best_r1, "best_r2": res.best_r2,
                           "best_tpt_ms_in_search": res.best_tpt * 1000,
                           "search_s": time.monotonic() - t,
                           "trace_ms": [e.tpt * 1000 for e in res.evaluations]}
        found["default"] = {"search": "default", "evaluations": 0, "best_r1": DEFAULT_R1,
                            "best_r2": DEFAULT_R2, "best_tpt_ms_in_search": None}
        print(f"# re-measuring every chosen point {repeats} times, interleaved", flush=True)
        again = {name: [] for name in found}
        for rep in range(repeats):
            names = list(found) if rep % 2 == 0 else list(found)[::-1]
            for name in names:
                again[name].append(measure(found[name]["best_r1"], found[name]["best_r2"]) * 1000)

    grid = again["grid"]
    rows = []
    for name, f in found.items():
        s = summary(again[name])
        rows.append({**f, "tpt_ms": s["median"], "tpt_ms_spread": s["iqr"],
                     "tpt_ms_runs": again[name],
                     "vs_grid": s["median"] / summary(grid)["median"],
                     "welch_t_vs_grid": welch_t(again[name], grid) if name != "grid" else None,
                     "identical_to_reference": not wrong})
    print()
    print(f"# re-measured TPT at each search's chosen point; link {note}")
    print(table(rows, [("search", "search"), ("evaluations", "evals"), ("best_r1", "R1"),
                       ("best_r2", "R2"), ("best_tpt_ms_in_search", "best in search ms"),
                       ("tpt_ms", "re-measured median ms"), ("tpt_ms_spread", "IQR"),
                       ("vs_grid", "vs grid"), ("welch_t_vs_grid", "t vs grid")]))
    if wrong:
        print(f"# OUTPUT DIFFERS FROM THE REFERENCE: {wrong[:5]}")
    print(f"# wall time {time.monotonic() - t_start:.0f} s")
    write_json(args.json, "tuner", args.scenario, rows, link=note, drafter=args.drafter,
               budget=budget, max_tokens=n, repeats=repeats, prompts=kinds, seed=args.seed)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
