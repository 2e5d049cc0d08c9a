"""Token trees: the shape arithmetic every layer shares, pure and model-free.

A tree round carries nodes 0..N-1 in topological order; parents[i] == -1 for a child of the
round's root (the session's last committed token), else an earlier node's index. Node i sits at
position start + depth(i). The *main path* follows the lowest-index child from the root: the
drafter orders children by preference, so it is the drafter's own chain (common/protocol.py,
DraftBatch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # only `attention` builds tensors: the dispatcher uses the rest without torch
    import torch


def depths(parents: list[int]) -> list[int]:
    """depth(i): 0 for a root child, else depth(parent) + 1 (parents in topological order)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def children(parents: list[int]) -> dict[int, list[int]]:
    """node (-1 = the root) -> its children in index order (the drafter's preference)."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def root_path(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's first child down to `node` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def main_path(parents: list[int]) -> list[int]:
    """From the root, repeatedly the lowest-index child."""
    first_child: dict[int, int] = {}
    for i, p in enumerate(parents):
        first_child.setdefault(p, i)
    path, node = [], -1
    while node in first_child:
        node = first_child[node]
        path.append(node)
    return path


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def attention(parents: list[int], lead: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """What the runner needs for one forward over `lead` chain tokens (the root's token, or
    none) followed by the tree's nodes (common/runner.Segment.positions / .ancestors): each
    token's position offset from the cache length, and the bool [n, n] mask of the new tokens
    each one sees (the lead tokens causally, then a node its lead tokens, ancestors and itself)."""
    import torch

    n = lead + len(parents)
    d = depths(parents)
    positions = torch.tensor(list(range(lead)) + [lead + x for x in d], dtype=torch.long)
    seen = torch.zeros(n, n, dtype=torch.bool)
    seen[:lead, :lead] = torch.ones(lead, lead, dtype=torch.bool).tril()
    seen[lead:, :lead] = True
    for i, p in enumerate(parents):
        row = lead + i
        if p >= 0:
            seen[row, lead:] = seen[lead + p, lead:]
        seen[row, row] = True
    return positions, seen
