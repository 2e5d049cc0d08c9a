"""`tandem bench spec|split|overhead|runner [...]`: each benchmark is a module with main(argv)."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "spec": ("bench.bench_spec", "speculative policies side by side on an emulated link"),
    "split": ("bench.bench_split", "split-mode schedulers under Poisson arrivals and fleets"),
    "overhead": ("bench.bench_overhead", "transport cost per hop, end-to-end vs runner, RSS"),
    "runner": ("bench.bench_runner", "LayerRangeRunner vs transformers, ragged batching, verify k"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print("usage: tandem bench {" + ",".join(BENCHES) + "} [--quick] [--json PATH] [...]\n")
        for name, (_, what) in BENCHES.items():
            print(f"  {name:9s} {what}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(BENCHES[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
