"""The speculative benchmark and the tuner run green from a clean checkout (`tandem bench spec|tuner
--quick`), write the JSON shape the results page reads (the field names) and a plot, and every
output they checked was identical to the reference. Slow: each starts its own services. The
other benches: test_bench_modes.py (a module each way, so the two xdist workers share them)."""

from __future__ import annotations

import pytest

from bench import results_page
from tests._bench import bench

pytestmark = pytest.mark.slow


SPEC_FIELDS = {"policy", "tpt_ms", "ci95", "tuned_params", "tpt_over_bound", "cloud_s_per_token",
               "edge_cpu_s_per_token", "identical_to_reference"}


def test_bench_spec_quick(tmp_path):
    """The shape: HumanEval split into tuning and test prompts, every knobbed policy
    tuned by the same BO with the same budget on the tuning prompts only, every row with its
    interval, its knobs, its TPT over the clairvoyant bound (>= 1), cloud seconds and edge
    CPU-seconds per token, and outputs identical to transformers'. Every evaluation has its
    control (the default knobs on its prompts), and every request paid its prompt: the policies
    run each prompt back to back, and the drafter reused none of one request's prompt KV in
    another."""
    # cloud-only, two knobbed policies tuned in lockstep, and auto with and without a target:
    # every path of the bench (the other policies' knob spaces: tests/unit/test_bench_tuning.py)
    doc = bench(tmp_path, "spec", "--workload", "humaneval",
                "--policies", "cloud-only,edgellm,pipesd,auto,auto-slo")
    assert doc["workload"] == "humaneval" and doc["tuned"] is True
    assert doc["drafter_prompt_tokens"]["hit"] == 0 and doc["drafter_prompt_tokens"]["miss"] > 0
    assert len(doc["test_prompts"]) == 2 and doc["tuning_prompts"]
    assert not set(doc["test_prompts"]) & set(doc["tuning_prompts"])
    rows = doc["results"]
    assert {r["policy"] for r in rows} == {"cloud-only", "edgellm", "pipesd", "auto", "auto-slo"}
    by = {r["policy"]: r for r in rows}
    for r in rows:
        assert SPEC_FIELDS <= set(r), SPEC_FIELDS - set(r)
        assert r["identical_to_reference"] is True and r["tpt_ms"] > 0
        lo, hi = r["ci95"]
        assert lo <= r["tpt_ms"] <= hi
        assert r["tpt_over_bound"] >= 1.0 and r["bound_violations"] == 0, r
        # /proc counts CPU time in 10 ms ticks: cloud-only's dispatcher may stay under one
        assert r["cloud_s_per_token"] > 0 and r["edge_cpu_s_per_token"] >= 0
        if r["policy"] != "cloud-only":
            assert r["edge_cpu_s_per_token"] > 0   # the drafter works
        knobs = r["tuned_params"]["knobs"]
        if r["policy"] == "cloud-only":
            assert knobs is None
        elif r["policy"] in ("auto", "auto-slo"):
            # pipesd's knobs, and as many tuning requests as a BO ran
            assert knobs == by["pipesd"]["tuned_params"]["knobs"]
            assert r["tuned_params"]["warm_requests"] == 3
            share = r["auto_token_share"]
            assert share and sum(share.values()) == pytest.approx(1.0)
        else:   # the same BO budget for every knobbed policy
            evals = r["tuned_params"]["evaluations"]
            assert len(evals) == doc["tune_budget"] == 3
            assert all(e["control_ms"] > 0 for e in evals)
            assert knobs in [e["knobs"] for e in evals]
        if r["policy"] != "cloud-only":   # paired with cloud-only's, prompt by prompt
            assert r["ttft_vs_cloud_only_ci95"] and r["cloud_vs_cloud_only_ci95"]
        # auto-slo's target, set on a tuning prompt, and every row's count of requests within it
        assert r["slo_ms"] == by["auto-slo"]["tuned_params"]["tpt_slo_ms"] > 0
        assert r["slo_met"].endswith("/2")
    section = results_page.spec_section(doc, "spec")
    assert "pipesd" in section and "auto-slo cloud CPU per token" in section


def test_bench_tuner_quick(tmp_path):
    doc = bench(tmp_path, "tuner", "--budget", "4")
    by = {r["search"]: r for r in doc["results"]}
    assert set(by) == {"grid", "random", "bo", "default"}
    for name in ("grid", "random", "bo"):
        assert by[name]["evaluations"] == 4 and len(by[name]["trace_ms"]) == 4
    assert all(r["identical_to_reference"] and r["tpt_ms"] > 0 for r in by.values())
    assert "re-measured" in results_page.tuner_section(doc, "tuner")
