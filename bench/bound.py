"""The clairvoyant bound: the least time any policy could have taken to produce a measured trace.

`oracle-trigger` (a policy the bench runs) verifies at the first draft the target rejects, but it
is one policy among others, with no proactive drafting and no say over batching: other policies
can beat it, so it is no bound. This module computes one offline, from a measured run:

Trace.  The target's greedy output t_0 … t_{n−1} and, for every position j, whether the drafter,
given the committed prefix t_<j, drafts t_j itself: ``match[j]``. The drafter's and target's
choices are deterministic under greedy decoding, so from committed position i the drafter's
tokens agree with the target's for exactly m(i) tokens (the run of True from i) and differ at
i + m(i).

Costs (measured in the run): γ seconds per drafted token; a batch of b tokens occupies the
uplink α + β·b (α excludes propagation, as services/dispatcher/spec/link_model.py defines it); a
one-way latency each way (``rtt_s`` = up + down); a verification forward pass over the last
batch of b draft tokens costs ``verify_s[b]`` (b = 0: one forward that only yields the target's
token, as a cloud-only step). Prompt prefill is not counted (the bound is lower for it: a valid
bound, a little loose; ``fixed_s`` adds any known floor).

Actions, from committed position i with the drafter in step with the target:

* **stall round** of k draft tokens, 0 ≤ k ≤ m(i) (drafting beyond m(i) is wasted time):
  the k tokens are drafted back to back and sent in batches (any batch plan); the last batch is
  verified as it arrives (earlier batches were verified while the later ones were in flight —
  streaming verification, free on the critical path); the result returns, and the target's token
  at i + k (bonus or correction) commits with them. Time: S(k) + rtt, where S(k) is the best
  batch plan's time until the last batch is verified:

      dp[0] = 0,   dp[j] = min_{h<j} max(dp[h], γ·j) + α + β·(j − h)         (PipeSD Algorithm 1)
      S(k)  = min_{h<k} max(dp[h], γ·k) + α + β·(k − h) + verify_s[k − h],    S(0) = α + verify_s[0]

  Progress: k + 1 tokens (the last round may end in a bonus token past n, which is dropped).
* **overlapped round** of k < m(i) draft tokens (proactive drafting): the target's token at i + k
  is the drafter's own next guess, so the drafter never waits for the verification: only its
  drafting, γ·(k + 1), lies on the critical path (the link and the verifier are taken to be
  free, which can only lower the bound). Not as the last round: the output's end must be verified.
* **cloud run** of j ≥ 1 tokens: the target generates alone (as cloud-only does):
  α + rtt + j·verify_s[0].

The bound is the cheapest sequence of actions that commits all n tokens, a DP over the committed
position (``bound``), O(n · (max m + n + max m²)). `brute_force` enumerates every action sequence
and every batch plan, for the tests. Any chain policy (one round's draft at a time, each round
ending in a verification, proactive drafting or not, streaming or not, any batching) takes at
least this long on the trace; a measured TPT under the bound means a wrong measurement or a bug.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

__all__ = ["Costs", "match_runs", "batch_time", "bound", "brute_force", "plan_time"]


@dataclass(frozen=True)
class Costs:
    gamma_s: float                  # drafting time per token
    alpha_s: float                  # uplink start-up cost per batch (no propagation)
    beta_s: float                   # uplink cost per token
    rtt_s: float                    # one-way latency up + one-way latency down
    verify_s: tuple[float, ...]     # verify forward cost by last-batch size b = 0, 1, ...
    fixed_s: float = 0.0            # a known floor outside the rounds (e.g. prefill), added once

    def __post_init__(self):
        for name in ("gamma_s", "alpha_s", "beta_s", "rtt_s", "fixed_s"):
            v = getattr(self, name)
            if not v >= 0:   # also rejects NaN
                raise ValueError(f"{name} must be >= 0, got {v!r}")
        if not self.verify_s or any(not v >= 0 for v in self.verify_s):
            raise ValueError("verify_s needs at least verify_s[0], all >= 0")

    def verify(self, b: int) -> float:
        """verify_s[b]; beyond the table, extended linearly from its last two entries."""
        v = self.verify_s
        if b < len(v):
            return v[b]
        slope = max(0.0, v[-1] - v[-2]) if len(v) > 1 else 0.0
        return v[-1] + slope * (b - len(v) + 1)


def match_runs(match: Sequence[bool]) -> list[int]:
    """m(i): how many consecutive draft tokens from position i equal the target's."""
    m = [0] * (len(match) + 1)
    for i in range(len(match) - 1, -1, -1):
        m[i] = m[i + 1] + 1 if match[i] else 0
    return m[: len(match)]


def batch_time(k: int, c: Costs) -> float:
    """S(k): the least time from the first drafted token's start until the last batch of k
    back-to-back drafted tokens is verified, over every batch plan (Algorithm 1 + the last
    batch's verify cost)."""
    if k == 0:
        return c.alpha_s + c.verify(0)
    dp = [0.0] * (k + 1)
    for j in range(1, k):
        dp[j] = min(max(dp[h], c.gamma_s * j) + c.alpha_s + c.beta_s * (j - h) for h in range(j))
    return min(max(dp[h], c.gamma_s * k) + c.alpha_s + c.beta_s * (k - h) + c.verify(k - h)
               for h in range(k))


def bound(match: Sequence[bool], c: Costs) -> float:
    """The least time (seconds) any policy could take to commit len(match) tokens."""
    n = len(match)
    m = match_runs(match)
    s_cache: dict[int, float] = {}

    def s(k: int) -> float:
        if k not in s_cache:
            s_cache[k] = batch_time(k, c)
        return s_cache[k]

    best = [0.0] * (n + 1)   # best[i]: least time to commit positions i … n−1
    for i in range(n - 1, -1, -1):
        b = float("inf")
        for k in range(0, min(m[i], n - i) + 1):                     # stall rounds
            b = min(b, s(k) + c.rtt_s + best[min(n, i + k + 1)])
        for k in range(0, min(m[i] - 1, n - i - 2) + 1):             # overlapped rounds
            b = min(b, c.gamma_s * (k + 1) + best[i + k + 1])
        for j in range(1, n - i + 1):                                # cloud runs
            b = min(b, c.alpha_s + c.rtt_s + j * c.verify(0) + best[i + j])
        best[i] = b
    return best[0] + c.fixed_s


# -- brute force, for the tests -------------------------------------------------------------------

def plan_time(plan: Sequence[int], c: Costs) -> float:
    """One batch plan (batch sizes, in order) of back-to-back drafted tokens: the time until its
    last batch is verified, by PipeSD's recurrences τ_c(k) = max(τ_c(k−1) + t_c(k−1),
    τ_ag(k) + t_ag(k))."""
    if not plan:
        return c.alpha_s + c.verify(0)
    link_free = 0.0
    drafted = 0
    for b in plan:
        drafted += b
        link_free = max(link_free, c.gamma_s * drafted) + c.alpha_s + c.beta_s * b
    return link_free + c.verify(plan[-1])


def _compositions(k: int):
    """Every ordered split of k into positive parts (every batch plan of k tokens)."""
    if k == 0:
        yield ()
        return
    for cuts in itertools.product((False, True), repeat=k - 1):
        plan, size = [], 1
        for cut in cuts:
            if cut:
                plan.append(size)
                size = 1
            else:
                size += 1
        plan.append(size)
        yield tuple(plan)


def brute_force(match: Sequence[bool], c: Costs) -> float:
    """The same minimum by enumerating every action sequence and every batch plan (exponential:
    small traces only). Independent of ``bound``: no Algorithm 1, no shared recurrence."""
    n = len(match)

    def run_from(i: int) -> int:
        r = 0
        while i + r < n and match[i + r]:
            r += 1
        return r

    @lru_cache(maxsize=None)
    def go(i: int) -> float:
        if i >= n:
            return 0.0
        r = run_from(i)
        options = []
        for k in range(0, r + 1):
            if k <= n - i:
                for plan in _compositions(k):
                    options.append(plan_time(plan, c) + c.rtt_s + go(i + k + 1))
            if k < r and i + k + 1 < n:
                options.append(c.gamma_s * (k + 1) + go(i + k + 1))
        for j in range(1, n - i + 1):
            options.append(c.alpha_s + c.rtt_s + j * c.verify(0) + go(i + j))
        return min(options)

    return go(0) + c.fixed_s
