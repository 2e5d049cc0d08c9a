"""A prompt's K/V rows and logits do not depend on how its prefill is chunked: the prefix cache
(common/prefix_cache.py) hands one session rows another session computed in other
chunks, and output with the cache must equal output without it, bit for bit."""

from __future__ import annotations

import pytest
import torch

from common.runner import LayerRangeRunner, Segment


@pytest.fixture(scope="module")
def runner(target_runner):
    r = target_runner
    if not r.chunk_invariant:
        pytest.skip("the runner's kernels are not built here (chunk invariance is theirs)")
    return r


def prefill(runner, ids: list[int], chunk: int):
    kv = runner.new_kv()
    rows = []
    for i in range(0, len(ids), chunk):
        x = torch.tensor(ids[i: i + chunk])
        rows.append(runner.forward([Segment(kv, x, "all")], 0, runner.num_layers)[0])
    return kv, torch.cat(rows)


def test_chunks_of_1_7_64_and_whole_give_the_same_bits(runner, tokenizer):
    text = ("The printing press spread across Europe within decades; each city that took it up "
            "saw books fall in price, literacy rise and new trades appear around the shops. ")
    ids = tokenizer.encode(text * 6)[:83]
    assert len(ids) == 83   # not a multiple of 7, 8 or 64: every chunk has a ragged tail
    kv_whole, logits_whole = prefill(runner, ids, len(ids))
    for chunk in (1, 7, 64):
        kv, logits = prefill(runner, ids, chunk)
        assert torch.equal(logits, logits_whole), f"logits differ with chunks of {chunk}"
        for layer, (a, b) in enumerate(zip(kv.bufs, kv_whole.bufs)):
            assert torch.equal(a[:, :, : len(ids)], b[:, :, : len(ids)]), (
                f"K/V of layer {layer} differ with chunks of {chunk}")


def test_sliding_window_layers_give_the_same_bits_in_any_chunks(tmp_path):
    """A tiny seeded Qwen3 (tests/unit/test_architectures.py): two layers with a window of 6
    keys, shorter than the prompt, so each chunk's first visible key moves, and two global."""
    from tests.unit.test_architectures import build

    family = "qwen3"
    build(family, tmp_path)
    r = LayerRangeRunner(tmp_path)
    if not r.chunk_invariant:
        pytest.skip("the runner's kernels are not built here")
    ids = [(7 * i + 3) % 120 + 3 for i in range(45)]
    kv_whole, logits_whole = prefill(r, ids, len(ids))
    for chunk in (1, 5, 16):
        kv, logits = prefill(r, ids, chunk)
        assert torch.equal(logits, logits_whole), f"{family}: logits differ with chunks of {chunk}"
        for a, b in zip(kv.bufs, kv_whole.bufs):
            assert torch.equal(a[:, :, : len(ids)], b[:, :, : len(ids)]), (family, chunk)


def test_a_sliding_window_starts_on_an_8_key_boundary(runner):
    """Windowed layers read keys from a multiple of 8 and mask the ones before the window, so
    a key keeps its lane in the softmax sum whatever the chunk."""
    first, mask = runner._session_mask(p=21, n=1, window=8)
    assert first == 8 and mask.tolist() == [[False] * 6 + [True] * 8]
    assert runner._session_mask(p=23, n=1, window=8) == (16, None)
    assert runner._session_mask(p=5, n=1, window=None) == (0, None)
