"""Every Prometheus metric Tandem exports, in one place (DESIGN.md §6).

Names: prefix `tandem_`, base units, `_total` counters, histograms for latencies. Labels have low
cardinality only (`service`, `mode`, `policy`, `cut`, `scheduler`, `phase`, `reason`, `code`,
`position`) — never a session id. Each service process registers them all in the default
registry; a metric a service never touches exports no samples. The label sets a service knows
when it starts (its modes, policies, scheduler) are declared then, at 0 (`declare_*` below);
other children appear on first use.
"""

from __future__ import annotations

import resource

from prometheus_client import Counter, Gauge, Histogram

# Latency buckets from 100 µs to 60 s: covers one-token decode on a GPU and a slow WAN round trip.
LATENCY = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25,
           0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)
ROUND_COUNTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64)   # 0 = all rejected

# --- requests and tokens (dispatcher) -------------------------------------------------------
REQUESTS = Counter("tandem_requests_total", "Client requests finished, by outcome",
                   ["service", "mode", "policy", "outcome"])
GENERATED_TOKENS = Counter("tandem_generated_tokens_total", "Tokens streamed to clients",
                           ["service", "mode", "policy"])
PROMPT_TOKENS = Counter("tandem_prompt_tokens_total", "Prompt tokens received",
                        ["service", "mode"])
RESUMED_REQUESTS = Counter("tandem_resumed_requests_total",
                           "Continuations admitted: requests a client re-submitted with the "
                           "tokens it already held after losing its dispatcher mid-stream",
                           ["service", "mode"])
ACTIVE_SESSIONS = Gauge("tandem_active_sessions", "Sessions currently open", ["service", "mode"])
TTFT = Histogram("tandem_time_to_first_token_seconds", "Request arrival to first streamed token",
                 ["service", "mode", "policy"], buckets=LATENCY)
ITL = Histogram("tandem_inter_token_latency_seconds", "Gap between streamed tokens (per token)",
                ["service", "mode", "policy"], buckets=LATENCY)
TPT = Histogram("tandem_time_per_accepted_token_seconds",
                "Request wall time / tokens emitted (PipeSD's TPT), per finished request",
                ["service", "mode", "policy"], buckets=LATENCY)
E2E = Histogram("tandem_request_duration_seconds", "Request arrival to last token",
                ["service", "mode", "policy"], buckets=LATENCY)
AUTO_CHOICES = Counter("tandem_auto_choices_total",
                       "Modes chosen for mode=auto requests, by the mode, its policy label and "
                       "why (services/dispatcher/auto_policy.py REASONS)",
                       ["service", "mode", "policy", "reason"])
AUTO_SWITCHES = Counter("tandem_auto_switches_total",
                        "mode=auto requests switched mid-stream between spec and cloud-only, "
                        "by from, to and why", ["service", "from_mode", "to_mode", "reason"])

# --- speculative decoding, in vLLM's shape ------------------------------------------------
SPEC_DRAFTS = Counter("tandem_spec_drafts_total", "Verification rounds (NAVs)",
                      ["service", "policy"])
SPEC_DRAFT_TOKENS = Counter("tandem_spec_draft_tokens_total", "Draft tokens verified",
                            ["service", "policy"])
SPEC_ACCEPTED = Counter("tandem_spec_accepted_tokens_total", "Draft tokens accepted",
                        ["service", "policy"])
SPEC_ACCEPTED_POS = Counter("tandem_spec_accepted_tokens_per_pos_total",
                            "Accepted draft tokens by position in the round (0-based, capped)",
                            ["service", "policy", "position"])
SPEC_DRAFT_LEN = Histogram("tandem_spec_draft_length", "Draft tokens per verification round",
                           ["service", "policy"], buckets=SIZE)
SPEC_BATCH_SIZE = Histogram("tandem_spec_batch_tokens", "Draft tokens per transmitted batch",
                            ["service", "policy"], buckets=SIZE)
# vLLM's spec-decode shape (accepted per round, acceptance per position) extended to trees: a
# round's draft may be a chain (depth d = position d) or a token tree (nodes at several depths).
SPEC_ACCEPTED_PER_ROUND = Histogram("tandem_spec_accepted_tokens_per_round",
                                    "Draft tokens accepted per verification round",
                                    ["service", "policy"], buckets=ROUND_COUNTS)
SPEC_DRAFT_DEPTH = Counter("tandem_spec_draft_tokens_per_depth_total",
                           "Draft tokens (tree nodes) verified, by depth in the round (0-based, "
                           "capped; a chain's depth is its position)",
                           ["service", "policy", "depth"])
SPEC_ACCEPTED_DEPTH = Counter("tandem_spec_accepted_tokens_per_depth_total",
                              "Accepted draft tokens by depth in the round (0-based, capped); "
                              "acceptance at a depth = this / tandem_spec_draft_tokens_per_depth_total",
                              ["service", "policy", "depth"])
SPEC_TREE_NODES = Histogram("tandem_spec_tree_nodes_per_round",
                            "Draft nodes sent per verification round (a chain: its draft tokens)",
                            ["service", "policy"], buckets=SIZE)
NAV_TRIGGERS = Counter("tandem_spec_nav_triggers_total", "NAV triggers by reason",
                       ["service", "policy", "reason"])
PROACTIVE = Counter("tandem_spec_proactive_tokens_total",
                    "Proactively drafted tokens, kept or discarded", ["service", "outcome"])
EARLY_REJECTS = Counter("tandem_spec_early_rejects_total",
                        "Rounds ended early by a streaming-verification mismatch", ["service"])
POLICY_PARAM = Gauge("tandem_spec_policy_parameter",
                     "Current policy parameters: r1, r2, window (N̂), alpha/beta/gamma seconds",
                     ["service", "policy", "name"])
DP_REPLANS = Counter("tandem_spec_dp_replans_total", "DP batch-plan recomputations by reason",
                     ["service", "reason"])
BO_EVALUATIONS = Counter("tandem_spec_bo_evaluations_total", "Autotuner objective evaluations",
                         ["service"])

# --- split mode ---------------------------------------------------------------------------
SPLIT_WINDOW_SIZE = Histogram("tandem_split_window_size", "Sessions per scheduling window",
                              ["service", "scheduler"], buckets=SIZE)
SPLIT_WINDOW_DEPTH = Histogram("tandem_split_window_depth_layers",
                               "Deepest minus shallowest cut in a window",
                               ["service", "scheduler"], buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
SPLIT_CALLS_PER_STEP = Histogram("tandem_split_forward_calls_per_step",
                                 "Runner calls needed for one window step",
                                 ["service", "scheduler"], buckets=SIZE)
SPLIT_IDLE_GAP = Histogram("tandem_split_idle_gap_seconds", "Idle time between suffix calls",
                           ["service", "scheduler"], buckets=LATENCY)
SPLIT_TOKENS = Counter("tandem_split_tokens_total", "Tokens produced by the suffix",
                       ["service", "scheduler", "cut"])

# --- every service ------------------------------------------------------------------------
MESSAGES = Counter("tandem_messages_total", "Wire messages handled", ["service", "type"])
ERRORS = Counter("tandem_errors_total", "Error replies and failures by stable code",
                 ["service", "code"])
FORWARD = Histogram("tandem_forward_seconds", "Model forward-call duration by phase",
                    ["service", "phase"], buckets=LATENCY)
PROMPT_CACHE = Counter("tandem_prompt_cache_tokens_total",
                       "Prompt tokens whose KV a reused context held already (hit) or that were "
                       "evaluated (miss)", ["service", "outcome"])
FORWARD_TOKENS = Histogram("tandem_forward_batch_tokens", "Tokens in one forward call",
                           ["service", "phase"], buckets=SIZE)
FORWARD_SESSIONS = Histogram("tandem_forward_batch_sessions",
                             "Sessions in one forward call (more than 1: a batched forward)",
                             ["service", "phase"], buckets=SIZE)
QUEUE_TIME = Histogram("tandem_queue_seconds", "Time a request waited before its forward call",
                       ["service"], buckets=LATENCY)
LINK_RTT = Histogram("tandem_link_rtt_seconds", "Heartbeat round trip to a peer service",
                     ["service", "peer"], buckets=LATENCY)
PEER_UP = Gauge("tandem_peer_up", "1 when the peer answered its last heartbeat",
                ["service", "peer"])
SESSIONS = Gauge("tandem_sessions", "Sessions held by a service (KV caches)", ["service"])
ORPHANS = Counter("tandem_orphaned_sessions_dropped_total",
                  "Sessions dropped because the client that opened them went silent "
                  "(no message, not even a heartbeat, for peer_idle_timeout_s)", ["service"])
HANDED_BACK = Counter("tandem_sessions_handed_back_total",
                      "Sessions a draining service (SIGTERM) handed back unfinished after drain_s; "
                      "the dispatcher replays them on another replica", ["service"])
PLACEMENTS = Counter("tandem_placements_total",
                     "Sessions placed on a cloud replica by the dispatcher (least outstanding work)",
                     ["service", "peer"])
DEGRADED_TOKENS = Counter("tandem_degraded_tokens_total",
                          "Tokens streamed by the edge drafter alone while the cloud was "
                          "unreachable (spec mode with allow_edge_only)", ["service", "mode"])
KV_BYTES = Gauge("tandem_kv_cache_bytes", "Bytes held in KV caches", ["service"])
KV_BUDGET = Gauge("tandem_kv_budget_bytes", "The KV cache byte budget (live sessions + cached "
                  "prefixes)", ["service"])
KV_CACHED = Gauge("tandem_kv_cached_bytes", "Bytes of KV kept for finished sessions' prefixes",
                  ["service"])
KV_EVICTIONS = Counter("tandem_kv_evictions_total", "Cached prefixes evicted to make room",
                       ["service"])
RSS = Gauge("tandem_process_resident_memory_bytes", "Peak resident set size of the process",
            ["service"])
UP = Gauge("tandem_up", "1 once the service is ready", ["service"])
RECOVERIES = Counter("tandem_session_recoveries_total",
                     "Sessions rebuilt by replaying their committed tokens, by what went wrong",
                     ["service", "mode", "reason"])
RECOVERY_TIME = Histogram("tandem_session_recovery_seconds",
                          "Failure detected to the first token streamed after the replay",
                          ["service", "mode"], buckets=LATENCY)


def refresh_process_metrics(service: str) -> None:
    """Called before each scrape: peak RSS from getrusage (kB on Linux)."""
    RSS.labels(service).set(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


# --- label sets a service knows at start ----------------------------------------------------
# A child created with `.labels(...)` and never touched exports 0. Declaring every label set a
# service knows when it starts means a series exists before its first event, so rate() and
# increase() count that first event (Prometheus cannot see a series born at its final value
# grow), and dashboards show 0 where nothing happened instead of no data.
OUTCOMES = ("ok", "error", "cancelled", "deadline")     # tandem_requests_total{outcome}
PROACTIVE_OUTCOMES = ("kept", "discarded")
ACCEPTED_POSITIONS = tuple(str(i) for i in range(15)) + ("15+",)
DEPTHS = ACCEPTED_POSITIONS   # the depth label's values: 0..14, then 15+


def depth_label(d: int) -> str:
    return str(d) if d < 15 else "15+"


def observe_round(service: str, policy: str, accepted: int,
                  nodes_per_depth: list[int] | tuple[int, ...]) -> None:
    """One verification round in vLLM's shape: `nodes_per_depth[d]` draft nodes were sent at
    depth d (a chain of n tokens: [1] * n; a tree: its width per level) and the target accepted
    `accepted` of them, one per depth along the accepted path (depths 0 .. accepted-1)."""
    SPEC_ACCEPTED_PER_ROUND.labels(service, policy).observe(accepted)
    SPEC_TREE_NODES.labels(service, policy).observe(sum(nodes_per_depth))
    for d, n in enumerate(nodes_per_depth):
        if n:
            SPEC_DRAFT_DEPTH.labels(service, policy, depth_label(d)).inc(n)
    for d in range(accepted):
        SPEC_ACCEPTED_DEPTH.labels(service, policy, depth_label(d)).inc()


def declare_dispatcher(service: str, policies: dict[str, list[str]]) -> None:
    """`policies`: mode -> the policy labels its requests carry (cloud-only and split requests
    carry their mode; spec requests their policy)."""
    for mode, names in policies.items():
        PROMPT_TOKENS.labels(service, mode)
        RESUMED_REQUESTS.labels(service, mode)
        ACTIVE_SESSIONS.labels(service, mode)
        for policy in names:
            GENERATED_TOKENS.labels(service, mode, policy)
            for outcome in OUTCOMES:
                REQUESTS.labels(service, mode, policy, outcome)
            for h in (TTFT, ITL, TPT, E2E):
                h.labels(service, mode, policy)
    for policy in policies.get("spec", ()):
        for c in (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED, SPEC_DRAFT_LEN, SPEC_BATCH_SIZE):
            c.labels(service, policy)
        for pos in ACCEPTED_POSITIONS:
            SPEC_ACCEPTED_POS.labels(service, policy, pos)
        for h in (SPEC_ACCEPTED_PER_ROUND, SPEC_TREE_NODES):
            h.labels(service, policy)
        for depth in DEPTHS:
            SPEC_DRAFT_DEPTH.labels(service, policy, depth)
            SPEC_ACCEPTED_DEPTH.labels(service, policy, depth)
    if "spec" in policies:
        for outcome in PROACTIVE_OUTCOMES:
            PROACTIVE.labels(service, outcome)
        BO_EVALUATIONS.labels(service)
        DEGRADED_TOKENS.labels(service, "spec")


def declare_forward(service: str, phases: tuple[str, ...], token_phases: tuple[str, ...] = ()
                    ) -> None:
    """A model service's forward-duration (and tokens-per-call) series, at 0: a burst of
    traffic shorter than one scrape would otherwise appear with its final value and show no
    rate at all."""
    for phase in phases:
        FORWARD.labels(service, phase)
    for phase in token_phases or phases:
        FORWARD_TOKENS.labels(service, phase)
        FORWARD_SESSIONS.labels(service, phase)


def declare_drafter(service: str) -> None:
    for phase in ("prefill", "draft"):
        FORWARD.labels(service, phase)
    for outcome in ("hit", "miss"):
        PROMPT_CACHE.labels(service, outcome)


def declare_kv(service: str) -> None:
    """The KV budget and prefix cache series of a service holding one (common/prefix_cache.py)."""
    KV_BYTES.labels(service)
    KV_CACHED.labels(service)
    KV_EVICTIONS.labels(service)
    for outcome in ("hit", "miss"):
        PROMPT_CACHE.labels(service, outcome)


def declare_verifier(service: str) -> None:
    EARLY_REJECTS.labels(service)
    declare_kv(service)
    declare_forward(service, ("prefill", "decode", "verify"))


def declare_suffix(service: str, scheduler: str) -> None:
    declare_kv(service)
    declare_forward(service, ("private", "shared"), ("step",))
    for h in (SPLIT_WINDOW_SIZE, SPLIT_WINDOW_DEPTH, SPLIT_CALLS_PER_STEP, SPLIT_IDLE_GAP):
        h.labels(service, scheduler)
    QUEUE_TIME.labels(service)
