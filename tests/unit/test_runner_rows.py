"""#20: the runner's one-row path (plain weights where this CPU's gemv is faster), its fused
norm, and the limits `tandem bench runner` measures against (bench/runner_limits.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from bench import runner_limits
from common.runner import LayerRangeRunner, Segment, rms_norm

LOGIT_TOL = 3e-4   # as tests/unit/test_runner.py: oneDNN/MKL vs transformers' MKL sums


@pytest.fixture(scope="module")
def runners(model_paths):
    return {kind: LayerRangeRunner(model_paths.target, row_weights=kind)
            for kind in ("always", "never")}


def test_one_row_path_matches_transformers_and_the_packed_path(runners, hf_model, tokenizer):
    ids = tokenizer.encode("The history of the printing press begins")
    L = hf_model.config.num_hidden_layers
    always, never = runners["always"], runners["never"]
    assert always._row_w and not never._row_w
    cache = DynamicCache(config=hf_model.config)
    with torch.inference_mode():
        hf_model(torch.tensor([ids[:-3]]), cache=cache, use_cache=True)
    kvs = {k: r.new_kv() for k, r in runners.items()}
    for k, r in runners.items():
        r.forward([Segment(kvs[k], torch.tensor(ids[:-3]))], 0, L)
    for t in ids[-3:]:   # one token a step: the one-row products
        with torch.inference_mode():
            want = hf_model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0]
        got = {k: r.forward([Segment(kvs[k], torch.tensor([t]))], 0, L)[0]
               for k, r in runners.items()}
        for k, g in got.items():
            assert (g - want).abs().max().item() < LOGIT_TOL, k
        assert (got["always"] - got["never"]).abs().max().item() < LOGIT_TOL
        assert got["always"].argmax() == want.argmax()


def test_one_row_in_a_ragged_batch_equals_it_alone(runners, tokenizer):
    r = runners["always"]
    L = r.num_layers
    a, b = tokenizer.encode("Once upon a time, in a quiet village"), tokenizer.encode("def f(x):")
    kva, kvb, kva1 = r.new_kv(), r.new_kv(), r.new_kv()
    r.forward([Segment(kva, torch.tensor(a[:-1])), Segment(kvb, torch.tensor(b))], 0, L)
    r.forward([Segment(kva1, torch.tensor(a[:-1]))], 0, L)
    batched = r.forward([Segment(kva, torch.tensor(a[-1:])), Segment(kvb, torch.tensor([11]))],
                        0, L)[0]   # two rows: the packed path
    alone = r.forward([Segment(kva1, torch.tensor(a[-1:]))], 0, L)[0]  # one row: the plain path
    assert (batched - alone).abs().max().item() < LOGIT_TOL


def test_row_weights_is_checked_and_costs_no_streamed_bytes(runners, model_paths):
    with pytest.raises(ValueError, match="row_weights"):
        LayerRangeRunner(model_paths.target, layers=(0, 1), row_weights="sometimes")
    # the plain copies are an alternative route to the same matrices, not extra bytes a step reads
    assert (runner_limits.weight_bytes(runners["always"])
            == runner_limits.weight_bytes(runners["never"]) > 500e6)


def test_fused_norm_is_used_only_where_it_is_bit_exact(runners):
    r = runners["never"]
    assert r._fused_norm   # Llama-style fp32 norm
    x = torch.randn(5, r.hidden_size) * 10
    w = r.layers[0]["in_norm"]
    assert torch.equal(r.norm(x, w), rms_norm(x, w, r.eps))


def test_gemv_case_measures_a_bandwidth():
    sample = runner_limits.gemv_case(8 << 20)
    assert 1e8 < sample() < 1e13   # bytes/s: a sample, not a unit mix-up


def test_llama_anchor_on_an_f32_conversion(model_paths, tmp_path):
    """The anchor path end to end on the bundled drafter (small, fast): ALL_F32 conversion made
    once, then decode and prompt timings from llama.cpp."""
    out = tmp_path / "drafter.ALL_F32.gguf"
    f32 = runner_limits.f32_gguf(model_paths.drafter, out)
    assert f32 == out and out.stat().st_size > model_paths.drafter.stat().st_size * 4
    mtime = out.stat().st_mtime_ns
    assert runner_limits.f32_gguf(model_paths.drafter, out) == out
    assert out.stat().st_mtime_ns == mtime   # prepared once
    cases = runner_limits.llama_cases(out, threads=1, ctx=8, steps=2, prompt_tokens=16,
                                      vocab_size=49152)
    assert cases["llama_decode"]() > 0 and cases["llama_prompt"]() > 0
