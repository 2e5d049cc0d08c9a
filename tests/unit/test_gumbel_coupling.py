"""The Gumbel-max sampling coupling (common/gumbel.py): noise keyed by
(seed, position) that is the same on the edge (numpy, llama.cpp logits) and in the cloud (torch),
draws that are exact samples of the target's distribution, acceptance exactly when the draft is
the target's token, and the wire's rule for the field."""

from __future__ import annotations

import hashlib

import msgpack
import msgspec
import numpy as np
import pytest
import torch

from common import gumbel, protocol, sampling
from common.protocol import Sampling
from services.drafter import engine as drafter_engine
from services.verifier import spec_verify


def test_noise_is_a_pure_function_of_seed_and_position_and_pinned():
    a = gumbel.noise(7, 123, 4096)
    assert np.array_equal(a, gumbel.noise(7, 123, 4096))
    assert not np.array_equal(a, gumbel.noise(7, 124, 4096))
    assert not np.array_equal(a, gumbel.noise(8, 123, 4096))
    # negative seeds (the wire allows them) and 64-bit ones key distinct streams
    assert not np.array_equal(gumbel.noise(-1, 0, 64), gumbel.noise(1, 0, 64))
    # pinned: a numpy whose Philox stream changed would desynchronise an edge and a cloud on
    # different versions, so the bytes themselves are part of the contract
    digest = hashlib.sha256(gumbel.uniforms(7, 123, 4096).tobytes()).hexdigest()[:16]
    assert digest == PINNED_DIGEST, digest


PINNED_DIGEST = "fe79f3ed83784375"   # numpy 2.x Philox4x64, key (7, 123), 4096 float64


@pytest.mark.parametrize("warp", [{}, {"top_k": 20}, {"top_p": 0.9}, {"top_k": 30, "top_p": 0.8}])
def test_edge_draft_equals_cloud_token_on_the_same_distribution(warp):
    """The drafter's numpy path and the verifier's torch path pick the same token from the same
    logits and noise, so a drafter that is the target is always accepted."""
    rng = np.random.default_rng(0)
    s = Sampling(temperature=0.8, seed=11, coupling="gumbel", **warp)
    for position in range(200):
        logits = (rng.standard_normal(512) * 3).astype(np.float32)
        draft, q = drafter_engine._gumbel(logits, s, position)
        target = sampling.gumbel_token(torch.from_numpy(logits), s, position)
        assert draft == target, (position, draft, target)
        p = sampling.target_probs(torch.from_numpy(logits), s)
        # q(draft), the trigger's confidence
        assert abs(q - float(p[draft])) < 1e-4


def _chi_square_p(tokens: list[int], probs: np.ndarray) -> float:
    from scipy.stats import chisquare
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "a token with probability 0 was drawn"
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.mark.parametrize("warp", [{}, {"top_k": 8, "top_p": 0.9}])
def test_gumbel_tokens_are_exact_samples_of_the_target_distribution(warp):
    """Over seeds (the randomness), argmax(log p + g) follows p: a chi-square at one position,
    and across positions of one seed (the noise of different positions is independent)."""
    logits = torch.tensor(np.random.default_rng(3).standard_normal(40) * 0.6, dtype=torch.float32)
    s = Sampling(temperature=0.7, coupling="gumbel", **warp)
    p = sampling.target_probs(logits, s).double().numpy()
    over_seeds = [sampling.gumbel_token(logits, msgspec.structs.replace(s, seed=k), 5)
                  for k in range(4000)]
    assert _chi_square_p(over_seeds, p) > 1e-4
    seeded = msgspec.structs.replace(s, seed=99)
    over_positions = [sampling.gumbel_token(logits, seeded, n) for n in range(4000)]
    assert _chi_square_p(over_positions, p) > 1e-4


def test_verification_under_gumbel_accepts_exactly_the_target_token():
    logits = torch.tensor(np.random.default_rng(5).standard_normal(64), dtype=torch.float32)
    s = Sampling(temperature=1.0, seed=3, coupling="gumbel")
    for position in range(50):
        target = sampling.gumbel_token(logits, s, position)
        assert spec_verify.decide(logits, target, s, position) == spec_verify.Decision(target, True)
        other = (target + 1) % 64
        assert spec_verify.decide(logits, other, s, position) == spec_verify.Decision(target, False)
        # the bonus token (and cloud-only / split decoding) is the same token
        assert spec_verify.bonus(logits, s, position) == target


def test_the_wire_refuses_an_unknown_coupling():
    msg = protocol.GenerateRequest(prompt="x", max_tokens=1,
                                   sampling=Sampling(temperature=1.0, coupling="gumbel"))
    frames = protocol.encode(msg)
    assert protocol.decode(frames, protocol.Limits()).sampling.coupling == "gumbel"
    bad = protocol.encode(msg)
    header = msgpack.unpackb(bad[0])
    header["sampling"]["coupling"] = "argmax"
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.decode([msgpack.packb(header), *bad[1:]], protocol.Limits())
    assert e.value.code == protocol.BAD_FIELD and e.value.field == "sampling.coupling"


def test_resolved_fills_the_default_coupling_and_a_seed_for_gumbel():
    s = sampling.resolved(Sampling(temperature=0.8), "gumbel")
    assert s.coupling == "gumbel" and s.seed is not None
    assert sampling.resolved(Sampling(temperature=0.8, seed=4), "rejection") == \
        Sampling(temperature=0.8, seed=4, coupling="rejection")
    # greedy needs no seed; a named coupling wins over the default
    assert sampling.resolved(Sampling(), "gumbel").seed is None
    assert sampling.resolved(Sampling(temperature=1.0, coupling="rejection"), "gumbel").seed is None


# --- the whole stack in-process: the output depends only on the seed and the prompt -----------

N = 16
SAMPLED = dict(temperature=0.8, top_p=0.95, sampling_coupling="gumbel")


@pytest.fixture(scope="module")
def stack(default_stack):
    return default_stack


def _gen(stack, ids, seed, **kw):
    return list(stack.complete(list(ids), max_tokens=N, stop_at_eos=False, deadline_s=120,
                               seed=seed, **SAMPLED, **kw).token_ids)


def test_same_seed_same_output_in_every_mode_policy_and_threshold(stack, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    base = _gen(stack, ids, 7, mode="cloud-only")
    assert len(base) == N
    assert _gen(stack, ids, 8, mode="cloud-only") != base      # the seed matters
    runs = {f"split cut {c}": dict(mode="split", cut=c) for c in (1, 10, 29)}
    runs.update({f"spec {p}": dict(mode="spec", policy=p)
                 for p in ("pipesd", "pipesd-stream", "vanilla", "hsl", "edgellm",
                           "oracle-trigger", "pipesd-learned", "tree", "tree-stream")})
    # wide trees: siblings are drafted, and the walk must still land on the seed's tokens
    runs["spec tree cs=0.05 m=24"] = dict(mode="spec", policy="tree",
                                          policy_knobs={"cs": 0.05, "m": 24})
    # thresholds moved (as the autotuner moves them between requests) and other draft lengths
    runs.update({"spec pipesd R=(0.3, 0.5)": dict(mode="spec", policy="pipesd",
                                                  nav_thresholds=(0.3, 0.5)),
                 "spec pipesd R=(0.99, 0.99)": dict(mode="spec", policy="pipesd",
                                                    nav_thresholds=(0.99, 0.99)),
                 "spec vanilla n=2": dict(mode="spec", policy="vanilla", policy_knobs={"n": 2}),
                 "spec vanilla n=12": dict(mode="spec", policy="vanilla", policy_knobs={"n": 12})})
    # sent together: the verifier and suffix batch them, and batched must equal one by one
    outs = stack.complete_many([(list(ids), dict(max_tokens=N, stop_at_eos=False, deadline_s=240,
                                                 seed=7, **SAMPLED, **kw)) for kw in runs.values()])
    differ = {name: list(r.token_ids) for name, r in zip(runs, outs) if list(r.token_ids) != base}
    assert not differ, f"cloud-only gave {base}; these differ: {differ}"


def test_gumbel_spec_mode_speculates_and_accepts(stack, tokenizer):
    from prometheus_client import REGISTRY
    ids = tokenizer.encode("def fibonacci(n):\n")
    labels = {"service": "dispatcher", "policy": "vanilla"}

    def per_round(what):
        return REGISTRY.get_sample_value(f"tandem_spec_accepted_tokens_per_round_{what}",
                                         labels) or 0.0
    before = per_round("sum"), per_round("count")
    r = stack.complete(list(ids), max_tokens=N, stop_at_eos=False, deadline_s=120, seed=3,
                       mode="spec", policy="vanilla", **SAMPLED)
    assert r.stats["rounds"] >= 1 and r.stats["draft_tokens"] >= 1
    assert r.stats["accepted_tokens"] >= 1     # the drafter's noise is the target's
    # the dispatcher's vLLM-shaped histogram saw this request's rounds
    assert per_round("sum") - before[0] == r.stats["accepted_tokens"]
    assert per_round("count") - before[1] == r.stats["rounds"]
    assert list(r.token_ids) == _gen(stack, ids, 3, mode="cloud-only")
