"""`tandem bench chat`'s pure parts: MT-Bench conversations, the no-cache stack's flags, and the
rows and goals computed from per-turn samples."""

from __future__ import annotations

import pytest

from bench import bench_chat, workloads


def test_conversations_are_mtbench_turns_in_order():
    rows = workloads.mtbench_questions()
    two = bench_chat.conversations(2, 3)
    assert [turns for _, turns in two] == [r["turns"] for r in rows[:3]]
    six = bench_chat.conversations(6, 2)
    assert [len(turns) for _, turns in six] == [6, 6]
    assert six[1][1] == [t for r in rows[3:6] for t in r["turns"]]
    assert six[0][0] == "+".join(f"mtbench/{r['question_id']}" for r in rows[:3])


def test_the_no_cache_stack_turns_off_every_services_cache():
    flags = bench_chat.cache_settings()
    assert flags["verifier"] == ["--prefix-cache", "false"]
    assert flags["drafter"] == ["--context-pool", "0"]
    assert "dispatcher" not in flags


def _turn(ttft_s, prompt, cached, answer="a"):
    return {"ttft_s": ttft_s, "prompt_tokens": prompt, "cached_tokens": cached, "answer": answer}


def test_rows_pair_the_same_conversations_and_check_the_goal():
    samples = {("cloud-only", "cache"): [[_turn(0.4, 50, 0), _turn(0.1, 100, 80)],
                                         [_turn(0.5, 60, 0), _turn(0.2, 120, 90)]],
               ("cloud-only", "no cache"): [[_turn(0.4, 50, 0), _turn(0.6, 100, 0)],
                                            [_turn(0.5, 60, 0), _turn(0.6, 120, 0, "b")]]}
    rows = bench_chat.result_rows(samples, ["cloud-only"], 2)
    second = rows[1]
    assert second["turn"] == 2 and second["n"] == 2
    assert second["ttft_ratio"] == pytest.approx(0.3 / 1.2)
    assert second["cached_fraction"] == pytest.approx((0.8 + 0.75) / 2)
    assert second["same_answers"] is False and rows[0]["same_answers"] is True
    (line,) = bench_chat.goals(rows, 2)
    assert line.startswith("cloud-only: turn-2 TTFT with the cache 0.25x")
    assert line.endswith(": met (goal <= 0.35x)")
