"""Well-formed messages with poisoned values, derived from the protocol types themselves.

The structural fuzzers vary shapes; these keep every field valid but one, and set that one to a
value that is the right type yet meaningless: NaN, ±inf, -0.0, a negative or huge integer, an
empty or enormous list. The rules live in the types (msgspec constraints, common/protocol.py),
so the cases are read from them with msgspec.inspect: a new constrained field is covered without
touching this file.
"""

from __future__ import annotations

import msgspec
import msgspec.inspect as mi
import numpy as np
from hypothesis import strategies as st

from common import protocol

NAN, INF = float("nan"), float("inf")

# A valid value for each field name (constraints of that field permitting); what is not here
# takes the smallest value its constraints allow.
EXAMPLE = {"sid": "sem-1", "prompt": "Hello", "mode": "cloud-only", "token_ids": [1, 2, 3],
           "append": [4], "probs": [0.5], "max_tokens": 4, "code": "busy", "message": "m",
           "finish_reason": "length", "dtype": "float32", "service": "x", "top_k": 1,
           "nav_thresholds": [0.5, 0.5], "temperature": 0.7, "top_p": 0.9, "cut": 1}


def _unwrap(t):
    """Optional[X] -> X (the non-None member), else t."""
    if isinstance(t, mi.UnionType):
        rest = [m for m in t.types if not isinstance(m, mi.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return t


def _valid(name: str, t):
    t = _unwrap(t)
    if name in EXAMPLE and not isinstance(t, mi.StructType):
        return EXAMPLE[name]
    if isinstance(t, (mi.IntType, mi.FloatType)):
        lo = t.ge if t.ge is not None else (t.gt + (1 if isinstance(t, mi.IntType) else 0.5)
                                            if t.gt is not None else 0)
        return lo
    if isinstance(t, mi.ListType):
        return [_valid(name, t.item_type)] * (t.min_length or 1)
    if isinstance(t, mi.StructType):
        return {f.encode_name: _valid(f.name, f.type) for f in t.fields}
    if isinstance(t, mi.BoolType):
        return False
    if isinstance(t, mi.StrType):
        return "x"
    if isinstance(t, mi.DictType):
        return {}
    if isinstance(t, mi.LiteralType):
        return t.values[0]
    return None


def valid_header(msg_type) -> tuple[dict, list[bytes]]:
    """A header every rule accepts, with its buffer frames (a tensor ref gets a matching one)."""
    info = mi.type_info(msg_type)
    head = {"v": protocol.VERSION, "type": info.tag}
    buffers: list[bytes] = []
    for f in info.fields:
        if f.name == "v":
            continue
        t = _unwrap(f.type)
        if isinstance(t, mi.StructType) and t.cls is protocol.TensorRef:
            if not f.required:
                continue   # optional tensors (sparse q) stay out
            head[f.name] = {"dtype": "float32", "shape": [1, 4], "frame": len(buffers)}
            buffers.append(np.zeros(4, np.float32).tobytes())
        elif f.required or f.name in EXAMPLE or isinstance(t, mi.StructType):
            head[f.name] = _valid(f.name, f.type)
    return head, buffers


def _bad_numbers(t) -> list:
    """Values of the right Python type that break `t`'s constraints."""
    t = _unwrap(t)
    if isinstance(t, mi.FloatType):
        bad = [NAN, INF, -INF]
        if t.ge is not None:
            bad += [t.ge - 1e-3 if t.ge != 0 else -0.5]
        if t.gt is not None:
            bad += [t.gt]
        if t.le is not None:
            bad += [t.le * 2 + 1]
        return bad
    if isinstance(t, mi.IntType):
        bad = []
        if t.ge is not None:
            bad += [t.ge - 1]
        if t.le is not None:
            bad += [t.le + 1]
        return [v for v in bad if -2**63 <= v <= 2**64 - 1]   # msgpack cannot carry the rest
    return []


def poison_cases(msg_type) -> list[tuple[str, object]]:
    """(dotted path, value) for every constrained number in the type, nested structs and list
    items included ("probs[0]")."""
    out: list[tuple[str, object]] = []

    def walk(prefix: str, t) -> None:
        t = _unwrap(t)
        if isinstance(t, mi.StructType):
            for f in t.fields:
                if f.name != "v":
                    walk(f"{prefix}{f.encode_name}", f.type) if not prefix else \
                        walk(f"{prefix}.{f.encode_name}", f.type)
        elif isinstance(t, mi.ListType):
            if t.min_length is not None and t.min_length > 0:
                out.append((prefix, []))
            if t.max_length is not None:
                out.append((prefix, [_valid("", t.item_type)] * (t.max_length + 1)))
            for v in _bad_numbers(t.item_type):
                out.append((f"{prefix}[0]", v))
        else:
            for v in _bad_numbers(t):
                out.append((prefix, v))

    walk("", mi.type_info(msg_type))
    return out


def set_path(head: dict, path: str, value) -> dict:
    """A copy of `head` with `path` (a.b, a[0]) set to `value`; missing parents are created."""
    head = msgspec.msgpack.decode(msgspec.msgpack.encode(head))   # deep copy
    node = head
    parts = path.replace("[", ".[").split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part.startswith("["):
            idx = int(part[1:-1])
            while len(node) <= idx:
                node.append(0)
            if last:
                node[idx] = value
            else:
                node = node[idx]
        else:
            if last:
                node[part] = value
            else:
                nxt = parts[i + 1]
                if part not in node or node[part] is None:
                    node[part] = [] if nxt.startswith("[") else {}
                node = node[part]
    return head


ALL_CASES = [(t, path, value) for t in protocol.MESSAGE_TYPES for path, value in poison_cases(t)]


@st.composite
def poisoned_message(draw, types=protocol.MESSAGE_TYPES) -> tuple[list[bytes], dict]:
    """A valid header of one of `types` with one number poisoned (or, a third of the time, a
    semantically odd but valid value: -0.0, a huge token id, an unknown or empty session)."""
    kind = draw(st.sampled_from(types))
    head, buffers = valid_header(kind)
    cases = poison_cases(kind)
    if cases and draw(st.integers(0, 2)):
        path, value = draw(st.sampled_from(cases))
        head = set_path(head, path, value)
    else:
        odd = {"sid": draw(st.sampled_from(["", "never-opened", "sem-1"])),
               "seq": draw(st.sampled_from([0, 1, protocol.INT64_MAX]))}
        for f in ("temperature",):
            if "sampling" in head:
                head["sampling"][f] = draw(st.sampled_from([-0.0, 0.0, 1e-300, 99.9]))
        if "token_ids" in head:
            odd["token_ids"] = draw(st.sampled_from([[], [protocol.MAX_ID], [0] * 300,
                                                     [49151, 49152]]))
        head.update(odd)
    frames = [msgspec.msgpack.encode(head)] + buffers
    return frames, head
