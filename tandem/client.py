"""The Tandem client SDK: talk to a dispatcher over ZMQ.

    from tandem import Client
    with Client("tcp://127.0.0.1:5550") as c:
        for chunk in c.generate("Hello", mode="spec", max_tokens=32):
            print(chunk.text, end="", flush=True)
        print(c.last_result.stats)

    async with AsyncClient() as c:
        async for chunk in c.generate("Hello"):
            ...
        result = await c.complete("Hello", max_tokens=16)   # whole result at once

Errors arrive as typed exceptions (tandem.errors). Nothing here needs torch.

A dispatcher that runs CURVE is reached with its public key and this client's key pair:

    Client(endpoint, curve_server_key="keys/dispatcher.key",
           curve_client_key="keys/app.key_secret")
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import zmq
import zmq.asyncio

from common import protocol
from tandem.errors import Cancelled, DeadlineExceeded, TandemError, Unavailable, error_from_code
from tandem.stats import Stats

# A wire field as the argument of `generate` that sets it (InvalidRequest.field).
_ARGUMENTS = {"sampling.temperature": "temperature", "sampling.top_k": "top_k",
              "sampling.top_p": "top_p", "sampling.seed": "seed", "token_ids": "prompt",
              "deadline_s": "deadline_s"}

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5550"


@dataclass
class Chunk:
    """Tokens appended to the stream; `index` is the position of the first one."""
    index: int
    token_ids: list[int]
    text: str
    degraded: bool = False   # produced by the edge alone while the cloud was unreachable


@dataclass
class Result:
    """A finished request. `finish_reason`: "length" (max_tokens reached), "eos" or "cancelled".
    `stats`: the dispatcher's per-request figures, typed (tandem.stats.Stats; also indexable
    like a dict: `stats["tpt_s"]`)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    stats: Stats = field(default_factory=Stats)


def curve_keys(server_key, client_key):
    """(public, secret, server_public) z85 keys for a CURVE client socket, or None.

    `server_key`: the dispatcher's public key, a NAME.key file (`tandem keys create`) or its
    40-character z85 text; `client_key`: this client's NAME.key_secret file (its public key
    must be in the dispatcher's `curve_allow_dir`)."""
    if server_key is None and client_key is None:
        return None
    if server_key is None or client_key is None:
        raise ValueError("CURVE needs both curve_server_key (the dispatcher's NAME.key) and "
                         "curve_client_key (this client's NAME.key_secret)")
    from common import security  # noqa: PLC0415 - zmq.auth, only when CURVE is asked for

    if isinstance(server_key, (str, bytes)) and len(server_key) == 40 and \
            not os.path.exists(server_key):
        server = server_key.encode("ascii") if isinstance(server_key, str) else server_key
    else:
        server = security.load_public(server_key)
    public, secret = security.load_secret(client_key)
    return public, secret, server


def client_options(server_key, client_key, connect_timeout_s: float):
    """Check the constructor's options (both client classes, so a bad one fails in the caller
    before any socket or thread exists); returns the CURVE keys, or None."""
    if not connect_timeout_s > 0:
        raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
    return curve_keys(server_key, client_key)


class AsyncClient:
    """`curve_server_key` + `curve_client_key` (paths from `tandem keys`): talk to a
    dispatcher that runs CURVE (`--curve-secret-key`, `--curve-allow-dir`): the stream is
    encrypted and the dispatcher lets in only allowlisted client keys."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 300.0,
                 limits: protocol.Limits | None = None, *, curve_server_key=None,
                 curve_client_key=None, connect_timeout_s: float = 10.0,
                 context: zmq.asyncio.Context | None = None):
        self.endpoint = endpoint
        self.timeout_s = timeout_s       # default deadline of a request
        self.connect_timeout_s = connect_timeout_s   # no dispatcher connected by then: Unavailable
        self.limits = limits or protocol.Limits()
        keys = client_options(curve_server_key, curve_client_key, connect_timeout_s)
        # `context`: the one an in-process stack's services share (tandem/inprocess.py)
        self.ctx = context or zmq.asyncio.Context()
        self._own_ctx = context is None
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"client-{uuid.uuid4().hex[:12]}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)   # queue only to a connected (and authenticated) peer
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = keys
        self.sock.connect(endpoint)
        self._rids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self.last_result: Result | None = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg = protocol.decode(frames, self.limits)
            except protocol.ProtocolError:
                continue
            q = self._queues.get(msg.rid)
            if q is not None:
                q.put_nowait(msg)

    async def generate(self, prompt: str | list[int], *, mode: str = "cloud-only",
                       max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int | None = None, policy: str = "",
                       cut: int = 0, chat: bool = False, deadline_s: float | None = None,
                       stop_at_eos: bool = True,
                       allow_edge_only: bool = False,
                       nav_thresholds: tuple[float, float] | None = None) -> AsyncIterator[Chunk]:
        """Stream a generation. On normal end `self.last_result` holds the whole result."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        rid = next(self._rids)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        deadline = self.timeout_s if deadline_s is None else deadline_s
        msg = protocol.GenerateRequest(
            rid=rid, prompt=prompt if isinstance(prompt, str) else "",
            token_ids=None if isinstance(prompt, str) else list(prompt), chat=chat, mode=mode,
            policy=policy, cut=cut, max_tokens=max_tokens, stop_at_eos=stop_at_eos,
            sampling=protocol.Sampling(temperature=temperature, top_k=top_k, top_p=top_p,
                                       seed=seed),
            deadline_s=deadline, allow_edge_only=allow_edge_only,
            nav_thresholds=None if nav_thresholds is None else [float(r) for r in nav_thresholds])
        try:   # the wire's own rules, before anything leaves: NaN, inf, out-of-range values
            protocol.check(msg)
        except protocol.ProtocolError as e:
            arg = _ARGUMENTS.get(e.field, e.field)
            raise error_from_code(e.code, e.message.replace(e.field, arg, 1), arg) from None
        result = Result()
        end = time.monotonic() + deadline + 5.0   # the dispatcher enforces the deadline; this
        finished = False                          # only guards against a dead dispatcher
        try:
            # A DEALER's send waits until a dispatcher is connected: one that is not running,
            # or refuses our CURVE key, must not hold the caller for the whole deadline.
            wait = min(max(end - time.monotonic(), 0.001), self.connect_timeout_s)
            try:
                await asyncio.wait_for(self.sock.send_multipart(protocol.encode(msg)), wait)
            except asyncio.TimeoutError:
                raise Unavailable(protocol.UNAVAILABLE, f"no dispatcher reachable at "
                                  f"{self.endpoint} within {wait:.3g} s (not running, or not "
                                  f"accepting this client's CURVE key)") from None
            while True:
                left = end - time.monotonic()
                try:
                    ev = await asyncio.wait_for(q.get(), max(left, 0.001))
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(protocol.DEADLINE,
                                           f"no answer from the dispatcher at {self.endpoint}") from None
                if isinstance(ev, protocol.TokenEvent):
                    if ev.index != len(result.token_ids):
                        continue  # never yield a token twice
                    result.token_ids.extend(ev.token_ids)
                    result.text += ev.text
                    yield Chunk(ev.index, list(ev.token_ids), ev.text, ev.degraded)
                elif isinstance(ev, protocol.Done):
                    result.finish_reason = ev.finish_reason
                    result.stats = Stats.from_dict(ev.stats)
                    self.last_result = result
                    finished = True
                    if ev.finish_reason == "cancelled":
                        raise Cancelled(protocol.CANCELLED, "request cancelled")
                    return
                elif isinstance(ev, protocol.Error):
                    finished = True
                    raise error_from_code(ev.code, ev.message, _ARGUMENTS.get(ev.field, ev.field))
        finally:
            self._queues.pop(rid, None)
            if not finished:  # the caller stopped iterating early, or we timed out: cancel
                try:
                    await asyncio.wait_for(self.sock.send_multipart(
                        protocol.encode(protocol.Cancel(rid=rid))), 1.0)
                except (zmq.ZMQError, asyncio.TimeoutError):
                    pass

    async def complete(self, prompt: str | list[int], **kw) -> Result:
        async for _ in self.generate(prompt, **kw):
            pass
        assert self.last_result is not None
        return self.last_result


class Client:
    """Synchronous wrapper: the async client runs on a private event-loop thread."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 300.0, *,
                 curve_server_key=None, curve_client_key=None, connect_timeout_s: float = 10.0):
        client_options(curve_server_key, curve_client_key, connect_timeout_s)   # fail here
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="tandem-client")
        self._thread.start()
        self._async = self._call(self._make(endpoint, timeout_s, curve_server_key,
                                            curve_client_key, connect_timeout_s))

    @staticmethod
    async def _make(endpoint, timeout_s, server_key, client_key, connect_s) -> AsyncClient:
        return AsyncClient(endpoint, timeout_s, curve_server_key=server_key,
                           curve_client_key=client_key, connect_timeout_s=connect_s)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def last_result(self) -> Result | None:
        return self._async.last_result

    def generate(self, prompt: str | list[int], **kw) -> Iterator[Chunk]:
        agen = self._async.generate(prompt, **kw)
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(agen.aclose())

    def complete(self, prompt: str | list[int], **kw) -> Result:
        return self._call(self._async.complete(prompt, **kw))

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Client", "AsyncClient", "Chunk", "Result", "Stats", "TandemError", "DEFAULT_ENDPOINT"]
