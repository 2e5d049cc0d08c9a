"""Every script under examples/ (the SDK guide's, docs/sdk.md) runs against a real local Tandem
(all five services on the bundled model) and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stack.launcher import Cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


@pytest.fixture(scope="module")
def endpoint(model_paths, tmp_path_factory):
    c = Cluster(ephemeral=True, logdir=tmp_path_factory.mktemp("examples-logs"),
                extra={"suffix": ["--threads", "1"], "prefix": ["--threads", "1"]})
    c.start_all()
    try:
        c.wait_ready(timeout=240)
        yield c.endpoint("dispatcher")
    finally:
        c.stop_all()


def test_every_example_is_documented():
    guide = (EXAMPLES.parent / "docs" / "sdk.md").read_text()
    assert SCRIPTS and all(f"examples/{s}" in guide for s in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(endpoint, script):
    r = subprocess.run([sys.executable, str(EXAMPLES / script), endpoint], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, f"{script} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip(), f"{script} printed nothing"
