"""The `tandem` command line as a user runs it: up --detach (demo + stats), status, down; --json
output; helpful errors (no traceback) when the dispatcher is down or a port is taken."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def tandem(*args, env, timeout=400):
    return subprocess.run([sys.executable, "-m", "stack.cli", *args], capture_output=True,
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


@pytest.mark.slow
def test_up_stops_every_service_even_when_signalled_twice(tmp_path, model_paths):
    """Ctrl-C pressed twice (or two SIGTERMs) while `tandem up` is stopping its services; the
    first comes as soon as the services are up, while `up` still runs its demo request (a
    SIGTERM before `up` had its handler killed it and left every service running)."""
    import re
    import signal
    env = {**os.environ, "TANDEM_RUN_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "stack.cli", "up"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    out = []
    try:
        for line in p.stdout:
            out.append(line)
            pids = [int(x) for x in re.findall(r" pid (\d+) ", "".join(out))]
            if len(pids) >= 5:
                break
        assert len(pids) >= 5, "".join(out)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        p.wait(120)
    finally:
        if p.poll() is None:
            p.kill()

    def alive() -> list[int]:
        out = []
        for pid in pids:
            try:
                if "services." in Path(f"/proc/{pid}/cmdline").read_text():
                    out.append(pid)
            except OSError:         # gone (or going) meanwhile
                pass
        return out
    deadline = time.monotonic() + 10     # `up` waited for them; a zombie's reaping may lag
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(), f"services left running: {alive()}"


def test_serve_rejects_unknown_service():
    r = tandem("serve", "teleporter", env=dict(os.environ), timeout=60)
    assert r.returncode == 2 and "invalid choice: 'teleporter'" in r.stderr


def test_generate_reports_unreachable_dispatcher():
    from stack.launcher import free_port
    r = tandem("generate", "hi", "--endpoint", f"tcp://127.0.0.1:{free_port()}", "--deadline", "1",
               env=dict(os.environ), timeout=60)
    assert r.returncode == 1 and "error:" in r.stderr


def test_generate_with_nothing_running_fails_fast_with_a_hint():
    from stack.launcher import free_port
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    t = time.monotonic()
    r = tandem("generate", "hi", "--endpoint", endpoint, env=dict(os.environ), timeout=60)
    assert time.monotonic() - t < 30   # not the default 300 s deadline
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"no dispatcher at {endpoint}" in r.stderr and "tandem up" in r.stderr
    j = tandem("generate", "hi", "--endpoint", endpoint, "--json", env=dict(os.environ),
               timeout=60)
    assert j.returncode == 1 and json.loads(j.stdout)["error"]["code"] == "unavailable"


@pytest.mark.parametrize("which", ["zmq", "http"])
def test_serve_on_a_busy_port_says_so(which):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        flags = (["--bind", f"tcp://127.0.0.1:{port}", "--http-port", "0"] if which == "zmq"
                 else ["--bind", "tcp://127.0.0.1:0", "--http-port", str(port)])
        r = tandem("serve", "dispatcher", *flags, env=dict(os.environ), timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"127.0.0.1:{port}: address already in use" in r.stderr
    assert ("--bind" if which == "zmq" else "--http-port") in r.stderr


def test_up_on_a_busy_port_says_so(tmp_path):
    from stack.launcher import DEFAULT_PORTS
    held = []
    try:
        for name in ("dispatcher", "suffix"):   # one ZMQ port, one HTTP port
            port = DEFAULT_PORTS[name][0 if name == "dispatcher" else 1]
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # past TIME_WAIT
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
            except OSError:
                pass   # already taken by something else: just as busy
            held.append(s)
        r = tandem("up", "--detach", env={**os.environ, "TANDEM_RUN_DIR": str(tmp_path)},
                   timeout=120)
    finally:
        for s in held:
            s.close()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "ports already in use" in r.stderr and "starting" not in r.stdout
    assert f"http://127.0.0.1:{DEFAULT_PORTS['suffix'][1]}" in r.stderr
    assert f"tcp://127.0.0.1:{DEFAULT_PORTS['dispatcher'][0]}" in r.stderr


def test_models_show_json():
    r = tandem("models", "show", "--json", env=dict(os.environ), timeout=60)
    rows = json.loads(r.stdout)
    assert r.returncode == 0 and [x["name"] for x in rows] == ["target", "drafter",
                                                                 "drafter_ideal"]
    assert all(isinstance(x["ok"], bool) and x["path"] for x in rows)
