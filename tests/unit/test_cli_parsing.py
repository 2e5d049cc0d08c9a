"""The command line refuses a bad enumerated value with its choices listed, takes the papers'
capitals, and `tandem serve SERVICE --help` shows that service's settings."""

from __future__ import annotations

import pytest

from bench import bench_spec
from stack import cli


def test_serve_help_lists_the_services_settings(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "verifier", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "tandem serve verifier" in out and "--max-sessions" in out


def test_serve_names_its_services(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "verfier"])
    assert e.value.code == 2
    assert "choose from" in capsys.readouterr().err


@pytest.mark.parametrize("scenario", ["S1", "s1", "LAN"])
def test_bench_scenarios_are_case_insensitive(scenario, capsys):
    with pytest.raises(SystemExit) as e:
        bench_spec.main(["--scenario", scenario, "--help"])
    assert e.value.code == 0


def test_bench_refuses_an_unknown_scenario_listing_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        bench_spec.main(["--scenario", "S9"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'s9'" in err and "'s1'" in err and "'lan'" in err
