"""The benchmarks run green from a clean checkout (`tandem bench ... --quick`), write the JSON
shape the results page reads (issue #5's field names) and a plot, and every output they checked
was identical to the reference.  Slow: each starts its own services; together a few minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import results_page

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def bench(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "bench", name, "--quick", *args,
                        "--plot", str(tmp_path / f"{name}.png")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"bench {name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    doc = json.loads(out.read_text())
    assert {"bench", "scenario", "machine", "results"} <= set(doc)
    assert doc["machine"]["versions"]["torch"] and doc["command"]
    return doc


def test_bench_spec_quick(tmp_path):
    # pipesd@R1:R2 is pipesd held at fixed thresholds (what --grid adds)
    doc = bench(tmp_path, "spec", "--policies",
                "cloud-only,vanilla,pipesd,pipesd-stream,pipesd@0.15:0.4", "--uplink", "20,80")
    rows = doc["results"]
    assert {(r["uplink_mbit"], r["policy"]) for r in rows} == {
        (u, p) for u in (20.0, 80.0)
        for p in ("cloud-only", "vanilla", "pipesd", "pipesd-stream", "pipesd@0.15:0.4")}
    for r in rows:
        assert {"policy", "tpt_ms", "tpt_ms_spread", "acceptance_rate", "cloud_forwards_per_token",
                "identical_to_reference"} <= set(r)
        assert r["identical_to_reference"] is True and r["tpt_ms"] > 0
    assert "pipesd" in results_page.spec_section(doc, "spec")


def test_bench_tuner_quick(tmp_path):
    doc = bench(tmp_path, "tuner", "--budget", "4")
    by = {r["search"]: r for r in doc["results"]}
    assert set(by) == {"grid", "random", "bo", "default"}
    for name in ("grid", "random", "bo"):
        assert by[name]["evaluations"] == 4 and len(by[name]["trace_ms"]) == 4
    assert all(r["identical_to_reference"] and r["tpt_ms"] > 0 for r in by.values())
    assert "re-measured" in results_page.tuner_section(doc, "tuner")


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
    hand-set and the unplanned configurations, and reports every mode for each, with ratios and
    intervals (a report, not a timed assertion)."""
    doc = bench(tmp_path, "defaults")
    rows = doc["results"]
    assert {(r["mode"], r["config"]) for r in rows} == {
        (m, c) for m in ("spec", "split", "cloud-only") for c in ("planned", "tuned", "unplanned")}
    for r in rows:
        assert r["tpt_ms"] > 0 and r["ttft_ms"] > 0 and r["n"] == 2
        if r["config"] != "tuned":
            lo, hi = r["tpt_ms_ratio_ci"]
            assert r["tpt_ms_ratio"] > 0 and (lo != lo or lo <= hi)   # NaN or an interval
    assert set(doc["plan"]) == {"planned"}
    assert {"threads", "cpus", "env"} <= set(doc["plan"]["planned"]["verifier"])
    assert len(doc["goals"]) == 4
    assert "planned" in results_page.defaults_section(doc, "defaults")
