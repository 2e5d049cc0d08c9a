"""Process faults: services killed with SIGKILL mid-generation, then restarted.

* verifier killed and restarted (cloud-only and spec mode), suffix or prefix killed and
  restarted (split mode): each session is replayed from its committed tokens on the restarted
  service (services/dispatcher/recovery.py) and finishes with transformers' output, every token
  streamed exactly once;
* drafter killed (spec mode): the session goes on with the target alone, output exact;
* two verifier replicas, one killed: its sessions move to the live one;
* dispatcher killed and back only after the request's deadline: the client gets a clear error
  from the SDK (`unavailable`, naming the lost dispatcher and the deadline) instead of hanging,
  and a resubmitted request is served once it is back. (Back within the deadline, the SDK
  resumes the stream itself: tests/integration/test_resume_process.py.)

Recovery times (kill to the next token at the client) go to docs/reliability.md.
"""

from __future__ import annotations

import threading
import time

import pytest

from stack.launcher import SERVICES, Cluster
from common.models import repo_root
from tandem import Client, TandemError, Unavailable
from tests import _reliability as rel
from tests.conftest import PROMPTS

N = 32
AVAILABLE = [s for s in SERVICES if (repo_root() / "services" / s / "service.py").is_file()]
needs = {mode: pytest.mark.skipif(not set(svcs) <= set(AVAILABLE), reason=f"{mode} not built")
         for mode, svcs in {"spec": ("drafter",), "split": ("prefix", "suffix")}.items()}
KEYS = ("plain", "code", "count", "story")
TEXTS = {**PROMPTS, "count": "1, 2, 3, 4,", "story": "Once upon a time"}


@pytest.fixture(scope="module")
def env(model_paths, tmp_path_factory):
    """One dispatcher on every service (verifier A alone), one on verifier replicas A and B."""
    logs = tmp_path_factory.mktemp("fault-logs")
    flags = rel.FAST_PEERS + ["--stall-s", "4", "--peer-wait-s", "60"]
    single = Cluster(services=AVAILABLE, ephemeral=True, logdir=logs / "a",
                     extra={"verifier": rel.ONE_THREAD, "prefix": rel.ONE_THREAD,
                            "suffix": rel.ONE_THREAD,
                            "dispatcher": flags + ["--spec-bo", "false"]})
    pair = Cluster(services=("verifier", "dispatcher"), ephemeral=True, logdir=logs / "b",
                   extra={"verifier": rel.ONE_THREAD, "dispatcher": flags})
    both = f"{single.endpoint('verifier')},{pair.endpoint('verifier')}"
    pair.extra["dispatcher"] = flags + ["--verifier", both, "--spec-bo", "false"]
    single.start_all()
    pair.start_all()
    try:
        single.wait_ready(timeout=300)
        pair.wait_ready(timeout=300)
        yield single, pair
    finally:
        pair.stop_all()
        single.stop_all()


@pytest.fixture(scope="module")
def prompts(tokenizer, reference):
    out = {k: tokenizer.encode(TEXTS[k]) for k in KEYS}
    return {k: (ids, reference(ids, N)) for k, ids in out.items()}


def _check_all(streams, keys, prompts, assert_same_tokens, label) -> dict:
    reasons, replicas = [], []
    for k, s in zip(keys, streams):
        assert s.done is not None, f"{label}/{k}: ended with {s.end}"
        s.check_exactly_once()
        assert_same_tokens(prompts[k][0], s.tokens, prompts[k][1], f"{label}/{k}")
        reasons += s.done.stats.get("recovery_reasons", [])
        replicas.append(s.done.stats.get("verifier_replica"))
    return {"sessions": len(streams), "tokens": sum(len(s.tokens) for s in streams),
            "tokens_lost": sum(max(0, N - len(s.tokens)) for s in streams),
            "tokens_duplicated": sum(max(0, len(s.tokens) - N) for s in streams),
            "sessions_recovered": sum(1 for s in streams if s.done.stats.get("recoveries")),
            "recovery_reasons": reasons, "final_replicas": replicas}


def _kill_restart(single, prompts, assert_same_tokens, victim: str, mode: str, label: str,
                  restart: bool = True, recovered: bool = True, **gen) -> None:
    keys = KEYS[:2]
    with rel.Recorder(single.endpoint("dispatcher")) as rec:
        streams = [rec.generate(prompts[k][0], N, mode=mode, **gen) for k in keys]
        assert rec.wait_tokens(streams[0], 4)
        replays_before = rel.recoveries_total(single)
        t_kill = time.monotonic()
        single.kill(victim)
        assert any(s.end is None for s in streams), "the sessions ended before the kill"
        if restart:
            single.start(victim)
        assert rec.wait_end(streams, timeout=240), "sessions never ended"
    figures = _check_all(streams, keys, prompts, assert_same_tokens, label)
    replays = rel.recoveries_total(single) - replays_before
    # the kill took effect: sessions were replayed (both counts agree), or, for the drafter,
    # the dispatcher noticed its loss and went on with the target alone
    assert replays == sum(s.done.stats.get("recoveries", 0) for s in streams), replays
    if recovered:
        assert figures["sessions_recovered"] >= 1, figures
        effect = f"{figures['sessions_recovered']} sessions replayed ({replays:.0f} replays)"
    else:
        lost = sum(1 for s in streams if s.done.stats.get("drafter_lost"))
        assert lost >= 1, [s.done.stats for s in streams]
        effect = f"{lost} sessions lost their drafter and went on with the target alone"
    waits = [s.gap_after(t_kill) for s in streams if s.gap_after(t_kill) is not None]
    rel.record("faults", label, fault=f"SIGKILL {victim}" + (", restart" if restart else ""),
               mode=mode, time_to_recover_s=round(max(waits), 2) if waits else None,
               took_effect=True, effect=effect, **figures)
    if not restart:
        single.start(victim)
    single.wait_ready(timeout=300)


def test_verifier_killed_and_restarted(env, prompts, assert_same_tokens):
    _kill_restart(env[0], prompts, assert_same_tokens, "verifier", "cloud-only",
                  "verifier kill -9 + restart (cloud-only)")


@needs["spec"]
def test_verifier_killed_and_restarted_spec(env, prompts, assert_same_tokens):
    _kill_restart(env[0], prompts, assert_same_tokens, "verifier", "spec",
                  "verifier kill -9 + restart (spec, pipesd)", policy="pipesd")


@needs["split"]
def test_suffix_killed_and_restarted_split(env, prompts, assert_same_tokens):
    _kill_restart(env[0], prompts, assert_same_tokens, "suffix", "split",
                  "suffix kill -9 + restart (split, cut 4)", cut=4)


@pytest.mark.slow
@needs["split"]
def test_prefix_killed_and_restarted_split(env, prompts, assert_same_tokens):
    _kill_restart(env[0], prompts, assert_same_tokens, "prefix", "split",
                  "prefix kill -9 + restart (split, cut 12)", cut=12)


@pytest.mark.slow
@needs["spec"]
def test_drafter_killed_spec(env, prompts, assert_same_tokens):
    """No replay needed: the session goes on with the target alone (zero-draft rounds)."""
    _kill_restart(env[0], prompts, assert_same_tokens, "drafter", "spec",
                  "drafter kill -9 (spec, pipesd)", restart=False, recovered=False,
                  policy="pipesd")


def test_replica_failover(env, prompts, assert_same_tokens):
    single, pair = env
    with rel.Recorder(pair.endpoint("dispatcher")) as rec:
        streams = [rec.generate(prompts[k][0], N) for k in KEYS]
        assert rec.wait_tokens(streams[0], 6)
        t_kill = time.monotonic()
        single.kill("verifier")          # replica A; B (pair's verifier) stays
        assert any(s.end is None for s in streams), "the sessions ended before the kill"
        try:
            assert rec.wait_end(streams, timeout=240), "sessions never ended"
        finally:
            single.start("verifier")
    figures = _check_all(streams, KEYS, prompts, assert_same_tokens, "failover")
    assert figures["sessions_recovered"] >= 1
    moved = [s for s in streams if s.done.stats.get("recoveries")]
    assert all(s.done.stats["verifier_replica"] == "verifier-1" for s in moved)
    waits = [s.gap_after(t_kill) for s in moved if s.gap_after(t_kill) is not None]
    rel.record("faults", "verifier replica kill -9, 2 replicas (cloud-only)",
               fault="SIGKILL one of two verifier replicas", took_effect=True,
               effect=f"{len(moved)} sessions moved to the live replica",
               time_to_recover_s=round(max(waits), 2) if waits else None, **figures)
    single.wait_ready(timeout=300)


def test_dispatcher_killed_client_gets_clear_error_and_resubmits(env, prompts,
                                                                  assert_same_tokens):
    single, _ = env
    ids, want = prompts["plain"]
    outcome: dict = {}
    first = threading.Event()

    def client():
        try:
            with Client(single.endpoint("dispatcher"), timeout_s=60) as c:
                for _ in c.generate(ids, max_tokens=N, stop_at_eos=False, deadline_s=2.0):
                    first.set()
        except TandemError as e:
            outcome["error"] = e
        outcome["at"] = time.monotonic()
        first.set()

    th = threading.Thread(target=client)
    th.start()
    assert first.wait(120)
    t_kill = time.monotonic()
    single.kill("dispatcher")
    single.start("dispatcher")
    th.join(60)
    assert not th.is_alive(), "the client hung"
    assert isinstance(outcome.get("error"), Unavailable), outcome
    assert "dispatcher" in outcome["error"].message and "deadline" in outcome["error"].message
    single.wait_ready(timeout=300, names=["dispatcher"])
    t = time.monotonic()
    with Client(single.endpoint("dispatcher"), timeout_s=120) as c:
        r = c.complete(ids, max_tokens=N, stop_at_eos=False)
    assert_same_tokens(ids, r.token_ids, want, "resubmitted")
    rel.record("faults", "dispatcher kill -9 + restart (cloud-only)",
               fault="SIGKILL dispatcher, restart; client resubmits",
               client_error=type(outcome["error"]).__name__,
               error_after_s=round(outcome["at"] - t_kill, 2),
               resubmitted_tokens=len(r.token_ids), resubmit_s=round(time.monotonic() - t, 2),
               sessions=1, tokens_lost=0, took_effect=True,
               effect="the client's request ended `unavailable` (its 2 s deadline passed "
                      "before the dispatcher was back)")
