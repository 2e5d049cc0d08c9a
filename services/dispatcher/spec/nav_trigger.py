"""NAV (non-autoregressive verification) triggers and the scheduling window (DESIGN.md §3).

Pure, no I/O.  Every trigger has the same interface, so the dispatcher drives all policies the
same way:

* ``observe(p, token_id=None, position=None) -> str | None`` — called once per new draft token,
  *after* it was drafted, with its draft probability ``p = P(D_n)``.  A non-None return is the
  trigger reason and means "verify now"; **the token just observed is included in the
  verification**.  After a trigger the trigger's round state resets (a new draft round starts
  with the next token).
* ``reset()`` — forget the current round (rollback, early reject, new request).
* ``on_round(n_drafted, n_accepted)`` — the outcome of a verified round (n draft tokens sent for
  verification, a of them accepted, 0 ≤ a ≤ n); adaptive triggers update their thresholds here,
  the others ignore it.
* ``drafted`` — tokens observed in the current round.

Reasons (label values for the trigger-reason metric, see ``REASONS``): "cumulative" (C1* ≤ R1),
"single" (P ≤ R2), "both" (both at once), "length" (draft-length cap or fixed length),
"oracle" (the first token the target will reject).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "REASONS", "R_MIN", "R_MAX",
    "NavConfig", "NavTrigger", "DualThresholdTrigger", "SingleThresholdTrigger",
    "CumulativeTrigger", "FixedLengthTrigger", "OracleTrigger",
    "DraftWindowConfig", "DraftWindow", "make_trigger",
]

REASON_CUMULATIVE = "cumulative"
REASON_SINGLE = "single"
REASON_BOTH = "both"
REASON_LENGTH = "length"
REASON_ORACLE = "oracle"
REASONS = (REASON_CUMULATIVE, REASON_SINGLE, REASON_BOTH, REASON_LENGTH, REASON_ORACLE)

R_MIN = 1e-6   # lower clamp of thresholds (the BO search space starts here too)
R_MAX = 1.0    # upper clamp of thresholds


@dataclass
class NavConfig:
    r1: float = 0.90          # cumulative (sequence) confidence threshold R1 (PipeSD default before tuning)
    r2: float = 0.94          # single-token confidence threshold R2 (PipeSD default before tuning)
    max_length: int = 64      # hard cap on draft tokens per round ("length"); 0 disables the cap
    fixed_length: int = 8     # draft length N of the vanilla (fixed-length) policy
    edgellm_r1: float = 0.5   # EdgeLLM's initial cumulative threshold R1
    edgellm_c: float = 0.5    # EdgeLLM's constant C in R1 ÷ C^((n−a)/n), 0 < C < 1


def _clamp_r(r: float) -> float:
    if math.isnan(r):
        raise ValueError("threshold is NaN")
    return min(R_MAX, max(R_MIN, float(r)))


def _check_p(p: float) -> float:
    p = float(p)
    if math.isnan(p):
        raise ValueError("draft probability is NaN")
    # Probabilities that left a softmax may be a hair outside [0, 1].
    return min(1.0, max(0.0, p))


class NavTrigger:
    """Base class: round bookkeeping and the optional length cap."""

    name = "base"

    def __init__(self, max_length: int = 0) -> None:
        if max_length < 0:
            raise ValueError("max_length must be >= 0")
        self.max_length = int(max_length)
        self.drafted = 0

    # -- interface -----------------------------------------------------------------------------
    def observe(self, p: float, token_id: int | None = None, position: int | None = None) -> str | None:
        p = _check_p(p)
        self.drafted += 1
        reason = self._decide(p, token_id, position)
        if reason is None and self.max_length and self.drafted >= self.max_length:
            reason = REASON_LENGTH
        if reason is not None:
            self.reset()
        return reason

    def reset(self) -> None:
        self.drafted = 0
        self._reset_round()

    def on_round(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted < 0 or n_accepted < 0 or n_accepted > n_drafted:
            raise ValueError(f"need 0 <= n_accepted <= n_drafted, got {n_accepted}/{n_drafted}")

    def set_thresholds(self, r1: float | None = None, r2: float | None = None) -> None:
        """Move the thresholds (BO autotuner); triggers without that threshold ignore it."""

    def context(self, entropy: float | None, margin: float | None) -> None:
        """The drafter's entropy and top-2 margin at the token observe() gets next (the learned
        trigger's features, services/dispatcher/spec/learned_trigger.py); the others ignore them."""

    def round_closed(self) -> None:
        """The dispatcher closed the current round itself (its length cap, the drafter paused or
        gone) without this trigger firing; triggers that keep per-round state may restart it."""

    # -- hooks ---------------------------------------------------------------------------------
    def _decide(self, p: float, token_id: int | None, position: int | None) -> str | None:
        return None

    def _reset_round(self) -> None:
        pass

    def thresholds(self) -> dict[str, float]:
        """Current thresholds, for gauges."""
        return {}


class DualThresholdTrigger(NavTrigger):
    """PipeSD's dual-threshold trigger.

    With C1 the product of the draft probabilities of the unverified tokens (C1 = 1 at the start
    of a round), for each new draft token D_n:

        C1* = C1 · P(D_n);   trigger iff  C1* ≤ R1  or  P(D_n) ≤ R2;
        on trigger C1 ← 1 (new round), else C1 ← C1*.

    Reasons: "cumulative", "single", "both", or "length" when the round reaches ``max_length``.
    ``set_thresholds`` is how the BO autotuner moves (R1, R2); values are clamped to [1e-6, 1].
    """

    name = "pipesd"

    def __init__(self, r1: float = 0.90, r2: float = 0.94, max_length: int = 64) -> None:
        super().__init__(max_length)
        self.r1 = _clamp_r(r1)
        self.r2 = _clamp_r(r2)
        self.c1 = 1.0

    def set_thresholds(self, r1: float | None = None, r2: float | None = None) -> None:
        if r1 is not None:
            self.r1 = _clamp_r(r1)
        if r2 is not None:
            self.r2 = _clamp_r(r2)

    def _decide(self, p, token_id, position):
        c1_star = self.c1 * p
        cum = c1_star <= self.r1
        single = p <= self.r2
        self.c1 = c1_star
        if cum and single:
            return REASON_BOTH
        if cum:
            return REASON_CUMULATIVE
        if single:
            return REASON_SINGLE
        return None

    def _reset_round(self) -> None:
        self.c1 = 1.0

    def thresholds(self) -> dict[str, float]:
        return {"r1": self.r1, "r2": self.r2}


class SingleThresholdTrigger(NavTrigger):
    """HSL: trigger iff P(D_n) ≤ R2 (plus the ``max_length`` cap: "length")."""

    name = "hsl"

    def __init__(self, r2: float = 0.94, max_length: int = 64) -> None:
        super().__init__(max_length)
        self.r2 = _clamp_r(r2)

    def set_thresholds(self, r1: float | None = None, r2: float | None = None) -> None:
        if r2 is not None:
            self.r2 = _clamp_r(r2)

    def _decide(self, p, token_id, position):
        return REASON_SINGLE if p <= self.r2 else None

    def thresholds(self) -> dict[str, float]:
        return {"r2": self.r2}


class CumulativeTrigger(NavTrigger):
    """EdgeLLM: cumulative confidence threshold with an adaptive R1.

    Within a round: C1 ← C1 · P(D_n); trigger ("cumulative") iff C1 ≤ R1; C1 ← 1 on trigger.

    After each verified round with n draft tokens verified and a accepted (0 ≤ a ≤ n, n ≥ 1):

        fully accepted (a = n):  R1 ← R1 · 0.5                 (let the next draft run longer)
        otherwise:               R1 ← R1 ÷ C^((n − a) / n)     (0 < C < 1: R1 grows, by at most
                                                               the factor 1/C when nothing was
                                                               accepted; drafts get shorter)

    and R1 is clamped to [1e-6, 1].  Rounds with n = 0 leave R1 unchanged.
    """

    name = "edgellm"

    def __init__(self, r1: float = 0.5, c: float = 0.5, max_length: int = 64) -> None:
        super().__init__(max_length)
        if not 0.0 < c < 1.0:
            raise ValueError(f"C must lie in (0, 1), got {c!r}")
        self.r1 = _clamp_r(r1)
        self.c = float(c)
        self.c1 = 1.0

    def set_thresholds(self, r1: float | None = None, r2: float | None = None) -> None:
        if r1 is not None:
            self.r1 = _clamp_r(r1)

    def _decide(self, p, token_id, position):
        self.c1 *= p
        return REASON_CUMULATIVE if self.c1 <= self.r1 else None

    def _reset_round(self) -> None:
        self.c1 = 1.0

    def on_round(self, n_drafted: int, n_accepted: int) -> None:
        super().on_round(n_drafted, n_accepted)
        if n_drafted == 0:
            return
        if n_accepted == n_drafted:
            self.r1 = _clamp_r(self.r1 * 0.5)
        else:
            self.r1 = _clamp_r(self.r1 / self.c ** ((n_drafted - n_accepted) / n_drafted))

    def thresholds(self) -> dict[str, float]:
        return {"r1": self.r1}


class FixedLengthTrigger(NavTrigger):
    """Vanilla speculative decoding: trigger ("length") after exactly N draft tokens."""

    name = "vanilla"

    def __init__(self, n: int = 8) -> None:
        if n < 1:
            raise ValueError("fixed draft length must be >= 1")
        super().__init__(max_length=int(n))


class OracleTrigger(NavTrigger):
    """The oracle-trigger policy's trigger: verify exactly at the first draft token the target
    rejects. Not a bound on policies (it neither drafts proactively nor tunes batching: others
    beat it); bench/bound.py computes a true bound.

    The caller provides the target's greedy continuation of the committed prefix with
    ``set_reference(token_ids)`` at the start of each round (``offset`` skips tokens already
    committed, so a precomputed full target output can be passed with ``offset = committed``).
    ``observe(p, token_id, position)`` triggers ("oracle") when ``token_id`` differs from the
    reference at ``position`` (0-based within the round; default: the trigger's own count), or
    when the reference is exhausted (the target would stop there).  A fully matching draft runs
    up to ``max_length`` ("length").  ``p`` is ignored.
    """

    name = "oracle"

    def __init__(self, max_length: int = 64) -> None:
        super().__init__(max_length)
        self._ref: Sequence[int] = ()
        self._offset = 0

    def set_reference(self, token_ids: Sequence[int], offset: int = 0) -> None:
        if offset < 0:
            raise ValueError("offset must be >= 0")
        self._ref = token_ids
        self._offset = int(offset)

    def _decide(self, p, token_id, position):
        if token_id is None:
            raise ValueError("OracleTrigger.observe needs the draft token id")
        pos = self.drafted - 1 if position is None else int(position)
        idx = self._offset + pos
        if idx >= len(self._ref) or int(self._ref[idx]) != int(token_id):
            return REASON_ORACLE
        return None


@dataclass
class DraftWindowConfig:
    history: int = 100   # number of recent draft lengths averaged
    initial: int = 20    # N̂ before any draft was observed
    minimum: int = 1     # floor on N̂
    maximum: int = 512   # cap on N̂


class DraftWindow:
    """Scheduling window N̂ = round(mean of the last 100 draft lengths); 20 before any.

    Rounding is half-up (``floor(x + 0.5)``), then clamped to [minimum, maximum].
    """

    def __init__(self, config: DraftWindowConfig | None = None) -> None:
        self.config = config or DraftWindowConfig()
        self._lengths: deque[int] = deque(maxlen=self.config.history)
        self._sum = 0

    def record(self, length: int) -> int:
        """Add one round's draft length; returns the new N̂."""
        length = int(length)
        if length < 0:
            raise ValueError("draft length must be >= 0")
        if len(self._lengths) == self._lengths.maxlen:
            self._sum -= self._lengths[0]
        self._lengths.append(length)
        self._sum += length
        return self.value

    @property
    def value(self) -> int:
        if not self._lengths:
            n = self.config.initial
        else:
            n = math.floor(self._sum / len(self._lengths) + 0.5)
        return max(self.config.minimum, min(self.config.maximum, n))

    def __len__(self) -> int:
        return len(self._lengths)


def make_trigger(policy: str, config: NavConfig | None = None) -> NavTrigger:
    """A trigger for a policy name: "pipesd", "hsl", "edgellm", "vanilla" or "oracle-trigger"."""
    c = config or NavConfig()
    if policy == "pipesd":
        return DualThresholdTrigger(c.r1, c.r2, c.max_length)
    if policy == "hsl":
        return SingleThresholdTrigger(c.r2, c.max_length)
    if policy == "edgellm":
        return CumulativeTrigger(c.edgellm_r1, c.edgellm_c, c.max_length)
    if policy == "vanilla":
        return FixedLengthTrigger(c.fixed_length)
    if policy == "oracle-trigger":
        return OracleTrigger(c.max_length)
    raise ValueError(f"unknown NAV policy {policy!r}")
