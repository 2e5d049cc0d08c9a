"""Per-request statistics, typed: what the dispatcher reports in a request's `Done.stats`.

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
from dataclasses import dataclass, field, fields
from typing import Any


def _opt_float(v) -> float | None:
    return None if v is None else float(v)


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


@dataclass(frozen=True, eq=False)
class Stats(Mapping):
    """Per-request figures. Times are seconds (monotonic clock on the dispatcher)."""

    # --- every mode -----------------------------------------------------------------------------
    mode: str = ""
    """The mode that served the request: "spec", "split" or "cloud-only"."""
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
    cloud_forwards_per_token: float | None = None
    """Forward passes of the cloud target per emitted token: 1.0 in cloud-only mode, under 1 when
    speculation accepts drafts; None in split mode."""

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

    # --- faults and recovery (any mode) ---------------------------------------------------------
    recoveries: int = 0
    """Times the session was replayed on a live replica after a failure."""
    recovery_reasons: tuple[str, ...] = ()
    """Why each recovery happened."""
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
        g = d.get
        return cls(
            mode=str(g("mode") or ""), policy=str(g("policy") or ""),
            prompt_tokens=int(g("prompt_tokens") or 0),
            generated_tokens=int(g("generated_tokens") or 0),
            duration_s=float(g("duration_s") or 0.0),
            ttft_s=_opt_float(g("ttft_s")), tpt_s=_opt_float(g("tpt_s")),
            cloud_forwards_per_token=_opt_float(g("cloud_forwards_per_token")),
            rounds=_opt_int(g("rounds")), draft_tokens=_opt_int(g("draft_tokens")),
            accepted_tokens=_opt_int(g("accepted_tokens")),
            acceptance_rate=_opt_float(g("acceptance_rate")),
            mean_draft_length=_opt_float(g("mean_draft_length")),
            nav_reasons=g("nav_reasons"), thresholds=g("thresholds"),
            cut=_opt_int(g("cut")), edge_forward_s=_opt_float(g("edge_forward_s")),
            cloud_forward_s=_opt_float(g("cloud_forward_s")),
            cloud_queue_s=_opt_float(g("cloud_queue_s")), wire_s=_opt_float(g("wire_s")),
            recoveries=int(g("recoveries") or 0),
            recovery_reasons=tuple(g("recovery_reasons") or ()),
            degraded=bool(g("degraded", False)), degraded_tokens=int(g("degraded_tokens") or 0),
            raw=d)

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


__all__ = ["Stats"]
