"""A service draining on SIGTERM (common/runtime.py), in process: not ready, Pong says
`admitting=False` with its load, a new session is refused `unavailable` while an open one goes
on, sessions left at `drain_s` are handed back (`unavailable` on their channel), then it stops;
GET /drain does the same from loopback and answers once drained."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import zmq.asyncio

from common import protocol as p
from common.config import ServiceConfig
from stack.launcher import free_port
from common.runtime import Peer, PeerError, Service


class Holder(Service):
    """Opens a session per SuffixOpen-like message (DraftOpen here), closes it on Close."""
    name = "holder"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.sessions: dict[str, int] = {}
        self.route(p.DraftOpen, self.on_open)
        self.route(p.DraftRequest, self.on_request)
        self.route(p.Close, self.on_close)

    async def on_open(self, ident, msg, frames):
        self.sessions[msg.sid] = len(msg.token_ids)
        await self.send(ident, p.Ack(sid=msg.sid, seq=msg.seq, rid=msg.rid))

    async def on_request(self, ident, msg, frames):
        await self.send(ident, p.DraftTokens(sid=msg.sid, rid=msg.rid, start=0, token_ids=[1],
                                             probs=[1.0]))

    def open_sessions(self):
        return list(self.sessions)

    def load(self):
        return len(self.sessions), 7, 1000 * len(self.sessions)

    async def drop_session(self, sid):
        self.sessions.pop(sid, None)


def cfg(drain_s: float) -> ServiceConfig:
    return ServiceConfig(bind=f"tcp://127.0.0.1:{free_port()}", http_port=0, heartbeat_s=0.1,
                         peer_timeout_s=1.0, drain_s=drain_s)


async def start(drain_s: float):
    svc = Holder(cfg(drain_s))
    task = asyncio.get_running_loop().create_task(svc.serve())
    while not svc.ready:
        await asyncio.sleep(0.01)
    # its own context: the service terminates its own when it stops
    peer = Peer(zmq.asyncio.Context(), svc.bound_endpoint, "holder", "test", heartbeat_s=0.1,
                timeout_s=1.0)
    peer.start()
    assert await peer.wait_up(5)
    return svc, task, peer


def test_drain_refuses_new_sessions_and_hands_back_the_rest():
    async def body():
        svc, task, peer = await start(drain_s=0.6)
        a, b = peer.channel(), peer.channel()
        await a.send(p.DraftOpen(sid="a", seq=0, token_ids=[1, 2]))
        await b.send(p.DraftOpen(sid="b", seq=0, token_ids=[3]))
        await a.recv(2)
        await b.recv(2)
        await asyncio.sleep(0.3)
        assert (peer.load.sessions, peer.load.queued_tokens, peer.load.kv_bytes) == (2, 7, 2000)
        assert peer.load.admitting
        svc.terminate()                               # what SIGTERM does
        await asyncio.sleep(0.3)
        assert svc.not_ready_reason() == "draining"
        assert not peer.up and peer.load.admitting is False and not peer.load.ready
        c = peer.channel()
        await c.send(p.DraftOpen(sid="c", seq=0, token_ids=[1]))
        try:
            await c.recv(2)
            raise AssertionError("a draining service admitted a session")
        except PeerError as e:
            assert e.code == p.UNAVAILABLE and "draining" in e.message
        # an open session still works, and one that closes in time is not handed back
        await a.send(p.DraftRequest(sid="a", n=1))
        assert isinstance((await a.recv(2))[0], p.DraftTokens)
        await a.send(p.Close(sid="a"))
        await a.recv(2)
        t0 = time.monotonic()
        try:
            await b.recv(3)
            raise AssertionError("b was not handed back")
        except PeerError as e:
            assert e.code == p.UNAVAILABLE and "handed back" in e.message
        assert 0.0 < time.monotonic() - t0 < 1.0
        await asyncio.wait_for(task, 5)               # and then it stops by itself
        assert svc.sessions == {} and svc.drained.is_set()
        peer.close()
    asyncio.run(body())


def test_get_drain_answers_once_drained():
    async def body():
        svc, task, peer = await start(drain_s=5.0)
        ch = peer.channel()
        await ch.send(p.DraftOpen(sid="s", seq=0, token_ids=[1]))
        await ch.recv(2)
        url = f"http://127.0.0.1:{svc.http_port}/drain"

        def get():
            t = time.monotonic()
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status, r.read().decode().strip(), time.monotonic() - t
        pending = asyncio.ensure_future(asyncio.to_thread(get))
        await asyncio.sleep(0.4)
        assert svc.draining and not pending.done()    # held while the session is open
        await ch.send(p.Close(sid="s"))
        status, text, took = await pending
        assert (status, text) == (200, "drained") and 0.3 < took < 3.0
        await asyncio.wait_for(task, 5)
        peer.close()
    asyncio.run(body())
