"""The runner's CPU kernels: common/cpu_kernels.c (fp32, AVX2 + FMA, OpenMP; products of 4 rows or
more in AVX-512 where the CPU has it, chosen at run time: `isa()`), built once with
the system C compiler and called through ctypes: the products on panel-packed weights, RMSNorm,
residual + norm, SwiGLU, one layer's attention for a ragged batch, and whole pre-norm SwiGLU
decoder layers, a forward's range of them in one call (`LayerStack`).

    lib = cpu_kernels.load()              # None where it cannot run here (why: unavailable())
    wp = cpu_kernels.pack(w)              # [N, K] fp32 -> PanelWeight, once at load
    y = cpu_kernels.linear(x, wp, bias)   # x [M, K] -> [M, N], any M

Building: the library is compiled on first use (~2 s) into a folder named after the source
and the flags, beside this file (`common/_build/`, where a package install can prebuild it:
`python -m common.cpu_kernels`) or, where that is not writable, under the user's cache; a second
process finds it there. It links the OpenMP runtime that torch has already loaded (the same
`libgomp.so.1`), so its threads are torch's threads, not a second pool spinning on the same
cores.

Where it is unavailable (no AVX2/FMA, no C compiler, not x86-64) the runner keeps oneDNN's
prepacked products; `unavailable()` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-lm"]
PANEL = 16   # output rows per panel (PW in the C source)

_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False


@dataclass(frozen=True)
class PanelWeight:
    """A [out_features, in_features] fp32 matrix in the kernel's panel layout."""

    data: torch.Tensor      # [panels, in_features, 16], contiguous
    out_features: int

    @property
    def in_features(self) -> int:
        return self.data.shape[1]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _cpu_supported() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2/FMA (torch reports {torch.backends.cpu.get_cpu_capability()})"
    return None


def _build_dirs(key: str) -> list[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [Path(__file__).with_name("_build") / key, cache / "tandem" / "kernels" / key]


def _compile(out: Path, cc: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, out)   # atomic: a process starting at the same time sees all or nothing
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None where it cannot run here (see unavailable())."""
    global _lib, _why, _tried
    if _tried:
        return _lib
    _tried = True
    _why = _cpu_supported()
    if _why is not None:
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    errors = []
    for d in _build_dirs(key):
        lib = d / "libtandem_kernels.so"
        try:
            if not lib.is_file():
                if cc is None:
                    errors.append("no C compiler (cc/gcc) to build it")
                    break
                _compile(lib, cc)
            _lib = ctypes.CDLL(str(lib))
            break
        except subprocess.CalledProcessError as e:
            errors.append(f"{cc} failed: {e.stderr.strip()[-500:]}")
            break
        except OSError as e:   # an unwritable folder: try the next one
            errors.append(f"{d}: {e}")
    if _lib is None:
        _why = "; ".join(errors) or "not built"
        return None
    vp, lng = ctypes.c_void_p, ctypes.c_long
    _lib.tdm_pack.argtypes = [vp, lng, lng, vp, ctypes.c_int]
    _lib.tdm_linear.argtypes = [vp, lng, lng, vp, lng, vp, vp, ctypes.c_int]
    _lib.tdm_rms_norm.argtypes = [vp, lng, lng, vp, ctypes.c_float, vp, ctypes.c_int]
    _lib.tdm_add_rms_norm.argtypes = [vp, vp, lng, lng, vp, ctypes.c_float, vp, vp, ctypes.c_int]
    _lib.tdm_silu_mul.argtypes = [vp, lng, lng, vp, ctypes.c_int]
    _lib.tdm_attention.argtypes = [vp, lng, lng, lng, lng, lng, vp, vp, lng,
                                   lng, vp, vp, vp, vp, ctypes.c_float, vp, ctypes.c_int]
    _lib.tdm_layers.argtypes = [lng, vp, vp, lng, vp, vp, ctypes.c_float, vp, vp, vp, lng, vp,
                                vp, vp, vp, ctypes.c_float, vp, ctypes.c_int]
    _lib.tdm_layers.restype = ctypes.c_int
    _lib.tdm_fma_peak.argtypes = [lng, ctypes.c_int]
    _lib.tdm_fma_peak.restype = ctypes.c_double
    _lib.tdm_isa.argtypes = []
    _lib.tdm_isa.restype = ctypes.c_int
    _lib.tdm_set_isa.argtypes = [ctypes.c_int]
    _lib.tdm_set_isa.restype = ctypes.c_int
    for f in (_lib.tdm_pack, _lib.tdm_linear, _lib.tdm_rms_norm, _lib.tdm_add_rms_norm,
              _lib.tdm_silu_mul, _lib.tdm_attention):
        f.restype = None
    return _lib


def unavailable() -> str | None:
    """Why the kernel cannot be used here, or None if it can."""
    load()
    return _why


def pack(w: torch.Tensor) -> PanelWeight:
    """[N, K] fp32 CPU weight -> its panel layout (a copy; `w` may be freed after), on torch's
    threads (a service started with --threads 1 packs on one core too)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {_why}")
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
        raise ValueError(f"pack: need a 2-D fp32 CPU tensor, got {w.dtype} {tuple(w.shape)} "
                         f"on {w.device}")
    w = w.contiguous()
    n, k = w.shape
    data = torch.empty((n + PANEL - 1) // PANEL, k, PANEL)
    lib.tdm_pack(w.data_ptr(), n, k, data.data_ptr(), torch.get_num_threads())
    return PanelWeight(data, n)


def linear(x: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] fp32, on torch's threads."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"linear: x must be fp32 [M, {w.in_features}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    x = x.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError("linear: bias must be a contiguous fp32 tensor")
    y = torch.empty(x.shape[0], w.out_features)
    _lib.tdm_linear(x.data_ptr(), x.shape[0], x.shape[1], w.data.data_ptr(), w.out_features,
                    None if bias is None else bias.data_ptr(), y.data_ptr(),
                    torch.get_num_threads())
    return y


def isa() -> int:
    """The products' vector width in bits: 512 where the CPU has AVX-512F, else 256 (AVX2)."""
    return _lib.tdm_isa()


def set_isa(width: int) -> int:
    """Use `width` (256 or 512) for the products from now on, where the CPU allows; returns the
    width in use. Both give the same bits; the tests and the bench compare them."""
    return _lib.tdm_set_isa(width)


def _f32(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{what} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    return t.contiguous()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """(x * rsqrt(mean(x^2) + eps)) * w over the last dimension of x [T, H]."""
    x, w = _f32(x, "rms_norm x"), _f32(w, "rms_norm w")
    y = torch.empty_like(x)
    _lib.tdm_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), eps, y.data_ptr(),
                      torch.get_num_threads())
    return y


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual step and the next norm: (x + a, rms_norm(x + a, w)), x and a [T, H]."""
    x, a, w = _f32(x, "add_rms_norm x"), _f32(a, "add_rms_norm a"), _f32(w, "add_rms_norm w")
    if a.shape != x.shape:
        raise ValueError(f"add_rms_norm: shapes {tuple(x.shape)} and {tuple(a.shape)} differ")
    xo, y = torch.empty_like(x), torch.empty_like(x)
    _lib.tdm_add_rms_norm(x.data_ptr(), a.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), eps,
                          xo.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return xo, y


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused gate|up product gu [T, 2 * inter] -> [T, inter]."""
    gu = _f32(gu, "silu_mul input")
    inter = gu.shape[1] // 2
    y = torch.empty(gu.shape[0], inter)
    _lib.tdm_silu_mul(gu.data_ptr(), gu.shape[0], inter, y.data_ptr(), torch.get_num_threads())
    return y


class AttentionBatch:
    """What one ragged forward's attention calls share across layers: each segment's first
    row, token count, cache position and (per sliding window) first visible key and mask."""

    def __init__(self, offsets: list[int], sizes: list[int], starts: list[int],
                 masks: dict[int | None, list[tuple[int, torch.Tensor | None]]]):
        self.nseg = len(sizes)
        self.seg = {}
        self.masks = {}
        self._keep = []   # the mask tensors whose addresses the C side reads
        for window, per_seg in masks.items():
            self.seg[window] = torch.tensor(
                [[o, n, p, first] for o, n, p, (first, _) in zip(offsets, sizes, starts, per_seg)],
                dtype=torch.long)
            ptrs = []
            for _, m in per_seg:
                if m is None:
                    ptrs.append(None)
                else:
                    m = m.contiguous()
                    self._keep.append(m)
                    ptrs.append(m.data_ptr())
            self.masks[window] = (ctypes.c_void_p * self.nseg)(*ptrs)

    def buffers(self, bufs: list[torch.Tensor]):
        """Cache buffers [2, nkv, cap, hd], a segment each (layer after layer for several
        layers): (addresses, capacities)."""
        return ((ctypes.c_void_p * len(bufs))(*[b.data_ptr() for b in bufs]),
                (ctypes.c_long * len(bufs))(*[b.shape[2] for b in bufs]))


def attention(qkv: torch.Tensor, nh: int, nkv: int, hd: int, cos: torch.Tensor,
              sin: torch.Tensor, batch: AttentionBatch, window: int | None,
              bufs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """RoPE, the new K/V into each segment's cache buffer bufs[s] ([2, nkv, cap, hd]) and
    attention, for a layer's q|k|v product qkv [T, (nh + 2 nkv) hd] (modified in place: q is
    rotated there). Returns [T, nh * hd]."""
    T = qkv.shape[0]
    out = torch.empty(T, nh * hd)
    ptrs, caps = batch.buffers(bufs)
    _lib.tdm_attention(qkv.data_ptr(), T, qkv.shape[1], nh, nkv, hd, cos.data_ptr(),
                       sin.data_ptr(), cos.shape[-1], batch.nseg, batch.seg[window].data_ptr(),
                       ptrs, caps, batch.masks[window], scale, out.data_ptr(),
                       torch.get_num_threads())
    return out


# tdm_layer's tensors, in the order of its LW_* indices
LAYER_TENSORS = ("in_norm", "q_norm", "k_norm", "pre_mlp_norm", "qkv", "qkv_b", "o", "o_b",
                 "gate_up", "gate_up_b", "down", "down_b")


class LayerStack:
    """Consecutive pre-norm SwiGLU decoder layers as `tdm_layers` runs them, any sub-range in one
    call: their tensors' addresses (the caller keeps the tensors) and dimensions."""

    def __init__(self, layers: list[dict], hidden: int, nh: int, nkv: int, hd: int, eps: float,
                 scale: float):
        def address(w, name):
            t = w.get(name)
            return None if t is None else (t.data if isinstance(t, PanelWeight) else t).data_ptr()

        self.n_layers = len(layers)
        self.inter = max(w["gate_up"].out_features // 2 for w in layers)
        self.ptrs = (ctypes.c_void_p * (len(layers) * len(LAYER_TENSORS)))(
            *[address(w, n) for w in layers for n in LAYER_TENSORS])
        self.dims = (ctypes.c_long * (5 * len(layers)))(
            *[d for w in layers for d in (hidden, nh, nkv, hd, w["gate_up"].out_features // 2)])
        self.hidden, self.nh, self.nkv, self.hd = hidden, nh, nkv, hd
        self.eps, self.scale = eps, scale

    def scratch_floats(self, T: int) -> int:
        return T * (2 * self.hidden + (self.nh + 2 * self.nkv) * self.hd + self.nh * self.hd
                    + 3 * self.inter)

    def __call__(self, first: int, x: torch.Tensor, rope: list[tuple[torch.Tensor, torch.Tensor]],
                 batch: AttentionBatch, windows: list[int | None],
                 bufs: list[list[torch.Tensor]]) -> torch.Tensor:
        """Layers first, first + 1, ... (one per entry of rope, windows and bufs: that layer's
        cos/sin rows [T, rot], sliding window, and each segment's cache buffer) applied to x
        [T, hidden] (contiguous fp32); appends each segment's K/V as `attention` does. Returns
        the output (x or a new tensor)."""
        n, nseg = len(rope), batch.nseg
        if not n == len(windows) == len(bufs) or any(len(b) != nseg for b in bufs):
            raise ValueError("LayerStack: one rope pair, window and buffer list per layer")
        if not (0 <= first and 0 < n and first + n <= self.n_layers):
            raise ValueError(f"LayerStack: layers [{first}, {first + n}) outside its "
                             f"{self.n_layers}")
        xo = torch.empty_like(x)
        scratch = torch.empty(self.scratch_floats(x.shape[0]))
        vp, lng = ctypes.c_void_p, ctypes.c_long
        lw = len(LAYER_TENSORS)
        ptrs, caps = batch.buffers([b for layer in bufs for b in layer])
        out = _lib.tdm_layers(
            n, x.data_ptr(), xo.data_ptr(), x.shape[0],
            ctypes.addressof(self.ptrs) + first * lw * ctypes.sizeof(vp),
            ctypes.addressof(self.dims) + first * 5 * ctypes.sizeof(lng), self.eps,
            (vp * n)(*[c.data_ptr() for c, _ in rope]), (vp * n)(*[s.data_ptr() for _, s in rope]),
            (lng * n)(*[c.shape[-1] for c, _ in rope]), nseg,
            (vp * n)(*[batch.seg[w].data_ptr() for w in windows]), ptrs, caps,
            (vp * n)(*[ctypes.addressof(batch.masks[w]) for w in windows]),
            self.scale, scratch.data_ptr(), torch.get_num_threads())
        return xo if out else x


def fma_flops(iters: int, threads: int) -> int:
    """Run `tdm_fma_peak` (12 FMA chains a thread on registers, at the products' vector width)
    and return the FLOP it did; FLOP over the call's wall time is the machine's fp32 FMA
    throughput on `threads`."""
    return int(_lib.tdm_fma_peak(iters, threads))


if __name__ == "__main__":   # prebuild (package installs, images): python -m common.cpu_kernels
    if load() is None:
        print(f"CPU kernels unavailable: {_why}", file=sys.stderr)
        sys.exit(1)
    print(f"CPU kernels: {_lib._name}")
