"""The OpenAI-compatible gateway (api/, `tandem serve api`) against a live stack.

One cluster of all five services (loopback, ephemeral ports; the dispatcher with a per-client
token quota, so one test can make it answer busy) and the gateway as `tandem serve api` in a
subprocess; a second gateway points at a dispatcher that does not exist (503). The official
`openai` client (sync and async, streaming and not, chat and completions, stop strings, spec and
split through `extra_body`) must get transformers' greedy text; raw HTTP (httpx) checks every
error's status and OpenAI error shape, the SSE framing, and that a client disconnecting
mid-stream cancels its request on the dispatcher (its active-sessions gauge back to 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import StopScanner
from stack.launcher import Cluster, free_port
from common.models import repo_root
from tests.conftest import PROMPTS

MODEL = "tandem"
QUOTA = 1000   # the dispatcher's --client-max-tokens: prompt + max_tokens in flight per client
KEY_A, KEY_B, KEY_C = "sk-alpha-0123456789", "sk-bravo-0123456789", "sk-charlie-0123456789"


def _gateway(dispatcher: str, logdir: Path, name: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(logdir / f"{name}.log", "wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(repo_root()), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "stack.cli", "serve", "api", "--port",
                             str(port), "--dispatcher", dispatcher, *extra], stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=str(repo_root()))
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def _wait_http(proc: subprocess.Popen, base: str, log: Path, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"gateway not ready: {log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def stack(model_paths, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("api-logs")
    # The 64-client test counts what the per-client quota admits: the verifier's refusals for
    # prompt work queued ahead (tested on their own) would add some that depend on the machine's
    # speed, so its queue limit is out of reach here.
    c = Cluster(ephemeral=True, logdir=logdir,
                extra={"suffix": ["--threads", "1"], "prefix": ["--threads", "1"],
                       "verifier": ["--max-queue-s", "3600"],
                       "dispatcher": ["--client-max-tokens", str(QUOTA)]})
    c.start_all()
    gw, base = _gateway(c.endpoint("dispatcher"), logdir, "api", "--max-body-bytes", "65536",
                        "--max-messages", "8", "--max-prompt-tokens", "512")
    dead, dead_base = _gateway(f"tcp://127.0.0.1:{free_port()}", logdir, "api-dead",
                               "--connect-timeout-s", "0.5")
    keys_file = logdir / "keys.txt"
    keys_file.write_text(f"# from a file\n{KEY_C}\n")
    keyed, keyed_base = _gateway(c.endpoint("dispatcher"), logdir, "api-keyed",
                                 "--api-key", KEY_A, "--api-key", KEY_B,
                                 "--api-keys-file", str(keys_file))
    try:
        c.wait_ready(timeout=240)
        _wait_http(gw, base, logdir / "api.log")
        _wait_http(dead, dead_base, logdir / "api-dead.log")
        _wait_http(keyed, keyed_base, logdir / "api-keyed.log")
        yield {"base": base, "dead": dead_base, "keyed": keyed_base, "cluster": c}
    finally:
        for p in (gw, dead, keyed):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        c.stop_all()


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack["base"] + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def greedy_text(tokenizer, reference, ids: list[int], n: int) -> tuple[str, int]:
    """transformers' generate(do_sample=False) continuation (up to its end-of-sequence token),
    decoded; and its token count, the end-of-sequence token included (as the dispatcher's)."""
    out = reference(ids, n, eos=True)
    return tokenizer.decode(out, skip_special_tokens=True), len(out)


def chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name a primary colour."},
    {"role": "assistant", "content": "Red."},
    {"role": "user", "content": "Name another one."},
]


# --- no cluster ---------------------------------------------------------------------------------

def test_stop_scanner_holds_back_a_possible_start_and_cuts_at_the_first_stop():
    s = StopScanner(["END", "xy"])
    assert s.feed("abcE") == ("ab", False)      # "cE" could start "END"
    assert s.feed("Nq") == ("cE", False)
    assert s.feed("rsxyzEND") == ("Nqrs", True)   # the earliest stop wins; nothing after it
    assert StopScanner([]).feed("abc") == ("abc", False)


# --- the official client ------------------------------------------------------------------------

def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_chat_multi_turn_greedy_equals_transformers(client, tokenizer, reference):
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=12,
                                       temperature=0)
    ids = chat_ids(tokenizer, CONVERSATION)
    want, n = greedy_text(tokenizer, reference, ids, 12)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    ended = reference(ids, 12, eos=True)[-1] == tokenizer.eos_token_id
    assert r.choices[0].finish_reason == ("stop" if ended else "length")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == n
    assert r.usage.total_tokens == len(ids) + n
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_a_repeated_conversation_reports_its_cached_prompt_tokens(client, tokenizer):
    """The verifier's prefix cache kept the first answer's rows: the same conversation again
    prefills only its last token (usage.prompt_tokens_details, as OpenAI reports it)."""
    ids = chat_ids(tokenizer, CONVERSATION)
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=4,
                                           temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.prompt_tokens_details.cached_tokens == len(ids) - 1


def test_completions_stream_with_usage_equals_transformers(client, tokenizer, reference):
    prompt = PROMPTS["plain"]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    ids = tokenizer.encode(prompt)
    want, n = greedy_text(tokenizer, reference, ids, 10)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n == 10
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_completions_token_id_prompt(client, tokenizer, reference):
    ids = tokenizer.encode(PROMPTS["code"])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == greedy_text(tokenizer, reference, ids, 8)[0]


def test_async_client_streams_and_concurrent_requests(stack, tokenizer, reference):
    prompts = ["1, 2, 3,", "Monday, Tuesday,", "red, green,"]

    async def main():
        async with openai.AsyncOpenAI(base_url=stack["base"] + "/v1", api_key="unused",
                                      max_retries=0, timeout=120) as c:
            stream = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPTS["chat"]}],
                max_completion_tokens=8, temperature=0, stream=True)
            deltas = [ch async for ch in stream]
            many = await asyncio.gather(*(c.completions.create(
                model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts))
            return deltas, many

    deltas, many = asyncio.run(main())
    assert deltas[0].choices[0].delta.role == "assistant"
    text = "".join(d.choices[0].delta.content or "" for d in deltas)
    ids = chat_ids(tokenizer, [{"role": "user", "content": PROMPTS["chat"]}])
    assert text == greedy_text(tokenizer, reference, ids, 8)[0]
    assert deltas[-1].choices[0].finish_reason in ("length", "stop")
    for p, r in zip(prompts, many):
        assert r.choices[0].text == greedy_text(tokenizer, reference, tokenizer.encode(p), 6)[0]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_and_cancels(client, stack, tokenizer, reference, stream):
    prompt = PROMPTS["plain"]
    full, _ = greedy_text(tokenizer, reference, tokenizer.encode(prompt), 16)
    at = len(full) // 3
    stop = full[at:at + 6]                      # spans token boundaries, mid-word
    want = full[:full.index(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
              stop=[stop, "\u2603never"])
    if stream:
        chunks = list(client.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.completion_tokens < 16   # cancelled on the dispatcher, not run out
    assert text == want and finish == "stop"


@pytest.mark.parametrize("extra", [{"mode": "spec"}, {"mode": "spec", "policy": "vanilla"},
                                   {"mode": "split", "cut": 6}])
def test_spec_and_split_modes_through_extra_body(client, tokenizer, reference, extra):
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=10,
                                       temperature=0, extra_body=extra)
    want, _ = greedy_text(tokenizer, reference, chat_ids(tokenizer, CONVERSATION), 10)
    assert r.choices[0].message.content == want
    stats = r.model_extra["tandem"]
    assert stats["mode"] == extra["mode"]
    if "cut" in extra:
        assert stats["cut"] == extra["cut"]


def test_seeded_sampling_is_reproducible(client):
    """The same seed gives the same text, and the seed is what decides it: other seeds give
    other texts (a sampler that ignored the seed would give one text for all, or a new text
    each call)."""
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=0.9,
              top_p=0.95)
    texts = {seed: client.completions.create(**kw, seed=seed).choices[0].text
             for seed in range(7, 11)}
    assert client.completions.create(**kw, seed=7).choices[0].text == texts[7]
    assert len(set(texts.values())) >= 2, texts


def test_official_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CONVERSATION)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CONVERSATION, n=17)
    assert e.value.body["param"] == "n"


# --- raw HTTP: errors ---------------------------------------------------------------------------

LONG = " ".join(["word"] * 600)   # > --max-prompt-tokens 512

ERRORS = [   # (route, body, status, param, code or None)
    ("completions", {"model": "nope", "prompt": "a"}, 400, "model", "model_not_found"),
    ("completions", {"prompt": "a"}, 400, "model", None),
    ("completions", {"model": MODEL, "prompt": "a", "max_tokens": "4"}, 400, "max_tokens",
     "invalid_type"),
    ("completions", {"model": MODEL, "prompt": 5}, 400, "prompt", "invalid_type"),
    ("chat", {"model": MODEL, "messages": "hi"}, 400, "messages", "invalid_type"),
    ("completions", {"model": MODEL, "prompt": "a", "temperature": 2.5}, 400, "temperature",
     None),
    ("completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p", None),  # SDK's
    ("completions", {"model": MODEL, "prompt": "a", "n": 17}, 400, "n", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "a", "n": 2.5}, 400, "n", "invalid_type"),
    ("chat", {"model": MODEL, "messages": CONVERSATION, "n": "2"}, 400, "n", "invalid_type"),
    ("chat", {"model": MODEL, "messages": CONVERSATION, "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs", "invalid_value"),
    ("chat", {"model": MODEL, "messages": CONVERSATION, "top_logprobs": 2}, 400, "top_logprobs",
     "invalid_value"),
    ("chat", {"model": MODEL, "messages": CONVERSATION, "logprobs": 1}, 400, "logprobs",
     "invalid_type"),
    ("completions", {"model": MODEL, "prompt": "a", "logprobs": 21}, 400, "logprobs",
     "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "a", "logprobs": True}, 400, "logprobs",
     "invalid_type"),
    ("chat", {"model": MODEL, "messages": CONVERSATION, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "tools", None),
    ("completions", {"model": MODEL, "prompt": "a", "echo": True}, 400, "echo", None),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": "a", "stop": ["1", "2", "3", "4", "5"]}, 400,
     "stop", None),
    ("completions", {"model": MODEL, "prompt": "a", "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("completions", {"model": MODEL, "prompt": "a", "mode": "warp"}, 400, "mode", None),
    ("completions", {"model": MODEL, "prompt": "a", "mode": "split", "cut": 99}, 400, "cut",
     None),   # the dispatcher's rule, its field
    ("chat", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 9}, 400,
     "messages", "too_many_messages"),
    ("completions", {"model": MODEL, "prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "context_length_exceeded"),
]


def _post(base: str, route: str, **kw) -> httpx.Response:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    return httpx.post(base + path, timeout=60, **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("route,body,status,param,code", ERRORS,
                         ids=[f"{e[3]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors_in_openai_shape(stack, route, body, status, param, code):
    err = _error(_post(stack["base"], route, json=body), status)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code


# --- constrained output: response_format and guided_regex -----------------------------------------

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Give a JSON record for a user named Ada, 36 years old."}]


@pytest.mark.parametrize("extra", [{}, {"mode": "spec", "policy": "pipesd"}],
                         ids=["cloud-only", "spec"])
def test_response_format_json_schema_equals_transformers_under_the_mask(
        client, tokenizer, constrained_reference, extra):
    import jsonschema
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=48, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        extra_body=extra)
    want = constrained_reference(chat_ids(tokenizer, ASK), PERSON, 48)
    text = r.choices[0].message.content
    assert text == tokenizer.decode(want, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_guided_regex_on_completions(client):
    import re
    r = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:",
                                  max_tokens=48, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:   # cut at max_tokens: still an object's prefix
        assert r.choices[0].text.startswith("{")
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("rf,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
     "response_format.json_schema.schema")])
def test_a_bad_response_format_is_a_400_naming_it(client, rf, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                       response_format=rf)
    assert e.value.body["param"] == param, e.value.body


def test_malformed_json_oversized_body_and_unknown_route(stack):
    base = stack["base"]
    err = _error(_post(base, "chat", content=b'{"model": "tandem", "messages": [',
                       headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json"
    _error(_post(base, "completions", content=b"[1, 2]"), 400)
    big = {"model": MODEL, "prompt": "x" * 70_000}                # > --max-body-bytes 65536
    assert _error(_post(base, "completions", json=big), 413)["code"] == "request_too_large"
    assert _error(httpx.get(base + "/v1/nothing"), 404)["code"] == "not_found"
    assert _error(httpx.get(base + "/v1/completions"), 405)["code"] == "method_not_allowed"


def test_deadline_is_504(stack):
    err = _error(_post(stack["base"], "completions", json={
        "model": MODEL, "prompt": PROMPTS["plain"], "max_tokens": 64, "deadline_s": 0.001}), 504)
    assert err["code"] == "deadline"


def test_no_dispatcher_is_503(stack):
    for stream in (False, True):
        err = _error(_post(stack["dead"], "completions", json={
            "model": MODEL, "prompt": "a", "max_tokens": 4, "stream": stream}), 503)
        assert err["code"] == "unavailable"


# --- raw HTTP: SSE framing, disconnects, busy ---------------------------------------------------

def test_sse_framing(stack):
    body = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", stack["base"] + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert len({o["id"] for o in objs}) == 1
    assert all(o["object"] == "chat.completion.chunk" and o["model"] == MODEL for o in objs)
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(o["usage"] is None for o in objs[:-1])
    assert objs[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert objs[-2]["choices"][0]["delta"] == {}
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] <= 5


def _dispatcher_sessions(stack) -> float:
    text = httpx.get(stack["cluster"].procs["dispatcher"].url("/metrics"), timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "tandem_active_sessions" for s in f.samples
               if s.labels.get("service") == "dispatcher")


def test_disconnect_mid_stream_cancels_and_busy_is_429(stack):
    base = stack["base"]
    body = {"model": MODEL, "prompt": PROMPTS["plain"], "max_tokens": QUOTA - 100,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            assert _dispatcher_sessions(stack) == 1
            # the per-client token quota is held by the stream: the next request is busy
            busy = _post(base, "completions", json={"model": MODEL, "prompt": "a",
                                                    "max_tokens": 200})
            err = _error(busy, 429)
            assert err["type"] == "rate_limit_error" and busy.headers["retry-after"] == "1"
        # the response closed mid-stream: the gateway sees the disconnect and cancels
    end = time.monotonic() + 15
    while _dispatcher_sessions(stack) != 0:
        assert time.monotonic() < end, "the dispatcher still holds the abandoned request"
        time.sleep(0.1)
    # and the quota is free again
    r = _post(base, "completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2,
                                         "temperature": 0})
    assert r.status_code == 200, r.text


def test_disconnect_before_a_whole_answer_cancels(stack):
    body = {"model": MODEL, "prompt": PROMPTS["plain"], "max_tokens": QUOTA - 100,
            "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):   # the client gives up and closes the connection
        httpx.post(stack["base"] + "/v1/completions", json=body, timeout=1.0)
    end = time.monotonic() + 15
    while _dispatcher_sessions(stack) != 0:
        assert time.monotonic() < end, "the dispatcher still holds the abandoned request"
        time.sleep(0.1)


def test_metrics(stack, client):
    client.models.list()
    text = httpx.get(stack["base"] + "/metrics", timeout=5).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    reqs = {(s.labels["route"], s.labels["status"]): s.value
            for s in fams["tandem_api_requests"].samples if s.name.endswith("_total")}
    assert reqs[("/v1/models", "200")] >= 1
    assert reqs[("/v1/chat/completions", "200")] >= 1
    assert reqs.get(("/v1/completions", "400"), 0) >= 1
    assert any(s.value > 0 for s in fams["tandem_api_time_to_first_token_seconds"].samples
               if s.name.endswith("_count"))
    assert any(s.value > 0 for s in fams["tandem_api_time_per_token_seconds"].samples
               if s.name.endswith("_count"))


@pytest.mark.parametrize("field, raw", [("temperature", b"NaN"), ("temperature", b"Infinity"),
                                        ("top_p", b"-Infinity"), ("deadline_s", b"NaN"),
                                        ("max_tokens", b"-3"), ("seed", b"1e400")])
def test_poisoned_numbers_are_refused_naming_them_and_the_gateway_serves_on(
        stack, client, tokenizer, reference, field, raw):
    """JSON as Python's encoder writes it accepts NaN and ±Infinity: each is a 400 naming the
    field, and the next request is served exactly."""
    body = b'{"model": "%s", "prompt": "a", "max_tokens": 2, "%s": %s}' % (
        MODEL.encode(), field.encode(), raw)
    err = _error(_post(stack["base"], "completions", content=body,
                       headers={"content-type": "application/json"}), 400)
    assert err["param"] == field, err
    ids = tokenizer.encode(PROMPTS["code"])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert r.choices[0].text == greedy_text(tokenizer, reference, ids, 4)[0]


def test_sdk_messages_render_as_the_gateway_does(stack, client, tokenizer, reference):
    """The SDK's `messages=` goes through the dispatcher's chat template (common/chat.py, the
    gateway's code too): the same prompt ids, transformers' greedy continuation."""
    from tandem import Client
    ids = chat_ids(tokenizer, CONVERSATION)
    want = list(reference(ids, 8))
    with Client(stack["cluster"].endpoint("dispatcher")) as c:
        r = c.complete(messages=CONVERSATION, max_tokens=8, stop_at_eos=False)
    assert r.token_ids == want
    http = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert http.choices[0].message.content == r.text
    assert http.usage.prompt_tokens == len(ids)


# --- API keys -----------------------------------------------------------------------------------

def test_api_keys_401_without_a_valid_key(stack):
    base = stack["keyed"]
    for headers in ({}, {"Authorization": "Bearer sk-not-a-key-123"},
                    {"Authorization": KEY_A}):   # no "Bearer"
        r = httpx.get(base + "/v1/models", headers=headers, timeout=10)
        err = _error(r, 401)
        assert err["code"] in ("missing_api_key", "invalid_api_key")
        assert "WWW-Authenticate" in r.headers
        r = _post(base, "chat/completions", headers=headers,
                  json={"model": MODEL, "messages": CONVERSATION, "max_tokens": 2})
        _error(r, 401)
    for path in ("/healthz", "/readyz", "/metrics"):   # probes and scrapes need no key
        assert httpx.get(base + path, timeout=10).status_code == 200
    with openai.OpenAI(base_url=base + "/v1", api_key="sk-wrong-0123", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


@pytest.mark.parametrize("key", [KEY_A, KEY_B, KEY_C])
def test_api_keys_from_flags_and_file_are_served_exactly(stack, tokenizer, reference, key):
    ids = tokenizer.encode(PROMPTS["code"])
    with openai.OpenAI(base_url=stack["keyed"] + "/v1", api_key=key, max_retries=0,
                       timeout=120) as c:
        assert [m.id for m in c.models.list().data] == [MODEL]
        r = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == greedy_text(tokenizer, reference, ids, 6)[0]


def test_each_api_key_is_one_client_for_the_dispatchers_limits(stack):
    """Key A's stream holds most of the per-client token quota: A's next request is busy (429),
    B's is served (another client); the open gateway's requests are yet another client."""
    base = stack["keyed"]
    auth_a, auth_b = ({"Authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B))
    body = {"model": MODEL, "prompt": PROMPTS["plain"], "max_tokens": QUOTA - 100,
            "temperature": 0, "stream": True, "ignore_eos": True}
    small = {"model": MODEL, "prompt": "a", "max_tokens": 200, "temperature": 0}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", base + "/v1/completions", json=body, headers=auth_a) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            busy = _post(base, "completions", json=small, headers=auth_a)
            assert _error(busy, 429)["type"] == "rate_limit_error"
            ok = _post(base, "completions", json={**small, "max_tokens": 3}, headers=auth_b)
            assert ok.status_code == 200, ok.text
            ok = _post(stack["base"], "completions", json={**small, "max_tokens": 3})
            assert ok.status_code == 200, ok.text
    end = time.monotonic() + 15
    while _dispatcher_sessions(stack) != 0:
        assert time.monotonic() < end, "the dispatcher still holds the abandoned request"
        time.sleep(0.1)
    r = _post(base, "completions", json={**small, "max_tokens": 2}, headers=auth_a)
    assert r.status_code == 200, r.text


# --- load -----------------------------------------------------------------------------------------

CONCURRENT = 64


def test_64_concurrent_streaming_clients_served_or_429_no_token_lost(stack, tokenizer,
                                                                     reference):
    """64 streaming chat clients at once through one gateway (one client at the dispatcher, so
    its per-client token quota turns some away): each is either served exactly — its streamed
    text equals transformers' greedy text, usage counting every token — or answered 429. No
    other outcome."""
    n = 12
    convs = [[{"role": "user", "content": f"{p} ({i})"}] for i, p in
             enumerate(PROMPTS.values())]
    want = []
    for conv in convs:
        ids = chat_ids(tokenizer, conv)
        want.append(greedy_text(tokenizer, reference, ids, n))

    async def one(c: openai.AsyncOpenAI, k: int):
        conv = convs[k % len(convs)]
        try:
            stream = await c.chat.completions.create(
                model=MODEL, messages=conv, max_tokens=n, temperature=0, stream=True,
                stream_options={"include_usage": True})
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    usage = chunk.usage
            return "served", k, text, usage
        except openai.RateLimitError as e:
            return "429", k, e.message, None

    async def main():
        async with openai.AsyncOpenAI(base_url=stack["base"] + "/v1", api_key="unused",
                                      max_retries=0, timeout=300) as c:
            t0 = time.monotonic()
            out = await asyncio.gather(*(one(c, k) for k in range(CONCURRENT)),
                                       return_exceptions=True)
            return out, time.monotonic() - t0

    out, wall = asyncio.run(main())
    errors = [o for o in out if isinstance(o, BaseException)]
    assert not errors, errors[:3]
    served = [o for o in out if o[0] == "served"]
    refused = [o for o in out if o[0] == "429"]
    assert len(served) + len(refused) == CONCURRENT
    assert all("per-client limit" in why for _, _, why, _ in refused), \
        [why for _, _, why, _ in refused if "per-client limit" not in why][:3]
    # all 64 arrive together, so at least as many as the quota holds at once are admitted (the
    # gateway may serve more, as earlier streams end and free the quota)
    fit = QUOTA // max(len(chat_ids(tokenizer, conv)) + n for conv in convs)
    assert len(served) >= min(fit, CONCURRENT), (len(served), fit)
    for _, k, text, usage in served:
        text_want, count_want = want[k % len(convs)]
        assert text == text_want, (k, text, text_want)
        assert usage.completion_tokens == count_want
    print(f"\n{CONCURRENT} concurrent streaming clients: {len(served)} served exactly, "
          f"{len(refused)} answered 429, 0 other errors, in {wall:.1f} s")
    end = time.monotonic() + 15
    while _dispatcher_sessions(stack) != 0:
        assert time.monotonic() < end
        time.sleep(0.1)


# --- vLLM's token routes, log-probabilities, n choices ------------------------------------------

def test_tokenize_detokenize_and_health(stack, tokenizer):
    base = stack["base"]
    prompt = PROMPTS["plain"]
    r = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    assert r["tokens"] == tokenizer.encode(prompt) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 8192   # the target's context length
    r = httpx.post(base + "/tokenize", json={"model": MODEL, "messages": CONVERSATION}).json()
    assert r["tokens"] == chat_ids(tokenizer, CONVERSATION)   # what the chat route generates from
    back = httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(r["tokens"])}
    h = httpx.get(base + "/health")
    assert h.status_code == 200 and h.content == b""
    for route, body, param in [
            ("/tokenize", {"model": MODEL}, "prompt"),
            ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
            ("/tokenize", {"model": "nope", "prompt": "a"}, "model"),
            ("/tokenize", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
             "messages[0].role"),
            ("/detokenize", {"model": MODEL}, "tokens"),
            ("/detokenize", {"model": MODEL, "tokens": [1, "2"]}, "tokens"),
            ("/detokenize", {"model": MODEL, "tokens": [-1]}, "tokens"),
            ("/detokenize", {"model": MODEL, "tokens": [len(tokenizer)]}, "tokens")]:
        assert _error(httpx.post(base + route, json=body), 400)["param"] == param, (route, body)
    _error(httpx.post(stack["keyed"] + "/tokenize", json={"prompt": "a"}), 401)


def _reference_logprobs(hf_model, ids: list[int], out: list[int]):
    import torch
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_chat_logprobs_are_the_targets_streamed_and_not(client, tokenizer, reference, hf_model):
    """Each token's logprob and its top 5 within 1e-4 of transformers' log_softmax, with the
    greedy text still transformers'; streamed in spec mode, the same entries."""
    ids = chat_ids(tokenizer, CONVERSATION)
    out = reference(ids, 8)
    want = _reference_logprobs(hf_model, ids, out)
    kw = dict(model=MODEL, messages=CONVERSATION, max_tokens=8, temperature=0, logprobs=True,
              top_logprobs=5, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == tokenizer.decode(out, skip_special_tokens=True)
    assert [e.token for e in content] == [tokenizer.decode([t]) for t in out]
    for j, (t, e) in enumerate(zip(out, content)):
        assert abs(e.logprob - float(want[j, t])) < 1e-4
        assert e.bytes == list(e.token.encode())
        ref_top = [(tokenizer.decode([i]), v) for v, i in zip(*want[j].topk(5))]
        assert [a.token for a in e.top_logprobs] == [tok for tok, _ in ref_top]
        assert max(abs(a.logprob - float(v)) for a, (_, v) in zip(e.top_logprobs, ref_top)) \
            < 1e-4
    chunks = list(client.chat.completions.create(
        **{**kw, "extra_body": {"mode": "spec", "ignore_eos": True}}, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < 1e-4
    plain = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_legacy_shape_in_split_mode(client, tokenizer, reference, hf_model):
    ids = tokenizer.encode(PROMPTS["code"])
    out = reference(ids, 6)
    want = _reference_logprobs(hf_model, ids, out)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS["code"], max_tokens=6,
                                            temperature=0, logprobs=3, stream=True,
                                            extra_body={"mode": "split", "cut": 6,
                                                        "ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks)
    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for k in lp:
            lp[k] += getattr(c.choices[0].logprobs, k) if c.choices[0].logprobs else []
    assert text == tokenizer.decode(out) and "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:j])) for j in range(6)]
    for j, t in enumerate(out):
        assert abs(lp["token_logprobs"][j] - float(want[j, t])) < 1e-4
        top = lp["top_logprobs"][j]
        assert len(top) == 3 and lp["tokens"][j] in top   # greedy: the token is the top one
        for v, i in zip(*want[j].topk(3)):
            assert abs(top[tokenizer.decode([int(i)])] - float(v)) < 1e-4
    # a stop string: the tokens whose text begins before it are the answer's, no later one
    full = tokenizer.decode(out)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = client.completions.create(model=MODEL, prompt=PROMPTS["code"], max_tokens=6,
                                  temperature=0, logprobs=0, stop=[stop])
    kept = r.choices[0].logprobs.tokens
    cut = r.choices[0].text
    assert cut == full[:full.index(stop)] and "".join(kept).startswith(cut)
    assert len("".join(kept[:-1])) < len(cut) and len(kept) < 6


def test_n_choices_seeded_reproducible_and_summed(client, tokenizer, reference):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=6, temperature=1.0,
              seed=11, n=4, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    texts = [c.text for c in a.choices]
    assert len(set(texts)) > 1                              # independent samples
    assert a.usage.completion_tokens == 4 * 6               # every choice's tokens
    one = client.completions.create(**{**kw, "n": 1, "seed": 13})
    assert one.choices[0].text == texts[2]                  # choice i is seed + i
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, max_tokens=5, temperature=1.0, seed=3, n=3,
        stream=True, stream_options={"include_usage": True},
        extra_body={"mode": "spec", "ignore_eos": True}))
    streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks
                           if c.choices and c.choices[0].index == i) for i in range(3)}
    assert sorted(c.choices[0].index for c in chunks if c.choices and
                  c.choices[0].finish_reason) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 3 * 5
    whole = client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, max_tokens=5, temperature=1.0, seed=3, n=3,
        extra_body={"mode": "spec", "ignore_eos": True})
    assert [c.message.content for c in whole.choices] == [streamed[i] for i in range(3)]
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS["plain"], max_tokens=5,
                                       temperature=0, n=2, extra_body={"mode": "split", "cut": 6})
    want = greedy_text(tokenizer, reference, tokenizer.encode(PROMPTS["plain"]), 5)[0]
    assert [c.text for c in greedy.choices] == [want, want]
