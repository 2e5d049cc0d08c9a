"""Speculative policies side by side (DESIGN.md §3): PipeSD and its baselines on the same prompts,
the same drafter and the same verifier, over an emulated WAN.

    python -m bench.bench_spec [--quick] [--json PATH] [--scenario s1|s2|s3|s4|lan|none]
                               [--drafter bundled|bundled-q4_1] [--max-tokens N] [--repeats R]
                               [--uplink 10,20,40,80]

Services run as real processes (common.launcher.Cluster): the drafter and the dispatcher (the
edge) pinned to core 0, the verifier (the cloud) to core 1, one thread each, so the numbers
measure scheduling, not two models fighting over two cores. The dispatcher reaches the verifier
through the WAN emulator (common/wan.py WanProxy, PipeSD's S1 by default: 20 Mbit/s up,
200 Mbit/s down, 25 ms one way); `--scenario none` is plain loopback. S2 and S3 are S1's link with
a slower edge: the drafter held to 50 % / 25 % of its core by a CPU quota (cgroup cpu.cfs_quota_us,
as `docker run --cpus` does). `--uplink` sweeps the uplink bandwidth: the proxy is reshaped at run
time and every policy runs at every bandwidth, in one run with one set of processes.

Per policy: TPT (request wall time / tokens, PipeSD's headline figure) median and spread (IQR) over
prompts x repeats, the workload's TPT (all requests' time / all their tokens) and its mean per prompt, Welch's t of its TPT against pipesd's (|t| > 2.5: significant), acceptance rate, mean draft length, verifier forward passes per emitted token,
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
import contextlib
import os
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

from bench.report import headroom, summary, table, welch_t, write_json
from common.launcher import Cluster, free_port
from common.progress import Progress
from tests.conftest import PROMPTS

POLICIES = ["cloud-only", "vanilla", "hsl", "edgellm", "pipesd", "pipesd-stream", "oracle"]
EDGE_QUOTA = {"s2": 0.5, "s3": 0.25}   # slower edges: the drafter's share of its one core
LINK_OF = {"s2": "s1", "s3": "s1"}     # ... on S1's link


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

    def set_uplink(self, mbit: float) -> None:
        async def go():
            self.proxy.set("up", bandwidth_mbit=float(mbit))
        asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

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


class CpuQuota:
    """A cgroup (v1 `cpu` or v2) holding a process to `share` of one core, like `docker --cpus`."""

    def __init__(self, pid: int, share: float, name: str = "tandem-bench-edge"):
        period = 100_000
        v1 = Path("/sys/fs/cgroup/cpu")
        v2 = Path("/sys/fs/cgroup")
        if (v1 / "cpu.cfs_quota_us").exists():
            self.dir = v1 / name
            self.dir.mkdir(exist_ok=True)
            (self.dir / "cpu.cfs_period_us").write_text(str(period))
            (self.dir / "cpu.cfs_quota_us").write_text(str(int(period * share)))
        elif (v2 / "cgroup.controllers").exists():
            self.dir = v2 / name
            self.dir.mkdir(exist_ok=True)
            (self.dir / "cpu.max").write_text(f"{int(period * share)} {period}")
        else:
            raise SystemExit("no cgroup cpu controller here: S2/S3 need one (run as root)")
        (self.dir / "cgroup.procs").write_text(str(pid))   # moves all its threads, v1 and v2

    def close(self) -> None:
        root = self.dir.parent
        with contextlib.suppress(OSError):
            for pid in (self.dir / "cgroup.procs").read_text().split():
                (root / "cgroup.procs").write_text(pid)
            self.dir.rmdir()


def encode_prompts(kinds: list[str]) -> dict[str, list[int]]:
    """The shipped prompt set (tests/conftest.PROMPTS), tokenised; chat through the template."""
    from transformers import AutoTokenizer

    from common import models
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
    return prompts


@contextlib.contextmanager
def spec_cluster(scenario: str, drafter: str, bo: bool = True, proactive_depth: int = 1):
    """Verifier (cloud, core 1) behind the WAN emulator; drafter + dispatcher (edge, core 0).
    Yields (Client, Link or None, note)."""
    from tandem import Client
    cores = os.cpu_count() or 1
    pin = {"drafter": [0], "dispatcher": [0], "verifier": [1 % cores]}
    cluster = Cluster(services=("verifier", "drafter", "dispatcher"), ephemeral=True, pin=pin,
                      extra={"verifier": ["--threads", "1"],
                             "drafter": ["--threads", "1", "--drafter", drafter],
                             "dispatcher": ["--spec-bo", "true" if bo else "false",
                                            "--spec-proactive-depth", str(proactive_depth)]})
    link = quota = None
    note = "loopback (no WAN emulation)"
    try:
        cluster.start("verifier")
        if scenario != "none":
            port = int(cluster.endpoint("verifier").rsplit(":", 1)[1])
            link = Link(LINK_OF.get(scenario, scenario), port)
            note = f"{scenario}: {link.note}"
            cluster.extra["dispatcher"] += ["--verifier", f"tcp://127.0.0.1:{link.port}"]
        proc = cluster.start("drafter")
        if scenario in EDGE_QUOTA:
            quota = CpuQuota(proc.pid, EDGE_QUOTA[scenario])
            note += f"; edge drafter held to {EDGE_QUOTA[scenario]:.0%} of a core"
        cluster.start("dispatcher")
        cluster.wait_ready(timeout=240)
        with Client(cluster.endpoint("dispatcher"), timeout_s=600) as c:
            yield c, link, note
    finally:
        cluster.stop_all()
        if quota is not None:
            quota.close()
        if link is not None:
            link.close()


# `--grid`: pipesd at fixed thresholds, around where the live tuner settled in S1 runs (R1 from
# 1e-6 to 0.56, R2 from 0.38 to 0.95); R1 = 1e-6 leaves the single-token threshold alone.
GRID_R1 = (1e-6, 0.03, 0.15, 0.5)
GRID_R2 = (0.2, 0.4, 0.6, 0.8)


def fixed_policy(r1: float, r2: float) -> str:
    """The bench's name for pipesd held at (R1, R2): "pipesd@R1:R2"."""
    return f"pipesd@{r1:g}:{r2:g}"


def parse_policy(p: str) -> tuple[str, tuple[float, float] | None]:
    """"pipesd@0.15:0.4" -> ("pipesd", (0.15, 0.4)); any other name -> (name, None).
    ValueError for thresholds that are not two numbers in (0, 1], or on a policy without them."""
    if "@" not in p:
        return p, None
    name, _, rr = p.partition("@")
    if name not in ("pipesd", "pipesd-stream"):
        raise ValueError(f"{p!r}: only pipesd and pipesd-stream take thresholds (@R1:R2)")
    try:
        r1, r2 = (float(x) for x in rr.split(":"))
    except ValueError:
        raise ValueError(f"{p!r}: thresholds are @R1:R2, two numbers") from None
    if not (0 < r1 <= 1 and 0 < r2 <= 1):
        raise ValueError(f"{p!r}: R1 and R2 must be in (0, 1]")
    return name, (r1, r2)


def run_request(c, p: str, ids: list[int], n: int, **extra) -> tuple[object, dict]:
    p, thresholds = parse_policy(p)
    kw = {"mode": "cloud-only"} if p == "cloud-only" else {"mode": "spec", "policy": p}
    if thresholds is not None:
        kw["nav_thresholds"] = thresholds
    r = c.complete(ids, max_tokens=n, stop_at_eos=False, **kw, **extra)
    return r, r.stats


def warm_up_tuners(c, policies: list[str], prompts: list[list[int]], n: int, most: int) -> None:
    """Unmeasured live traffic until each policy's BO autotuner has finished its search (16
    evaluations of a window of accepted tokens each, 96 by default), so the measured runs see
    the tuned thresholds, as a deployment would after its first minutes, not the exploration."""
    left = list(policies)
    for i in range(most):
        for p in list(left):
            _, st = run_request(c, p, prompts[i % len(prompts)], n)
            tuner = st.get("tuner") or {}
            if tuner.get("state") == "settled":
                left.remove(p)
                print(f"# BO warm-up: {p} settled after {i + 1} requests at {st['thresholds']}",
                      flush=True)
        if not left:
            return
    print(f"# BO warm-up: {left} still exploring after {most} requests each", flush=True)


RUN_STATS = ("acceptance_rate", "mean_draft_length", "cloud_forwards_per_token", "rounds",
             "proactive_kept", "proactive_discarded", "early_rejects", "thresholds", "window",
             "dp_plan", "alpha_s", "beta_s", "gamma_s", "oracle_reference_s", "batches")


def policy_rows(runs: dict[str, list[dict]], **fields) -> list[dict]:
    """One result row per policy (issue #5's field names), Welch's t against pipesd."""
    rows = []
    ref = [x["tpt_s"] * 1000 for x in runs.get("pipesd", [])]
    for p, rs in runs.items():
        if not rs:
            continue
        ms = [x["tpt_s"] * 1000 for x in rs]
        tpt = summary(ms)

        def mean(key):
            v = [x[key] for x in rs if x.get(key) is not None]
            return statistics.fmean(v) if v else None
        prompts = dict.fromkeys(x["prompt"] for x in rs)
        rows.append({**fields, "policy": p, "tpt_ms": tpt["median"], "tpt_ms_spread": tpt["iqr"],
                     "tpt_ms_min": tpt["min"], "tpt_ms_max": tpt["max"],
                     # the whole workload's time / tokens (every request asks the same count)
                     "tpt_ms_workload": statistics.fmean(ms),
                     "tpt_ms_by_prompt": {k: statistics.fmean(m for x, m in zip(rs, ms)
                                                              if x["prompt"] == k)
                                          for k in prompts},
                     "welch_t_vs_pipesd": welch_t(ms, ref) if p != "pipesd" and ref else None,
                     "acceptance_rate": mean("acceptance_rate"),
                     "mean_draft_length": mean("mean_draft_length"),
                     "cloud_forwards_per_token": mean("cloud_forwards_per_token")
                     if p != "cloud-only" else 1.0,
                     "proactive_kept": sum(x.get("proactive_kept") or 0 for x in rs),
                     "proactive_discarded": sum(x.get("proactive_discarded") or 0 for x in rs),
                     "early_rejects": sum(x.get("early_rejects") or 0 for x in rs),
                     "identical_to_reference": all(x["identical"] for x in rs),
                     "identical_runs": f"{sum(x['identical'] for x in rs)}/{len(rs)}",
                     "runs": rs})
    base = next((r["tpt_ms"] for r in rows if r["policy"] == "cloud-only"), None)
    for r in rows:
        r["speedup_vs_cloud_only"] = base / r["tpt_ms"] if base and r["tpt_ms"] else None
    return rows


COLUMNS = [("policy", "policy"), ("tpt_ms", "TPT median ms"), ("tpt_ms_spread", "IQR"),
           ("tpt_ms_workload", "workload ms"),
           ("tpt_ms_min", "min"), ("tpt_ms_max", "max"), ("welch_t_vs_pipesd", "t vs pipesd"),
           ("speedup_vs_cloud_only", "vs cloud-only"), ("acceptance_rate", "acceptance"),
           ("mean_draft_length", "draft len"), ("cloud_forwards_per_token", "cloud fwd/token"),
           ("proactive_kept", "proactive kept"), ("proactive_discarded", "discarded"),
           ("early_rejects", "early rejects"), ("identical_runs", "identical to ref")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_spec", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts, 1 repeat, 24 tokens (< 3 min)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--scenario", default="s1", help="s1 | s2 | s3 | s4 | lan | none (loopback)")
    ap.add_argument("--drafter", default="bundled", help="bundled (Q4_0) | bundled-q4_1 | GGUF path")
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens per request (default 48; quick 24)")
    ap.add_argument("--repeats", type=int, default=0, help="runs per prompt and policy (default 2; quick 1)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated; pipesd@R1:R2 is pipesd held at those thresholds")
    ap.add_argument("--uplink", default="", help="uplink Mbit/s to sweep, e.g. 10,20,40,80")
    ap.add_argument("--no-bo", action="store_true", help="keep R1/R2 fixed (no BO autotuner)")
    ap.add_argument("--grid", action="store_true",
                    help=f"add pipesd held at each (R1, R2) of {GRID_R1} x {GRID_R2} as a policy "
                         "of its own (pipesd@R1:R2): the best fixed thresholds, measured in the "
                         "same run as the baselines and the oracle")
    ap.add_argument("--proactive-depth", type=int, default=1,
                    help="proactive rounds in flight behind the active one (PipeSD: 1)")
    ap.add_argument("--bo-warmup", type=int, default=-1,
                    help="at most this many unmeasured requests per pipesd policy first, until "
                         "its BO autotuner has settled (default 60; quick 0)")
    args = ap.parse_args(argv)
    n = args.max_tokens or (24 if args.quick else 48)
    repeats = args.repeats or (1 if args.quick else 2)
    kinds = ["plain", "code"] if args.quick else ["plain", "chat", "code"]
    policies = args.policies.split(",")
    if args.grid:
        policies += [fixed_policy(r1, r2) for r1 in GRID_R1 for r2 in GRID_R2]
    try:
        unknown = sorted({parse_policy(p)[0] for p in policies} - set(POLICIES))
    except ValueError as e:
        ap.error(str(e))
    if unknown:
        ap.error(f"unknown policies {unknown}; known: {POLICIES}")
    uplinks = [float(x) for x in args.uplink.split(",") if x] or [None]
    if uplinks != [None] and args.scenario == "none":
        ap.error("--uplink needs an emulated link (--scenario s1, s2, s3 or lan)")
    bo_warmup = args.bo_warmup if args.bo_warmup >= 0 else (0 if args.quick or args.no_bo else 60)
    t_start = time.monotonic()
    prompts = encode_prompts(kinds)
    runs: dict[tuple, list[dict]] = {(u, p): [] for u in uplinks for p in policies}
    with spec_cluster(args.scenario, args.drafter, bo=not args.no_bo,
                      proactive_depth=args.proactive_depth) as (c, link, note):
        print(f"# bench_spec: {len(policies)} policies x {len(prompts)} prompts x {repeats} "
              f"repeats, {n} tokens, drafter {args.drafter}, link {note}, BO "
              f"{'off' if args.no_bo else 'on'}, proactive depth {args.proactive_depth}"
              + (f", uplink sweep {uplinks} Mbit/s" if uplinks != [None] else ""), flush=True)
        print("# pinning: drafter+dispatcher on core 0, verifier on core 1, 1 thread each",
              flush=True)
        ref = reference_outputs(prompts, n)
        for p in policies:   # warm-up: first-call costs (oneDNN packing, imports) left out
            run_request(c, p, prompts[kinds[0]], 4)
        for u in uplinks:
            if u is not None:
                link.set_uplink(u)
                print(f"# uplink {u:g} Mbit/s", flush=True)
            if bo_warmup:
                warm_up_tuners(c, [p for p in ("pipesd", "pipesd-stream") if p in policies],
                               list(prompts.values()), n, bo_warmup)
            label = "bench spec" + ("" if u is None else f" {u:g} Mbit/s")
            with Progress(repeats * len(prompts) * len(policies), label, tick=True) as bar:
                for rep in range(repeats):
                    for k, ids in prompts.items():
                        order = policies if rep % 2 == 0 else policies[::-1]
                        for p in order:
                            bar.stage(f"{p} {k} rep {rep}")
                            r, st = run_request(c, p, ids, n)
                            runs[u, p].append({"prompt": k, "repeat": rep, "tpt_s": st["tpt_s"],
                                               "identical": r.token_ids == ref[k],
                                               **{key: st.get(key) for key in RUN_STATS}})
                            bar.write(f"  {p:14s} {k:6s} rep {rep}: TPT "
                                      f"{st['tpt_s'] * 1000:7.1f} ms  "
                                      f"identical={r.token_ids == ref[k]}")
                            bar.advance()

    rows = []
    for u in uplinks:
        part = policy_rows({p: runs[u, p] for p in policies},
                           **({} if u is None else {"uplink_mbit": u}))
        rows += part
        print()
        print(f"# TPT = wall time / tokens; link {note}"
              + ("" if u is None else f"; uplink {u:g} Mbit/s"))
        print(table(part, COLUMNS))
        for line in headroom(part) + headroom(part, "tpt_ms_workload"):
            print("# " + line)
        for p in ("pipesd", "pipesd-stream"):
            if runs.get((u, p)):
                last = runs[u, p][-1]
                print(f"# {p} last request: thresholds {last['thresholds']}, N̂={last['window']}, "
                      f"DP plan {last['dp_plan']} for α={_ms(last['alpha_s'])} "
                      f"β={_ms(last['beta_s'])} γ={_ms(last['gamma_s'])}")
    print(f"# wall time {time.monotonic() - t_start:.0f} s")
    write_json(args.json, "spec", args.scenario, rows,
               link=note, drafter=args.drafter, max_tokens=n, repeats=repeats, prompts=kinds,
               bo=not args.no_bo, bo_warmup=bo_warmup, proactive_depth=args.proactive_depth,
               uplinks_mbit=[u for u in uplinks if u is not None])
    return 0 if all(x["identical"] for rs in runs.values() for x in rs) else 1


def _ms(v):
    return "?" if v is None else f"{v * 1000:.3g}ms"


if __name__ == "__main__":
    sys.exit(main())
