"""Split-mode step planners: which layer ranges the suffix runs, for which sessions, in what order.

One *step* of a window serves every request in it once (a decode token or a prefill): session i
arrives with the hidden state after layers [0, c_i) and must be run through [c_i, L), after which
the runner applies norm + LM head. A plan is a list of `Call`s in execution order; each is one
`LayerRangeRunner.forward(items, a, b)` over a ragged batch of sessions.

Execution contract for the executor: a session's first call starts from the hidden state it
arrived with; every later call of that session starts from the hidden state its previous call
produced (DSB and cascade rely on this carry-over); the call with b == L produces its logits.
Every plan covers each session's [c_i, L) exactly once, contiguously, in order (`validate_plan`).

Schedulers (DESIGN.md §4; the first four follow the DySCo paper's baselines):
  fifo       one session per call, arrival order: [c_i, L) each.
  exact      exact-match batching: one call [c, L) per distinct cut, groups by earliest arrival.
  interleave one session per call in round-robin order (`RoundRobin` keeps the cursor).
  dsb        depth-synchronized batching: d = deepest cut; each distinct cut c < d runs [c, d)
             privately (same-cut peers together), then [d, L) runs once for everybody.
  cascade    ours: layer l runs once for every session with c_i <= l; consecutive layers with
             the same session set are one call, so calls are [c(j), c(j+1)) for the sessions at
             cuts <= c(j) and [c(k), L) for all. No layer index runs twice in a step.

Within a call, sessions are ordered by (cut, arrival, input order), so in dsb's tail and in every
cascade call the rows of earlier calls come first and sessions joining at this cut are appended.
`Request.n_tokens` does not affect planning; it rides along for the executor (prefill vs decode).
"""

from collections.abc import Callable
from dataclasses import dataclass

SCHEDULERS = ("fifo", "exact", "interleave", "dsb", "cascade")


@dataclass(frozen=True)
class Request:
    sid: str  # session id; at most one request per session in a window
    cut: int  # first cloud layer: the edge already ran [0, cut); 0 <= cut < num_layers
    n_tokens: int = 1  # new tokens this step: 1 for decode, the prompt length for prefill
    arrival: float = 0.0  # when the hidden state became ready (caller's clock); orders ties


@dataclass(frozen=True)
class Call:
    a: int  # first layer to run
    b: int  # one past the last layer; b == num_layers also applies norm + LM head
    sids: tuple[str, ...]  # sessions in this ragged batch, in row order


class RoundRobin:
    """Round-robin cursor over admitted sessions for the interleaving scheduler.

    The ring holds sessions in admission order; `order(ready)` walks the ring from the cursor and
    returns the ready sessions it meets, skipping (not dropping) those not ready, so an idle
    session never stalls the worker and keeps its place for the next turn. The cursor then moves
    just past the last session returned, so the next turn starts with whoever was skipped or not
    reached. `limit=1` is the paper's one-session-per-call worker; no limit serves a whole window.
    Ready sessions not yet in the ring are admitted at its end (first-seen order).
    """

    def __init__(self):
        self.ring: list[str] = []  # admitted sessions, admission order
        self.cursor = 0  # ring index of the session whose turn is next

    def admit(self, sid: str) -> None:
        if sid not in self.ring:
            self.ring.append(sid)

    def drop(self, sid: str) -> None:
        """Remove a closed session; the session after it keeps its turn."""
        if sid not in self.ring:
            return
        i = self.ring.index(sid)
        del self.ring[i]
        if i < self.cursor:
            self.cursor -= 1
        if self.cursor >= len(self.ring):
            self.cursor = 0

    def order(self, ready_sids, limit: int | None = None) -> list[str]:
        ready_sids = list(ready_sids)
        ready = set(ready_sids)
        for sid in ready_sids:
            self.admit(sid)
        n = len(self.ring)
        picked, last = [], None
        for step in range(n):
            if limit is not None and len(picked) >= limit:
                break
            i = (self.cursor + step) % n
            if self.ring[i] in ready:
                picked.append(self.ring[i])
                last = i
        if last is not None:
            self.cursor = (last + 1) % n
        return picked


def _check_requests(requests: list[Request], num_layers: int) -> None:
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    seen = set()
    for r in requests:
        if r.sid in seen:
            raise ValueError(f"session {r.sid!r} appears twice in one window")
        seen.add(r.sid)
        if not 0 <= r.cut < num_layers:
            raise ValueError(f"session {r.sid!r}: cut {r.cut} outside [0, {num_layers})")


def _by_arrival(requests: list[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.arrival)  # stable: input order breaks ties


def _rows(requests: list[Request]) -> tuple[str, ...]:
    return tuple(r.sid for r in sorted(_by_arrival(requests), key=lambda r: r.cut))


def plan_window(scheduler: str, requests: list[Request], num_layers: int,
                rr: RoundRobin | None = None) -> list[Call]:
    """Calls, in execution order, that serve every request once. `rr` orders `interleave`
    (arrival order without one)."""
    _check_requests(requests, num_layers)
    L = num_layers
    if not requests:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; expected one of {SCHEDULERS}")
        return []
    if scheduler == "fifo":
        return [Call(r.cut, L, (r.sid,)) for r in _by_arrival(requests)]
    if scheduler == "interleave":
        if rr is None:
            return plan_window("fifo", requests, L)
        cut = {r.sid: r.cut for r in requests}
        return [Call(cut[s], L, (s,)) for s in rr.order([r.sid for r in _by_arrival(requests)])]
    if scheduler == "exact":
        groups: dict[int, list[Request]] = {}  # insertion order = earliest arrival per cut
        for r in _by_arrival(requests):
            groups.setdefault(r.cut, []).append(r)
        return [Call(c, L, tuple(r.sid for r in g)) for c, g in groups.items()]
    cuts = sorted({r.cut for r in requests})
    if scheduler == "dsb":
        d = cuts[-1]
        private = [Call(c, d, _rows([r for r in requests if r.cut == c])) for c in cuts[:-1]]
        return private + [Call(d, L, _rows(requests))]
    if scheduler == "cascade":
        bounds = cuts + [L]
        return [Call(bounds[j], bounds[j + 1], _rows([r for r in requests if r.cut <= bounds[j]]))
                for j in range(len(cuts))]
    raise ValueError(f"unknown scheduler {scheduler!r}; expected one of {SCHEDULERS}")


def validate_plan(calls: list[Call], requests: list[Request], num_layers: int) -> None:
    """Raise ValueError unless each session runs exactly [cut, L), contiguously and in order."""
    _check_requests(requests, num_layers)
    depth = {r.sid: r.cut for r in requests}  # next layer each session must run
    for k, call in enumerate(calls):
        if not 0 <= call.a < call.b <= num_layers:
            raise ValueError(f"call {k}: bad layer range [{call.a}, {call.b}) for L={num_layers}")
        if not call.sids:
            raise ValueError(f"call {k}: no sessions")
        if len(set(call.sids)) != len(call.sids):
            raise ValueError(f"call {k}: a session appears twice")
        for sid in call.sids:
            if sid not in depth:
                raise ValueError(f"call {k}: unknown session {sid!r}")
            if depth[sid] != call.a:
                raise ValueError(f"call {k}: session {sid!r} is at layer {depth[sid]}, "
                                 f"call starts at {call.a}")
            depth[sid] = call.b
    short = sorted(s for s, d in depth.items() if d != num_layers)
    if short:
        raise ValueError(f"sessions not run to layer {num_layers}: {short}")


def plan_stats(calls: list[Call]) -> dict:
    """Counters for metrics and benchmarks.

    calls           runner invocations
    layer_execs     sum of (b - a): layer weight passes, what batching saves
    session_layers  sum of (b - a) * batch: per-row work, the same for every valid plan
    max_batch       largest call
    mean_batch      session_layers / layer_execs: rows served per layer pass
    shared_tail     layers run in calls holding every session of the plan (dsb: L - d)
    private_advance layer passes in calls holding only part of the plan (dsb: sum of d - c)
    """
    everyone = set().union(*(c.sids for c in calls)) if calls else set()
    layer_execs = sum(c.b - c.a for c in calls)
    session_layers = sum((c.b - c.a) * len(c.sids) for c in calls)
    shared = sum(c.b - c.a for c in calls if set(c.sids) == everyone)
    return {
        "calls": len(calls),
        "layer_execs": layer_execs,
        "session_layers": session_layers,
        "max_batch": max((len(c.sids) for c in calls), default=0),
        "mean_batch": session_layers / layer_execs if layer_execs else 0.0,
        "shared_tail": shared,
        "private_advance": layer_execs - shared,
    }


def plan_cost(calls: list[Call], cost_fn: Callable[[int, int], float]) -> float:
    """Modelled step time: sum of cost_fn(n_layers, batch_size) over calls (run back to back)."""
    return sum(cost_fn(c.b - c.a, len(c.sids)) for c in calls)


def linear_cost(per_layer: float, per_row: float,
                per_call: float = 0.0) -> Callable[[int, int], float]:
    """t = per_call + n_layers * (per_layer + per_row * batch): per_layer is the weight read that
    batching amortises, per_row the per-session compute, per_call the launch/dispatch overhead."""
    return lambda n_layers, batch: per_call + n_layers * (per_layer + per_row * batch)
