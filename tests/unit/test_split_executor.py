"""Split mode in process: the prefix's batched [0, c) passes and the suffix executor running every
scheduler's plans, against transformers' generate(do_sample=False) (the independent reference).

Every cut 1..L-1 runs at once, one session per cut, with mixed prompts, lengths and start steps,
so windows mix cuts, prefills and decode steps. Windows are random groups of the ready sessions
(fifo/interleave: one session per window, as the suffix service runs them)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from common.runner import Segment
from services.prefix.service import run_prefixes
from services.suffix.executor import Item, execute, padded_forward
from services.suffix.planning import SCHEDULERS, Call, Request, RoundRobin, plan_window, validate_plan
from tests.conftest import PROMPTS

N_TOKENS = 8
# interleave, like fifo, runs one session per window: fifo's plan (checked below), so fifo's
# run covers it
CASES = [(s, False) for s in SCHEDULERS if s != "interleave"] + [("exact", True), ("dsb", True)]


@pytest.fixture(scope="module", autouse=True)
def one_thread(hf_model):
    """Reference model on one thread: on a shared 2-core machine two threads wait on each other
    (measured 7-25x slower under load). Restored for the modules that follow."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def runner(target_runner, one_thread):
    return target_runner


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(p) for p in (PROMPTS["plain"], PROMPTS["code"], "1, 2, 3,",
                                          PROMPTS["chat"])]


@dataclass
class Sim:
    sid: str
    prompt: list[int]
    cut: int
    n: int          # tokens to generate
    start: int      # step at which the session opens
    pkv: object = None
    skv: object = None
    x: torch.Tensor | None = None   # hidden state waiting for the suffix
    tokens: list[int] = field(default_factory=list)

    @property
    def done(self):
        return len(self.tokens) >= self.n


def fleet(runner, prompts, cuts):
    L = runner.num_layers
    sims = []
    for i, c in enumerate(cuts):
        s = Sim(f"s{i}", prompts[i % len(prompts)], c, N_TOKENS - i % 3, i % 4)
        s.pkv, s.skv = runner.new_kv(0, c), runner.new_kv(c, L)
        sims.append(s)
    return sims


def simulate(runner, sims, scheduler, padded=False, window=8, seed=0):
    """Drive the sessions step by step; returns the per-window step breakdowns."""
    L = runner.num_layers
    rng, rr = random.Random(seed), RoundRobin()
    if scheduler in ("fifo", "interleave"):
        window = 1
    results, step = [], 0
    while not all(s.done for s in sims):
        edge = [s for s in sims if s.x is None and not s.done and step >= s.start]
        if edge:
            ids = [torch.tensor(s.tokens[-1:] if s.tokens else s.prompt) for s in edge]
            for s, h in zip(edge, run_prefixes(runner, [(s.pkv, x, s.cut) for s, x in zip(edge, ids)])):
                s.x = h
        ready = [s for s in sims if s.x is not None]
        rng.shuffle(ready)
        for k in range(0, len(ready), window):
            group = ready[k:k + window]
            reqs = [Request(s.sid, s.cut, s.x.shape[0], arrival=float(j)) for j, s in enumerate(group)]
            plan = plan_window(scheduler, reqs, L, rr)
            validate_plan(plan, reqs, L)
            res = execute(runner, plan, {s.sid: Item(s.skv, s.x) for s in group}, padded=padded)
            assert res.calls == len(plan)
            results.append(res)
            for s in group:
                s.tokens.append(int(torch.argmax(res.logits[s.sid])))
                s.x = None
        step += 1
    return results


@pytest.fixture(scope="module")
def one_by_one(runner, prompts):
    sims = fleet(runner, prompts, range(1, runner.num_layers))
    simulate(runner, sims, "fifo")
    return sims


def test_fifo_every_cut_equals_transformers(one_by_one, reference, assert_same_tokens):
    for s in one_by_one:
        assert_same_tokens(s.prompt, s.tokens, reference(s.prompt, N_TOKENS)[:s.n],
                           f"fifo cut {s.cut}")


@pytest.mark.parametrize("scheduler,padded", [c for c in CASES if c[0] != "fifo"])
def test_every_cut_every_scheduler_lossless(runner, prompts, one_by_one, reference,
                                            assert_same_tokens, scheduler, padded):
    """All 29 cuts concurrently: equal to transformers and to the one-by-one run."""
    sims = fleet(runner, prompts, range(1, runner.num_layers))
    results = simulate(runner, sims, scheduler, padded=padded, seed=sum(map(ord, scheduler)))
    for s, ref in zip(sims, one_by_one):
        label = f"{scheduler}{' padded' if padded else ''} cut {s.cut}"
        assert_same_tokens(s.prompt, s.tokens, reference(s.prompt, N_TOKENS)[:s.n], label)
        assert_same_tokens(s.prompt, s.tokens, ref.tokens, label + " vs one-by-one")
    merge = sum(r.seconds["merge"] for r in results)
    padded_calls = sum(r.padded_calls for r in results)
    assert (merge > 0) == (padded_calls > 0), "merge time appears exactly when calls run padded"
    if scheduler == "dsb":
        assert (padded_calls > 0) == padded


def test_a_one_session_window_is_planned_alike_by_fifo_and_interleave():
    rr = RoundRobin()
    for cut in (1, 15, 29):
        for rows in (1, 7):
            req = [Request("s", cut, rows)]
            assert plan_window("interleave", req, 30, rr) == plan_window("fifo", req, 30) == \
                [Call(cut, 30, ("s",))]


def test_clustered_and_repeated_cuts(runner, prompts, reference, assert_same_tokens):
    """Many sessions on few cuts (DySCo's clustered fleets): same-cut rows share calls."""
    cuts = [10] * 7 + [2] + [4, 4, 4, 4, 12, 12, 12, 12]
    for scheduler, padded in (("exact", True), ("dsb", True), ("cascade", False)):
        sims = fleet(runner, prompts, cuts)
        simulate(runner, sims, scheduler, padded=padded, seed=3)
        for s in sims:
            assert_same_tokens(s.prompt, s.tokens, reference(s.prompt, N_TOKENS)[:s.n],
                               f"{scheduler} clustered cut {s.cut}")


def test_padded_call_matches_ragged_call(runner):
    """The padded (DySCo prototype) call computes what the runner computes, and leaves each
    session's cache exactly as a ragged call would."""
    torch.manual_seed(0)
    L = runner.num_layers
    lens = [3, 17, 9, 1]
    prompts = [torch.randn(n, runner.hidden_size) for n in lens]
    step = [torch.randn(1, runner.hidden_size) for _ in lens]
    pads = [runner.new_kv(5, L) for _ in lens]
    rags = [runner.new_kv(5, L) for _ in lens]
    for p, a, b in zip(prompts, pads, rags):
        runner.forward([Segment(a, p)], 5, L)
        runner.forward([Segment(b, p)], 5, L)
    outs, merge_s, _ = padded_forward(runner, pads, step, 5, 12)
    want = runner.forward([Segment(kv, x) for kv, x in zip(rags, step)], 5, 12)
    for o, w in zip(outs, want):
        rel = ((o - w).norm() / w.norm()).item()
        assert rel < 1e-5, rel
    assert merge_s > 0
    for a, b in zip(pads, rags):
        assert [a.length(l) for l in range(5, 12)] == [b.length(l) for l in range(5, 12)]
        for l in range(5, 12):
            n = a.length(l)
            ka, kb = a.bufs[l - 5][:, :, :n], b.bufs[l - 5][:, :, :n]
            assert ((ka - kb).abs().max() / kb.abs().max()).item() < 1e-5


def test_execute_refuses_an_incomplete_plan(runner):
    L = runner.num_layers
    kv = runner.new_kv(4, L)
    with pytest.raises(ValueError, match="did not bring"):
        execute(runner, [Call(4, 10, ("a",))], {"a": Item(kv, torch.zeros(1, runner.hidden_size))})


def test_step_breakdown_dsb_vs_cascade(runner):
    """DSB runs private [c, d) ranges then a shared tail; cascade has no merge phase and runs
    fewer layer passes (each layer once per step)."""
    L = runner.num_layers
    cuts = [2, 3, 4, 5, 6, 7, 8, 9]
    seen = {}
    for scheduler, padded in (("dsb", True), ("cascade", False)):
        torch.manual_seed(1)
        items = {}
        for i, c in enumerate(cuts):
            kv = runner.new_kv(c, L)
            runner.forward([Segment(kv, torch.randn(12, runner.hidden_size))], c, L)
            items[f"s{i}"] = Item(kv, torch.randn(1, runner.hidden_size))
        plan = plan_window(scheduler, [Request(s, c) for s, c in zip(items, cuts)], L)
        res = execute(runner, plan, items, padded=padded)
        seen[scheduler] = res
        assert res.seconds["shared"] > 0 and res.seconds["private"] > 0
    assert seen["dsb"].seconds["merge"] > 0 and seen["dsb"].padded_calls == 1  # the tail
    assert seen["cascade"].seconds["merge"] == 0 and seen["cascade"].padded_calls == 0
    # same sessions, same hidden states in: same greedy tokens out
    for s in seen["dsb"].logits:
        assert torch.argmax(seen["dsb"].logits[s]) == torch.argmax(seen["cascade"].logits[s])
