"""One speculative session on the dispatcher (`SpecRun`): what chain rounds (chain_run.ChainRun)
and token-tree rounds (tree_run.TreeRun) share. The round machine (session.SpecRounds or
tree_session.TreeRounds) decides; this carries out its actions.

One session = one verifier channel (SpecOpen, DraftBatch, VerifyRequest -> Ack, VerifyResult),
held by a verifier_link.VerifierLink, and one drafter channel (DraftOpen,
DraftRequest/DraftRollback -> DraftTokens streamed one token, or one tree depth, at a time). Both
are read into one inbox, so the loop reacts to whichever comes first: a draft token goes through
the round machine at once, and drafting never waits for a verification unless the policy says
so.

Measurements. γ: the drafter's own compute seconds per token (DraftTokens.seconds). α, β: each
DraftBatch is acknowledged by the verifier on receipt; the send -> Ack round trip minus twice the
one-way latency (half the heartbeat RTT, tracked separately) is the batch's transmission time,
fitted by least squares against batch size. Cloud forwards per token: the verifier counts the
forward passes that included the session (prefill chunks included) and reports the running count
in every VerifyResult.

Failures. Drafter gone (or a drafter error): what was drafted is verified, then the session goes
on with zero-draft rounds (the target's next token alone); the output stays exact. Verifier gone
(heartbeats stop, `unknown_session`, or no result for stall_s while a NAV is out): the verifier
session is replayed on a live replica from the committed tokens (services/dispatcher/recovery.py)
and the drafts past them are verified again there; the output stays exact. With no replica up
(a partition), the replay waits and retries until the request's deadline: a link that heals in
time gives the same output, one that does not ends with `deadline`. If the request allows
edge-only and no replica is up at that moment, the drafter's tokens continue the stream marked
degraded instead (Done.stats: degraded, degraded_tokens); when a verifier is up again, the
session resumes verification from everything streamed so far, degraded tokens included
(stats resumed_at), and the tokens after that are the target's again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from common import metrics, protocol
from common.runtime import PeerError
from services.dispatcher import recovery
from services.dispatcher.spec.edge import SERVICE, Edge
from services.dispatcher.spec.session import Emit, Limit, Rollback, SendBatch, SendNav, SpecError
from services.dispatcher.spec.verifier_link import OPEN_SEQ, VerifierLink

log = logging.getLogger("tandem.dispatcher.spec")


class SpecRun:
    """One speculative session; ChainRun and TreeRun build its round machine (`sm`) and handle
    what differs between chain and tree rounds. Under mode "auto" it may be one stretch of a
    request that switches to and from cloud-only: it starts from the stream's current end
    (`adopt`: the (peer, sid) of the verifier session whose KV cache it takes over, protocol
    ADOPT) and stops when `req.switch_due()` says so, leaving its verifier session open for the
    next stretch (`handover`), and its drafter session too (`drafter_handover`: (sid, synced,
    epoch), its first `synced` tokens being committed ones). Given such a drafter session
    (`drafter`), it rolls it back to those tokens and appends the ones committed since: the
    drafter catches up on them alone instead of opening on the whole stream."""

    def __init__(self, req, policy, edge: Edge, tag: str = "", adopt: tuple | None = None,
                 drafter: tuple | None = None):
        self.req = req
        self.d = req.d
        self.cfg = req.d.cfg
        self.policy = policy
        self.edge = edge
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.readers: list[asyncio.Task] = []
        self.verifier = VerifierLink(req, self._reader, policy.stream, tag, adopt)
        self.dch = None
        self.forwards = 0
        self.drafter_alive = False
        self.edge_only = False
        self.verifier_ready_s = None
        self.last_commit: float | None = None   # the autotuner's clock: set at the first commit
        self.bo_tasks: set[asyncio.Task] = set()
        self.sm = None
        self.dsid = drafter[0] if drafter else req.sid + tag   # the drafter session
        self.resume_drafter = drafter
        self.drafter_handover: tuple | None = None
        self.base = len(req.tokens)        # tokens streamed before this session
        self.handover: tuple | None = None  # (peer, sid) left open for the next stretch

    # --- what chain and tree rounds do differently ---------------------------------------------
    async def _rounds(self):
        """The session's round machine, built once its verifier session is placed."""
        raise NotImplementedError

    def tree_nodes(self) -> int:
        """The most nodes the drafter drafts for one tree round (DraftOpen.tree_nodes)."""
        return 0

    def _observe_draft_time(self, msg: protocol.DraftTokens) -> None:
        """The drafter's compute time for `msg`'s tokens: one decode per token along a chain."""
        if msg.parents is None and msg.seconds > 0 and msg.token_ids:
            self.edge.speed.observe(len(msg.token_ids), msg.seconds)

    async def _on_draft(self, msg: protocol.DraftTokens, q_ids, q_probs) -> None:
        """The drafter's tokens (the stream is verified, not edge-only)."""
        raise NotImplementedError

    def _on_result(self, msg: protocol.VerifyResult) -> list:
        """The round machine's actions for a verification result."""
        raise NotImplementedError

    async def _send_nav(self, a: SendNav) -> None:
        if not self.sm.rounds or self.sm.rounds[0].id == a.round:
            self.verifier.restart_stall_clock()   # the stall clock starts at the NAV
        await self.verifier.send_nav(a)

    async def _act_other(self, a) -> None:
        """An action only one kind of round machine returns."""

    def _hand_over_drafter(self, emitted: Emit) -> None:
        """The stretch ends at `emitted`: a run whose drafter session can go on from there
        leaves it open for the next stretch (`drafter_handover`); a tree's is closed."""

    async def _drafter_alone(self) -> None:
        """Ask the drafter for the stream's continuation once the verifier is gone."""
        raise NotImplementedError

    # --- setup ---------------------------------------------------------------------------------
    def _reader(self, ch, src: str) -> asyncio.Task:
        async def pump():
            while True:
                msg, frames = await ch.queue.get()
                self.inbox.put_nowait((src, msg, frames))
        t = asyncio.get_running_loop().create_task(pump())
        self.readers.append(t)
        return t

    @property
    def tuned(self) -> bool:
        """This request uses and feeds its policy's BO autotuner (not when it fixes the
        thresholds itself)."""
        return (self.policy.bo and self.cfg.spec.bo and self.req.msg.nav_thresholds is None
                and self.req.msg.policy_knobs is None)

    def _params(self) -> tuple[float, float, float]:
        link, rtt = self.edge.link, self.verifier.peer.rtt
        if math.isfinite(rtt):
            link.observe_latency(rtt / 2)
        alpha, beta = link.params()
        gamma = self.edge.speed.gamma
        p = self.policy.name
        metrics.POLICY_PARAM.labels(SERVICE, p, "window").set(self.edge.window(p).value)
        return alpha, beta, gamma

    async def run(self) -> None:
        await self.verifier.connect()
        self.sm = await self._rounds()
        await self._loop()

    async def _loop(self) -> None:
        req, d = self.req, self.d
        committed = await self.verifier.open()
        # One token wanted: it is the target's own (the last wanted position always is), so no
        # draft could be used and the drafter's prefill would be wasted edge work. It is opened
        # anyway when the request may have to go on from the drafter alone (allow_edge_only).
        wants_drafter = req.max_tokens - self.base > 1 or req.msg.allow_edge_only
        if wants_drafter:
            # a drafter seen before and down now is not waited for: the target goes on alone
            wait = 0.0 if d.drafter.last_seen else min(self.cfg.peer_wait_s, req.remaining())
            self.drafter_alive = d.drafter.up or await d.drafter.wait_up(wait)
        if self.resume_drafter:   # its rollback's epoch must pass the session's last one
            self.sm.epoch = self.resume_drafter[2] + 1
        actions = self.sm.start()
        if self.drafter_alive and self.resume_drafter:
            self.dch = d.drafter.channel()
            self._reader(self.dch, "d")
            synced = self.resume_drafter[1]
            await self.dch.send(protocol.DraftRollback(
                sid=self.dsid, seq=self.sm.epoch, keep=synced, append=committed[synced:],
                until=self.sm.until))
        elif self.drafter_alive:
            self.dch = d.drafter.channel()
            self._reader(self.dch, "d")
            await self.dch.send(protocol.DraftOpen(
                sid=self.dsid, seq=OPEN_SEQ, token_ids=committed, sampling=req.sampling,
                top_k=self.cfg.spec.q_width, max_tokens=req.max_tokens - self.base,
                tree_nodes=self.tree_nodes(),
                features=self.policy.trigger == "pipesd-learned", **req.constraint_fields()))
        elif wants_drafter:
            log.warning("drafter at %s is down: %s goes on with the target alone",
                        d.drafter.endpoint, req.sid)
            req.stats["drafter_lost"] = True
            actions += self.sm.drafter_lost()
        self.verifier.restart_stall_clock()
        await self.act(actions)
        while not req.done and self.handover is None:
            try:
                async with asyncio.timeout(self.cfg.stall_s / 4):
                    src, msg, frames = await self.inbox.get()
            except TimeoutError:
                src = None
            try:
                if self.edge_only and self.drafter_alive and any(p.up for p in d.verifiers):
                    await self.resume_verification()
                if self._verifier_stalled():
                    raise recovery.Lost("stall", f"no verification result for "
                                                 f"{self.cfg.stall_s:.1f} s")
                if src == self.verifier.src:
                    self.verifier.restart_stall_clock()
                    await self.on_verifier(msg, frames)
                elif src == "d":   # a draft token may send a batch: the verifier may fail there
                    await self.on_drafter(msg, frames)
            except PeerError as e:
                await self.verifier.recover(e, self._verify_again)

    def _verifier_stalled(self) -> bool:
        """A NAV is out and the verifier session has been silent for stall_s."""
        sm = self.sm
        return self.verifier.stalled(not self.edge_only and bool(sm.rounds) and sm.rounds[0].closed)

    async def _verify_again(self) -> None:
        """After a replay: the drafts past the committed tokens go to the new verifier session
        (SpecRounds.verifier_lost)."""
        await self.act(self.sm.verifier_lost())

    # --- events --------------------------------------------------------------------------------
    async def on_verifier(self, msg, frames) -> None:
        if self.edge_only:
            return
        if isinstance(msg, protocol.Error):
            if msg.code == protocol.UNAVAILABLE and self.req.msg.allow_edge_only \
                    and self.drafter_alive and not any(p.up for p in self.d.verifiers):
                await self.go_edge_only()
                return
            raise PeerError(msg.code, f"verifier: {msg.message}",   # replayed if recoverable
                            retry_after_s=msg.retry_after_s)
        if isinstance(msg, protocol.Ack):
            sent_at = self.verifier.sent_at
            if msg.seq == OPEN_SEQ:
                self.verifier_ready_s = time.monotonic() - self.req.start
                self.req.stats.setdefault("cached_tokens", msg.cached_tokens)
            elif msg.seq in sent_at:
                t, size = sent_at.pop(msg.seq)
                self.edge.link.observe_round_trip(size, time.monotonic() - t)
            return
        if isinstance(msg, protocol.VerifyResult):
            self.forwards = max(self.forwards, msg.forwards)
            try:
                actions = self._on_result(msg)
            except SpecError as e:
                raise PeerError(protocol.INTERNAL, str(e)) from None
            if msg.logprobs is not None:   # the result's tokens are its Emit's, in order
                for a in actions:
                    if isinstance(a, Emit):
                        a.logprobs = msg.logprobs
                        break
            await self.act(actions)

    async def on_drafter(self, msg, frames) -> None:
        if not self.drafter_alive:
            return
        if isinstance(msg, protocol.Error):
            await self._drafter_failed(msg)
            return
        if not isinstance(msg, protocol.DraftTokens) or msg.seq != self.sm.epoch:
            return   # the open Ack, or tokens drafted before the last rollback
        self._observe_draft_time(msg)
        q_ids = q_probs = None
        if msg.q_ids is not None and msg.q_probs is not None:
            q_ids = protocol.tensor_numpy(msg.q_ids, frames)
            q_probs = protocol.tensor_numpy(msg.q_probs, frames)
        if self.edge_only:
            if msg.parents is None:      # a tree round still in flight is not the stream
                await self.emit_degraded(msg)
            return
        await self._on_draft(msg, q_ids, q_probs)

    async def _drafter_failed(self, msg: protocol.Error) -> None:
        log.warning("drafter failed for %s (%s: %s): going on with the target alone",
                    self.req.sid, msg.code, msg.message)
        self.drafter_alive = False
        self.req.stats["drafter_lost"] = True
        self.d.spawn(self.d.close_remote(self.d.drafter, self.dsid))
        if self.edge_only:
            raise PeerError(protocol.UNAVAILABLE, "verifier and drafter are both gone")
        await self.act(self.sm.drafter_lost())

    # --- actions -------------------------------------------------------------------------------
    async def act(self, actions) -> None:
        req = self.req
        for a in actions:
            if req.done:
                return
            if isinstance(a, Emit):
                await req.emit(a.tokens, logprobs=a.logprobs)
                self.verifier.rec.progress()
                self._bo(len(a.tokens))
                if not self.edge_only and req.switch_due():
                    self.handover = (self.verifier.peer, self.verifier.sid)
                    self._hand_over_drafter(a)
                    return
            elif isinstance(a, SendBatch):
                await self.verifier.send_batch(a)
            elif isinstance(a, SendNav):
                await self._send_nav(a)
            elif isinstance(a, Rollback):
                if self.drafter_alive:
                    await self.dch.send(protocol.DraftRollback(sid=self.dsid, seq=a.epoch,
                                                               keep=a.keep, append=a.append,
                                                               until=a.until, path=a.path))
            elif isinstance(a, Limit):
                if self.drafter_alive:
                    await self.dch.send(protocol.DraftRequest(sid=self.dsid, seq=self.sm.epoch,
                                                              until=a.until))
            else:
                await self._act_other(a)

    def _bo(self, tokens: int) -> None:
        """Feed the autotuner: wall time since the last commit, tokens this commit emitted.
        The first commit of a request only starts the clock: its time is mostly the prompt's
        prefill (verifier and drafter), which no threshold changes and which differs from prompt
        to prompt — counted, it was the largest noise in the tuner's windows."""
        now = time.monotonic()
        last, self.last_commit = self.last_commit, now
        if last is None or not self.tuned:
            return
        elapsed = now - last
        tuner = self.edge.tuner(self.policy.name)
        trigger = self.sm.trigger

        def record():
            with self.edge.tuner_lock:
                before = len(tuner.history)
                changed = tuner.record(elapsed, tokens)
                evaluated = len(tuner.history) != before
                return changed, evaluated, tuner.current()

        async def task():
            changed, evaluated, (r1, r2) = await asyncio.to_thread(record)
            if evaluated:
                metrics.BO_EVALUATIONS.labels(SERVICE).inc()
            if changed:
                trigger.set_thresholds(r1, r2)
            metrics.POLICY_PARAM.labels(SERVICE, self.policy.name, "r1").set(r1)
            metrics.POLICY_PARAM.labels(SERVICE, self.policy.name, "r2").set(r2)
        t = asyncio.get_running_loop().create_task(task())
        self.bo_tasks.add(t)
        t.add_done_callback(self.bo_tasks.discard)

    # --- edge-only (degraded) ------------------------------------------------------------------
    async def go_edge_only(self) -> None:
        """The cloud is gone and the request allows it: the drafter's own tokens continue the
        stream, marked degraded (no longer the target's output), until the deadline, the end of
        the request, or a verifier coming back (`resume_verification`)."""
        log.warning("verifier unreachable: %s continues on the drafter alone (degraded)",
                    self.req.sid)
        self.edge_only = True
        self.req.stats["degraded"] = True
        sm = self.sm
        self.next_degraded = sm.C
        tokens = [x.token for x in sm.drafts]
        self.next_degraded += len(tokens)
        if tokens:
            await self._emit_degraded(tokens)
        await self._drafter_alone()

    async def emit_degraded(self, msg: protocol.DraftTokens) -> None:
        skip = self.next_degraded - msg.start
        tokens = list(msg.token_ids[skip:]) if skip >= 0 else []
        if tokens:
            self.next_degraded += len(tokens)
            await self._emit_degraded(tokens)

    async def _emit_degraded(self, tokens: list[int]) -> None:
        req = self.req
        before = len(req.tokens)
        await req.emit(tokens, degraded=True)
        n = len(req.tokens) - before
        req.stats["degraded_tokens"] = req.stats.get("degraded_tokens", 0) + n
        metrics.DEGRADED_TOKENS.labels(SERVICE, req.mode).inc(n)

    async def resume_verification(self) -> None:
        """A verifier is up again while the request runs edge-only: open a fresh verifier
        session holding every token streamed so far (the degraded ones included: they reached
        the client and stay) and go on speculating from there. Tokens from here on are the
        target's again (not marked degraded); the stream never repeats or skips a token."""
        req = self.req
        peer = next(p for p in self.d.verifiers if p.up)
        committed = self.verifier.rec.committed()
        log.warning("verifier %s is back: %s resumes verification after %d degraded tokens",
                    peer.name, req.sid, req.stats.get("degraded_tokens", 0))
        self.edge_only = False
        req.stats["resumed_at"] = len(req.tokens)
        await self.verifier.resume(peer, committed)
        await self.act(self.sm.resync(len(committed), committed[-1]))

    # --- teardown -------------------------------------------------------------------------------
    async def close(self) -> None:
        for t in self.readers:
            t.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)
        self.verifier.close(keep_session=self.edge_only or self.handover is not None)
        d = self.d
        if self.dch is not None:
            self.dch.close()
            if self.drafter_alive and self.drafter_handover is None:
                d.spawn(d.close_remote(d.drafter, self.dsid))
        elif self.resume_drafter is not None and self.drafter_handover is None:
            # a drafter session handed to this stretch and never taken up (one token was left,
            # or the drafter is down): nobody else will close it
            d.spawn(d.close_remote(d.drafter, self.resume_drafter[0]))
        if self.sm is not None:
            self._stats()

    def _stats(self) -> None:
        st, sm, req = self.sm.stats, self.sm, self.req
        n = len(req.tokens) - self.base   # this session's tokens
        planner = sm.planner
        req.stats.update({
            "rounds": st.rounds,
            "draft_tokens": st.draft_tokens,
            "accepted_tokens": st.accepted,
            "acceptance_rate": st.accepted / st.draft_tokens if st.draft_tokens else None,
            "mean_draft_length": st.draft_tokens / st.rounds if st.rounds else None,
            "batches": st.batches,
            "early_rejects": st.early_rejects,
            "proactive_kept": st.proactive_kept,
            "proactive_discarded": st.proactive_discarded,
            "rollbacks": st.rollbacks,
            "nav_reasons": dict(st.nav_reasons),
            "verifier_forwards": self.forwards,
            "cloud_forwards_per_token": self.forwards / n if n else None,
            "verifier_ready_s": self.verifier_ready_s,
            "duplicate_results": st.duplicate_results,
            "unknown_results": st.unknown_results,
            "thresholds": sm.trigger.thresholds(),
            "window": sm.window.value,
            "dp_plan": list(planner.sizes),
            "alpha_s": planner.alpha, "beta_s": planner.beta, "gamma_s": planner.gamma,
        })
        if self.tuned:
            tuner = self.edge.tuner(self.policy.name)   # plain attribute reads: no lock needed
            req.stats["tuner"] = {"state": tuner.state, "evaluations": len(tuner.evaluations),
                                  "retunes": tuner.retunes}
