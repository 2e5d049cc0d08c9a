"""tandem.Stats: the typed per-request stats of Result.stats, and their dict compatibility."""

from __future__ import annotations

import dataclasses
import json

import pytest

from common import protocol
from tandem import Result, Stats

SPEC = {"mode": "spec", "policy": "pipesd", "prompt_tokens": 9, "generated_tokens": 16,
        "duration_s": 0.32, "ttft_s": 0.05, "tpt_s": 0.02, "rounds": 4, "draft_tokens": 20,
        "accepted_tokens": 13, "acceptance_rate": 0.65, "mean_draft_length": 5.0,
        "cloud_forwards_per_token": 0.25, "nav_reasons": {"r1": 3, "end": 1},
        "thresholds": {"r1": 0.4, "r2": 0.7}, "dp_plan": [3, 2], "window": 6,
        "alpha_s": 0.001, "beta_s": 1e-5, "gamma_s": 0.002}
SPLIT = {"mode": "split", "policy": "split", "prompt_tokens": 5, "generated_tokens": 8,
         "duration_s": 0.4, "ttft_s": 0.1, "tpt_s": 0.05, "cut": 6, "edge_forward_s": 0.1,
         "cloud_forward_s": 0.2, "cloud_queue_s": 0.01, "wire_s": 0.09,
         "recoveries": 1, "recovery_reasons": ["stall"], "suffix_replica": "suffix-1"}


def test_typed_fields_from_spec_stats():
    s = Stats.from_dict(SPEC)
    assert s.mode == "spec" and s.policy == "pipesd"
    assert s.generated_tokens == 16 and isinstance(s.generated_tokens, int)
    assert s.tpt_s == pytest.approx(0.02) and s.ttft_s == pytest.approx(0.05)
    assert s.acceptance_rate == pytest.approx(0.65) and s.rounds == 4
    assert s.cloud_forwards_per_token == pytest.approx(0.25)
    assert s.thresholds == {"r1": 0.4, "r2": 0.7} and s.nav_reasons["r1"] == 3
    assert s.tokens_per_s == pytest.approx(50.0)
    # split-only fields are None in spec mode; recovery fields have neutral defaults
    assert s.cut is None and s.edge_forward_s is None and s.wire_s is None
    assert s.recoveries == 0 and s.recovery_reasons == () and s.degraded is False


def test_typed_fields_from_split_stats():
    s = Stats.from_dict(SPLIT)
    assert s.cut == 6 and s.edge_forward_s == pytest.approx(0.1)
    assert s.cloud_queue_s == pytest.approx(0.01)
    assert s.rounds is None and s.acceptance_rate is None and s.cloud_forwards_per_token is None
    assert s.recoveries == 1 and s.recovery_reasons == ("stall",)
    assert s["suffix_replica"] == "suffix-1"      # untyped keys stay reachable


def test_dict_compatibility():
    s = Stats.from_dict(SPEC)
    assert s["tpt_s"] == 0.02 and s.get("rounds") == 4 and s.get("nope") is None
    assert s.get("nope", 7) == 7 and "dp_plan" in s and "nope" not in s
    assert s["dp_plan"] == [3, 2] and s["thresholds"]["r1"] == 0.4
    assert dict(s) == SPEC and s == SPEC and s == Stats.from_dict(dict(SPEC))
    assert set(s.keys()) == set(SPEC) and len(s) == len(SPEC)
    assert json.loads(json.dumps(s.raw)) == SPEC and s.to_dict() == SPEC
    with pytest.raises(KeyError):
        s["nope"]


def test_frozen_and_read_only():
    s = Stats.from_dict(SPEC)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tpt_s = 1.0
    with pytest.raises(TypeError):
        s["tpt_s"] = 1.0  # a Mapping, not a MutableMapping


def test_empty_and_none_values():
    s = Stats.from_dict({"mode": "cloud-only", "generated_tokens": 0, "ttft_s": None,
                         "tpt_s": None})
    assert s.ttft_s is None and s.tpt_s is None and s.tokens_per_s is None
    assert Stats() == {} and Stats.from_dict(None) == {} and Result().stats == {}
    assert "mode='cloud-only'" in repr(s)


def test_from_the_wire():
    """Done.stats through the real wire codec gives the same typed view."""
    done = protocol.Done(rid=1, finish_reason="length", stats=SPLIT)
    back = protocol.decode(protocol.encode(done), protocol.Limits())
    s = Stats.from_dict(back.stats)
    assert s.cut == 6 and s.recovery_reasons == ("stall",) and s == SPLIT
