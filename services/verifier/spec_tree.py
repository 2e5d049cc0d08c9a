"""Tree rounds of a speculative session on the verifier (the wire format is DraftBatch's
docstring in common/protocol.py).

A tree round's nodes arrive in batches (in order, contiguous, `first_node` = nodes received so
far) and are checked as they arrive: parents earlier, siblings distinct, node and depth limits.
At the NAV (`VerifyRequest.nodes`) the session feeds the root's token and every node in ONE
forward (common/runner.Segment.positions / .ancestors: each node sees the cache and its
ancestors, at position start + depth), then `walk` descends from the root, one
`spec_verify.tree_choose` per node, to the accepted path and the target's token after it. Only
that path's K/V survives: its rows move to consecutive positions (SessionKV.move_rows), the rest
is truncated.

Nothing here mutates a round until a batch has passed every check, so a bad tree is an Error
reply and the session goes on as before it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from common import protocol
from common import tree as trees
from common.protocol import ProtocolError, Sampling
from services.verifier import spec_verify


@dataclass
class TreeRound:
    id: int
    start: int                      # position of the root's children (= committed tokens C)
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    kids: dict[int, list[int]] = field(default_factory=dict)   # node (-1 root) -> children
    q_ids: list[np.ndarray | None] = field(default_factory=list)
    q_probs: list[np.ndarray | None] = field(default_factory=list)
    nodes: int | None = None        # the NAV's node count: closed, ready to verify
    fed: bool = False               # its forward is in flight or done

    def append(self, msg: protocol.DraftBatch, q_ids, q_probs, max_nodes: int,
               max_depth: int) -> None:
        """Take a batch of this round's nodes (a resent one is checked and ignored); raises
        ProtocolError, changing nothing, on a batch that breaks a tree rule."""
        if msg.start != self.start:
            raise ProtocolError(protocol.BAD_FIELD, f"tree round {self.id} starts at "
                                                    f"{self.start}, batch says {msg.start}",
                                field="start")
        have, first = len(self.tokens), msg.first_node
        if first > have:
            raise ProtocolError(protocol.BAD_FIELD, f"tree round {self.id}: batch starts at "
                                                    f"node {first}, {have} received (a batch is "
                                                    f"missing)", field="first_node")
        skip = have - first
        for i in range(min(skip, len(msg.token_ids))):     # a resend overlaps what we have
            g = first + i
            if (msg.token_ids[i], msg.parents[i]) != (self.tokens[g], self.parents[g]):
                raise ProtocolError(protocol.BAD_FIELD, f"tree round {self.id}: node {g} resent "
                                                        f"as ({msg.token_ids[i]}, parent "
                                                        f"{msg.parents[i]}), was ({self.tokens[g]},"
                                                        f" parent {self.parents[g]})",
                                    field="parents")
        new = list(range(skip, len(msg.token_ids)))
        if not new:
            return
        if self.nodes is not None:
            raise ProtocolError(protocol.BAD_FIELD, f"tree round {self.id} is closed (its NAV "
                                                    f"arrived)", field="round")
        if have + len(new) > max_nodes:
            raise ProtocolError(protocol.TOO_LARGE, f"tree round {self.id} would have "
                                                    f"{have + len(new)} nodes > limit {max_nodes} "
                                                    f"(max_tree_nodes)", field="parents")
        depths = list(self.depths)
        sibling_tokens = {p: {self.tokens[c] for c in cs} for p, cs in self.kids.items()}
        for i in new:
            g, p, t = first + i, msg.parents[i], msg.token_ids[i]
            if not -1 <= p < g:
                raise ProtocolError(protocol.BAD_FIELD, f"parents[{i}] = {p}: node {g}'s parent "
                                                        f"must be -1 (the root) or an earlier "
                                                        f"node", field="parents")
            d = 0 if p < 0 else depths[p] + 1
            if d + 1 > max_depth:
                raise ProtocolError(protocol.TOO_LARGE, f"tree round {self.id}: node {g} at depth"
                                                        f" {d + 1} > limit {max_depth} "
                                                        f"(max_tree_depth)", field="parents")
            seen = sibling_tokens.setdefault(p, set())
            if t in seen:
                raise ProtocolError(protocol.BAD_FIELD, f"tree round {self.id}: node {g} repeats "
                                                        f"token {t} among the children of "
                                                        f"{'the root' if p < 0 else f'node {p}'}",
                                    field="parents")
            seen.add(t)
            depths.append(d)
        for i in new:
            g, p = first + i, msg.parents[i]
            self.tokens.append(msg.token_ids[i])
            self.parents.append(p)
            self.kids.setdefault(p, []).append(g)
            self.q_ids.append(None if q_ids is None else q_ids[i])
            self.q_probs.append(None if q_probs is None else q_probs[i])
        self.depths = depths

    def close(self, nodes: int) -> None:
        """The NAV: verify nodes [0, nodes), which must be every node received."""
        if nodes != len(self.tokens) or (self.nodes is not None and nodes != self.nodes):
            raise ProtocolError(protocol.BAD_FIELD, f"tree round {self.id}: NAV for {nodes} "
                                                    f"nodes, {len(self.tokens)} received",
                                field="nodes")
        self.nodes = nodes

    def attention(self, lead: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment positions / ancestors for [root token] (lead = 1; 0 when the cache holds
        it already) + every node."""
        return trees.attention(self.parents, lead)

    def main_path(self) -> list[int]:
        return trees.main_path(self.parents)

    def walk(self, rows: torch.Tensor, s: Sampling, mask=None) -> tuple[list[int], int]:
        """The accepted root path and the target's token after it. rows[0] is the root token's
        logits row (predicting position start), rows[1 + i] node i's. `mask(path_tokens, row)`:
        the row under an output constraint after the path's tokens (None: no constraint)."""
        path: list[int] = []
        node = -1
        while True:
            kids = self.kids.get(node, [])
            first = kids[0] if kids else None
            row = rows[node + 1]
            if mask is not None:
                row = mask([self.tokens[i] for i in path], row)
            step = spec_verify.tree_choose(
                row, [self.tokens[k] for k in kids], s, self.start + len(path),
                None if first is None else self.q_ids[first],
                None if first is None else self.q_probs[first])
            if step.child is None:
                return path, step.token
            node = kids[step.child]
            path.append(node)
