"""What every benchmark records: the machine and versions, robust summaries, Welch's t, JSON."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for mod in ("torch", "transformers", "llama_cpp", "zmq", "msgspec", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing library is just not recorded
            pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "versions": versions,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def summary(xs: list[float]) -> dict:
    """Median and spread (IQR; min/max) of repeated trials."""
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"n": len(xs), "median": statistics.median(xs), "iqr": q[2] - q[0],
            "min": xs[0], "max": xs[-1], "mean": statistics.fmean(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def welch_t(a: list[float], b: list[float]) -> float:
    """Welch's t statistic of mean(a) - mean(b); |t| > 2.5 is the DySCo paper's criterion."""
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return float("inf") if statistics.fmean(a) != statistics.fmean(b) else 0.0
    return (statistics.fmean(a) - statistics.fmean(b)) / math.sqrt(va + vb)


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """a/b trial by trial, for conditions run on the same inputs (the split bench's trials share
    their seeded arrivals across schedulers): mean ratio, its t against 1 (|t| > 2.5:
    significant), and how many trials a won."""
    r = [x / y for x, y in zip(a, b)]
    n = len(r)
    if n < 2:
        return {"n": n, "mean_ratio": r[0] if r else float("nan"), "t": float("nan"), "wins": 0}
    sd = statistics.stdev(r)
    m = statistics.fmean(r)
    t = (m - 1) / (sd / math.sqrt(n)) if sd else (float("inf") if m != 1 else 0.0)
    return {"n": n, "mean_ratio": m, "t": t, "wins": sum(x > 1 for x in r)}


def write_json(path: str | None, bench: str, scenario: str, results: list[dict], **extra) -> dict:
    doc = {"bench": bench, "scenario": scenario, "machine": machine(),
           "command": _command(),
           "results": results, **extra}
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=2, default=float) + "\n")
    return doc


def _command() -> str:
    """The command line that ran: `python -m MODULE ...`, or `tandem ...` from the console
    script."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return " ".join(["python -m", spec.name, *sys.argv[1:]])
    return " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    """A fixed-width text table: cols = [(key, header)]."""
    cells = [[h for _, h in cols]] + [[_fmt(r.get(k)) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, float) for x in v):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"   # an interval
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)


AUTO = ("auto", "auto-slo")   # rows where the dispatcher chose the mode


CHANGING_LINK_GAIN = 1.1   # on a link that changes under requests, auto beats every fixed mode by this


def auto_goals(rows: list[dict], scenario: str = "") -> list[list[str]]:
    """auto's verdicts on one run's rows (DESIGN.md §10), as [goal, target, this run, status]:
    its time per token against the best fixed choice (on the `changing` link, faster than it by
    CHANGING_LINK_GAIN) and cloud-only, its first token against cloud-only's, and auto-slo's
    target met with the cloud work it cost."""
    from bench.stats import ratio_ci
    by = {r["policy"]: r for r in rows}
    fixed = [r for r in rows if r["policy"] not in AUTO and r["policy"] != "oracle-trigger"]
    out = []

    def ci(v):
        return f"[{v[0]:.3g}, {v[1]:.3g}]" if v else "n/a"

    def vs(r, ref):
        names = list(r["tpt_ms_by_prompt"])
        a = [r["tpt_ms_by_prompt"][k] for k in names]
        b = [ref["tpt_ms_by_prompt"][k] for k in names]
        return statistics.fmean(a) / statistics.fmean(b), ratio_ci(a, b)
    if "auto" in by and fixed:
        r, best = by["auto"], min(fixed, key=lambda x: x["tpt_ms"])
        x, c = vs(r, best)
        goal, limit, target = f"auto TPT / best fixed ({best['policy']})", 1.05, "<= 1.05"
        if scenario == "changing":
            goal += " on a changing link"
            limit = 1 / CHANGING_LINK_GAIN
            target = f"<= {limit:.3f} ({CHANGING_LINK_GAIN}x faster)"
        out.append([goal, target, f"{x:.3f} {ci(c)}", "met" if x <= limit else "NOT met"])
        if "cloud-only" in by:
            x, c = vs(r, by["cloud-only"])
            out.append(["auto TPT / cloud-only", "CI upper end <= 1.02", f"{x:.3f} {ci(c)}",
                        "met" if c and c[1] <= 1.02 else "NOT met"])
            x, c = r.get("ttft_vs_cloud_only"), r.get("ttft_vs_cloud_only_ci95")
            if x is not None:
                out.append(["auto first token / cloud-only's", "<= 1.1", f"{x:.3f} {ci(c)}",
                            "met" if x <= 1.1 else "NOT met"])
    if "auto-slo" in by and "cloud-only" in by and by["auto-slo"].get("slo_ms"):
        r = by["auto-slo"]
        meeting = [x["policy"] for x in fixed if x["policy"] != "cloud-only"
                   and x.get("slo_hit_rate", 0) >= 0.95]
        out.append([f"auto-slo requests within {r['slo_ms']:.1f} ms per output token after the "
                    "first (1.25x cloud-only's on the tuning prompts)", ">= 95 %",
                    f"{r['slo_met']} ({r['slo_hit_rate']:.0%})",
                    "met" if r["slo_hit_rate"] >= 0.95 else "NOT met"])
        x, c = r.get("cloud_vs_cloud_only"), r.get("cloud_vs_cloud_only_ci95")
        share = ", ".join(f"{k} {v:.0%}" for k, v in r.get("auto_token_share", {}).items())
        if x is not None:   # (cloud-only's cloud CPU was measured)
            out.append(["auto-slo cloud CPU per token / cloud-only's",
                        "<= 0.6 where a speculative policy meets the target",
                        f"{x:.3f} {ci(c)}; tokens: {share}",
                        ("met" if x <= 0.6 else "NOT met") if meeting else
                        "no speculative policy meets the target here"])
    return out


BASELINES = ("vanilla", "hsl", "edgellm")   # the speculative baselines pipesd is measured against


def best_baseline(by: dict[str, dict], key: str = "tpt_ms") -> str | None:
    """The baseline with the lowest `key` of the rows `by` policy name; None unless all three
    baselines have that figure."""
    if not all(by.get(p, {}).get(key) for p in BASELINES):
        return None
    return min(BASELINES, key=lambda p: by[p][key])


def headroom(rows: list[dict], key: str = "tpt_ms") -> list[str]:
    """How much a better NAV trigger could gain on this link and pair: oracle-trigger's TPT (it
    verifies exactly at the first rejected draft; a policy, not a bound: see bench/bound.py)
    against the best baseline's, next to what pipesd, pipesd-stream and the best fixed-threshold
    pipesd of a `bench spec --grid` run ("pipesd@R1:R2" rows) gained. `key`: "tpt_ms" (medians) or
    "tpt_ms_workload" (all time / all tokens)."""
    by = {r["policy"]: r for r in rows if r.get(key)}
    best = best_baseline(by, key)
    if best is None:
        return []
    base = by[best][key]
    out = [f"best baseline by {key}: {best}, {base:.1f} ms"]
    fixed = [p for p in by if "@" in p]
    top = min(fixed, key=lambda p: by[p][key]) if fixed else None
    for p in ("oracle-trigger", "pipesd", "pipesd-stream", top):
        if p in by:
            what = {"oracle-trigger": "a perfect trigger", top: f"the best of {len(fixed)} fixed (R1, R2)"}
            out.append(f"best baseline / {p}: {base / by[p][key]:.3f}x"
                       + (f"  ({what[p]})" if p in what else ""))
    return out
