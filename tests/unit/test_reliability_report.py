"""bench/reliability_report.py counts a fault as survived only when its test showed that it took
effect: figures without that evidence (a drop that hit nothing, an older run) are shown apart."""

from __future__ import annotations

from bench.reliability_report import render


def _page(chaos: dict, faults: dict) -> str:
    return render({"chaos": chaos, "faults": faults, "partitions": {}, "load": {}, "fuzz": {},
                   "security": {}, "run": {"machine": {"cpu": "test", "cores": 2}}})


def _row(page: str, figure: str) -> str | None:
    return next((line for line in page.splitlines() if line.startswith(f"| {figure} |")), None)


def test_only_faults_that_took_effect_count_as_survived():
    chaos = {"cloud-only: fault drop x2": {"kind": "fault", "recoveries": 0, "took_effect": True},
             "cloud-only: fault partition 3s cut": {"kind": "fault", "recoveries": 2,
                                                    "took_effect": True},
             "spec: fault drop x2": {"kind": "fault", "recoveries": 0},      # no evidence
             "cloud-only: link 0ms 100Mbit": {"kind": "shape", "recoveries": 0}}
    faults = {"verifier kill -9": {"sessions": 2, "sessions_recovered": 2, "took_effect": True},
              "drafter kill -9": {"sessions": 2, "sessions_recovered": 0}}   # no evidence
    page = _page(chaos, faults)
    assert _row(page, "faults injected and survived (link + process)").endswith("| 3 |")
    assert _row(page, "faults injected with no evidence they took effect (not counted above)"
                ).endswith("| 2 |")
    assert _row(page, "link conditions run (shapes + faults)").endswith("| 4 |")


def test_no_extra_row_when_every_fault_took_effect():
    page = _page({"a: fault drop x2": {"kind": "fault", "took_effect": True}}, {})
    assert _row(page, "faults injected and survived (link + process)").endswith("| 1 |")
    assert "no evidence" not in page
