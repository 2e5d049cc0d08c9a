"""SDK conventions (tandem/client.py) against a scripted fake dispatcher (a ZMQ ROUTER in the
test's event loop; no models): retries with exponential backoff and jitter on busy / unavailable
before the first token only, per client and per call; a stream object that carries its own
result (concurrent streams never share one); `messages=` on the wire; `tandem --version`."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq
import zmq.asyncio

from common import protocol
from tandem import AsyncClient, Busy, Client, InvalidRequest, Unavailable
from tandem.client import retry_delay

LIMITS = protocol.Limits()


class FakeDispatcher:
    """Answers each GenerateRequest per `script`: a list of replies for successive requests,
    each "busy" / "unavailable" (an Error), "tokens" (3 tokens then Done), or
    "token-then-busy" (one token, then a busy Error). Records every request it got."""

    def __init__(self, script: list[str]):
        self.script = list(script)
        self.requests: list[protocol.GenerateRequest] = []
        self.cancels: list[int] = []   # rids of the Cancel messages received
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> "FakeDispatcher":
        self.task = asyncio.get_running_loop().create_task(self.serve())
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close(linger=0)
        self.ctx.term()

    async def send(self, ident: bytes, msg: protocol.Msg) -> None:
        await self.sock.send_multipart([ident, *protocol.encode(msg)])

    async def serve(self) -> None:
        while True:
            ident, *frames = await self.sock.recv_multipart()
            msg = protocol.decode(frames, LIMITS)
            if isinstance(msg, protocol.Cancel):
                self.cancels.append(msg.rid)
            if not isinstance(msg, protocol.GenerateRequest):
                continue
            self.requests.append(msg)
            what = self.script.pop(0) if self.script else "tokens"
            rid = msg.rid
            if what in ("busy", "unavailable"):
                code = protocol.BUSY if what == "busy" else protocol.UNAVAILABLE
                await self.send(ident, protocol.Error(rid=rid, code=code, message=what))
            elif what == "busy-for-3s":   # busy, with the service's estimate of when to retry
                await self.send(ident, protocol.Error(rid=rid, code=protocol.BUSY,
                                                      message="busy", retry_after_s=3.0))
            elif what == "token-then-hold":   # one token, then nothing until cancelled
                await self.send(ident, protocol.TokenEvent(rid=rid, index=0, token_ids=[7],
                                                           text="x"))
            elif what == "token-then-busy":
                await self.send(ident, protocol.TokenEvent(rid=rid, index=0, token_ids=[7],
                                                           text="x"))
                await self.send(ident, protocol.Error(rid=rid, code=protocol.BUSY,
                                                      message="busy"))
            else:
                n = len(self.requests)   # each answer tells which request it was
                for i in range(3):
                    await self.send(ident, protocol.TokenEvent(rid=rid, index=i,
                                                               token_ids=[n * 10 + i],
                                                               text=f"{n}.{i} "))
                await self.send(ident, protocol.Done(rid=rid, finish_reason="length",
                                                     stats={"tokens": 3}))


def recording(client: AsyncClient, dice: float = 0.5) -> list[float]:
    """Replace the client's backoff sleep with a recorder (and fix its jitter dice)."""
    delays: list[float] = []

    async def sleep(s: float) -> None:
        delays.append(s)

    client._sleep = sleep
    client._random = lambda: dice
    return delays


def test_retry_delay_schedule_is_openai_pythons():
    assert retry_delay(0, rand=lambda: 0.0) == 0.5
    assert retry_delay(1, rand=lambda: 0.0) == 1.0
    assert retry_delay(3, rand=lambda: 0.0) == 4.0
    assert retry_delay(10, rand=lambda: 0.0) == 8.0                  # capped
    assert retry_delay(1, rand=lambda: 1.0) == pytest.approx(0.75)   # jitter takes up to 25 %
    assert all(0.375 <= retry_delay(0) <= 0.5 for _ in range(200))


@pytest.mark.parametrize("refusal", ["busy", "unavailable"])
def test_busy_or_unavailable_before_the_first_token_is_retried_with_backoff(refusal):
    async def main():
        async with FakeDispatcher([refusal, refusal, "tokens"]) as d, \
                AsyncClient(d.endpoint) as c:
            delays = recording(c, dice=0.5)
            stream = c.generate("hi", max_tokens=3)
            texts = [ch.text async for ch in stream]
            assert texts == ["3.0 ", "3.1 ", "3.2 "]    # the third request's answer
            assert stream.attempts == 3 and len(d.requests) == 3
            assert delays == [pytest.approx(0.5 * 0.875), pytest.approx(1.0 * 0.875)]
            assert stream.result.token_ids == [30, 31, 32]
            assert len({r.rid for r in d.requests}) == 3   # each try is a new request
            # the retries stay within the request's deadline: each sends what is left
            assert all(r.deadline_s <= d.requests[0].deadline_s for r in d.requests)
    asyncio.run(main())


def test_a_busy_answer_with_its_own_estimate_waits_that_long_and_carries_it():
    async def main():
        async with FakeDispatcher(["busy-for-3s", "busy-for-3s", "busy-for-3s"]) as d, \
                AsyncClient(d.endpoint) as c:
            delays = recording(c, dice=0.5)
            stream = c.generate("hi", max_tokens=3)
            with pytest.raises(Busy) as refused:
                async for _ in stream:
                    pass
            # the longer of the backoff (0.44 s, 0.875 s) and the service's estimate
            assert delays == [3.0, 3.0] and len(d.requests) == 3
            assert refused.value.retry_after_s == 3.0
    asyncio.run(main())


def test_the_gateway_sends_the_services_estimate_as_retry_after():
    from api.app import from_tandem

    assert from_tandem(Busy("busy", "queue full", retry_after_s=2.2)).headers == \
        {"Retry-After": "3"}
    assert from_tandem(Busy("busy", "in flight"), retry_after_s=1).headers == {"Retry-After": "1"}


def test_retries_give_up_after_max_retries_default_two():
    async def main():
        async with FakeDispatcher(["busy"] * 5) as d, AsyncClient(d.endpoint) as c:
            delays = recording(c)
            assert c.max_retries == 2
            stream = c.generate("hi")
            with pytest.raises(Busy):
                async for _ in stream:
                    pass
            assert stream.attempts == 3 and len(d.requests) == 3 and len(delays) == 2
            assert stream.result is None
    asyncio.run(main())


def test_max_retries_per_client_and_per_call():
    async def main():
        async with FakeDispatcher(["busy"] * 20) as d, \
                AsyncClient(d.endpoint, max_retries=0) as c:
            delays = recording(c)
            with pytest.raises(Busy):
                await c.complete("hi")
            assert len(d.requests) == 1 and delays == []          # the client's setting
            with pytest.raises(Busy):
                await c.complete("hi", max_retries=4)             # the call's wins
            assert len(d.requests) == 1 + 5 and len(delays) == 4
            assert delays == [pytest.approx(x * 0.875) for x in (0.5, 1.0, 2.0, 4.0)]
    asyncio.run(main())
    with pytest.raises(ValueError, match="max_retries"):
        AsyncClient("tcp://127.0.0.1:1", max_retries=-1)


def test_no_retry_after_a_token_was_yielded():
    async def main():
        async with FakeDispatcher(["token-then-busy"]) as d, AsyncClient(d.endpoint) as c:
            delays = recording(c)
            stream = c.generate("hi")
            got = []
            with pytest.raises(Busy):
                async for ch in stream:
                    got.append(ch.text)
            assert got == ["x"] and stream.attempts == 1 and len(d.requests) == 1
            assert delays == []
    asyncio.run(main())


def test_no_retry_past_the_deadline():
    async def main():
        async with FakeDispatcher(["busy"] * 5) as d, AsyncClient(d.endpoint) as c:
            recording(c)
            with pytest.raises(Busy):
                await c.complete("hi", deadline_s=0.3)   # the first backoff (>= 0.375 s) would
            assert len(d.requests) == 1                   # overrun it: fail now, say why
    asyncio.run(main())


def test_invalid_request_is_never_retried():
    async def main():
        async with FakeDispatcher([]) as d, AsyncClient(d.endpoint) as c:
            with pytest.raises(InvalidRequest) as e:
                await c.complete("hi", temperature=float("nan"))
            assert e.value.field == "temperature" and d.requests == []
    asyncio.run(main())


def test_concurrent_streams_each_carry_their_own_result():
    async def main():
        async with FakeDispatcher([]) as d, AsyncClient(d.endpoint) as c:
            a, b = c.generate("a"), c.generate("b")
            # interleave the two streams' iteration
            ta, tb = [], []
            for _ in range(3):
                ta.append(await a.__anext__())
                tb.append(await b.__anext__())
            for s in (a, b):
                with pytest.raises(StopAsyncIteration):
                    await s.__anext__()
            assert a.result is not b.result
            assert a.result.text == "".join(ch.text for ch in ta)
            assert b.result.text == "".join(ch.text for ch in tb)
            assert a.result.text != b.result.text
            assert c.last_result is b.result          # kept for compatibility: the latest
            assert (await c.complete("c")).text == c.last_result.text
    asyncio.run(main())


def test_messages_travel_on_the_wire_checked():
    async def main():
        async with FakeDispatcher([]) as d, AsyncClient(d.endpoint) as c:
            conv = [{"role": "developer", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                    {"role": "assistant", "content": None},
                    {"role": "user", "content": "Again"}]
            r = await c.complete(messages=conv, max_tokens=3)
            assert r.finish_reason == "length"
            sent = d.requests[-1]
            assert sent.prompt == "" and sent.token_ids is None
            assert [(m.role, m.content) for m in sent.messages] == [
                ("system", "Be brief."), ("user", "Hi"), ("assistant", ""), ("user", "Again")]
            with pytest.raises(InvalidRequest) as e:
                await c.complete(messages=[{"role": "tool", "content": "x"}])
            assert e.value.field == "messages[0].role"
            with pytest.raises(InvalidRequest) as e:
                await c.complete("both", messages=conv)
            assert e.value.field == "messages"
            with pytest.raises(InvalidRequest) as e:
                await c.complete()
            assert e.value.field == "prompt"
            assert len(d.requests) == 1   # none of the bad ones left the client
    asyncio.run(main())


def test_sync_client_stream_object_and_retries():
    async def start(d):
        await d.__aenter__()

    d = FakeDispatcher(["busy", "tokens", "tokens"])
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    asyncio.run_coroutine_threadsafe(start(d), loop).result()
    try:
        with Client(d.endpoint, max_retries=1) as c:
            assert c.max_retries == 1
            c._async._sleep = asyncio.sleep   # a real (short) backoff on the client's loop
            c._async._random = lambda: 1.0    # 0.5 s * 0.75
            s1 = c.generate("one", max_tokens=3)
            s2 = c.generate("two", max_tokens=3)
            t1 = [ch.text for ch in s1]
            t2 = [ch.text for ch in s2]
            assert s1.attempts == 2 and s2.attempts == 1
            assert s1.result.text == "".join(t1) and s2.result.text == "".join(t2)
            assert s1.result.text != s2.result.text and c.last_result is s2.result
    finally:
        asyncio.run_coroutine_threadsafe(d.__aexit__(None, None, None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)


def test_unavailable_without_a_dispatcher_is_retried_then_raised():
    async def main():
        async with AsyncClient("tcp://127.0.0.1:9", connect_timeout_s=0.05) as c:
            delays = recording(c, dice=1.0)
            stream = c.generate("hi", max_retries=1)
            with pytest.raises(Unavailable):
                async for _ in stream:
                    pass
            assert stream.attempts == 2 and delays == [pytest.approx(0.375)]
    asyncio.run(main())


def test_tandem_version(capsys):
    from tandem import __version__
    from stack.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"tandem {__version__}"
    assert __version__ != "0+unknown"   # the installed distribution's version (pyproject.toml)


def test_a_stream_cancelled_as_a_token_arrives_ends_and_cancels_on_the_dispatcher():
    """The API cancels a stream's task when its HTTP client disconnects. A cancel landing in the
    loop step a token event arrives in was swallowed by Python 3.11's asyncio.wait_for: the
    stream went on and the dispatcher kept generating for nobody (CI: test_api's disconnect)."""
    async def main():
        async with FakeDispatcher(["token-then-hold"]) as d, AsyncClient(d.endpoint) as c:
            got = []

            async def consume():
                async for ch in c.generate("hi", max_tokens=50):
                    got.append(ch.index)
            task = asyncio.create_task(consume())
            while not got:
                await asyncio.sleep(0.01)
            (rid, q), = c._queues.items()
            q.put_nowait(protocol.TokenEvent(rid=rid, index=1, token_ids=[8], text="y"))
            task.cancel()                    # in the same step as the token's arrival
            done, _ = await asyncio.wait([task], timeout=2.0)
            assert task in done and task.cancelled(), "the cancelled stream went on"
            for _ in range(100):
                if d.cancels:
                    break
                await asyncio.sleep(0.01)
            assert d.cancels == [rid]
    asyncio.run(main())
