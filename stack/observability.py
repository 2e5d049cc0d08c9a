"""Tandem observed end to end: the Grafana dashboards' PromQL, a real Prometheus, real traffic.

Used by the deployment tests (tests/integration/test_deploy.py: synthetic exporter;
tests/integration/test_observability.py: the running services) and by the dashboard screenshots
(`python -m bench.dashboard_snapshots`):

* `dashboard_queries()` / `variable_queries()` — every panel expression and template variable of
  deploy/grafana/dashboards/*.json; `render_expr()` replaces Grafana's variables as Grafana would;
* `run_prometheus()` — a real Prometheus (Debian package `prometheus`) on loopback scraping the
  given targets; `prometheus_query()` / `prometheus_query_range()` / `evaluate_panels()`;
* `promtool_check_metrics()` — `promtool check metrics` on an exposition text;
* `observed_stack()` — every service as a local process (stack.launcher.Cluster), with a second
  suffix replica on another scheduler, and a Prometheus scraping all of them every second;
* `drive_traffic()` — requests in every mode through the SDK: cloud-only, speculative (several
  policies), split (both suffix replicas, several cuts), and one invalid request.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from stack.launcher import free_port
from common.models import repo_root

DASHBOARDS = repo_root() / "deploy" / "grafana" / "dashboards"


# ================================================================= dashboards

@dataclass(frozen=True)
class PanelQuery:
    dashboard: str   # file stem: overview, speculative, split, services
    panel: str       # panel title
    ref_id: str
    expr: str        # as written in the dashboard (Grafana variables unrendered)
    instant: bool
    legend: str = ""  # the target's legendFormat

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}"


def load_dashboards(directory: Path = DASHBOARDS) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def iter_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])          # panels inside collapsed rows


def panel_queries(name: str, panel: dict) -> list[PanelQuery]:
    return [PanelQuery(name, panel.get("title", ""), t.get("refId", ""), t["expr"],
                       bool(t.get("instant")), t.get("legendFormat", ""))
            for t in panel.get("targets", []) if t.get("expr")]


def dashboard_queries(directory: Path = DASHBOARDS) -> list[PanelQuery]:
    """Every (dashboard, panel, expr) in the Grafana dashboards, for static and live checks."""
    out = []
    for name, dash in load_dashboards(directory).items():
        for panel in iter_panels(dash):
            out += panel_queries(name, panel)
    return out


def variable_queries(directory: Path = DASHBOARDS) -> list[tuple[str, str, str]]:
    """(dashboard, variable, query) for every query variable, e.g. label_values(metric, label)."""
    out = []
    for name, dash in load_dashboards(directory).items():
        for v in dash.get("templating", {}).get("list", []):
            if v.get("type") == "query":
                q = v.get("query")
                out.append((name, v["name"], q.get("query", "") if isinstance(q, dict) else q))
    return out


def label_values_query(query: str) -> tuple[str, str]:
    """`label_values(metric, label)` -> (metric, label)."""
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*(\w+)\s*\)\s*", query)
    if not m:
        raise ValueError(f"variable query {query!r} is not label_values(metric, label)")
    return m.group(1), m.group(2)


_GRAFANA_VARS = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def render_expr(expr: str, variables: dict[str, str] | None = None, *,
                rate_interval: str = "1m", range_: str = "5m", interval: str = "15s") -> str:
    """Grafana's variables replaced, as Grafana would before sending `expr` to Prometheus.

    Template variables default to `.*` (the dashboards' "All" value)."""
    builtins = {"__rate_interval": rate_interval, "__range": range_, "__interval": interval,
                "__range_s": "300", "__interval_ms": "15000"}
    variables = variables or {}

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name in builtins:
            return builtins[name]
        return variables.get(name, ".*")

    return _GRAFANA_VARS.sub(sub, expr)


# ================================================================= Prometheus

class ToolMissing(RuntimeError):
    """A binary from the Debian package `prometheus` is not installed."""


def tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        raise ToolMissing(f"{name} not installed (Debian: apt-get install prometheus)")
    return path


def _api(base: str, path: str, params: dict, timeout: float) -> dict:
    url = f"{base}{path}?" + urllib.parse.urlencode(params, doseq=True)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    if body.get("status") != "success":
        raise AssertionError(f"{body.get('errorType')}: {body.get('error')}")
    return body["data"]


def prometheus_query(base: str, expr: str, timeout: float = 10) -> list[dict]:
    """Instant query; returns the result vector, raises AssertionError on a PromQL error."""
    result = _api(base, "/api/v1/query", {"query": expr}, timeout)["result"]
    return result if isinstance(result, list) else [result]


def prometheus_query_range(base: str, expr: str, start: float, end: float, step: float,
                           timeout: float = 30) -> list[dict]:
    """Range query; [{"metric": {...}, "values": [[t, "v"], ...]}, ...]."""
    return _api(base, "/api/v1/query_range",
                {"query": expr, "start": start, "end": end, "step": step}, timeout)["result"]


def label_values(base: str, label: str, metric: str, timeout: float = 10) -> list[str]:
    return _api(base, f"/api/v1/label/{label}/values", {"match[]": metric}, timeout)


@contextlib.contextmanager
def run_prometheus(targets: dict[str, str], workdir: Path, scrape_interval: str = "1s"
                   ) -> Iterator[str]:
    """A real Prometheus on loopback scraping {job: "host:port"}; yields its base URL."""
    binary = tool("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = {"global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval},
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t]}]}
                                 for job, t in targets.items()]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    raise AssertionError("prometheus did not start:\n"
                                         + (workdir / "prometheus.log").read_text()[-3000:]) from None
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def evaluate_panels(base: str, queries: list[PanelQuery] | None = None, *,
                    rate_interval: str = "1m", range_: str = "5m",
                    variables: dict[str, str] | None = None
                    ) -> list[tuple[PanelQuery, list[dict], str | None]]:
    """(query, result vector, error or None) for every panel query, evaluated now."""
    out = []
    for pq in queries if queries is not None else dashboard_queries():
        expr = render_expr(pq.expr, variables, rate_interval=rate_interval, range_=range_)
        try:
            out.append((pq, prometheus_query(base, expr), None))
        except AssertionError as e:
            out.append((pq, [], str(e)))
    return out


def finite_values(result: list[dict]) -> list[float]:
    """The finite sample values of an instant-query result (NaN/Inf is no data on a panel)."""
    vals = [float(s["value"][1]) for s in result if "value" in s]
    return [v for v in vals if v == v and abs(v) != float("inf")]


def promtool_check_metrics(exposition: str) -> tuple[int, str]:
    """`promtool check metrics` on an exposition text (fed on stdin): (exit status, output)."""
    r = subprocess.run([tool("promtool"), "check", "metrics"], input=exposition,
                       capture_output=True, text=True, timeout=60)
    return r.returncode, (r.stdout + r.stderr).strip()


# ================================================================= the running services

SPLIT_SCHEDULERS = ("cascade", "dsb")   # suffix replica 0, replica 1
ONE_THREAD = ["--threads", "1"]          # two shared cores: each model process keeps to one


@dataclass
class Stack:
    cluster: object                      # stack.launcher.Cluster: the five services
    replica: object                      # a Cluster holding the second suffix replica
    prometheus: str                      # base URL
    api: str = ""                        # the OpenAI-compatible gateway's base URL (api/)
    started: float = field(default_factory=time.time)

    @property
    def dispatcher(self) -> str:
        return self.cluster.endpoint("dispatcher")

    def metrics_urls(self) -> dict[str, str]:
        """job name -> /metrics URL of every service process."""
        urls = {n: p.url("/metrics") for n, p in self.cluster.procs.items()}
        urls[f"suffix-{SPLIT_SCHEDULERS[1]}"] = self.replica.procs["suffix"].url("/metrics")
        return urls


@contextlib.contextmanager
def observed_stack(workdir: Path, ready_timeout: float = 300.0) -> Iterator[Stack]:
    """Every service as a local process on ephemeral ports, plus a second suffix replica on the
    other scheduler (the dispatcher takes turns over the two for new split sessions), and a real
    Prometheus scraping every /metrics each second."""
    from stack.launcher import Cluster

    tool("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(ephemeral=True, logdir=workdir / "logs", extra={
        "verifier": ONE_THREAD, "prefix": ONE_THREAD,
        "suffix": ONE_THREAD + ["--scheduler", SPLIT_SCHEDULERS[0]],
        "dispatcher": ["--heartbeat-s", "0.5", "--peer-timeout-s", "3"]})
    replica = Cluster(services=("suffix",), ephemeral=True, logdir=workdir / "logs-replica",
                      extra={"suffix": ONE_THREAD + ["--scheduler", SPLIT_SCHEDULERS[1]]})
    suffixes = f"{cluster.endpoint('suffix')},{replica.endpoint('suffix')}"
    cluster.extra["dispatcher"] += ["--suffix", suffixes]
    gateway = None
    try:
        cluster.start_all()
        replica.start_all()
        cluster.wait_ready(timeout=ready_timeout)
        replica.wait_ready(timeout=ready_timeout)
        gateway, api = start_gateway(cluster.endpoint("dispatcher"), workdir / "logs" / "api.log")
        targets = {n: f"127.0.0.1:{p.http_port}" for n, p in cluster.procs.items()}
        targets[f"suffix-{SPLIT_SCHEDULERS[1]}"] = f"127.0.0.1:{replica.procs['suffix'].http_port}"
        targets["api"] = api.removeprefix("http://")
        with run_prometheus(targets, workdir / "prometheus") as base:
            wait_for_scrapes(base, len(targets))
            yield Stack(cluster, replica, base, api)
    finally:
        if gateway is not None:
            gateway.terminate()
            try:
                gateway.wait(10)
            except subprocess.TimeoutExpired:
                gateway.kill()
        replica.stop_all()
        cluster.stop_all()


def start_gateway(dispatcher: str, log: Path, timeout: float = 120.0
                  ) -> tuple[subprocess.Popen, str]:
    """`tandem serve api` on a free port in front of `dispatcher`, ready; (process, base URL)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root()),
                                                        os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stack.cli", "serve", "api", "--port",
                                 str(port), "--dispatcher", dispatcher], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=str(repo_root()))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the API gateway exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"the API gateway not ready in {timeout} s")
        time.sleep(0.2)


def wait_for_scrapes(base: str, n_targets: int, timeout: float = 30.0) -> None:
    """Until every target has been scraped successfully."""
    deadline = time.monotonic() + timeout
    while True:
        up = prometheus_query(base, "up == 1")
        if len(up) >= n_targets:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(up)} of {n_targets} targets up in Prometheus: "
                                 f"{[s['metric'] for s in up]}")
        time.sleep(0.25)
