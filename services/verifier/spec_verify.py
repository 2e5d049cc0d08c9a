"""Accept or reject one draft token against the target's logits (DESIGN.md §3, Verification).

Pure functions on one position at a time; no model, no session state, so they are tested alone
(tests/unit/test_spec_verify.py) and the verifier's sessions only decide *which* position to check.

* Greedy: the target's token is its argmax; the draft is accepted iff it is that token.
* Sampling: exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023). With p the
  target's distribution (temperature / top-k / top-p, common/sampling.target_probs) and q the
  drafter's *truncated* distribution, sparse as (ids, probs), a draft x ~ q is accepted with
  probability min(1, p(x) / q(x)); otherwise the token is drawn from norm(max(0, p − q)). Then
  the token at the position is distributed exactly as p whatever q is. q is exactly zero off its
  support, so max(0, p − q) = p there: the residual needs only k subtractions.
* Randomness is keyed by (request seed, position, stream): stream 1 is the acceptance uniform,
  stream 2 the resample, stream 0 a plain draw from p (the bonus token, and cloud-only decode),
  so a seeded request gives the same tokens however its positions were batched.
* Gumbel coupling (`Sampling.coupling = "gumbel"`): the target's token is
  argmax(log p + g(seed, position)) (common/sampling.gumbel_token) and the draft, drafted as
  argmax(log q + g) with the same noise, is accepted iff it is that token: the greedy walk, with
  no q needed. The token never depends on the draft, so the output is the same for every drafter,
  policy and batching.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common import sampling
from common.protocol import Sampling

ACCEPT_STREAM = 1     # generator stream of the acceptance test's uniform
RESAMPLE_STREAM = 2   # generator stream of the residual resample


@dataclass(frozen=True)
class Decision:
    """The target's token at one position, and whether the draft there was that token."""
    token: int
    accepted: bool


def greedy(logits: torch.Tensor, draft: int) -> Decision:
    token = int(torch.argmax(logits).item())
    return Decision(token, token == draft)


def bonus(logits: torch.Tensor, s: Sampling, position: int) -> int:
    """The target's own token at `position` (no draft to test): argmax, or a draw from p."""
    return sampling.sample(logits, s, position)


def speculative(p: torch.Tensor, draft: int, q_ids, q_probs, u: float,
                resample: torch.Generator) -> Decision:
    """Exact speculative sampling of one position.

    p: target probabilities [V] (sums to 1); draft: a token drawn from q; q_ids / q_probs: q's
    support and its probabilities ([k]); u: a uniform draw in [0, 1) independent of the draft;
    resample: the generator for the residual draw."""
    q_ids = torch.as_tensor(np.asarray(q_ids), dtype=torch.long)
    q_probs = torch.as_tensor(np.asarray(q_probs), dtype=torch.float32)
    hit = (q_ids == draft).nonzero()
    q_x = float(q_probs[hit[0, 0]]) if len(hit) else 0.0
    p_x = float(p[draft])
    if q_x > 0.0 and u * q_x < p_x:        # u < p(x)/q(x), i.e. accept with min(1, p/q)
        return Decision(draft, True)
    residual = p.clone()
    residual[q_ids] = torch.clamp(residual[q_ids] - q_probs.to(p.dtype), min=0.0)
    total = float(residual.sum())
    if total <= 0.0:   # p <= q everywhere means p == q: rejection had probability 0 (rounding)
        residual, total = p, float(p.sum())
    token = int(torch.multinomial(residual / total, 1, generator=resample).item())
    return Decision(token, token == draft)


def decide(logits: torch.Tensor, draft: int, s: Sampling, position: int,
           q_ids=None, q_probs=None) -> Decision:
    """Check the draft token at absolute `position` against the target's logits row for it."""
    if sampling.is_greedy(s):
        return greedy(logits, draft)
    if sampling.is_gumbel(s):
        token = sampling.gumbel_token(logits, s, position)
        return Decision(token, token == draft)
    p = sampling.target_probs(logits.float().cpu(), s)   # seeded generators live on the CPU
    u = float(torch.rand(1, generator=sampling.generator(s, position, ACCEPT_STREAM)).item())
    return speculative(p, draft, q_ids, q_probs, u,
                       sampling.generator(s, position, RESAMPLE_STREAM))


def check_q(token_ids: list[int], q_ids: np.ndarray, q_probs: np.ndarray, vocab: int) -> str:
    """Why a batch's sparse q is unusable, or "" when it is fine: shapes [n, k], ids in the
    vocabulary and distinct per row, probabilities finite, >= 0, summing to ~1, and each draft
    token inside its row's support with q > 0 (it was drawn from q)."""
    n = len(token_ids)
    if q_ids.ndim != 2 or q_ids.shape != q_probs.shape or q_ids.shape[0] != n or q_ids.shape[1] < 1:
        return f"q_ids {list(q_ids.shape)} and q_probs {list(q_probs.shape)} must both be [{n}, k]"
    if not np.issubdtype(q_ids.dtype, np.integer):
        return "q_ids must be integers"
    if q_ids.min() < 0 or q_ids.max() >= vocab:
        return f"q_ids outside the vocabulary [0, {vocab})"
    probs = q_probs.astype(np.float64)
    if not np.isfinite(probs).all() or probs.min() < 0:
        return "q_probs must be finite and >= 0"
    sums = probs.sum(axis=1)
    if np.abs(sums - 1.0).max() > 1e-3:
        return f"each q row must sum to 1 (got {sums.min():.4f}..{sums.max():.4f})"
    for i, t in enumerate(token_ids):
        row = q_ids[i]
        if len(np.unique(row)) != len(row):
            return f"q row {i} repeats an id"
        hit = np.nonzero(row == t)[0]
        if len(hit) == 0 or probs[i, hit[0]] <= 0:
            return f"draft token {t} at row {i} is outside its q support"
    return ""


# ---------------------------------------------------------------------------------------------
# Token trees: the target's token at one tree node, given that node's children.
#
# A verifier walks a tree from the root: at each node it asks `tree_choose` for the target's
# token at the next position and which child (if any) carries it; it descends into that child or
# stops there. Greedy: the argmax, matched against the children. Sampling: recursive rejection
# sampling over the siblings (Jeon et al. 2024, "Recursive Speculative Decoding"), the siblings
# having been drawn from q *without replacement* in rank order: child i is accepted with
# probability min(1, p_i(x_i) / q_i(x_i)); on rejection p_{i+1} = norm(max(0, p_i - q_i)) and
# q_{i+1} = q_i without x_i, renormalised; when every child is rejected the token is drawn from
# p_{k+1}. At every step the token is distributed as p_i given that the step is reached, so the
# output is distributed exactly as p (tests/unit/test_spec_verify_tree.py enumerates it). With one
# child this is `speculative` above, with the same random streams, so a chain-shaped tree gives
# the chain's tokens.

TREE_ACCEPT_STREAM = 16   # + sibling rank (>= 1) for the acceptance uniforms of later siblings


@dataclass(frozen=True)
class TreeStep:
    """The target's token at a node's next position, and the rank of the child carrying it
    among the node's children (None: no child does; the walk stops with `token`)."""
    token: int
    child: int | None


def rrs_plan(p: torch.Tensor, children: list[int], q_ids, q_probs
             ) -> tuple[list[float], torch.Tensor]:
    """Recursive rejection sampling's numbers for one node: the acceptance probability of each
    child in rank order (given that the ones before it were rejected) and the distribution
    p_{k+1} a token is drawn from when all are rejected (float64, sums to 1).

    p: the target's probabilities [V]; children: the child tokens in rank order, drawn from q
    without replacement; q_ids / q_probs: the sparse q they were drawn from ([k])."""
    p_i = p.double() / p.double().sum()
    ids = torch.as_tensor(np.asarray(q_ids), dtype=torch.long)
    q_i = torch.as_tensor(np.asarray(q_probs), dtype=torch.float64).clone()
    q_i = q_i / q_i.sum()
    accept: list[float] = []
    for x in children:
        hit = (ids == x).nonzero()
        q_x = float(q_i[hit[0, 0]]) if len(hit) else 0.0
        p_x = float(p_i[x])
        a = min(1.0, p_x / q_x) if q_x > 0.0 else 0.0
        accept.append(a)
        if a >= 1.0:
            break   # accepted for sure: nothing after it is ever reached
        residual = p_i.clone()
        residual[ids] = torch.clamp(p_i[ids] - q_i, min=0.0)
        total = float(residual.sum())
        if total > 0.0:   # (p_i <= q_i everywhere means p_i == q_i: a was 1 up to rounding)
            p_i = residual / total
        if len(hit):
            q_i[hit[0, 0]] = 0.0
        mass = float(q_i.sum())
        if mass <= 0.0:
            break       # q's whole support drafted: no further sibling can exist
        q_i = q_i / mass
    accept += [0.0] * (len(children) - len(accept))
    return accept, p_i


def tree_choose(logits: torch.Tensor, children: list[int], s: Sampling, position: int,
                q_ids=None, q_probs=None) -> TreeStep:
    """The target's token at absolute `position` (logits: its row there), given the drafted
    children of the node before it in rank order and, when sampling, the sparse q they were drawn
    from. A walk step of tree verification; the place for another coupling of target and drafter
    (Gumbel-max: the token is argmax(log p + g), matched against the children as greedy is)."""
    if sampling.is_greedy(s):
        token = int(torch.argmax(logits).item())
        return TreeStep(token, children.index(token) if token in children else None)
    # The Gumbel coupling: the token is argmax(log p + g), whatever was drafted, and the walk
    # matches it against the children as greedy does
    if sampling.is_gumbel(s):
        token = sampling.gumbel_token(logits, s, position)
        return TreeStep(token, children.index(token) if token in children else None)
    if not children:
        return TreeStep(bonus(logits, s, position), None)
    p = sampling.target_probs(logits.float().cpu(), s)
    accept, residual = rrs_plan(p, children, q_ids, q_probs)
    for rank, (x, a) in enumerate(zip(children, accept)):
        stream = ACCEPT_STREAM if rank == 0 else TREE_ACCEPT_STREAM + rank
        u = float(torch.rand(1, generator=sampling.generator(s, position, stream)).item())
        if u < a:
            return TreeStep(x, rank)
    token = int(torch.multinomial(residual.float(), 1,
                                  generator=sampling.generator(s, position, RESAMPLE_STREAM)).item())
    return TreeStep(token, None)
