"""Speculative metrics in vLLM's shape: accepted tokens per verification round
(histogram), acceptance per depth, tree nodes per round, and `accepted_tokens_per_round` in the
bench's JSON rows."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from common import metrics


def _value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_observe_round_for_a_chain_and_a_tree():
    svc, pol = "metrics-test", "p"
    metrics.observe_round(svc, pol, 3, [1] * 5)               # a chain of 5, 3 accepted
    metrics.observe_round(svc, pol, 0, [1] * 2)               # all rejected
    metrics.observe_round(svc, pol, 2, [3, 4, 2])             # a tree: 9 nodes, depth 2 reached
    assert _value("tandem_spec_accepted_tokens_per_round_count", service=svc, policy=pol) == 3
    assert _value("tandem_spec_accepted_tokens_per_round_sum", service=svc, policy=pol) == 5
    # the 0 bucket holds the all-rejected round
    assert _value("tandem_spec_accepted_tokens_per_round_bucket", service=svc, policy=pol,
                  le="0.0") == 1
    assert _value("tandem_spec_tree_nodes_per_round_sum", service=svc, policy=pol) == 16
    drafted = {d: _value("tandem_spec_draft_tokens_per_depth_total", service=svc, policy=pol,
                         depth=str(d)) for d in range(5)}
    accepted = {d: _value("tandem_spec_accepted_tokens_per_depth_total", service=svc,
                          policy=pol, depth=str(d)) for d in range(5)}
    assert drafted == {0: 5, 1: 6, 2: 3, 3: 1, 4: 1}
    assert accepted == {0: 2, 1: 2, 2: 1, 3: 0, 4: 0}


def test_deep_rounds_share_the_capped_depth_label():
    svc, pol = "metrics-test-deep", "p"
    metrics.observe_round(svc, pol, 20, [1] * 24)
    assert _value("tandem_spec_draft_tokens_per_depth_total", service=svc, policy=pol,
                  depth="15+") == 9
    assert _value("tandem_spec_accepted_tokens_per_depth_total", service=svc, policy=pol,
                  depth="15+") == 5


def test_declared_at_zero_for_each_spec_policy():
    metrics.declare_dispatcher("metrics-test-declared", {"spec": ["pipesd"]})
    assert REGISTRY.get_sample_value("tandem_spec_accepted_tokens_per_round_count",
                                     {"service": "metrics-test-declared", "policy": "pipesd"}) == 0
    assert REGISTRY.get_sample_value("tandem_spec_draft_tokens_per_depth_total",
                                     {"service": "metrics-test-declared", "policy": "pipesd",
                                      "depth": "15+"}) == 0


def test_bench_rows_carry_accepted_tokens_per_round():
    from bench.bench_spec import policy_rows
    runs = {"pipesd": [{"prompt": k, "tpt_s": 0.04, "identical": True, "rounds": r,
                        "accepted_tokens": a, "accepted_tokens_per_round": a / r}
                       for k, r, a in (("A", 4, 10), ("B", 6, 5))]}
    (row,) = policy_rows(runs, ["A", "B"], {"A": 20.0, "B": 20.0}, {})
    assert row["accepted_tokens_per_round"] == pytest.approx(15 / 10)


def test_a_tree_round_reports_its_width_per_depth():
    """The dispatcher's tree rounds hand the metrics each depth's node count, not a chain's."""
    from services.dispatcher.spec.tree_session import _width_per_depth
    assert _width_per_depth([-1, -1, 0, 0, 1, 2]) == [2, 3, 1]
    assert _width_per_depth([-1, 0, 1]) == [1, 1, 1]      # a chain-shaped tree
    assert _width_per_depth([]) == []
