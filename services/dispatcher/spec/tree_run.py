"""A speculative session of token-tree rounds (`TreeRun`, policies `tree` and `tree-stream`):
each round's shape comes from tree_policy.TreePolicy, the drafter drafts it a depth at a time,
and tree_session.TreeRounds keeps the rounds and their proactive chain. The session feeds the
tree policy what it measures: each depth's decode time, each round's verify time and its wall
time per committed token."""

from __future__ import annotations

import math
import time

from common import protocol
from services.dispatcher.spec.edge import MetricHooks
from services.dispatcher.spec.nav_trigger import NavConfig, make_trigger
from services.dispatcher.spec.run import SpecRun
from services.dispatcher.spec.session import Draft, SendNav, SpecError
from services.dispatcher.spec.tree_session import AskTree, TreeRounds


class TreeRun(SpecRun):
    """One speculative session whose rounds are token trees."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nav_at: dict[int, float] = {}     # when each round's NAV went out
        self.ask_at: dict[int, float] = {}     # when each round was asked for

    async def _rounds(self) -> TreeRounds:
        req, c = self.req, self.cfg.spec
        return TreeRounds(len(req.prompt_ids) + self.base, req.max_tokens - self.base,
                          self.policy,
                          self.edge.tree(self.policy.name), self._tree_shape,
                          MetricHooks(self.policy.name, self.edge),
                          proactive=c.tree_proactive,
                          batch=self.edge.window(self.policy.name).value,
                          trigger=make_trigger("pipesd", NavConfig(r1=c.r1, r2=c.r2, max_length=0))
                          if c.tree_proactive_trigger else None)

    def tree_nodes(self) -> int:
        knobs = self.req.msg.policy_knobs or {}
        return int(knobs.get("m", self.cfg.spec.tree_nodes))

    def _tree_shape(self, depth_left: int) -> protocol.TreeRequest:
        """The next tree round's shape rule, from what this dispatcher measured."""
        rtt = self.verifier.peer.rtt if math.isfinite(self.verifier.peer.rtt) else 0.0
        _, beta, gamma = self._params()
        knobs = dict(self.req.msg.policy_knobs or {})
        knobs["m"] = self.tree_nodes()
        return self.edge.tree(self.policy.name).request(rtt, beta, gamma, depth_left, knobs)

    def _observe_draft_time(self, msg: protocol.DraftTokens) -> None:
        """A tree depth is one batched decode, not rows × γ."""
        if msg.parents is None:
            super()._observe_draft_time(msg)
        elif msg.rows:
            self.edge.tree(self.policy.name).observe_decode(msg.rows, msg.seconds)

    async def _on_draft(self, msg: protocol.DraftTokens, q_ids, q_probs) -> None:
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
            await self._drafter_failed(protocol.Error(code=protocol.INTERNAL, message=str(e)))
            return
        await self.act(actions)

    def _on_result(self, msg: protocol.VerifyResult) -> list:
        self._tree_timing(msg)
        return self.sm.on_result(msg.round, msg.start, msg.accepted, msg.token, msg.early,
                                 msg.path)

    def _tree_timing(self, msg: protocol.VerifyResult) -> None:
        """Feed the tree policy: the verifier's time for the round's nodes (NAV to result minus
        the round trip) and the round's wall time per committed token."""
        sm, now = self.sm, time.monotonic()
        r = sm.rounds[0] if sm.rounds and sm.rounds[0].id == msg.round else None
        if r is None:
            return
        tree, rtt = self.edge.tree(self.policy.name), self.verifier.peer.rtt
        nav = self.nav_at.pop(msg.round, None)
        if nav is not None and not msg.early and math.isfinite(rtt):
            tree.observe_verify(r.sent, max(0.0, now - nav - rtt))
        asked = self.ask_at.pop(msg.round, None)
        if asked is not None:
            tree.observe_commit(now - asked, msg.accepted + 1)

    async def _send_nav(self, a: SendNav) -> None:
        self.nav_at[a.round] = time.monotonic()
        await super()._send_nav(a)

    async def _act_other(self, a) -> None:
        if isinstance(a, AskTree):
            self.ask_at[a.round] = time.monotonic()
            if self.drafter_alive:
                await self.dch.send(protocol.DraftRequest(sid=self.dsid, seq=a.epoch,
                                                          tree=a.request, until=a.until))

    async def _drafter_alone(self) -> None:
        """Back to the committed tokens, a chain from there."""
        await self.act(self.sm.edge_only())
