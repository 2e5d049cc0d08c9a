"""Output constraints (JSON object, JSON schema, regular expression) as token masks, on
llguidance (github.com/guidance-ai/llguidance).

Every service that chooses or checks a token under a constraint holds a `Matcher`: the allowed
tokens after the output so far (`mask`), advanced with committed tokens (`advance`) and rolled
back with them (`rollback`: a replay, a rejected draft). Applying the mask sets the logits
outside it to -inf, so greedy, sampling, the Gumbel coupling and speculative verification all
work on the masked distribution p' ∝ p·m unchanged (docs/design.md, Constrained speculative
decoding).

Why llguidance:
* one library for all three constraint kinds (JSON schema, regex, Lark), with rollback of any
  number of tokens built in (a speculative drafter rolls back every rejected draft);
* tokenizers from both runtimes Tandem has: transformers (`llguidance.hf`, the verifier and the
  suffix) and llama.cpp (`llguidance.llamacpp`, the edge drafter), so drafter and target mask
  the same vocabulary without shipping a transformers tokenizer to the edge;
* masks cheap enough to compute per token on a CPU, next to the forward (an Earley parser
  over a token trie, with lexer-level slicing), and strict: a schema keyword it does not
  implement is a compile error (a 400), never silently ignored.

Measured on this machine's CPU (2 shared cores), SmolLM2's 49,152-token vocabulary
(bench/bench_constraint.py over SchemaStore's schemas): computing one mask takes
~20 µs median, ~56 µs at the 95th percentile, ~26 µs mean over 2,884 output tokens of 12 real
schemas, against ~27 ms per target decode step (0.1 %). The first masks of a process are slower
(up to ~16 ms, once). Compiling a schema takes ~1 ms median (0.23 s the largest); building the
tokenizer ~0.5 s, once per process (cached). 208 of SchemaStore's 497 schemas compile.
The alternatives (not measured here): xgrammar takes its tokenizer from transformers, so the
GGUF drafter would need one shipped to the edge; outlines-core compiles a schema to one regex
and builds its whole token index up front, per schema, and has no JSON-schema-level errors.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from common import protocol
from common.protocol import Constraint, ProtocolError

KINDS = ("json_object", "json_schema", "regex")

# JSON compiler options: compact separators, so no run of whitespace a small model could loop
# on; properties come in the schema's order.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def _bad(message: str) -> ProtocolError:
    return ProtocolError(protocol.BAD_FIELD, f"constraint: {message}", field="constraint")


def grammar(c: Constraint) -> str:
    """The llguidance grammar of a constraint; raises BAD_FIELD (field "constraint") when the
    constraint is malformed or the library cannot compile it. Cached: an application sends the
    same schema again and again, and every service of a request compiles it."""
    return _grammar(c.kind, c.value)


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, value: str) -> str:
    import llguidance

    if kind == "regex":
        g = llguidance.LLMatcher.grammar_from_regex(value)
    else:
        if kind == "json_object":
            schema: Any = {"type": "object"}
        else:
            try:
                schema = json.loads(value)
            except ValueError as e:
                raise _bad(f"the schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise _bad("the schema must be a JSON object")
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise _bad(f"the schema cannot be compiled: {e}") from None
    why = llguidance.LLMatcher.validate_grammar(g)
    if why:
        raise _bad(f"the {kind.replace('_', ' ')} cannot be compiled: {why}")
    return g


def check(c: Constraint, max_bytes: int) -> None:
    """A constraint a request may carry: within `max_bytes` and compilable."""
    if c.kind == "json_object" and c.value:
        raise _bad("json_object takes no value")
    if c.kind != "json_object" and not c.value:
        raise _bad(f"{c.kind} needs a value")
    if len(c.value.encode()) > max_bytes:
        raise ProtocolError(protocol.TOO_LARGE, f"constraint: {len(c.value.encode())} bytes "
                            f"over the limit of {max_bytes} (max_constraint_bytes)",
                            field="constraint")
    grammar(c)


@functools.lru_cache(maxsize=4)
def hf_tokenizer(path: str, n_vocab: int):
    """The llguidance tokenizer of a transformers model directory, with the model's logits
    width (it may exceed the tokenizer's: padding rows are never allowed). ~0.5 s: cached."""
    import llguidance.hf

    from common import tokenizer

    return llguidance.hf.from_tokenizer(tokenizer.load(path), n_vocab=n_vocab)


def llama_tokenizer(llama):
    """The llguidance tokenizer of a llama_cpp.Llama (the drafter's GGUF vocabulary)."""
    import llguidance.llamacpp

    return llguidance.llamacpp.lltokenizer_from_vocab(llama._model.vocab, n_vocab=llama.n_vocab())


class Matcher:
    """A constraint's state over one output: the allowed next tokens after the tokens advanced
    so far. Each service keeps its own (advanced with what it committed or drafted)."""

    def __init__(self, tokenizer, c: Constraint, vocab: int):
        import llguidance

        self.vocab = vocab
        self.kind = c.kind
        self.m = llguidance.LLMatcher(tokenizer, grammar(c), log_level=0)
        self.consumed = 0          # tokens advanced and not rolled back
        self.past_stop = 0         # of them, EOS tokens after the constraint was complete
        self._fail()

    def _fail(self) -> None:
        if self.m.is_error():
            raise ProtocolError(protocol.CONSTRAINT, f"the {self.kind} constraint failed: "
                                f"{self.m.get_error()}", field="constraint")

    def mask(self) -> np.ndarray:
        """bool [vocab]: the tokens allowed next. Raises CONSTRAINT when none is (the output can
        neither go on nor end inside the constraint): the request ends with that error."""
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)
        self._fail()
        if not allowed.any():
            raise ProtocolError(protocol.CONSTRAINT, f"the {self.kind} constraint allows no next "
                                f"token after {self.consumed} tokens", field="constraint")
        return allowed

    def _take(self, token: int) -> bool:
        """Advance over one token if it is allowed; whether it was. Once the constraint is
        complete (llguidance stops) only EOS is allowed, and llguidance keeps no history of it:
        those tokens are counted here (`past_stop`) so that rollback stays exact."""
        if self.m.is_stopped():
            bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
            if not 0 <= token < self.vocab or not (bits[token >> 3] >> (token & 7)) & 1:
                return False
            self.past_stop += 1
        elif self.m.validate_tokens([token]) != 1 or not self.m.consume_token(token):
            return False
        self.consumed += 1
        return True

    def advance(self, tokens: list[int]) -> None:
        """Commit tokens the output now has; a token outside the mask is a CONSTRAINT error."""
        for t in tokens:
            if not self._take(int(t)):
                self._fail()
                raise ProtocolError(protocol.CONSTRAINT, f"token {t} is outside the {self.kind} "
                                    f"constraint after {self.consumed} tokens", field="constraint")

    def advance_valid(self, tokens: list[int]) -> int:
        """Advance over the longest allowed prefix of `tokens`; how many it took (drafts past a
        disallowed token are never used). A disallowed token never reaches llguidance, whose
        error state would be permanent."""
        n = 0
        while n < len(tokens) and self._take(int(tokens[n])):
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Forget the last `n` advanced tokens."""
        if n > self.consumed:
            raise ProtocolError(protocol.CONSTRAINT, f"cannot roll the constraint back by {n} "
                                f"of {self.consumed} tokens", field="constraint")
        past = min(n, self.past_stop)
        self.past_stop -= past
        if n - past and not self.m.rollback(n - past):
            self._fail()
            raise ProtocolError(protocol.CONSTRAINT, f"cannot roll the constraint back by {n}",
                                field="constraint")
        self.consumed -= n

    def accepting(self) -> bool:
        """Whether the output so far is a complete value of the constraint."""
        return self.m.is_accepting()


def apply(logits, allowed: np.ndarray):
    """Logits (a torch row [V] or a numpy row) with -inf outside `allowed` (a copy)."""
    if isinstance(logits, np.ndarray):
        out = logits.copy()
        out[~allowed[:out.shape[-1]]] = -np.inf
        return out
    import torch

    keep = torch.from_numpy(allowed[:logits.shape[-1]]).to(logits.device)
    return logits.masked_fill(~keep, float("-inf"))
