"""GenerateRequest.policy_knobs (spec mode, the benchmarks' tuning parity): knobs the request's
policy does not have, values outside their range and a fractional draft length are refused as
`bad_field` naming policy_knobs; the wire types refuse NaN and infinities before that."""

from __future__ import annotations

import math

import msgspec
import pytest

from common import protocol
from common.protocol import ProtocolError
from services.dispatcher.spec.mode import check_knobs
from services.dispatcher.spec.session import POLICIES


@pytest.mark.parametrize("policy,knobs", [("pipesd", {"r1": 0.5, "r2": 0.9}), ("hsl", {"r2": 0.7}),
                                          ("edgellm", {"r1": 0.2, "c": 0.5}),
                                          ("vanilla", {"n": 12.0}), ("pipesd", None),
                                          ("tree", {"cs": 0.5, "m": 16.0}),
                                          ("tree-stream", {"m": 64.0})])
def test_knobs_of_the_policy_in_range_are_taken(policy, knobs):
    check_knobs(POLICIES[policy], knobs)


@pytest.mark.parametrize("policy,knobs", [("pipesd", {"n": 8.0}), ("hsl", {"r1": 0.5}),
                                          ("oracle-trigger", {"r1": 0.5}),
                                          ("pipesd", {"r2": 1.5}), ("edgellm", {"c": 1.0}),
                                          ("vanilla", {"n": 2.5}), ("vanilla", {"n": 2000.0}),
                                          ("tree", {"m": 2.5}), ("tree", {"m": 65.0}),
                                          ("tree-stream", {"r1": 0.5})])
def test_other_knobs_and_values_out_of_range_are_bad_fields(policy, knobs):
    with pytest.raises(ProtocolError) as e:
        check_knobs(POLICIES[policy], knobs)
    assert e.value.code == protocol.BAD_FIELD and e.value.field == "policy_knobs"


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 0.0])
def test_the_wire_refuses_poisoned_knob_values(value):
    raw = msgspec.msgpack.encode({"type": "generate", "v": protocol.VERSION, "rid": 1,
                                  "prompt": "x", "policy_knobs": {"r1": value}})
    with pytest.raises(ProtocolError) as e:
        protocol.decode([raw], protocol.Limits())
    assert e.value.code == protocol.BAD_FIELD and "policy_knobs" in e.value.field
