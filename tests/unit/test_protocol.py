"""Wire protocol: every message round-trips, any msgpack client can read it, and anything
malformed is refused with a stable code (never an exception of another kind)."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import protocol as p

LIMITS = p.Limits(max_frame_bytes=1 << 20, max_tokens=64)


def sample_messages():
    ref = p.TensorRef(dtype="float16", shape=[2, 3], frame=0)
    buf = np.arange(6, dtype=np.float16).tobytes()
    return [
        (p.Ping(t=1.5), []),
        (p.Error(code=p.BUSY, message="full"), []),
        (p.GenerateRequest(sid="s", rid=3, prompt="hi", mode="spec", max_tokens=8,
                           sampling=p.Sampling(temperature=0.7, top_k=5, seed=1)), []),
        (p.TokenEvent(rid=3, index=4, token_ids=[1, 2], text="ab"), []),
        (p.Done(rid=3, finish_reason="length", stats={"tpt_s": 0.1}), []),
        (p.CloudGenerate(sid="s", token_ids=[1, 2, 3], max_tokens=4), []),
        (p.DraftBatch(sid="s", round=2, start=10, token_ids=[5, 6], probs=[0.9, 0.8]), []),
        (p.VerifyRequest(sid="s", round=2, end=12), []),
        (p.VerifyResult(sid="s", round=2, start=10, accepted=1, token=7), []),
        (p.DraftRollback(sid="s", keep=11, append=[7]), []),
        (p.Hidden(sid="s", cut=3, start=0, hidden=ref), [buf]),
        (p.SuffixStep(sid="s", start=4, hidden=ref), [buf]),
        (p.SuffixToken(sid="s", position=5, token=9), []),
    ]


@pytest.mark.parametrize("msg,bufs", sample_messages(), ids=lambda m: type(m).__name__)
def test_roundtrip_and_msgpack_python_reads_it(msg, bufs):
    frames = p.encode(msg, bufs)
    assert p.decode([bytes(f) for f in frames], LIMITS) == msg
    raw = msgpack.unpackb(frames[0], raw=False)     # an independent decoder
    assert raw["v"] == p.VERSION and raw["type"] == msg.__struct_config__.tag
    assert raw["sid"] == msg.sid and raw["rid"] == msg.rid


def test_message_written_by_msgpack_python_decodes():
    header = msgpack.packb({"v": 1, "type": "verify", "sid": "x", "seq": 2, "rid": 9,
                            "round": 1, "end": 40})
    msg = p.decode([header], LIMITS)
    assert isinstance(msg, p.VerifyRequest) and msg.end == 40 and msg.rid == 9


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_tensor_roundtrip(dtype):
    x = torch.randn(3, 576).to(getattr(torch, dtype))
    ref, buf = p.tensor_frame(x, 0)
    frames = p.encode(p.Hidden(sid="s", cut=2, start=0, hidden=ref), [buf])
    msg = p.decode([bytes(f) for f in frames], LIMITS)
    y = p.tensor_torch(msg.hidden, [bytes(f) for f in frames])
    assert y.dtype == x.dtype and torch.equal(y, x)
    assert np.array_equal(p.tensor_numpy(msg.hidden, [bytes(f) for f in frames]),
                          x.float().numpy())


def _code(frames):
    with pytest.raises(p.ProtocolError) as e:
        p.decode(frames, LIMITS)
    assert e.value.code in p.ERROR_CODES
    return e.value.code


def test_malformed_messages_get_specific_codes():
    assert _code([]) == p.BAD_FRAME
    assert _code([b"\xc1garbage"]) == p.BAD_FRAME
    assert _code([msgpack.packb([1, 2, 3])]) == p.BAD_FRAME
    assert _code([msgpack.packb({"v": 1, "type": "nope"})]) == p.UNKNOWN_TYPE
    assert _code([msgpack.packb({"v": 7, "type": "ping"})]) == p.BAD_VERSION
    assert _code([msgpack.packb({"v": 1})]) == p.BAD_FIELD
    assert _code([msgpack.packb({"v": 1, "type": "draft", "n": "ten"})]) == p.BAD_FIELD
    assert _code([msgpack.packb({"v": 1, "type": "draft", "n": -3})]) == p.BAD_FIELD
    too_many = {"v": 1, "type": "cloud_generate", "token_ids": list(range(65)), "max_tokens": 1}
    assert _code([msgpack.packb(too_many)]) == p.TOO_LARGE
    assert _code([b"x"] * (LIMITS.max_frames + 1)) == p.TOO_LARGE
    big = {"v": 1, "type": "ping", "pad": "x" * (LIMITS.max_header_bytes + 1)}
    assert _code([msgpack.packb(big)]) == p.TOO_LARGE


def test_bad_tensors():
    def hidden(dtype="float16", shape=(2, 3), frame=0):
        return msgpack.packb({"v": 1, "type": "hidden", "cut": 1, "start": 0,
                              "hidden": {"dtype": dtype, "shape": list(shape), "frame": frame}})
    ok = np.zeros((2, 3), np.float16).tobytes()
    assert _code([hidden(), ok[:-1]]) == p.BAD_TENSOR           # truncated
    assert _code([hidden(), ok + b"\0\0"]) == p.BAD_TENSOR      # oversize for its shape
    assert _code([hidden(dtype="float64"), ok]) == p.BAD_TENSOR
    assert _code([hidden(shape=(2, -3)), ok]) == p.BAD_TENSOR
    assert _code([hidden(frame=1), ok]) == p.BAD_FRAME          # points past the frames
    assert _code([hidden()]) == p.BAD_FRAME                     # frame missing
    assert _code([hidden(), b"\0" * (LIMITS.max_frame_bytes + 1)]) == p.TOO_LARGE


def test_no_pickle_anywhere():
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    for path in [f for pkg in ("common", "services", "tandem", "stack") for f in (root / pkg).rglob("*.py")]:
        text = path.read_text()
        assert "import pickle" not in text and "pickle.loads" not in text, path


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=256), min_size=0, max_size=10))
def test_random_frames_never_crash(frames):
    try:
        p.decode(frames, LIMITS)
    except p.ProtocolError as e:
        assert e.code in p.ERROR_CODES


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                         children, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(p.TYPE_NAMES)),
       st.dictionaries(st.sampled_from(["sid", "seq", "rid", "token_ids", "round", "end", "n",
                                        "index", "cut", "start", "hidden", "probs", "max_tokens",
                                        "sampling", "code", "message", "keep", "append"]),
                       _values, max_size=6))
def test_structured_garbage_never_crashes(tag, fields):
    header = msgpack.packb({"v": 1, "type": tag, **fields})
    try:
        msg = p.decode([header], LIMITS)
    except p.ProtocolError as e:
        assert e.code in p.ERROR_CODES
    else:
        assert isinstance(msg, p.Msg)
        msgspec.msgpack.encode(msg)   # anything accepted can be re-encoded


def test_logprobs_travel_typed_one_per_token():
    lp = p.TokenLogprob(-0.25, [7, 3], [-0.25, -1.5])
    for msg in (p.TokenEvent(index=0, token_ids=[7, 9], logprobs=[lp, lp]),
                p.VerifyResult(round=2, start=5, accepted=1, token=9, logprobs=[lp, lp]),
                p.SuffixToken(position=3, token=7, logprob=lp)):
        got = p.decode(p.encode(msg), LIMITS)
        assert got == msg
    raw = msgpack.unpackb(p.encode(p.CloudTokens(index=0, token_ids=[7], logprobs=[lp]))[0])
    assert raw["logprobs"] == [{"logprob": -0.25, "top_ids": [7, 3], "top_logprobs": [-0.25, -1.5]}]
    bad = [p.TokenEvent(index=0, token_ids=[7, 9], logprobs=[lp]),            # a token without
           p.VerifyResult(round=2, start=5, accepted=0, token=9, logprobs=[lp, lp]),
           p.SuffixToken(position=3, token=7, logprob=p.TokenLogprob(-1.0, [1, 2], [-1.0])),
           p.CloudTokens(index=0, token_ids=[7], logprobs=[p.TokenLogprob(0.5)]),   # > 0
           p.GenerateRequest(prompt="a", logprobs=21)]                           # over 20
    for msg in bad:
        with pytest.raises(p.ProtocolError) as e:
            p.decode(p.encode(msg), LIMITS)
        assert e.value.code == p.BAD_FIELD and e.value.field.startswith("logprob"), e.value
