"""Tool calling on the chat route (api/tools.py): `tools` / `tool_choice` in, OpenAI's
`tool_calls` out, for a target whose chat template renders tools.

Neither bundled model's template does, so the served target here is a tiny random-weight Qwen2
checkpoint (seeded, no downloads) with the bundled SmolLM2 tokenizer and a Qwen2.5-style
(Hermes) template that renders tools, tool results and assistant tool calls. The stack runs in
this process (stack/inprocess.py) and the gateway in Starlette's test client; the official
`openai` client talks to it. A forced call (a named function, "required") is checked against
transformers' greedy `generate` under the same llguidance mask, token for token, and its
arguments against the function's schema (jsonschema). The parsing of free answers ("auto") and
the validation errors need no model.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil

import jsonschema
import openai
import pytest
import torch
import transformers
from starlette.testclient import TestClient

from api import tools
from api.app import create_app
from api.config import ApiConfig
from tests.conftest import LLGuidanceProcessor

MODEL = "tandem"

# Qwen2.5's chat template (Hermes-style tool calling), on SmolLM2's <|im_start|> / <|im_end|>;
# it refuses a conversation that starts with a tool result (a template's own error).
HERMES_TEMPLATE = r"""{%- if messages[0].role == 'tool' %}
    {{- raise_exception('a conversation cannot start with a tool result') }}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and " }}
    {{- "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 8},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "The time in a time zone.",
                                           "parameters": TIME}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
N = 96   # max_tokens: more than any call of these schemas takes


def call_schema(name: str) -> dict:
    """A forced call's output: {"name", "arguments"} (api/tools.py), written out here."""
    return {"type": "object", "properties": {"name": {"const": name},
                                             "arguments": PARAMETERS[name]},
            "required": ["name", "arguments"], "additionalProperties": False}


def build_tiny_tools_model(out, tokenizer_dir) -> None:
    """A seeded random-weight Qwen2 of SmolLM2's vocabulary, its tokenizer, and the Hermes
    template. The LM head is scaled up so greedy choices have clear margins."""
    cfg = transformers.Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=2)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    (out / "chat_template.jinja").write_text(HERMES_TEMPLATE)


# --- no model -----------------------------------------------------------------------------------

def _tools(choice="auto", parallel=True) -> tools.Tools:
    return tools.parse({"tools": TOOLS, "tool_choice": choice,
                        "parallel_tool_calls": parallel}, 32768)


def test_parse_calls_in_the_hermes_and_bare_formats():
    t = _tools()
    one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    calls = tools.parse_calls(one, t)
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    two = one + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert [c["function"]["name"] for c in tools.parse_calls(two, t)] == ["get_time",
                                                                          "get_weather"]
    assert len(tools.parse_calls(two, _tools(parallel=False))) == 1
    bare = ' {"name": "get_time", "parameters": {"zone": "CET"}}'   # Llama 3's key
    assert json.loads(tools.parse_calls(bare, t)[0]["function"]["arguments"]) == {"zone": "CET"}
    for text in ("The weather is fine.", '{"name": "nope", "arguments": {}}',
                 '{"name": "get_time", "arguments": "UTC"}', '<tool_call>\n{"name": "get_',
                 one + " and some words", ""):
        assert tools.parse_calls(text, t) is None, text


def test_could_be_call_holds_back_only_what_may_start_a_call():
    for text in ("", "  ", "<", "<tool_", "\n<tool_call>\n{", "{", ' {"na'):
        assert tools.could_be_call(text), text
    for text in ("The", "<b>", " I will", "<tool_calls>"[:-1] + "X"):
        assert not tools.could_be_call(text), text


class _Piece:
    def __init__(self, text, entries, offset=0, tool_calls=None):
        self.text, self.entries, self.offset, self.tool_calls = text, entries, offset, tool_calls


class _Choice:
    finish = None


async def _pieces(texts, choice, finish):
    for s in texts:
        yield _Piece(s, [])
    choice.finish = finish


def _held(texts, t, finish="stop"):
    import asyncio

    async def go():
        choice = _Choice()
        out = [p async for p in tools.hold_calls(_pieces(texts, choice, finish), t, choice,
                                                 _Piece)]
        return [(p.text, p.tool_calls) for p in out], choice.finish
    return asyncio.run(go())


def test_hold_calls_releases_text_at_once_and_answers_a_call_as_tool_calls():
    auto = _tools()
    out, finish = _held(["The ", "sky ", "is blue."], auto)   # released as soon as it is text
    assert out == [("The ", None), ("sky ", None), ("is blue.", None)] and finish == "stop"
    out, finish = _held(["<tool", "_call>\n", '{"name": "get_time", ', '"arguments": ',
                         '{"zone": "PST"}}\n</tool_call>'], auto)
    assert finish == "tool_calls" and len(out) == 1 and out[0][0] == ""
    assert out[0][1][0]["function"]["name"] == "get_time"
    out, finish = _held(["<tool", "_call>\n", '{"name": "get_'], auto, "length")   # cut short
    assert out == [('<tool_call>\n{"name": "get_', None)] and finish == "length"
    forced = _tools({"type": "function", "function": {"name": "get_time"}})
    out, finish = _held(['{"name":"get_time",', '"arguments":{"zone":"UTC"}}'], forced)
    assert finish == "tool_calls" and out[0][1][0]["function"]["arguments"] == '{"zone": "UTC"}'


def test_forced_choices_constrain_to_the_call_schema():
    named = _tools({"type": "function", "function": {"name": "get_weather"}})
    assert named.forced and json.loads(named.constraint().value) == call_schema("get_weather")
    required = _tools("required")
    assert json.loads(required.constraint().value) == {
        "anyOf": [call_schema("get_weather"), call_schema("get_time")]}
    assert _tools("auto").constraint() is None and _tools("none").constraint() is None
    no_args = tools.parse({"tools": [{"type": "function", "function": {"name": "ping"}}],
                           "tool_choice": "required"}, 32768)
    assert no_args.call_schema()["properties"]["arguments"] == tools.NO_PARAMETERS


@pytest.mark.parametrize("body,param", [
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": ["f"]}, "tools[0]"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS + [TOOLS[0]]}, "tools[2].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_name_the_field(body, param):
    with pytest.raises(tools.ToolsError) as e:
        tools.parse(body, 32768)
    assert e.value.param == param, e.value


# --- the bundled model: no tools ----------------------------------------------------------------

@contextlib.contextmanager
def _gateway(target: str, dispatcher: str, context=None):
    """The gateway in Starlette's test client; the official client on it. `context`: the
    in-process stack's ZMQ context (inproc:// endpoints are reached only within it)."""
    import tandem.client

    app = create_app(ApiConfig(target=target, dispatcher=dispatcher, connect_timeout_s=0.5))
    with pytest.MonkeyPatch.context() as mp:
        if context is not None:
            mp.setattr(tandem.client, "AsyncClient",
                       functools.partial(tandem.client.AsyncClient, context=context))
        http = TestClient(app, base_url="http://tandem")
        http.__enter__()   # the lifespan: the gateway loads the tokenizer, makes its client
    try:
        with openai.OpenAI(base_url="http://tandem/v1", api_key="unused", http_client=http,
                           max_retries=0) as c:
            yield c
    finally:
        http.__exit__(None, None, None)


def test_the_bundled_model_refuses_tools_naming_them(model_paths):
    # refused before any dispatcher is asked (there is none)
    with _gateway(str(model_paths.target), "tcp://127.0.0.1:9") as c:
        for choice in (None, "auto", "none", "required"):
            extra = {} if choice is None else {"tool_choice": choice}
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **extra)
            assert e.value.body["param"] == "tools", e.value.body
            assert "does not support tools" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:   # nor tool results
            c.chat.completions.create(model=MODEL, messages=ASK + [
                {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}])
        assert e.value.body["param"] == "messages[1].role", e.value.body


def test_gemma3_refuses_tools_naming_them():
    from common import models

    try:
        target = models.resolve_target("gemma3-270m")
    except models.ModelError as e:
        pytest.skip(str(e))
    with _gateway(str(target), "tcp://127.0.0.1:9") as c:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
        assert e.value.body["param"] == "tools", e.value.body


# --- a tools-capable tiny model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(model_paths, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tools")
    build_tiny_tools_model(out, model_paths.target)
    return out


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir):
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir, tiny_tokenizer):
    """reference(messages, name | None) -> transformers' greedy generate on the tiny model
    under the llguidance mask of a call of `name` (None: "required", any of the tools): the
    text (without its EOS), the prompt's length and the output's tokens (with its EOS)."""
    import llguidance
    from transformers import LogitsProcessorList

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir),
                                                              dtype=torch.float32).eval()

    def run(messages, name):
        ids = tiny_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True,
                                                 add_generation_prompt=True, return_dict=False)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        schema = call_schema(name) if name else {"anyOf": [call_schema(n) for n in PARAMETERS]}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        proc = LLGuidanceProcessor(tiny_tokenizer, grammar, len(ids), model.config.vocab_size)
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N,
                                 do_sample=False, logits_processor=LogitsProcessorList([proc]),
                                 eos_token_id=tiny_tokenizer.eos_token_id,
                                 pad_token_id=tiny_tokenizer.eos_token_id)
        out = out[0, len(ids):].tolist()
        return tiny_tokenizer.decode(out, skip_special_tokens=True), len(ids), len(out)
    return run


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """The official client on the gateway over an in-process stack serving the tiny model."""
    from stack.inprocess import BackgroundStack

    stack = BackgroundStack(target=str(tiny_dir))
    try:
        with _gateway(str(tiny_dir), stack.stack.endpoint("dispatcher"),
                      context=stack.stack.ctx) as c:
            yield c
    finally:
        stack.close()


def _check_call(choice, name: str | None) -> dict:
    """A choice that is one call (of `name`, or any tool), its arguments valid; the call."""
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    return call


@pytest.mark.parametrize("extra", [{"mode": "cloud-only"}, {"mode": "spec"},
                                   {"mode": "split", "cut": 1}],   # the tiny model has 2 layers
                         ids=["cloud-only", "spec", "split"])
def test_a_named_tool_choice_is_transformers_call_under_the_mask(tiny, tiny_reference, extra):
    r = tiny.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=N, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=extra)
    call = _check_call(r.choices[0], "get_weather")
    want, prompt_len, out_len = tiny_reference(ASK, "get_weather")
    assert json.loads(want) == {"name": "get_weather",
                                "arguments": json.loads(call.function.arguments)}
    assert r.usage.prompt_tokens == prompt_len   # the tools were in the prompt
    assert r.usage.completion_tokens == out_len


def test_required_picks_one_of_the_tools_with_n_choices(tiny, tiny_reference):
    r = tiny.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=N,
                                     temperature=0, tool_choice="required", n=2)
    want, _, out_len = tiny_reference(ASK, None)
    assert r.usage.completion_tokens == 2 * out_len
    for choice in r.choices:   # greedy: both the same call
        call = _check_call(choice, None)
        assert json.loads(want) == {"name": call.function.name,
                                    "arguments": json.loads(call.function.arguments)}
    sampled = tiny.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=N,
                                           temperature=1.0, seed=3, tool_choice="required", n=3)
    assert len(sampled.choices) == 3
    for choice in sampled.choices:
        _check_call(choice, None)


def test_streaming_a_forced_call_sends_it_as_one_tool_calls_delta(tiny, tiny_reference):
    chunks = list(tiny.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=N, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    want, _, _ = tiny_reference(ASK, "get_weather")
    assert json.loads(calls[0].function.arguments) == json.loads(want)["arguments"]


def test_tool_results_and_assistant_calls_render_through_the_template(tiny, tiny_tokenizer,
                                                                      tiny_reference):
    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"},
        {"role": "user", "content": "And the time in UTC?"}]
    r = tiny.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=N,
                                     temperature=0, tool_choice="required")
    call = _check_call(r.choices[0], None)
    # the template saw the call's arguments as an object, as transformers' convention has them
    rendered = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]) if m.get("tool_calls") else m
        for m in turns]
    want, prompt_len, _ = tiny_reference(rendered, None)
    assert r.usage.prompt_tokens == prompt_len
    assert json.loads(want) == {"name": call.function.name,
                                "arguments": json.loads(call.function.arguments)}


def test_none_and_auto_answer_text_when_it_is_no_call(tiny):
    for choice in ("none", "auto"):
        r = tiny.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                         temperature=0, tool_choice=choice)
        c = r.choices[0]
        # a random model's text is no call: content, never tool_calls
        assert c.message.tool_calls is None and isinstance(c.message.content, str), c
        assert c.finish_reason in ("stop", "length")


def test_the_templates_own_error_is_a_400_naming_messages(tiny):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.chat.completions.create(model=MODEL, messages=[
            {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}] + ASK, tools=TOOLS)
    assert e.value.body["param"] == "messages", e.value.body
    assert "cannot start with a tool result" in e.value.body["message"]


def test_a_forced_call_refuses_response_format_and_ignore_eos(tiny):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                     tool_choice="required",
                                     response_format={"type": "json_object"})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        tiny.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                     tool_choice="required", extra_body={"ignore_eos": True})
    assert e.value.body["param"] == "ignore_eos"
