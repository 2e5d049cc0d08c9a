"""Pointing Tandem at a model: `tandem models list | check`, the target/drafter resolution that
`tandem up --model / --target / --drafter` and TANDEM_TARGET use, and the refusal of a drafter
whose tokenizer differs (naming the first differing token)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from common import models
from stack import cli


def gemma_or_skip():
    m = models.NAMED["gemma3-270m"]
    if not m.prepared() and not os.environ.get("CI"):
        pytest.skip("gemma3-270m not prepared: `tandem models prepare gemma3-270m`")
    return models.prepare_all("gemma3-270m")


def test_list_names_both_families(capsys):
    assert cli.main(["models", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {"smollm2-135m", "gemma3-270m"} <= set(rows)


def test_check_reports_architecture_and_tokenizer(model_paths, capsys):
    assert cli.main(["models", "check", "--target", str(model_paths.target), "--drafter",
                     str(model_paths.drafter), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["family"] == "Llama" and report["supported"] is True
    assert report["tokenizer"] == "identical on the probe text"


def test_check_refuses_a_drafter_with_another_tokenizer(model_paths, capsys):
    g = gemma_or_skip()
    assert cli.main(["models", "check", "--target", str(model_paths.target), "--drafter",
                     str(g.drafter), "--json"]) == 1
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "model"
    assert "first difference at token" in err["message"] and "drafter id" in err["message"]


def test_check_refuses_an_unsupported_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert cli.main(["models", "check", "--target", str(tmp_path), "--json"]) == 1
    msg = json.loads(capsys.readouterr().out)["error"]["message"]
    assert "gpt2" in msg and "Gemma 3" in msg and "Phi-3" in msg


def test_names_resolve_to_prepared_paths(model_paths):
    assert models.resolve_target("bundled") == models.resolve_target("smollm2-135m")
    assert models.resolve_drafter("smollm2-135m") == model_paths.drafter
    with pytest.raises(models.ModelError, match="neither"):
        models.resolve_target("/nonexistent/model")


def _up_args(**kw):
    return argparse.Namespace(**{"model": "", "target": "", "drafter": "", **kw})


def test_up_selection(model_paths, monkeypatch):
    monkeypatch.delenv("TANDEM_TARGET", raising=False)
    monkeypatch.delenv("TANDEM_DRAFTER_DRAFTER", raising=False)
    assert cli._select_model(_up_args()) == (model_paths.target, model_paths.drafter)
    # an HF directory without a drafter: served without one (no spec mode)
    assert cli._select_model(_up_args(target=str(model_paths.target))) == (model_paths.target,
                                                                           None)
    assert cli._select_model(_up_args(target=str(model_paths.target),
                                      drafter="bundled-q4_1"))[1] == models.bundled_gguf()
    with pytest.raises(models.ModelError, match="exclusive"):
        cli._select_model(_up_args(model="gemma3-270m", target=str(model_paths.target)))
    monkeypatch.setenv("TANDEM_TARGET", "smollm2-135m")   # the environment, as compose sets it
    assert cli._select_model(_up_args())[0] == model_paths.target


def test_up_selects_gemma_by_name(monkeypatch):
    g = gemma_or_skip()
    monkeypatch.delenv("TANDEM_DRAFTER_DRAFTER", raising=False)
    assert cli._select_model(_up_args(model="gemma3-270m")) == (g.target, g.drafter)


def test_demo_sends_chat_only_where_the_model_has_a_template(model_paths, tmp_path):
    assert cli._has_chat_template(model_paths.target)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    assert not cli._has_chat_template(tmp_path)   # a base model such as Gemma 3 270M


def test_compose_selects_the_model_through_the_environment():
    """compose: TANDEM_TARGET names the model the one-shot `models` job prepares and every
    service serves; TANDEM_DRAFTER_MODEL reaches the drafter's own `drafter` field."""
    from tests.integration.test_deploy import compose_config
    cfg = compose_config(("edge", "cloud"), env={"TANDEM_TARGET": "gemma3-270m",
                                                 "TANDEM_DRAFTER_MODEL": "gemma3-270m"})
    services = cfg["services"]
    assert services["models"]["command"] == ["models", "prepare", "gemma3-270m"]
    assert services["verifier"]["environment"]["TANDEM_TARGET"] == "gemma3-270m"
    assert services["drafter"]["environment"]["TANDEM_DRAFTER_DRAFTER"] == "gemma3-270m"
