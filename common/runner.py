"""LayerRangeRunner: runs any contiguous layer range [a, b) of a decoder model (Llama, Mistral,
Qwen2/3, Gemma 2/3, Phi-3: common/architectures.py) for a ragged batch of sessions, each with its
own KV cache and its own number of new tokens (DySCo's dyForward).

One runner serves the verifier ([0, L), many sessions, k draft tokens each), the prefix ([0, c))
and the suffix ([c, L), sessions at different cuts, cascaded range by range within a step).

How a forward call is laid out (T = all new tokens of all segments, concatenated):
* projections and MLPs run once per layer over all T tokens (q/k/v fused, gate/up fused);
* RoPE uses per-token positions, which start at each session's cache length at layer a;
* attention runs per session against its own KV (no padding, no merge/split), with a causal
  mask only where a session has more than one new token;
* each session's KV lives in per-layer buffers [2, kv_heads, capacity, head_dim] that grow
  geometrically; truncation only moves the per-layer lengths.

Matrix products and the layer around them (CPU, float32): this project's kernels
(common/cpu_kernels.c, built on first use; `gemm="panel"`, the default where they build). Every
weight is stored once as panels of 16 output rows, k-major, so a product streams each panel as
one contiguous run; the pre-norm SwiGLU families (Llama, Mistral, Qwen2/3, Phi-3) run a
forward's whole layers as one kernel call (each layer's norm, q|k|v, q/k norms, RoPE + K/V
writes + attention for every segment, o, residual + norm, SwiGLU, down), Gemma's layers op by
op through the same kernels.
Why: on this project's 2-core AMD EPYC (Zen 3, AVX2) the libraries' products read the weights
far below the machine's bandwidth at decode's row counts. All 121 products of a SmolLM2 decode
step (538 MB), 2 threads, median of 7 interleaved reps (`tandem bench runner --gemm`, README):

    rows   MKL F.linear   oneDNN prepacked   this kernel      (read bandwidth, best reader: 33 GB/s)
    1      48.3 ms        38.4 ms            22.4 ms (24 GB/s)
    8      99.4 ms        48.4 ms            34.3 ms (63 GFLOP/s)

and the ~25 torch ops a layer around them added ~8 ms: a decode step took 46 ms with oneDNN's
products and torch's ops, 22 ms with the kernels (same run). For prefill the
kernel is level with oneDNN (LM head, 64 rows: 28.0 vs 29.4 ms), so one layout serves every row
count and each weight is held once. `gemm="onednn"` (prepacked oneDNN and torch's ops: where the
kernels cannot be built, and for comparison) and `gemm="torch"` (plain F.linear: CUDA, and dtypes
the others do not serve) remain.

Devices. `device="cuda"` (or "cuda:N") puts the weights, the KV caches and the RoPE tables on
that GPU and runs every product as plain F.linear (the kernels above are CPU-only);
inputs may be CPU tensors and outputs come back on the CPU, so callers (the services, the suffix
executor's padded path) are unchanged. Asking for CUDA where torch cannot use it is an error at
load, saying why (`resolve_device`).

Accuracy: transformers runs MKL, so logits differ from it by ~1e-4 (sums in another order), as
much as transformers differs from itself between prefill and token-by-token decode. The
kernel's products are independent of the batch: each output is one FMA chain over k whatever
the tile, so a row gives the same bits alone or among any number of others (MKL's do not).
With the whole-layer kernels (`chunk_invariant`) attention is too: a query's softmax visits its
keys in one order with one lane blocking whatever number of later keys the call holds, so a
prompt's K/V rows and logits have the same bits however its prefill was chunked
(tests/unit/test_chunk_invariance.py), and the verifier's prefix cache hands out rows computed
by another session.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common import cpu_kernels as kernels
from common.architectures import ACTIVATIONS, layer_plan, load_config, rope_kinds

# The row count oneDNN tunes its blocked weight layout for (gemm="onednn").
PACK_ROWS = 8


def resolve_device(device: str | torch.device) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` as a torch.device; a clear error if torch cannot use it."""
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported: use cpu, cuda or cuda:N")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support" if torch.version.cuda is None else
                   "torch sees no CUDA GPU (driver, CUDA_VISIBLE_DEVICES, or a container "
                   "started without --gpus / a device reservation)")
            raise RuntimeError(f"device {device!r}: {why} (torch {torch.__version__}). Install "
                               "a CUDA build of torch (docker: --build-arg VARIANT=cuda) or set "
                               "device: cpu (TANDEM_DEVICE=cpu).")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise RuntimeError(f"device {device!r}: only {torch.cuda.device_count()} CUDA "
                               "device(s) visible")
    return d


class SessionKV:
    """One session's KV cache for layers [lo, hi): per-layer buffers, allocated on first use."""

    def __init__(self, lo: int, hi: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.lo, self.hi = lo, hi
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.bufs: list[torch.Tensor | None] = [None] * (hi - lo)  # [2, kv_heads, capacity, head_dim]
        self.lens = [0] * (hi - lo)
        self.caps = [0] * (hi - lo)   # bufs[i].shape[2] (0: not allocated)

    def length(self, layer: int | None = None) -> int:
        """Tokens cached at `layer` (default lo). Layers of one range differ only mid-cascade."""
        return self.lens[(self.lo if layer is None else layer) - self.lo]

    def truncate(self, n_keep: int) -> None:
        """Roll back to the first n_keep tokens at every layer (layers holding fewer keep theirs)."""
        if n_keep < 0:
            raise ValueError(f"truncate: n_keep must be >= 0, got {n_keep}")
        self.lens = [min(n, n_keep) for n in self.lens]

    @torch.inference_mode()   # the buffers are inference tensors (written by forward)
    def move_rows(self, rows: list[int], to: int) -> None:
        """Keep cache rows `rows` (increasing, each >= its destination) at to, to + 1, ... and
        drop everything after them, at every layer: a verified tree's accepted path becomes
        consecutive positions by copying len(rows) rows, not the cache."""
        if any(r < to + i for i, r in enumerate(rows)) or any(
                a >= b for a, b in zip(rows, rows[1:])):
            raise ValueError(f"move_rows: rows {rows} must increase, each at or after {to} + its index")
        n_keep = to + len(rows)
        for i, buf in enumerate(self.bufs):
            if rows and buf is not None and self.lens[i] > rows[-1]:
                src = torch.tensor(rows, device=buf.device)
                buf[:, :, to: n_keep] = buf[:, :, src]   # the gather copies before the write
        self.truncate(n_keep)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs if b is not None)

    def reserve(self, a: int, b: int, n_total: int) -> None:
        """Room for n_total tokens at layers [a, b) (of the model's numbering)."""
        i0, i1 = a - self.lo, b - self.lo
        if min(self.caps[i0:i1]) < n_total:   # one check a forward on the hot path
            for i in range(i0, i1):
                self._reserve(i, n_total)

    def _reserve(self, i: int, n_total: int) -> torch.Tensor:
        """Buffer of layer lo+i with room for n_total tokens; doubles so appends are amortised O(1)."""
        buf = self.bufs[i]
        if buf is None or buf.shape[2] < n_total:
            cap = max(64, n_total, 2 * buf.shape[2] if buf is not None else 0)
            new = torch.empty(2, self.kv_heads, cap, self.head_dim, dtype=self.dtype,
                              device=self.device)
            if buf is not None:
                new[:, :, : self.lens[i]] = buf[:, :, : self.lens[i]]
            self.bufs[i] = buf = new
            self.caps[i] = cap
        return buf


@dataclass
class Segment:
    """One session's share of a ragged batch."""

    kv: SessionKV
    x: torch.Tensor      # LongTensor [n] token ids when a == 0, else float [n, hidden]
    logits: str = "last"  # when b == L: "last" -> [1, V], "all" -> [n, V]; ignored when b < L
    # A token tree: each new token's position minus the cache length (a tree node's
    # depth + 1 after the root's token; None = 0..n-1) and which new tokens each one sees
    # (bool [n, n], row i: token i's ancestors and itself; None = causal). Every new token
    # sees the whole cache. K/V rows are stored in token order, so after verification the
    # caller keeps the accepted path with SessionKV.move_rows.
    positions: torch.Tensor | None = None
    ancestors: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm as transformers computes it, bit for bit: Llama's `w * normed.to(dtype)`, or with
    `gemma=True` Gemma's `(normed * (1 + w)).to(dtype)` in float32 (`w` then holds 1 + w)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * w).to(x.dtype)
    return w * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last dimension (rotate-half layout). When cos is narrower than x (Phi-3's
    partial_rotary_factor), only the leading cos.shape[-1] features rotate."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _first_key(p: int, window: int | None) -> int:
    """The first key a call's attention reads for new tokens from position p: 0, or for a
    sliding window the window's start rounded down to a multiple of 8 (the keys before it
    masked), so a key's place in the kernel's 8-lane blocks is its position mod 8 however the
    prompt was chunked (the softmax sum's bits depend on it)."""
    if window is None:
        return 0
    first = max(0, p - window + 1)
    return first - first % 8


def _safetensors_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for single-file and sharded checkpoints."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{model_dir}: no model.safetensors(.index.json); only safetensors "
                         "checkpoints are supported")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


class LayerRangeRunner:
    """Layers [lo, hi) of a decoder-only model (embeddings if lo == 0, final norm + LM head if
    hi == L), for the families in common/architectures.py.

    The layer is exposed as public steps, which forward() composes and which the suffix's padded
    executor (services/suffix/executor.py) reuses over its padded batch so both compute the same
    layer: `rope_rows`, `attention_inputs`, `attend`, `layer_output`, `logits`, plus
    `window(layer)` for sliding-window layers.

    `gemm`: the products ("auto", "panel", "onednn", "torch": `_choose_gemm`)."""

    def __init__(self, model_dir: str | Path, layers: tuple[int, int] | None = None,
                 dtype: torch.dtype = torch.float32, threads: int | None = None,
                 device: str | torch.device = "cpu", gemm: str = "auto"):
        model_dir = Path(model_dir)
        self.device = resolve_device(device)
        fam, cfg = load_config(model_dir, f"{model_dir}: ")
        self.family = fam
        if threads is not None:
            torch.set_num_threads(threads)

        self.config, self.dtype = cfg, dtype
        self.num_layers = L = cfg.num_hidden_layers
        self.hidden_size, self.vocab_size = cfg.hidden_size, cfg.vocab_size
        self.lo, self.hi = layers if layers is not None else (0, L)
        if not 0 <= self.lo < self.hi <= L:
            raise ValueError(f"layers {layers} outside [0, {L}]")
        self.n_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.gemma_norm = fam.gemma_norm
        self.act = ACTIVATIONS[getattr(cfg, fam.act_key)]
        swiglu = getattr(cfg, fam.act_key) in ("silu", "swish")
        # None keeps SDPA's own 1/sqrt(head_dim) (what Llama-family models use)
        self.attn_scale = cfg.query_pre_attn_scalar ** -0.5 if fam.pre_attn_scalar else None
        self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        # transformers multiplies by the scale cast to the weights' dtype
        self.embed_scale = (torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype)
                            if fam.embed_scale else None)
        self.plans = layer_plan(cfg)
        self.gemm = self._choose_gemm(gemm)
        # With the panel kernel's library loaded (fp32 on the CPU), the layer around the
        # products runs in it too: norms, SwiGLU, and RoPE + K/V writes + attention as one call
        # a layer for the whole ragged batch (Gemma 2's soft-capped scores stay in torch).
        self._kernels = self.gemm == "panel"
        self._kernel_swiglu = self._kernels and swiglu
        self._kernel_attention = (self._kernels and self.attn_softcap is None
                                  and self.head_dim % 8 == 0)
        # the kernels take the scale itself (SDPA's default where the family sets none)
        self._kernel_scale = self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5
        # RMSNorm as one fused op where it gives transformers' bits (checked at load)
        self._fused_norm = False

        # RoPE kind -> (inv_freq, scale) and its cos/sin tables by position, grown on demand
        self.rope = rope_kinds(cfg, self.head_dim)
        self.rope_tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}

        index = _safetensors_index(model_dir)
        from safetensors import safe_open

        handles: dict[Path, object] = {}

        def get(name: str) -> torch.Tensor:
            if name not in index:
                raise ValueError(f"{model_dir}: checkpoint lacks tensor {name}")
            f = handles.get(index[name])
            if f is None:
                f = handles[index[name]] = safe_open(str(index[name]), framework="pt")
            return f.get_tensor(name).to(device=self.device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            w = get(name)
            # Gemma's (1 + w) is computed in float32, as transformers does at every call
            return (1.0 + w.float()) if fam.gemma_norm else w

        def fused(prefix: str, parts: tuple[str, ...], fused_name: str, kind: str):
            """One product over concatenated rows: the checkpoint's own fused tensor (Phi-3) or
            the separate ones concatenated; biases where the checkpoint has them."""
            if prefix + fused_name + "." + kind in index:
                return get(prefix + fused_name + "." + kind)
            names = [prefix + n + "." + kind for n in parts]
            if kind == "bias" and not any(n in index for n in names):
                return None
            if kind == "bias":  # a bias on some parts only: zeros for the others
                ws = [get(prefix + n + ".weight") for n in parts]
                return torch.cat([get(b) if b in index else w.new_zeros(w.shape[0])
                                  for b, w in zip(names, ws)])
            return torch.cat([get(n) for n in names])

        def bias(name: str) -> torch.Tensor | None:
            return get(name) if name in index else None

        self.embed_w = get("model.embed_tokens.weight") if self.lo == 0 else None
        self.layers = []  # index l - lo
        for i in range(self.lo, self.hi):
            p = f"model.layers.{i}."
            qkv_parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            gu_parts = ("mlp.gate_proj", "mlp.up_proj")
            w = {
                "in_norm": norm(p + "input_layernorm.weight"),
                # q|k|v rows in that order; gate|up rows in that order (Phi-3 stores them so)
                "qkv": self._pack(fused(p, qkv_parts, "self_attn.qkv_proj", "weight")),
                "qkv_b": fused(p, qkv_parts, "self_attn.qkv_proj", "bias"),
                "o": self._pack(get(p + "self_attn.o_proj.weight")),
                "o_b": bias(p + "self_attn.o_proj.bias"),
                "gate_up": self._pack(fused(p, gu_parts, "mlp.gate_up_proj", "weight")),
                "gate_up_b": fused(p, gu_parts, "mlp.gate_up_proj", "bias"),
                "down": self._pack(get(p + "mlp.down_proj.weight")),
                "down_b": bias(p + "mlp.down_proj.bias"),
            }
            if fam.sandwich_norms:
                w["post_attn_norm"] = norm(p + "post_attention_layernorm.weight")
                w["pre_mlp_norm"] = norm(p + "pre_feedforward_layernorm.weight")
                w["post_mlp_norm"] = norm(p + "post_feedforward_layernorm.weight")
            else:
                w["pre_mlp_norm"] = norm(p + "post_attention_layernorm.weight")
            if fam.qk_norm:
                w["q_norm"] = norm(p + "self_attn.q_norm.weight")
                w["k_norm"] = norm(p + "self_attn.k_norm.weight")
            self.layers.append(w)
        if self.hi == L:
            self.norm_w = norm("model.norm.weight")
            tied = cfg.tie_word_embeddings or "lm_head.weight" not in index
            self.lm_head = self._pack(get("model.embed_tokens.weight" if tied else "lm_head.weight"))
        else:
            self.norm_w = self.lm_head = None
        handles.clear()
        self._fused_norm = not self._kernels and self._fused_norm_exact()
        # the pre-norm SwiGLU families run a forward's layers as one kernel call (tdm_layers)
        self._kernel_layers = None
        if self._kernel_attention and self._kernel_swiglu and not fam.sandwich_norms:
            self._kernel_layers = kernels.LayerStack(self.layers, self.hidden_size, self.n_heads,
                                                     self.kv_heads, self.head_dim, self.eps,
                                                     self._kernel_scale)
        # Whether a token's K/V rows and logits have the same bits however its prompt was
        # chunked and batched (module doc): what lets the prefix cache reuse rows exactly.
        self.chunk_invariant = self._kernel_layers is not None

    def _choose_gemm(self, gemm: str) -> str:
        """The products' implementation ('Matrix products', module doc): "panel" (this
        project's kernel, common/cpu_kernels.py), "onednn" (oneDNN's prepacked weights) or "torch"
        (F.linear on the weights as loaded: CUDA, and CPUs or dtypes neither of the others
        serves); "auto" takes the first of them that this device and dtype allow."""
        if gemm not in ("auto", "panel", "onednn", "torch"):
            raise ValueError(f"gemm must be auto, panel, onednn or torch, got {gemm!r}")
        def why_not(kind: str) -> str | None:   # asked lazily: "panel" may build the kernels
            if kind == "torch":
                return None
            if self.device.type != "cpu":
                return "not on the CPU"
            if kind == "panel":
                return "needs float32" if self.dtype != torch.float32 else kernels.unavailable()
            if not torch.backends.mkldnn.is_available():
                return "this torch has no oneDNN"
            if self.dtype == torch.float32 or (self.dtype == torch.bfloat16 and
                                               torch.ops.mkldnn._is_mkldnn_bf16_supported()):
                return None
            return f"no oneDNN kernels for {self.dtype} on this CPU"

        if gemm == "auto":
            return next(k for k in ("panel", "onednn", "torch") if why_not(k) is None)
        why = why_not(gemm)
        if why is not None:
            raise ValueError(f"gemm={gemm!r} is unavailable here: {why}")
        return gemm

    def _fused_norm_exact(self) -> bool:
        """Whether torch's fused F.rms_norm gives this runner's rms_norm bit for bit (Llama-style
        norms in float32 only; Gemma's 1 + w and lower precisions keep the spelled-out ops)."""
        if self.gemma_norm or self.dtype != torch.float32:
            return False
        g = torch.Generator().manual_seed(0)
        x = torch.randn(17, self.hidden_size, generator=g, dtype=self.dtype) * 3
        w = torch.randn(self.hidden_size, generator=g, dtype=self.dtype).to(self.device)
        x = x.to(self.device)
        ref = rms_norm(x, w, self.eps)
        return torch.equal(F.rms_norm(x, (x.shape[-1],), w, self.eps), ref)

    # -- products ---------------------------------------------------------------------------
    def _pack(self, w: torch.Tensor):
        """A weight [out, in] in the layout `linear` takes for this runner's products."""
        if self.gemm == "panel":
            return kernels.pack(w)
        if self.gemm == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        return w.contiguous()

    def linear(self, x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T (+ b) with a weight as stored by this runner (`_pack`)."""
        if self.gemm == "panel":
            return kernels.linear(x, w, b)
        if self.gemm == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return F.linear(x, w, b)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """This family's RMSNorm with a weight as stored by this runner."""
        if self._kernels:
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), w, self.eps).view(x.shape)
        if self._fused_norm:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return rms_norm(x, w, self.eps, self.gemma_norm)

    # -- public API -------------------------------------------------------------------------
    def new_kv(self, lo: int = 0, hi: int | None = None) -> SessionKV:
        hi = self.num_layers if hi is None else hi
        if not 0 <= lo < hi <= self.num_layers:
            raise ValueError(f"new_kv: range [{lo}, {hi}) outside [0, {self.num_layers}]")
        return SessionKV(lo, hi, self.kv_heads, self.head_dim, self.dtype, self.device)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids.long().to(self.device), self.embed_w)
        return x if self.embed_scale is None else x * self.embed_scale

    def embed(self, token_ids) -> torch.Tensor:
        """Layer-0 input for token ids (scaled where the family scales embeddings), on the CPU."""
        if self.embed_w is None:
            raise ValueError(f"runner holds layers [{self.lo}, {self.hi}): no embeddings")
        return self._embed(torch.as_tensor(token_ids, dtype=torch.long)).cpu()

    def window(self, layer: int) -> int | None:
        """Sliding window of `layer` (a query at q sees keys in (q - window, q]) or None."""
        return self.plans[layer].window

    def rope_rows(self, positions: torch.Tensor) -> dict:
        """Per RoPE kind, cos/sin rows [T, 1, rot] for `positions`, from tables grown
        geometrically. Each row is computed with transformers' own elementwise ops, so indexing
        a table changes no bit."""
        need = int(positions.max()) + 1
        positions = positions.to(self.device)
        out = {}
        for key, (inv_freq, scale) in self.rope.items():
            cos, sin = self.rope_tables.get(key, (None, None))
            if cos is None or need > cos.shape[0]:
                n = max(need, 2 * (cos.shape[0] if cos is not None else 0), 256)
                freqs = torch.arange(n, dtype=torch.float)[:, None] * inv_freq.float()
                emb = torch.cat((freqs, freqs), dim=-1)
                cos = (emb.cos() * scale).to(device=self.device, dtype=self.dtype)
                sin = (emb.sin() * scale).to(device=self.device, dtype=self.dtype)
                self.rope_tables[key] = (cos, sin)
            out[key] = (cos[positions][:, None], sin[positions][:, None])
        return out

    def attention_inputs(self, layer: int, x: torch.Tensor, rope: dict
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm, q|k|v product (+ bias), q/k norms and RoPE for T rows of `layer`.
        Returns q [T, heads, hd], k and v [T, kv_heads, hd]."""
        w = self.layers[layer - self.lo]
        T, nh, nkv, hd = x.shape[0], self.n_heads, self.kv_heads, self.head_dim
        qkv = self.linear(self.norm(x, w["in_norm"]), w["qkv"], w["qkv_b"])
        qk = qkv[:, : (nh + nkv) * hd].view(T, nh + nkv, hd)
        if "q_norm" in w:
            qk = torch.cat((self.norm(qk[:, :nh], w["q_norm"]),
                            self.norm(qk[:, nh:], w["k_norm"])), dim=1)
        cos, sin = rope[self.plans[layer].rope]
        qk = apply_rope(qk, cos, sin)
        return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * hd:].view(T, nkv, hd)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [B, heads, n, hd] over k, v [B, kv_heads, S, hd]; `mask` (bool, True =
        visible, broadcastable to [B, heads, n, S]) or None. Gemma 2's logit soft-capping needs
        the scores themselves, so it runs as transformers' eager attention does."""
        if self.attn_softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.attn_scale,
                                                  enable_gqa=True)
        groups = self.n_heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scale = self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5
        s = torch.matmul(q, k.transpose(2, 3)) * scale
        s = torch.tanh(s / self.attn_softcap) * self.attn_softcap
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)

    def layer_output(self, layer: int, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Residual stream after `layer` given its attention output att [T, heads * hd]:
        output product, (Gemma's sandwich norms), MLP."""
        w = self.layers[layer - self.lo]
        a = self.linear(att, w["o"], w["o_b"])
        if "post_attn_norm" in w:
            a = self.norm(a, w["post_attn_norm"])
        if self._kernels:
            x, h = kernels.add_rms_norm(x, a, w["pre_mlp_norm"], self.eps)
        else:
            x = x + a
            h = self.norm(x, w["pre_mlp_norm"])
        gu = self.linear(h, w["gate_up"], w["gate_up_b"])
        inter = gu.shape[1] // 2
        h = kernels.silu_mul(gu) if self._kernel_swiglu else self.act(gu[:, :inter]) * gu[:, inter:]
        m = self.linear(h, w["down"], w["down_b"])
        if "post_mlp_norm" in w:
            m = self.norm(m, w["post_mlp_norm"])
        return x + m

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and (Gemma 2) final soft-capping: float32 logits on the device."""
        if self.lm_head is None:
            raise ValueError(f"runner holds layers [{self.lo}, {self.hi}): no LM head")
        out = self.linear(self.norm(h, self.norm_w), self.lm_head).float()
        if self.final_softcap is not None:
            out = torch.tanh(out / self.final_softcap) * self.final_softcap
        return out

    def _check(self, segments: list[Segment], a: int, b: int) -> list[int]:
        """Validate a call; returns each segment's starting position."""
        if not self.lo <= a < b <= self.hi:
            raise ValueError(f"forward range [{a}, {b}) outside this runner's [{self.lo}, {self.hi})")
        if not segments:
            raise ValueError("forward: no segments")
        if len({id(s.kv) for s in segments}) != len(segments):
            raise ValueError("forward: a session's KV appears in two segments of one call")
        starts = []
        for i, s in enumerate(segments):
            kv = s.kv
            if not kv.lo <= a < b <= kv.hi:
                raise ValueError(f"segment {i}: range [{a}, {b}) outside its KV's [{kv.lo}, {kv.hi})")
            if a == 0:
                if s.x.dim() != 1 or s.x.dtype not in (torch.int64, torch.int32):
                    raise ValueError(f"segment {i}: at layer 0, x must be a 1-D integer tensor of "
                                     f"token ids, got {s.x.dtype} {tuple(s.x.shape)}")
            elif s.x.dim() != 2 or s.x.shape[1] != self.hidden_size or not s.x.is_floating_point():
                raise ValueError(f"segment {i}: x must be float [n, {self.hidden_size}], "
                                 f"got {s.x.dtype} {tuple(s.x.shape)}")
            if s.x.shape[0] == 0:
                raise ValueError(f"segment {i}: no new tokens")
            if (s.positions is None) != (s.ancestors is None) or (s.ancestors is not None and (
                    s.positions.shape != (s.x.shape[0],) or s.ancestors.dtype != torch.bool
                    or s.ancestors.shape != (s.x.shape[0], s.x.shape[0]))):
                raise ValueError(f"segment {i}: a tree needs positions [n] and a bool ancestors "
                                 f"[n, n] together (n = {s.x.shape[0]})")
            if b == self.num_layers and s.logits not in ("last", "all"):
                raise ValueError(f"segment {i}: logits must be 'last' or 'all', got {s.logits!r}")
            lens = kv.lens[a - kv.lo: b - kv.lo]
            if min(lens) != max(lens):
                raise ValueError(f"segment {i}: cache lengths differ across layers [{a}, {b}): "
                                 f"{lens}; run the missing earlier range first")
            starts.append(lens[0])
        return starts

    def _session_mask(self, p: int, n: int, window: int | None) -> tuple[int, torch.Tensor | None]:
        """For n new tokens at positions p..p+n-1: the first visible key and the mask over keys
        [first, p + n) (None when every one of them is visible to every query)."""
        first = _first_key(p, window)
        if n == 1 and (window is None or first == max(0, p - window + 1)):
            return first, None
        keys = torch.arange(first, p + n, device=self.device)[None, :]
        queries = torch.arange(p, p + n, device=self.device)[:, None]
        visible = keys <= queries
        if window is not None:
            visible &= keys > queries - window
        return first, visible

    def _tree_mask(self, p: int, s: Segment, window: int | None) -> tuple[int, torch.Tensor]:
        """`_session_mask` for a tree segment: token i at position p + positions[i] sees every
        cached key (within the window) and the new tokens its `ancestors` row names."""
        pos = p + s.positions.to(self.device)
        first = _first_key(p, window)
        cached = torch.arange(first, p, device=self.device)[None, :].expand(len(pos), -1)
        visible = torch.cat((cached <= pos[:, None], s.ancestors.to(self.device)), dim=1)
        if window is not None:
            keys = torch.cat((torch.arange(first, p, device=self.device), pos))[None, :]
            visible &= keys > pos[:, None] - window
        return first, visible

    def _torch_attend(self, layer: int, x: torch.Tensor, rope: dict, segments, starts, sizes,
                      offsets, masks) -> torch.Tensor:
        """`attention_inputs`, each segment's K/V written to its cache and `attend` per segment,
        in torch's ops: attention output [T, heads * hd]."""
        nh, hd = self.n_heads, self.head_dim
        q, k, v = self.attention_inputs(layer, x, rope)
        q = q.transpose(0, 1)[None]                        # [1, nh, T, hd]
        k, v = k.transpose(0, 1), v.transpose(0, 1)        # [nkv, T, hd]
        outs = []
        for s, p, n, o, (first, mask) in zip(segments, starts, sizes, offsets,
                                             masks[self.plans[layer].window]):
            buf = s.kv.bufs[layer - s.kv.lo]
            buf[0, :, p: p + n] = k[:, o: o + n]
            buf[1, :, p: p + n] = v[:, o: o + n]
            outs.append(self.attend(q[:, :, o: o + n], buf[0:1, :, first: p + n],
                                    buf[1:2, :, first: p + n], mask))
        att = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return att[0].transpose(0, 1).reshape(x.shape[0], nh * hd)

    def _kernel_attend(self, layer: int, x: torch.Tensor, rope: dict, batch, segments) -> torch.Tensor:
        """`attention_inputs` + the per-segment K/V writes and `attend` of `forward`, with RoPE,
        the writes and attention in one kernel call for every segment (common/cpu_kernels.c)."""
        w = self.layers[layer - self.lo]
        nh, nkv, hd = self.n_heads, self.kv_heads, self.head_dim
        qkv = self.linear(self.norm(x, w["in_norm"]), w["qkv"], w["qkv_b"])
        if "q_norm" in w:
            qk = qkv[:, : (nh + nkv) * hd].view(-1, nh + nkv, hd)
            qk.copy_(torch.cat((self.norm(qk[:, :nh], w["q_norm"]),
                                self.norm(qk[:, nh:], w["k_norm"])), dim=1))
        cos, sin = rope[self.plans[layer].rope]
        return kernels.attention(
            qkv, nh, nkv, hd, cos.contiguous(), sin.contiguous(), batch,
            self.plans[layer].window, [s.kv.bufs[layer - s.kv.lo] for s in segments],
            self._kernel_scale)

    def _kernel_forward(self, x: torch.Tensor, rope: dict, batch, segments, a: int,
                        b: int) -> torch.Tensor:
        """Layers [a, b) as one tdm_layers call."""
        rope = {k: (c.contiguous(), s_.contiguous()) for k, (c, s_) in rope.items()}
        layers = range(a, b)
        return self._kernel_layers(
            a - self.lo, x.contiguous(), [rope[self.plans[layer].rope] for layer in layers],
            batch, [self.plans[layer].window for layer in layers],
            [[s.kv.bufs[layer - s.kv.lo] for s in segments] for layer in layers])

    @torch.inference_mode()
    def forward(self, segments: list[Segment], a: int, b: int) -> list[torch.Tensor]:
        """Run layers [a, b) for all segments as one ragged batch and append their K/V.

        Returns per segment the hidden state after layer b-1 ([n, hidden], runner dtype) when
        b < L, or float32 logits ([1, V] or [n, V] per `Segment.logits`) when b == L, on the CPU
        whatever the runner's device (inputs may be on either)."""
        starts = self._check(segments, a, b)
        sizes = [s.x.shape[0] for s in segments]
        dev = self.device
        if a == 0:
            x = self._embed(torch.cat([s.x for s in segments]))
        else:
            x = torch.cat([s.x.to(device=dev, dtype=self.dtype) for s in segments])
        positions = torch.cat([torch.arange(p, p + n) if s.positions is None else p + s.positions
                               for s, p, n in zip(segments, starts, sizes)])
        rope = self.rope_rows(positions)
        # Per distinct window of the layers run: each session's first visible key and mask
        # (a session with n > 1 new tokens needs the bottom-right causal mask; one token sees
        # every cached key, or the last `window` of them).
        masks = {w: [self._session_mask(p, n, w) if s.ancestors is None else self._tree_mask(p, s, w)
                     for s, p, n in zip(segments, starts, sizes)]
                 for w in {self.plans[layer].window for layer in range(a, b)}}
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)

        # Room for the new tokens at every layer up front; lengths move only after the last
        # layer, so a call that fails midway leaves every cache as it was.
        for s, p, n in zip(segments, starts, sizes):
            s.kv.reserve(a, b, p + n)
        batch = (kernels.AttentionBatch(offsets, sizes, starts, masks)
                 if self._kernel_attention else None)
        if self._kernel_layers is not None:
            x = self._kernel_forward(x, rope, batch, segments, a, b)
        else:
            for layer in range(a, b):
                att = (self._kernel_attend(layer, x, rope, batch, segments) if batch is not None
                       else self._torch_attend(layer, x, rope, segments, starts, sizes, offsets,
                                               masks))
                x = self.layer_output(layer, x, att)
        for s, p, n in zip(segments, starts, sizes):
            s.kv.lens[a - s.kv.lo: b - s.kv.lo] = [p + n] * (b - a)

        if b < self.num_layers:
            return list(x.cpu().split(sizes))
        rows = [torch.arange(o, o + n) if s.logits == "all" else torch.tensor([o + n - 1])
                for s, o, n in zip(segments, offsets, sizes)]
        logits = self.logits(x[torch.cat(rows).to(dev)]).cpu()
        return list(logits.split([len(r) for r in rows]))
