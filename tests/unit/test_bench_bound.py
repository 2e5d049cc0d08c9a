"""The clairvoyant bound (bench/bound.py): its DP equals brute force over every action sequence
and every batch plan on small synthetic traces, and it is a bound on simple policies replayed on
the same trace."""

from __future__ import annotations

import random

import pytest

from bench.bound import Costs, batch_time, bound, brute_force, match_runs, plan_time


def random_costs(rng: random.Random) -> Costs:
    verify0 = rng.uniform(0.005, 0.05)
    slope = rng.uniform(0.0, 0.01)
    return Costs(gamma_s=rng.uniform(0.001, 0.03), alpha_s=rng.uniform(0.0, 0.01),
                 beta_s=rng.uniform(0.0, 0.005), rtt_s=rng.uniform(0.0, 0.1),
                 verify_s=tuple(verify0 + slope * b for b in range(4)))


def test_match_runs():
    assert match_runs([True, True, False, True, False, False]) == [2, 1, 0, 1, 0, 0]
    assert match_runs([]) == []


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    match = [rng.random() < rng.choice((0.3, 0.7, 0.95)) for _ in range(n)]
    c = random_costs(rng)
    assert bound(match, c) == pytest.approx(brute_force(match, c), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("k", range(0, 9))
def test_batch_time_is_the_best_batch_plan(k):
    """Algorithm 1 + the last batch's verify cost = the best of all 2^(k-1) batch plans."""
    from bench.bound import _compositions
    rng = random.Random(k)
    for _ in range(20):
        c = random_costs(rng)
        best = min(plan_time(p, c) for p in _compositions(k))
        assert batch_time(k, c) == pytest.approx(best, rel=1e-12, abs=1e-15)


def vanilla_time(match, c: Costs, n_draft: int) -> float:
    """A fixed-length policy without proactive drafting, replayed on the trace: draft N, send in
    one batch, wait for the verdict."""
    m, i, t = match_runs(match), 0, 0.0
    while i < len(match):
        k = n_draft
        a = min(k, m[i])
        t += plan_time((k,), c) + c.rtt_s
        i += a + 1
    return t


@pytest.mark.parametrize("seed", range(20))
def test_bound_below_replayed_policies(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(1, 40)
    match = [rng.random() < 0.8 for _ in range(n)]
    c = random_costs(rng)
    b = bound(match, c)
    cloud_only = c.alpha_s + c.rtt_s + n * c.verify(0)
    assert b <= cloud_only + 1e-12
    for n_draft in (1, 2, 4, 8):
        assert b <= vanilla_time(match, c, n_draft) + 1e-12


def test_all_matching_trace_is_drafting_plus_one_verification():
    """Every draft right, free link: the best is to draft all but the last token overlapped
    (γ each) and pay one verification round at the end."""
    c = Costs(gamma_s=0.01, alpha_s=0.0, beta_s=0.0, rtt_s=0.05, verify_s=(0.02, 0.02))
    n = 10
    # overlapped rounds draft n - 1 tokens (γ each), the last token comes from one verification
    assert bound([True] * n, c) == pytest.approx(0.01 * (n - 1) + 0.02 + 0.05)


def test_bad_costs_rejected():
    with pytest.raises(ValueError, match="gamma_s"):
        Costs(gamma_s=float("nan"), alpha_s=0, beta_s=0, rtt_s=0, verify_s=(0.1,))
    with pytest.raises(ValueError, match="verify_s"):
        Costs(gamma_s=0, alpha_s=0, beta_s=0, rtt_s=0, verify_s=())


def test_a_changing_link_bounds_with_its_least_round_trip(monkeypatch):
    """The `changing` scenario runs LAN, S1, a 300 ms round trip and LAN again, each phase both
    ways; the bound takes its least round trip (a bound with the S1 or the 300 ms figure could be
    beaten during the LAN phases)."""
    from bench.bench_spec import link_rtt_s
    from stack.wan import SCENARIOS

    sched = SCENARIOS["changing"].schedule
    rtts = [sched.at(t)["up"]["latency_ms"] + sched.at(t)["down"]["latency_ms"]
            for t in (1.0, 6.0, 11.0, 16.0, 21.0)]
    assert rtts == [0.5, 50.0, 300.0, 0.5, 0.5]      # repeating every 20 s
    assert sched.at(6.0)["up"]["bandwidth_mbit"] == 20.0 and sched.at(11.0)["up"]["bandwidth_mbit"] == 0
    assert link_rtt_s("changing") == 0.0005
    # a link that starts slow and gets fast: the bound takes the fast phase, not the start
    from stack.wan import LinkShape, Scenario, Schedule, Step
    fast_later = Schedule([Step(5.0, "both", {"latency_ms": 1.0})], period_s=10.0)
    monkeypatch.setitem(SCENARIOS, "slow-then-fast", Scenario(
        LinkShape(latency_ms=150.0), LinkShape(latency_ms=150.0), schedule=fast_later))
    assert link_rtt_s("slow-then-fast") == 0.002
    assert link_rtt_s("s1") == 0.05 and link_rtt_s("s2") == 0.05 and link_rtt_s("none") == 0.0
