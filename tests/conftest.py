"""Shared fixtures: the bundled models, transformers as the independent reference, and real
service clusters on loopback."""

from __future__ import annotations

import functools
import os
import time
import urllib.error
import urllib.request
import warnings

# Test processes and the services they start share two cores: OpenMP's default spin-waiting
# makes every forward 5-10x slower under that contention (measured by the runner's tests).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from bench.workloads import BUILTIN_PROMPTS
from common import models, protocol

NEAR_TIE = 1e-4   # DESIGN.md §5: a top-2 logit margin under this is a floating-point tie

PROMPTS = BUILTIN_PROMPTS   # shipped in the package: `tandem bench` must not need tests/

# Modules whose assertions need the machine to themselves: delays measured through the WAN
# emulator, replica balance and memory under load, a supervisor's backoff, processes killed and
# restarted against their timeouts, a live Prometheus' scrapes. scripts/test.sh runs them alone
# after everything else, which runs on two workers, a module per worker (test_cli's `tandem up`
# holds the default ports, which no other module binds). The link chaos and partition modules
# run with the rest: they spend their time waiting out faults, and what they assert of time is
# a lower bound a loaded machine cannot break (a partition silences the streams at least its
# length, a deadline ends a request no sooner than it passes).
SERIAL_MODULES = {"test_wan", "test_faults", "test_load", "test_replicas_process",
                  "test_replicas_launcher", "test_runtime", "test_api_curve",
                  "test_observability"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


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


class LLGuidanceProcessor:
    """A transformers LogitsProcessor on llguidance's own matcher (not Tandem's wrapper,
    common/constraint.py): the scores outside its mask set to -inf at every step."""

    def __init__(self, tokenizer, grammar: str, prompt_len: int, vocab: int):
        import llguidance
        import llguidance.hf

        self.m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab),
                                      grammar)
        self.prompt_len, self.vocab = prompt_len, vocab

    def __call__(self, input_ids, scores):
        import numpy as np

        out = input_ids[0, self.prompt_len:].tolist()
        if out:
            assert self.m.consume_token(out[-1]), self.m.get_error()
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)
        return scores.masked_fill(~torch.from_numpy(allowed)[None, :scores.shape[-1]],
                                  float("-inf"))


@pytest.fixture(scope="session")
def constrained_reference(hf_model, tokenizer):
    """constrained_reference(prompt_ids, schema, n) -> transformers' generate(do_sample=False)
    under a JSON schema (a dict; or {"regex": pattern}), up to its EOS included."""
    import json

    import llguidance
    from transformers import LogitsProcessorList

    @functools.lru_cache(maxsize=None)
    def run(prompt_ids: tuple[int, ...], spec: str, n: int) -> tuple[int, ...]:
        schema = json.loads(spec)
        grammar = llguidance.LLMatcher.grammar_from_regex(schema["regex"]) \
            if set(schema) == {"regex"} else llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
        proc = LLGuidanceProcessor(tokenizer, grammar, len(prompt_ids), hf_model.config.vocab_size)
        x = torch.tensor([list(prompt_ids)])
        with torch.inference_mode():
            out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                    do_sample=False, logits_processor=LogitsProcessorList([proc]),
                                    eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.eos_token_id)
        return tuple(out[0, len(prompt_ids):].tolist())

    def call(prompt_ids, schema: dict, n: int) -> list[int]:
        return list(run(tuple(prompt_ids), json.dumps(schema), n))   # its order is the output's
    return call


def compare_tokens(prompt_ids, got, want, label, *, logits_after, regenerate, n=None,
                   eos_id=None, ties=None) -> None:
    """Assert that `got` is the reference output `want`, over the full length.

    A difference is allowed only at a near-tie: where the reference's logit for the system's
    token is within NEAR_TIE of its top logit (fp32 reductions in another order may pick
    either). It is reported (appended to `ties`, and warned), and the comparison goes on against
    a reference regenerated from the system's own prefix (up to and including the tie token),
    so everything after a tie is still checked, token for token.

    `logits_after(ids)`: the reference model's next-token logits after `ids`;
    `regenerate(ids, k)`: the reference's greedy continuation of `ids`, k tokens (stopping at
    EOS when `eos_id` is given); `n`: the requested length (default: the reference's)."""
    got, want = list(got), list(want)
    n = len(want) if n is None else n
    i = 0
    while i < min(len(got), len(want)):
        g, w = got[i], want[i]
        if g == w:
            i += 1
            continue
        logits = logits_after(list(prompt_ids) + got[:i])
        margin = float(logits.max() - logits[g])
        assert margin < NEAR_TIE, (f"{label}: token {i} differs ({g} vs reference {w}); the "
                                   f"reference's logit for {g} is {margin:.3g} under its top: "
                                   f"no tie")
        note = (f"{label}: near-tie at token {i} ({g} vs {w}), margin {margin:.2e}; compared on "
                f"against the reference regenerated from the system's prefix")
        if ties is not None:
            ties.append(note)
        warnings.warn(note, stacklevel=3)
        i += 1
        prefix = got[:i]
        rest = 0 if eos_id is not None and g == eos_id else n - i
        want = prefix + (list(regenerate(list(prompt_ids) + prefix, rest)) if rest > 0 else [])
    assert len(got) == len(want), (f"{label}: {len(got)} tokens vs reference {len(want)}: "
                                   f"got {got}, want {want}")


@pytest.fixture(scope="session")
def assert_same_tokens(hf_model, reference):
    """check(prompt_ids, got, want, label, n=None, eos=False): compare_tokens with transformers
    as the reference (`eos`: `want` is `reference(..., eos=True)`, so a regenerated continuation
    stops at EOS too). `check.ties` lists the near-ties met."""
    ties: list[str] = []

    def logits_after(ids):
        with torch.inference_mode():
            return hf_model(torch.tensor([ids])).logits[0, -1]

    def check(prompt_ids, got, want, label="", *, n: int | None = None, eos: bool = False):
        compare_tokens(prompt_ids, got, want, label, logits_after=logits_after,
                       regenerate=lambda ids, k: reference(ids, k, eos), n=n,
                       eos_id=hf_model.config.eos_token_id if eos else None, ties=ties)
    check.ties = ties
    return check


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def need_tool(what: str, install: str) -> None:
    """A tool a test needs is missing. Under CI (CI=true) the test fails with the install hint,
    so a missing tool cannot pass as a silent skip; locally it is skipped, saying the same."""
    msg = f"{what} not installed ({install})"
    if in_ci():
        pytest.fail(f"{msg}; CI must have it", pytrace=False)
    pytest.skip(msg)


async def error_code(peer, msg) -> str:
    """The error code a service answers `msg` with, through `peer` (a runtime Peer). A message
    the service acks first (it starts a stream) is sent again until the answer is not an Ack;
    that answer must be an error, or the test fails."""
    from common.runtime import PeerError
    with pytest.raises(PeerError) as e:
        while True:
            r, _ = await peer.request(msg, timeout=10)
            if not isinstance(r, protocol.Ack):
                break
    return e.value.code


def wait_until(cond, timeout: float, what: str, every: float = 0.05):
    """Poll `cond()` until it returns something truthy (returned), failing after `timeout` s
    with `what`: a wait on the state itself instead of a sleep that hopes it is long enough."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(every)


def metric_samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample a /metrics endpoint exports."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples]


def forwards_over_one_session(url: str, service: str) -> float:
    """How many forward calls of `service` held more than one session (every phase), from its
    tandem_forward_batch_sessions histogram: the count minus the le="1" bucket."""
    total = single = 0.0
    for name, labels, value in metric_samples(url):
        if labels.get("service") != service:
            continue
        if name == "tandem_forward_batch_sessions_count":
            total += value
        elif name == "tandem_forward_batch_sessions_bucket" and float(labels["le"]) == 1.0:
            single += value
    return total - single


def readyz(http_port: int) -> tuple[int, str]:
    """(status, body) of a service's /readyz: 200 "ready", or 503 with why it is not."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=5) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()
