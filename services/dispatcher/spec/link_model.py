"""Online estimates of the pipeline parameters α, β (link) and γ (drafter) (DESIGN.md §3).

Pure, no I/O: the dispatcher feeds measurements, the DP planner reads the estimates.

Link.  Sending a batch of s tokens occupies the link for

    t_c(s) = α + β·s

(α: per-message start-up cost — serialisation, syscalls, framing, ZMQ; β: per-token cost —
bytes / bandwidth).  (α, β) are fitted by ordinary least squares over a sliding window of the
last W observations (s_i, t_i):

    β = Σ (s_i − s̄)(t_i − t̄) / Σ (s_i − s̄)²,   α = t̄ − β·s̄,

constrained to α ≥ 0, β ≥ 0: when the unconstrained fit leaves that region, the better (lower
squared error) of the two boundary fits is used — β = 0, α = max(0, t̄), or α = 0,
β = max(0, Σ s_i t_i / Σ s_i²).  Until the window holds at least two distinct sizes, the
configured seeds are returned.

One-way latency is separate.  Over a persistent ZMQ connection propagation delay is not
serialised per message: it shifts every delivery by the same constant and so does not change
the batching plan.  It is kept in ``latency_s`` (seeded from configuration, optionally tracked
with ``observe_latency``) and is *not* folded into α.  Measurements that include it (a
send→ack round trip) go through ``observe_round_trip``, which subtracts 2·latency first.

Drafter.  γ (seconds per drafted token) is an exponentially weighted moving average of the
drafter's own timings: for a timing of n tokens in d seconds, ``γ ← (1 − w)·γ + w·(d / n)``,
starting from the configured seed (the first observation replaces the seed).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["LinkModelConfig", "LinkModel", "DraftSpeedConfig", "DraftSpeed"]


def _finite_nonneg(name: str, v: float) -> float:
    v = float(v)
    if math.isnan(v) or math.isinf(v) or v < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
    return v


@dataclass
class LinkModelConfig:
    alpha_seed: float = 0.002        # α before enough data: per-message start-up cost, seconds
    beta_seed: float = 0.0002        # β before enough data: per-token transmission cost, seconds
    window: int = 64                 # sliding window of (batch size, time) observations for the fit
    one_way_latency_s: float = 0.0   # propagation delay, a constant NOT part of α
    latency_ewma: float = 0.2        # weight of a new sample in observe_latency's EWMA


class LinkModel:
    """Least-squares (α, β) over a sliding window, plus a separate one-way latency constant."""

    def __init__(self, config: LinkModelConfig | None = None) -> None:
        self.config = config or LinkModelConfig()
        if self.config.window < 2:
            raise ValueError("window must be >= 2")
        self._obs: deque[tuple[int, float]] = deque(maxlen=self.config.window)
        self.latency_s = _finite_nonneg("one_way_latency_s", self.config.one_way_latency_s)
        self._fit: tuple[float, float] | None = None
        self._dirty = False

    # -- feeding -------------------------------------------------------------------------------
    def observe(self, batch_size: int, seconds: float) -> None:
        """One transmission of ``batch_size`` tokens that occupied the link for ``seconds``
        (propagation delay excluded)."""
        if int(batch_size) < 1:
            raise ValueError("batch_size must be >= 1")
        self._obs.append((int(batch_size), _finite_nonneg("seconds", seconds)))
        self._dirty = True

    def observe_round_trip(self, batch_size: int, rtt_s: float) -> None:
        """A send→ack round trip: 2·latency is subtracted (clamped at 0) before ``observe``."""
        self.observe(batch_size, max(0.0, _finite_nonneg("rtt_s", rtt_s) - 2.0 * self.latency_s))

    def observe_latency(self, one_way_s: float) -> None:
        """A one-way latency sample (e.g. half a small-message RTT): EWMA into ``latency_s``."""
        w = self.config.latency_ewma
        self.latency_s = (1 - w) * self.latency_s + w * _finite_nonneg("one_way_s", one_way_s)

    # -- estimates -----------------------------------------------------------------------------
    @property
    def n_observations(self) -> int:
        return len(self._obs)

    @property
    def fitted(self) -> bool:
        """True once the window holds two distinct batch sizes (estimates are no longer seeds)."""
        return self._estimate() is not None

    def _estimate(self) -> tuple[float, float] | None:
        if self._dirty:
            self._fit = _nonneg_least_squares(self._obs)
            self._dirty = False
        return self._fit

    @property
    def alpha(self) -> float:
        est = self._estimate()
        return self.config.alpha_seed if est is None else est[0]

    @property
    def beta(self) -> float:
        est = self._estimate()
        return self.config.beta_seed if est is None else est[1]

    def params(self) -> tuple[float, float]:
        """(α, β)."""
        return self.alpha, self.beta

    def transmission_time(self, batch_size: int) -> float:
        """Predicted link occupancy α + β·s of one batch."""
        return self.alpha + self.beta * batch_size

    def delivery_time(self, batch_size: int) -> float:
        """Predicted send→arrival time of one batch on an idle link: latency + α + β·s."""
        return self.latency_s + self.transmission_time(batch_size)


def _nonneg_least_squares(obs) -> tuple[float, float] | None:
    n = len(obs)
    if n < 2:
        return None
    sizes = [s for s, _ in obs]
    if min(sizes) == max(sizes):
        return None
    s_mean = sum(sizes) / n
    t_mean = sum(t for _, t in obs) / n
    sxx = sum((s - s_mean) ** 2 for s in sizes)
    sxy = sum((s - s_mean) * (t - t_mean) for s, t in obs)
    beta = sxy / sxx
    alpha = t_mean - beta * s_mean
    if alpha >= 0 and beta >= 0:
        return alpha, beta

    def sse(a: float, b: float) -> float:
        return sum((t - a - b * s) ** 2 for s, t in obs)

    cand_flat = (max(0.0, t_mean), 0.0)                      # β = 0
    s2 = sum(s * s for s in sizes)
    cand_origin = (0.0, max(0.0, sum(s * t for s, t in obs) / s2))  # α = 0
    return min((cand_flat, cand_origin), key=lambda ab: sse(*ab))


@dataclass
class DraftSpeedConfig:
    gamma_seed: float = 0.015   # γ before any timing: seconds per drafted token (~66 tok/s)
    ewma: float = 0.2           # weight of a new timing in the EWMA


class DraftSpeed:
    """γ = EWMA of the drafter's seconds per token; the first timing replaces the seed."""

    def __init__(self, config: DraftSpeedConfig | None = None) -> None:
        self.config = config or DraftSpeedConfig()
        if not 0.0 < self.config.ewma <= 1.0:
            raise ValueError("ewma weight must lie in (0, 1]")
        self.gamma = _finite_nonneg("gamma_seed", self.config.gamma_seed)
        self.n_observations = 0

    def observe(self, n_tokens: int, seconds: float) -> float:
        """``n_tokens`` drafted in ``seconds``; returns the new γ."""
        if int(n_tokens) < 1:
            raise ValueError("n_tokens must be >= 1")
        per_token = _finite_nonneg("seconds", seconds) / int(n_tokens)
        if self.n_observations == 0:
            self.gamma = per_token
        else:
            w = self.config.ewma
            self.gamma = (1 - w) * self.gamma + w * per_token
        self.n_observations += 1
        return self.gamma
