"""The dispatcher's recovery decisions (services/dispatcher/recovery_policy.py), without
processes: which failures are replayed, when a request gives up, the backoff, the bans."""

from __future__ import annotations

import pytest

from common import protocol
from services.dispatcher.recovery_policy import (GiveUp, PassThrough, RecoveryPolicy, Replay,
                                                 ReplicaHealth, backoff, decide)

P = RecoveryPolicy(max_recoveries=3, backoff_s=0.1, backoff_max_s=1.0, jitter=0.25,
                   ban_failures=2, ban_window_s=10.0, ban_s=5.0, incident_s=1.0)


def _decide(code=protocol.UNAVAILABLE, reason=None, replays=0, time_left=60.0, finished=False):
    return decide(P, code=code, message="m", reason=reason, replays=replays,
                  time_left=time_left, finished=finished, tokens=7)


@pytest.mark.parametrize("code,reason", [(protocol.UNAVAILABLE, "down"),
                                         (protocol.UNKNOWN_SESSION, "restarted"),
                                         (protocol.UNKNOWN_ROUND, "gap")])
def test_failures_a_replay_cures_are_replayed(code, reason):
    d = _decide(code=code)
    assert isinstance(d, Replay) and d.reason == reason


def test_the_dispatchers_own_diagnosis_names_the_reason():
    assert _decide(reason="stall") == Replay("stall", backoff(P, 0, 60.0))


@pytest.mark.parametrize("code", [protocol.BAD_FIELD, protocol.BUSY, protocol.INTERNAL,
                                  protocol.TOO_LARGE, protocol.DEADLINE])
def test_other_errors_are_the_requests_answer(code):
    assert _decide(code=code) == PassThrough()


def test_a_finished_or_cancelled_request_is_never_replayed():
    assert _decide(finished=True) == PassThrough()


def test_no_time_left_is_a_deadline_whatever_interrupted_it():
    d = _decide(time_left=0.0)
    assert isinstance(d, GiveUp) and d.code == protocol.DEADLINE and "after 7 tokens" in d.message


def test_gives_up_after_max_recoveries_with_its_own_code():
    assert isinstance(_decide(replays=2), Replay)
    d = _decide(replays=3)
    assert d == GiveUp(protocol.UNAVAILABLE, "m (gave up after 3 replays)")


def test_backoff_doubles_is_capped_jittered_and_within_the_time_left():
    mid = [backoff(P, n, 60.0, rand=0.5) for n in range(6)]
    assert mid == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert backoff(P, 0, 60.0, rand=0.0) == pytest.approx(0.075)
    assert backoff(P, 0, 60.0, rand=0.999999) == pytest.approx(0.125, rel=1e-4)
    assert backoff(P, 5, 0.3, rand=0.5) == pytest.approx(0.3)


def test_a_replica_failing_repeatedly_is_banned_for_a_while():
    h = ReplicaHealth(P)
    assert not h.failed("v0", 100.0)
    assert not h.banned("v0", 100.5)
    assert h.failed("v0", 103.0)               # the second failure within the window
    assert h.banned("v0", 107.9) and not h.banned("v0", 108.1)
    assert h.eligible(["v0", "v1"], 105.0) == ["v1"]
    assert h.eligible(["v0", "v1"], 109.0) == ["v0", "v1"]


def test_sessions_failing_together_are_one_incident():
    """A crash fails every session the replica held at once: that is one failure, not a ban."""
    h = ReplicaHealth(P)
    assert not any(h.failed("v0", 100.0 + i * 0.01) for i in range(8))
    assert not h.banned("v0", 100.5)


def test_failures_outside_the_window_do_not_add_up():
    h = ReplicaHealth(P)
    assert not h.failed("v0", 100.0)
    assert not h.failed("v0", 111.0)           # the first one has left the 10 s window
    assert not h.banned("v0", 111.5)


def test_a_ban_never_leaves_a_request_without_a_replica():
    h = ReplicaHealth(P)
    h.failed("v0", 100.0)
    h.failed("v0", 102.0)
    assert h.banned("v0", 103.0)
    assert h.eligible(["v0"], 103.0) == ["v0"]
    assert h.eligible([], 103.0) == []


def test_ban_s_zero_never_bans():
    h = ReplicaHealth(RecoveryPolicy(ban_failures=1, ban_s=0.0))
    assert not h.failed("v0", 1.0) and not h.banned("v0", 1.0)
