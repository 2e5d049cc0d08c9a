"""Sampling: temperature, top_k, top_p and seed. temperature 0 (the default) is greedy; with a
seed, a sampled output is reproducible — in every mode, since all of them sample the target's
distribution.

    python examples/sampling.py [tcp://127.0.0.1:5550]
"""

from _endpoint import ENDPOINT

from tandem import Client

opts = dict(temperature=0.8, top_k=50, top_p=0.95, max_tokens=10)
with Client(ENDPOINT) as c:
    a = c.complete("My favourite animal is", seed=7, **opts)
    b = c.complete("My favourite animal is", seed=7, **opts)
    other = c.complete("My favourite animal is", seed=8, **opts)
    print(f"seed 7: {a.text!r}\nseed 7: {b.text!r}  (same: {a.token_ids == b.token_ids})")
    print(f"seed 8: {other.text!r}")
    assert a.token_ids == b.token_ids
