"""The gateway's Prometheus metrics (served on its own /metrics). Names follow common/metrics.py:
prefix `tandem_api_`, base units, `_total` counters, low-cardinality labels (`route` is one of
the API's routes, never a raw path)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from common.metrics import LATENCY

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions")

REQUESTS = Counter("tandem_api_requests_total", "HTTP requests answered, by route and status",
                   ["route", "status"])
ACTIVE = Gauge("tandem_api_active_requests", "Generation requests in progress", ["route"])
TTFT = Histogram("tandem_api_time_to_first_token_seconds",
                 "Request arrival to the first generated text sent (streaming and not)",
                 ["route", "mode"], buckets=LATENCY)
TPT = Histogram("tandem_api_time_per_token_seconds",
                "Request duration / completion tokens, per finished generation",
                ["route", "mode"], buckets=LATENCY)
COMPLETION_TOKENS = Counter("tandem_api_completion_tokens_total", "Completion tokens returned",
                            ["route", "mode"])
PROMPT_TOKENS = Counter("tandem_api_prompt_tokens_total", "Prompt tokens received",
                        ["route", "mode"])
CANCELLED = Counter("tandem_api_cancelled_total",
                    "Generations cancelled on the dispatcher, by why (stop string, disconnect)",
                    ["route", "reason"])

RESUMES = Counter("tandem_api_resumes_total",
                  "Generations resumed (continued from their tokens) after the dispatcher was "
                  "lost mid-stream", ["route", "mode"])


MODES = ("auto", "cloud-only", "spec", "split")   # the requested mode


def declare() -> None:
    """Children known at start, at 0, so dashboards show them before the first request (and a
    rate() over the first requests sees them rise from 0: a series born at 1 has no increase)."""
    for route in ROUTES:
        REQUESTS.labels(route, "200")
    for route in ROUTES[1:]:
        ACTIVE.labels(route).set(0)
        for mode in MODES:
            for family in (TTFT, TPT, COMPLETION_TOKENS, PROMPT_TOKENS, RESUMES):
                family.labels(route, mode)


def route_of(path: str) -> str:
    return path if path in ROUTES else "other"
