"""The value rules in the protocol types (common/protocol.py), each tested: every constrained
number of every message type, nested and in lists, refused with `bad_field` (or `bad_tensor`
inside a tensor reference) naming the field — NaN, ±inf, below and above its range, lists of
the wrong length — both when a peer sends it and when Python code builds it (`protocol.check`,
what the SDK runs before sending). Cases come from the types (tests/_semantic.py)."""

from __future__ import annotations

import math

import msgspec
import pytest

from common import protocol as p
from tests import _semantic as sem

LIMITS = p.Limits(max_tokens=64)


@pytest.mark.parametrize("kind", p.MESSAGE_TYPES, ids=lambda t: t.__struct_config__.tag)
def test_a_valid_message_of_every_type_decodes(kind):
    head, buffers = sem.valid_header(kind)
    msg = p.decode([msgspec.msgpack.encode(head)] + buffers, LIMITS)
    assert isinstance(msg, kind)


def test_every_constrained_field_has_cases():
    paths = {path for _, path, _ in sem.ALL_CASES}
    for want in ("sampling.temperature", "sampling.top_p", "sampling.top_k", "deadline_s",
                 "nav_thresholds", "nav_thresholds[0]", "probs[0]", "token_ids[0]", "t",
                 "seconds", "queued", "max_tokens", "cut", "token_id", "seq", "rid",
                 "hidden.shape[0]"):
        assert want in paths, want
    assert len(sem.ALL_CASES) > 150


@pytest.mark.parametrize("kind, path, value", sem.ALL_CASES,
                         ids=[f"{t.__struct_config__.tag}.{pa}={v!r}"[:80]
                              for t, pa, v in sem.ALL_CASES])
def test_poisoned_value_is_refused_naming_its_field(kind, path, value):
    head, buffers = sem.valid_header(kind)
    frames = [msgspec.msgpack.encode(sem.set_path(head, path, value))] + buffers
    with pytest.raises(p.ProtocolError) as e:
        p.decode(frames, LIMITS)
    want = p.BAD_TENSOR if path.split(".")[0] in p.TENSOR_FIELDS else p.BAD_FIELD
    assert e.value.code == want, e.value
    assert e.value.field == path, e.value
    assert e.value.message.startswith(path + ":"), e.value.message


@pytest.mark.parametrize("bad", [dict(temperature=math.nan), dict(temperature=math.inf),
                                 dict(temperature=-math.inf), dict(temperature=-1.0),
                                 dict(temperature=1e9), dict(top_p=math.nan), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1)])
def test_python_built_messages_are_checked_too(bad):
    """The SDK builds its request in Python, where msgspec does not check constraints: `check`
    applies the decoder's rules before anything is sent."""
    msg = p.GenerateRequest(prompt="Hi", sampling=p.Sampling(**bad))
    with pytest.raises(p.ProtocolError) as e:
        p.check(msg)
    assert e.value.code == p.BAD_FIELD
    assert e.value.field == f"sampling.{next(iter(bad))}"
    assert "finite" in e.value.message or "int" in e.value.message


def test_minus_zero_and_limits_are_accepted():
    for t in (-0.0, 0.0, p.MAX_TEMPERATURE):
        p.check(p.GenerateRequest(prompt="Hi", sampling=p.Sampling(temperature=t)))
    p.check(p.GenerateRequest(prompt="Hi", deadline_s=p.MAX_SECONDS, nav_thresholds=[1.0, 1.0]))
    with pytest.raises(p.ProtocolError, match="int"):
        p.check(p.GenerateRequest(prompt="Hi", sampling=p.Sampling(top_k=2**70)))


def test_model_dependent_rule_top_k_over_vocabulary():
    p.check_sampling(p.Sampling(top_k=100), 100)
    with pytest.raises(p.ProtocolError) as e:
        p.check_sampling(p.Sampling(top_k=101), 100)
    assert e.value.code == p.BAD_FIELD and e.value.field == "sampling.top_k"


def test_an_oversize_prompt_is_explained_in_the_users_terms():
    msg = p.GenerateRequest(prompt="x" * 100_000)
    with pytest.raises(p.ProtocolError) as e:
        p.decode(p.encode(msg), p.Limits())
    text = e.value.message
    assert e.value.code == p.TOO_LARGE and e.value.field == "header"
    for words in ("prompt", "kB", "max_prompt_tokens", "TANDEM_MAX_HEADER_BYTES", "context"):
        assert words in text, (words, text)
