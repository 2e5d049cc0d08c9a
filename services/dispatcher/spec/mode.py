"""Speculative mode (PipeSD, DESIGN.md §3): the per-session loop on the dispatcher.

Wiring only; the decisions live in pure modules:
    session.SpecRounds         rounds, proactive rounds, what to send / emit / roll back
    nav_trigger                when to verify (dual threshold, HSL, EdgeLLM, fixed, oracle-trigger)
    dp_batching.BatchPlanner   how to batch the tokens of a round (Algorithm 1)
    link_model                 α, β (least squares over batch acks) and γ (drafter timings)
    bo_tuner.BOTuner           (R1, R2) tuned on live traffic

One session = one verifier channel (SpecOpen, DraftBatch, VerifyRequest -> Ack, VerifyResult) and
one drafter channel (DraftOpen, DraftRequest/DraftRollback -> DraftTokens streamed one token at a
time). Both are read into one inbox, so the loop reacts to whichever comes first: a draft token
goes through the NAV trigger and the batch plan at once, and drafting never waits for a
verification unless the policy says so.

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
import threading
import time

import msgspec
import numpy as np

from common import metrics, protocol, sampling
from common.protocol import ProtocolError
from common.runtime import PeerError
from services.dispatcher import recovery
from services.dispatcher.spec.bo_tuner import BOConfig, BOTuner
from services.dispatcher.spec.dp_batching import BatchPlanner
from services.dispatcher.spec.learned_trigger import AcceptanceModel, LearnedTrigger
from services.dispatcher.spec.link_model import DraftSpeed, DraftSpeedConfig, LinkModel, LinkModelConfig
from services.dispatcher.spec.nav_trigger import DraftWindow, NavConfig, make_trigger
from services.dispatcher.spec.session import (POLICIES, Draft, Emit, Hooks, Limit, Rollback,
                                              SendBatch, SendNav, SpecError, SpecRounds)
from services.dispatcher.spec.tree_policy import TreePolicy, TreePolicyConfig
from services.dispatcher.spec.tree_session import AskTree, TreeRounds

log = logging.getLogger("tandem.dispatcher.spec")
SERVICE = "dispatcher"
OPEN_SEQ = 1          # seq of SpecOpen / DraftOpen; batches and NAVs count up from 2


class Edge:
    """What every speculative session of this dispatcher shares: one link and one drafter
    (α, β, γ), and per policy the scheduling window N̂ and the BO tuner."""

    def __init__(self, cfg):
        self.link = LinkModel(LinkModelConfig(alpha_seed=cfg.spec.alpha_s, beta_seed=cfg.spec.beta_s))
        self.speed = DraftSpeed(DraftSpeedConfig(gamma_seed=cfg.spec.gamma_s))
        self.windows: dict[str, DraftWindow] = {}
        self.tuners: dict[str, BOTuner] = {}
        self.trees: dict[str, TreePolicy] = {}
        self.models: dict[str, AcceptanceModel] = {}
        self.tuner_lock = threading.Lock()   # record() runs on a worker thread (GP fits)
        self.cfg = cfg

    def window(self, policy: str) -> DraftWindow:
        return self.windows.setdefault(policy, DraftWindow())

    def tree(self, policy: str) -> TreePolicy:
        """The tree policy's measurements (acceptance per depth and rank, verify-cost and
        drafter-cost curves, TPT), shared by its sessions."""
        if policy not in self.trees:
            c = self.cfg.spec
            self.trees[policy] = TreePolicy(TreePolicyConfig(
                max_nodes=c.tree_nodes, max_depth=c.tree_depth, max_width=c.tree_width,
                cost_scale=c.tree_cost_scale, node_cost_seed_s=c.tree_node_cost_s))
        return self.trees[policy]

    def acceptance_model(self, policy: str) -> AcceptanceModel:
        """pipesd-learned's online acceptance model, shared by the policy's sessions."""
        if policy not in self.models:
            self.models[policy] = AcceptanceModel()
        return self.models[policy]

    def tuner(self, policy: str) -> BOTuner:
        if policy not in self.tuners:
            self.tuners[policy] = BOTuner(BOConfig(default_r1=self.cfg.spec.r1,
                                                   default_r2=self.cfg.spec.r2,
                                                   min_tokens=self.cfg.spec.bo_window_tokens))
        return self.tuners[policy]


class MetricHooks(Hooks):
    def __init__(self, policy: str, e: Edge):
        self.policy = policy
        self.edge = e

    def nav(self, reason: str) -> None:
        metrics.NAV_TRIGGERS.labels(SERVICE, self.policy, reason).inc()

    def batch(self, size: int) -> None:
        metrics.SPEC_BATCH_SIZE.labels(SERVICE, self.policy).observe(size)

    def replan(self, planner: BatchPlanner) -> None:
        metrics.DP_REPLANS.labels(SERVICE, planner.reason).inc()
        for name, value in (("window", planner.window), ("alpha", planner.alpha),
                            ("beta", planner.beta), ("gamma", planner.gamma)):
            metrics.POLICY_PARAM.labels(SERVICE, self.policy, name).set(value)
        log.debug("DP plan (%s): %s", self.policy, planner.describe())

    def round(self, draft_tokens: int, accepted: int, early: bool,
              nodes_per_depth: list[int] | None = None) -> None:
        metrics.SPEC_DRAFTS.labels(SERVICE, self.policy).inc()
        metrics.SPEC_DRAFT_TOKENS.labels(SERVICE, self.policy).inc(draft_tokens)
        metrics.SPEC_ACCEPTED.labels(SERVICE, self.policy).inc(accepted)
        metrics.SPEC_DRAFT_LEN.labels(SERVICE, self.policy).observe(draft_tokens)
        for i in range(min(accepted, 16)):
            metrics.SPEC_ACCEPTED_POS.labels(SERVICE, self.policy, str(i) if i < 15 else "15+").inc()
        if accepted > 16:
            metrics.SPEC_ACCEPTED_POS.labels(SERVICE, self.policy, "15+").inc(accepted - 16)
        metrics.observe_round(SERVICE, self.policy, accepted,
                              nodes_per_depth or [1] * draft_tokens)   # None: a chain

    def proactive(self, outcome: str, tokens: int) -> None:
        metrics.PROACTIVE.labels(SERVICE, outcome).inc(tokens)


def check_policy(name: str, sampling_params):
    policy = POLICIES.get(name)
    if policy is None:
        raise ProtocolError(protocol.BAD_FIELD,
                            f"unknown spec policy {name!r}; one of {sorted(POLICIES)}",
                            field="policy")
    # the oracle knows the target's output in advance: its greedy output, or under the Gumbel
    # coupling its seeded output (which no draft changes); rejection sampling's depends on drafts
    if policy.name == "oracle-trigger" and not sampling.is_greedy(sampling_params) \
            and sampling_params.coupling != "gumbel":
        raise ProtocolError(protocol.BAD_FIELD, "the oracle-trigger policy needs greedy decoding "
                                                "or the gumbel sampling coupling (its trigger knows "
                                                "the target's output)",
                            field="sampling.temperature")
    return policy


# The knobs each trigger takes per request (GenerateRequest.policy_knobs) and their ranges.
POLICY_KNOBS = {"pipesd": {"r1": (0.0, 1.0), "r2": (0.0, 1.0)},
                "hsl": {"r2": (0.0, 1.0)},
                "edgellm": {"r1": (0.0, 1.0), "c": (0.0, 0.999999)},
                "vanilla": {"n": (0.0, 1024.0)},
                "oracle-trigger": {},
                "tree": {"cs": (0.0, 1024.0), "m": (0.0, 64.0)},   # m: the drafter's max_tree_nodes default
                "pipesd-learned": {"k": (0.0, 100.0)}}
WHOLE_KNOBS = ("n", "m")   # knobs that count something


def check_knobs(policy, knobs: dict | None) -> None:
    """policy_knobs must name knobs of the request's policy, in range ("n" a whole number)."""
    if knobs is None:
        return
    allowed = POLICY_KNOBS[policy.trigger]
    for k, v in knobs.items():
        if k not in allowed:
            raise ProtocolError(protocol.BAD_FIELD,
                                f"policy_knobs: {policy.name} has no knob {k!r}; its knobs: "
                                f"{sorted(allowed) or 'none'}", field="policy_knobs")
        lo, hi = allowed[k]
        if not lo < v <= hi or (k in WHOLE_KNOBS and v != int(v)):
            raise ProtocolError(protocol.BAD_FIELD,
                                f"policy_knobs: {k}={v!r} outside ({lo:g}, {hi:g}]"
                                + (" or not a whole number" if k in WHOLE_KNOBS else ""),
                                field="policy_knobs")


class Spec:
    """Speculative mode on one dispatcher: its sessions share one `Edge`."""
    name = "spec"
    policies = tuple(POLICIES)

    def __init__(self, cfg):
        self.edge = Edge(cfg)

    def validate(self, d, msg) -> None:
        """An unknown policy (or the oracle trigger with sampling), or knobs the policy does
        not have, are a bad field."""
        s = msgspec.structs.replace(msg.sampling, coupling=msg.sampling.coupling
                                    or d.cfg.sampling_coupling)
        check_knobs(check_policy(self.policy(d, msg), s), msg.policy_knobs)

    def policy(self, d, msg) -> str:
        return msg.policy or d.cfg.spec.policy

    async def run(self, req) -> None:
        s = SpecRun(req, check_policy(req.policy, req.sampling), self.edge)
        try:
            await s.run()
        finally:
            await s.close()


class SpecRun:
    """One speculative session. Under mode "auto" it may be one stretch of a request that
    switches to and from cloud-only: it starts from the stream's current end (`adopt`: the
    (peer, sid) of the verifier session whose KV cache it takes over, protocol ADOPT) and stops
    when `req.switch_due()` says so, leaving its verifier session open for the next stretch
    (`handover`), and its drafter session too (`drafter_handover`: (sid, synced, epoch), its
    first `synced` tokens being committed ones). Given such a drafter session (`drafter`), it
    rolls it back to those tokens and appends the ones committed since: the drafter catches up
    on them alone instead of opening on the whole stream."""

    def __init__(self, req, policy, edge: Edge, tag: str = "", adopt: tuple | None = None,
                 drafter: tuple | None = None):
        self.req = req
        self.d = req.d
        self.cfg = req.d.cfg
        self.policy = policy
        self.edge = edge
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.readers: list[asyncio.Task] = []
        self.vch = self.dch = None
        self.seq = OPEN_SEQ
        self.sent_at: dict[int, tuple[float, int]] = {}
        self.forwards = 0
        self.drafter_alive = False
        self.edge_only = False
        self.verifier_ready_s = None
        self.last_commit: float | None = None   # the autotuner's clock: set at the first commit
        self.bo_tasks: set[asyncio.Task] = set()
        self.sm: SpecRounds | None = None
        # the verifier session: replica, id and inbox tag change when it is replayed
        self.rec = recovery.Recovery(req, req.d.verifiers, "verifier", tag=tag,
                                     peer=adopt[0] if adopt else None)
        self.vpeer = None
        self.vsid = self.rec.sid
        self.dsid = drafter[0] if drafter else req.sid + tag   # the drafter session
        self.resume_drafter = drafter
        self.drafter_handover: tuple | None = None
        self.adopt = adopt
        self.base = len(req.tokens)        # tokens streamed before this session
        self.handover: tuple | None = None  # (peer, sid) left open for the next stretch
        self.vsrc = "v"
        self.last_v = 0.0   # last sign of life of the verifier session (or the last NAV sent)
        self.nav_at: dict[int, float] = {}     # tree rounds: when each round's NAV went out
        self.ask_at: dict[int, float] = {}     # tree rounds: when each round was asked for

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

    def _trigger(self):
        c = self.cfg
        knobs = self.req.msg.policy_knobs or {}
        nav = NavConfig(r1=knobs.get("r1", c.spec.r1), r2=knobs.get("r2", c.spec.r2),
                        max_length=c.spec.max_draft,
                        fixed_length=int(knobs.get("n", c.spec.fixed_length)))
        if self.policy.trigger == "edgellm":
            nav.edgellm_r1 = knobs.get("r1", nav.edgellm_r1)
            nav.edgellm_c = knobs.get("c", nav.edgellm_c)
        if self.policy.trigger == "pipesd-learned":
            return LearnedTrigger(self.edge.acceptance_model(self.policy.name),
                                  lambda: (self.vpeer.rtt, *self._params()),
                                  k=knobs.get("k"), max_length=c.spec.max_draft)
        trig = make_trigger(self.policy.trigger, nav)
        if self.req.msg.nav_thresholds is not None:
            trig.set_thresholds(*self.req.msg.nav_thresholds)
        elif self.tuned:
            r1, r2 = self.edge.tuner(self.policy.name).current()
            trig.set_thresholds(r1, r2)
        return trig

    def _tree_nodes(self) -> int:
        knobs = self.req.msg.policy_knobs or {}
        return int(knobs.get("m", self.cfg.spec.tree_nodes))

    def _tree_shape(self, depth_left: int) -> protocol.TreeRequest:
        """The next tree round's shape rule, from what this dispatcher measured."""
        rtt = self.vpeer.rtt if math.isfinite(self.vpeer.rtt) else 0.0
        _, beta, gamma = self._params()
        knobs = dict(self.req.msg.policy_knobs or {})
        knobs["m"] = self._tree_nodes()
        return self.edge.tree(self.policy.name).request(rtt, beta, gamma, depth_left, knobs)

    async def run(self) -> None:
        req = self.req
        self.vpeer = await self.rec.connect()
        if self.policy.tree:
            await self._run()
            return
        trigger = self._trigger()
        if self.policy.name == "oracle-trigger":
            t = time.monotonic()
            trigger.set_reference(await self._reference())
            req.stats["oracle_reference_s"] = time.monotonic() - t
            req.start = time.monotonic()   # its reference generation is not counted in its TPT
        self.sm = SpecRounds(len(req.prompt_ids) + self.base, req.max_tokens - self.base,
                             self.policy, trigger,
                             BatchPlanner(), self.edge.window(self.policy.name), self._params,
                             self.cfg.spec.lookahead, MetricHooks(self.policy.name, self.edge),
                             depth=self.cfg.spec.proactive_depth)
        await self._run()

    async def _run(self) -> None:
        req, d = self.req, self.d
        if self.policy.tree:
            self.sm = TreeRounds(len(req.prompt_ids) + self.base, req.max_tokens - self.base,
                                 self.policy,
                                 self.edge.tree(self.policy.name), self._tree_shape,
                                 MetricHooks(self.policy.name, self.edge),
                                 proactive=self.cfg.spec.tree_proactive,
                                 batch=self.edge.window(self.policy.name).value,
                                 trigger=make_trigger("pipesd", NavConfig(
                                     r1=self.cfg.spec.r1, r2=self.cfg.spec.r2, max_length=0))
                                 if self.cfg.spec.tree_proactive_trigger else None)
        self.vch = self.vpeer.channel()
        self._reader(self.vch, self.vsrc)
        committed = self.rec.committed()
        # the cache to adopt, unless its replica went down and the session opens elsewhere
        adopt = self.adopt[1] if self.adopt and self.vpeer is self.adopt[0] else ""
        await self.vch.send(self._spec_open(committed, adopt))
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
                tree_nodes=self._tree_nodes() if self.policy.tree else 0,
                features=self.policy.trigger == "pipesd-learned", **req.constraint_fields()))
        elif wants_drafter:
            log.warning("drafter at %s is down: %s goes on with the target alone",
                        d.drafter.endpoint, req.sid)
            req.stats["drafter_lost"] = True
            actions += self.sm.drafter_lost()
        self.last_v = time.monotonic()
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
                if src == self.vsrc:
                    self.last_v = time.monotonic()
                    await self.on_verifier(msg, frames)
                elif src == "d":   # a draft token may send a batch: the verifier may fail there
                    await self.on_drafter(msg, frames)
            except PeerError as e:
                await self.recover(e)

    async def recover(self, err: PeerError) -> None:
        """Replay the verifier session until a replay sticks (each one counts against
        max_recoveries). What recovery.Recovery.fail raises (deadline, too many replays, an
        error no replay cures) is the request's answer: it leaves this loop, never re-enters
        fail (recovery.with_recovery's shape)."""
        while True:
            self.rec.fail(err)                     # raises what recovery cannot fix
            try:
                await self.replay_verifier()
                return
            except PeerError as e:   # the replica chosen failed at once
                err = e

    def _verifier_stalled(self) -> bool:
        """A NAV is out and the verifier session has been silent for stall_s."""
        sm = self.sm
        waiting = not self.edge_only and sm.rounds and sm.rounds[0].closed
        return bool(waiting) and time.monotonic() - self.last_v > self.cfg.stall_s

    async def replay_verifier(self) -> None:
        """Rebuild the verifier session on a live replica from the committed tokens; the drafts
        past them are verified again there (SpecRounds.verifier_lost)."""
        d = self.d
        old_peer, old_sid = self.vpeer, self.vsid
        self.vpeer = await self.rec.connect()
        self.vsid = self.rec.sid
        self.vch.close()
        d.spawn(d.close_remote(old_peer, old_sid))
        self.vsrc = f"v{self.rec.attempt}"         # what the old channel still queued is ignored
        self.vch = self.vpeer.channel()
        self._reader(self.vch, self.vsrc)
        self.sent_at.clear()
        self.last_v = time.monotonic()
        await self.vch.send(self._spec_open(self.rec.committed()))
        await self.act(self.sm.verifier_lost())

    async def _reference(self) -> list[int]:
        """The target's greedy continuation (cloud-only generation), for the oracle trigger."""
        req = self.req
        ch = self.vpeer.channel()   # the replica this session was placed on
        out: list[int] = []
        try:
            await ch.send(protocol.CloudGenerate(sid=f"{req.sid}-oracle", seq=OPEN_SEQ,
                                                 token_ids=req.prompt_ids,
                                                 max_tokens=req.max_tokens,
                                                 sampling=req.sampling,
                                                 **req.constraint_fields()))
            while len(out) < req.max_tokens:
                msg, _ = await ch.recv(timeout=max(0.001, req.remaining()))
                if isinstance(msg, protocol.CloudTokens) and msg.index == len(out):
                    out += msg.token_ids
                    if msg.done:
                        break
        finally:
            ch.close()
        return out

    def _params(self) -> tuple[float, float, float]:
        link = self.edge.link
        if math.isfinite(self.vpeer.rtt):
            link.observe_latency(self.vpeer.rtt / 2)
        alpha, beta = link.params()
        gamma = self.edge.speed.gamma
        p = self.policy.name
        metrics.POLICY_PARAM.labels(SERVICE, p, "window").set(self.edge.window(p).value)
        return alpha, beta, gamma

    # --- events --------------------------------------------------------------------------------
    async def on_verifier(self, msg, frames) -> None:
        if self.edge_only:
            return
        if isinstance(msg, protocol.Error):
            if msg.code == protocol.UNAVAILABLE and self.req.msg.allow_edge_only \
                    and self.drafter_alive and not any(p.up for p in self.d.verifiers):
                await self.go_edge_only()
                return
            raise PeerError(msg.code, f"verifier: {msg.message}")   # replayed if recoverable
        if isinstance(msg, protocol.Ack):
            if msg.seq == OPEN_SEQ:
                self.verifier_ready_s = time.monotonic() - self.req.start
                self.req.stats.setdefault("cached_tokens", msg.cached_tokens)
            elif msg.seq in self.sent_at:
                t, size = self.sent_at.pop(msg.seq)
                self.edge.link.observe_round_trip(size, time.monotonic() - t)
            return
        if isinstance(msg, protocol.VerifyResult):
            self.forwards = max(self.forwards, msg.forwards)
            try:
                if self.policy.tree:
                    self._tree_timing(msg)
                    actions = self.sm.on_result(msg.round, msg.start, msg.accepted, msg.token,
                                                msg.early, msg.path)
                else:
                    actions = self.sm.on_result(msg.round, msg.start, msg.accepted, msg.token,
                                                msg.early)
            except SpecError as e:
                raise PeerError(protocol.INTERNAL, str(e)) from None
            if msg.logprobs is not None:   # the result's tokens are its Emit's, in order
                for a in actions:
                    if isinstance(a, Emit):
                        a.logprobs = msg.logprobs
                        break
            await self.act(actions)

    def _tree_timing(self, msg: protocol.VerifyResult) -> None:
        """Feed the tree policy: the verifier's time for the round's nodes (NAV to result minus
        the round trip) and the round's wall time per committed token."""
        sm, now = self.sm, time.monotonic()
        r = sm.rounds[0] if sm.rounds and sm.rounds[0].id == msg.round else None
        if r is None:
            return
        tree = self.edge.tree(self.policy.name)
        nav = self.nav_at.pop(msg.round, None)
        if nav is not None and not msg.early and math.isfinite(self.vpeer.rtt):
            tree.observe_verify(r.sent, max(0.0, now - nav - self.vpeer.rtt))
        asked = self.ask_at.pop(msg.round, None)
        if asked is not None:
            tree.observe_commit(now - asked, msg.accepted + 1)

    async def on_drafter(self, msg, frames) -> None:
        if not self.drafter_alive:
            return
        if isinstance(msg, protocol.Error):
            log.warning("drafter failed for %s (%s: %s): going on with the target alone",
                        self.req.sid, msg.code, msg.message)
            self.drafter_alive = False
            self.req.stats["drafter_lost"] = True
            self.d.spawn(self.d.close_remote(self.d.drafter, self.dsid))
            if self.edge_only:
                raise PeerError(protocol.UNAVAILABLE, "verifier and drafter are both gone")
            await self.act(self.sm.drafter_lost())
            return
        if not isinstance(msg, protocol.DraftTokens) or msg.seq != self.sm.epoch:
            return   # the open Ack, or tokens drafted before the last rollback
        if msg.parents is not None:    # a tree depth: one batched decode, not rows × γ
            if msg.rows and self.policy.tree:
                self.edge.tree(self.policy.name).observe_decode(msg.rows, msg.seconds)
        elif msg.seconds > 0 and msg.token_ids:
            self.edge.speed.observe(len(msg.token_ids), msg.seconds)
        q_ids = q_probs = None
        if msg.q_ids is not None and msg.q_probs is not None:
            q_ids = protocol.tensor_numpy(msg.q_ids, frames)
            q_probs = protocol.tensor_numpy(msg.q_probs, frames)
        if self.edge_only:
            if msg.parents is None:      # a tree round still in flight is not the stream
                await self.emit_degraded(msg)
            return
        if self.policy.tree:
            try:
                if msg.parents is None:   # the proactive chain along a tree's main path
                    actions = []
                    for i, (t, p) in enumerate(zip(msg.token_ids, msg.probs)):
                        actions += self.sm.on_chain(Draft(
                            msg.start + i, t, p, None if q_ids is None else q_ids[i],
                            None if q_probs is None else q_probs[i]))
                else:
                    actions = self.sm.on_tree(msg.start, msg.first_node, msg.token_ids,
                                              msg.parents, msg.probs, msg.tree_done, q_ids,
                                              q_probs)
            except SpecError as e:
                await self.on_drafter(protocol.Error(code=protocol.INTERNAL, message=str(e)),
                                      frames)
                return
            await self.act(actions)
            return
        actions = []
        n = len(msg.token_ids)
        entropies = msg.entropies if msg.entropies and len(msg.entropies) == n else [None] * n
        margins = msg.margins if msg.margins and len(msg.margins) == n else [None] * n
        for i, (t, p) in enumerate(zip(msg.token_ids, msg.probs)):
            actions += self.sm.on_draft(Draft(msg.start + i, t, p,
                                              None if q_ids is None else q_ids[i],
                                              None if q_probs is None else q_probs[i],
                                              entropies[i], margins[i]))
        await self.act(actions)

    # --- actions -------------------------------------------------------------------------------
    async def act(self, actions) -> None:
        req = self.req
        for a in actions:
            if req.done:
                return
            if isinstance(a, Emit):
                await req.emit(a.tokens, logprobs=a.logprobs)
                self.rec.progress()
                self._bo(len(a.tokens))
                if not self.edge_only and req.switch_due():
                    self.handover = (self.vpeer, self.vsid)
                    if self.dch is not None and self.drafter_alive and not self.policy.tree:
                        # the round just resolved started at the committed end before it: the
                        # drafter's context holds exactly the committed tokens up to there
                        synced = self.sm.C - len(a.tokens)
                        self.drafter_handover = (self.dsid, synced, self.sm.epoch)
                    return
            elif isinstance(a, SendBatch):
                await self._send_batch(a)
            elif isinstance(a, SendNav):
                self.seq += 1
                if not self.sm.rounds or self.sm.rounds[0].id == a.round:
                    self.last_v = time.monotonic()   # the stall clock starts at the NAV
                self.nav_at[a.round] = time.monotonic()
                await self.vch.send(protocol.VerifyRequest(sid=self.vsid, seq=self.seq,
                                                           round=a.round, end=a.end,
                                                           nodes=a.nodes))
            elif isinstance(a, Rollback):
                if self.drafter_alive:
                    await self.dch.send(protocol.DraftRollback(sid=self.dsid, seq=a.epoch,
                                                               keep=a.keep, append=a.append,
                                                               until=a.until, path=a.path))
            elif isinstance(a, AskTree):
                self.ask_at[a.round] = time.monotonic()
                if self.drafter_alive:
                    await self.dch.send(protocol.DraftRequest(sid=self.dsid, seq=a.epoch,
                                                              tree=a.request, until=a.until))
            elif isinstance(a, Limit):
                if self.drafter_alive:
                    await self.dch.send(protocol.DraftRequest(sid=self.dsid, seq=self.sm.epoch,
                                                              until=a.until))

    async def _send_batch(self, b: SendBatch) -> None:
        self.seq += 1
        msg = protocol.DraftBatch(sid=self.vsid, seq=self.seq, round=b.round, start=b.start,
                                  token_ids=[x.token for x in b.drafts],
                                  probs=[x.prob for x in b.drafts], parent=b.parent,
                                  parents=b.parents, first_node=b.first_node)
        buffers = []
        if b.drafts and b.drafts[0].q_ids is not None:
            msg.q_ids, ids = protocol.tensor_frame(np.stack([x.q_ids for x in b.drafts]), 0)
            msg.q_probs, probs = protocol.tensor_frame(np.stack([x.q_probs for x in b.drafts]), 1)
            buffers = [ids, probs]
        self.sent_at[self.seq] = (time.monotonic(), len(b.drafts))
        await self.vch.send(msg, buffers)

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
        if self.policy.tree:     # back to the committed tokens, a chain from there
            await self.act(sm.edge_only())
            return
        final = len(self.req.prompt_ids) + self.req.max_tokens
        await self.dch.send(protocol.DraftRequest(sid=self.dsid, seq=sm.epoch, until=final))

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
        req, d = self.req, self.d
        peer = next(p for p in d.verifiers if p.up)
        committed = self.rec.committed()
        log.warning("verifier %s is back: %s resumes verification after %d degraded tokens",
                    peer.name, req.sid, req.stats.get("degraded_tokens", 0))
        old_peer, old_sid = self.vpeer, self.vsid
        self.rec.attempt += 1                      # a fresh session id on the verifier
        self.rec.reasons.append("resumed")
        metrics.RECOVERIES.labels(d.name, req.mode, "resumed").inc()
        self.rec.peer = self.vpeer = peer
        self.vsid = self.rec.sid
        self.vch.close()
        d.spawn(d.close_remote(old_peer, old_sid))
        self.vsrc = f"v{self.rec.attempt}"
        self.vch = peer.channel()
        self._reader(self.vch, self.vsrc)
        self.sent_at.clear()
        self.edge_only = False
        req.stats["resumed_at"] = len(req.tokens)
        self.last_v = time.monotonic()
        await self.vch.send(self._spec_open(committed))
        await self.act(self.sm.resync(len(committed), committed[-1]))

    def _spec_open(self, committed: list[int], adopt: str = "") -> protocol.SpecOpen:
        """The verifier session's open, on the committed tokens: the first, or a reopen after a
        lost verifier or a resync (what the request asks of every verification is the same)."""
        req = self.req
        return protocol.SpecOpen(sid=self.vsid, seq=OPEN_SEQ, token_ids=committed,
                                 sampling=req.sampling, stream=self.policy.stream,
                                 logprobs=req.msg.logprobs, adopt=adopt,
                                 max_tokens=max(1, req.max_tokens - len(req.tokens)),
                                 **req.constraint_fields())

    # --- teardown -------------------------------------------------------------------------------
    async def close(self) -> None:
        for t in self.readers:
            t.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)
        for ch in (self.vch, self.dch):
            if ch is not None:
                ch.close()
        d, sid = self.d, self.dsid
        if self.vch is not None and not self.edge_only and self.handover is None:
            d.spawn(d.close_remote(self.vpeer, self.vsid))
        if self.dch is not None and self.drafter_alive and self.drafter_handover is None:
            d.spawn(d.close_remote(d.drafter, sid))
        self.rec.finish()
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
