"""Tree verification's walk step without a model (services/verifier/spec_verify.py):
recursive rejection sampling over siblings drawn from q without replacement emits exactly the
target's distribution, checked by enumerating every draw on a tiny vocabulary and by a
chi-square test over seeded draws through `tree_choose`; greedy matches the argmax."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from common.protocol import Sampling
from services.verifier import spec_verify

CASES = {
    # p, q support, q probabilities
    "overlap": ([0.30, 0.25, 0.20, 0.15, 0.10], [2, 0, 4, 1], [0.4, 0.3, 0.2, 0.1]),
    "q_misses_mass": ([0.50, 0.30, 0.10, 0.05, 0.05], [4, 3, 2], [0.6, 0.3, 0.1]),
    "q_is_p": ([0.30, 0.25, 0.20, 0.15, 0.10], [0, 1, 2, 3, 4], [0.30, 0.25, 0.20, 0.15, 0.10]),
    "p_sharper": ([0.90, 0.10, 0.0, 0.0, 0.0], [1, 0, 3], [0.5, 0.3, 0.2]),
    "p_zero_on_q": ([0.0, 0.0, 0.6, 0.4, 0.0], [0, 1, 4, 2], [0.4, 0.3, 0.2, 0.1]),
}


def draws_without_replacement(q_ids, q_probs, k):
    """Every ordered draw of k distinct children from q, with its probability."""
    for seq in itertools.permutations(range(len(q_ids)), k):
        prob, left = 1.0, 1.0
        for j in seq:
            prob *= q_probs[j] / left
            left -= q_probs[j]
        if prob > 0:
            yield [int(q_ids[j]) for j in seq], prob


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_recursive_rejection_sampling_is_exact_by_enumeration(case, k):
    p, q_ids, q_probs = (np.array(x, dtype=np.float64) for x in CASES[case])
    q_ids = q_ids.astype(np.int64)
    if k > len(q_ids):
        pytest.skip("fewer q tokens than children")
    out = np.zeros(len(p))
    for children, prob in draws_without_replacement(q_ids, q_probs, k):
        accept, residual = spec_verify.rrs_plan(torch.tensor(p), children, q_ids, q_probs)
        reach = 1.0
        for x, a in zip(children, accept):
            out[x] += prob * reach * a
            reach *= 1.0 - a
        out += prob * reach * residual.numpy()
    np.testing.assert_allclose(out, p, atol=1e-12)


def _chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token with target probability 0 was emitted"
    return stats.chisquare(counts[keep], counts.sum() * p[keep] / p[keep].sum()).pvalue


@pytest.mark.parametrize("case", ["overlap", "q_misses_mass", "p_sharper"])
def test_tree_choose_emits_the_target_distribution(case):
    """Seeded draws through the sampler itself: children drawn from q without replacement,
    the token at the position follows p (and an accepted rank always carries its child)."""
    p, q_ids, q_probs = (np.array(x, dtype=np.float64) for x in CASES[case])
    q_ids = q_ids.astype(np.int64)
    logits = torch.log(torch.tensor(p, dtype=torch.float32).clamp_min(1e-30))
    rng = np.random.default_rng(11)
    counts = np.zeros(len(p))
    n = 3000
    for trial in range(n):
        k = 1 + trial % 3
        children = [int(x) for x in rng.choice(q_ids, size=min(k, len(q_ids)), replace=False,
                                               p=q_probs)]
        step = spec_verify.tree_choose(logits, children, Sampling(temperature=1.0, seed=trial),
                                       position=40, q_ids=q_ids, q_probs=q_probs.astype(np.float32))
        assert step.child is None or children[step.child] == step.token
        counts[step.token] += 1
    assert _chi_square(counts, p) > 1e-3


def test_greedy_tree_step_matches_the_argmax_child():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert spec_verify.tree_choose(logits, [3, 1], Sampling(), 5) == spec_verify.TreeStep(1, 1)
    assert spec_verify.tree_choose(logits, [3, 0], Sampling(), 5) == spec_verify.TreeStep(1, None)
    assert spec_verify.tree_choose(logits, [], Sampling(), 5) == spec_verify.TreeStep(1, None)


def test_one_child_draws_what_a_chain_draws():
    """A chain-shaped tree verifies as the chain does: same streams, same tokens."""
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])
    q_ids, q_probs = np.array([2, 0, 4, 1]), np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32)
    same = 0
    for seed in range(200):
        s = Sampling(temperature=1.0, seed=seed)
        draft = int(q_ids[seed % 4])
        chain = spec_verify.decide(torch.log(p), draft, s, 9, q_ids, q_probs)
        step = spec_verify.tree_choose(torch.log(p), [draft], s, 9, q_ids, q_probs)
        same += (chain.token, chain.accepted) == (step.token, step.child == 0)
    assert same == 200
