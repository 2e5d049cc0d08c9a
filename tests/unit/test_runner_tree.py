"""Tree attention in LayerRangeRunner: one forward over a token tree, where each
node sees the session's cache and its own ancestors at position start + depth, gives for every
node the logits transformers gives for the prompt followed by that node's root path. Checked on
every tiny architecture of test_architectures.py (sliding windows, soft-capping, partial RoPE,
...) and on the bundled SmolLM2 target; batched beside another session's chain; and after
SessionKV.move_rows keeps one path, decoding on equals transformers."""

from __future__ import annotations

import pytest
import torch

from common import tree
from common.runner import Segment
from tests.unit.test_architectures import PROMPT, assert_close, hf_logits

# Branching at the root and below, depth 4, a deep node whose ancestors are not its neighbours.
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 3, 5, -1, 7]
TREE_TOKENS = [9, 44, 71, 120, 8, 30, 61, 5, 99, 17]


def tree_forward(runner, prompt, tokens, parents, other=None):
    """Prefill prompt[:-1], then one forward over [prompt[-1]] + the tree (with `other` =
    (kv, ids) another session's chain in the same call). Returns (kv, rows[, other rows])."""
    L = runner.num_layers
    kv = runner.new_kv()
    runner.forward([Segment(kv, torch.tensor(prompt[:-1]))], 0, L)
    positions, seen = tree.attention(parents)
    seg = Segment(kv, torch.tensor([prompt[-1], *tokens]), "all", positions, seen)
    segs = [seg] if other is None else [Segment(other[0], torch.tensor(other[1]), "all"), seg]
    out = runner.forward(segs, 0, L)
    return kv, out[-1], (out[0] if other is not None else None)


def check_tree_rows(ref, rows, prompt, tokens, parents, what):
    assert_close(rows[0], hf_logits(ref, prompt)[-1], f"{what} root")
    for i in range(len(parents)):
        ids = prompt + [tokens[j] for j in tree.root_path(parents, i)]
        assert_close(rows[1 + i], hf_logits(ref, ids)[-1], f"{what} node {i}")


def test_tree_rows_equal_transformers_on_every_family(tiny):
    name, _, ref, runner = tiny
    _, rows, _ = tree_forward(runner, PROMPT, TREE_TOKENS, TREE_PARENTS)
    check_tree_rows(ref, rows, PROMPT, TREE_TOKENS, TREE_PARENTS, name)


def test_move_rows_keeps_one_path_then_decoding_goes_on(tiny):
    name, _, ref, runner = tiny
    kv, _, _ = tree_forward(runner, PROMPT, TREE_TOKENS, TREE_PARENTS)
    path = tree.root_path(TREE_PARENTS, 7)            # 0 -> 2 -> 5 -> 7: not the first rows
    start = len(PROMPT)
    kv.move_rows([start + i for i in path], start)
    assert kv.length() == start + len(path)
    ids = PROMPT + [TREE_TOKENS[i] for i in path]
    nxt = 3
    got = runner.forward([Segment(kv, torch.tensor([nxt, 11]), "all")], 0, runner.num_layers)[0]
    want = hf_logits(ref, ids + [nxt, 11])
    assert_close(got, want[-2:], f"{name} after move_rows")


def test_smollm2_tree_batched_beside_a_chain(target_runner, hf_model, tokenizer):
    runner = target_runner
    prompt = tokenizer.encode("The history of the printing press begins")
    other_prompt = tokenizer.encode("def add(a, b):\n    return")
    # real continuations and alternatives: each node's children are transformers' top tokens
    tokens, parents = [], []
    top = torch.topk(hf_logits(hf_model, prompt)[-1], 3).indices.tolist()
    for t in top[:2]:
        tokens.append(t)
        parents.append(-1)
    for depth_parent in (0, 2, 4):
        ids = prompt + [tokens[j] for j in tree.root_path(parents, depth_parent)]
        for t in torch.topk(hf_logits(hf_model, ids)[-1], 2).indices.tolist():
            tokens.append(t)
            parents.append(depth_parent)
    assert len(tree.main_path(parents)) == 4 and not tree.is_chain(parents)
    other_kv = runner.new_kv()
    runner.forward([Segment(other_kv, torch.tensor(other_prompt[:-3]))], 0, runner.num_layers)
    _, rows, other_rows = tree_forward(runner, prompt, tokens, parents,
                                       other=(other_kv, other_prompt[-3:]))
    check_tree_rows(hf_model, rows, prompt, tokens, parents, "smollm2")
    assert_close(other_rows, hf_logits(hf_model, other_prompt)[-3:], "chain beside the tree")


def test_tree_segments_are_checked(tiny):
    _, _, _, runner = tiny
    kv = runner.new_kv()
    positions, seen = tree.attention([-1, 0])
    with pytest.raises(ValueError, match="tree"):
        runner.forward([Segment(kv, torch.tensor([1, 2, 3]), "all", positions, None)], 0,
                       runner.num_layers)
    with pytest.raises(ValueError, match="tree"):
        runner.forward([Segment(kv, torch.tensor([1, 2]), "all", positions, seen)], 0,
                       runner.num_layers)
    with pytest.raises(ValueError, match="move_rows"):
        kv.move_rows([3, 2], 0)
