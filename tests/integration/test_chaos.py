"""Chaos on the edge–cloud links: the dispatcher reaches the verifier (cloud-only and spec mode)
and the suffix (split mode) through the WAN emulator (stack/wan.py) while it shapes, drops and
partitions the link mid-generation.

For every condition: greedy output equals transformers' generate(do_sample=False), every token
reaches the client exactly once (raw event indices, duplicates included, which the SDK would
hide), and the time from the fault to the next token is recorded (docs/reliability.md). A
deadline that passes during a partition ends the request with a clear `deadline` error.

Every condition is asserted to have taken effect, so a fault that missed cannot pass as one
survived: a shape carried the requests' bytes both ways and cost the first token a round trip;
each drop closed a live connection while the streams ran (the WAN emulator's counters); a
partition silenced the streams for at least its length (the longest inter-token gap); and the
replays the fault caused are the same in Done.stats and in the dispatcher's
tandem_session_recoveries_total.

A few representative points run by default (cloud-only: two shapes, three faults; spec and split:
one shape, one fault); the sweep (delay 0–200 ms, 1–100 Mbit/s, jitter, partitions 1–10 s held
and cut, repeated drops; all in cloud-only, a spread of them in spec and split) is marked slow.
"""

from __future__ import annotations

import time

import pytest

from stack.launcher import SERVICES, Cluster
from common.models import repo_root
from tests import _reliability as rel
from tests.conftest import PROMPTS, wait_until

N = 24                        # tokens per request
PROMPT_KEYS = ("plain", "code")
AVAILABLE = [s for s in SERVICES if (repo_root() / "services" / s / "service.py").is_file()]
MODES = {"cloud-only": ("verifier", {}), "spec": ("verifier", {"policy": "pipesd"}),
         "split": ("suffix", {"cut": 4})}          # mode: (the cloud link it uses, request args)
MODES = {m: v for m, v in MODES.items()
         if m == "cloud-only" or {"spec": {"drafter"}, "split": {"prefix", "suffix"}}[m]
         <= set(AVAILABLE)}
# spec and split run these (cloud-only runs every condition)
DEFAULT_OTHER_MODES = {"100ms+-20ms 10Mbit", "partition 3s cut"}
SLOW_OTHER_MODES = {"200ms 1Mbit", "200ms+-100ms 10Mbit", "drop x2", "partition 5s cut",
                    "partition 10s hold"}

SHAPES = {                    # name: LinkShape fields (both directions)
    "100ms+-20ms 10Mbit": dict(latency_ms=100, jitter_ms=20, bandwidth_mbit=10),
    "200ms 1Mbit": dict(latency_ms=200, bandwidth_mbit=1),
}
SLOW_SHAPES = {
    "0ms 100Mbit": dict(bandwidth_mbit=100),
    "50ms 1Mbit": dict(latency_ms=50, bandwidth_mbit=1),
    "50ms+-50ms normal jitter": dict(latency_ms=50, jitter_ms=50, jitter_dist="normal"),
    "200ms 100Mbit": dict(latency_ms=200, bandwidth_mbit=100),
    "200ms+-100ms 10Mbit": dict(latency_ms=200, jitter_ms=100, bandwidth_mbit=10),
}
# name: (action, seconds, mode); the detection time is 1.5 s (FAST_PEERS), so a 1 s hold only
# delays bytes, while longer outages make the dispatcher replay sessions
FAULTS = {
    "drop x2": ("drop", 0, ""),
    "partition 1s hold": ("partition", 1, "hold"),
    "partition 3s cut": ("partition", 3, "cut"),
}
SLOW_FAULTS = {
    "partition 5s hold": ("partition", 5, "hold"),
    "partition 5s cut": ("partition", 5, "cut"),
    "partition 10s hold": ("partition", 10, "hold"),
    "partition 10s cut": ("partition", 10, "cut"),
    "drop x5 under 100ms": ("drop5", 0, ""),
}


def _params(default: dict, slow: dict) -> list:
    out = []
    for mode in MODES:
        for k in list(default) + list(slow):
            if mode != "cloud-only" and k not in DEFAULT_OTHER_MODES | SLOW_OTHER_MODES:
                continue
            fast = k in default and (mode == "cloud-only" or k in DEFAULT_OTHER_MODES)
            out.append(pytest.param(mode, k, marks=() if fast else pytest.mark.slow,
                                    id=f"{mode}-{k}"))
    return out


@pytest.fixture(scope="module")
def env(model_paths, tmp_path_factory):
    """Every service; the dispatcher's links to the verifier and the suffix each cross a WAN."""
    c = Cluster(services=AVAILABLE, ephemeral=True, logdir=tmp_path_factory.mktemp("chaos-logs"),
                extra={"verifier": rel.ONE_THREAD, "prefix": rel.ONE_THREAD,
                       "suffix": rel.ONE_THREAD,
                       "dispatcher": rel.FAST_PEERS + ["--stall-s", "4", "--spec-bo", "false"]})
    links = {}
    for cloud in {link for link, _ in MODES.values()}:
        links[cloud] = rel.Link(c.endpoint(cloud))
        c.extra["dispatcher"] += [f"--{cloud}", links[cloud].endpoint]
    with rel.running(c), rel.Recorder(c.endpoint("dispatcher")) as rec:
        yield c, links, rec
    for link in links.values():
        link.close()


@pytest.fixture(autouse=True)
def isolated(env):
    """Each condition starts on a healed link with no request of an earlier one in flight, so
    a condition that failed half-way cannot leak its replays into the next one's counts."""
    yield
    c, links, rec = env
    for link in links.values():
        link.shape()
        wait_until(lambda link=link: link.partitioned_for() == 0, 30, "the link to heal")
    assert rec.wait_end(list(rec.streams.values()), timeout=180), "requests never ended"


@pytest.fixture(scope="module")
def prompts(tokenizer, reference):
    out = {k: tokenizer.encode(PROMPTS[k]) for k in PROMPT_KEYS}
    return {k: (ids, reference(ids, N)) for k, ids in out.items()}


def _check(streams, prompts, assert_same_tokens, label, n: int = N) -> dict:
    figures = {"requests": len(streams), "tokens_expected": n * len(streams),
               "tokens_received": 0, "tokens_lost": 0, "tokens_duplicated": 0,
               "recoveries": 0, "recovery_reasons": [], "near_ties": 0}
    for key, s in zip(PROMPT_KEYS, streams):
        ids, want = prompts[key]
        assert s.done is not None, f"{label}/{key}: ended with {s.end}"
        s.check_exactly_once()
        ties = len(assert_same_tokens.ties)
        assert_same_tokens(ids, s.tokens, want, f"{label}/{key}")
        figures["near_ties"] += len(assert_same_tokens.ties) - ties
        figures["tokens_received"] += len(s.tokens)
        figures["tokens_lost"] += max(0, n - len(s.tokens))
        figures["tokens_duplicated"] += max(0, len(s.tokens) - n)
        figures["recoveries"] += s.done.stats.get("recoveries", 0)
        figures["recovery_reasons"] += s.done.stats.get("recovery_reasons", [])
    return figures


@pytest.mark.parametrize("mode,name", _params(SHAPES, SLOW_SHAPES))
def test_shaped_link(env, prompts, assert_same_tokens, mode, name):
    c, links, rec = env
    cloud, args = MODES[mode]
    link = links[cloud]
    shape = {**SHAPES, **SLOW_SHAPES}[name]
    wan_before = link.stats()
    link.shape(**shape)
    try:
        t = time.monotonic()
        streams = [rec.generate(prompts[k][0], N, mode=mode, **args) for k in PROMPT_KEYS]
        assert rec.wait_end(streams, timeout=180), "requests never ended"
        wall = time.monotonic() - t
    finally:
        link.shape()
    figures = _check(streams, prompts, assert_same_tokens, f"{mode} {name}")
    # the shape took effect: the requests crossed the shaped link both ways, and a first token
    # needs a round trip over it (uniform jitter takes at most jitter_ms off each way)
    wan = link.stats()
    for way in ("up", "down"):
        assert wan[way]["bytes_out"] > wan_before[way]["bytes_out"], (way, wan)
    if shape.get("jitter_dist", "uniform") == "uniform":
        one_way_s = max(0, shape.get("latency_ms", 0) - shape.get("jitter_ms", 0)) / 1e3
        first = min(s.token_times()[0] - s.sent_at for s in streams)
        assert first >= 2 * one_way_s, f"first token after {first:.3f} s < a round trip"
    rel.record("chaos", f"{mode}: link {name}", kind="shape", mode=mode, link=f"dispatcher->{cloud}",
               shape=shape, wall_s=round(wall, 2),
               longest_gap_s=round(max(s.longest_gap() for s in streams), 3), **figures)


# tokens per request under each fault: five drops 0.5 s apart need a longer stream to land in
FAULT_TOKENS = {"drop5": 48}


def _inject(link: rel.Link, rec: rel.Recorder, streams: list[rel.Stream], action: str,
            seconds: float, how: str) -> list[int]:
    """Inject the fault while the streams run; for drops, the connections each one closed
    (every drop is aimed at a live connection, asserted)."""
    dropped: list[int] = []
    if action == "drop":
        dropped.append(link.drop_live(streams))
        # the second drop once the streams moved on: it hits the re-made connection
        moved = [len(s.tokens) for s in streams]
        assert rec.wait(lambda: any(len(s.tokens) > k for s, k in zip(streams, moved))
                        or all(s.end is not None for s in streams), 60), "no token after a drop"
        dropped.append(link.drop_live(streams))
    elif action == "drop5":
        link.shape(latency_ms=100)
        try:
            for k in range(5):
                if k:
                    time.sleep(0.5)          # the fault itself: a drop every 0.5 s
                dropped.append(link.drop_live(streams))
        finally:
            link.shape()
    else:
        link.partition(seconds, how)
    return dropped


@pytest.mark.parametrize("mode,name", _params(FAULTS, SLOW_FAULTS))
def test_link_fault(env, tokenizer, reference, assert_same_tokens, mode, name):
    """Every fault takes effect, asserted: each drop closes a live connection (the WAN
    emulator's counters) and a partition silences the streams for at least its length (the
    longest inter-token gap); the replays it caused are recorded (Done.stats and the dispatcher's
    tandem_session_recoveries_total agree)."""
    c, links, rec = env
    cloud, args = MODES[mode]
    link = links[cloud]
    action, seconds, how = {**FAULTS, **SLOW_FAULTS}[name]
    n = FAULT_TOKENS.get(action, N)
    ids_of = {k: tokenizer.encode(PROMPTS[k]) for k in PROMPT_KEYS}
    prompts = {k: (ids, reference(ids, n)) for k, ids in ids_of.items()}
    wan_before = link.stats()
    replays_before = rel.recoveries_total(c)
    streams = [rec.generate(prompts[k][0], n, deadline_s=120, mode=mode, **args)
               for k in PROMPT_KEYS]
    assert rec.wait_tokens(streams[0], 4), "no tokens before the fault"
    t_fault = time.monotonic()
    dropped = _inject(link, rec, streams, action, seconds, how)
    assert rec.wait_end(streams, timeout=180), "requests never ended"
    figures = _check(streams, prompts, assert_same_tokens, f"{mode} {name}", n)
    wan = link.stats()
    replays_metric = rel.recoveries_total(c) - replays_before
    assert replays_metric == figures["recoveries"], (replays_metric, figures)
    longest_gap = max(s.longest_gap() for s in streams)
    if action.startswith("drop"):
        assert wan["drops"] - wan_before["drops"] >= len(dropped) and all(dropped), (dropped, wan)
        effect = f"{len(dropped)} drops closed {sum(dropped)} live connections"
    else:
        assert wan["partitions"] == wan_before["partitions"] + 1, wan
        # nothing crosses a partition: the streams' silence spans it (timer slack: 50 ms)
        assert longest_gap >= seconds - 0.05, f"longest gap {longest_gap:.2f} s < {seconds} s"
        effect = f"streams silent {longest_gap:.2f} s across a {seconds} s partition"
    waits = [s.gap_after(t_fault) for s in streams if s.gap_after(t_fault) is not None]
    rel.record("chaos", f"{mode}: fault {name}", kind="fault", mode=mode,
               link=f"dispatcher->{cloud}", action=action, seconds=seconds, how=how,
               time_to_recover_s=round(max(waits), 3) if waits else None,
               longest_gap_s=round(longest_gap, 3), took_effect=True, effect=effect,
               connections_dropped=sum(dropped), replays_metric=replays_metric, **figures)


def test_deadline_passes_during_partition(env, prompts, assert_same_tokens):
    """A cut link and a 2 s deadline: the client gets `deadline` (not a hang), and the next
    request after the link heals is served."""
    c, links, rec = env
    ids = prompts["plain"][0]
    links["verifier"].partition(6, "cut")
    t = time.monotonic()
    s = rec.generate(ids, 64, deadline_s=2.0)
    assert rec.wait_end([s], timeout=30), "request hung past its deadline"
    waited = time.monotonic() - t
    assert s.error is not None and s.error.code == "deadline", s.end
    assert "deadline" in s.error.message
    s.check_exactly_once()
    rel.wait_link_back(c, links["verifier"], "verifier")
    after = rec.generate(ids, 4, deadline_s=60)
    assert rec.wait_end([after], timeout=90)
    assert after.done is not None
    assert_same_tokens(ids, after.tokens, prompts["plain"][1][:4], "after heal")
    rel.record("chaos", "deadline during 6s cut partition", kind="deadline", deadline_s=2.0,
               error=s.error.code, answered_after_s=round(waited, 2),
               tokens_before_error=len(s.tokens), served_after_heal=True)
