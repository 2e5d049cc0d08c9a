"""Split-mode planners and window formation, checked against brute-force references: per-layer
expansion of plans, a per-layer simulation of the cascade, closed-form DSB costs from the paper's
description, and hand-worked fleets."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from services.suffix.planning import (
    SCHEDULERS, Call, Request, RoundRobin, linear_cost, plan_cost, plan_stats, plan_window,
    validate_plan)
from services.suffix.window import WindowBuilder, WindowConfig


@st.composite
def windows(draw, max_sessions=10, max_layers=40):
    L = draw(st.integers(1, max_layers))
    cuts = draw(st.lists(st.integers(0, L - 1), min_size=1, max_size=max_sessions))
    arrivals = draw(st.lists(st.floats(0, 1), min_size=len(cuts), max_size=len(cuts)))
    return [Request(f"s{i}", c, arrival=t) for i, (c, t) in enumerate(zip(cuts, arrivals))], L


def reqs(*cuts):
    return [Request(f"s{i}", c, arrival=float(i)) for i, c in enumerate(cuts)]


def layers_per_session(calls):
    """Reference expansion: the layer indices each session runs, in execution order."""
    out = {}
    for c in calls:
        for s in c.sids:
            out.setdefault(s, []).extend(range(c.a, c.b))
    return out


def shape(calls):
    return [(c.a, c.b, set(c.sids)) for c in calls]


def cascade_reference(requests, L):
    """Per-layer simulation: layer l serves {i : c_i <= l}; merge runs of equal session sets."""
    out = []
    for l in range(L):
        group = {r.sid for r in requests if r.cut <= l}
        if not group:
            continue
        if out and out[-1][2] == group and out[-1][1] == l:
            out[-1] = (out[-1][0], l + 1, group)
        else:
            out.append((l, l + 1, group))
    return out


def dsb_cost_formula(requests, L, w, u):
    """The paper's DSB step under t = n_layers * (w + u * batch): private [c, d) per distinct cut,
    then [d, L) for all."""
    d = max(r.cut for r in requests)
    cost = (L - d) * (w + u * len(requests))
    for c in {r.cut for r in requests if r.cut < d}:
        cost += (d - c) * (w + u * sum(r.cut == c for r in requests))
    return cost


def layer_lower_bound(requests, L, w, u):
    """No plan beats running every needed layer once (w) plus one row per session-layer (u)."""
    return sum(w + u * sum(r.cut <= l for r in requests)
               for l in range(L) if any(r.cut <= l for r in requests))


# --- every scheduler yields a valid plan -------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(windows(), st.sampled_from(SCHEDULERS))
def test_every_scheduler_covers_each_suffix_exactly_once(window, scheduler):
    requests, L = window
    rr = RoundRobin() if scheduler == "interleave" else None
    calls = plan_window(scheduler, requests, L, rr=rr)
    validate_plan(calls, requests, L)
    assert layers_per_session(calls) == {r.sid: list(range(r.cut, L)) for r in requests}
    assert all(len(set(c.sids)) == len(c.sids) for c in calls)
    work = sum(L - r.cut for r in requests)
    assert plan_stats(calls)["session_layers"] == work


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_empty_window_plans_nothing(scheduler):
    assert plan_window(scheduler, [], 28) == []


def test_bad_windows_rejected():
    with pytest.raises(ValueError):
        plan_window("dsb", [Request("a", 2), Request("a", 3)], 28)
    with pytest.raises(ValueError):
        plan_window("dsb", [Request("a", 28)], 28)
    with pytest.raises(ValueError):
        plan_window("dsb", [Request("a", -1)], 28)
    with pytest.raises(ValueError):
        plan_window("lifo", reqs(2), 28)


def test_validate_plan_rejects_broken_plans():
    requests, L = reqs(2, 5), 10
    good = [Call(2, 5, ("s0",)), Call(5, 10, ("s0", "s1"))]
    validate_plan(good, requests, L)
    broken = [
        good[:1],                                                      # s0, s1 never finish
        good + [Call(9, 10, ("s0",))],                                 # a layer twice
        [Call(2, 6, ("s0",)), Call(5, 10, ("s0", "s1"))],              # overlap
        [Call(2, 4, ("s0",)), Call(5, 10, ("s0", "s1"))],              # gap
        [Call(5, 10, ("s0", "s1")), Call(2, 5, ("s0",))],              # out of order
        [Call(2, 5, ("s0",)), Call(5, 10, ("s0", "s1", "x"))],         # unknown session
        [Call(2, 5, ("s0",)), Call(5, 10, ("s0", "s1", "s1"))],        # row twice
        [Call(2, 5, ("s0",)), Call(5, 5, ()), Call(5, 10, ("s0", "s1"))],  # empty call
        [Call(2, 5, ("s0",)), Call(5, 11, ("s0", "s1"))],              # past L
    ]
    for calls in broken:
        with pytest.raises(ValueError):
            validate_plan(calls, requests, L)


# --- baselines ---------------------------------------------------------------------------------

def test_fifo_one_session_per_call_in_arrival_order():
    requests = [Request("a", 4, arrival=0.3), Request("b", 2, arrival=0.1),
                Request("c", 4, arrival=0.2)]
    assert plan_window("fifo", requests, 12) == [
        Call(2, 12, ("b",)), Call(4, 12, ("c",)), Call(4, 12, ("a",))]


def test_exact_groups_by_cut_ordered_by_earliest_arrival():
    requests = [Request("a", 4, arrival=0.3), Request("b", 2, arrival=0.2),
                Request("c", 4, arrival=0.1), Request("d", 2, arrival=0.4)]
    assert plan_window("exact", requests, 12) == [Call(4, 12, ("c", "a")), Call(2, 12, ("b", "d"))]


def test_homogeneous_window_dsb_equals_exact():
    requests = reqs(3, 3, 3)
    assert plan_window("dsb", requests, 28) == plan_window("exact", requests, 28) \
        == [Call(3, 28, ("s0", "s1", "s2"))]


# --- DSB as the paper describes it --------------------------------------------------------------

def test_dsb_hand_example():
    # d = 9: the cut-2 session advances [2, 9) alone, the two cut-5 peers [5, 9) together,
    # the cut-9 session waits; then [9, 28) for all four.
    requests = reqs(2, 5, 5, 9)
    calls = plan_window("dsb", requests, 28)
    assert shape(calls) == [(2, 9, {"s0"}), (5, 9, {"s1", "s2"}), (9, 28, {"s0", "s1", "s2", "s3"})]
    stats = plan_stats(calls)
    assert stats["shared_tail"] == 19 and stats["private_advance"] == 7 + 4


@settings(max_examples=100, deadline=None)
@given(windows())
def test_dsb_structure(window):
    requests, L = window
    calls = plan_window("dsb", requests, L)
    d = max(r.cut for r in requests)
    assert (calls[-1].a, calls[-1].b) == (d, L)
    assert set(calls[-1].sids) == {r.sid for r in requests}
    private = calls[:-1]
    assert sorted(c.a for c in private) == sorted({r.cut for r in requests if r.cut < d})
    for c in private:
        assert c.b == d and set(c.sids) == {r.sid for r in requests if r.cut == c.a}
    assert plan_stats(calls)["shared_tail"] == L - d
    expect = dsb_cost_formula(requests, L, 1.0, 0.1)
    assert plan_cost(calls, linear_cost(1.0, 0.1)) == pytest.approx(expect)


# --- cascade -----------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(windows())
def test_cascade_matches_per_layer_simulation(window):
    requests, L = window
    calls = plan_window("cascade", requests, L)
    assert shape(calls) == cascade_reference(requests, L)
    ran = [l for c in calls for l in range(c.a, c.b)]
    assert len(ran) == len(set(ran))  # each layer index at most once per step
    assert len(calls) == len({r.cut for r in requests})
    needed = set().union(*(range(r.cut, L) for r in requests))
    assert plan_stats(calls)["layer_execs"] == len(needed)  # minimal: every needed layer once
    for prev, nxt in zip(calls, calls[1:]):  # joiners are appended after the running rows
        assert nxt.sids[:len(prev.sids)] == prev.sids


@settings(max_examples=150, deadline=None)
@given(windows(), st.floats(0.01, 10), st.floats(0, 10), st.floats(0, 5))
def test_cascade_cost_at_most_dsb_and_meets_lower_bound(window, w, u, per_call):
    requests, L = window
    cost = linear_cost(w, u, per_call)
    cascade = plan_cost(plan_window("cascade", requests, L), cost)
    dsb = plan_cost(plan_window("dsb", requests, L), cost)
    distinct = len({r.cut for r in requests})
    bound = layer_lower_bound(requests, L, w, u)
    assert cascade == pytest.approx(bound + distinct * per_call)
    for scheduler in SCHEDULERS:
        assert plan_cost(plan_window(scheduler, requests, L), linear_cost(w, u)) >= bound - 1e-9
    if distinct <= 2:  # one private range at most: both plans are the same calls
        assert cascade == pytest.approx(dsb)
    else:  # a layer between the 2nd and deepest cut runs once in cascade, >= twice in DSB
        assert cascade < dsb - w / 2


# --- fleets from the paper's Table V ------------------------------------------------------------

def test_single_outlier_fleet():
    requests = reqs(*[2] * 7, 9)  # 7@2 + 1@9, L = 28
    exact, dsb, cascade = (plan_window(s, requests, 28) for s in ("exact", "dsb", "cascade"))
    seven = {f"s{i}" for i in range(7)}
    assert shape(exact) == [(2, 28, seven), (9, 28, {"s7"})]
    assert shape(dsb) == shape(cascade) == [(2, 9, seven), (9, 28, seven | {"s7"})]
    assert plan_stats(exact)["layer_execs"] == 26 + 19
    assert plan_stats(dsb)["layer_execs"] == 7 + 19
    assert plan_stats(dsb)["max_batch"] == 8


def test_two_clusters_fleet():
    requests = reqs(*[2] * 4, *[6] * 4)  # 4@2 + 4@6
    low, high = {f"s{i}" for i in range(4)}, {f"s{i}" for i in range(4, 8)}
    assert shape(plan_window("exact", requests, 28)) == [(2, 28, low), (6, 28, high)]
    assert shape(plan_window("dsb", requests, 28)) == shape(plan_window("cascade", requests, 28)) \
        == [(2, 6, low), (6, 28, low | high)]


def test_two_outliers_fleet_cascade_beats_dsb():
    requests = reqs(*[2] * 6, 5, 9)  # 6@2 + 1@5 + 1@9
    six = {f"s{i}" for i in range(6)}
    dsb, cascade = plan_window("dsb", requests, 28), plan_window("cascade", requests, 28)
    assert shape(dsb) == [(2, 9, six), (5, 9, {"s6"}), (9, 28, six | {"s6", "s7"})]
    assert shape(cascade) == [(2, 5, six), (5, 9, six | {"s6"}), (9, 28, six | {"s6", "s7"})]
    assert plan_stats(dsb)["layer_execs"] == 30 and plan_stats(cascade)["layer_execs"] == 26
    assert plan_stats(cascade)["private_advance"] == 7 and plan_stats(dsb)["private_advance"] == 11
    cost = linear_cost(1.0, 0.1)
    assert plan_cost(cascade, cost) == pytest.approx(plan_cost(dsb, cost) - 4 * 1.0)


# --- round robin -------------------------------------------------------------------------------

def test_round_robin_skips_sessions_not_ready():
    rr = RoundRobin()
    assert rr.order(["a", "b", "c", "d"]) == ["a", "b", "c", "d"]
    assert rr.order(["c", "a"], limit=1) == ["a"]       # b not ready: skipped, keeps its place
    assert rr.order(["b", "c", "d"], limit=1) == ["b"]  # b's turn comes right after a
    assert rr.order(["a", "d"]) == ["d", "a"]           # c skipped; wrap around
    assert rr.order([]) == []
    assert rr.order(["a", "b", "c", "d"], limit=2) == ["b", "c"]


def test_round_robin_admits_and_drops():
    rr = RoundRobin()
    assert rr.order(["a", "b", "c"], limit=2) == ["a", "b"]
    rr.drop("a")
    assert rr.order(["a", "b", "c", "e"]) == ["c", "a", "e", "b"]  # a re-admitted at the end
    rr.drop("b")
    rr.drop("zz")
    assert rr.order(["c", "a", "e"], limit=1) == ["c"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sets(st.sampled_from("abcde")), max_size=30))
def test_round_robin_serves_next_ready_after_last_served(ready_sets):
    ring = list("abcde")
    rr, last = RoundRobin(), None
    for s in ring:
        rr.admit(s)
    for ready in ready_sets:
        got = rr.order(sorted(ready), limit=1)
        start = 0 if last is None else ring.index(last) + 1
        cyclic = ring[start:] + ring[:start]
        expect = [s for s in cyclic if s in ready][:1]
        assert got == expect
        last = got[0] if got else last


def test_interleave_plan_uses_round_robin_across_windows():
    rr = RoundRobin()
    first = plan_window("interleave", reqs(2, 5, 9), 28, rr=rr)
    assert first == [Call(2, 28, ("s0",)), Call(5, 28, ("s1",)), Call(9, 28, ("s2",))]
    rr.order(["s0"], limit=1)  # the worker served s0 alone meanwhile
    second = plan_window("interleave", reqs(2, 5, 9), 28, rr=rr)
    assert [c.sids[0] for c in second] == ["s1", "s2", "s0"]


# --- windows -----------------------------------------------------------------------------------

def test_window_closes_on_timer():
    wb = WindowBuilder(WindowConfig(window_ms=8.0, max_size=8))
    assert wb.deadline() is None and not wb.ready(0.0) and wb.take(1e9) == []
    wb.add(Request("a", 2), now=1.000)
    wb.add(Request("b", 5), now=1.005)
    assert wb.deadline() == pytest.approx(1.008)  # timer runs from the oldest request
    assert not wb.ready(1.0079)
    assert wb.take(1.0079) == []
    assert wb.ready(1.008)
    assert [r.sid for r in wb.take(1.008)] == ["a", "b"]
    assert len(wb) == 0 and wb.deadline() is None


def test_window_closes_when_full_and_keeps_the_rest():
    wb = WindowBuilder(WindowConfig(window_ms=8.0, max_size=3))
    for i, t in enumerate([0.000, 0.001, 0.002, 0.003, 0.004]):
        wb.add(Request(f"s{i}", i), now=t)
        if i == 1:
            assert not wb.ready(t)
    assert wb.deadline() == pytest.approx(0.002)  # filled by the third request
    assert wb.ready(0.004)
    assert [r.sid for r in wb.take(0.004)] == ["s0", "s1", "s2"]
    assert wb.deadline() == pytest.approx(0.011)  # next window's timer starts at s3's arrival
    assert not wb.ready(0.010)
    assert [r.sid for r in wb.take(0.011)] == ["s3", "s4"]


def test_window_flush_and_single_request_windows():
    wb = WindowBuilder(WindowConfig(window_ms=8.0, max_size=8))
    wb.add(Request("a", 2), now=0.0)
    assert [r.sid for r in wb.take(math.inf)] == ["a"]
    one = WindowBuilder(WindowConfig(window_ms=0.0, max_size=1))  # how fifo/interleave use it
    one.add(Request("a", 2), now=0.0)
    one.add(Request("b", 3), now=0.0)
    assert one.ready(0.0)
    assert [r.sid for r in one.take(0.0)] == ["a"]
    assert [r.sid for r in one.take(0.0)] == ["b"]


def test_window_rejects_duplicates_backwards_clock_and_bad_config():
    wb = WindowBuilder()
    wb.add(Request("a", 2), now=1.0)
    with pytest.raises(ValueError):
        wb.add(Request("a", 2), now=1.001)
    with pytest.raises(ValueError):
        wb.add(Request("b", 2), now=0.5)
    with pytest.raises(ValueError):
        WindowConfig(max_size=0)
    with pytest.raises(ValueError):
        WindowConfig(window_ms=-1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 0.02), min_size=1, max_size=20), st.integers(1, 5), st.floats(0, 10))
def test_window_against_event_simulation(gaps, max_size, window_ms):
    """Poll at every arrival: each taken window is the oldest <= max_size requests, taken exactly
    when it filled or its oldest request had waited window_ms."""
    wb = WindowBuilder(WindowConfig(window_ms=window_ms, max_size=max_size))
    times = [sum(gaps[:i + 1]) for i in range(len(gaps))]
    queue, taken = [], []
    for i, t in enumerate(times):
        # reference: windows that closed before this arrival
        while queue and (len(queue) >= max_size or t >= queue[0][0] + window_ms / 1000):
            expect = [s for _, s in queue[:max_size]]
            got = [r.sid for r in wb.take(t)]
            assert got == expect
            taken += got
            queue = queue[max_size:]
        assert wb.take(t) == []
        wb.add(Request(f"s{i}", 0), now=t)
        queue.append((t, f"s{i}"))
    while queue:  # whatever is left flushes in max_size chunks, oldest first
        got = [r.sid for r in wb.take(math.inf)]
        assert got == [s for _, s in queue[:max_size]]
        taken += got
        queue = queue[max_size:]
    assert len(wb) == 0 and wb.take(math.inf) == []
    assert taken == [f"s{i}" for i in range(len(taken))]
