"""The OpenAI-compatible HTTP API over Tandem (Starlette, served by uvicorn: api/service.py).

    GET  /v1/models                 the served model
    POST /v1/completions            prompt -> text
    POST /v1/chat/completions       messages (system / developer / user / assistant) -> text,
                                    rendered with the target's chat template here; `tools`
                                    and `tool_choice` where the template renders tools
                                    (api/tools.py)
    POST /tokenize /detokenize      text or messages <-> token ids (vLLM's shapes)
    GET  /metrics /healthz /readyz  Prometheus metrics, liveness, readiness
    GET  /health                    200, empty, while serving (vLLM's probe)

`n` > 1 runs n generations on the dispatcher at once (seed + i, or distinct random seeds), one
choice each. `logprobs` (chat: with `top_logprobs`; completions: an integer) are the target's
own log-probabilities, log_softmax of its raw logits before temperature (vLLM's default).

`stream: true` answers Server-Sent Events in OpenAI's chunk shape ending with `data: [DONE]`
(`stream_options.include_usage` adds a usage chunk). `stop` strings are found in the decoded
text: the request is cancelled on the dispatcher at once, the stop string is not returned.
Tandem's own options ride as extra body fields (openai-python's `extra_body`): `mode` (default
auto: the dispatcher chooses), `tpt_slo_ms` (auto: a target time per token), `policy`, `cut`,
`deadline_s`, `nav_thresholds`, `top_k`, `allow_edge_only`, `ignore_eos`, `guided_regex` (the
output matches a regular expression; `response_format` json_object / json_schema constrains it
to JSON; both exactly, in every mode: common/constraint.py).

With API keys configured (api/auth.py) the /v1 routes need `Authorization: Bearer KEY` (401
otherwise); each key is one client for the dispatcher's per-client limits.

Errors answer OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for a bad
request (naming the field in `param`), 413 for a body over `max_body_bytes`, 429 (Retry-After)
when the dispatcher is busy, 503 when it or a service the mode needs is unavailable, 504 when
the deadline passed. A client that disconnects mid-stream cancels its request on the dispatcher
(the SDK's async generator sends Cancel when it is closed or its task cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from api import auth, metrics, tools
from api.config import ApiConfig
from common import chat, constraint, protocol
from tandem.errors import (Busy, Cancelled, DeadlineExceeded, InvalidRequest, ServerError,
                           TandemError, Unavailable)

log = logging.getLogger("tandem.api")

MODES = metrics.MODES

# Request fields Tandem cannot honour: refused (400 naming the field) when set to anything but
# their "off" value, rather than silently ignored.
UNSUPPORTED_CHAT = ("functions", "function_call", "logit_bias", "presence_penalty",
                    "frequency_penalty", "audio", "modalities", "prediction", "web_search_options")
UNSUPPORTED_COMPLETIONS = ("logit_bias", "presence_penalty", "frequency_penalty",
                           "best_of", "echo", "suffix")


def _is_off(name: str, value: Any) -> bool:
    if value is None or value is False or value in ({}, [], ""):
        return True
    if name in ("presence_penalty", "frequency_penalty") and isinstance(value, (int, float)) \
            and not isinstance(value, bool) and value == 0:
        return True
    if name == "best_of" and value == 1 and not isinstance(value, bool):
        return True
    if name == "modalities" and value == ["text"]:
        return True
    return False


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_REQUEST_FIELDS = ("cut", "mode", "policy", "max_tokens", "temperature", "top_k", "top_p", "seed",
                   "sampling_coupling", "nav_thresholds", "deadline_s", "prompt", "tpt_slo_ms")


def from_tandem(e: TandemError, retry_after_s: int = 1) -> ApiError:
    """A typed SDK error as the HTTP answer OpenAI clients expect."""
    if isinstance(e, InvalidRequest):
        field = e.field
        if not field:   # a service's rule that names no field (e.g. the prefix's "cut 99 outside")
            head = e.message.split(" ", 1)[0].strip(":")
            field = head if head in _REQUEST_FIELDS else ""
        if field == "constraint":   # the gateway's name for it
            field = "response_format"
        code = "context_length_exceeded" if e.code == "too_large" and field == "prompt" \
            else e.code
        return ApiError(400, e.message, param=field or None, code=code)
    if isinstance(e, Busy):   # the service's own estimate when it gave one, else the setting
        wait = math.ceil(e.retry_after_s) if e.retry_after_s > 0 else retry_after_s
        return ApiError(429, e.message, code=e.code, type="rate_limit_error",
                        headers={"Retry-After": str(wait)})
    if isinstance(e, DeadlineExceeded):
        return ApiError(504, e.message, code=e.code, type="timeout_error")
    if isinstance(e, (Unavailable, Cancelled)):
        return ApiError(503, e.message, code=e.code, type="service_unavailable_error")
    assert isinstance(e, (ServerError, TandemError))
    return ApiError(500, e.message, code=e.code, type="server_error")


# --- request validation -------------------------------------------------------------------------

def _type_error(name: str, want: str, value: Any) -> ApiError:
    return ApiError(400, f"{name}: expected {want}, got {type(value).__name__} {value!r:.60}",
                    param=name, code="invalid_type")


def _range_error(name: str, want: str, value: Any) -> ApiError:
    return ApiError(400, f"{name}: expected {want}, got {value!r:.60}", param=name,
                    code="invalid_value")


def get_int(body: dict, name: str, default=None, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _type_error(name, "an integer", v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        want = (f"an integer in [{lo}, {hi}]" if lo is not None and hi is not None else
                f"an integer >= {lo}" if lo is not None else f"an integer <= {hi}")
        raise _range_error(name, want, v)
    return v


def get_num(body: dict, name: str, default=None, lo: float | None = None,
            hi: float | None = None, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(name, "a number", v)
    v = float(v)
    bad = not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) or \
        (hi is not None and v > hi)
    if bad:
        left = "(" if lo_open else "["
        raise _range_error(name, f"a number in {left}{lo}, {hi}]" if hi is not None
                           else f"a number {'>' if lo_open else '>='} {lo}", v)
    return v


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def get_str(body: dict, name: str, default: str = "") -> str:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _type_error(name, "a string", v)
    return v


def check_model(body: dict, model_ids: tuple[str, ...], required: bool = False) -> str:
    """The request's model, one this server serves (optional on /tokenize, as vLLM's)."""
    model = body.get("model")
    if model is None:
        if not required:
            return model_ids[0]
        raise ApiError(400, "model: required (GET /v1/models lists the served model)",
                       param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model not in model_ids:
        raise ApiError(400, f"model {model!r} does not exist; this server serves "
                       f"{model_ids[0]!r}", param="model", code="model_not_found")
    return model


class Params:
    """What one request asks for, checked: the SDK's keyword arguments and the gateway's own."""

    def __init__(self, body: dict, cfg: ApiConfig, route: str, model_ids: tuple[str, ...]):
        chat = route == "/v1/chat/completions"
        self.model = check_model(body, model_ids, required=True)
        for name in UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETIONS:
            if name in body and not _is_off(name, body[name]):
                raise ApiError(400, f"{name} is not supported by Tandem", param=name,
                               code="unsupported_parameter")
        self.n = get_int(body, "n", 1, lo=1, hi=cfg.max_n)
        if chat:
            wants = get_bool(body, "logprobs")
            top = get_int(body, "top_logprobs", None, lo=0, hi=cfg.max_top_logprobs)
            if top is not None and not wants:
                raise ApiError(400, "top_logprobs: only allowed with logprobs: true",
                               param="top_logprobs", code="invalid_value")
            self.logprobs = (top or 0) if wants else None
        else:
            self.logprobs = get_int(body, "logprobs", None, lo=0, hi=cfg.max_top_logprobs)
        self.stream = get_bool(body, "stream")
        opts = body.get("stream_options")
        self.include_usage = False
        if opts is not None:
            if not isinstance(opts, dict):
                raise _type_error("stream_options", "an object", opts)
            if not self.stream:
                raise ApiError(400, "stream_options: only allowed with stream: true",
                               param="stream_options", code="invalid_value")
            self.include_usage = get_bool(opts, "include_usage")
        max_tokens = get_int(body, "max_tokens", None, lo=1)
        if chat:
            max_tokens = get_int(body, "max_completion_tokens", max_tokens, lo=1)
        self.max_tokens = cfg.default_max_tokens if max_tokens is None else max_tokens
        stop = body.get("stop")
        if stop is None:
            self.stop: list[str] = []
        elif isinstance(stop, str):
            self.stop = [stop] if stop else []
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            if len(stop) > cfg.max_stop:
                raise _range_error("stop", f"at most {cfg.max_stop} strings", stop)
            self.stop = [s for s in stop if s]
        else:
            raise _type_error("stop", "a string or a list of strings", stop)
        mode = get_str(body, "mode", cfg.default_mode)
        if mode not in MODES:
            raise _range_error("mode", " | ".join(MODES), mode)
        self.mode = mode
        nav = body.get("nav_thresholds")
        if nav is not None:
            if not (isinstance(nav, list) and len(nav) == 2 and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in nav)):
                raise _type_error("nav_thresholds", "a list of two numbers [R1, R2]", nav)
        deadline = get_num(body, "deadline_s", None, lo=0, lo_open=True)
        c = output_constraint(body, cfg.max_constraint_bytes)
        self.tools = tool_spec(body, cfg.max_constraint_bytes) if chat else None
        if self.tools is not None and self.tools.forced:
            if c is not None:
                raise ApiError(400, "tool_choice: a forced tool call constrains the output "
                               "itself; not with response_format or guided_regex",
                               param="tool_choice", code="invalid_value")
            c = self.tools.constraint()
        if c is not None and get_bool(body, "ignore_eos"):
            raise ApiError(400, "ignore_eos: not with response_format, guided_regex or a forced "
                           "tool call (the output ends where the constraint is complete)",
                           param="ignore_eos", code="invalid_value")
        self.sdk = dict(
            mode=mode, max_tokens=self.max_tokens,
            temperature=get_num(body, "temperature", cfg.default_temperature, lo=0, hi=2),
            top_p=get_num(body, "top_p", 1.0, lo=0, hi=1),
            top_k=get_int(body, "top_k", 0, lo=0),
            seed=get_int(body, "seed", None),
            sampling_coupling=get_str(body, "sampling_coupling") or None,   # gumbel | rejection
            policy=get_str(body, "policy", cfg.default_policy),
            cut=get_int(body, "cut", cfg.default_cut, lo=0),
            deadline_s=cfg.request_timeout_s if deadline is None else deadline,
            allow_edge_only=get_bool(body, "allow_edge_only"),
            stop_at_eos=not get_bool(body, "ignore_eos"),
            nav_thresholds=None if nav is None else (float(nav[0]), float(nav[1])),
            logprobs=self.logprobs, constraint=c,
            tpt_slo_ms=get_num(body, "tpt_slo_ms", 0.0, lo=0, hi=1e9))

    def seeds(self) -> list[int | None]:
        """Each choice's seed: the request's + i, or, for n > 1 without one, distinct random
        seeds (so sampled choices differ); greedy choices are all the same answer."""
        seed = self.sdk["seed"]
        if self.n == 1:
            return [seed]
        if seed is None:
            return random.sample(range(2**62), self.n)
        return [seed + i for i in range(self.n)]


def output_constraint(body: dict, max_bytes: int) -> protocol.Constraint | None:
    """The request's output constraint: `response_format` (OpenAI's json_object / json_schema;
    "text" is none) or `guided_regex` (vLLM's name, through the SDK's extra_body), compiled
    here so a schema the library cannot compile is a 400 naming the field."""
    rf, regex = body.get("response_format"), body.get("guided_regex")
    if rf is not None and not isinstance(rf, dict):
        raise _type_error("response_format", "an object", rf)
    if rf is not None and rf.get("type") == "text":
        rf = None
    if rf is not None and regex is not None:
        raise ApiError(400, "response_format and guided_regex: send one of them",
                       param="guided_regex", code="invalid_value")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise _type_error("guided_regex", "a non-empty string", regex)
        param, c = "guided_regex", protocol.Constraint("regex", regex)
    elif rf is None:
        return None
    elif rf.get("type") == "json_object":
        param, c = "response_format", protocol.Constraint("json_object")
    elif rf.get("type") == "json_schema":
        param = "response_format"
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _type_error("response_format.json_schema", "an object", js)
        name = js.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "response_format.json_schema.name: required (a string)",
                           param=param, code="invalid_value")
        if not isinstance(js.get("strict", False), bool):
            raise _type_error("response_format.json_schema.strict", "a boolean", js["strict"])
        schema = js.get("schema", {})   # OpenAI's default: any JSON value of the object
        if not isinstance(schema, dict):
            raise _type_error("response_format.json_schema.schema", "an object", schema)
        c = protocol.Constraint("json_schema", json.dumps(schema))
    else:
        raise _range_error("response_format.type", "text | json_object | json_schema",
                           rf.get("type"))
    try:
        constraint.check(c, max_bytes)
    except protocol.ProtocolError as e:
        text = e.message.replace("constraint: ", "", 1)
        raise ApiError(400, f"{param}: {text}", param=param,
                       code="too_large" if e.code == protocol.TOO_LARGE else "invalid_value") \
            from None
    return c


def tool_spec(body: dict, max_bytes: int) -> tools.Tools | None:
    """The request's `tools` and `tool_choice`, checked (api/tools.py)."""
    try:
        return tools.parse(body, max_bytes)
    except tools.ToolsError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None


# --- prompts ------------------------------------------------------------------------------------

_MESSAGE_CODES = {"missing": "missing_required_parameter", "invalid_type": "invalid_type",
                  "invalid_value": "invalid_value", "too_many": "too_many_messages",
                  "unsupported": "unsupported_value"}


def chat_messages(body: dict, max_messages: int, tool_turns: bool = False) -> list[dict]:
    """The request's conversation, checked (common/chat.py, shared with the dispatcher);
    `tool_turns`: tool results and assistant tool calls are accepted (the template renders
    them)."""
    try:
        return chat.normalize(body.get("messages"), max_messages, tool_turns)
    except chat.MessageError as e:
        raise ApiError(400, str(e), param=e.field, code=_MESSAGE_CODES[e.code]) from None


def completion_prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if p is None:
        raise ApiError(400, "prompt: required", param="prompt", code="missing_required_parameter")
    if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool)
                                         for x in p):
        return p
    if isinstance(p, list):
        if len(p) != 1:
            raise ApiError(400, "prompt: one prompt per request (batched prompts are not "
                           "supported)", param="prompt", code="unsupported_value")
        return completion_prompt({"prompt": p[0]})
    if not isinstance(p, str):
        raise _type_error("prompt", "a string or a list of token ids", p)
    return p


class StopScanner:
    """Finds stop strings in the streamed text; holds back the tail that could start one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string appeared: then nothing after it counts)."""
        self.buf += text
        if self.stops:
            hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
            if hits:
                out, self.buf = self.buf[:min(hits)], ""
                return out, True
        cut = max(len(self.buf) - self.hold, 0)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


# --- the gateway --------------------------------------------------------------------------------

class Gateway:
    def __init__(self, cfg: ApiConfig):
        self.cfg = cfg
        self.tokenizer = None
        self.client = None
        self.ready = False
        self.model_ids: tuple[str, ...] = (cfg.model,)
        self.created = int(time.time())
        self.max_model_len = cfg.max_prompt_tokens   # the target's context length, once loaded
        self.supports_tools = False   # the target's chat template renders tools (api/tools.py)
        self._token_strs: dict[int, str] = {}

    async def start(self) -> None:
        from common import models, tokenizer
        from tandem.client import AsyncClient

        path = models.resolve_target(self.cfg.target)
        self.tokenizer = await asyncio.to_thread(tokenizer.load, path)
        self.supports_tools = tools.supports_tools(self.tokenizer)
        self.model_ids = tuple(dict.fromkeys((self.cfg.model, Path(path).name)))
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            config = json.loads((Path(path) / "config.json").read_text())
            config = config.get("text_config", config)   # multimodal configs nest it
            self.max_model_len = int(config["max_position_embeddings"])
        self.client = AsyncClient(
            self.cfg.dispatcher, timeout_s=self.cfg.request_timeout_s,
            connect_timeout_s=self.cfg.connect_timeout_s,
            # busy / unavailable go straight back as 429 / 503: HTTP clients retry on their own
            # schedule (openai-python does, honouring Retry-After); retrying here as well would
            # multiply the attempts and hide the load from them
            max_retries=0,
            # a dispatcher lost mid-stream (restarted by its supervisor): the stream pauses and
            # continues from its tokens, the HTTP client sees no error (tandem/link.py)
            heartbeat_s=self.cfg.dispatcher_heartbeat_s,
            link_timeout_s=self.cfg.dispatcher_timeout_s, max_resumes=self.cfg.max_resumes,
            curve_server_key=self.cfg.curve_server_key or None,
            curve_client_key=self.cfg.curve_client_key or None)
        metrics.declare()
        self.ready = True
        log.info("gateway ready: model %s, dispatcher %s", self.model_ids, self.cfg.dispatcher)

    async def stop(self) -> None:
        self.ready = False
        if self.client is not None:
            await self.client.close()

    # --- prompts -> token ids ---
    async def _tokens(self, fn, size: int) -> list[int]:
        # short prompts inline (microseconds); long ones off the event loop
        ids = await asyncio.to_thread(fn) if size > 8192 else fn()
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return ids

    async def chat_ids(self, messages: list[dict], with_tools: tools.Tools | None = None
                       ) -> list[int]:
        if with_tools is not None and not self.supports_tools:
            raise ApiError(400, "tools: this model's chat template does not support tools",
                           param="tools", code="unsupported_parameter")
        listed = None if with_tools is None else with_tools.template_tools()
        size = sum(len(m["content"]) for m in messages)
        try:
            return await self._tokens(lambda: chat.render_ids(self.tokenizer, messages, listed),
                                      size)
        except TemplateError as e:   # the template's own rule (e.g. roles must alternate)
            raise ApiError(400, f"messages: the chat template cannot render this conversation: "
                           f"{e}", param="messages", code="invalid_value") from None

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt: token ids outside the vocabulary: {bad[:5]}",
                               param="prompt", code="invalid_value")
            return prompt
        return await self._tokens(lambda: self.tokenizer.encode(prompt), len(prompt))

    async def text_ids(self, text: str, special_tokens: bool = True) -> list[int]:
        return await self._tokens(
            lambda: self.tokenizer.encode(text, add_special_tokens=special_tokens), len(text))

    def check_length(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, f"{param}: empty prompt", param=param, code="invalid_value")
        if len(ids) > self.cfg.max_prompt_tokens:
            raise ApiError(400, f"{param}: the prompt is {len(ids)} tokens, over the limit of "
                           f"{self.cfg.max_prompt_tokens}", param=param,
                           code="context_length_exceeded")

    # --- one generation ---
    def answer(self, run: "Run", choice: "Choice") -> AsyncIterator[Piece]:
        """pieces(), with a tool call answered as a last piece carrying `tool_calls`."""
        t = run.params.tools
        if t is None or t.choice == "none":
            return self.pieces(run, choice)
        return tools.hold_calls(self.pieces(run, choice), t, choice, Piece)

    async def pieces(self, run: "Run", choice: "Choice") -> AsyncIterator[Piece]:
        """One choice's text to send, in pieces, each with the log-probabilities of the tokens
        it releases (when asked for); choice.finish / .tokens / .stats filled as it goes.
        Closing this generator (or cancelling its task) cancels the request on the dispatcher."""
        agen = self.client.generate(run.ids, end_client=run.client,
                                    **{**run.params.sdk, "seed": choice.seed})
        scan = StopScanner(run.params.stop)
        wants = run.params.logprobs is not None
        held: list[tuple[int, Any]] = []   # (token id, TokenLogprob) not sent yet
        try:
            while True:
                try:
                    chunk = await agen.__anext__()
                except StopAsyncIteration:
                    r = agen.result   # this stream's own (concurrent streams have theirs)
                    choice.stats = dict(r.stats) if r is not None else {}
                    choice.finish = "length" if r is not None and r.finish_reason == "length" \
                        else "stop"
                    tail = scan.flush()
                    if tail or held:
                        yield Piece(tail, held, choice.lp_chars)
                    return
                choice.tokens += len(chunk.token_ids)
                if wants:
                    held += zip(chunk.token_ids, chunk.logprobs or [None] * len(chunk.token_ids))
                text, stopped = scan.feed(chunk.text)
                if stopped:
                    # the tokens that begin before the cut are the answer's; later ones are not
                    sent, keep = choice.chars + len(text), []
                    at = choice.lp_chars
                    for t, lp in held:
                        if at >= sent:
                            break
                        keep.append((t, lp))
                        at += len(self.token_str(t))
                    held = keep
                if text or (stopped and held):
                    run.first()
                    piece = Piece(text, held, choice.lp_chars)
                    choice.chars += len(text)
                    choice.lp_chars += sum(len(self.token_str(t)) for t, _ in held)
                    yield piece
                    held = []
                if stopped:
                    choice.finish = "stop"
                    metrics.CANCELLED.labels(run.route, "stop").inc()
                    return   # the finally closes the SDK stream: Cancel to the dispatcher
        except (GeneratorExit, asyncio.CancelledError):
            metrics.CANCELLED.labels(run.route, "disconnect").inc()
            raise
        finally:
            await agen.aclose()
            if agen.resumes:
                metrics.RESUMES.labels(run.route, run.params.mode).inc(agen.resumes)

    # --- log-probabilities in OpenAI's shapes ---
    def token_str(self, token: int) -> str:
        s = self._token_strs.get(token)
        if s is None:
            s = self._token_strs[token] = self.tokenizer.decode([token])
        return s

    def chat_logprobs(self, entries: list) -> dict:
        """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}"""
        def one(t: int, lp: float) -> dict:
            s = self.token_str(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**one(t, lp.logprob), "top_logprobs": [
            one(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
            for t, lp in entries if lp is not None], "refusal": None}

    def completion_logprobs(self, entries: list, offset: int) -> dict:
        """The legacy shape: tokens, token_logprobs, top_logprobs ({token: logprob}, the
        sampled token included as vLLM does) and text_offset (into the choice's text, from
        `offset`)."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp in entries:
            if lp is None:
                continue
            s = self.token_str(t)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp.logprob)
            top = {self.token_str(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}
            top.setdefault(s, lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(s)
        return out


class Piece:
    """Text released to the client, the (token id, TokenLogprob) of the tokens with it, and
    where the first of those tokens' text starts in the choice's text; or the answer's tool
    calls (OpenAI's shape, api/tools.py), with no text."""
    __slots__ = ("text", "entries", "offset", "tool_calls")

    def __init__(self, text: str, entries: list, offset: int = 0,
                 tool_calls: list[dict] | None = None):
        self.text, self.entries, self.offset = text, entries, offset
        self.tool_calls = tool_calls


class Choice:
    """One of a request's n generations."""

    def __init__(self, index: int, seed: int | None):
        self.index, self.seed = index, seed
        self.tokens = 0
        self.finish: str | None = None
        self.stats: dict = {}
        self.chars = 0       # text sent so far
        self.lp_chars = 0    # text of the tokens whose log-probabilities were sent


class Run:
    """One request's bookkeeping: its n choices."""

    def __init__(self, route: str, ids: list[int], params: Params, client: str = ""):
        self.route, self.ids, self.params = route, ids, params
        self.client = client   # the API key's identity: the dispatcher's per-client limits
        self.choices = [Choice(i, seed) for i, seed in enumerate(params.seeds())]
        self.t0 = time.monotonic()
        self.ttft: float | None = None
        self.id = ("chatcmpl-" if route == "/v1/chat/completions" else "cmpl-") + \
            uuid.uuid4().hex[:24]
        self.created = int(time.time())

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def stats(self) -> dict:
        """The dispatcher's per-request stats (n > 1: the first choice's, and every choice's
        under "choices")."""
        if len(self.choices) == 1:
            return self.choices[0].stats
        return {**self.choices[0].stats, "choices": [c.stats for c in self.choices]}

    def first(self) -> None:
        if self.ttft is None:
            self.ttft = time.monotonic() - self.t0
            metrics.TTFT.labels(self.route, self.params.mode).observe(self.ttft)

    def usage(self) -> dict:
        prompt = len(self.ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens,
                "total_tokens": prompt + self.tokens,
                "prompt_tokens_details": {"cached_tokens": int(self.stats().get("cached_tokens") or 0)}}

    def done(self) -> None:
        mode = self.params.mode
        metrics.PROMPT_TOKENS.labels(self.route, mode).inc(len(self.ids))
        metrics.COMPLETION_TOKENS.labels(self.route, mode).inc(self.tokens)
        if self.tokens:
            metrics.TPT.labels(self.route, mode).observe(
                (time.monotonic() - self.t0) / self.tokens)


async def read_body(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {length} bytes is over the limit of {limit}",
                       code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes",
                           code="request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return data


def _sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else
                        json.dumps(obj, separators=(",", ":"))).encode() + b"\n\n"


# --- the routes ---------------------------------------------------------------------------------
# Each route is a handler that finds what it needs on request.app.state: the Gateway (`gateway`),
# the ApiConfig (`config`) and the API keys (`keys`), set by create_app.

def authorize(request: Request) -> str:
    """The request's client identity ("" when the API is open); 401 without a valid key."""
    keys: auth.Keys = request.app.state.keys
    if not keys.enabled:
        return ""
    ident = keys.identity(request.headers.get("authorization"))
    if ident is None:
        missing = not request.headers.get("authorization")
        raise ApiError(
            401, "no API key provided: send it as 'Authorization: Bearer KEY'" if missing
            else "incorrect API key provided", code="missing_api_key" if missing else
            "invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="tandem"'})
    return ident


def check_ready(gw: Gateway) -> None:
    """503 until the gateway has its tokenizer and its dispatcher connection."""
    if not gw.ready:
        raise ApiError(503, "the gateway is starting", code="unavailable",
                       type="service_unavailable_error")


async def models_route(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        authorize(request)
    except ApiError as e:
        return e.response()
    return JSONResponse({"object": "list", "data": [
        {"id": m, "object": "model", "created": gw.created, "owned_by": "tandem"}
        for m in gw.model_ids[:1]]})


async def generation_route(request: Request) -> Response:
    """POST /v1/completions and /v1/chat/completions: one answer whole, or streamed."""
    gw: Gateway = request.app.state.gateway
    cfg: ApiConfig = request.app.state.config
    route = request.url.path
    chat = route == "/v1/chat/completions"
    try:
        client = authorize(request)
        check_ready(gw)
        body = await read_body(request, cfg.max_body_bytes)
        params = Params(body, cfg, route, gw.model_ids)
        ids = await request_ids(gw, body, chat, cfg.max_messages, params.tools)
        run = Run(route, ids, params, client)
        if params.stream:
            return await stream_answer(gw, run, chat, cfg.retry_after_s)
        return await whole_answer(gw, run, chat, request, cfg.retry_after_s)
    except ApiError as e:
        return e.response()


async def request_ids(gw: Gateway, body: dict, chat: bool, max_messages: int,
                      tool_list=None) -> list[int]:
    """The prompt's token ids: the rendered conversation (chat, with its tools) or the
    completion prompt."""
    if chat:
        messages = chat_messages(body, max_messages, gw.supports_tools)
        ids = await gw.chat_ids(messages, tool_list)
        gw.check_length(ids, "messages")
    else:
        ids = await gw.prompt_ids(completion_prompt(body))
        gw.check_length(ids, "prompt")
    return ids


# --- a whole answer ---

async def whole_answer(gw: Gateway, run: Run, chat: bool, request: Request,
                       retry_after_s: int) -> Response:
    """Every choice generated to its end, then one JSON answer. A client that goes away before
    the answer cancels the request on the dispatcher (499, nobody is listening)."""
    metrics.ACTIVE.labels(run.route).inc()
    gen = asyncio.ensure_future(collect_choices(gw, run))
    watch = asyncio.ensure_future(until_disconnected(request.receive))
    try:
        await asyncio.wait((gen, watch), return_when=asyncio.FIRST_COMPLETED)
        if not gen.done():
            gen.cancel()
            await asyncio.gather(gen, return_exceptions=True)
            return Response(status_code=499)
        answers = gen.result()
    except TandemError as e:
        raise from_tandem(e, retry_after_s) from None
    finally:
        watch.cancel()
        metrics.ACTIVE.labels(run.route).dec()
    run.done()
    choices = [whole_choice(gw, run, chat, c, text, entries, calls)
               for c, (text, entries, calls) in zip(run.choices, answers)]
    return JSONResponse({
        "id": run.id, "object": "chat.completion" if chat else "text_completion",
        "created": run.created, "model": run.params.model, "system_fingerprint": None,
        "choices": choices, "usage": run.usage(), "tandem": run.stats()})


async def collect_choices(gw: Gateway, run: Run) -> list[tuple[str, list, list | None]]:
    """Each choice's (text, log-probability entries, tool calls), the choices generated at once;
    one that fails (or the caller's cancel) ends the others too."""
    tasks = [asyncio.ensure_future(collect_choice(gw, run, c)) for c in run.choices]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_choice(gw: Gateway, run: Run, choice: Choice
                         ) -> tuple[str, list, list | None]:
    text, entries, calls = [], [], None
    async for piece in gw.answer(run, choice):
        text.append(piece.text)
        entries += piece.entries
        calls = piece.tool_calls or calls
    return "".join(text), entries, calls


def whole_choice(gw: Gateway, run: Run, chat: bool, c: Choice, text: str,
                 entries: list, calls: list | None = None) -> dict:
    """One choice of a whole answer, in the route's shape."""
    wants = run.params.logprobs is not None
    if chat:
        return {"index": c.index, "message": tools.message(text, calls),
                "logprobs": gw.chat_logprobs(entries) if wants else None,
                "finish_reason": c.finish}
    return {"index": c.index, "text": text,
            "logprobs": gw.completion_logprobs(entries, 0) if wants else None,
            "finish_reason": c.finish}


async def until_disconnected(receive) -> None:
    """Returns when the client has gone away (the ASGI receive channel says so)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# --- a streamed answer ---

async def stream_answer(gw: Gateway, run: Run, chat: bool, retry_after_s: int) -> Response:
    """Server-Sent Events, one chunk per piece of any choice. An error before the first piece
    is an HTTP status; after it, an error event (as OpenAI's)."""
    merged = MergedPieces(gw, run)
    first = await first_piece(merged, retry_after_s)
    chunks = StreamChunks(gw, run, chat)
    return EventStream(stream_events(run, chunks, merged, first, retry_after_s), merged.close,
                       media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class MergedPieces:
    """Every choice's pieces in one queue, as they come: (choice, Piece), (choice, None) at its
    end, or (choice, the exception that ended it). Counted in tandem_api_active_requests until
    closed."""

    def __init__(self, gw: Gateway, run: Run):
        self.route = run.route
        self.queue: asyncio.Queue = asyncio.Queue()
        self.gens = [gw.answer(run, c) for c in run.choices]
        self.tasks = [asyncio.ensure_future(self._pump(c, g))
                      for c, g in zip(run.choices, self.gens)]
        metrics.ACTIVE.labels(run.route).inc()
        self.closed = False

    async def _pump(self, c: Choice, gen) -> None:
        try:
            async for piece in gen:
                self.queue.put_nowait((c, piece))
            self.queue.put_nowait((c, None))
        except Exception as e:  # noqa: BLE001 - the stream's reader raises it
            self.queue.put_nowait((c, e))

    async def get(self) -> tuple[Choice, Any]:
        return await self.queue.get()

    async def close(self) -> None:
        """Once, whichever way the stream ends: a choice not finished sends Cancel to the
        dispatcher."""
        if self.closed:
            return
        self.closed = True
        metrics.ACTIVE.labels(self.route).dec()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for g in self.gens:
            await g.aclose()


async def first_piece(merged: MergedPieces, retry_after_s: int) -> tuple[Choice, Any]:
    """The first item before the answer starts: an error up to there is an HTTP status."""
    try:
        first = await merged.get()
        if isinstance(first[1], BaseException):
            raise first[1]
    except TandemError as e:
        await merged.close()
        raise from_tandem(e, retry_after_s) from None
    except BaseException:
        await merged.close()
        raise
    return first


class StreamChunks:
    """A streamed answer's events in OpenAI's chunk shape (chat.completion.chunk or
    text_completion), each framed as one SSE `data:` line."""

    def __init__(self, gw: Gateway, run: Run, chat: bool):
        self.gw, self.run, self.chat = gw, run, chat
        self.head = {"id": run.id,
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": run.created, "model": run.params.model,
                     "system_fingerprint": None}
        # with include_usage every chunk says "usage": null, the last one the usage
        self.usage_null = {"usage": None} if run.params.include_usage else {}
        self.wants = run.params.logprobs is not None

    def choice(self, c: Choice, piece: Piece | None, finish: str | None,
               first: bool = False) -> bytes:
        """A chunk of one choice: a piece of its text, its end (finish), or (chat, first) the
        assistant's role."""
        text = None if piece is None else piece.text
        lps = None
        if self.wants and piece is not None and piece.entries:
            lps = self.gw.chat_logprobs(piece.entries) if self.chat else \
                self.gw.completion_logprobs(piece.entries, piece.offset)
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if first else
                     {} if text is None else {"content": text})
            if piece is not None and piece.tool_calls:
                delta = {"tool_calls": tools.deltas(piece.tool_calls)}
            choice = {"index": c.index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": c.index, "text": text or "", "logprobs": lps,
                      "finish_reason": finish}
        return _sse({**self.head, "choices": [choice], **self.usage_null})

    def usage(self) -> bytes:
        return _sse({**self.head, "choices": [], "usage": self.run.usage()})


async def stream_events(run: Run, chunks: StreamChunks, merged: MergedPieces,
                        first: tuple[Choice, Any], retry_after_s: int) -> AsyncIterator[bytes]:
    """The answer's events from the first piece on, to `data: [DONE]`; closes the pieces."""
    try:
        if chunks.chat:
            for c in run.choices:
                yield chunks.choice(c, None, None, first=True)
        item, left = first, len(run.choices)
        while True:
            c, piece = item
            if isinstance(piece, BaseException):
                raise piece
            if piece is None:
                yield chunks.choice(c, None, c.finish)
                left -= 1
                if not left:
                    break
            else:
                yield chunks.choice(c, piece, None)
            item = await merged.get()
        run.done()
        if run.params.include_usage:
            yield chunks.usage()
        yield _sse("[DONE]")
    except TandemError as e:   # after the answer started: an error event, as OpenAI
        yield _sse(from_tandem(e, retry_after_s).body())
    finally:
        await merged.close()


# --- vLLM's token routes, probes and metrics ---

async def token_route_body(request: Request) -> dict:
    """The body of a /tokenize or /detokenize request, once its key and model are checked."""
    gw: Gateway = request.app.state.gateway
    authorize(request)
    check_ready(gw)
    body = await read_body(request, request.app.state.config.max_body_bytes)
    check_model(body, gw.model_ids)
    return body


async def tokenize_route(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        body = await token_route_body(request)
        if ("prompt" in body) == ("messages" in body):
            raise ApiError(400, "prompt or messages: send one of them", param="prompt",
                           code="missing_required_parameter")
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise _type_error("prompt", "a string", prompt)
            ids = await gw.text_ids(prompt, get_bool(body, "add_special_tokens", True))
        else:   # as the chat route renders it, tools included
            cfg = request.app.state.config
            messages = chat_messages(body, cfg.max_messages, gw.supports_tools)
            ids = await gw.chat_ids(messages, tool_spec(body, cfg.max_constraint_bytes))
        return JSONResponse({"count": len(ids), "max_model_len": gw.max_model_len,
                             "tokens": ids, "token_strs": None})
    except ApiError as e:
        return e.response()


async def detokenize_route(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        body = await token_route_body(request)
        tokens = body.get("tokens")
        if tokens is None:
            raise ApiError(400, "tokens: required", param="tokens",
                           code="missing_required_parameter")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise _type_error("tokens", "a list of token ids", tokens)
        vocab = len(gw.tokenizer)
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: ids outside the vocabulary [0, {vocab}): "
                           f"{bad[:5]}", param="tokens", code="invalid_value")
        return JSONResponse({"prompt": gw.tokenizer.decode(tokens)})
    except ApiError as e:
        return e.response()


async def health_route(request: Request) -> Response:
    return Response(status_code=200 if request.app.state.gateway.ready else 503)


async def metrics_route(request: Request) -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def healthz_route(request: Request) -> Response:
    return PlainTextResponse("ok")


async def readyz_route(request: Request) -> Response:
    ready = request.app.state.gateway.ready
    return PlainTextResponse("ready" if ready else "loading", status_code=200 if ready else 503)


async def not_found(request: Request, exc) -> Response:
    return ApiError(404, f"no route {request.method} {request.url.path}",
                    code="not_found").response()


async def not_allowed(request: Request, exc) -> Response:
    return ApiError(405, f"method {request.method} not allowed on {request.url.path}",
                    code="method_not_allowed").response()


@contextlib.asynccontextmanager
async def lifespan(app: Starlette):
    """The gateway runs while the server does: tokenizer loaded, dispatcher connected."""
    gw: Gateway = app.state.gateway
    await gw.start()
    try:
        yield
    finally:
        await gw.stop()


ROUTES = [
    Route("/v1/models", models_route, methods=["GET"]),
    Route("/v1/completions", generation_route, methods=["POST"]),
    Route("/v1/chat/completions", generation_route, methods=["POST"]),
    Route("/metrics", metrics_route, methods=["GET"]),
    Route("/healthz", healthz_route, methods=["GET"]),
    Route("/readyz", readyz_route, methods=["GET"]),
    Route("/health", health_route, methods=["GET"]),
    Route("/tokenize", tokenize_route, methods=["POST"]),
    Route("/detokenize", detokenize_route, methods=["POST"]),
]


def create_app(cfg: ApiConfig | None = None) -> CountRequests:
    """The gateway's ASGI app: the routes over one Gateway, every answer counted."""
    cfg = cfg or ApiConfig()
    keys = auth.Keys(auth.load_keys(cfg.api_key, cfg.api_keys_file))   # KeysError: bad setting
    app = Starlette(routes=ROUTES, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: not_allowed})
    app.state.config = cfg
    app.state.keys = keys
    app.state.gateway = Gateway(cfg)
    return CountRequests(app)


class EventStream(StreamingResponse):
    """A streaming answer that notices a client going away while it waits for the next token
    (not only at its next write), and then closes the stream: the request is cancelled on the
    dispatcher at once, whatever point the generation is at."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(until_disconnected(receive))
        try:
            await asyncio.wait((streaming, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            results = await asyncio.gather(streaming, watching, return_exceptions=True)
            await self.body_iterator.aclose()
            await self.on_close()
        err = results[0]
        if isinstance(err, Exception) and not isinstance(err, OSError):
            raise err


class CountRequests:
    """ASGI middleware: tandem_api_requests_total{route, status} for every answer."""

    def __init__(self, app):
        self.app = app
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = metrics.route_of(scope.get("path", ""))
        status = {"code": 500}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            if route != "other":
                metrics.REQUESTS.labels(route, str(status["code"])).inc()
