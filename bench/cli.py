"""`tandem bench spec|split|tuner|overhead|runner|coupling|defaults|chat|kv|resume|constraint
[...]`:
a module with main(argv) each."""

from __future__ import annotations

import importlib
import json
import signal
import sys
from pathlib import Path

BENCHES = {
    "spec": ("bench.bench_spec", "speculative policies side by side on an emulated link"),
    "split": ("bench.bench_split", "split-mode schedulers under Poisson arrivals and fleets"),
    "tuner": ("bench.bench_tuner", "BO autotuner against grid and random search, live traffic"),
    "overhead": ("bench.bench_overhead", "transport cost per hop, end-to-end vs runner, RSS"),
    "runner": ("bench.bench_runner", "LayerRangeRunner vs transformers, ragged batching, verify k"),
    "coupling": ("bench.bench_coupling", "accepted tokens per round: gumbel vs rejection sampling"),
    "defaults": ("bench.bench_defaults", "`tandem up`'s resource plan vs hand-set threads and cores"),
    "chat": ("bench.bench_chat", "multi-turn chat through the gateway, prefix cache on and off"),
    "kv": ("bench.bench_kv", "hundreds of long sessions against the verifier's KV byte budget"),
    "resume": ("bench.bench_resume", "kill -9 of a process mid-stream under the supervisor"),
    "constraint": ("bench.bench_constraint", "JSON schemas from SchemaStore in every mode"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print("usage: tandem bench {" + ",".join(BENCHES) + "} [--quick] [--json PATH] [...]\n")
        for name, (_, what) in BENCHES.items():
            print(f"  {name:9s} {what}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(BENCHES[argv[0]][0])
    args = list(argv[1:])
    plot_path = None
    if "--plot" in args:  # every bench gets --plot the same way: plot its own JSON afterwards
        i = args.index("--plot")
        plot_path = args[i + 1] if i + 1 < len(args) else None
        del args[i:i + 2]
        if plot_path is None:
            print("--plot needs a PATH.png", file=sys.stderr)
            return 2
        if "--json" not in args:
            args += ["--json", str(Path(plot_path).with_suffix(".json"))]
    # SIGTERM unwinds like Ctrl-C, so a bench stops the services it started (its finally blocks)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        rc = module.main(args) or 0
    except KeyboardInterrupt:
        print(f"tandem bench {argv[0]}: interrupted; its services are stopped", file=sys.stderr)
        return 130
    if plot_path and rc == 0:
        from bench.plots import plot
        doc = json.loads(Path(args[args.index("--json") + 1]).read_text())
        print(f"plot: {plot(doc, plot_path)}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
