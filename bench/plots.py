"""Plots of benchmark JSON documents (shape: {"bench", "scenario", "machine", "results"})."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def _spec(doc: dict, ax) -> None:
    rows = [r for r in doc["results"] if "tpt_ms" in r and r.get("policy")
            and r.get("kind") != "load"]
    if any(r.get("uplink_mbit") for r in rows):   # a bandwidth sweep: TPT against uplink
        by_policy = defaultdict(list)
        for r in rows:
            by_policy[r["policy"]].append((r["uplink_mbit"], r["tpt_ms"]))
        for policy, pts in by_policy.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["uplink_mbit"] for r in rows}),
                      [f"{u:g}" for u in sorted({r["uplink_mbit"] for r in rows})])
        ax.set_xlabel("uplink (Mbit/s)")
        ax.set_ylabel("time per accepted token (ms, median)")
        ax.set_title(f"spec — uplink sweep, scenario {doc.get('scenario')}")
        ax.legend(fontsize=8)
        return
    labels = [r["policy"] + (f"\n{r['drafter']}" if r.get("drafter") else "") for r in rows]
    vals = [r["tpt_ms"] for r in rows]
    if all(r.get("ci95") for r in rows):   # 95 % bootstrap interval of the mean
        err = [[max(0.0, v - r["ci95"][0]) for v, r in zip(vals, rows)],
               [max(0.0, r["ci95"][1] - v) for v, r in zip(vals, rows)]]
    else:                                   # older runs: half the IQR
        err = [(r.get("tpt_ms_spread", 0) or 0) / 2 for r in rows]
    ax.bar(range(len(rows)), vals, yerr=err, capsize=3, color="#4c72b0")
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("time per token (ms; bar = 95 % CI, or IQR in older runs)")
    ax.set_title(f"spec — scenario {doc.get('scenario')}")


def split_rows(doc: dict) -> list[dict]:
    """Flat rows from either shape bench_split writes: flat results or sections of rows."""
    out = []
    for r in doc["results"]:
        for row in (r.get("rows") or [r]):
            row = {**row, "section": r.get("section", row.get("section", ""))}
            row.setdefault("scheduler", row.get("variant"))
            row.setdefault("throughput_tok_s", row.get("throughput"))
            row.setdefault("concurrency", row.get("load", row.get("fleet", row.get("context"))))
            row.setdefault("mean_latency_s", row.get("latency"))
            if "mismatches" in row:
                row.setdefault("identical_to_reference", row["mismatches"] == 0)
            out.append(row)
    return out


def _split(doc: dict, ax) -> None:
    by_sched = defaultdict(list)
    for r in split_rows(doc):
        if r.get("section", "poisson") != "poisson":
            continue
        if (r.get("throughput_tok_s") is not None and r.get("scheduler")
                and isinstance(r.get("concurrency"), (int, float))):
            by_sched[r["scheduler"]].append((r["concurrency"], r["throughput_tok_s"]))
    for sched, pts in sorted(by_sched.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=sched)
    ax.set_xlabel("mean concurrency")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(f"split — scenario {doc.get('scenario')}")
    ax.legend(fontsize=8)


def _overhead(doc: dict, ax) -> None:
    rows = [r for r in doc["results"] if r.get("kind") == "transport"]
    ax.bar([r["message"] for r in rows], [r["rtt_us"] for r in rows], color="#55a868")
    ax.set_ylabel("round trip (µs, median)")
    ax.set_title("transport per hop (loopback)")


def _tuner(doc: dict, ax) -> None:
    """Best TPT found so far against evaluations spent, one line per search (PipeSD's figure)."""
    for r in doc["results"]:
        trace = r.get("trace_ms") or []
        if trace:
            best = [min(trace[:i + 1]) for i in range(len(trace))]
            ax.plot(range(1, len(best) + 1), best, marker=".",
                    label=f"{r['search']} (re-measured {r['tpt_ms']:.1f} ms)")
    ax.set_xlabel("evaluations")
    ax.set_ylabel("best TPT so far (ms)")
    ax.set_title(f"R1/R2 search — scenario {doc.get('scenario')}")
    ax.legend(fontsize=8)


def _defaults(doc: dict, ax) -> None:
    """`bench defaults`: TPT per mode, one bar per configuration (error bar: IQR / 2)."""
    rows = doc["results"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    by = {(r["mode"], r["config"]): r for r in rows}
    w = 0.8 / max(1, len(configs))
    for j, c in enumerate(configs):
        xs = [i + (j - (len(configs) - 1) / 2) * w for i in range(len(modes))]
        vals = [by[m, c]["tpt_ms"] if (m, c) in by else 0 for m in modes]
        err = [(by[m, c].get("tpt_ms_iqr") or 0) / 2 if (m, c) in by else 0 for m in modes]
        ax.bar(xs, vals, w, yerr=err, capsize=2, label=c)
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("time per token (ms, median)")
    ax.set_title("defaults — `tandem up`'s plan vs hand-set threads and cores")
    ax.legend(fontsize=8)


def plot(doc: dict, path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    {"spec": _spec, "split": _split, "overhead": _overhead,
     "tuner": _tuner, "defaults": _defaults}.get(doc["bench"], _overhead)(doc, ax)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
