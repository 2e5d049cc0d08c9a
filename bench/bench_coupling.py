"""`tandem bench coupling`: accepted draft tokens per verification round under the two sampling
couplings, on the same held-out prompts and seeds.

* rejection: speculative sampling, a draft x ~ q accepted with min(1, p(x)/q(x)) (1 - TV(p, q)
  per position in expectation);
* gumbel: the draft argmax(log q + g) accepted iff it equals the target's argmax(log p + g)
  (P[argmax agree] per position), the output then a function of seed and prompt only.

Each (prompt, seed) runs under both couplings, interleaved (the order alternates per pair), in
spec mode with the same fixed-length policy (vanilla, n = --draft-length: the rounds' lengths do
not depend on timing, so accepted tokens per round compares the couplings alone) and, with
--policies, others. The whole stack runs in this process (stack/inprocess.py; no link emulation:
acceptance does not depend on the link). Prompts: the workload's test split (tuning split never
used). Reported: mean accepted tokens per round per coupling with 95 % bootstrap intervals, and
the paired ratio gumbel / rejection with its interval.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench import stats, workloads
from bench.report import write_json

COUPLINGS = ("rejection", "gumbel")


async def _run(args, prompts: dict[str, list[int]]) -> list[dict]:
    from stack.inprocess import InProcessStack
    rows = []
    async with InProcessStack(threads=args.threads) as stack:
        async with stack.client(timeout_s=600) as c:
            pairs = [(name, seed) for name in prompts for seed in range(args.seeds)]
            for k, (name, seed) in enumerate(pairs):
                for policy in args.policies.split(","):
                    order = COUPLINGS if k % 2 == 0 else COUPLINGS[::-1]
                    for coupling in order:
                        knobs = {"n": float(args.draft_length)} if policy == "vanilla" else None
                        r = await c.complete(prompts[name], mode="spec", policy=policy,
                                             policy_knobs=knobs, max_tokens=args.max_tokens,
                                             stop_at_eos=False, temperature=args.temperature,
                                             top_p=args.top_p, seed=seed,
                                             sampling_coupling=coupling, deadline_s=600)
                        st = r.stats
                        rows.append({"prompt": name, "seed": seed, "policy": policy,
                                     "coupling": coupling, "rounds": st["rounds"],
                                     "draft_tokens": st["draft_tokens"],
                                     "accepted_tokens": st["accepted_tokens"],
                                     "accepted_tokens_per_round":
                                         st["accepted_tokens"] / st["rounds"] if st["rounds"]
                                         else 0.0})
                        print(f"[{len(rows)}] {name} seed {seed} {policy} {coupling}: "
                              f"{rows[-1]['accepted_tokens_per_round']:.2f} accepted/round",
                              file=sys.stderr, flush=True)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        by = {c: [r for r in rows if r["policy"] == policy and r["coupling"] == c]
              for c in COUPLINGS}
        keys = [(r["prompt"], r["seed"]) for r in by["rejection"]]
        assert keys == [(r["prompt"], r["seed"]) for r in by["gumbel"]]
        per = {c: [r["accepted_tokens_per_round"] for r in by[c]] for c in COUPLINGS}
        s = {"policy": policy, "pairs": len(keys)}
        for c in COUPLINGS:
            xs = per[c]
            s[c] = {"accepted_tokens_per_round": sum(xs) / len(xs),
                    "ci95": stats.mean_ci(xs),
                    "acceptance_rate": sum(r["accepted_tokens"] for r in by[c])
                    / max(1, sum(r["draft_tokens"] for r in by[c]))}
        s["gumbel_over_rejection"] = (s["gumbel"]["accepted_tokens_per_round"]
                                      / s["rejection"]["accepted_tokens_per_round"])
        s["ratio_ci95"] = stats.ratio_ci(per["gumbel"], per["rejection"])
        out.append(s)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench coupling", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="humaneval", choices=workloads.WORKLOADS)
    ap.add_argument("--prompts", type=int, default=8, help="test-split prompts used (0 = all)")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--draft-length", type=int, default=8, help="vanilla's fixed draft length")
    ap.add_argument("--policies", default="vanilla", help="comma-separated spec policies")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="3 prompts, 1 seed, 24 tokens")
    ap.add_argument("--json", help="write rows and summary here")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.seeds, args.max_tokens = 3, 1, 24
    from common import models
    from transformers import AutoTokenizer
    paths = models.prepare_all()
    tok = AutoTokenizer.from_pretrained(str(paths.target))
    _, test = workloads.split(workloads.load(args.workload))
    test = test[:args.prompts] if args.prompts else test
    prompts = workloads.encode(test, tok)
    rows = asyncio.run(_run(args, prompts))
    summary = summarise(rows)
    print(f"{'policy':10s} {'coupling':10s} {'accepted/round':>15s} {'95% CI':>17s} "
          f"{'accept rate':>11s}")
    for s in summary:
        for c in COUPLINGS:
            lo, hi = s[c]["ci95"]
            print(f"{s['policy']:10s} {c:10s} {s[c]['accepted_tokens_per_round']:15.3f} "
                  f"[{lo:6.3f}, {hi:6.3f}] {s[c]['acceptance_rate']:11.3f}")
        lo, hi = s["ratio_ci95"]
        print(f"{s['policy']:10s} gumbel/rejection = {s['gumbel_over_rejection']:.3f} "
              f"[{lo:.3f}, {hi:.3f}] over {s['pairs']} (prompt, seed) pairs")
    write_json(args.json, "coupling", "none", summary, rows=rows, args=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
