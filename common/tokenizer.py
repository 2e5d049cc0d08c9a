"""A model directory's tokenizer, loaded without importing torch once its class is known.

transformers' `AutoTokenizer` maps a directory to a tokenizer class through its auto-model tables,
which import torch: seconds at every start of a process that never runs a model (the dispatcher,
the API gateway). The class it picks depends only on the directory's config files and the
transformers version, so the first load records it under a key made of those, and later loads
import that class alone and call its own `from_pretrained`, which reads the same files.
A record is only a shortcut: a missing, stale or unreadable one means resolving again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import tempfile
from pathlib import Path

CONFIG_FILES = ("tokenizer_config.json", "config.json", "special_tokens_map.json")
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")


def record_file() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tandem" / "tokenizer-classes.json"


def record_key(path: Path) -> str:
    """What AutoTokenizer's choice depends on: the config files' bytes, the vocabulary files'
    size and modification time (they are large; a changed one is a rewritten one), and the
    transformers version."""
    import transformers

    h = hashlib.sha256(transformers.__version__.encode())
    for name in CONFIG_FILES:
        f = path / name
        h.update(f"\0{name}\0".encode() + (f.read_bytes() if f.is_file() else b"-"))
    for name in VOCAB_FILES:
        f = path / name
        if f.is_file():
            st = f.stat()
            h.update(f"\0{name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return f"{path.resolve()}\0{h.hexdigest()}"


def _records() -> dict[str, str]:
    with contextlib.suppress(OSError, ValueError):
        records = json.loads(record_file().read_text())
        if isinstance(records, dict):
            return records
    return {}


def _write(records: dict[str, str]) -> None:
    """Atomically: processes starting together each see a whole file (the last one wins; a lost
    entry is only resolved again next time)."""
    out = record_file()
    with contextlib.suppress(OSError):
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=out.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(records, f, indent=0)
            os.replace(tmp, out)
        finally:
            Path(tmp).unlink(missing_ok=True)   # left only where the write failed


def _recorded_class(name: str):
    module, _, qualname = name.partition(":")
    with contextlib.suppress(ImportError, AttributeError, ValueError):
        return getattr(importlib.import_module(module), qualname)
    return None


def load(path: str | os.PathLike):
    """The tokenizer AutoTokenizer.from_pretrained(path) gives, from the recorded class when
    there is one."""
    path = Path(path)
    key = record_key(path)
    records = _records()
    cls = _recorded_class(records[key]) if key in records else None
    if cls is not None:
        return cls.from_pretrained(str(path))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    records = _records()   # re-read: another process may have recorded meanwhile
    records[key] = f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}"
    _write(records)
    return tokenizer
