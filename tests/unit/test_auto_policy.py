"""The auto chooser's rules (services/dispatcher/auto_policy.py), without processes: cold start,
exploration, the latency and SLO objectives, and its speculative cost model's terms."""

from __future__ import annotations

import math

import pytest

from services.dispatcher import auto_policy as ap
from services.dispatcher.auto_policy import CLOUD_ONLY, Candidate, Estimates, Link
from services.dispatcher.config import AutoConfig
from services.dispatcher.spec.dp_batching import plan_batches_with_time

PIPESD = Candidate("spec", policy="pipesd")
SPLIT4 = Candidate("split", cut=4)
LINK = Link(rtt_s=0.004, alpha_s=0.001, beta_s=0.0001, gamma_s=0.012)


def measured(t_dec=0.05, spec_tpt=None, acceptance=0.7, draft_len=6.0, fpt=0.3) -> Estimates:
    """Estimates with cloud-only timed at t_dec and pipesd measured at spec_tpt per token."""
    e = Estimates()
    e.observe_cloud(t_dec)
    if spec_tpt is not None:
        e.observe_spec("pipesd", LINK, acceptance=acceptance, draft_len=draft_len,
                       forwards_per_token=fpt, decode_s_per_token=spec_tpt, proactive=True)
    return e


def test_cold_start_chooses_cloud_only_with_nothing_predicted():
    c = ap.choose([CLOUD_ONLY, PIPESD, SPLIT4], Estimates(), LINK, slo_s=0.5)
    assert (c.candidate, c.reason, c.predictions) == (CLOUD_ONLY, ap.COLD_START, ())


def test_explore_tries_an_unmeasured_spec_policy_once_then_predicts_it():
    e = measured()
    c = ap.choose([CLOUD_ONLY, PIPESD, SPLIT4], e, LINK, explore=True)
    assert (c.candidate, c.reason) == (PIPESD, ap.EXPLORE)
    e = measured(spec_tpt=0.08)
    assert ap.choose([CLOUD_ONLY, PIPESD], e, LINK).candidate == CLOUD_ONLY


def test_explore_remeasures_the_candidate_measured_longest_ago():
    e = measured(t_dec=0.05, spec_tpt=0.03)          # spec measured last, and fastest
    for _ in range(3):
        e.observe_spec("pipesd", LINK, acceptance=0.7, draft_len=6.0, forwards_per_token=0.3,
                       decode_s_per_token=0.03, proactive=True)
    assert ap.choose([CLOUD_ONLY, PIPESD], e, LINK).candidate == PIPESD
    c = ap.choose([CLOUD_ONLY, PIPESD, SPLIT4], e, LINK, explore=True)
    assert (c.candidate, c.reason) == (CLOUD_ONLY, ap.EXPLORE)
    e.observe_cloud(0.05)
    assert ap.choose([CLOUD_ONLY, PIPESD], e, LINK, explore=True).candidate == PIPESD


def test_under_a_target_explore_skips_candidates_predicted_to_miss_it():
    e = measured(t_dec=0.05, spec_tpt=0.03)
    e.observe_cloud(0.05)                         # spec is now the stalest, and predicted fast
    assert ap.choose([CLOUD_ONLY, PIPESD], e, LINK, slo_s=0.04, explore=True).candidate == PIPESD
    slow = measured(t_dec=0.05, spec_tpt=0.09)
    slow.observe_cloud(0.05)                      # spec the stalest, predicted to miss 0.06
    c = ap.choose([CLOUD_ONLY, PIPESD], slow, LINK, slo_s=0.06, explore=True)
    assert (c.candidate, c.reason) == (CLOUD_ONLY, ap.EXPLORE)
    # with no target it is re-measured all the same
    assert ap.choose([CLOUD_ONLY, PIPESD], slow, LINK, explore=True).candidate == PIPESD


def test_split_is_never_explored_nor_predicted_unmeasured():
    e = measured()
    assert ap.choose([CLOUD_ONLY, SPLIT4], e, LINK, explore=True).candidate == CLOUD_ONLY
    assert ap.predict(SPLIT4, e, LINK) is None


def test_no_target_chooses_the_least_predicted_time_per_token():
    slow_spec = measured(t_dec=0.05, spec_tpt=0.08)
    c = ap.choose([CLOUD_ONLY, PIPESD], slow_spec, LINK)
    assert (c.candidate, c.reason) == (CLOUD_ONLY, ap.FASTEST)
    assert {str(p.candidate) for p in c.predictions} == {"cloud-only", "spec/pipesd"}
    fast_spec = measured(t_dec=0.05, spec_tpt=0.02)
    assert ap.choose([CLOUD_ONLY, PIPESD], fast_spec, LINK).candidate == PIPESD


def test_slo_chooses_the_least_cloud_work_that_meets_it():
    e = measured(t_dec=0.05, spec_tpt=0.08, fpt=0.3)      # spec: slower, a third of the work
    both = ap.choose([CLOUD_ONLY, PIPESD], e, LINK, slo_s=0.1)
    assert (both.candidate, both.reason) == (PIPESD, ap.LEAST_CLOUD)
    only_cloud = ap.choose([CLOUD_ONLY, PIPESD], e, LINK, slo_s=0.06)
    assert (only_cloud.candidate, only_cloud.reason) == (CLOUD_ONLY, ap.LEAST_CLOUD)
    none = ap.choose([CLOUD_ONLY, PIPESD], e, LINK, slo_s=0.01)
    assert (none.candidate, none.reason) == (CLOUD_ONLY, ap.SLO_UNMET)


def test_a_target_is_met_by_the_predicted_95th_percentile_not_the_mean():
    steady, scattered = measured(t_dec=0.05, spec_tpt=0.08), measured(t_dec=0.05, spec_tpt=0.08)
    for tpt in (0.08, 0.08, 0.08):
        steady.observe_spec("pipesd", LINK, acceptance=0.7, draft_len=6.0, forwards_per_token=0.3,
                            decode_s_per_token=tpt, proactive=True)
    for tpt in (0.05, 0.11, 0.06, 0.12):   # the same mean, prompt to prompt far apart
        scattered.observe_spec("pipesd", LINK, acceptance=0.7, draft_len=6.0,
                               forwards_per_token=0.3, decode_s_per_token=tpt, proactive=True)
    assert ap.predict(PIPESD, steady, LINK).tpt_hi_s == pytest.approx(0.08)
    p = ap.predict(PIPESD, scattered, LINK)
    assert p.tpt_s < 0.1 < p.tpt_hi_s
    assert ap.choose([CLOUD_ONLY, PIPESD], steady, LINK, slo_s=0.1).candidate == PIPESD
    c = ap.choose([CLOUD_ONLY, PIPESD], scattered, LINK, slo_s=0.1)
    assert (c.candidate, c.reason) == (CLOUD_ONLY, ap.LEAST_CLOUD)
    # the spread is learned from each request against what was predicted for it: one
    # residual of log 2 after a steady first request
    e = measured(t_dec=0.05, spec_tpt=0.08)
    e.observe_spec("pipesd", LINK, acceptance=0.7, draft_len=6.0, forwards_per_token=0.3,
                   decode_s_per_token=0.16, proactive=True)
    assert e.spread[PIPESD] == pytest.approx(math.log(2) ** 2)


def test_the_remaining_pace_makes_up_what_a_request_spent():
    # 0.1 s per token over 64: 16 tokens at 0.1 leave 0.1; at 0.13, the rest must be faster
    assert ap.remaining_pace(0.1, 1.6, 16, 48) == pytest.approx(0.1)
    assert ap.remaining_pace(0.1, 2.08, 16, 48) == pytest.approx(0.09)
    assert ap.remaining_pace(0.1, 10.0, 16, 48) == 0.0           # already lost
    assert ap.remaining_pace(0.1, 0.8, 16, 48) == 0.1             # ahead: the lead is kept
    assert ap.remaining_pace(0.1, 5.0, 64, 0) == 0.1
    # a spec stretch meeting the target on its own pace still switches when the request
    # fell behind and cloud-only can make it up
    e = measured(t_dec=0.05, spec_tpt=0.08, fpt=0.3)
    assert ap.recheck(PIPESD, CLOUD_ONLY, 0.095, e, LINK, slo_s=0.1) == ap.STAY
    behind = ap.remaining_pace(0.1, 32 * 0.11, 32, 32)
    assert ap.recheck(PIPESD, CLOUD_ONLY, 0.095, e, LINK, slo_s=behind) == \
        ap.Switch(CLOUD_ONLY, ap.SWITCH_MEET_SLO)


def test_calibration_makes_the_prediction_match_what_was_measured_on_the_same_link():
    e = measured(t_dec=0.05, spec_tpt=0.0731)
    assert ap.predict(PIPESD, e, LINK).tpt_s == pytest.approx(0.0731)
    assert ap.predict(PIPESD, e, LINK).cloud_s == pytest.approx(0.05 * 0.3)
    # a slower link moves the prediction the way the model says, calibration kept
    far = Link(rtt_s=0.2, alpha_s=LINK.alpha_s, beta_s=LINK.beta_s, gamma_s=LINK.gamma_s)
    assert ap.predict(PIPESD, e, far).tpt_s > 0.0731


def test_tokens_per_round_is_leviathans_expectation():
    assert ap.tokens_per_round(0.0, 5) == 1.0
    assert ap.tokens_per_round(1.0, 5) == 6.0
    assert ap.tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_a_round_is_the_dp_pipeline_plus_round_trip_and_verify():
    pipeline = plan_batches_with_time(6, LINK.gamma_s, LINK.alpha_s, LINK.beta_s)[1]
    stalled = ap.spec_round_s(6, LINK, 0.05, proactive=False)
    assert stalled == pytest.approx(pipeline + LINK.rtt_s + 0.05)
    overlapped = ap.spec_round_s(6, LINK, 0.05, proactive=True)
    assert 6 * LINK.gamma_s <= overlapped < stalled


def test_split_is_predicted_from_its_forwards_and_the_round_trip():
    e = measured(t_dec=0.05)
    e.observe_split(4, edge_s=0.01, cloud_s=0.03)
    p = ap.predict(SPLIT4, e, LINK)
    assert (p.tpt_s, p.cloud_s) == (pytest.approx(0.01 + LINK.rtt_s + 0.03), 0.03)
    assert ap.choose([CLOUD_ONLY, SPLIT4], e, LINK).candidate == SPLIT4


def test_cloud_only_must_be_a_candidate():
    with pytest.raises(ValueError, match="cloud-only"):
        ap.choose([PIPESD], measured(), LINK)


def test_auto_settings_refuse_unknown_policies_and_bad_cuts():
    with pytest.raises(ValueError, match="auto_policies"):
        AutoConfig(policies="pipesd,nope")
    with pytest.raises(ValueError, match="auto_cuts"):
        AutoConfig(cuts="4,x")


def test_recheck_switches_only_for_a_gain_past_the_hysteresis():
    e = measured(t_dec=0.05, spec_tpt=0.08)
    assert ap.recheck(PIPESD, CLOUD_ONLY, 0.08, e, LINK, hysteresis=0.2) == \
        ap.Switch(CLOUD_ONLY, ap.SWITCH_FASTER)
    assert ap.recheck(PIPESD, CLOUD_ONLY, 0.06, e, LINK, hysteresis=0.2) == ap.STAY  # 17 %
    assert ap.recheck(CLOUD_ONLY, PIPESD, 0.05, e, LINK) == ap.STAY
    # this prompt drafts well: live spec beats cloud-only's prediction, so it stays
    assert ap.recheck(PIPESD, CLOUD_ONLY, 0.03, e, LINK) == ap.STAY


def test_recheck_under_a_target_meets_it_then_saves_cloud_work():
    e = measured(t_dec=0.05, spec_tpt=0.08, fpt=0.3)
    # cloud-only meets 0.1 and so would spec, with 30 % of the work: switch
    assert ap.recheck(CLOUD_ONLY, PIPESD, 0.05, e, LINK, slo_s=0.1) == \
        ap.Switch(PIPESD, ap.SWITCH_LESS_CLOUD)
    # spec live misses 0.07, cloud-only meets it
    assert ap.recheck(PIPESD, CLOUD_ONLY, 0.09, e, LINK, slo_s=0.07) == \
        ap.Switch(CLOUD_ONLY, ap.SWITCH_MEET_SLO)
    # spec meets the target with less work than cloud-only would: it stays
    assert ap.recheck(PIPESD, CLOUD_ONLY, 0.08, e, LINK, slo_s=0.1) == ap.STAY


def test_recheck_stays_when_the_other_mode_cannot_be_predicted():
    assert ap.recheck(CLOUD_ONLY, PIPESD, 0.05, measured(), LINK) == ap.STAY


def test_calibration_starts_with_the_first_spec_request_timed_after_cloud_only():
    e = Estimates()
    e.observe_spec("pipesd", LINK, acceptance=0.7, draft_len=6.0, forwards_per_token=0.3,
                   decode_s_per_token=0.08, proactive=True)   # no t_dec yet: uncalibrated
    assert e.spec["pipesd"].calibration is None
    e.observe_cloud(0.05)
    e.observe_spec("pipesd", LINK, acceptance=0.7, draft_len=6.0, forwards_per_token=0.3,
                   decode_s_per_token=0.08, proactive=True)
    assert ap.predict(PIPESD, e, LINK).tpt_s == pytest.approx(0.08)


def _seg(mode, tokens, seconds, policy="", **fig):
    return {"mode": mode, "policy": policy or mode, "tokens": tokens, "why": "x",
            "seconds": seconds, **fig}


SPEC_FIG = {"rounds": 10, "acceptance_rate": 0.6, "mean_draft_length": 2.0,
            "cloud_forwards_per_token": 0.5}


def test_a_request_that_switched_teaches_each_stretch_on_its_own_time():
    """cloud-first (the prefill's token left out), a speculative stretch with its own figures,
    then back to cloud-only: three stretches, each timed alone; the request-level figures (the
    last stretch's) are not the speculative stretch's."""
    stats = {"mode": "spec", "ttft_s": 0.1, "generated_tokens": 40, "acceptance_rate": 0.1,
             "rounds": 3, "mean_draft_length": 9.0,
             "segments": [_seg("cloud-only", 5, 0.1 + 4 * 0.02),
                          _seg("spec", 20, 20 * 0.03, "pipesd", **SPEC_FIG),
                          _seg("cloud-only", 15, 15 * 0.025)]}
    got = ap.stretches(stats)
    assert [(str(x.candidate), round(x.tpt_s, 6)) for x in got] == [
        ("cloud-only", 0.02), ("spec/pipesd", 0.03), ("cloud-only", 0.025)]
    assert (got[1].acceptance, got[1].draft_len, got[1].forwards_per_token) == (0.6, 2.0, 0.5)
    e = Estimates()
    e.observe_cloud(got[0].tpt_s)
    assert ap.predict(CLOUD_ONLY, e, LINK).tpt_s == pytest.approx(0.02)


def test_a_request_run_as_one_mode_is_timed_after_its_first_token():
    spec = {"mode": "spec", "ttft_s": 0.2, "generated_tokens": 11, **SPEC_FIG,
            "segments": [_seg("spec", 11, 0.2 + 10 * 0.04, "pipesd")]}
    [x] = ap.stretches(spec)
    assert x.tpt_s == pytest.approx(0.04) and x.acceptance == 0.6
    assert ap.stretches({**spec, "drafter_lost": True}) == []   # a fallback is not its pace
    short = {"mode": "cloud-only", "ttft_s": 0.1, "generated_tokens": 3,
             "segments": [_seg("cloud-only", 3, 0.14)]}
    assert ap.stretches(short) == []


def test_a_link_move_is_past_its_fraction_and_the_jitter_floor():
    assert ap.link_moved(0.05, 0.30, 0.5) and ap.link_moved(0.30, 0.05, 0.5)   # S1 <-> 300 ms
    assert not ap.link_moved(0.05, 0.07, 0.5)                                  # 40 %: no move
    assert not ap.link_moved(0.0005, 0.003, 0.5)     # 6x, but under the floor: LAN jitter
    assert ap.link_moved(0.0005, 0.05, 0.5)          # LAN -> S1
    assert not ap.link_moved(0.05, 0.30, 0.0)        # 0: switching every N tokens only
    assert not ap.link_moved(math.nan, 0.30, 0.5) and not ap.link_moved(0.05, math.nan, 0.5)


def test_after_a_link_move_speculation_is_judged_on_the_new_link():
    e = measured(t_dec=0.05, spec_tpt=0.03)
    far = Link(rtt_s=0.3, alpha_s=LINK.alpha_s, beta_s=LINK.beta_s, gamma_s=LINK.gamma_s)
    # its pace on the old link would keep it; its prediction on the new one sends it away
    assert ap.recheck(PIPESD, CLOUD_ONLY, 0.03, e, far) == ap.STAY
    pace = ap.pace_on_new_link(PIPESD, 0.03, e, far)
    assert pace == ap.predict(PIPESD, e, far).tpt_s > 0.3 / 7   # a round trip per round
    assert ap.recheck(PIPESD, CLOUD_ONLY, pace, e, far) == ap.Switch(CLOUD_ONLY, ap.SWITCH_FASTER)
    # cloud-only streams: its own pace stands (its prediction when it has none)
    assert ap.pace_on_new_link(CLOUD_ONLY, 0.06, e, far) == 0.06
    assert ap.pace_on_new_link(CLOUD_ONLY, math.nan, e, far) == 0.05
