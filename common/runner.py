"""LayerRangeRunner: runs any contiguous layer range [a, b) of a Llama model for a ragged batch of
sessions, each with its own KV cache and its own number of new tokens (DySCo's dyForward).

One runner serves the verifier ([0, L), many sessions, k draft tokens each), the prefix ([0, c))
and the suffix ([c, L), sessions at different cuts, cascaded range by range within a step).

How a forward call is laid out (T = all new tokens of all segments, concatenated):
* projections and MLPs run once per layer over all T tokens (q/k/v fused, gate/up fused);
* RoPE uses per-token positions, which start at each session's cache length at layer a;
* attention runs per session against its own KV (no padding, no merge/split), with a causal
  mask only where a session has more than one new token;
* each session's KV lives in per-layer buffers [2, kv_heads, capacity, head_dim] that grow
  geometrically; truncation only moves the per-layer lengths.

Matrix products go through oneDNN with weights pre-reordered into its blocked layout, not through
torch's default MKL sgemm. Measured on the 2-core AMD EPYC (Zen, AVX-512) this project runs on,
median ms, 2 threads (bench/bench_runner.py --gemm reproduces it):

    LM head 49152x576, rows:      1      2      8     64    512
    F.linear (MKL sgemm)         6.8   13.5   11.0   31.8   175
    mm(W, x.T) (MKL, swapped)    6.9    2.4    5.4   24.0   160
    numpy x @ W.T (OpenBLAS)     2.2    6.0    5.2   19.9     -
    oneDNN, plain weight         2.4    3.5    4.1   10.1     -
    oneDNN, prepacked weight     2.3    2.3    2.5    8.4     85

Why MKL is pathological here. MKL_VERBOSE shows that torch calls SGEMM(T,N, m=49152, n=rows,
k=576): the weight is the huge transposed operand and the few rows are n. For n=1 MKL never
reaches a bandwidth-bound gemv (6.8 ms, while OpenBLAS and oneDNN stream the same 113 MB in
2.2 ms, ~50 GB/s); n=2 costs two such passes (13.5 ms); from n~4 the time (11 ms for 8 rows) is
that of a blocked gemm that re-packs the weight panel on every call. Handing MKL the same
product with the operands swapped (m=rows, mm(W, x.T)) halves it, so MKL's small-n path is
the first cause. The second is vendor dispatch: MKL's timings do not move under
MKL_ENABLE_INSTRUCTIONS=SSE4_2 and its large-batch throughput is half of oneDNN's, consistent
with MKL running no AVX-512 kernels on this AMD CPU, while oneDNN picks kernels by CPUID
features. Prepacking the weight once (hint: 8 rows) also removes oneDNN's per-call reorder. The
decoder projections (at most 7 MB) show the same pattern at 8 rows (gate/up 0.27 ms MKL vs
0.08 ms prepacked oneDNN), so every projection is prepacked.

Devices. `device="cuda"` (or "cuda:N") puts the weights, the KV caches and the RoPE tables on
that GPU and runs every product as plain F.linear (the oneDNN prepacking above is CPU-only);
inputs may be CPU tensors and outputs come back on the CPU, so callers (the services, the suffix
executor's padded path) are unchanged. Asking for CUDA where torch cannot use it is an error at
load, saying why (`resolve_device`).

Accuracy: transformers runs MKL, so logits differ from it by ~1e-4 (sums in another order), as
much as transformers differs from itself between prefill and token-by-token decode. Prepacked
oneDNN rows are also independent of the batch size (bit-equal for 2..128 rows; one row takes a
gemv path in the down projection), which MKL's are not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# The row count oneDNN tunes its blocked weight layout for. Decode (1 row), ragged decode batches
# and k-token verification (8) run at bandwidth speed with it. Prefill pays some: gate/up on 512
# rows takes 8.0 ms in this layout vs 3.5 ms in one tuned for 512 (MKL: 8.6 ms); a whole 512-token
# prefill still takes half of transformers' time (1.5 s vs 3.1 s, measured at load 6).
PACK_ROWS = 8
# RoPE types whose inverse frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


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

    def length(self, layer: int | None = None) -> int:
        """Tokens cached at `layer` (default lo). Layers of one range differ only mid-cascade."""
        return self.lens[(self.lo if layer is None else layer) - self.lo]

    def truncate(self, n_keep: int) -> None:
        """Roll back to the first n_keep tokens at every layer (layers holding fewer keep theirs)."""
        if n_keep < 0:
            raise ValueError(f"truncate: n_keep must be >= 0, got {n_keep}")
        self.lens = [min(n, n_keep) for n in self.lens]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs if b is not None)

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
        return buf


@dataclass
class Segment:
    """One session's share of a ragged batch."""

    kv: SessionKV
    x: torch.Tensor      # LongTensor [n] token ids when a == 0, else float [n, hidden]
    logits: str = "last"  # when b == L: "last" -> [1, V], "all" -> [n, V]; ignored when b < L


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operations, same order as transformers' LlamaRMSNorm (bitwise-equal results).
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _safetensors_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for single-file and sharded checkpoints."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{model_dir}: no model.safetensors(.index.json); only safetensors "
                         "checkpoints are supported")
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


class LayerRangeRunner:
    """Layers [lo, hi) of a Llama model (embeddings if lo == 0, final norm + LM head if hi == L)."""

    def __init__(self, model_dir: str | Path, layers: tuple[int, int] | None = None,
                 dtype: torch.dtype = torch.float32, threads: int | None = None,
                 prepack: bool = True, device: str | torch.device = "cpu"):
        model_dir = Path(model_dir)
        self.device = resolve_device(device)
        raw = json.loads((model_dir / "config.json").read_text())
        if raw.get("model_type") != "llama":
            raise ValueError(f"LayerRangeRunner supports Llama models only; {model_dir} has "
                             f"model_type {raw.get('model_type')!r}")
        from transformers import LlamaConfig  # noqa: PLC0415

        cfg = LlamaConfig.from_pretrained(str(model_dir))
        if cfg.attention_bias or cfg.mlp_bias or cfg.hidden_act != "silu":
            raise ValueError(f"{model_dir}: Llama variant not supported (attention_bias="
                             f"{cfg.attention_bias}, mlp_bias={cfg.mlp_bias}, act={cfg.hidden_act})")
        rope_type = cfg.rope_parameters.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"{model_dir}: rope_type {rope_type!r} not supported "
                             f"(one of {sorted(STATIC_ROPE_TYPES)})")
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
        # oneDNN's blocked layout needs a CPU with the dtype's kernels; otherwise plain F.linear.
        self.prepack = prepack and self.device.type == "cpu" and (
            torch.backends.mkldnn.is_available()) and (
            dtype == torch.float32
            or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))

        if rope_type == "default":
            inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (
                torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
            self.rope_scale = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415

            inv_freq, self.rope_scale = ROPE_INIT_FUNCTIONS[rope_type](cfg)
        self.inv_freq = inv_freq
        self.cos = self.sin = torch.empty(0, self.head_dim, dtype=dtype,
                                          device=self.device)  # table by position

        where = _safetensors_index(model_dir)
        from safetensors import safe_open  # noqa: PLC0415

        handles: dict[Path, object] = {}

        def get(name: str) -> torch.Tensor:
            if name not in where:
                raise ValueError(f"{model_dir}: checkpoint lacks tensor {name}")
            f = handles.get(where[name])
            if f is None:
                f = handles[where[name]] = safe_open(str(where[name]), framework="pt")
            return f.get_tensor(name).to(device=self.device, dtype=dtype)

        self.embed_w = get("model.embed_tokens.weight") if self.lo == 0 else None
        self.layers = []  # index l - lo
        for i in range(self.lo, self.hi):
            p = f"model.layers.{i}."
            self.layers.append({
                "in_norm": get(p + "input_layernorm.weight"),
                "post_norm": get(p + "post_attention_layernorm.weight"),
                # one product for q|k|v and one for gate|up: rows concatenated in that order
                "qkv": self._pack(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])),
                "o": self._pack(get(p + "self_attn.o_proj.weight")),
                "gate_up": self._pack(torch.cat([get(p + "mlp.gate_proj.weight"),
                                                 get(p + "mlp.up_proj.weight")])),
                "down": self._pack(get(p + "mlp.down_proj.weight")),
            })
        if self.hi == L:
            self.norm_w = get("model.norm.weight")
            head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            self.lm_head = self._pack(get(head))
        else:
            self.norm_w = self.lm_head = None
        handles.clear()

    # -- products ---------------------------------------------------------------------------
    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        if self.prepack:
            return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        return w.contiguous()

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.prepack:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return F.linear(x, w)

    # -- public API -------------------------------------------------------------------------
    def new_kv(self, lo: int = 0, hi: int | None = None) -> SessionKV:
        hi = self.num_layers if hi is None else hi
        if not 0 <= lo < hi <= self.num_layers:
            raise ValueError(f"new_kv: range [{lo}, {hi}) outside [0, {self.num_layers}]")
        return SessionKV(lo, hi, self.kv_heads, self.head_dim, self.dtype, self.device)

    def embed(self, token_ids) -> torch.Tensor:
        if self.embed_w is None:
            raise ValueError(f"runner holds layers [{self.lo}, {self.hi}): no embeddings")
        ids = torch.as_tensor(token_ids, dtype=torch.long).to(self.device)
        return F.embedding(ids, self.embed_w).cpu()

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`, from a table grown geometrically. Each row is computed
        with transformers' own elementwise ops, so indexing the table changes no bit."""
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 256)
            freqs = torch.arange(n, dtype=torch.float)[:, None] * self.inv_freq.float()
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos = (emb.cos() * self.rope_scale).to(device=self.device, dtype=self.dtype)
            self.sin = (emb.sin() * self.rope_scale).to(device=self.device, dtype=self.dtype)
        positions = positions.to(self.device)
        return self.cos[positions], self.sin[positions]

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
            if b == self.num_layers and s.logits not in ("last", "all"):
                raise ValueError(f"segment {i}: logits must be 'last' or 'all', got {s.logits!r}")
            lens = kv.lens[a - kv.lo: b - kv.lo]
            if min(lens) != max(lens):
                raise ValueError(f"segment {i}: cache lengths differ across layers [{a}, {b}): "
                                 f"{lens}; run the missing earlier range first")
            starts.append(lens[0])
        return starts

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
            x = F.embedding(torch.cat([s.x for s in segments]).long().to(dev), self.embed_w)
        else:
            x = torch.cat([s.x.to(device=dev, dtype=self.dtype) for s in segments])
        T = x.shape[0]
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, sizes)]).to(dev)
        cos, sin = self._rope_tables(positions)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        # A session with n > 1 new tokens needs the bottom-right causal mask over its
        # start + n keys (query i sees keys <= start + i); a single token sees everything.
        masks = [None if n == 1 else torch.ones(n, p + n, dtype=torch.bool, device=dev).tril(p)
                 for p, n in zip(starts, sizes)]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)

        # Room for the new tokens at every layer up front; lengths move only after the last
        # layer, so a call that fails midway leaves every cache as it was.
        for s, p, n in zip(segments, starts, sizes):
            for i in range(a - s.kv.lo, b - s.kv.lo):
                s.kv._reserve(i, p + n)
        nh, nkv, hd = self.n_heads, self.kv_heads, self.head_dim
        nqk = (nh + nkv) * hd
        for layer in range(a, b):
            w = self.layers[layer - self.lo]
            h = _rms_norm(x, w["in_norm"], self.eps)
            qkv = self._linear(h, w["qkv"])  # [T, (nh + 2 nkv) hd]: q | k | v
            qkv[:, :nqk] = _rope(qkv[:, :nqk].view(T, nh + nkv, hd), cos, sin).view(T, nqk)
            q = qkv[:, : nh * hd].view(T, nh, hd).transpose(0, 1)[None]   # [1, nh, T, hd]
            kv_new = qkv[:, nqk - nkv * hd:].view(T, 2, nkv, hd).permute(1, 2, 0, 3)  # [2, nkv, T, hd]
            outs = []
            for s, p, n, o, mask in zip(segments, starts, sizes, offsets, masks):
                buf = s.kv.bufs[layer - s.kv.lo]
                buf[:, :, p: p + n] = kv_new[:, :, o: o + n]
                outs.append(F.scaled_dot_product_attention(
                    q[:, :, o: o + n], buf[0:1, :, : p + n], buf[1:2, :, : p + n],
                    attn_mask=mask, enable_gqa=True))
            att = torch.cat(outs, dim=2)[0].transpose(0, 1).reshape(T, nh * hd)
            x = x + self._linear(att, w["o"])
            gu = self._linear(_rms_norm(x, w["post_norm"], self.eps), w["gate_up"])
            inter = gu.shape[1] // 2
            x = x + self._linear(F.silu(gu[:, :inter]) * gu[:, inter:], w["down"])
        for s, p, n in zip(segments, starts, sizes):
            s.kv.lens[a - s.kv.lo: b - s.kv.lo] = [p + n] * (b - a)

        if b < self.num_layers:
            return list(x.cpu().split(sizes))
        rows = [torch.arange(o, o + n) if s.logits == "all" else torch.tensor([o + n - 1])
                for s, o, n in zip(segments, offsets, sizes)]
        h = _rms_norm(x[torch.cat(rows).to(dev)], self.norm_w, self.eps)
        logits = self._linear(h, self.lm_head).float().cpu()
        return list(logits.split([len(r) for r in rows]))
