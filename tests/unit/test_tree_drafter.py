"""Token trees on the drafter: the engine's tree rounds on llama.cpp's
multi-sequence KV, and the service's tree requests, their stream and their errors (in-process)."""

from __future__ import annotations

import asyncio

import llama_cpp as L
import numpy as np
import pytest

from common import models, protocol
from common.protocol import Sampling
from common.tree_shape import ROOT, Shape
from services.drafter.engine import DraftError, DraftModel
from tests.conftest import PROMPTS, error_code


@pytest.fixture(scope="module")
def model(model_paths):
    m = DraftModel(str(models.resolve_drafter("bundled")), threads=1)
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode(PROMPTS["code"])


def wide(**kw):
    """A shape that pays for many nodes (a slow link)."""
    return Shape(**{**dict(max_nodes=16, max_depth=5, max_width=3, token_value_s=1.0,
                           node_cost_s=[0.01], depth_cost_s=0.01), **kw})


def tree_round(sess, shape):
    steps = [sess.tree_begin(shape)]
    while not steps[-1].done:
        steps.append(sess.tree_step())
    return steps


def flat(steps):
    tokens, parents, probs = [], [], []
    for d in steps:
        assert d.first_node == len(tokens)
        tokens += d.tokens
        parents += d.parents
        probs += d.probs
    return tokens, parents, probs


def chain(model, prompt, n, s=Sampling()):
    sess = model.session(prompt, 256, s)
    sess.prefill()
    out = [sess.step() for _ in range(n)]
    sess.close()
    return out


def seq_max(sess, seq):
    return L.llama_memory_seq_pos_max(sess.mem, seq)


def test_greedy_tree_children_are_the_top_of_q_and_the_main_path_is_the_chain(model, prompt):
    sess = model.session(prompt, 256, Sampling(), tree_nodes=16)
    sess.prefill()
    steps = tree_round(sess, wide())
    tokens, parents, probs = flat(steps)
    assert len(tokens) > 5 and len(steps) >= 3 and steps[-1].done
    assert parents.count(ROOT) == 3
    for p in set(parents):           # siblings distinct, by q descending
        kids = [i for i, q in enumerate(parents) if q == p]
        assert len({tokens[i] for i in kids}) == len(kids)
        assert [probs[i] for i in kids] == sorted((probs[i] for i in kids), reverse=True)
    # each step timed one batched decode: the root's one row, then every node of the last depth
    assert steps[0].rows == 1
    assert all(d.rows == len(prev.tokens) or (d.rows == 0 and not d.tokens)
               for prev, d in zip(steps, steps[1:]))
    ref = chain(model, prompt, 1)[0]
    assert tokens[0] == ref.token and probs[0] == pytest.approx(ref.prob, abs=1e-6)
    main = sess.tree.main_path()
    assert sess.tokens == prompt + [tokens[i] for i in main]
    assert seq_max(sess, 0) == sess.n_past - 1 and sess.n_past <= len(sess.tokens)
    sess.close()


def test_rollback_to_a_side_path_keeps_exactly_that_path(model, prompt):
    sess = model.session(prompt, 256, Sampling(), tree_nodes=16)
    sess.prefill()
    tokens, parents, _ = flat(tree_round(sess, wide()))
    main = set(sess.tree.main_path())
    leaf = max((i for i in range(len(tokens)) if i not in main),
               key=lambda i: (sum(1 for _ in _ancestors(parents, i)), -i))
    path = list(reversed([leaf, *_ancestors(parents, leaf)]))
    assert len(path) >= 2 and sess.seqs_used >= 1
    keep = len(prompt) + len(path)
    sess.rollback(keep, [], path)
    assert sess.tokens == prompt + [tokens[i] for i in path]
    assert sess.seqs_used == 0 and all(seq_max(sess, s) == -1 for s in range(1, 17))
    assert seq_max(sess, 0) == sess.n_past - 1 and sess.n_past <= keep
    # sequence 0 now holds exactly the path: drafting goes on as from a fresh context
    after = [sess.step().token for _ in range(4)]
    assert after == [d.token for d in chain(model, sess.tokens[:keep], 4)]
    # and a rollback on the main path after a round keeps its cells
    steps = tree_round(sess, wide(max_width=2))
    t2, _, _ = flat(steps)
    start = steps[0].start
    main2 = sess.tree.main_path()
    sess.rollback(start + 1, [t2[main2[0]] ^ 1], main2[:1])
    assert sess.tokens[start:] == [t2[main2[0]], t2[main2[0]] ^ 1]
    assert seq_max(sess, 0) == sess.n_past - 1
    sess.close()


def _ancestors(parents, i):
    while parents[i] != ROOT:
        i = parents[i]
        yield i


def test_sampled_trees_are_seeded_distinct_and_carry_q(model, prompt):
    s = Sampling(temperature=0.9, seed=11)

    def draw():
        sess = model.session(prompt, 256, s, q_width=16, tree_nodes=16)
        sess.prefill()
        steps = tree_round(sess, wide(token_value_s=5.0))
        sess.close()
        return steps
    a, b = draw(), draw()
    assert flat(a) == flat(b)                         # reproducible with the seed
    tokens, parents, probs = flat(a)
    assert len(tokens) > 3
    for p in set(parents):
        kids = [i for i, q in enumerate(parents) if q == p]
        assert len({tokens[i] for i in kids}) == len(kids)   # without replacement
    k = 0
    for d in a:
        for j in range(len(d.tokens)):
            ids, q = d.q_ids[j], d.q_probs[j]
            assert d.tokens[j] in ids and abs(float(q.sum()) - 1) < 1e-5
            assert probs[k] == pytest.approx(float(q[list(ids).index(d.tokens[j])]))
            k += 1
    # siblings share their parent's q row
    roots = [i for i, p in enumerate(parents) if p == ROOT]
    assert all(np.array_equal(a[0].q_ids[i], a[0].q_ids[0]) for i in roots)
    # the rank-0 root child is the chain's own seeded draw at that position
    assert tokens[0] == chain(model, prompt, 1, s)[0].token
    c = Sampling(temperature=0.9, seed=12)
    sess = model.session(prompt, 256, c, q_width=16, tree_nodes=16)
    sess.prefill()
    assert flat(tree_round(sess, wide(token_value_s=5.0))) != flat(a)   # another seed
    sess.close()


def test_engine_refuses_bad_trees(model, prompt):
    sess = model.session(prompt, 256, Sampling())
    sess.prefill()
    with pytest.raises(DraftError, match="without tree_nodes"):
        sess.tree_begin(wide())
    sess.close()
    sess = model.session(prompt, 256, Sampling(), tree_nodes=4)
    sess.prefill()
    with pytest.raises(DraftError, match="tree_nodes"):
        sess.tree_begin(wide(max_nodes=5))
    tokens, parents, _ = flat(tree_round(sess, wide(max_nodes=4)))
    bad = [i for i, p in enumerate(parents) if p != ROOT][:1] or [len(tokens)]
    with pytest.raises(DraftError, match="path"):
        sess.rollback(len(prompt) + 1, [], bad)        # not a root child / not a node
    sess.close()


# --- the service, in-process ------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter():
    from stack.inprocess import InProcessStack

    async def start():
        st = InProcessStack(threads=1)
        await st.start("drafter")
        return st
    loop = asyncio.new_event_loop()
    st = loop.run_until_complete(start())
    yield loop, st
    loop.run_until_complete(st.stop())
    loop.close()


def with_peer(drafter, fn):
    from common.runtime import Peer
    loop, st = drafter

    async def go():
        peer = Peer(st.ctx, st.endpoint("drafter"), "drafter", "test")
        try:
            assert await peer.wait_up(30)
            return await fn(peer)
        finally:
            peer.close()
    return loop.run_until_complete(go())


def req(**kw):
    return protocol.TreeRequest(**{**dict(max_nodes=8, max_depth=4, max_width=2,
                                          token_value_s=1.0, node_cost_s=[0.01],
                                          depth_cost_s=0.01), **kw})


def test_service_streams_a_tree_round_then_its_chain(drafter, prompt):
    P = len(prompt)

    async def fn(peer):
        ch = peer.channel()
        await ch.send(protocol.DraftOpen(sid="t1", seq=1, token_ids=prompt, max_tokens=64,
                                         tree_nodes=8))
        msg, _ = await ch.recv(30)
        assert isinstance(msg, protocol.Ack)
        await ch.send(protocol.DraftRequest(sid="t1", tree=req(), until=P + 8))
        nodes, msgs = 0, []
        while True:
            msg, _ = await ch.recv(30)
            assert isinstance(msg, protocol.DraftTokens) and msg.parents is not None
            assert msg.start == P and msg.first_node == nodes and msg.seq == 0
            nodes += len(msg.token_ids)
            msgs.append(msg)
            if msg.tree_done:
                break
        assert 2 < nodes <= 8 and msgs[0].parents == [-1, -1]
        # each message times one batched decode: the root's row, then the last depth's nodes
        assert msgs[0].rows == 1
        assert all(m.rows in (0, len(prev.token_ids)) for prev, m in zip(msgs, msgs[1:]))
        assert any(m.rows == len(prev.token_ids) >= 2 for prev, m in zip(msgs, msgs[1:]))
        main_len = 1
        parents = [p for m in msgs for p in m.parents]
        i = 0
        while True:
            kids = [j for j, p in enumerate(parents) if p == i]
            if not kids:
                break
            i, main_len = kids[0], main_len + 1
        # then a chain on the main path, up to `until`
        msg, _ = await ch.recv(30)
        assert msg.parents is None and msg.start == P + main_len
        # roll back to the second root child and ask another tree
        await ch.send(protocol.DraftRollback(sid="t1", seq=1, keep=P + 1, append=[5], path=[1]))
        await ch.send(protocol.DraftRequest(sid="t1", seq=1, tree=req(max_nodes=3)))
        while True:
            msg, _ = await ch.recv(30)
            if msg.seq == 1:
                break
        assert msg.start == P + 2 and msg.parents[0] == -1
        await peer.request(protocol.Close(sid="t1"), timeout=10)
    with_peer(drafter, fn)


def test_service_errors_for_bad_trees(drafter, prompt):
    async def fn(peer):
        def code(msg):
            return error_code(peer, msg)
        assert (await code(protocol.DraftOpen(sid="b0", token_ids=prompt, tree_nodes=200))) \
            == protocol.TOO_LARGE
        ch = peer.channel()
        await ch.send(protocol.DraftOpen(sid="b1", seq=1, token_ids=prompt))
        await ch.send(protocol.DraftOpen(sid="b2", seq=1, token_ids=prompt, tree_nodes=4))
        assert isinstance((await ch.recv(30))[0], protocol.Ack)
        assert isinstance((await ch.recv(30))[0], protocol.Ack)
        assert (await code(protocol.DraftRequest(sid="b1", seq=2, tree=req()))) \
            == protocol.BAD_FIELD                  # a chain session
        assert (await code(protocol.DraftRequest(sid="b2", seq=2, tree=req()))) \
            == protocol.TOO_LARGE                  # 8 nodes > the session's 4
        assert (await code(protocol.DraftRollback(sid="b2", seq=3, keep=len(prompt) + 1,
                                                  path=[0]))) == protocol.BAD_FIELD
        # the session survives its bad requests
        ch2 = peer.channel()
        await ch2.send(protocol.DraftRequest(sid="b2", seq=3, tree=req(max_nodes=4)))
        msg, _ = await ch2.recv(30)
        assert isinstance(msg, protocol.DraftTokens) and msg.parents
        for sid in ("b1", "b2"):
            await peer.request(protocol.Close(sid=sid), timeout=10)
    with_peer(drafter, fn)
