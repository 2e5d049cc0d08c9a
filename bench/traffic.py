"""Traffic in every mode through the SDK, for the dashboards: what `bench/dashboard_snapshots.py`
renders and what tests/integration/test_observability.py checks every panel against.

It lives here, not in common/: it is a client of the whole stack (tandem's SDK), and common/ is
the layer below the services and the SDK.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from tandem import AsyncClient, InvalidRequest

# (prompt, request options) — what drive_traffic sends in each round, concurrently per phase
PROMPTS = ("The history of the printing press begins", "def fibonacci(n):\n",
           "Once upon a time", "What are three good habits for writing clean Python code?")
SPEC_POLICIES = ("pipesd", "pipesd-stream", "vanilla", "edgellm")
SPLIT_CUTS = (4, 12)


def traffic_phases(max_tokens: int) -> list[list[tuple[str, dict]]]:
    n = max_tokens
    cloud = [(PROMPTS[0], {"mode": "cloud-only", "max_tokens": n}),
             (PROMPTS[1], {"mode": "cloud-only", "max_tokens": n, "temperature": 0.8, "seed": 7})]
    spec = [(PROMPTS[i % len(PROMPTS)], {"mode": "spec", "policy": p, "max_tokens": n})
            for i, p in enumerate(SPEC_POLICIES)]
    # pipesd alone, verifying after every draft token: tokens are drafted while a verification
    # is in flight, so the proactive panels have data. The spec phase's sessions share one
    # drafter, one token each in turn, so each verification is back before its session's next
    # draft and they may draft nothing proactively.
    proactive = [(PROMPTS[0], {"mode": "spec", "policy": "pipesd", "max_tokens": n,
                               "nav_thresholds": (1.0, 1.0)})]
    # four sessions, taking turns over the two suffix replicas: each gets both cuts at once
    split = [(PROMPTS[i % len(PROMPTS)], {"mode": "split", "cut": c, "max_tokens": n})
             for i, c in enumerate(SPLIT_CUTS + SPLIT_CUTS[::-1])]
    return [cloud, spec, proactive, split]


@dataclass
class TrafficReport:
    requests: int = 0
    tokens: int = 0
    invalid_rejected: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


async def _drive(endpoint: str, rounds: int, max_tokens: int, report: TrafficReport) -> None:
    async with AsyncClient(endpoint, timeout_s=120) as c:
        for _ in range(rounds):
            for phase in traffic_phases(max_tokens):
                results = await asyncio.gather(
                    *[c.complete(p, stop_at_eos=False, **kw) for p, kw in phase],
                    return_exceptions=True)
                for (_, kw), r in zip(phase, results):
                    if isinstance(r, BaseException):
                        report.failures.append(f"{kw}: {r!r}")
                    else:
                        report.requests += 1
                        report.tokens += len(r.token_ids)
            # a real client error through the API: a cut the model does not have
            try:
                await c.complete(PROMPTS[0], mode="split", cut=10_000, max_tokens=2)
                report.failures.append("cut=10000 was accepted")
            except InvalidRequest:
                report.invalid_rejected += 1


def sse_events(http, base: str, route: str, body: dict):
    """The JSON events of one streamed request to the gateway's /v1/`route` (httpx client
    `http`): a non-200 answer or an `error` event raises RuntimeError."""
    with http.stream("POST", f"{base}/v1/{route}", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"gateway stream failed: {event['error']}")
            yield event


def _drive_api(base: str, max_tokens: int, report: TrafficReport) -> None:
    """A completion and a streamed chat completion through the OpenAI-compatible gateway."""
    import httpx

    for route, body in (("completions", {"prompt": PROMPTS[0]}),
                        ("chat/completions", {"messages": [{"role": "user", "content": PROMPTS[3]}],
                                              "stream": True})):
        r = httpx.post(f"{base}/v1/{route}", timeout=120, json={
            "model": "tandem", "max_tokens": max_tokens, "temperature": 0, **body})
        if r.status_code == 200:
            report.requests += 1
        else:
            report.failures.append(f"POST /v1/{route}: {r.status_code} {r.text[:200]}")


def drive_traffic(endpoint: str, rounds: int = 1, max_tokens: int = 16,
                  api: str = "") -> TrafficReport:
    """Requests in every mode through the SDK (see traffic_phases), `rounds` times; and through
    the API gateway at `api`, when given."""
    report = TrafficReport()
    t0 = time.monotonic()
    asyncio.run(_drive(endpoint, rounds, max_tokens, report))
    if api:
        _drive_api(api, max_tokens, report)
    report.seconds = time.monotonic() - t0
    return report
