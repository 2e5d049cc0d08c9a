"""Session recovery at the dispatcher: a cloud session survives its service dying, restarting or
losing messages on the WAN.

KV caches are session-local state on a replica; losing them loses nothing that matters, because
the dispatcher holds what defines a session: the prompt and every token already committed to the
client's stream. Recovery replays those tokens as the prompt of a fresh session (a new session
id) on a live replica — the prefill rebuilds the KV cache, as Petals rebuilds a failed server's
attention caches from the client's record of past inputs — and generation continues from the
stream's end. `Request.emit` numbers tokens, so nothing the client saw is sent twice and the
replay starts exactly where the stream stands: no token is lost or duplicated. Greedy output is
the same (the target's argmax over the same prefix); sampling is seeded per position, so a seeded
request is reproduced too.

What triggers a replay (`reason`, a metrics label):
    down      the replica stopped answering heartbeats (killed, partitioned): Peer fails the
              session's channel with `unavailable`
    gap       a token index jumped: a message was lost (connection dropped mid-stream); or
              (spec mode) the verifier answered `unknown_round`: a batch or NAV that opened a
              round never reached it, and a later one names that round
    stall     nothing arrived for `stall_s` while time was left (a lost final message, a
              request lost on the way up)
    restarted the replica answered `unknown_session`: it restarted and forgot the session; or
              its heartbeat answer came from another run (Pong.instance), a restart faster than
              the heartbeat's timeout (a supervisor's): Peer fails the sessions in flight at once
    resumed   (spec mode) a request that went on with the drafter alone while the cloud was
              unreachable (allow_edge_only) found a verifier up again: verification resumes
              from the tokens streamed so far, degraded ones included
Anything else (`busy`, `too_large`, `bad_field`, `internal`, ...) is the request's answer and goes
to the client. A request gives up after `max_recoveries` replays, or when its deadline passes: a
replay waits `recovery_wait_s` (30 s; 0 = until the deadline) for a replica, so a restart or a
partition that heals in time is survived with identical output, and a cloud service that is down
and not coming back fails the request `unavailable` after that bounded wait, not at its deadline.
These decisions, the backoff between replays and the temporary ban of a replica that keeps
failing are pure functions in services/dispatcher/recovery_policy.py.

Replicas: a comma-separated list (`--verifier tcp://a:5551,tcp://b:5551`, or
`dns+tcp://verifier.tandem:5551` for every A record of a headless service, re-resolved every
`discovery_s`) makes one Peer per replica ("verifier", "verifier-1", ...). A new session goes to
the replica with the least outstanding work (services/dispatcher/placement.py) and sticks to it
while it is up; when it is down or draining, the session moves to another replica that is up,
waiting (bounded by the request's deadline and `peer_wait_s` / `recovery_wait_s`) for one when
none is. A draining replica (SIGTERM) hands its unfinished sessions back with `unavailable`:
replayed like a lost one.

A mode runs each attempt through `with_recovery` (cloud_only.py is the example):

    async def attempt(rec: Recovery, peer: Peer) -> None:
        # open rec.sid on peer with rec.committed() as the prompt; read with rec.recv(channel)
        # (stall detection); call rec.gap(expected, got) on an index jump and rec.progress()
        # after each emit; close the remote session in a finally if the request is not done
    await with_recovery(req, d.verifiers, "verifier", attempt)
"""

from __future__ import annotations

import asyncio
import random
import time

from common import metrics, protocol
from common.runtime import Peer, PeerError
from services.dispatcher import placement
from services.dispatcher.recovery_policy import (GiveUp, PassThrough, RecoveryPolicy,
                                                 ReplicaHealth, decide)


class Lost(PeerError):
    """Messages of a session went missing (`gap`) or stopped coming (`stall`)."""

    def __init__(self, reason: str, message: str):
        super().__init__(protocol.UNAVAILABLE, message)
        self.reason = reason


class Replicas(list):
    """The Peers of one role's replicas. A new session goes to the replica with the least
    outstanding work (services/dispatcher/placement.py, from the load each replica reports in
    its heartbeat replies); a session then stays on its replica while that is up. A list that
    names DNS targets is re-resolved (`refresh`): new replicas are added, vanished ones retired
    (no new sessions; sessions on them go on while they answer)."""

    def __init__(self, peers: list[Peer], service=None, role: str = "", spec: str = "",
                 health: ReplicaHealth | None = None):
        super().__init__(peers)
        self.turn = 0
        self.service, self.role, self.spec = service, role, spec
        self.health = health or ReplicaHealth(RecoveryPolicy())   # bans (recovery_policy.py)
        self.retired: set[str] = set()       # endpoints gone from discovery
        self.placed: dict[str, int] = {}     # peer name -> sessions this dispatcher holds on it
        self.at_report: dict[str, tuple[object, int]] = {}   # name -> (report seen, placed then)
        self.suspect: dict[str, object] = {}  # name -> report current when it refused a session
        self.affinity = placement.Affinity()  # which replica holds which conversation prefix

    def estimates(self) -> list[placement.Estimate]:
        out = []
        allowed = set(self.health.eligible([p.name for p in self if p.up], time.monotonic()))
        for p in self:
            pong = p.load
            placed = self.placed.get(p.name, 0)
            seen, then = self.at_report.get(p.name, (None, placed))
            if seen is not pong:      # a new report: it counts what we had placed by now
                seen, then = pong, placed
                self.at_report[p.name] = (seen, then)
            report = placement.Report() if pong is None else placement.Report(
                pong.sessions, pong.queued_tokens, pong.kv_bytes, pong.admitting)
            suspect = p.name in self.suspect and self.suspect[p.name] is pong
            if p.name in self.suspect and not suspect:
                del self.suspect[p.name]      # it has reported since: believe the report
            up = p.up and p.endpoint not in self.retired and p.name in allowed
            out.append(placement.Estimate(p.name, up, report, placed, then, suspect))
        return out

    def next_up(self, tokens: list[int] | None = None) -> Peer | None:
        """The replica a new session on `tokens` goes to, or None when none is up and
        admitting."""
        if not self:
            return None
        prefer = self.affinity.lookup(tokens)[0] if tokens and len(self) > 1 else None
        i = placement.choose(self.estimates(), self.turn % len(self), prefer)
        if i is None:
            return None
        self.turn = i + 1
        return self[i]

    def acquire(self, peer: Peer) -> None:
        self.placed[peer.name] = self.placed.get(peer.name, 0) + 1
        if self.service is not None:
            metrics.PLACEMENTS.labels(self.service.name, peer.name).inc()

    def release(self, peer: Peer) -> None:
        # a report that came while the session ran counts it: note it before the session goes,
        # or the replica would look a session busier until its next report
        self.estimates()
        self.placed[peer.name] = max(0, self.placed.get(peer.name, 0) - 1)

    def refused(self, peer: Peer) -> None:
        """`peer` answered `unavailable` while its heartbeats still say up (it is draining, or
        restarting): no new session goes there until its next report."""
        self.suspect[peer.name] = peer.load

    def refresh(self, lookup=placement.dns_lookup) -> tuple[list[str], list[str]]:
        """Re-resolve the replica list: add a Peer per new endpoint, retire vanished ones."""
        current = [p.endpoint for p in self]
        resolved = placement.resolve(self.spec, lookup)
        added, gone = placement.diff(current, resolved)
        self.retired = set(gone)
        for ep in added:
            name = self.role if not self else f"{self.role}-{len(self)}"
            peer = self.service.peer(name, ep)
            if self.service.ready:        # serve() started the others; this one starts now
                peer.start()
            self.append(peer)
        if added or gone:
            self.service.log.info("%s replicas: +%s -%s (%d known)", self.role, added or "[]",
                                  gone or "[]", len(self))
        return added, gone


def replicas(service, role: str, endpoints: str, lookup=placement.dns_lookup) -> Replicas:
    """One Peer per endpoint of a comma-separated list (DNS targets resolved: every A record of
    a headless service), named role, role-1, role-2, ..."""
    try:
        placement.targets(endpoints)
    except ValueError as e:
        raise ValueError(f"{role}: {e}") from None
    eps = placement.resolve(endpoints, lookup)
    if not eps and not placement.is_dynamic(endpoints):
        raise ValueError(f"{role}: no endpoint configured")
    return Replicas([service.peer(role if i == 0 else f"{role}-{i}", ep)
                     for i, ep in enumerate(eps)], service, role, endpoints,
                    ReplicaHealth(recovery_policy(service.cfg)))


def recovery_policy(cfg) -> RecoveryPolicy:
    return RecoveryPolicy(max_recoveries=cfg.max_recoveries, backoff_s=cfg.recovery_backoff_s,
                          backoff_max_s=cfg.recovery_backoff_max_s,
                          ban_failures=cfg.replica_ban_failures,
                          ban_window_s=cfg.replica_ban_window_s, ban_s=cfg.replica_ban_s)


async def first_up(peers: list[Peer], timeout: float,
                   tokens: list[int] | None = None) -> Peer | None:
    """The replica to place a session on `tokens` on (least outstanding work), else the first
    to come up within `timeout`."""
    place = (lambda: peers.next_up(tokens)) if isinstance(peers, Replicas) else (
        lambda: next((p for p in peers if p.up), None))
    up = place()
    if up is not None or timeout <= 0:
        return up
    end = time.monotonic() + timeout
    for p in peers:
        p.start()
    while time.monotonic() < end:
        # polled: the set of replicas may grow (discovery) and their reports change while we wait
        await asyncio.sleep(min(0.05, max(0.0, end - time.monotonic())))
        up = place()
        if up is not None:
            return up
    return None


class Recovery:
    """One request's path through failures of one cloud role (verifier or suffix)."""

    def __init__(self, req, peers: list[Peer], role: str, needs: tuple[Peer, ...] = (),
                 tag: str = "", peer: Peer | None = None):
        """`tag`: appended to the session id (each stretch of a request that switches modes has
        its own session); `peer`: the replica to start on (where the session it adopts is)."""
        self.req = req
        self.peers = peers
        self.role = role
        self.needs = needs              # edge peers the session also needs (split: the prefix)
        self.tag = tag
        self.peer: Peer | None = peer   # the replica the session is on
        if peer is not None and isinstance(peers, Replicas):
            peers.acquire(peer)
        self.attempt = 0                # replays so far
        self.failed_at = 0.0            # when the failure being recovered from was detected
        self.delay = 0.0                # backoff before the next replay connects
        self.times: list[float] = []    # failure detected -> first token after the replay
        self.reasons: list[str] = []

    @property
    def sid(self) -> str:
        """The session id on the cloud side: fresh per replay, so a replica that still holds the
        old session (a partition that healed) never mistakes the replay for a retry of it."""
        sid = self.req.sid + self.tag
        return sid if self.attempt == 0 else f"{sid}~r{self.attempt}"

    def committed(self) -> list[int]:
        """What a replay prefills: the prompt and every token already streamed."""
        return list(self.req.prompt_ids) + list(self.req.tokens)

    async def connect(self) -> Peer:
        """A live replica (and every peer in `needs` up). A new session waits `peer_wait_s` for
        one, then fails `unavailable`; a session that lost its replica (a replay) waits and
        retries until its deadline (`recovery_wait_s` caps that when set), so a partition that
        heals in time costs only the wait, and one that does not ends in `deadline`."""
        d = self.req.d
        if self.delay:
            await asyncio.sleep(min(self.delay, self.req.remaining()))
            self.delay = 0.0
        for p in self.needs:
            await d.need(p, self.req)
        health = getattr(self.peers, "health", None)
        if self.peer is not None and self.peer.up and \
                (health is None or not health.banned(self.peer.name, time.monotonic())):
            return self.peer
        self._leave()
        left = self.req.remaining()
        limit = d.cfg.peer_wait_s if self.attempt == 0 else (d.cfg.recovery_wait_s or left)
        wait = min(limit, left)
        peer = await first_up(self.peers, wait, self.committed())
        if peer is None:
            names = ", ".join(p.endpoint for p in self.peers)
            if wait >= left:
                raise PeerError(protocol.DEADLINE, f"deadline passed after {len(self.req.tokens)} "
                                                   f"tokens, waiting {wait:.1f} s for a {self.role} "
                                                   f"({names}) to come back")
            raise PeerError(protocol.UNAVAILABLE, f"no {self.role} reachable ({names}) "
                                                  f"within {wait:.1f} s")
        self.peer = peer
        if isinstance(self.peers, Replicas):
            self.peers.acquire(peer)
        return peer

    def _leave(self) -> None:
        """The session no longer counts on its replica (placement's tally)."""
        if self.peer is not None and isinstance(self.peers, Replicas):
            self.peers.release(self.peer)
        self.peer = None

    async def recv(self, channel) -> tuple:
        """The session's next message; a silence of `stall_s` with time left is a stall."""
        stall = self.req.d.cfg.stall_s
        left = self.req.remaining()
        try:
            return await channel.recv(timeout=max(0.001, min(stall, left)))
        except PeerError as e:
            # a stall only if the stall timer, not the deadline, ended the wait: asyncio may
            # fire a timer a hair early, so "time is still left" would turn a request's own
            # deadline into a stall (and its `deadline` error into `unavailable`)
            if e.code == protocol.DEADLINE and stall < left:
                raise Lost("stall", f"nothing from {self.role} for {stall:.1f} s") from None
            raise

    def gap(self, expected: int, got: int) -> None:
        raise Lost("gap", f"{self.role} sent token {got}, expected {expected}: "
                          f"{got - expected} lost in transit")

    def fail(self, err: PeerError) -> None:
        """Record a failure and allow a replay, or raise the request's error (recovery_policy)."""
        req = self.req
        health = getattr(self.peers, "health", None)
        policy = health.policy if health is not None else recovery_policy(req.d.cfg)
        decision = decide(policy, code=err.code, message=err.message,
                          reason=err.reason if isinstance(err, Lost) else None,
                          replays=self.attempt, time_left=req.remaining(),
                          finished=req.done or req.cancelled.is_set(), tokens=len(req.tokens),
                          rand=random.random())
        if isinstance(decision, PassThrough):
            raise err
        if isinstance(decision, GiveUp):
            raise PeerError(decision.code, decision.message, retry_after_s=err.retry_after_s
                            if decision.code == err.code else 0.0)
        now = time.monotonic()
        # a replica that hands sessions back while draining (its last report: not admitting) is
        # shutting down on purpose, not failing: it is not counted toward a ban
        draining = self.peer is not None and self.peer.load is not None \
            and not self.peer.load.admitting
        if self.peer is not None and health is not None and not draining \
                and health.failed(self.peer.name, now):
            req.d.log.warning("%s %s failed %d sessions within %.0f s: no new sessions for %.0f s",
                              self.role, self.peer.name, policy.ban_failures,
                              policy.ban_window_s, policy.ban_s)
        req.d.log.warning("%s: %s on %s (%s); replaying %d committed tokens", req.sid,
                          decision.reason, self.peer.name if self.peer else self.role,
                          err.message, len(self.committed()))
        metrics.RECOVERIES.labels(req.d.name, req.mode, decision.reason).inc()
        if decision.reason == "down" and self.peer is not None and self.peer.up:
            # refused or handed back while its heartbeats say up: it is draining (or just
            # restarted); the replay goes elsewhere, and so do new sessions until it reports
            if isinstance(self.peers, Replicas):
                self.peers.refused(self.peer)
            self._leave()
        self.attempt += 1
        self.reasons.append(decision.reason)
        self.delay = decision.delay_s
        if not self.failed_at:
            self.failed_at = now

    def progress(self) -> None:
        """Call after tokens reach the client: closes the recovery in progress, if any."""
        if self.failed_at:
            dt = time.monotonic() - self.failed_at
            self.failed_at = 0.0
            self.times.append(dt)
            metrics.RECOVERY_TIME.labels(self.req.d.name, self.req.mode).observe(dt)

    def finish(self) -> None:
        """Put the request's recovery figures into its stats (Done.stats)."""
        if self.attempt:
            self.req.stats.update({"recoveries": self.attempt, "recovery_reasons": self.reasons,
                                   "recovery_s": [round(t, 4) for t in self.times]})
        if self.peer is not None and len(self.peers) > 1:
            self.req.stats[f"{self.role}_replica"] = self.peer.name
        if self.peer is not None and isinstance(self.peers, Replicas):
            self.peers.release(self.peer)
            # its prefix cache keeps what the session committed: the next turn goes there
            self.peers.affinity.remember(self.committed(), self.peer.name)


async def with_recovery(req, peers: list[Peer], role: str, attempt,
                        needs: tuple[Peer, ...] = (), tag: str = "",
                        peer: Peer | None = None) -> None:
    """Run `await attempt(rec, peer)` on a live replica until it completes, replaying after
    each recoverable failure; the request's stats get the recovery figures. `needs`: other
    peers that must be up for an attempt (waited for, bounded, like the replicas); `tag`,
    `peer`: as Recovery's."""
    rec = Recovery(req, peers, role, needs, tag, peer)
    try:
        while True:
            peer = await rec.connect()
            try:
                await attempt(rec, peer)
                return
            except PeerError as e:
                rec.fail(e)
    finally:
        rec.finish()
