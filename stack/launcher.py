"""Start and stop Tandem services as local processes (the embedded, no-Docker deployment).

`tandem up` and the integration tests both use this: each service is `python -m
services.<name>.service` with its own ports, logs to run/<name>.log, and a state file
(run/state.json) records what runs where so `tandem status` and `tandem down` find it.
`planned()` builds the cluster `tandem up` starts: each service with its share of the machine
(threads, cores, thread-pool settings) from common/resources.py, with the services' own
settings read by stack/plan.py.

Replicas (`tandem up --replicas verifier=2,suffix=2`): a cloud service may run as several
processes, "verifier", "verifier-1", ..., replica i on its role's ports + 100·i; the dispatcher
gets them all as its comma-separated replica list and places sessions across them
(services/dispatcher/placement.py). `Supervisor` restarts a service that dies, with backoff, as
compose's `restart: unless-stopped` or a Deployment would; the dispatcher replays the sessions
it held (services/dispatcher/recovery.py).
"""

from __future__ import annotations

import json
import os
import random
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
from stack import plan

SERVICES = ("verifier", "drafter", "prefix", "suffix", "dispatcher")
REPLICABLE = ("verifier", "suffix")   # stateless across sessions: any number of replicas
REPLICA_PORT_STRIDE = 100             # replica i listens on its role's ports + 100·i
# The OpenAI-compatible HTTP gateway (api/, `tandem serve api`): `tandem up` starts it after the
# dispatcher; it has no ZMQ endpoint (its `endpoint` is its HTTP base URL, its `http_port` the
# same port) and a light share, like the dispatcher's: one thread on the dispatcher's cores.
GATEWAY = "api"
PEER_FIELDS = {"verifier": "verifier", "drafter": "drafter", "prefix": "prefix", "suffix": "suffix"}


def role_of(name: str) -> str:
    """The service a process runs: "verifier-1" -> "verifier"."""
    base, _, index = name.rpartition("-")
    return base if base in SERVICES and index.isdigit() else name


def replica_names(role: str, n: int) -> list[str]:
    return [role if i == 0 else f"{role}-{i}" for i in range(n)]


def parse_replicas(spec: str) -> dict[str, int]:
    """`verifier=2,suffix=2` -> {"verifier": 2, "suffix": 2}; ValueError naming what is wrong."""
    out: dict[str, int] = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        name, eq, count = item.partition("=")
        if not eq or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"--replicas {item!r}: expected SERVICE=N with N >= 1")
        if name.strip() not in REPLICABLE:
            raise ValueError(f"--replicas: {name.strip()!r} cannot be replicated; only "
                             f"{', '.join(REPLICABLE)} (cloud services) can")
        out[name.strip()] = int(count)
    return out


def run_dir() -> Path:
    return Path(os.environ.get("TANDEM_RUN_DIR", repo_root() / "run"))


_handed_out: set[int] = set()
_rng = random.Random()   # its own: a test seeding `random` must not make two processes agree


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999   # Linux's default


def free_port() -> int:
    """A loopback port nothing is bound to, for a service to listen on a moment later. Taken
    below the kernel's ephemeral range: bind(0) would hand out a port from that range, where the
    kernel also puts the source port of every outgoing connection, so a health probe could hold
    it by the time the service binds (CI saw a dispatcher fail `address already in use`). A port
    is handed out once per process, so two services of a cluster never get the same one."""
    lo, hi = _ephemeral_range()
    first, end = (max(1024, lo - 12000), lo) if lo > 1024 else (hi + 1, 65536)
    for _ in range(200 if first < end else 0):
        port = _rng.randrange(first, end)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:   # a crowded machine: whatever the kernel gives
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
    role: str = ""                                   # the service it runs ("verifier" for "verifier-1")
    restarts: int = 0                                # times the supervisor restarted it
    argv: list[str] = field(default_factory=list)    # how it was started (a supervisor restarts it so)
    env: dict[str, str] = field(default_factory=dict)  # environment it was given on top of the caller's

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
                 service_env: dict[str, dict[str, str]] | None = None,
                 replicas: dict[str, int] | None = None):
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
        self.replicas = dict(replicas or {})  # {role: processes}; 1 when not named
        self.saved = False                    # loaded from a state file: argv/env as recorded
        for role in services:
            for i, name in enumerate(replica_names(role, self.replicas.get(role, 1))):
                self._add(name, role, i)

    def _add(self, name: str, role: str, index: int) -> None:
        if name == GATEWAY:
            port = free_port() if self.ephemeral else API_PORT
            self.procs[name] = ServiceProc(name, f"http://127.0.0.1:{port}", port,
                                           log=str(self.logdir / f"{name}.log"),
                                           cpus=self.pin.get(name, []), role=role)
            return
        zmq_port, http_port = (p + REPLICA_PORT_STRIDE * index for p in DEFAULT_PORTS[role])
        if self.ephemeral:
            zmq_port, http_port = free_port(), free_port()
        self.procs[name] = ServiceProc(name, f"tcp://127.0.0.1:{zmq_port}", http_port,
                                       log=str(self.logdir / f"{name}.log"),
                                       cpus=self.pin.get(name, self.pin.get(role, [])),
                                       role=role)

    def endpoint(self, name: str) -> str:
        return self.procs[name].endpoint

    def endpoints(self, role: str) -> str:
        """Every replica of `role`, as the dispatcher's comma-separated replica list."""
        return ",".join(p.endpoint for p in self.procs.values() if (p.role or p.name) == role)

    def argv(self, name: str) -> list[str]:
        p = self.procs[name]
        role = p.role or role_of(name)
        extra = self.extra.get(name, self.extra.get(role, []))
        if name == GATEWAY:
            args = [sys.executable, "-m", "api.service", "--host", "127.0.0.1",
                    "--port", str(p.http_port)]
            if "dispatcher" in self.procs:
                args += ["--dispatcher", self.procs["dispatcher"].endpoint]
            return args + [str(a) for a in extra]
        args = [sys.executable, "-m", f"services.{role}.service", "--bind", p.endpoint,
                "--http-port", str(p.http_port)]
        if role == "dispatcher":
            for peer in PEER_FIELDS:
                if peer in self.procs:
                    args += [f"--{peer}", self.endpoints(peer)]
        return args + [str(a) for a in extra]

    def start(self, name: str) -> ServiceProc:
        p = self.procs[name]
        role = p.role or role_of(name)
        Path(p.log).parent.mkdir(parents=True, exist_ok=True)
        if not (self.saved and p.argv):   # from a state file: restarted as it was started
            p.argv = self.argv(name)
            p.env = {k: v for k, v in self.service_env.get(name, self.service_env.get(role, {})).items()
                     if k not in os.environ}
            p.env.update({k: v for k, v in self.env.items() if v is not None})
        # the plan's thread-pool settings unless the caller's environment has its own
        env = {**os.environ, **p.env, "PYTHONUNBUFFERED": "1"}
        for k, v in self.env.items():
            if v is None:
                env.pop(k, None)
        env["PYTHONPATH"] = os.pathsep.join([str(repo_root()), env.get("PYTHONPATH", "")])
        cpus = list(p.cpus)
        logf = open(p.log, "ab")
        # pinned in the child before exec, so every thread it ever starts inherits the cores
        proc = subprocess.Popen(p.argv, stdout=logf, stderr=subprocess.STDOUT, env=env,
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

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Stop one service: SIGTERM (a service drains for up to its drain_s, 10 s by default,
        then exits), SIGKILL after `timeout`."""
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
        c.saved = True
        for name, d in data.items():
            c.procs[name] = ServiceProc(**d)
        return c


def planned(services=SERVICES, ephemeral: bool = False, extra: dict | None = None,
            env: dict | None = None, logdir: Path | None = None,
            cpus: list[int] | None = None, replicas: dict[str, int] | None = None) -> Cluster:
    """The cluster `tandem up` starts: each service with its share of the usable cores
    (common/resources.py), its configured `threads` / `cpus` (TANDEM_<SERVICE>_THREADS,
    TANDEM_<SERVICE>_CPUS, or flags in `extra`) taken as overrides."""
    extra = {k: [str(a) for a in v] for k, v in (extra or {}).items()}
    merged = {**os.environ, **{k: v for k, v in (env or {}).items() if v is not None}}
    wire = [s for s in services if s != GATEWAY]
    cores, shares = plan.plan_services(wire, argv=extra, env=merged, cpus=cpus)
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
                             for n, s in shares.items()},
                      replicas=replicas)
    # replicas of a role share its plan (they take turns on its cores, as sessions do)
    for p in cluster.procs.values():
        share = shares.get(p.role or p.name)
        if share is not None:
            p.threads = share.threads
    cluster.shares, cluster.cores = shares, cores
    return cluster


class Supervisor:
    """Restart services that die, with exponential backoff — what compose's
    `restart: unless-stopped` and a Kubernetes controller do. A service that ran `stable_s`
    before dying starts again after `base_s`; one that keeps dying waits twice as long each time,
    up to `max_s`. The dispatcher replays the sessions a dead cloud service held
    (services/dispatcher/recovery.py), so a restart costs those requests a replay, not their
    output."""

    def __init__(self, cluster: Cluster, base_s: float = 1.0, max_s: float = 30.0,
                 stable_s: float = 60.0, log=print, state: Path | None = None):
        self.cluster = cluster
        self.base_s, self.max_s, self.stable_s = base_s, max_s, stable_s
        self.log = log
        self.state = state                      # state file to keep current, if any
        now = time.monotonic()
        self.started = {n: now for n in cluster.procs}
        self.backoff = {n: 0.0 for n in cluster.procs}
        self.due: dict[str, float] = {}         # name -> when its restart is due

    def poll(self) -> list[str]:
        """Check every service once; restart those whose backoff has passed. Returns the names
        restarted."""
        now = time.monotonic()
        restarted = []
        for name, p in self.cluster.procs.items():
            if not p.pid or p.alive():   # pid 0: stopped on purpose ("unless-stopped")
                continue
            if name not in self.due:
                ran = now - self.started.get(name, now)
                b = self.base_s if ran >= self.stable_s or not self.backoff[name] else \
                    min(self.max_s, 2 * self.backoff[name])
                self.backoff[name] = b
                self.due[name] = now + b
                self.log(f"{name} (pid {p.pid}) exited after {ran:.1f} s; restarting in {b:.1f} s "
                         f"(last log lines:\n{tail(p.log, 5)})")
                continue
            if now < self.due[name]:
                continue
            del self.due[name]
            self.cluster._popen.pop(name, None)
            self.cluster.start(name)
            p.restarts += 1
            self.started[name] = time.monotonic()
            restarted.append(name)
            self.log(f"{name} restarted (pid {p.pid}, restart {p.restarts})")
        if restarted and self.state is not None:
            self.cluster.save_state(self.state)
        return restarted

    def run(self, interval: float = 0.5, stop=lambda: False) -> None:
        while not stop():
            self.poll()
            time.sleep(interval)


def supervisor_pid_file() -> Path:
    return run_dir() / "supervisor.pid"


def supervise_detached(state: Path) -> int:
    """Start a background supervisor of the cluster in `state` (for `tandem up --detach`);
    `tandem down` stops it first. Returns its pid."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root()),
                                                        os.environ.get("PYTHONPATH", "")])}
    logf = open(run_dir() / "supervisor.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "stack.launcher", "supervise", str(state)],
                            stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(repo_root()),
                            start_new_session=True)
    logf.close()
    supervisor_pid_file().write_text(str(proc.pid))
    return proc.pid


def stop_supervisor() -> None:
    path = supervisor_pid_file()
    if path.is_file():
        try:
            _terminate(int(path.read_text().strip()), signal.SIGTERM, 5.0)
        except ValueError:
            pass
        path.unlink(missing_ok=True)


def _supervise_main(state: str) -> None:
    cluster = Cluster.from_state(Path(state))
    if cluster is None:
        raise SystemExit(f"no state file {state}")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))

    def log(msg: str) -> None:
        print(time.strftime("%H:%M:%S"), msg, flush=True)
    Supervisor(cluster, log=log, state=Path(state)).run(stop=lambda: bool(stopping))


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


if __name__ == "__main__":   # python -m stack.launcher supervise STATE (tandem up --detach)
    if len(sys.argv) == 3 and sys.argv[1] == "supervise":
        _supervise_main(sys.argv[2])
    else:
        raise SystemExit("usage: python -m stack.launcher supervise STATE_FILE")
