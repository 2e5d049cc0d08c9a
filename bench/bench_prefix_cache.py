"""Turn-2 time to first token with and without the verifier's prefix cache.

A chat's second turn re-sends the first turn's prompt and answer. Each repetition runs turn 1
(a ~1000-token passage and a question, its own text so repetitions share nothing), then turn 2
(turn 1 + its answer + a follow-up) either as it comes (the cache holds turn 1's rows) or after
emptying the cache; the two alternate, so drift on a shared machine hits both alike. Reported:
the median TTFT of turn 2 each way, from the dispatcher's stats, over the in-process stack.

    python -m bench.bench_prefix_cache --reps 5 --mode cloud-only
"""

from __future__ import annotations

import argparse
import json
import statistics

PASSAGE = ("Tandem serves one language model across an edge device and a cloud server. The edge "
           "drafts tokens with a small model, the cloud verifies them in one pass, and the output "
           "is exactly what the large model alone would have written. ")


def passage(tokenizer, rep: int, n_tokens: int) -> list[int]:
    text, ids = f"Conversation {rep}.", []
    while len(ids) < n_tokens:
        text += f" Section {len(ids) // 40}. {PASSAGE}"
        ids = tokenizer.encode(text + "\nQuestion: what does the edge do?")
    return ids


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--mode", default="cloud-only", choices=["cloud-only", "spec"])
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from common import models
    from stack.inprocess import BackgroundStack

    tokenizer = AutoTokenizer.from_pretrained(str(models.prepare_all().target))
    stack = BackgroundStack()
    verifier = stack.stack.services["verifier"]
    cache = verifier.prefix_cache()
    ttft: dict[str, list[float]] = {"cache": [], "no cache": []}
    cached: dict[str, list[int]] = {"cache": [], "no cache": []}
    try:
        for rep in range(2 * args.reps):
            way = ("cache", "no cache")[rep % 2]
            turn1 = passage(tokenizer, rep, args.prefix_tokens)
            kw = dict(mode=args.mode, max_tokens=args.answer_tokens, stop_at_eos=False,
                      deadline_s=600)
            answer = stack.complete(turn1, **kw).token_ids
            turn2 = turn1 + answer + tokenizer.encode("\nQuestion: and the cloud?")
            stack.call(_settle(verifier, cache, clear=way == "no cache"))
            r = stack.complete(turn2, **kw)
            ttft[way].append(r.stats["ttft_s"])
            cached[way].append(r.stats["cached_tokens"])
    finally:
        stack.close()
    print(json.dumps({"mode": args.mode, "turn2_prompt_tokens": len(turn2),
                      "median_ttft_s": {k: statistics.median(v) for k, v in ttft.items()},
                      "ttft_s": ttft, "cached_tokens": cached}, indent=1))


def _settle(verifier, cache, clear: bool):
    """Wait until turn 1's session is closed on the verifier (its rows cached), then empty
    the cache if asked."""
    async def settle(_stack):
        import asyncio

        for _ in range(500):
            if not verifier.sessions.ids():
                break
            await asyncio.sleep(0.01)
        if clear:
            cache.clear()
    return settle


if __name__ == "__main__":
    main()
