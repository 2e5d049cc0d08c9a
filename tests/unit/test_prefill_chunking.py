"""The verifier's step planning: a long prompt is chunked to the step's token budget
and planned after every session already decoding, so it delays their decode steps by at most
one chunk; no processes, no model."""

from __future__ import annotations

from types import SimpleNamespace

from services.verifier.engine import CloudSession
from services.verifier.service import Verifier


def cloud(sid: str, prompt: list[int], generated: list[int] = ()) -> CloudSession:
    req = SimpleNamespace(token_ids=prompt, sampling=None, max_tokens=100, eos_token_id=None,
                          logprobs=None)
    s = CloudSession(sid, b"", 0, 0, kv=None, req=req)
    s.generated = list(generated)
    return s


def plan(budget: int, sessions: list[CloudSession]):
    fake = SimpleNamespace(cfg=SimpleNamespace(max_batch_tokens=budget, max_batch_sessions=64),
                           sessions={s.sid: s for s in sessions})
    return Verifier.plan_step(fake)


def test_a_long_prompt_first_in_line_leaves_decoders_their_step():
    long_prompt = cloud("p", list(range(5000)))
    decoders = [cloud(f"d{i}", [7], generated=[7]) for i in range(3)]
    step = plan(512, [long_prompt, *decoders])
    planned = {s.sid: w for s, w in step}
    assert set(planned) == {"p", "d0", "d1", "d2"}
    assert all(planned[f"d{i}"].token_ids == [7] and planned[f"d{i}"].phase == "decode"
               for i in range(3))
    # the prompt takes what the decoders leave, as one chunk with no logits
    assert len(planned["p"].token_ids) == 512 - 3 and planned["p"].logits == "none"
    assert sum(len(w.token_ids) for _, w in step) == 512


def test_decoders_filling_the_budget_defer_the_prompt():
    long_prompt = cloud("p", list(range(600)))
    decoders = [cloud(f"d{i}", [7], generated=[7]) for i in range(4)]
    step = plan(4, [long_prompt, *decoders])
    assert [s.sid for s, _ in step] == ["d0", "d1", "d2", "d3"]


def test_prompts_keep_arrival_order_among_themselves():
    a, b = cloud("a", list(range(300))), cloud("b", list(range(300)))
    step = plan(512, [a, b])
    assert [(s.sid, len(w.token_ids)) for s, w in step] == [("a", 300), ("b", 212)]
