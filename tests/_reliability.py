"""Shared by the reliability tests (chaos, faults, load, fuzz, security): a raw stream recorder
that sees every event the dispatcher sends (duplicates included, which the SDK would hide), a
WAN proxy on its own thread, cluster start-up, and the figures file docs/reliability.md is
rendered from (bench/reliability_report.py).

Figures go to $TANDEM_RELIABILITY_DIR (default run/reliability/), one JSON per section, keyed by
check name, so a rerun replaces its own figures and leaves the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import zmq

from common import protocol
from stack.launcher import Cluster
from common.models import repo_root
from stack.wan import LinkShape, WanProxy
from tests.conftest import metric_samples, wait_until

# Service flags that make failures visible in ~1 s instead of ~6 s (tests only).
FAST_PEERS = ["--heartbeat-s", "0.25", "--peer-timeout-s", "1.5"]
ONE_THREAD = ["--threads", "1"]   # two shared cores: each model process keeps to one


def results_dir() -> Path:
    return Path(os.environ.get("TANDEM_RELIABILITY_DIR", repo_root() / "run" / "reliability"))


def record(section: str, name: str, **figures) -> None:
    """Store one check's figures (replacing an older run of the same check)."""
    d = results_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{section}.json"
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[name] = {**figures, "recorded": time.strftime("%Y-%m-%dT%H:%M:%S")}
        path.write_text(json.dumps(data, indent=2, default=float) + "\n")


@contextlib.contextmanager
def running(cluster: Cluster, timeout: float = 240.0):
    cluster.start_all()
    try:
        cluster.wait_ready(timeout=timeout)
        yield cluster
    finally:
        cluster.stop_all()


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def no_sessions_left(c: Cluster, wait_s: float = 15.0) -> None:
    """Every service's session gauges are back to 0 (closes are asynchronous: polled until they
    are, or `wait_s` passes)."""
    def left() -> dict[str, float]:
        out = {}
        for name, p in c.procs.items():
            with urllib.request.urlopen(p.url("/metrics"), timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith(("tandem_sessions{", "tandem_active_sessions{")):
                        value = float(line.rsplit(" ", 1)[1])
                        if value:
                            out[f"{name}:{line.split(' ')[0]}"] = value
        return out
    deadline = time.monotonic() + wait_s
    while (now := left()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not now, f"sessions left behind: {now}"


def recoveries_total(c: Cluster, service: str = "dispatcher") -> float:
    """The dispatcher's tandem_session_recoveries_total, every mode and reason together."""
    return sum(v for name, labels, v in metric_samples(c.procs[service].url("/metrics"))
               if name == "tandem_session_recoveries_total" and labels.get("service") == service)


def heartbeats_from(c: Cluster, peer: str, service: str = "dispatcher") -> tuple[float, bool]:
    """(heartbeat answers `service` has had from `peer`, whether it counts `peer` up now)."""
    pongs, up = 0.0, False
    for name, labels, v in metric_samples(c.procs[service].url("/metrics")):
        if labels.get("service") != service or labels.get("peer") != peer:
            continue
        if name == "tandem_link_rtt_seconds_count":
            pongs = v
        elif name == "tandem_peer_up":
            up = v == 1
    return pongs, up


def wait_link_back(c: Cluster, link: "Link", peer: str, timeout: float = 60.0) -> None:
    """Wait until `link`'s partition has healed and the dispatcher has heard `peer` answer a
    heartbeat through it since, and counts it up again: the link is usable, not merely healed."""
    wait_until(lambda: link.partitioned_for() == 0, timeout, "the partition to heal")
    pongs, _ = heartbeats_from(c, peer)
    wait_until(lambda: (lambda n, up: n > pongs and up)(*heartbeats_from(c, peer)), timeout,
               f"the dispatcher to hear {peer} again after the heal")


# ------------------------------------------------------------------------- stream recorder

@dataclass
class Event:
    t: float                   # time.monotonic() at arrival
    msg: protocol.Msg


@dataclass
class Stream:
    """Every message the dispatcher sent for one request, in arrival order."""
    prompt_ids: list[int]
    sent_at: float = 0.0
    events: list[Event] = field(default_factory=list)

    @property
    def token_events(self) -> list[Event]:
        return [e for e in self.events if isinstance(e.msg, protocol.TokenEvent)]

    @property
    def tokens(self) -> list[int]:
        """Every token received, in order, duplicates included."""
        return [t for e in self.token_events for t in e.msg.token_ids]

    @property
    def end_event(self) -> Event | None:
        """The first end (Done or Error) and when it arrived; None while in flight."""
        return next((e for e in self.events
                     if isinstance(e.msg, (protocol.Done, protocol.Error))), None)

    @property
    def end(self) -> protocol.Msg | None:
        e = self.end_event
        return e.msg if e else None

    @property
    def ended_at(self) -> float | None:
        e = self.end_event
        return e.t if e else None

    @property
    def done(self) -> protocol.Done | None:
        return self.end if isinstance(self.end, protocol.Done) else None

    @property
    def error(self) -> protocol.Error | None:
        return self.end if isinstance(self.end, protocol.Error) else None

    def check_exactly_once(self) -> None:
        """Invariant 5: event indices tile 0..n-1 with no gap, no overlap, no repeat."""
        at = 0
        for e in self.token_events:
            assert e.msg.index == at, f"token event at index {e.msg.index}, expected {at}"
            at += len(e.msg.token_ids)
        ends = [e for e in self.events if isinstance(e.msg, (protocol.Done, protocol.Error))]
        assert len(ends) <= 1, f"{len(ends)} end events"

    def token_times(self) -> list[float]:
        return [e.t for e in self.token_events for _ in e.msg.token_ids]

    def longest_gap(self) -> float:
        """Longest silence between consecutive tokens (the fault's visible cost)."""
        ts = self.token_times()
        return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)

    def gap_after(self, t: float) -> float | None:
        """From `t` (a fault) to the next token: the time the client waited to recover."""
        later = [x for x in self.token_times() if x >= t]
        return later[0] - t if later else None


class Recorder:
    """Raw DEALER client on its own thread: sends GenerateRequests and records every reply."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.streams: dict[int, Stream] = {}
        self.rid = 0
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.stop = threading.Event()
        self.outbox: list[list[bytes]] = []
        self.thread = threading.Thread(target=self._loop, daemon=True, name="recorder")
        self.thread.start()

    def _loop(self) -> None:
        # one thread owns the socket (ZMQ sockets are not thread-safe); others queue sends
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            with self.lock:
                out, self.outbox = self.outbox, []
            for frames in out:
                self.sock.send_multipart(frames)
            if not poller.poll(5):
                continue
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                t = time.monotonic()
                msg = protocol.decode(frames, protocol.Limits())
                with self.cond:
                    s = self.streams.get(msg.rid)
                    if s is not None:
                        s.events.append(Event(t, msg))
                    self.cond.notify_all()

    def generate(self, prompt_ids: list[int], max_tokens: int, deadline_s: float = 120.0,
                 mode: str = "cloud-only", **kw) -> Stream:
        with self.lock:
            self.rid += 1
            rid = self.rid
            s = self.streams[rid] = Stream(list(prompt_ids), sent_at=time.monotonic())
            msg = protocol.GenerateRequest(rid=rid, token_ids=list(prompt_ids), mode=mode,
                                           max_tokens=max_tokens, stop_at_eos=False,
                                           deadline_s=deadline_s, **kw)
            self.outbox.append(protocol.encode(msg))
        return s

    def wait(self, cond, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(cond, timeout)

    def wait_tokens(self, stream: Stream, n: int, timeout: float = 120.0) -> bool:
        return self.wait(lambda: len(stream.tokens) >= n or stream.end is not None, timeout)

    def wait_end(self, streams: list[Stream], timeout: float = 180.0) -> bool:
        return self.wait(lambda: all(s.end is not None for s in streams), timeout)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- WAN on a thread

class Link:
    """A WanProxy on its own event-loop thread, steered from synchronous test code."""

    def __init__(self, target_endpoint: str, **proxy_kw):
        host, port = target_endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="wan")
        self.thread.start()
        self.proxy: WanProxy = self.call(self._start(host, int(port), proxy_kw))

    async def _start(self, host, port, kw) -> WanProxy:
        return await WanProxy("127.0.0.1", 0, host, port, seed=7, **kw).start()

    def call(self, coro_or_fn, *args, **kw):
        if asyncio.iscoroutine(coro_or_fn):
            return asyncio.run_coroutine_threadsafe(coro_or_fn, self.loop).result(30)

        async def run():
            return coro_or_fn(*args, **kw)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.proxy.port}"

    def shape(self, **fields) -> None:
        """Same shape both ways; clears every field not given."""
        self.call(self.proxy.set, "both", **{**LinkShape().state(), **fields})

    def drop(self) -> int:
        return self.call(self.proxy.drop)

    def partition(self, seconds: float, mode: str = "hold") -> None:
        self.call(self.proxy.partition, seconds, mode)

    def stats(self) -> dict:
        return self.call(self.proxy.stats)

    def partitioned_for(self) -> float:
        return self.call(self.proxy.partitioned_for)

    def drop_live(self, streams: list[Stream], timeout: float = 30.0) -> int:
        """A drop that hits: once a connection is open and a stream is still running, close
        every connection; returns how many were closed (at least 1, asserted).

        The check and the drop run in one step of the proxy's loop: a connection the client is
        replacing (the dispatcher re-dials a peer it gave up on) can close between a check made
        from this thread and the drop, which would then hit nothing."""
        async def drop_when_open() -> int:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while loop.time() < deadline and not all(s.end is not None for s in streams):
                if self.proxy.stats()["connections_open"] >= 1:
                    return self.proxy.drop()
                await asyncio.sleep(0.005)
            return 0
        n = asyncio.run_coroutine_threadsafe(drop_when_open(), self.loop).result(timeout + 5)
        assert not all(s.end is not None for s in streams) or n >= 1, \
            "the streams ended before the drop"
        assert n >= 1, f"no connection through the link to drop within {timeout} s"
        return n

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call(self.proxy.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
