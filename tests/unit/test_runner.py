"""LayerRangeRunner against transformers' LlamaForCausalLM on the same directory (the independent
reference): full-model logits, greedy continuation, every prefix/suffix cut, ragged batches,
cascaded ranges, rollback, and refusal of non-Llama models.

Tolerance: the runner's products run in oneDNN, transformers' in MKL, so sums run in another
order. Logits then differ by ~1e-4 — as much as transformers differs from itself between a
prefill and a token-by-token decode of the same text (7e-5 measured on an 18-token prompt).
LOGIT_TOL leaves room above that; greedy tokens must agree except at a reported near-tie."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import DynamicCache

from common.runner import LayerRangeRunner, Segment

LOGIT_TOL = 3e-4
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def runner(target_runner):
    return target_runner


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode("The history of the printing press begins")


def hf_logits(hf_model, ids) -> torch.Tensor:
    """transformers' logits at every position of `ids` (one causal forward)."""
    with torch.inference_mode():
        return hf_model(torch.tensor([list(ids)])).logits[0]


def hf_hidden(hf_model, ids, layer: int) -> torch.Tensor:
    """transformers' hidden state after decoder layer `layer`-1 (hidden_states[layer])."""
    with torch.inference_mode():
        return hf_model(torch.tensor([list(ids)]), output_hidden_states=True).hidden_states[layer][0]


def assert_close(got, want, tol=LOGIT_TOL, what=""):
    diff = (got.float() - want.float()).abs().max().item()
    assert diff < tol, f"{what}: max |diff| {diff:.3g} >= {tol:g}"


def assert_rows_close(got, want, rel=1e-4, what=""):
    """Hidden states: per-row relative error (rows carry a few ~1e4 "massive activation"
    channels, so an absolute bound would be meaningless; measured up to 1.7e-5 here)."""
    err = ((got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)).max().item()
    assert err < rel, f"{what}: relative row error {err:.3g} >= {rel:g}"


def assert_same_argmax(got, want):
    """Same top-1 per row, except where the reference's top-2 margin is a near-tie."""
    top2 = torch.topk(want.float(), 2, dim=-1).values
    differ = got.argmax(-1) != want.argmax(-1)
    margins = (top2[:, 0] - top2[:, 1])[differ]
    assert (margins < NEAR_TIE).all(), f"top-1 differs at margins {margins.tolist()}"
    for m in margins.tolist():
        warnings.warn(f"near-tie: top-1 differs at reference margin {m:.2e}", stacklevel=2)


def greedy(runner, ids, n):
    kv = runner.new_kv()
    out, x = [], torch.tensor(ids)
    for _ in range(n):
        logits = runner.forward([Segment(kv, x)], 0, runner.num_layers)[0]
        out.append(int(logits[-1].argmax()))
        x = torch.tensor(out[-1:])
    return out


# -- (a) full model ---------------------------------------------------------------------------
def test_prefill_and_cached_decode_match_transformers(runner, hf_model, prompt):
    L = runner.num_layers
    kv = runner.new_kv()
    got = runner.forward([Segment(kv, torch.tensor(prompt), "all")], 0, L)[0]
    assert got.dtype == torch.float32 and got.shape == (len(prompt), runner.vocab_size)
    assert_close(got, hf_logits(hf_model, prompt), what="prefill")
    assert kv.length() == len(prompt) and kv.length(L - 1) == len(prompt)

    # cached decode vs transformers' own cached decode (DynamicCache), token by token
    cache = DynamicCache(config=hf_model.config)
    with torch.inference_mode():
        hf_model(torch.tensor([prompt]), cache=cache, use_cache=True)
        for t in [28, 1345, 30, 378, 2012]:
            want = hf_model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0]
            got = runner.forward([Segment(kv, torch.tensor([t]))], 0, L)[0]
            assert got.shape == (1, runner.vocab_size)
            assert_close(got, want, what=f"decode {t}")
    assert kv.length() == len(prompt) + 5


def test_greedy_continuation_equals_generate(runner, prompt, reference, assert_same_tokens):
    want = reference(prompt, 30)
    got = greedy(runner, prompt, 30)
    assert_same_tokens(prompt, got, want, "runner greedy")


# -- (b) split at every cut -------------------------------------------------------------------
def test_prefix_then_suffix_at_every_cut(runner, hf_model, prompt):
    L = runner.num_layers
    cont = [28, 1345]  # two cached decode steps after the prompt
    ids = prompt + cont
    want = hf_logits(hf_model, ids)
    with torch.inference_mode():
        hidden = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for c in range(1, L):
        kv = runner.new_kv()
        h = runner.forward([Segment(kv, torch.tensor(prompt))], 0, c)[0]
        assert h.shape == (len(prompt), runner.hidden_size)
        assert_rows_close(h, hidden[c][0, : len(prompt)], what=f"cut {c} hidden")
        got = runner.forward([Segment(kv, h, "all")], c, L)[0]
        assert_close(got, want[: len(prompt)], what=f"cut {c} prefill")
        for i, t in enumerate(cont):
            h = runner.forward([Segment(kv, torch.tensor([t]))], 0, c)[0]
            got = runner.forward([Segment(kv, h)], c, L)[0]
            assert_close(got, want[len(prompt) + i], what=f"cut {c} decode {i}")


def test_separate_range_runners_load_only_their_part(model_paths, hf_model, prompt):
    pre = LayerRangeRunner(model_paths.target, layers=(0, 10))
    suf = LayerRangeRunner(model_paths.target, layers=(10, 30))
    assert pre.lm_head is None and pre.norm_w is None and len(pre.layers) == 10
    assert suf.embed_w is None and len(suf.layers) == 20
    with pytest.raises(ValueError, match="outside this runner"):
        pre.forward([Segment(pre.new_kv(), torch.tensor(prompt))], 0, 30)
    with pytest.raises(ValueError, match="no embeddings"):
        suf.embed([1, 2])
    kv_pre, kv_suf = pre.new_kv(0, 10), suf.new_kv(10, 30)
    h = pre.forward([Segment(kv_pre, torch.tensor(prompt))], 0, 10)[0]
    got = suf.forward([Segment(kv_suf, h, "all")], 10, 30)[0]
    want = hf_logits(hf_model, prompt)
    assert_close(got, want, what="separate runners")
    assert kv_pre.length() == kv_suf.length() == len(prompt)
    # any float dtype is accepted and cast (hidden states travel as fp16/bf16 on the wire)
    got16 = suf.forward([Segment(suf.new_kv(10, 30), h.half())], 10, 30)[0]
    assert_same_argmax(got16, want[-1:])


def test_cascade_ranges_within_a_step(runner, hf_model, prompt):
    """[0,2) then [2,5) then [5,30) in one step, positions from each range's own cache length."""
    ids = prompt + [28, 1345]
    want = hf_logits(hf_model, ids)
    kv = runner.new_kv()
    for part, rows in ((prompt, slice(0, len(prompt))), ([28], len(prompt)), ([1345], len(prompt) + 1)):
        h = runner.forward([Segment(kv, torch.tensor(part))], 0, 2)[0]
        assert kv.length(2) == kv.length(0) - len(part)  # mid-cascade: later layers lag
        h = runner.forward([Segment(kv, h)], 2, 5)[0]
        with pytest.raises(ValueError, match="cache lengths differ"):
            runner.forward([Segment(kv, h)], 4, 30)  # layer 4 ran, [5,30) not yet: refused
        got = runner.forward([Segment(kv, h, "all")], 5, 30)[0]
        assert_close(got, want[rows].reshape(got.shape), what="cascade")

    # two sessions at cuts 2 and 5 (the suffix's cascade): A runs [2,5) alone, then A and B
    # run [5,30) as one ragged batch
    other = [1, 504, 3458, 282]
    kv_a, kv_b = runner.new_kv(), runner.new_kv()
    h_a = runner.forward([Segment(kv_a, torch.tensor(prompt))], 0, 2)[0]
    h_b = runner.forward([Segment(kv_b, torch.tensor(other))], 0, 5)[0]
    h_a = runner.forward([Segment(kv_a, h_a)], 2, 5)[0]
    got_a, got_b = runner.forward([Segment(kv_a, h_a, "all"), Segment(kv_b, h_b, "all")], 5, 30)
    assert_close(got_a, want[: len(prompt)], what="cascade batch A")
    assert_close(got_b, hf_logits(hf_model, other), what="cascade batch B")


# -- (c) ragged batch -------------------------------------------------------------------------
def test_ragged_batch_equals_one_by_one(runner, hf_model, tokenizer):
    """A prefill, a 1-token decode and an 8-token draft from sessions at different lengths, in
    one call, vs each alone and vs transformers."""
    L = runner.num_layers
    texts = ["Once upon a time, in a quiet village", "def add(a, b):\n    return",
             "The capital of France is Paris, and the capital of Italy"]
    seqs = [tokenizer.encode(t) for t in texts]
    past = [0, 7, 5]  # cached tokens before the step
    new = [len(seqs[0]), 1, 8]
    seqs[2] = (seqs[2] * 2)[: past[2] + new[2]]
    seqs[1] = (seqs[1] * 2)[: past[1] + new[1]]
    modes = ["all", "last", "all"]

    def setup():
        kvs = [runner.new_kv() for _ in seqs]
        for kv, s, p in zip(kvs, seqs, past):
            if p:
                runner.forward([Segment(kv, torch.tensor(s[:p]))], 0, L)
        return kvs

    kvs = setup()
    batched = runner.forward([Segment(kv, torch.tensor(s[p:]), m)
                              for kv, s, p, m in zip(kvs, seqs, past, modes)], 0, L)
    kvs1 = setup()
    alone = [runner.forward([Segment(kv, torch.tensor(s[p:]), m)], 0, L)[0]
             for kv, s, p, m in zip(kvs1, seqs, past, modes)]
    for i, (got, one, s, p, n, m) in enumerate(zip(batched, alone, seqs, past, new, modes)):
        want = hf_logits(hf_model, s)[p:] if m == "all" else hf_logits(hf_model, s)[-1:]
        assert got.shape == want.shape == one.shape
        assert_close(got, want, what=f"session {i} vs transformers")
        assert_close(got, one, what=f"session {i} batched vs alone")
        assert_same_argmax(got, want)
        assert kvs[i].length() == p + n
    # a middle range returns hidden states per session, [n, hidden]
    kvs = setup()
    hs = runner.forward([Segment(kv, torch.tensor(s[p:])) for kv, s, p in zip(kvs, seqs, past)], 0, 6)
    assert [tuple(h.shape) for h in hs] == [(n, runner.hidden_size) for n in new]
    for h, s, p in zip(hs, seqs, past):
        assert_rows_close(h, hf_hidden(hf_model, s, 6)[p:], what="batched hidden [0,6)")


# -- (d) rollback -----------------------------------------------------------------------------
def test_truncate_then_reforward_equals_never_seen(runner, hf_model, prompt):
    L = runner.num_layers
    kv = runner.new_kv()
    runner.forward([Segment(kv, torch.tensor(prompt))], 0, L)
    for junk in ([5, 6, 7, 8, 9, 10, 11, 12], [99] * 70):  # the second grows the buffers
        runner.forward([Segment(kv, torch.tensor(junk), "all")], 0, L)
        assert kv.length() == len(prompt) + len(junk)
        kv.truncate(len(prompt))
        assert kv.length() == kv.length(L - 1) == len(prompt)
    got = runner.forward([Segment(kv, torch.tensor([28, 1345]), "all")], 0, L)[0]
    assert_close(got, hf_logits(hf_model, prompt + [28, 1345])[-2:], what="after truncate")
    fresh = runner.new_kv()
    runner.forward([Segment(fresh, torch.tensor(prompt))], 0, L)
    again = runner.forward([Segment(fresh, torch.tensor([28, 1345]), "all")], 0, L)[0]
    assert torch.equal(got, again)  # same operations on the same kept entries: bit for bit
    with pytest.raises(ValueError):
        kv.truncate(-1)


def test_kv_growth_and_accounting(runner, hf_model, tokenizer):
    """Decoding past the first buffer capacity (64) keeps exact positions; nbytes grows
    geometrically, not per token."""
    L = runner.num_layers
    ids = tokenizer.encode("Count: one two three four five six seven eight nine ten")
    ids = (ids * 8)[:60]
    kv = runner.new_kv()
    assert kv.nbytes() == 0
    runner.forward([Segment(kv, torch.tensor(ids))], 0, L)
    sizes, extra = {kv.nbytes()}, [11, 12, 13, 14, 15, 16, 17, 18]
    for t in extra:
        got = runner.forward([Segment(kv, torch.tensor([t]))], 0, L)[0]
        sizes.add(kv.nbytes())
    assert_close(got, hf_logits(hf_model, ids + extra)[-1:], what="past capacity")
    per_token = 2 * runner.kv_heads * runner.head_dim * 4 * L
    assert len(sizes) == 2 and max(sizes) == 128 * per_token


# -- validation and refusal -------------------------------------------------------------------
def test_refuses_non_llama(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match="gpt2"):
        LayerRangeRunner(tmp_path)


def test_rejects_bad_segments(runner, prompt):
    L = runner.num_layers
    kv = runner.new_kv()
    with pytest.raises(ValueError, match="token ids"):
        runner.forward([Segment(kv, torch.zeros(3, runner.hidden_size))], 0, L)
    with pytest.raises(ValueError, match="float"):
        runner.forward([Segment(kv, torch.tensor(prompt))], 3, L)
    with pytest.raises(ValueError, match="two segments"):
        runner.forward([Segment(kv, torch.tensor([1])), Segment(kv, torch.tensor([2]))], 0, L)
    part = runner.new_kv(5, 30)
    with pytest.raises(ValueError, match="outside its KV"):
        runner.forward([Segment(part, torch.tensor([1]))], 0, L)
    assert kv.length() == 0 and kv.nbytes() == 0  # nothing was written by refused calls


@pytest.mark.slow
def test_bfloat16_runner_tracks_fp32(runner, model_paths, prompt):
    bf = LayerRangeRunner(model_paths.target, dtype=torch.bfloat16)
    got = bf.forward([Segment(bf.new_kv(), torch.tensor(prompt), "all")], 0, bf.num_layers)[0]
    want = runner.forward([Segment(runner.new_kv(), torch.tensor(prompt), "all")], 0, 30)[0]
    assert got.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.99, cos
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.75


# -- devices ----------------------------------------------------------------------------------
def test_device_names_and_a_missing_gpu_are_clear_errors(model_paths):
    from common.runner import resolve_device
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        resolve_device("cuda:x")
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(RuntimeError, match="TANDEM_DEVICE=cpu"):
            LayerRangeRunner(model_paths.target, device="cuda")


def test_device_is_a_config_field_of_every_runner_service():
    from common.config import load
    from services.prefix.config import PrefixConfig
    from services.suffix.config import SuffixConfig
    from services.verifier.config import VerifierConfig
    for cls, name in ((VerifierConfig, "verifier"), (PrefixConfig, "prefix"),
                      (SuffixConfig, "suffix")):
        assert load(cls, name, [], env={}).device == "cpu"
        assert load(cls, name, [], env={"TANDEM_DEVICE": "cuda"}).device == "cuda"
        assert load(cls, name, ["--device", "cuda:1"], env={}).device == "cuda:1"


@pytest.mark.parametrize("device", [
    "cpu",     # the same plain F.linear path CUDA takes, on the CPU: checks the check itself
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA GPU visible to torch"))])
def test_plain_linear_runner_on_a_device_tracks_the_cpu_runner(runner, model_paths, prompt,
                                                               device):
    """Weights and KV on the device, plain F.linear: logits within float32 noise of the
    CPU runner's own products, ragged batches and the suffix's padded path included; outputs
    come back on the CPU."""
    from services.suffix.executor import padded_forward
    gpu = LayerRangeRunner(model_paths.target, device=device, gemm="torch")
    assert gpu.gemm == "torch" and gpu.lm_head.device.type == device
    L = gpu.num_layers
    kv_c, kv_g = runner.new_kv(), gpu.new_kv()
    want = runner.forward([Segment(kv_c, torch.tensor(prompt), "all")], 0, L)[0]
    got = gpu.forward([Segment(kv_g, torch.tensor(prompt), "all")], 0, L)[0]
    assert got.device.type == "cpu" and kv_g.bufs[0].device.type == device
    assert_close(got, want, tol=2e-3, what="cuda prefill")
    # a ragged batch: one decode token for this session, a fresh 3-token prompt for another
    nxt = int(want[-1].argmax())
    segs = lambda r, kv, kv2: [Segment(kv, torch.tensor([nxt])), Segment(kv2, torch.tensor(prompt[:3]))]  # noqa: E731
    c2, g2 = runner.new_kv(), gpu.new_kv()
    for w, g in zip(runner.forward(segs(runner, kv_c, c2), 0, L), gpu.forward(segs(gpu, kv_g, g2), 0, L)):
        assert_close(g, w, tol=2e-3, what="cuda ragged")
    # the suffix's left-padded decode path from a cut, two sessions at different lengths
    c = 7
    hc = runner.forward([Segment(runner.new_kv(0, c), torch.tensor(prompt))], 0, c)[0]
    sc, sg = runner.new_kv(c, L), gpu.new_kv(c, L)
    runner.forward([Segment(sc, hc[:-1])], c, L)
    gpu.forward([Segment(sg, hc[:-1])], c, L)
    tc, tg = runner.new_kv(c, L), gpu.new_kv(c, L)
    runner.forward([Segment(tc, hc[:-3])], c, L)
    gpu.forward([Segment(tg, hc[:-3])], c, L)
    want, _, _ = padded_forward(runner, [sc, tc], [hc[-1:], hc[-3:-2]], c, L)
    got, _, _ = padded_forward(gpu, [sg, tg], [hc[-1:], hc[-3:-2]], c, L)
    for g, w in zip(got, want):
        assert g.device.type == "cpu"
        assert_close(g, w, tol=2e-3, what="cuda padded")
