"""mode="auto" end to end on the in-process stack: the choice at admission from a cold start,
through exploring speculation, to predictions; the output of every choice equals transformers'
greedy output, a seeded Gumbel-coupled request gives the same tokens whatever mode was chosen,
the choice is visible (Stats.segments, auto, the choice counter) and bad input is refused by
field. One stack for the module: its estimates start empty, so the first choices are known."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from prometheus_client import REGISTRY

from common import protocol
from common.runtime import PeerError
from services.dispatcher import auto_policy
from services.dispatcher.auto_policy import SpecFigures
from services.dispatcher.config import AutoConfig
from tandem import InvalidRequest
from stack.inprocess import BackgroundStack
from tests.conftest import wait_until

PROMPT = "def fibonacci(n):\n"
N = 16


@pytest.fixture(scope="module")
def stack(model_paths):
    s = BackgroundStack(overrides={"dispatcher": {"auto": AutoConfig(explore_every=2,
                                                                     cloud_first=False)}})
    yield s
    s.close()


@pytest.fixture(scope="module")
def ids(tokenizer):
    return tokenizer.encode(PROMPT)


def _auto(stack, ids, **kw):
    return stack.complete(list(ids), max_tokens=N, stop_at_eos=False, deadline_s=120,
                          mode="auto", **kw)


def _choices(mode: str, policy: str, reason: str) -> float:
    return REGISTRY.get_sample_value("tandem_auto_choices_total", {
        "service": "dispatcher", "mode": mode, "policy": policy, "reason": reason}) or 0.0


def test_auto_chooses_cold_start_then_explores_then_predicts_and_stays_exact(stack, ids,
                                                                             reference):
    want = reference(ids, N)
    cold = _choices("cloud-only", "cloud-only", auto_policy.COLD_START)
    first = _auto(stack, ids)                        # nothing measured: cloud-only
    assert first.token_ids == want
    assert first.stats.mode == "cloud-only"
    (segment,) = first.stats.segments
    assert segment["seconds"] > 0
    assert segment == {"mode": "cloud-only", "policy": "cloud-only", "tokens": N,
                       "why": auto_policy.COLD_START, "seconds": segment["seconds"]}
    assert first.stats.auto["reason"] == auto_policy.COLD_START
    assert first.stats.cloud_forwards_per_token == 1.0
    assert _choices("cloud-only", "cloud-only", auto_policy.COLD_START) == cold + 1

    second = _auto(stack, ids)                       # explore_every=2: pipesd is tried
    assert second.token_ids == want
    assert (second.stats.mode, second.stats.policy) == ("spec", "pipesd")
    assert second.stats.segments[0]["why"] == auto_policy.EXPLORE
    assert second.stats.rounds >= 1

    third = _auto(stack, ids)                        # both measured: predicted and compared
    assert third.token_ids == want
    assert third.stats.auto["reason"] == auto_policy.FASTEST
    assert {p["candidate"] for p in third.stats.auto["predictions"]} == {"cloud-only",
                                                                         "spec/pipesd"}
    fastest = min(third.stats.auto["predictions"], key=lambda p: p["tpt_s"])
    assert third.stats.auto["chosen"] == fastest["candidate"]

    fourth = _auto(stack, ids)                       # explores again: the one measured longest ago
    assert fourth.token_ids == want
    assert fourth.stats.auto["reason"] == auto_policy.EXPLORE
    assert fourth.stats.auto["chosen"] != third.stats.auto["chosen"]

    # a target every mode meets: the least cloud work, which speculation's accepted drafts save
    slo = _auto(stack, ids, tpt_slo_ms=1e6)
    assert slo.token_ids == want
    assert slo.stats.auto["reason"] == auto_policy.LEAST_CLOUD
    least = min(slo.stats.auto["predictions"], key=lambda p: p["cloud_s_per_token"])
    assert slo.stats.auto["chosen"] == least["candidate"]


@pytest.fixture
def no_exploring(stack):
    cfg = stack.stack.services["dispatcher"].cfg.auto
    saved, cfg.explore_every = cfg.explore_every, 0
    yield
    cfg.explore_every = saved


def test_seeded_gumbel_sampling_gives_the_same_tokens_whatever_auto_chooses(stack, ids,
                                                                            no_exploring):
    sampled = dict(temperature=0.8, seed=11, sampling_coupling="gumbel")
    served = {}
    for slo in (1e6, 0.0):       # the least cloud work, then the fastest
        r = _auto(stack, ids, tpt_slo_ms=slo, **sampled)
        served[r.stats.segments[0]["mode"]] = tuple(r.token_ids)
    cloud = stack.complete(list(ids), max_tokens=N, stop_at_eos=False, deadline_s=120,
                           mode="cloud-only", **sampled)
    spec = stack.complete(list(ids), max_tokens=N, stop_at_eos=False, deadline_s=120,
                          mode="spec", **sampled)
    assert "spec" in served          # the least cloud work: accepted drafts save forwards
    assert set(served.values()) == {tuple(cloud.token_ids)} == {tuple(spec.token_ids)}


@pytest.fixture
def switching_every_4_tokens(stack):
    """Predictions far below any live pace, so every recheck (every 4 tokens) switches: the
    request alternates between spec and cloud-only. A finished request feeds its real pace into
    the estimates, so the test pins them again before each request (the fixture's value); they
    are restored after."""
    d = stack.stack.services["dispatcher"]
    e, cfg = d.auto.estimates, d.cfg.auto
    saved = e.t_dec, dict(e.spec), cfg.switch_every

    def pin():
        e.t_dec, cfg.switch_every = 1e-6, 4
        e.spec["pipesd"] = SpecFigures(acceptance=0.7, draft_len=6, forwards_per_token=0.3,
                                       calibration=1e-6)
    yield pin
    e.t_dec, e.spec, cfg.switch_every = saved


def _prefilled(service: str) -> float:
    return REGISTRY.get_sample_value("tandem_forward_batch_tokens_sum",
                                     {"service": service, "phase": "prefill"}) or 0.0


def _drafter_opens() -> float:
    return REGISTRY.get_sample_value("tandem_messages_total",
                                     {"service": "drafter", "type": "draft_open"}) or 0.0


def _switches() -> float:
    return sum(REGISTRY.get_sample_value("tandem_auto_switches_total", {
        "service": "dispatcher", "from_mode": a, "to_mode": b,
        "reason": auto_policy.SWITCH_FASTER}) or 0.0
        for a, b in (("spec", "cloud-only"), ("cloud-only", "spec")))


def test_switching_mid_request_keeps_the_cache_and_greedy_and_seeded_output_exact(
        stack, ids, reference, switching_every_4_tokens, no_exploring):
    n = 20
    before = _switches()
    prefilled, drafter_opens = _prefilled("verifier"), _drafter_opens()
    switching_every_4_tokens()
    r = stack.complete(list(ids), max_tokens=n, stop_at_eos=False, deadline_s=120, mode="auto")
    assert r.token_ids == reference(ids, n)
    modes = [s["mode"] for s in r.stats.segments]
    assert len(modes) >= 3 and "spec" in modes and "cloud-only" in modes, r.stats.segments
    assert all(a != b for a, b in zip(modes, modes[1:]))          # each stretch a switch
    assert all(s["why"] == auto_policy.SWITCH_FASTER for s in r.stats.segments[1:])
    assert sum(s["tokens"] for s in r.stats.segments) == n
    assert _switches() == before + len(modes) - 1
    # the verifier prefilled the prompt once; a switch adopts its cache and feeds one token
    assert _prefilled("verifier") - prefilled <= len(ids) - 1 + 2 * (len(modes) - 1)
    # the drafter session opened once: back to spec, it catches up in the session it kept
    assert modes.count("spec") >= 2 and _drafter_opens() - drafter_opens == 1
    assert not r.stats.drafter_lost and r.stats.accepted_tokens > 0   # and it drafted on
    sampled = dict(temperature=0.8, seed=5, sampling_coupling="gumbel")
    switching_every_4_tokens()
    switched = stack.complete(list(ids), max_tokens=n, stop_at_eos=False, deadline_s=120,
                              mode="auto", **sampled)
    assert len(switched.stats.segments) >= 3
    cloud = stack.complete(list(ids), max_tokens=n, stop_at_eos=False, deadline_s=120,
                           mode="cloud-only", **sampled)
    assert switched.token_ids == cloud.token_ids


@pytest.fixture
def link_far_after_3_looks(stack, monkeypatch):
    """The dispatcher's link figures as measured, until auto has looked at them three times;
    from then on a 10 s round trip: the link moves under a running request."""
    d = stack.stack.services["dispatcher"]
    measured_link, looks = d.auto.link, []

    def link(d):
        looks.append(1)
        real = measured_link(d)
        return real if len(looks) <= 3 else dataclasses.replace(real, rtt_s=10.0)
    monkeypatch.setattr(d.auto, "link", link)
    return looks


def test_a_link_that_moves_under_a_request_is_rechecked_at_once(
        stack, ids, reference, no_exploring, link_far_after_3_looks):
    """No recheck is due by tokens (every 1000), so only the link's move can switch it: on the
    new link a round trip per round makes speculation far slower than cloud-only. The
    estimates (which this request teaches on the made-up link) are restored after."""
    d = stack.stack.services["dispatcher"]
    e, cfg = d.auto.estimates, d.cfg.auto
    saved, switch_every = copy.deepcopy(e), cfg.switch_every
    e.t_dec, cfg.switch_every = 0.2, 1000
    e.spec["pipesd"] = SpecFigures(acceptance=0.7, draft_len=6, forwards_per_token=0.3,
                                   calibration=1.0)
    try:
        n = 24
        r = stack.complete(list(ids), max_tokens=n, stop_at_eos=False, deadline_s=120,
                           mode="auto")
    finally:
        d.auto.estimates, cfg.switch_every = saved, switch_every
    assert r.token_ids == reference(ids, n)
    assert [s["mode"] for s in r.stats.segments] == ["spec", "cloud-only"], r.stats.segments
    assert r.stats.segments[1]["why"] == auto_policy.SWITCH_FASTER
    assert r.stats.segments[0]["tokens"] >= auto_policy.MIN_STRETCH_TOKENS
    assert len(link_far_after_3_looks) > 3          # the move was seen, not assumed


def test_a_verifier_refuses_to_adopt_a_session_it_does_not_hold(stack, ids):
    """protocol ADOPT: a cache is only ever taken from a session of the same sender that is
    open there; anything else is `unknown_session` (a switch then replays from the committed
    tokens, like any lost session)."""
    async def adopt(s, msg):
        with pytest.raises(PeerError) as e:
            await s.services["dispatcher"].verifier.request(msg, timeout=30)
        return e.value.code
    for kind in (protocol.CloudGenerate(sid="adopt-test", seq=1, token_ids=list(ids),
                                        max_tokens=2, adopt="nobody"),
                 protocol.SpecOpen(sid="adopt-test-2", seq=1, token_ids=list(ids),
                                   adopt="nobody")):
        assert stack.call(lambda s, kind=kind: adopt(s, kind)) == protocol.UNKNOWN_SESSION


@pytest.mark.parametrize("kw, field", [({"tpt_slo_ms": -1.0}, "tpt_slo_ms"),
                                       ({"tpt_slo_ms": float("nan")}, "tpt_slo_ms"),
                                       ({"tpt_slo_ms": "fast"}, "tpt_slo_ms"),
                                       ({"mode": "fastest"}, "mode"),
                                       ({"policy": "nope"}, "policy"),
                                       ({"cut": 999}, "cut")])
def test_bad_auto_input_is_refused_naming_the_field(stack, ids, kw, field):
    args = dict(max_tokens=N, deadline_s=30, mode="auto") | kw
    with pytest.raises(InvalidRequest) as e:
        stack.complete(list(ids), **args)
    assert e.value.field == field, e.value
    if field == "mode":
        assert "auto" in e.value.message


@pytest.fixture
def cloud_first(stack):
    cfg = stack.stack.services["dispatcher"].cfg.auto
    saved, cfg.cloud_first = cfg.cloud_first, True
    yield
    cfg.cloud_first = saved


def _drafter_ready_switches() -> float:
    return REGISTRY.get_sample_value("tandem_auto_switches_total", {
        "service": "dispatcher", "from_mode": "cloud-only", "to_mode": "spec",
        "reason": auto_policy.SWITCH_DRAFTER_READY}) or 0.0


def test_a_spec_choice_streams_its_first_tokens_from_the_cloud_while_the_drafter_prefills(
        stack, ids, reference, cloud_first, no_exploring):
    """Chosen for pipesd (a target every mode meets: the least cloud work), the request starts
    cloud-only while its drafter session opens beside it, then runs speculatively in that same
    drafter session: exact, greedy and seeded."""
    n = 32
    opens, switches = _drafter_opens(), _drafter_ready_switches()
    r = stack.complete(list(ids), max_tokens=n, stop_at_eos=False, deadline_s=120, mode="auto",
                       tpt_slo_ms=1e6)
    assert r.token_ids == reference(ids, n)
    assert r.stats.auto["chosen"] == "spec/pipesd" and r.stats.mode == "spec"
    first, then = r.stats.segments
    assert (first["mode"], first["why"]) == ("cloud-only", auto_policy.CLOUD_FIRST)
    assert (then["mode"], then["why"]) == ("spec", auto_policy.SWITCH_DRAFTER_READY)
    assert first["tokens"] >= 1 and first["tokens"] + then["tokens"] == n
    assert r.stats.rounds >= 1 and r.stats.accepted_tokens > 0
    assert _drafter_opens() - opens == 1   # the session opened beside the cloud drafts
    assert _drafter_ready_switches() == switches + 1
    sampled = dict(temperature=0.8, seed=3, sampling_coupling="gumbel")
    seeded = stack.complete(list(ids), max_tokens=n, stop_at_eos=False, deadline_s=120,
                            mode="auto", tpt_slo_ms=1e6, **sampled)
    assert [s["mode"] for s in seeded.stats.segments] == ["cloud-only", "spec"]
    cloud = stack.complete(list(ids), max_tokens=n, stop_at_eos=False, deadline_s=120,
                           mode="cloud-only", **sampled)
    assert seeded.token_ids == cloud.token_ids
    _no_drafter_sessions_left(stack)


def _no_drafter_sessions_left(stack) -> None:
    """Closes are asynchronous: polled until the drafter holds no session, or 10 s pass."""
    drafter = stack.stack.services["drafter"]
    wait_until(lambda: not drafter.sessions.ids(), 10,
               f"the drafter to close its sessions ({drafter.sessions.ids()} when the wait began)")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_cloud_first_request_too_short_to_draft_leaves_no_drafter_session(
        stack, ids, reference, cloud_first, no_exploring, n):
    """Chosen for pipesd but over before its drafter is of use: the drafter session opened
    beside the cloud is closed whether or not the request switched into it."""
    r = stack.complete(list(ids), max_tokens=n, stop_at_eos=False, deadline_s=120, mode="auto",
                       tpt_slo_ms=1e6)
    assert r.token_ids == reference(ids, n) and r.stats.auto["chosen"] == "spec/pipesd"
    _no_drafter_sessions_left(stack)
