"""Token trees on the wire: DraftBatch.parents / first_node, VerifyRequest.nodes and
VerifyResult.path round-trip, and what a batch shows by itself about its tree is checked while
it is decoded (the round-level rules are the verifier's: tests/unit/test_verifier_tree.py)."""

from __future__ import annotations

import msgpack
import pytest

from common import protocol as p

LIMITS = p.Limits(max_tokens=64)


def _decode(header: dict):
    return p.decode([msgpack.packb({"v": 1, "sid": "s", **header})], LIMITS)


def _error(header: dict) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as e:
        _decode(header)
    return e.value


def test_tree_fields_roundtrip_and_default_to_a_chain():
    batch = p.DraftBatch(sid="s", round=3, start=10, token_ids=[5, 6, 7], probs=[0.5, 0.3, 0.9],
                         parents=[-1, -1, 0], first_node=0)
    got = p.decode(p.encode(batch), LIMITS)
    assert got == batch and got.parents == [-1, -1, 0] and got.first_node == 0
    chain = p.decode(p.encode(p.DraftBatch(sid="s", round=3, start=10, token_ids=[5])), LIMITS)
    assert chain.parents is None and chain.first_node == 0
    nav = p.decode(p.encode(p.VerifyRequest(sid="s", round=3, end=0, nodes=3)), LIMITS)
    assert nav.nodes == 3
    res = p.decode(p.encode(p.VerifyResult(sid="s", round=3, start=10, accepted=2, token=4,
                                           path=[0, 2])), LIMITS)
    assert res.path == [0, 2]
    # a later batch of the round names earlier nodes as parents
    later = _decode({"type": "draft_batch", "round": 3, "start": 10, "token_ids": [8, 9],
                     "parents": [2, 3], "first_node": 3})
    assert later.parents == [2, 3] and later.first_node == 3


@pytest.mark.parametrize("parents,first_node,why", [
    ([-1, -1], 0, "one parent per token"),           # length mismatch
    ([-1, 1, 0], 0, "a child before its parent"),    # parents[1] = 1 is itself
    ([-1, 0, 2], 0, "a child before its parent"),
    ([-1, 5, 0], 0, "parent out of range"),
    ([4, 5, 6], 4, "parents[0] must be an earlier node"),
    ([-2, 0, 1], 0, "below the root"),
])
def test_bad_parents_are_bad_field_naming_parents(parents, first_node, why):
    e = _error({"type": "draft_batch", "round": 1, "start": 4, "token_ids": [1, 2, 3],
                "parents": parents, "first_node": first_node})
    assert e.code == p.BAD_FIELD, why
    assert e.field.startswith("parents"), why   # the type rule names parents[i]


def test_tree_sizes_are_limited_like_tokens():
    n = LIMITS.max_tokens + 1
    e = _error({"type": "draft_batch", "round": 1, "start": 4, "token_ids": [1] * n,
                "parents": [-1] * n})
    assert e.code == p.TOO_LARGE
    e = _error({"type": "verify_result", "round": 1, "start": 4, "accepted": n, "token": 1,
                "path": list(range(n))})
    assert e.code == p.TOO_LARGE and e.field == "path"
    assert _error({"type": "verify", "round": 1, "end": 0, "nodes": -1}).code == p.BAD_FIELD
    assert _error({"type": "draft_batch", "round": 1, "start": 4, "token_ids": [1],
                   "parents": [-1], "first_node": -1}).code == p.BAD_FIELD


def test_draft_tokens_rows_roundtrip_and_bad_rows_name_the_field():
    """`rows` (the decode a tree depth's `seconds` timed) travels; negative, non-integer or more
    rows than a message may carry nodes (a depth is decoded from one message) are refused."""
    msg = p.DraftTokens(sid="s", start=4, token_ids=[1, 2], probs=[0.5, 0.4], seconds=0.02,
                        parents=[-1, -1], rows=1)
    assert p.decode(p.encode(msg), LIMITS).rows == 1
    base = {"type": "draft_tokens", "start": 4, "token_ids": [1], "probs": [0.5],
            "parents": [-1]}
    for bad, code in ((-1, p.BAD_FIELD), (1.5, p.BAD_FIELD), ("2", p.BAD_FIELD),
                      (LIMITS.max_tokens + 1, p.TOO_LARGE), (2**62, p.BAD_FIELD)):
        e = _error({**base, "rows": bad})
        assert e.code == code and e.field == "rows", (bad, e.code, e.field)
