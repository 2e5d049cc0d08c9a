"""The benchmarks' pure summaries (bench/report.py, the results page's tables, bench spec's policy
names), on hand-made rows: fast, no services."""

from __future__ import annotations

import math

import pytest

from bench import report, results_page
from bench.bench_spec import fixed_policy, parse_policy

# (median, workload) TPT in ms per policy; the best baseline is vanilla by median (36) and
# edgellm by workload (38); the fixed-threshold rows are a `bench spec --grid` run's.
TPT = {"vanilla": (36.0, 40.0), "hsl": (46.0, 47.0), "edgellm": (38.0, 38.0),
       "oracle-trigger": (30.0, 32.0), "pipesd": (34.0, 35.0),
       "pipesd@0.15:0.4": (33.0, 34.0), "pipesd@0.5:0.8": (38.0, 33.0)}
ROWS = [{"policy": p, "tpt_ms": m, "tpt_ms_workload": w} for p, (m, w) in TPT.items()]


def test_headroom_compares_each_policy_with_the_best_baseline_of_that_figure():
    by_median = report.headroom(ROWS)
    assert by_median[0] == "best baseline by tpt_ms: vanilla, 36.0 ms"
    assert "best baseline / oracle-trigger: 1.200x  (a perfect trigger)" in by_median
    assert "best baseline / pipesd: 1.059x" in by_median
    # the grid's best point by median is pipesd@0.15:0.4 (33 ms)
    assert "best baseline / pipesd@0.15:0.4: 1.091x  (the best of 2 fixed (R1, R2))" in by_median
    by_workload = report.headroom(ROWS, "tpt_ms_workload")
    assert by_workload[0] == "best baseline by tpt_ms_workload: edgellm, 38.0 ms"
    # ... and by workload pipesd@0.5:0.8 (33 ms)
    assert "best baseline / pipesd@0.5:0.8: 1.152x  (the best of 2 fixed (R1, R2))" in by_workload


def test_headroom_needs_all_three_baselines():
    assert report.headroom([r for r in ROWS if r["policy"] != "hsl"]) == []


def test_results_page_headroom_table():
    rows = results_page._headroom_rows(ROWS)
    assert [r[0] for r in rows] == ["oracle-trigger", "pipesd",
                                    "pipesd@0.5:0.8 (the grid's best fixed R1:R2 by workload)"]
    assert rows[0][1:] == pytest.approx([36 / 30, 38 / 32])
    assert rows[2][1:] == pytest.approx([36 / 38, 38 / 33])
    section = results_page.spec_section({"results": ROWS, "scenario": "s1"}, "spec_s1_grid")
    assert "Headroom" in section and "1.2 | 1.19" in section


def test_fixed_threshold_policy_names_round_trip():
    assert fixed_policy(1e-6, 0.2) == "pipesd@1e-06:0.2"
    assert parse_policy(fixed_policy(1e-6, 0.2)) == ("pipesd", (1e-6, 0.2))
    assert parse_policy("edgellm") == ("edgellm", None)
    for bad in ("pipesd@0.1", "pipesd@x:0.2", "pipesd@0.1:0.2:0.3", "pipesd@0:0.5",
                "pipesd@0.5:1.5", "vanilla@0.1:0.2"):
        with pytest.raises(ValueError, match="pipesd|R1"):
            parse_policy(bad)


def test_bench_spec_refuses_a_bad_policy_name_before_starting_anything(capsys):
    from bench import bench_spec
    with pytest.raises(SystemExit) as e:
        bench_spec.main(["--policies", "vanilla,pipesd@0.1"])
    assert e.value.code == 2 and "@R1:R2" in capsys.readouterr().err


def test_paired_ratio():
    r = report.paired_ratio([2.0, 2.2, 1.8, 2.0], [1.0, 1.0, 1.0, 1.0])
    assert r["n"] == 4 and r["wins"] == 4 and r["mean_ratio"] == pytest.approx(2.0)
    assert r["t"] > 2.5
    one = report.paired_ratio([3.0], [2.0])
    assert one["mean_ratio"] == 1.5 and math.isnan(one["t"])


def synthetic_runs():
    """Per policy, 6 prompts' requests; pipesd 20 % faster than vanilla on every prompt."""
    import random
    rng = random.Random(0)
    base = {f"P{i}": rng.uniform(30, 50) for i in range(6)}
    speed = {"cloud-only": 0.7, "vanilla": 1.0, "hsl": 1.3, "edgellm": 1.1, "pipesd": 1 / 1.2}
    runs = {}
    for p, f in speed.items():
        runs[p] = [{"prompt": k, "tpt_s": b * f * (1 + rng.uniform(-0.01, 0.01)) / 1000,
                    "identical": True, "cloud_s_per_token": 0.01, "edge_cpu_s_per_token": 0.02,
                    "acceptance_rate": 0.5, "tokens": 16} for k, b in base.items()]
        for x in runs[p]:
            x["tpot_s"] = x["tpt_s"]
    return runs, list(base), {k: b * 0.5 for k, b in base.items()}


def test_policy_rows_pair_prompts_and_carry_intervals():
    from bench.bench_spec import policy_rows
    runs, names, bound_ms = synthetic_runs()
    tuned = {"vanilla": {"knobs": {"n": 4}, "how": "BO"}}
    rows = policy_rows(runs, names, bound_ms, tuned)
    by = {r["policy"]: r for r in rows}
    assert by["pipesd"]["best_baseline"] == "vanilla"
    assert by["pipesd"]["vs_best_baseline"] == pytest.approx(1.2, rel=0.02)
    lo, hi = by["pipesd"]["vs_best_baseline_ci95"]
    assert lo <= by["pipesd"]["vs_best_baseline"] <= hi and lo > 1.1 and hi < 1.3
    assert by["vanilla"]["tuned_params"] == tuned["vanilla"]
    assert by["hsl"]["tuned_params"]["knobs"] is None
    for r in rows:
        assert r["tpt_over_bound"] > 1 and r["bound_violations"] == 0
        assert r["ci95"][0] <= r["tpt_ms"] <= r["ci95"][1]
    section = results_page.spec_section(
        {"results": rows, "workload": "humaneval", "scenario": "s1", "test_prompts": names,
         "tuning_prompts": ["T"], "tuned": True, "tune_budget": 16, "tune_window": 4,
         "bound": {"rtt_s": 0.05, "verify_s": [0.02, 0.03]}}, "spec_s1")
    assert "pipesd over the best tuned baseline (vanilla)" in section
    assert "| 1.203x [1.2, 1.21] | met |" in section


def test_policy_rows_flag_a_run_under_the_bound():
    from bench.bench_spec import policy_rows
    runs, names, bound_ms = synthetic_runs()
    bound_ms[names[0]] = 1000.0   # no request could be that slow: every policy "beats" it
    rows = policy_rows(runs, names, bound_ms, {})
    assert all(r["bound_violations"] == 1 and r["tpt_over_bound_min"] < 1 for r in rows)


def test_a_checkpoint_summarizes_only_prompts_every_policy_finished():
    """A long run saves its JSON as it goes: a prompt that some policy has not yet measured
    is left out of every row, so the rows stay paired; the page marks the run partial."""
    from bench.bench_spec import summarize
    runs, names, _ = synthetic_runs()
    runs["pipesd"] = [x for x in runs["pipesd"] if x["prompt"] != names[-1]]
    for rs in runs.values():
        for x in rs:
            x.update(gamma_s=0.01, alpha_s=0.005, beta_s=0.005)
    policies = list(runs)
    matches = {k: [True, False] * 8 for k in names}
    rows, violations, parts = summarize({(None, p): runs[p] for p in policies}, [None], policies,
                                        names, matches, 16, 0.05, [0.02, 0.021, 0.022], {})
    assert len(parts) == 1 and len(rows) == len(policies)
    for r in rows:
        assert list(r["tpt_ms_by_prompt"]) == names[:-1]
    doc = {"results": rows, "workload": "humaneval", "scenario": "s1", "test_prompts": names,
           "tuning_prompts": ["T"], "tuned": False, "partial": {"test_prompts_finished": 5,
                                                                "of": 6},
           "bound": {"rtt_s": 0.05, "verify_s": [0.02]}}
    assert "**Partial run**: it stopped after 5 of 6 test prompts" in \
        results_page.spec_section(doc, "spec_s1")


def test_the_page_judges_token_trees_goals_from_the_same_run():
    """The goals: tree against pipesd and the best chain policy (paired), and
    pipesd-learned against the bound, each with its target and a met / NOT met verdict."""
    from bench.bench_spec import policy_rows
    runs, names, bound_ms = synthetic_runs()
    runs["tree"] = [dict(x, tpt_s=x["tpt_s"] / 1.3 * (1 + 0.002 * (i % 3 - 1)))
                    for i, x in enumerate(runs["pipesd"])]
    runs["pipesd-learned"] = [dict(x, tpt_s=x["tpt_s"] * (1 + 0.003 * (i % 2)))
                              for i, x in enumerate(runs["pipesd"])]
    for p, (acc, rounds) in {"pipesd": (2, 1), "tree": (5, 1)}.items():
        for x in runs[p]:
            x.update(accepted_tokens=acc, rounds=rounds)
    by = {r["policy"]: r for r in policy_rows(runs, names, bound_ms, {})}
    goals = {g[0]: g for g in results_page.token_tree_goals(by)}
    assert goals["accepted tokens per round, tree over pipesd"][3] == "met"      # 2.5x
    assert goals["TPT, tree over pipesd"][2].startswith("1.30")
    assert goals["TPT, tree over pipesd"][3] == "met"
    best = goals["TPT, tree over the best chain policy (pipesd)"]                # 1.3x, tight CI
    assert best[3] == "met"
    learned = goals["pipesd-learned TPT over the clairvoyant chain bound"]      # bound is half
    assert learned[3] == "NOT met" and learned[2].startswith("1.6")
    assert results_page.token_tree_goals({"pipesd": by["pipesd"]}) == []


def test_bench_resume_plans_varied_kill_points_from_its_seed():
    from bench.bench_resume import KINDS, plan_trials
    trials = plan_trials(10, 64, seed=0)
    assert trials == plan_trials(10, 64, seed=0)          # the same seed, the same kills
    assert len(trials) == 10 * len(KINDS)
    for victim, mode in KINDS:
        mine = [t for t in trials if (t.victim, t.mode) == (victim, mode)]
        assert {t.client for t in mine} == {"sdk", "gateway"}
        assert {t.seed is None for t in mine} == {True, False}
        assert all(0 <= t.after_tokens <= 48 for t in mine)
    assert any(t.after_tokens == 0 for t in trials)       # aimed at the prefill
    assert len({t.after_tokens for t in trials}) > 10     # and all along the stream


def test_bench_resume_summary_goals_and_section():
    from bench.bench_resume import goals, summarize
    row = {"client": "sdk", "sampling": "greedy", "prompt": 0, "aimed_at": "after 5 tokens",
           "tokens_before_kill": 5, "landed": "stream", "died": True, "restarted": True,
           "restarts": 1, "resumes": 1, "replays": 0.0, "completed": True, "tokens": 64, "exact": True,
           "no_duplicate_or_gap": True, "wall_s": 9.0, "error": "", "notes": []}
    rows = [{**row, "kind": "dispatcher/cloud-only", "restart_s": 4.0, "pause_s": 4.5,
             "pause_minus_restart_s": 0.5},
            {**row, "kind": "dispatcher/cloud-only", "restart_s": 5.0, "pause_s": 7.5,
             "pause_minus_restart_s": 2.5, "landed": "prefill", "tokens_before_kill": 0},
            {**row, "kind": "drafter/spec", "restart_s": 2.0, "pause_s": 3.0,
             "pause_minus_restart_s": 1.0, "exact": False, "resumes": 0}]
    kinds = summarize(rows)
    assert [k["kind"] for k in kinds] == ["dispatcher/cloud-only", "drafter/spec"]
    d = kinds[0]
    assert (d["n"], d["completed"], d["exact"], d["pause_within_restart_plus_2s"]) == (2, 2, 2, 1)
    assert (d["pause_s_max"], d["restart_s_median"], d["resumes"]) == (7.5, 4.5, 2)
    assert d["landed"] == {"prefill": 1, "stream": 1, "after the end": 0}
    lines = goals(kinds, rows, per_kind=2)
    assert lines[0].startswith("dispatcher kill -9s: 2/2") and lines[0].endswith("not met")
    assert "worst 2.50 s" in lines[1] and lines[1].endswith("not met")
    assert lines[-1] == "drafter/spec kill -9s: 0/1 complete exactly: not met"
    page = results_page.resume_section({"results": kinds, "goals": lines, "tokens": 64,
                                        "trials_per_kind": 2}, "resume")
    assert "| dispatcher/cloud-only | 2 | 2 | 2 | 2 |" in page and lines[1] in page


def auto_runs():
    """synthetic_runs plus auto, 3 % slower than cloud-only with the same first token, and
    auto-slo, which met a 1.25x-cloud-only target on its decode pace (TPOT) on 5 of 6 prompts at
    40 % of its cloud work; on one of those its TPT, first token counted, is over the target."""
    runs, names, bound_ms = synthetic_runs()
    cloud = {x["prompt"]: x for x in runs["cloud-only"]}
    for x in runs["cloud-only"]:
        x["ttft_s"] = 0.1
    runs["auto"] = [{**x, "tpt_s": x["tpt_s"] * 1.03, "ttft_s": 0.1} for x in runs["cloud-only"]]
    runs["auto-slo"] = [{**cloud[k], "tpot_s": cloud[k]["tpt_s"] * (1.2 if i else 3.0),
                         "tpt_s": cloud[k]["tpt_s"] * (1.2 if i > 1 else 3.0),
                         "cloud_s_per_token": 0.004, "ttft_s": 0.1,
                         "segments": [{"policy": "pipesd", "tokens": 16}]}
                        for i, k in enumerate(names)]
    return runs, names, bound_ms


def test_auto_goals_judge_auto_against_the_best_fixed_choice_and_cloud_only():
    from bench.bench_spec import policy_rows
    runs, names, bound_ms = auto_runs()
    slo_ms = 1.25 * max(x["tpt_s"] for x in runs["cloud-only"]) * 1000
    rows = policy_rows(runs, names, bound_ms, {}, slo_ms)
    by = {r["policy"]: r for r in rows}
    assert by["auto-slo"]["slo_met"] == "5/6" and by["auto-slo"]["auto_token_share"] == {
        "pipesd": 1.0}
    assert by["auto-slo"]["cloud_vs_cloud_only"] == pytest.approx(0.4)
    assert by["auto"]["ttft_vs_cloud_only"] == pytest.approx(1.0)
    goals = {g[0].split(" (")[0]: g for g in report.auto_goals(rows)}
    # cloud-only is the fastest fixed choice (0.7x vanilla): auto is 1.03x it, on every prompt
    best = goals["auto TPT / best fixed"]
    assert "(cloud-only)" in best[0] and best[2].startswith("1.030") and best[3] == "met"
    # ... but the interval of auto over cloud-only lies above 1.02: not met
    assert goals["auto TPT / cloud-only"][3] == "NOT met"
    assert goals["auto first token / cloud-only's"][3] == "met"
    slo = next(g for name, g in goals.items() if name.startswith("auto-slo requests"))
    assert slo[2] == "5/6 (83%)" and slo[3] == "NOT met"
    # pipesd met the target on every prompt, so auto-slo's cloud work is judged: 0.4 <= 0.6
    work = goals["auto-slo cloud CPU per token / cloud-only's"]
    assert work[2].startswith("0.400") and work[3] == "met"
    # where no fixed speculative policy meets the target on 95 % of its requests, it is not
    slow = {p: [{**x, "tpt_s": 1.0, "tpot_s": 1.0} for x in rs] if p in ("vanilla", "hsl", "edgellm", "pipesd")
            else rs for p, rs in runs.items()}
    work = report.auto_goals(policy_rows(slow, names, bound_ms, {}, slo_ms))[-1]
    assert work[3] == "no speculative policy meets the target here"
    section = results_page.spec_section(
        {"results": rows, "workload": "mtbench", "scenario": "s1", "test_prompts": names,
         "tuning_prompts": ["T"], "tuned": True, "tune_budget": 8, "tune_window": 2,
         "bound": {"rtt_s": 0.05, "verify_s": [0.02, 0.03]}}, "auto")
    assert "| auto first token / cloud-only's | <= 1.1 | 1.000 [1, 1] | met |" in section


def test_the_bound_allows_cloud_only_its_own_time():
    """The bound's cloud run pays α + the round trip + n decode steps; the decode step is
    scaled to cloud-only's fastest prompt less both, so cloud-only never measures under it
    (scaling by the round trip alone put it 0.2 % under when α > 0)."""
    from bench.bench_spec import summarize
    runs, names, _ = synthetic_runs()
    for p, rs in runs.items():
        for x in rs:
            x.update(gamma_s=0.03, alpha_s=0.004, beta_s=0.0001) if p != "cloud-only" else None
    matches = {k: [False] * 16 for k in names}   # nothing to speculate: the cloud run is best
    rows, violations, _ = summarize({(None, p): runs[p] for p in runs}, [None], list(runs),
                                    names, matches, 16, 0.05, [1.0, 1.1], {})
    assert violations == []
    cloud = next(r for r in rows if r["policy"] == "cloud-only")
    assert cloud["tpt_over_bound_min"] == pytest.approx(1.0) and cloud["bound_violations"] == 0
