"""bench/tuning.py: the BO is told TPT relative to the default knobs on the same prompts, so how
hard an evaluation's prompt is does not choose the knobs."""

from __future__ import annotations

import random

from bench.tuning import DEFAULTS, PolicyTuner

DEFAULT_N = DEFAULTS["vanilla"]["n"]   # 8


def slowdown(n: int) -> float:
    """A knob's own effect: vanilla's draft length n, best at 20."""
    return 1.0 + ((n - 20) / 12) ** 2


def tuned_n(prompt_seed: int, with_control: bool) -> tuple[int, list[dict]]:
    """16 evaluations, each on its own prompt: TPT = the prompt's difficulty (log-normal, σ 0.5)
    x the knob's slowdown; the control is the default knobs on the same prompt."""
    rng = random.Random(prompt_seed)
    t = PolicyTuner("vanilla", budget=16, seed=0)
    while not t.done:
        difficulty = rng.lognormvariate(0.0, 0.5)
        n = t.ask()["n"]
        t.tell(difficulty * slowdown(n), difficulty * slowdown(DEFAULT_N) if with_control else None)
    res = t.result()
    return res.knobs["n"], res.evaluations


def test_the_control_takes_the_prompt_out_of_the_choice():
    controlled = [tuned_n(s, with_control=True) for s in range(3)]
    for s, (n, evaluations) in enumerate(controlled):
        assert abs(n - 20) <= 2, f"prompts {s}: chose n={n}; the knob's best is 20"
        assert evaluations[0]["knobs"] == {"n": DEFAULT_N}
        assert all(e["control_ms"] > 0 for e in evaluations)
    # the same knobs evaluated whatever the prompts: each draw is the same BO run
    assert len({tuple(e["knobs"]["n"] for e in ev) for _, ev in controlled}) == 1
    # What the control is for: told plain TPT, the same BO on the same prompts lets an easy
    # prompt choose, for some of these prompt draws far from the best n.
    plain = [tuned_n(s, with_control=False) for s in range(3)]
    assert all(e["control_ms"] is None for _, ev in plain for e in ev)
    assert max(abs(n - 20) for n, _ in plain) > 5, [n for n, _ in plain]
