"""The static-shape decode step (common/static_decode.py) run eagerly on the CPU:
the same logits as the runner's forward and transformers, for every family (sliding windows,
soft-capping, q/k norms), and its refusals. On a CUDA device the same step is captured as a CUDA
graph; that path is exercised only where torch sees a GPU."""

from __future__ import annotations

import pytest
import torch

from common.runner import LayerRangeRunner, Segment
from common.static_decode import StaticDecodeStep
from tests.unit.test_architectures import PROMPT, assert_close, hf_logits


def test_static_step_equals_forward_and_transformers(tiny):
    name, _, ref, runner = tiny
    L = runner.num_layers
    ctx = PROMPT[:8]
    kv_fwd, kv_static = runner.new_kv(), runner.new_kv()
    runner.forward([Segment(kv_fwd, torch.tensor(ctx))], 0, L)
    runner.forward([Segment(kv_static, torch.tensor(ctx))], 0, L)
    step = StaticDecodeStep(runner, kv_static, capacity=len(PROMPT) + 4)
    for i, t in enumerate(PROMPT[8:], start=8):   # past every sliding window
        want = runner.forward([Segment(kv_fwd, torch.tensor([t]))], 0, L)[0]
        got = step(t)
        assert got.shape == want.shape
        assert_close(got, want, what=f"{name} static vs forward at {i}")
        assert_close(got, hf_logits(ref, PROMPT[: i + 1])[-1:], what=f"{name} vs transformers")
    assert kv_static.length() == len(PROMPT)
    # rollback then decode again: the static step follows the session's length
    kv_static.truncate(10)
    kv_fwd.truncate(10)
    assert_close(step(PROMPT[10]), runner.forward([Segment(kv_fwd, torch.tensor(PROMPT[10:11]))],
                                                  0, L)[0], what=f"{name} after truncate")


def test_static_step_refuses_what_it_cannot_hold(model_paths):
    runner = LayerRangeRunner(model_paths.target, layers=(0, 2))
    with pytest.raises(ValueError, match="whole-model"):
        StaticDecodeStep(runner, runner.new_kv(0, 2), capacity=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch")
def test_cuda_graph_step_tracks_the_cpu_runner(model_paths, tokenizer):
    ids = tokenizer.encode("The history of the printing press begins")
    cpu, gpu = LayerRangeRunner(model_paths.target), LayerRangeRunner(model_paths.target,
                                                                       device="cuda")
    L = cpu.num_layers
    kc, kg = cpu.new_kv(), gpu.new_kv()
    cpu.forward([Segment(kc, torch.tensor(ids[:-4]))], 0, L)
    gpu.forward([Segment(kg, torch.tensor(ids[:-4]))], 0, L)
    step = StaticDecodeStep(gpu, kg, capacity=64)
    for t in ids[-4:]:
        want = cpu.forward([Segment(kc, torch.tensor([t]))], 0, L)[0]
        got = step(t)
        assert step.graph is not None
        assert (got - want).abs().max().item() < 1e-3
