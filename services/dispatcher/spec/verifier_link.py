"""The verifier side of one speculative session (`VerifierLink`): the replica that holds it, the
session's id there, the channel to it and the tag its messages carry in the session's inbox, the
Recovery that places and replays it (services/dispatcher/recovery.py), and its stall clock.

A replay (the replica lost) and a resume (a verifier back after edge-only) both open a fresh
session, under a fresh id, on the committed tokens, through a fresh channel with a fresh inbox
tag: what the old channel still queued is ignored."""

from __future__ import annotations

import time

import numpy as np

from common import metrics, protocol
from common.runtime import PeerError
from services.dispatcher import recovery
from services.dispatcher.spec.session import SendBatch, SendNav

OPEN_SEQ = 1          # seq of SpecOpen / DraftOpen; batches and NAVs count up from 2


class VerifierLink:
    """One speculative session's verifier session. `listen(channel, tag)` reads a channel into
    the session's inbox under `tag`; `stream`: the policy verifies while drafts stream in;
    `adopt`: the (peer, sid) of a verifier session whose KV cache the first open takes over."""

    def __init__(self, req, listen, stream: bool, tag: str = "", adopt: tuple | None = None):
        self.req = req
        self.d = req.d
        self.listen = listen
        self.stream = stream
        self.adopt = adopt
        # replica, session id and inbox tag change when the session is replayed
        self.rec = recovery.Recovery(req, req.d.verifiers, "verifier", tag=tag,
                                     peer=adopt[0] if adopt else None)
        self.peer = None
        self.sid = self.rec.sid
        self.ch = None
        self.src = "v"
        self.seq = OPEN_SEQ
        self.sent_at: dict[int, tuple[float, int]] = {}   # batch seq -> (sent at, size) until its Ack
        self.last_heard = 0.0   # last sign of life of the session (or the last NAV sent)

    async def connect(self) -> None:
        """Place the session on a live replica (the adopted cache's while it is up)."""
        self.peer = await self.rec.connect()

    async def open(self) -> list[int]:
        """Open the session on the committed tokens and return them. The cache handed over is
        adopted unless its replica went down and the session was placed elsewhere."""
        self.ch = self.peer.channel()
        self.listen(self.ch, self.src)
        committed = self.rec.committed()
        adopt = self.adopt[1] if self.adopt and self.peer is self.adopt[0] else ""
        await self.ch.send(self._spec_open(committed, adopt))
        return committed

    async def recover(self, err: PeerError, replayed) -> None:
        """Replay the session until a replay sticks (each one counts against max_recoveries):
        `replayed()` sends the new session what it must verify again, and a PeerError there is
        that replay failing. What recovery.Recovery.fail raises (deadline, too many replays, an
        error no replay cures) is the request's answer: it leaves this loop, never re-enters
        fail (recovery.with_recovery's shape)."""
        while True:
            self.rec.fail(err)                     # raises what recovery cannot fix
            try:
                await self.replay()
                await replayed()
                return
            except PeerError as e:   # the replica chosen failed at once
                err = e

    async def replay(self) -> None:
        """Rebuild the session on a live replica from the committed tokens."""
        old = self.peer, self.sid
        self.peer = await self.rec.connect()
        await self._reopen(old, self.rec.committed())

    async def resume(self, peer, committed: list[int]) -> None:
        """Open a fresh session on `peer` holding `committed`, after the request went on from the
        drafter alone (every token streamed so far, the degraded ones included)."""
        d = self.d
        old = self.peer, self.sid
        self.rec.attempt += 1                      # a fresh session id on the verifier
        self.rec.reasons.append("resumed")
        metrics.RECOVERIES.labels(d.name, self.req.mode, "resumed").inc()
        self.rec.peer = self.peer = peer
        await self._reopen(old, committed)

    async def _reopen(self, old: tuple, committed: list[int]) -> None:
        """Close the old (peer, sid) and open the session again on self.peer under the
        recovery's current id."""
        d = self.d
        self.sid = self.rec.sid
        self.ch.close()
        d.spawn(d.close_remote(*old))
        self.src = f"v{self.rec.attempt}"         # what the old channel still queued is ignored
        self.ch = self.peer.channel()
        self.listen(self.ch, self.src)
        self.sent_at.clear()
        self.restart_stall_clock()
        await self.ch.send(self._spec_open(committed))

    def _spec_open(self, committed: list[int], adopt: str = "") -> protocol.SpecOpen:
        """The verifier session's open, on the committed tokens: the first, or a reopen after a
        lost verifier or a resync (what the request asks of every verification is the same)."""
        req = self.req
        return protocol.SpecOpen(sid=self.sid, seq=OPEN_SEQ, token_ids=committed,
                                 sampling=req.sampling, stream=self.stream,
                                 logprobs=req.msg.logprobs, adopt=adopt,
                                 max_tokens=max(1, req.max_tokens - len(req.tokens)),
                                 **req.constraint_fields())

    # --- liveness ------------------------------------------------------------------------------
    def restart_stall_clock(self) -> None:
        """The session just showed a sign of life, or a NAV it must answer just went out."""
        self.last_heard = time.monotonic()

    def stalled(self, waiting: bool) -> bool:
        """`waiting` for a result (a NAV is out) and the session silent for stall_s."""
        return waiting and time.monotonic() - self.last_heard > self.d.cfg.stall_s

    # --- sending -------------------------------------------------------------------------------
    async def send_batch(self, b: SendBatch) -> None:
        self.seq += 1
        msg = protocol.DraftBatch(sid=self.sid, seq=self.seq, round=b.round, start=b.start,
                                  token_ids=[x.token for x in b.drafts],
                                  probs=[x.prob for x in b.drafts], parent=b.parent,
                                  parents=b.parents, first_node=b.first_node)
        buffers = []
        if b.drafts and b.drafts[0].q_ids is not None:
            msg.q_ids, ids = protocol.tensor_frame(np.stack([x.q_ids for x in b.drafts]), 0)
            msg.q_probs, probs = protocol.tensor_frame(np.stack([x.q_probs for x in b.drafts]), 1)
            buffers = [ids, probs]
        self.sent_at[self.seq] = (time.monotonic(), len(b.drafts))
        await self.ch.send(msg, buffers)

    async def send_nav(self, a: SendNav) -> None:
        self.seq += 1
        await self.ch.send(protocol.VerifyRequest(sid=self.sid, seq=self.seq, round=a.round,
                                                  end=a.end, nodes=a.nodes))

    # --- teardown ------------------------------------------------------------------------------
    def close(self, keep_session: bool) -> None:
        """Close the channel and, unless `keep_session` (handed over to the next stretch, or
        left behind when the request went edge-only), the session on its replica; the recovery
        figures go into the request's stats."""
        if self.ch is not None:
            self.ch.close()
            if not keep_session:
                self.d.spawn(self.d.close_remote(self.peer, self.sid))
        self.rec.finish()
