"""Tuning parity: every speculative policy with knobs gets the same BO, the same budget, on the
same tuning prompts, before anything is measured on the test set.

The BO is the dispatcher's own (services/dispatcher/spec/bo_tuner.py): skopt's Optimizer with a GP,
expected improvement with ξ = 0.1 on ln(TPT), the same initial points, acquisition settings and
seed, the policy's current default evaluated first, and at the end the evaluated point with the
lowest GP posterior mean (noise-aware, as BOTuner settles) is chosen. Only the search space
differs per policy.

What the GP models is TPT *relative to the policy's default knobs on the same prompts*,
ln TPT(knobs) − ln TPT(default), when the caller measures that control (``tell(tpt, control)``;
the bench always does). Each evaluation runs on its own tuning prompts, and prompts differ more
than knobs do: in a run without the control, pipesd's 16 evaluations spanned 38-96 ms, and for
pipesd, tree and pipesd-learned alike the chosen point was evaluation 1 (the default), on the
prompt where all three were fastest. The control takes the prompt's share out, so the GP compares
knobs, not prompts.

    vanilla         n   draft length, integer in [1, 32]                  default 8
    hsl             r2  single-token threshold, uniform in [1e-6, 1]      default 0.94
    edgellm         r1  initial cumulative threshold, log-uniform         default 0.5
                    c   its update constant, uniform in [0.05, 0.95]      default 0.5
    pipesd(-stream) r1  log-uniform in [1e-6, 1], r2 uniform in [1e-6, 1]  defaults 0.90, 0.94
                        (exactly BOTuner's space)
    tree(-stream)   cs  cost scale of the tree's shape rule, log-uniform   default 1
                        in [0.05, 20]
                    m   most nodes per round, integer in [2, 64]          default 32
    pipesd-learned  k   price of waiting in its stopping rule, log-uniform
                        in [0.05, 20]                                     default 1

Policies without knobs (cloud-only, oracle-trigger) are measured as they are.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from threadpoolctl import threadpool_limits

from services.dispatcher.spec.bo_tuner import DEFAULT_R1, DEFAULT_R2, R_HIGH, R_LOW, BOConfig

__all__ = ["KNOBS", "DEFAULTS", "TuneResult", "PolicyTuner", "tune", "knob_policy"]

# policy -> [(knob, kind, low, high, prior)]
KNOBS: dict[str, list[tuple[str, str, float, float, str]]] = {
    "vanilla": [("n", "int", 1, 32, "uniform")],
    "hsl": [("r2", "real", R_LOW, R_HIGH, "uniform")],
    "edgellm": [("r1", "real", R_LOW, R_HIGH, "log-uniform"), ("c", "real", 0.05, 0.95, "uniform")],
    "pipesd": [("r1", "real", R_LOW, R_HIGH, "log-uniform"),
               ("r2", "real", R_LOW, R_HIGH, "uniform")],
}
KNOBS["pipesd-stream"] = KNOBS["pipesd"]
KNOBS["tree"] = [("cs", "real", 0.05, 20.0, "log-uniform"), ("m", "int", 2, 64, "uniform")]
KNOBS["tree-stream"] = KNOBS["tree"]
KNOBS["pipesd-learned"] = [("k", "real", 0.05, 20.0, "log-uniform")]
DEFAULTS: dict[str, dict[str, float]] = {
    "vanilla": {"n": 8}, "hsl": {"r2": DEFAULT_R2}, "edgellm": {"r1": 0.5, "c": 0.5},
    "pipesd": {"r1": DEFAULT_R1, "r2": DEFAULT_R2},
    "pipesd-stream": {"r1": DEFAULT_R1, "r2": DEFAULT_R2},
    "tree": {"cs": 1.0, "m": 32}, "tree-stream": {"cs": 1.0, "m": 32},
    "pipesd-learned": {"k": 1.0},
}


def knob_policy(policy: str) -> bool:
    return policy in KNOBS


@dataclass
class TuneResult:
    policy: str
    knobs: dict[str, float]
    # {"knobs": {...}, "tpt_ms": ..., "control_ms": TPT of the default knobs on the same prompts}
    evaluations: list[dict] = field(default_factory=list)


def _space(policy: str):
    from skopt.space import Integer, Real
    dims = []
    for name, kind, lo, hi, prior in KNOBS[policy]:
        dims.append(Integer(int(lo), int(hi), name=name) if kind == "int"
                    else Real(lo, hi, prior=prior, name=name))
    return dims


def _point(policy: str, x) -> dict[str, float]:
    out = {}
    for (name, kind, lo, hi, _), v in zip(KNOBS[policy], x):
        v = min(hi, max(lo, float(v)))
        out[name] = int(round(v)) if kind == "int" else v
    return out


class PolicyTuner:
    """The BO of one policy, ask/tell: ``ask()`` the knobs to evaluate next, ``tell(tpt_s,
    control_s)`` their TPT and, if measured, the TPT of the default knobs on the same prompts;
    after `budget` tells, ``result()`` gives the chosen knobs (the evaluated point with the lowest
    GP posterior mean, as BOTuner settles; the lowest measured objective while the GP has not been
    fitted)."""

    def __init__(self, policy: str, budget: int = 16, seed: int = 0,
                 config: BOConfig | None = None):
        from skopt import Optimizer
        if budget < 1:
            raise ValueError("budget must be >= 1")
        if policy not in KNOBS:
            raise ValueError(f"{policy!r} has no knobs to tune")
        self.policy, self.budget = policy, budget
        self.config = c = config or BOConfig()
        self.opt = Optimizer(_space(policy), base_estimator="GP", acq_func="EI",
                             acq_func_kwargs={"xi": c.xi},
                             n_initial_points=min(c.n_initial_points, budget),
                             random_state=seed, acq_optimizer="lbfgs",
                             acq_optimizer_kwargs={"n_points": c.acq_n_points,
                                                   "n_restarts_optimizer": c.acq_n_restarts})
        default = DEFAULTS[policy]
        self._next = _point(policy, [default[name] for name, *_ in KNOBS[policy]])
        self.xs: list[list[float]] = []
        self.ys: list[float] = []
        self.evaluations: list[dict] = []

    @property
    def done(self) -> bool:
        return len(self.ys) >= self.budget

    def ask(self) -> dict[str, float]:
        if self.done:
            raise RuntimeError("the budget is spent")
        return dict(self._next)

    def tell(self, tpt_s: float, control_s: float | None = None) -> None:
        """The objective is ln(tpt_s / control_s): TPT relative to the default knobs on the same
        prompts (plain ln tpt_s without a control)."""
        knobs = self._next
        self.evaluations.append({"knobs": dict(knobs), "tpt_ms": float(tpt_s) * 1000,
                                 "control_ms": None if control_s is None else float(control_s) * 1000})
        self.xs.append([knobs[name] for name, *_ in KNOBS[self.policy]])
        self.ys.append(_ln(tpt_s) - (0.0 if control_s is None else _ln(control_s)))
        with warnings.catch_warnings(), threadpool_limits(limits=self.config.blas_threads):
            warnings.simplefilter("ignore")   # sklearn's GP convergence chatter
            self.opt.tell(self.xs[-1], self.ys[-1], fit=True)
            if not self.done:
                self._next = _point(self.policy, self.opt.ask())

    def result(self) -> TuneResult:
        best = int(np.argmin(self.ys))
        if self.opt.models:
            with warnings.catch_warnings(), threadpool_limits(limits=self.config.blas_threads):
                warnings.simplefilter("ignore")
                mu = self.opt.models[-1].predict(self.opt.space.transform(self.xs))
            best = int(np.argmin(mu))
        return TuneResult(self.policy, dict(self.evaluations[best]["knobs"]), self.evaluations)


def _ln(seconds: float) -> float:
    return math.log(max(float(seconds), 1e-12))


def tune(policy: str, objective: Callable[[dict[str, float]], float], budget: int = 16,
         seed: int = 0, config: BOConfig | None = None) -> TuneResult:
    """`budget` evaluations of objective(knobs) -> TPT seconds, the policy's default first."""
    t = PolicyTuner(policy, budget, seed, config)
    while not t.done:
        t.tell(objective(t.ask()))
    return t.result()
