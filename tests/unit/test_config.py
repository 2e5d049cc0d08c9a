"""Configuration (common/config.py): sections, ranges and choices declared on the fields,
help text from the fields' metadata, one flat name per setting for flags, env and YAML."""

from __future__ import annotations

import importlib

import pytest

from common.config import ServiceConfig, load, settings
from services.dispatcher.config import DispatcherConfig

SERVICES = ("dispatcher", "verifier", "drafter", "prefix", "suffix")


def _config_class(service: str) -> type:
    mod = importlib.import_module(f"services.{service}.config")
    return next(v for k, v in vars(mod).items() if k.lower() == f"{service}config")


@pytest.mark.parametrize("service", SERVICES)
def test_every_setting_has_help(service):
    missing = [name for name, (_, _, meta) in settings(_config_class(service)).items()
               if not meta.get("help")]
    assert not missing, f"settings without help text: {missing}"


def test_a_section_is_set_by_flat_names_and_nested_yaml(tmp_path):
    yml = tmp_path / "d.yaml"
    yml.write_text("spec:\n  r1: 0.7\n  policy: vanilla\nsplit_cut: 9\n"
                   "dispatcher:\n  spec:\n    r2: 0.5\n")
    c = load(DispatcherConfig, "dispatcher", ["--config", str(yml), "--spec-lookahead", "12"],
             env={"TANDEM_SPEC_Q_WIDTH": "8"})
    assert (c.spec.r1, c.spec.r2, c.spec.policy, c.split.cut) == (0.7, 0.5, "vanilla", 9)
    assert (c.spec.lookahead, c.spec.q_width) == (12, 8)
    yml.write_text("spec:\n  no_such_knob: 1\n")
    with pytest.raises(SystemExit, match="spec_no_such_knob"):
        load(DispatcherConfig, "dispatcher", ["--config", str(yml)], env={})


@pytest.mark.parametrize("argv,message", [
    (["--spec-r2", "1.5"], "spec_r2 must be <= 1"),
    (["--spec-q-width", "0"], "spec_q_width must be >= 1"),
    (["--default-mode", "fast"], "default_mode must be one of cloud-only, spec, split"),
    (["--spec-policy", "oracle2"], "spec_policy must be one of"),
    (["--log-level", "loud"], "log_level must be one of"),
    (["--heartbeat-s", "0"], "heartbeat_s must be > 0"),
    (["--http-port", "70000"], "http_port must be <= 65535"),
])
def test_out_of_range_and_unknown_choices_are_refused_naming_the_setting(argv, message):
    with pytest.raises(SystemExit, match=message):
        load(DispatcherConfig, "dispatcher", argv, env={})


def test_rules_hold_however_a_config_is_made():
    """Not only through `load`: a config built in code is checked too."""
    with pytest.raises(ValueError, match="max_sessions must be >= 1"):
        ServiceConfig(max_sessions=0)
    with pytest.raises(ValueError, match="scheduler must be one of"):
        _config_class("suffix")(scheduler="lifo")


def test_help_shows_the_rules_and_choices(capsys):
    with pytest.raises(SystemExit):
        load(_config_class("suffix"), "suffix", ["--help"], env={})
    out = " ".join(capsys.readouterr().out.split())
    assert "[fifo | exact | interleave | dsb | cascade]" in out
    assert "steps per window (fifo/interleave: always 1) [>= 1]" in out
