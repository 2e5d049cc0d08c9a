"""PipeSD policy algorithms: DP batching, NAV triggers, link/drafter estimators, BO autotuner.

All pure and fast (the whole file runs in a few seconds on two cores).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time

import numpy as np
import pytest

from services.dispatcher.spec.bo_tuner import (
    BOConfig, BOTuner, DEFAULT_R1, DEFAULT_R2, bo_search, grid_search, random_search,
)
from services.dispatcher.spec.dp_batching import (
    BatchPlanner, PlannerConfig, pipeline_time, plan_batches, plan_batches_with_time,
)
from services.dispatcher.spec.link_model import DraftSpeed, DraftSpeedConfig, LinkModel, LinkModelConfig
from services.dispatcher.spec.nav_trigger import (
    REASONS, CumulativeTrigger, DraftWindow, DualThresholdTrigger, FixedLengthTrigger, NavConfig,
    OracleTrigger, SingleThresholdTrigger, make_trigger,
)


# ---------------------------------------------------------------------------------------------
# DP batching
# ---------------------------------------------------------------------------------------------
def compositions(n: int):
    """All 2^(n-1) ordered compositions of n (each cut point present or not)."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, run = [], 1
        for c in cuts:
            if c:
                sizes.append(run)
                run = 1
            else:
                run += 1
        sizes.append(run)
        yield sizes


def test_compositions_helper_counts():
    for n in range(1, 9):
        comps = list(compositions(n))
        assert len(comps) == 2 ** (n - 1)
        assert len({tuple(c) for c in comps}) == len(comps)
        assert all(sum(c) == n for c in comps)


def test_pipeline_time_hand_examples():
    # one batch: generate 4 tokens, then send: 4γ + α + 4β
    assert pipeline_time([4], 1.0, 10.0, 0.5) == pytest.approx(4 + 10 + 2)
    # per token, link faster than drafting: link always waits for generation: nγ + α + β
    assert pipeline_time([1, 1, 1], 1.0, 0.2, 0.1) == pytest.approx(3 + 0.3)
    # per token, link slower (α+β = 3 > γ = 1): first sent at 1, then back-to-back: 1 + 3·3
    assert pipeline_time([1, 1, 1], 1.0, 2.5, 0.5) == pytest.approx(1 + 9)
    # [2, 1]: batch 1 ready at 2, sent until 2+α+2β = 5; batch 2 ready at 3, starts 5, ends 5+α+β
    assert pipeline_time([2, 1], 1.0, 2.0, 0.5) == pytest.approx(5 + 2.5)
    assert pipeline_time([], 1.0, 1.0, 1.0) == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_dp_matches_brute_force(seed):
    rng = random.Random(seed)
    for n in range(1, 13):
        # spread the regimes: link-bound, drafter-bound and balanced, zero costs included
        gamma = rng.choice([0.0, rng.uniform(0.001, 0.05)])
        alpha = rng.choice([0.0, rng.uniform(0.0, 0.1), rng.uniform(0.0, 0.01)])
        beta = rng.choice([0.0, rng.uniform(0.0, 0.02)])
        sizes, t_dp = plan_batches_with_time(n, gamma, alpha, beta)
        assert sum(sizes) == n and all(s >= 1 for s in sizes)
        assert sizes == plan_batches(n, gamma, alpha, beta)
        t_plan = pipeline_time(sizes, gamma, alpha, beta)
        assert t_plan == pytest.approx(t_dp, rel=1e-9, abs=1e-12)
        times = [pipeline_time(c, gamma, alpha, beta) for c in compositions(n)]
        best = min(times)
        assert t_plan == pytest.approx(best, rel=1e-9, abs=1e-12), (n, gamma, alpha, beta, sizes)
        # tie-break: among the optimal plans, the earliest-sending one (least reversed sizes)
        optimal = [c[::-1] for c, t in zip(compositions(n), times)
                   if t <= best * (1 + 1e-9) + 1e-12]
        assert sizes[::-1] == min(optimal), (n, gamma, alpha, beta, sizes)


def test_dp_regimes():
    # link faster than the drafter: stream every token (ties broken towards sending early)
    assert plan_batches(6, 1.0, 0.0, 0.1) == [1] * 6
    assert plan_batches(6, 1.0, 0.5, 0.0) == [1] * 6
    assert plan_batches(6, 0.0, 0.0, 0.0) == [1] * 6
    # huge start-up cost: one batch
    assert plan_batches(6, 0.001, 100.0, 0.001) == [6]
    # batches grow when the link is the bottleneck... and the plan always covers n
    sizes = plan_batches(20, 0.015, 0.03, 0.001)
    assert sum(sizes) == 20 and 1 < len(sizes) < 20
    assert plan_batches(0, 1.0, 1.0, 1.0) == []
    with pytest.raises(ValueError):
        plan_batches(3, -1.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        plan_batches(3, 1.0, float("nan"), 0.0)


def test_dp_fast_for_large_window():
    t = time.perf_counter()
    sizes = plan_batches(256, 0.015, 0.02, 0.0005)
    assert sum(sizes) == 256
    assert time.perf_counter() - t < 2.0


def test_planner_replans_only_on_material_change():
    pl = BatchPlanner(PlannerConfig(replan_fraction=0.2))
    assert pl.update(0.01, 0.001, 0.015, 20) and pl.reason == "initial"
    assert sum(pl.sizes) == 20 and max(pl.cut_points) == 20
    assert pl.predicted_time <= min(pl.single_batch_time, pl.per_token_time) + 1e-12
    first = list(pl.sizes)
    assert not pl.update(0.0115, 0.00081, 0.0169, 20)      # every move under 20 %
    assert pl.sizes == first and pl.replans == 1
    # drift is measured against the plan's inputs, not the previous call: 0.0115 → 0.0125 is 25 %
    assert pl.update(0.0125, 0.001, 0.015, 20) and pl.reason == "alpha"
    assert pl.update(0.0125, 0.001, 0.015, 21) and pl.reason == "window"
    assert pl.update(0.0125, 0.002, 0.03, 21) and pl.reason == "beta+gamma"
    assert not pl.update(0.0125, 0.002, 0.03, 21)
    assert pl.is_cut(21) and not pl.is_cut(0)
    assert "N̂=21" in pl.describe()
    # from zero any change counts
    pl2 = BatchPlanner()
    pl2.update(0.0, 0.001, 0.01, 10)
    assert pl2.update(1e-9, 0.001, 0.01, 10) and pl2.reason == "alpha"


# ---------------------------------------------------------------------------------------------
# NAV triggers
# ---------------------------------------------------------------------------------------------
def test_dual_threshold_cumulative_and_single():
    t = DualThresholdTrigger(r1=0.5, r2=0.3, max_length=0)
    assert t.observe(0.9) is None and t.c1 == pytest.approx(0.9)
    assert t.observe(0.8) is None and t.c1 == pytest.approx(0.72)
    assert t.observe(0.6) == "cumulative"          # 0.432 ≤ 0.5; this token is verified too
    assert t.c1 == 1.0 and t.drafted == 0           # C1 reset on trigger
    assert t.observe(0.95) is None                  # a fresh product: 0.95 > 0.5
    assert t.observe(0.31) == "cumulative"          # 0.2945 ≤ 0.5, P = 0.31 > 0.3


def test_dual_threshold_reason_labels():
    t = DualThresholdTrigger(r1=0.2, r2=0.3, max_length=0)
    assert t.observe(0.25) == "single"              # C1* = 0.25 > 0.2, P = 0.25 ≤ 0.3
    assert t.observe(0.1) == "both"                 # C1* = 0.1 ≤ 0.2 and P ≤ 0.3
    assert t.observe(0.5) is None
    assert t.observe(0.35) == "cumulative"          # C1* = 0.175 ≤ 0.2, P > 0.3
    # boundaries are inclusive (≤)
    t2 = DualThresholdTrigger(r1=0.5, r2=0.25, max_length=0)
    assert t2.observe(0.25) == "both"
    t3 = DualThresholdTrigger(r1=1e-6, r2=0.5, max_length=0)
    assert t3.observe(0.5) == "single"


def test_dual_threshold_length_cap_reset_and_thresholds():
    t = DualThresholdTrigger(r1=1e-6, r2=1e-6, max_length=4)
    assert [t.observe(0.99) for _ in range(4)] == [None, None, None, "length"]
    assert t.drafted == 0 and t.c1 == 1.0
    t.observe(0.5)
    t.reset()
    assert t.c1 == 1.0 and t.drafted == 0
    t.set_thresholds(r1=5.0, r2=-1.0)               # clamped to [1e-6, 1]
    assert t.thresholds() == {"r1": 1.0, "r2": 1e-6}
    assert t.observe(1.0000001) == "cumulative"     # p clamped to 1, C1* = 1 ≤ R1 = 1
    with pytest.raises(ValueError):
        t.observe(float("nan"))


def test_single_threshold_hsl():
    t = SingleThresholdTrigger(r2=0.4, max_length=3)
    assert t.observe(0.41) is None
    assert t.observe(0.4) == "single"
    assert [t.observe(0.9) for _ in range(3)] == [None, None, "length"]
    t.on_round(5, 2)                                 # not adaptive
    assert t.thresholds() == {"r2": 0.4}


def test_cumulative_edgellm_rule():
    t = CumulativeTrigger(r1=0.4, c=0.5, max_length=0)
    assert t.observe(0.8) is None
    assert t.observe(0.5) == "cumulative"           # 0.4 ≤ 0.4
    t.on_round(4, 4)                                 # fully accepted: halve
    assert t.r1 == pytest.approx(0.2)
    t.on_round(4, 2)                                 # ÷ C^((n−a)/n) = ÷ 0.5^0.5
    assert t.r1 == pytest.approx(0.2 / math.sqrt(0.5))
    t.on_round(3, 0)                                 # nothing accepted: ÷ C → doubles
    assert t.r1 == pytest.approx(0.4 / math.sqrt(0.5))
    for _ in range(5):
        t.on_round(2, 0)
    assert t.r1 == 1.0                               # clamped at 1
    for _ in range(40):
        t.on_round(2, 2)
    assert t.r1 == 1e-6                              # clamped at 1e-6
    t.on_round(0, 0)
    assert t.r1 == 1e-6
    with pytest.raises(ValueError):
        t.on_round(2, 3)
    with pytest.raises(ValueError):
        CumulativeTrigger(c=1.0)


def test_fixed_length_vanilla():
    t = FixedLengthTrigger(3)
    assert [t.observe(0.01) for _ in range(6)] == [None, None, "length"] * 2


def test_oracle_triggers_at_first_mismatch():
    t = OracleTrigger(max_length=10)
    t.set_reference([5, 6, 7, 8])
    assert t.observe(0.1, token_id=5) is None
    assert t.observe(0.1, token_id=6) is None
    assert t.observe(0.99, token_id=9) == "oracle"   # first token the target rejects, included
    # next round: the caller passes the full target output and how much is committed
    full = [5, 6, 7, 8, 1, 2]
    t.set_reference(full, offset=3)
    assert t.observe(0.5, token_id=8) is None
    assert t.observe(0.5, token_id=1) is None
    assert t.observe(0.5, token_id=2) is None
    assert t.observe(0.5, token_id=3) == "oracle"    # reference exhausted
    t.set_reference([4] * 100)
    assert t.observe(0.5, token_id=4, position=0) is None
    assert t.observe(0.5, token_id=3, position=1) == "oracle"
    t.set_reference([4] * 100)
    assert [t.observe(0.5, token_id=4) for _ in range(10)][-1] == "length"
    with pytest.raises(ValueError):
        t.observe(0.5)


def test_common_interface_and_factory():
    for policy in ("pipesd", "hsl", "edgellm", "vanilla", "oracle-trigger"):
        trig = make_trigger(policy, NavConfig(max_length=5, fixed_length=5))
        if policy == "oracle-trigger":
            trig.set_reference([1] * 100)
        reasons = set()
        for _ in range(12):
            r = trig.observe(0.999, token_id=1)
            if r is not None:
                reasons.add(r)
        assert reasons and reasons <= set(REASONS)
        trig.on_round(5, 3)
        trig.set_thresholds(0.5, 0.5)
        trig.reset()
        assert trig.drafted == 0
    with pytest.raises(ValueError):
        make_trigger("nope")


def test_draft_window():
    w = DraftWindow()
    assert w.value == 20
    assert w.record(3) == 3
    w.record(4)
    assert w.value == 4                              # 3.5 rounds half-up
    w2 = DraftWindow()
    for _ in range(100):
        w2.record(10)
    for _ in range(50):
        w2.record(30)
    assert len(w2) == 100 and w2.value == 20         # only the last 100 count
    for _ in range(100):
        w2.record(0)
    assert w2.value == 1                             # floored at 1


# ---------------------------------------------------------------------------------------------
# Link model and drafter speed
# ---------------------------------------------------------------------------------------------
def test_link_model_recovers_alpha_beta_from_noisy_data():
    rng = np.random.default_rng(0)
    alpha, beta = 0.012, 0.0008
    lm = LinkModel(LinkModelConfig(window=64, one_way_latency_s=0.05))
    for _ in range(200):
        s = int(rng.integers(1, 33))
        lm.observe(s, max(0.0, alpha + beta * s + rng.normal(0, 0.0005)))
    assert lm.alpha == pytest.approx(alpha, rel=0.1)
    assert lm.beta == pytest.approx(beta, rel=0.05)
    assert lm.latency_s == 0.05                      # latency is not part of α
    assert lm.delivery_time(10) == pytest.approx(0.05 + lm.alpha + 10 * lm.beta)
    # round trips: 2·latency removed before fitting
    lm2 = LinkModel(LinkModelConfig(one_way_latency_s=0.05))
    for _ in range(100):
        s = int(rng.integers(1, 33))
        lm2.observe_round_trip(s, 0.1 + alpha + beta * s + rng.normal(0, 0.0005))
    assert lm2.alpha == pytest.approx(alpha, rel=0.1)
    assert lm2.beta == pytest.approx(beta, rel=0.1)


def test_link_model_window_tracks_change():
    lm = LinkModel(LinkModelConfig(window=32))
    for i in range(100):
        s = 1 + i % 16
        lm.observe(s, 0.01 + 0.001 * s)
    for i in range(32):
        s = 1 + i % 16
        lm.observe(s, 0.002 + 0.004 * s)              # bandwidth dropped
    assert lm.alpha == pytest.approx(0.002, abs=1e-9)
    assert lm.beta == pytest.approx(0.004, rel=1e-9)


def test_link_model_seeds_and_clamping():
    cfg = LinkModelConfig(alpha_seed=0.003, beta_seed=0.0004)
    lm = LinkModel(cfg)
    assert lm.params() == (0.003, 0.0004) and not lm.fitted
    for _ in range(10):
        lm.observe(8, 0.01)                           # one distinct size only: still seeds
    assert lm.params() == (0.003, 0.0004)
    lm.observe(4, 0.02)                               # time falls with size: β would be < 0
    a, b = lm.params()
    assert lm.fitted and a >= 0 and b == 0.0
    assert a == pytest.approx(sum([0.01] * 10 + [0.02]) / 11)
    lm3 = LinkModel()
    for s, t in ((1, 0.0), (2, 0.0), (10, 0.5), (11, 0.55)):   # intercept would be < 0
        lm3.observe(s, t)
    a, b = lm3.params()
    assert a == 0.0 and b > 0
    with pytest.raises(ValueError):
        lm3.observe(0, 0.1)
    with pytest.raises(ValueError):
        lm3.observe(1, -0.1)
    lm3.observe_latency(0.02)
    assert lm3.latency_s == pytest.approx(0.2 * 0.02)


def test_draft_speed_ewma():
    ds = DraftSpeed(DraftSpeedConfig(gamma_seed=0.015, ewma=0.5))
    assert ds.gamma == 0.015
    assert ds.observe(4, 0.08) == pytest.approx(0.02)            # first timing replaces the seed
    assert ds.observe(1, 0.04) == pytest.approx(0.5 * 0.02 + 0.5 * 0.04)
    with pytest.raises(ValueError):
        ds.observe(0, 0.1)


# ---------------------------------------------------------------------------------------------
# BO autotuner
# ---------------------------------------------------------------------------------------------
R1_STAR, R2_STAR, TPT_STAR = 1e-2, 0.6, 0.05


def bowl(r1: float, r2: float) -> float:
    """A smooth TPT bowl in (log10 R1, R2), minimum TPT_STAR at (R1_STAR, R2_STAR)."""
    u = (math.log10(r1) - math.log10(R1_STAR)) / 2.0
    v = r2 - R2_STAR
    return TPT_STAR * (1 + 0.5 * u * u + 3.0 * v * v)


def test_the_dispatcher_imports_the_optimizer_before_it_serves():
    """skopt (with scikit-learn and scipy) is imported when the dispatcher's modules are, not
    when the first spec request makes a policy's tuner on the event loop: that lazy import froze
    the loop ~2 s, and the dispatcher declared its peers lost. A fresh process, since this one
    has imported skopt already."""
    import subprocess
    import sys

    code = ("import sys; import services.dispatcher.service; "
            "print('skopt' in sys.modules, 'sklearn.gaussian_process' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["True", "True"], out


def test_bo_tuner_converges_on_bowl():
    t0 = time.perf_counter()
    rng = np.random.default_rng(1)
    tuner = BOTuner(BOConfig(random_state=0))
    assert tuner.current() == (DEFAULT_R1, DEFAULT_R2) and tuner.state == "exploring"
    seen = set()
    while tuner.state == "exploring":
        r1, r2 = tuner.current()
        assert 1e-6 <= r1 <= 1 and 1e-6 <= r2 <= 1
        seen.add((r1, r2))
        tpt = bowl(r1, r2) * (1 + 0.02 * rng.standard_normal())
        # rounds of 7 accepted tokens: three rounds make one ≥ 20-token evaluation
        changed = [tuner.record(tpt * 7, 7) for _ in range(3)]
        assert changed[:2] == [False, False]
    assert tuner.n_evaluations == 16 and len(seen) >= 15
    assert all(e.tokens >= 20 for e in tuner.evaluations)
    assert tuner.state == "settled" and tuner.current() == (tuner.best.r1, tuner.best.r2)
    assert bowl(tuner.best.r1, tuner.best.r2) <= 1.10 * TPT_STAR
    assert time.perf_counter() - t0 < 10.0


def test_bo_tuner_settles_by_posterior_not_by_a_lucky_window():
    """Live windows are noisy (the text being generated moves TPT more than the thresholds do):
    one window reported 40 % too fast must not decide where the tuner settles. Settling on the
    best *measured* point would pick it (true TPT 1.30x the optimum on average over these
    seeds); the GP posterior mean, which models noise, does not."""
    posterior, measured = [], []
    for seed in range(6):
        rng = np.random.default_rng(seed)
        tuner = BOTuner(BOConfig(random_state=seed))
        i = 0
        while tuner.state == "exploring":
            tpt = bowl(*tuner.current()) * (1 + 0.05 * rng.standard_normal())
            if i == 2:
                tpt = 0.6 * bowl(*tuner.current())        # a lucky window (easy text)
            i += 1
            tuner.record(tpt * 20, 20)
        assert tuner.current() == (tuner.best.r1, tuner.best.r2)
        posterior.append(bowl(*tuner.current()) / TPT_STAR)
        low = min(tuner.evaluations, key=lambda e: e.tpt)
        measured.append(bowl(low.r1, low.r2) / TPT_STAR)
    assert statistics.fmean(posterior) <= 1.10
    assert statistics.fmean(posterior) < statistics.fmean(measured) - 0.1


def test_bo_tuner_reproducible():
    def run():
        tuner = BOTuner(BOConfig(random_state=3, n_calls=8))
        xs = []
        while tuner.state == "exploring":
            xs.append(tuner.current())
            tuner.record(bowl(*tuner.current()) * 20, 20)
        return xs
    assert run() == run()


def test_bo_tuner_drift_retunes():
    cfg = BOConfig(random_state=0, n_calls=6, n_initial_points=3, drift_baseline_windows=2,
                   drift_patience=2, warm_start_points=2)
    tuner = BOTuner(cfg)
    while tuner.state == "exploring":
        tuner.record(bowl(*tuner.current()) * 20, 20)
    best = tuner.best
    assert tuner.current() == (best.r1, best.r2)
    # baseline windows at the settled point, then small noise: no re-tune
    for f in (1.0, 1.02, 0.98, 1.1, 0.95, 1.05):
        tuner.record(bowl(*tuner.current()) * f * 20, 20)
    assert tuner.state == "settled" and tuner.reference_tpt is not None and tuner.retunes == 0
    # one outlier window does not re-tune (patience)
    tuner.record(bowl(*tuner.current()) * 3 * 20, 20)
    tuner.record(bowl(*tuner.current()) * 20, 20)
    assert tuner.state == "settled"
    # the link gets 2× slower for good: re-tune, warm-started at the previous best points
    changed = False
    for _ in range(3):
        changed |= tuner.record(bowl(*tuner.current()) * 2 * 20, 20)
        if tuner.state == "exploring":
            break
    assert tuner.state == "exploring" and tuner.retunes == 1
    assert tuner.current() == (best.r1, best.r2) and tuner.n_evaluations == 0
    tuner.record(bowl(*tuner.current()) * 2 * 20, 20)
    ranked = sorted(tuner.history[:6], key=lambda e: e.tpt)
    assert tuner.current() == (ranked[1].r1, ranked[1].r2)
    while tuner.state == "exploring":
        tuner.record(bowl(*tuner.current()) * 2 * 20, 20)
    assert tuner.state == "settled" and len(tuner.history) == 12


def test_bo_tuner_accumulates_and_validates():
    tuner = BOTuner(BOConfig(min_tokens=20))
    assert tuner.record(1.0, 0) is False                  # no tokens yet
    assert tuner.record(1.0, 19) is False
    assert tuner.record(0.0, 1) is True                   # 20 tokens: evaluated, next candidate
    assert tuner.evaluations[0].tpt == pytest.approx(2.0 / 20)
    assert tuner.evaluations[0].tokens == 20
    with pytest.raises(ValueError):
        tuner.record(-1.0, 3)


def test_search_helpers_for_benchmark():
    g = grid_search(bowl, 16)
    assert len(g.evaluations) == 16
    assert len({e.r1 for e in g.evaluations}) == 4 and len({e.r2 for e in g.evaluations}) == 4
    r = random_search(bowl, 16, seed=0)
    assert len(r.evaluations) == 16 and r == random_search(bowl, 16, seed=0)
    b = bo_search(bowl, 16, seed=0)
    assert len(b.evaluations) == 16
    for res in (g, r, b):
        assert res.best_tpt == min(e.tpt for e in res.evaluations) >= TPT_STAR
    assert bowl(b.best_r1, b.best_r2) <= 1.10 * TPT_STAR
    # (which search wins on one seed is luck: the bowl's minimum lies near a 4×4 grid cell
    # centre; comparing them over many seeds and objectives is the benchmark's job)
