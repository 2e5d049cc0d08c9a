"""Regenerate docs/benchmarks.md (and its plots) from the benchmark JSON files in docs/results/.

    python -m bench.results_page            # after e.g. `tandem bench spec --json docs/results/spec_s1.json`

Every number on the page comes from those files; each section names the command that wrote it.
The papers' figures are compared as ratios, since the hardware differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.plots import plot, split_rows
from bench.report import BASELINES, auto_goals, best_baseline, paired_ratio
from bench.stats import ratio_ci

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"

# PipeSD, S1, HumanEval: TPT in ms. DySCo Table III at mean concurrency 8: tokens/s.
PIPESD_TPT = {"vanilla": 194, "hsl": 155, "edgellm": 153, "pipesd": 129}
DYSCO_TPUT = {"fifo": 58.5, "exact": 148.3, "interleave": 122.5, "dsb": 219.8}


def _f(v, nd=3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{nd}g}"
    return str(v)


def _md_table(rows: list[list], header: list[str]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_f(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _ci(v) -> str:
    if not v or any(x != x for x in v):
        return "n/a"
    return f"[{v[0]:.3g}, {v[1]:.3g}]"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _knobs(tp: dict | None) -> str:
    k = (tp or {}).get("knobs")
    if not k:
        return "—"
    return ", ".join(f"{n}={v:.3g}" if isinstance(v, float) else f"{n}={v}" for n, v in k.items())


def spec_workload_section(doc: dict, name: str) -> str:
    """A `tandem bench spec` run on a real workload: tuned policies, bound, intervals,
    cloud and edge cost per token, and the load sweep when there is one."""
    rows = [r for r in doc["results"] if r.get("policy") and r.get("kind") != "load"]
    loads = [r for r in doc["results"] if r.get("kind") == "load"]
    by = {r["policy"]: r for r in rows if not r.get("uplink_mbit")}
    paired = any(e.get("control_ms") is not None for r in rows
                 for e in (r.get("tuned_params") or {}).get("evaluations") or [])
    tuning = (f"every knobbed policy tuned by the same BO, {doc.get('tune_budget')} evaluations x "
              f"{doc.get('tune_window')} tuning prompts"
              + (", each told as TPT relative to the policy's default knobs on the same prompts"
                 if paired else "") if doc.get("tuned")
              else "every policy at its defaults (--no-tune)")
    lines = [f"### Speculative mode — `{name}` (workload `{doc.get('workload')}`, scenario "
             f"`{doc.get('scenario')}`, model `{doc.get('model', 'smollm2-135m')}`, drafter "
             f"`{doc.get('drafter', 'bundled')}`)", "",
             (f"**Partial run**: it stopped after {doc['partial']['test_prompts_finished']} of "
              f"{doc['partial']['of']} test prompts; the rows cover those. "
              if doc.get("partial") else "") +
             f"{len(doc.get('test_prompts', []))} test prompts x {doc.get('repeats')} repeat(s), "
             f"{doc.get('max_tokens')} tokens each; {len(doc.get('tuning_prompts', []))} "
             f"held-apart tuning prompts; {tuning}. TPT is the mean over test prompts of each "
             "prompt's time per token; every interval is a 95 % bootstrap interval over the "
             "test prompts (paired: the same prompts for every policy). Link: "
             f"{doc.get('link')}. Energy: {doc.get('energy')}.", ""]
    sweep = any(r.get("uplink_mbit") for r in rows)
    cols = (["uplink Mbit/s"] if sweep else []) + [
        "policy", "knobs (how chosen: see above)", "TPT ms", "95 % CI", "TPT / bound", "95 % CI",
        "vs best baseline", "95 % CI", "vs cloud-only", "acceptance", "accepted / round",
        "draft len",
        "cloud fwd / token", "cloud s / token", "edge CPU s / token", "TTFT ms", "SLO met",
        "identical to reference"]
    lines.append(_md_table([([r.get("uplink_mbit")] if sweep else []) + [
        r["policy"], _knobs(r.get("tuned_params")), r.get("tpt_ms"), _ci(r.get("ci95")),
        r.get("tpt_over_bound"), _ci(r.get("tpt_over_bound_ci95")), r.get("vs_best_baseline"),
        _ci(r.get("vs_best_baseline_ci95")), r.get("speedup_vs_cloud_only"),
        r.get("acceptance_rate"), r.get("accepted_tokens_per_round"), r.get("mean_draft_length"),
        r.get("cloud_forwards_per_token"),
        r.get("cloud_s_per_token"), r.get("edge_cpu_s_per_token"), r.get("ttft_ms"),
        r.get("slo_met"), r.get("identical_runs")] for r in rows], cols))
    goals = []
    if "pipesd" in by and by["pipesd"].get("vs_best_baseline"):
        r = by["pipesd"]
        lo = r["vs_best_baseline_ci95"][0]
        met = r["vs_best_baseline"] >= 1.16 and lo > 1.0
        goals.append([f"pipesd over the best tuned baseline ({r['best_baseline']})",
                      ">= 1.16x, CI lower end > 1", f"{r['vs_best_baseline']:.3f}x "
                      f"{_ci(r['vs_best_baseline_ci95'])}", "met" if met else "NOT met"])
    if rows:
        worst = min(rows, key=lambda r: r.get("tpt_over_bound_min", r["tpt_over_bound"]))
        ok = all(r.get("bound_violations", 0) == 0 and r["tpt_over_bound"] >= 1 for r in rows)
        goals.append(["no policy below the clairvoyant bound", "TPT / bound >= 1 for every row",
                      f"lowest per-request ratio {worst.get('tpt_over_bound_min', 0):.3f} "
                      f"({worst['policy']})", "met" if ok else "NOT met (a bug: see the bench)"])
    if "pipesd" in by:
        goals.append(["pipesd's TPT over the bound", "reported (token trees set its goal)",
                      f"{by['pipesd']['tpt_over_bound']:.3f} "
                      f"{_ci(by['pipesd'].get('tpt_over_bound_ci95'))}", "reported"])
    goals += auto_goals([r for r in rows if not r.get("uplink_mbit")], doc.get("scenario", ""))
    if goals:
        lines += ["", "Goals:", ""]
        lines.append(_md_table(goals, ["goal", "target", "this run", "status"]))
    tree_goals = token_tree_goals(by)
    if tree_goals:
        lines += ["", "Goals, from the same run:", ""]
        lines.append(_md_table(tree_goals, ["goal", "target", "this run", "status"]))
    energy = [r for r in rows if r.get("edge_cpu_s_per_token") is not None and not sweep]
    if energy:
        base = next((r for r in energy if r["policy"] == energy[0].get("best_baseline")), None)
        lines += ["", "Energy, as PipeSD compares it (per generated token, relative to the best "
                      "tuned baseline), with CPU-seconds as the proxy — "
                      f"{doc.get('energy') or 'no power reading'}:", ""]
        lines.append(_md_table([[r["policy"], r["edge_cpu_s_per_token"] * 1000,
                                 _ms(r.get("drafter_cpu_s_per_token")),
                                 _ms(r.get("dispatcher_cpu_s_per_token")),
                                 r["cloud_s_per_token"] * 1000,
                                 (r["edge_cpu_s_per_token"] + r["cloud_s_per_token"]) * 1000,
                                 f"{100 * (r['edge_cpu_s_per_token'] / base['edge_cpu_s_per_token'] - 1):+.0f} %"
                                 if base and base["edge_cpu_s_per_token"] else "n/a",
                                 r.get("joules_per_token")] for r in energy],
                               ["policy", "edge CPU ms / token", "of it, drafter",
                                "of it, dispatcher", "cloud CPU ms / token",
                                "total CPU ms / token", "edge vs best baseline", "J / token"]))
    b = doc.get("bound") or {}
    if b:
        lines += ["", f"Clairvoyant bound (bench/bound.py): link RTT {b.get('rtt_s', 0) * 1000:.1f}"
                      f" ms, verify cost {b['verify_s'][0] * 1000:.1f} ms (0 drafts) to "
                      f"{b['verify_s'][-1] * 1000:.1f} ms ({len(b['verify_s']) - 1} drafts), "
                      "α, β, γ as the run measured them (per prompt, the least over the "
                      "policies), prompt prefill not counted (so the bound is, if anything, "
                      "low). `oracle-trigger` is a policy (it verifies at the first rejected "
                      "draft, with no proactive drafting), not a bound."]
    if loads:
        ld = doc.get("load") or {}
        lines += ["", f"Load sweep: concurrent edge sessions sharing one verifier core; "
                      f"per-session TPT (mean, 95 % CI) and the verifier's utilisation "
                      f"(its CPU-seconds / wall seconds). Sessions served within "
                      f"{ld.get('tpt_budget_ms', 0):.1f} ms/token: "
                      f"{ld.get('users_within_budget')}.", ""]
        lines.append(_md_table([[r["policy"], r["sessions"], r.get("tpt_ms"), _ci(r.get("ci95")),
                                 r.get("tpt_ms_p90"), r.get("verifier_utilisation"),
                                 r.get("requests")] for r in loads],
                               ["policy", "sessions", "per-session TPT ms", "95 % CI", "p90 ms",
                                "verifier utilisation", "requests"]))
    if "vanilla" in by and by["vanilla"].get("tpt_ms"):
        base = by["vanilla"]["tpt_ms"]
        lines += ["", "Against PipeSD's published figures (S1, HumanEval), as TPT relative to "
                      "vanilla (lower is better; here vanilla is tuned too):", ""]
        lines.append(_md_table([[p, PIPESD_TPT[p] / PIPESD_TPT["vanilla"],
                                 by[p]["tpt_ms"] / base if p in by else None]
                                for p in PIPESD_TPT], ["policy", "PipeSD paper", "Tandem (this run)"]))
    return "\n".join(lines)


CHAIN_POLICIES = ("vanilla", "hsl", "edgellm", "pipesd", "pipesd-stream", "pipesd-learned")


def token_tree_goals(by: dict[str, dict]) -> list[list]:
    """The goals, where the run has the policies they compare: `tree` against pipesd
    and the best chain policy (paired over the test prompts), `pipesd-learned` against the
    clairvoyant chain bound."""
    goals = []
    tree, pipesd = by.get("tree"), by.get("pipesd")
    if tree and pipesd and pipesd.get("accepted_tokens_per_round"):
        x = tree["accepted_tokens_per_round"] / pipesd["accepted_tokens_per_round"]
        goals.append(["accepted tokens per round, tree over pipesd", ">= 1.5x",
                      f"{x:.2f}x ({tree['accepted_tokens_per_round']:.2f} vs "
                      f"{pipesd['accepted_tokens_per_round']:.2f})",
                      "met" if x >= 1.5 else "NOT met"])
    if tree and tree.get("vs_pipesd"):   # policy_rows' paired ratio: pipesd's TPT / tree's
        x = tree["vs_pipesd"]
        goals.append(["TPT, tree over pipesd", ">= 1.25x",
                      f"{x:.3f}x {_ci(tree.get('vs_pipesd_ci95'))}",
                      "met" if x >= 1.25 else "NOT met"])
    chains = [p for p in CHAIN_POLICIES if p in by]
    if tree and chains:
        best = min(chains, key=lambda p: by[p]["tpt_ms"])
        x = by[best]["tpt_ms"] / tree["tpt_ms"]
        ci = ratio_ci(list(by[best]["tpt_ms_by_prompt"].values()),
                      list(tree["tpt_ms_by_prompt"].values()))
        goals.append([f"TPT, tree over the best chain policy ({best})",
                      ">= 1.16x, CI lower end > 1", f"{x:.3f}x {_ci(ci)}",
                      "met" if x >= 1.16 and ci[0] > 1 else "NOT met"])
    learned = by.get("pipesd-learned")
    if learned:
        x = learned["tpt_over_bound"]
        goals.append(["pipesd-learned TPT over the clairvoyant chain bound", "<= 1.10",
                      f"{x:.3f} {_ci(learned.get('tpt_over_bound_ci95'))}",
                      "met" if x <= 1.10 else "NOT met"])
    return goals


def spec_section(doc: dict, name: str) -> str:
    if doc.get("workload"):
        return spec_workload_section(doc, name)
    rows = [r for r in doc["results"] if r.get("policy")]
    by = {r["policy"]: r for r in rows}
    lines = [f"### Speculative mode — `{name}` (scenario `{doc.get('scenario')}`, drafter "
             f"`{doc.get('drafter', 'bundled')}`)", ""]
    sweep = any(r.get("uplink_mbit") for r in rows)
    cols = (["uplink Mbit/s"] if sweep else []) + [
        "policy", "TPT ms (median)", "spread ms (IQR)", "Welch t vs pipesd", "acceptance",
        "mean draft len", "cloud fwd / token", "identical to reference"]
    lines.append(_md_table([([r.get("uplink_mbit")] if sweep else []) + [
        r["policy"], r.get("tpt_ms"), r.get("tpt_ms_spread", r.get("iqr_ms")),
        r.get("welch_t_vs_pipesd"), r.get("acceptance_rate", r.get("accept")),
        r.get("mean_draft_length", r.get("draft_len")),
        r.get("cloud_forwards_per_token", r.get("fwd_per_tok")),
        r.get("identical_runs", r.get("identical_to_reference", r.get("identical")))]
        for r in rows], cols))
    if not sweep and {"pipesd", "oracle-trigger", "vanilla", "hsl", "edgellm"} <= set(by):
        best = best_baseline(by)
        goals = [["pipesd vs the best baseline (" + best + "), TPT ratio", ">= 1.16",
                  by[best]["tpt_ms"] / by["pipesd"]["tpt_ms"], by[best].get("welch_t_vs_pipesd")],
                 ["pipesd vs oracle-trigger, TPT ratio", "<= 1.15",
                  by["pipesd"]["tpt_ms"] / by["oracle-trigger"]["tpt_ms"],
                  by["oracle-trigger"].get("welch_t_vs_pipesd")]]
        if "pipesd-stream" in by:
            goals.append(["pipesd-stream vs pipesd, TPT ratio", "< 1",
                          by["pipesd-stream"]["tpt_ms"] / by["pipesd"]["tpt_ms"],
                          by["pipesd-stream"].get("welch_t_vs_pipesd")])
        wbest = best_baseline(by, "tpt_ms_workload")
        if wbest is not None and by["pipesd"].get("tpt_ms_workload"):
            goals.insert(1, [f"the same on the workload's TPT (all time / all tokens; best "
                             f"baseline {wbest})", ">= 1.16",
                             by[wbest]["tpt_ms_workload"] / by["pipesd"]["tpt_ms_workload"], None])
        lines += ["", "Goals, from the medians above; Welch's t of the other policy "
                      "against pipesd (|t| > 2.5: significant):", ""]
        lines.append(_md_table(goals, ["goal", "target", "this run", "Welch t"]))
    if not sweep and "oracle-trigger" in by and set(BASELINES) <= set(by):
        lines += ["", "Headroom: the best baseline's TPT over each policy's. oracle-trigger "
                      "verifies exactly at the first rejected draft (a policy, not a bound):", ""]
        lines.append(_md_table(_headroom_rows(rows), ["policy", "by median", "by workload"]))
    kinds = list(rows[0].get("tpt_ms_by_prompt") or {}) if rows and not sweep else []
    if kinds:
        lines += ["", "Mean TPT ms per prompt (the median above sits on the middle prompt; "
                      "which baseline is best changes from prompt to prompt):", ""]
        lines.append(_md_table([[r["policy"], r.get("tpt_ms_workload")]
                                + [r["tpt_ms_by_prompt"].get(k) for k in kinds] for r in rows],
                               ["policy", "workload"] + kinds))
    if not sweep and "vanilla" in by and by["vanilla"].get("tpt_ms"):
        base = by["vanilla"]["tpt_ms"]
        lines += ["", "Against PipeSD's published figures (S1, HumanEval), as TPT relative to "
                      "vanilla (lower is better):", ""]
        lines.append(_md_table([[p, PIPESD_TPT[p] / PIPESD_TPT["vanilla"],
                                 by[p]["tpt_ms"] / base if p in by else None]
                                for p in PIPESD_TPT], ["policy", "PipeSD paper", "Tandem (this run)"]))
    return "\n".join(lines)


def _headroom_rows(rows: list[dict]) -> list[list]:
    """oracle-trigger, pipesd, pipesd-stream and the best fixed-threshold pipesd ("pipesd@R1:R2" rows of
    a `--grid` run): the best baseline's TPT over theirs, by median and by workload."""
    by = {r["policy"]: r for r in rows}
    fixed = [p for p in by if "@" in p]
    names = ["oracle-trigger", "pipesd", "pipesd-stream"]
    if fixed:
        names.append(min(fixed, key=lambda p: by[p].get("tpt_ms_workload") or by[p]["tpt_ms"]))
    out = []
    for p in names:
        if p not in by:
            continue
        cells = []
        for key in ("tpt_ms", "tpt_ms_workload"):
            best = best_baseline(by, key)
            cells.append(by[best][key] / by[p][key] if best and by[p].get(key) else None)
        label = p + (" (the grid's best fixed R1:R2 by workload)" if "@" in p else "")
        out.append([label] + cells)
    return out


def _condition(row: dict) -> str:
    """What a split result row was run under: a Poisson load, a fleet, or a context length."""
    return next((f"{k} {row[k]}" for k in ("load", "fleet", "context") if k in row), "")


def split_section(doc: dict, name: str) -> str:
    rows = [r for r in split_rows(doc) if r.get("scheduler") and r.get("throughput_tok_s") is not None]
    lines = [f"### Split mode — `{name}` (scenario `{doc.get('scenario')}`)", ""]
    wire = [r for sec in doc["results"] if sec.get("section") == "wire" for r in sec["rows"]]
    if wire:
        lines += ["Hidden states rounded to a 16-bit dtype on the wire vs float32, greedy tokens "
                  "at every cut:", ""]
        lines.append(_md_table([[r["dtype"], r["pairs"],
                                 r["pairs"] - len({(c, p) for c, p, _ in r["differing"]}),
                                 r["differing"] or "none"] for r in wire],
                               ["wire dtype", "(cut, prompt) pairs", "identical to float32",
                                "differing (cut, prompt, first token)"]))
        if not rows:
            return "\n".join(lines)
        lines.append("")
    cols = ["section", "scheduler", "load / fleet / context", "achieved concurrency",
            "throughput tok/s", "mean latency s", "identical to reference"]
    lines.append(_md_table([[r.get("section", r.get("kind", "")), r["scheduler"],
                             r.get("concurrency"), r.get("achieved_concurrency"),
                             r["throughput_tok_s"], r.get("mean_latency_s"),
                             r.get("identical_to_reference")] for r in rows], cols))
    if "recordings_identical_to_transformers" in doc:
        lines += ["", "Reference: every token is checked against recordings of the full model, "
                      "and the recordings against transformers' generate(do_sample=False): "
                      + ("identical." if doc["recordings_identical_to_transformers"] else
                         f"prompts {doc.get('recordings_differing_from_transformers')} differ.")]
    paired = []
    for section in doc["results"]:
        by = {(_condition(r), r.get("scheduler", r.get("variant"))): r
              for r in section.get("rows", []) if r.get("trials")}
        for (cond, s), r in by.items():
            base = by.get((cond, "dsb"))
            if s != "cascade" or base is None or len(r["trials"]) != len(base["trials"]):
                continue
            a_tp = [t["throughput"] for t in r["trials"]]
            b_tp = [t["throughput"] for t in base["trials"]]
            tp = paired_ratio(a_tp, b_tp)
            lat = paired_ratio([t["latency"] for t in r["trials"]],
                               [t["latency"] for t in base["trials"]])
            paired.append([section.get("section"), cond, tp["n"], tp["mean_ratio"],
                           _ci(ratio_ci(a_tp, b_tp)), tp["wins"], lat["mean_ratio"],
                           lat["n"] - lat["wins"]])
    if paired:
        lines += ["", "cascade against dsb trial by trial (each trial's arrivals and prompts are "
                      "the same for both schedulers):", ""]
        lines.append(_md_table(paired, ["section", "condition", "trials", "throughput ratio",
                                        "95 % CI (ratio of means)", "trials won", "latency ratio",
                                        "trials with lower latency"]))
    goals = doc.get("goals") or {}
    if goals:
        lines += ["", "Goals (DySCo Table III / V), at the highest Poisson load:", ""]
        lines.append(_md_table([[k, v[1], v[0], v[2]] for k, v in goals.items()],
                               ["comparison", "target %", "this run %", "Welch t"]))
    at8 = {r["scheduler"]: r["throughput_tok_s"] for r in rows
           if r.get("concurrency") == 8 and r.get("section", "poisson") == "poisson"}
    if at8.get("exact"):
        lines += ["", "Against DySCo Table III at mean concurrency 8, throughput relative to "
                      "exact-match (higher is better):", ""]
        lines.append(_md_table([[s, DYSCO_TPUT.get(s, 0) / DYSCO_TPUT["exact"] if s in DYSCO_TPUT
                                 else None, at8[s] / at8["exact"] if s in at8 else None]
                                for s in ("fifo", "exact", "interleave", "dsb", "cascade")],
                               ["scheduler", "DySCo paper", "Tandem (this run)"]))
    return "\n".join(lines)


def tuner_section(doc: dict, name: str) -> str:
    lines = [f"### Autotuner against grid and random search — `{name}` (scenario "
             f"`{doc.get('scenario')}`, {doc.get('budget')} evaluations each)", "",
             "TPT re-measured at each search's chosen (R1, R2), interleaved, "
             f"{doc.get('repeats')} times over the prompts; `default` is the untuned (0.90, 0.94).",
             ""]
    grid = next((r for r in doc["results"] if r["search"] == "grid"), None)

    def ci(r):   # re-measurements are interleaved rep by rep: paired with grid's by rep
        a, b = r.get("tpt_ms_runs"), (grid or {}).get("tpt_ms_runs")
        if r is grid or not a or not b or len(a) != len(b):
            return None
        return ratio_ci(a, b)
    lines.append(_md_table([[r["search"], r.get("best_r1"), r.get("best_r2"),
                             r.get("best_tpt_ms_in_search"), r.get("tpt_ms"),
                             r.get("tpt_ms_spread"), r.get("vs_grid"), _ci(ci(r)),
                             r.get("identical_to_reference")] for r in doc["results"]],
                           ["search", "R1", "R2", "best in search ms", "re-measured TPT ms",
                            "spread ms (IQR)", "vs grid", "95 % CI (mean ratio, paired)",
                            "identical"]))
    bo = next((r for r in doc["results"] if r["search"] == "bo"), None)
    if bo is not None:
        lines += ["", f"Goal: BO within 10 % of the best grid point after "
                      f"{doc.get('budget')} samples — this run: BO/grid = {_f(bo.get('vs_grid'))} "
                      f"(mean ratio's 95 % CI {_ci(ci(bo))})."]
    return "\n".join(lines)


def runner_section(doc: dict, name: str) -> str:
    lines = [f"### LayerRangeRunner against transformers — `{name}` ({doc.get('threads')} threads, "
             f"scenario `{doc.get('scenario')}`)", "",
             "Median over reps with the range; ratios taken per rep (paired). Goals from the "
             "project's runner targets. Where the run measured its limits (bench/runner_limits.py)"
             ": the bandwidth floor is the bytes a decode step streams over the read bandwidth "
             "measured in the same reps (a GEMV alone in runs before the CPU kernels), and "
             "llama.cpp runs the same weights as an ALL_F32 GGUF.",
             ""]
    lines.append(_md_table([[r["case"], r["median"], r["min"], r["max"], r["unit"], r["goal"]]
                            for r in doc["results"]],
                           ["case", "median", "min", "max", "unit", "goal"]))
    if doc.get("step_products"):
        lines += ["", "Every product of one decode step, by method and rows (median over reps):", "",
                  _md_table([[r["rows"], r["method"], r["ms"], r["GB/s"], r["GFLOP/s"]]
                             for r in doc["step_products"]],
                            ["rows", "method", "ms", "GB/s of weights", "GFLOP/s"])]
    if doc.get("gemm"):
        lines += ["", "LM head 49152x576, ms by method and rows:", "",
                  _md_table([list(g.values()) for g in doc["gemm"]], list(doc["gemm"][0]))]
    return "\n".join(lines)


def defaults_section(doc: dict, name: str) -> str:
    """`tandem bench defaults`: each mode's TPT and TTFT per configuration, ratios with CIs."""
    base = "tuned" if "tuned" in doc.get("configs", []) else doc.get("configs", ["?"])[0]
    rows = []
    for r in doc["results"]:
        rows.append([r["mode"], r["config"], r["n"], _f(r["tpt_ms"]), _f(r["ttft_ms"]),
                     r.get(f"tpt_ms_vs_{base}", ""), r.get(f"ttft_ms_vs_{base}", "")])
    out = [f"{doc.get('max_tokens')} tokens per request, prompts {doc.get('prompts')}, "
           f"{doc.get('repeats')} repeats, configurations interleaved; TPT and TTFT are "
           f"medians, ratios are means over the same (prompt, repeat) pairs / {base}'s with "
           f"95 % bootstrap intervals. planned = what `tandem up` starts (the resource plan), "
           f"tuned = one thread per service pinned (edge core 0, cloud core 1), unplanned = every "
           f"service on every core with library defaults, passive = that with "
           f"OMP_WAIT_POLICY=PASSIVE.", "",
           _md_table(rows, ["mode", "config", "n", "TPT ms", "TTFT ms",
                            f"TPT / {base} [95% CI]", f"TTFT / {base} [95% CI]"])]
    if doc.get("goals"):
        out += ["", "Goals:", ""] + [f"* {g}" for g in doc["goals"]]
    plan = doc.get("plan", {}).get("planned")
    if plan:
        out += ["", "The plan: " + "; ".join(
            f"{n} {p['threads']} thread(s) on cores {','.join(map(str, p['cpus']))}"
            for n, p in plan.items())]
    return "\n".join(out)


def coupling_section(doc: dict, name: str) -> str:
    """`tandem bench coupling`: accepted tokens per round under the two sampling couplings."""
    rows = [[r["policy"], r["pairs"], r["rejection"]["accepted_tokens_per_round"],
             _ci(r["rejection"]["ci95"]), r["gumbel"]["accepted_tokens_per_round"],
             _ci(r["gumbel"]["ci95"]), r["gumbel_over_rejection"], _ci(r["ratio_ci95"])]
            for r in doc["results"]]
    return (f"### Sampling couplings — `{name}`\n\nAccepted draft tokens per verification round "
            "(mean over (prompt, seed) pairs, 95 % bootstrap intervals, the ratio paired), "
            "rejection sampling vs the Gumbel-max coupling.\n\n"
            + _md_table(rows, ["policy", "pairs", "rejection", "95 % CI", "gumbel", "95 % CI",
                               "gumbel / rejection", "95 % CI"]))


def chat_section(doc: dict, name: str) -> str:
    """`tandem bench chat`: TTFT per turn with the cloud's prefix cache on and off."""
    rows = [[r["mode"], r["turn"], r["n"], f"{r['prompt_tokens_mean']:.0f}",
             f"{r['ttft_ms_cache']:.0f}", f"{r['ttft_ms_no_cache']:.0f}", _f(r["ttft_ratio"]),
             _ci(r["ttft_ratio_ci95"]), _f(r["cached_fraction"]), r["same_answers"]]
            for r in doc["results"]]
    out = [f"### Multi-turn chat — `{name}`", "",
           f"{len(doc.get('conversations', []))} conversations of {doc.get('turns')} user turns "
           f"through the gateway, {doc.get('answer_tokens')}-token answers, two alike stacks "
           f"(prefix cache on / off) interleaved; {doc.get('deployment', '')}. TTFT is the "
           "client's time to the first streamed text (median); the ratio is of mean TTFTs over "
           "the same conversations, with a 95 % paired bootstrap interval; cached = the "
           "fraction of the prompt the services reused.", "",
           _md_table(rows, ["mode", "turn", "n", "prompt tokens", "TTFT ms cache",
                            "TTFT ms no cache", "cache / no cache", "95 % CI", "cached",
                            "same answers"])]
    if doc.get("goals"):
        out += ["", "Goals:", ""] + [f"* {g}" for g in doc["goals"]]
    return "\n".join(out)


def kv_section(doc: dict, name: str) -> str:
    """`tandem bench kv`: sessions against the verifier's KV byte budget."""
    rows = [[r["phase"], r["sessions"], r["seconds"], r["served"], r["busy"], r["failed"],
             r["failed_mid_stream"], r["busy_answers"],
             f"{r['checked_against_transformers'] - r['wrong']}/{r['checked_against_transformers']}",
             r["rss_peak_mib"]] for r in doc["results"]]
    out = [f"### KV memory under pressure — `{name}`", "",
           f"{doc.get('sessions')} sessions of {doc.get('prompt_tokens')}-token prompts against a "
           f"{doc.get('budget_bytes', 0) / 2**30:.2f} GiB KV budget ({doc.get('deployment', '')}); "
           f"verifier RSS idle {doc.get('rss_idle_mib')} MiB, bound {doc.get('rss_bound_mib')} "
           "MiB (idle + budget, plus 15 %).", "",
           _md_table(rows, ["phase", "sessions", "s", "served", "busy", "failed",
                            "failed mid-stream", "busy answers", "exact (checked)",
                            "RSS peak MiB"])]
    if doc.get("goals"):
        out += ["", "Goals:", ""] + [f"* {g}" for g in doc["goals"]]
    return "\n".join(out)


def resume_section(doc: dict, name: str) -> str:
    """`tandem bench resume`: SIGKILL of a process mid-stream under the supervisor, per kind."""
    rows = [[r["kind"], r["n"], r.get("restarts"), r["completed"], r["exact"], r["pause_s_median"],
             r["pause_s_max"], r["restart_s_median"], r["restart_s_max"],
             r["pause_within_restart_plus_2s"],
             r["resumes"], r["replays"],
             ", ".join(f"{n} {w}" for w, n in r["landed"].items() if n)]
            for r in doc["results"]]
    out = [f"### kill -9 mid-stream under the supervisor — `{name}`", "",
           f"{doc.get('trials_per_kind')} trials per kind, {doc.get('tokens')} tokens per request, "
           f"one at a time on the stack `tandem up` starts (every service and the gateway, "
           f"supervised: restarted 1 s after it dies). Each trial streams one request through "
           f"the SDK or the gateway (`openai` client), greedy or seeded sampling, and sends "
           f"SIGKILL to the process at a point drawn from a seeded RNG (during the prefill, or "
           f"after k tokens plus a random delay). Pause: the largest gap between two token "
           f"arrivals the client saw; restart: SIGKILL to the new process answering /readyz; "
           f"restarts: the supervisor's, one per kill unless a restarted run died again. "
           f"Exact: greedy output equal to transformers' generate(do_sample=False), seeded "
           f"output equal to the uninterrupted run with the same seed; token ids through the "
           f"SDK, text through the gateway. Resumes: continuations the SDK or gateway sent "
           f"after losing its dispatcher; replays: sessions the dispatcher rebuilt.", "",
           _md_table(rows, ["kind", "n", "restarts", "completed", "exact", "pause s median", "pause s worst",
                            "restart s median", "restart s worst", "pause <= restart + 2 s",
                            "resumes", "replays", "kill landed"])]
    if doc.get("goals"):
        out += ["", "Goals:", ""] + [f"* {g}" for g in doc["goals"]]
    return "\n".join(out)


def constraint_section(doc: dict, name: str) -> str:
    """`tandem bench constraint`: SchemaStore schemas in every mode."""
    rows = [[r["mode"], "yes" if r["constrained"] else "no", r["generated"],
             _f(r["finished_fraction"]), f"{_f(r['valid_fraction'])} of {r['validated']}",
             _f(r["same_as_cloud_only"]), _f(r.get("acceptance_mean")), f"{r['tokens_mean']:.0f}",
             f"{r['seconds_mean']:.1f}"] for r in doc["results"]]
    c, m = doc.get("compile", {}), doc.get("mask_cost", {})
    out = [f"### Structured output on SchemaStore — `{name}`", "",
           f"{doc.get('schemas')} schemas drawn from the {c.get('schemas')} in the `schemastore` "
           f"package's cache ({c.get('compiled')} compile with llguidance; median compile "
           f"{1e3 * c.get('compile_s_median', 0):.1f} ms), one greedy answer of at most "
           f"{doc.get('max_tokens')} tokens per schema and mode, modes interleaved schema by "
           f"schema; {doc.get('deployment', '')}. Finished: EOS before the limit. Valid: finished "
           "outputs that validate with `jsonschema` (of those it can decide: a remote `$ref` it "
           "cannot). Same: token for token equal to cloud-only's answer. `spec-free` is pipesd "
           "on the same prompts without the schema. Mask cost per token: median "
           f"{m.get('mask_us_median', 0):.0f} µs, p95 {m.get('mask_us_p95', 0):.0f} µs over "
           f"{m.get('tokens')} tokens.", "",
           _md_table(rows, ["mode", "schema", "n", "finished", "valid", "same as cloud-only",
                            "acceptance", "tokens", "s per answer"])]
    if doc.get("goals"):
        out += ["", "Goals:", ""] + [f"* {g}" for g in doc["goals"]]
    return "\n".join(out)


def generic_section(doc: dict, name: str) -> str:
    return (f"### {doc['bench']} — `{name}`\n\n```json\n"
            + json.dumps(doc["results"], indent=1, default=str)[:6000] + "\n```")


def main(argv=None) -> int:
    files = sorted(RESULTS.glob("*.json"))
    if not files:
        print(f"no benchmark JSON in {RESULTS}; run e.g. "
              f"`tandem bench spec --quick --json {RESULTS}/spec_s1.json`", file=sys.stderr)
        return 1
    img = ROOT / "docs" / "img"
    parts = ["# Benchmarks", "",
             "Generated by `python -m bench.results_page` from the JSON files in `docs/results/`; "
             "every number below was printed by the benchmark command recorded with it. "
             "Machine: see each file's `machine` field.", "",
             "How to read it. Method (bench/report.py, each bench's docstring): warm-up first, "
             "conditions interleaved or in randomised order, services pinned to cores, every "
             "output compared with transformers' generate(do_sample=False). The speculative "
             "runs measure a real workload (HumanEval by default) on test prompts "
             "held apart from the tuning prompts on which every policy with knobs was tuned by "
             "the same BO with the same budget; every ratio there carries a 95 % bootstrap "
             "interval over the test prompts (paired), and every policy is compared with a "
             "clairvoyant bound computed from its own trace (bench/bound.py). Older sections "
             "(split, tuner, runner) report medians with the IQR and Welch's t (|t| > 2.5, the "
             "DySCo paper's criterion). Earlier speculative runs (3 hand-written prompts, only "
             "pipesd tuned, an `oracle` policy taken for a bound) are kept in "
             "`docs/results/archive/` and no longer shown. On this 2-core CPU machine the bundled "
             "speculative target and drafter are the same 135M model (fp32 in torch vs Q4 in "
             "llama.cpp), so a target forward costs about as much as a draft step: speculative "
             "mode cannot beat cloud-only there. Gemma 3 270M's Q4 drafter is much cheaper than "
             "its fp32 target, and there speculation pays. The `auto_*` runs (the dispatcher "
             "choosing the mode per request, with and without a time-per-token target) are on "
             "today's code; every speculative run models the edge (drafter + dispatcher) and "
             "the cloud (verifier) on one core each of one box, over the emulated link. What "
             "carries over to a GPU cloud: the cloud work per token each mode asks for and the "
             "policies' comparison with each other; not the absolute times, nor which mode is "
             "fastest, since a GPU verifier's step is far shorter than this CPU's. In split "
             "mode the cloud is one CPU core, where batching gains less than on a GPU, so "
             "FIFO's handicap is smaller than in DySCo's tables. "
             "`tandem bench spec|split|tuner|overhead|defaults --quick` runs a small version "
             "of each (tests/integration/test_bench.py and test_bench_modes.py run them in "
             "CI).", ""]
    for f in files:
        doc = json.loads(f.read_text())
        m = doc.get("machine", {})
        parts += [f"## `{f.name}`", "",
                  f"Command: `{doc.get('command', 'tandem bench ' + doc['bench'])}` — "
                  f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('date', '?')}", ""]
        if doc.get("note"):
            parts += [f"Note: {doc['note']}", ""]
        section = {"spec": spec_section, "split": split_section,
                   "tuner": tuner_section, "runner": runner_section,
                   "defaults": defaults_section,
                   "coupling": coupling_section, "chat": chat_section,
                   "kv": kv_section, "constraint": constraint_section,
                   "resume": resume_section}.get(doc["bench"], generic_section)
        parts += [section(doc, f.stem), ""]
        drawable = doc["bench"] != "split" or any(
            r.get("throughput_tok_s") is not None for r in split_rows(doc))
        if doc["bench"] in ("spec", "split", "overhead", "tuner", "defaults") and drawable:
            png = plot(doc, img / f"{f.stem}.png")
            parts += [f"![{f.stem}](img/{png.name})", ""]
    PAGE.write_text("\n".join(parts))
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
