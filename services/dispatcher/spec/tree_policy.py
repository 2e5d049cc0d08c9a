"""What a token-tree round may cost and gain, from what the dispatcher measures online. Pure: no
I/O, no clock; tree_run.TreeRun feeds it measurements.

The drafter grows the tree (common/tree_shape.py: best-first by estimated path-acceptance
probability P, a node added while P × token_value_s pays its marginal cost); this module gives
it the numbers, each round:

    token_value_s   the TPT now: seconds per committed token of the recent tree rounds (EWMA of
                    round wall time over EWMA of tokens per round). One more accepted token in a
                    round saves about that much.
    node_cost_s     the verify-cost curve's marginal cost of one more node (least squares of the
                    verifier's time vs nodes verified, like γ for the drafter) plus β, the
                    per-token transmission cost of the link model
    depth_cost_s    one more sequential drafter decode: a + b of the drafter-cost curve, the
                    least squares of a tree decode's seconds vs its rows (a + b·rows, from the
                    drafter's timings of each depth); γ until two row counts are measured
    width_cost_s    b: one more row in a depth that is decoded anyway (γ × width_cost until
                    then; on this project's 2-core VM a row costs a fifth to a half of a
                    one-row decode of the bundled drafter)
    accept_scale    per depth and sibling rank: measured acceptance over the q of the nodes that
                    were tried there (a node is tried when its parent was accepted), with a prior
                    of `prior` pseudo-nodes at scale 1 (q itself is the estimate until measured)

Every cost is multiplied by the policy knob `cs` (cost scale) and the tree holds at most `m`
nodes (knob): the BO tuner of the benchmarks tunes those two like every other policy's knobs.
On a fast link the TPT is small, siblings (small q) do not pay their node cost and the tree is
a chain; on a slow link the TPT is large and the tree widens where the drafter is unsure.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common import protocol
from common.tree_shape import ROOT
from services.dispatcher.spec.link_model import _nonneg_least_squares

__all__ = ["TreePolicyConfig", "TreePolicy", "ranks"]


@dataclass
class TreePolicyConfig:
    max_nodes: int = 32         # nodes per round (knob "m"); <= the drafter's max_tree_nodes
    max_depth: int = 16         # depth of a tree round
    max_width: int = 4          # children per node
    cost_scale: float = 1.0     # every cost × this (knob "cs")
    node_cost_seed_s: float = 0.002   # marginal verify seconds per node before measurements
    width_cost: float = 0.1     # one more row in a decoded depth, as a fraction of γ, until
    #                             the drafter-cost curve is measured
    prior: float = 2.0          # pseudo-nodes at acceptance scale 1 per (depth, rank)
    ewma: float = 0.2           # weight of a new round in the TPT estimate
    window: int = 64            # observations in each curve's fit: (nodes, verify seconds)
    #                             and (rows, drafter decode seconds)
    scale_depths: int = 8       # rows of accept_scale sent (deeper nodes use the last row)


def ranks(parents: list[int]) -> list[int]:
    """Each node's rank among its siblings (wire order: a parent's children in rank order)."""
    seen: dict[int, int] = {}
    out = []
    for p in parents:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p == ROOT else out[p] + 1)
    return out


class TreePolicy:
    """Shared by the sessions of one policy on one dispatcher (like the DP window N̂)."""

    def __init__(self, config: TreePolicyConfig | None = None):
        self.config = config or TreePolicyConfig()
        c = self.config
        # (depth, rank) -> [tried, accepted, sum of q]
        self.table: dict[tuple[int, int], list[float]] = {}
        self.curve: deque[tuple[int, float]] = deque(maxlen=c.window)
        self.decodes: deque[tuple[int, float]] = deque(maxlen=c.window)
        self.round_s: float | None = None     # EWMA of a round's wall time
        self.round_tokens: float | None = None  # EWMA of tokens a round commits

    # --- measurements ---------------------------------------------------------------------------
    def observe_round(self, parents: list[int], probs: list[float], path: list[int]) -> None:
        """A verified tree round: which nodes were tried and which of them accepted."""
        accepted = set(path)
        for i, (p, d, r) in enumerate(zip(parents, depths(parents), ranks(parents))):
            if p != ROOT and p not in accepted:
                continue           # its parent was rejected: never compared with the target
            row = self.table.setdefault((d, r), [0.0, 0.0, 0.0])
            row[0] += 1
            row[1] += i in accepted
            row[2] += float(probs[i])

    def observe_verify(self, nodes: int, seconds: float) -> None:
        """Verifier time for a round of `nodes` nodes (NAV to result, minus the round trip)."""
        if seconds >= 0:
            self.curve.append((int(nodes), float(seconds)))

    def observe_decode(self, rows: int, seconds: float) -> None:
        """The drafter's time for one tree depth: a batched decode of `rows` rows."""
        if rows >= 1 and seconds >= 0:
            self.decodes.append((int(rows), float(seconds)))

    def observe_commit(self, seconds: float, tokens: int) -> None:
        """A round's wall time (its drafting included) and the tokens it committed."""
        w = self.config.ewma
        if self.round_s is None:
            self.round_s, self.round_tokens = float(seconds), float(tokens)
        else:
            self.round_s = (1 - w) * self.round_s + w * float(seconds)
            self.round_tokens = (1 - w) * self.round_tokens + w * float(tokens)

    # --- estimates ------------------------------------------------------------------------------
    def verify_curve(self) -> tuple[float, float]:
        """(intercept, seconds per node) of verify time vs nodes."""
        fit = _nonneg_least_squares(self.curve)   # None until two node counts are timed
        if fit is None:
            base = min((t for _, t in self.curve), default=0.0)
            return base, self.config.node_cost_seed_s
        return fit

    def decode_costs(self, gamma: float) -> tuple[float, float]:
        """(seconds of a one-row depth decode, seconds per further row) of the drafter."""
        fit = _nonneg_least_squares(self.decodes)   # None until two row counts are timed
        if fit is None:
            return gamma, gamma * self.config.width_cost
        a, b = fit
        return a + b, b

    def scale(self, depth: int, rank: int) -> float:
        tried, acc, sum_q = self.table.get((depth, rank), (0.0, 0.0, 0.0))
        k = self.config.prior
        return min(4.0, max(0.05, (acc + k) / (sum_q + k)))

    def token_value(self, rtt: float, gamma: float) -> float:
        """Seconds one more accepted token saves: the measured TPT, or before any round the
        time of a round that commits one token."""
        if self.round_s is not None and self.round_tokens:
            return self.round_s / self.round_tokens
        return rtt + self.verify_curve()[0] + gamma

    def request(self, rtt: float, beta: float, gamma: float, depth_left: int,
                knobs: dict | None = None) -> protocol.TreeRequest:
        """The shape rule of the next round. `depth_left`: positions the round may fill before
        the last wanted one (the target's own)."""
        c = self.config
        knobs = knobs or {}
        scale = float(knobs.get("cs", c.cost_scale))
        max_nodes = int(knobs.get("m", c.max_nodes))
        _, per_node = self.verify_curve()
        depth_cost, width_cost = self.decode_costs(gamma)
        rows = min(c.scale_depths, c.max_depth)
        return protocol.TreeRequest(
            max_nodes=max(1, max_nodes), max_depth=max(1, min(c.max_depth, depth_left)),
            max_width=c.max_width, token_value_s=min(protocol.MAX_SECONDS,
                                                     self.token_value(rtt, gamma)),
            node_cost_s=[scale * (per_node + beta)], depth_cost_s=scale * depth_cost,
            width_cost_s=scale * width_cost,
            accept_scale=[self.scale(d, r) for d in range(rows) for r in range(c.max_width)])
