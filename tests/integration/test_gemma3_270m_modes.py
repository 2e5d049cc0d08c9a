"""Gemma 3 270M through the real services (processes on loopback, `TANDEM_TARGET` and
`TANDEM_DRAFTER_DRAFTER` naming the model as `tandem up --model gemma3-270m` does): greedy output
equals transformers' generate(do_sample=False) in cloud-only, in spec mode under every policy
(Q4_0 drafter re-quantised by llama.cpp) and in split mode at every cut 1..L-1."""

from __future__ import annotations

import os

import pytest
import torch

from common import models
from stack.launcher import Cluster
from services.dispatcher.spec.session import POLICIES
from tests.conftest import NEAR_TIE, PROMPTS

N_TOKENS = 16
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    m = models.NAMED["gemma3-270m"]
    if not m.prepared() and not os.environ.get("CI"):
        pytest.skip("gemma3-270m not prepared: `tandem models prepare gemma3-270m`")
    return models.prepare_all("gemma3-270m")


@pytest.fixture(scope="module")
def hf(gemma):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    n = torch.get_num_threads()
    torch.set_num_threads(1)   # the services share the cores
    m = AutoModelForCausalLM.from_pretrained(str(gemma.target), dtype=torch.float32).eval()
    yield m, AutoTokenizer.from_pretrained(str(gemma.target))
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def client(gemma, tmp_path_factory):
    from tandem import Client
    env = {"TANDEM_TARGET": "gemma3-270m", "TANDEM_DRAFTER_DRAFTER": "gemma3-270m"}
    c = Cluster(services=("verifier", "drafter", "prefix", "suffix", "dispatcher"),
                ephemeral=True, logdir=tmp_path_factory.mktemp("gemma-logs"), env=env,
                extra={s: ["--threads", "1"] for s in ("verifier", "drafter", "prefix", "suffix")})
    try:
        c.start_all()
        c.wait_ready(timeout=400)
        with Client(c.endpoint("dispatcher"), timeout_s=600) as cl:
            yield cl
    finally:
        c.stop_all()


@pytest.fixture(scope="module")
def cases(hf):
    model, tok = hf
    out = []
    for kind in ("plain", "code"):
        ids = tok.encode(PROMPTS[kind])
        with torch.inference_mode():
            g = model.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS,
                               min_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        out.append((kind, ids, g[0, len(ids):].tolist()))
    return out


def same(hf, ids, got, want, label):
    model, _ = hf
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            with torch.inference_mode():
                top2 = torch.topk(model(torch.tensor([ids + want[:i]])).logits[0, -1], 2).values
            margin = float(top2[0] - top2[1])
            assert margin < NEAR_TIE, f"{label}: token {i} differs ({g} vs {w}), margin {margin:.3g}"
            return
    assert len(got) == len(want), f"{label}: {len(got)} tokens vs {len(want)}"


def test_cloud_only(client, hf, cases):
    for kind, ids, want in cases:
        r = client.complete(ids, mode="cloud-only", max_tokens=N_TOKENS, stop_at_eos=False)
        same(hf, ids, r.token_ids, want, f"cloud-only/{kind}")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_spec_every_policy(client, hf, cases, policy):
    for kind, ids, want in cases:
        r = client.complete(ids, mode="spec", policy=policy, max_tokens=N_TOKENS,
                            stop_at_eos=False)
        same(hf, ids, r.token_ids, want, f"spec/{policy}/{kind}")
        assert r.stats["mode"] == "spec" and r.stats["rounds"] >= 1


def test_split_every_cut(client, hf, cases):
    """Every cut, eight requests in flight at a time: the suffix batches sessions at different
    cuts, and batched must equal one by one."""
    from concurrent.futures import ThreadPoolExecutor
    L = hf[0].config.num_hidden_layers
    runs = [(cut, kind, ids, want) for cut in range(1, L) for kind, ids, want in cases]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda r: client.complete(r[2], mode="split", cut=r[0],
                                                          max_tokens=N_TOKENS, stop_at_eos=False),
                                runs))
    for (cut, kind, ids, want), r in zip(runs, results):
        same(hf, ids, r.token_ids, want, f"split/cut {cut}/{kind}")
