"""Choosing the next token from logits: greedy, or temperature / top-k / top-p with seeded,
position-keyed randomness (so a request with a seed is reproducible whatever the batching).

`target_probs` gives the distribution a sampling configuration actually samples from; the
speculative verifier compares it with the draft distribution.
"""

from __future__ import annotations

import torch

from common.protocol import Sampling


def is_greedy(s: Sampling) -> bool:
    return s.temperature <= 0.0


def target_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p (float32)."""
    x = logits.float() / max(s.temperature, 1e-6)
    if s.top_k and 0 < s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if s.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
        drop_sorted = (cum - sorted_p) >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def generator(s: Sampling, position: int, stream: int = 0) -> torch.Generator:
    """A generator keyed by (seed, position, stream): the same draw whatever else ran before.
    `stream` separates independent draws at one position (accept test vs resample)."""
    g = torch.Generator()
    seed = s.seed if s.seed is not None else torch.seed()
    g.manual_seed((seed * 1_000_003 + position * 7919 + stream) % (2**63 - 1))
    return g


def sample(logits: torch.Tensor, s: Sampling, position: int) -> int:
    """One token from a logits row [V] for absolute position `position`."""
    if is_greedy(s):
        return int(torch.argmax(logits).item())
    probs = target_probs(logits, s)
    return int(torch.multinomial(probs, 1, generator=generator(s, position)).item())
