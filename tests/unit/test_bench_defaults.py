"""`tandem bench defaults`' report helpers (bench/bench_defaults.py), without services: ratios
with bootstrap intervals, one row per (mode, configuration), the goal lines."""

from __future__ import annotations

import math

import pytest

from bench import bench_defaults as bd


def runs(tpt: list[float], ttft: float = 100.0, tokens=(1, 2, 3)):
    return [{"key": ("chat", i), "tpt_ms": t, "ttft_ms": ttft, "tokens": list(tokens)}
            for i, t in enumerate(tpt)]


def test_ratio_ci_brackets_the_ratio_of_means():
    a = [52.0, 55.0, 50.0, 53.0, 54.0, 51.0]
    b = [50.0, 50.5, 49.0, 51.0, 52.0, 50.0]
    point, lo, hi = bd.ratio_ci(a, b)
    assert point == pytest.approx(sum(a) / sum(b))
    assert lo <= point <= hi and 1.0 < lo < hi < 1.1
    assert math.isnan(bd.ratio_ci([2.0], [1.0])[1])           # one pair: no interval
    point, lo, hi = bd.ratio_ci([2.0, 2.0], [1.0, 1.0])       # no spread: degenerate, no crash
    assert point == 2.0


def test_rows_and_goals():
    samples = {("planned", "spec"): runs([50, 52, 51], ttft=150),
               ("tuned", "spec"): runs([70, 72, 71], ttft=200),
               ("unplanned", "spec"): runs([48, 49, 50], tokens=(1, 2, 4)),
               ("planned", "cloud-only"): runs([40, 41, 42], ttft=60),
               ("tuned", "cloud-only"): runs([40, 40, 40], ttft=60)}
    rows = bd.result_rows(samples, ["planned", "tuned", "unplanned"], ["spec", "cloud-only"])
    by = {(r["mode"], r["config"]): r for r in rows}
    assert len(rows) == 5 and by["spec", "planned"]["tpt_ms"] == 51
    assert by["spec", "planned"]["tpt_ms_ratio"] == pytest.approx(153 / 213)
    assert by["spec", "planned"]["tpt_ms_vs_tuned"].startswith("0.72 [")
    assert by["spec", "unplanned"]["identical_to_tuned"] is False
    assert by["spec", "planned"]["identical_to_tuned"] is True
    assert "tpt_ms_ratio" not in by["spec", "tuned"]
    lines = bd.goals(rows)
    assert lines[0].startswith("spec: planned TPT 51.0 ms = 1.04x the best other configuration "
                               "(unplanned, 49.0 ms): met")
    assert "cloud-only" in lines[1] and "met" in lines[1]
    assert lines[-1].startswith("planned spec TTFT 150 ms = 2.50x cloud-only's 60 ms: NOT met")


def test_unknown_configuration_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bd.main(["--configs", "planned,fastest"])
    assert e.value.code == 2 and "fastest" in capsys.readouterr().err
