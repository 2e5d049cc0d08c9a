"""What the clairvoyant bound (bench/bound.py) needs beyond the run's own α, β, γ: the drafter's
agreement with the target along each reference output, and the verifier's cost curve.

* ``draft_matches``: for each position j of the target's greedy output, whether the drafter (the
  same GGUF, llama.cpp, greedy) given the prompt and t_<j drafts t_j — one batched evaluation of
  prompt + output with logits for every position.
* ``verify_curve``: the time of one verification forward pass on the target over b draft tokens
  plus the bonus position (b + 1 tokens, logits for all), b = 0 … B, on a KV cache of the prompt,
  through the verifier's own runner (common/runner.LayerRangeRunner) on one thread, as the bench
  pins the verifier. Minimum of `reps` runs: the bound needs the least the verifier can take.
* ``cpu_seconds``: a process's user + system CPU time from /proc/<pid>/stat (the energy proxy:
  there is no RAPL or GPU power reading on a VM like this one; ``rapl_joules`` reads RAPL where
  /sys/class/powercap exposes it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["draft_matches", "verify_curve", "cpu_seconds", "rapl_joules", "energy_note"]

_TICK = os.sysconf("SC_CLK_TCK")
RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")


def draft_matches(drafter_gguf: str | Path, prompts: dict[str, list[int]],
                  outputs: dict[str, list[int]]) -> dict[str, list[bool]]:
    import llama_cpp
    import numpy as np
    longest = max(len(prompts[k]) + len(outputs[k]) for k in outputs)
    llm = llama_cpp.Llama(model_path=str(drafter_gguf), n_ctx=max(512, longest + 8),
                          n_threads=1, n_batch=512, logits_all=True, verbose=False)
    out = {}
    for k, ref in outputs.items():
        ids = list(prompts[k]) + list(ref)
        llm.reset()
        llm.eval(ids)
        scores = np.asarray(llm.scores[: len(ids)])
        p = len(prompts[k])
        # the logits after token p-1+j predict output token j
        out[k] = [int(np.argmax(scores[p - 1 + j])) == int(t) for j, t in enumerate(ref)]
    return out


def verify_curve(target: str | Path, context: list[int], most: int = 16, reps: int = 3) -> list[float]:
    import torch

    from common.runner import LayerRangeRunner, Segment
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = LayerRangeRunner(Path(target))
        L = runner.num_layers
        ctx = torch.tensor(context)
        kv = runner.new_kv()
        with torch.inference_mode():
            runner.forward([Segment(kv, ctx)], 0, L)
            toks = torch.randint(100, runner.vocab_size, (most + 1,),
                                 generator=torch.Generator().manual_seed(0))
            curve = []
            for b in range(most + 1):
                best = float("inf")
                for _ in range(reps + 1):   # the first is a warm-up
                    t = time.perf_counter()
                    runner.forward([Segment(kv, toks[: b + 1], "all")], 0, L)
                    best = min(best, time.perf_counter() - t)
                    kv.truncate(len(context))
                curve.append(best)
        return curve
    finally:
        torch.set_num_threads(threads)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK   # utime, stime (fields 14, 15)


def rapl_joules() -> float | None:
    """The CPU package's energy counter in joules, or None where RAPL is not exposed."""
    try:
        return int(RAPL.read_text()) / 1e6
    except (OSError, ValueError):
        return None


def energy_note() -> str:
    if rapl_joules() is not None:
        return "RAPL package energy available: joules per token reported beside CPU-seconds"
    return ("no RAPL (/sys/class/powercap) and no GPU power reading on this machine: energy is "
            "reported as CPU-seconds per token of each process (a proxy), no joules")
