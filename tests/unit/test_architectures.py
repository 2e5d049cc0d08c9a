"""Every architecture the runner supports, against transformers' own implementation of it.

Each family is a tiny random-weight model built from its transformers config class (no
downloads, seeded), saved as a safetensors directory and loaded by both LayerRangeRunner and
transformers (eager attention: the reference that implements soft-capping and sliding windows
exactly). The options that distinguish the families are switched on in the tiny configs: Llama 3
RoPE scaling, q/k/v biases, q/k norms, a sliding window shorter than the prompts (on every layer,
or per layer type), Gemma's sandwich norms, scaled embeddings, soft-capping and per-layer-type
RoPE bases with linear scaling, Phi-3's fused tensors and partial rotary dimension.

The LM head is scaled up so that logits have clear top-2 margins (std ~3 on a 128-token vocab):
greedy generation can then be compared token for token, with no near-tie to excuse.

Checked per family: prefill logits at every position, cached decode, a ragged batch of three
sessions (prefill, decode, k-token verification in one call), rollback and re-verification, the
suffix's padded executor, and greedy generation in cloud-only and split at every cut."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from common.architectures import FAMILIES, UnsupportedModel
from common.runner import LayerRangeRunner, Segment
from services.suffix.executor import padded_forward

LOGIT_TOL = 2e-4     # relative to the logits' scale (oneDNN vs MKL summation order)
HEAD_SCALE = 20.0    # LM head multiplier: logits std ~3, clear greedy margins

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (config class, extra options that exercise what the family differs in)
CONFIGS = {
    "llama3": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32))),
    "llama-bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", dict(sliding_window=7)),
    "qwen2": ("Qwen2Config", dict()),  # q/k/v biases by construction
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=6, max_window_layers=2)),
    "gemma2": ("Gemma2Config", dict(sliding_window=6, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=20.0,
                                    hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=6, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention",
                                                     "sliding_attention", "full_attention"],
                                        rope_parameters=dict(
                                            full_attention=dict(rope_type="linear", factor=4.0,
                                                                rope_theta=1e6),
                                            sliding_attention=dict(rope_type="default",
                                                                   rope_theta=1e4)))),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, sliding_window=9)),
    # transformers' own defaults: RoPE keyed by layer type for both types, every layer of a
    # checkpoint this small sliding (the layout today's transformers saves)
    "gemma3-defaults": ("Gemma3TextConfig", dict(sliding_window=6)),
}
# Prompts longer than every window, so sliding layers really drop keys.
PROMPT = [1, 17, 33, 90, 5, 64, 12, 100, 7, 45, 77, 23, 3, 118, 56]


def build(name: str, out) -> None:
    cls_name, extra = CONFIGS[name]
    cfg = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, t in model.named_parameters():
            if "norm" in n or "layernorm" in n:
                t.normal_(0.0, 0.2)  # norms away from their init so a wrong norm shows
            if n.endswith(".bias"):
                t.normal_(0.0, 0.1)
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(str(out))


def hf_logits(ref, ids) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor([list(ids)])).logits[0]


def hf_greedy(ref, ids, n: int) -> list[int]:
    with torch.inference_mode():
        out = ref.generate(torch.tensor([list(ids)]), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def assert_close(got, want, what=""):
    scale = want.float().abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= LOGIT_TOL * max(scale, 1.0), f"{what}: max |diff| {diff:.3g} (scale {scale:.3g})"


def greedy(stages, ids, n: int) -> list[int]:
    """Greedy generation through a chain of (runner, a, b) stages, each with its own cache."""
    kvs = [r.new_kv(a, b) for r, a, b in stages]
    out, x = [], torch.tensor(ids)
    for _ in range(n):
        for (r, a, b), kv in zip(stages, kvs):
            x = r.forward([Segment(kv, x)], a, b)[0]
        out.append(int(x[-1].argmax()))
        x = torch.tensor(out[-1:])
    return out


def test_every_family_is_covered():
    assert {CONFIGS[n][0] for n in CONFIGS} >= {
        "LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config", "Gemma2Config",
        "Gemma3TextConfig", "Phi3Config"}
    assert set(FAMILIES) == {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"}


# Which of the runner's CPU kernel paths (common/runner.py) each family takes, so that the tests
# below check the kernels against transformers rather than a silent fallback to torch's ops.
KERNEL_PATH = {"llama3": "layer", "llama-bias": "layer", "mistral": "layer", "qwen2": "layer", "qwen3": "layer",
               "phi3": "layer",
               "gemma3": "attention", "gemma3-defaults": "attention",   # sandwich norms, GELU
               "gemma2": "ops"}                          # soft-capped scores: torch's attention


def test_each_family_takes_its_kernel_path(tiny):
    name, _, _, runner = tiny
    assert runner.gemm == "panel"
    path = ("layer" if runner._kernel_layers is not None else
            "attention" if runner._kernel_attention else "ops")
    assert path == KERNEL_PATH[name]


def test_margins_are_clear(tiny):
    """The premise of token-for-token comparison: no near-tie along the reference's path."""
    _, _, ref, _ = tiny
    ids = PROMPT + hf_greedy(ref, PROMPT, 12)
    top2 = torch.topk(hf_logits(ref, ids)[len(PROMPT) - 1:], 2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-3


def test_prefill_and_decode(tiny):
    name, _, ref, runner = tiny
    L = runner.num_layers
    ids = PROMPT + [9, 44, 71, 120, 8, 30]
    want = hf_logits(ref, ids)
    kv = runner.new_kv()
    got = runner.forward([Segment(kv, torch.tensor(PROMPT), logits="all")], 0, L)[0]
    assert_close(got, want[: len(PROMPT)], f"{name} prefill")
    for i in range(len(PROMPT), len(ids)):
        got = runner.forward([Segment(kv, torch.tensor([ids[i]]))], 0, L)[0]
        assert_close(got, want[i: i + 1], f"{name} decode at {i}")
    assert kv.length() == len(ids)


def test_ragged_batch_and_verification(tiny):
    """One call: a prefill, a one-token decode and a 4-token verification, each against its own
    cache; then a rollback and re-verification of other drafts."""
    name, _, ref, runner = tiny
    L = runner.num_layers
    a, b, c = PROMPT, PROMPT[3:] + [61, 62], PROMPT[:9]
    kvs = [runner.new_kv() for _ in range(3)]
    runner.forward([Segment(kvs[1], torch.tensor(b[:-1])), Segment(kvs[2], torch.tensor(c))], 0, L)
    drafts = [4, 99, 13, 50]
    outs = runner.forward([Segment(kvs[0], torch.tensor(a), logits="all"),
                           Segment(kvs[1], torch.tensor(b[-1:])),
                           Segment(kvs[2], torch.tensor(drafts), logits="all")], 0, L)
    assert_close(outs[0], hf_logits(ref, a), f"{name} ragged prefill")
    assert_close(outs[1], hf_logits(ref, b)[-1:], f"{name} ragged decode")
    assert_close(outs[2], hf_logits(ref, c + drafts)[len(c):], f"{name} ragged verify")
    kvs[2].truncate(len(c) + 1)  # keep the first draft, re-verify others
    again = [77, 5, 31]
    got = runner.forward([Segment(kvs[2], torch.tensor(again), logits="all")], 0, L)[0]
    assert_close(got, hf_logits(ref, c + drafts[:1] + again)[len(c) + 1:], f"{name} re-verify")


def test_padded_executor_matches_ragged(tiny):
    """The suffix's padded batch (left padding, sliding masks over padded columns) computes what
    the ragged forward computes, for sessions of different lengths."""
    name, _, _, runner = tiny
    L, cut = runner.num_layers, 1
    lens = [len(PROMPT), 4, 10]
    ragged, padded = [runner.new_kv(cut, L) for _ in lens], [runner.new_kv(cut, L) for _ in lens]
    hidden = [runner.forward([Segment(runner.new_kv(0, cut), torch.tensor(PROMPT[:n] + [6]))],
                             0, cut)[0] for n in lens]
    for kr, kp, h, n in zip(ragged, padded, hidden, lens):
        runner.forward([Segment(kr, h[:n])], cut, L)
        runner.forward([Segment(kp, h[:n])], cut, L)
    want = runner.forward([Segment(kv, h[n:]) for kv, h, n in zip(ragged, hidden, lens)], cut, L)
    got, _, _ = padded_forward(runner, padded, [h[n:] for h, n in zip(hidden, lens)], cut, L)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, f"{name} padded session {i}")
        assert padded[i].length() == ragged[i].length()


def test_greedy_cloud_only_and_split_at_every_cut(tiny):
    name, path, ref, runner = tiny
    L, n = runner.num_layers, 16
    want = hf_greedy(ref, PROMPT, n)
    assert greedy([(runner, 0, L)], PROMPT, n) == want, f"{name} cloud-only"
    for cut in range(1, L):
        edge, cloud = LayerRangeRunner(path, layers=(0, cut)), LayerRangeRunner(path, layers=(cut, L))
        assert greedy([(edge, 0, cut), (cloud, cut, L)], PROMPT, n) == want, f"{name} cut {cut}"


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedModel, match="gpt2") as e:
        LayerRangeRunner(tmp_path)
    for fam in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma 2", "Gemma 3", "Phi-3"):
        assert fam in str(e.value)


def test_unsupported_option_fails_at_load(tmp_path):
    cfg = transformers.LlamaConfig(**{**TINY, "rope_parameters": dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0)})
    cfg.save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModel, match="dynamic"):
        LayerRangeRunner(tmp_path)


def test_models_check_refuses_what_serving_refuses(tmp_path, monkeypatch):
    """`tandem models check` reads the config as the runner does (architectures.load_config):
    whatever the runner's config-derived setup refuses (here RoPE, made to refuse), the check
    refuses too, so it never calls supported a model that serving then rejects."""
    from common import architectures, models
    build("gemma3-defaults", tmp_path)
    assert models.check_pair(tmp_path, None)["supported"]

    def refuse(cfg, head_dim):
        raise UnsupportedModel("rope: not this one")
    monkeypatch.setattr(architectures, "rope_kinds", refuse)
    with pytest.raises(UnsupportedModel, match="not this one"):
        LayerRangeRunner(tmp_path)
    with pytest.raises(models.ModelError, match="not this one"):
        models.check_pair(tmp_path, None)
