"""Tool calling on the chat route: OpenAI's `tools` and `tool_choice`, for a target whose chat
template renders tools (other targets answer 400 naming `tools`).

The tools reach the chat template as `tools=` (transformers' `apply_chat_template`), which
describes them to the model in its family's words. What the model answers depends on
`tool_choice`:

* a named function (`{"type": "function", "function": {"name": ...}}`) or `"required"`: the
  output is constrained (llguidance, common/constraint.py, exact in every mode) to one call's
  JSON, `{"name": NAME, "arguments": ARGS}` with ARGS an instance of that function's
  `parameters` schema ("required": any of the tools). That object is the body of a call in the
  Hermes / Qwen and Llama 3 formats; the family's markers around it (`<tool_call>` ...) are not
  generated, as vLLM's forced calls. The answer is that call, as `tool_calls`.
* `"auto"` (the default with tools): free generation. An answer that is a call in the family's
  format, one or more `<tool_call>{"name", "arguments"}</tool_call>` blocks or a bare
  `{"name", "arguments" | "parameters"}` object naming one of the tools, is returned as
  `tool_calls`; anything else is the text, as `content`.
* `"none"`: the tools are in the prompt, the answer is text.

A returned call has `finish_reason: "tool_calls"` and `content: null`. An answer cut at
`max_tokens` (or by a stop string) before its call is complete is returned as text, with its
finish reason. Streaming holds back the text while it can still be a call (a forced choice: all
of it) and sends the call as one `tool_calls` delta when the answer is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from common import constraint, protocol

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"   # the Hermes / Qwen markers
CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128                                       # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")             # OpenAI's rule for a function name
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function that takes no arguments

# A tool the support check renders: a template that describes tools to the model prints its name.
PROBE_NAME = "tandem_probe_tool"
PROBE = [{"type": "function", "function": {"name": PROBE_NAME, "description": "a probe",
                                           "parameters": NO_PARAMETERS}}]


class ToolsError(ValueError):
    """A bad `tools` / `tool_choice`; `param` names the field, `code` is OpenAI's."""

    def __init__(self, param: str, code: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.code = param, code


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict

    def template_tool(self) -> dict:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}

    def call_schema(self) -> dict:
        """The JSON schema of one call of this function: its name, then its arguments."""
        return {"type": "object", "properties": {"name": {"const": self.name},
                                                 "arguments": self.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class Tools:
    """A request's tools, checked; `choice`: none | auto | required | a function's name."""
    functions: tuple[Function, ...]
    choice: str
    parallel: bool   # parallel_tool_calls: more than one call per answer (auto only)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.functions)

    @property
    def forced(self) -> bool:
        """The answer must be a call: a named function or "required"."""
        return self.choice not in ("none", "auto")

    def template_tools(self) -> list[dict]:
        return [f.template_tool() for f in self.functions]

    def call_schema(self) -> dict:
        """The output's schema under a forced choice."""
        if self.choice == "required":
            if len(self.functions) == 1:
                return self.functions[0].call_schema()
            return {"anyOf": [f.call_schema() for f in self.functions]}
        return next(f for f in self.functions if f.name == self.choice).call_schema()

    def constraint(self) -> protocol.Constraint | None:
        if not self.forced:
            return None
        return protocol.Constraint("json_schema", json.dumps(self.call_schema()))


def _compile(schema: dict, max_bytes: int, param: str) -> None:
    try:
        constraint.check(protocol.Constraint("json_schema", json.dumps(schema)), max_bytes)
    except protocol.ProtocolError as e:
        raise ToolsError(param, "too_large" if e.code == protocol.TOO_LARGE else "invalid_value",
                         e.message.replace("constraint: ", "", 1)) from None


def _function(i: int, tool: Any, max_bytes: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ToolsError(where, "invalid_type", f"expected an object, got {type(tool).__name__}")
    if tool.get("type") != "function":
        raise ToolsError(f"{where}.type", "invalid_value",
                         f'expected "function", got {tool.get("type")!r:.60}')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolsError(f"{where}.function", "invalid_type",
                         f"expected an object, got {type(fn).__name__}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolsError(f"{where}.function.name", "invalid_value",
                         f"expected 1 to 64 letters, digits, _ or -, got {name!r:.60}")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolsError(f"{where}.function.description", "invalid_type",
                         f"expected a string, got {type(description).__name__}")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolsError(f"{where}.function.strict", "invalid_type",
                         f"expected a boolean, got {type(strict).__name__}")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise ToolsError(f"{where}.function.parameters", "invalid_type",
                         f"expected a JSON schema object, got {type(parameters).__name__}")
    _compile(parameters, max_bytes, f"{where}.function.parameters")
    return Function(name, description, parameters)


def parse(body: dict, max_bytes: int) -> Tools | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked; None without
    tools (an empty list is none). Each function's parameters must compile as a constraint."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice is None or choice == "none":
            return None
        raise ToolsError("tool_choice", "invalid_value", "only allowed with tools")
    if not isinstance(raw, list):
        raise ToolsError("tools", "invalid_type",
                         f"expected a list of tools, got {type(raw).__name__}")
    if len(raw) > MAX_TOOLS:
        raise ToolsError("tools", "invalid_value", f"{len(raw)} tools is over the limit of "
                         f"{MAX_TOOLS}")
    functions = tuple(_function(i, t, max_bytes) for i, t in enumerate(raw))
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ToolsError(f"tools[{i}].function.name", "invalid_value",
                             f"{name!r} names two tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict):
            raise ToolsError("tool_choice", "invalid_value", 'expected "none", "auto", '
                             '"required" or {"type": "function", "function": {"name": ...}}')
        choice = fn.get("name")
        if choice not in names:
            raise ToolsError("tool_choice.function.name", "invalid_value",
                             f"{choice!r:.60} is not one of the tools ({', '.join(names)})")
    elif choice not in CHOICES:
        raise ToolsError("tool_choice", "invalid_value", 'expected "none", "auto", "required" '
                         f'or {{"type": "function", "function": {{"name": ...}}}}, got '
                         f"{choice!r:.60}")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolsError("parallel_tool_calls", "invalid_type",
                         f"expected a boolean, got {type(parallel).__name__}")
    tools = Tools(functions, choice, parallel)
    if tools.forced:
        _compile(tools.call_schema(), max_bytes, "tools")
    return tools


def supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools: a probe tool given to it appears in
    the prompt (a template that ignores `tools` renders the same prompt without it)."""
    turn = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        probed = tokenizer.apply_chat_template(turn, tools=PROBE, tokenize=False,
                                               add_generation_prompt=True)
    except Exception:   # noqa: BLE001 - no template, or one that refuses tools: none
        return False
    return probed != plain and PROBE_NAME in probed


# --- answers ------------------------------------------------------------------------------------

def _call(name: str, arguments: dict) -> dict:
    """One call in OpenAI's message shape (arguments as a JSON string)."""
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_calls(text: str, tools: Tools) -> list[dict] | None:
    """The tool calls an answer is, in OpenAI's shape, or None when it is not one: one or more
    `<tool_call>` blocks (the last may lack its close: the answer ended there) or one bare call
    object, each naming one of the tools, with an object of arguments."""
    s = text.strip()
    bodies = []
    if s.startswith(CALL_OPEN):
        while s:
            if not s.startswith(CALL_OPEN):
                return None
            end = s.find(CALL_CLOSE)
            body_end = len(s) if end < 0 else end
            bodies.append(s[len(CALL_OPEN):body_end])
            s = "" if end < 0 else s[end + len(CALL_CLOSE):].lstrip()
    else:
        bodies.append(s)
    calls = []
    for body in bodies:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in tools.names:
            return None
        args = obj.get("arguments", obj.get("parameters"))
        if not isinstance(args, dict):
            return None
        calls.append(_call(obj["name"], args))
    return calls[:1] if not tools.parallel else calls


def could_be_call(text: str) -> bool:
    """Whether an answer that starts with `text` may still turn out to be a call."""
    s = text.lstrip()
    return not s or s.startswith("{") or s[:len(CALL_OPEN)] == CALL_OPEN[:len(s)]


async def hold_calls(pieces: AsyncIterator, tools: Tools, choice, piece_type) -> AsyncIterator:
    """A choice's pieces (api/app.py's Piece), with an answer that is a tool call returned as
    one last piece carrying `tool_calls` (and no text) instead of its text: text is held back
    while it may still be a call (under a forced choice, all of it) and released as soon as it
    cannot be. Sets `choice.finish` to "tool_calls" when the answer is a call. Closing this
    closes `pieces` (the request is cancelled on the dispatcher)."""
    held_text: list[str] = []
    held_entries: list = []
    offset = None
    holding = True
    try:
        async for piece in pieces:
            if not holding:
                yield piece
                continue
            held_text.append(piece.text)
            held_entries += piece.entries
            offset = piece.offset if offset is None else offset
            if tools.forced or could_be_call("".join(held_text)):
                continue
            holding = False
            yield piece_type("".join(held_text), held_entries, offset)
        if not holding:
            return
        text = "".join(held_text)
        calls = parse_calls(text, tools) if choice.finish == "stop" else None
        if calls:
            choice.finish = "tool_calls"
            yield piece_type("", held_entries, offset or 0, calls)
        elif text or held_entries:
            yield piece_type(text, held_entries, offset or 0)
    finally:
        await pieces.aclose()


def message(text: str, calls: list[dict] | None) -> dict:
    """A chat answer's message: the text, or the tool calls (content null)."""
    if calls:
        return {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
    return {"role": "assistant", "content": text, "refusal": None}


def deltas(calls: list[dict]) -> list[dict]:
    """Tool calls as one streamed delta (each whole, with its index)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]
