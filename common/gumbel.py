"""Gumbel noise keyed by (seed, absolute position): the shared randomness of the Gumbel-max
sampling coupling (`Sampling.coupling = "gumbel"`, docs/design.md).

The Gumbel-max trick: with g_i i.i.d. standard Gumbel, argmax_i(log p_i + g_i) is an exact
sample from p. If every service that picks a token at position n uses the *same* noise vector
g(seed, n) — the cloud's target (verifier, suffix) and the edge's drafter alike — then

* the target's token at n is argmax(log p + g): an exact draw from p, which depends only on the
  seed, n and the target's distribution there, never on which drafter, policy, batching or link
  timing led to it (output = f(seed, prompt));
* the drafter drafts argmax(log q + g) with the same g, and a draft is accepted exactly when it
  equals the target's token (P[accept] = P[argmax agree], the coupling's acceptance).

The noise is numpy only (no torch: the edge drafter does not need it) and bit-identical
wherever it is computed: numpy's Philox4x64 counter-based generator keyed by (seed, position),
float64 uniforms over the vocabulary (tests/unit/test_gumbel_coupling.py pins a checksum, so a
numpy that changed the stream would be caught rather than silently desynchronise edge and cloud).
"""

from __future__ import annotations

import numpy as np

COUPLINGS = ("gumbel", "rejection")   # Sampling.coupling's values
_MASK64 = (1 << 64) - 1


def uniforms(seed: int, position: int, vocab: int) -> np.ndarray:
    """float64 [vocab] uniforms in [0, 1), a pure function of (seed, position, vocab)."""
    key = np.array([int(seed) & _MASK64, int(position) & _MASK64], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key)).random(int(vocab))


def noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """float64 [vocab] standard Gumbel noise g = -log(-log u) for (seed, position). A u of
    exactly 0 (probability 2^-53 per entry) gives -inf: that token can never win the argmax."""
    u = uniforms(seed, position, vocab)
    with np.errstate(divide="ignore"):
        return -np.log(-np.log(u))


def argmax_token(log_probs: np.ndarray, g: np.ndarray) -> int:
    """argmax(log p + g) over a row; -inf entries of log p (outside the support) never win."""
    return int(np.argmax(np.asarray(log_probs, dtype=np.float64) + g))
