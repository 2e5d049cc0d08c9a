"""One session's one-token decode step with static shapes, so that on a GPU it can be captured
once as a CUDA graph and replayed per token: the per-token cost is then one graph
launch instead of ~30 kernel launches per layer from Python.

Static shapes: the step attends over the session's whole KV capacity (reserved up front, zeros
beyond the cached length) under a mask `key <= position` (and the sliding window where a layer
has one), writes its K/V at a device-side position with index_copy_, and gathers its RoPE rows
from tables copied up to the capacity. It composes the runner's public layer steps
(`attention_inputs`, `attend`, `layer_output`, `logits`), so it computes the same layer as
`LayerRangeRunner.forward`; the masked keys add exact zeros to the softmax sums, so the logits
stay within the runner's tolerance of transformers.

On the CPU the step runs eagerly (there is no graph to capture); that is how it is tested here.
On CUDA it is captured on the first call (after a warm-up on a side stream) and replayed after.
The CUDA path has not been run on a GPU yet: no GPU was available where it was written.
"""

from __future__ import annotations

import torch


class StaticDecodeStep:
    """Decode one token at a time for `kv` (a whole-model SessionKV of `runner`), up to
    `capacity` cached tokens. Each call appends the token's K/V and returns float32 logits [1, V]
    on the CPU, as `runner.forward([Segment(kv, tensor([token]))], 0, L)[0]` does."""

    def __init__(self, runner, kv, capacity: int):
        L = runner.num_layers
        if (runner.lo, runner.hi) != (0, L) or (kv.lo, kv.hi) != (0, L):
            raise ValueError("StaticDecodeStep needs a whole-model runner and KV")
        if capacity <= kv.length():
            raise ValueError(f"capacity {capacity} leaves no room after {kv.length()} tokens")
        self.runner, self.kv, self.capacity = runner, kv, capacity
        dev = runner.device
        with torch.inference_mode():   # the KV buffers are inference tensors
            for i in range(L):
                buf = kv._reserve(i, capacity)
                # garbage beyond the cache would meet the mask as NaN * 0: zeros instead
                buf[:, :, kv.lens[i]:].zero_()
        # the graph holds these addresses: keep the tensors themselves
        self.bufs = list(kv.bufs)
        runner.rope_rows(torch.tensor([capacity - 1]))   # grow the tables to the capacity
        self.tables = {key: (cos[:capacity].clone(), sin[:capacity].clone())
                       for key, (cos, sin) in runner.rope_tables.items()}
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.keys = torch.arange(capacity, device=dev)
        self.graph = None
        self.out: torch.Tensor | None = None

    @torch.inference_mode()
    def _step(self) -> torch.Tensor:
        r = self.runner
        nh, hd = r.n_heads, r.head_dim
        x = r._embed(self.token)
        rope = {key: (cos.index_select(0, self.pos)[:, None], sin.index_select(0, self.pos)[:, None])
                for key, (cos, sin) in self.tables.items()}
        visible = self.keys <= self.pos
        masks: dict[int | None, torch.Tensor] = {}
        for layer in range(r.num_layers):
            window = r.window(layer)
            if window not in masks:
                m = visible if window is None else visible & (self.keys > self.pos - window)
                masks[window] = m[None, None, None, :]
            q, k, v = r.attention_inputs(layer, x, rope)      # [1, nh, hd], [1, nkv, hd]
            buf = self.bufs[layer]
            buf[0].index_copy_(1, self.pos, k.transpose(0, 1))
            buf[1].index_copy_(1, self.pos, v.transpose(0, 1))
            cap = self.capacity   # the buffer may be larger (it grows geometrically)
            att = r.attend(q.transpose(0, 1)[None], buf[0:1, :, :cap], buf[1:2, :, :cap],
                           masks[window])
            x = r.layer_output(layer, x, att[0].transpose(0, 1).reshape(1, nh * hd))
        return r.logits(x)

    def _capture(self) -> None:
        dev = self.runner.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):   # warm-up: lazy inits and allocator pools outside the capture
                self._step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._step()
        self.graph = graph

    @torch.inference_mode()
    def __call__(self, token: int) -> torch.Tensor:
        p = self.kv.length()
        if p + 1 > self.capacity:
            raise ValueError(f"static decode: {p} cached tokens fill the capacity {self.capacity}")
        if any(a is not b for a, b in zip(self.kv.bufs, self.bufs)):
            raise ValueError("static decode: the session's KV buffers were reallocated")
        self.token.fill_(int(token))
        self.pos.fill_(p)
        if self.runner.device.type == "cuda":
            if self.graph is None:
                self._capture()
            self.graph.replay()
            out = self.out
        else:
            out = self._step()
        self.kv.lens = [p + 1] * len(self.kv.lens)
        return out.cpu()
