"""KV memory under pressure: hundreds of long sessions at once against a byte budget.

    tandem bench kv [--sessions 300] [--prompt-tokens 1000] [--budget-gib 1] [--quick]
                    [--json PATH]

A verifier with `--kv-budget-bytes` and a dispatcher, both admitting more sessions than the
budget can hold (`--max-sessions` above `--sessions`), so the budget is what refuses. Two phases:

1. burst: every session at once, each its own 1000-token prompt (nothing to share), clients
   that do not retry: each request is served or answered `busy`; none may fail once admitted.
2. churn: the same number of clients, closed loop, retrying `busy` after a short pause, their
   prompts drawn from a few conversations so that cached prefixes are reused, evicted and
   refused while other sessions decode.

Every served output is compared with transformers' greedy continuation (on a sample of prompts:
the reference costs a full prefill each). The verifier's resident memory is sampled throughout;
the goal: its peak stays within (RSS with the weights loaded and no session) + budget, plus 15 %.
Deployment: verifier and dispatcher as local processes on this machine's cores (one box).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.report import write_json
from stack.launcher import Cluster

GIB = 1 << 30
HEADROOM = 0.15


def prompts(tokenizer, count: int, n_tokens: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of `n_tokens` tokens: numbered words, so no two share more than
    a few leading tokens (no prefix to reuse)."""
    rng = random.Random(seed)
    words = ["river", "stone", "cloud", "lamp", "garden", "engine", "letter", "window", "forest",
             "signal", "harbor", "market", "candle", "bridge", "violin", "meadow"]
    out = []
    for k in range(count):
        ids = tokenizer.encode(f"Session {k}:")
        while len(ids) < n_tokens:
            ids += tokenizer.encode(" " + " ".join(rng.choice(words) for _ in range(64)))
        out.append(ids[:n_tokens])
    return out


class RssSampler:
    def __init__(self, pid: int, every_s: float = 0.1):
        import psutil
        self.proc, self.every_s = psutil.Process(pid), every_s
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.stop.wait(self.every_s)


async def one(endpoint: str, prompt: list[int], n: int, retry: bool, deadline: float) -> dict:
    """A request: served (its tokens), busy (not retried), or failed (and whether mid-stream)."""
    from tandem import AsyncClient, Busy, TandemError
    busy = 0
    async with AsyncClient(endpoint, timeout_s=600, max_retries=0) as c:
        while True:
            tokens = []
            try:
                async for chunk in c.generate(prompt, max_tokens=n, stop_at_eos=False,
                                              mode="cloud-only", deadline_s=600):
                    tokens += chunk.token_ids
                return {"outcome": "served", "tokens": tokens, "busy": busy}
            except Busy:
                busy += 1
                if not retry or time.monotonic() > deadline:
                    return {"outcome": "busy", "busy": busy}
                await asyncio.sleep(0.2 + random.random() * 0.3)
            except TandemError as e:
                return {"outcome": "failed", "mid_stream": bool(tokens), "error": repr(e),
                        "busy": busy}


async def phase(endpoint: str, work: list[list[int]], n: int, retry: bool, limit_s: float
                ) -> list[dict]:
    deadline = time.monotonic() + limit_s
    return await asyncio.gather(*[one(endpoint, p, n, retry, deadline) for p in work])


def summarise(name: str, work: list[list[int]], results: list[dict], seconds: float,
              reference) -> dict:
    served = [(p, r) for p, r in zip(work, results) if r["outcome"] == "served"]
    checked = served[:: max(1, len(served) // 8)]
    wrong = sum(r["tokens"] != reference(p) for p, r in checked)
    return {"phase": name, "sessions": len(work), "seconds": round(seconds, 1),
            "served": len(served), "busy": sum(r["outcome"] == "busy" for r in results),
            "failed": sum(r["outcome"] == "failed" for r in results),
            "failed_mid_stream": sum(r.get("mid_stream", False) for r in results),
            "busy_answers": sum(r["busy"] for r in results),
            "checked_against_transformers": len(checked), "wrong": wrong,
            "errors": sorted({r["error"] for r in results if "error" in r})[:5]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench kv", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=0, help="default 300 (quick 40)")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="default 1000 (quick 400)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--budget-gib", type=float, default=0, help="default 1 (quick 0.1)")
    ap.add_argument("--churn-s", type=float, default=0, help="churn phase length (default 60)")
    ap.add_argument("--threads", type=int, default=2, help="the verifier's threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    sessions = args.sessions or (40 if args.quick else 300)
    n_prompt = args.prompt_tokens or (400 if args.quick else 1000)
    budget = int((args.budget_gib or (0.1 if args.quick else 1.0)) * GIB)
    churn_s = args.churn_s or (15 if args.quick else 60)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common import models
    target = str(models.prepare_all().target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    refs: dict[tuple, list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in refs:
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=args.max_tokens,
                                  min_new_tokens=args.max_tokens, do_sample=False)
            refs[key] = out[0, len(prompt):].tolist()
        return refs[key]

    burst = prompts(tokenizer, sessions, n_prompt, args.seed)
    # churn: a few long conversations, each session one of their turns (a prefix of the next)
    convs = prompts(tokenizer, 6, n_prompt + 200, args.seed + 1)
    rng = random.Random(args.seed)
    churn = [c[:n_prompt - 100 + 50 * rng.randrange(5)] for c in
             (rng.choice(convs) for _ in range(sessions))]

    many = str(sessions + 100)
    cluster = Cluster(("verifier", "dispatcher"), ephemeral=True,
                      logdir=Path(tempfile.mkdtemp(prefix="tandem-bench-kv-")),
                      extra={"verifier": ["--kv-budget-bytes", str(budget), "--max-sessions", many,
                                          "--threads", str(args.threads)],
                             "dispatcher": ["--max-sessions", many]})
    cluster.start_all()
    rows = []
    try:
        cluster.wait_ready(timeout=300)
        endpoint = cluster.endpoint("dispatcher")
        asyncio.run(phase(endpoint, [burst[0][:32]], 2, False, 60))   # warm-up
        pid = cluster.procs["verifier"].pid
        sampler = RssSampler(pid)
        time.sleep(1.0)
        idle = sampler.proc.memory_info().rss
        sampler.thread.start()
        print(f"# bench kv: {sessions} sessions of {n_prompt} tokens against a "
              f"{budget / GIB:.2f} GiB KV budget; verifier RSS idle {idle / 2**20:.0f} MiB",
              flush=True)
        for name, work, retry, limit in (("burst", burst, False, 600.0),
                                         ("churn", churn, True, churn_s)):
            t = time.monotonic()
            results = asyncio.run(phase(endpoint, work, args.max_tokens, retry, limit))
            row = summarise(name, work, results, time.monotonic() - t, reference)
            row["rss_peak_mib"] = round(sampler.peak / 2**20, 1)
            rows.append(row)
            print(f"  {name}: {row}", flush=True)
        sampler.stop.set()
    finally:
        cluster.stop_all()
    peak = max(r["rss_peak_mib"] for r in rows) * 2**20
    bound = (idle + budget) * (1 + HEADROOM)
    goal = (f"verifier RSS peak {peak / 2**20:.0f} MiB <= (idle {idle / 2**20:.0f} MiB + budget "
            f"{budget / 2**20:.0f} MiB) x {1 + HEADROOM:.2f} = {bound / 2**20:.0f} MiB: "
            f"{'met' if peak <= bound else 'NOT met'}; requests failed: "
            f"{sum(r['failed'] for r in rows)}, wrong: {sum(r['wrong'] for r in rows)}")
    print("# goal: " + goal)
    write_json(args.json, "kv", "loopback", rows, sessions=sessions, prompt_tokens=n_prompt,
               budget_bytes=budget, rss_idle_mib=round(idle / 2**20, 1),
               rss_bound_mib=round(bound / 2**20, 1), goals=[goal],
               deployment="verifier and dispatcher as processes on one box")
    return 0 if all(r["failed"] == 0 and r["wrong"] == 0 for r in rows) and peak <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
