"""Speculative mode end to end.

1. Without models: the dispatcher's round machine (spec/session.SpecRounds) wired to the
   verifier's session (verifier/spec.SpecSession) and a fake drafter through message queues
   delivered in random order (per-link FIFO, as ZMQ keeps it), with resent batches / NAVs,
   forwards overlapping message handling, and a drafter that dies. The fake target is a fixed
   function of the prefix, so its greedy output is known: every policy must reproduce it exactly,
   and a seeded sampled run must give the same tokens under any schedule.
2. With the real services (stack.launcher.Cluster, loopback, ephemeral ports): greedy output of
   every policy equals transformers' generate(do_sample=False), with the Q4_0 drafter and with the
   Q4_1 one; seeded sampling is reproducible; protocol abuse gets clear errors; a drafter killed
   mid-request is survived without a lost or repeated token.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque

import numpy as np
import pytest
import torch

from common import protocol
from stack.launcher import Cluster
from common.protocol import Sampling
from services.dispatcher.spec import session as ss
from services.dispatcher.spec.dp_batching import BatchPlanner
from services.dispatcher.spec.learned_trigger import AcceptanceModel, LearnedTrigger
from services.dispatcher.spec.nav_trigger import DraftWindow, NavConfig, make_trigger
from services.verifier.spec import SpecSession
from tests.conftest import PROMPTS, forwards_over_one_session, long_prompt
from tests.unit.test_spec_verify import V, FakeKV, target_greedy, target_logits

# --- 1. simulation ------------------------------------------------------------------------------


def draft_logits(prefix) -> torch.Tensor:
    """The fake drafter: the target's logits plus prefix-keyed noise (agrees most of the time)."""
    g = np.random.default_rng(abs(hash(tuple(prefix[-3:]))) % (2**32) + 17)
    return target_logits(prefix) + torch.tensor(g.normal(0, 1.2, V), dtype=torch.float32)


class FakeDrafter:
    """Honours DraftRequest(until) / DraftRollback(seq=epoch) like services/drafter."""

    def __init__(self, prompt, s: Sampling, k=6):
        self.tokens, self.s, self.k = list(prompt), s, k
        self.epoch, self.limit = 0, len(prompt)

    def handle(self, msg):
        if isinstance(msg, protocol.DraftRollback):
            if msg.seq <= self.epoch:
                return
            assert 1 <= msg.keep <= len(self.tokens)
            self.tokens = self.tokens[:msg.keep] + list(msg.append)
            self.epoch, self.limit = msg.seq, msg.until or len(self.tokens)
        elif isinstance(msg, protocol.DraftRequest) and msg.seq >= self.epoch:
            self.limit = msg.until

    def step(self):
        if len(self.tokens) >= self.limit:
            return None
        x = draft_logits(self.tokens)
        pos = len(self.tokens)
        if self.s.temperature <= 0:
            p = torch.softmax(x, -1)
            t, prob, qi, qp = int(p.argmax()), float(p.max()), None, None
        else:
            ids = torch.topk(x, self.k).indices
            q = torch.softmax(x[ids] / self.s.temperature, -1).numpy().astype(np.float64)
            rng = np.random.default_rng([self.s.seed, pos])
            j = int(rng.choice(self.k, p=q / q.sum()))
            t, prob = int(ids[j]), float(q[j])
            qi, qp = ids.numpy().astype(np.int64), q.astype(np.float32)
        self.tokens.append(t)
        return ss.Draft(pos, t, prob, qi, qp), self.epoch


def simulate(policy: str, prompt, n, schedule_seed, s=Sampling(), dup=0.0, kill_drafter_at=None,
             stream=None, lookahead=96, depth=1):
    """Run one request through the three state machines; returns (tokens, stats)."""
    rng = random.Random(schedule_seed)
    pol = ss.POLICIES[policy]
    if stream is not None:
        pol = ss.Policy(pol.name, pol.trigger, pol.dp, pol.proactive, stream, pol.bo)
    if pol.trigger == "pipesd-learned":   # its model and the link's costs come from the dispatcher
        trigger = LearnedTrigger(AcceptanceModel(), lambda: (0.05, 0.004, 0.0005, 0.002),
                                 max_length=16)
    else:
        trigger = make_trigger(pol.trigger, NavConfig(max_length=16, fixed_length=5))
    if policy == "oracle-trigger":
        trigger.set_reference(target_greedy(prompt, n))
    sm = ss.SpecRounds(len(prompt), n, pol, trigger, BatchPlanner(), DraftWindow(),
                       lambda: (0.004, 0.0005, 0.002), lookahead, depth=depth)
    ver = SpecSession("s", b"", 1, 1, FakeKV(), prompt, s, pol.stream, V)
    drafter = FakeDrafter(prompt, s)
    to_v, to_d, from_v, from_d = deque(), deque(), deque(), deque()
    out: list[int] = []
    drafter_alive = True

    def act(actions):
        for a in actions:
            if isinstance(a, ss.Emit):
                out.extend(a.tokens)
            elif isinstance(a, ss.SendBatch):
                q = (None, None) if a.drafts[0].q_ids is None else \
                    (np.stack([d.q_ids for d in a.drafts]), np.stack([d.q_probs for d in a.drafts]))
                m = protocol.DraftBatch(sid="s", round=a.round, start=a.start, parent=a.parent,
                                        token_ids=[d.token for d in a.drafts])
                to_v.append((m, q))
            elif isinstance(a, ss.SendNav):
                to_v.append((protocol.VerifyRequest(sid="s", round=a.round, end=a.end), None))
            elif isinstance(a, ss.Rollback):
                to_d.append(protocol.DraftRollback(sid="s", seq=a.epoch, keep=a.keep,
                                                   append=a.append, until=a.until))
            elif isinstance(a, ss.Limit):
                to_d.append(protocol.DraftRequest(sid="s", seq=sm.epoch, until=a.until))

    while (w := ver.next_work(512)) is not None and w.phase == "prefill":
        ver.kv.tokens.extend(w.token_ids)
        ver.consume(w, torch.zeros(1, V))   # prefill logits are not used
    work = w                                # streaming already feeds the last prompt token
    act(sm.start())
    for step in range(200_000):
        if len(out) >= n:
            break
        if kill_drafter_at is not None and drafter_alive and step == kill_drafter_at:
            drafter_alive = False
            to_d.clear()
            from_d.clear()
            act(sm.drafter_lost())
        r = rng.random()
        if r < 0.2 and to_v:
            msg, q = to_v.popleft()
            if dup and rng.random() < dup:      # a resend arrives again, later
                to_v.insert(rng.randint(0, len(to_v)), (msg, q))
            if isinstance(msg, protocol.DraftBatch):
                ver.on_batch(msg, *q)
            else:
                stored = ver.on_verify(msg)
                if stored is not None:
                    from_v.append(stored)
            from_v.extend(ver.resolve())
        elif r < 0.35 and work is None:
            work = ver.next_work(512)
        elif r < 0.5 and work is not None:
            rows = []
            for t in work.token_ids:
                ver.kv.tokens.append(t)
                rows.append(target_logits(ver.kv.tokens))
            from_v.extend(ver.consume(work, torch.stack(rows)))
            work = None
        elif r < 0.65 and from_v:
            m = from_v.popleft()
            if dup and rng.random() < dup:
                from_v.insert(rng.randint(0, len(from_v)), m)
            act(sm.on_result(m.round, m.start, m.accepted, m.token, m.early))
        elif r < 0.75 and to_d and drafter_alive:
            drafter.handle(to_d.popleft())
        elif r < 0.9 and drafter_alive:
            d = drafter.step()
            if d is not None:
                from_d.append(d)
        elif from_d and drafter_alive:
            d, epoch = from_d.popleft()
            if epoch == sm.epoch:
                act(sm.on_draft(d))
    else:
        raise AssertionError(f"{policy}: stuck after {len(out)} tokens: C={sm.C} drafts={len(sm.drafts)} "
                             f"until={sm.until} rounds={sm.rounds} drafter={len(drafter.tokens)}/"
                             f"{drafter.limit} e{drafter.epoch}/{sm.epoch} ver C={ver.C} "
                             f"active={ver.active} child={ver.child} kv={ver.kv.length()} "
                             f"queues={len(to_v)},{len(to_d)},{len(from_v)},{len(from_d)}")
    return out[:n], sm.stats


SIM_POLICIES = ["pipesd", "pipesd-stream", "vanilla", "hsl", "edgellm", "oracle-trigger",
                "pipesd-learned"]


@pytest.mark.parametrize("policy", SIM_POLICIES)
def test_simulated_greedy_is_lossless_under_any_schedule(policy):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = target_greedy(prompt, 60)
    for seed in range(12):
        got, st = simulate(policy, prompt, 60, seed, dup=0.1 if seed % 2 else 0.0,
                           depth=1 + seed % 4)
        assert got == want, f"{policy} schedule {seed}"
        assert st.rounds > 1 and st.accepted > 0
    if policy.startswith("pipesd"):
        assert st.proactive_kept + st.proactive_discarded > 0


@pytest.mark.parametrize("policy", ["pipesd", "pipesd-stream", "vanilla"])
def test_simulated_drafter_death_keeps_the_output_exact(policy):
    prompt = [2, 7, 1, 8, 2, 8]
    want = target_greedy(prompt, 40)
    for seed, at in enumerate((0, 5, 60, 200)):
        got, st = simulate(policy, prompt, 40, seed, kill_drafter_at=at)
        assert got == want
        assert st.nav_reasons.get("no_drafter", 0) >= 1


def test_simulated_sampling_is_reproducible_whatever_the_schedule():
    prompt = [1, 2, 3, 4]
    s = Sampling(temperature=0.9, top_k=8, seed=1234)
    runs = [simulate("pipesd", prompt, 40, seed, s, dup=0.1, stream=stream, depth=depth)[0]
            for seed, stream, depth in ((0, False, 1), (1, True, 1), (2, False, 3), (3, True, 4))]
    assert all(r == runs[0] for r in runs)
    other = simulate("pipesd", prompt, 40, 0, Sampling(temperature=0.9, top_k=8, seed=99))[0]
    assert other != runs[0]


def test_results_for_unknown_or_finished_rounds_are_ignored():
    sm = ss.SpecRounds(4, 10, ss.POLICIES["vanilla"], make_trigger("vanilla", NavConfig(fixed_length=2)),
                       BatchPlanner(), DraftWindow(), lambda: (0.001, 0.0, 0.01), 8)
    sm.start()
    a = sm.on_draft(ss.Draft(4, 10, 0.9)) + sm.on_draft(ss.Draft(5, 11, 0.9))
    assert any(isinstance(x, ss.SendNav) for x in a)
    assert sm.on_result(7, 4, 1, 3) == [] and sm.stats.unknown_results == 1
    out = sm.on_result(1, 4, 1, 3)
    assert out[0] == ss.Emit([10, 3])
    assert sm.on_result(1, 4, 1, 3) == [] and sm.stats.duplicate_results == 1
    sm.on_draft(ss.Draft(6, 12, 0.9))
    sm.on_draft(ss.Draft(7, 13, 0.9))
    with pytest.raises(ss.SpecError):   # accepts more drafts than round 2 sent: a verifier bug
        sm.on_result(2, 6, 5, 1)


# --- 2. real services ---------------------------------------------------------------------------
MAX_TOKENS = 24
POLICIES = ["pipesd", "pipesd-stream", "vanilla", "hsl", "edgellm", "oracle-trigger",
            "pipesd-learned"]
KINDS = ["plain", "chat", "code"]


@pytest.fixture(scope="module")
def clusters(model_paths, tmp_path_factory):
    """Cluster "q4_0": verifier + realistic drafter + dispatcher. Cluster "q4_1": the near-ideal
    drafter + its own dispatcher (BO off, short peer timeout for the drafter-kill test),
    sharing the first cluster's verifier."""
    logs = tmp_path_factory.mktemp("spec-logs")
    a = Cluster(services=("verifier", "drafter", "dispatcher"), ephemeral=True, logdir=logs / "a",
                extra={"dispatcher": ["--heartbeat-s", "0.5", "--peer-timeout-s", "2"]})
    b = Cluster(services=("drafter", "dispatcher"), ephemeral=True, logdir=logs / "b",
                extra={"drafter": ["--drafter", "bundled-q4_1"],
                       "dispatcher": ["--verifier", a.endpoint("verifier"), "--spec-bo", "false",
                                      "--heartbeat-s", "0.5", "--peer-timeout-s", "2"]})
    try:
        a.start_all()
        b.start_all()
        a.wait_ready(timeout=240)
        b.wait_ready(timeout=240)
        yield {"q4_0": a, "q4_1": b}
    finally:
        b.stop_all()
        a.stop_all()


@pytest.fixture(scope="module")
def clients(clusters):
    from tandem import Client
    cs = {k: Client(c.endpoint("dispatcher"), timeout_s=300) for k, c in clusters.items()}
    yield cs
    for c in cs.values():
        c.close()


def prompt_ids(tokenizer, kind):
    if kind == "chat":
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[kind]}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode(PROMPTS[kind])


@pytest.mark.parametrize("drafter", ["q4_0", "q4_1"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_spec_equals_transformers(clients, tokenizer, reference, assert_same_tokens,
                                         policy, drafter):
    for kind in KINDS:
        ids = prompt_ids(tokenizer, kind)
        chunks = list(clients[drafter].generate(ids, mode="spec", policy=policy,
                                                max_tokens=MAX_TOKENS, stop_at_eos=False))
        r = clients[drafter].last_result
        assert [c.index for c in chunks] == list(np.cumsum([0] + [len(c.token_ids) for c in chunks])[:-1])
        assert sum((c.token_ids for c in chunks), []) == r.token_ids
        assert_same_tokens(ids, r.token_ids, reference(ids, MAX_TOKENS), f"{policy}/{drafter}/{kind}")
        st = r.stats
        assert st["mode"] == "spec" and st["policy"] == policy and st["rounds"] >= 1
        assert st["acceptance_rate"] is not None, (kind, st)
        assert 0 <= st["acceptance_rate"] <= 1 and st["cloud_forwards_per_token"] > 0
        assert not any(c.degraded for c in chunks)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["q4_0", "q4_1"])
def test_long_prompt_spec_equals_transformers(clients, tokenizer, reference, assert_same_tokens,
                                              drafter):
    ids = long_prompt(tokenizer)
    assert len(ids) >= 1000
    want = reference(ids, 12)
    for policy in POLICIES:
        r = clients[drafter].complete(ids, mode="spec", policy=policy, max_tokens=12,
                                      stop_at_eos=False)
        assert_same_tokens(ids, r.token_ids, want, f"long/{policy}/{drafter}")


def test_concurrent_sessions_share_verifier_forwards_and_stay_exact(clusters, tokenizer,
                                                                   reference, assert_same_tokens):
    """Four requests at once (different prompts and policies): the verifier batches their
    verifications into shared forward passes; each output must still be the target's."""
    from tandem import AsyncClient
    jobs = [("plain", "pipesd"), ("chat", "pipesd-stream"), ("code", "vanilla"), ("plain", "hsl")]
    metrics_url = clusters["q4_0"].procs["verifier"].url("/metrics")
    batched_before = forwards_over_one_session(metrics_url, "verifier")

    async def go():
        async with AsyncClient(clusters["q4_0"].endpoint("dispatcher"), timeout_s=300) as c:
            return await asyncio.gather(*[
                c.complete(prompt_ids(tokenizer, k), mode="spec", policy=p, max_tokens=MAX_TOKENS,
                           stop_at_eos=False) for k, p in jobs])
    for (kind, policy), r in zip(jobs, asyncio.run(go())):
        ids = prompt_ids(tokenizer, kind)
        assert_same_tokens(ids, r.token_ids, reference(ids, MAX_TOKENS), f"concurrent/{policy}/{kind}")
    batched = forwards_over_one_session(metrics_url, "verifier") - batched_before
    assert batched >= 1, "no verifier forward held more than one session: nothing was batched"


def test_fixed_nav_thresholds_per_request(clients, tokenizer, reference, assert_same_tokens):
    """nav_thresholds fixes (R1, R2) for one request (the tuner benchmark's objective): the round
    machine uses them, the output stays the target's, and a bad pair is refused."""
    from tandem import InvalidRequest
    ids = tokenizer.encode(PROMPTS["code"])
    for r1, r2 in ((0.05, 0.5), (0.99, 0.99)):
        r = clients["q4_0"].complete(ids, mode="spec", policy="pipesd", max_tokens=MAX_TOKENS,
                                     stop_at_eos=False, nav_thresholds=(r1, r2))
        assert_same_tokens(ids, r.token_ids, reference(ids, MAX_TOKENS), f"thresholds {r1},{r2}")
        assert r.stats["thresholds"]["r1"] == pytest.approx(r1)
        assert r.stats["thresholds"]["r2"] == pytest.approx(r2)
        assert "tuner" not in r.stats          # the autotuner was neither used nor fed
    r = clients["q4_0"].complete(ids, mode="spec", policy="pipesd", max_tokens=4)
    assert r.stats["tuner"]["state"] in ("exploring", "settled")   # BO on in this cluster
    for bad in ((0.0, 0.5), (0.5, 1.5)):
        with pytest.raises(InvalidRequest, match="nav_thresholds"):
            clients["q4_0"].complete(ids, mode="spec", max_tokens=4, nav_thresholds=bad)


def test_seeded_sampling_is_reproducible(clients, tokenizer):
    ids = tokenizer.encode(PROMPTS["plain"])
    kw = dict(mode="spec", max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, stop_at_eos=False)
    for drafter, policy in (("q4_0", "vanilla"), ("q4_1", "pipesd-stream")):
        c = clients[drafter]
        a = c.complete(ids, policy=policy, seed=7, **kw)
        b = c.complete(ids, policy=policy, seed=7, **kw)
        assert a.token_ids == b.token_ids, f"{policy}: same seed, different tokens"
        assert len(a.token_ids) == MAX_TOKENS and a.stats["rounds"] >= 1
    outs = {tuple(clients["q4_0"].complete(ids, policy="vanilla", seed=s, **kw).token_ids)
            for s in (1, 2, 3)}
    assert len(outs) > 1, "different seeds should give different samples"


def test_verifier_rejects_bad_rounds_and_tokens(clusters, tokenizer):
    """Protocol abuse straight at the verifier: clear errors, and the session keeps working."""
    from common.runtime import Peer, PeerError
    import zmq.asyncio

    ids = tokenizer.encode(PROMPTS["plain"])
    C = len(ids)

    async def go():
        ctx = zmq.asyncio.Context()
        peer = Peer(ctx, clusters["q4_0"].endpoint("verifier"), "verifier", "test")
        try:
            assert await peer.wait_up(30)
            ch = peer.channel()
            await ch.send(protocol.SpecOpen(sid="abuse", seq=1, token_ids=ids))
            msg, _ = await ch.recv(60)
            assert isinstance(msg, protocol.Ack)

            async def expect_error(m, code):
                await ch.send(m)
                with pytest.raises(PeerError) as e:
                    while True:
                        r, _ = await ch.recv(30)
                        assert isinstance(r, protocol.Ack)   # acks of accepted batches
                assert e.value.code == code, e.value
            # a NAV for a round never opened (end == C would be a legal zero-draft round)
            await expect_error(protocol.VerifyRequest(sid="abuse", seq=2, round=5, end=C + 3),
                               protocol.UNKNOWN_ROUND)
            await expect_error(protocol.DraftBatch(sid="abuse", seq=3, round=1, start=C,
                                                   token_ids=[1, 10**6]), protocol.BAD_FIELD)
            await expect_error(protocol.DraftBatch(sid="abuse", seq=4, round=1, start=C + 3,
                                                   token_ids=[1]), protocol.BAD_FIELD)
            await expect_error(protocol.VerifyRequest(sid="nosuch", seq=5, round=1, end=1),
                               protocol.UNKNOWN_SESSION)
            # the session still verifies correctly; a repeated NAV gets the same answer
            await ch.send(protocol.DraftBatch(sid="abuse", seq=6, round=1, start=C, token_ids=[198]))
            got = []
            for seq in (7, 8):     # the second NAV is a retry after the result: same answer
                await ch.send(protocol.VerifyRequest(sid="abuse", seq=seq, round=1, end=C + 1))
                while True:
                    r, _ = await ch.recv(60)
                    if isinstance(r, protocol.VerifyResult):
                        got.append(r)
                        break
            assert got[0] == got[1] and got[0].round == 1 and got[0].start == C
            await peer.request(protocol.Close(sid="abuse"), timeout=10)
        finally:
            peer.close()
            ctx.term()
    asyncio.run(go())


def test_spec_metrics_are_exported(clusters, clients, tokenizer):
    import urllib.request
    clients["q4_0"].complete(tokenizer.encode(PROMPTS["plain"]), mode="spec", policy="pipesd",
                             max_tokens=8, stop_at_eos=False)
    with urllib.request.urlopen(clusters["q4_0"].procs["dispatcher"].url("/metrics"), timeout=10) as r:
        text = r.read().decode()
    for name in ("tandem_spec_drafts_total", "tandem_spec_draft_tokens_total",
                 "tandem_spec_accepted_tokens_total", "tandem_spec_accepted_tokens_per_pos_total",
                 "tandem_spec_draft_length_bucket", "tandem_spec_batch_tokens_bucket",
                 "tandem_spec_nav_triggers_total", "tandem_spec_proactive_tokens_total",
                 "tandem_spec_policy_parameter", "tandem_spec_dp_replans_total",
                 "tandem_time_per_accepted_token_seconds_bucket"):
        assert f"\n{name}{{" in text, name
    assert 'policy="pipesd"' in text and 'name="gamma"' in text
    # the dispatcher declares every policy's series at 0 when it starts: this request moved them
    drafts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("tandem_spec_drafts_total{") and 'policy="pipesd"' in line]
    assert drafts and drafts[0] > 0, drafts


def test_drafter_killed_mid_request_output_stays_exact(clusters, clients, tokenizer, reference,
                                                       assert_same_tokens):
    """Runs last in this module: it kills the q4_1 cluster's drafter."""
    ids = prompt_ids(tokenizer, "code")
    n = 40
    c = clients["q4_1"]
    chunks = []
    killed = False
    for chunk in c.generate(ids, mode="spec", policy="pipesd-stream", max_tokens=n,
                            stop_at_eos=False):
        chunks.append(chunk)
        if not killed:
            clusters["q4_1"].kill("drafter")
            killed = True
    r = c.last_result
    got = sum((ch.token_ids for ch in chunks), [])
    assert got == r.token_ids and len(got) == n
    assert_same_tokens(ids, got, reference(ids, n), "drafter-killed")
    assert r.stats.get("drafter_lost") is True
    # a new request with the drafter still down: the target decodes alone, still exact
    r2 = c.complete(ids, mode="spec", policy="pipesd", max_tokens=8, stop_at_eos=False,
                    deadline_s=120)
    assert_same_tokens(ids, r2.token_ids, reference(ids, 8), "drafter-down")


def test_verifier_killed_mid_request(clusters, clients, tokenizer, reference):
    """Runs last: kills the verifier. With allow_edge_only the stream goes on with the
    drafter's tokens marked degraded (after an exact prefix); without it, a clear error."""
    from tandem import Unavailable
    ids = prompt_ids(tokenizer, "plain")
    n = 32
    c = clients["q4_0"]
    chunks = []
    for chunk in c.generate(ids, mode="spec", policy="pipesd", max_tokens=n, stop_at_eos=False,
                            allow_edge_only=True):
        chunks.append(chunk)
        if len(chunks) == 1:
            clusters["q4_0"].kill("verifier")
    r = c.last_result
    assert r.stats.get("degraded") is True and len(r.token_ids) == n
    assert [ch.index for ch in chunks] == list(np.cumsum([0] + [len(ch.token_ids) for ch in chunks])[:-1])
    exact = sum((ch.token_ids for ch in chunks if not ch.degraded), [])
    # the kill came after the first chunk, which the target verified: at least it is exact
    assert not chunks[0].degraded and len(exact) >= len(chunks[0].token_ids) > 0, chunks
    assert exact == reference(ids, n)[:len(exact)]
    assert chunks[-1].degraded
    assert all(ch.degraded for ch in chunks[next(i for i, ch in enumerate(chunks) if ch.degraded):])
    with pytest.raises(Unavailable):
        c.complete(ids, mode="spec", policy="pipesd", max_tokens=4, deadline_s=60)
