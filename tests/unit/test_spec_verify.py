"""The verifier's side of speculative mode without a model.

* spec_verify: greedy acceptance and exact speculative sampling with a sparse q — the emitted
  distribution is checked against p by a chi-square test over thousands of draws.
* SpecSession (services/verifier/spec.py) driven by a fake KV cache and a fake "model" whose
  logits are a fixed function of the prefix: streaming and NAV-time verification, proactive
  rounds kept and discarded, late proactive batches, resent batches and NAVs, bad rounds.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from scipy import stats

from common import protocol, sampling
from common.protocol import ProtocolError, Sampling
from services.verifier import spec_verify
from services.verifier.spec import SpecSession

V = 32


# --- pure decisions ------------------------------------------------------------------------------
def test_greedy_accepts_only_the_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert spec_verify.greedy(logits, 1) == spec_verify.Decision(1, True)
    assert spec_verify.greedy(logits, 3) == spec_verify.Decision(1, False)
    d = spec_verify.decide(logits, 3, Sampling(), position=5)
    assert d == spec_verify.Decision(1, False)


def _chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    """p-value of observed counts against probabilities p (cells with p > 0)."""
    n = counts.sum()
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token with target probability 0 was emitted"
    return stats.chisquare(counts[keep], n * p[keep] / p[keep].sum()).pvalue


@pytest.mark.parametrize("case", ["overlap", "q_misses_mass", "q_is_p", "p_sharper"])
def test_speculative_sampling_emits_the_target_distribution(case):
    """Draft x ~ q (sparse), accept with min(1, p/q), else resample norm(max(0, p - q)):
    the emitted token must follow p exactly, whatever q is."""
    rng = np.random.default_rng(7)
    p = np.array([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
    if case == "overlap":
        q_ids, q_probs = np.array([2, 0, 5, 7]), np.array([0.4, 0.3, 0.2, 0.1])
    elif case == "q_misses_mass":      # q puts mass only on tokens p finds unlikely
        q_ids, q_probs = np.array([7, 6]), np.array([0.7, 0.3])
    elif case == "q_is_p":
        q_ids, q_probs = np.arange(8), p.copy()
    else:
        p = np.array([0.9, 0.05, 0.05, 0, 0, 0, 0, 0])
        q_ids, q_probs = np.array([1, 0, 3]), np.array([0.5, 0.3, 0.2])
    pt = torch.tensor(p, dtype=torch.float32)
    n = 6000
    counts = np.zeros(len(p), dtype=np.int64)
    accepted = 0
    for i in range(n):
        x = int(rng.choice(q_ids, p=q_probs))
        g = torch.Generator().manual_seed(1_000 + i)
        d = spec_verify.speculative(pt, x, q_ids.astype(np.int32), q_probs.astype(np.float32),
                                    float(rng.random()), g)
        counts[d.token] += 1
        accepted += d.accepted
        assert d.accepted == (d.token == x)
    assert _chi_square(counts, p) > 1e-3
    want_accept = sum(min(p[t], q) for t, q in zip(q_ids, q_probs))   # sum_x min(p, q)
    assert abs(accepted / n - want_accept) < 0.03


def test_decide_end_to_end_on_logits_with_top_k():
    """decide(): temperature + top-k target from logits, draft from a truncated drafter q, keyed
    randomness per position; over many seeds the emitted tokens follow target_probs."""
    torch.manual_seed(0)
    logits = torch.randn(V) * 2
    s0 = Sampling(temperature=0.8, top_k=6)
    p = sampling.target_probs(logits, s0).numpy().astype(np.float64)
    q_logits = logits + torch.randn(V)
    q_ids = torch.topk(q_logits, 5).indices.numpy().astype(np.int32)
    q_probs = torch.softmax(q_logits[q_ids] / 0.8, -1).numpy().astype(np.float32)
    rng = np.random.default_rng(3)
    counts = np.zeros(V, dtype=np.int64)
    for seed in range(4000):
        s = Sampling(temperature=0.8, top_k=6, seed=seed)
        x = int(rng.choice(q_ids, p=q_probs.astype(np.float64) / q_probs.sum()))
        counts[spec_verify.decide(logits, x, s, 17, q_ids, q_probs).token] += 1
    assert _chi_square(counts, p) > 1e-3
    s = Sampling(temperature=0.8, top_k=6, seed=11)   # same seed, same position: same token
    a = spec_verify.decide(logits, int(q_ids[0]), s, 17, q_ids, q_probs)
    assert all(spec_verify.decide(logits, int(q_ids[0]), s, 17, q_ids, q_probs) == a
               for _ in range(5))


def test_check_q_rejects_malformed_distributions():
    ids = np.array([[1, 2, 3]], dtype=np.int32)
    probs = np.array([[0.5, 0.3, 0.2]], dtype=np.float32)
    assert spec_verify.check_q([2], ids, probs, V) == ""
    assert "outside its q support" in spec_verify.check_q([9], ids, probs, V)
    assert "sum to 1" in spec_verify.check_q([2], ids, probs * 2, V)
    assert "repeats" in spec_verify.check_q([2], np.array([[1, 2, 2]]), probs, V)
    assert "vocabulary" in spec_verify.check_q([2], ids + V, probs, V)
    assert "must both be" in spec_verify.check_q([2, 3], ids, probs, V)
    assert ">= 0" in spec_verify.check_q([2], ids, np.array([[1.2, 0.0, -0.2]]), V)


# --- the verifier session with a fake model -------------------------------------------------------
def target_logits(prefix) -> torch.Tensor:
    """A fixed 'model': logits as a pseudo-random function of the last 3 tokens."""
    h = hashlib.blake2b(np.asarray(prefix[-3:], dtype=np.int64).tobytes(), digest_size=8)
    g = np.random.default_rng(int.from_bytes(h.digest(), "little"))
    return torch.tensor(g.normal(0, 2, V), dtype=torch.float32)


def target_greedy(prompt, n):
    out = list(prompt)
    for _ in range(n):
        out.append(int(torch.argmax(target_logits(out))))
    return out[len(prompt):]


class FakeKV:
    def __init__(self):
        self.tokens: list[int] = []

    def length(self):
        return len(self.tokens)

    def truncate(self, n):
        del self.tokens[n:]

    def reserve(self, a, b, n):
        pass

    def nbytes(self):
        return 0


def run_engine(s: SpecSession) -> list:
    """Run the engine loop for one session until it has no work; return its replies."""
    out = []
    while (w := s.next_work(512)) is not None:
        rows = []
        for t in w.token_ids:
            s.kv.tokens.append(t)
            rows.append(target_logits(s.kv.tokens))
        out += s.consume(w, torch.stack(rows) if w.logits == "all" else torch.stack(rows[-1:]))
    return out


def open_session(prompt, stream=False, s=Sampling()):
    sess = SpecSession("s", b"id", 1, 1, FakeKV(), prompt, s, stream, V)
    acks = run_engine(sess)
    # streaming feeds the last prompt token at once (its row checks the first draft on arrival)
    assert isinstance(acks[0], protocol.Ack) and sess.kv.length() == len(prompt) - (not stream)
    return sess


def batch(rnd, start, tokens, parent=0):
    return protocol.DraftBatch(sid="s", round=rnd, start=start, token_ids=list(tokens), parent=parent)


def results(replies):
    return [r for r in replies if isinstance(r, protocol.VerifyResult)]


PROMPT = [3, 1, 4, 1, 5]


@pytest.mark.parametrize("stream", [False, True])
def test_round_accepts_the_target_prefix_and_corrects(stream):
    want = target_greedy(PROMPT, 8)
    s = open_session(PROMPT, stream)
    drafts = want[:3] + [(want[3] + 1) % V] + want[4:6]      # 4th draft is wrong
    s.on_batch(batch(1, 5, drafts[:2]), None, None)
    out = run_engine(s)
    s.on_batch(batch(1, 7, drafts[2:]), None, None)
    out += run_engine(s)
    if stream:   # the mismatch is found before any NAV: early reject
        (r,) = results(out)
        assert r.early and r.accepted == 3 and r.token == want[3]
        assert s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=11)) == r  # NAV answered from state
    else:
        assert results(out) == []
        assert s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=11)) is None
        (r,) = results(run_engine(s))
        assert not r.early and r.accepted == 3 and r.token == want[3]
    # the rejected draft left the cache; streaming already fed the correction
    assert s.C == 9 and s.kv.tokens == PROMPT + want[:3 + stream]
    # next round continues from the corrected prefix
    s.on_batch(batch(2, 9, want[4:7]), None, None)
    s.on_verify(protocol.VerifyRequest(sid="s", round=2, end=12))
    (r2,) = results(run_engine(s) + s.resolve())
    assert (r2.accepted, r2.token) == (3, want[7])       # full acceptance: bonus token


@pytest.mark.parametrize("stream", [False, True])
def test_proactive_round_kept_when_bonus_matches_its_guess(stream):
    want = target_greedy(PROMPT, 10)
    s = open_session(PROMPT, stream)
    s.on_batch(batch(1, 5, want[:3]), None, None)
    s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=8))
    s.on_batch(batch(2, 8, want[3:6], parent=1), None, None)   # guess want[3], drafts want[4:6]
    s.on_verify(protocol.VerifyRequest(sid="s", round=2, end=11))
    out = results(run_engine(s) + s.resolve())
    assert [(r.round, r.accepted, r.token) for r in out] == [(1, 3, want[3]), (2, 2, want[6])]
    assert s.C == 12 and s.kv.tokens == PROMPT + want[:6 + stream]


def test_proactive_round_discarded_on_rejection_and_wrong_guess():
    want = target_greedy(PROMPT, 10)
    s = open_session(PROMPT, True)
    wrong = (want[1] + 1) % V
    s.on_batch(batch(1, 5, [want[0], wrong]), None, None)
    s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=7))
    s.on_batch(batch(2, 7, [7, 8, 9], parent=1), None, None)
    (r,) = results(run_engine(s))
    assert (r.accepted, r.token) == (1, want[1]) and 2 in s.discarded
    assert s.kv.tokens == PROMPT + want[:2] and s.stream == []
    s.on_batch(batch(2, 10, [1]), None, None)          # more of the discarded round: ignored
    assert s.on_verify(protocol.VerifyRequest(sid="s", round=2, end=11)) is None
    # a fully accepted round whose bonus differs from the guess also drops its child
    s.on_batch(batch(3, 7, want[2:4]), None, None)
    s.on_verify(protocol.VerifyRequest(sid="s", round=3, end=9))
    s.on_batch(batch(4, 9, [(want[4] + 1) % V, 5], parent=3), None, None)
    (r,) = results(run_engine(s) + s.resolve())
    assert (r.round, r.accepted, r.token) == (3, 2, want[4]) and 4 in s.discarded
    assert s.C == 10 and s.kv.tokens == PROMPT + want[:5]


def test_late_proactive_batch_after_its_parent_resolved():
    want = target_greedy(PROMPT, 10)
    s = open_session(PROMPT)
    s.on_batch(batch(1, 5, want[:2]), None, None)
    s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=7))
    (r,) = results(run_engine(s))
    assert (r.accepted, r.token) == (2, want[2])
    s.on_batch(batch(2, 7, want[2:5], parent=1), None, None)   # guess == bonus: kept
    s.on_verify(protocol.VerifyRequest(sid="s", round=2, end=10))
    (r2,) = results(run_engine(s) + s.resolve())
    assert (r2.round, r2.start, r2.accepted, r2.token) == (2, 8, 2, want[5])


def test_resent_batches_and_navs_are_answered_from_state():
    want = target_greedy(PROMPT, 10)
    s = open_session(PROMPT, True)
    s.on_batch(batch(1, 5, want[:2]), None, None)
    s.on_batch(batch(1, 5, want[:3]), None, None)        # resend overlapping + one new token
    s.on_batch(batch(1, 6, want[1:3]), None, None)       # pure duplicate
    assert [e.token for e in s.stream] == want[:3]
    s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=8))
    s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=8))   # duplicate NAV before result
    out = results(run_engine(s) + s.resolve())
    assert len(out) == 1
    assert s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=8)) == out[0]
    s.on_batch(batch(1, 5, want[:3]), None, None)        # resend after resolution: ignored
    assert s.C == 9 and s.stream == []


def test_bad_rounds_and_positions_are_clear_errors():
    s = open_session(PROMPT)
    with pytest.raises(ProtocolError) as e:
        s.on_verify(protocol.VerifyRequest(sid="s", round=9, end=12))
    assert e.value.code == protocol.UNKNOWN_ROUND
    with pytest.raises(ProtocolError) as e:
        s.on_batch(batch(1, 6, [1]), None, None)          # must start at C = 5
    assert e.value.code == protocol.BAD_FIELD
    s.on_batch(batch(1, 5, [1, 2]), None, None)
    with pytest.raises(ProtocolError) as e:
        s.on_batch(batch(1, 8, [1]), None, None)          # gap at 7: lost, a replay cures it
    assert "missing" in e.value.message and e.value.code == protocol.UNKNOWN_ROUND
    with pytest.raises(ProtocolError) as e:
        s.on_batch(batch(1, 5, [9]), None, None)          # position 5 changed
    assert e.value.code == protocol.BAD_FIELD
    with pytest.raises(ProtocolError) as e:
        s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=9))   # beyond received
    assert e.value.code == protocol.BAD_FIELD
    with pytest.raises(ProtocolError) as e:
        s.on_batch(batch(3, 7, [1], parent=2), None, None)   # parent never existed
    assert e.value.code == protocol.UNKNOWN_ROUND
    with pytest.raises(ProtocolError) as e:
        s.on_batch(batch(4, 5, [1]), None, None)              # new round while 1 unresolved
    assert e.value.code == protocol.BAD_FIELD


def test_a_proactive_round_past_its_parents_end_is_a_gap_a_replay_cures():
    """A dropped connection can lose a round's last batch while its proactive child's first batch
    arrives: `unknown_round` (the dispatcher replays), not `bad_field` (the request's answer).
    A child starting inside its parent is inconsistent, not lost: `bad_field`."""
    s = open_session(PROMPT)
    s.on_batch(batch(1, 5, [1, 2]), None, None)               # round 1 holds 5..6, next is 7
    with pytest.raises(ProtocolError) as e:
        s.on_batch(batch(2, 8, [3], parent=1), None, None)
    assert e.value.code == protocol.UNKNOWN_ROUND
    with pytest.raises(ProtocolError) as e:
        s.on_batch(batch(2, 6, [3], parent=1), None, None)
    assert e.value.code == protocol.BAD_FIELD


def test_zero_draft_round_returns_the_next_target_token():
    want = target_greedy(PROMPT, 3)
    for stream in (False, True):
        s = open_session(PROMPT, stream)
        s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=5))
        (r,) = results(run_engine(s) + s.resolve())
        assert (r.accepted, r.token) == (0, want[0])


def test_sampling_session_is_reproducible_and_checks_q():
    s0 = Sampling(temperature=1.0, top_k=8, seed=5)
    q_ids = np.array([[0, 1, 2, 3]] * 3, dtype=np.int64)
    q_probs = np.full((3, 4), 0.25, dtype=np.float32)
    outs = []
    for stream in (False, True):
        s = open_session(PROMPT, stream, s0)
        s.on_batch(batch(1, 5, [0, 1, 2]), q_ids, q_probs)
        s.on_verify(protocol.VerifyRequest(sid="s", round=1, end=8))
        outs.append([(r.accepted, r.token) for r in results(run_engine(s) + s.resolve())])
    assert outs[0] == outs[1] and len(outs[0]) == 1


def test_repeated_open_of_another_session_kind_is_refused():
    """A repeated open (same sid and seq) is an idempotent retry only for the same kind of
    session: a SpecOpen over a cloud-only session (or the other way round) is `session_exists`,
    never silently taken as a retry of the other kind."""
    import asyncio

    from stack.launcher import free_port
    from services.verifier.config import VerifierConfig
    from services.verifier.engine import CloudSession
    from services.verifier.service import Verifier

    class Runner:   # the shape the verifier's KV budget reads; rows that depend on chunking
        num_layers, kv_heads, head_dim, dtype = 1, 1, 8, torch.float32
        lo, hi = 0, 1
        device, chunk_invariant = torch.device("cpu"), False

        def new_kv(self, lo=0, hi=1):
            return FakeKV()

    async def main():
        v = Verifier(VerifierConfig(bind=f"tcp://127.0.0.1:{free_port()}", http_port=0))
        v.runner, v.vocab_size = Runner(), V
        cloud = v.handlers[protocol.CloudGenerate]
        spec = v.handlers[protocol.SpecOpen]
        try:
            await cloud(b"a", protocol.CloudGenerate(sid="x", seq=1, token_ids=[1, 2],
                                                     max_tokens=4), [])
            await cloud(b"b", protocol.CloudGenerate(sid="x", seq=1, token_ids=[1, 2],
                                                     max_tokens=4), [])   # a retry: fine
            assert isinstance(v.sessions["x"], CloudSession) and v.sessions["x"].ident == b"b"
            with pytest.raises(ProtocolError) as e:
                await spec(b"a", protocol.SpecOpen(sid="x", seq=1, token_ids=[1, 2]), [])
            assert e.value.code == protocol.SESSION_EXISTS
            await spec(b"a", protocol.SpecOpen(sid="y", seq=1, token_ids=[1, 2]), [])
            await spec(b"c", protocol.SpecOpen(sid="y", seq=1, token_ids=[1, 2]), [])
            assert isinstance(v.sessions["y"], SpecSession) and v.sessions["y"].ident == b"c"
            with pytest.raises(ProtocolError) as e:
                await cloud(b"a", protocol.CloudGenerate(sid="y", seq=1, token_ids=[1, 2],
                                                         max_tokens=4), [])
            assert e.value.code == protocol.SESSION_EXISTS
            assert isinstance(v.sessions["x"], CloudSession)
            assert isinstance(v.sessions["y"], SpecSession)
        finally:
            v.ctx.term()
    asyncio.run(main())
