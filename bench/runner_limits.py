"""The limits the runner is measured against in every `tandem bench runner` run:

* the machine's read bandwidth: the fastest of a torch matrix-vector product, a plain sum and
  the runner's panel kernel over an fp32 buffer as large as the model's weights, on the bench's
  threads; the bandwidth floor of a decode step is then the bytes a step streams (every layer
  matrix, the norms and the LM head) over that bandwidth (a GEMV alone read 12-15 GB/s on the
  AMD EPYC where a sum read 35, and llama.cpp's products beat that "floor");
* the machine's fp32 compute: the FMA throughput of 12 register-only FMA chains a thread
  (common/cpu_kernels.c's tdm_fma_peak), no product can do fp32 multiply-adds faster; the
  compute floor of a forward over M rows is its products' FLOP over that, and its floor is the
  larger of the two (the roofline: a forward must both stream the weights and do the FLOP);
* llama.cpp on the same weights: the bundled Q4_1 GGUF converted to ALL_F32 by llama.cpp's own
  quantize API (the runner's fp32 target is the same GGUF dequantised by transformers, so both
  read the same values), timed by llama-cpp-python for decode and for prompt evaluation.

Each function returns closures that take one measurement, so the bench can interleave them with
its other cases.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from common.cpu_kernels import PanelWeight


def weight_bytes(runner) -> int:
    """Bytes a decode step of `runner` streams: every layer tensor, the final norm and the LM
    head (the embedding table is only indexed, one row per token)."""
    def nbytes(t) -> int:
        if isinstance(t, PanelWeight):   # padded to whole panels: the bytes the kernel reads
            return t.nbytes()
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    return (sum(nbytes(t) for w in runner.layers for t in w.values())
            + nbytes(runner.norm_w) + nbytes(runner.lm_head))


def product_flops(runner, rows: int, logit_rows: int) -> int:
    """FLOP of the matrix products of a forward over `rows` tokens through every layer, with
    the LM head for `logit_rows` of them (2 per multiply-add; attention's are left out, so the
    compute floor stays a floor)."""
    def macs(t) -> int:
        if isinstance(t, PanelWeight):
            return t.out_features * t.in_features
        return t.numel() if isinstance(t, torch.Tensor) and t.dim() == 2 else 0

    layer = sum(macs(t) for w in runner.layers for t in w.values())
    return 2 * (rows * layer + logit_rows * macs(runner.lm_head))


def roofline_ms(step_bytes: int, flops: int, read_bw: list[float],
                fma_peak: list[float]) -> list[float]:
    """Per rep, the floor of a forward in ms: the larger of streaming `step_bytes` at that rep's
    read bandwidth and doing `flops` at its FMA peak."""
    return [max(step_bytes / bw, flops / peak) * 1e3 for bw, peak in zip(read_bw, fma_peak)]


def fma_peak_case(threads: int, seconds: float = 0.05):
    """Closure returning one sample of the machine's fp32 FMA throughput in FLOP/s on `threads`
    (about `seconds` a sample), or None where the CPU kernels are unavailable."""
    from common import cpu_kernels

    if cpu_kernels.unavailable() is not None:
        return None
    iters = 1_000_000
    t = time.perf_counter()
    cpu_kernels.fma_flops(iters, threads)
    iters = max(iters, int(iters * seconds / max(time.perf_counter() - t, 1e-6)))

    def sample() -> float:
        t = time.perf_counter()
        flops = cpu_kernels.fma_flops(iters, threads)
        return flops / (time.perf_counter() - t)

    return sample


def read_bandwidth_case(nbytes: int, width: int = 1024):
    """Closure returning one sample of the machine's read bandwidth in bytes/s over an fp32
    buffer of about `nbytes` (so it streams from memory as the model's weights do, not from
    cache): the fastest of a torch GEMV (torch.mv), a plain sum, and the runner's own panel
    kernel (common/cpu_kernels.py) over the same bytes. Any product reads every weight byte at
    least once, so the bytes a step streams over this is a floor only as good as the fastest
    reader measured; a kernel under it (llama.cpp/floor < 1) means a faster reader exists."""
    from common import cpu_kernels

    rows = max(1, nbytes // (4 * width))
    w = torch.randn(rows, width)
    x = torch.randn(width)
    readers = [lambda: torch.mv(w, x), w.sum]
    if cpu_kernels.unavailable() is None:
        panel, x1 = cpu_kernels.pack(w), x[None]
        readers.append(lambda: cpu_kernels.linear(x1, panel))
    for read in readers:
        read()

    def sample() -> float:
        best = float("inf")
        for read in readers:
            t = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t)
        return w.numel() * 4 / best

    return sample


def f32_gguf(source: Path, out: Path) -> Path:
    """`source` converted to ALL_F32 by llama.cpp's quantize API into `out` (made once)."""
    if out.is_file():
        return out
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = 2
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(),
                                        ctypes.byref(params))
    if rc != 0 or not tmp.is_file():
        raise RuntimeError(f"llama.cpp quantize to ALL_F32 failed with code {rc}")
    tmp.rename(out)
    return out


def llama_cases(gguf: Path, threads: int, ctx: int, steps: int, prompt_tokens: int,
                vocab_size: int):
    """Closures timing llama.cpp on `gguf`: ms per decoded token (`steps` tokens after a
    `ctx`-token prompt) and ms for evaluating a `prompt_tokens`-token prompt in one batch."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max(ctx + steps, prompt_tokens) + 16,
                          n_threads=threads, n_threads_batch=threads, n_batch=prompt_tokens,
                          n_ubatch=prompt_tokens, verbose=False)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(100, vocab_size, (max(ctx + steps, prompt_tokens),), generator=gen).tolist()

    def decode() -> float:
        llm.reset()
        llm.eval(ids[:ctx])
        t = time.perf_counter()
        for i in range(steps):
            llm.eval([ids[ctx + i]])
        return (time.perf_counter() - t) * 1e3 / steps

    def prompt() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids[:prompt_tokens])
        return (time.perf_counter() - t) * 1e3

    return {"llama_decode": decode, "llama_prompt": prompt}
