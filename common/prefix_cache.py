"""A model service's KV memory: a byte budget over live sessions and an exact prefix cache.
The verifier, the prefix and the suffix each hold one over their runner.

Every chat turn re-sends the whole conversation. When a session ends, the K/V rows of its
committed tokens (prompt + generated text) stay here; a new session whose prompt starts with the
same tokens gets a copy of those rows and computes only the rest. The runner's rows do not depend
on how a prefill was chunked or batched (`LayerRangeRunner.chunk_invariant`,
tests/unit/test_chunk_invariance.py), so a reused row has the bits a recomputed one would have
and output with the cache equals output without it. Where the runner cannot promise that (its
kernels are not built, a GPU), nothing is cached and only the budget applies.

Spaces: a row is a function of the tokens up to it and of what computed it. An entry is kept in
a *space*, (lo, hi, tag): the layer range its rows hold and a tag naming anything else they
depend on (the suffix's: the dtype and the edge prefix its cut-layer inputs came from). A
session only ever matches entries of its own space, so rows of layers [4, L) never serve a
session that holds [8, L), and a session never gets rows computed from other inputs than its own.

Data structure: one entry per finished sequence (its token ids and a tight copy of its rows),
matched by the longest common prefix over the entries of a space. Chats grow by appending, so an
entry whose tokens start another's is dropped when the longer one arrives (turn N's entry is a
prefix of turn N+1's): the common case keeps one entry per conversation. Matching is one
vectorised compare per entry; the budget bounds the entries to hundreds, so a scan costs well
under a millisecond, against seconds of prefill saved, and needs no block hashing or radix tree
(whose shared nodes would pay off when many live conversations share a long system prompt). A
hit copies rows (about 46 KB a token for SmolLM2's 30 layers, ~10 ms for 1000 tokens) rather
than sharing buffers, so sessions keep owning their KV and entries never change once stored.

Budget: `used` = every live session's KV buffers (each reserved at admission for its prompt and
what it may generate) + the cached entries. A new session first evicts cached entries, least
recently used first (the one it is about to reuse last); if it still does not fit it is refused
with `busy` before any work, so an admitted session never fails for memory. A prompt larger than
the whole budget is refused with `too_large`, naming the limit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from common import metrics, protocol
from common.protocol import ProtocolError


MIN_ROWS = 64   # the fewest rows a SessionKV buffer holds (common/runner.py)


@dataclass
class Entry:
    space: tuple                 # (lo, hi, tag): what the rows are besides their tokens
    tokens: np.ndarray           # int64 ids whose rows `rows` holds, in order
    rows: list[torch.Tensor]     # per layer [2, kv_heads, n, head_dim], tight

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.rows)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if len(differ) else m


def for_service(runner, cfg, service: str, exact: bool = True) -> "PrefixCache":
    """The KV budget and prefix cache of a service over `runner`, from its settings
    (`kv_budget_bytes`: 0 = half the memory left once the weights are loaded; `prefix_cache`).
    Rows are cached only where they are exact: the runner's rows do not depend on chunking, and
    `exact` (the service computes them the way a prefill would)."""
    from common.resources import available_memory

    budget = cfg.kv_budget_bytes or available_memory(runner.device) // 2
    return PrefixCache(runner, budget, cfg.prefix_cache and runner.chunk_invariant and exact,
                       service)


def describe(cache: "PrefixCache", cfg) -> str:
    """One log line: the budget and whether rows are cached."""
    return (f"KV budget {cache.budget / 1e9:.2f} GB ({cache.budget // cache.row_bytes} tokens); "
            f"prefix cache " + ("on" if cache.enabled else "off" if not cfg.prefix_cache else
                                "off: the rows would not be exact here"))


class PrefixCache:
    """KV budget and cached prefixes of one service's runner (layers [runner.lo, runner.hi))."""

    def __init__(self, runner, budget_bytes: int, enabled: bool, service: str = "verifier"):
        self.runner = runner
        self.budget = budget_bytes
        self.enabled = enabled
        self.service = service
        # one token's K and V at one layer, and over every layer the runner holds
        self.layer_bytes = 2 * runner.kv_heads * runner.head_dim * torch.finfo(runner.dtype).bits // 8
        self.row_bytes = (runner.hi - runner.lo) * self.layer_bytes
        if budget_bytes < MIN_ROWS * self.row_bytes:
            raise ValueError(f"kv_budget_bytes {budget_bytes} holds {budget_bytes // self.row_bytes}"
                             f" tokens of KV ({self.row_bytes} bytes each); a session needs room "
                             f"for at least {MIN_ROWS}")
        self.entries: OrderedDict[int, Entry] = OrderedDict()   # least recently used first
        self.cached_bytes = 0
        self._next = 0
        metrics.KV_BUDGET.labels(service).set(budget_bytes)

    def space(self, lo: int | None = None, hi: int | None = None, tag=None) -> tuple:
        """The space of rows of layers [lo, hi) (default: the runner's) computed with `tag`."""
        return (self.runner.lo if lo is None else lo, self.runner.hi if hi is None else hi, tag)

    # --- admission ------------------------------------------------------------------------------
    def open(self, prompt: list[int], new_rows: int, live_bytes: int, space: tuple | None = None,
             reuse: int | None = None, need: int = 0):
        """A KV cache of layers [lo, hi) of `space` for a new session: room for its prompt and
        `new_rows` more tokens, holding the longest prefix of prompt[:-1] cached in that space
        (the last prompt token is always computed: its logits are the first answer), at most
        `reuse` rows of it. Returns (kv, reused rows); (None, rows) without admitting anything
        when fewer than `need` rows could be reused. Raises `too_large` for a prompt over the
        whole budget, `busy` when live sessions leave no room."""
        space = space or self.space()
        lo, hi, _ = space
        row_bytes = (hi - lo) * self.layer_bytes
        n_prompt = len(prompt)
        if n_prompt * row_bytes > self.budget:
            raise ProtocolError(
                protocol.TOO_LARGE,
                f"a prompt of {n_prompt} tokens needs {n_prompt * row_bytes} bytes of KV "
                f"cache, more than the {self.service}'s whole kv_budget_bytes ({self.budget}: "
                f"{self.budget // row_bytes} tokens)", field="token_ids")
        rows = min(n_prompt + new_rows, self.budget // row_bytes)
        need_bytes = max(MIN_ROWS, rows) * row_bytes   # what SessionKV allocates for them
        if live_bytes + need_bytes > self.budget:   # refused before anything cached is evicted
            raise ProtocolError(
                protocol.BUSY,
                f"{self.service} KV budget full: live sessions hold {live_bytes} of "
                f"{self.budget} bytes and this one needs {need_bytes}; retry when a session "
                f"ends (in about a second)")
        key, hit = self.match(prompt, space) if reuse != 0 else (None, 0)
        hit = hit if reuse is None else min(hit, reuse)
        if hit < need:
            return None, hit
        self._evict(need_bytes + live_bytes, keep=key)
        if self.cached_bytes + live_bytes + need_bytes > self.budget:
            self._evict(need_bytes + live_bytes)   # the prefix it would reuse as well
            key, hit = None, 0
            if hit < need:
                return None, hit
        kv = self.runner.new_kv(lo, hi)
        with torch.inference_mode():
            kv.reserve(lo, hi, rows)
            if key is not None and hit:
                e = self.entries[key]
                self.entries.move_to_end(key)
                for buf, r in zip(kv.bufs, e.rows):
                    buf[:, :, :hit] = r[:, :, :hit]
                kv.lens = [hit] * len(kv.lens)
        metrics.PROMPT_CACHE.labels(self.service, "hit").inc(hit)
        metrics.PROMPT_CACHE.labels(self.service, "miss").inc(n_prompt - hit)
        return kv, hit

    def match(self, prompt: list[int], space: tuple | None = None) -> tuple[int | None, int]:
        """(entry key, rows reusable) for the entry of `space` sharing the longest prefix with
        prompt[:-1]; (None, 0) when none does."""
        if not self.enabled or len(prompt) < 2:
            return None, 0
        space = space or self.space()
        ids = np.asarray(prompt[:-1], dtype=np.int64)
        best, best_n = None, 0
        for key, e in self.entries.items():
            if e.space != space:
                continue
            n = common_prefix(e.tokens, ids)
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    # --- finished sessions ----------------------------------------------------------------------
    def put(self, tokens: list[int], kv, n: int, tag=None, live_bytes: int = 0) -> None:
        """Keep the first `n` rows of a finished session's `kv`, whose tokens are tokens[:n],
        in the space of its layers and `tag`. Copies them (the session's buffers may still be
        written by a forward in flight past row n, and hold room beyond it); drops entries of
        the space this one extends. The copy is made within the budget beside `live_bytes` (the
        other sessions) and `kv` itself, still allocated while it is copied: least recently used
        entries go first, and if it still does not fit it is not kept."""
        n = min(n, len(tokens), min(kv.lens))
        space = (kv.lo, kv.hi, tag)
        size = n * (kv.hi - kv.lo) * self.layer_bytes
        if not self.enabled or n < 1 or size > self.budget:
            return
        ids = np.asarray(tokens[:n], dtype=np.int64)
        for key, e in list(self.entries.items()):
            if e.space != space:
                continue
            c = common_prefix(e.tokens, ids)
            if c == len(ids):          # an entry holds all of this already
                self.entries.move_to_end(key)
                return
            if c == len(e.tokens):     # this extends the entry
                self._drop(key)
        beside = live_bytes + kv.nbytes() + size
        self._evict(beside)
        if self.cached_bytes + beside > self.budget:
            return
        with torch.inference_mode():
            rows = [buf[:, :, :n].clone() for buf in kv.bufs]
        e = Entry(space, ids, rows)
        self.entries[self._next] = e
        self._next += 1
        self.cached_bytes += e.nbytes
        metrics.KV_CACHED.labels(self.service).set(self.cached_bytes)

    def clear(self) -> None:
        for key in list(self.entries):
            self._drop(key)

    def fit(self, live_bytes: int) -> None:
        """Evict what the budget no longer holds (live sessions grew past their reservation)."""
        self._evict(live_bytes)

    # --- eviction -------------------------------------------------------------------------------
    def _evict(self, other_bytes: int, keep: int | None = None) -> None:
        """Least recently used entries out until they fit beside `other_bytes`."""
        for key in list(self.entries):
            if self.cached_bytes + other_bytes <= self.budget:
                return
            if key != keep:
                self._drop(key)
                metrics.KV_EVICTIONS.labels(self.service).inc()

    def _drop(self, key: int) -> None:
        self.cached_bytes -= self.entries.pop(key).nbytes
        metrics.KV_CACHED.labels(self.service).set(self.cached_bytes)
