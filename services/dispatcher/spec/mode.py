"""Speculative mode (PipeSD, DESIGN.md §3) on the dispatcher: the mode (`Spec`), the checks of a
request's policy and knobs, and the session each request runs (`spec_run`).

The sessions, their I/O:
    run.SpecRun                 one session: inbox, drafter session, actions, edge-only, stats
    chain_run.ChainRun          a session of chain rounds (every policy but the token trees)
    tree_run.TreeRun            a session of token-tree rounds
    verifier_link.VerifierLink  its verifier session: replica, channel, replay, stall clock
    edge.Edge                   what the sessions of one dispatcher share
The decisions, in pure modules:
    session.SpecRounds          rounds, proactive rounds, what to send / emit / roll back
    tree_session.TreeRounds     the same for token trees
    tree_policy.TreePolicy      a tree round's shape, from measured costs and acceptance
    nav_trigger                 when to verify (dual threshold, HSL, EdgeLLM, fixed, oracle-trigger)
    learned_trigger             pipesd-learned: an online acceptance model and its stopping rule
    dp_batching.BatchPlanner    how to batch the tokens of a round (Algorithm 1)
    link_model                  α, β (least squares over batch acks) and γ (drafter timings)
    bo_tuner.BOTuner            (R1, R2) tuned on live traffic
"""

from __future__ import annotations

import msgspec

from common import protocol, sampling
from common.protocol import ProtocolError
from services.dispatcher.spec.chain_run import ChainRun
from services.dispatcher.spec.edge import Edge
from services.dispatcher.spec.run import SpecRun
from services.dispatcher.spec.session import POLICIES
from services.dispatcher.spec.tree_run import TreeRun


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
        s = spec_run(req, check_policy(req.policy, req.sampling), self.edge)
        try:
            await s.run()
        finally:
            await s.close()


def spec_run(req, policy, edge: Edge, tag: str = "", adopt: tuple | None = None,
             drafter: tuple | None = None) -> SpecRun:
    """The session for `req` under `policy`: token-tree rounds or chain rounds (SpecRun has
    what `tag`, `adopt` and `drafter` mean)."""
    cls = TreeRun if policy.tree else ChainRun
    return cls(req, policy, edge, tag, adopt, drafter)
