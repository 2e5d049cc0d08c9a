"""`tandem up --replicas` and supervision (stack/launcher.py), without model processes: replica
names, ports and the dispatcher's replica lists; the supervisor restarting a dead process with
backoff and leaving a stopped one alone; the CLI's flag parsing and `status` rows."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from stack import launcher
from stack.launcher import Cluster, ServiceProc, Supervisor


def test_parse_replicas():
    assert launcher.parse_replicas("verifier=2, suffix=3") == {"verifier": 2, "suffix": 3}
    assert launcher.parse_replicas("") == {}
    for bad, why in (("verifier", "SERVICE=N"), ("verifier=0", "N >= 1"),
                     ("dispatcher=2", "cannot be replicated"), ("suffix=x", "SERVICE=N")):
        with pytest.raises(ValueError, match=why):
            launcher.parse_replicas(bad)


def test_role_of():
    assert launcher.role_of("verifier-1") == "verifier"
    assert launcher.role_of("verifier") == "verifier"
    assert launcher.role_of("suffix-12") == "suffix"
    assert launcher.role_of("api") == "api"


def test_cluster_replicas_names_ports_and_dispatcher_lists(tmp_path):
    c = Cluster(services=("verifier", "suffix", "dispatcher"), logdir=tmp_path,
                replicas={"verifier": 2, "suffix": 3})
    assert list(c.procs) == ["verifier", "verifier-1", "suffix", "suffix-1", "suffix-2",
                             "dispatcher"]
    assert c.procs["verifier-1"].endpoint == "tcp://127.0.0.1:5651"
    assert c.procs["verifier-1"].http_port == 9651
    assert c.procs["suffix-2"].endpoint == "tcp://127.0.0.1:5754"
    assert c.procs["suffix-2"].role == "suffix"
    argv = c.argv("dispatcher")
    assert argv[argv.index("--verifier") + 1] == "tcp://127.0.0.1:5551,tcp://127.0.0.1:5651"
    assert argv[argv.index("--suffix") + 1] == ("tcp://127.0.0.1:5554,tcp://127.0.0.1:5654,"
                                                "tcp://127.0.0.1:5754")
    assert c.argv("suffix-1")[2] == "services.suffix.service"
    # ephemeral ports (tests): every replica its own
    e = Cluster(services=("verifier",), ephemeral=True, logdir=tmp_path, replicas={"verifier": 2})
    assert e.procs["verifier"].endpoint != e.procs["verifier-1"].endpoint


def test_planned_replicas_share_their_roles_plan(tmp_path):
    c = launcher.planned(("verifier", "suffix", "dispatcher"), ephemeral=True, logdir=tmp_path,
                         replicas={"suffix": 2}, cpus=[0, 1])
    assert c.procs["suffix-1"].cpus == c.procs["suffix"].cpus
    assert c.procs["suffix-1"].threads == c.procs["suffix"].threads
    argv = c.argv("suffix-1")
    assert argv[argv.index("--threads") + 1] == str(c.procs["suffix"].threads)


def sleeper(tmp_path, name="verifier") -> Cluster:
    c = Cluster(services=(), logdir=tmp_path)
    c.saved = True
    c.procs[name] = ServiceProc(name, "tcp://127.0.0.1:1", 1, log=str(tmp_path / f"{name}.log"),
                                role=name, argv=[sys.executable, "-c",
                                                 "import time; time.sleep(120)"])
    return c


def test_supervisor_restarts_a_dead_service_with_backoff(tmp_path):
    c = sleeper(tmp_path)
    c.start("verifier")
    logs: list[str] = []
    sup = Supervisor(c, base_s=0.2, max_s=1.0, stable_s=30.0, log=logs.append,
                     state=tmp_path / "state.json")
    try:
        first = c.procs["verifier"].pid
        assert sup.poll() == []
        os.kill(first, signal.SIGKILL)
        time.sleep(0.1)
        assert sup.poll() == []                 # noticed; restart due after the backoff
        assert "restarting in 0.2 s" in logs[-1]
        time.sleep(0.25)
        assert sup.poll() == ["verifier"]
        second = c.procs["verifier"].pid
        assert second != first and c.procs["verifier"].alive()
        assert c.procs["verifier"].restarts == 1
        saved = json.loads((tmp_path / "state.json").read_text())
        assert saved["verifier"]["pid"] == second and saved["verifier"]["restarts"] == 1
        # dying again soon after: twice the wait
        os.kill(second, signal.SIGKILL)
        time.sleep(0.1)
        sup.poll()
        assert "restarting in 0.4 s" in logs[-1]
        # a service stopped on purpose stays stopped (unless-stopped)
        time.sleep(0.45)
        assert sup.poll() == ["verifier"]
        c.stop("verifier")
        time.sleep(0.1)
        assert sup.poll() == [] and not c.procs["verifier"].alive()
    finally:
        c.stop_all()


def test_status_lists_each_replica(tmp_path, monkeypatch, capsys):
    from stack import cli
    monkeypatch.setenv("TANDEM_RUN_DIR", str(tmp_path))
    c = Cluster(services=("verifier", "dispatcher"), logdir=tmp_path, ephemeral=True,
                replicas={"verifier": 2})
    c.procs["verifier-1"].restarts = 2
    c.save_state(tmp_path / "state.json")
    assert cli.main(["status", "--json"]) == 1        # nothing runs: all down
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["verifier", "verifier-1", "dispatcher"]
    assert rows[1]["role"] == "verifier" and rows[1]["restarts"] == 2
    assert all(r["health"] == "down" for r in rows)
    cli.main(["status"])
    assert "restarted 2x" in capsys.readouterr().out


def test_up_refuses_a_bad_replicas_flag(tmp_path, monkeypatch, capsys):
    from stack import cli
    monkeypatch.setenv("TANDEM_RUN_DIR", str(tmp_path))
    assert cli.main(["up", "--replicas", "drafter=2"]) == 1
    assert "cannot be replicated" in capsys.readouterr().err
