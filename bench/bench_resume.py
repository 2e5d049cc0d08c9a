"""kill -9 mid-stream under the supervisor: what a client sees when a Tandem process dies.

    tandem bench resume [--quick] [--json PATH] [--trials N] [--seed S]

The stack is the one `tandem up` starts (stack.launcher.planned: every service and the
OpenAI-compatible gateway, each on its planned share of the cores, the default model and
drafter), watched by stack.launcher.Supervisor as `tandem up` watches it (polled every 0.5 s,
restarted after base_s = 1 s). The supervisor here counts every death as a first one
(stable_s = 0), so each trial's restart costs one base backoff rather than a backoff doubled by
the trial before it. Every client setting is the default one (the SDK and the gateway ping
their dispatcher every second).

Trials run one at a time. Each starts a streaming request (through the SDK, or through the
gateway with the `openai` client: alternating), greedy or seeded sampling (alternating in
pairs), and sends SIGKILL to the process under test at a point drawn from a seeded RNG: during
the prompt's prefill (a short random delay after the request is sent, before its first token) or
after k tokens plus a random delay (so the kill lands anywhere in a decode step or a
verification round). Where it landed is recorded (tokens the client held when the signal went).
The kinds:

    dispatcher  in cloud-only, spec and split mode: the SDK (or the gateway's own SDK client)
                notices the restarted dispatcher by its heartbeat and resumes the request as a
                continuation of the tokens it holds (tandem/link.py)
    drafter     in spec mode: the dispatcher goes on with the target alone
    prefix      in split mode: the dispatcher replays the session on the restarted prefix
                from its committed tokens (services/dispatcher/recovery.py)

Per trial: that the process died and came back (its pid changed, the supervisor counted a
restart), its restart time (SIGKILL to /readyz answering 200), the pause the client saw (the
largest gap between two token arrivals, the request's start counting as the first arrival),
the resumes (SDK: Stats.resumes; gateway: tandem_api_resumes_total) and dispatcher replays,
and whether the output is exact: greedy against transformers' generate(do_sample=False),
seeded sampling against an uninterrupted run of the same request (same mode, seed and prompt),
token ids through the SDK (indices contiguous: no duplicate, no gap) and text through the
gateway. Goals: every request completes exactly; a dispatcher kill's pause is at most its
restart time + 2 s; no request runs into its deadline.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.report import summary, table, write_json
from bench.workloads import BUILTIN_PROMPTS

# (process killed, mode): the dispatcher in each mode, then the edge process each mode leans on
KINDS = (("dispatcher", "cloud-only"), ("dispatcher", "spec"), ("dispatcher", "split"),
         ("drafter", "spec"), ("prefix", "split"))
PROMPTS = (BUILTIN_PROMPTS["plain"], BUILTIN_PROMPTS["code"], "Once upon a time, in a village by the sea,",
           "The three laws of thermodynamics state that")
# Seeded trials sample under the Gumbel coupling: the text depends on the seed and the prompt
# alone, so an uninterrupted run is the reference in every mode (under rejection sampling spec
# output depends on where rounds began and ended: not even an uninterrupted rerun repeats it)
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "sampling_coupling": "gumbel"}
DEADLINE_S = 120.0          # each request's deadline: no trial may come near it
PAUSE_MARGIN_S = 2.0        # goal: pause <= restart time + this
PREFILL_SHARE = 0.2         # share of trials whose kill is aimed at the prompt's prefill


@dataclass
class Trial:
    """One planned kill: what runs, and when the signal goes."""
    kind: str                # "dispatcher/cloud-only", ...
    victim: str
    mode: str
    client: str              # "sdk" | "gateway"
    seed: int | None         # None: greedy; else seeded sampling
    prompt: int              # index into PROMPTS
    after_tokens: int        # kill once the client holds this many tokens (0: during prefill)
    delay_s: float           # ... and this much later


@dataclass
class Outcome:
    kind: str
    client: str
    sampling: str
    prompt: int
    aimed_at: str
    tokens_before_kill: int
    landed: str = ""          # "prefill" (no token yet) | "stream" | "after the end"
    died: bool = False
    restarted: bool = False   # a new pid and a supervisor restart
    restarts: int = 0         # supervisor restarts of the process during the trial (1 per kill;
                              # more when a restarted run died again)
    restart_s: float | None = None
    pause_s: float | None = None
    pause_minus_restart_s: float | None = None
    resumes: int = 0
    replays: float = 0.0
    completed: bool = False
    tokens: int = 0
    exact: bool = False
    no_duplicate_or_gap: bool = False
    wall_s: float = 0.0
    error: str = ""
    notes: list[str] = field(default_factory=list)


def metric_sum(url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def plan_trials(per_kind: int, tokens: int, seed: int) -> list[Trial]:
    """The trials, their kill points drawn from one seeded RNG; the kinds take turns, so each
    meets the same conditions over the run (and a run cut short has some of every kind)."""
    rng = random.Random(seed)
    by_kind = []
    for victim, mode in KINDS:
        mine = []
        for i in range(per_kind):
            sampled = (i // 2) % 2 == 1
            prefill = rng.random() < PREFILL_SHARE
            after = 0 if prefill else rng.randint(1, tokens - tokens // 4)
            delay = rng.uniform(0.0, 0.1) if prefill else rng.uniform(0.0, 0.08)
            mine.append(Trial(f"{victim}/{mode}", victim, mode,
                              "sdk" if i % 2 == 0 else "gateway",
                              rng.randrange(1, 2**31) if sampled else None, i % len(PROMPTS),
                              after, delay))
        by_kind.append(mine)
    return [t for turn in zip(*by_kind) for t in turn]


class Streamer:
    """One streaming request on its own thread; records when each token arrived."""

    def __init__(self, trial: Trial, ids: list[int], tokens: int, dispatcher: str, api: str):
        self.trial, self.ids, self.n = trial, ids, tokens
        self.dispatcher, self.api = dispatcher, api
        self.arrivals: list[tuple[float, int]] = []   # (monotonic time, tokens held after it)
        self.token_ids: list[int] = []
        self.indices: list[int] = []
        self.text = ""
        self.usage_tokens: int | None = None
        self.resumes = 0
        self.stats: dict = {}
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.t_start = self.t_end = 0.0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def held(self) -> int:
        return self.arrivals[-1][1] if self.arrivals else 0

    def run(self) -> None:
        try:
            (self.run_sdk if self.trial.client == "sdk" else self.run_gateway)()
        except Exception as e:   # noqa: BLE001 - the trial's outcome
            self.error = e
        self.t_end = time.monotonic()

    def run_sdk(self) -> None:
        from tandem import Client
        sampling = {} if self.trial.seed is None else {**SAMPLING, "seed": self.trial.seed}
        with Client(self.dispatcher) as c:
            stream = c.generate(self.ids, mode=self.trial.mode, max_tokens=self.n,
                                stop_at_eos=False, deadline_s=DEADLINE_S, **sampling)
            self.t_start = time.monotonic()
            self.started.set()
            for chunk in stream:
                self.indices += range(chunk.index, chunk.index + len(chunk.token_ids))
                self.token_ids += chunk.token_ids
                self.arrivals.append((time.monotonic(), len(self.token_ids)))
            self.resumes = stream.resumes
            self.stats = stream.result.stats.raw

    def run_gateway(self) -> None:
        import openai
        # OpenAI's own fields as arguments, Tandem's (the coupling) in the body's extra fields
        sampling = {"temperature": 0.0} if self.trial.seed is None else {
            "temperature": SAMPLING["temperature"], "top_p": SAMPLING["top_p"],
            "seed": self.trial.seed}
        coupling = {} if self.trial.seed is None else {
            "sampling_coupling": SAMPLING["sampling_coupling"]}
        with openai.OpenAI(base_url=self.api + "/v1", api_key="unused", max_retries=0,
                           timeout=DEADLINE_S + 30) as c:
            self.t_start = time.monotonic()
            self.started.set()
            # logprobs=0: each event lists its tokens (in spec mode an event may hold several),
            # so the kill is aimed by tokens as through the SDK
            events = c.completions.create(
                model="tandem", prompt=self.ids, max_tokens=self.n, stream=True, logprobs=0,
                stream_options={"include_usage": True},
                extra_body={"mode": self.trial.mode, "ignore_eos": True,
                            "deadline_s": DEADLINE_S, **coupling}, **sampling)
            held = 0
            for ev in events:
                if ev.usage is not None:
                    self.usage_tokens = ev.usage.completion_tokens
                if not ev.choices:
                    continue
                text, lp = ev.choices[0].text or "", ev.choices[0].logprobs
                got = len(lp.tokens) if lp is not None and lp.tokens else int(bool(text))
                self.text += text
                if got:
                    held += got
                    self.arrivals.append((time.monotonic(), held))

    def pause(self) -> float | None:
        """The largest gap between two arrivals, the request's start counting as the first."""
        times = [self.t_start] + [t for t, _ in self.arrivals]
        return max((b - a for a, b in zip(times, times[1:])), default=None)


class Bench:
    def __init__(self, tokens: int, logdir: Path):
        from common import models
        from stack.cli import _available_services
        from stack.launcher import Supervisor, planned
        paths = models.prepare_all(models.DEFAULT_MODEL)
        self.target = paths.target
        # what `tandem up` gives every service: the target, and the drafter's GGUF
        env = {"TANDEM_TARGET": str(paths.target), "TANDEM_DRAFTER_DRAFTER": str(paths.drafter)}
        self.cluster = planned(_available_services(), ephemeral=True, env=env, logdir=logdir)
        self.tokens = tokens
        self.supervisor = Supervisor(self.cluster, base_s=1.0, stable_s=0.0,
                                     log=lambda m: print("  supervisor:", m.splitlines()[0],
                                                         flush=True))
        self.stop = threading.Event()
        self.watcher = threading.Thread(target=self.supervisor.run,
                                        kwargs={"interval": 0.5, "stop": self.stop.is_set},
                                        daemon=True)

    def __enter__(self) -> "Bench":
        self.cluster.start_all()
        try:
            self.cluster.wait_ready(timeout=600)
            self.wait_peers_up()
        except BaseException:
            self.cluster.stop_all()
            raise
        self.watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.watcher.join(5)
        self.cluster.stop_all()

    def url(self, name: str, path: str = "/metrics") -> str:
        return self.cluster.procs[name].url(path)

    def wait_peers_up(self, timeout: float = 120.0) -> None:
        """Every service ready and the dispatcher counting each of its peers up (a restarted
        edge process is back for the next trial only once the dispatcher has heard it)."""
        self.cluster.wait_ready(timeout=timeout)
        peers = [n for n in ("verifier", "drafter", "prefix", "suffix") if n in self.cluster.procs]
        end = time.monotonic() + timeout
        while any(metric_sum(self.url("dispatcher"), "tandem_peer_up", service="dispatcher",
                             peer=p) != 1 for p in peers):
            if time.monotonic() > end:
                raise TimeoutError(f"the dispatcher does not count its peers {peers} up")
            time.sleep(0.2)

    def uninterrupted(self, trial: Trial, ids: list[int]) -> list[int]:
        """The same seeded request, run through the SDK with nothing killed."""
        from tandem import Client
        with Client(self.cluster.endpoint("dispatcher")) as c:
            return c.complete(ids, mode=trial.mode, max_tokens=self.tokens, stop_at_eos=False,
                              deadline_s=DEADLINE_S, seed=trial.seed, **SAMPLING).token_ids

    def run(self, trial: Trial, ids: list[int], want: list[int], tokenizer) -> Outcome:
        out = Outcome(trial.kind, trial.client, "greedy" if trial.seed is None else "seeded",
                      trial.prompt, "prefill" if trial.after_tokens == 0 else
                      f"after {trial.after_tokens} tokens", 0)
        proc = self.cluster.procs[trial.victim]
        restarts = proc.restarts
        replays = metric_sum(self.url("dispatcher"), "tandem_session_recoveries_total",
                             service="dispatcher")
        api_resumes = metric_sum(self.url("api"), "tandem_api_resumes_total")
        s = Streamer(trial, ids, self.tokens, self.cluster.endpoint("dispatcher"),
                     self.cluster.endpoint("api"))
        s.thread.start()
        if not s.started.wait(30):
            out.error = "the request never started"
            return out
        while s.held() < trial.after_tokens and s.thread.is_alive():
            time.sleep(0.002)
        time.sleep(trial.delay_s)
        old = proc.pid
        t_kill = time.monotonic()
        out.tokens_before_kill = s.held()
        out.landed = ("after the end" if not s.thread.is_alive() else
                      "prefill" if out.tokens_before_kill == 0 else "stream")
        os.kill(old, signal.SIGKILL)
        out.died = True
        restart_end = time.monotonic() + 120
        while (proc.pid == old or not proc.probe(timeout=0.5)) and time.monotonic() < restart_end:
            time.sleep(0.02)
        if proc.pid != old and proc.probe():
            out.restart_s = time.monotonic() - t_kill
        out.restarts = proc.restarts - restarts
        out.restarted = proc.pid != old and out.restarts >= 1
        s.thread.join(DEADLINE_S + 60)
        out.wall_s = (s.t_end or time.monotonic()) - s.t_start
        if s.thread.is_alive():
            out.error = "the request was still running after its deadline"
            return out
        if s.error is not None:
            out.error = f"{type(s.error).__name__}: {s.error}"
        out.pause_s = s.pause()
        if out.pause_s is not None and out.restart_s is not None:
            out.pause_minus_restart_s = out.pause_s - out.restart_s
        if trial.victim != "dispatcher":   # the dispatcher's counters survived: its replays
            out.replays = metric_sum(self.url("dispatcher"), "tandem_session_recoveries_total",
                                     service="dispatcher") - replays
        if trial.client == "sdk":
            out.resumes = s.resumes
            out.tokens = len(s.token_ids)
            out.completed = s.error is None and out.tokens == self.tokens
            out.no_duplicate_or_gap = s.indices == list(range(len(s.indices)))
            out.exact = out.completed and s.token_ids == want
            if trial.victim != "dispatcher" and s.stats.get("drafter_lost"):
                out.notes.append("drafter_lost")
            if not out.exact and out.completed:
                first = next(i for i, (a, b) in enumerate(zip(s.token_ids, want)) if a != b)
                out.notes.append(f"first difference at token {first}")
        else:
            out.resumes = int(metric_sum(self.url("api"), "tandem_api_resumes_total") - api_resumes)
            out.tokens = s.usage_tokens or 0
            out.completed = s.error is None and out.tokens == self.tokens
            want_text = tokenizer.decode(want, skip_special_tokens=True)
            out.exact = out.completed and s.text == want_text
            # the gateway streams text: a duplicated or missing token would change it
            out.no_duplicate_or_gap = out.exact
        return out


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for victim, mode in KINDS:
        kind = f"{victim}/{mode}"
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        pauses = [r["pause_s"] for r in rs if r["pause_s"] is not None]
        restarts = [r["restart_s"] for r in rs if r["restart_s"] is not None]
        within = [r for r in rs if r["pause_minus_restart_s"] is not None
                  and r["pause_minus_restart_s"] <= PAUSE_MARGIN_S]
        out.append({"kind": kind, "n": len(rs),
                    "restarted": sum(r["restarted"] for r in rs),
                    "restarts": sum(r["restarts"] for r in rs),
                    "completed": sum(r["completed"] for r in rs),
                    "exact": sum(r["exact"] for r in rs),
                    "pause_s_median": statistics.median(pauses) if pauses else None,
                    "pause_s_max": max(pauses, default=None),
                    "restart_s_median": statistics.median(restarts) if restarts else None,
                    "restart_s_max": max(restarts, default=None),
                    "pause_within_restart_plus_2s": len(within),
                    "pause_minus_restart_s": summary([r["pause_minus_restart_s"] for r in rs
                                                      if r["pause_minus_restart_s"] is not None]),
                    "resumes": sum(r["resumes"] for r in rs),
                    "replays": sum(r["replays"] for r in rs),
                    "landed": {w: sum(r["landed"] == w for r in rs)
                               for w in ("prefill", "stream", "after the end")},
                    "tokens_before_kill": [r["tokens_before_kill"] for r in rs],
                    "wall_s_max": max(r["wall_s"] for r in rs)})
    return out


def goals(kinds: list[dict], rows: list[dict], per_kind: int) -> list[str]:
    def met(ok: bool) -> str:
        return "met" if ok else "not met"
    by = {k["kind"]: k for k in kinds}
    disp = [k for k in kinds if k["kind"].startswith("dispatcher/")]
    n = sum(k["n"] for k in disp)
    exact = sum(k["exact"] for k in disp)
    out = [f"dispatcher kill -9s: {exact}/{n} requests complete exactly ({per_kind} per mode "
           f"wanted): {met(n == 3 * per_kind and exact == n)}"]
    d_rows = [r for r in rows if r["kind"].startswith("dispatcher/")]
    gaps = [r["pause_minus_restart_s"] for r in d_rows if r["pause_minus_restart_s"] is not None]
    if gaps:
        ok = len(gaps) == len(d_rows) and max(gaps) <= PAUSE_MARGIN_S
        out.append(f"dispatcher pause - restart time: median {statistics.median(gaps):.2f} s, "
                   f"worst {max(gaps):.2f} s (<= {PAUSE_MARGIN_S:.0f} s in "
                   f"{sum(g <= PAUSE_MARGIN_S for g in gaps)}/{len(d_rows)}): {met(ok)}")
    slowest = max((r["wall_s"] for r in rows), default=0.0)
    out.append(f"no request waits for its deadline ({DEADLINE_S:.0f} s): longest request "
               f"{slowest:.1f} s, {sum(bool(r['error']) for r in rows)} errors: "
               f"{met(slowest < DEADLINE_S and not any(r['error'] for r in rows))}")
    for kind in ("drafter/spec", "prefix/split"):
        k = by.get(kind)
        if k:
            out.append(f"{kind} kill -9s: {k['exact']}/{k['n']} complete exactly: "
                       f"{met(k['n'] == per_kind and k['exact'] == k['n'])}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench resume", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 trials per kind, 24 tokens")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--trials", type=int, default=0, help="trials per kind (default 10)")
    ap.add_argument("--tokens", type=int, default=0, help="tokens per request (default 64)")
    ap.add_argument("--kinds", default=",".join(f"{v}/{m}" for v, m in KINDS),
                    help="comma-separated subset of the kinds")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill points and sampling")
    args = ap.parse_args(argv)
    per_kind = args.trials or (2 if args.quick else 10)
    tokens = args.tokens or (24 if args.quick else 64)
    kinds = {k.strip() for k in args.kinds.split(",") if k.strip()}
    unknown = kinds - {f"{v}/{m}" for v, m in KINDS}
    if unknown:
        ap.error(f"unknown --kinds {sorted(unknown)}")

    from transformers import AutoTokenizer

    from bench.bench_spec import reference_outputs
    trials = [t for t in plan_trials(per_kind, tokens, args.seed) if t.kind in kinds]
    logdir = Path(tempfile.mkdtemp(prefix="tandem-bench-resume-"))
    with Bench(tokens, logdir) as bench:
        tokenizer = AutoTokenizer.from_pretrained(str(bench.target))
        prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
        greedy = reference_outputs(dict(enumerate(prompt_ids)), tokens, str(bench.target))
        print(f"{len(trials)} trials, {tokens} tokens each; services' logs in {logdir}",
              flush=True)
        rows = []
        setup = {"tokens": tokens, "trials_per_kind": per_kind, "seed": args.seed,
                 "deadline_s": DEADLINE_S, "sampling": SAMPLING, "prompts": list(PROMPTS)}
        for i, t in enumerate(trials):
            ids = prompt_ids[t.prompt]
            want = greedy[t.prompt] if t.seed is None else bench.uninterrupted(t, ids)
            o = bench.run(t, ids, want, tokenizer)
            rows.append(asdict(o))
            print(f"[{i + 1}/{len(trials)}] {o.kind:21s} {o.client:7s} {o.sampling:6s} "
                  f"killed at {o.tokens_before_kill:2d} ({o.landed}): restart "
                  f"{o.restart_s or float('nan'):.2f} s, pause {o.pause_s or float('nan'):.2f} s, "
                  f"resumes {o.resumes}, replays {o.replays:.0f}, "
                  f"{'exact' if o.exact else 'NOT EXACT'}"
                  + (f" {o.error}" if o.error else "") + (f" {o.notes}" if o.notes else ""),
                  flush=True)
            # the file holds every trial so far: a run cut short keeps what it measured
            write_json(args.json, "resume", "loopback, supervised", summarize(rows),
                       trials=rows, goals=goals(summarize(rows), rows, per_kind), **setup)
            bench.wait_peers_up()
    kinds_summary = summarize(rows)
    print("\nkill -9 under the supervisor, mid-stream")
    print(table(kinds_summary, [("kind", "kind"), ("n", "n"), ("completed", "completed"),
                                ("exact", "exact"), ("pause_s_median", "pause s (median)"),
                                ("pause_s_max", "pause s (worst)"),
                                ("restart_s_median", "restart s (median)"),
                                ("restart_s_max", "restart s (worst)"),
                                ("pause_within_restart_plus_2s", "pause <= restart + 2 s")]))
    goal_lines = goals(kinds_summary, rows, per_kind)
    print("\n" + "\n".join(goal_lines))
    write_json(args.json, "resume", "loopback, supervised", kinds_summary, trials=rows,
               goals=goal_lines, **setup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
