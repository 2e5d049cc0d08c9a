"""Choosing the next token from logits: greedy, or temperature / top-k / top-p with seeded,
position-keyed randomness (so a request with a seed is reproducible whatever the batching).

`target_probs` gives the distribution a sampling configuration actually samples from; the
speculative verifier compares it with the draft distribution.

Two couplings between the drafter's and the target's randomness (`Sampling.coupling`):
* "rejection": speculative (rejection) sampling; a plain draw from p is a multinomial keyed by
  (seed, position). The tokens depend on the draft (a rejected draft's residual resample).
* "gumbel": the token at a position is argmax(log p + g(seed, position)) (`gumbel_token`), an
  exact sample from p whatever drafted it, so the output depends only on the seed and the prompt
  (common/gumbel.py). A draft is accepted exactly when it equals that token.

torch is imported by the functions that compute on logits, not by the module: the dispatcher
(an edge process) needs only the request rules (`resolved`, `is_greedy`) and runs without torch,
about 1.3 s and 180 MB less per dispatcher start.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import msgspec

from common import gumbel
from common.protocol import LOGPROB_FLOOR, Sampling, TokenLogprob

if TYPE_CHECKING:
    import torch

# The coupling of a request that names none (Sampling.coupling None). The dispatcher fills in its
# configured default (DispatcherConfig.sampling_coupling) before a request reaches the other
# services, so this is what a direct client of the verifier or suffix gets. Rejection sampling
# accepts more drafts per round (1 - TV against P[argmax agree]; bench/bench_coupling.py).
DEFAULT_COUPLING = "rejection"


def is_greedy(s: Sampling) -> bool:
    return s.temperature <= 0.0


def coupling(s: Sampling) -> str:
    """The request's coupling: "gumbel" or "rejection" (greedy requests need none)."""
    return s.coupling or DEFAULT_COUPLING


def resolved(s: Sampling, default_coupling: str) -> Sampling:
    """A request's sampling as the services downstream of the dispatcher get it: the coupling
    named (the request's, else `default_coupling`), and a seed when the Gumbel coupling samples
    (drafter and target must share one; the client named none, so one is drawn)."""
    c = s.coupling or default_coupling
    seed = s.seed
    if c == "gumbel" and not is_greedy(s) and seed is None:
        seed = secrets.randbits(62)
    if c == s.coupling and seed == s.seed:
        return s
    return msgspec.structs.replace(s, coupling=c, seed=seed)


def is_gumbel(s: Sampling) -> bool:
    """Sampling under the Gumbel coupling. It needs a seed shared by drafter and target: the
    dispatcher gives every request one; a seedless request sent straight to a service samples
    with the rejection coupling's draws instead."""
    return not is_greedy(s) and coupling(s) == "gumbel" and s.seed is not None


def target_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p (float32)."""
    import torch

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
    import torch

    g = torch.Generator()
    seed = s.seed if s.seed is not None else torch.seed()
    g.manual_seed((seed * 1_000_003 + position * 7919 + stream) % (2**63 - 1))
    return g


def gumbel_token(logits: torch.Tensor, s: Sampling, position: int) -> int:
    """The Gumbel-max token at absolute `position`: argmax(log p + g(seed, position)), with p the
    warped target distribution (temperature / top-k / top-p; -inf off its support). An exact
    sample from p that depends only on (seed, position, p). Needs a seed (the dispatcher gives
    every gumbel request one)."""
    import torch

    if s.seed is None:
        raise ValueError("the gumbel coupling needs a seed")
    log_p = torch.log(target_probs(logits.float().cpu(), s)).numpy()
    return gumbel.argmax_token(log_p, gumbel.noise(s.seed, position, log_p.shape[-1]))


def sample(logits: torch.Tensor, s: Sampling, position: int) -> int:
    """One token from a logits row [V] for absolute position `position`."""
    import torch

    if is_greedy(s):
        return int(torch.argmax(logits).item())
    if is_gumbel(s):
        return gumbel_token(logits, s, position)
    probs = target_probs(logits, s)
    return int(torch.multinomial(probs, 1, generator=generator(s, position)).item())


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The log-probability of `token` and the `top` most likely tokens under the unmodified
    distribution of a logits row [V]: log_softmax of the raw logits (before temperature, top-k
    and top-p, as vLLM's default "raw logprobs"), clamped at LOGPROB_FLOOR."""
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1).clamp_(min=LOGPROB_FLOOR)
    if top:
        values, ids = torch.topk(lp, top)
        top_ids, top_lps = ids.tolist(), values.tolist()
    else:
        top_ids, top_lps = [], []
    return TokenLogprob(min(float(lp[token]), 0.0), top_ids, [min(v, 0.0) for v in top_lps])
