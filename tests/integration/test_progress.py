"""Progress bars (common/progress.py) and where the CLI shows them: model preparation."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

from common.progress import Progress, render


def test_render_known_total():
    line = render("bench spec", 3, 12, 30.0, "pipesd plain")
    assert line.startswith("[bench spec] ") and " 3/12 " in line and "25%" in line
    assert "0:30" in line and "<1:30" in line and line.endswith("  pipesd plain")
    assert line.count("█") == 6 and line.count("░") == 18
    done = render("x", 12, 12, 65.0)
    assert "100%" in done and "1:05" in done and "<" not in done


def test_render_unknown_total_is_a_spinner():
    line = render("models", 0, None, 3725.0)
    assert line.startswith("[models] ") and "1:02:05" in line and "/" not in line.split()[-1]


def test_bar_draws_only_where_enabled():
    out = io.StringIO()
    with Progress(2, "t", stream=out, enabled=False) as bar:
        bar.advance()
    assert out.getvalue() == ""
    with Progress(2, "t", stream=out, enabled=True) as bar:
        bar.stage("first")
        bar.advance(note="second")
        bar.advance()
    text = out.getvalue()
    assert "\r[t] " in text and "first" in text and "2/2" in text and text.endswith("\n")


def test_write_prints_above_the_bar(capsys):
    err = io.StringIO()
    with Progress(1, "t", stream=err, enabled=True) as bar:
        bar.write("a result line")
        bar.advance()
    assert capsys.readouterr().out == "a result line\n"
    assert "1/1" in err.getvalue()


def test_tick_keeps_the_clock_moving():
    out = io.StringIO()
    with Progress.step("long call", stream=out, enabled=True):
        time.sleep(0.7)
    assert out.getvalue().count("\r[long call] ") >= 3 and "done" in out.getvalue()


def test_tty_detection(monkeypatch):
    monkeypatch.delenv("TANDEM_PROGRESS", raising=False)
    assert not Progress(1, "t", stream=io.StringIO()).enabled   # a pipe or a file: no bar
    monkeypatch.setenv("TANDEM_PROGRESS", "1")
    assert Progress(1, "t", stream=io.StringIO()).enabled


def test_model_preparation_shows_a_bar(model_paths, tmp_path):
    """Re-quantising the drafter (the quick half of `tandem models prepare`) draws its bar."""
    code = ("import sys; from pathlib import Path; from common import models; "
            "models.prepare_drafter(Path(sys.argv[1]), Path(sys.argv[2]), 'Q8_0')")
    r = subprocess.run([sys.executable, "-c", code, str(model_paths.drafter_ideal),
                        str(tmp_path / "d.gguf")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TANDEM_PROGRESS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "d.gguf").is_file()
    assert "[models: drafter Q8_0]" in r.stderr and "1/1" in r.stderr and "done" in r.stderr
