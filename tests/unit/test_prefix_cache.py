"""The prefix cache and KV budget (common/prefix_cache.py): what is matched, per space,
kept, evicted and refused (on a toy cache), that reused rows give the logits a full prefill gives
bit for bit (the real runner), and through the in-process stack that a later turn reuses an
earlier turn's prompt and answer with output unchanged and equal to transformers', in cloud-only
and speculative mode, reported as `cached_tokens`."""

from __future__ import annotations

import pytest
import torch

from common import protocol
from common.protocol import ProtocolError
from common.runner import SessionKV
from common.prefix_cache import PrefixCache


class ToyRunner:
    """The shape of a runner, for the cache's bookkeeping: 2 layers of 1 x 8 K/V (128 B a row)."""
    num_layers, kv_heads, head_dim, dtype = 2, 1, 8, torch.float32
    lo, hi = 0, 2

    def new_kv(self, lo=0, hi=2):
        return SessionKV(lo, hi, 1, 8, torch.float32)


ROW = 128


def finished(tokens: list[int]) -> SessionKV:
    """A session's KV whose row i holds token i's id (so a copied row says where it came from)."""
    kv = ToyRunner().new_kv()
    kv.reserve(0, 2, len(tokens))
    for buf in kv.bufs:
        buf[:, :, : len(tokens)] = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None]
    kv.lens = [len(tokens)] * 2
    return kv


def test_a_prompt_gets_the_longest_cached_prefix_and_computes_its_last_token():
    c = PrefixCache(ToyRunner(), 1 << 20, enabled=True)
    c.put([1, 2, 3, 4, 5], finished([1, 2, 3, 4, 5]), 5)
    c.put([1, 2, 9], finished([1, 2, 9]), 3)
    kv, hit = c.open([1, 2, 3, 4, 7, 8], 10, live_bytes=0)
    assert hit == 4 and kv.length() == 4
    assert kv.bufs[1][0, 0, :4, 0].tolist() == [1, 2, 3, 4]
    _, hit = c.open([1, 2, 3, 4, 5], 10, live_bytes=0)
    assert hit == 4   # all five are cached, the last is computed anyway: its logits answer
    assert c.open([5, 1, 2], 10, live_bytes=0)[1] == 0


def test_a_longer_turn_replaces_the_one_it_extends():
    c = PrefixCache(ToyRunner(), 1 << 20, enabled=True)
    c.put([1, 2, 3], finished([1, 2, 3]), 3)
    c.put([1, 2, 3, 4, 5], finished([1, 2, 3, 4, 5]), 5)
    c.put([1, 2], finished([1, 2]), 2)   # held already
    assert [e.tokens.tolist() for e in c.entries.values()] == [[1, 2, 3, 4, 5]]
    assert c.cached_bytes == 5 * ROW


def test_the_budget_evicts_least_recently_used_then_refuses_busy():
    c = PrefixCache(ToyRunner(), 400 * ROW, enabled=True)
    c.put(list(range(100)), finished(list(range(100))), 100)
    c.put(list(range(500, 560)), finished(list(range(500, 560))), 60)
    c.open(list(range(50)) + [999], 1, live_bytes=0)     # touches the first entry
    # 102 rows beside 150 live and 160 cached: the least recently used entry goes
    kv, hit = c.open(list(range(100)) + [7], 1, live_bytes=150 * ROW)
    assert hit == 100 and [len(e.tokens) for e in c.entries.values()] == [100]
    assert c.cached_bytes == 100 * ROW
    with pytest.raises(ProtocolError) as e:
        c.open([3, 4, 5], 150, live_bytes=300 * ROW)
    assert e.value.code == protocol.BUSY and "retry" in str(e.value)
    assert len(c.entries) == 1   # a refused session evicts nothing
    c.open([3, 4, 5], 150, live_bytes=200 * ROW)
    assert not c.entries         # an admitted one evicts what it needs


def test_a_prompt_over_the_whole_budget_is_too_large_naming_the_limit():
    c = PrefixCache(ToyRunner(), 70 * ROW, enabled=True)
    with pytest.raises(ProtocolError) as e:
        c.open(list(range(71)), 1, live_bytes=0)
    assert e.value.code == protocol.TOO_LARGE and e.value.field == "token_ids"
    assert "kv_budget_bytes" in str(e.value) and "70 tokens" in str(e.value)
    with pytest.raises(ValueError, match="at least 64"):
        PrefixCache(ToyRunner(), 63 * ROW, enabled=True)


def test_rows_serve_only_sessions_of_their_own_space_and_reuse_is_capped():
    c = PrefixCache(ToyRunner(), 1 << 20, enabled=True)
    upper = SessionKV(1, 2, 1, 8, torch.float32)     # layer [1, 2) only: a suffix at cut 1
    upper.reserve(1, 2, 5)
    upper.bufs[0][:, :, :5] = torch.arange(5.0)[None, None, :, None]
    upper.lens = [5]
    c.put([1, 2, 3, 4, 5], upper, 5, tag="edge-a")
    c.put([1, 2, 3], finished([1, 2, 3]), 3)          # layers [0, 2), no tag
    assert c.open([1, 2, 3, 4, 5, 6], 4, 0, c.space(1, 2, "edge-b"))[1] == 0
    assert c.open([1, 2, 3, 4, 5, 6], 4, 0, c.space(0, 2))[1] == 3
    kv, hit = c.open([1, 2, 3, 4, 5, 6], 4, 0, c.space(1, 2, "edge-a"))
    assert hit == 5 and (kv.lo, kv.hi) == (1, 2) and kv.bufs[0][0, 0, :5, 0].tolist() == [0, 1, 2, 3, 4]
    assert c.open([1, 2, 3, 4, 5, 6], 4, 0, c.space(1, 2, "edge-a"), reuse=2)[1] == 2
    # fewer rows than the caller needs: nothing admitted, how many there are said
    assert c.open([1, 2, 3, 4, 9], 4, 0, c.space(0, 2), reuse=4, need=4) == (None, 3)
    assert len(c.entries) == 2   # one per space: neither extends the other


def test_a_disabled_cache_keeps_nothing_but_still_budgets():
    c = PrefixCache(ToyRunner(), 100 * ROW, enabled=False)
    c.put([1, 2, 3], finished([1, 2, 3]), 3)
    assert not c.entries and c.open([1, 2, 3], 1, live_bytes=0)[1] == 0
    with pytest.raises(ProtocolError):
        c.open([1, 2, 3], 1, live_bytes=90 * ROW)


# --- through the in-process stack -------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(default_stack):
    return default_stack


def test_reused_rows_give_a_full_prefills_logits_bits(stack, tokenizer):
    from common.runner import Segment

    runner = stack.stack.services["verifier"].runner   # idle between requests: ours to use
    if not runner.chunk_invariant:
        pytest.skip("the runner's kernels are not built here")
    L = runner.num_layers
    turn1 = tokenizer.encode("The printing press spread across Europe within decades, and")
    turn2 = turn1 + tokenizer.encode(" books fell in price while literacy rose in every city")
    c = PrefixCache(runner, 1 << 30, enabled=True)
    kv = runner.new_kv()
    runner.forward([Segment(kv, torch.tensor(turn1))], 0, L)
    c.put(turn1, kv, kv.length())
    kv_hit, hit = c.open(turn2, 4, live_bytes=0)
    assert hit == len(turn1)
    got = runner.forward([Segment(kv_hit, torch.tensor(turn2[hit:]), "all")], 0, L)[0]
    full = runner.forward([Segment(runner.new_kv(), torch.tensor(turn2), "all")], 0, L)[0]
    assert torch.equal(got, full[hit:])


N = 12


def _gen(stack, prompt_ids, mode):
    r = stack.complete(list(prompt_ids), mode=mode, max_tokens=N, stop_at_eos=False, deadline_s=120)
    verifier = stack.stack.services["verifier"]
    # a finished session's rows are cached when the verifier drops it (the dispatcher's Close)
    stack.call(lambda _: _until(lambda: not verifier.sessions.ids()))
    return r


async def _until(ready, timeout=10.0):
    import asyncio

    for _ in range(int(timeout / 0.02)):
        if ready():
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("the verifier kept its sessions")


def _drafter_cache_hits() -> float:
    from common import metrics

    return metrics.PROMPT_CACHE.labels("drafter", "hit")._value.get()


@pytest.mark.parametrize("mode", ["cloud-only", "spec"])
def test_a_later_turn_reuses_the_earlier_turn_exactly(stack, tokenizer, reference,
                                                      assert_same_tokens, mode):
    verifier = stack.stack.services["verifier"]
    if not verifier.kv_cache.enabled:
        pytest.skip("the runner's kernels are not built here")
    turn1 = tokenizer.encode(f"[{mode}] The printing press spread across Europe within decades;"
                             " each city that took it up saw books fall in price and")
    verifier.kv_cache.clear()
    first = _gen(stack, turn1, mode)
    assert first.stats["cached_tokens"] == 0
    turn2 = turn1 + first.token_ids + tokenizer.encode(" Next,")
    drafter_hits = _drafter_cache_hits()
    hit = _gen(stack, turn2, mode)
    # the prompt and the answer (but its last token: never fed) were cached
    assert hit.stats["cached_tokens"] >= len(turn1) + N - 1
    if mode == "spec":   # and the drafter's pooled context held them, but for the answer's
        # last draft and the target's last token, which the request ended before it evaluated
        assert _drafter_cache_hits() - drafter_hits >= len(turn1) + N - 2
    verifier.kv_cache.clear()
    miss = _gen(stack, turn2, mode)
    assert miss.stats["cached_tokens"] == 0
    assert hit.token_ids == miss.token_ids
    assert_same_tokens(turn2, hit.token_ids, reference(turn2, N), mode)


def test_a_tight_budget_evicts_then_refuses_busy_and_never_fails_a_running_session(
        stack, tokenizer):
    import asyncio

    from tandem.errors import Busy

    verifier = stack.stack.services["verifier"]
    c = verifier.prefix_cache()
    budget, c.budget = c.budget, 0
    try:
        evicted = _evictions()
        verifier.prefix_cache().clear()
        a = tokenizer.encode("Budgets: the first conversation starts here and")
        b = tokenizer.encode("Another conversation, on budgets, starts over there and")
        # room for one session (64 rows reserved at least) and the copy of its rows, never two
        c.budget = 100 * c.row_bytes
        first = _gen(stack, a, "cloud-only")          # cached when it ends
        assert c.entries
        second = _gen(stack, b, "cloud-only")         # its copy evicts the first's rows
        assert _evictions() > evicted
        assert second.stats["cached_tokens"] == 0 and len(second.token_ids) == N

        async def both(s):
            async with s.client(max_retries=0) as cl:
                long = asyncio.ensure_future(cl.complete(a, mode="cloud-only", max_tokens=40,
                                                         stop_at_eos=False, deadline_s=120))
                await _until(lambda: verifier.sessions.ids())
                try:
                    await cl.complete(b, mode="cloud-only", max_tokens=N, deadline_s=120)
                    refused = None
                except Busy as e:
                    refused = e
                return await long, refused
        done, refused = stack.call(both)
        assert refused is not None and "KV budget" in str(refused)
        # the admitted session ran to the end, its output exact (greedy: it extends the first)
        assert len(done.token_ids) == 40 and done.token_ids[:N] == first.token_ids
    finally:
        c.budget = budget


def test_a_full_prefill_queue_answers_busy_with_its_wait_as_retry_after(stack, tokenizer):
    """A session refused for the prompt work queued ahead of it (the verifier's max_queue_s)
    hears how long that work takes: the verifier's estimate reaches the SDK's Busy as
    retry_after_s, through the dispatcher."""
    import asyncio

    from tandem.errors import Busy

    verifier = stack.stack.services["verifier"]
    _gen(stack, tokenizer.encode("One request first, so the prefill rate is measured, and"),
         "cloud-only")
    assert verifier.prefill_rate > 0
    words = "The queue ahead holds a long prompt of many words, chunk after chunk, and "
    long = tokenizer.encode(words * 60)[:1200]

    async def both(s):
        async with s.client(max_retries=0) as cl:
            first = asyncio.ensure_future(cl.complete(long, mode="cloud-only", max_tokens=2,
                                                      deadline_s=120))
            await _until(lambda: verifier.sessions.ids())
            try:
                await cl.complete(tokenizer.encode("Behind it, a short one"), mode="cloud-only",
                                  max_tokens=2, deadline_s=120)
                refused = None
            except Busy as e:
                refused = e
            await first
            return refused
    limit, verifier.cfg.max_queue_s = verifier.cfg.max_queue_s, 1e-3
    try:
        refused = stack.call(both)
    finally:
        verifier.cfg.max_queue_s = limit
    assert refused is not None and "prefill queue full" in str(refused)
    assert 0 < refused.retry_after_s < 60, refused.retry_after_s


def _evictions() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("tandem_kv_evictions_total", {"service": "verifier"}) or 0.0


def test_a_finished_sessions_copy_is_made_within_the_budget_beside_its_own_buffers():
    """Copying a finished session's rows needs room for the copy while the session's buffers
    and the other live sessions still hold theirs: older entries make it, or nothing is kept."""
    c = PrefixCache(ToyRunner(), 300 * ROW, enabled=True)
    c.put(list(range(100)), finished(list(range(100))), 100)
    assert c.cached_bytes == 100 * ROW
    c.put(list(range(200, 300)), finished(list(range(200, 300))), 100, live_bytes=100 * ROW)
    assert [e.tokens[0] for e in c.entries.values()] == [200]   # the older entry made room
    c.put(list(range(400, 500)), finished(list(range(400, 500))), 100, live_bytes=150 * ROW)
    assert not c.entries and c.cached_bytes == 0     # 150 live + 100 own + 100 copy > 300
