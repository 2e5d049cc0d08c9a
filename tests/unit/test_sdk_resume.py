"""A dispatcher lost mid-stream costs the stream a pause, not the request (tandem/link.py,
tandem/client.py): against a scripted fake dispatcher that answers pings with its run's
instance, a restart (another instance answers) or a silence past link_timeout_s makes the SDK
re-submit the request as a continuation — same prompt and settings, the tokens it holds as
resume_ids — and the stream goes on with no duplicate and no gap. Bounded by max_resumes and the
deadline: past them the caller gets `unavailable`, never silence. No models."""

from __future__ import annotations

import asyncio
import time

import pytest

from common import protocol
from tandem import AsyncClient, Unavailable
from tandem.link import LinkState, resume_refusal
from tests.unit.test_sdk_conventions import FakeDispatcher

LIMITS = protocol.Limits()
FAST = {"heartbeat_s": 0.05, "link_timeout_s": 0.4}


class RestartingDispatcher(FakeDispatcher):
    """Streams `first` tokens of a new request, then holds it (the run that will be lost); a
    continuation gets its last held token again (a duplicate the SDK must drop), then the rest
    up to max_tokens and Done. `restart()` changes the run answering pings; `mute` stops them."""

    def __init__(self, first: int = 3):
        super().__init__(script=[])
        self.first = first
        self.instance = "run-1"
        self.mute = False

    def restart(self) -> None:
        self.instance = f"run-{int(self.instance.split('-')[1]) + 1}"

    async def serve(self) -> None:
        while True:
            ident, *frames = await self.sock.recv_multipart()
            msg = protocol.decode(frames, LIMITS)
            if isinstance(msg, protocol.Ping):
                if not self.mute:
                    await self.send(ident, protocol.Pong(rid=msg.rid, t=msg.t, ready=True,
                                                         instance=self.instance))
            elif isinstance(msg, protocol.Cancel):
                self.cancels.append(msg.rid)
            elif isinstance(msg, protocol.GenerateRequest):
                self.requests.append(msg)
                held = list(msg.resume_ids or ())
                start = len(held)
                if msg.resume_ids is None:
                    stop = self.first
                else:   # the last held token again, then the rest
                    if held:
                        await self.send(ident, protocol.TokenEvent(
                            rid=msg.rid, index=start - 1, token_ids=[held[-1]], text="?"))
                    stop = msg.max_tokens
                for i in range(start, stop):
                    await self.send(ident, protocol.TokenEvent(rid=msg.rid, index=i,
                                                               token_ids=[100 + i], text=f"{i} "))
                if msg.resume_ids is not None:
                    await self.send(ident, protocol.Done(
                        rid=msg.rid, finish_reason="length",
                        stats={"generated_tokens": stop - start, "continued_from": start}))


async def stream_until(c: AsyncClient, n: int, on_n, **kw):
    """Stream a request, calling `on_n()` once `n` tokens arrived and the link has heard the
    dispatcher (a peer never heard is never declared lost); returns the stream and the token
    ids with their indices."""
    stream = c.generate("hi", max_tokens=8, temperature=0.7, seed=42, **kw)

    async def fault():
        if n == 0:   # no token to wait for: the request is on the dispatcher once it is held
            while not c._queues:
                await asyncio.sleep(0.01)
        while c.link.last_heard is None:
            await asyncio.sleep(0.01)
        on_n()
    got, task = [], None
    if n == 0:
        task = asyncio.get_running_loop().create_task(fault())
    async for ch in stream:
        got.append((ch.index, ch.token_ids))
        if len(got) == n:
            task = asyncio.get_running_loop().create_task(fault())
    await task
    return stream, got


def test_a_restarted_dispatcher_resumes_the_stream_without_duplicate_or_gap():
    async def main():
        async with RestartingDispatcher() as d, AsyncClient(d.endpoint, **FAST) as c:
            t0 = time.monotonic()
            stream, got = await stream_until(c, 3, d.restart)
            assert [i for i, _ in got] == list(range(8))
            assert stream.result.token_ids == [100 + i for i in range(8)]
            assert stream.resumes == 1 and stream.attempts == 2 and c.resumes == 1
            stats = stream.result.stats
            assert stats.resumes == 1 and stats.generated_tokens == 8
            assert len(stats.resume_s) == 1 and stats.resume_s[0] < 5.0
            assert time.monotonic() - t0 < 10.0
            first, cont = d.requests
            assert first.resume_ids is None and cont.resume_ids == [100, 101, 102]
            # the same request, continued: prompt, sampling and seed, mode, total max_tokens
            assert (cont.prompt, cont.sampling, cont.mode, cont.max_tokens) == \
                (first.prompt, first.sampling, first.mode, first.max_tokens)
            assert cont.deadline_s < first.deadline_s and cont.rid != first.rid
    asyncio.run(main())


def test_a_request_lost_before_its_first_token_is_resumed_from_nothing():
    async def main():
        async with RestartingDispatcher(first=0) as d, AsyncClient(d.endpoint, **FAST) as c:
            stream, got = await stream_until(c, 0, d.restart)
            assert [i for i, _ in got] == list(range(8)) and stream.resumes == 1
            assert d.requests[1].resume_ids == []   # a continuation, of no token
    asyncio.run(main())


def test_a_silent_dispatcher_is_lost_and_the_stream_resumes_when_it_answers():
    async def main():
        async with RestartingDispatcher() as d, AsyncClient(d.endpoint, **FAST) as c:
            async def unmute_later():
                await asyncio.sleep(1.0)   # silent past link_timeout_s (0.4 s)
                d.mute = False

            def mute():
                d.mute = True
                tasks.append(asyncio.get_running_loop().create_task(unmute_later()))
            tasks = []
            stream, got = await stream_until(c, 3, mute)
            assert stream.result.token_ids == [100 + i for i in range(8)]
            assert stream.resumes == 1
            # the silent run was told to cancel the request it may still hold
            assert d.requests[0].rid in d.cancels
    asyncio.run(main())


def test_a_silent_dispatcher_hands_the_stream_to_the_next_listed_one():
    async def main():
        async with RestartingDispatcher() as a, RestartingDispatcher() as b, \
                AsyncClient(f"{a.endpoint},{b.endpoint}", **FAST) as c:
            stream, got = await stream_until(c, 3, lambda: setattr(a, "mute", True))
            assert stream.result.token_ids == [100 + i for i in range(8)]
            assert stream.resumes == 1 and c.endpoint == b.endpoint
            assert len(a.requests) == 1 and b.requests[0].resume_ids == [100, 101, 102]
    asyncio.run(main())


def test_a_client_loop_held_up_past_the_timeout_is_not_a_lost_dispatcher():
    """A caller that holds the client's event loop (here for 0.8 s, link_timeout_s 0.4) leaves
    the dispatcher's answers unread, not missing: no resume."""
    async def main():
        async with RestartingDispatcher() as d, AsyncClient(d.endpoint, **FAST) as c:
            async def hold_then_restart():
                time.sleep(0.8)                  # the whole loop held up
                for _ in range(10):              # a few heartbeats after it
                    await asyncio.sleep(0.05)
                assert len(d.requests) == 1, "resumed after a held-up loop"
                d.restart()
            stream, got = await stream_until(
                c, 3, lambda: tasks.append(asyncio.get_running_loop().create_task(
                    hold_then_restart())))
            await asyncio.gather(*tasks)
            assert stream.resumes == 1   # the restart alone
            tasks.clear()
    tasks: list = []
    asyncio.run(main())


def test_no_resume_budget_ends_the_stream_unavailable_at_once():
    async def main():
        async with RestartingDispatcher() as d, \
                AsyncClient(d.endpoint, max_resumes=0, **FAST) as c:
            t0 = time.monotonic()
            with pytest.raises(Unavailable, match="resume budget"):
                await stream_until(c, 3, d.restart)
            assert time.monotonic() - t0 < 5.0 and len(d.requests) == 1
    asyncio.run(main())


def test_a_dispatcher_that_never_comes_back_ends_unavailable_at_the_deadline():
    async def main():
        async with RestartingDispatcher() as d, AsyncClient(d.endpoint, **FAST) as c:
            t0 = time.monotonic()
            with pytest.raises(Unavailable, match="deadline"):
                await stream_until(c, 3, lambda: setattr(d, "mute", True), deadline_s=1.2)
            assert 1.0 < time.monotonic() - t0 < 3.0   # at the deadline, not silence
    asyncio.run(main())


def test_link_state_and_resume_refusal():
    link = LinkState(timeout_s=1.0)
    assert not link.silent(100.0)                       # never heard: never declared lost
    assert not link.heard("a", True, 0.0)
    assert not link.heard("a", True, 0.5) and not link.silent(1.4)
    assert link.overdue(1.6) and link.silent(1.6) and not link.ready
    assert not link.silent(5.0)                         # once per silence
    assert not link.heard("a", False, 6.0)              # the same run again: not a restart
    assert link.heard("b", True, 6.1)                   # another run: the old one's requests died
    assert not link.heard("", True, 6.2)                # a peer that names no run: no verdict
    assert resume_refusal(0, 3, 10.0) == ""
    assert "budget" in resume_refusal(3, 3, 10.0)
    assert "deadline" in resume_refusal(0, 3, 0.0)
    with pytest.raises(ValueError, match="link_timeout_s"):
        AsyncClient("tcp://127.0.0.1:1", heartbeat_s=1.0, link_timeout_s=0.5)
    with pytest.raises(ValueError, match="max_resumes"):
        AsyncClient("tcp://127.0.0.1:1", max_resumes=-1)
