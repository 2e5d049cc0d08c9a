"""common/constraint.py alone: compiling (errors name the field), the size limit, and a
matcher's mask, advance and rollback (past the constraint's end too) on the target's tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common import constraint, protocol
from common.protocol import Constraint, ProtocolError

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["id", "ok"]}


@pytest.fixture(scope="module")
def vocab(model_paths):
    return json.loads((model_paths.target / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def lltok(model_paths, vocab):
    return constraint.hf_tokenizer(str(model_paths.target), vocab)


@pytest.mark.parametrize("c,code", [
    (Constraint("json_schema", "{not json"), protocol.BAD_FIELD),
    (Constraint("json_schema", "[1, 2]"), protocol.BAD_FIELD),
    (Constraint("json_schema", json.dumps({"properties": {"a": {"$ref": "#/nowhere"}}})),
     protocol.BAD_FIELD),
    (Constraint("regex", "(unclosed"), protocol.BAD_FIELD),
    (Constraint("regex", ""), protocol.BAD_FIELD),
    (Constraint("json_object", "{}"), protocol.BAD_FIELD),
    (Constraint("regex", "a" * 101), protocol.TOO_LARGE)])
def test_a_bad_or_oversized_constraint_is_refused_naming_the_field(c, code):
    with pytest.raises(ProtocolError) as e:
        constraint.check(c, max_bytes=100)
    assert e.value.code == code and e.value.field == "constraint", e.value


def test_the_wire_refuses_a_constraint_over_the_limit():
    msg = protocol.CloudGenerate(sid="s", token_ids=[1], max_tokens=1,
                                 constraint=Constraint("regex", "a" * 200))
    frames = protocol.encode(msg)
    with pytest.raises(ProtocolError) as e:
        protocol.decode(frames, protocol.Limits(max_constraint_bytes=100))
    assert e.value.code == protocol.TOO_LARGE and e.value.field == "constraint"


def test_mask_advance_and_rollback_follow_the_output(tokenizer, lltok, vocab):
    m = constraint.Matcher(lltok, Constraint("json_schema", json.dumps(SCHEMA)), vocab)
    text = tokenizer.encode('{"id":7,"ok":true}')
    start = m.mask()
    assert start.dtype == bool and start.shape == (vocab,) and start[text[0]]
    assert not start[tokenizer.encode("hello")[0]]
    masks = []
    for t in text:
        masks.append(m.mask())
        assert masks[-1][t]
        m.advance([t])
    assert m.accepting()
    end = m.mask()
    assert end[tokenizer.eos_token_id] and end.sum() == 1   # complete: only EOS
    m.advance([tokenizer.eos_token_id])                       # past llguidance's stop
    m.rollback(3)
    assert np.array_equal(m.mask(), masks[-2])
    with pytest.raises(ProtocolError) as e:
        m.advance(tokenizer.encode("x"))
    assert e.value.code == protocol.CONSTRAINT
    assert np.array_equal(m.mask(), masks[-2])                # a refused token changes nothing
    took = m.advance_valid([text[-2], text[-1], tokenizer.eos_token_id, text[0]])
    assert took == 3 and m.consumed == len(text) + 1
    m.rollback(m.consumed)
    assert np.array_equal(m.mask(), start)


def test_masked_logits_are_minus_infinity_outside(lltok, vocab):
    import torch
    m = constraint.Matcher(lltok, Constraint("regex", "[0-9]+"), vocab)
    allowed = m.mask()
    row = constraint.apply(torch.zeros(vocab), allowed)
    assert torch.isinf(row[torch.from_numpy(~allowed)]).all()
    assert (row[torch.from_numpy(allowed)] == 0).all()
    assert np.isinf(constraint.apply(np.zeros(vocab, np.float32), allowed)[~allowed]).all()
