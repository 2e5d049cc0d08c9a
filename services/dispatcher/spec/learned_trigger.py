"""The `pipesd-learned` NAV trigger: PipeSD's dual threshold replaced by an online model of
P(next draft token accepted) and a stopping rule priced with the link model.

Pure, no I/O, no clock: the dispatcher feeds it draft tokens (with the drafter's features),
round outcomes and, through `costs()`, its current link and drafter estimates.

The model. Online logistic regression on a few bounded features of a draft token x_t:

    logit(p)      the draft probability P(D_n) (clipped to [-8, 8]); its weight starts at 1 and
                  every other at 0, so before any data the model predicts P(accept) = P(D_n)
    entropy       of the drafter's distribution at that position (nats, / 4, clipped to [0, 3])
    margin        top-1 minus top-2 probability of the drafter's distribution
    depth         position of the token in its round (0-based, / 16, clipped to [0, 4])
    recent        an exponential moving average of accepted / verified tokens over recent rounds
    rtt           the link's round trip (seconds / 0.1, clipped to [0, 10])

It estimates the *conditional* acceptance P(x_t accepted | every earlier draft of its round
accepted) — what the stopping rule needs — because that is what each round reveals: with n
drafts verified and a accepted, tokens 0..a-1 are positives, token a (when a < n) a negative,
and the tokens after it carry no label (the verifier never judged them). One SGD step per
labelled token, learning rate `lr`, L2 pull `l2` towards the prior, weights clipped to
[-max_weight, max_weight], so a burst of odd rounds cannot run the model away; the model keeps
learning for ever, so when the acceptance law changes (another prompt, the Gumbel coupling, a
drafter under load) it follows within tens of rounds.

The stopping rule (renewal-reward: end a round when its marginal token earns less than the
round's average rate). In the current round, after n drafts with predicted conditional
acceptances a_1..a_n,

    S_n = Π a_i                  P(all n accepted)
    E_n = Σ_k Π_{i<=k} a_i       expected accepted drafts
    T_n = RTT + α + (β + γ)·n    the round's time: a round trip, the transmission, the drafting

and one more token would add S_n·â accepted drafts (â: the model's acceptance for a next token
like this one, one level deeper) for β + γ more seconds, which at the round's rate
(E_n + 1) / T_n (the +1: the target's own token) is worth (E_n + 1)(β + γ) / T_n tokens.
The trigger fires ("learned") when

    S_n · â  <  k · (E_n + 1) · (β + γ) / T_n

k (knob, default 1) scales the price of waiting; the BO tunes it like PipeSD's (R1, R2). A
longer round trip makes every round dearer and waiting cheaper, so drafts grow with the RTT
(roughly with its log: S_n decays geometrically), and shrink again when the link recovers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from services.dispatcher.spec.nav_trigger import NavTrigger, _check_p

__all__ = ["REASON_LEARNED", "FEATURES", "LearnedConfig", "AcceptanceModel", "LearnedTrigger",
           "features"]

REASON_LEARNED = "learned"
FEATURES = ("bias", "logit_p", "entropy", "margin", "depth", "recent", "rtt")
_LOGIT_CLIP = 8.0


@dataclass
class LearnedConfig:
    lr: float = 0.05            # SGD step of the logistic regression
    l2: float = 1e-3            # pull of the weights towards the prior per step
    max_weight: float = 8.0     # |w_i| bound
    recent_weight: float = 0.1  # EMA weight of a round in the recent-acceptance feature
    k: float = 1.0              # price of waiting (the stopping rule's knob)
    max_length: int = 64        # hard cap on draft tokens per round ("length")


def features(p: float, entropy: float | None, margin: float | None, depth: int, recent: float,
             rtt_s: float) -> np.ndarray:
    """The model's feature vector (FEATURES), every entry bounded. A drafter that sends no
    entropy / margin (an older one) gets neutral values derived from p."""
    p = min(1.0 - 1e-6, max(1e-6, float(p)))
    if entropy is None or not math.isfinite(entropy):
        entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))   # a two-outcome stand-in
    if margin is None or not math.isfinite(margin):
        margin = max(0.0, 2 * p - 1)                                # p against 1 - p
    rtt = rtt_s if math.isfinite(rtt_s) and rtt_s > 0 else 0.0
    return np.array([1.0,
                     min(_LOGIT_CLIP, max(-_LOGIT_CLIP, math.log(p / (1 - p)))),
                     min(3.0, max(0.0, entropy / 4.0)),
                     min(1.0, max(0.0, margin)),
                     min(4.0, max(0.0, depth / 16.0)),
                     min(1.0, max(0.0, recent)),
                     min(10.0, rtt / 0.1)])


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


class AcceptanceModel:
    """Online logistic regression of P(draft token accepted | features); shared by every
    session of a dispatcher (per policy), so each round teaches the next request too."""

    def __init__(self, config: LearnedConfig | None = None):
        self.config = config or LearnedConfig()
        self.prior = np.zeros(len(FEATURES))
        self.prior[FEATURES.index("logit_p")] = 1.0     # P(accept) = P(D_n) before any data
        self.w = self.prior.copy()
        self.updates = 0
        self.recent = 0.7          # recent acceptance before any round (a typical draft)

    def predict(self, x: np.ndarray) -> float:
        return _sigmoid(float(self.w @ x))

    def update(self, x: np.ndarray, accepted: bool) -> None:
        c = self.config
        err = float(accepted) - self.predict(x)
        self.w += c.lr * (err * x - c.l2 * (self.w - self.prior))
        np.clip(self.w, -c.max_weight, c.max_weight, out=self.w)
        self.updates += 1

    def observe_round(self, xs: list[np.ndarray], accepted: int) -> None:
        """A verified round's tokens (in order) and how many the target accepted."""
        for i, x in enumerate(xs[:accepted + 1]):
            self.update(x, i < accepted)
        if xs:
            w = self.config.recent_weight
            self.recent = (1 - w) * self.recent + w * (min(accepted, len(xs)) / len(xs))

    def weights(self) -> dict[str, float]:
        return dict(zip(FEATURES, map(float, self.w)))


# costs() -> (rtt_s, alpha_s, beta_s, gamma_s): the link model's and the drafter's estimates now
Costs = Callable[[], tuple[float, float, float, float]]


class LearnedTrigger(NavTrigger):
    """`pipesd-learned`'s trigger over a shared AcceptanceModel (module docstring).

    Round bookkeeping: every observed draft's feature vector joins a FIFO in position order;
    `on_round(n, a)` (results come in round order) takes the first n, teaches the model with
    them and drops them; `reset()` (a rollback, a lost verifier: nothing pending will be judged)
    clears it. A round closed by the dispatcher itself (its length cap, the drafter paused)
    leaves the trigger's round state running; `round_closed()` (NavTrigger's hook for it) and
    the FIFO keep the labels aligned either way, since they follow positions, not triggers."""

    name = "pipesd-learned"

    def __init__(self, model: AcceptanceModel, costs: Costs, k: float | None = None,
                 max_length: int | None = None):
        c = model.config
        super().__init__(c.max_length if max_length is None else max_length)
        self.model = model
        self.costs = costs
        self.k = c.k if k is None else float(k)
        if not (self.k >= 0 and math.isfinite(self.k)):
            raise ValueError(f"k must be finite and >= 0, got {k!r}")
        self.pending: deque[np.ndarray] = deque()
        self._context: tuple[float | None, float | None] = (None, None)
        self._price: tuple[float, float] | None = None    # (rtt + α, β + γ) for this round
        self._reset_round()

    # -- inputs ----------------------------------------------------------------------------------
    def context(self, entropy: float | None, margin: float | None) -> None:
        """The drafter's entropy and top-2 margin of the token observe() gets next."""
        self._context = (entropy, margin)

    def observe(self, p: float, token_id: int | None = None, position: int | None = None):
        p = _check_p(p)
        if self._price is None:
            rtt, alpha, beta, gamma = self.costs()
            rtt = rtt if math.isfinite(rtt) and rtt > 0 else 0.0
            self._price = (rtt + max(0.0, alpha), max(1e-6, beta + gamma))
            self._rtt = rtt
        entropy, margin = self._context
        self._context = (None, None)
        depth = self.drafted
        x = features(p, entropy, margin, depth, self.model.recent, self._rtt)
        self.pending.append(x)
        self.drafted += 1
        a = self.model.predict(x)
        self.S *= a
        self.E += self.S
        reason = None
        if self.max_length and self.drafted >= self.max_length:
            reason = "length"
        else:
            nxt = x.copy()
            nxt[FEATURES.index("depth")] = min(4.0, (depth + 1) / 16.0)
            fixed, per_token = self._price
            gain = self.S * self.model.predict(nxt)
            cost = self.k * (self.E + 1.0) * per_token / (fixed + per_token * self.drafted)
            if gain < cost:
                reason = REASON_LEARNED
        if reason is not None:
            self._reset_round()
        return reason

    def on_round(self, n_drafted: int, n_accepted: int) -> None:
        super().on_round(n_drafted, n_accepted)
        xs = [self.pending.popleft() for _ in range(min(n_drafted, len(self.pending)))]
        self.model.observe_round(xs, n_accepted)

    def round_closed(self) -> None:
        self._reset_round()

    def reset(self) -> None:
        self.pending.clear()
        self._reset_round()

    # -- internals -------------------------------------------------------------------------------
    def _reset_round(self) -> None:
        self.drafted = 0
        self.S, self.E = 1.0, 0.0
        self._price = None
        self._rtt = 0.0

    def thresholds(self) -> dict[str, float]:
        return {"k": self.k}
