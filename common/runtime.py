"""The asyncio ZMQ service runtime shared by all five services (vLLM v1 engine-core style).

`Service` binds a ROUTER socket, decodes and validates every message (common/protocol.py),
answers heartbeats, routes each message type to a handler, and serves /metrics, /healthz and
/readyz over HTTP. Handlers run on the event loop and must not block: model work goes to a worker
thread (`await self.compute(fn, ...)`), so the socket keeps being read while a forward runs.

`Peer` is the client side: a DEALER with an explicit identity, heartbeats, request/reply matched
by request id (`rid`), long-lived channels for streams, timeouts, and a fresh socket when the peer
stops answering (so a half-open TCP connection never wedges a session).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import signal
import threading
import time
import traceback
import uuid
from typing import Any, Awaitable, Callable

import zmq
import zmq.asyncio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common import metrics, protocol, security
from common.config import ServiceConfig
from common.errors import ConfigurationError, TandemError
from common.protocol import Msg, ProtocolError

Handler = Callable[[bytes, Msg, list], Awaitable[None]]

LINGER_MS = 200          # on close, flush for at most this long, then drop: shutdown never hangs
RECONNECT_MS = 100       # first reconnect attempt after a drop
RECONNECT_MAX_MS = 2000  # backoff cap between reconnect attempts
HEARTBEAT_RID = 0        # request id reserved for heartbeats; real requests start at 1
LOOP_BEAT_S = 1.0        # an idle service loop still beats this often (see Service.idle)
# Messages that open a session: refused (`unavailable`, replayed on another replica by the
# dispatcher) while a service drains; retries of an open already done still pass.
OPENS = (protocol.CloudGenerate, protocol.SpecOpen, protocol.SuffixOpen, protocol.PrefixOpen,
         protocol.DraftOpen, protocol.GenerateRequest)
LOOP_STALL_S = 120.0     # a loop silent this long is stalled: /readyz fails. Far above the longest
                         # single step (a max_prompt_tokens prefill on a 2-core CPU takes ~30 s)


def _tune(sock: zmq.Socket, heartbeat_s: float, handshake_s: float | None = None) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    if handshake_s is not None:  # a peer stuck mid-handshake (slow or hostile) is dropped
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_s * 1000)))
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
    # ZMTP-level heartbeats detect a dead TCP connection even when no application traffic flows.
    ivl = max(100, int(heartbeat_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ivl * 3)
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.setsockopt(zmq.RCVHWM, 10000)


class Session:
    """What a service keeps for every session it holds; each service subclasses it."""

    def __init__(self, sid: str, ident: bytes = b"", rid: int = 0, seq: int = 0):
        self.sid = sid
        self.ident = ident       # the connection replies go to: whoever spoke for it last
        self.rid = rid           # the request id its replies carry
        self.open_seq = seq      # seq of its open: an open resent with this seq is a retry
        self.seq = seq           # seq of the latest request taken (open or step)
        self.reply: tuple[Msg, list] | None = None   # the answer to request `seq`, for a retry
        self.busy = False        # request `seq` is queued or running
        self.closed = False      # dropped: work still in flight for it is thrown away


class SessionTable:
    """The sessions one service holds, and the one place its sessions are admitted: an empty
    id, an open that repeats one already taken (a retry) or clashes with it, `max_sessions`,
    the prompt's length and vocabulary. Services add their own checks (a cut, a sampling
    vocabulary) around `admit`."""

    def __init__(self, service: str, max_sessions: int, limits: protocol.Limits):
        self.service = service
        self.max_sessions = max_sessions
        self.limits = limits
        self._by_sid: dict[str, Session] = {}

    # --- admission ----------------------------------------------------------------------------
    def admit(self, msg: Msg, prompt: list[int] | int | None = None,
              vocab_size: int = 0) -> Session | None:
        """May `msg` open session `msg.sid`? The open session when `msg` repeats its open (same
        seq: answer it from state), None when a new session may be added; else ProtocolError.
        `prompt`: its token ids (checked against `vocab_size` when given) or just its length."""
        old = self._by_sid.get(msg.sid)
        if old is not None:
            if old.open_seq == msg.seq:
                return old
            raise ProtocolError(protocol.SESSION_EXISTS, f"session {msg.sid!r} is already open",
                                field="sid")
        if not msg.sid:
            raise ProtocolError(protocol.BAD_FIELD, "sid must not be empty", field="sid")
        if len(self._by_sid) >= self.max_sessions:
            raise ProtocolError(protocol.BUSY, f"{len(self._by_sid)} sessions open on the "
                                               f"{self.service} (max_sessions)")
        if prompt is not None:
            n = prompt if isinstance(prompt, int) else len(prompt)
            if n == 0:
                raise ProtocolError(protocol.BAD_FIELD, "empty prompt", field="token_ids")
            if n > self.limits.max_prompt_tokens:
                raise ProtocolError(protocol.TOO_LARGE, f"prompt of {n} tokens > "
                                    f"max_prompt_tokens {self.limits.max_prompt_tokens}",
                                    field="token_ids")
            if vocab_size and not isinstance(prompt, int):
                check_token_ids(prompt, vocab_size)
        return None

    def find(self, msg: Msg) -> Session:
        """The session `msg` is for; `unknown_session` if it is not open (never, or closed)."""
        s = self._by_sid.get(msg.sid)
        if s is None:
            raise ProtocolError(protocol.UNKNOWN_SESSION, f"no {self.service} session "
                                                          f"{msg.sid!r} (never opened, or closed)")
        return s

    # --- the table ------------------------------------------------------------------------------
    def add(self, s: Session) -> None:
        self._by_sid[s.sid] = s
        metrics.SESSIONS.labels(self.service).set(len(self._by_sid))

    def pop(self, sid: str) -> Session | None:
        """Remove a session (marked closed); None if it is not open."""
        s = self._by_sid.pop(sid, None)
        if s is not None:
            s.closed = True
        metrics.SESSIONS.labels(self.service).set(len(self._by_sid))
        return s

    def get(self, sid: str) -> Session | None:
        return self._by_sid.get(sid)

    def ids(self) -> list[str]:
        return list(self._by_sid)

    def values(self) -> list[Session]:
        return list(self._by_sid.values())

    def __getitem__(self, sid: str) -> Session:
        return self._by_sid[sid]

    def __contains__(self, sid: object) -> bool:
        return sid in self._by_sid

    def __len__(self) -> int:
        return len(self._by_sid)

    def __iter__(self):
        return iter(list(self._by_sid))


def check_token_ids(token_ids: list[int], vocab_size: int, field: str = "token_ids") -> None:
    """Every id inside the model's vocabulary [0, vocab_size), else `bad_field` naming `field`."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ProtocolError(protocol.BAD_FIELD, f"{field} holds ids outside the vocabulary "
                                                f"[0, {vocab_size}): {bad[:5]}", field=field)


class Service:
    """Base class: subclasses set `name`, register handlers in `__init__` with `self.route`,
    and load models in `setup()` (called before the service reports ready)."""

    name = "service"

    def __init__(self, cfg: ServiceConfig, ctx: zmq.asyncio.Context | None = None):
        self.cfg = cfg
        self.limits = cfg.limits()
        self.log = logging.getLogger(f"tandem.{self.name}")
        # a shared context lets services in one process talk over inproc:// (stack/inprocess.py)
        self.ctx = ctx or zmq.asyncio.Context()
        self._own_ctx = ctx is None
        self.sock: zmq.asyncio.Socket | None = None
        self.ready = False
        self.stopping: asyncio.Event | None = None  # created on the loop in serve()
        self.handlers: dict[type, Handler] = {}
        self.peers: list[Peer] = []
        self.bound_endpoint = ""
        self.http_port = 0
        self.auth = None              # ZAP authenticator when the socket is a CURVE server
        self._tasks: set[asyncio.Task] = set()
        self._compute_lock = threading.Lock()
        self._heard: dict[bytes, float] = {}   # client identity -> last message (pings too)
        self._owners: dict[str, bytes] = {}    # session id -> identity that last spoke for it
        self._reaping = cfg.peer_idle_timeout_s > 0
        self.sessions = SessionTable(self.name, cfg.max_sessions, self.limits)
        self.beats: dict[str, float] = {}      # service loop -> its last heartbeat (monotonic)
        self.failure = ""                      # why a loop the service needs ended: exit non-zero
        self.draining = False                  # SIGTERM: finishing open sessions, admitting none
        self.drained: asyncio.Event | None = None   # set when a drain has finished (serve())
        self._routes: dict[str, tuple[bytes, int]] = {}   # session id -> (identity, rid) last used
        self.instance = uuid.uuid4().hex[:16]   # this run: in every Pong (a restart changes it)
        self.kv_cache = None   # a model service's KV budget and prefix cache (common/prefix_cache.py)
        self.route(protocol.Ping, self._on_ping)

    # --- for subclasses -----------------------------------------------------------------------
    def route(self, msg_type: type, handler: Handler) -> None:
        self.handlers[msg_type] = handler

    async def setup(self) -> None:
        """Load models, connect peers. Runs before /readyz turns 200."""

    async def teardown(self) -> None:
        """Release resources on shutdown."""

    def open_sessions(self) -> list[str]:
        """Ids of the sessions this service holds (for the orphan reaper)."""
        return self.sessions.ids()

    async def drop_session(self, sid: str) -> None:
        """End a session: its client closed it (`on_close`), went silent (the orphan reaper) or
        it hit a bug (`fail_session`). Services that hold more than the table (queued work, a
        llama.cpp context) free it in `session_dropped`."""
        s = self.sessions.pop(sid)
        if s is not None:
            self.session_dropped(s)

    def session_dropped(self, s: Session) -> None:
        """Free what a dropped session holds beyond its table entry; nothing by default."""

    async def next_step(self, ident: bytes, msg: Msg) -> Session | None:
        """The session a step (one request after its open, `seq` counting up) is for, when the
        step is new; None when it repeats the latest one (answered from state). A step older
        than the latest, or one sent while the latest still runs, is refused."""
        s = self.sessions.find(msg)
        if await self.answer_retry(ident, s, msg):
            return None
        if msg.seq < s.seq:
            raise ProtocolError(protocol.BAD_FIELD, f"stale step: seq {msg.seq} < {s.seq}",
                                field="seq")
        if s.busy:
            raise ProtocolError(protocol.BAD_FIELD, f"session {msg.sid!r} has a step in flight",
                                field="seq")
        return s

    async def answer_retry(self, ident: bytes, s: Session, msg: Msg) -> bool:
        """Is `msg` a resend of the session's latest request (same seq)? Then it is answered
        from state — the stored reply, or nothing yet while it still runs — never run twice."""
        if msg.seq != s.seq:
            return False
        if s.reply is not None and not s.busy:
            reply, buffers = s.reply
            reply.rid = msg.rid
            await self.send(ident, reply, buffers)
        return True

    async def on_close(self, ident: bytes, msg: protocol.Close, frames) -> None:
        """The Close handler of every session-holding service (they route Close here): free the
        session, then Ack — also for one already gone, so a retried Close is answered."""
        await self.drop_session(msg.sid)
        await self.send(ident, protocol.Ack(sid=msg.sid, seq=msg.seq, rid=msg.rid))

    def load(self) -> tuple[int, int, int]:
        """(sessions held, tokens queued for a forward, KV bytes held): reported in every Pong
        for placement across replicas; services with an engine override it."""
        return len(list(self.open_sessions())), 0, 0

    def in_flight(self) -> int:
        """Work a drain waits for (open sessions by default)."""
        return len(list(self.open_sessions()))

    def peer(self, name: str, endpoint: str) -> "Peer":
        p = Peer(self.ctx, endpoint, name=name, owner=self.name,
                 heartbeat_s=self.cfg.heartbeat_s, timeout_s=self.cfg.peer_timeout_s,
                 limits=self.limits, curve=security.client_keys(self.cfg, name),
                 handshake_s=self.cfg.handshake_s)
        self.peers.append(p)
        return p

    async def send(self, ident: bytes, msg: Msg, buffers: list | tuple = ()) -> bool:
        """Send to a connected client; False if it is gone (ROUTER_MANDATORY)."""
        assert self.sock is not None
        try:
            await self.sock.send_multipart([ident, *protocol.encode(msg, buffers)], copy=False)
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self.log.debug("peer %r gone; dropped %s", ident, type(msg).__name__)
                return False
            raise

    async def error(self, ident: bytes, req: Msg | None, code: str, message: str,
                    field: str = "", retry_after_s: float = 0.0) -> None:
        metrics.ERRORS.labels(self.name, code).inc()
        self.log.debug("error %s to %r: %s", code, ident, message)
        await self.send(ident, protocol.error_reply(req, code, message, field, retry_after_s))

    async def fail_session(self, ident: bytes, req: Msg, what: str, exc: BaseException) -> None:
        """One session hit a bug (`what`: its forward, its sampling, ...): the session ends
        (`drop_session`: its state may be half-updated), the traceback goes to the log, and the
        session's peer gets `internal` naming the session (never the exception's internals);
        everything else goes on."""
        self.log.error("session %r: %s failed; session ended:\n%s", req.sid, what,
                       "".join(traceback.format_exception(exc)))
        if req.sid:
            try:
                await self.drop_session(req.sid)
            except Exception:
                self.log.exception("dropping session %r failed", req.sid)
        whose = f"session {req.sid!r}" if req.sid else "a request without a session"
        await self.error(ident, req, protocol.INTERNAL,
                         f"{self.name}: internal error in the {what} of {whose}; the session "
                         f"was ended (details in the {self.name} log)")

    async def end_constrained(self, ident: bytes, req: Msg, e: ProtocolError) -> None:
        """A session whose output constraint failed (no token allowed, common/constraint.py)
        ends with that error: the request's own doing, not a bug."""
        self.log.info("session %r ended: %s", req.sid, e.message)
        await self.drop_session(req.sid)
        await self.error(ident, req, e.code, e.message, e.field)

    async def compute_each(self, fn: Callable[[list], list], items: list) -> list:
        """`fn(items)` on the compute thread, one result per item. If the batch fails, each item
        runs alone, so a failure costs only the sessions that fail by themselves: the result is
        then that item's exception. (Model calls leave their KV untouched when they raise —
        common/runner.py — so running an item again is safe.)"""
        try:
            return list(await self.compute(fn, items))
        except Exception as e:  # noqa: BLE001 - isolate the culprit below
            if len(items) == 1:
                return [e]
            self.log.warning("a batch of %d failed (%s: %s); running its members one by one",
                             len(items), type(e).__name__, e)
        out: list = []
        for item in items:
            try:
                out.append((await self.compute(fn, [item]))[0])
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out

    # --- liveness: the loops a service needs ------------------------------------------------
    def beat(self, loop: str) -> None:
        """A service loop is alive and making progress (called by the loop itself)."""
        self.beats[loop] = time.monotonic()

    async def idle(self, loop: str, wakeup: asyncio.Event, timeout: float | None = None) -> None:
        """Wait for `wakeup` (or `timeout`), beating while idle so that readiness can tell an
        idle loop from a dead or stuck one."""
        end = None if timeout is None else time.monotonic() + timeout
        while not wakeup.is_set():
            self.beat(loop)
            wait = LOOP_BEAT_S if end is None else min(LOOP_BEAT_S, end - time.monotonic())
            if wait <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await wakeup.wait()
        self.beat(loop)

    def not_ready_reason(self) -> str:
        """"" when ready; else what is wrong, for /readyz, Pong and `tandem status`."""
        if self.failure:
            return f"failed: {self.failure}"
        if self.draining:
            return "draining"
        if not self.ready:
            return "loading"
        now = time.monotonic()
        for loop, t in self.beats.items():
            if now - t > LOOP_STALL_S:
                return f"{loop} loop stalled for {now - t:.0f} s"
        return ""

    def spawn_loop(self, name: str, coro) -> asyncio.Task:
        """Start a loop the service cannot work without (an engine loop): it beats (`beat`,
        `idle`); if it ever ends — an exception, or a return — the service is not ready and
        stops with a non-zero exit status, so a supervisor restarts it."""
        self.beat(name)
        task = self.spawn(coro)

        def ended(t: asyncio.Task) -> None:
            if t.cancelled() or self.stopping is None or self.stopping.is_set():
                return   # shutting down
            why = "returned" if t.exception() is None else f"{type(t.exception()).__name__}"
            self.failure = f"the {name} loop ended ({why})"
            self.log.critical("%s: %s; stopping (exit status 1)", self.name, self.failure)
            self.stop()
        task.add_done_callback(ended)
        return task

    async def compute(self, fn: Callable, *args: Any) -> Any:
        """Run model work on a worker thread; one at a time (the model uses all its threads)."""
        def locked():
            with self._compute_lock:
                return fn(*args)
        return await asyncio.to_thread(locked)

    def spawn(self, coro) -> asyncio.Task:
        """Start a background task whose failure is logged, never silently lost."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task):
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.log.error("background task failed: %s", "".join(
                    traceback.format_exception(t.exception())))
        task.add_done_callback(done)
        return task

    # --- the loop -----------------------------------------------------------------------------
    async def _on_ping(self, ident: bytes, msg: Msg, frames: list) -> None:
        sessions, queued, kv = self.load() if self.ready else (0, 0, 0)
        await self.send(ident, protocol.Pong(rid=msg.rid, t=msg.t, service=self.name,
                                             ready=not self.not_ready_reason(),
                                             sessions=sessions, queued_tokens=queued,
                                             kv_bytes=kv, admitting=not self.draining,
                                             instance=self.instance,
                                             prefix_cache=bool(self.kv_cache
                                                               and self.kv_cache.enabled)))

    async def _dispatch(self, ident: bytes, frames: list) -> None:
        try:
            msg = protocol.decode(frames, self.limits)
        except Exception as e:
            if not isinstance(e, ProtocolError):
                self.log.exception("decoder failed on a message")
                e = ProtocolError(protocol.BAD_FRAME, f"undecodable message ({type(e).__name__})")
            sid, seq, rid = protocol.peek_ids(frames)
            metrics.ERRORS.labels(self.name, e.code).inc()
            await self.send(ident, protocol.Error(sid=sid, seq=seq, rid=rid, code=e.code,
                                                  message=e.message, field=e.field))
            return
        metrics.MESSAGES.labels(self.name, msg.__struct_config__.tag).inc()
        if self._reaping and msg.sid and not isinstance(msg, (protocol.Ping, protocol.Close)):
            self._owners[msg.sid] = ident   # replies, and the session's life, follow its client
        if msg.sid and not isinstance(msg, (protocol.Ping, protocol.Close)):
            if len(self._routes) > 64 + 2 * len(list(self.open_sessions())):
                held = set(self.open_sessions())   # forget closed sessions (amortised)
                self._routes = {k: v for k, v in self._routes.items() if k in held}
            self._routes[msg.sid] = (ident, msg.rid)   # where a drain hands the session back
            if self.draining and isinstance(msg, OPENS) and msg.sid not in set(self.open_sessions()):
                await self.error(ident, msg, protocol.UNAVAILABLE,
                                 f"{self.name} is draining (shutting down): open the session "
                                 f"on another replica")
                return
        handler = self.handlers.get(type(msg))
        if not self.ready and handler is not None and not isinstance(msg, (protocol.Ping,
                                                                           protocol.Close)):
            # still in setup() (models loading): a message queued for us while we were down
            # must not reach a handler that needs them; UNAVAILABLE is retried by the sender
            await self.error(ident, msg, protocol.UNAVAILABLE, f"{self.name} is starting")
            return
        if handler is None:
            await self.error(ident, msg, protocol.WRONG_SERVICE,
                             f"{self.name} does not serve {msg.__struct_config__.tag!r} messages")
            return
        try:
            await handler(ident, msg, frames)
        except ProtocolError as e:
            await self.error(ident, msg, e.code, e.message, e.field, e.retry_after_s)
        except Exception as e:  # noqa: BLE001 - a bug must not take the service down
            await self.fail_session(ident, msg, f"{msg.__struct_config__.tag!r} handler", e)

    async def _recv_loop(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue  # a routing id alone: nothing to answer
            ident = frames[0].bytes
            if self._reaping:
                self._heard[ident] = time.monotonic()
            await self._dispatch(ident, frames[1:])

    async def _reap_orphans(self) -> None:
        """Drop the sessions of clients that went silent (a dispatcher killed with SIGKILL never
        sends Close): a client's Peer heartbeats every heartbeat_s, so a silence of
        peer_idle_timeout_s means it is gone, and its sessions would otherwise hold KV caches
        (and a cloud-only session would generate to max_tokens) for nobody. A client that
        reconnected under a new identity and spoke for a session since owns it again, so only
        sessions nobody has claimed are dropped; a dispatcher that comes back later replays
        them under fresh session ids (services/dispatcher/recovery.py)."""
        timeout = self.cfg.peer_idle_timeout_s
        while True:
            await asyncio.sleep(min(1.0, max(0.05, timeout / 4)))
            now = time.monotonic()
            held = set(self.open_sessions())
            for sid in [s for s in self._owners if s not in held]:
                del self._owners[sid]            # closed or finished: nothing to watch
            silent = {i for i, t in self._heard.items() if now - t > timeout}
            if not silent:
                continue
            for i in silent:
                del self._heard[i]
            orphans = [sid for sid, i in self._owners.items() if i in silent]
            for sid in orphans:
                del self._owners[sid]
                await self.drop_session(sid)
            if orphans:
                metrics.ORPHANS.labels(self.name).inc(len(orphans))
                self.log.warning("dropped %d session(s) of %d client(s) silent for over %.1f s: "
                                 "%s", len(orphans), len(silent), timeout,
                                 ", ".join(sorted(orphans)[:8]))

    async def serve(self) -> None:
        self.stopping = asyncio.Event()
        self.drained = asyncio.Event()
        self.sock = self.ctx.socket(zmq.ROUTER)
        _tune(self.sock, self.cfg.heartbeat_s, self.cfg.handshake_s)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # a frame up to twice the wire limit is read and answered `too_large`; a peer that
        # announces more (say 1 TB) is disconnected before ZMQ allocates or reads any of it
        limit = max(self.limits.max_frame_bytes, self.limits.max_header_bytes)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * limit + (1 << 20))
        # a ZAP domain makes libzmq refuse unversioned (ZMTP 1.0) peers — any stream of bytes
        # not starting with a ZMTP greeting — which it would otherwise hold open forever;
        # with no ZAP handler (plaintext) every ZMTP 3 peer is let in as before
        self.sock.setsockopt(zmq.ZAP_DOMAIN, security.ZAP_DOMAIN.encode())
        curve = security.server_keys(self.cfg)
        security.check_plaintext(self.cfg, self.name)   # across hosts: CURVE, or an explicit opt-out
        if curve is not None:  # before bind: every connection must then speak CURVE
            security.apply_server(self.sock, curve)
            self.auth = security.start_authenticator(self.ctx, curve)
        try:
            self.sock.bind(self.cfg.bind)
        except zmq.ZMQError as e:
            self._unbind()
            raise BindError(self.name, self.cfg.bind, "--bind", e.errno, e.strerror) from None
        self.bound_endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        try:
            http = await asyncio.start_server(self._http, self.cfg.http_host, self.cfg.http_port)
        except OSError as e:
            self._unbind()
            raise BindError(self.name, f"http://{self.cfg.http_host}:{self.cfg.http_port}",
                            "--http-port", e.errno, e.strerror) from None
        self.http_port = http.sockets[0].getsockname()[1]
        self.log.info("%s listening on %s, http://%s:%d (pid %d)", self.name,
                      self.bound_endpoint, self.cfg.http_host, self.http_port, os.getpid())
        recv = asyncio.get_running_loop().create_task(self._recv_loop())
        try:
            await self.setup()
            for p in self.peers:
                p.start()
            if self._reaping:
                metrics.ORPHANS.labels(self.name)   # the series exists, at 0, from the start
                self.spawn(self._reap_orphans())
            self.ready = True
            metrics.UP.labels(self.name).set(1)
            self.log.info("%s ready", self.name)
            stop = asyncio.get_running_loop().create_task(self.stopping.wait())
            await asyncio.wait([recv, stop], return_when=asyncio.FIRST_COMPLETED)
            if recv.done() and recv.exception():
                raise recv.exception()
        finally:
            self.log.info("%s shutting down", self.name)
            self.ready = False
            recv.cancel()
            for t in list(self._tasks):
                t.cancel()
            with contextlib.suppress(Exception):
                await self.teardown()
            for p in self.peers:
                p.close()
            http.close()
            self.sock.close(linger=LINGER_MS)
            if self.auth is not None:
                self.auth.stop()
            if self._own_ctx:
                self.ctx.term()

    def _unbind(self) -> None:
        """Start-up failed before serving: release the socket (and the CURVE authenticator)."""
        self.sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    def stop(self) -> None:
        if self.stopping is not None:
            self.stopping.set()

    def terminate(self) -> None:
        """SIGTERM: drain (a second SIGTERM, or SIGINT, stops at once)."""
        if self.draining or not self.ready or self.cfg.drain_s <= 0:
            self.stop()
            return
        self.draining = True
        self.spawn(self._drain())

    async def _drain(self) -> None:
        """Not ready (/readyz 503, Pong ready=False and admitting=False, so dispatchers place no
        new session here), new opens refused `unavailable`; open sessions get `drain_s` to
        finish; those left are handed back — an `unavailable` error on their channel, which the
        dispatcher replays on another replica from the tokens it committed — then exit."""
        self.log.warning("%s draining: %d session(s) open, up to %.1f s to finish", self.name,
                         self.in_flight(), self.cfg.drain_s)
        end = time.monotonic() + self.cfg.drain_s
        while self.in_flight() and time.monotonic() < end:
            self._drop_silent_owners()
            await asyncio.sleep(0.05)
        left = list(self.open_sessions())
        for sid in left:
            ident, rid = self._routes.get(sid, (b"", 0))
            if ident:
                await self.send(ident, protocol.Error(sid=sid, rid=rid, code=protocol.UNAVAILABLE,
                                                      message=f"{self.name} is shutting down: "
                                                              f"session handed back"))
            await self.drop_session(sid)
        if left:
            metrics.HANDED_BACK.labels(self.name).inc(len(left))
            self.log.warning("%s handed back %d session(s) after %.1f s", self.name, len(left),
                             self.cfg.drain_s)
            await asyncio.sleep(LINGER_MS / 1000)   # let the hand-back errors leave
        self.log.info("%s drained", self.name)
        self.drained.set()
        await asyncio.sleep(0.1)   # a preStop hook waiting on GET /drain gets its answer
        self.stop()

    def _drop_silent_owners(self) -> None:
        """While draining, a session whose client has gone silent (a dispatcher already
        stopped) is waited for by nobody: it does not hold the drain up."""
        if not self._reaping:
            return
        now = time.monotonic()
        quiet = 3 * self.cfg.heartbeat_s
        for sid in list(self.open_sessions()):
            ident = self._owners.get(sid)
            if ident is not None and now - self._heard.get(ident, now) > quiet:
                self.spawn(self.drop_session(sid))

    @classmethod
    def launch(cls, config_cls: type, argv: list[str] | None = None) -> None:
        """`tandem serve <name>`: config (YAML < env < CLI), logging, torch threads, run."""
        import sys

        from common import log
        from common.config import load

        cfg = load(config_cls, cls.name, argv)
        log.setup(cls.name, cfg.log_level)
        if cfg.threads and "torch" in sys.modules:  # services with a model imported torch
            sys.modules["torch"].set_num_threads(cfg.threads)
        cls(cfg).run()

    def run(self) -> None:
        """Blocking entry point: uvloop, SIGTERM/SIGINT -> graceful shutdown."""
        try:
            import uvloop
            runner = uvloop.run
        except ImportError:  # pragma: no cover
            runner = asyncio.run

        async def main():
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self.terminate)
            loop.add_signal_handler(signal.SIGINT, self.stop)
            await self.serve()
        try:
            runner(main())
        except (security.KeyFileError, BindError, ConfigurationError) as e:   # no traceback
            raise SystemExit(f"{self.name}: {e}") from None
        if self.failure:   # a loop the service needs ended: a supervisor must restart us
            raise SystemExit(f"{self.name}: {self.failure}")

    # --- HTTP: /metrics, /healthz, /readyz ----------------------------------------------------
    async def _http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                line = await reader.readline()
            while True:
                async with asyncio.timeout(5):
                    if await reader.readline() in (b"\r\n", b"\n", b""):
                        break
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            if path == "/metrics":
                metrics.refresh_process_metrics(self.name)
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest()
            elif path == "/healthz":
                status, ctype, body = "200 OK", "text/plain", b"ok\n"
            elif path == "/drain":    # a Kubernetes preStop hook, from inside the pod only
                status, ctype, body = await self._http_drain(writer)
            elif path == "/readyz":   # ready = set up, and every service loop beating
                why = self.not_ready_reason()
                status = "503 Service Unavailable" if why else "200 OK"
                ctype, body = "text/plain", f"{why or 'ready'}\n".encode()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                         + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, ValueError):
            pass  # slow, vanished or oversize (a line over 64 KiB): drop the connection
        finally:
            writer.close()


    async def _http_drain(self, writer) -> tuple[str, str, bytes]:
        """GET /drain (loopback only): drain as on SIGTERM and answer once drained, so that a
        preStop hook holds the pod's termination until its sessions are finished or handed
        back; the service then exits."""
        peer = writer.get_extra_info("peername") or ("",)
        if not security.bind_is_local(f"tcp://{peer[0]}:0"):
            return "403 Forbidden", "text/plain", b"/drain is served to loopback only\n"
        if not self.draining:
            self.terminate()
        if self.drained is not None and self.draining:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.drain_s + 5):
                    await self.drained.wait()
        return "200 OK", "text/plain", b"drained\n"


class BindError(OSError):
    """A service cannot listen where it was told to (most often: the port is taken)."""

    def __init__(self, service: str, where: str, flag: str, errno_: int | None, why: str):
        hint = ""
        if errno_ == errno.EADDRINUSE:
            why = "address already in use"
            hint = (f" — another process listens there (another Tandem? `tandem status`, "
                    f"`tandem down`); choose another port with {flag}")
        super().__init__(errno_, f"cannot listen on {where}: {why}{hint}")
        self.service, self.where = service, where

    def __str__(self) -> str:
        return self.strerror


class PeerError(TandemError):
    """A peer answered with an Error message, or did not answer in time."""


class Channel:
    """All replies carrying one request id, in order. A spec session talks to the verifier over
    one channel: its batches, NAV requests and (early) results share the rid."""

    def __init__(self, peer: "Peer", rid: int):
        self.peer = peer
        self.rid = rid
        self.queue: asyncio.Queue = asyncio.Queue()

    async def send(self, msg: Msg, buffers: list | tuple = ()) -> None:
        msg.rid = self.rid
        await self.peer._send(msg, buffers)

    async def recv(self, timeout: float | None = None) -> tuple[Msg, list]:
        """Next reply; raises PeerError on an Error message, timeout or lost connection."""
        try:
            async with asyncio.timeout(timeout):
                item = await self.queue.get()
        except TimeoutError:
            raise PeerError(protocol.DEADLINE,
                            f"no reply from {self.peer.name} within {timeout:.1f} s") from None
        msg, frames = item
        if isinstance(msg, protocol.Error):
            raise PeerError(msg.code, msg.message, msg.field, msg.retry_after_s)
        return msg, frames

    def close(self) -> None:
        self.peer._channels.pop(self.rid, None)


class Peer:
    """DEALER client of another service."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, name: str, owner: str,
                 heartbeat_s: float = 2.0, timeout_s: float = 6.0,
                 limits: protocol.Limits | None = None,
                 curve: security.ClientKeys | None = None, handshake_s: float | None = None):
        self.ctx = ctx
        self.curve = curve            # CURVE client keys when the peer runs CURVE
        self.handshake_s = handshake_s
        self.endpoint = endpoint
        self.name = name
        self.owner = owner
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.limits = limits or protocol.Limits()
        self.up = False
        self.rtt = float("nan")
        self.last_seen = 0.0
        self.generation = 0           # bumps each time the socket is recreated
        self.load: protocol.Pong | None = None   # the last heartbeat reply: readiness and load
        self.instance = ""            # the peer's run, from its Pongs ("" before any)
        self._rids = itertools.count(1)
        self._channels: dict[int, Channel] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._up_event: asyncio.Event | None = None
        self.log = logging.getLogger(f"tandem.{owner}.peer.{name}")
        self._connect()

    def _connect(self) -> None:
        self._sock = self.ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, f"{self.owner}-{uuid.uuid4().hex[:12]}".encode())
        _tune(self._sock, self.heartbeat_s, self.handshake_s)
        if self.curve is not None:
            security.apply_client(self._sock, self.curve)
        self._sock.connect(self.endpoint)
        self.generation += 1

    def start(self) -> None:
        """Start receiving and heartbeating (needs a running loop)."""
        if self._tasks:
            return
        self._up_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._recv_loop()), loop.create_task(self._heartbeat())]

    def channel(self) -> Channel:
        self.start()
        ch = Channel(self, next(self._rids))
        self._channels[ch.rid] = ch
        return ch

    async def request(self, msg: Msg, buffers: list | tuple = (),
                      timeout: float | None = None) -> tuple[Msg, list]:
        """One request, one reply."""
        ch = self.channel()
        try:
            await ch.send(msg, buffers)
            return await ch.recv(self.timeout_s if timeout is None else timeout)
        finally:
            ch.close()

    async def wait_up(self, timeout: float) -> bool:
        self.start()
        assert self._up_event is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._up_event.wait()
        return self.up

    async def _send(self, msg: Msg, buffers: list | tuple = ()) -> None:
        """Queue a message, never waiting: a DEALER with no pipe to its peer (an inproc://
        peer that is gone) or a full queue would block the send, and with it the heartbeat that
        is to notice the peer is gone. Such a peer is unreachable: `unavailable`."""
        assert self._sock is not None
        try:
            await self._sock.send_multipart(protocol.encode(msg, buffers), flags=zmq.NOBLOCK,
                                            copy=False)
        except zmq.Again:
            raise PeerError(protocol.UNAVAILABLE, f"{self.name} at {self.endpoint} takes no "
                                                  f"messages (not connected, or its queue is "
                                                  f"full)") from None

    async def _recv_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                msg = protocol.decode(frames, self.limits)
            except ProtocolError as e:
                self.log.warning("undecodable reply from %s: %s", self.name, e)
                continue
            self.last_seen = time.monotonic()
            if isinstance(msg, protocol.Pong) and msg.rid == HEARTBEAT_RID:
                self.rtt = time.monotonic() - msg.t
                self.load = msg            # its load, for placement (services/dispatcher/placement.py)
                metrics.LINK_RTT.labels(self.owner, self.name).observe(self.rtt)
                if self.instance and msg.instance and msg.instance != self.instance:
                    self._restarted()
                self.instance = msg.instance or self.instance
                self._mark(msg.ready)
                continue
            ch = self._channels.get(msg.rid)
            if ch is not None:
                ch.queue.put_nowait((msg, frames))
            else:
                self.log.debug("reply for closed request %d dropped (%s)", msg.rid,
                               type(msg).__name__)

    def _mark(self, up: bool) -> None:
        if up != self.up:
            self.log.info("%s is %s", self.name, "up" if up else "DOWN")
        self.up = up
        metrics.PEER_UP.labels(self.owner, self.name).set(1 if up else 0)
        if self._up_event is not None:
            if up:
                self._up_event.set()
            else:
                self._up_event.clear()

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self._send(protocol.Ping(rid=HEARTBEAT_RID, t=time.monotonic()))
            except (zmq.ZMQError, PeerError):
                pass   # unsent: the silence that follows marks the peer down
            await asyncio.sleep(self.heartbeat_s if self.up else min(0.2, self.heartbeat_s))
            silent = time.monotonic() - self.last_seen
            if self.up and silent > self.timeout_s:
                self._mark(False)
                self._reset()

    def _restarted(self) -> None:
        """Another run of the peer answers: it restarted, faster than its silence would have
        marked it down, and the sessions the old run held are gone with it. Everything in flight
        fails now (`unknown_session`: replayed as a restart), not after the stall timer."""
        self.log.warning("%s restarted; failing its %d requests in flight", self.name,
                         len(self._channels))
        for ch in list(self._channels.values()):
            ch.queue.put_nowait((protocol.Error(rid=ch.rid, code=protocol.UNKNOWN_SESSION,
                                                message=f"{self.name} restarted"), []))

    def _reset(self) -> None:
        """The peer stopped answering: fail everything in flight and start a fresh socket."""
        self.log.warning("%s silent; reconnecting to %s", self.name, self.endpoint)
        old = self._sock
        self._tasks[0].cancel()
        self._connect()
        self._tasks[0] = asyncio.get_running_loop().create_task(self._recv_loop())
        if old is not None:
            old.close(linger=0)
        for ch in list(self._channels.values()):
            ch.queue.put_nowait((protocol.Error(rid=ch.rid, code=protocol.UNAVAILABLE,
                                                message=f"{self.name} stopped answering"), []))

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._sock is not None:
            self._sock.close(linger=LINGER_MS)
