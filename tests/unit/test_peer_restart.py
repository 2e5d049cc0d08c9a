"""A peer that restarts faster than its silence would mark it down (a supervisor's restart): the
next heartbeat answer comes from another run (Pong.instance), and every request in flight on it
fails at once with `unknown_session`, which the dispatcher replays as a restart, instead of
waiting for the stall timer."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq.asyncio

from common import protocol as p
from common.config import ServiceConfig
from common.runtime import Peer, PeerError, Service
from stack.launcher import free_port


class Quiet(Service):
    """Takes a DraftRequest and never answers it: the request stays in flight."""
    name = "quiet"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.route(p.DraftRequest, self.hold)

    async def hold(self, ident, msg, frames):
        pass


async def serve(bind: str) -> tuple[Service, asyncio.Task]:
    svc = Quiet(ServiceConfig(bind=bind, http_port=0, heartbeat_s=0.1, peer_timeout_s=30.0))
    task = asyncio.get_running_loop().create_task(svc.serve())
    while not svc.ready:
        await asyncio.sleep(0.01)
    return svc, task


def test_a_restarted_peer_fails_the_requests_in_flight_at_once():
    async def body():
        bind = f"tcp://127.0.0.1:{free_port()}"
        first, task = await serve(bind)
        # a silence of 30 s would be needed to mark it down: only the restart can end the wait
        peer = Peer(zmq.asyncio.Context(), bind, "quiet", "test", heartbeat_s=0.1, timeout_s=30.0)
        peer.start()
        assert await peer.wait_up(5)
        before = peer.instance
        assert before == first.instance
        ch = peer.channel()
        await ch.send(p.DraftRequest(sid="s", until=4))   # in flight: never answered
        first.stop()
        await task
        second, task = await serve(bind)
        t = time.monotonic()
        with pytest.raises(PeerError) as e:
            await ch.recv(timeout=10)
        assert e.value.code == p.UNKNOWN_SESSION and "restarted" in e.value.message
        assert time.monotonic() - t < 5
        assert peer.instance == second.instance != before
        fresh = peer.channel()          # the restarted run serves new requests as usual
        assert await peer.wait_up(5)
        await fresh.send(p.Ping(t=1.0))
        msg, _ = await fresh.recv(timeout=5)
        assert isinstance(msg, p.Pong)
        peer.close()
        second.stop()
        await task
    asyncio.run(body())
