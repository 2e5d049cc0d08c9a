"""Split mode's prefix caches and KV budgets (common/prefix_cache.py in the prefix and the suffix,
the open in services/dispatcher/split_mode.py), through the in-process stack: a later turn
reuses the earlier turn's rows on both sides, only for the cut they were computed at, with
output equal to transformers' and to a run without the cache, reported as `cached_tokens`; a
suffix holding fewer rows than the prefix makes the prefix compute from there; a prompt over a
budget is `too_large` naming the limit, and a full budget refuses new sessions with `busy`
while the admitted ones finish."""

from __future__ import annotations

import asyncio

import pytest

from common import protocol

N = 8


@pytest.fixture(scope="module")
def stack(default_stack):
    if not default_stack.stack.services["suffix"].kv_cache.enabled:
        pytest.skip("the runner's kernels are not built here: split mode caches nothing")
    return default_stack


def _caches(stack):
    return stack.stack.services["prefix"].kv_cache, stack.stack.services["suffix"].kv_cache


def _clear(stack):
    for c in _caches(stack):
        c.clear()


async def _until(ready, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if ready():
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("the services kept their sessions")


def _gen(stack, prompt_ids, cut, max_tokens=N):
    r = stack.complete(list(prompt_ids), mode="split", cut=cut, max_tokens=max_tokens,
                       stop_at_eos=False, deadline_s=120)
    # a finished session's rows are cached when each side drops it (the dispatcher's Close)
    services = [stack.stack.services[n] for n in ("prefix", "suffix")]
    stack.call(lambda _: _until(lambda: not any(s.sessions.ids() for s in services)))
    return r


def test_later_turns_reuse_both_sides_rows_for_their_own_cut_exactly(stack, tokenizer, reference,
                                                                     assert_same_tokens):
    _clear(stack)
    turn1 = tokenizer.encode("The printing press spread across Europe within decades; each "
                             "city that took it up saw books fall in price and")
    first = _gen(stack, turn1, cut=4)
    assert first.stats["cached_tokens"] == 0
    turn2 = turn1 + first.token_ids + tokenizer.encode(" Next,")
    want2 = list(reference(tuple(turn2), N))
    # rows of layers [0, 4) and [4, L) are not a session at cut 8's: nothing reused
    other_cut = _gen(stack, turn2, cut=8)
    assert other_cut.stats["cached_tokens"] == 0
    assert_same_tokens(turn2, other_cut.token_ids, want2, "turn 2, cut 8, no rows for it")
    hit = _gen(stack, turn2, cut=4)
    # the prompt and the answer (but its last token: never fed) were cached on both sides
    assert hit.stats["cached_tokens"] == len(turn1) + N - 1
    assert hit.token_ids == other_cut.token_ids
    assert_same_tokens(turn2, hit.token_ids, want2, "turn 2, cut 4, cached")
    # turn 3 at cut 8 extends the cut-8 run of turn 2
    turn3 = turn2 + other_cut.token_ids + tokenizer.encode(" Then")
    third = _gen(stack, turn3, cut=8)
    assert third.stats["cached_tokens"] == len(turn2) + N - 1
    assert_same_tokens(turn3, third.token_ids, list(reference(tuple(turn3), N)), "turn 3, cut 8")
    _clear(stack)
    assert _gen(stack, turn3, cut=8).token_ids == third.token_ids


def test_a_suffix_holding_fewer_rows_makes_the_prefix_compute_from_there(stack, tokenizer,
                                                                         reference,
                                                                         assert_same_tokens):
    _clear(stack)
    _, suffix = _caches(stack)
    turn1 = tokenizer.encode("Rivers carve valleys over millions of years, and the water")
    first = _gen(stack, turn1, cut=6)
    held = (dict(suffix.entries), suffix.cached_bytes)   # the suffix's rows of turn 1 only
    turn2 = turn1 + first.token_ids + tokenizer.encode(" Later")
    second = _gen(stack, turn2, cut=6)
    assert second.stats["cached_tokens"] == len(turn1) + N - 1
    suffix.clear()   # the suffix forgets turn 2 (another replica, evicted): it holds turn 1
    suffix.entries.update(held[0])
    suffix.cached_bytes = held[1]
    turn3 = turn2 + second.token_ids + tokenizer.encode(" So")
    third = _gen(stack, turn3, cut=6)
    # the prefix held turn 2's rows, the suffix turn 1's: both reused turn 1's
    assert third.stats["cached_tokens"] == len(turn1) + N - 1
    assert_same_tokens(turn3, third.token_ids, list(reference(tuple(turn3), N)), "fallback")


def _with_budget(stack, role, rows, cut):
    """Set `role`'s KV budget to `rows` tokens of a session at `cut`; returns the old one."""
    c = stack.stack.services[role].kv_cache
    layers = cut if role == "prefix" else c.runner.num_layers - cut
    old, c.budget = c.budget, rows * layers * c.layer_bytes
    return old


@pytest.mark.parametrize("role", ["prefix", "suffix"])
def test_a_prompt_over_the_budget_is_too_large_naming_the_limit(stack, role):
    from tandem.errors import TandemError

    c = stack.stack.services[role].kv_cache
    old = _with_budget(stack, role, 70, cut=5)
    try:
        with pytest.raises(TandemError) as e:
            _gen(stack, list(range(300, 380)), cut=5)
    finally:
        c.budget = old
    assert e.value.code == protocol.TOO_LARGE
    assert f"{role}'s whole kv_budget_bytes" in str(e.value) and "70 tokens" in str(e.value)


def test_a_full_suffix_budget_refuses_busy_and_admitted_sessions_finish(stack, tokenizer,
                                                                        reference,
                                                                        assert_same_tokens):
    from tandem.errors import Busy

    suffix = stack.stack.services["suffix"]
    _clear(stack)
    old = _with_budget(stack, "suffix", 100, cut=5)   # one session (64 rows at least) at a time
    a = tokenizer.encode("Budgets: the first conversation starts here and")
    b = tokenizer.encode("Budgets: another conversation starts over there and")
    try:
        async def both(s):
            async with s.client(max_retries=0) as cl:
                long = asyncio.ensure_future(cl.complete(a, mode="split", cut=5, max_tokens=30,
                                                         stop_at_eos=False, deadline_s=120))
                await _until(lambda: suffix.sessions.ids())
                try:
                    await cl.complete(b, mode="split", cut=5, max_tokens=N, deadline_s=120)
                    refused = None
                except Busy as e:
                    refused = e
                return await long, refused
        done, refused = stack.call(both)
    finally:
        suffix.kv_cache.budget = old
    assert refused is not None and "suffix KV budget full" in str(refused)
    assert len(done.token_ids) == 30
    assert_same_tokens(a, done.token_ids, list(reference(tuple(a), 30)), "admitted")
