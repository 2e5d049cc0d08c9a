"""Cloud-only mode end to end: SDK -> dispatcher -> verifier, real processes on loopback.

Greedy output must equal transformers' own generate(do_sample=False) token for token."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from stack.launcher import Cluster, free_port
from tandem import AsyncClient, Client, DeadlineExceeded, InvalidRequest, Unavailable
from tests.conftest import PROMPTS, forwards_over_one_session, long_prompt


@pytest.fixture(scope="module")
def cluster(model_paths, tmp_path_factory):
    c = Cluster(services=("verifier", "dispatcher"), ephemeral=True,
                logdir=tmp_path_factory.mktemp("logs"))
    c.start_all()
    try:
        c.wait_ready(timeout=180)
        yield c
    finally:
        c.stop_all()


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.endpoint("dispatcher"), timeout_s=120) as c:
        yield c


@pytest.mark.parametrize("kind", ["plain", "chat", "code"])
def test_greedy_equals_transformers(client, tokenizer, reference, assert_same_tokens, kind):
    if kind == "chat":
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[kind]}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        prompt_ids = list(prompt_ids["input_ids"] if isinstance(prompt_ids, dict) else prompt_ids)
        r = client.complete(PROMPTS[kind], chat=True, max_tokens=24, stop_at_eos=False)
    else:
        prompt_ids = tokenizer.encode(PROMPTS[kind])
        r = client.complete(PROMPTS[kind], max_tokens=24, stop_at_eos=False)
    want = reference(prompt_ids, 24)
    assert_same_tokens(prompt_ids, r.token_ids, want, kind)
    assert r.finish_reason == "length" and r.stats["generated_tokens"] == 24
    assert r.text == tokenizer.decode(r.token_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_long_prompt_equals_transformers(client, tokenizer, reference, assert_same_tokens):
    ids = long_prompt(tokenizer)
    assert len(ids) >= 1000
    r = client.complete(ids, max_tokens=16, stop_at_eos=False)
    assert_same_tokens(ids, r.token_ids, reference(ids, 16), "long")


def test_concurrent_sessions_batched_equal_one_by_one(cluster, tokenizer, reference,
                                                      assert_same_tokens):
    prompts = [PROMPTS["plain"], PROMPTS["code"], "Once upon a time", "1, 2, 3, 4,"]
    metrics_url = cluster.procs["verifier"].url("/metrics")
    batched_before = forwards_over_one_session(metrics_url, "verifier")

    async def go():
        async with AsyncClient(cluster.endpoint("dispatcher")) as c:
            return await asyncio.gather(*[c.complete(p, max_tokens=12 + 3 * i, stop_at_eos=False)
                                          for i, p in enumerate(prompts)])
    results = asyncio.run(go())
    for i, (p, r) in enumerate(zip(prompts, results)):
        ids = tokenizer.encode(p)
        assert_same_tokens(ids, r.token_ids, reference(ids, 12 + 3 * i), f"concurrent {i}")
    batched = forwards_over_one_session(metrics_url, "verifier") - batched_before
    assert batched >= 1, "no verifier forward held more than one session: nothing was batched"


def test_streaming_chunks_are_ordered_and_complete(client):
    chunks = list(client.generate("Count: one, two,", max_tokens=10, stop_at_eos=False))
    assert [c.index for c in chunks] == list(range(10))
    assert sum(len(c.token_ids) for c in chunks) == 10


def test_cancel_by_closing_the_stream_and_service_keeps_serving(client):
    gen = client.generate(PROMPTS["plain"], max_tokens=200, stop_at_eos=False)
    first = next(gen)
    gen.close()     # the SDK sends Cancel
    assert first.index == 0
    r = client.complete("Hello", max_tokens=3, stop_at_eos=False)
    assert len(r.token_ids) == 3


def test_no_dispatcher_is_unavailable_within_the_connect_timeout():
    """Nothing listening: the SDK says so after connect_timeout_s, not after the whole deadline
    (a DEALER queues a request for a peer that may never come)."""
    t = time.monotonic()
    with Client(f"tcp://127.0.0.1:{free_port()}", connect_timeout_s=1.0) as c:
        with pytest.raises(Unavailable, match="no dispatcher reachable"):
            c.complete("hi", max_tokens=1)
    assert time.monotonic() - t < 5
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="connect_timeout_s"):
            Client(connect_timeout_s=bad)


def test_deadline(client):
    t = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        client.complete(PROMPTS["plain"], max_tokens=2000, stop_at_eos=False, deadline_s=1.0)
    assert time.monotonic() - t < 10


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(mode="teleport"), dict(top_p=0.0),
                                dict(temperature=-1.0)])
def test_bad_requests_get_clear_errors(client, kw):
    with pytest.raises(InvalidRequest):
        client.complete("Hello", **{"max_tokens": 4, **kw})


def test_out_of_vocabulary_prompt(client):
    with pytest.raises(InvalidRequest) as e:
        client.complete([1, 2, 10**9], max_tokens=2)
    assert "vocabulary" in e.value.message


def test_cli_generate_json(cluster, tokenizer, reference, assert_same_tokens):
    out = subprocess.run([sys.executable, "-m", "stack.cli", "generate", PROMPTS["plain"],
                          "--endpoint", cluster.endpoint("dispatcher"), "--max-tokens", "8",
                          "--json"], capture_output=True, text=True, timeout=120, check=True)
    data = json.loads(out.stdout)
    assert set(data) >= {"mode", "token_ids", "text", "stats"}
    ids = tokenizer.encode(PROMPTS["plain"])
    # the CLI stops at EOS by default: the reference of the requested length that stops there too
    assert_same_tokens(ids, data["token_ids"], reference(ids, 8, eos=True), "cli", n=8, eos=True)


def _raw_request(endpoint: str, header: dict, timeout: float = 30.0) -> dict:
    """One message straight onto the wire (msgpack-python, no SDK checks); its first reply."""
    import msgpack
    import zmq
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart([msgpack.packb(header)])
        assert s.poll(int(timeout * 1000)), f"no reply to {header}"
        return msgpack.unpackb(s.recv_multipart()[0])
    finally:
        s.close()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_poisoned_temperature_is_refused_and_the_next_request_served(
        cluster, client, tokenizer, reference, assert_same_tokens, value):
    """The reproduction of the wedge: `tandem generate --temperature nan` hung, and then every
    cloud-only request did. Now it is refused naming the field — by the CLI/SDK before sending,
    by the dispatcher and by the verifier when it comes over the wire anyway — and the next
    request is served exactly."""
    out = subprocess.run([sys.executable, "-m", "stack.cli", "generate", "Hi", "--endpoint",
                          cluster.endpoint("dispatcher"), "--max-tokens", "4",
                          f"--temperature={value}", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    assert "error: temperature: expected a finite" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    err = json.loads(out.stdout)["error"]
    assert err["code"] == "bad_field" and err["field"] == "temperature", err
    t = float(value)
    for endpoint, header in [
            (cluster.endpoint("dispatcher"),
             {"v": 1, "type": "generate", "rid": 5, "prompt": "Hi", "max_tokens": 4,
              "sampling": {"temperature": t}}),
            (cluster.endpoint("verifier"),
             {"v": 1, "type": "cloud_generate", "sid": "poison", "rid": 6, "token_ids": [1, 2],
              "max_tokens": 4, "sampling": {"temperature": t}})]:
        reply = _raw_request(endpoint, header)
        assert reply["type"] == "error" and reply["code"] == "bad_field", reply
        assert reply["field"] == "sampling.temperature", reply
    ids = tokenizer.encode(PROMPTS["plain"])
    r = client.complete(ids, max_tokens=8, stop_at_eos=False)
    assert_same_tokens(ids, r.token_ids, reference(ids, 8), "after the poisoned request")


def test_top_k_over_the_vocabulary_is_refused(client):
    with pytest.raises(InvalidRequest) as e:
        client.complete("Hello", max_tokens=2, temperature=0.5, top_k=10**6)
    assert e.value.field == "top_k" and "vocabulary" in e.value.message
