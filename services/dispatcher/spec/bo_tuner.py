"""Bayesian-optimisation autotuner for the dual NAV thresholds (R1, R2) (DESIGN.md §3).

Pure, no I/O: the dispatcher reports (elapsed time, accepted tokens) as rounds complete and reads
the thresholds to use from ``current()``; the tuner runs inside live traffic with skopt's
ask/tell interface.

Search.  Dimensions R1 ∈ [1e-6, 1] (log-uniform) and R2 ∈ [1e-6, 1] (uniform); a Gaussian-process
surrogate with expected improvement,

    EI(x) = E[max(0, y* − f(x) − ξ)],  ξ = 0.1,

``n_initial_points`` space-filling points (the defaults R1 = 0.90, R2 = 0.94 are evaluated first
and count as one of them), ``n_calls`` = 16 evaluations per search.  Each evaluation of a
candidate is its mean time per accepted token,

    TPT = Σ elapsed / Σ accepted tokens,

accumulated over rounds until at least ``min_tokens`` tokens were accepted (DESIGN's floor is
20; the dispatcher uses 96, ``spec_bo_window_tokens``: on live traffic a window's TPT moves ±20 %
with the text being generated, plain prose vs code, more than between good and poor thresholds,
and longer windows average that out).  The optimizer is
told ln(TPT), not TPT: ξ = 0.1 then means "an improvement of ≈10 %" whatever the time unit or the
speed of the deployment (on raw seconds, ξ = 0.1 s dwarfs a TPT of tens of milliseconds and EI
degenerates into pure exploration; measured here, it also makes skopt's GP fit ~5× slower).

Settling.  After ``n_calls`` evaluations the tuner settles on the evaluated point with the lowest
GP posterior mean, not the lowest measured TPT: the GP models the noise (skopt's GP has a white
noise term), so a lucky window among poor neighbours ranks below a region that was good every
time.  Either way the chosen value is biased low, so the drift reference is re-measured:
the first ``drift_baseline_windows`` windows (≥ min_tokens each) at the settled point set
``reference_tpt``.  Afterwards each window updates ``ewma ← (1 − w)·ewma + w·TPT_window``; when
``|ewma − reference| / reference > drift_fraction`` (25 %) and the window's own TPT is out of
that band too, for ``drift_patience`` consecutive windows, conditions have changed and a new
search starts (either direction: a faster link may favour other thresholds).  Requiring the
window itself out of band keeps one outlier, which lingers in the EWMA, from re-tuning.  The new search is
warm-started by
re-measuring the previous search's ``warm_start_points`` best points (by posterior mean) first (old TPT values are
stale after a drift, so they are re-evaluated, not re-used).

Cost.  One evaluation's tell + ask (GP fit, acquisition optimisation) takes ~20-40 ms of CPU
on one core, once per window; BLAS is held to one thread meanwhile (OpenBLAS
threads on 16×16 matrices spin: measured 7× more CPU with two threads).  A latency-sensitive
caller runs ``record`` off its event loop.

``grid_search``, ``random_search`` and ``bo_search`` run the same budget against an offline
objective ``objective(r1, r2) -> TPT`` for the benchmark.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from threadpoolctl import threadpool_limits
# At import, not when the first tuner is made: importing skopt (scikit-learn, scipy) takes ~2 s
# here, and the dispatcher makes a policy's tuner on its event loop when the first request of
# that policy arrives; imported lazily, it froze every session for those seconds, long enough
# for the dispatcher to declare its peers lost (tests/integration/test_spec_mode.py saw it).
from skopt import Optimizer
from skopt.space import Real

__all__ = [
    "BOConfig", "Evaluation", "BOTuner", "SearchResult",
    "grid_search", "random_search", "bo_search",
    "R_LOW", "R_HIGH", "DEFAULT_R1", "DEFAULT_R2",
]

R_LOW = 1e-6        # lower bound of both thresholds
R_HIGH = 1.0        # upper bound of both thresholds
DEFAULT_R1 = 0.90   # R1 before tuning (reference reproduction's default)
DEFAULT_R2 = 0.94   # R2 before tuning (reference reproduction's default)

EXPLORING = "exploring"
SETTLED = "settled"


@dataclass
class BOConfig:
    n_calls: int = 16                  # evaluations per search before settling
    n_initial_points: int = 5          # space-filling evaluations before the GP drives (defaults included)
    xi: float = 0.1                    # EI exploration margin ξ, in ln(TPT) units (≈ relative improvement)
    min_tokens: int = 20               # accepted tokens per evaluation window (DESIGN's floor; dispatcher: 96)
    default_r1: float = DEFAULT_R1     # R1 used first (and until the first evaluation completes)
    default_r2: float = DEFAULT_R2     # R2 used first
    random_state: int = 0              # seed of the optimizer (reproducible searches)
    drift_fraction: float = 0.25       # re-tune when TPT's EWMA is this far (relative) from the reference
    drift_ewma: float = 0.3            # weight of a new window in the drift EWMA
    drift_baseline_windows: int = 3    # windows at the settled point that set the reference TPT
    drift_patience: int = 2            # consecutive out-of-band windows before re-tuning
    warm_start_points: int = 3         # previous best points re-measured first in a re-tune
    retune: bool = True                # re-tune on drift at all
    acq_n_points: int = 2000           # random points scored per acquisition optimisation (skopt: 10000)
    acq_n_restarts: int = 2            # L-BFGS restarts of the acquisition optimisation (skopt: 5)
    blas_threads: int = 1              # BLAS/OpenMP threads while fitting (tiny matrices: more threads only spin)


@dataclass(frozen=True)
class Evaluation:
    r1: float
    r2: float
    tpt: float          # seconds per accepted token
    tokens: int         # accepted tokens the measurement covered


@dataclass
class SearchResult:
    best_r1: float
    best_r2: float
    best_tpt: float
    evaluations: list[Evaluation] = field(default_factory=list)


def _space():
    return [Real(R_LOW, R_HIGH, prior="log-uniform", name="r1"),
            Real(R_LOW, R_HIGH, prior="uniform", name="r2")]


def _clamp(r: float) -> float:
    return min(R_HIGH, max(R_LOW, float(r)))


class BOTuner:
    """Ask/tell BO over (R1, R2) driven by live (elapsed, accepted) reports; see module docstring.

    ``current()`` → thresholds to use now; ``record(elapsed_s, accepted_tokens)`` → True when the
    thresholds changed.  ``state`` is "exploring" or "settled"; ``evaluations`` lists the current
    search's evaluations, ``history`` all of them; ``best`` is the best evaluation of the current
    (or last finished) search, None before the first.
    """

    def __init__(self, config: BOConfig | None = None) -> None:
        self.config = c = config or BOConfig()
        if c.n_calls < 1 or c.n_initial_points < 1 or c.min_tokens < 1:
            raise ValueError("n_calls, n_initial_points and min_tokens must be >= 1")
        self.state = EXPLORING
        self.evaluations: list[Evaluation] = []
        self.history: list[Evaluation] = []
        self.best: Evaluation | None = None
        self.retunes = 0
        self.reference_tpt: float | None = None
        self.ewma_tpt: float | None = None
        self._acc_elapsed = 0.0
        self._acc_tokens = 0
        self._baseline: list[float] = []
        self._out_of_band = 0
        self._pending: list[tuple[float, float]] = []
        self._start_search([(_clamp(c.default_r1), _clamp(c.default_r2))])

    # -- public --------------------------------------------------------------------------------
    def current(self) -> tuple[float, float]:
        """(R1, R2) to use now."""
        return self._current

    def record(self, elapsed_s: float, accepted_tokens: int) -> bool:
        """Account ``elapsed_s`` wall seconds that produced ``accepted_tokens`` tokens under
        ``current()``.  Returns True when ``current()`` changed as a result."""
        elapsed_s = float(elapsed_s)
        if math.isnan(elapsed_s) or elapsed_s < 0 or int(accepted_tokens) < 0:
            raise ValueError("elapsed_s and accepted_tokens must be >= 0")
        self._acc_elapsed += elapsed_s
        self._acc_tokens += int(accepted_tokens)
        if self._acc_tokens < self.config.min_tokens:
            return False
        tpt = self._acc_elapsed / self._acc_tokens
        tokens = self._acc_tokens
        self._acc_elapsed, self._acc_tokens = 0.0, 0
        before = self._current
        if self.state == EXPLORING:
            self._tell(tpt, tokens)
        else:
            self._track(tpt)
        return self._current != before

    @property
    def n_evaluations(self) -> int:
        return len(self.evaluations)

    # -- search --------------------------------------------------------------------------------
    def _start_search(self, first_points: list[tuple[float, float]]) -> None:
        c = self.config
        self._opt = Optimizer(
            _space(), base_estimator="GP", acq_func="EI", acq_func_kwargs={"xi": c.xi},
            n_initial_points=c.n_initial_points, random_state=c.random_state + self.retunes,
            acq_optimizer="lbfgs",
            acq_optimizer_kwargs={"n_points": c.acq_n_points,
                                  "n_restarts_optimizer": c.acq_n_restarts})
        self.state = EXPLORING
        self.evaluations = []
        self._pending = list(first_points[1:])
        self._current = first_points[0]
        self.reference_tpt = self.ewma_tpt = None
        self._baseline = []
        self._out_of_band = 0

    def _tell(self, tpt: float, tokens: int) -> None:
        c = self.config
        r1, r2 = self._current
        ev = Evaluation(r1, r2, tpt, tokens)
        self.evaluations.append(ev)
        self.history.append(ev)
        if len(self.evaluations) == 1 or tpt < self.best.tpt:
            self.best = ev
        done = len(self.evaluations) >= c.n_calls
        y = math.log(max(tpt, 1e-12))
        with warnings.catch_warnings(), threadpool_limits(limits=c.blas_threads):
            warnings.simplefilter("ignore")     # sklearn's GP convergence chatter
            # the final tell fits the GP too: settling ranks the evaluations by its posterior
            self._opt.tell([r1, r2], y, fit=done or not self._pending)
            if done:
                self._settle()
            elif self._pending:
                self._current = self._pending.pop(0)
            else:
                x = self._opt.ask()
                self._current = (_clamp(x[0]), _clamp(x[1]))

    def _settle(self) -> None:
        self.best = self._ranked()[0]
        self._current = (self.best.r1, self.best.r2)
        self.state = SETTLED
        self.reference_tpt = self.ewma_tpt = None
        self._baseline = []
        self._out_of_band = 0

    def _ranked(self) -> list[Evaluation]:
        """The current search's evaluations, best first, by the GP's posterior mean at each
        (noise-aware: a lucky window next to poor ones ranks below a consistently good region);
        by the measured TPT when no model has been fitted yet (fewer evaluations than the
        initial points)."""
        evals = list(self.evaluations)
        if not self._opt.models:
            return sorted(evals, key=lambda e: e.tpt)
        with warnings.catch_warnings(), threadpool_limits(limits=self.config.blas_threads):
            warnings.simplefilter("ignore")
            mu = self._opt.models[-1].predict(self._opt.space.transform([[e.r1, e.r2] for e in evals]))
        order = np.argsort(mu, kind="stable")
        return [evals[i] for i in order]

    def _track(self, tpt: float) -> None:
        c = self.config
        if self.reference_tpt is None:
            self._baseline.append(tpt)
            if len(self._baseline) >= c.drift_baseline_windows:
                self.reference_tpt = self.ewma_tpt = sum(self._baseline) / len(self._baseline)
            return
        self.ewma_tpt = (1 - c.drift_ewma) * self.ewma_tpt + c.drift_ewma * tpt
        ref = self.reference_tpt
        out = (abs(self.ewma_tpt - ref) / ref > c.drift_fraction
               and abs(tpt - ref) / ref > c.drift_fraction)
        self._out_of_band = self._out_of_band + 1 if out else 0
        if c.retune and self._out_of_band >= c.drift_patience:
            self.retunes += 1
            ranked = self._ranked()
            warm: list[tuple[float, float]] = []
            for e in ranked:
                if (e.r1, e.r2) not in warm:
                    warm.append((e.r1, e.r2))
                if len(warm) >= max(1, c.warm_start_points):
                    break
            self._start_search(warm)


# -- offline searches for the benchmark ---------------------------------------------------------
Objective = Callable[[float, float], float]


def _result(evals: list[Evaluation]) -> SearchResult:
    b = min(evals, key=lambda e: e.tpt)
    return SearchResult(b.r1, b.r2, b.tpt, evals)


def grid_search(objective: Objective, n: int) -> SearchResult:
    """Evaluate a k1 × k2 grid (k1 = ⌊√n⌋, k2 = ⌊n / k1⌋, so at most n points; 16 → 4 × 4) of cell
    centres over log10 R1 ∈ [−6, 0] × R2 ∈ [1e-6, 1]."""
    if n < 1:
        raise ValueError("n must be >= 1")
    k1 = max(1, math.isqrt(n))
    k2 = max(1, n // k1)
    lo, hi = math.log10(R_LOW), math.log10(R_HIGH)
    evals = []
    for i in range(k1):
        r1 = _clamp(10 ** (lo + (hi - lo) * (i + 0.5) / k1))
        for j in range(k2):
            r2 = _clamp(R_LOW + (R_HIGH - R_LOW) * (j + 0.5) / k2)
            evals.append(Evaluation(r1, r2, float(objective(r1, r2)), 0))
    return _result(evals)


def random_search(objective: Objective, n: int, seed: int = 0) -> SearchResult:
    """n points uniform in (log10 R1, R2) over the same space as the BO search."""
    if n < 1:
        raise ValueError("n must be >= 1")
    rng = np.random.default_rng(seed)
    lo, hi = math.log10(R_LOW), math.log10(R_HIGH)
    evals = []
    for _ in range(n):
        r1 = _clamp(10 ** rng.uniform(lo, hi))
        r2 = _clamp(rng.uniform(R_LOW, R_HIGH))
        evals.append(Evaluation(r1, r2, float(objective(r1, r2)), 0))
    return _result(evals)


def bo_search(objective: Objective, n: int = 16, seed: int = 0,
              config: BOConfig | None = None) -> SearchResult:
    """Drive a ``BOTuner`` offline for n evaluations (each objective value stands for one window
    of ``min_tokens`` accepted tokens)."""
    base = config or BOConfig()
    cfg = BOConfig(**{**base.__dict__, "n_calls": n, "random_state": seed, "retune": False})
    tuner = BOTuner(cfg)
    while tuner.state == EXPLORING:
        r1, r2 = tuner.current()
        tpt = float(objective(r1, r2))
        tuner.record(tpt * cfg.min_tokens, cfg.min_tokens)
    return _result(list(tuner.evaluations))
