"""Every mode, batching and recovery with the real service objects in this process
(stack/inprocess.py: the five services on ZMQ's inproc:// transport, the wire unchanged), in
seconds instead of the minutes the process-based suites take. transformers' own
`generate(do_sample=False)` is the reference throughout."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from common.stats import RequestStats
from stack.inprocess import BackgroundStack
from tests.conftest import wait_until

PROMPTS = ["def fibonacci(n):\n", "The history of the printing press begins",
           "Once upon a time", "What are three good habits for writing clean Python code?"]
N = 20


@pytest.fixture(scope="module")
def stack(model_paths):
    s = BackgroundStack(verifiers=2, suffixes=2)
    yield s
    s.close()


@pytest.fixture(scope="module")
def ids(tokenizer):
    return [tokenizer.encode(p) for p in PROMPTS]


TYPED = {f for f in RequestStats.__dataclass_fields__ if f != "raw"}


def _gen(stack, prompt_ids, **kw):
    r = stack.complete(list(prompt_ids), max_tokens=N, stop_at_eos=False, deadline_s=120, **kw)
    untyped = set(r.stats.raw) - TYPED
    assert not untyped, f"the dispatcher sent stats the shared type lacks: {sorted(untyped)}"
    return r


def test_cloud_only_equals_transformers(stack, ids, reference):
    for p in ids:
        assert _gen(stack, p, mode="cloud-only").token_ids == reference(p, N)


@pytest.mark.parametrize("policy", ["pipesd", "pipesd-stream", "vanilla", "hsl", "edgellm",
                                    "tree", "tree-stream", "pipesd-learned"])
def test_spec_equals_transformers(stack, ids, reference, policy):
    r = _gen(stack, ids[0], mode="spec", policy=policy)
    assert r.token_ids == reference(ids[0], N)
    assert r.stats["rounds"] >= 1 and r.stats["draft_tokens"] >= 1   # it did speculate


def test_a_conversations_next_turn_goes_to_the_replica_that_holds_it(stack, tokenizer,
                                                                     reference):
    """Two verifier replicas, idle: placement alone takes turns between them, so turn 2 would
    land where turn 1's rows are not. Affinity sends it to turn 1's replica, whose prefix cache
    serves the conversation so far; the output stays transformers'."""
    replicas = [stack.stack.services[n] for n in ("verifier", "verifier-1")]
    if not all(v.kv_cache.enabled for v in replicas):
        pytest.skip("the runner's kernels are not built here")
    turn1 = tokenizer.encode("A conversation about rivers. " + "The river runs to the sea; " * 12)
    first = _gen(stack, turn1, mode="cloud-only")
    # a finished session's rows are cached once its replica drops it (the dispatcher's Close)
    wait_until(lambda: not any(v.sessions.ids() for v in replicas), 10, "sessions closed")
    turn2 = turn1 + first.token_ids + tokenizer.encode(" And where does it begin?")
    second = _gen(stack, turn2, mode="cloud-only")
    assert second.stats["verifier_replica"] == first.stats["verifier_replica"]
    assert second.stats["cached_tokens"] >= len(turn1)
    assert second.token_ids == reference(turn2, N)


def _drafter_opens() -> float:
    return REGISTRY.get_sample_value("tandem_messages_total",
                                     {"service": "drafter", "type": "draft_open"}) or 0.0


@pytest.mark.parametrize("policy", ["pipesd", "tree"])
def test_a_one_token_spec_request_opens_no_drafter_session(stack, ids, reference, policy):
    """The one token wanted is the target's own, so the drafter is not asked to prefill the
    prompt: the token equals transformers' and the drafter saw no DraftOpen. Two tokens do
    open a drafter session (the count would have seen one)."""
    before = _drafter_opens()
    for n in (1, 2):
        r = stack.complete(list(ids[0]), max_tokens=n, stop_at_eos=False, deadline_s=120,
                           mode="spec", policy=policy)
        assert r.token_ids == reference(ids[0], n)
        assert not r.stats.get("drafter_lost"), r.stats
        assert _drafter_opens() == before + n - 1


@pytest.mark.parametrize("policy", ["tree", "tree-stream"])
def test_trees_equal_transformers_on_every_prompt(stack, ids, reference, policy):
    """Greedy token trees: every test prompt, token for token, with trees made
    wide by a low cost scale."""
    for p in ids:
        r = _gen(stack, p, mode="spec", policy=policy, policy_knobs={"cs": 0.05, "m": 24})
        assert r.token_ids == reference(p, N)
        assert r.stats["rounds"] >= 1 and r.stats["draft_tokens"] >= 1
    # siblings were sent and compared with the target: acceptance measured at rank >= 1
    table = stack.stack.services["dispatcher"].modes["spec"].edge.tree(policy).table
    assert any(rank >= 1 and row[0] > 0 for (_, rank), row in table.items()), table


def test_tree_depths_time_the_drafter_cost_curve_not_the_chain_gamma(stack, ids, reference):
    """A tree depth is one batched decode of `rows` rows: its time goes to the tree policy's
    drafter-cost curve (depth and row costs), never into γ as seconds per node (γ is a chain's
    seconds per token, which the drafter sends one at a time)."""
    edge = stack.stack.services["dispatcher"].modes["spec"].edge
    tree = edge.tree("tree")
    gamma_calls, decodes = [], []
    speed_observe, tree_observe = edge.speed.observe, tree.observe_decode
    edge.speed.observe = lambda n, s: (gamma_calls.append(n), speed_observe(n, s))[1]
    tree.observe_decode = lambda rows, s: (decodes.append(rows), tree_observe(rows, s))[1]
    try:
        for p in ids[:2]:
            r = _gen(stack, p, mode="spec", policy="tree", policy_knobs={"cs": 0.05, "m": 24})
            assert r.token_ids == reference(p, N)
    finally:
        edge.speed.observe, tree.observe_decode = speed_observe, tree_observe
    assert decodes and max(decodes) >= 2, decodes          # wide depths were timed as such
    assert set(gamma_calls) <= {1}, gamma_calls             # and only chain tokens fed γ
    depth_cost, row_cost = tree.decode_costs(edge.speed.gamma)
    assert depth_cost > 0 and len({r for r, _ in tree.decodes}) >= 2


def test_sampled_trees_follow_the_seed(stack, ids):
    """Sampling over wide token trees (the drafter's children drawn without replacement,
    recursive rejection sampling on the verifier): the seed reproduces the text and different
    seeds give different texts. (That a tree walk lands on the target's own samples is checked
    under the Gumbel coupling, tests/unit/test_gumbel_coupling.py, and its distribution exactly,
    tests/unit/test_spec_verify_tree.py.)"""
    kw = dict(max_tokens=8, stop_at_eos=False, deadline_s=120, mode="spec", policy="tree",
              policy_knobs={"cs": 0.05, "m": 24}, temperature=0.8)
    runs = stack.complete_many([(list(ids[0]), dict(kw, seed=seed)) for seed in (7, 8, 9, 7)])
    assert all(r.stats["rounds"] >= 1 and r.stats["draft_tokens"] >= 1 for r in runs)
    texts = [tuple(r.token_ids) for r in runs]
    assert texts[3] == texts[0], texts
    assert len(set(texts[:3])) >= 2, texts


@pytest.mark.parametrize("cut", [1, 4, 15, 29])
def test_split_equals_transformers_at_every_depth(stack, ids, reference, cut):
    r = _gen(stack, ids[1], mode="split", cut=cut)
    assert r.token_ids == reference(ids[1], N) and r.stats["cut"] == cut


def _sessions_per_forward(stack, service: str):
    """Wrap `service`'s step to record how many sessions each forward held."""
    svc = stack.stack.services[service]
    seen: list[int] = []
    if service.startswith("verifier"):
        original = svc.run_step

        def counted(step):
            seen.append(len(step))
            return original(step)
        svc.run_step = counted
        return seen, lambda: setattr(svc, "run_step", original)
    original = svc.step

    def counted_window(plan, window):
        seen.append(len(window))
        return original(plan, window)
    svc.step = counted_window
    return seen, lambda: setattr(svc, "step", original)


async def _admitting(s, name: str, admitting: bool) -> None:
    """Set whether replica `name` takes new sessions (as its drain sets it: Pongs say not ready),
    and wait until the dispatcher sees it so."""
    s.services[name].draining = not admitting
    peer = next(p for p in s.services["dispatcher"].peers if p.name == name)
    for _ in range(400):
        if peer.up == admitting:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the dispatcher still sees {name} {'down' if admitting else 'up'}")


@pytest.mark.parametrize("mode,service", [("cloud-only", "verifier"), ("split", "suffix")])
def test_batched_equals_one_by_one_and_forwards_held_several_sessions(stack, ids, reference,
                                                                      mode, service):
    """Four concurrent requests, all on replica 0 (the other admits none meanwhile): every output
    equals transformers', and at least one forward carried more than one session."""
    other = f"{service}-1"
    stack.call(lambda s: _admitting(s, other, False))
    seen, restore = _sessions_per_forward(stack, service)
    try:
        async def go(s):
            async with s.client() as c:
                return await asyncio.gather(*(c.complete(list(p), mode=mode, max_tokens=N,
                                                         stop_at_eos=False, deadline_s=120,
                                                         **({"cut": 4} if mode == "split" else {}))
                                              for p in ids))
        results = stack.call(go)
    finally:
        restore()
        stack.call(lambda s: _admitting(s, other, True))
    for p, r in zip(ids, results):
        assert r.token_ids == reference(p, N)
    assert max(seen) > 1, f"no forward held more than one session: {seen}"


def _holding_new_sessions(s, role: str):
    """A function naming the `role` replica that holds a session opened after this call: an
    earlier test's session may still be closing on the other replica."""
    names = [name for name in s.services if name.split("-")[0] == role]
    before = {m: set(s.services[m].sessions.ids()) for m in names}

    def holding() -> str:
        new = [m for m in names if set(s.services[m].sessions.ids()) - before[m]]
        assert len(new) == 1, f"replicas holding the new session: {new}"
        return new[0]
    return holding


@pytest.mark.parametrize("mode,role", [("cloud-only", "verifier"), ("spec", "verifier"),
                                       ("split", "suffix"), ("spec-tree", "verifier")])
def test_a_replica_stopped_mid_stream_is_recovered_exactly(stack, ids, reference, mode, role):
    """The replica holding the session stops after the first tokens: the session is replayed on
    the other replica, nothing is lost or repeated, and the replay is on record (the fault
    took effect)."""
    n = 32
    kw = {"policy": "pipesd"} if mode == "spec" else {"cut": 8} if mode == "split" else {}
    if mode == "spec-tree":
        mode, kw = "spec", {"policy": "tree"}

    async def go(s):
        holding = _holding_new_sessions(s, role)
        async with s.client() as c:
            tokens, stopped = [], None
            async for chunk in c.generate(list(ids[2]), mode=mode, max_tokens=n,
                                          stop_at_eos=False, deadline_s=120, **kw):
                tokens += chunk.token_ids
                if stopped is None and len(tokens) >= 4:
                    stopped = holding()
                    await s.stop(stopped)
            return tokens, c.last_result, stopped
    tokens, result, stopped = stack.call(go)
    try:
        assert tokens == reference(ids[2], n)
        assert result.stats.get("recoveries", 0) >= 1, result.stats
    finally:
        stack.call(lambda s: s.start(stopped))


def test_a_drafter_stopped_mid_tree_stream_leaves_the_target_exact(stack, ids, reference):
    """Token trees without their drafter (stopped after the first tokens, a tree round in
    flight): what was sent is verified, the target goes on alone, the output is exact."""
    n = 32

    async def go(s):
        async with s.client() as c:
            tokens, stopped = [], False
            async for chunk in c.generate(list(ids[3]), mode="spec", policy="tree", max_tokens=n,
                                          stop_at_eos=False, deadline_s=120):
                tokens += chunk.token_ids
                if not stopped and len(tokens) >= 4:
                    stopped = True
                    await s.stop("drafter")
            return tokens, c.last_result
    try:
        tokens, result = stack.call(go)
    finally:
        stack.call(lambda s: s.start("drafter"))
    assert tokens == reference(ids[3], n)
    assert result.stats.get("drafter_lost"), result.stats


LOGPROB_CASES = [   # (mode, extra arguments): every path a target's token is chosen on
    ("cloud-only", {}), ("split", {"cut": 6}), ("spec", {"policy": "pipesd"}),
    ("spec", {"policy": "pipesd-stream", "temperature": 0.8, "seed": 3}),
    ("spec", {"policy": "tree", "policy_knobs": {"cs": 0.05, "m": 24}}),
    ("spec", {"policy": "tree", "policy_knobs": {"cs": 0.05, "m": 24}, "temperature": 0.8,
              "seed": 5}),
]


@pytest.mark.parametrize("mode,extra", LOGPROB_CASES,
                         ids=[f"{m}-{e.get('policy', '')}-{'t' if 'seed' in e else 'g'}"
                              for m, e in LOGPROB_CASES])
def test_logprobs_are_the_targets_raw_log_softmax(stack, ids, reference, hf_model, mode, extra,
                                                  monkeypatch):
    """Every emitted token's logprob and its top 5 alternatives are within 1e-4 of
    transformers' own log_softmax of the logits at that position (before temperature), in every
    mode; greedy output is still transformers'. A request that asks for none computes none."""
    import torch

    from common import sampling
    n, k = 12, 5
    p = ids[2]
    calls = []
    counted = sampling.token_logprob
    monkeypatch.setattr(sampling, "token_logprob", lambda *a: calls.append(1) or counted(*a))
    plain = stack.complete(list(p), max_tokens=4, stop_at_eos=False, deadline_s=120, mode=mode,
                           **extra)
    assert plain.logprobs is None and not calls   # not asked: nothing computed, nothing sent
    r = stack.complete(list(p), max_tokens=n, stop_at_eos=False, deadline_s=120, mode=mode,
                       logprobs=k, **extra)
    if "seed" not in extra:
        assert r.token_ids == reference(p, n)
    assert len(r.logprobs) == len(r.token_ids) == n
    with torch.inference_mode():
        logits = hf_model(torch.tensor([list(p) + r.token_ids])).logits[0]
    want = torch.log_softmax(logits[len(p) - 1:-1].float(), dim=-1)
    for j, (t, lp) in enumerate(zip(r.token_ids, r.logprobs)):
        assert abs(lp.logprob - float(want[j, t])) < 1e-4, (j, lp.logprob, float(want[j, t]))
        assert len(lp.top_ids) == k and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        top = torch.topk(want[j], k).values.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top)) < 1e-4, j
        assert max(abs(v - float(want[j, i])) for i, v in zip(lp.top_ids, lp.top_logprobs)) \
            < 1e-4, j


# --- a dispatcher lost mid-stream: the SDK resumes the stream as a continuation ---------------
RESUME_N = 24


async def _start_again(s, name: str, timeout: float = 30.0) -> None:
    """Start a stopped service again; its inproc:// name is free once libzmq has reaped the old
    socket (after its linger), which may take a moment."""
    end = time.monotonic() + timeout
    while True:
        try:
            return await s.start(name)
        except RuntimeError as e:
            if "address already in use" not in str(e) or time.monotonic() > end:
                raise
            await asyncio.sleep(0.1)


def _stop_dispatcher_mid_stream(stack, prompt_ids, **kw):
    """Stream a request, stop the dispatcher after 4 tokens (every request it held dies with it,
    as under kill -9) and start another: the tokens, the Result and the two dispatcher runs."""
    async def go(s):
        first = s.services["dispatcher"]
        async with s.client(heartbeat_s=0.2, link_timeout_s=2.0) as c:
            tokens, indices, stopped = [], [], False
            stream = c.generate(list(prompt_ids), max_tokens=RESUME_N, stop_at_eos=False,
                                deadline_s=120, **kw)
            async for chunk in stream:
                tokens += chunk.token_ids
                indices.append(chunk.index)
                if not stopped and len(tokens) >= 4:
                    stopped = True
                    assert first.requests, "the dispatcher holds no request"
                    await s.stop("dispatcher")
                    await _start_again(s, "dispatcher")
            return tokens, indices, stream, first, s.services["dispatcher"]
    return stack.call(go)


@pytest.mark.parametrize("mode,kw", [
    ("spec", {"policy": "pipesd"}),
    ("cloud-only", {"temperature": 0.8, "seed": 7, "sampling_coupling": "rejection"}),
    ("spec", {"policy": "pipesd", "temperature": 0.8, "seed": 7, "sampling_coupling": "gumbel"})])
def test_a_dispatcher_stopped_mid_stream_is_resumed_exactly(stack, ids, reference, mode, kw):
    """The SDK notices the lost dispatcher (silence, then another run answers), re-submits the
    request with the tokens it holds, and the stream goes on: no duplicate, no gap, the output
    is transformers' (greedy) or the uninterrupted run's (seeded sampling: the continuation's
    draws are keyed by the same absolute positions). Cloud-only greedy across a kill -9 of the
    dispatcher process: tests/integration/test_resume_process.py."""
    if "seed" in kw:
        want = stack.complete(list(ids[1]), max_tokens=RESUME_N, stop_at_eos=False,
                              deadline_s=120, mode=mode, **kw).token_ids
    else:
        want = reference(ids[1], RESUME_N)
    tokens, indices, stream, first, second = _stop_dispatcher_mid_stream(
        stack, ids[1], mode=mode, **kw)
    assert second is not first and second.instance != first.instance   # the fault took effect
    assert stream.resumes == 1 and stream.result.stats.resumes == 1, stream.result.stats
    assert stream.result.stats.continued_from >= 4
    assert len(tokens) == RESUME_N and indices == sorted(set(indices))
    assert tokens == stream.result.token_ids == want


def test_a_continuation_is_checked(stack, ids):
    """resume_ids that leave nothing to generate, fall outside the vocabulary, hold the EOS the
    request stops at, or are over the message limit are refused with a stable code."""
    from common import protocol
    from common.runtime import Peer
    from tests.conftest import error_code

    async def go(s):
        peer = Peer(s.ctx, s.endpoint("dispatcher"), "dispatcher", "test")
        eos = s.services["dispatcher"].eos_token_id

        def req(resume, **kw):
            return protocol.GenerateRequest(token_ids=list(ids[0]), max_tokens=kw.pop("n", 8),
                                            resume_ids=resume, **kw)
        try:
            return [await error_code(peer, m) for m in (
                req([1, 2, 3], n=3), req([10**7]), req([5, eos]), req([1] * 5000, n=6000))]
        finally:
            peer.close()
    assert stack.call(go) == ["bad_field", "bad_field", "bad_field", "too_large"]


# --- constrained output (common/constraint.py) ---------------------------------------------------
# The reference: transformers with llguidance's own mask (tests/conftest.constrained_reference).

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}},
          "required": ["name", "age", "role"]}
PRODUCT = {"type": "object", "additionalProperties": False,
           "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                          "in_stock": {"type": "boolean"},
                          "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                   "maxItems": 2},
                          "price": {"type": "object", "additionalProperties": False,
                                    "properties": {"amount": {"type": "integer", "minimum": 0,
                                                              "maximum": 999},
                                                   "currency": {"enum": ["USD", "EUR"]}},
                                    "required": ["amount", "currency"]}},
           "required": ["sku", "in_stock", "tags", "price"]}
SCHEMA_PROMPTS = [(PERSON, "Give a JSON record for a user named Ada, 36 years old, an admin."),
                  (PRODUCT, "Describe a red mug that costs 12 dollars as JSON.")]
CN = 64


@pytest.fixture(scope="module")
def constrained(tokenizer, constrained_reference):
    """[(schema, prompt ids, the constrained reference)] for SCHEMA_PROMPTS."""
    cases = []
    for schema, text in SCHEMA_PROMPTS:
        chat_text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=False)
        p = tokenizer.encode(chat_text, add_special_tokens=False)
        cases.append((schema, p, constrained_reference(p, schema, CN)))
    return cases


def _valid(tokenizer, schema: dict, token_ids: list[int]) -> None:
    import json

    import jsonschema
    jsonschema.validate(json.loads(tokenizer.decode(token_ids, skip_special_tokens=True)), schema)


@pytest.mark.parametrize("mode,kw", [("cloud-only", {}), ("spec", {"policy": "pipesd"}),
                                     ("spec", {"policy": "tree"}), ("split", {"cut": 8})])
def test_constrained_output_equals_transformers_with_the_mask(stack, tokenizer, constrained,
                                                             mode, kw):
    import json

    from common.protocol import Constraint
    runs = stack.complete_many([(list(p), dict(max_tokens=CN, deadline_s=120, mode=mode,
                                               constraint=Constraint("json_schema",
                                                                     json.dumps(schema)), **kw))
                                for schema, p, _ in constrained])
    for (schema, _, want), r in zip(constrained, runs):
        assert r.token_ids == want
        assert r.finish_reason == "eos"
        _valid(tokenizer, schema, r.token_ids)
        if kw.get("policy") == "pipesd":   # drafted under the mask: the drafts mostly taken
            assert r.stats["draft_tokens"] >= 1 and r.stats["acceptance_rate"] >= 0.5, r.stats
        elif mode == "spec":   # a tree, drafted unmasked: walked on the masked rows
            assert r.stats["draft_tokens"] >= 1, r.stats


def test_unmasked_drafts_are_rejected_and_the_output_stays_exact(stack, tokenizer, constrained,
                                                                monkeypatch):
    """A drafter that drafts without the mask (drafts outside it have p' = 0): the verifier
    rejects them and the output is still the target's constrained decoding."""
    import json

    from common.protocol import Constraint
    from services.drafter.engine import DraftSession
    monkeypatch.setattr(DraftSession, "_masked", lambda self, logits: logits)
    schema, p, want = constrained[1]
    r = stack.complete(list(p), max_tokens=CN, deadline_s=120, mode="spec", policy="vanilla",
                       constraint=Constraint("json_schema", json.dumps(schema)))
    assert r.token_ids == want and r.stats["draft_tokens"] >= 1


def test_a_constraint_the_library_refuses_or_without_eos_is_a_bad_field(stack, ids):
    from common.protocol import Constraint
    from tandem.errors import InvalidRequest
    bad = [(Constraint("json_schema", '{"type": "object", "properties": {"a": {"$ref": '
                                      '"#/nowhere"}}}'), {}),
           (Constraint("regex", "(unclosed"), {}),
           (Constraint("json_object"), {"stop_at_eos": False})]
    for c, kw in bad:
        with pytest.raises(InvalidRequest) as e:
            stack.complete(list(ids[0]), max_tokens=4, constraint=c, **kw)
        assert e.value.field == "constraint", e.value


@pytest.mark.parametrize("mode,kw", [("cloud-only", {}), ("spec", {"policy": "pipesd"}),
                                     ("split", {"cut": 8})])
def test_a_constraint_that_allows_no_token_ends_the_request_with_its_error(stack, ids, mode, kw,
                                                                          monkeypatch):
    """Every service's mask finds no allowed token: the request ends at once with the
    `constraint` error (the drafter drafts unmasked; the target's services refuse)."""
    from common import constraint, protocol
    from common.protocol import Constraint
    from tandem.errors import InvalidRequest

    def nothing_allowed(self):
        raise protocol.ProtocolError(protocol.CONSTRAINT, "the regex constraint allows no next "
                                     "token", field="constraint")
    monkeypatch.setattr(constraint.Matcher, "mask", nothing_allowed)
    with pytest.raises(InvalidRequest) as e:
        stack.complete(list(ids[0]), max_tokens=8, deadline_s=60, mode=mode,
                       constraint=Constraint("regex", "[a-z]+"), **kw)
    assert e.value.code == protocol.CONSTRAINT and "allows no next token" in e.value.message


@pytest.mark.parametrize("mode,role,kw", [("spec", "verifier", {"policy": "pipesd"}),
                                          ("split", "suffix", {"cut": 8})])
def test_a_constrained_session_replayed_mid_output_resumes_its_constraint(
        stack, tokenizer, constrained, mode, role, kw):
    """The replica stops after the first tokens: the replay opens with the output so far, the
    new replica's matcher advances over it, and the output is still the constrained reference.
    (A cloud-only replay opens its verifier session as spec's does: the same code.)"""
    import json

    from common.protocol import Constraint
    schema, p, want = constrained[0]

    async def go(s):
        holding = _holding_new_sessions(s, role)
        async with s.client() as c:
            tokens, stopped = [], None
            async for chunk in c.generate(list(p), mode=mode, max_tokens=CN, deadline_s=120,
                                          constraint=Constraint("json_schema", json.dumps(schema)),
                                          **kw):
                tokens += chunk.token_ids
                if stopped is None and len(tokens) >= 4:
                    stopped = holding()
                    await s.stop(stopped)
            return tokens, c.last_result, stopped
    tokens, result, stopped = stack.call(go)
    try:
        assert tokens == want
        assert result.stats.get("recoveries", 0) >= 1, result.stats
        _valid(tokenizer, schema, tokens)
    finally:
        stack.call(lambda s: s.start(stopped))


def test_constrained_gumbel_sampling_is_the_same_sample_in_every_mode(stack, tokenizer,
                                                                      constrained):
    """Sampled under the Gumbel coupling the token at a position is argmax(log p' + g): with the
    masked p' the same seed gives the same constrained sample in every mode and policy (the
    drafter, the verifier and the suffix all mask)."""
    import json

    from common.protocol import Constraint
    schema, p, _ = constrained[0]
    kw = dict(max_tokens=CN, deadline_s=120, temperature=0.9, seed=11,
              sampling_coupling="gumbel", constraint=Constraint("json_schema", json.dumps(schema)))
    runs = stack.complete_many([(list(p), dict(kw, mode="cloud-only")),
                                (list(p), dict(kw, mode="spec", policy="pipesd")),
                                (list(p), dict(kw, mode="split", cut=8))])
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    if runs[0].finish_reason == "eos":
        _valid(tokenizer, schema, runs[0].token_ids)


def test_a_refusal_from_a_peer_after_admission_names_its_field(stack, ids, monkeypatch):
    """The dispatcher admits a request and a peer then refuses it (here every verifier refuses
    its constraint, as one whose tokenizer cannot compile it would): the client's error keeps
    the field the peer named, so the gateway can blame the right parameter."""
    from common import protocol
    from tandem import InvalidRequest

    async def refuse(msg):
        raise protocol.ProtocolError(protocol.BAD_FIELD, "constraint: refused by this verifier",
                                     field="constraint")
    for n in ("verifier", "verifier-1"):
        monkeypatch.setattr(stack.stack.services[n], "matcher", refuse)
    with pytest.raises(InvalidRequest, match="refused by this verifier") as e:
        stack.complete(ids[0], mode="cloud-only", max_tokens=2, deadline_s=30,
                       constraint=protocol.Constraint("regex", "[a-z]+"))
    assert e.value.field == "constraint", e.value
