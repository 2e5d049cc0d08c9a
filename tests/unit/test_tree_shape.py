"""Token trees, the pure parts: the shape rule (common/tree_shape.py), the online
inputs it gets (services/dispatcher/spec/tree_policy.py) and a session's tree rounds on the
dispatcher (services/dispatcher/spec/tree_session.py)."""

from __future__ import annotations

import random

import pytest

from common import protocol
from common.tree_shape import ROOT, Shape, check_parents, grow
from services.dispatcher.spec.session import (POLICIES, Draft, Emit, Limit, Rollback, SendBatch,
                                              SendNav, SpecError)
from services.dispatcher.spec.tree_policy import TreePolicy, TreePolicyConfig, depths, ranks
from services.dispatcher.spec.tree_session import AskTree, TreeRounds


def flat(qs):
    """Every node offers the same candidates: tokens 10, 11, ... with probabilities qs."""
    return lambda path: [(10 + i, q) for i, q in enumerate(qs)]


def noisy(seed):
    """Candidates whose q depends on the path (a deterministic pseudo-random drafter)."""
    def children(path):
        rng = random.Random(hash((seed, tuple(path))))
        raw = sorted((rng.random() ** 2 for _ in range(4)), reverse=True)
        total = sum(raw) * (1 + rng.random())
        return [(100 + i, x / total) for i, x in enumerate(raw)]
    return children


def widths(g):
    out = {}
    for n in g.nodes:
        out[n.parent] = out.get(n.parent, 0) + 1
    return out


def check_wire(g):
    """The wire format's rules: topological order, distinct siblings, children in rank order
    and each parent's children together, depth by depth."""
    parents = g.parents
    check_parents(parents, 0, len(parents), 10**6)
    seen = set()
    for n in g.nodes:
        assert (n.parent, n.token) not in seen
        seen.add((n.parent, n.token))
        sib = [j for j, m in enumerate(g.nodes) if m.parent == n.parent]
        assert [g.nodes[j].rank for j in sib] == list(range(len(sib)))
        assert sib == list(range(sib[0], sib[0] + len(sib)))
    assert [n.depth for n in g.nodes] == sorted(n.depth for n in g.nodes)
    assert depths(parents) == [n.depth for n in g.nodes]
    assert ranks(parents) == [n.rank for n in g.nodes]


def test_slow_link_and_an_unsure_drafter_grow_a_wide_tree():
    shape = Shape(max_nodes=32, max_depth=8, max_width=4, token_value_s=0.100,
                  node_cost_s=[0.001], depth_cost_s=0.002, width_cost_s=0.001)
    g = grow(shape, flat([0.35, 0.25, 0.2, 0.1]))
    check_wire(g)
    assert widths(g)[ROOT] == 4 and len(g.nodes) >= 16
    assert max(n.depth for n in g.nodes) >= 2


def test_fast_link_with_costly_nodes_gives_a_chain():
    shape = Shape(max_nodes=32, max_depth=16, max_width=4, token_value_s=0.005,
                  node_cost_s=[0.001], depth_cost_s=0.001, width_cost_s=0.0005)
    g = grow(shape, flat([0.9, 0.05, 0.03, 0.02]))
    check_wire(g)
    assert all(w == 1 for w in widths(g).values()), "a sibling paid for itself"
    assert len(g.nodes) >= 4 and g.main_path() == list(range(len(g.nodes)))


def test_nothing_pays_gives_an_empty_tree():
    shape = Shape(max_nodes=8, max_depth=8, token_value_s=0.001, node_cost_s=[0.01])
    g = grow(shape, flat([0.5, 0.3]))
    assert g.nodes == [] and g.done


@pytest.mark.parametrize("seed", range(6))
def test_more_value_never_means_fewer_nodes_and_more_cost_never_more(seed):
    base = dict(max_nodes=48, max_depth=10, max_width=4, node_cost_s=[0.002],
                depth_cost_s=0.004, width_cost_s=0.001)
    counts = [len(grow(Shape(token_value_s=v, **base), noisy(seed)).nodes)
              for v in (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)]
    assert counts == sorted(counts), counts
    costs = [len(grow(Shape(**{**base, "node_cost_s": [c], "token_value_s": 0.05}),
                      noisy(seed)).nodes) for c in (0.0005, 0.001, 0.003, 0.01, 0.03)]
    assert costs == sorted(costs, reverse=True), costs


@pytest.mark.parametrize("seed", range(4))
def test_limits_and_best_first_order(seed):
    shape = Shape(max_nodes=12, max_depth=3, max_width=3, token_value_s=10.0)
    g = grow(shape, noisy(seed))
    check_wire(g)
    assert len(g.nodes) == 12 and max(n.depth for n in g.nodes) <= 2
    assert all(w <= 3 for w in widths(g).values())
    # P along a path never grows, and every node's P is the product of its estimates
    for n in g.nodes:
        parent_p = 1.0 if n.parent == ROOT else g.nodes[n.parent].path_p
        assert n.path_p == pytest.approx(parent_p * min(1.0, n.prob))


def test_accept_scale_calibrates_q():
    """Siblings measured as never accepted (scale 0 at rank >= 1) are not grown; a depth's
    scale applies to deeper depths too."""
    qs = [0.4, 0.3, 0.2, 0.1]
    scale = [1.0, 0.0, 0.0, 0.0] * 2
    shape = Shape(max_nodes=32, max_depth=6, max_width=4, token_value_s=1.0,
                  node_cost_s=[0.001], accept_scale=scale)
    g = grow(shape, flat(qs))
    assert all(w == 1 for w in widths(g).values()) and len(g.nodes) >= 3
    assert shape.scale(5, 1) == 0.0 and shape.scale(0, 9) == 1.0


def test_sampling_ranks_are_grown_in_order():
    """A rank-r child is never added without the rank r-1 one (recursive rejection sampling
    verifies siblings in draw order), even when its q is larger."""
    shape = Shape(max_nodes=2, max_depth=1, max_width=3, token_value_s=1.0)
    g = grow(shape, flat([0.1, 0.6, 0.3]))
    assert [n.rank for n in g.nodes] == [0, 1]


def test_check_parents_rules():
    d = check_parents([-1, 0, 0], 0, 8, 4)
    assert d == [0, 1, 1]
    with pytest.raises(ValueError):
        check_parents([3], 3, 8, 4, list(d))         # parent not before the node? (3 == 3)
    with pytest.raises(ValueError):
        check_parents([-1], 2, 8, 4, list(d))        # first_node != nodes received
    with pytest.raises(OverflowError):
        check_parents([-1] * 6, 3, 8, 4, list(d))    # too many nodes
    with pytest.raises(OverflowError):
        check_parents([1, 3, 4], 3, 8, 4, list(d))   # depth 4 >= limit 4


# --- the dispatcher's inputs -------------------------------------------------------------------
def test_policy_measures_acceptance_per_depth_and_rank():
    tp = TreePolicy(TreePolicyConfig(prior=1.0))
    parents = [-1, -1, 0, 0, 1]        # nodes 2, 3 under node 0; node 4 under node 1
    probs = [0.6, 0.3, 0.5, 0.4, 0.9]
    for _ in range(20):
        tp.observe_round(parents, probs, [1])    # the rank-1 root child accepted, then nothing
    assert tp.table[(0, 0)][:2] == [20, 0] and tp.table[(0, 1)][:2] == [20, 20]
    assert (1, 0) in tp.table and tp.table[(1, 0)][:2] == [20, 0]   # node 4 was tried
    assert tp.table.get((1, 1)) is None            # node 3's parent was rejected: not tried
    assert tp.scale(0, 0) < 0.2 and tp.scale(0, 1) > 2.5 and tp.scale(5, 3) == 1.0


def test_policy_request_follows_the_link():
    tp = TreePolicy()
    for n, t in ((4, 0.010), (8, 0.012), (16, 0.016), (32, 0.024)):
        tp.observe_verify(n, t)
    base, per_node = tp.verify_curve()
    assert base == pytest.approx(0.008) and per_node == pytest.approx(0.0005)
    slow = tp.request(rtt=0.100, beta=0.0001, gamma=0.005, depth_left=100)
    fast = tp.request(rtt=0.001, beta=0.0001, gamma=0.005, depth_left=3)
    assert slow.token_value_s > fast.token_value_s and fast.max_depth == 3
    assert slow.node_cost_s == [pytest.approx(0.0006)]
    scaled = tp.request(rtt=0.1, beta=0.0001, gamma=0.005, depth_left=9, knobs={"cs": 2, "m": 5})
    assert scaled.max_nodes == 5 and scaled.depth_cost_s == pytest.approx(0.010)
    tp.observe_commit(0.3, 3)
    assert tp.token_value(0.1, 0.005) == pytest.approx(0.1)
    # the drafter's decode costs: γ and γ × width_cost until two row counts are timed ...
    assert scaled.width_cost_s == pytest.approx(2 * 0.005 * 0.1)
    tp.observe_decode(1, 0.020)
    assert tp.decode_costs(0.005) == (0.005, pytest.approx(0.0005))
    # ... then the fit a + b·rows: a depth costs a + b, a further row b
    for rows, t in ((2, 0.028), (4, 0.044), (8, 0.076)):
        tp.observe_decode(rows, t)
    depth, row = tp.decode_costs(0.005)
    assert depth == pytest.approx(0.020) and row == pytest.approx(0.008)
    req = tp.request(rtt=0.1, beta=0.0001, gamma=0.005, depth_left=9, knobs={"cs": 2})
    assert req.depth_cost_s == pytest.approx(0.040) and req.width_cost_s == pytest.approx(0.016)
    protocol.check(protocol.DraftRequest(tree=slow))   # it travels


# --- a session's tree rounds --------------------------------------------------------------------
def rounds(max_tokens=20, prompt=10):
    tp = TreePolicy()
    shape = lambda left: tp.request(0.05, 0.0, 0.005, left)  # noqa: E731
    return TreeRounds(prompt, max_tokens, POLICIES["tree"], tp, shape, batch=8), tp


def test_a_round_asks_sends_verifies_and_rolls_back_to_the_path():
    sm, tp = rounds(max_tokens=10)
    (ask,) = sm.start()
    assert isinstance(ask, AskTree) and ask.epoch == 0 and ask.request.max_depth == 9
    out = sm.on_tree(10, 0, [5, 6], [-1, -1], [0.6, 0.3], False)
    assert isinstance(out[0], SendBatch) and out[0].parents == [-1, -1] and out[0].first_node == 0
    assert [d.position for d in out[0].drafts] == [10, 10]
    out = sm.on_tree(10, 2, [7, 8, 9], [0, 0, 1], [0.5, 0.2, 0.9], True)
    assert out[0].first_node == 2 and [d.position for d in out[0].drafts] == [11, 11, 11]
    assert isinstance(out[1], SendNav) and out[1].nodes == 5
    assert sm.on_tree(10, 5, [1], [0], [0.1], True) == []        # the round is closed
    out = sm.on_result(ask.round, 10, 2, 42, path=[1, 4])
    assert out[0] == Emit([6, 9, 42])
    assert out[1] == Rollback(1, 12, [42], 0, path=[1, 4])
    assert isinstance(out[2], AskTree) and out[2].epoch == 1 and sm.C == 13
    assert sm.stats.accepted == 2 and sm.stats.draft_tokens == 5
    assert (1, 1) not in tp.table and tp.table[(1, 0)][:2] == [1, 1]   # only node 4 was tried
    assert sm.on_result(ask.round, 10, 2, 42, path=[1, 4]) == []    # a duplicate
    assert sm.stats.duplicate_results == 1


def test_bad_results_and_bad_drafter_trees_raise():
    sm, _ = rounds()
    (ask,) = sm.start()
    sm.on_tree(10, 0, [5, 6], [-1, -1], [0.6, 0.3], True)
    with pytest.raises(SpecError):
        sm.on_result(ask.round, 10, 2, 1, path=[0, 1])     # 1 is not a child of 0
    with pytest.raises(SpecError):
        sm.on_result(ask.round, 10, 1, 1, path=[])         # accepted != len(path)
    sm, _ = rounds()
    sm.start()
    with pytest.raises(SpecError):
        sm.on_tree(10, 0, [5, 5], [-1, -1], [0.6, 0.3], False)   # repeated sibling token
    sm, _ = rounds()
    sm.start()
    with pytest.raises(SpecError):
        sm.on_tree(10, 0, [5, 6], [-1, 1], [0.6, 0.3], False)    # a parent after its child
    assert sm.on_tree(11, 0, [5], [-1], [0.6], False) == []      # another start: stale


def test_empty_trees_the_last_token_and_a_lost_drafter_are_zero_rounds():
    sm, _ = rounds(max_tokens=3)
    (ask,) = sm.start()
    (nav,) = sm.on_tree(10, 0, [], [], [], True)
    assert nav.nodes == 0 and nav.end == 10                      # a chain NAV with no draft
    out = sm.on_result(ask.round, 10, 0, 7)
    assert out[0] == Emit([7]) and isinstance(out[-1], AskTree) and out[-1].request.max_depth == 1
    out = sm.drafter_lost()
    assert isinstance(out[0], SendNav) and out[0].nodes == 0
    out = sm.on_result(out[0].round, 11, 0, 8)
    assert out[0] == Emit([8]) and isinstance(out[1], SendNav)   # the target alone
    assert sm.on_result(out[1].round, 12, 0, 9) == [Emit([9])] and sm.C == sm.final


def _tree_then_chain(sm):
    """A tree [5 -> 7, 6] at 10 (main path 5, 7), then its proactive chain 8, 9, 1, 2 from 12."""
    (ask,) = sm.start()
    sm.on_tree(10, 0, [5, 6], [-1, -1], [0.6, 0.3], False)
    out = sm.on_tree(10, 2, [7], [0], [0.9], True)
    assert isinstance(out[1], SendNav) and out[1].nodes == 3
    assert out[2] == Limit(12 + 4)                  # the chain along the main path
    sends = []
    for i, t in enumerate([8, 9, 1, 2]):
        sends += sm.on_chain(Draft(12 + i, t, 0.9))
    batch, nav = sends
    assert batch.parent == ask.round and batch.start == 12 and len(batch.drafts) == 4
    assert nav.end == 16 and nav.nodes == 0
    return ask, nav


def test_a_proactive_chain_behind_a_tree_is_kept_when_the_main_path_and_guess_hold():
    sm, _ = rounds(max_tokens=20)
    sm.proactive = 4
    ask, nav = _tree_then_chain(sm)
    out = sm.on_result(ask.round, 10, 2, 8, path=[0, 2])      # main path, bonus == guess 8
    assert out == [Emit([5, 7, 8])] and sm.C == 13 and sm.stats.proactive_kept == 4
    out = sm.on_result(nav.round, 13, 1, 4)                  # the chain: 9 accepted, then 4
    assert out[0] == Emit([9, 4]) and out[1] == Rollback(1, 14, [4], 0)
    assert isinstance(out[2], AskTree) and sm.C == 15


def test_a_proactive_chain_is_discarded_otherwise():
    sm, _ = rounds(max_tokens=20)
    sm.proactive = 4
    ask, nav = _tree_then_chain(sm)
    out = sm.on_result(ask.round, 10, 2, 3, path=[0, 2])      # bonus 3 != guess 8
    assert out[0] == Emit([5, 7, 3]) and out[1] == Rollback(1, 12, [3], 0, path=[0, 2])
    assert isinstance(out[2], AskTree) and sm.stats.proactive_discarded == 4
    assert sm.on_result(nav.round, 13, 1, 4) == []           # the verifier dropped it too
    sm, _ = rounds(max_tokens=20)
    sm.proactive = 4
    ask, _ = _tree_then_chain(sm)
    out = sm.on_result(ask.round, 10, 1, 8, path=[1])         # a side path: discarded
    assert out[1] == Rollback(1, 11, [8], 0, path=[1]) and sm.stats.proactive_discarded == 4


def test_a_trigger_ends_the_proactive_chain_at_an_unsure_draft():
    from services.dispatcher.spec.nav_trigger import NavConfig, make_trigger
    tp = TreePolicy()
    sm = TreeRounds(10, 20, POLICIES["tree"], tp, lambda left: tp.request(0.05, 0, 0.005, left),
                    proactive=8, batch=8,
                    trigger=make_trigger("pipesd", NavConfig(r1=0.5, r2=0.5, max_length=0)))
    (ask,) = sm.start()
    out = sm.on_tree(10, 0, [5], [-1], [0.9], True)
    assert out[-1] == Limit(11 + 8)
    assert sm.on_chain(Draft(11, 8, 0.1)) == []      # the guess: not judged by the trigger
    assert sm.on_chain(Draft(12, 9, 0.9)) == []
    batch, nav = sm.on_chain(Draft(13, 1, 0.2))      # unsure: the chain round ends here
    assert batch.start == 11 and len(batch.drafts) == 3 and nav.end == 14
    assert nav.reason in ("single", "both") and sm.on_chain(Draft(14, 2, 0.9)) == []
