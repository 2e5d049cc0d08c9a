"""A speculative session of chain rounds (`ChainRun`): every policy but the token trees. Each
draft token goes through the NAV trigger (nav_trigger, learned_trigger) and the batch plan
(dp_batching.BatchPlanner) at once; session.SpecRounds keeps the rounds."""

from __future__ import annotations

import time

from common import protocol
from services.dispatcher.spec.dp_batching import BatchPlanner
from services.dispatcher.spec.edge import MetricHooks
from services.dispatcher.spec.learned_trigger import LearnedTrigger
from services.dispatcher.spec.nav_trigger import NavConfig, make_trigger
from services.dispatcher.spec.run import SpecRun
from services.dispatcher.spec.session import Draft, Emit, SpecRounds
from services.dispatcher.spec.verifier_link import OPEN_SEQ


class ChainRun(SpecRun):
    """One speculative session whose rounds are chains of draft tokens."""

    async def _rounds(self) -> SpecRounds:
        req = self.req
        trigger = self._trigger()
        if self.policy.name == "oracle-trigger":
            t = time.monotonic()
            trigger.set_reference(await self._reference())
            req.stats["oracle_reference_s"] = time.monotonic() - t
            req.start = time.monotonic()   # its reference generation is not counted in its TPT
        return SpecRounds(len(req.prompt_ids) + self.base, req.max_tokens - self.base,
                          self.policy, trigger,
                          BatchPlanner(), self.edge.window(self.policy.name), self._params,
                          self.cfg.spec.lookahead, MetricHooks(self.policy.name, self.edge),
                          depth=self.cfg.spec.proactive_depth)

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
                                  lambda: (self.verifier.peer.rtt, *self._params()),
                                  k=knobs.get("k"), max_length=c.spec.max_draft)
        trig = make_trigger(self.policy.trigger, nav)
        if self.req.msg.nav_thresholds is not None:
            trig.set_thresholds(*self.req.msg.nav_thresholds)
        elif self.tuned:
            r1, r2 = self.edge.tuner(self.policy.name).current()
            trig.set_thresholds(r1, r2)
        return trig

    async def _reference(self) -> list[int]:
        """The target's greedy continuation (cloud-only generation), for the oracle trigger."""
        req = self.req
        ch = self.verifier.peer.channel()   # the replica this session was placed on
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

    async def _on_draft(self, msg: protocol.DraftTokens, q_ids, q_probs) -> None:
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

    def _on_result(self, msg: protocol.VerifyResult) -> list:
        return self.sm.on_result(msg.round, msg.start, msg.accepted, msg.token, msg.early)

    def _hand_over_drafter(self, emitted: Emit) -> None:
        if self.dch is not None and self.drafter_alive:
            # the round just resolved started at the committed end before it: the drafter's
            # context holds exactly the committed tokens up to there
            synced = self.sm.C - len(emitted.tokens)
            self.drafter_handover = (self.dsid, synced, self.sm.epoch)

    async def _drafter_alone(self) -> None:
        """The drafter goes on from its drafts to the request's end."""
        final = len(self.req.prompt_ids) + self.req.max_tokens
        await self.dch.send(protocol.DraftRequest(sid=self.dsid, seq=self.sm.epoch, until=final))
