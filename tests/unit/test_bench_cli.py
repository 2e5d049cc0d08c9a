"""`tandem bench` (bench/cli.py): SIGTERM unwinds a bench like Ctrl-C, so the services it
started are stopped by its own cleanup, and the command ends 130 with one line, no traceback."""

from __future__ import annotations

import os
import signal
import time

from bench import cli

cleaned_up: list[bool] = []


def main(argv) -> int:
    """A bench that is sent SIGTERM while it runs."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return 0
    finally:
        cleaned_up.append(True)


def test_sigterm_runs_the_benchs_cleanup_and_exits_130(monkeypatch, capsys):
    monkeypatch.setitem(cli.BENCHES, "sigterm", (__name__, "a bench sent SIGTERM"))
    before = signal.getsignal(signal.SIGTERM)
    try:
        t = time.monotonic()
        assert cli.main(["sigterm"]) == 130
    finally:
        signal.signal(signal.SIGTERM, before)
    assert cleaned_up == [True] and time.monotonic() - t < 4
    assert "interrupted; its services are stopped" in capsys.readouterr().err
