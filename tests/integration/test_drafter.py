"""The drafter: llama.cpp engine (services/drafter/engine.py) and its streaming service.

The reference for greedy drafts and their probabilities is llama-cpp-python's high-level
`Llama` (its own batching and logits buffer), softmaxed here with numpy. Rollback must give
exactly the drafts of a session that never went past the rollback point.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from common import models, protocol
from stack.launcher import Cluster
from common.protocol import Sampling
from common.runtime import PeerError
from services.drafter.engine import DraftError, DraftModel
from tests.conftest import PROMPTS, error_code


@pytest.fixture(scope="module")
def drafter_path(model_paths):
    return str(models.resolve_drafter("bundled"))


@pytest.fixture(scope="module")
def model(drafter_path):
    m = DraftModel(drafter_path, threads=1)
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode(PROMPTS["plain"])


def drafts(model, prompt, n, s=Sampling(), **kw):
    sess = model.session(prompt, 512, s, **kw)
    sess.prefill()
    out = [sess.step() for _ in range(n)]
    return sess, out


def test_greedy_drafts_match_llama_high_level_api(model, drafter_path, prompt):
    """Same evaluation pattern (prompt minus its last token in one batch, then one token per
    decode), through llama-cpp-python's high-level Llama: identical tokens and probabilities."""
    import llama_cpp
    ref = llama_cpp.Llama(model_path=drafter_path, n_ctx=512, logits_all=True, verbose=False,
                          n_threads=1)
    ref.eval(prompt[:-1])
    next_in = prompt[-1]
    want = []
    for _ in range(12):
        ref.eval([next_in])
        logits = np.asarray(ref.scores[ref.n_tokens - 1], dtype=np.float64)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        next_in = int(np.argmax(logits))
        want.append((next_in, float(p[next_in])))
    _, got = drafts(model, prompt, 12)
    assert [d.token for d in got] == [t for t, _ in want]
    assert max(abs(d.prob - p) for d, (_, p) in zip(got, want)) < 1e-5
    assert [d.position for d in got] == list(range(len(prompt), len(prompt) + 12))
    assert all(d.seconds > 0 for d in got)


def test_rollback_gives_identical_subsequent_drafts(model, prompt):
    sess, first = drafts(model, prompt, 14)
    P = len(prompt)
    # keep 5 drafts, re-append the 6th: the KV cache is truncated and re-fed
    sess.rollback(P + 5, [first[5].token])
    again = [sess.step() for _ in range(8)]
    assert [(d.position, d.token, d.prob) for d in again] == \
           [(d.position, d.token, d.prob) for d in first[6:14]]
    # keep everything, append nothing: the last token's logits are recomputed
    sess.rollback(len(sess.tokens), [])
    more = sess.step()
    ref_sess, ref = drafts(model, prompt, 15)
    assert (more.position, more.token, more.prob) == (ref[14].position, ref[14].token, ref[14].prob)
    ref_sess.close()
    # roll back 12 drafts to another token: exactly the drafts of a session that drafted only
    # 2 tokens before that token was appended (nothing of the discarded drafts survives)
    other = (first[2].token + 1) % model.n_vocab
    sess.rollback(P + 2, [other])
    after = [sess.step() for _ in range(6)]
    fresh, two = drafts(model, prompt, 2)
    fresh.rollback(P + 2, [other])
    want = [fresh.step() for _ in range(6)]
    assert [(d.position, d.token, d.prob) for d in after] == \
           [(d.position, d.token, d.prob) for d in want]
    sess.close()
    fresh.close()


def test_sampling_gives_sparse_q_and_is_seeded(model, prompt):
    s = Sampling(temperature=0.9, top_k=12, seed=42)
    sess, a = drafts(model, prompt, 10, s, q_width=16)
    for d in a:
        assert d.q_ids.shape == (12,) and d.q_probs.shape == (12,)   # request top_k < width
        assert d.q_ids.dtype == np.int32 and len(set(d.q_ids.tolist())) == 12
        assert abs(float(d.q_probs.sum()) - 1) < 1e-5 and (d.q_probs >= 0).all()
        k = list(d.q_ids).index(d.token)
        assert d.prob == pytest.approx(float(d.q_probs[k])) and d.prob > 0
    _, b = drafts(model, prompt, 10, s, q_width=16)
    assert [d.token for d in a] == [d.token for d in b]
    _, c = drafts(model, prompt, 10, Sampling(temperature=0.9, top_k=12, seed=43), q_width=16)
    _, e = drafts(model, prompt, 10, Sampling(temperature=0.9, top_k=12, seed=44), q_width=16)
    assert len({tuple(d.token for d in x) for x in (a, c, e)}) > 1
    _, tp = drafts(model, prompt, 5, Sampling(temperature=1.0, top_p=0.5, seed=1), q_width=16)
    for d in tp:   # top-p zeroes the tail (after the mass reaches 0.5) but keeps the row width
        q = d.q_probs
        nz = int((q > 0).sum())
        assert q.shape == (16,) and (q[nz:] == 0).all() and abs(float(q.sum()) - 1) < 1e-5
    sess.close()


def test_engine_errors(model, prompt):
    with pytest.raises(DraftError):
        model.session([model.n_vocab + 5], 64, Sampling())
    with pytest.raises(DraftError):
        model.session(list(range(100)), 64, Sampling())     # prompt longer than the context
    sess = model.session(prompt, len(prompt) + 3, Sampling())
    sess.prefill()
    for _ in range(3):
        sess.step()
    with pytest.raises(DraftError, match="context full"):
        sess.step()
    with pytest.raises(DraftError):
        sess.rollback(0, [])
    with pytest.raises(DraftError):
        sess.rollback(len(sess.tokens) + 1, [])
    sess.close()


def test_a_reused_context_drafts_what_a_fresh_one_does(model, drafter_path, prompt):
    """Contexts go back to a pool at close with their prompt's KV (DraftModel.take/give_back).
    A session on a reused context must draft exactly what one on a new context (the module's
    `model`, no pool) drafts: the same tokens, probabilities and q rows, bit for bit, whether it
    keeps the whole prompt's KV, whole chunks of it, or none."""
    pooled = DraftModel(drafter_path, threads=1, pool=2)
    s = Sampling(temperature=0.8, seed=11)

    def run(m, p, n_batch=256, rollback_to=None):
        sess = m.session(p, 512, s, q_width=16, n_batch=n_batch)
        reused = sess.reused
        sess.prefill()
        out = [sess.step() for _ in range(4)]
        if rollback_to is not None:
            sess.rollback(rollback_to, [])
            out += [sess.step() for _ in range(4)]
        sess.close()
        return reused, [(d.position, d.token, d.prob, d.q_ids.tobytes(), d.q_probs.tobytes())
                        for d in out]

    other = [t + 1 for t in prompt[-2:]]
    cases = [  # (prompt, n_batch, rollback keep, prompt tokens the pooled session must reuse)
        (prompt, 256, None, 0),                         # an empty pool: a new context
        (prompt, 256, None, len(prompt) - 1),           # the same prompt: all of its KV
        # the same but for its last two tokens: a fresh session evaluates this prompt in one
        # chunk, and llama.cpp promises no batch of another size rounds alike (a prompt fed 1-2
        # tokens a batch drafts other probabilities): only whole chunks are kept, here none
        (prompt[:-2] + other, 256, None, 0),
        (prompt[:-2] + other, 4, None, 0),              # another context size: no reuse
        (prompt, 4, None, (len(prompt) - 3) // 4 * 4),  # whole 4-token chunks in common
        (prompt, 4, 3, len(prompt) - 1),                # ... then a rollback into the prompt
        (prompt, 4, None, 0),                           # ... whose KV is not kept at close
        (prompt, 256, len(prompt) - 1, 0),              # a rollback into the last prompt token
        (prompt[:-1], 256, None, 0),                    # ... keeps no part of the prompt either
    ]
    try:
        for i, (p, n_batch, keep, want_reused) in enumerate(cases):
            reused, got = run(pooled, p, n_batch, keep)
            _, want = run(model, p, n_batch, keep)
            assert reused == want_reused, f"case {i}: reused {reused}, expected {want_reused}"
            assert got == want, f"case {i}: a reused context drafted differently"
        assert len(pooled.idle) == 2   # the pool holds no more than it may
    finally:
        pooled.close()


def test_a_conversations_next_turn_keeps_the_last_turns_cells(model, drafter_path, tokenizer,
                                                              prompt):
    """A session whose drafts cannot change the output (greedy here) keeps every cell it shares
    with a closed session — the last turn's prompt and answer — even from a smaller context or
    one of another batch size (its cells are copied into a context of the turn's own size). Its
    drafts are a fresh context's tokens; their probabilities move (llama.cpp computes a token's
    cells otherwise in a batch of another length: by up to 0.07 here), which changes only how
    many drafts the target accepts, never its output. A seeded rejection-sampled session, whose
    draws follow its drafts, keeps only cells a fresh evaluation would give bit for bit: none of
    a conversation's rows here."""
    pooled = DraftModel(drafter_path, threads=1, pool=2)
    try:
        turn1 = pooled.session(prompt, 192, Sampling())   # a 192-token batch, then 256
        turn1.prefill()
        for _ in range(6):
            turn1.step()
        answer = turn1.tokens[len(prompt):len(prompt) + 4]
        turn1.rollback(len(prompt) + 4, [])       # four drafts committed, the rest rejected
        turn1.step()
        turn1.close()
        turn2_prompt = prompt + answer + tokenizer.encode(" Tell me more about it.")
        shared = len(prompt) + 4

        turn2 = pooled.session(turn2_prompt, 512, Sampling())
        assert turn2.reused == shared and turn2.context.key[:2] == (512, 256)
        turn2.prefill()
        got = [turn2.step() for _ in range(6)]
        turn2.close()
        _, want = drafts(model, turn2_prompt, 6)
        assert [d.token for d in got] == [d.token for d in want]
        np.testing.assert_allclose([d.prob for d in got], [d.prob for d in want], atol=0.1)

        seeded = Sampling(temperature=0.8, seed=3)
        s = pooled.session(turn2_prompt + [prompt[0]], 512, seeded)
        assert s.reused == 0, "a seeded session kept cells evaluated in another batching"
        s.close()

        idle = len(pooled.idle)   # a context of another size that shares nothing stays pooled
        other = pooled.session([t + 1 for t in prompt], 1024, Sampling())
        assert other.reused == 0 and len(pooled.idle) == idle
        other.close()
    finally:
        pooled.close()


# --- the service ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter_service(model_paths, tmp_path_factory):
    c = Cluster(services=("drafter",), ephemeral=True, logdir=tmp_path_factory.mktemp("drafter"),
                extra={"drafter": ["--threads", "1"]})
    c.start_all()
    try:
        c.wait_ready(timeout=120)
        yield c
    finally:
        c.stop_all()


def with_peer(cluster, fn):
    import zmq.asyncio

    from common.runtime import Peer

    async def go():
        ctx = zmq.asyncio.Context()
        peer = Peer(ctx, cluster.endpoint("drafter"), "drafter", "test")
        try:
            assert await peer.wait_up(30)
            return await fn(peer)
        finally:
            peer.close()
            ctx.term()
    return asyncio.run(go())


async def collect(ch, n, timeout=30.0):
    out = []
    while len(out) < n:
        msg, frames = await ch.recv(timeout)
        if isinstance(msg, protocol.DraftTokens):
            out.append((msg, frames))
    return out


def test_service_streams_pauses_and_rolls_back(drafter_service, model, prompt):
    P = len(prompt)
    _, want = drafts(model, prompt, 8)

    async def fn(peer):
        ch = peer.channel()
        await ch.send(protocol.DraftOpen(sid="s1", seq=1, token_ids=prompt, max_tokens=32))
        await ch.send(protocol.DraftRequest(sid="s1", until=P + 5))
        msg, _ = await ch.recv(30)
        assert isinstance(msg, protocol.Ack)
        got = await collect(ch, 5)
        assert [m.start for m, _ in got] == list(range(P, P + 5))
        assert [m.token_ids[0] for m, _ in got] == [d.token for d in want[:5]]
        assert all(m.seq == 0 and m.seconds > 0 and len(m.probs) == 1 for m, _ in got)
        with pytest.raises(PeerError):          # paused at `until`: nothing more comes
            await ch.recv(0.5)
        # roll back to 2 drafts + a different token, then draft 3 more in epoch 1
        other = (want[2].token + 7) % model.n_vocab
        await ch.send(protocol.DraftRollback(sid="s1", seq=1, keep=P + 2, append=[other],
                                             until=P + 6))
        await ch.send(protocol.DraftRollback(sid="s1", seq=1, keep=P + 2, append=[other],
                                             until=P + 6))     # a retry: no-op
        got = await collect(ch, 3)
        assert [(m.seq, m.start) for m, _ in got] == [(1, P + 3), (1, P + 4), (1, P + 5)]
        _, ref = drafts(model, prompt + [d.token for d in want[:2]] + [other], 3)
        assert [m.token_ids[0] for m, _ in got] == [d.token for d in ref]
        await ch.send(protocol.DraftRequest(sid="s1", seq=1, n=2))   # relative request
        got = await collect(ch, 2)
        assert [m.start for m, _ in got] == [P + 6, P + 7]
        reply, _ = await peer.request(protocol.Close(sid="s1"), timeout=10)
        assert isinstance(reply, protocol.Ack)
    with_peer(drafter_service, fn)


def test_service_sampling_sends_q_frames(drafter_service, prompt):
    async def fn(peer):
        ch = peer.channel()
        await ch.send(protocol.DraftOpen(sid="s2", seq=1, token_ids=prompt, top_k=8,
                                         sampling=Sampling(temperature=0.7, seed=3)))
        await ch.send(protocol.DraftRequest(sid="s2", until=len(prompt) + 3))
        for msg, frames in await collect(ch, 3):
            ids = protocol.tensor_numpy(msg.q_ids, frames)
            probs = protocol.tensor_numpy(msg.q_probs, frames)
            assert ids.shape == probs.shape == (1, 8) and abs(probs.sum() - 1) < 1e-5
            assert msg.token_ids[0] in ids[0]
        await peer.request(protocol.Close(sid="s2"), timeout=10)
    with_peer(drafter_service, fn)


def test_service_errors(drafter_service, prompt):
    async def fn(peer):
        def code(msg):
            return error_code(peer, msg)
        assert await code(protocol.DraftRequest(sid="nope", until=5)) == protocol.UNKNOWN_SESSION
        assert await code(protocol.DraftOpen(sid="bad", token_ids=[10**7])) == protocol.BAD_FIELD
        assert await code(protocol.DraftOpen(sid="bad", token_ids=[1], top_k=65)) == protocol.BAD_FIELD
        ch = peer.channel()
        await ch.send(protocol.DraftOpen(sid="s3", seq=1, token_ids=prompt))
        msg, _ = await ch.recv(30)
        assert isinstance(msg, protocol.Ack)
        assert await code(protocol.DraftOpen(sid="s3", seq=2, token_ids=prompt)) == protocol.SESSION_EXISTS
        assert await code(protocol.DraftRollback(sid="s3", seq=1, keep=10_000)) == protocol.BAD_FIELD
        assert await code(protocol.DraftRollback(sid="s3", seq=2, keep=1, append=[-1 % 2**31])) \
            == protocol.BAD_FIELD
        await peer.request(protocol.Close(sid="s3"), timeout=10)
    with_peer(drafter_service, fn)
