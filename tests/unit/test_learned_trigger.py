"""The `pipesd-learned` trigger (services/dispatcher/spec/learned_trigger.py): its
online model learns a synthetic acceptance law and follows it when the law changes, and its
stopping rule lengthens rounds when the link's round trip grows (the WAN emulator's schedule
drives the RTT) and shortens them when it recovers, close to the best fixed draft length of
each phase."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from stack.wan import Schedule, Step
from services.dispatcher.spec.learned_trigger import (REASON_LEARNED, AcceptanceModel,
                                                      LearnedConfig, LearnedTrigger, features)
from services.dispatcher.spec.mode import POLICY_KNOBS
from services.dispatcher.spec.session import POLICIES


def _sigmoid(z):
    return 1 / (1 + math.exp(-z))


# Two acceptance laws over the drafter's features: an over-confident drafter (accepts less than
# P(D_n) says, the margin matters) and, after the change, a better-matched one.
LAW_A = lambda p, ent, margin: _sigmoid(2.0 * math.log(p / (1 - p)) + 2.0 * margin - 2.5)   # noqa: E731
LAW_B = lambda p, ent, margin: _sigmoid(0.5 * math.log(p / (1 - p)) + 1.5)                  # noqa: E731


class Tokens:
    """A stream of draft tokens: (P(D_n), entropy, margin) like a drafter's."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def next(self):
        p = float(np.clip(self.rng.beta(4.0, 1.2), 0.02, 0.995))
        second = float(self.rng.uniform(0, 1 - p))
        entropy = float(-(p * math.log(p)) - (1 - p) * math.log(max(1e-9, 1 - p)) + 0.5 * (1 - p))
        return p, entropy, p - min(p, second)


def _calibration_error(model, law, tokens, depth=2, n=3000):
    err = 0.0
    for _ in range(n):
        p, ent, margin = tokens.next()
        x = features(p, ent, margin, depth, model.recent, 0.05)
        err += abs(model.predict(x) - law(p, ent, margin))
    return err / n


def _train(model, law, tokens, rng, rounds, length=6):
    """Rounds of `length` drafts verified as a chain: accepted up to the first rejection."""
    for _ in range(rounds):
        xs, accepted, alive = [], 0, True
        for d in range(length):
            p, ent, margin = tokens.next()
            xs.append(features(p, ent, margin, d, model.recent, 0.05))
            if alive and rng.random() < law(p, ent, margin):
                accepted += 1
            else:
                alive = False
        model.observe_round(xs, accepted)


def test_the_model_learns_a_law_and_follows_it_when_it_changes():
    model, tokens, rng = AcceptanceModel(), Tokens(0), np.random.default_rng(1)
    before = _calibration_error(model, LAW_A, Tokens(9))      # the prior: P(accept) = P(D_n)
    _train(model, LAW_A, tokens, rng, 3000)
    learned_a = _calibration_error(model, LAW_A, Tokens(9))
    assert learned_a < 0.05 and learned_a < before / 3, (before, learned_a)
    stale = _calibration_error(model, LAW_B, Tokens(9))
    _train(model, LAW_B, tokens, rng, 3000)                    # the law changes mid-stream
    learned_b = _calibration_error(model, LAW_B, Tokens(9))
    assert learned_b < 0.05 and learned_b < stale / 3, (stale, learned_b)
    # bounded weights whatever it saw
    assert np.abs(model.w).max() <= model.config.max_weight


def test_weights_stay_bounded_under_adversarial_labels():
    model = AcceptanceModel(LearnedConfig(lr=1.0, max_weight=2.0))
    x = features(0.999, 0.01, 0.99, 0, 1.0, 0.05)
    for _ in range(500):
        model.update(x, False)     # confident tokens always rejected
    assert np.abs(model.w).max() <= 2.0 and 0.0 < model.predict(x) < 1.0


# --- the stopping rule against the link, the RTT following a WAN emulator schedule -------------

GAMMA, ALPHA, BETA = 0.015, 0.002, 0.0002
VERIFY_S = 0.02
LATENCY = Schedule([Step(0, "both", {"latency_ms": 2.5}), Step(60, "both", {"latency_ms": 100.0}),
                    Step(180, "both", {"latency_ms": 2.5})])


def _rtt(t: float) -> float:
    at = LATENCY.at(t)
    return (at["up"]["latency_ms"] + at["down"]["latency_ms"]) / 1000


def _round_time(n: int, rtt: float) -> float:
    return n * GAMMA + ALPHA + BETA * n + rtt + VERIFY_S


def _one_round(trigger, tokens, rng, law):
    """Draft until the trigger fires; the chain is accepted up to its first rejection."""
    alive, accepted, n = True, 0, 0
    while True:
        p, ent, margin = tokens.next()
        trigger.context(ent, margin)
        n += 1
        if alive and rng.random() < law(p, ent, margin):
            accepted += 1
        else:
            alive = False
        if trigger.observe(p) is not None:
            trigger.on_round(n, accepted)
            return n, accepted


@functools.cache
def _fixed_acceptance(law, seed=5) -> tuple[float, ...]:
    """Expected tokens accepted per round of each fixed draft length 1..24 (by simulation): the
    same whatever the round trip, which only prices the rounds."""
    tokens, rng = Tokens(seed), np.random.default_rng(seed)
    out = []
    for n in range(1, 25):
        got = 0
        for _ in range(400):
            alive = True
            for _ in range(n):
                p, ent, margin = tokens.next()
                if alive and rng.random() < law(p, ent, margin):
                    got += 1
                else:
                    alive = False
        out.append(got / 400)
    return tuple(out)


def _best_fixed_rate(law, rtt):
    """Tokens per second of the best fixed draft length (expected, by simulation)."""
    return max((accepted + 1) / _round_time(n, rtt)
               for n, accepted in enumerate(_fixed_acceptance(law), start=1))


def test_rounds_follow_the_round_trip_and_stay_near_the_best_fixed_length():
    now = {"t": 0.0}
    trigger = LearnedTrigger(AcceptanceModel(), lambda: (_rtt(now["t"]), ALPHA, BETA, GAMMA))
    tokens, rng = Tokens(3), np.random.default_rng(4)
    phases = []
    for t_end in (60, 180, 300):            # LAN-like, then a 200 ms round trip, then LAN again
        rows = []
        while now["t"] < t_end:
            n, accepted = _one_round(trigger, tokens, rng, LAW_A)
            dt = _round_time(n, _rtt(now["t"]))
            rows.append((n, accepted + 1, dt))
            now["t"] += dt
        rows = rows[len(rows) // 4:]          # the model and the link estimate caught up
        phases.append((np.mean([r[0] for r in rows]),
                       sum(r[1] for r in rows) / sum(r[2] for r in rows)))
    (lan1_len, lan1_rate), (wan_len, wan_rate), (lan2_len, lan2_rate) = phases
    assert wan_len > 1.5 * lan1_len and wan_len > 1.5 * lan2_len, phases
    # within 10 % of the rate of each phase's best fixed draft length (the clairvoyant chain)
    for rate, rtt in ((lan1_rate, 0.005), (wan_rate, 0.2), (lan2_rate, 0.005)):
        assert rate > 0.9 * _best_fixed_rate(LAW_A, rtt), (rate, rtt, phases)


def test_k_prices_waiting_and_length_caps():
    model = AcceptanceModel()
    sure = LearnedTrigger(model, lambda: (0.05, ALPHA, BETA, GAMMA), k=0.0, max_length=5)
    assert [sure.observe(0.99) for _ in range(5)] == [None] * 4 + ["length"]
    eager = LearnedTrigger(model, lambda: (0.05, ALPHA, BETA, GAMMA), k=100.0)
    assert eager.observe(0.99) == REASON_LEARNED
    with pytest.raises(ValueError):
        LearnedTrigger(model, lambda: (0.05, ALPHA, BETA, GAMMA), k=float("nan"))


def test_labels_follow_positions_across_closed_rounds_and_resets():
    model = AcceptanceModel(LearnedConfig(lr=0.0))   # count updates only
    trig = LearnedTrigger(model, lambda: (0.05, ALPHA, BETA, GAMMA), k=0.0)
    for _ in range(3):
        trig.observe(0.9)
    trig.round_closed()             # the dispatcher closed it (length cap): 3 pending
    trig.observe(0.9)
    trig.observe(0.9)               # a proactive round's 2 drafts
    trig.on_round(3, 1)             # accepted 1: tokens 0 (positive) and 1 (negative) teach
    assert model.updates == 2 and len(trig.pending) == 2
    trig.reset()                    # rejected: the proactive round is discarded
    assert not trig.pending
    trig.on_round(0, 0)             # a zero-draft round teaches nothing
    assert model.updates == 2


def test_registered_as_a_policy_with_a_knob():
    pol = POLICIES["pipesd-learned"]
    assert pol.trigger == "pipesd-learned" and pol.dp and pol.proactive and not pol.bo
    assert POLICY_KNOBS["pipesd-learned"] == {"k": (0.0, 100.0)}
    from bench.tuning import DEFAULTS, KNOBS
    assert [k[0] for k in KNOBS["pipesd-learned"]] == ["k"] and DEFAULTS["pipesd-learned"]["k"] == 1


def test_drafter_features_are_the_entropy_and_margin_of_its_distribution():
    from services.drafter.engine import _entropy_margin
    rng = np.random.default_rng(2)
    for temperature in (1.0, 0.7):
        logits = (rng.standard_normal(1000) * 4).astype(np.float32)
        x = logits.astype(np.float64) / temperature
        p = np.exp(x - x.max())
        p /= p.sum()
        top = np.sort(p)[::-1]
        entropy, margin = _entropy_margin(logits, temperature)
        assert entropy == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-9)
        assert margin == pytest.approx(float(top[0] - top[1]), rel=1e-9)
