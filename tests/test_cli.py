"""The `tandem` command line as a user runs it: up --detach (demo + stats), status, down."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def tandem(*args, env, timeout=400):
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_up_status_down(tmp_path, model_paths):
    env = {**os.environ, "TANDEM_RUN_DIR": str(tmp_path)}
    up = tandem("up", "--detach", env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "all services ready" in up.stdout
        assert "[stats] mode=" in up.stdout and "tokens=" in up.stdout
        st = tandem("status", "--json", env=env, timeout=60)
        rows = json.loads(st.stdout)
        assert st.returncode == 0 and rows
        assert {r["name"] for r in rows} >= {"dispatcher", "verifier"}
        assert all(r["health"] == "ready" and r["pid"] > 0 for r in rows)
        again = tandem("up", "--detach", env=env, timeout=60)
        assert again.returncode != 0 and "already running" in again.stderr
    finally:
        down = tandem("down", env=env, timeout=120)
    assert down.returncode == 0
    st = tandem("status", env=env, timeout=60)
    assert st.returncode == 1 and "not running" in st.stdout


def test_serve_rejects_unknown_service():
    r = tandem("serve", "teleporter", env=dict(os.environ), timeout=60)
    assert r.returncode == 2 and "unknown service" in r.stderr


def test_generate_reports_unreachable_dispatcher():
    from common.launcher import free_port
    r = tandem("generate", "hi", "--endpoint", f"tcp://127.0.0.1:{free_port()}", "--deadline", "1",
               env=dict(os.environ), timeout=60)
    assert r.returncode == 1 and "error:" in r.stderr
