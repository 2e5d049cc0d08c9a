"""Runs one window step's plan (planning.Call list) on the LayerRangeRunner.

A session enters the step with the hidden state it arrived with (cut-layer output of the edge,
[n, hidden]); every later call of that session starts from what its previous call produced, and
the call reaching layer L yields its logits (planning's execution contract). The whole plan runs
in one compute call on the suffix's worker thread.

Two ways to run a multi-session call:
* ragged (the runner's own): projections and MLPs batched over all rows, attention per session
  against its own cache. Nothing is merged or split. Cascade always runs this way.
* padded (the DySCo prototype's batched call, `padded=True`, used by exact and dsb unless
  configured off): for each layer the members' K/V caches are copied into one left-padded
  [B, kv_heads, P+1, head_dim] batch with a padding mask, attention runs over the padded batch,
  and the new token's K/V is split back into each session's cache. The copy in and out is the
  merge/split the paper measured at 18-43 % of a step; it grows with context length. Splitting
  back writes only the new token's column, the least any padded design must do (the prototype
  re-slices whole caches), so the merge cost shown here is a lower bound of the paper's.
  Padding applies to decode calls of >= 2 sessions; a call holding a prefill (n > 1) runs ragged.

Step breakdown (seconds, `StepResult.seconds`): `private` = calls holding only part of the
window (dsb's [c, d) advances, cascade's early ranges, exact's per-cut groups), `shared` =
calls holding every session of the window, `merge` = padded merge + split. The padded path uses
the runner's public layer steps (attention_inputs, attend, layer_output, logits in
common/runner.py), so it computes exactly the layer the runner computes, for every architecture,
only over a padded batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.runner import LayerRangeRunner, Segment, SessionKV
from services.suffix.planning import Call

PHASES = ("private", "shared", "merge")


@dataclass
class Item:
    """One session's share of a window step."""
    kv: SessionKV      # the session's suffix cache, layers [cut, L)
    x: torch.Tensor    # hidden state it arrived with: float [n, hidden], n = new tokens


@dataclass
class StepResult:
    logits: dict[str, torch.Tensor]                  # sid -> float32 [V], last new position
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    calls: int = 0                                   # runner calls (padded ones included)
    padded_calls: int = 0                            # calls that ran padded


def execute(runner: LayerRangeRunner, plan: list[Call], items: dict[str, Item],
            padded: bool = False) -> StepResult:
    """Run `plan` for `items`, carrying each session's hidden state from call to call."""
    L = runner.num_layers
    everyone = set(items)
    h = {sid: it.x for sid, it in items.items()}
    res = StepResult(logits={})
    for call in plan:
        phase = "shared" if set(call.sids) == everyone else "private"
        xs = [h[s] for s in call.sids]
        kvs = [items[s].kv for s in call.sids]
        if padded and len(call.sids) > 1 and all(x.shape[0] == 1 for x in xs):
            outs, merge_s, compute_s = padded_forward(runner, kvs, xs, call.a, call.b)
            res.seconds["merge"] += merge_s
            res.padded_calls += 1
        else:
            t = time.perf_counter()
            outs = runner.forward([Segment(kv, x) for kv, x in zip(kvs, xs)], call.a, call.b)
            compute_s = time.perf_counter() - t
        res.seconds[phase] += compute_s
        res.calls += 1
        for sid, out in zip(call.sids, outs):
            if call.b == L:
                res.logits[sid] = out[-1]
            else:
                h[sid] = out
    missing = everyone - set(res.logits)
    if missing:
        raise ValueError(f"plan did not bring sessions {sorted(missing)} to layer {L}")
    return res


@torch.inference_mode()
def padded_forward(runner: LayerRangeRunner, kvs: list[SessionKV], xs: list[torch.Tensor],
                   a: int, b: int) -> tuple[list[torch.Tensor], float, float]:
    """One decode token per session through layers [a, b) as a left-padded batch.

    Returns (per-session outputs as runner.forward would, merge + split seconds, compute
    seconds). Outputs: hidden [1, hidden] when b < L, float32 logits [1, V] when b == L."""
    if not runner.lo <= a < b <= runner.hi:
        raise ValueError(f"forward range [{a}, {b}) outside this runner's [{runner.lo}, {runner.hi})")
    starts = []
    for i, (kv, x) in enumerate(zip(kvs, xs)):
        if x.dim() != 2 or x.shape != (1, runner.hidden_size):
            raise ValueError(f"segment {i}: padded calls take one token [1, {runner.hidden_size}], "
                             f"got {tuple(x.shape)}")
        if not kv.lo <= a < b <= kv.hi:
            raise ValueError(f"segment {i}: range [{a}, {b}) outside its KV's [{kv.lo}, {kv.hi})")
        lens = kv.lens[a - kv.lo: b - kv.lo]
        if min(lens) != max(lens):
            raise ValueError(f"segment {i}: cache lengths differ across layers [{a}, {b}): {lens}")
        starts.append(lens[0])
    B, P = len(kvs), max(starts)
    nh, nkv, hd = runner.n_heads, runner.kv_heads, runner.head_dim
    dtype, dev = runner.dtype, runner.device
    x = torch.cat([x.to(device=dev, dtype=dtype) for x in xs])     # [B, hidden]
    pos = torch.tensor(starts, device=dev)
    rope = runner.rope_rows(pos)
    pad = P - pos                                                   # left padding per row
    cols = torch.arange(P + 1, device=dev)[None, :]
    mask = (cols >= pad[:, None])[:, None, None, :]                 # [B, 1, 1, P+1]
    # Sliding-window layers: padded column j holds position j - pad, the query position P - pad,
    # so "key within the window" is the same j > P - window for every row.
    windowed = {w: mask & (cols > P - w)[:, None, None, :]
                for w in {runner.window(layer) for layer in range(a, b)} if w is not None}
    merge_s = compute_s = 0.0
    for layer in range(a, b):
        t0 = time.perf_counter()
        # merge: this layer's caches, left-padded with zeros (padding must be finite: masked
        # weights are exact zeros, and 0 * NaN from uninitialised memory would poison the sum)
        k = torch.zeros(B, nkv, P + 1, hd, dtype=dtype, device=dev)
        v = torch.zeros(B, nkv, P + 1, hd, dtype=dtype, device=dev)
        for i, (kv, p) in enumerate(zip(kvs, starts)):
            if p:
                buf = kv.bufs[layer - kv.lo]
                k[i, :, P - p: P] = buf[0, :, :p]
                v[i, :, P - p: P] = buf[1, :, :p]
        t1 = time.perf_counter()
        q, k_new, v_new = runner.attention_inputs(layer, x, rope)   # [B, nh|nkv, hd]
        k[:, :, P] = k_new
        v[:, :, P] = v_new
        w = runner.window(layer)
        att = runner.attend(q[:, :, None], k, v, mask if w is None else windowed[w])
        x = runner.layer_output(layer, x, att.reshape(B, nh * hd))
        t2 = time.perf_counter()
        # split: each session's new K/V back into its own cache
        for i, (kv, p) in enumerate(zip(kvs, starts)):
            j = layer - kv.lo
            buf = kv._reserve(j, p + 1)
            buf[0, :, p] = k_new[i]
            buf[1, :, p] = v_new[i]
            kv.lens[j] = p + 1
        t3 = time.perf_counter()
        merge_s += (t1 - t0) + (t3 - t2)
        compute_s += t2 - t1
    t = time.perf_counter()
    if b < runner.num_layers:
        outs = list(x.cpu().split(1))
    else:
        outs = list(runner.logits(x).cpu().split(1))
    compute_s += time.perf_counter() - t
    return outs, merge_s, compute_s
