"""The model families LayerRangeRunner serves, each as a few data-driven differences from Llama.

A decoder layer of every supported family is the same pipeline (norm, fused q|k|v product, RoPE,
attention against the session's cache, output product, norm, fused gate|up product, activation,
down product); the families differ only in the pieces described by `Family`:

* the RMSNorm kind: Llama's `w * normed.to(dtype)` or Gemma's `(normed * (1 + w)).to(dtype)`;
* biases on q/k/v (Qwen2) or anywhere else (read from the checkpoint when present);
* RMSNorm of q and k per head before RoPE (Qwen3, Gemma 3);
* the "sandwich" norms of Gemma 2/3: a norm after attention and after the MLP, besides the
  ones before;
* embeddings scaled by sqrt(hidden) (Gemma);
* the attention scale (Gemma: query_pre_attn_scalar ** -0.5) and soft-capping of attention and
  final logits (Gemma 2, where the config sets them);
* sliding-window attention, on every layer (Mistral) or per `config.layer_types` (Gemma 2/3,
  Qwen2/3 when enabled), and per-layer-type RoPE bases (Gemma 3);
* fused checkpoint tensors (Phi-3's qkv_proj and gate_up_proj), which the runner detects by name.

`layer_plan(config)` turns a transformers config into per-layer attention settings (window and
RoPE kind); `rope_kinds(config, head_dim)` gives each RoPE kind's inverse frequencies and scale,
computed as transformers computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.errors import ConfigurationError

# RoPE types whose inverse frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


class UnsupportedModel(ConfigurationError, ValueError):
    """The checkpoint's architecture or one of its options is not supported by the runner."""


@dataclass(frozen=True)
class Family:
    name: str                       # shown in errors and in `tandem models check`
    gemma_norm: bool = False        # RMSNorm weight applied as (1 + w), in float32
    qk_norm: bool = False           # RMSNorm over head_dim of q and k before RoPE
    sandwich_norms: bool = False    # Gemma 2/3: post-attention and pre/post-feedforward norms
    embed_scale: bool = False       # embeddings multiplied by sqrt(hidden_size)
    pre_attn_scalar: bool = False   # attention scale = config.query_pre_attn_scalar ** -0.5
    act_key: str = "hidden_act"     # config attribute naming the MLP activation


# model_type (config.json) -> family. The tiny-model tests in tests/unit/test_architectures.py check
# each one against transformers' own implementation.
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3", qk_norm=True),
    "phi3": Family("Phi-3"),
    "gemma2": Family("Gemma 2", gemma_norm=True, sandwich_norms=True, embed_scale=True,
                     pre_attn_scalar=True, act_key="hidden_activation"),
    "gemma3_text": Family("Gemma 3", gemma_norm=True, qk_norm=True, sandwich_norms=True,
                          embed_scale=True, pre_attn_scalar=True, act_key="hidden_activation"),
}

ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "swish": torch.nn.functional.silu,
    "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
}


def supported_text() -> str:
    return ", ".join(f"{f.name} ({t})" for t, f in FAMILIES.items())


def family_of(model_type: str | None, where: str = "") -> Family:
    """The family for a config's model_type, or an error naming the supported ones."""
    fam = FAMILIES.get(model_type or "")
    if fam is None:
        hint = (" (a multimodal Gemma 3 checkpoint: use its text-only Gemma3ForCausalLM part)"
                if model_type == "gemma3" else "")
        raise UnsupportedModel(f"{where}model_type {model_type!r} is not supported{hint}; "
                               f"supported: {supported_text()}")
    return fam


def check_config(cfg, fam: Family, where: str = "") -> None:
    """Options of a supported family that the runner does not implement fail here, at load."""
    act = getattr(cfg, fam.act_key, None)
    if act not in ACTIVATIONS:
        raise UnsupportedModel(f"{where}{fam.name}: activation {act!r} not supported "
                               f"(one of {sorted(ACTIVATIONS)})")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"{where}{fam.name}: bidirectional attention is not supported")
    for kind in _rope_params(cfg).values():
        rope_type = kind.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModel(f"{where}rope_type {rope_type!r} not supported "
                                   f"(one of {sorted(STATIC_ROPE_TYPES)})")


def load_config(model_dir, where: str = ""):
    """(family, config) of an HF model directory, as transformers reads it (AutoConfig, so every
    RoPE and layer-type layout transformers loads is normalised the same way), checked for all
    the runner builds from it: what this accepts, the runner serves, and `tandem models check`
    says so from this alone."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    fam = family_of(raw.get("model_type"), where)
    try:
        cfg = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, TypeError) as e:   # transformers' own refusal of the config
        raise UnsupportedModel(f"{where}transformers cannot read its config: {e}") from None
    check_config(cfg, fam, where)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    try:
        rope_kinds(cfg, head_dim)
        layer_plan(cfg)
    except UnsupportedModel as e:
        raise UnsupportedModel(f"{where}{e}") from None
    return fam, cfg


def _rope_params(cfg) -> dict[str | None, dict]:
    """RoPE parameters per layer type (Gemma 3 keys them by layer type, for every type it knows,
    also those no layer of a small checkpoint has), else {None: params}."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return dict(params)
    return {None: params}


def rope_kinds(cfg, head_dim: int) -> dict[str | None, tuple[torch.Tensor, float]]:
    """Per RoPE kind: (inverse frequencies, attention scaling), as transformers computes them.
    The rotated width is 2 * len(inv_freq) (Phi-3's partial_rotary_factor rotates a prefix)."""
    out = {}
    for key, p in _rope_params(cfg).items():
        rope_type = p.get("rope_type", "default")
        if rope_type == "default":
            dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
            theta = p.get("rope_theta", getattr(cfg, "rope_theta", None))
            if theta is None:
                raise UnsupportedModel("config has no rope_theta")
            inv_freq = 1.0 / (theta ** (
                torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            out[key] = (inv_freq, 1.0)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            fn = ROPE_INIT_FUNCTIONS[rope_type]
            out[key] = fn(cfg, None, layer_type=key) if key is not None else fn(cfg, None)
    return out


@dataclass(frozen=True)
class LayerPlan:
    window: int | None   # sliding window: a query at position q sees keys k with q - window < k <= q
    rope: str | None     # key into rope_kinds()


def layer_plan(cfg) -> list[LayerPlan]:
    """Each layer's attention window and RoPE kind, following transformers' masks: a layer slides
    when config.layer_types says "sliding_attention" (Gemma 2/3, Qwen2/3) or, for configs without
    layer_types (Mistral), on every layer whenever config.sliding_window is set."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    keyed = None not in _rope_params(cfg)
    plans = []
    for i in range(n):
        lt = types[i] if types else None
        if types:
            w = window if lt == "sliding_attention" else None
        else:
            w = window
        plans.append(LayerPlan(window=w, rope=lt if keyed else None))
    return plans
