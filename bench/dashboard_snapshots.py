"""Screenshots of the Grafana dashboards from real data, drawn with matplotlib (not by Grafana).

    python -m bench.dashboard_snapshots [--seconds 60] [--out docs/img/dashboards]

Starts every service locally (stack.observability.observed_stack: the five services, a second
suffix replica on the dsb scheduler, a real Prometheus scraping all of them each second), drives
traffic in every mode through the SDK for `--seconds`, then, for each dashboard in
deploy/grafana/dashboards, runs every panel's PromQL (Grafana's variables rendered as "All")
through Prometheus' `query_range` over the traffic window and draws the dashboard in its grid
layout: rows, stat panels (last value and sparkline), time series with their legends, heatmaps,
bar gauges and state timelines, in the panels' units. Grafana itself cannot run on the machine
these were made on (no Docker, no Debian package), so this is a faithful sketch of what Grafana
shows, from the same queries and the same data — not Grafana's rendering.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates
import matplotlib.pyplot as plt
import numpy as np

from stack import observability as obs
from bench import traffic
from common.models import repo_root

OUT = repo_root() / "docs" / "img" / "dashboards"

# Grafana's dark theme, roughly
BG, PANEL, BORDER, TEXT, DIM, GRID = "#111217", "#181b1f", "#2a2d33", "#d8d9da", "#8e8e8e", "#26292e"
PALETTE = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff",
           "#ffb357", "#96d98d", "#fade2a", "#ca95e5", "#ff7383", "#37872d", "#c4162a"]
COL_W, ROW_H = 0.78, 0.33      # inches per grid column (24 across) and per grid row


# ---------------------------------------------------------------------------- data

class Data:
    """The panels' queries over [start, end], through Prometheus."""

    def __init__(self, base: str, start: float, end: float, step: float,
                 rate_interval: str = "15s"):
        self.base, self.start, self.end, self.step = base, start, end, step
        # what Grafana puts for $__rate_interval; its own choice for a short range at a 1 s
        # scrape interval (4 s) makes bursty traffic unreadable, so the default is wider
        self.rate_interval = rate_interval
        self.range_ = f"{math.ceil(end - start)}s"

    def expr(self, target: dict) -> str:
        return obs.render_expr(target["expr"], rate_interval=self.rate_interval,
                               range_=self.range_)

    def range(self, target: dict) -> list[dict]:
        return obs.prometheus_query_range(self.base, self.expr(target), self.start, self.end,
                                          self.step)

    def instant(self, target: dict) -> list[dict]:
        return [{"metric": s["metric"], "values": [s["value"]]}
                for s in obs.prometheus_query(self.base, self.expr(target))]

    def series(self, target: dict) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(legend, times (datetime), values) for each series a target returns."""
        result = self.instant(target) if target.get("instant") else self.range(target)
        out = []
        for s in result:
            t = np.array([datetime.fromtimestamp(float(v[0])) for v in s["values"]])
            y = np.array([float(v[1]) for v in s["values"]])
            out.append((legend(target, s["metric"]), t, y))
        return sorted(out, key=lambda x: x[0])


def legend(target: dict, labels: dict) -> str:
    fmt = target.get("legendFormat") or "__auto"
    if fmt == "__auto":
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or target.get("refId", "")
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


# ---------------------------------------------------------------------------- units

def fmt_value(v: float, unit: str | None) -> str:
    if v is None or not math.isfinite(v):
        return "No data"
    unit = unit or "short"
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    if unit == "s":
        a = abs(v)
        if a == 0:
            return "0 s"
        if a < 1e-3:
            return f"{v * 1e6:.0f} µs"
        if a < 1:
            return f"{v * 1e3:.3g} ms"
        return f"{v:.3g} s"
    if unit == "bytes":
        for u, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(v) >= k:
                return f"{v / k:.3g} {u}"
        return f"{v:.0f} B"
    suffix = " req/s" if unit == "reqps" else ""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g} M{suffix}"
    if a >= 1e3:
        return f"{v / 1e3:.3g} K{suffix}"
    if a == 0 or a >= 0.01:
        return f"{v:.3g}{suffix}"
    return f"{v:.2e}{suffix}"


def unit_of(panel: dict) -> str | None:
    return panel.get("fieldConfig", {}).get("defaults", {}).get("unit")


# ---------------------------------------------------------------------------- drawing

def style(ax, unit: str | None, time_axis: bool = True) -> None:
    ax.set_facecolor(PANEL)
    for sp in ax.spines.values():
        sp.set_visible(False)
    ax.tick_params(colors=DIM, labelsize=6.5, length=0)
    ax.grid(True, color=GRID, linewidth=0.6)
    if time_axis:
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=6))
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: fmt_value(v, unit)))


def draw_timeseries(ax, panel, data: Data) -> int:
    ncol = max(1, int(panel["gridPos"]["w"] * COL_W / 2.2))
    unit = unit_of(panel)
    n = 0
    for target in panel["targets"]:
        for label, t, y in data.series(target):
            if not np.isfinite(y).any():
                continue                 # a series that is NaN throughout (0/0): nothing drawn
            ax.plot(t, y, color=PALETTE[n % len(PALETTE)], linewidth=1.1, label=label)
            n += 1
    style(ax, unit)
    ax.set_xlim(datetime.fromtimestamp(data.start), datetime.fromtimestamp(data.end))
    if n:
        handles, labels = ax.get_legend_handles_labels()
        fits = ncol * 6                  # six legend rows fit under the plot
        if len(handles) > fits:
            handles, labels = handles[:fits - 1], labels[:fits - 1]
            handles.append(plt.Line2D([], [], color=PANEL))
            labels.append(f"… {n - fits + 1} more series")
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(0, -0.12), ncol=ncol,
                  fontsize=5.5, frameon=False, labelcolor=TEXT, handlelength=1.2,
                  columnspacing=1.0, borderaxespad=0, labelspacing=0.25)
    return n


def draw_stat(ax, panel, data: Data) -> int:
    unit = unit_of(panel)
    ax.set_facecolor(PANEL)
    ax.set_xticks([])
    ax.set_yticks([])
    for sp in ax.spines.values():
        sp.set_visible(False)
    series = [s for target in panel["targets"] for s in data.series(target)]
    value = None
    if series:
        _, t, y = series[0]
        finite = y[np.isfinite(y)]
        value = float(finite[-1]) if finite.size else None
        if finite.size > 1:
            yy = np.where(np.isfinite(y), y, np.nan)
            ax.fill_between(t, yy, color=PALETTE[0], alpha=0.18, linewidth=0)
            ax.plot(t, yy, color=PALETTE[0], linewidth=0.9, alpha=0.8)
            lo, hi = np.nanmin(yy), np.nanmax(yy)
            ax.set_ylim(min(0, lo), hi * 2.2 if hi > 0 else 1)
    ax.text(0.5, 0.55, fmt_value(value, unit), transform=ax.transAxes, ha="center",
            va="center", fontsize=15, color=PALETTE[0] if value is not None else DIM,
            fontweight="bold")
    return len(series)


def draw_heatmap(ax, panel, data: Data) -> int:
    """format=heatmap: cumulative `le` buckets over time, de-accumulated as Grafana does."""
    (target,) = panel["targets"]
    result = data.range(target)
    if not result:
        style(ax, None)
        return 0
    les = sorted(result, key=lambda s: float(s["metric"]["le"]))
    t = np.array([datetime.fromtimestamp(float(v[0])) for v in les[0]["values"]])
    grid = np.array([[float(v[1]) for v in s["values"]] for s in les])
    counts = np.diff(np.vstack([np.zeros(grid.shape[1]), grid]), axis=0).clip(min=0)
    bounds = [s["metric"]["le"] for s in les]
    unit = (panel.get("options", {}).get("yAxis") or {}).get("unit")
    names = [b if b == "+Inf" else fmt_value(float(b), unit) for b in bounds]
    keep = np.where(counts.sum(axis=1) > 0)[0]
    if keep.size:                                   # the populated bucket range, as Grafana trims
        counts, names = counts[keep[0]:keep[-1] + 1], names[keep[0]:keep[-1] + 1]
    x = mdates.date2num(t)
    cmap = plt.get_cmap("Oranges").with_extremes(bad=PANEL)   # empty cells: the background
    ax.imshow(np.ma.masked_less_equal(counts, 0), aspect="auto", origin="lower", cmap=cmap,
              interpolation="nearest",
              extent=(x[0], x[-1], -0.5, len(names) - 0.5))
    style(ax, None)
    ax.grid(False)
    ax.xaxis_date()
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names)
    if len(names) > 8:
        for i, lab in enumerate(ax.get_yticklabels()):
            lab.set_visible(i % math.ceil(len(names) / 8) == 0)
    return len(result)


def draw_bargauge(ax, panel, data: Data) -> int:
    unit = unit_of(panel)
    bars = []
    for target in panel["targets"]:
        for label, _, y in data.series(target):
            finite = y[np.isfinite(y)]
            bars.append((label, float(finite[-1]) if finite.size else float("nan")))

    def key(b):
        m = re.match(r"(\d+)", b[0])
        return (0, int(m.group(1)), b[0]) if m else (1, 0, b[0])
    bars.sort(key=key)
    style(ax, unit, time_axis=False)
    if bars:
        names, vals = zip(*bars)
        colors = [PALETTE[i % len(PALETTE)] for i in range(len(bars))]
        ax.bar(range(len(bars)), np.nan_to_num(vals), color=colors, alpha=0.85)
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels(names, fontsize=6, color=DIM)
        for i, v in enumerate(vals):
            ax.text(i, np.nan_to_num(v), fmt_value(v, unit), ha="center", va="bottom",
                    fontsize=5.5, color=TEXT)
    return len(bars)


def draw_state_timeline(ax, panel, data: Data) -> int:
    series = [s for target in panel["targets"] for s in data.series(target)]
    ax.set_facecolor(PANEL)
    for sp in ax.spines.values():
        sp.set_visible(False)
    for i, (_label, t, y) in enumerate(series):
        x = mdates.date2num(t)
        if len(x) < 2:
            continue
        width = np.diff(np.append(x, x[-1] + (x[-1] - x[-2])))
        colors = [PALETTE[0] if v >= 1 else PALETTE[4] for v in y]
        ax.barh(i, width, left=x, height=0.8, color=colors, linewidth=0)
    ax.set_yticks(range(len(series)))
    ax.set_yticklabels([s[0] for s in series], fontsize=6.5, color=TEXT)
    ax.tick_params(colors=DIM, labelsize=6.5, length=0)
    ax.xaxis_date()
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.set_xlim(datetime.fromtimestamp(data.start), datetime.fromtimestamp(data.end))
    ax.invert_yaxis()
    return len(series)


DRAW = {"timeseries": draw_timeseries, "stat": draw_stat, "heatmap": draw_heatmap,
        "bargauge": draw_bargauge, "state-timeline": draw_state_timeline}


def render(name: str, dashboard: dict, data: Data, out: Path) -> dict[str, int]:
    """Draw one dashboard to `out`; returns {panel title: series drawn}."""
    panels = list(obs.iter_panels(dashboard))
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    head = 1.6                                      # title bar, in grid rows
    W, H = 24 * COL_W, (rows + head) * ROW_H
    fig = plt.figure(figsize=(W, H), facecolor=BG)
    span = f"{datetime.fromtimestamp(data.start):%Y-%m-%d %H:%M:%S} – " \
           f"{datetime.fromtimestamp(data.end):%H:%M:%S}"
    fig.text(0.006, 1 - 0.45 * ROW_H / H, dashboard["title"], color=TEXT, fontsize=13,
             fontweight="bold", va="top")
    fig.text(0.994, 1 - 0.45 * ROW_H / H,
             f"{span} · rate interval {data.rate_interval} · drawn by matplotlib from real "
             "Prometheus data (python -m bench.dashboard_snapshots), not by Grafana",
             color=DIM, fontsize=7, va="top", ha="right")
    drawn = {}
    for panel in panels:
        g = panel["gridPos"]
        left, top = g["x"] / 24, 1 - (g["y"] + head) * ROW_H / H
        width, height = g["w"] / 24, g["h"] * ROW_H / H
        if panel["type"] == "row":
            fig.text(left + 0.004, top - height / 2, panel["title"], color=TEXT, fontsize=9.5,
                     fontweight="bold", va="center")
            continue
        pad = 0.003
        frame = fig.add_axes((left + pad, top - height + pad * W / H, width - 2 * pad,
                              height - 2 * pad * W / H))
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for sp in frame.spines.values():
            sp.set_color(BORDER)
            sp.set_linewidth(0.8)
        frame.text(0.012, 0.985, panel["title"], transform=frame.transAxes, color=TEXT,
                   fontsize=7.5, fontweight="bold", va="top")
        # plotting area inside the frame: leave the title, and the legend under time series
        title_h = 0.55 * ROW_H / H
        legend_h = (2.3 * ROW_H / H) if panel["type"] == "timeseries" else (
            0.7 * ROW_H / H if panel["type"] in ("heatmap", "bargauge", "state-timeline") else 0)
        side_in = {"timeseries": 0.6, "heatmap": 0.6, "state-timeline": 1.3,
                   "bargauge": 0.6}.get(panel["type"], 0.05)    # y tick labels, inches
        x0 = left + pad + side_in / W
        ax = fig.add_axes((x0, top - height + pad * W / H + legend_h + 0.1 * ROW_H / H,
                           left + width - pad - 0.004 - x0,
                           height - 2 * pad * W / H - title_h - legend_h - 0.1 * ROW_H / H))
        drawn[panel["title"]] = DRAW[panel["type"]](ax, panel, data)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, facecolor=BG)
    plt.close(fig)
    return drawn


# ---------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="traffic duration")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per request")
    ap.add_argument("--out", type=Path, default=OUT, help="directory for <dashboard>.png")
    ap.add_argument("--rate-interval", default="15s", help="what $__rate_interval becomes")
    ap.add_argument("--prometheus", metavar="URL",
                    help="draw from this Prometheus (e.g. a compose deployment's) over the last "
                         "--seconds instead of starting Tandem and driving traffic")
    args = ap.parse_args(argv)
    if args.prometheus:
        end = time.time()
        step = max(1.0, round(args.seconds / 300))
        draw_all(Data(args.prometheus.rstrip("/"), end - args.seconds, end, step,
                      args.rate_interval), args.out)
        return 0
    with tempfile.TemporaryDirectory(prefix="tandem-snapshots-") as tmp, \
            obs.observed_stack(Path(tmp)) as stack:
        start = time.time() - 5
        rounds = requests = tokens = 0
        while time.time() - start < args.seconds + 5:
            rep = traffic.drive_traffic(stack.dispatcher, rounds=1, max_tokens=args.max_tokens,
                                        api=stack.api)
            if rep.failures:
                print("failed requests:", *rep.failures, sep="\n  ", file=sys.stderr)
                return 1
            rounds, requests, tokens = rounds + 1, requests + rep.requests, tokens + rep.tokens
        time.sleep(2.5)                              # the last scrapes
        end = time.time()
        print(f"traffic: {rounds} rounds, {requests} requests, {tokens} tokens, "
              f"{end - start:.0f} s window")
        draw_all(Data(stack.prometheus, start, end, 1.0, args.rate_interval), args.out)
    return 0


def draw_all(data: Data, directory: Path) -> dict[str, dict[str, int]]:
    """Every dashboard to directory/<name>.png; {dashboard: {panel: series drawn}}."""
    everything = {}
    for name, dash in obs.load_dashboards().items():
        out = directory / f"{name}.png"
        drawn = everything[name] = render(name, dash, data, out)
        empty = [t for t, n in drawn.items() if not n]
        shown = out.relative_to(repo_root()) if out.is_relative_to(repo_root()) else out
        print(f"{shown}: {len(drawn)} panels, {sum(drawn.values())} series"
              + (f"; no data: {empty}" if empty else ""))
    return everything


if __name__ == "__main__":
    sys.exit(main())
