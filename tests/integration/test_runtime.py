"""The service runtime on loopback: garbage in gets an Error out and the service stays up;
peers match replies, time out cleanly and see a dead service go down; config precedence."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from common import protocol as p
from common.config import ServiceConfig, load
from stack.launcher import free_port
from common.runtime import Peer, PeerError, Service
from tests.conftest import readyz


class Echo(Service):
    name = "echo"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.route(p.DraftRequest, self.on_draft)

    async def on_draft(self, ident, msg, frames):
        if msg.n == 13:
            raise RuntimeError("unlucky")          # a bug in a handler
        if msg.n > 100:
            raise p.ProtocolError(p.BAD_FIELD, "n too large")
        await self.send(ident, p.DraftTokens(sid=msg.sid, rid=msg.rid, start=0,
                                             token_ids=list(range(msg.n)), probs=[1.0] * msg.n))


def cfg(**kw):
    c = ServiceConfig(bind=f"tcp://127.0.0.1:{free_port()}", http_port=0, heartbeat_s=0.2,
                      peer_timeout_s=0.8, max_tokens=1000, **kw)
    return c


async def _with_service(fn):
    svc = Echo(cfg())
    task = asyncio.get_running_loop().create_task(svc.serve())
    while not svc.ready:
        await asyncio.sleep(0.01)
    try:
        await fn(svc)
    finally:
        svc.stop()
        await asyncio.wait_for(task, 5)


def run(fn):
    asyncio.run(_with_service(fn))


def test_garbage_gets_errors_and_service_survives():
    async def body(svc):
        ctx = zmq.asyncio.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(svc.bound_endpoint)
        cases = [
            [b"\x00\xff garbage"],
            [msgpack.packb({"v": 1, "type": "what", "rid": 5})],
            [msgpack.packb({"v": 99, "type": "ping", "rid": 6})],
            [msgpack.packb({"v": 1, "type": "draft", "n": "x", "rid": 7})],
            [msgpack.packb({"v": 1, "type": "draft", "n": 13, "rid": 8})],
            [msgpack.packb({"v": 1, "type": "draft", "n": 101, "rid": 9})],
            [msgpack.packb({"v": 1, "type": "verify", "round": 1, "end": 2, "rid": 10})],
            [msgpack.packb({"v": 1, "type": "hidden", "cut": 1, "start": 0, "rid": 11,
                            "hidden": {"dtype": "float16", "shape": [4], "frame": 0}}), b"12"],
        ]
        want = [p.BAD_FRAME, p.UNKNOWN_TYPE, p.BAD_VERSION, p.BAD_FIELD, p.INTERNAL, p.BAD_FIELD,
                p.WRONG_SERVICE, p.BAD_TENSOR]
        for frames, code in zip(cases, want):
            await s.send_multipart(frames)
            reply = p.decode(await asyncio.wait_for(s.recv_multipart(), 5), p.Limits())
            assert isinstance(reply, p.Error) and reply.code == code, (frames, reply)
        # still serving, and rids let the client match the error to its request
        await s.send_multipart(p.encode(p.DraftRequest(sid="a", rid=42, n=3)))
        reply = p.decode(await asyncio.wait_for(s.recv_multipart(), 5), p.Limits())
        assert isinstance(reply, p.DraftTokens) and reply.rid == 42 and reply.token_ids == [0, 1, 2]
        # health endpoints
        for path, status in (("/healthz", 200), ("/readyz", 200)):
            url = f"http://127.0.0.1:{svc.http_port}{path}"
            r = await asyncio.to_thread(urllib.request.urlopen, url, None, 5)
            assert r.status == status
        body = (await asyncio.to_thread(urllib.request.urlopen,
                                        f"http://127.0.0.1:{svc.http_port}/metrics", None, 5)).read()
        assert b'tandem_errors_total{code="bad_frame",service="echo"}' in body
        s.close()
    run(body)


def test_peer_request_reply_timeout_and_down_detection():
    async def body(svc):
        peer = svc.peer("echo-self", svc.bound_endpoint)
        peer.timeout_s = 0.8
        assert await peer.wait_up(5)
        reply, _ = await peer.request(p.DraftRequest(sid="x", n=2), timeout=5)
        assert reply.token_ids == [0, 1]
        with pytest.raises(PeerError) as e:
            await peer.request(p.DraftRequest(sid="x", n=500), timeout=5)
        assert e.value.code == p.BAD_FIELD
        # many concurrent requests, each gets its own answer
        replies = await asyncio.gather(*[peer.request(p.DraftRequest(sid="x", n=k), timeout=5)
                                         for k in range(1, 13)])
        assert [len(r.token_ids) for r, _ in replies] == list(range(1, 13))
        # a peer that never answers: a clean timeout, then DOWN
        dead = svc.peer("nobody", f"tcp://127.0.0.1:{free_port()}")
        dead.start()
        with pytest.raises(PeerError) as e:
            await dead.request(p.DraftRequest(sid="x", n=1), timeout=0.3)
        assert e.value.code == p.DEADLINE
        assert not await dead.wait_up(0.5)
        dead.close()
        peer.close()
    run(body)


def test_config_precedence(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text("log_level: debug\nthreads: 3\nverifier:\n  heartbeat_s: 9.5\n")
    env = {"TANDEM_THREADS": "4", "TANDEM_VERIFIER_MAX_SESSIONS": "7"}
    c = load(ServiceConfig, "verifier", ["--config", str(yml), "--threads", "5"], env=env)
    assert c.log_level == "debug" and c.heartbeat_s == 9.5
    assert c.threads == 5 and c.max_sessions == 7
    assert c.bind == "tcp://127.0.0.1:5551" and c.http_port == 9551
    c = load(ServiceConfig, "verifier", ["--config", str(yml)], env=env)
    assert c.threads == 4
    yml.write_text("no_such_setting: 1\n")
    with pytest.raises(SystemExit):
        load(ServiceConfig, "verifier", ["--config", str(yml)], env={})
    with pytest.raises(SystemExit):
        load(ServiceConfig, "verifier", ["--threads", "many"], env={})


def test_dispatcher_settings_out_of_range_are_refused_at_start():
    from services.dispatcher.config import DispatcherConfig
    assert load(DispatcherConfig, "dispatcher", [], env={}).spec.bo_window_tokens == 96
    for argv in (["--spec-bo-window-tokens", "0"], ["--spec-q-width", "65"],
                 ["--spec-r2", "1.5"], ["--spec-proactive-depth", "0"]):
        with pytest.raises(SystemExit, match="bad dispatcher setting"):
            load(DispatcherConfig, "dispatcher", argv, env={})


class Holder(Service):
    """Holds a "session" per DraftOpen, like the model services do, for the orphan reaper."""
    name = "holder"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.sessions: set[str] = set()
        self.dropped: list[str] = []
        self.route(p.DraftOpen, self.on_open)

    async def on_open(self, ident, msg, frames):
        self.sessions.add(msg.sid)
        await self.send(ident, p.Ack(sid=msg.sid, rid=msg.rid))

    def open_sessions(self):
        return list(self.sessions)

    async def drop_session(self, sid):
        self.sessions.discard(sid)
        self.dropped.append(sid)


def test_sessions_of_a_silent_client_are_dropped():
    """A client that stops talking (no heartbeat either: killed) loses its sessions after
    peer_idle_timeout_s; a client that keeps heartbeating (a Peer) keeps its own."""
    async def main():
        svc = Holder(cfg(peer_idle_timeout_s=0.6))
        task = asyncio.get_running_loop().create_task(svc.serve())
        while not svc.ready:
            await asyncio.sleep(0.01)
        ctx = zmq.asyncio.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(svc.bound_endpoint)
        from common.runtime import Peer
        live = Peer(ctx, svc.bound_endpoint, name="holder", owner="test", heartbeat_s=0.1,
                    timeout_s=2.0)
        try:
            await raw.send_multipart(p.encode(p.DraftOpen(sid="gone", token_ids=[1], rid=1)))
            await asyncio.wait_for(raw.recv_multipart(), 5)
            await live.request(p.DraftOpen(sid="kept", token_ids=[1]))
            assert svc.sessions == {"gone", "kept"}
            opened = time.monotonic()
            while not svc.dropped and time.monotonic() - opened < 10:   # the silent one goes
                await asyncio.sleep(0.01)
            assert time.monotonic() - opened >= 0.6 - 0.05, "dropped before the idle timeout"
            assert svc.dropped == ["gone"] and svc.sessions == {"kept"}
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{svc.http_port}/metrics", timeout=5).read().decode())
            assert 'tandem_orphaned_sessions_dropped_total{service="holder"} 1.0' in text
        finally:
            live.close()
            raw.close(0)
            svc.stop()
            await asyncio.wait_for(task, 5)
    asyncio.run(main())


class SlowStart(Echo):
    """setup() waits for the test: the window in which a restarted model service is still
    loading, while messages queued for it by a client arrive."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.release = asyncio.Event()

    async def setup(self):
        await self.release.wait()


def test_messages_before_ready_get_unavailable_not_a_handler():
    async def main():
        svc = SlowStart(cfg())
        task = asyncio.get_running_loop().create_task(svc.serve())
        ctx = zmq.asyncio.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        while not svc.bound_endpoint:
            await asyncio.sleep(0.01)
        raw.connect(svc.bound_endpoint)
        try:
            await raw.send_multipart(p.encode(p.DraftRequest(sid="s", rid=1, n=2)))
            err = p.decode(await asyncio.wait_for(raw.recv_multipart(), 5), p.Limits())
            assert isinstance(err, p.Error) and err.code == p.UNAVAILABLE, err
            assert "starting" in err.message and not svc.ready
            await raw.send_multipart(p.encode(p.Ping(rid=2, t=0.0)))
            pong = p.decode(await asyncio.wait_for(raw.recv_multipart(), 5), p.Limits())
            assert isinstance(pong, p.Pong) and pong.ready is False
            svc.release.set()
            while not svc.ready:
                await asyncio.sleep(0.01)
            await raw.send_multipart(p.encode(p.DraftRequest(sid="s", rid=3, n=2)))
            ok = p.decode(await asyncio.wait_for(raw.recv_multipart(), 5), p.Limits())
            assert isinstance(ok, p.DraftTokens) and ok.token_ids == [0, 1]
        finally:
            raw.close(0)
            svc.stop()
            await asyncio.wait_for(task, 5)
    asyncio.run(main())


# --- liveness: /readyz follows the service's loops, not just its HTTP server -----------------

class Looping(Service):
    """A service with one loop it needs; `mode` says how the loop misbehaves once told to."""
    name = "looping"

    def __init__(self, cfg, mode: str):
        super().__init__(cfg)
        self.mode = mode
        self.go = asyncio.Event()

    async def setup(self):
        self.spawn_loop("engine", self.loop())

    async def loop(self):
        while not self.go.is_set():
            await self.idle("engine", self.go)
        if self.mode == "raise":
            raise RuntimeError("loop bug")
        await asyncio.sleep(3600)          # "stall": stuck without beating


def _readyz(svc) -> tuple[int, str]:
    return readyz(svc.http_port)


def test_a_loop_that_dies_makes_the_service_unready_and_stop():
    async def main():
        svc = Looping(cfg(), "raise")
        task = asyncio.get_running_loop().create_task(svc.serve())
        while not svc.ready:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.5)                       # idle for longer than one beat
        assert svc.not_ready_reason() == ""
        svc.go.set()
        await asyncio.wait_for(task, 5)                # the service stops by itself
        assert "engine loop ended (RuntimeError)" in svc.failure
        assert svc.not_ready_reason().startswith("failed:")
    asyncio.run(main())


def test_a_stalled_loop_fails_readiness_and_pong(monkeypatch):
    from common import runtime
    monkeypatch.setattr(runtime, "LOOP_STALL_S", 0.5)

    async def main():
        svc = Looping(cfg(), "stall")
        task = asyncio.get_running_loop().create_task(svc.serve())
        while not svc.ready:
            await asyncio.sleep(0.01)
        try:
            assert await asyncio.to_thread(_readyz, svc) == (200, "ready")
            svc.go.set()
            stalled_at = time.monotonic()
            while (status_body := await asyncio.to_thread(_readyz, svc))[0] == 200 \
                    and time.monotonic() - stalled_at < 10:
                await asyncio.sleep(0.05)
            status, body = status_body
            assert status == 503 and "engine loop stalled" in body, (status, body)
            peer = Peer(zmq.asyncio.Context.instance(), svc.bound_endpoint, "looping", "t")
            reply, _ = await peer.request(p.Ping(t=1.0), timeout=5)
            peer.close()
            assert isinstance(reply, p.Pong) and reply.ready is False
        finally:
            svc.stop()
            await asyncio.wait_for(task, 5)
    asyncio.run(main())


def test_a_service_whose_loop_died_exits_non_zero(tmp_path):
    """A supervisor (tandem up, compose `restart:`, Kubernetes) restarts what exits non-zero."""
    import subprocess
    import sys
    script = tmp_path / "svc.py"
    script.write_text(f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from tests.integration.test_runtime import Looping, cfg

class Dies(Looping):
    async def setup(self):
        await super().setup()
        self.go.set()
Dies(cfg(), "raise").run()
""")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "engine loop ended" in r.stderr


@pytest.mark.parametrize("argv, env", [(["--heartbeat-s", "nan"], {}),
                                       ([], {"TANDEM_HEARTBEAT_S": "inf"}),
                                       (["--heartbeat-s=-inf"], {})])
def test_non_finite_settings_are_refused_naming_them(argv, env):
    """A NaN passes every range check after it (nan < 0 is false): refused where it enters."""
    with pytest.raises(SystemExit, match="heartbeat-s: expected a finite number"):
        load(ServiceConfig, "verifier", argv, env=env)
