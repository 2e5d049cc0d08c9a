"""Speculative mode (PipeSD): the edge's draft model proposes tokens, the cloud's target
verifies them in one pass. Output is exactly the target's; the options change only speed.

    policy          pipesd (default) | pipesd-stream | vanilla | hsl | edgellm | oracle-trigger
    nav_thresholds  (R1, R2) of the dual-threshold verification trigger for this request,
                    each in (0, 1] (default: the dispatcher's, tuned by Bayesian optimisation)
    allow_edge_only keep drafting on the edge alone while the cloud is unreachable; those
                    tokens arrive with Chunk.degraded = True (and stats.degraded_tokens)

    python examples/spec_options.py [tcp://127.0.0.1:5550]
"""

from _endpoint import ENDPOINT

from tandem import Client

PROMPT = "def add(a, b):\n"

with Client(ENDPOINT) as c:
    ref = c.complete(PROMPT, mode="cloud-only", max_tokens=12, stop_at_eos=False)
    for policy in ("pipesd", "vanilla"):
        r = c.complete(PROMPT, mode="spec", policy=policy, max_tokens=12, stop_at_eos=False)
        s = r.stats
        print(f"{policy:8s} rounds {s.rounds}, acceptance {s.acceptance_rate:.2f}, "
              f"mean draft {s.mean_draft_length:.1f}, cloud forwards/token "
              f"{s.cloud_forwards_per_token:.2f}, same as cloud-only: {r.token_ids == ref.token_ids}")

    chunks = list(c.generate(PROMPT, mode="spec", max_tokens=12, stop_at_eos=False,
                             nav_thresholds=(0.3, 0.6), allow_edge_only=True))
    s = c.last_result.stats
    print(f"nav_thresholds (0.3, 0.6): thresholds used {s.thresholds}, "
          f"trigger reasons {s.nav_reasons}, degraded tokens {s.degraded_tokens} "
          f"(any degraded chunk: {any(ch.degraded for ch in chunks)})")
