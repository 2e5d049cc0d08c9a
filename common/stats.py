"""Per-request statistics, typed: what the dispatcher reports in a request's `Done.stats`, one
type for both ends — the dispatcher's keys are its fields (tests/unit/test_inprocess_stack.py
checks every key a request in every mode carries), and the SDK's `Result.stats` is one.

`Result.stats` is a `Stats`: a frozen dataclass whose fields are the figures most callers want,
typed and documented, and at the same time a read-only mapping over everything the dispatcher
sent (`.raw`), so code that indexes it like the plain dict it used to be keeps working:

    r = client.complete("Hello", mode="spec", max_tokens=16)
    r.stats.tpt_s                # float | None — typed attribute
    r.stats["tpt_s"]             # the same value, dict-style
    r.stats.get("rounds")        # every key of the wire dict, including ones not typed here
    json.dumps(r.stats.raw)      # the wire dict itself (Stats is a Mapping, not a dict)

Fields that only one mode fills are None (or 0/False) in the others; keys the dispatcher adds
later that have no field yet are still in `.raw` and reachable by `stats[key]`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any


def _coerce(tp, v):
    """A wire value as the field's type (msgpack has no tuples; ints may stand for floats)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):   # X | None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    kind = typing.get_origin(tp) or tp
    if kind is tuple:
        return tuple(v)
    if kind in (int, float, bool, str):
        return kind(v)
    return v


@dataclass(frozen=True, eq=False)
class Stats(Mapping):
    """Per-request figures. Times are seconds (monotonic clock on the dispatcher)."""

    # --- every mode -----------------------------------------------------------------------------
    mode: str = ""
    """The mode that served the request: "spec", "split" or "cloud-only" (for mode="auto",
    the one chosen)."""
    policy: str = ""
    """Speculative policy (pipesd, pipesd-stream, vanilla, hsl, edgellm, oracle-trigger); the mode's
    name in the other modes."""
    prompt_tokens: int = 0
    """Prompt length in tokens (after the chat template, when `chat=True`)."""
    generated_tokens: int = 0
    """Tokens streamed to the client."""
    duration_s: float = 0.0
    """From admission on the dispatcher to the end of the request."""
    ttft_s: float | None = None
    """Time to first token (None when no token was generated)."""
    tpt_s: float | None = None
    """Time per token: `duration_s / generated_tokens` (PipeSD's headline figure)."""
    tpot_s: float | None = None
    """Time per output token after the first: `(duration_s - ttft_s) / (generated_tokens - 1)`,
    the decode pace (vLLM's TPOT) that a `tpt_slo_ms` target bounds (None under two tokens)."""
    cached_tokens: int = 0
    """Prompt tokens whose KV the prefix cache held, so their prefill was skipped: the
    verifier's (cloud-only and speculative modes), or in split mode the rows both the edge
    prefix and the cloud suffix reused (OpenAI's `usage.prompt_tokens_details.cached_tokens`)."""
    cloud_forwards_per_token: float | None = None
    """Forward passes of the cloud target per emitted token: 1.0 in cloud-only mode, under 1 when
    speculation accepts drafts; None in split mode."""

    segments: tuple[dict, ...] = ()
    """The stretches of the request served one way, in order: each {"mode", "policy",
    "tokens", "why"} (and "cut" in split mode); "why" is "requested" for a named mode, else the
    auto chooser's reason (services/dispatcher/auto_policy.py REASONS)."""
    auto: dict | None = None
    """mode="auto" only: {"chosen", "reason", "predictions": [{"candidate", "tpt_s",
    "cloud_s_per_token"}]}, what the chooser compared."""

    # --- speculative mode (None elsewhere) --------------------------------------------------------
    rounds: int | None = None
    """Verification rounds."""
    draft_tokens: int | None = None
    """Draft tokens sent for verification."""
    accepted_tokens: int | None = None
    """Draft tokens the target accepted."""
    acceptance_rate: float | None = None
    """accepted_tokens / draft_tokens."""
    mean_draft_length: float | None = None
    """draft_tokens / rounds."""
    nav_reasons: dict | None = None
    """Why each verification was triggered ({reason: count}, the dual-threshold trigger)."""
    thresholds: dict | None = None
    """The NAV trigger's thresholds at the end ({"r1": ..., "r2": ...})."""

    # --- split mode (None elsewhere) -------------------------------------------------------------
    cut: int | None = None
    """The cut layer: the edge ran decoder layers [0, cut), the cloud the rest."""
    edge_forward_s: float | None = None
    """Total time of the edge's (prefix) forward passes."""
    cloud_forward_s: float | None = None
    """Total time of the cloud's (suffix) forward passes."""
    cloud_queue_s: float | None = None
    """Time the request's steps waited in the suffix's scheduler queue."""
    wire_s: float | None = None
    """The rest of the request's time: network and overheads."""

    prefill_s: float | None = None
    """Time until the prompt was through both halves (first token's prefill)."""

    # --- speculative mode: the machinery (None elsewhere) ----------------------------------------
    batches: int | None = None
    """Draft batches sent (DP batching splits a round into several)."""
    early_rejects: int | None = None
    """Rounds the streaming verifier resolved before their NAV (a rejected draft)."""
    proactive_kept: int | None = None
    """Proactive (drafted-ahead) rounds kept because their guess of the bonus token held."""
    proactive_discarded: int | None = None
    """Proactive rounds thrown away."""
    rollbacks: int | None = None
    """Drafter rollbacks after a rejection."""
    verifier_forwards: int | None = None
    """Target forward passes that included this session."""
    verifier_ready_s: float | None = None
    """From admission until the verifier had the prompt in its cache."""
    duplicate_results: int | None = None
    """Verification results received twice (a resend after a loss): ignored."""
    unknown_results: int | None = None
    """Results for rounds the session no longer had: ignored."""
    window: float | None = None
    """The scheduling window N̂ at the end (PipeSD's expected draft length)."""
    dp_plan: list | None = None
    """The batch sizes of the last DP plan (Algorithm 1)."""
    alpha_s: float | None = None
    """α: per-batch transmission cost as measured."""
    beta_s: float | None = None
    """β: per-token transmission cost as measured."""
    gamma_s: float | None = None
    """γ: drafter seconds per token as measured."""
    tuner: dict | None = None
    """The BO autotuner's state (pipesd policies): state, evaluations, retunes."""
    oracle_reference_s: float | None = None
    """oracle-trigger only: time spent computing the target's reference continuation."""
    drafter_lost: bool = False
    """The drafter failed mid-request: the rest came from zero-draft rounds (still exact)."""
    resumed_at: int | None = None
    """allow_edge_only: the stream index where verification resumed."""

    # --- faults and recovery (any mode) ---------------------------------------------------------
    recoveries: int = 0
    """Times the session was replayed on a live replica after a failure."""
    recovery_reasons: tuple[str, ...] = ()
    """Why each recovery happened."""
    recovery_s: tuple[float, ...] = ()
    """For each recovery: from the failure's detection to the first token after the replay."""
    verifier_replica: str | None = None
    """The verifier replica that finished the request (when there are several)."""
    suffix_replica: str | None = None
    """The suffix replica that finished the request (when there are several)."""
    continued_from: int | None = None
    """A continuation (the request was resumed): the stream index its last dispatcher continued
    at, after the tokens the client already held."""
    resumes: int = 0
    """Times the SDK re-submitted the request as a continuation after losing its dispatcher
    mid-stream (tandem/link.py); set by the SDK."""
    resume_s: tuple[float, ...] = ()
    """For each resume: from the last token before the loss to the first token after it (the
    pause the caller saw); set by the SDK."""
    degraded: bool = False
    """Some tokens were produced by the edge alone while the cloud was unreachable
    (`allow_edge_only=True`)."""
    degraded_tokens: int = 0
    """How many tokens were produced that way."""

    raw: dict = field(default_factory=dict, repr=False)
    """Everything the dispatcher sent, as sent (JSON-serialisable)."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "Stats":
        """Build from the wire dict; missing keys get the defaults, unknown keys stay in raw."""
        d = dict(d or {})
        hints = typing.get_type_hints(cls)
        kw = {f.name: _coerce(hints[f.name], d[f.name]) for f in fields(cls)
              if f.name != "raw" and d.get(f.name) is not None}
        return cls(**kw, raw=d)

    @property
    def tokens_per_s(self) -> float | None:
        """Throughput of this request: 1 / tpt_s."""
        return 1.0 / self.tpt_s if self.tpt_s else None

    def to_dict(self) -> dict:
        """A copy of the wire dict (what `json.dumps` wants)."""
        return dict(self.raw)

    # --- read-only Mapping over `raw`: r.stats["tpt_s"], r.stats.get(...), dict(r.stats) ---------
    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def __eq__(self, other) -> bool:   # equal to another Stats or a dict with the same items
        if isinstance(other, Stats):
            return self.raw == other.raw
        if isinstance(other, Mapping):
            return self.raw == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # holds dicts

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                          if f.repr and getattr(self, f.name) not in (None, 0, (), False, ""))
        return f"Stats({shown})"


RequestStats = Stats

__all__ = ["Stats", "RequestStats"]
