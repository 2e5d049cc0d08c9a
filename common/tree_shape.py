"""The shape of a token tree (EAGLE-2 / Sequoia style). Pure: no I/O, no model.

The drafter grows a tree one depth at a time (one batched decode per depth). Every node has an
estimated *path-acceptance probability* P: the probability that the target accepts it and all
its ancestors,

    P(node) = P(parent) × a(node),   a(node) = min(1, q(node) × accept_scale[depth][rank])

where q(node) is the draft probability of the node's token under its parent's context and
accept_scale is the dispatcher's measured acceptance over q at that depth and sibling rank (1
until measured: q itself is the estimate, as in EAGLE-2). The next node added is always the
candidate with the highest P (best-first), subject to one rule: a parent's children are added in
rank order (the rank-r child only after the rank-(r-1) one), because when sampling the rank-r
child was drawn from q with the earlier ones removed and recursive rejection sampling verifies
them in that order. A node is added only while its expected gain pays for it:

    P × token_value_s  >=  node_cost_s[n] + (depth_cost_s if it opens a new depth else width_cost_s)

(n = nodes already in the tree; token_value_s = the seconds one more accepted token saves, i.e.
the TPT; node_cost_s = the verify-cost curve's marginal cost of one more node plus its
transmission; depth_cost_s = one more sequential drafter decode). The rule finds a chain by
itself where siblings do not pay (a fast link, costly nodes) and a wide tree where they do (a
slow link, a drafter that is often wrong).

Node numbering follows the wire format (DESIGN.md §3): nodes 0..N-1 in topological order, depth
by depth; within a depth grouped by parent in parent order, each parent's children in rank order.
So a node's lowest-index child is its rank-0 child and the main path is the drafter's own chain.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

ROOT = -1   # parents[i] == ROOT: node i is a child of the round's root (the last committed token)


@dataclass
class Shape:
    """The shape rule's inputs (the wire's protocol.TreeRequest, as plain values)."""
    max_nodes: int = 16
    max_depth: int = 8
    max_width: int = 4
    token_value_s: float = 0.0
    node_cost_s: Sequence[float] = ()
    depth_cost_s: float = 0.0
    width_cost_s: float = 0.0
    accept_scale: Sequence[float] = ()

    @classmethod
    def of(cls, req) -> "Shape":
        """From a protocol.TreeRequest (or anything with the same fields)."""
        return cls(req.max_nodes, req.max_depth, req.max_width, req.token_value_s,
                   list(req.node_cost_s), req.depth_cost_s, req.width_cost_s,
                   list(req.accept_scale))

    def scale(self, depth: int, rank: int) -> float:
        """accept_scale[depth][rank]; deeper than its rows: the last row; missing: 1."""
        rows = len(self.accept_scale) // max(1, self.max_width)
        if rows == 0 or not 0 <= rank < self.max_width:
            return 1.0
        return float(self.accept_scale[min(depth, rows - 1) * self.max_width + rank])

    def node_cost(self, n: int) -> float:
        """Marginal cost of the (n+1)-th node (the curve's last value repeats past its end)."""
        if not self.node_cost_s:
            return 0.0
        return float(self.node_cost_s[min(n, len(self.node_cost_s) - 1)])

    def pays(self, path_p: float, n: int, new_depth: bool) -> bool:
        cost = self.node_cost(n) + (self.depth_cost_s if new_depth else self.width_cost_s)
        return path_p * self.token_value_s >= cost


@dataclass
class Node:
    token: int
    parent: int          # ROOT or a node index
    depth: int
    rank: int            # among its siblings (0 = the parent's preferred child)
    prob: float          # q(token) under the parent's context
    path_p: float        # estimated path-acceptance probability
    row: object = None   # the parent's sparse q (ids, probs) when sampling, shared by siblings
    children: list[int] = field(default_factory=list)


class TreeGrower:
    """One tree round's shape, grown depth by depth.

    The caller (the drafter) alternates: `offer(parent, candidates, row)` for every node of the
    last depth once its logits are known (the root first, parent = ROOT), then `grow()` picks
    the next depth's nodes among all offered candidates (returns their indices; [] = the tree is
    complete). `worth_decoding()` says, before the decode that would produce the next offers,
    whether any node of the next depth could still pay (if not, the round ends without it)."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.nodes: list[Node] = []
        self.depth = -1                 # depth of the last nodes grown (-1: none yet)
        self._offers: dict[int, tuple[list[tuple[int, float]], object]] = {}
        self.done = False

    # --- the drafter's side ---------------------------------------------------------------------
    def frontier(self) -> list[int]:
        """Nodes of the last depth (ROOT before the first)."""
        if self.depth < 0:
            return [ROOT]
        return [i for i, n in enumerate(self.nodes) if n.depth == self.depth]

    def path_p(self, i: int) -> float:
        return 1.0 if i == ROOT else self.nodes[i].path_p

    def worth_decoding(self) -> bool:
        """Could a node one depth below the frontier pay? Its P is at most the best frontier
        node's P × max(1, scale of rank 0 there) (q <= 1), and it opens a new depth."""
        s = self.shape
        if self.done or len(self.nodes) >= s.max_nodes or self.depth + 1 >= s.max_depth:
            return False
        d = self.depth + 1
        best = max(self.path_p(i) for i in self.frontier())
        return s.pays(best * min(1.0, s.scale(d, 0)), len(self.nodes), new_depth=d > 0)

    def offer(self, parent: int, candidates: Sequence[tuple[int, float]], row=None) -> None:
        """The children `parent` could have, in its rank order: (token, q(token)), distinct
        tokens (at most max_width are considered)."""
        seen = set()
        for t, _ in candidates:
            if t in seen:
                raise ValueError(f"candidate children of node {parent} repeat token {t}")
            seen.add(t)
        self._offers[parent] = (list(candidates[:self.shape.max_width]), row)

    def grow(self) -> list[int]:
        """Add the next depth's nodes, best-first by P (each parent's children in rank order),
        while they pay and fit. Returns the indices of the nodes added."""
        s = self.shape
        d = self.depth + 1
        offers, self._offers = self._offers, {}
        if self.done or d >= s.max_depth:
            self.done = True
            return []
        heap: list[tuple[float, int, int]] = []   # (-P, parent order, rank) of each next child

        def push(k: int, parent: int, rank: int) -> None:
            cands = offers[parent][0]
            if rank < len(cands):
                a = min(1.0, max(0.0, cands[rank][1]) * s.scale(d, rank))
                heapq.heappush(heap, (-self.path_p(parent) * a, k, rank))

        parents = [p for p in self.frontier() if p in offers]
        for k, p in enumerate(parents):
            push(k, p, 0)
        chosen: list[tuple[int, int, float]] = []     # (parent order, rank, P)
        while heap and len(self.nodes) + len(chosen) < s.max_nodes:
            neg_p, k, rank = heap[0]
            if not s.pays(-neg_p, len(self.nodes) + len(chosen), new_depth=not chosen and d > 0):
                break
            heapq.heappop(heap)
            chosen.append((k, rank, -neg_p))
            push(k, parents[k], rank + 1)
        if not chosen:
            self.done = True
            return []
        chosen.sort()                                  # by parent, then rank: the wire order
        added = []
        for k, rank, p in chosen:
            parent = parents[k]
            cands, row = offers[parent]
            token, q = cands[rank]
            idx = len(self.nodes)
            self.nodes.append(Node(token, parent, d, rank, float(q), p, row))
            if parent != ROOT:
                self.nodes[parent].children.append(idx)
            added.append(idx)
        self.depth = d
        if len(self.nodes) >= s.max_nodes or d + 1 >= s.max_depth:
            self.done = True
        return added

    # --- reading the tree -----------------------------------------------------------------------
    @property
    def parents(self) -> list[int]:
        return [n.parent for n in self.nodes]

    def main_path(self) -> list[int]:
        """From the root, the lowest-index child each time: the drafter's own chain."""
        path: list[int] = []
        kids = [i for i, n in enumerate(self.nodes) if n.parent == ROOT][:1]
        while kids:
            path.append(kids[0])
            kids = self.nodes[kids[0]].children[:1]
        return path


def grow(shape: Shape, children: Callable[[list[int]], Sequence[tuple[int, float]]]) -> TreeGrower:
    """A whole tree offline: `children(path_tokens)` gives a node's candidates (token, q) in
    rank order from the tokens on the path from the root. For tests and what-if analysis; the
    drafter drives TreeGrower itself, one decode per depth."""
    g = TreeGrower(shape)
    g.offer(ROOT, children([]))
    while True:
        added = g.grow()
        if not added or g.done or not g.worth_decoding():
            return g
        for i in added:
            g.offer(i, children(path_tokens(g, i)))


def path_tokens(g: TreeGrower, i: int) -> list[int]:
    out = []
    while i != ROOT:
        out.append(g.nodes[i].token)
        i = g.nodes[i].parent
    return out[::-1]


def check_parents(parents: Sequence[int], first_node: int, limit: int, max_depth: int,
                  depths: list[int] | None = None) -> list[int]:
    """The wire rules for a batch of tree nodes (first_node.. of a round): each parent in
    [-1, first_node + i), at most `limit` nodes, depth < max_depth. `depths` holds the depths of
    the round's earlier nodes (extended in place); returns it. Raises ValueError naming the
    rule broken (the caller maps it to its error code)."""
    depths = [] if depths is None else depths
    if first_node != len(depths):
        raise ValueError(f"first_node {first_node} != {len(depths)} nodes received")
    if first_node + len(parents) > limit:
        raise OverflowError(f"{first_node + len(parents)} nodes > limit {limit}")
    for i, p in enumerate(parents):
        if not ROOT <= p < first_node + i:
            raise ValueError(f"parents[{i}] = {p} outside [-1, {first_node + i})")
        d = 0 if p == ROOT else depths[p] + 1
        if d >= max_depth:
            raise OverflowError(f"node {first_node + i} at depth {d} >= limit {max_depth}")
        depths.append(d)
    return depths
