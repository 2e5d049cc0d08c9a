"""The resource plan: how many threads each co-located service runs and on which cores.

A model service left to its libraries takes every core for its torch / llama.cpp threads (the
llama.cpp drafter four, whatever the machine has), and OpenMP lets a thread that waits for work
spin for ~3 ms (ACTIVE: minutes).  Several such services on one machine then fight: the drafter,
the verifier and the dispatcher take turns within every speculative round, and each turn can wait
for the others' spinning threads to be descheduled.  `plan()` gives each service a
share:

* From SPLIT_FROM usable cores on, the **edge half** (drafter, dispatcher) and the **cloud
  half** get disjoint shares for what runs at the same time: in speculative mode the drafter
  drafts while the verifier verifies, so the drafter keeps to a third of the cores and the
  verifier, while it holds speculative sessions, to as many threads as the rest (its
  `spec_threads`, set through TANDEM_VERIFIER_SPEC_THREADS). A half that runs on a GPU needs
  one core to drive it; the rest go to the other half.
* What takes turns gets every core (ALTERNATING): split mode's prefix and suffix (a session's
  token passes through one, then the other) and the verifier outside speculative mode.
  Measured on 2 cores (`tandem bench defaults`, docs/results/defaults.json): the halves pinned
  apart with one thread each cost split and cloud-only ~20 % against every service on both
  cores; every service on both cores with two threads doubled speculative mode's TPT.
* One core: everybody shares it.
* The dispatcher is Python: one thread, on the edge cores.
* A service on a GPU runs one CPU thread.
* Services that share cores spin briefly, then sleep: GOMP_SPINCOUNT=SPIN (~0.2 ms) instead of
  OpenMP's ~3 ms, so a service whose turn is over gives the cores back at once, while its own
  back-to-back parallel regions (microseconds apart within a forward pass) still find their
  threads awake.  OMP_WAIT_POLICY=PASSIVE (no spinning) was 10-20 % slower per token on the
  2-core machine; it is set where a service runs more threads than it has cores.

Overrides are the services' own settings, `threads` and `cpus` (YAML / `TANDEM_<SERVICE>_THREADS`,
`TANDEM_<SERVICE>_CPUS` / `--threads`, `--cpus`): a service that names its cores gets them (and
as many threads, unless it names those too); the other services keep their planned shares.

`plan()` is pure (cores and services in, shares out); `usable_cpus()` reads the machine.
The services' configured overrides are read by stack/plan.py (it loads each service's config).
`tandem up` plans for every service it starts; `tandem serve SERVICE` (what the containers run)
plans for the half the service belongs to, on the container's cores (its cpuset and CPU quota).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

EDGE = ("dispatcher", "drafter", "prefix")
CLOUD = ("verifier", "suffix")
LIGHT = ("dispatcher",)          # no model: one thread wherever the edge is
ALTERNATING = ("verifier", "prefix", "suffix")   # never busy at once with the other half's model
SPLIT_FROM = 2                   # from this many usable cores the edge and cloud halves split them
SPIN = 20_000                    # OpenMP spins before sleeping where services share cores (~0.2 ms)
# what every thread pool a service may load reads: OpenMP (torch, llama.cpp), MKL, OpenBLAS
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class Share:
    """One service's part of the machine."""
    threads: int                            # torch / llama.cpp threads (the service's --threads)
    cpus: tuple[int, ...]                   # cores it may run on (its affinity)
    env: dict[str, str] = field(default_factory=dict, hash=False)  # thread pools' settings
    note: str = ""                          # why, for the start-up table
    shared: bool = False                    # other services run on some of these cores

    @property
    def wait(self) -> str:
        """How its idle OpenMP threads wait: "passive", "spin 20000" (then sleep) or "spin"."""
        if self.env.get("OMP_WAIT_POLICY") == "PASSIVE":
            return "passive"
        return f"spin {self.env['GOMP_SPINCOUNT']}" if "GOMP_SPINCOUNT" in self.env else "spin"


def half(service: str) -> tuple[str, ...]:
    """The services deployed with `service` on its host: its edge or cloud half."""
    return EDGE if service in EDGE else CLOUD


def plan(cpus: Iterable[int], services: Sequence[str], gpu: Iterable[str] = (),
         threads: dict[str, int] | None = None,
         pinned: dict[str, Sequence[int]] | None = None) -> dict[str, Share]:
    """Each service's threads, cores and thread-pool environment.

    cpus: the usable cores; services: those co-located here; gpu: those whose model runs on a
    GPU; threads / pinned: per-service overrides (0 / empty = planned).  ValueError when there
    is no core or an override names a core that is not usable."""
    cores = sorted(set(cpus))
    if not cores:
        raise ValueError("no usable CPU cores")
    threads = {k: v for k, v in (threads or {}).items() if v}
    pinned = {k: sorted(set(v)) for k, v in (pinned or {}).items() if v}
    gpu = set(gpu)
    for name, want in pinned.items():
        outside = set(want) - set(cores)
        if outside:
            raise ValueError(f"{name}: cpus {format_cpus(want)} include {format_cpus(outside)}, "
                             f"not among the usable cores {format_cpus(cores)}")
    for name, n in threads.items():
        if n < 0:
            raise ValueError(f"{name}: threads must be >= 0, not {n}")

    edge = [s for s in services if s in EDGE]
    cloud = [s for s in services if s in CLOUD]
    n = len(cores)
    if edge and cloud and n >= SPLIT_FROM:
        models = [s for s in cloud if s not in LIGHT]
        if models and all(s in gpu for s in models):
            n_edge = n - 1                       # the cloud half only drives its GPU
        elif [s for s in edge if s not in LIGHT] and all(s in gpu for s in edge
                                                          if s not in LIGHT):
            n_edge = 1
        else:
            n_edge = min(n - 1, max(1, round(n / 3)))
        side = {"edge": cores[:n_edge], "cloud": cores[n_edge:]}
    else:
        side = {"edge": cores, "cloud": cores}

    out: dict[str, Share] = {}
    split = side["edge"] != side["cloud"]
    for name in services:
        where = "edge" if name in EDGE else "cloud"
        mine = pinned.get(name, side[where])
        one = name in LIGHT or name in gpu
        # The halves only run at the same time in speculative mode (the drafter drafts while
        # the verifier verifies). The split-mode models (prefix, suffix) take turns with each
        # other, and cloud-only has the verifier alone: on CPU they get every core, and the
        # verifier keeps to the cloud's share only while it has speculative sessions
        # (`spec_threads`). Measured on 2 cores: pinned halves cost split and cloud-only ~20 %.
        alternates = split and not one and name in ALTERNATING and name not in pinned
        if alternates:
            mine = cores
        t = threads.get(name) or (1 if one else len(mine))
        note = ("pinned" if name in pinned else "all cores" if alternates or not split
                else f"{where} cores") + (
            ", GPU" if name in gpu else ", no model" if name in LIGHT else "")
        share = Share(t, tuple(mine), note=note)
        if alternates and name == "verifier":
            share = Share(t, tuple(mine), {"TANDEM_VERIFIER_SPEC_THREADS": str(len(side["cloud"]))},
                          note + f", {len(side['cloud'])} while speculating")
        out[name] = share
    # who shares cores with whom: they spin briefly, then sleep
    for name, s in out.items():
        others = [o for o, x in out.items() if o != name and set(x.cpus) & set(s.cpus)]
        env = {**s.env, **{v: str(s.threads) for v in THREAD_VARS}}
        if s.threads > len(s.cpus):          # oversubscribed by itself: never spin
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        elif others:
            env["GOMP_SPINCOUNT"] = str(SPIN)
        note = s.note + (f", shared with {'+'.join(others)}" if others else "")
        out[name] = Share(s.threads, s.cpus, env, note, shared=bool(others))
    return out


# ---- the machine -----------------------------------------------------------------------------

def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPU quota of this process's cgroup in cores (`docker --cpus`), None when unlimited:
    cgroup v2 `cpu.max` ("max 100000" or "150000 100000") or v1 cpu.cfs_quota_us / period."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus(affinity: Iterable[int] | None = None, quota: float | None = -1.0) -> list[int]:
    """The cores this process may use: its affinity mask, cut to the CPU quota (a quota of 1.5
    cores on 8 allowed gives the first one: threads beyond the quota only queue for it)."""
    cores = sorted(os.sched_getaffinity(0) if affinity is None else affinity)
    if quota == -1.0:
        quota = cgroup_quota()
    if quota is not None and quota > 0:
        cores = cores[:max(1, math.floor(quota))]
    return cores


def parse_cpus(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6] (the kernel's cpu-list format, as in `taskset -c`)."""
    out: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"bad cpu list {text!r}: expected e.g. 0-3,6") from None
        if a < 0 or b < a:
            raise ValueError(f"bad cpu list {text!r}: expected e.g. 0-3,6")
        out.update(range(a, b + 1))
    return sorted(out)


def format_cpus(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3,6"."""
    xs = sorted(set(cpus))
    parts = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def describe(shares: dict[str, Share], cores: Sequence[int] | None = None) -> str:
    """The start-up table: one line per service."""
    head = f"resource plan ({len(cores)} usable cores: {format_cpus(cores)})" if cores else \
        "resource plan"
    lines = [head]
    for name, s in shares.items():
        lines.append(f"  {name:10s} {s.threads:2d} thread{'s' if s.threads != 1 else ' '} "
                     f"on cores {format_cpus(s.cpus):8s} {s.wait + ' wait':18s} ({s.note})")
    return "\n".join(lines)


def available_memory(device) -> int:
    """Bytes a service could still allocate on `device` (a torch.device): a GPU's free memory,
    else the lower of the machine's MemAvailable and what the cgroup's memory.max leaves."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            left = int(limit) - used
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail if avail is not None else 4 << 30
