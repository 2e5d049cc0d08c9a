"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch
import transformers

from common.runner import LayerRangeRunner
from tests.unit.test_architectures import CONFIGS, build


@pytest.fixture(scope="session")
def target_runner(model_paths):
    """The bundled target on one LayerRangeRunner (default products) for the modules that read
    it: it holds no session state (each test makes its own KV caches), and a load takes seconds."""
    return LayerRangeRunner(model_paths.target)


@pytest.fixture(scope="session")
def default_stack(model_paths):
    """One in-process stack (stack/inprocess.py), a replica of each service, for the modules whose
    tests leave it as they found it (caches cleared, budgets restored): a start takes seconds."""
    from stack.inprocess import BackgroundStack
    s = BackgroundStack()
    yield s
    s.close()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """Each supported family as a tiny seeded random model (tests/unit/test_architectures.py):
    (family, its directory, transformers' model as the reference, the runner on it)."""
    path = tmp_path_factory.mktemp(request.param)
    build(request.param, path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()
    return request.param, path, ref, LayerRangeRunner(path)
