"""The draft model: llama.cpp through llama-cpp-python's low-level API, one context per session.

Why the low-level API: a draft token's confidence P(D_n) is the top-1 probability of the full
softmax of the last logits row; reading that row straight from llama.cpp's buffer costs ~0.1 ms,
where `create_completion(logprobs=...)` is ~6x slower per token. Each session owns a context
(its own KV cache), so sessions never disturb each other and a rollback is a KV truncation:

    context  = tokens[0 : len(tokens)]      prompt + committed + drafted tokens
    KV cache = tokens[0 : n_past]           what llama.cpp has evaluated (n_past < len(tokens))

`step()` evaluates tokens[n_past:] (the prompt in chunks, every later token alone, so its logits
never depend on timing), reads the last logits row and appends one draft token.
`rollback(keep, append)` truncates the KV cache to
`keep` tokens (`llama_memory_seq_rm`) and appends the target's token; the next step re-evaluates
from there, so drafts after a rollback are exactly those of a session that never drafted past
`keep` (tests/integration/test_drafter.py checks it).

Contexts outlive their sessions (DraftModel.take / give_back): creating one costs ~20 ms and a
short prompt's evaluation ~40 ms on a 2-core CPU, more than the few tokens a short request
drafts. A closed session's context goes back to a small pool with the KV of every token it
evaluated (prompt, committed and drafted tokens); the next session takes the one that shares
most of its prompt and evaluates only the rest. How much it may keep depends on whether its
output can depend on its drafts:
- Greedy, Gumbel-coupled and unseeded sessions cannot: the target picks every token (greedy,
  Gumbel) or the draw is fresh anyway (unseeded), and rejection sampling is exact for any draft
  distribution, as long as q is the one the draft was drawn from. Such a session keeps every row
  it shares with the cached tokens — a chat's next turn finds the whole conversation so far,
  the last answer included — from a context of any size (a smaller one's rows are copied into a
  new context of the size it needs, as are another batch size's). Its drafts' probabilities may differ from a fresh
  context's (llama.cpp computes a token's cells otherwise in a batch of another length; top-1
  probabilities move by up to ~0.07 on the bundled drafter), which moves only how many drafts
  the target accepts.
- A seeded rejection-sampled session's draws follow its drafts, so it keeps only what makes its
  drafts bit for bit a fresh context's: from a context of its own size, whole `n_batch` chunks of
  the same tokens at the same positions (a prompt is evaluated in `n_batch` chunks from position
  0), or the whole prompt when it is the same prompt.

Token trees (DraftSession.tree_begin / tree_step): a session opened with
`tree_nodes` > 0 gets a unified KV cache with tree_nodes + 1 sequences and room for the nodes.
Sequence 0 is the session's context; a tree round grows one depth per llama_decode, every node
of that depth in the batch. A node continues its parent's sequence if it is the parent's first
decoded child, else it gets a fresh sequence made by `llama_memory_seq_cp` of the parent's (a
cell-sharing copy in a unified cache: no KV is duplicated), so each sequence is one root-to-node
path and the main path (every node's rank-0 child) lives in sequence 0. After the round the
context holds the main path. A rollback naming the accepted path moves that path's cells into
sequence 0 (`seq_rm` of sequence 0 past the divergence, `seq_cp` of the branch's cells over that
range: cheap, no re-decode) and frees every other sequence; nodes of the path that were never
decoded (the last depth) are evaluated later like any appended token. common/tree_shape.py
chooses the shape.

Greedy: the draft is the argmax; P(D_n) its softmax probability. Sampling: the draft is drawn
from a *truncated* distribution q (temperature, then the top-k with k <= 64, then top-p), and q
travels sparse as (ids, probs) so the verifier can do exact speculative sampling against it;
P(D_n) = q(D_n). Draws are keyed by (seed, position), so a seeded request drafts reproducibly.
Gumbel coupling (`Sampling.coupling = "gumbel"`, common/gumbel.py): the draft is
argmax(log q + g(seed, position)) with the noise the target uses, so it is accepted exactly when
it is the target's token; no q travels (the verifier needs none).

Constrained output (DraftOpen.constraint, common/constraint.py): the session's matcher follows
its tokens past the prompt (drafts, and the target's tokens a rollback appends); each step
drafts from the masked logits, q' ∝ q·m, so drafts are valid and mostly accepted. Where the
mask is unavailable (a token the matcher does not allow, an empty mask) the step drafts from the
unmasked logits: the verifier, which masks the target, stays exact either way. Token trees are
drafted unmasked (a node's mask would need the matcher at every branch): the verifier walks
them on masked rows, so an invalid child is never taken.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np

import llama_cpp as L

from common import constraint, gumbel
from common.protocol import ProtocolError, Sampling
from common.tree_shape import ROOT, Shape, TreeGrower

MAX_Q_WIDTH = 64   # the widest sparse q the protocol carries (DESIGN.md §3: k <= 64)

_backend_lock = threading.Lock()
_backend_ready = False


def _quiet_log(level, text, user_data):
    return None


_QUIET = L.llama_log_callback(_quiet_log)


def _fix_mmap_threshold() -> None:
    """Keep glibc from hoarding freed llama.cpp buffers.

    Every session's context allocates a compute buffer of tens of MB and frees it at close. glibc
    raises its mmap threshold to the size of each large block freed, so after the first close the
    next contexts' buffers come from the heap instead of mmap, and a heap fragmented by contexts of
    different sizes never shrinks: under steady load the drafter's RSS crept up by hundreds of MB
    (tests/integration/test_load.py). A fixed threshold sends every large buffer back to the OS at close."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)   # M_MMAP_THRESHOLD; a fixed value turns the adjustment off
    except (OSError, AttributeError):
        pass                           # not glibc: nothing to fix


def _init_backend(verbose: bool) -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            _fix_mmap_threshold()
            if not verbose:
                L.llama_log_set(_QUIET, ctypes.c_void_p(0))
            L.llama_backend_init()
            _backend_ready = True


class DraftError(RuntimeError):
    """A drafting request the session cannot honour (context full, bad rollback)."""


@dataclass
class Draft:
    """One drafted token."""
    position: int                    # absolute position of the token in the context
    token: int
    prob: float                      # P(D_n): top-1 softmax prob (greedy) or q(token) (sampling)
    seconds: float                   # compute time of this step (evaluation + softmax + choice)
    q_ids: np.ndarray | None = None  # int32 [k]: support of q (sampling only)
    q_probs: np.ndarray | None = None  # float32 [k]: q on that support, sums to 1
    entropy: float | None = None     # nats, of the temperature-scaled distribution (features)
    margin: float | None = None      # its top-1 minus top-2 probability (features)


@dataclass
class TreeDepth:
    """The nodes one tree step added (round-global indices first_node..), in wire order."""
    start: int                       # position of the round's root children
    first_node: int
    tokens: list[int]
    parents: list[int]
    probs: list[float]
    seconds: float
    done: bool                       # the round is complete (this may add no node)
    rows: int = 0                    # rows of the one batched decode `seconds` timed (0: none,
    #                                  or more than one decode call)
    q_ids: np.ndarray | None = None  # int32 [n, k]: each node's parent's sparse q (sampling)
    q_probs: np.ndarray | None = None


@dataclass
class _Context:
    """A llama.cpp context with its batch, and what its KV cache holds between sessions."""
    ctx: object
    mem: object
    batch: object
    key: tuple            # (n_ctx, n_batch, n_seq_max, kv_unified): contexts of one key are alike
    cached: list[int]     # sequence 0 holds these tokens at positions 0..
    exact: int = 0        # the first `exact` of them were evaluated as a prompt, in n_batch chunks


def reusable_prefix(c: _Context, head: list[int], bitwise: bool) -> int:
    """How many of `c`'s KV cells a prompt whose evaluated part is `head` can keep: every cell of
    the tokens the two share, or with `bitwise` only those a fresh evaluation of `head` would
    give bit for bit (all of the cached prompt for the same prompt, else the whole `n_batch`
    chunks the two have in common)."""
    n = 0
    for a, b in zip(c.cached, head):
        if a != b:
            break
        n += 1
    if not bitwise:
        return n
    n = min(n, c.exact)
    if n == c.exact == len(head):
        return n
    return n // c.key[1] * c.key[1]


class DraftModel:
    """A GGUF model loaded once and shared by every session's context."""

    def __init__(self, path: str, threads: int = 0, verbose: bool = False, pool: int = 0):
        _init_backend(verbose)
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.path = str(path)
        self.model = L.llama_model_load_from_file(self.path.encode(), mparams)
        if not self.model:
            raise DraftError(f"llama.cpp could not load {self.path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(self.model))
        self.threads = threads
        self.pool = max(0, int(pool))      # idle contexts kept; 0: every context freed at close
        self.idle: list[_Context] = []     # least recently returned first
        self.lock = threading.Lock()       # sessions open on the event loop, may close elsewhere
        self._ll_tokenizer = None

    def ll_tokenizer(self):
        """The vocabulary as llguidance reads it (built once, ~1 s: constrained sessions)."""
        with self.lock:
            if self._ll_tokenizer is None:
                import llguidance.llamacpp
                with warnings.catch_warnings():   # it reads token attributes by a deprecated name
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._ll_tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(
                        self.vocab, n_vocab=self.n_vocab)
            return self._ll_tokenizer

    def take(self, key: tuple, head: list[int], bitwise: bool = True) -> tuple[_Context, int]:
        """A context of this key for a prompt whose evaluated part is `head`, and how many of
        `head`'s tokens its KV holds already: the idle one that holds most, else a new one.
        With `bitwise` only a context of this very key, keeping only cells a fresh evaluation
        would give bit for bit; without, a context of any size and batch (reusable_prefix)."""
        with self.lock:
            best, keep = None, -1
            for c in self.idle:
                if c.key == key or not bitwise and c.key[2:] == key[2:]:
                    n = reusable_prefix(c, head, bitwise)
                    if c.key != key and n == 0:
                        continue   # nothing to carry over: not worth another key's context
                    if n >= keep:                  # ties: the most recently returned
                        best, keep = c, n
            if best is not None:
                self.idle.remove(best)
        if best is None:
            return self._new_context(key), 0
        if keep == 0 or not L.llama_memory_seq_rm(best.mem, 0, keep, -1):
            L.llama_memory_clear(best.mem, True)
            keep = 0
        if best.key[1:] != key[1:] or best.key[0] < key[0]:
            # too small, or batched otherwise: its cells move to a new context of this key
            old, best = best, self._new_context(key)
            if keep and not _copy_sequence(old, best):
                L.llama_memory_clear(best.mem, True)
                keep = 0
            _free_context(old)
        best.cached, best.exact = head[:keep], 0
        return best, keep

    def give_back(self, c: _Context) -> None:
        """Keep a closed session's context for the next sessions (the oldest idle one is freed
        when the pool is full)."""
        with self.lock:
            if self.model is not None and self.pool > 0:
                self.idle.append(c)
                c = self.idle.pop(0) if len(self.idle) > self.pool else None
        if c is not None:
            _free_context(c)

    def _new_context(self, key: tuple) -> _Context:
        n_ctx, n_batch, n_seq_max, unified = key
        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq_max
        # one cache for every sequence: a seq_cp then shares cells instead of copying a stream
        cparams.kv_unified = unified
        if self.threads:
            cparams.n_threads = self.threads
            cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        # llama.cpp's CPU flash attention accumulates in fp16 (top-1 probabilities move by ~0.03
        # on this model): use the exact path, as llama-cpp-python's Llama does by default
        cparams.flash_attn_type = 0
        ctx = L.llama_init_from_model(self.model, cparams)
        if not ctx:
            raise DraftError("llama.cpp could not create a context")
        return _Context(ctx, L.llama_get_memory(ctx), L.llama_batch_init(n_batch, 0, 1), key, [])

    def session(self, prompt: list[int], n_ctx: int, sampling: Sampling,
                q_width: int = 16, n_batch: int = 256, tree_nodes: int = 0,
                features: bool = False, matcher: constraint.Matcher | None = None,
                output_start: int | None = None) -> "DraftSession":
        return DraftSession(self, prompt, n_ctx, sampling, q_width, n_batch, tree_nodes, features,
                            matcher, output_start)

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for c in idle:
            _free_context(c)
        if self.model:
            L.llama_model_free(self.model)
            self.model = None


def _free_context(c: _Context) -> None:
    L.llama_batch_free(c.batch)
    L.llama_free(c.ctx)


def _copy_sequence(src: _Context, dst: _Context) -> bool:
    """Copy sequence 0's KV cells from one context into another's empty sequence 0."""
    size = L.llama_state_seq_get_size(src.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    got = L.llama_state_seq_get_data(src.ctx, buf, size, 0)
    return got > 0 and L.llama_state_seq_set_data(dst.ctx, buf, got, 0) == got


class DraftSession:
    """One session's llama.cpp context, its token list and its position in the KV cache."""

    def __init__(self, model: DraftModel, prompt: list[int], n_ctx: int, sampling: Sampling,
                 q_width: int, n_batch: int, tree_nodes: int = 0, features: bool = False,
                 matcher: constraint.Matcher | None = None, output_start: int | None = None):
        if not prompt:
            raise DraftError("empty prompt")
        bad = [t for t in prompt if not 0 <= t < model.n_vocab]
        if bad:
            raise DraftError(f"prompt holds ids outside the vocabulary [0, {model.n_vocab}): {bad[:5]}")
        self.model = model
        self.n_ctx = min(int(n_ctx), model.n_ctx_train)
        if len(prompt) >= self.n_ctx:
            raise DraftError(f"prompt of {len(prompt)} tokens does not fit a {self.n_ctx}-token context")
        self.sampling = sampling
        self.greedy = sampling.temperature <= 0.0
        self.features = features   # each draft carries its entropy and top-2 margin (~0.3 ms)
        # the Gumbel coupling needs the seed the target uses (the dispatcher gives one); without
        # it (a direct client) drafting falls back to rejection sampling's draws, as the cloud does
        self.gumbel = (not self.greedy and sampling.coupling == "gumbel"
                       and sampling.seed is not None)
        self.q_width = max(1, min(MAX_Q_WIDTH, int(q_width)))
        if sampling.top_k > 0:
            self.q_width = min(self.q_width, sampling.top_k)
        self.tree_nodes = max(0, int(tree_nodes))
        # a tree's nodes need cells beside the context's (twice as many: a round's branches are
        # freed only when the next rollback arrives, and a proactive chain grows meanwhile)
        self.n_batch = max(1, min(max(n_batch, self.tree_nodes), self.n_ctx))
        key = (self.n_ctx + 2 * self.tree_nodes, self.n_batch, self.tree_nodes + 1,
               self.tree_nodes > 0)
        # drafts that cannot change the output may come from cells rounded in another batching
        self.bitwise = not (self.greedy or self.gumbel or sampling.seed is None)
        self.context, self.reused = model.take(key, list(prompt[:-1]), self.bitwise)
        self.ctx, self.mem, self.batch = self.context.ctx, self.context.mem, self.context.batch
        self.tokens: list[int] = list(prompt)
        self.prompt_len = len(prompt)
        self.n_past = self.reused             # prompt tokens whose KV the context holds already
        self.prompt_intact = True             # no rollback has cut into the prompt (rollback)
        self.seed_base = sampling.seed if sampling.seed is not None else \
            int(np.random.SeedSequence().entropy % (2**63))
        self.tree: TreeGrower | None = None   # the tree round being grown, or the last one
        self.tree_start = 0
        self.node_seq: list[int] = []         # the sequence holding each decoded node, else -1
        self.seqs_used = 0                    # sequences 1..seqs_used hold branches
        self.tree_pending: list[int] = []     # nodes grown but not decoded yet (last depth)
        self.matcher = matcher                # the output constraint's state; None = none
        self.output_start = len(prompt) if output_start is None else int(output_start)
        self.matched: list[int] = []          # the tokens past output_start the matcher holds

    # --- the KV cache ---------------------------------------------------------------------------
    def _eval(self, upto: int) -> np.ndarray:
        """Evaluate tokens[n_past:upto] and return the logits row of the last one (a view into
        llama.cpp's buffer, valid until the next decode)."""
        while self.n_past < upto:
            # Past the prompt, one token per decode call: llama.cpp's batched kernels round
            # differently, so a token's logits would otherwise depend on whether a rollback
            # arrived before or after it was evaluated, and a seeded request would not draft
            # reproducibly.
            n = 1 if self.n_past >= self.prompt_len - 1 else \
                min(self.n_batch, self.prompt_len - 1 - self.n_past)
            b = self.batch
            b.n_tokens = n
            for i in range(n):
                b.token[i] = self.tokens[self.n_past + i]
                b.pos[i] = self.n_past + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = 1 if i == n - 1 and self.n_past + n == upto else 0
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                raise DraftError(f"llama_decode failed with code {rc} at position {self.n_past}")
            self.n_past += n
        ptr = L.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def prefill(self) -> float:
        """Evaluate the prompt except its last token (the first step feeds that one)."""
        t = time.perf_counter()
        if self.n_past < len(self.tokens) - 1:   # a reused context may hold it all already
            self._eval(len(self.tokens) - 1)
        return time.perf_counter() - t

    def step(self) -> Draft:
        """Draft one token after the current end of the context."""
        if len(self.tokens) >= self.n_ctx:
            raise DraftError(f"context full ({self.n_ctx} tokens)")
        t = time.perf_counter()
        if self.n_past >= len(self.tokens):      # the last token's logits are gone: re-feed it
            self._truncate(len(self.tokens) - 1)
        raw = logits = self._eval(len(self.tokens))
        position = len(self.tokens)
        if self.matcher is not None:
            logits = self._masked(logits)
        if self.greedy:
            token, prob = _greedy(logits)
            draft = Draft(position, token, prob, 0.0)
        elif self.gumbel:
            token, prob = _gumbel(logits, self.sampling, position)
            draft = Draft(position, token, prob, 0.0)
        else:
            ids, probs = _truncated(logits, self.sampling, self.q_width)
            rng = np.random.Generator(np.random.PCG64([self.seed_base, position, 0x7A9D]))
            k = int(rng.choice(len(ids), p=probs.astype(np.float64) / probs.sum(dtype=np.float64)))
            draft = Draft(position, int(ids[k]), float(probs[k]), 0.0, ids, probs)
        if self.features:
            draft.entropy, draft.margin = _entropy_margin(
                raw, 1.0 if self.greedy else self.sampling.temperature)
        self.tokens.append(draft.token)
        draft.seconds = time.perf_counter() - t
        return draft

    def _masked(self, logits: np.ndarray) -> np.ndarray:
        """The logits with -inf outside the constraint's mask after the session's tokens; the
        logits themselves when the matcher cannot follow them (see the module's docstring)."""
        out = self.tokens[self.output_start:]
        keep = 0
        while keep < min(len(out), len(self.matched)) and out[keep] == self.matched[keep]:
            keep += 1
        self.matcher.rollback(len(self.matched) - keep)
        del self.matched[keep:]
        took = self.matcher.advance_valid(out[keep:])
        self.matched += out[keep:keep + took]
        if keep + took < len(out):
            return logits
        try:
            return constraint.apply(logits, self.matcher.mask())
        except ProtocolError:   # no token allowed: the verifier ends the request
            return logits

    def _truncate(self, n: int) -> None:
        if n < self.n_past:
            if not L.llama_memory_seq_rm(self.mem, 0, n, -1):
                raise DraftError(f"llama.cpp refused to truncate the KV cache to {n}")
            self.n_past = n

    def rollback(self, keep: int, append: list[int], path: list[int] | None = None) -> None:
        """Keep the first `keep` tokens of the context, then append `append`. With `path` (node
        indices of the last tree round, root to leaf), the context from the round's start is
        first that path's tokens."""
        if path:
            self._take_path(list(path))
        elif self.tree is not None:
            self.tree_abort()
        if not 1 <= keep <= len(self.tokens):
            raise DraftError(f"rollback keep={keep} outside [1, {len(self.tokens)}]")
        bad = [t for t in append if not 0 <= t < self.model.n_vocab]
        if bad:
            raise DraftError(f"rollback appends ids outside the vocabulary: {bad[:5]}")
        if keep + len(append) > self.n_ctx:
            raise DraftError(f"rollback to {keep + len(append)} tokens overflows the context")
        self.tokens = self.tokens[:keep] + list(append)
        self._truncate(min(self.n_past, keep))
        if keep < self.prompt_len:   # the prompt itself is cut: what follows is evaluated token
            self.prompt_len = keep   # by token, and its cells are no prompt's evaluation to keep
            self.prompt_intact = False

    # --- token trees ----------------------------------------------------------------------------
    def tree_begin(self, shape: Shape) -> TreeDepth:
        """Start a tree round rooted at the end of the context: its root children."""
        if self.tree_nodes <= 0:
            raise DraftError("this session was opened without tree_nodes: it drafts chains only")
        if shape.max_nodes > self.tree_nodes:
            raise DraftError(f"tree of {shape.max_nodes} nodes > the session's tree_nodes "
                             f"{self.tree_nodes}")
        if len(self.tokens) >= self.n_ctx:
            raise DraftError(f"context full ({self.n_ctx} tokens)")
        t = time.perf_counter()
        self.tree_abort()
        if self.n_past >= len(self.tokens):      # the last token's logits are gone: re-feed it
            self._truncate(len(self.tokens) - 1)
        fed = len(self.tokens) - self.n_past
        logits = self._eval(len(self.tokens))
        self.tree_start = len(self.tokens)
        shape.max_depth = min(shape.max_depth, self.n_ctx - self.tree_start)
        self.tree = TreeGrower(shape)
        self.node_seq = []
        self.tree.offer(ROOT, *self._children(logits, self.tree_start, shape.max_width))
        return self._grown(self.tree.grow(), t, rows=1 if fed == 1 else 0)

    def tree_step(self) -> TreeDepth:
        """Decode the last depth's nodes (one batch) and grow the next depth from them."""
        g = self.tree
        if g is None or not self.tree_pending:
            raise DraftError("no tree round in progress")
        t = time.perf_counter()
        if not g.worth_decoding():
            return self._grown([], t)
        frontier = self.tree_pending
        b = self.batch
        b.n_tokens = len(frontier)
        taken: set[int] = set()
        for j, i in enumerate(frontier):
            node = g.nodes[i]
            parent_seq = 0 if node.parent == ROOT else self.node_seq[node.parent]
            if parent_seq in taken:
                self.seqs_used += 1
                seq = self.seqs_used
                L.llama_memory_seq_cp(self.mem, parent_seq, seq, -1, -1)
            else:
                seq = parent_seq
                taken.add(parent_seq)
            self.node_seq[i] = seq
            b.token[j] = node.token
            b.pos[j] = self.tree_start + node.depth
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = seq
            b.logits[j] = 1
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise DraftError(f"llama_decode of {len(frontier)} tree nodes failed with code {rc}")
        depth = g.nodes[frontier[0]].depth
        position = self.tree_start + depth + 1
        for j, i in enumerate(frontier):
            row = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, j),
                                        shape=(self.model.n_vocab,))
            g.offer(i, *self._children(row, position, g.shape.max_width))
        if g.nodes[frontier[0]].parent == ROOT or self._on_main(frontier[0]):
            self.n_past = self.tree_start + depth + 1   # sequence 0 grew by the main node
        return self._grown(g.grow(), t, rows=len(frontier))

    def _on_main(self, i: int) -> bool:
        return i in set(self.tree.main_path())

    def _grown(self, added: list[int], t: float, rows: int = 0) -> TreeDepth:
        g = self.tree
        self.node_seq += [-1] * len(added)
        self.tree_pending = added
        done = not added or g.done or not g.worth_decoding()
        nodes = [g.nodes[i] for i in added]
        first = added[0] if added else len(g.nodes)
        d = TreeDepth(self.tree_start, first, [n.token for n in nodes],
                      [n.parent for n in nodes], [min(1.0, n.prob) for n in nodes], 0.0, done,
                      rows=rows)
        if not self.greedy and nodes:
            d.q_ids = np.stack([n.row[0] for n in nodes])
            d.q_probs = np.stack([n.row[1] for n in nodes])
        if done:
            self.tree_pending = []
            self.tokens = self.tokens[:self.tree_start] + [g.nodes[i].token
                                                           for i in g.main_path()]
        d.seconds = time.perf_counter() - t
        return d

    def _children(self, logits: np.ndarray, position: int, width: int):
        """A node's candidate children in rank order, (token, q) each, and the q row they were
        drawn from (sampling). Greedy: the top-`width` of the softmax. Sampling: `width` draws
        without replacement from the truncated q, draw r keyed by (seed, position, r); draw 0
        is the chain's own draw at that position."""
        if self.greedy:
            width = min(width, logits.shape[0])
            top = np.argpartition(-logits, width - 1)[:width]
            top = top[np.argsort(-logits[top], kind="stable")]
            m = float(logits[top[0]])
            z = float(np.exp(logits - m, dtype=np.float32).sum(dtype=np.float64))
            return [(int(t), float(np.exp(float(logits[t]) - m) / z)) for t in top], None
        ids, probs = _truncated(logits, self.sampling, self.q_width)
        left = probs.astype(np.float64)
        out = []
        for r in range(min(width, int(np.count_nonzero(left)))):
            key = [self.seed_base, position, 0x7A9D] + ([r] if r else [])
            rng = np.random.Generator(np.random.PCG64(key))
            k = int(rng.choice(len(ids), p=left / left.sum()))
            out.append((int(ids[k]), float(probs[k])))
            left[k] = 0.0
        return out, (ids, probs)

    def tree_abort(self) -> None:
        """Forget the tree round (its branches' cells freed); the context keeps what it has."""
        for seq in range(1, self.seqs_used + 1):
            L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.seqs_used = 0
        if self.tree is not None and self.tree_pending:
            # aborted mid-round: the context never took the main path; drop its decoded cells
            self.tokens = self.tokens[:self.tree_start]
            self._truncate(self.tree_start)
        self.tree = None
        self.tree_pending = []
        self.node_seq = []

    def _take_path(self, path: list[int]) -> None:
        """Make the context [0, tree_start) + the accepted path's tokens, its decoded cells in
        sequence 0; every branch is freed."""
        g = self.tree
        if g is None or self.tree_pending:
            raise DraftError("rollback names a tree path but no finished tree round is held")
        for k, i in enumerate(path):
            if not 0 <= i < len(g.nodes):
                raise DraftError(f"path[{k}] = {i}: the tree round has {len(g.nodes)} nodes")
            want = ROOT if k == 0 else path[k - 1]
            if g.nodes[i].parent != want:
                raise DraftError(f"path[{k}] = {i} is not a child of {want}")
        main = g.main_path()
        j = 0
        while j < len(path) and j < len(main) and path[j] == main[j]:
            j += 1
        start = self.tree_start
        if j < len(path):
            decoded = [k for k in range(j, len(path)) if self.node_seq[path[k]] >= 0]
            L.llama_memory_seq_rm(self.mem, 0, start + j, -1)
            if decoded:
                last = decoded[-1]
                seq = self.node_seq[path[last]]
                L.llama_memory_seq_cp(self.mem, seq, 0, start + j, start + last + 1)
                self.n_past = start + last + 1
            else:
                self.n_past = min(self.n_past, start + j)
        self.tokens = self.tokens[:start] + [g.nodes[i].token for i in path]
        self._truncate(min(self.n_past, len(self.tokens)))   # a proactive chain past the path
        self.tree = None
        self.tree_abort()

    def close(self) -> None:
        """Hand the context back to the model's pool with the KV of every token it evaluated,
        noting how many of them are its prompt's cells as a prompt's evaluation makes them (a
        tree session's unified cache is cleared: its cells need not lie in position order)."""
        c, self.context = self.context, None
        if c is None:
            return
        self.ctx = self.mem = self.batch = None
        if self.tree_nodes:
            L.llama_memory_clear(c.mem, True)
            c.cached, c.exact = [], 0
        else:
            c.cached = self.tokens[:self.n_past]
            c.exact = min(self.n_past, self.prompt_len - 1) if self.prompt_intact else 0
        self.model.give_back(c)


def _greedy(logits: np.ndarray) -> tuple[int, float]:
    """Argmax and its full-softmax probability, 1 / sum(exp(l - max))."""
    token = int(np.argmax(logits))
    m = logits[token]
    prob = 1.0 / float(np.exp(logits - m, dtype=np.float32).sum(dtype=np.float64))
    return token, prob


def _entropy_margin(logits: np.ndarray, temperature: float) -> tuple[float, float]:
    """Entropy (nats) and top-1 minus top-2 probability of softmax(logits / temperature)."""
    x = logits.astype(np.float64) / max(temperature, 1e-6)
    top2 = np.partition(x, x.shape[0] - 2)[-2:]
    m = top2.max()
    e = np.exp(x - m)
    z = float(e.sum())
    entropy = math.log(z) - float(e @ (x - m)) / z
    margin = (1.0 - math.exp(float(top2.min()) - m)) / z
    return max(0.0, entropy), min(1.0, max(0.0, margin))


def _gumbel(logits: np.ndarray, s: Sampling, position: int) -> tuple[int, float]:
    """The Gumbel-max draft argmax(log q + g(seed, position)) and q(draft). q is the draft model's
    distribution warped as the target's is (common/sampling.target_probs): temperature, top-k,
    top-p; a support wider than MAX_Q_WIDTH tokens is cut there (this only shapes the draft,
    never the output)."""
    g = gumbel.noise(s.seed, position, logits.shape[0])
    x = logits.astype(np.float64) / max(s.temperature, 1e-6)
    e = np.exp(x - x.max())
    if s.top_k <= 0 and s.top_p >= 1.0:
        token = gumbel.argmax_token(x, g)  # log q = x - logsumexp(x): the shift changes no argmax
        return token, min(1.0, float(e[token] / e.sum()))
    k = min(s.top_k or MAX_Q_WIDTH, MAX_Q_WIDTH, x.shape[0])
    ids = np.argpartition(-x, k - 1)[:k]
    ids = ids[np.argsort(-x[ids], kind="stable")]
    # normalised over the top-k when top-k is on, else over the whole vocabulary (as the target)
    p = e[ids] / (e[ids].sum() if s.top_k > 0 else e.sum())
    if s.top_p < 1.0:
        n = max(1, int(np.count_nonzero(np.cumsum(p) - p < s.top_p)))
        p[n:] = 0.0
    p /= p.sum()
    with np.errstate(divide="ignore"):
        j = gumbel.argmax_token(np.log(p), g[ids])
    return int(ids[j]), float(p[j])


def _truncated(logits: np.ndarray, s: Sampling, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top-k of the temperature-scaled distribution, then top-p: (ids int32 [k], probs
    float32 [k]), most likely first, summing to 1. Always k entries, so a batch's rows stack:
    top-p zeroes the tail instead of dropping it."""
    x = logits.astype(np.float64) / max(s.temperature, 1e-6)
    k = min(k, x.shape[0])
    ids = np.argpartition(-x, k - 1)[:k]
    ids = ids[np.argsort(-x[ids], kind="stable")]
    p = np.exp(x[ids] - x[ids[0]])
    p /= p.sum()
    if s.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (as common/sampling.target_probs)
        n = max(1, int(np.count_nonzero(np.cumsum(p) - p < s.top_p)))
        p[n:] = 0.0
        p /= p.sum()
    probs = p.astype(np.float32)
    probs /= probs.sum(dtype=np.float32)
    return ids.astype(np.int32), probs
