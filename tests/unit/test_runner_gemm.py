"""The runner's matrix products (common/cpu_kernels.py's panel kernel, oneDNN's prepacked
weights), its fused norm, and the limits `tandem bench runner` measures against
(bench/runner_limits.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from bench import runner_limits
from common import cpu_kernels as kernels
from common.runner import LayerRangeRunner, Segment, rms_norm

LOGIT_TOL = 3e-4   # as tests/unit/test_runner.py: the runner's sums vs transformers' MKL sums


@pytest.fixture(scope="module")
def runners(model_paths, target_runner):
    panel = target_runner if target_runner.gemm == "panel" else \
        LayerRangeRunner(model_paths.target, gemm="panel")
    return {"panel": panel, "onednn": LayerRangeRunner(model_paths.target, gemm="onednn")}


@pytest.fixture
def isa():
    """kernels.set_isa for one test, the CPU's own width restored after."""
    native = kernels.isa()
    yield kernels.set_isa
    kernels.set_isa(native)


def test_the_kernel_builds_on_this_machine():
    """CI's machines are x86-64 with AVX2 and a C compiler: the kernel must be there, so the
    runner's default is the panel path (a silent fallback would hide a broken build)."""
    assert kernels.unavailable() is None
    assert LayerRangeRunner.__init__.__defaults__[-1] == "auto"


@pytest.mark.parametrize("n, k", [(960, 576), (37, 19), (16, 1), (1, 300), (49, 1536)])
@pytest.mark.parametrize("width", [256, 512])
def test_kernel_products_match_float64(n, k, width, isa):
    if isa(width) != width:
        pytest.skip(f"this CPU has no {width}-bit FMA (AVX-512F)")
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    wp = kernels.pack(w)
    assert wp.out_features == n and wp.in_features == k
    for m in (1, 2, 3, 5, 6, 7, 8, 13, 64):
        x = torch.randn(m, k, generator=g)
        want = (x.double() @ w.double().T + b.double())
        got = kernels.linear(x, wp, b)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # a float32 sum of k products: error grows like sqrt(k) * eps * |terms|
        tol = 1e-5 * (k ** 0.5) * (x.abs().max() * w.abs().max()).item() + 1e-6
        assert (got.double() - want).abs().max().item() < tol, (m, n, k)
        assert ((kernels.linear(x, wp) + b).double() - want).abs().max().item() < tol


def test_a_row_gives_the_same_bits_in_any_batch():
    """Each output is one FMA chain over k whatever the tile: row i of an M-row product equals
    the same row alone, bit for bit, for every M (the batch-independence the runner relies on)."""
    g = torch.Generator().manual_seed(3)
    w = kernels.pack(torch.randn(100, 576, generator=g))
    x = torch.randn(40, 576, generator=g)
    alone = torch.cat([kernels.linear(x[i: i + 1], w) for i in range(40)])
    for m in range(1, 41):
        assert torch.equal(kernels.linear(x[:m], w), alone[:m]), m
    assert torch.equal(kernels.linear(x[7:19], w), alone[7:19])


def test_avx512_and_avx2_products_give_the_same_bits(isa):
    """The AVX-512 tiles (4 rows on) run the same FMA chain per output as AVX2's: a session's
    logits do not depend on the CPU's vector width or on the batch it lands in."""
    if isa(512) != 512:
        pytest.skip("this CPU has no AVX-512F")
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(200, 576, generator=g), torch.randn(200, generator=g)
    wp = kernels.pack(w)
    x = torch.randn(40, 576, generator=g)
    for m in range(1, 41):
        isa(256)
        narrow = kernels.linear(x[:m], wp, b)
        isa(512)
        assert torch.equal(kernels.linear(x[:m], wp, b), narrow), m


def test_the_kernel_refuses_bad_inputs():
    w = kernels.pack(torch.randn(8, 4))
    with pytest.raises(ValueError, match="fp32"):
        kernels.linear(torch.randn(2, 4, dtype=torch.float64), w)
    with pytest.raises(ValueError, match=r"\[M, 4\]"):
        kernels.linear(torch.randn(2, 5), w)
    with pytest.raises(ValueError, match="2-D fp32 CPU"):
        kernels.pack(torch.randn(8, 4).half())


def test_the_kernel_shares_torchs_openmp_runtime():
    """One OpenMP runtime for torch and the kernels: their threads are torch's, not a second pool
    spinning against it on the same cores. In a fresh process (this one may hold other
    libraries' own runtimes, e.g. scikit-learn's)."""
    code = (
        "import re, torch\n"
        "from pathlib import Path\n"
        "from common import cpu_kernels as k\n"
        "k.linear(torch.randn(3, 64), k.pack(torch.randn(64, 64)))\n"
        "maps = Path('/proc/self/maps').read_text().splitlines()\n"
        "print(sorted({l.split()[-1] for l in maps if re.search(r'libgomp[^/]*\\.so', l)}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    gomps = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert len(gomps) == 1 and "torch" in gomps[0], gomps


def test_panel_path_matches_transformers_and_the_onednn_path(runners, hf_model, tokenizer):
    ids = tokenizer.encode("The history of the printing press begins")
    L = hf_model.config.num_hidden_layers
    panel, onednn = runners["panel"], runners["onednn"]
    assert panel.gemm == "panel" and onednn.gemm == "onednn"
    cache = DynamicCache(config=hf_model.config)
    with torch.inference_mode():
        want_prefill = hf_model(torch.tensor([ids[:-3]]), cache=cache, use_cache=True).logits[0]
    kvs = {k: r.new_kv() for k, r in runners.items()}
    for k, r in runners.items():
        got = r.forward([Segment(kvs[k], torch.tensor(ids[:-3]), "all")], 0, L)[0]
        assert (got - want_prefill).abs().max().item() < LOGIT_TOL, k
    for t in ids[-3:]:   # one token a step: the one-row products
        with torch.inference_mode():
            want = hf_model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0]
        got = {k: r.forward([Segment(kvs[k], torch.tensor([t]))], 0, L)[0]
               for k, r in runners.items()}
        for k, g in got.items():
            assert (g - want).abs().max().item() < LOGIT_TOL, k
        assert (got["panel"] - got["onednn"]).abs().max().item() < LOGIT_TOL
        assert got["panel"].argmax() == want.argmax()


def test_a_session_in_a_ragged_batch_equals_it_alone(runners, tokenizer):
    """A decode row batched with another session's decode and a third one's 5-token draft gives
    the same logits as the session alone."""
    r = runners["panel"]
    L = r.num_layers
    a, b = tokenizer.encode("Once upon a time, in a quiet village"), tokenizer.encode("def f(x):")
    kva, kvb, kvc, kva1 = r.new_kv(), r.new_kv(), r.new_kv(), r.new_kv()
    r.forward([Segment(kva, torch.tensor(a[:-1])), Segment(kvb, torch.tensor(b)),
               Segment(kvc, torch.tensor(b[:3]))], 0, L)
    r.forward([Segment(kva1, torch.tensor(a[:-1]))], 0, L)
    batched = r.forward([Segment(kva, torch.tensor(a[-1:])), Segment(kvb, torch.tensor([11])),
                         Segment(kvc, torch.tensor(b[3:8]), "all")], 0, L)[0]
    alone = r.forward([Segment(kva1, torch.tensor(a[-1:]))], 0, L)[0]
    assert (batched - alone).abs().max().item() < 1e-5


def test_gemm_is_checked(model_paths):
    with pytest.raises(ValueError, match="gemm must be"):
        LayerRangeRunner(model_paths.target, layers=(0, 1), gemm="mkl")
    with pytest.raises(ValueError, match="float32"):
        LayerRangeRunner(model_paths.target, layers=(0, 1), gemm="panel", dtype=torch.float16)


def test_weight_bytes_count_each_matrix_once(runners):
    """The bytes a decode step streams are the same whichever layout the weights are in."""
    bp, bo = (runner_limits.weight_bytes(runners[k]) for k in ("panel", "onednn"))
    assert bo > 500e6 and abs(bp - bo) / bo < 0.01


def test_fused_norm_is_used_only_where_it_is_bit_exact(runners):
    r = runners["onednn"]   # the torch path of the layer (the kernels' norm is checked below)
    assert r._fused_norm   # Llama-style fp32 norm
    x = torch.randn(5, r.hidden_size) * 10
    w = r.layers[0]["in_norm"]
    assert torch.equal(r.norm(x, w), rms_norm(x, w, r.eps))


def test_kernel_norm_and_swiglu_track_torch():
    """The layer kernels against the torch ops they replace (float32 rounding apart)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 576, generator=g) * 20
    x[3, 9] = 3e3   # a "massive activation" channel
    w = torch.randn(576, generator=g)
    got = kernels.rms_norm(x, w, 1e-5)
    want = rms_norm(x.double(), w.double(), 1e-5)
    assert ((got.double() - want).abs() / want.abs().clamp_min(1e-3)).max().item() < 1e-5
    gu = torch.randn(4, 2 * 1536, generator=g) * 4
    want = torch.nn.functional.silu(gu[:, :1536].double()) * gu[:, 1536:].double()
    assert (kernels.silu_mul(gu).double() - want).abs().max().item() < 1e-5


def _attend(q_heads, k, v, cache, p, mask, cos, sin):
    """kernels.attention for one segment of n new tokens at cache position p: q_heads
    [n, nh, hd] sharing one K/V head (k, v [n, hd]); cache [2, 1, cap, hd] is copied first."""
    assert kernels.load() is not None, kernels.unavailable()
    n, nh, hd = q_heads.shape
    qkv = torch.cat((q_heads.reshape(n, nh * hd), k, v), dim=1).contiguous()
    buf = cache.clone()
    batch = kernels.AttentionBatch([0, n], [n], [p], {None: [(0, mask)]})
    return kernels.attention(qkv, nh, 1, hd, cos, sin, batch, None, [buf], 0.125)


@pytest.mark.parametrize("nh", [1, 3, 4, 8])
def test_attention_gives_each_query_head_the_bits_it_has_alone(nh):
    """Attention works on the query heads of a K/V group together (each K and V row read once
    for them); every head's output must be the same bits as that head run alone, for decode
    (no mask) and for a verification with masked keys, past the 4-key and 32-feature blocks."""
    g = torch.Generator().manual_seed(11)
    hd, p, cap = 64, 37, 64
    cache = torch.randn(2, 1, cap, hd, generator=g)
    for n in (1, 6):
        q = torch.randn(n, nh, hd, generator=g) * 2
        k, v = torch.randn(n, hd, generator=g), torch.randn(n, hd, generator=g)
        angle = torch.rand(n, hd, generator=g) * 6
        cos, sin = angle.cos().contiguous(), angle.sin().contiguous()
        mask = None
        if n > 1:
            mask = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
            mask[2, 5] = False   # a cached key one token does not see (as a tree would)
        together = _attend(q, k, v, cache, p, mask, cos, sin).view(n, nh, hd)
        for h in range(nh):
            alone = _attend(q[:, h: h + 1], k, v, cache, p, mask, cos, sin)
            assert torch.equal(together[:, h], alone), (nh, n, h)
        # and the outputs are attention: softmax(q k^T / 8) v against float64 (RoPE on q, k)
        def rope(x, cos=cos, sin=sin):
            half = hd // 2
            return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]
        keys = torch.cat((cache[0, 0, :p], rope(k[:, None])[:, 0])).double()
        vals = torch.cat((cache[1, 0, :p], v)).double()
        s = torch.einsum("nhd,sd->nhs", rope(q).double(), keys) * 0.125
        if mask is not None:
            s = s.masked_fill(~mask[:, None], float("-inf"))
        want = torch.einsum("nhs,sd->nhd", torch.softmax(s, -1), vals)
        assert (together.double() - want).abs().max().item() < 1e-5


def test_read_bandwidth_case_measures_a_bandwidth():
    sample = runner_limits.read_bandwidth_case(8 << 20)
    assert 1e8 < sample() < 1e13   # bytes/s: a sample, not a unit mix-up


def test_product_flops_count_the_models_parameters(runners, hf_model):
    """The compute floor's FLOP, against the parameter count transformers' own model gives:
    2 FLOP per weight per row through the layers' projections, and per logit row through the LM
    head (tied to the embedding in SmolLM2: counted once as a parameter, read per logit row)."""
    hf = hf_model
    proj = sum(p.numel() for n, p in hf.model.layers.named_parameters() if p.dim() == 2)
    head = hf.lm_head.weight.numel()
    for kind in ("panel", "onednn"):
        r = runners[kind]
        assert runner_limits.product_flops(r, 1, 1) == 2 * (proj + head)
        assert runner_limits.product_flops(r, 8, 1) == 2 * (8 * proj + head)
        assert runner_limits.product_flops(r, 9, 9) == 2 * 9 * (proj + head)


def test_fma_peak_case_measures_flops():
    sample = runner_limits.fma_peak_case(torch.get_num_threads(), seconds=0.01)
    assert 1e8 < sample() < 1e13   # FLOP/s: a sample, not a unit mix-up


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


def test_layer_stack_refuses_a_range_outside_its_layers():
    """LayerStack reads its pointer table at `first`: a range past its layers is an error, not
    a read beyond the table."""
    k = 64
    w = {"in_norm": torch.ones(k), "pre_mlp_norm": torch.ones(k),
         "qkv": kernels.pack(torch.zeros(3 * k, k)), "o": kernels.pack(torch.zeros(k, k)),
         "gate_up": kernels.pack(torch.zeros(2 * k, k)),
         "down": kernels.pack(torch.zeros(k, k))}
    stack = kernels.LayerStack([w, w], k, 1, 1, k, 1e-5, 0.125)
    batch = kernels.AttentionBatch([0, 1], [1], [0], {None: [(0, None)]})
    x = torch.zeros(1, k)
    rope = (torch.ones(1, k), torch.zeros(1, k))
    buf = torch.zeros(2, 1, 64, k)
    for first, n in ((1, 2), (2, 1), (-1, 1)):
        with pytest.raises(ValueError, match="outside"):
            stack(first, x, [rope] * n, batch, [None] * n, [[buf]] * n)
    out = stack(0, x, [rope] * 2, batch, [None] * 2, [[buf]] * 2)   # in range: runs
    assert out.shape == (1, k) and torch.isfinite(out).all()
