"""The runner's CPU matrix product: common/gemm_kernel.c (panel-packed fp32 weights, AVX2 +
FMA, OpenMP), built once with the system C compiler and called through ctypes.

    kernel = gemm.load()           # None where it cannot run here (why: gemm.unavailable())
    wp = gemm.pack(w)              # [N, K] fp32 -> PanelWeight, once at load
    y = gemm.linear(x, wp, bias)   # x [M, K] -> [M, N], any M

Building: the library is compiled on first use (~1 s) into a folder named after the source
and the flags, beside this file (`common/_build/`, where a package install can prebuild it:
`python -m common.gemm`) or, where that is not writable, under the user's cache; a second
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

SOURCE = Path(__file__).with_name("gemm_kernel.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
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
        lib = d / "libtandem_gemm.so"
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
    _lib.tdm_pack.argtypes = [vp, lng, lng, vp]
    _lib.tdm_pack.restype = None
    _lib.tdm_linear.argtypes = [vp, lng, lng, vp, lng, vp, vp, ctypes.c_int]
    _lib.tdm_linear.restype = None
    return _lib


def unavailable() -> str | None:
    """Why the kernel cannot be used here, or None if it can."""
    load()
    return _why


def pack(w: torch.Tensor) -> PanelWeight:
    """[N, K] fp32 CPU weight -> its panel layout (a copy; `w` may be freed after)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the gemm kernel is unavailable: {_why}")
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
        raise ValueError(f"pack: need a 2-D fp32 CPU tensor, got {w.dtype} {tuple(w.shape)} "
                         f"on {w.device}")
    w = w.contiguous()
    n, k = w.shape
    data = torch.empty((n + PANEL - 1) // PANEL, k, PANEL)
    lib.tdm_pack(w.data_ptr(), n, k, data.data_ptr())
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


if __name__ == "__main__":   # prebuild (package installs, images): python -m common.gemm
    if load() is None:
        print(f"gemm kernel unavailable: {_why}", file=sys.stderr)
        sys.exit(1)
    print(f"gemm kernel: {_lib._name}")
