"""Chat messages -> prompt token ids through the target model's chat template.

One implementation for every place a conversation enters Tandem: the OpenAI gateway
(api/app.py, `POST /v1/chat/completions`) and the dispatcher (a GenerateRequest with `messages`,
as the SDK's `generate(messages=...)` sends, or `chat=True` with a single user prompt). So the
same conversation becomes the same token ids whichever way it came in.

Tool calling (the gateway, for a model whose chat template renders tools: api/tools.py) adds
`tool` messages (a tool's result, with the `tool_call_id` it answers) and assistant messages
carrying `tool_calls`; their `arguments` (a JSON string on OpenAI's wire) reach the template as
an object, as chat templates expect (transformers' tool-use convention).
"""

from __future__ import annotations

import json
from typing import Any

# Accepted roles -> the role the chat template sees ("developer" is OpenAI's newer "system").
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class MessageError(ValueError):
    """A message the template cannot take; `field` names it (e.g. "messages[2].role"), `code` is
    a stable reason: missing | invalid_type | invalid_value | too_many | unsupported."""

    def __init__(self, field: str, code: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.code, self.message = field, code, message


def _content_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise MessageError(f"messages[{i}].content", "unsupported",
                                   "only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise MessageError(f"messages[{i}].content", "invalid_type",
                       f"expected a string or a list of text parts, got "
                       f"{type(content).__name__} {content!r:.60}")


def _tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's `tool_calls`, checked, with each call's arguments as an object."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise MessageError(where, "invalid_type", f"expected a list of tool calls, got "
                           f"{type(calls).__name__}")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessageError(f"{where}[{k}]", "invalid_value",
                               'expected {"type": "function", "function": {"name", "arguments"}}')
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise MessageError(f"{where}[{k}].function.arguments", "invalid_value",
                                   "not valid JSON") from None
        if not isinstance(args, dict):
            raise MessageError(f"{where}[{k}].function.arguments", "invalid_value",
                               "expected a JSON object")
        one = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            one["id"] = call["id"]
        out.append(one)
    return out


def normalize(messages: Any, max_messages: int, tools: bool = False) -> list[dict]:
    """Check a conversation and return it as [{"role", "content"}] with the template's roles.
    Accepts dicts or objects with `role` / `content` attributes (the wire's ChatMessage).
    `tools`: the template renders tool calling, so `tool` messages and assistant `tool_calls`
    are accepted (otherwise they are refused as unsupported)."""
    if messages is None:
        raise MessageError("messages", "missing", "required")
    if not isinstance(messages, (list, tuple)):
        raise MessageError("messages", "invalid_type", f"expected a list of messages, got "
                           f"{type(messages).__name__}")
    if not messages:
        raise MessageError("messages", "invalid_value", "at least one message is required")
    if len(messages) > max_messages:
        raise MessageError("messages", "too_many", f"{len(messages)} messages is over the limit "
                           f"of {max_messages}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            if hasattr(m, "role") and hasattr(m, "content"):
                m = {"role": m.role, "content": m.content}
            else:
                raise MessageError(f"messages[{i}]", "invalid_type",
                                   f"expected an object, got {type(m).__name__} {m!r:.60}")
        role = m.get("role")
        if tools and role == "tool":
            turn = {"role": "tool", "content": _content_text(i, m.get("content"))}
            if isinstance(m.get("tool_call_id"), str):
                turn["tool_call_id"] = m["tool_call_id"]
            out.append(turn)
            continue
        if role not in ROLES:
            if role in ("tool", "function"):
                raise MessageError(f"messages[{i}].role", "unsupported",
                                   f"{role!r} messages (tool calling) are not supported")
            raise MessageError(f"messages[{i}].role", "invalid_value",
                               f"expected system, developer, user or assistant, got {role!r:.60}")
        calls = m.get("tool_calls")
        if calls and not (tools and role == "assistant"):
            raise MessageError(f"messages[{i}].tool_calls", "unsupported",
                               "tool calling is not supported" if not tools else
                               "only assistant messages carry tool calls")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        turn = {"role": ROLES[role], "content": _content_text(i, content)}
        if calls:
            turn["tool_calls"] = _tool_calls(i, calls)
        out.append(turn)
    return out


def render_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids: the conversation through the tokenizer's chat template, ending
    with the assistant's turn opened (add_generation_prompt); `tools` (OpenAI's shape) are
    rendered by the template where it describes them to the model."""
    extra = {} if tools is None else {"tools": tools}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False, **extra)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
