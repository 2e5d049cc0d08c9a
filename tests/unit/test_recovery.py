"""services/dispatcher/recovery.Recovery's decisions on their own (fake request and channel): a
silence is a stall only when the stall timer ended the wait, and a failure with no time left is
the request's deadline. The replays themselves run against real services in test_faults.py,
test_partitions.py and test_chaos.py."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from common import protocol
from common.runtime import PeerError
from services.dispatcher.config import DispatcherConfig
from services.dispatcher.recovery import Lost, Recovery


class FakeRequest:
    def __init__(self, left: float, stall_s: float = 20.0):
        self.left = left
        self.d = SimpleNamespace(cfg=DispatcherConfig(stall_s=stall_s, max_recoveries=8),
                                 name="dispatcher", log=logging.getLogger("test"))
        self.sid, self.mode = "r1", "cloud-only"
        self.prompt_ids, self.tokens = [1, 2], [3]
        self.done = False
        self.cancelled = asyncio.Event()
        self.stats: dict = {}

    def remaining(self) -> float:
        return self.left


class SilentChannel:
    """recv times out the way common.runtime.Channel does; the request's clock moves on by
    `elapsed` (less than the timeout: asyncio may fire a timer a hair early)."""

    def __init__(self, req: FakeRequest, elapsed: float):
        self.req, self.elapsed, self.timeouts = req, elapsed, []

    async def recv(self, timeout: float):
        self.timeouts.append(timeout)
        self.req.left -= self.elapsed
        raise PeerError(protocol.DEADLINE, f"no reply within {timeout:.1f} s")


def _recv(req: FakeRequest, elapsed: float):
    rec = Recovery(req, [], "verifier")
    ch = SilentChannel(req, elapsed)
    with pytest.raises(PeerError) as e:
        asyncio.run(rec.recv(ch))
    return e.value, ch


def test_silence_until_the_deadline_is_the_deadline_even_if_the_timer_fires_early():
    err, ch = _recv(FakeRequest(left=1.0), elapsed=0.9995)   # 0.5 ms "left" when it fires
    assert ch.timeouts == [1.0]
    assert not isinstance(err, Lost) and err.code == protocol.DEADLINE


def test_silence_for_stall_s_with_time_left_is_a_stall():
    err, ch = _recv(FakeRequest(left=60.0, stall_s=4.0), elapsed=4.0)
    assert ch.timeouts == [4.0]
    assert isinstance(err, Lost) and err.reason == "stall"


def test_a_recoverable_failure_with_no_time_left_is_the_deadline():
    req = FakeRequest(left=0.0)
    rec = Recovery(req, [], "verifier")
    for err in (Lost("gap", "token 5 lost"), PeerError(protocol.UNAVAILABLE, "verifier down")):
        with pytest.raises(PeerError) as e:
            rec.fail(err)
        assert e.value.code == protocol.DEADLINE and "deadline passed after 1 tokens" in str(e.value)
    assert rec.attempt == 0


def test_a_recoverable_failure_with_time_left_allows_a_replay():
    req = FakeRequest(left=30.0)
    rec = Recovery(req, [], "verifier")
    rec.fail(PeerError(protocol.UNKNOWN_ROUND, "round 4 never opened"))
    assert rec.attempt == 1 and rec.reasons == ["gap"] and rec.sid == "r1~r1"
    with pytest.raises(PeerError) as e:          # not recoverable: the request's answer
        rec.fail(PeerError(protocol.BAD_FIELD, "bad"))
    assert e.value.code == protocol.BAD_FIELD


# --- spec mode's replay loop (VerifierLink.recover) -------------------------------------------
def _spec_recover(req: FakeRequest, replay) -> PeerError:
    """VerifierLink.recover on its own: `replay` stands in for rebuilding the verifier
    session."""
    from services.dispatcher.spec.verifier_link import VerifierLink

    async def replayed():
        pass

    link = SimpleNamespace(rec=Recovery(req, [], "verifier"), replay=replay)
    with pytest.raises(PeerError) as e:
        asyncio.run(VerifierLink.recover(link, PeerError(protocol.UNAVAILABLE, "verifier down"),
                                         replayed))
    return e.value


@pytest.mark.timeout(30)   # the bug this guards against spun the event loop forever
def test_spec_replay_loop_ends_with_deadline_when_no_time_is_left():
    calls = []

    async def replay():
        calls.append(1)

    err = _spec_recover(FakeRequest(left=0.0), replay)
    assert err.code == protocol.DEADLINE and calls == []


@pytest.mark.timeout(30)
def test_spec_replay_loop_gives_up_after_max_recoveries_replays_that_fail_at_once():
    calls = []

    async def replay():
        calls.append(1)
        raise PeerError(protocol.UNAVAILABLE, "the replica chosen is down too")

    err = _spec_recover(FakeRequest(left=30.0), replay)
    assert len(calls) == 8, calls                    # DispatcherConfig(max_recoveries=8)
    assert err.code == protocol.UNAVAILABLE and "gave up after 8 replays" in err.message


# --- a cancel is never lost ---------------------------------------------------------------------
def test_a_cancel_that_lands_as_a_reply_arrives_still_cancels_the_waiter():
    """Python 3.11's asyncio.wait_for returns the result when the cancel and the result land in
    the same loop step; a cancelled request's recv then went on (the request was never
    abandoned). Channel.recv must raise CancelledError."""
    from common.runtime import Channel

    async def main():
        ch = Channel(SimpleNamespace(name="verifier"), 7)
        waiter = asyncio.create_task(ch.recv(timeout=5.0))
        await asyncio.sleep(0)          # recv is waiting on the queue
        ch.queue.put_nowait((protocol.Pong(), []))
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    asyncio.run(main())
