"""Split mode end to end: SDK -> dispatcher -> prefix ([0, c)) + suffix ([c, L)), real processes on
loopback. Greedy output must equal transformers' generate(do_sample=False) token for token, for
every cut tried and every scheduler; bad input gets a clear error and disturbs nobody else.

The executor-level suite (tests/unit/test_split_executor.py) covers every cut 1..L-1 x every scheduler;
here a subset of cuts runs through the real services."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import numpy as np
import pytest
import torch
import zmq.asyncio

from common import protocol, sampling
from stack.launcher import Cluster
from common.runtime import Peer, PeerError
from tandem import AsyncClient, Client, InvalidRequest, Unavailable
from tests.conftest import PROMPTS, metric_samples

L = 30
H = 576


@pytest.fixture(scope="module", autouse=True)
def one_thread(hf_model):
    """Reference model on one thread: on a shared 2-core machine two threads wait on each other
    (measured 7-25x slower under load). Restored for the modules that follow."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def start_cluster(logdir, scheduler="dsb", extra=None):
    flags = {"suffix": ["--scheduler", scheduler, "--threads", "1"],
             "prefix": ["--threads", "1"],
             "dispatcher": ["--heartbeat-s", "0.5", "--peer-timeout-s", "2"]}
    for k, v in (extra or {}).items():
        flags[k] = flags.get(k, []) + v
    c = Cluster(services=("prefix", "suffix", "dispatcher"), ephemeral=True, logdir=logdir,
                extra=flags)
    c.start_all()
    try:
        c.wait_ready(timeout=180)
    except BaseException:
        c.stop_all()
        raise
    return c


@pytest.fixture(scope="module")
def cluster(model_paths, tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("split-logs"))
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.endpoint("dispatcher"), timeout_s=120) as c:
        yield c


def concurrent(endpoint, jobs):
    """Run (prompt, kwargs) jobs at once through one AsyncClient; results in order."""
    async def go():
        async with AsyncClient(endpoint, timeout_s=120) as c:
            return await asyncio.gather(*[c.complete(p, mode="split", stop_at_eos=False, **kw)
                                          for p, kw in jobs], return_exceptions=True)
    return asyncio.run(go())


@pytest.mark.parametrize("cut", [1, 4, 15, 29])
def test_greedy_equals_transformers(client, tokenizer, reference, assert_same_tokens, cut):
    ids = tokenizer.encode(PROMPTS["plain"])
    r = client.complete(PROMPTS["plain"], mode="split", cut=cut, max_tokens=8, stop_at_eos=False)
    assert_same_tokens(ids, r.token_ids, reference(ids, 8), f"split cut {cut}")
    assert r.stats["cut"] == cut and r.stats["generated_tokens"] == 8
    assert r.stats["edge_forward_s"] > 0 and r.stats["cloud_forward_s"] > 0


def mixed_jobs(tokenizer):
    prompts = [PROMPTS["plain"], PROMPTS["code"], "1, 2, 3,", PROMPTS["chat"], "Once upon a time"]
    cuts = [2, 9, 17, 29, 2, 5]
    return [(prompts[i % len(prompts)], {"cut": c, "max_tokens": 5 + 2 * (i % 3)})
            for i, c in enumerate(cuts)]


def check_jobs(jobs, results, tokenizer, reference, assert_same_tokens, label):
    for (p, kw), r in zip(jobs, results):
        assert not isinstance(r, BaseException), f"{label} cut {kw['cut']}: {r!r}"
        ids = tokenizer.encode(p)
        assert_same_tokens(ids, r.token_ids, reference(ids, kw["max_tokens"]),
                           f"{label} cut {kw['cut']}")


def test_concurrent_mixed_cuts_equal_transformers(cluster, tokenizer, reference,
                                                  assert_same_tokens):
    jobs = mixed_jobs(tokenizer)
    results = concurrent(cluster.endpoint("dispatcher"), jobs)
    check_jobs(jobs, results, tokenizer, reference, assert_same_tokens, "dsb concurrent")
    text = urllib.request.urlopen(cluster.procs["suffix"].url("/metrics"), timeout=5).read().decode()
    for name in ("tandem_split_window_size_bucket", "tandem_split_window_depth_layers_bucket",
                 "tandem_split_forward_calls_per_step_bucket", "tandem_split_idle_gap_seconds_bucket",
                 "tandem_split_tokens_total", 'phase="shared"', 'phase="private"'):
        assert name in text, name
    assert 'scheduler="dsb"' in text
    # six sessions at six different cuts ran concurrently: some window held several of them
    sizes = [float(line.split()[-1]) for line in text.splitlines()
             if line.startswith("tandem_split_window_size_sum")]
    counts = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("tandem_split_window_size_count")]
    assert sum(sizes) / sum(counts) > 1.0


def test_seeded_sampling_is_reproducible_and_follows_the_model(client, tokenizer, hf_model):
    kw = dict(mode="split", cut=7, max_tokens=8, stop_at_eos=False, temperature=0.8, top_k=40,
              seed=1234)
    a = client.complete(PROMPTS["code"], **kw)
    b = client.complete(PROMPTS["code"], **kw)
    assert a.token_ids == b.token_ids
    # the same draws from transformers' logits: position-keyed seeded sampling
    ids = tokenizer.encode(PROMPTS["code"])
    s = protocol.Sampling(temperature=0.8, top_k=40, seed=1234)
    want = []
    with torch.inference_mode():
        for _ in range(8):
            logits = hf_model(torch.tensor([ids + want])).logits[0, -1]
            want.append(sampling.sample(logits, s, len(ids) + len(want)))
    assert a.token_ids == want


def test_bad_cut_is_a_clear_error(client):
    for cut in (L, 99):
        with pytest.raises(InvalidRequest, match=r"cut .* outside \[1, 29\]"):
            client.complete("hello", mode="split", cut=cut, max_tokens=2)
    r = client.complete("hello", mode="split", cut=3, max_tokens=2, stop_at_eos=False)
    assert len(r.token_ids) == 2


async def _peer(endpoint):
    ctx = zmq.asyncio.Context()
    peer = Peer(ctx, endpoint, name="suffix", owner="test", heartbeat_s=0.5, timeout_s=5)
    assert await peer.wait_up(10)
    return ctx, peer


def _hidden(x: np.ndarray):
    ref, buf = protocol.tensor_frame(x, 0)
    return ref, [buf]


def test_suffix_bad_input_gets_clear_errors_and_others_are_unaffected(
        cluster, tokenizer, reference, assert_same_tokens):
    async def go():
        ctx, peer = await _peer(cluster.endpoint("suffix"))
        errors = {}

        async def expect(name, msg, buffers=()):
            with pytest.raises(PeerError) as e:
                await peer.request(msg, buffers, timeout=10)
            errors[name] = (e.value.code, e.value.message)

        good = np.random.default_rng(0).standard_normal((4, H)).astype(np.float32)
        # a real session runs through the dispatcher meanwhile
        async with AsyncClient(cluster.endpoint("dispatcher"), timeout_s=120) as c:
            bystander = asyncio.ensure_future(c.complete(PROMPTS["plain"], mode="split", cut=11,
                                                         max_tokens=8, stop_at_eos=False))
            ref, bufs = _hidden(good[:, :100])
            await expect("shape", protocol.SuffixOpen(sid="t-shape", cut=5, start=0, hidden=ref), bufs)
            ref, bufs = _hidden(good.astype(np.int32))
            await expect("dtype", protocol.SuffixOpen(sid="t-dtype", cut=5, start=0, hidden=ref), bufs)
            ref, bufs = _hidden(good)
            await expect("cut", protocol.SuffixOpen(sid="t-cut", cut=L, start=0, hidden=ref), bufs)
            await expect("cut0", protocol.SuffixOpen(sid="t-cut0", cut=0, start=0, hidden=ref), bufs)
            nan = good.copy()
            nan[1, 3] = np.nan
            ref2, bufs2 = _hidden(nan)
            await expect("nan", protocol.SuffixOpen(sid="t-nan", cut=5, start=0, hidden=ref2), bufs2)
            one, one_bufs = _hidden(good[:1])
            await expect("unknown", protocol.SuffixStep(sid="nobody", seq=1, start=4, hidden=one), one_bufs)
            # a proper session, then a step at the wrong position, then a step after close
            tok, _ = await peer.request(protocol.SuffixOpen(sid="t-ok", cut=5, start=0, hidden=ref),
                                        bufs, timeout=30)
            assert isinstance(tok, protocol.SuffixToken) and tok.position == 4
            await expect("position", protocol.SuffixStep(sid="t-ok", seq=1, start=7, hidden=one), one_bufs)
            two, two_bufs = _hidden(good[:2])
            await expect("two", protocol.SuffixStep(sid="t-ok", seq=1, start=4, hidden=two), two_bufs)
            tok2, _ = await peer.request(protocol.SuffixStep(sid="t-ok", seq=1, start=4, hidden=one),
                                         one_bufs, timeout=30)
            assert tok2.position == 5
            # a resent step (same seq) is answered from state, not run again
            again, _ = await peer.request(protocol.SuffixStep(sid="t-ok", seq=1, start=4, hidden=one),
                                          one_bufs, timeout=30)
            assert (again.position, again.token) == (tok2.position, tok2.token)
            await peer.request(protocol.Close(sid="t-ok"), timeout=10)
            await expect("closed", protocol.SuffixStep(sid="t-ok", seq=2, start=5, hidden=one), one_bufs)
            result = await bystander
        peer.close()
        ctx.term()
        return errors, result

    errors, result = asyncio.run(go())
    codes = {k: v[0] for k, v in errors.items()}
    assert codes == {"shape": "bad_tensor", "dtype": "bad_tensor", "cut": "bad_field",
                     "cut0": "bad_field", "nan": "bad_tensor", "unknown": "unknown_session",
                     "position": "bad_field", "two": "bad_tensor", "closed": "unknown_session"}
    assert "[n >= 1, 576]" in errors["shape"][1] and "outside [1, 29]" in errors["cut"][1]
    ids = tokenizer.encode(PROMPTS["plain"])
    assert_same_tokens(ids, result.token_ids, reference(ids, 8), "bystander")


def test_prefix_bad_input(cluster):
    async def go():
        ctx = zmq.asyncio.Context()
        peer = Peer(ctx, cluster.endpoint("prefix"), name="prefix", owner="test", heartbeat_s=0.5)
        assert await peer.wait_up(10)
        out = {}
        for name, msg in (("cut", protocol.PrefixOpen(sid="p1", cut=L, token_ids=[1, 2])),
                          ("vocab", protocol.PrefixOpen(sid="p2", cut=3, token_ids=[1, 10**7])),
                          ("empty", protocol.PrefixOpen(sid="p3", cut=3, token_ids=[])),
                          ("unknown", protocol.PrefixStep(sid="nobody", seq=1, token_id=5))):
            with pytest.raises(PeerError) as e:
                await peer.request(msg, timeout=10)
            out[name] = e.value.code
        h, frames = await peer.request(protocol.PrefixOpen(sid="p4", cut=3, token_ids=[1, 2, 3]),
                                       timeout=30)
        arr = protocol.tensor_numpy(h.hidden, frames)
        peer.close()
        ctx.term()
        return out, h, arr

    out, h, arr = asyncio.run(go())
    assert out == {"cut": "bad_field", "vocab": "bad_field", "empty": "bad_field",
                   "unknown": "unknown_session"}
    assert (h.cut, h.start) == (3, 0) and arr.shape == (3, H) and arr.dtype == np.float32


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["fifo", "interleave", "exact", "cascade"])
def test_other_schedulers_end_to_end(model_paths, tmp_path, tokenizer, reference,
                                     assert_same_tokens, scheduler):
    c = start_cluster(tmp_path, scheduler)
    try:
        jobs = mixed_jobs(tokenizer)
        results = concurrent(c.endpoint("dispatcher"), jobs)
        check_jobs(jobs, results, tokenizer, reference, assert_same_tokens, scheduler)
    finally:
        c.stop_all()


@pytest.mark.slow
def test_prefix_disappearing_mid_session(model_paths, tmp_path, tokenizer, reference,
                                         assert_same_tokens):
    """Kill the prefix while sessions run: they fail with `unavailable`; the suffix keeps serving
    (its sessions are closed), and after a restart split mode works again."""
    c = start_cluster(tmp_path)
    try:
        async def go():
            async with AsyncClient(c.endpoint("dispatcher"), timeout_s=60) as cl:
                runs = [asyncio.ensure_future(cl.complete(PROMPTS["plain"], mode="split", cut=k,
                                                          max_tokens=400, stop_at_eos=False))
                        for k in (3, 12)]
                # sessions running on the prefix: then it disappears mid-session
                url = c.procs["prefix"].url("/metrics")
                deadline = time.monotonic() + 60
                while sum(v for n, _, v in await asyncio.to_thread(metric_samples, url)
                          if n == "tandem_sessions") < 2:
                    assert time.monotonic() < deadline, "the split sessions never opened"
                    await asyncio.sleep(0.05)
                c.kill("prefix")
                return await asyncio.gather(*runs, return_exceptions=True)
        results = asyncio.run(go())
        for r in results:
            assert isinstance(r, Unavailable), repr(r)
            assert "prefix" in str(r)
        c.start("prefix")
        c.wait_ready(timeout=120, names=["prefix"])
        ids = tokenizer.encode(PROMPTS["code"])
        with Client(c.endpoint("dispatcher"), timeout_s=60) as cl:
            r = cl.complete(PROMPTS["code"], mode="split", cut=6, max_tokens=6, stop_at_eos=False)
        assert_same_tokens(ids, r.token_ids, reference(ids, 6), "after prefix restart")
        text = urllib.request.urlopen(c.procs["suffix"].url("/metrics"), timeout=5).read().decode()
        sessions = [line for line in text.splitlines() if line.startswith("tandem_sessions{")]
        assert sessions and float(sessions[0].split()[-1]) == 0.0, sessions
    finally:
        c.stop_all()

