"""The split, overhead and defaults benchmarks run green from a clean checkout (`tandem bench
split|overhead|defaults --quick`), write the JSON shape the results page reads and a plot, and
every output they checked was identical to the reference. Slow: each starts its own services."""

from __future__ import annotations

import pytest

from bench import results_page
from tests._bench import bench

pytestmark = pytest.mark.slow


def test_bench_split_quick(tmp_path):
    doc = bench(tmp_path, "split", "--sections", "poisson", "--loads", "2",
                "--schedulers", "fifo,dsb,cascade")
    rows = [r for part in doc["results"] for r in part["rows"]]
    assert {r["scheduler"] for r in rows} == {"fifo", "dsb", "cascade"}
    for r in rows:
        assert {"scheduler", "concurrency", "throughput_tok_s", "mean_latency_s",
                "identical_to_reference"} <= set(r)
        assert r["identical_to_reference"] is True and r["throughput_tok_s"] > 0
    assert "cascade" in results_page.split_section(doc, "split")


def test_bench_overhead_quick(tmp_path):
    doc = bench(tmp_path, "overhead")
    kinds = {r.get("kind") for r in doc["results"]}
    assert {"transport", "e2e", "gateway_vs_sdk"} <= kinds


def test_bench_defaults_quick(tmp_path):
    """`tandem bench defaults --quick` runs the stack as `tandem up` plans it next to the
    hand-set configuration (the full run adds the unplanned one), and reports every mode for
    each, with ratios and intervals (a report, not a timed assertion)."""
    doc = bench(tmp_path, "defaults")
    rows = doc["results"]
    assert {(r["mode"], r["config"]) for r in rows} == {
        (m, c) for m in ("spec", "split", "cloud-only") for c in ("planned", "tuned")}
    for r in rows:
        assert r["tpt_ms"] > 0 and r["ttft_ms"] > 0 and r["n"] == 2
        if r["config"] != "tuned":
            lo, hi = r["tpt_ms_ratio_ci"]
            assert r["tpt_ms_ratio"] > 0 and (lo != lo or lo <= hi)   # NaN or an interval
    assert set(doc["plan"]) == {"planned"}
    assert {"threads", "cpus", "env"} <= set(doc["plan"]["planned"]["verifier"])
    assert len(doc["goals"]) == 4
    assert "planned" in results_page.defaults_section(doc, "defaults")
