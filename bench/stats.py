"""Confidence intervals for the benchmarks: 95 % bootstrap intervals (scipy.stats.bootstrap,
BCa) of a mean and of a ratio of means over paired samples (the same prompts, in the same order,
for both policies: resampling keeps the pairs together)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["mean_ci", "ratio_ci", "CONFIDENCE", "RESAMPLES"]

CONFIDENCE = 0.95
RESAMPLES = 9999
SEED = 0   # intervals are reproducible from the JSON's numbers


def _interval(data, statistic, paired: bool) -> list[float]:
    from scipy.stats import bootstrap
    n = len(data[0])
    if n < 2:
        return [math.nan, math.nan]
    if all(np.allclose(d, d[0]) for d in data):   # no spread: BCa is undefined, the CI is a point
        v = float(statistic(*data))
        return [v, v]
    res = bootstrap(data, statistic, paired=paired, vectorized=True, confidence_level=CONFIDENCE,
                    n_resamples=RESAMPLES, method="BCa", rng=np.random.default_rng(SEED))
    lo, hi = res.confidence_interval
    if not (math.isfinite(lo) and math.isfinite(hi)):   # BCa degenerate: fall back to percentile
        res = bootstrap(data, statistic, paired=paired, vectorized=True,
                        confidence_level=CONFIDENCE, n_resamples=RESAMPLES, method="percentile",
                        rng=np.random.default_rng(SEED))
        lo, hi = res.confidence_interval
    return [float(lo), float(hi)]


def mean_ci(xs) -> list[float]:
    """95 % interval of the mean of xs; [nan, nan] under two samples."""
    x = np.asarray(xs, dtype=float)
    return _interval((x,), lambda a, axis=-1: np.mean(a, axis=axis), paired=False)


def ratio_ci(num, den) -> list[float]:
    """95 % interval of mean(num) / mean(den), num[i] and den[i] measured on the same prompt."""
    a = np.asarray(num, dtype=float)
    b = np.asarray(den, dtype=float)
    if a.shape != b.shape:
        raise ValueError("paired samples need the same length")
    return _interval((a, b), lambda x, y, axis=-1: np.mean(x, axis=axis) / np.mean(y, axis=axis),
                     paired=True)
