"""Sampling end to end (DESIGN.md §5 invariant 3): seeded draws through the running services
follow the distribution that *transformers* computes — its own forward pass and its own logits
processors (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, in generate()'s order) —
not the one common/sampling.py computes.

For cloud-only, speculative (pipesd and the vanilla baseline) and split mode, at temperature 0.8
with and without top-k / top-p (COMBOS), DRAWS seeded 2-token requests on a prompt whose next
token is spread (17 tokens over 1 %):
* position 0 is tested with a chi-square. In spec mode it is the position the drafter drafts and
  the verifier accepts or rejects (a request of n tokens drafts positions 0..n-2; the last is the
  target's own token), so the draws go through rejection sampling's accept and residual paths:
  the test asserts that every spec draw verified a draft and that some were rejected.
* position 1, given the most common position-0 token: the decode step's sampling in cloud-only
  and split, the token after a verification in spec (fewer draws: a weaker check).
Power (tests/integration/sampling_power.py simulates the chi-square on transformers' own
distributions): with 2000 draws at position 0, moving 5 % of the probability mass (total
variation 0.05) from the most likely token to the 2nd is rejected in 91 % of runs, to the 10th in
100 %; mixing 5 % of uniform mass over the top 20 into the top-k 20 / top-p 0.95 distribution in
100 %; a temperature 0.85 instead of 0.8 (also TV 0.05, spread over every token) in only 26 %. A
correct sampler is rejected in none of 200 runs at P_MIN = 1e-4. A token transformers gives
probability 0 must never be drawn. Slow: about a minute per mode.

Under a constraint (a regular expression, through llguidance), speculative sampling drafts under
the mask and verifies against the masked target distribution: 2000 seeded spec draws pass the
same chi-square against transformers' logits masked by llguidance's own matcher, at position 0
(drafted and verified in every draw, some drafts rejected) and position 1.

Under the Gumbel coupling (`sampling_coupling="gumbel"`) a seed fixes the output whatever the
mode: TANDEM_GUMBEL_DRAWS seeds (default 400) of the same 2-token requests give token-for-token
the same draws in cloud-only, spec (pipesd, vanilla: position 0 drafted and verified) and split
mode, and those draws pass the same chi-square against transformers."""

from __future__ import annotations

import asyncio
import os
from collections import Counter

import numpy as np
import pytest
import torch

from stack.launcher import Cluster
from tandem import AsyncClient

pytestmark = pytest.mark.slow

DRAWS = int(os.environ.get("TANDEM_SAMPLING_DRAWS", "2000"))
GUMBEL_DRAWS = int(os.environ.get("TANDEM_GUMBEL_DRAWS", "400"))   # every mode draws the same
FLAT_PROMPT = "My favourite fruit is"            # position 0: many likely tokens
N_TOKENS = 2                                     # spec drafts position 0 and verifies it
TEMPERATURE = 0.8
CONFIGS = {"t0.8": {}, "t0.8-topk20-topp0.95": {"top_k": 20, "top_p": 0.95}}
MODES = {"cloud-only": {"mode": "cloud-only"},
         "spec-pipesd": {"mode": "spec", "policy": "pipesd"},
         "spec-vanilla": {"mode": "spec", "policy": "vanilla"},
         "split": {"mode": "split", "cut": 10}}
# Every mode with top-k / top-p, where a warper that a path skipped or misordered shows; plain
# temperature in cloud-only and in spec through the vanilla policy. The two spec policies differ
# in when and how much they send to verification, not in how a verification samples, so spec
# mode's two configs are split between them. The three other pairs of the full 4 x 2 grid cost
# ~12 minutes of CI time (spec 287-318 s each on a 2-core VM) and, each mode's warpers being
# tested with top-k / top-p already, add only plain temperature in spec-pipesd and split.
COMBOS = [("cloud-only", "t0.8"), ("cloud-only", "t0.8-topk20-topp0.95"),
          ("spec-pipesd", "t0.8-topk20-topp0.95"), ("spec-vanilla", "t0.8"),
          ("split", "t0.8-topk20-topp0.95")]
P_MIN = 1e-4
CONCURRENCY = 16


@pytest.fixture(scope="module")
def cluster(model_paths, tmp_path_factory):
    c = Cluster(services=("verifier", "drafter", "prefix", "suffix", "dispatcher"),
                ephemeral=True, logdir=tmp_path_factory.mktemp("sampling-logs"),
                extra={"verifier": ["--threads", "1"], "drafter": ["--threads", "1"],
                       "prefix": ["--threads", "1"], "suffix": ["--threads", "1"]})
    c.start_all()
    try:
        c.wait_ready(timeout=240)
        yield c
    finally:
        c.stop_all()


def transformers_probs(hf_model, ids: list[int], top_k: int = 0, top_p: float = 1.0,
                       temperature: float = TEMPERATURE) -> np.ndarray:
    """The next-token distribution generate(do_sample=True, temperature, top_k, top_p) samples
    from: transformers' forward, then its warpers in generate()'s order."""
    from transformers import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    x = torch.tensor([ids])
    with torch.inference_mode():
        logits = hf_model(x).logits[:, -1, :].float()
        scores = warpers(x, logits)
    return torch.softmax(scores, dim=-1)[0].double().numpy()


def chi_square(counts: Counter, probs: np.ndarray) -> tuple[float, str]:
    """p-value of the observed counts against probs; tokens with an expected count under 5
    pooled into one category. Draws outside the support fail outright (p = 0)."""
    from scipy.stats import chisquare
    n = sum(counts.values())
    impossible = {t: c for t, c in counts.items() if probs[t] == 0.0}
    if impossible:
        return 0.0, f"drawn with probability 0 under transformers: {impossible}"
    big = [t for t in np.flatnonzero(probs * n >= 5)]
    obs = [counts.get(int(t), 0) for t in big]
    exp = [probs[t] * n for t in big]
    rest_obs = n - sum(obs)
    rest_exp = n - sum(exp)
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:                       # too little mass left to pool: fold it into the largest bin
        i = int(np.argmax(exp))
        obs[i] += rest_obs
        exp[i] += rest_exp
    if len(obs) < 2:            # a point mass, and every draw in its support (checked above)
        return 1.0, f"one bin, n = {n}"
    res = chisquare(obs, np.asarray(exp) * (sum(obs) / sum(exp)))
    return float(res.pvalue), f"{len(obs)} bins, n = {n}, chi2 = {res.statistic:.1f}"


async def draws(endpoint: str, ids: list[int], mode: dict, config: dict,
                n_draws: int = DRAWS) -> list:
    """`n_draws` seeded N_TOKENS-token requests: their Results."""
    async with AsyncClient(endpoint, timeout_s=600) as c:
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(seed):
            async with sem:
                return await c.complete(ids, max_tokens=N_TOKENS, temperature=TEMPERATURE,
                                        seed=seed, **{"stop_at_eos": False, **config, **mode})
        return await asyncio.gather(*[one(s) for s in range(n_draws)])


def check_positions(hf_model, ids: list[int], out: list[list[int]], kw: dict) -> tuple[str, str]:
    """Chi-square of position 0, and of position 1 given the most common position-0 token."""
    p0, what0 = chi_square(Counter(o[0] for o in out), transformers_probs(hf_model, ids, **kw))
    t0, _ = Counter(o[0] for o in out).most_common(1)[0]
    second = Counter(o[1] for o in out if o[0] == t0)
    p1, what1 = chi_square(second, transformers_probs(hf_model, ids + [t0], **kw))
    assert p0 >= P_MIN, f"position 0: {what0}, p = {p0:.3g}"
    assert p1 >= P_MIN, f"position 1 given {t0}: {what1}, p = {p1:.3g}"
    return f"p = {p0:.3g} ({what0})", f"p = {p1:.3g} ({what1})"


@pytest.mark.parametrize(("mode", "config"), COMBOS, ids=[f"{m}-{c}" for m, c in COMBOS])
def test_draws_follow_transformers(cluster, tokenizer, hf_model, mode, config):
    kw = {"top_k": CONFIGS[config].get("top_k", 0), "top_p": CONFIGS[config].get("top_p", 1.0)}
    flat = tokenizer.encode(FLAT_PROMPT)
    results = asyncio.run(draws(cluster.endpoint("dispatcher"), flat, MODES[mode], CONFIGS[config]))
    out = [list(r.token_ids) for r in results]
    assert all(len(o) == N_TOKENS for o in out)
    if MODES[mode]["mode"] == "spec":   # position 0 was drafted and verified in every draw
        assert all(r.stats["draft_tokens"] >= 1 for r in results)
        rejected = sum(r.stats["accepted_tokens"] < r.stats["draft_tokens"] for r in results)
        assert 0 < rejected < len(results), f"{rejected} of {len(results)} drafts rejected"
    what0, what1 = check_positions(hf_model, flat, out, kw)
    print(f"{mode} {config}: position 0 {what0}; position 1 {what1}")


def test_gumbel_draws_are_one_per_seed_in_every_mode_and_follow_transformers(cluster, tokenizer,
                                                                              hf_model):
    endpoint = cluster.endpoint("dispatcher")
    gumbel = {"sampling_coupling": "gumbel", "top_k": 20, "top_p": 0.95}
    modes = ("cloud-only", "spec-pipesd", "spec-vanilla", "split")
    flat = tokenizer.encode(FLAT_PROMPT)
    out = {m: [list(r.token_ids) for r in
               asyncio.run(draws(endpoint, flat, MODES[m], gumbel, GUMBEL_DRAWS))] for m in modes}
    for m in modes:   # seed for seed, the same tokens
        assert out[m] == out["cloud-only"], f"{m} differs from cloud-only"
    what0, what1 = check_positions(hf_model, flat, out["cloud-only"], {"top_k": 20, "top_p": 0.95})
    print(f"gumbel: position 0 {what0}; position 1 {what1}")


# A regular expression whose first token has many allowed choices the target spreads over
# (" apple", " ban", " m", ...), and no end before a third token: every draw has N_TOKENS.
FRUIT = r" (apple|banana|cherry|grape|kiwi|lemon|lime|mango|melon|orange|peach|pear|plum|" \
        r"raspberry|strawberry|watermelon)s? and [a-z]+\."


def masked_probs(hf_model, tokenizer, ids: list[int], consumed: list[int]) -> np.ndarray:
    """The distribution constrained sampling draws from after `consumed`: transformers' logits,
    outside llguidance's own mask (its matcher, not Tandem's wrapper) set to -inf, then
    TemperatureLogitsWarper (temperature alone: no top-k / top-p whose order with the mask could
    matter)."""
    import llguidance
    import llguidance.hf
    from transformers import TemperatureLogitsWarper
    vocab = hf_model.config.vocab_size
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab),
                             llguidance.LLMatcher.grammar_from_regex(FRUIT))
    for t in consumed:
        assert m.consume_token(t), m.get_error()
    bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
    allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:vocab].astype(bool))
    x = torch.tensor([ids + consumed])
    with torch.inference_mode():
        logits = hf_model(x).logits[:, -1, :].float()
    logits = logits.masked_fill(~allowed[None, :logits.shape[-1]], float("-inf"))
    scores = TemperatureLogitsWarper(TEMPERATURE)(x, logits)
    return torch.softmax(scores, dim=-1)[0].double().numpy()


def test_constrained_spec_draws_follow_transformers_under_the_mask(cluster, tokenizer, hf_model):
    """Speculative sampling under a constraint: the drafter drafts under the regex, the verifier
    verifies against the masked target distribution. Position 0 is drafted and verified in every
    draw (rejection sampling's accept and residual paths on the masked distributions); its
    draws, and position 1's given the most common position-0 token, pass the chi-square against
    transformers' masked distribution."""
    from common.protocol import Constraint
    flat = tokenizer.encode(FLAT_PROMPT)
    results = asyncio.run(draws(cluster.endpoint("dispatcher"), flat, MODES["spec-pipesd"],
                                {"stop_at_eos": True, "constraint": Constraint("regex", FRUIT)}))
    out = [list(r.token_ids) for r in results]
    assert all(len(o) == N_TOKENS for o in out)
    assert all(r.stats["draft_tokens"] >= 1 for r in results)
    rejected = sum(r.stats["accepted_tokens"] < r.stats["draft_tokens"] for r in results)
    assert 0 < rejected < len(results), f"{rejected} of {len(results)} drafts rejected"
    probs0 = masked_probs(hf_model, tokenizer, flat, [])
    assert (probs0 > 0.01).sum() >= 5, "the mask leaves the first token too little spread"
    p0, what0 = chi_square(Counter(o[0] for o in out), probs0)
    t0, _ = Counter(o[0] for o in out).most_common(1)[0]
    p1, what1 = chi_square(Counter(o[1] for o in out if o[0] == t0),
                           masked_probs(hf_model, tokenizer, flat, [t0]))
    assert p0 >= P_MIN, f"position 0: {what0}, p = {p0:.3g}"
    assert p1 >= P_MIN, f"position 1 given {t0}: {what1}, p = {p1:.3g}"
    print(f"constrained spec: {rejected} of {len(results)} drafts rejected; position 0 p = "
          f"{p0:.3g} ({what0}); position 1 p = {p1:.3g} ({what1})")
