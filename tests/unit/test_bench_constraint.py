"""The constraint bench's arithmetic: per-mode fractions, the agreement with cloud-only, the
constrained/unconstrained pairing and the goal lines (bench/bench_constraint.py)."""

from __future__ import annotations

import pytest

from bench import bench_constraint as bc


def _row(url, mode, tokens, finished=True, valid=True, acceptance=None, seconds=1.0):
    return {"url": url, "mode": mode, "tokens": tokens, "finished": finished, "valid": valid,
            "acceptance": acceptance, "seconds": seconds, "tpt_s": seconds / len(tokens)}


def test_mode_rows_count_finished_valid_and_agreement():
    rows = [_row("a", "cloud-only", [1, 2]), _row("b", "cloud-only", [3, 4], finished=False,
                                                   valid=None),
            _row("a", "spec", [1, 2], acceptance=0.8, seconds=1.0),
            _row("b", "spec", [3, 5], finished=False, valid=None, acceptance=0.6, seconds=2.0),
            _row("a", "spec-free", [7, 7], valid=None, acceptance=1.0, seconds=0.5),
            _row("b", "spec-free", [7, 8], valid=None, acceptance=0.8, seconds=1.0)]
    by = {r["mode"]: r for r in bc.mode_rows(rows, ["cloud-only", "spec", "spec-free"])}
    assert by["cloud-only"]["finished_fraction"] == 0.5 and by["cloud-only"]["valid_fraction"] == 1
    assert by["spec"]["same_as_cloud_only"] == 0.5      # b differs at its second token
    assert by["cloud-only"]["same_as_cloud_only"] is None
    free = by["spec-free"]
    assert free["acceptance_ratio"] == pytest.approx(1.4 / 1.8)
    assert free["tpt_ratio"] == pytest.approx((0.5 + 1.0) / (0.25 + 0.5))
    lines = bc.goals(list(by.values()), 100, 256)
    assert "spec: 50% finished within 256 tokens: NOT met" in "\n".join(lines)
    assert any(g.startswith("pipesd acceptance under a schema 0.78x") and "NOT met" in g
               for g in lines)


def test_valid_checks_the_schema_and_leaves_the_undecidable_out():
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}
    assert bc.valid('{"n": 3}', schema) is True
    assert bc.valid('{"n": "3"}', schema) is False
    assert bc.valid('{"n": 3', schema) is False
    assert bc.valid('{"n": 3}', {"$ref": "urn:example:missing"}) is None
