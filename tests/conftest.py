"""Shared fixtures: the bundled models, transformers as the independent reference, and real
service clusters on loopback."""

from __future__ import annotations

import functools
import os
import warnings

# Test processes and the services they start share two cores: OpenMP's default spin-waiting
# makes every forward 5-10x slower under that contention (measured by the runner's tests).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from bench.workloads import BUILTIN_PROMPTS
from common import models

NEAR_TIE = 1e-4   # DESIGN.md §5: a top-2 logit margin under this is a floating-point tie

PROMPTS = BUILTIN_PROMPTS   # shipped in the package: `tandem bench` must not need tests/


def long_prompt(tokenizer, n_tokens: int = 1100) -> list[int]:
    """A ≥1000-token prompt written for this project (no data set needed)."""
    para = ("Tandem serves one language model across an edge device and a cloud server. "
            "The edge drafts tokens with a small model, the cloud verifies them in one pass, "
            "and the output is exactly what the large model alone would have written. ")
    ids: list[int] = []
    k = 0
    while len(ids) < n_tokens:
        k += 1
        ids = tokenizer.encode(" ".join(f"Section {j}. {para}" for j in range(k)) + "\nSummary:")
    return ids


@pytest.fixture(scope="session")
def model_paths() -> models.ModelPaths:
    return models.prepare_all()


@pytest.fixture(scope="session")
def tokenizer(model_paths):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_paths.target))


@pytest.fixture(scope="session")
def hf_model(model_paths):
    """transformers' own model: the independent reference for every losslessness test."""
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    m = AutoModelForCausalLM.from_pretrained(str(model_paths.target), dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="session")
def reference(hf_model):
    """reference(prompt_ids, n) -> transformers' generate(do_sample=False) continuation."""
    @functools.lru_cache(maxsize=None)
    def greedy(prompt_ids: tuple[int, ...], n: int, eos: bool = False) -> tuple[int, ...]:
        ids = torch.tensor([list(prompt_ids)])
        kw = {} if eos else {"eos_token_id": None}
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    min_new_tokens=0 if eos else n, do_sample=False,
                                    pad_token_id=hf_model.config.eos_token_id, **kw)
        return tuple(out[0, len(prompt_ids):].tolist())

    def call(prompt_ids, n, eos=False):
        return list(greedy(tuple(prompt_ids), n, eos))
    return call


@pytest.fixture(scope="session")
def assert_same_tokens(hf_model):
    """Compare generated tokens with the reference; a difference is allowed only at a near-tie
    of the reference (top-2 margin < 1e-4), which is reported, and ends the comparison."""
    ties: list[str] = []

    def check(prompt_ids, got, want, label=""):
        for i, (g, w) in enumerate(zip(got, want)):
            if g == w:
                continue
            ids = torch.tensor([list(prompt_ids) + list(want[:i])])
            with torch.inference_mode():
                logits = hf_model(ids).logits[0, -1]
            top2 = torch.topk(logits, 2).values
            margin = float(top2[0] - top2[1])
            assert margin < NEAR_TIE, (f"{label}: token {i} differs ({g} vs reference {w}); "
                                       f"reference margin {margin:.3g} is no tie")
            ties.append(f"{label}: near-tie at token {i}, margin {margin:.2e}")
            warnings.warn(ties[-1])
            return
        assert len(got) == len(want), f"{label}: {len(got)} tokens vs reference {len(want)}"
    check.ties = ties
    return check


def readyz(http_port: int) -> tuple[int, str]:
    """(status, body) of a service's /readyz: 200 "ready", or 503 with why it is not."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=5) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()
