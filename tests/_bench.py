"""Shared by the benchmark tests (tests/integration/test_bench*.py): `tandem bench NAME --quick`
run from the installed entry point, outside the checkout, with the JSON shape every bench writes
checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tandem_script() -> str:
    """The `tandem` console script the README names, installed beside this interpreter."""
    script = Path(sys.executable).parent / "tandem"
    assert script.exists(), f"{script} missing: run scripts/setup.sh (pip install -e .)"
    return str(script)


def bench(tmp_path, name: str, *args: str) -> dict:
    """`tandem bench NAME --quick ...` from the installed entry point, run from a directory
    outside the checkout (nothing in bench/ may need tests/ or the working directory)."""
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}   # this checkout's code, wherever pip put it
    r = subprocess.run([tandem_script(), "bench", name, "--quick", *args,
                        "--plot", str(tmp_path / f"{name}.png")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"bench {name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    doc = json.loads(out.read_text())
    assert {"bench", "scenario", "machine", "results"} <= set(doc)
    assert doc["machine"]["versions"]["torch"] and doc["command"]
    return doc
