"""Speculative policies side by side (DESIGN.md §3): PipeSD and its baselines on the same prompts,
the same drafter and the same verifier, over an emulated WAN.

    python -m bench.bench_spec [--quick] [--json PATH] [--scenario s1|lan|none]
                               [--drafter bundled|bundled-q4_1] [--max-tokens N] [--repeats R]

Services run as real processes (common.launcher.Cluster): the drafter and the dispatcher (the
edge) pinned to core 0, the verifier (the cloud) to core 1, one thread each, so the numbers
measure scheduling, not two models fighting over two cores. The dispatcher reaches the verifier
through the WAN emulator (common/wan.py WanProxy, PipeSD's S1 by default: 20 Mbit/s up,
200 Mbit/s down, 25 ms one way); `--scenario none` is plain loopback.

Per policy: TPT (request wall time / tokens, PipeSD's headline figure) median and spread over
prompts x repeats, acceptance rate, mean draft length, verifier forward passes per emitted token,
proactive tokens kept / discarded, early rejects, and whether the greedy output is identical to
transformers' generate(do_sample=False) on the target (the reference). Requests of different
policies are interleaved so drift in machine load spreads over all of them. The BO autotuner of
the pipesd policies works on this live traffic (its state is printed); `--no-bo` keeps R1/R2 at
0.90/0.94. The oracle policy is an upper bound: its trigger knows the target's output (its
reference generation is not counted in its TPT).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
import warnings

from bench.report import summary, table, write_json
from common.launcher import Cluster, free_port
from tests.conftest import PROMPTS

POLICIES = ["cloud-only", "vanilla", "hsl", "edgellm", "pipesd", "pipesd-stream", "oracle"]


class Link:
    """The WAN emulator on its own event-loop thread, between the dispatcher and the verifier."""

    def __init__(self, scenario: str, target_port: int):
        from common.wan import SCENARIOS, WanProxy
        sc = SCENARIOS[scenario]
        self.note = sc.note
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="wan")
        self.thread.start()
        self.proxy = WanProxy("127.0.0.1", self.port, "127.0.0.1", target_port, up=sc.up, down=sc.down)
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)
        if sc.schedule is not None:
            self.loop.call_soon_threadsafe(self.proxy.play, sc.schedule)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def reference_outputs(prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from common import models
    m = AutoModelForCausalLM.from_pretrained(str(models.resolve_target("bundled")),
                                             dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, ids in prompts.items():
            x = torch.tensor([ids])
            y = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=m.config.eos_token_id)
            out[k] = y[0, len(ids):].tolist()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_spec", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts, 1 repeat, 24 tokens (< 3 min)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--scenario", default="s1", help="WAN scenario of common/wan.py, or none")
    ap.add_argument("--drafter", default="bundled", help="bundled (Q4_0) | bundled-q4_1 | GGUF path")
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens per request (default 48; quick 24)")
    ap.add_argument("--repeats", type=int, default=0, help="runs per prompt and policy (default 2; quick 1)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--no-bo", action="store_true", help="keep R1/R2 fixed (no BO autotuner)")
    ap.add_argument("--proactive-depth", type=int, default=1,
                    help="proactive rounds in flight behind the active one (PipeSD: 1)")
    ap.add_argument("--bo-warmup", type=int, default=-1,
                    help="unmeasured pipesd requests first, so BO has evaluations to work from "
                         "(default 8; quick 0)")
    args = ap.parse_args(argv)
    n = args.max_tokens or (24 if args.quick else 48)
    repeats = args.repeats or (1 if args.quick else 2)
    kinds = ["plain", "code"] if args.quick else ["plain", "chat", "code"]
    policies = args.policies.split(",")
    bo_warmup = args.bo_warmup if args.bo_warmup >= 0 else (0 if args.quick or args.no_bo else 8)
    t_start = time.monotonic()

    from transformers import AutoTokenizer

    from common import models
    from tandem import Client
    tok = AutoTokenizer.from_pretrained(str(models.resolve_target("bundled")))
    prompts = {}
    for k in kinds:
        if k == "chat":
            ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[k]}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
            prompts[k] = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        else:
            prompts[k] = tok.encode(PROMPTS[k])

    cores = 2
    pin = {"drafter": [0], "dispatcher": [0], "verifier": [1 % cores]}
    cluster = Cluster(services=("verifier", "drafter", "dispatcher"), ephemeral=True, pin=pin,
                      extra={"verifier": ["--threads", "1"],
                             "drafter": ["--threads", "1", "--drafter", args.drafter],
                             "dispatcher": ["--spec-bo", "false" if args.no_bo else "true",
                                            "--spec-proactive-depth", str(args.proactive_depth)]})
    link = None
    note = "loopback (no WAN emulation)"
    try:
        cluster.start("verifier")
        if args.scenario != "none":
            port = int(cluster.endpoint("verifier").rsplit(":", 1)[1])
            link = Link(args.scenario, port)
            note = f"{args.scenario}: {link.note}"
            cluster.extra["dispatcher"] += ["--verifier", f"tcp://127.0.0.1:{link.port}"]
        cluster.start("drafter")
        cluster.start("dispatcher")
        print(f"# bench_spec: {len(policies)} policies x {len(prompts)} prompts x {repeats} "
              f"repeats, {n} tokens, drafter {args.drafter}, link {note}, BO "
              f"{'off' if args.no_bo else 'on'}, proactive depth {args.proactive_depth}", flush=True)
        print("# pinning: drafter+dispatcher on core 0, verifier on core 1, 1 thread each",
              flush=True)
        ref = reference_outputs(prompts, n)
        cluster.wait_ready(timeout=240)
        runs: dict[str, list[dict]] = {p: [] for p in policies}
        with Client(cluster.endpoint("dispatcher"), timeout_s=600) as c:
            for p in policies:   # warm-up: first-call costs (oneDNN packing, imports) left out
                kw = {"mode": "cloud-only"} if p == "cloud-only" else {"mode": "spec", "policy": p}
                c.complete(prompts[kinds[0]], max_tokens=4, stop_at_eos=False, **kw)
            for i in range(bo_warmup):   # live traffic for the BO autotuner, not measured
                for p in ("pipesd", "pipesd-stream"):
                    if p in policies:
                        c.complete(list(prompts.values())[i % len(prompts)], mode="spec",
                                   policy=p, max_tokens=n, stop_at_eos=False)
            if bo_warmup:
                print(f"# BO warm-up: {bo_warmup} unmeasured requests per pipesd policy", flush=True)
            for rep in range(repeats):
                for k, ids in prompts.items():
                    order = policies if rep % 2 == 0 else policies[::-1]
                    for p in order:
                        kw = {"mode": "cloud-only"} if p == "cloud-only" else \
                            {"mode": "spec", "policy": p}
                        r = c.complete(ids, max_tokens=n, stop_at_eos=False, **kw)
                        st = r.stats
                        runs[p].append({"prompt": k, "repeat": rep, "tpt_s": st["tpt_s"],
                                        "identical": r.token_ids == ref[k], **{
                                            key: st.get(key) for key in (
                                                "acceptance_rate", "mean_draft_length",
                                                "cloud_forwards_per_token", "rounds",
                                                "proactive_kept", "proactive_discarded",
                                                "early_rejects", "thresholds", "window",
                                                "dp_plan", "alpha_s", "beta_s", "gamma_s",
                                                "oracle_reference_s", "batches")}})
                        print(f"  {p:14s} {k:6s} rep {rep}: TPT {st['tpt_s'] * 1000:7.1f} ms"
                              f"  identical={r.token_ids == ref[k]}", flush=True)
    finally:
        cluster.stop_all()
        if link is not None:
            link.close()

    rows = []
    for p, rs in runs.items():
        if not rs:
            continue
        tpt = summary([x["tpt_s"] * 1000 for x in rs])

        def mean(key):
            v = [x[key] for x in rs if x.get(key) is not None]
            return statistics.fmean(v) if v else None
        rows.append({"policy": p, "tpt_ms": tpt["median"], "iqr_ms": tpt["iqr"],
                     "min_ms": tpt["min"], "max_ms": tpt["max"],
                     "accept": mean("acceptance_rate"), "draft_len": mean("mean_draft_length"),
                     "fwd_per_tok": mean("cloud_forwards_per_token") if p != "cloud-only" else 1.0,
                     "kept": sum(x.get("proactive_kept") or 0 for x in rs),
                     "discarded": sum(x.get("proactive_discarded") or 0 for x in rs),
                     "early": sum(x.get("early_rejects") or 0 for x in rs),
                     "identical": f"{sum(x['identical'] for x in rs)}/{len(rs)}",
                     "runs": rs})
    base = next((r["tpt_ms"] for r in rows if r["policy"] == "cloud-only"), None)
    for r in rows:
        r["speedup"] = base / r["tpt_ms"] if base and r["tpt_ms"] else None
    print()
    print(f"# TPT = wall time / tokens; link {note}")
    print(table(rows, [("policy", "policy"), ("tpt_ms", "TPT median ms"), ("iqr_ms", "IQR"),
                       ("min_ms", "min"), ("max_ms", "max"), ("speedup", "vs cloud-only"),
                       ("accept", "acceptance"), ("draft_len", "draft len"),
                       ("fwd_per_tok", "cloud fwd/token"), ("kept", "proactive kept"),
                       ("discarded", "discarded"), ("early", "early rejects"),
                       ("identical", "identical to ref")]))
    for p in ("pipesd", "pipesd-stream"):
        if runs.get(p):
            last = runs[p][-1]
            print(f"# {p} last request: thresholds {last['thresholds']}, N̂={last['window']}, "
                  f"DP plan {last['dp_plan']} for α={_ms(last['alpha_s'])} β={_ms(last['beta_s'])} "
                  f"γ={_ms(last['gamma_s'])}")
    print(f"# wall time {time.monotonic() - t_start:.0f} s")
    write_json(args.json, "spec", args.scenario,
               [{k: v for k, v in r.items()} for r in rows],
               link=note, drafter=args.drafter, max_tokens=n, repeats=repeats, prompts=kinds,
               bo=not args.no_bo, bo_warmup=bo_warmup, proactive_depth=args.proactive_depth)
    return 0 if all(x["identical"] for rs in runs.values() for x in rs) else 1


def _ms(v):
    return "?" if v is None else f"{v * 1000:.3g}ms"


if __name__ == "__main__":
    sys.exit(main())
