"""common.tokenizer gives the tokenizer transformers' AutoTokenizer gives, from the class it
recorded, without torch; and a directory whose config changes is resolved again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common import chat, models, tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ("def fib(n):\n    return n", "  Tandem ✓ 日本語 <|im_start|> <eos>\t\n", "")


@pytest.fixture
def records(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tokenizer.record_file()


def _model_dir(name: str) -> Path:
    m = models.NAMED[name]
    if not m.prepared() and not os.environ.get("CI"):
        pytest.skip(f"{name} not prepared: `tandem models prepare {name}`")
    return models.prepare_all(name).target   # under CI a missing model fails here


def _forbid_autotokenizer(monkeypatch):
    import transformers

    def refuse(*a, **k):
        raise AssertionError("resolved with AutoTokenizer, not the recorded class")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_the_recorded_class_gives_autotokenizers_tokenizer(name, records, monkeypatch):
    from transformers import AutoTokenizer

    path = _model_dir(name)
    want = AutoTokenizer.from_pretrained(str(path))
    tokenizer.load(path)   # records
    assert json.loads(records.read_text()) == {
        tokenizer.record_key(path): f"{type(want).__module__}:{type(want).__qualname__}"}
    _forbid_autotokenizer(monkeypatch)
    got = tokenizer.load(path)
    assert type(got) is type(want)
    assert (len(got), got.eos_token_id, got.bos_token_id) == (
        len(want), want.eos_token_id, want.bos_token_id)
    for text in TEXTS:
        for special in (True, False):
            ids = want.encode(text, add_special_tokens=special)
            assert got.encode(text, add_special_tokens=special) == ids
            assert got.decode(ids) == want.decode(ids)
    if want.chat_template:
        messages = [{"role": "user", "content": TEXTS[1]}]
        assert chat.render_ids(got, messages) == chat.render_ids(want, messages)


def test_a_recorded_load_imports_no_torch(records):
    path = _model_dir("smollm2-135m")
    tokenizer.load(path)
    code = (f"import sys; from common import tokenizer; t = tokenizer.load({str(path)!r})\n"
            "assert t.encode('hi')\n"
            "sys.exit(', '.join(m for m in ('torch',) if m in sys.modules) or None)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "XDG_CACHE_HOME": str(records.parents[1])})
    assert r.returncode == 0, f"imported: {r.stderr[-2000:]}"


def test_an_edited_tokenizer_config_is_resolved_again(records, tmp_path, monkeypatch):
    """The record is keyed by what AutoTokenizer reads: naming another tokenizer class in
    tokenizer_config.json gives that class, as AutoTokenizer would, not the recorded one."""
    from transformers import AutoTokenizer

    src = _model_dir("smollm2-135m")
    path = tmp_path / "model"
    path.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":   # all but the weights
            shutil.copy2(f, path / f.name)
    first = type(tokenizer.load(path))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    want = type(AutoTokenizer.from_pretrained(str(path)))
    assert want is not first   # the edit matters to AutoTokenizer
    assert type(tokenizer.load(path)) is want
    assert len(json.loads(records.read_text())) == 2


def test_an_unusable_record_is_resolved_again(records):
    """A record file that is not JSON, or names a class that does not import, is only a missed
    shortcut: the load resolves with AutoTokenizer and records the class it picked."""
    path = _model_dir("smollm2-135m")
    records.parent.mkdir(parents=True)
    records.write_text("{not json")
    want = type(tokenizer.load(path))
    records.write_text(json.dumps({tokenizer.record_key(path): "no_such_module:Tokenizer"}))
    assert type(tokenizer.load(path)) is want
    assert json.loads(records.read_text()) == {
        tokenizer.record_key(path): f"{want.__module__}:{want.__qualname__}"}
    assert [p.name for p in records.parent.iterdir()] == [records.name]   # no temporary left
