"""One client request in flight on the dispatcher, and what every mode does with it.

`Request.emit` is the only way tokens reach a client: it numbers them, stops at max_tokens / EOS,
and never sends a token twice, whatever the mode does (DESIGN.md §5, invariant 5).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

from common import metrics, protocol, sampling

log = logging.getLogger("tandem.dispatcher")

if TYPE_CHECKING:   # for annotations only: the dispatcher imports this module
    from services.dispatcher.service import Dispatcher


EVENT_TOKENS = 64   # tokens per TokenEvent when they carry log-probabilities


class Detokenizer:
    """Incremental detokenisation: emit text only once a token sequence decodes to whole
    characters (a multi-byte character may span tokens)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset],
                                 skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""


class Request:
    """One client request in flight."""

    def __init__(self, d: Dispatcher, ident: bytes, msg: protocol.GenerateRequest,
                 prompt_ids: list[int], mode: str, policy: str, resumed: int = 0):
        self.d = d
        self.ident = ident
        self.msg = msg
        self.rid = msg.rid
        self.sid = f"{msg.sid or 'req'}-{uuid.uuid4().hex[:10]}"   # unique across clients
        # the context the modes extend: the prompt, and for a continuation (GenerateRequest.
        # resume_ids) the `resumed` tokens the client already holds, so every position, and the
        # seeded draws keyed by it, is where the uninterrupted run had it
        self.prompt_ids = prompt_ids
        self.resumed = resumed
        self.mode = mode
        self.policy = policy
        # the coupling and (under gumbel) the seed resolved here, so every service agrees
        self.sampling = sampling.resolved(msg.sampling, d.cfg.sampling_coupling)
        self.max_tokens = msg.max_tokens - resumed
        self.eos = d.eos_token_id if msg.stop_at_eos else None
        self.tokens: list[int] = []
        self.finish_reason = ""
        self.start = time.monotonic()
        budget = msg.deadline_s if msg.deadline_s > 0 else d.cfg.request_timeout_s
        self.deadline = self.start + budget
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.stats: dict = {}            # mode-specific figures, returned in Done.stats
        self.choice = None               # mode="auto": the auto_policy.Choice that chose `mode`
        self.switch_to = None            # mode="auto": the Candidate it may switch to
        self.switcher = None             # mode="auto", switching: asked by `switch_due`
        self.segments: list[dict] = []   # mode="auto", switching: each stretch, in order
        self.cancelled = asyncio.Event()
        self.detok = Detokenizer(d.tokenizer)
        if resumed:   # the text continues where the client's left off
            self.detok.push(prompt_ids[len(prompt_ids) - resumed:])

    def constraint_fields(self) -> dict:
        """The output constraint as a service's open message carries it: the constraint and
        where the output starts in the committed tokens (after the prompt)."""
        if self.msg.constraint is None:
            return {}
        # a continuation's prompt_ids hold the tokens it already delivered: output, constrained
        return {"constraint": self.msg.constraint,
                "constrained_from": len(self.prompt_ids) - self.resumed}

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def emit(self, token_ids: list[int], degraded: bool = False,
                   logprobs: list[protocol.TokenLogprob] | None = None) -> bool:
        """Append committed tokens to the client's stream, with the target's TokenLogprob of
        each when the request asked for them (`logprobs`, one per token; None from the edge
        alone). Returns False once the request is complete (max_tokens reached or EOS emitted);
        tokens past that point are dropped."""
        if self.done:
            return False
        out = []
        for t in token_ids:
            out.append(t)
            if self.eos is not None and t == self.eos:
                self.finish_reason = "eos"
                break
            if len(self.tokens) + len(out) >= self.max_tokens:
                self.finish_reason = "length"
                break
        if not out:
            return not self.done
        now = time.monotonic()
        labels = (self.d.name, self.mode, self.policy)
        if not self.tokens:
            self.first_token_at = now
            metrics.TTFT.labels(*labels).observe(now - self.start)
        else:
            gap = (now - self.last_token_at) / len(out)
            for _ in out:
                metrics.ITL.labels(*labels).observe(gap)
        self.last_token_at = now
        metrics.GENERATED_TOKENS.labels(*labels).inc(len(out))
        lps = None
        if self.msg.logprobs is not None and logprobs is not None:
            lps = logprobs[:len(out)]
            if len(lps) < len(out):   # a peer's short list: the tokens go out without them
                log.warning("%s: %d logprobs for %d tokens", self.sid, len(lps), len(out))
                lps = None
        # with log-probabilities a token takes ~14 bytes per alternative: events stay small
        step = EVENT_TOKENS if lps is not None else len(out)
        for i in range(0, len(out), step):
            part = out[i:i + step]
            index = self.resumed + len(self.tokens)   # a continuation's numbering goes on
            self.tokens.extend(part)
            await self.d.send(self.ident, protocol.TokenEvent(
                sid=self.msg.sid, rid=self.rid, index=index, token_ids=part,
                text=self.detok.push(part), degraded=degraded,
                logprobs=None if lps is None else lps[i:i + step]))
        return not self.done

    def switch_due(self) -> bool:
        """Whether the stretch running now hands the request over to another mode here (mode
        "auto"; the modes ask after each token they stream)."""
        return self.switcher is not None and not self.done and self.switcher()

    def summary(self) -> dict:
        end = time.monotonic()
        n = len(self.tokens)
        stats = {"mode": self.mode, "policy": self.policy,
                 "prompt_tokens": len(self.prompt_ids) - self.resumed,
                 "generated_tokens": n, "duration_s": end - self.start,
                 "ttft_s": (self.first_token_at - self.start) if n else None,
                 "tpt_s": (end - self.start) / n if n else None,
                 "tpot_s": (end - self.first_token_at) / (n - 1) if n > 1 else None}
        if self.msg.resume_ids is not None:
            stats["continued_from"] = self.resumed
        stats.update(self.stats)
        if self.segments:
            stats["segments"] = [dict(s) for s in self.segments]
        else:
            segment = {"mode": self.mode, "policy": self.policy, "tokens": n,
                       "why": self.choice.reason if self.choice else "requested",
                       "seconds": round(end - self.start, 6)}
            if self.mode == "split":
                segment["cut"] = stats.get("cut")
            stats["segments"] = [segment]
        if self.choice is not None:
            stats["auto"] = self.choice.describe()
        return stats
