"""The cloud unreachable mid-request, and the edge gone for good.

Spec mode through a WAN partition of the dispatcher -> verifier link (stack/wan.py):
* without allow_edge_only the session waits and retries past peer_wait_s (2 s here) until its
  deadline: a partition that heals in time ends with transformers' output, every token once;
  one that outlasts the deadline ends with a clear `deadline` error, not `unavailable` at once;
* with allow_edge_only the drafter's tokens continue the stream marked degraded while the link
  is down, and when it heals the session resumes verification from everything streamed so far
  (the tokens after that are the target's own again), every token once.

The dispatcher killed with SIGKILL: nobody closes its sessions, so the verifier, the drafter, the
prefix and the suffix drop them once its heartbeats have been silent for peer_idle_timeout_s (2 s
here), instead of generating to max_tokens and holding KV caches / llama contexts for nobody.
"""

from __future__ import annotations

import time
import urllib.request

import pytest

from common import protocol
from stack.launcher import Cluster
from tests import _reliability as rel
from tests.conftest import PROMPTS

IDLE_S = 2.0      # peer_idle_timeout_s of the cloud services and the drafter
HOLDERS = ("verifier", "drafter", "prefix", "suffix")   # services that hold sessions


@pytest.fixture(scope="module")
def env(model_paths, tmp_path_factory):
    reap = ["--peer-idle-timeout-s", str(IDLE_S)]
    c = Cluster(services=HOLDERS + ("dispatcher",), ephemeral=True,
                logdir=tmp_path_factory.mktemp("partition-logs"),
                extra={**{svc: rel.ONE_THREAD + reap for svc in HOLDERS},
                       "dispatcher": rel.FAST_PEERS + ["--stall-s", "4", "--peer-wait-s", "2",
                                                       "--spec-bo", "false"]})
    link = rel.Link(c.endpoint("verifier"))
    c.extra["dispatcher"] += ["--verifier", link.endpoint]
    with rel.running(c), rel.Recorder(c.endpoint("dispatcher")) as rec:
        yield c, link, rec
    link.close()


def _gauge(c: Cluster, service: str, name: str) -> float:
    with urllib.request.urlopen(c.procs[service].url("/metrics"), timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f'{name}{{service="{service}"'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_spec_waits_through_partition_and_output_stays_exact(env, tokenizer, reference,
                                                              assert_same_tokens):
    c, link, rec = env
    ids = tokenizer.encode(PROMPTS["plain"])
    n = 24
    s = rec.generate(ids, n, deadline_s=90, mode="spec", policy="pipesd")
    assert rec.wait_tokens(s, 4), "no tokens before the partition"
    link.partition(5, "cut")            # > 1.5 s detection + 2 s peer_wait_s
    assert rec.wait_end([s], timeout=120), "request never ended"
    assert s.done is not None, f"ended with {s.end}"
    s.check_exactly_once()
    assert_same_tokens(ids, s.tokens, reference(ids, n), "spec through a 5 s partition")
    assert "down" in s.done.stats.get("recovery_reasons", []), s.done.stats
    assert s.longest_gap() >= 5 - 0.05, f"a 5 s partition, yet the longest gap {s.longest_gap():.2f} s"
    rel.record("partitions", "spec, 5 s cut partition, waits for the cloud", kind="wait",
               partition_s=5, tokens=len(s.tokens), tokens_lost=n - len(s.tokens),
               identical=True, wall_s=round(time.monotonic() - s.sent_at, 2),
               recovery_reasons=s.done.stats.get("recovery_reasons", []))


def test_spec_deadline_during_partition_is_deadline_not_unavailable(env, tokenizer):
    c, link, rec = env
    ids = tokenizer.encode(PROMPTS["code"])
    s = rec.generate(ids, 200, deadline_s=7, mode="spec", policy="pipesd")
    assert rec.wait_tokens(s, 2), "no tokens before the partition"
    link.partition(9, "cut")
    assert rec.wait_end([s], timeout=30), "request hung past its deadline"
    assert s.error is not None and s.error.code == protocol.DEADLINE, s.end
    waited = time.monotonic() - s.sent_at
    assert waited >= 6.0   # it waited for the link, not peer_wait_s
    s.check_exactly_once()
    rel.record("partitions", "spec, 9 s cut partition, 7 s deadline", kind="deadline",
               partition_s=9, deadline_s=7, error=s.error.code, answered_after_s=round(waited, 2),
               tokens_before_error=len(s.tokens))
    rel.wait_link_back(c, link, "verifier")     # the next test starts on a working link


def test_edge_only_during_partition_then_resumes_verification(env, tokenizer, reference,
                                                              assert_same_tokens):
    c, link, rec = env
    ids = tokenizer.encode(PROMPTS["code"])
    n = 1000                            # the drafter alone cannot finish before the heal
    s = rec.generate(ids, n, deadline_s=120, mode="spec", policy="pipesd", allow_edge_only=True)
    rid = rec.rid
    assert rec.wait_tokens(s, 4), "no tokens before the partition"
    link.partition(3, "cut")

    def resumed_at():
        """Stream index of the first token after the degraded ones, or None (-1: none yet)."""
        ev = [e.msg for e in s.token_events]
        first = next((i for i, m in enumerate(ev) if m.degraded), None)
        if first is None:
            return None
        return next((m.index for m in ev[first:] if not m.degraded), -1)

    assert rec.wait(lambda: resumed_at() is not None or s.end is not None, 30), "never degraded"
    assert rec.wait(lambda: (resumed_at() or -1) >= 0 or s.end is not None, 60), "never resumed"
    assert rec.wait(lambda: len(s.tokens) >= resumed_at() + 6 or s.end is not None, 60)
    with rec.lock:                      # enough: stop it
        rec.outbox.append(protocol.encode(protocol.Cancel(rid=rid)))
    assert rec.wait_end([s], timeout=30)
    assert s.done is not None and s.done.finish_reason == "cancelled", s.end
    s.check_exactly_once()
    ev = [e.msg for e in s.token_events]
    first = next(i for i, m in enumerate(ev) if m.degraded)
    back = next(i for i in range(first, len(ev)) if not ev[i].degraded)
    exact = [t for m in ev[:first] for t in m.token_ids]
    assert len(exact) >= 4, f"only {len(exact)} target tokens before the partition"
    assert exact == reference(ids, len(exact)), "tokens before the partition are the target's"
    st = s.done.stats
    assert st["degraded"] is True and st["degraded_tokens"] > 0
    assert st["resumed_at"] == ev[back].index
    # a cancelled request's stats are complete: built after the mode's cleanup
    assert "resumed" in st["recovery_reasons"] and st["recoveries"] >= 1, st
    assert st["rounds"] > 0, st
    # after the heal: the target's own continuation of everything streamed, degraded included
    prefix = list(ids) + s.tokens[:ev[back].index]
    after = s.tokens[ev[back].index:][:6]
    assert len(after) == 6, f"only {len(after)} tokens checked after the resume"
    assert_same_tokens(prefix, after, reference(prefix, len(after)), "resumed")
    text = urllib.request.urlopen(c.procs["dispatcher"].url("/metrics"), timeout=5).read().decode()
    assert 'tandem_degraded_tokens_total{mode="spec",service="dispatcher"}' in text
    assert 'reason="resumed"' in text    # tandem_session_recoveries_total
    rel.record("partitions", "spec with allow_edge_only, 3 s cut partition", kind="degraded",
               partition_s=3, exact_before=len(exact), degraded_tokens=st["degraded_tokens"],
               resumed_at=st["resumed_at"], resumed_checked=len(after), identical_after_resume=True)


def test_dispatcher_killed_cloud_drops_its_sessions(env, tokenizer):
    """Runs last: kills the dispatcher."""
    c, link, rec = env
    ids = tokenizer.encode(PROMPTS["plain"])
    streams = [rec.generate(ids, 1000, deadline_s=300, mode=m, **kw)
               for m, kw in (("cloud-only", {}), ("spec", {"policy": "pipesd"}),
                             ("split", {"cut": 6}))]
    assert all(rec.wait_tokens(s, 3) for s in streams)
    assert _gauge(c, "verifier", "tandem_sessions") >= 2
    assert _gauge(c, "prefix", "tandem_sessions") >= 1 and _gauge(c, "suffix", "tandem_sessions") >= 1
    dropped = {svc: _gauge(c, svc, "tandem_orphaned_sessions_dropped_total") for svc in HOLDERS}
    c.kill("dispatcher")
    t = time.monotonic()
    left = {}
    while time.monotonic() - t < IDLE_S + 6:
        left = {svc: _gauge(c, svc, "tandem_sessions") for svc in HOLDERS}
        if not any(left.values()):
            break
        time.sleep(0.25)
    took = time.monotonic() - t
    assert not any(left.values()), f"sessions left {took:.1f} s after the kill: {left}"
    assert took >= IDLE_S - 0.5, "dropped before the client had been silent for the timeout"
    now = {svc: _gauge(c, svc, "tandem_orphaned_sessions_dropped_total") for svc in HOLDERS}
    assert now["verifier"] >= dropped["verifier"] + 2, now
    assert all(now[svc] >= dropped[svc] + 1 for svc in ("drafter", "prefix", "suffix")), now
    rel.record("partitions", "dispatcher kill -9: cloud drops its sessions", kind="orphans",
               sessions=len(streams), idle_timeout_s=IDLE_S, dropped_after_s=round(took, 2))
