"""The WAN, emulated: an asyncio userspace TCP proxy that shapes one tcp:// link (DESIGN.md §7).

This kernel has no `netem`, so delay is injected in userspace. `WanProxy` listens on one address,
opens a connection to the target for every connection it accepts, and pumps each direction
through its own pipeline:

    socket recv ──► send queue ──► transmitter (the link: α, then β = 1/bandwidth) ──►
        delivery queue (one-way latency ± jitter) ──► socket send

The link model is PipeSD's (DESIGN.md §3): one transmission of k bytes occupies the link for
`t_c = α + β·k`, transmissions in one direction are serialised (across all connections of the
proxy, as on one physical link), and one-way propagation latency is a delivery-time *offset*, not
a serial cost — the link is a pipe, so throughput is not limited by latency.

What "one transmission" is: one `recv()` from the socket (one `data_received` call). The proxy
reads eagerly, so as long as it keeps up, one recv is one application write; for ZMQ that is one
flush of the socket's send buffer, ≈ one message batch. Writes that pile up while the proxy is
not reading (more than `send_queue_bytes` waiting for the link, or the proxy's loop busy) coalesce
into one recv and pay one α, as on a real backlogged link. A transmission is forwarded in slices
of at most `slice_bytes`, so a large one trickles out at the link rate instead of arriving whole.

Bandwidth is a token bucket (rate = bandwidth, depth = `burst_bytes`). Jitter is added to each
slice's latency, then delivery times are clamped to be non-decreasing per connection and
direction, so jitter never reorders bytes (it delays, as TCP's in-order delivery would).

Faults are link-wide, both directions at once (a one-way black hole stalls TCP both ways anyway,
its ACKs ride the dead direction): `drop()` closes every connection now; `partition(s)` stops all
traffic for s seconds, then heals. In "hold" mode bytes queue and connections stay up (new ones
are accepted and held); in "cut" mode every connection is closed and new ones are refused until
the partition heals.

Shapes change at run time (`proxy.set`), from a `Schedule` (`proxy.play`), or over the loopback
HTTP/JSON control API (`WanControl`): GET /state, POST /set, POST /partition, POST /drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import random
import socket
from dataclasses import dataclass
from typing import Any

DIRECTIONS = ("up", "down")
PARTITION_MODES = ("hold", "cut")
JITTER_DISTS = ("uniform", "normal")


@dataclass
class LinkShape:
    """How one direction of the link behaves. `drop` and `partition` are actions, not state:
    applying a shape with them set drops / partitions the whole link, and the stored shape keeps
    their defaults."""
    latency_ms: float = 0.0        # one-way propagation delay, added to every byte's delivery time
    jitter_ms: float = 0.0         # latency spread: uniform ±jitter, or the std dev when normal
    jitter_dist: str = "uniform"   # uniform | normal
    bandwidth_mbit: float = 0.0    # token-bucket rate in Mbit/s (1e6 bit/s); 0 = unlimited
    burst_bytes: int = 16384       # token-bucket depth: bytes that may leave back to back at once
    alpha_ms: float = 0.0          # per-transmission start-up cost, charged serially per recv chunk
    drop: bool = False             # action: close every connection of the link now
    partition: float = 0.0         # action: seconds during which no bytes flow, then heal

    def __post_init__(self):
        for name in ("latency_ms", "jitter_ms", "bandwidth_mbit", "alpha_ms", "partition"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:   # NaN passes `< 0`
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.burst_bytes, bool) or not isinstance(self.burst_bytes, int) \
                or self.burst_bytes < 1:
            raise ValueError(f"burst_bytes must be an integer >= 1, got {self.burst_bytes!r}")
        if self.jitter_dist not in JITTER_DISTS:
            raise ValueError(f"jitter_dist must be one of {JITTER_DISTS}, got {self.jitter_dist!r}")
        if not isinstance(self.drop, bool):
            raise ValueError(f"drop must be a boolean, got {self.drop!r}")

    def state(self) -> dict[str, Any]:
        """The shape's settings (the actions left out)."""
        out = dataclasses.asdict(self)
        del out["drop"], out["partition"]
        return out


SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(LinkShape))


def _directions(direction: str) -> tuple[str, ...]:
    if direction == "both":
        return DIRECTIONS
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be up, down or both, got {direction!r}")
    return (direction,)


# ------------------------------------------------------------------------------------ the link

class _Link:
    """One direction of the link: its shape, the serial transmitter clock and the counters.
    Shared by every connection through the proxy."""

    def __init__(self, shape: LinkShape, rng: random.Random):
        self.shape = shape
        self.rng = rng
        self.free_at = 0.0        # when the transmitter finishes what it has been given
        self.tat = 0.0            # token bucket's theoretical arrival time (GCRA form)
        self.bytes_in = 0
        self.bytes_out = 0
        self.queued_bytes = 0     # read and not yet written out, all connections together
        self.transmissions = 0

    def transmit(self, ready: float, not_before: float, sizes: list[int]) -> list[float]:
        """Departure time of each slice of one transmission ready at `ready` (α once, then the
        bytes): it starts when the link is free, τ_c(k) = max(τ_c(k-1) + t_c(k-1), ready)."""
        s = self.shape
        t = max(ready, self.free_at, not_before) + s.alpha_ms / 1e3
        departs = []
        for n in sizes:
            if s.bandwidth_mbit > 0:
                rate = s.bandwidth_mbit * 1e6 / 8  # bytes per second
                self.tat = max(self.tat, t) + n / rate
                # a full bucket lets `burst_bytes` leave at once; beyond it, bytes leave at `rate`
                t = max(t, self.tat - s.burst_bytes / rate)
            departs.append(t)
        self.free_at = t
        self.transmissions += 1
        return departs

    def arrival(self, depart: float) -> float:
        s = self.shape
        delay = s.latency_ms
        if s.jitter_ms > 0:
            if s.jitter_dist == "normal":
                delay += self.rng.gauss(0.0, s.jitter_ms)
            else:
                delay += self.rng.uniform(-s.jitter_ms, s.jitter_ms)
        return depart + max(0.0, delay) / 1e3

    def stats(self) -> dict[str, int]:
        return {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "queued_bytes": self.queued_bytes, "transmissions": self.transmissions}


_EOF = None  # queue marker: the sender half-closed


class _Side(asyncio.Protocol):
    """One socket of a proxied connection: what it reads feeds `inbound`, a pipe writes to it."""

    def __init__(self, conn: _Conn):
        self.conn = conn
        self.inbound: _Pipe | None = None
        self.transport: asyncio.Transport | None = None
        self.writable = asyncio.Event()  # cleared while the kernel buffer is full (flow control)
        self.writable.set()

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn.side_made(self)

    def data_received(self, data: bytes):
        self.inbound.on_data(data)

    def eof_received(self):
        self.inbound.on_data(_EOF)
        return True  # keep our writing half open: TCP half-close crosses the link too

    def connection_lost(self, exc):
        self.writable.set()
        self.conn.side_lost()

    def pause_writing(self):
        self.writable.clear()

    def resume_writing(self):
        self.writable.set()

    def abort(self):
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()


class _Pipe:
    """One direction of one connection: every recv() chunk is queued as one transmission, the
    link transmits the queue serially, and the bytes are delivered at their arrival times."""

    def __init__(self, proxy: WanProxy, link: _Link, src: _Side, dst: _Side):
        self.proxy, self.link, self.src, self.dst = proxy, link, src, dst
        self.send_q: asyncio.Queue = asyncio.Queue()
        self.send_bytes = 0       # read, not yet transmitted
        self.pending_bytes = 0    # read, not yet written out (includes send_bytes)
        self.paused = False       # reading paused: too much waits for the link or the receiver
        self.deliver_q: asyncio.Queue = asyncio.Queue()
        self.last_delivery = 0.0  # delivery times only grow: jitter never reorders bytes

    def on_data(self, data: bytes | None):
        # the read time: a transmission starts when both it and the link are ready, so a
        # transmitter that wakes late still keeps the link busy back to back (no drift)
        self.send_q.put_nowait((asyncio.get_running_loop().time(), data))
        if data is _EOF:
            return
        self.link.bytes_in += len(data)
        self.link.queued_bytes += len(data)
        self.send_bytes += len(data)
        self.pending_bytes += len(data)
        if not self.paused and (self.send_bytes > self.proxy.send_queue_bytes
                                or self.pending_bytes > self.proxy.window_bytes):
            self.paused = True
            self.src.transport.pause_reading()

    def _maybe_resume(self):
        if self.paused and self.send_bytes <= self.proxy.send_queue_bytes // 2 \
                and self.pending_bytes <= self.proxy.window_bytes // 2:
            self.paused = False
            self.src.transport.resume_reading()

    async def transmit(self):
        loop = asyncio.get_running_loop()
        step = self.proxy.slice_bytes
        while True:
            read_at, data = await self.send_q.get()
            if data is _EOF:
                self.deliver_q.put_nowait((self.last_delivery, _EOF))
                return
            self.send_bytes -= len(data)
            self._maybe_resume()
            slices = [data[i:i + step] for i in range(0, len(data), step)]
            departs = self.link.transmit(read_at, self.proxy.partition_until,
                                         [len(s) for s in slices])
            for piece, depart in zip(slices, departs):
                self.last_delivery = max(self.last_delivery, self.link.arrival(depart))
                self.deliver_q.put_nowait((self.last_delivery, piece))
            # the link is busy until the last slice leaves: later chunks see the shape then in force
            wait = departs[-1] - loop.time()
            if wait > 0.0005:
                await asyncio.sleep(wait)

    async def deliver(self):
        loop = asyncio.get_running_loop()
        transport = self.dst.transport
        while True:
            at, piece = await self.deliver_q.get()
            while True:
                # a partition holds bytes in flight too, whenever they were sent
                wait = max(at, self.proxy.partition_until) - loop.time()
                if wait <= 0.0002:
                    break
                await asyncio.sleep(wait)
            if piece is _EOF:
                if transport.can_write_eof() and not transport.is_closing():
                    try:
                        transport.write_eof()
                    except OSError:
                        pass    # the far side is already gone (ENOTCONN): nothing left to end
                return
            transport.write(piece)
            self.link.bytes_out += len(piece)
            self.link.queued_bytes -= len(piece)
            self.pending_bytes -= len(piece)
            self._maybe_resume()
            await self.dst.writable.wait()


class _Conn:
    """One accepted connection and the one it opens to the target."""

    def __init__(self, proxy: WanProxy):
        self.proxy = proxy
        self.client, self.target = _Side(self), _Side(self)
        self.up = _Pipe(proxy, proxy.links["up"], self.client, self.target)
        self.down = _Pipe(proxy, proxy.links["down"], self.target, self.client)
        self.client.inbound, self.target.inbound = self.up, self.down
        self.task: asyncio.Task | None = None

    def side_made(self, side: _Side):
        if side is self.client:
            self.proxy._accepted(self)

    def side_lost(self):
        # either socket gone (reset, or closed while bytes were still due) ends the connection;
        # once run() has finished, its own close() is flushing and must not be cut short
        if self.task is None or not self.task.done():
            if self.task is not None:
                self.task.cancel()
            self.abort()

    def abort(self):
        self.client.abort()
        self.target.abort()

    async def run(self):
        proxy, loop = self.proxy, asyncio.get_running_loop()
        try:
            # a held partition holds new connections too: dial the target once it heals
            while (wait := proxy.partition_until - loop.time()) > 0:
                await asyncio.sleep(wait)
            try:
                async with asyncio.timeout(proxy.connect_timeout_s):
                    await loop.create_connection(lambda: self.target, proxy.target_host,
                                                 proxy.target_port)
            except (OSError, TimeoutError):
                return
            async with asyncio.TaskGroup() as group:
                for pipe in (self.up, self.down):
                    group.create_task(pipe.transmit())
                    group.create_task(pipe.deliver())
            # both directions half-closed and delivered: close, flushing what is buffered
            for side in (self.client, self.target):
                if side.transport is not None:
                    side.transport.close()
        finally:
            proxy._conns.discard(self)
            for pipe in (self.up, self.down):  # what a cut connection never delivered
                pipe.link.queued_bytes -= pipe.pending_bytes
                pipe.pending_bytes = 0
            if self.client.transport is not None and not self.client.transport.is_closing() \
                    and self.target.transport is None:
                self.client.abort()  # never reached the target


# ----------------------------------------------------------------------------------- the proxy

class WanProxy:
    """A shaped TCP link from (listen_host, listen_port) to (target_host, target_port)."""

    def __init__(self, listen_host: str, listen_port: int, target_host: str, target_port: int,
                 up: LinkShape | None = None, down: LinkShape | None = None, *,
                 partition_mode: str = "hold",  # hold | cut: what a partition does to connections
                 seed: int | None = None,        # jitter's random stream; None = from the OS
                 slice_bytes: int = 16384,       # delivery granularity of a large transmission
                 send_queue_bytes: int = 1 << 20,  # bytes waiting for the link before reads pause
                 window_bytes: int = 32 << 20,   # bytes in flight before reads pause: caps
                                                 # throughput at window / latency, as TCP's window
                 connect_timeout_s: float = 5.0):  # give up dialing the target after this long
        if partition_mode not in PARTITION_MODES:
            raise ValueError(f"partition_mode must be one of {PARTITION_MODES}")
        self.listen_host, self.listen_port = listen_host, listen_port
        self.target_host, self.target_port = target_host, target_port
        self.partition_mode = partition_mode
        self.slice_bytes, self.send_queue_bytes = slice_bytes, send_queue_bytes
        self.window_bytes = window_bytes
        self.connect_timeout_s = connect_timeout_s
        rng = random.Random(seed)
        up, down = up or LinkShape(), down or LinkShape()
        self.links = {d: _Link(dataclasses.replace(shape, drop=False, partition=0.0),
                               random.Random(rng.random()))
                      for d, shape in (("up", up), ("down", down))}
        # actions in the initial shapes happen once the proxy is up
        self._initial_actions = {"drop": up.drop or down.drop,
                                 "partition": max(up.partition, down.partition)}
        self.partition_until = 0.0   # loop time when the current partition heals
        self._cut = False            # the current partition closes and refuses connections
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._schedules: set[asyncio.Task] = set()
        self._counts = {"connections_total": 0, "drops": 0, "refused": 0, "partitions": 0}

    # --- lifecycle

    async def start(self) -> WanProxy:
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Conn(self).client, self.listen_host, self.listen_port)
        self.set("both", **self._initial_actions)
        return self

    @property
    def port(self) -> int:
        """The port actually listened on (useful with listen_port=0)."""
        if self._server is None:
            return self.listen_port
        return self._server.sockets[0].getsockname()[1]

    async def stop(self):
        for task in list(self._schedules):
            task.cancel()
        if self._server is not None:
            self._server.close()
        self._close_all(count=False)
        tasks = [c.task for c in self._conns if c.task] + list(self._schedules)
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> WanProxy:
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()

    # --- control

    @property
    def up(self) -> LinkShape:
        return self.links["up"].shape

    @property
    def down(self) -> LinkShape:
        return self.links["down"].shape

    def set(self, direction: str, **fields) -> None:
        """Change "up", "down" or "both" now; applies from the next transmission on."""
        unknown = set(fields) - set(SHAPE_FIELDS)
        if unknown:
            raise ValueError(f"unknown link fields: {sorted(unknown)}")
        drop, seconds = fields.pop("drop", False), fields.pop("partition", 0.0)
        LinkShape(drop=drop, partition=seconds)  # validates the actions
        shapes = {d: dataclasses.replace(self.links[d].shape, **fields)
                  for d in _directions(direction)}  # all validated before any is applied
        for d, shape in shapes.items():
            self.links[d].shape = shape
        if drop:
            self.drop()
        if seconds:
            self.partition(seconds)

    def drop(self) -> int:
        """Close every connection now; returns how many. Clients may reconnect at once."""
        return self._close_all()

    def partition(self, seconds: float, mode: str | None = None) -> None:
        """No bytes flow for `seconds` (extending a partition in progress), then the link heals."""
        mode = mode or self.partition_mode
        if mode not in PARTITION_MODES:
            raise ValueError(f"partition mode must be one of {PARTITION_MODES}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        if seconds == 0:
            return
        now = asyncio.get_running_loop().time()
        if now >= self.partition_until:
            self._cut = False
        self.partition_until = max(self.partition_until, now + seconds)
        self._counts["partitions"] += 1
        if mode == "cut":
            self._cut = True
            self._close_all()

    def partitioned_for(self) -> float:
        """Seconds until the current partition heals (0 when none)."""
        return max(0.0, self.partition_until - asyncio.get_running_loop().time())

    def play(self, schedule: Schedule, time_scale: float = 1.0) -> asyncio.Task:
        """Apply a schedule's steps in the background; cancelled by stop()."""
        task = asyncio.create_task(run_schedule(self, schedule, time_scale))
        self._schedules.add(task)
        task.add_done_callback(self._schedules.discard)
        return task

    def stats(self) -> dict[str, Any]:
        return {**self._counts, "connections_open": len(self._conns),
                "up": self.links["up"].stats(), "down": self.links["down"].stats()}

    def state(self) -> dict[str, Any]:
        return {"listen": f"{self.listen_host}:{self.port}",
                "target": f"{self.target_host}:{self.target_port}",
                "up": self.up.state(), "down": self.down.state(),
                "partition_mode": self.partition_mode,
                "partitioned_for_s": round(self.partitioned_for(), 3),
                "stats": self.stats()}

    # --- connections

    def _close_all(self, count: bool = True) -> int:
        conns = list(self._conns)
        for conn in conns:
            conn.side_lost()
        if count:
            self._counts["drops"] += len(conns)
        return len(conns)

    def _accepted(self, conn: _Conn):
        if self._cut and asyncio.get_running_loop().time() < self.partition_until:
            self._counts["refused"] += 1
            conn.client.abort()
            return
        self._conns.add(conn)
        self._counts["connections_total"] += 1
        conn.task = asyncio.get_running_loop().create_task(conn.run())


# -------------------------------------------------------------------------------- schedules

@dataclass(frozen=True)
class Step:
    """At `at_s` seconds after the schedule starts, set these fields on that direction."""
    at_s: float                # seconds from the start of the schedule (of each cycle if repeating)
    direction: str             # up | down | both
    fields: dict[str, Any]     # LinkShape fields, e.g. {"bandwidth_mbit": 40}


@dataclass
class Schedule:
    steps: list[Step]          # in any order; applied in time order
    period_s: float = 0.0      # > 0: start over every period_s seconds, forever

    def at(self, t: float) -> dict[str, dict[str, Any]]:
        """The fields each direction has been given by time t (later steps win)."""
        if self.period_s > 0:
            t %= self.period_s
        out: dict[str, dict[str, Any]] = {"up": {}, "down": {}}
        for step in sorted(self.steps, key=lambda s: s.at_s):
            if step.at_s <= t:
                for d in _directions(step.direction):
                    out[d].update(step.fields)
        return out


async def run_schedule(proxy: WanProxy, schedule: Schedule, time_scale: float = 1.0):
    """Apply the steps on time; time_scale < 1 runs it faster (tests, demos)."""
    loop = asyncio.get_running_loop()
    steps = sorted(schedule.steps, key=lambda s: s.at_s)
    start = loop.time()
    while True:
        for step in steps:
            wait = start + step.at_s * time_scale - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            proxy.set(step.direction, **step.fields)
        if schedule.period_s <= 0:
            return
        start += schedule.period_s * time_scale
        wait = start - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)


def s4_schedule(seed: int = 0, period_s: float = 20.0, steps: int = 10, low_mbit: float = 10.0,
                high_mbit: float = 80.0, max_change_mbit: float = 30.0) -> Schedule:
    """PipeSD S4: uplink bandwidth changing every period_s seconds within [low, high] Mbit/s.
    Our copy of the paper lost its exact trace, so this is a seeded random walk: each step moves
    by up to ±max_change_mbit, reflected at the bounds, rounded to whole Mbit/s. Repeats."""
    rng = random.Random(seed)
    value = rng.uniform(low_mbit, high_mbit)
    out = []
    for k in range(steps):
        if k:
            value += rng.uniform(-max_change_mbit, max_change_mbit)
            if value < low_mbit:
                value = 2 * low_mbit - value
            if value > high_mbit:
                value = 2 * high_mbit - value
        out.append(Step(k * period_s, "up", {"bandwidth_mbit": float(round(value))}))
    return Schedule(out, period_s=steps * period_s)


@dataclass
class Scenario:
    up: LinkShape                     # uplink: edge -> cloud
    down: LinkShape                   # downlink: cloud -> edge
    schedule: Schedule | None = None  # played from the start, if any
    note: str = ""                    # one line for humans


_S4 = s4_schedule()


LAN = LinkShape(latency_ms=0.25)                       # same rack, no bandwidth limit
S1_UP = LinkShape(latency_ms=25.0, bandwidth_mbit=20.0)   # PipeSD's S1
S1_DOWN = LinkShape(latency_ms=25.0, bandwidth_mbit=200.0)


def changing_schedule(phase_s: float = 5.0) -> Schedule:
    """A link that changes under running requests: LAN, then S1, then a 300 ms round trip, then
    LAN again, `phase_s` seconds each, repeating. Each phase sets both directions' latency and
    bandwidth (S1's during the S1 phase, unlimited otherwise)."""
    far = LinkShape(latency_ms=150.0)
    phases = [(LAN, LAN), (S1_UP, S1_DOWN), (far, far), (LAN, LAN)]
    steps = [Step(k * phase_s, direction,
                  {"latency_ms": shape.latency_ms, "bandwidth_mbit": shape.bandwidth_mbit})
             for k, pair in enumerate(phases) for direction, shape in zip(("up", "down"), pair)]
    return Schedule(steps, period_s=len(phases) * phase_s)


SCENARIOS: dict[str, Scenario] = {
    "lan": Scenario(LAN, LAN, note="same rack: 0.25 ms one way, no bandwidth limit"),
    "s1": Scenario(S1_UP, S1_DOWN, note="PipeSD S1: 20 Mbit/s up, 200 Mbit/s down, 25 ms one way"),
    "s4": Scenario(LinkShape(latency_ms=25.0, bandwidth_mbit=_S4.at(0)["up"]["bandwidth_mbit"]),
                   S1_DOWN, schedule=_S4,
                   note="PipeSD S4: uplink 10-80 Mbit/s changing every 20 s (seeded walk), "
                        "200 Mbit/s down, 25 ms one way"),
    "changing": Scenario(LAN, LAN, schedule=changing_schedule(),
                         note="LAN, S1, 300 ms round trip, LAN, 5 s each, repeating"),
}


# ---------------------------------------------------------------------------- control API

class WanControl:
    """Loopback HTTP/JSON control of a proxy.

    GET  /state                                  -> proxy.state()
    POST /set       {"direction": "up", "latency_ms": 50, ...}  -> state
    POST /partition {"seconds": 3, "mode": "cut"}              -> state ("mode" optional)
    POST /drop                                   -> {"dropped": n}
    Errors answer 400/404/405 with {"error": "..."}."""

    MAX_BODY = 64 * 1024

    def __init__(self, proxy: WanProxy, host: str = "127.0.0.1", port: int = 0):
        self.proxy, self.host, self.requested_port = proxy, host, port
        self._server: asyncio.Server | None = None

    async def start(self) -> WanControl:
        self._server = await asyncio.start_server(self._on_client, self.host, self.requested_port)
        return self

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def stop(self):
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            async with asyncio.timeout(10.0):
                status, body = await self._handle(reader)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            status, body = 400, {"error": "malformed or incomplete request"}
        data = json.dumps(body).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found",
                  405: "Method Not Allowed"}[status]
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    async def _handle(self, reader: asyncio.StreamReader) -> tuple[int, dict]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3:
            return 400, {"error": "bad request line"}
        method, path = parts[0], parts[1].split("?")[0]
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip()) if value.strip().isdigit() else -1
        if not 0 <= length <= self.MAX_BODY:
            return 400, {"error": "bad Content-Length"}
        raw = await reader.readexactly(length) if length else b""
        routes = {"/state": "GET", "/set": "POST", "/partition": "POST", "/drop": "POST"}
        if path not in routes:
            return 404, {"error": f"no such endpoint {path}; have {sorted(routes)}"}
        if method != routes[path]:
            return 405, {"error": f"{path} takes {routes[path]}"}
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return 400, {"error": "body is not JSON"}
        if not isinstance(body, dict):
            return 400, {"error": "body must be a JSON object"}
        try:
            if path == "/set":
                body = dict(body)
                direction = body.pop("direction", "both")
                self.proxy.set(direction, **body)
            elif path == "/partition":
                self.proxy.partition(body.get("seconds", 0.0), body.get("mode"))
            elif path == "/drop":
                return 200, {"dropped": self.proxy.drop()}
        except (ValueError, TypeError) as e:
            return 400, {"error": str(e)}
        return 200, self.proxy.state()
