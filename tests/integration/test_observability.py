"""Observability against the running services (DESIGN.md §6; issue 6).

Every service runs as a local process (plus a second suffix replica on another scheduler), a real
Prometheus (Debian package) scrapes every /metrics each second, and traffic goes through the SDK
in every mode: cloud-only, speculative (pipesd, pipesd-stream, vanilla, edgellm), split (cascade
and dsb schedulers, cuts 4 and 12), and one invalid request. Then

* every PromQL expression of every Grafana dashboard panel, rendered as Grafana sends it, and
  every dashboard variable returns data: at least one series with a finite value;
* `promtool check metrics` finds nothing to say about any service's /metrics output.

tests/integration/test_deploy.py runs the same panel check against synthetic samples of every metric.
"""

from __future__ import annotations

import math
import shutil
import time
import urllib.request

import pytest

from bench import traffic
from stack import observability as obs
from tests.conftest import need_tool, wait_until



@pytest.fixture(scope="module")
def stack(model_paths, tmp_path_factory):
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        need_tool("prometheus/promtool", "Debian: apt-get install prometheus")
    with obs.observed_stack(tmp_path_factory.mktemp("observability")) as s:
        report = traffic.drive_traffic(s.dispatcher, rounds=1, max_tokens=12, api=s.api)
        assert not report.failures, report.failures
        assert report.invalid_rejected == 1
        s.traffic = report
        last = time.time()
        n_targets = len(s.metrics_urls())

        def scraped_twice_since() -> bool:
            # scrapes every second: a latest scrape over 1 s after `last` had one before it
            # that was after `last` too
            ts = [float(x["value"][1]) for x in obs.prometheus_query(s.prometheus, "timestamp(up)")]
            return len(ts) >= n_targets and min(ts) > last + 1.0
        wait_until(scraped_twice_since, 30, "two scrapes of every target after the last request",
                   every=0.2)
        yield s


def _window(stack) -> str:
    """A rate interval covering everything since the services started (Grafana's
    $__rate_interval over a dashboard range that holds the traffic)."""
    return f"{max(30, math.ceil(time.time() - stack.started) + 5)}s"


def test_every_panel_returns_data_from_the_running_services(stack):
    window = _window(stack)
    results = obs.evaluate_panels(stack.prometheus, rate_interval=window, range_=window)
    bad = []
    for pq, result, err in results:
        if err or not obs.finite_values(result):
            bad.append(f"{pq}: {err or ('no data' if not result else f'only NaN/Inf: {result}')}"
                       f"\n    {obs.render_expr(pq.expr, rate_interval=window, range_=window)}")
    for dash, var, query in obs.variable_queries():
        metric, label = obs.label_values_query(query)
        if not obs.label_values(stack.prometheus, label, metric):
            bad.append(f"{dash}: variable {var} ({query}) has no values")
    assert not bad, f"{len(bad)} of {len(results)} queries failed:\n" + "\n".join(bad)
    assert len(results) > 80


def test_variables_offer_every_mode_policy_and_scheduler(stack):
    values = {(d, v): set(obs.label_values(stack.prometheus, *obs.label_values_query(q)[::-1]))
              for d, v, q in obs.variable_queries()}
    assert {"cloud-only", "spec", "split"} <= values["overview", "mode"]
    assert set(traffic.SPEC_POLICIES) <= values["speculative", "policy"]
    assert set(obs.SPLIT_SCHEDULERS) == values["split", "scheduler"]
    assert {"dispatcher", "verifier", "drafter", "prefix", "suffix"} == values["services", "service"]


def test_promtool_check_metrics_on_every_service(stack):
    problems = []
    for job, url in stack.metrics_urls().items():
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        assert "tandem_up" in text, job
        rc, out = obs.promtool_check_metrics(text)
        if rc != 0 or out:
            problems.append(f"{job} (exit {rc}):\n{out}")
    assert not problems, "\n".join(problems)
