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

`generate` returns a stream object that carries its own result (`stream.result`, set when it
ended normally; `client.last_result` still holds the latest one, for compatibility):

    stream = c.generate("Hello", max_tokens=16)
    text = "".join(chunk.text for chunk in stream)
    print(stream.result.finish_reason, stream.attempts)

A conversation goes in as `messages=` (the dispatcher renders it with the target's chat
template, common/chat.py, as the OpenAI gateway does):

    c.complete(messages=[{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Name a colour."}])

A request the dispatcher answers `busy` or `unavailable` before its first token is retried with
exponential backoff and jitter (openai-python's schedule: 0.5 s doubling up to 8 s, minus up to
25 %), `max_retries` times (2 by default; per client or per call). Never after a token arrived:
the stream would repeat or lose text.

A dispatcher lost mid-stream (killed and restarted, or silent for `link_timeout_s`; the client
pings it every `heartbeat_s`, tandem/link.py) costs the stream a pause, not the request: each
request in flight is re-submitted as a continuation (the prompt plus the tokens already
delivered, same seed and settings) once the dispatcher answers ready again, `max_resumes` times
at most, within the request's deadline; the stream goes on from the next token, with no
duplicate and no gap (`stream.resumes`, `result.stats.resumes`). Greedy and seeded requests give
the uninterrupted run's tokens. A dispatcher that does not come back within the deadline ends
the stream with `Unavailable`.

Errors arrive as typed exceptions (tandem.errors). Nothing here needs torch.

A dispatcher that runs CURVE is reached with its public key and this client's key pair:

    Client(endpoint, curve_server_key="keys/dispatcher.key",
           curve_client_key="keys/app.key_secret")
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from common import chat, protocol
from tandem import link
from tandem.errors import (Busy, Cancelled, DeadlineExceeded, TandemError, Unavailable,
                           error_from_code)
from tandem.stats import Stats

# A wire field as the argument of `generate` that sets it (InvalidRequest.field).
_ARGUMENTS = {"sampling.temperature": "temperature", "sampling.top_k": "top_k",
              "sampling.top_p": "top_p", "sampling.seed": "seed",
              "sampling.coupling": "sampling_coupling", "token_ids": "prompt",
              "deadline_s": "deadline_s"}

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5550"


def _constraint(c) -> protocol.Constraint | None:
    """A Constraint, or the same as a {"kind", "value"} dict."""
    if c is None or isinstance(c, protocol.Constraint):
        return c
    if isinstance(c, dict) and set(c) <= {"kind", "value"} and "kind" in c:
        try:
            return msgspec.convert(c, protocol.Constraint)
        except msgspec.ValidationError as e:
            raise error_from_code(protocol.BAD_FIELD, f"constraint: {e}", "constraint") from None
    raise error_from_code(protocol.BAD_FIELD, "constraint: a protocol.Constraint or a "
                          "{\"kind\", \"value\"} dict", "constraint")
DEFAULT_MAX_RETRIES = 2        # as openai-python
RETRY_INITIAL_S = 0.5          # first backoff; doubles per retry (openai-python's schedule)
RETRY_MAX_S = 8.0              # backoff cap
MAX_MESSAGES = 1024            # the wire's limit on GenerateRequest.messages
HEARTBEAT_RID = 0              # the request id of pings (requests start at 1)
CANCEL_LINGER_MS = 500         # a lost dispatcher's socket closes with its Cancels this long


class DispatcherLost(Exception):
    """The dispatcher serving a request was lost (restarted or silent): resume it."""


@dataclass
class Chunk:
    """Tokens appended to the stream; `index` is the position of the first one."""
    index: int
    token_ids: list[int]
    text: str
    degraded: bool = False   # produced by the edge alone while the cloud was unreachable
    # with generate(logprobs=k): per token, the target's TokenLogprob (logprob, top_ids,
    # top_logprobs: its k most likely tokens), raw log_softmax of the logits before temperature;
    # None for tokens the edge produced alone
    logprobs: list[protocol.TokenLogprob] | None = None


@dataclass
class Result:
    """A finished request. `finish_reason`: "length" (max_tokens reached), "eos" or "cancelled".
    `stats`: the dispatcher's per-request figures, typed (tandem.stats.Stats; also indexable
    like a dict: `stats["tpt_s"]`)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    stats: Stats = field(default_factory=Stats)
    logprobs: list[protocol.TokenLogprob | None] | None = None   # per token, with logprobs=k


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
    from common import security

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


def retry_delay(attempt: int, initial_s: float = RETRY_INITIAL_S, max_s: float = RETRY_MAX_S,
                rand=random.random) -> float:
    """Seconds to wait before retry number `attempt` + 1 (0-based): exponential backoff capped
    at `max_s`, with jitter taking off up to 25 % so clients refused together do not come back
    together (openai-python's formula)."""
    return min(initial_s * 2.0 ** attempt, max_s) * (1.0 - 0.25 * rand())


def _check_retries(max_retries, name: str = "max_retries") -> int:
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {max_retries!r}")
    return max_retries


def _check_link(heartbeat_s: float, link_timeout_s: float) -> None:
    if not heartbeat_s > 0:
        raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
    if not link_timeout_s > heartbeat_s:
        raise ValueError(f"link_timeout_s must be > heartbeat_s ({heartbeat_s}), got "
                         f"{link_timeout_s}")


def _wire_messages(messages) -> list[protocol.ChatMessage]:
    """`messages=` checked here (the rules the dispatcher applies, common/chat.py), so a bad one
    fails in the caller naming the message."""
    try:
        turns = chat.normalize(messages, MAX_MESSAGES)
    except chat.MessageError as e:
        raise error_from_code(protocol.BAD_FIELD, str(e), e.field) from None
    return [protocol.ChatMessage(role=m["role"], content=m["content"]) for m in turns]


class AsyncStream:
    """One generation: an async iterator of Chunks. `result` is the whole Result once the stream
    ended normally (None before, or after an error); `attempts` how many times the request was
    sent (retries after busy / unavailable and resumes included); `resumes` how many times it
    was re-submitted as a continuation after its dispatcher was lost. Closing it early (`aclose()`, leaving
    `async with`, or cancelling the task iterating it) cancels the request on the dispatcher."""

    def __init__(self, client: "AsyncClient", args: dict, max_retries: int):
        self.result: Result | None = None
        self.attempts = 0
        self.resumes = 0
        self._gen = client._run(self, args, max_retries)

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> Chunk:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncClient:
    """`curve_server_key` + `curve_client_key` (paths from `tandem keys`): talk to a
    dispatcher that runs CURVE (`--curve-secret-key`, `--curve-allow-dir`): the stream is
    encrypted and the dispatcher lets in only allowlisted client keys. `max_retries`: times a
    request refused with busy / unavailable before its first token is sent again (per call:
    `generate(..., max_retries=n)`). `heartbeat_s`, `link_timeout_s`: the dispatcher is pinged
    this often, and lost after this long without an answer (or at once when another run of it
    answers); `max_resumes`: times one request is resumed after a lost dispatcher. `endpoint`
    may list several dispatchers, comma-separated: one is used at a time, and a silent one
    hands the client, and the requests it resumes, to the next."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 300.0,
                 limits: protocol.Limits | None = None, *, curve_server_key=None,
                 curve_client_key=None, connect_timeout_s: float = 10.0,
                 max_retries: int = DEFAULT_MAX_RETRIES,
                 context: zmq.asyncio.Context | None = None,
                 heartbeat_s: float = link.DEFAULT_HEARTBEAT_S,
                 link_timeout_s: float = link.DEFAULT_TIMEOUT_S,
                 max_resumes: int = link.DEFAULT_MAX_RESUMES):
        # "tcp://a:5550,tcp://b:5550": dispatchers to use one at a time; a silent one hands
        # the client (and its requests in flight, resumed) to the next
        self.endpoints = [e.strip() for e in endpoint.split(",") if e.strip()]
        if not self.endpoints:
            raise ValueError(f"no dispatcher endpoint in {endpoint!r}")
        self.endpoint = self.endpoints[0]   # the one in use
        self.timeout_s = timeout_s       # default deadline of a request
        self.connect_timeout_s = connect_timeout_s   # no dispatcher connected by then: Unavailable
        self.max_retries = _check_retries(max_retries)
        self.max_resumes = _check_retries(max_resumes, "max_resumes")
        _check_link(heartbeat_s, link_timeout_s)
        self.heartbeat_s = heartbeat_s
        self.link = link.LinkState(link_timeout_s)
        self.resumes = 0                 # continuations sent by this client, all requests
        self.limits = limits or protocol.Limits()
        keys = client_options(curve_server_key, curve_client_key, connect_timeout_s)
        # `context`: the one an in-process stack's services share (stack/inprocess.py)
        self.ctx = context or zmq.asyncio.Context()
        self._own_ctx = context is None
        self._keys = keys
        self.sock = self._connect()
        self._rids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._pinger: asyncio.Task | None = None
        self._ready: asyncio.Event | None = None   # the dispatcher's last Pong said ready
        self.last_result: Result | None = None   # the latest stream's result (compatibility;
        # concurrent streams overwrite it: read stream.result)
        self._sleep = asyncio.sleep     # the backoff's clock and dice (tests replace them)
        self._random = random.random

    def _connect(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"client-{uuid.uuid4().hex[:12]}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)   # queue only to a connected (and authenticated) peer
        # ZMTP heartbeats drop a dead TCP connection, so the socket reconnects to a restarted one
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, int(self.heartbeat_s * 1000)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(300, int(self.link.timeout_s * 1000)))
        if self._keys is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._keys
        sock.connect(self.endpoint)
        return sock

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        tasks = [t for t in (self._reader, self._pinger) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError:
                if sock.closed:   # replaced after a lost dispatcher (_lose): a new reader reads
                    return
                raise
            try:
                msg = protocol.decode(frames, self.limits)
            except protocol.ProtocolError:
                continue
            if isinstance(msg, protocol.Pong) and msg.rid == HEARTBEAT_RID:
                self._heard(msg)
                continue
            q = self._queues.get(msg.rid)
            if q is not None:
                q.put_nowait(msg)

    def _start(self) -> None:
        """The reader and the heartbeat, on the first request (they need the running loop)."""
        if self._reader is None:
            loop = asyncio.get_running_loop()
            self._ready = asyncio.Event()
            self._reader = loop.create_task(self._read(self.sock))
            self._pinger = loop.create_task(self._heartbeat())

    def _heard(self, pong: protocol.Pong) -> None:
        assert self._ready is not None
        if self.link.heard(pong.instance, pong.ready, time.monotonic()):
            self._lose(f"the dispatcher at {self.endpoint} restarted", move=False)
        if pong.ready:
            self._ready.set()
        else:   # starting (a restarted run loads its tokenizer) or draining: resume later
            self._ready.clear()

    def _lose(self, why: str, move: bool = True) -> None:
        """Every request in flight is cut off: each attempt raises DispatcherLost. The socket
        starts afresh (an inproc:// peer that went away is never reconnected to, and nothing
        the lost run queued can arrive late); a dispatcher that was only silent is told to cancel
        them on the old one first. `move`: go on with the next listed dispatcher (a restarted one
        is back already: stay)."""
        assert self._ready is not None and self._reader is not None
        self._ready.clear()
        for rid, q in self._queues.items():
            q.put_nowait(DispatcherLost(why))
            # never waits: a dead peer takes nothing (IMMEDIATE), a live one within the linger
            sent = self.sock.send_multipart(protocol.encode(protocol.Cancel(rid=rid)),
                                            flags=zmq.NOBLOCK)
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())   # refusal: fine
        self._reader.cancel()
        self.sock.close(linger=CANCEL_LINGER_MS)
        if move and len(self.endpoints) > 1:
            self.endpoint = self.endpoints[(self.endpoints.index(self.endpoint) + 1)
                                           % len(self.endpoints)]
            # another dispatcher: its silence counts from now (one that is down too hands on)
            self.link = link.LinkState(self.link.timeout_s, last_heard=time.monotonic())
        self.sock = self._connect()
        self._reader = asyncio.get_running_loop().create_task(self._read(self.sock))

    async def _ping(self) -> None:
        try:   # never waits: an unanswered ping is what the silence check counts
            await self.sock.send_multipart(protocol.encode(protocol.Ping(
                rid=HEARTBEAT_RID, t=time.monotonic())), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    async def _heartbeat(self) -> None:
        while True:
            await self._ping()
            await asyncio.sleep(self.heartbeat_s)
            if self.link.overdue(time.monotonic()):
                # a loop held up (by a busy caller) sent no pings meanwhile: ask once more and
                # give the answer a heartbeat before the silence counts
                await self._ping()
                await asyncio.sleep(self.heartbeat_s)
            if self.link.silent(time.monotonic()):
                self._lose(f"the dispatcher at {self.endpoint} was silent for "
                           f"{self.link.timeout_s:g} s")

    async def _wait_ready(self, timeout: float) -> bool:
        """Wait (at most `timeout`) until the dispatcher answers ready."""
        assert self._ready is not None
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._ready.wait()
        except TimeoutError:
            return False
        return True

    def generate(self, prompt: str | list[int] | None = None, *, messages: list | None = None,
                 mode: str = "auto", max_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, policy: str = "",
                 cut: int = 0, chat: bool = False, deadline_s: float | None = None,
                 stop_at_eos: bool = True, allow_edge_only: bool = False,
                 nav_thresholds: tuple[float, float] | None = None, end_client: str = "",
                 policy_knobs: dict[str, float] | None = None,
                 max_retries: int | None = None,
                 sampling_coupling: str | None = None,
                 logprobs: int | None = None, tpt_slo_ms: float = 0.0,
                 constraint: protocol.Constraint | None = None) -> AsyncStream:
        """Stream a generation of `prompt` (text or token ids) or of `messages` (a conversation,
        [{"role", "content"}], through the target's chat template). `end_client`: the end client
        a gateway sends this for (the dispatcher's per-client limits count it separately).
        `policy_knobs`: spec mode, hold the policy at these knob values (benchmarks' tuning).
        `sampling_coupling`: "gumbel" (the output depends only on seed + prompt, in every mode
        and policy) or "rejection" (more drafts accepted); None = the dispatcher's default.
        `logprobs`: 0..20, each token's log-probability under the target (log_softmax of its raw
        logits, before temperature) and that many most likely alternatives, in Chunk.logprobs
        and Result.logprobs; None = none (nothing is computed).
        `mode`: "auto" (the dispatcher chooses per request: the fastest, or with `tpt_slo_ms`
        the least cloud work meeting that time per token; `result.stats.segments` says what it
        chose and why), "cloud-only", "spec" or "split".
        `constraint`: the output is a JSON object, an instance of a JSON schema or a match of a
        regular expression (protocol.Constraint(kind="json_object" | "json_schema" | "regex",
        value=schema JSON text or pattern)), exactly in every mode; needs stop_at_eos.
        Returns an AsyncStream; its `result` (and `self.last_result`) holds the whole result
        once it ended normally."""
        args = dict(prompt=prompt, messages=messages, mode=mode, max_tokens=max_tokens,
                    temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, policy=policy,
                    cut=cut, chat=chat, deadline_s=deadline_s, stop_at_eos=stop_at_eos,
                    allow_edge_only=allow_edge_only, nav_thresholds=nav_thresholds,
                    end_client=end_client, policy_knobs=policy_knobs,
                    sampling_coupling=sampling_coupling, logprobs=logprobs,
                    tpt_slo_ms=tpt_slo_ms, constraint=constraint)
        retries = self.max_retries if max_retries is None else _check_retries(max_retries)
        return AsyncStream(self, args, retries)

    def _request(self, a: dict, deadline: float, resume_ids: list[int] | None = None
                 ) -> protocol.GenerateRequest:
        prompt, messages = a["prompt"], a["messages"]
        if (prompt is None) == (messages is None):
            raise error_from_code(protocol.BAD_FIELD, "pass a prompt or messages (one of them)",
                                  "prompt" if prompt is None else "messages")
        nav = a["nav_thresholds"]
        msg = protocol.GenerateRequest(
            rid=next(self._rids), prompt=prompt if isinstance(prompt, str) else "",
            token_ids=None if prompt is None or isinstance(prompt, str) else list(prompt),
            messages=None if messages is None else _wire_messages(messages),
            chat=a["chat"], mode=a["mode"], policy=a["policy"], cut=a["cut"],
            max_tokens=a["max_tokens"], stop_at_eos=a["stop_at_eos"],
            sampling=protocol.Sampling(temperature=a["temperature"], top_k=a["top_k"],
                                       top_p=a["top_p"], seed=a["seed"],
                                       coupling=a["sampling_coupling"]),
            deadline_s=deadline, allow_edge_only=a["allow_edge_only"],
            nav_thresholds=None if nav is None else [float(r) for r in nav],
            client=a["end_client"], logprobs=a["logprobs"], tpt_slo_ms=a["tpt_slo_ms"],
            constraint=_constraint(a["constraint"]),
            policy_knobs=None if a["policy_knobs"] is None else {
                str(k): float(v) for k, v in a["policy_knobs"].items()},
            resume_ids=None if resume_ids is None else list(resume_ids))
        c = msg.constraint
        if c is not None and len(c.value) > self.limits.max_constraint_bytes:
            raise error_from_code(protocol.TOO_LARGE, f"constraint: {len(c.value)} characters "
                                  f"over the limit of {self.limits.max_constraint_bytes} "
                                  f"(max_constraint_bytes)", "constraint")
        try:   # the wire's own rules, before anything leaves: NaN, inf, out-of-range values
            protocol.check(msg)
        except protocol.ProtocolError as e:
            arg = _ARGUMENTS.get(e.field, e.field)
            raise error_from_code(e.code, e.message.replace(e.field, arg, 1), arg) from None
        return msg

    async def _run(self, stream: AsyncStream, args: dict, max_retries: int
                   ) -> AsyncIterator[Chunk]:
        """The request, sent again after busy / unavailable while no token of the attempt has
        arrived, and resumed as a continuation after a lost dispatcher (tandem/link.py), all
        within the request's deadline."""
        deadline = self.timeout_s if args["deadline_s"] is None else args["deadline_s"]
        end = time.monotonic() + deadline
        result = Result()              # every attempt's tokens: a continuation extends it
        retry = 0
        last_token = time.monotonic()  # the pause a loss causes runs from the last token
        lost_at: float | None = None
        resume_s: list[float] = []
        while True:
            msg = self._request(args, deadline if stream.attempts == 0 else
                                max(end - time.monotonic(), 0.001),
                                result.token_ids if stream.resumes else None)
            started = False
            stream.attempts += 1
            attempt = self._attempt(stream, msg, result)
            try:
                async for chunk in attempt:
                    if lost_at is not None:
                        resume_s.append(time.monotonic() - lost_at)
                        lost_at = None
                    started = True
                    last_token = time.monotonic()
                    yield chunk
                result.stats = Stats.from_dict({**result.stats.raw,
                                                "generated_tokens": len(result.token_ids),
                                                "resumes": stream.resumes,
                                                "resume_s": resume_s})
                stream.result = self.last_result = result
                return
            except DispatcherLost as e:
                if lost_at is None:
                    lost_at = last_token
                why = link.resume_refusal(stream.resumes, self.max_resumes,
                                          end - time.monotonic())
                if not why and not await self._wait_ready(end - time.monotonic()):
                    why = "it did not answer ready again within the request's deadline"
                if why:
                    raise Unavailable(protocol.UNAVAILABLE, f"{e} mid-stream after "
                                      f"{len(result.token_ids)} tokens; not resumed: "
                                      f"{why}") from None
                stream.resumes += 1
                self.resumes += 1
                continue
            except (Busy, Unavailable) as e:
                if started or retry >= max_retries:
                    raise
                # the backoff, or later when the service said when it expects room
                delay = max(retry_delay(retry, rand=self._random), e.retry_after_s)
                if time.monotonic() + delay >= end:
                    raise   # no time left for another try: the caller hears why now
            finally:   # closed early (the caller stopped, or its task was cancelled): the
                await attempt.aclose()   # attempt's own cleanup sends Cancel now, not at GC
            retry += 1
            await self._sleep(delay)

    async def _attempt(self, stream: AsyncStream, msg: protocol.GenerateRequest,
                       result: Result) -> AsyncIterator[Chunk]:
        """One GenerateRequest's stream, appended to `result` (a continuation's indices follow
        the tokens `result` holds; anything else is dropped)."""
        self._start()
        rid = msg.rid
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        end = time.monotonic() + msg.deadline_s + 5.0   # the dispatcher enforces the deadline;
        finished = False                                # this only guards against a dead one
        try:
            # A DEALER's send waits until a dispatcher is connected: one that is not running,
            # or refuses our CURVE key, must not hold the caller for the whole deadline.
            wait = min(max(end - time.monotonic(), 0.001), self.connect_timeout_s)
            try:
                async with asyncio.timeout(wait):
                    await self.sock.send_multipart(protocol.encode(msg))
            except TimeoutError:
                finished = True   # nothing was sent: nothing to cancel
                raise Unavailable(protocol.UNAVAILABLE, f"no dispatcher reachable at "
                                  f"{self.endpoint} within {wait:.3g} s (not running, or not "
                                  f"accepting this client's CURVE key)") from None
            while True:
                left = end - time.monotonic()
                try:
                    async with asyncio.timeout(max(left, 0.001)):
                        ev = await q.get()
                except TimeoutError:
                    raise DeadlineExceeded(protocol.DEADLINE,
                                           f"no answer from the dispatcher at {self.endpoint}") from None
                if isinstance(ev, DispatcherLost):
                    finished = True   # cancelled on the lost dispatcher's socket (_lose)
                    raise ev
                if isinstance(ev, protocol.TokenEvent):
                    if ev.index != len(result.token_ids):
                        continue  # never yield a token twice
                    result.token_ids.extend(ev.token_ids)
                    result.text += ev.text
                    if msg.logprobs is not None:
                        result.logprobs = (result.logprobs or []) + (
                            ev.logprobs or [None] * len(ev.token_ids))
                    yield Chunk(ev.index, list(ev.token_ids), ev.text, ev.degraded, ev.logprobs)
                elif isinstance(ev, protocol.Done):
                    result.finish_reason = ev.finish_reason
                    result.stats = Stats.from_dict(ev.stats)
                    finished = True
                    if ev.finish_reason == "cancelled":
                        raise Cancelled(protocol.CANCELLED, "request cancelled")
                    return
                elif isinstance(ev, protocol.Error):
                    finished = True
                    raise error_from_code(ev.code, ev.message, _ARGUMENTS.get(ev.field, ev.field),
                                          ev.retry_after_s)
        finally:
            self._queues.pop(rid, None)
            if not finished:  # the caller stopped iterating early, or we timed out: cancel
                try:
                    async with asyncio.timeout(1.0):
                        await self.sock.send_multipart(protocol.encode(protocol.Cancel(rid=rid)))
                except (zmq.ZMQError, TimeoutError):
                    pass

    async def complete(self, prompt: str | list[int] | None = None, **kw) -> Result:
        """The whole result at once (same arguments as `generate`)."""
        stream = self.generate(prompt, **kw)
        async for _ in stream:
            pass
        assert stream.result is not None
        return stream.result


class Stream:
    """A synchronous generation (Client.generate): an iterator of Chunks with the stream's own
    `result` and `attempts`, as AsyncStream. `close()` (or leaving `with`) ends it early and
    cancels the request on the dispatcher."""

    def __init__(self, client: "Client", astream: AsyncStream):
        self._client, self._astream = client, astream

    @property
    def result(self) -> Result | None:
        return self._astream.result

    @property
    def attempts(self) -> int:
        return self._astream.attempts

    @property
    def resumes(self) -> int:
        return self._astream.resumes

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        try:
            return self._client._call(self._astream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self._client._call(self._astream.aclose())

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client:
    """Synchronous wrapper: the async client runs on a private event-loop thread."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 300.0, *,
                 curve_server_key=None, curve_client_key=None, connect_timeout_s: float = 10.0,
                 max_retries: int = DEFAULT_MAX_RETRIES,
                 heartbeat_s: float = link.DEFAULT_HEARTBEAT_S,
                 link_timeout_s: float = link.DEFAULT_TIMEOUT_S,
                 max_resumes: int = link.DEFAULT_MAX_RESUMES):
        client_options(curve_server_key, curve_client_key, connect_timeout_s)   # fail here
        _check_retries(max_retries)
        _check_retries(max_resumes, "max_resumes")
        _check_link(heartbeat_s, link_timeout_s)
        kw = dict(curve_server_key=curve_server_key, curve_client_key=curve_client_key,
                  connect_timeout_s=connect_timeout_s, max_retries=max_retries,
                  heartbeat_s=heartbeat_s, link_timeout_s=link_timeout_s,
                  max_resumes=max_resumes)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="tandem-client")
        self._thread.start()
        self._async = self._call(self._make(endpoint, timeout_s, kw))

    @staticmethod
    async def _make(endpoint, timeout_s, kw) -> AsyncClient:
        return AsyncClient(endpoint, timeout_s, **kw)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def last_result(self) -> Result | None:
        return self._async.last_result

    @property
    def max_retries(self) -> int:
        return self._async.max_retries

    def generate(self, prompt: str | list[int] | None = None, **kw) -> Stream:
        """As AsyncClient.generate, as a synchronous iterator."""
        return Stream(self, self._async.generate(prompt, **kw))

    def complete(self, prompt: str | list[int] | None = None, **kw) -> Result:
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


__all__ = ["Client", "AsyncClient", "Stream", "AsyncStream", "Chunk", "Result", "Stats",
           "TandemError", "DEFAULT_ENDPOINT", "retry_delay"]
