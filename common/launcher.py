"""Start and stop Tandem services as local processes (the embedded, no-Docker deployment).

`tandem up` and the integration tests both use this: each service is `python -m
services.<name>.service` with its own ports, logs to run/<name>.log, and a state file
(run/state.json) records what runs where so `tandem status` and `tandem down` find it.
`planned()` builds the cluster `tandem up` starts: each service with its share of the machine
(threads, cores, thread-pool settings) from common/resources.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import resources
from common.config import API_PORT, DEFAULT_PORTS
from common.models import repo_root

SERVICES = ("verifier", "drafter", "prefix", "suffix", "dispatcher")
# The OpenAI-compatible HTTP gateway (api/, `tandem serve api`): `tandem up` starts it after the
# dispatcher; it has no ZMQ endpoint (its `endpoint` is its HTTP base URL, its `http_port` the
# same port) and a light share, like the dispatcher's: one thread on the dispatcher's cores.
GATEWAY = "api"
PEER_FIELDS = {"verifier": "verifier", "drafter": "drafter", "prefix": "prefix", "suffix": "suffix"}


def run_dir() -> Path:
    return Path(os.environ.get("TANDEM_RUN_DIR", repo_root() / "run"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServiceProc:
    name: str
    endpoint: str          # ZMQ endpoint it binds
    http_port: int
    pid: int = 0
    log: str = ""
    cpus: list[int] = field(default_factory=list)   # its affinity; [] = inherited
    threads: int = 0                                 # its --threads; 0 = its own default

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def probe(self, path: str = "/readyz", timeout: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(self.url(path), timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def readiness(self, timeout: float = 1.0) -> tuple[bool, str]:
        """(ready, why): /readyz's status and body — "ready", "loading", "engine loop stalled
        for 130 s", "failed: ..." — or "down" when nothing answers."""
        try:
            with urllib.request.urlopen(self.url("/readyz"), timeout=timeout) as r:
                return r.status == 200, r.read().decode(errors="replace").strip()
        except urllib.error.HTTPError as e:
            return False, e.read().decode(errors="replace").strip()
        except OSError:
            return False, "down"

    def alive(self) -> bool:
        if not self.pid:
            return False
        try:
            os.kill(self.pid, 0)
        except OSError:
            return False
        try:  # a zombie child is not alive
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
            return pid == 0
        except ChildProcessError:
            return True


class Cluster:
    """A set of local service processes."""

    def __init__(self, services=SERVICES, ephemeral: bool = False, extra: dict | None = None,
                 env: dict | None = None, logdir: Path | None = None,
                 pin: dict[str, list[int]] | None = None,
                 service_env: dict[str, dict[str, str]] | None = None):
        self.ephemeral = ephemeral            # pick free ports (tests) instead of the defaults
        self.extra = extra or {}              # per-service extra CLI flags {name: [...]}
        self.env = env or {}                  # for every service; a None value unsets
        self.service_env = service_env or {}  # per service, under the caller's environment
        self.shares: dict[str, resources.Share] = {}   # the plan, when planned() made it
        self.cores: list[int] = []
        self.logdir = logdir or run_dir()
        self.pin = pin or {}                  # per-service CPU affinity
        self.procs: dict[str, ServiceProc] = {}
        self._popen: dict[str, subprocess.Popen] = {}
        for name in services:
            if name == GATEWAY:
                port = free_port() if ephemeral else API_PORT
                self.procs[name] = ServiceProc(name, f"http://127.0.0.1:{port}", port,
                                               log=str(self.logdir / f"{name}.log"),
                                               cpus=self.pin.get(name, []))
                continue
            zmq_port, http_port = DEFAULT_PORTS[name]
            if ephemeral:
                zmq_port, http_port = free_port(), free_port()
            self.procs[name] = ServiceProc(name, f"tcp://127.0.0.1:{zmq_port}", http_port,
                                           log=str(self.logdir / f"{name}.log"),
                                           cpus=self.pin.get(name, []))

    def endpoint(self, name: str) -> str:
        return self.procs[name].endpoint

    def argv(self, name: str) -> list[str]:
        p = self.procs[name]
        if name == GATEWAY:
            args = [sys.executable, "-m", "api.service", "--host", "127.0.0.1",
                    "--port", str(p.http_port)]
            if "dispatcher" in self.procs:
                args += ["--dispatcher", self.procs["dispatcher"].endpoint]
            return args + [str(a) for a in self.extra.get(name, [])]
        args = [sys.executable, "-m", f"services.{name}.service", "--bind", p.endpoint,
                "--http-port", str(p.http_port)]
        if name == "dispatcher":
            for peer in PEER_FIELDS:
                if peer in self.procs:
                    args += [f"--{peer}", self.procs[peer].endpoint]
        return args + [str(a) for a in self.extra.get(name, [])]

    def start(self, name: str) -> ServiceProc:
        p = self.procs[name]
        self.logdir.mkdir(parents=True, exist_ok=True)
        # the plan's thread-pool settings unless the caller's environment has its own
        env = {**self.service_env.get(name, {}), **os.environ, **self.env,
               "PYTHONUNBUFFERED": "1"}
        env = {k: v for k, v in env.items() if v is not None}
        env["PYTHONPATH"] = os.pathsep.join([str(repo_root()), env.get("PYTHONPATH", "")])
        cpus = list(p.cpus)
        logf = open(p.log, "ab")
        # pinned in the child before exec, so every thread it ever starts inherits the cores
        proc = subprocess.Popen(self.argv(name), stdout=logf, stderr=subprocess.STDOUT, env=env,
                                cwd=str(repo_root()), start_new_session=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        logf.close()
        self._popen[name] = proc
        p.pid = proc.pid
        return p

    def start_all(self) -> None:
        for name in self.procs:
            self.start(name)

    def wait_ready(self, timeout: float = 180.0, names=None) -> None:
        names = list(names or self.procs)
        end = time.monotonic() + timeout
        pending = set(names)
        while pending:
            for name in list(pending):
                p = self.procs[name]
                if p.probe():
                    pending.discard(name)
                elif not p.alive():
                    raise RuntimeError(f"{name} exited during start-up; last log lines:\n"
                                       + tail(p.log))
            if pending and time.monotonic() > end:
                raise TimeoutError(f"not ready after {timeout:.0f} s: {sorted(pending)}")
            if pending:
                time.sleep(0.2)

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        p = self.procs[name]
        proc = self._popen.pop(name, None)
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(sig)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        elif p.pid:
            _terminate(p.pid, sig, timeout)
        p.pid = 0

    def kill(self, name: str) -> None:
        self.stop(name, signal.SIGKILL)

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)

    def save_state(self, path: Path | None = None) -> Path:
        path = path or run_dir() / "state.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({n: asdict(p) for n, p in self.procs.items()}, indent=2))
        return path

    def describe(self) -> str:
        """The resource plan, one line per service (planned clusters only)."""
        return resources.describe(self.shares, self.cores) if self.shares else ""

    @classmethod
    def from_state(cls, path: Path | None = None) -> "Cluster | None":
        path = path or run_dir() / "state.json"
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        c = cls(services=())
        for name, d in data.items():
            c.procs[name] = ServiceProc(**d)
        return c


def planned(services=SERVICES, ephemeral: bool = False, extra: dict | None = None,
            env: dict | None = None, logdir: Path | None = None,
            cpus: list[int] | None = None) -> Cluster:
    """The cluster `tandem up` starts: each service with its share of the usable cores
    (common/resources.py), its configured `threads` / `cpus` (TANDEM_<SERVICE>_THREADS,
    TANDEM_<SERVICE>_CPUS, or flags in `extra`) taken as overrides."""
    extra = {k: [str(a) for a in v] for k, v in (extra or {}).items()}
    merged = {**os.environ, **{k: v for k, v in (env or {}).items() if v is not None}}
    wire = [s for s in services if s != GATEWAY]
    cores, shares = resources.plan_services(wire, argv=extra, env=merged, cpus=cpus)
    if GATEWAY in services:   # light, like the dispatcher: one thread on its cores (the edge's)
        base = shares.get("dispatcher")
        shares = {**shares, GATEWAY: resources.Share(
            threads=1, cpus=tuple(base.cpus) if base else tuple(cores),
            env=dict(base.env) if base else {}, shared=True,
            note="OpenAI-compatible HTTP gateway: one asyncio thread, beside the dispatcher")}
    cluster = Cluster(services, ephemeral=ephemeral, env=env, logdir=logdir,
                      pin={n: list(s.cpus) for n, s in shares.items()},
                      service_env={n: s.env for n, s in shares.items()},
                      extra={n: ["--threads", str(s.threads), "--cpus",
                                 resources.format_cpus(s.cpus), *extra.get(n, [])]
                             for n, s in shares.items()})
    for n, s in shares.items():
        cluster.procs[n].threads = s.threads
    cluster.shares, cluster.cores = shares, cores
    return cluster


def _terminate(pid: int, sig: int, timeout: float) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(path: str, n: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
