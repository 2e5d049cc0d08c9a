"""Replicated cloud services with real processes:

* rolling restart under load: 2 verifier + 2 suffix replicas shared by 3 dispatchers (three
  edges), cloud-only and split requests kept in flight; every cloud replica gets SIGTERM, one
  verifier and one suffix at a time (it drains: not ready, no new sessions, `drain_s` for open
  ones, the rest handed back), exits, and starts again. Every request must end `Done` with its
  tokens exactly once and equal to transformers' generate; the session counts of the replicas
  are sampled for the balance goal.
* `kill -9` of the verifier under supervision (what `tandem up` does): restarted with backoff,
  the request in flight is replayed and its output is exact.
* a verifier that is down and not coming back fails a request `unavailable` after the bounded
  `recovery_wait_s`, long before its deadline.

Figures go to docs/reliability.md (section "replicas", bench/reliability_report.py) and
docs/deploy.md. Slow: run under `flock /tmp/cpu.lock` on a shared machine.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stack.launcher import Cluster, Supervisor
from tests.conftest import wait_until
from tests import _reliability as rel
from tests._reliability import Recorder

pytestmark = pytest.mark.slow

# Tokens per request: long enough that sessions overlap on every replica (under this test's
# load on two cores a request takes ~6 s; with 16 tokens and the runner's CPU kernels they
# turned over between the two replicas' gauge reads often enough to show a gap of 4).
N = 32
CUT = 6                # split requests' cut
TEXTS = ["The history of the printing press begins", "Once upon a time", "1, 2, 3, 4,",
         "def fibonacci(n):\n"]
DRAIN_S = 2.0          # short, so that a restart both lets sessions finish and hands some back
CLOUD = ["--drain-s", str(DRAIN_S), *rel.ONE_THREAD, *rel.FAST_PEERS]
DISPATCH = [*rel.FAST_PEERS, "--stall-s", "8", "--peer-wait-s", "60", "--recovery-wait-s", "60"]


def sessions_gauge(port: int) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("tandem_sessions{"):
                    return float(line.rsplit(" ", 1)[1])
    except OSError:
        return None
    return None


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def prompts(tokenizer, reference):
    out = [tokenizer.encode(t) for t in TEXTS]
    return [(ids, reference(ids, N)) for ids in out]


@pytest.fixture(scope="module")
def fleet(model_paths, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replica-logs")
    cloud = Cluster(services=("verifier", "suffix", "prefix", "dispatcher"), ephemeral=True,
                    logdir=logs / "cloud", replicas={"verifier": 2, "suffix": 2},
                    extra={"verifier": CLOUD, "suffix": CLOUD, "prefix": rel.ONE_THREAD,
                           "dispatcher": DISPATCH})
    peers = ["--verifier", cloud.endpoints("verifier"), "--suffix", cloud.endpoints("suffix"),
             "--prefix", cloud.endpoint("prefix")]
    edges = [Cluster(services=("dispatcher",), ephemeral=True, logdir=logs / f"edge{i}",
                     extra={"dispatcher": DISPATCH + peers}) for i in (1, 2)]
    for c in (cloud, *edges):
        c.start_all()
    try:
        for c in (cloud, *edges):
            c.wait_ready(timeout=600)
        yield cloud, edges
    finally:
        for c in (*edges, cloud):
            c.stop_all()


class Load:
    """Keeps `per_edge` requests in flight on every dispatcher (cloud-only and split in turn,
    over the prompts) until stopped; every stream is kept for the checks."""

    def __init__(self, recorders: list[Recorder], prompts, per_edge: int = 2):
        self.recorders, self.prompts, self.per_edge = recorders, prompts, per_edge
        self.streams: list[tuple[int, str, object]] = []   # (prompt index, mode, stream)
        self.stop = threading.Event()
        self.k = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name="load")

    def _issue(self, rec: Recorder) -> object:
        i, mode = self.k % len(self.prompts), ("cloud-only", "split")[(self.k // 2) % 2]
        self.k += 1
        kw = {"cut": CUT} if mode == "split" else {}
        s = rec.generate(self.prompts[i][0], N, deadline_s=240.0, mode=mode, **kw)
        self.streams.append((i, mode, s))
        return s

    def _run(self) -> None:
        live = {id(r): [self._issue(r) for _ in range(self.per_edge)] for r in self.recorders}
        while not self.stop.is_set():
            for r in self.recorders:
                live[id(r)] = [s for s in live[id(r)] if s.end is None]
                while len(live[id(r)]) < self.per_edge:
                    live[id(r)].append(self._issue(r))
            time.sleep(0.05)


class Sampler:
    """Every `every` s: each cloud replica's readiness and sessions (tandem_sessions)."""

    def __init__(self, cloud: Cluster, every: float = 0.25):
        self.cloud, self.every = cloud, every
        self.samples: list[tuple[float, dict[str, dict[str, tuple[bool, float | None]]]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="sampler")

    def _run(self) -> None:
        while not self.stop.is_set():
            snap: dict[str, dict] = {"verifier": {}, "suffix": {}}
            for name, p in self.cloud.procs.items():
                if p.role in snap:
                    snap[p.role][name] = (ready(p.http_port), sessions_gauge(p.http_port))
            self.samples.append((time.monotonic(), snap))
            time.sleep(self.every)

    def imbalance(self, window: tuple[float, float], quiet: list[tuple[float, float]] = ()) -> dict:
        """Per role, over the samples taken under load (`window`): the largest gap in sessions
        between two replicas that are both admitting (ready), over all of them and outside the
        restarts' `quiet` windows, and how often the gap was 2 (and 3) or more."""
        out = {}
        for role in ("verifier", "suffix"):
            gaps, steady = [], []
            for t, snap in self.samples:
                if not window[0] <= t <= window[1]:
                    continue
                held = [n for ok, n in snap[role].values() if ok and n is not None]
                if len(held) < 2:
                    continue
                gap = max(held) - min(held)
                gaps.append(gap)
                if not any(a <= t <= b for a, b in quiet):
                    steady.append(gap)
            out[role] = {"samples_both_admitting": len(gaps), "max_gap": max(gaps, default=0),
                         "samples_gap_ge_2": sum(g >= 2 for g in gaps),
                         "steady_samples": len(steady), "steady_max_gap": max(steady, default=0),
                         "steady_samples_gap_ge_2": sum(g >= 2 for g in steady),
                         "steady_samples_gap_ge_3": sum(g >= 3 for g in steady),
                         "steady_gap_histogram": {str(int(g)): steady.count(g)
                                                  for g in sorted(set(steady))}}
        return out


REPLICAS = ("verifier", "verifier-1", "suffix", "suffix-1")
# a verifier and a suffix restart together (as two Deployments roll independently): each role
# keeps one replica up throughout, and the test waits for two restarts instead of four
ROLLS = (("verifier", "suffix"), ("verifier-1", "suffix-1"))
STEADY_S = 8.0


def holds(cloud: Cluster, name: str) -> bool:
    """The replica is admitting and holds at least one session."""
    p = cloud.procs[name]
    return ready(p.http_port) and (sessions_gauge(p.http_port) or 0) >= 1


def handed_back(log: str) -> int:
    text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
    return sum(int(m) for m in re.findall(r"handed back (\d+) session", text))


def test_rolling_restart_under_load(fleet, prompts, assert_same_tokens):
    cloud, edges = fleet
    recorders = [Recorder(cloud.endpoint("dispatcher"))] + [Recorder(e.endpoint("dispatcher"))
                                                            for e in edges]
    load, sampler = Load(recorders, prompts), Sampler(cloud)
    restarts, restart_windows = [], []
    try:
        sampler.thread.start()
        load.thread.start()
        wait_until(lambda: all(holds(cloud, n) for n in REPLICAS), 120, "sessions on every replica")
        t_load = time.monotonic()
        time.sleep(STEADY_S)                   # a steady phase before any restart
        for pair in ROLLS:
            t0 = time.monotonic()
            with ThreadPoolExecutor(len(pair)) as pool:   # each drains, then exits
                list(pool.map(lambda n: cloud.stop(n, signal.SIGTERM, timeout=DRAIN_S + 20),
                              pair))
            t_exit = time.monotonic()
            for name in pair:
                cloud.start(name)
            cloud.wait_ready(timeout=300, names=list(pair))
            t_ready = time.monotonic()
            restarts.append({"replicas": list(pair), "drain_and_exit_s": round(t_exit - t0, 2),
                             "restart_to_ready_s": round(t_ready - t_exit, 2)})
            restart_windows.append((t0, t_ready))
            # the restarted replicas take new sessions again before the next ones go
            for name in pair:
                wait_until(lambda n=name: holds(cloud, n), 120, f"sessions placed on {name}")
        time.sleep(STEADY_S)                   # and a steady phase after the last restart
        t_unload = time.monotonic()
        load.stop.set()
        load.thread.join(10)
        end = time.monotonic() + 300
        while any(s.end is None for _, _, s in load.streams) and time.monotonic() < end:
            time.sleep(0.2)   # streams end on three recorders' threads: poll them all
    finally:
        load.stop.set()
        sampler.stop.set()
        sampler.thread.join(5)
        for r in recorders:
            r.close()

    done = errors = recovered = 0
    reasons: dict[str, int] = {}
    for i, mode, s in load.streams:
        assert s.done is not None, f"{mode} request on prompt {i} ended with {s.end}"
        s.check_exactly_once()
        assert_same_tokens(prompts[i][0], s.tokens, prompts[i][1], f"{mode}/prompt {i}")
        assert len(s.tokens) == N
        done += 1
        rs = s.done.stats.get("recovery_reasons", [])
        recovered += bool(rs)
        for r in rs:
            reasons[r] = reasons.get(r, 0) + 1
    errors = len(load.streams) - done
    # A restart's gap lasts from its SIGTERM until every request sent before the replica was
    # back has ended: the sessions placed (or replayed) meanwhile all sit on the other replica
    # until they turn over. Measured, not assumed: on a slow machine a request under this load
    # takes several seconds. One sampling round more, for the gauges to catch up.
    quiet = [(t0, max(s.ended_at for _, _, s in load.streams if s.sent_at < t_ready)
              + sampler.every) for t0, t_ready in restart_windows]
    balance = sampler.imbalance((t_load, t_unload), quiet)
    seconds = sorted(s.ended_at - s.sent_at for _, _, s in load.streams)
    figures = {
        "replicas": "2 verifier + 2 suffix, 3 dispatchers, 2 requests in flight per dispatcher "
                    f"(cloud-only and split at cut {CUT}, {N} tokens each)",
        "requests": len(load.streams), "done": done, "errors": errors,
        "tokens": sum(len(s.tokens) for _, _, s in load.streams),
        "tokens_lost": sum(max(0, N - len(s.tokens)) for _, _, s in load.streams),
        "tokens_duplicated": sum(max(0, len(s.tokens) - N) for _, _, s in load.streams),
        "equal_to_transformers": done, "sessions_replayed": recovered,
        "recovery_reasons": reasons,
        "handed_back": sum(handed_back(p.log) for p in cloud.procs.values()),
        "restarts": restarts, "request_s_median": round(seconds[len(seconds) // 2], 2),
        "quiet_after_ready_s": [round(q[1] - r[1], 2) for q, r in zip(quiet, restart_windows)],
        "balance": balance, "drain_s": DRAIN_S,
    }
    rel.record("replicas", "rolling restart of every cloud replica under load", **figures)
    print(figures)
    # placement, outside the restarts' own windows. Placement puts every new session on the
    # emptiest replica as its dispatcher sees it (tests/unit/test_replicas_placement.py: it never
    # widens a gap), but a session that ends can open one (2 : 1 becomes 2 : 0 until the next
    # arrival for that role; two departures in a row make 3), and three dispatchers see each
    # other's placements only in the replicas' next heartbeat replies, which a saturated 2-core
    # machine delays: two arrivals close together at two dispatchers can both go to the replica
    # that looked emptiest (CI once showed a steady gap of 4 in 8 of 103 samples). So the test
    # bounds the worst gap by 4 and how often it reaches 3 by a fifth of the steady samples.
    # Placement blind to load (all on one replica) shows a gap as large as every session of the
    # role, up to 6, in most samples.
    for role in ("verifier", "suffix"):
        b = balance[role]
        assert b["steady_samples"] > 0, balance
        assert b["steady_max_gap"] <= 4, balance
        assert b["steady_samples_gap_ge_3"] <= 0.2 * b["steady_samples"], balance


@pytest.fixture()
def solo(model_paths, tmp_path, request):
    """A verifier and a dispatcher; the test's parameter is the dispatcher's recovery_wait_s:
    how long a replay waits for a verifier (long enough for a supervised restart, or short)."""
    wait = str(getattr(request, "param", 4))
    c = Cluster(services=("verifier", "dispatcher"), ephemeral=True, logdir=tmp_path,
                extra={"verifier": [*rel.ONE_THREAD, *rel.FAST_PEERS],
                       "dispatcher": [*rel.FAST_PEERS, "--stall-s", "8",
                                      "--recovery-wait-s", wait]})
    c.start_all()
    try:
        c.wait_ready(timeout=300)
        yield c
    finally:
        c.stop_all()


@pytest.mark.parametrize("solo", [120], indirect=True)
def test_kill_9_under_supervision_then_down_for_good(solo, prompts, assert_same_tokens):
    """`tandem up`'s supervisor restarts a verifier killed with SIGKILL; the request in flight
    is replayed and exact. Then, unsupervised, a killed verifier fails the next request
    `unavailable` after recovery_wait_s (4 s here), not at its 120 s deadline."""
    ids, want = prompts[0]
    sup = Supervisor(solo, base_s=0.5, log=lambda m: None)
    stop = threading.Event()
    watcher = threading.Thread(target=sup.run, kwargs={"interval": 0.2, "stop": stop.is_set},
                               daemon=True)
    watcher.start()
    with Recorder(solo.endpoint("dispatcher")) as rec:
        s = rec.generate(ids, N, deadline_s=300.0)
        assert rec.wait_tokens(s, 2, 120)
        t_kill = time.monotonic()
        os.kill(solo.procs["verifier"].pid, signal.SIGKILL)
        assert rec.wait_end([s], 240)
        stop.set()
        watcher.join(5)
        assert s.done is not None, s.end
        s.check_exactly_once()
        assert_same_tokens(ids, s.tokens, want, "kill -9 + supervised restart")
        restarted_in = s.gap_after(t_kill)
        assert solo.procs["verifier"].restarts == 1
        # now down for good: no supervisor
        solo.kill("verifier")
        time.sleep(2.5)                      # the dispatcher notices (peer_timeout_s 1.5 s)
        t0 = time.monotonic()
        s2 = rec.generate(ids, N, deadline_s=120.0)
        assert rec.wait_end([s2], 60)
        waited = time.monotonic() - t0
    assert s2.error is not None and s2.error.code == "unavailable", s2.end
    # a new request waits peer_wait_s (10 s by default) for a cloud replica, not its deadline
    assert waited < 20.0
    rel.record("replicas", "kill -9 of the verifier under supervision",
               fault="SIGKILL of the only verifier mid-request; supervisor restarts it",
               output_exact=True, client_gap_s=round(restarted_in or -1, 2),
               then="verifier killed, not restarted: next request fails `unavailable` after "
                    f"{waited:.1f} s (deadline 120 s)")
    print({"gap_s": restarted_in, "unavailable_after_s": waited})


@pytest.mark.parametrize("solo", [4], indirect=True)
def test_replay_waits_bounded_then_unavailable(solo, prompts):
    """A request whose verifier dies mid-stream and never comes back ends `unavailable` after
    recovery_wait_s (4 s), not at its deadline (the issue's `kill -9` report)."""
    ids, _ = prompts[1]
    with Recorder(solo.endpoint("dispatcher")) as rec:
        s = rec.generate(ids, 64, deadline_s=300.0)
        assert rec.wait_tokens(s, 1, 120)
        solo.kill("verifier")
        t0 = time.monotonic()
        assert rec.wait_end([s], 60)
        waited = time.monotonic() - t0
    assert s.error is not None and s.error.code == "unavailable", s.end
    assert waited < 15.0, waited          # detection (~1.5 s) + recovery_wait_s (4 s)
    rel.record("replicas", "verifier down for good mid-request",
               fault="SIGKILL of the only verifier mid-stream, no restart",
               outcome=f"`unavailable` after {waited:.1f} s (recovery_wait_s 4 s, deadline 300 s)",
               message=s.error.message)
    print({"unavailable_after_s": waited, "message": s.error.message})
