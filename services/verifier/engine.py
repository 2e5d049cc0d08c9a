"""What the verifier's engine loop schedules: a session feeds `Work` into one ragged forward step
and consumes its logits rows (services/verifier/service.py runs the loop).

* `CloudSession` (cloud-only mode): prefill (chunked), then one token per step, streamed back.
* `SpecSession` (speculative mode) lives in services/verifier/spec.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common import constraint, protocol, sampling
from common.protocol import Msg
from common.runtime import Session


@dataclass
class Work:
    """What a session feeds into one step."""
    token_ids: list[int]
    logits: str          # "last" | "all" | "none" (prefill chunk whose logits nobody needs)
    phase: str           # metrics label: prefill | decode | verify
    positions: torch.Tensor | None = None   # a token tree: common/runner.Segment.positions
    ancestors: torch.Tensor | None = None   # ... and Segment.ancestors (common/tree.attention)


class EngineSession(Session):
    """A session the engine loop steps: it holds a KV cache of the whole model."""

    def __init__(self, sid: str, ident: bytes, rid: int, seq: int, kv):
        super().__init__(sid, ident, rid, seq)
        self.kv = kv
        # the cache came from another session (protocol ADOPT): a forward of that session may
        # still be appending to it, so what it holds is settled in the engine loop, between
        # forwards, by the first next_work (take_over)
        self.adopting = False
        self.failed = False   # ended on a bug: its KV is not kept for the prefix cache

    def take_over(self, most: int) -> int:
        """Keep at most `most` of the adopted cache's tokens; returns how many were kept."""
        n = min(self.kv.length(), max(0, most))
        self.kv.truncate(n)
        self.adopting = False
        return n

    def next_work(self, budget: int) -> Work | None:
        raise NotImplementedError

    @property
    def prefilling(self) -> bool:
        """Whether the next work is (a chunk of) a prompt: the loop plans it after every
        decode/verify work, so a long prompt delays other sessions by at most one chunk."""
        return False

    def consume(self, work: Work, logits: torch.Tensor) -> list[Msg]:
        """Handle the step's logits; return the messages to send to the session's peer."""
        raise NotImplementedError

    def cacheable(self) -> tuple[list[int], int]:
        """(committed tokens, n): the first n rows of the KV cache hold tokens[:n] for good,
        what the prefix cache may keep when the session ends."""
        raise NotImplementedError


class CloudSession(EngineSession):
    """Cloud-only generation: prefill (chunked), then autoregressive decode."""

    def __init__(self, sid, ident, rid, seq, kv, req: protocol.CloudGenerate, cached: int = 0,
                 matcher: constraint.Matcher | None = None):
        super().__init__(sid, ident, rid, seq, kv)
        self.prompt = list(req.token_ids)
        self.cached = cached                       # prompt rows the prefix cache filled
        self.pending = self.prompt[cached:]        # tokens not yet in the cache
        self.matcher = matcher                     # the output constraint's state; None = none
        self.sampling = req.sampling
        self.max_tokens = req.max_tokens
        self.eos = req.eos_token_id
        self.logprobs = req.logprobs          # alternatives per token; None = no logprobs
        self.generated: list[int] = []

    @property
    def prefilling(self) -> bool:
        return bool(self.pending) and not self.generated

    def next_work(self, budget: int) -> Work | None:
        if self.adopting:   # the last token is fed again: its logits give the next one
            del self.pending[:self.take_over(len(self.pending) - 1)]
        if not self.pending or self.closed:
            return None
        take = self.pending[:budget]
        last_chunk = len(take) == len(self.pending)
        phase = "decode" if self.generated else "prefill"
        return Work(take, "last" if last_chunk else "none", phase)

    def consume(self, work: Work, logits: torch.Tensor) -> list[Msg]:
        del self.pending[:len(work.token_ids)]
        if work.logits == "none":
            return []
        position = self.kv.length()
        row = logits[-1]
        if self.matcher is not None:   # choose from the constrained distribution p' ∝ p·m
            row = constraint.apply(row, self.matcher.mask())
        token = sampling.sample(row, self.sampling, position)
        if self.matcher is not None:
            self.matcher.advance([token])
        lps = None if self.logprobs is None else [
            sampling.token_logprob(logits[-1], token, self.logprobs)]
        self.generated.append(token)
        done, reason = False, ""
        if self.eos is not None and token == self.eos:
            done, reason = True, "eos"
        elif len(self.generated) >= self.max_tokens:
            done, reason = True, "length"
        if not done:
            self.pending = [token]
        else:
            self.closed = True
        return [protocol.CloudTokens(sid=self.sid, seq=self.seq, rid=self.rid,
                                     index=len(self.generated) - 1, token_ids=[token], done=done,
                                     finish_reason=reason, logprobs=lps,
                                     cached_tokens=self.cached if len(self.generated) == 1 else 0)]

    def cacheable(self) -> tuple[list[int], int]:
        # the cache holds exactly the tokens fed so far: the prompt, then each sampled token
        return self.prompt + self.generated, self.kv.length()
