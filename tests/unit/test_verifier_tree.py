"""Tree rounds on the verifier, driven message by message: the real Verifier
object with the bundled SmolLM2 target, every message encoded, decoded and dispatched as the
service does (`_dispatch`), the engine stepped by hand. Trees are built from transformers' own
top-k, reordered and cut so that some nodes match and some do not; greedy output must equal
transformers' generate(do_sample=False). Bad trees get an Error with a stable code, and the
session goes on; a tree batched beside another session's chain changes neither; a streaming
session verifies trees at the NAV."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common import protocol as p
from common import tree
from stack.launcher import free_port
from services.verifier.config import VerifierConfig
from services.verifier.service import Verifier

PROMPTS = ["The history of the printing press begins", "def add(a, b):\n    return"]


class Driver:
    """One Verifier, no sockets: send() encodes + dispatches, pump() runs engine steps."""

    def __init__(self, runner, **cfg):
        self.v = Verifier(VerifierConfig(bind=f"tcp://127.0.0.1:{free_port()}", http_port=0, **cfg))
        self.v.runner, self.v.vocab_size, self.v.ready = runner, runner.vocab_size, True
        self.out: list = []
        self.steps: list[list[str]] = []

        async def send(ident, msg, buffers=()):
            self.out.append(msg)
            return True
        self.v.send = send

    def send(self, msg: p.Msg, buffers=()) -> list:
        n = len(self.out)
        asyncio.run(self.v._dispatch(b"client", p.encode(msg, buffers)))
        return self.out[n:]

    def pump(self) -> list:
        n = len(self.out)
        while step := self.v.plan_step():
            self.steps.append([s.sid for s, _ in step])
            for (s, work), logits in zip(step, self.v.run_step(step)):
                self.out += s.consume(work, logits)
        return self.out[n:]

    def close(self):
        self.v.ctx.term()


def errors(replies):
    return [r for r in replies if isinstance(r, p.Error)]


def results(replies):
    return [r for r in replies if isinstance(r, p.VerifyResult)]


@pytest.fixture(scope="module")
def runner(target_runner):
    return target_runner


def top(hf_model, ids, k):
    with torch.inference_mode():
        return torch.topk(hf_model(torch.tensor([ids])).logits[0, -1], k).indices.tolist()


def build_tree(hf_model, ids, rnd, depth=3):
    """A tree over the committed `ids` from transformers' top-3: two children per node down to
    `depth`; by round, the right child comes first or second, or is left out at some depth (so
    the walk stops there with the target's correction)."""
    tokens, parents = [], []
    frontier = [-1]
    for d in range(depth):
        nxt = []
        for node in frontier:
            path = [] if node < 0 else [tokens[j] for j in tree.root_path(parents, node)]
            t1, t2, t3 = top(hf_model, ids + path, 3)
            kids = {0: [t1, t2], 1: [t2, t1], 2: [t2, t3]}[(rnd + d) % 3 if d else rnd % 2]
            for t in kids:
                tokens.append(t)
                parents.append(node)
                nxt.append(len(tokens) - 1)
        frontier = nxt[:2]       # grow below the first two of each depth only
    return tokens, parents


def open_spec(d: Driver, sid: str, ids, **kw):
    assert not errors(d.send(p.SpecOpen(sid=sid, seq=1, token_ids=ids, **kw)))
    acks = d.pump()
    assert any(isinstance(a, p.Ack) for a in acks)


def tree_round(d: Driver, sid, rnd, start, tokens, parents, split=2, nav=True):
    """Send a tree round in two batches and its NAV; returns the replies."""
    out = d.send(p.DraftBatch(sid=sid, round=rnd, start=start, token_ids=tokens[:split],
                              parents=parents[:split]))
    out += d.send(p.DraftBatch(sid=sid, round=rnd, start=start, token_ids=tokens[split:],
                               parents=parents[split:], first_node=split))
    if nav:
        out += d.send(p.VerifyRequest(sid=sid, round=rnd, end=0, nodes=len(tokens)))
    return out


def commit(ids, res: p.VerifyResult, tokens, parents):
    assert res.accepted == len(res.path)
    if res.path:
        assert res.path == tree.root_path(parents, res.path[-1])
    return ids + [tokens[i] for i in res.path] + [res.token]


def test_greedy_tree_rounds_equal_generate(runner, hf_model, tokenizer, reference):
    ids = tokenizer.encode(PROMPTS[0])
    n = 20
    want = reference(ids, n)
    d = Driver(runner)
    try:
        open_spec(d, "a", ids)
        got, rnd, accepted, rejected_somewhere = list(ids), 0, [], False
        while len(got) - len(ids) < n:
            rnd += 1
            if rnd % 4 == 0:     # a chain round between tree rounds: both kinds share a session
                drafts = top(hf_model, got, 2)[1:] + [7]
                assert not errors(d.send(p.DraftBatch(sid="a", round=rnd, start=len(got),
                                                      token_ids=drafts)))
                d.send(p.VerifyRequest(sid="a", round=rnd, end=len(got) + len(drafts)))
                (res,) = results(d.pump())
                got += drafts[:res.accepted] + [res.token]
                continue
            tokens, parents = build_tree(hf_model, got, rnd)
            assert not errors(tree_round(d, "a", rnd, len(got), tokens, parents))
            (res,) = results(d.pump())
            assert res.start == len(got) and res.round == rnd
            got = commit(got, res, tokens, parents)
            accepted.append(res.accepted)
            rejected_somewhere |= res.path != tree.main_path(parents)[:res.accepted] or (
                res.accepted < len(tree.main_path(parents)))
            s = d.v.sessions["a"]
            assert s.kv.length() == len(got) - 1 == s.C - 1
        assert got[len(ids):len(ids) + n] == want
        # the trees really branched: some rounds took a non-main child, some stopped early
        assert max(accepted) >= 2 and rejected_somewhere
        assert any(res_path for res_path in [r.path for r in results(d.out)]
                   if res_path and res_path[0] != 0)
    finally:
        d.close()


def test_proactive_round_behind_a_tree(runner, hf_model, tokenizer, reference):
    """A proactive chain extending the tree's main path is kept when the whole main path is
    accepted and its guess is the bonus; otherwise it is discarded."""
    ids = tokenizer.encode(PROMPTS[1])
    want = reference(ids, 12)
    d = Driver(runner)
    try:
        open_spec(d, "a", ids)
        # main path = the reference's first 3 tokens, a wrong sibling at each depth
        tokens, parents = [], []
        for j in range(3):
            wrong = top(hf_model, ids + want[:j], 2)[1]
            tokens += [want[j], wrong]
            parents += [-1 if j == 0 else 2 * (j - 1)] * 2
        assert tree.main_path(parents) == [0, 2, 4]
        out = tree_round(d, "a", 1, len(ids), tokens, parents)
        # proactive round 2 arrives before the tree round's result: guess + 2 drafts
        out += d.send(p.DraftBatch(sid="a", round=2, start=len(ids) + 3, token_ids=want[3:6],
                                   parent=1))
        out += d.send(p.VerifyRequest(sid="a", round=2, end=len(ids) + 6))
        assert not errors(out)
        res = results(d.pump())
        assert [(r.round, r.accepted) for r in res] == [(1, 3), (2, 2)]
        assert res[0].path == [0, 2, 4] and res[0].token == want[3] and res[1].token == want[6]
        got = ids + want[:7]
        # a wrong guess: the proactive round is discarded, the tree's token stands
        tokens2, parents2 = build_tree(hf_model, got, 0)
        out = tree_round(d, "a", 3, len(got), tokens2, parents2)
        out += d.send(p.DraftBatch(sid="a", round=4, start=len(got) + 3, token_ids=[5, 6],
                                   parent=3))
        assert not errors(out)
        (r3,) = results(d.pump())
        assert 4 in d.v.sessions["a"].discarded
        got = commit(got, r3, tokens2, parents2)
        assert got[len(ids):] == reference(ids, len(got) - len(ids))
    finally:
        d.close()


def test_tree_batched_beside_a_chain_equals_one_by_one(runner, hf_model, tokenizer, reference):
    a_ids, b_ids = (tokenizer.encode(t) for t in PROMPTS)
    d = Driver(runner)
    try:
        open_spec(d, "a", a_ids)
        open_spec(d, "b", b_ids)
        tokens, parents = build_tree(hf_model, a_ids, 1)
        b_drafts = reference(b_ids, 3) + [11]
        out = tree_round(d, "a", 1, len(a_ids), tokens, parents)
        out += d.send(p.DraftBatch(sid="b", round=1, start=len(b_ids), token_ids=b_drafts))
        out += d.send(p.VerifyRequest(sid="b", round=1, end=len(b_ids) + 4))
        assert not errors(out)
        d.steps.clear()
        res = {r.sid: r for r in results(d.pump())}
        assert d.steps[0] == ["a", "b"] or d.steps[0] == ["b", "a"]   # one forward, both
        alone = Driver(runner)
        try:
            open_spec(alone, "a", a_ids)
            tree_round(alone, "a", 1, len(a_ids), tokens, parents)
            (solo,) = results(alone.pump())
        finally:
            alone.close()
        assert (res["a"].accepted, res["a"].token, res["a"].path) == (solo.accepted, solo.token,
                                                                      solo.path)
        assert (res["b"].accepted, res["b"].token) == (3, reference(b_ids, 4)[3])
        got = commit(a_ids, res["a"], tokens, parents)
        assert got[len(a_ids):] == reference(a_ids, len(got) - len(a_ids))
    finally:
        d.close()


def test_bad_trees_get_errors_and_the_session_goes_on(runner, hf_model, tokenizer, reference):
    ids = tokenizer.encode(PROMPTS[0])
    d = Driver(runner, max_tree_nodes=8, max_tree_depth=4)
    try:
        open_spec(d, "a", ids)
        start = len(ids)

        def bad(msg, code, field):
            (err,) = errors(d.send(msg))
            assert (err.code, err.field.split("[")[0]) == (code, field), err

        def batch(tokens, parents, first_node=0, rnd=1):
            return p.DraftBatch(sid="a", round=rnd, start=start, token_ids=tokens,
                                parents=parents, first_node=first_node)
        bad(batch([5, 6, 7], [-1, 2, 0]), p.BAD_FIELD, "parents")           # child before parent
        bad(batch([5, 6], [-1, 7]), p.BAD_FIELD, "parents")                 # parent out of range
        bad(batch([5, 6, 5], [-1, 0, -1]), p.BAD_FIELD, "parents")          # duplicate sibling
        bad(batch(list(range(9)), [-1] * 9), p.TOO_LARGE, "parents")        # too many nodes
        bad(batch([5, 6, 7, 8, 9], [-1, 0, 1, 2, 3]), p.TOO_LARGE, "parents")   # too deep
        bad(batch([5], [-1], first_node=1), p.BAD_FIELD, "first_node")       # no first batch
        bad(p.DraftBatch(sid="a", round=1, start=start, token_ids=[5], parents=[-1], parent=9),
            p.BAD_FIELD, "parents")                                           # a proactive tree
        assert not d.pump() and d.v.sessions["a"].tree is None   # nothing was taken
        # a good first batch, then a gap, a changed resend, a sibling repeated across batches
        tokens, parents = build_tree(hf_model, ids, 0, depth=2)   # 6 nodes
        assert not errors(d.send(batch(tokens[:2], parents[:2])))
        bad(batch(tokens[3:], parents[3:], first_node=3), p.BAD_FIELD, "first_node")
        bad(batch([tokens[0] + 1], [-1]), p.BAD_FIELD, "parents")
        bad(batch([tokens[0]], [-1], first_node=2), p.BAD_FIELD, "parents")
        bad(batch(tokens[2:] + [1, 2, 3], parents[2:] + [0, 0, 0], first_node=2), p.TOO_LARGE,
            "parents")
        bad(p.VerifyRequest(sid="a", round=1, end=0, nodes=5), p.BAD_FIELD, "nodes")
        assert not errors(d.send(batch(tokens, parents)))                  # a resend: ignored
        assert not errors(d.send(batch(tokens[2:], parents[2:], first_node=2)))
        assert not errors(d.send(p.VerifyRequest(sid="a", round=1, end=0, nodes=6)))
        (res,) = results(d.pump())
        again = d.send(p.VerifyRequest(sid="a", round=1, end=0, nodes=6))   # repeated NAV
        assert results(again) == [res]
        assert not errors(d.send(batch(tokens[:2], parents[:2])))          # late resend
        got = commit(ids, res, tokens, parents)
        tokens, parents = build_tree(hf_model, got, 2, depth=2)
        start = len(got)
        assert not errors(tree_round(d, "a", 2, start, tokens, parents))
        (res,) = results(d.pump())
        got = commit(got, res, tokens, parents)
        assert got[len(ids):] == reference(ids, len(got) - len(ids))
    finally:
        d.close()


def test_streaming_session_verifies_trees_at_the_nav(runner, hf_model, tokenizer, reference):
    """A `stream` session has fed the root's token before the tree arrives; its tree rounds are
    verified at the NAV from that row, with the same results as a non-streaming session's, and
    its chain rounds still stream."""
    ids = tokenizer.encode(PROMPTS[0])
    d = Driver(runner)
    try:
        for sid, stream in (("plain", False), ("stream", True)):
            open_spec(d, sid, ids, stream=stream)
        got = {"plain": list(ids), "stream": list(ids)}
        for rnd in (1, 2, 3):
            tokens, parents = build_tree(hf_model, got["plain"], rnd)
            for sid in got:
                fed = d.v.sessions[sid].kv.length() - len(got[sid])
                assert fed == (0 if sid == "stream" else -1)   # streaming fed the root's token
                out = tree_round(d, sid, rnd, len(got[sid]), tokens, parents)
                out += d.pump()
                assert not errors(out)
                (res,) = results(out)
                assert not res.early
                got[sid] = commit(got[sid], res, tokens, parents)
        assert got["plain"] == got["stream"]
        out = d.send(p.DraftBatch(sid="stream", round=4, start=len(got["stream"]),
                                  token_ids=[5, 6]))   # a chain: rejected at once, early
        out += d.pump()
        (res,) = results(out)
        assert res.early
        got["stream"] += [res.token]
        assert got["stream"][len(ids):] == reference(ids, len(got["stream"]) - len(ids))
    finally:
        d.close()


def test_sampling_chain_shaped_tree_draws_what_the_chain_draws(runner, hf_model, tokenizer,
                                                               reference):
    """Seeded sampling: a tree that is a chain (parents -1, 0, 1, ...) is verified by the same
    acceptance tests and random streams as the chain round, so both give the same result; a
    branching tree's result is a root path."""
    import numpy as np

    ids = tokenizer.encode(PROMPTS[0])
    drafts = reference(ids, 4)
    q_ids, q_probs = [], []
    for j in range(4):
        with torch.inference_mode():
            probs = torch.softmax(hf_model(torch.tensor([ids + drafts[:j]])).logits[0, -1] / 0.8, -1)
        top = torch.topk(probs, 8)
        q_ids.append(top.indices.numpy())
        q_probs.append((top.values / top.values.sum()).numpy())
    q_ids, q_probs = np.stack(q_ids).astype(np.int32), np.stack(q_probs).astype(np.float32)
    ref_i, buf_i = p.tensor_frame(q_ids, 0)
    ref_p, buf_p = p.tensor_frame(q_probs, 1)
    sampling = p.Sampling(temperature=0.8, seed=5)
    d = Driver(runner)
    try:
        outcomes = []
        for sid, parents in (("chain", None), ("tree", [-1, 0, 1, 2])):
            open_spec(d, sid, ids, sampling=sampling)
            out = d.send(p.DraftBatch(sid=sid, round=1, start=len(ids), token_ids=drafts,
                                      q_ids=ref_i, q_probs=ref_p, parents=parents),
                         [buf_i, buf_p])
            out += d.send(p.VerifyRequest(sid=sid, round=1, end=len(ids) + 4,
                                          nodes=0 if parents is None else 4))
            assert not errors(out), errors(out)
            (res,) = results(d.pump())
            outcomes.append((res.accepted, res.token))
            if parents is not None:
                assert res.path == list(range(res.accepted))
        assert outcomes[0] == outcomes[1]
        # a branching sampled tree: siblings drawn from q without replacement share its row
        sib = [int(q_ids[0, 1]), int(q_ids[0, 2])]
        tokens, parents = [drafts[0], *sib, drafts[1]], [-1, -1, -1, 0]
        rows = [0, 0, 0, 1]
        ri, bi = p.tensor_frame(q_ids[rows], 0)
        rp, bp = p.tensor_frame(q_probs[rows], 1)
        open_spec(d, "branch", ids, sampling=sampling)
        out = d.send(p.DraftBatch(sid="branch", round=1, start=len(ids), token_ids=tokens,
                                  q_ids=ri, q_probs=rp, parents=parents), [bi, bp])
        out += d.send(p.VerifyRequest(sid="branch", round=1, end=0, nodes=4))
        assert not errors(out), errors(out)
        (res,) = results(d.pump())
        assert res.accepted == len(res.path)
        if res.path:
            assert res.path == tree.root_path(parents, res.path[-1])
    finally:
        d.close()
