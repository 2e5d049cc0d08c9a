"""The dispatcher's settings, with one section per mode that has its own (`spec`, `split`).

A section's fields are set by their flat names everywhere outside the code: `--spec-r1`,
`TANDEM_SPEC_R1`, `spec_r1:` in YAML (or nested: `spec: {r1: 0.9}`); in the code, `cfg.spec.r1`.
"""

from dataclasses import dataclass
from typing import Literal

from common.config import ServiceConfig, default_endpoint, setting
from services.dispatcher.spec.session import POLICIES


@dataclass
class SpecConfig:
    """Speculative mode (PipeSD), services/dispatcher/spec/."""
    policy: str = setting("pipesd", f"policy of a request that names none: {' | '.join(POLICIES)}")
    lookahead: int = setting(96, "drafter may run this many tokens past the committed prefix", ge=1)
    r1: float = setting(0.90, "dual-threshold R1 (cumulative) before/without tuning", gt=0, le=1)
    r2: float = setting(0.94, "dual-threshold R2 (single token); HSL's threshold too", gt=0, le=1)
    bo: bool = setting(True, "BO autotuner moves (R1, R2) of the pipesd policies on live traffic")
    bo_window_tokens: int = setting(
        96, "accepted tokens per autotuner evaluation (longer: less prompt-to-prompt noise, "
            "slower search)", ge=1)
    max_draft: int = setting(64, "cap on draft tokens per round (every threshold policy)", ge=1)
    fixed_length: int = setting(8, "draft length N of the vanilla policy", ge=1)
    proactive_depth: int = setting(
        1, "proactive rounds in flight behind the active one (PipeSD: 1)", ge=1)
    q_width: int = setting(16, "sparse draft distribution width when sampling", ge=1, le=64)
    alpha_s: float = setting(0.002, "α seed: per-batch transmission cost before measurements",
                             ge=0)
    beta_s: float = setting(0.0002, "β seed: per-token transmission cost before measurements",
                            ge=0)
    gamma_s: float = setting(0.015, "γ seed: drafter seconds per token before measurements", ge=0)
    tree_nodes: int = setting(32, "tree policies: most nodes per round (knob m; the drafter's "
                                  "max_tree_nodes caps it)", ge=1, le=256)
    tree_depth: int = setting(16, "tree policies: most depths per round", ge=1, le=256)
    tree_width: int = setting(4, "tree policies: most children per node", ge=1, le=16)
    tree_cost_scale: float = setting(1.0, "tree policies: every node/depth cost × this before "
                                          "it is weighed against its gain (knob cs)", gt=0)
    tree_proactive: int = setting(8, "tree policies: tokens of the proactive chain drafted "
                                     "along the main path while a tree is verified; 0 = none",
                                  ge=0)
    tree_proactive_trigger: bool = setting(
        False, "tree policies: end that proactive chain at PipeSD's dual threshold (r1, r2) "
               "too, not only at tree_proactive tokens")
    tree_node_cost_s: float = setting(0.002, "tree policies: verify seconds per node before "
                                             "the verify-cost curve is measured", ge=0)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"spec_policy must be one of {', '.join(POLICIES)}; "
                             f"got {self.policy!r}")


@dataclass
class SplitConfig:
    """Split mode (DySCo), services/dispatcher/split_mode.py."""
    cut: int = setting(4, "cut of a request that names none: the edge runs layers [0, cut)", ge=1)


@dataclass
class AutoConfig:
    """mode="auto": the dispatcher chooses the mode per request, services/dispatcher/auto_mode.py."""
    tpt_slo_ms: float = setting(
        0.0, "target time per output token after the first (Stats.tpot_s) of an auto request "
             "that names none: the least cloud work meeting it is chosen; 0 = no target (the "
             "fastest mode)", ge=0)
    policies: str = setting("pipesd", "spec policies auto may choose, comma-separated")
    cuts: str = setting("", "split cuts auto may choose once measured, comma-separated; \"\" = "
                            "split_cut")
    explore_every: int = setting(
        8, "every this many auto requests, one tries a spec policy never measured yet, so it "
           "gets estimated; 0 = never", ge=0)
    ewma: float = setting(0.3, "weight of a finished request in the estimates", gt=0, le=1)
    switch_every: int = setting(
        32, "re-decide between spec and cloud-only every this many tokens of a running request "
            "(switching keeps the verifier's cache); 0 = never switch", ge=0)
    hysteresis: float = setting(
        0.2, "switch only for a gain of this fraction (time per token, or cloud work)", ge=0, lt=1)
    link_move: float = setting(
        0.5, "re-decide a running request at once when the link's round trip moves by more "
             "than this fraction (and 5 ms) since it was last judged; 0 = only every "
             "auto_switch_every tokens", ge=0)
    cloud_first: bool = setting(
        True, "a request chosen for a spec policy starts cloud-only while the drafter prefills "
              "its prompt, and switches when the drafter is ready: its first token does not wait "
              "for the drafter")

    def __post_init__(self) -> None:
        bad = [p for p in names(self.policies) if p not in POLICIES]
        if bad:
            raise ValueError(f"auto_policies: unknown spec policies {bad}; "
                             f"one of {', '.join(POLICIES)}")
        try:
            cuts = [int(c) for c in names(self.cuts)]
        except ValueError:
            raise ValueError(f"auto_cuts must be whole numbers, comma-separated; "
                             f"got {self.cuts!r}") from None
        if any(c < 1 for c in cuts):
            raise ValueError(f"auto_cuts must be >= 1; got {self.cuts!r}")


def names(csv: str) -> list[str]:
    """The items of a comma-separated setting."""
    return [x.strip() for x in csv.split(",") if x.strip()]


@dataclass
class DispatcherConfig(ServiceConfig):
    verifier: str = setting(default_endpoint("verifier"),
                            "cloud: target model (cloud-only and spec modes); comma-separated replicas, "
                            "dns+tcp://NAME:PORT = every A record (services/dispatcher/placement.py)")
    drafter: str = setting(default_endpoint("drafter"), "edge: draft model (spec mode)")
    prefix: str = setting(default_endpoint("prefix"), "edge: layers [0, c) (split mode)")
    suffix: str = setting(default_endpoint("suffix"),
                          "cloud: layers [c, L) (split mode); comma-separated replicas, "
                          "dns+tcp://NAME:PORT = every A record")
    target: str = setting("bundled", "HF dir whose tokenizer the dispatcher uses")
    default_mode: Literal["cloud-only", "spec", "split", "auto"] = setting(
        "cloud-only", "mode of a request that names none")
    max_new_tokens: int = setting(4096, "largest max_tokens a request may ask for", ge=1)
    request_timeout_s: float = setting(120.0, "a request with no deadline gets this one", gt=0)
    peer_wait_s: float = setting(10.0, "wait this long for a down peer before failing", ge=0)
    sampling_coupling: Literal["gumbel", "rejection"] = setting(
        "rejection", "sampling coupling of a request that names none: gumbel (output depends "
                     "only on seed + prompt, any mode/policy) | rejection (more drafts accepted)")
    spec: SpecConfig = setting(factory=SpecConfig, help="speculative mode")
    split: SplitConfig = setting(factory=SplitConfig, help="split mode")
    auto: AutoConfig = setting(factory=AutoConfig, help="auto mode: the dispatcher chooses")
    # --- reliability (services/dispatcher/recovery.py, recovery_policy.py) ---
    stall_s: float = setting(20.0, "a session that hears nothing this long (time left) is replayed",
                             gt=0)
    max_recoveries: int = setting(8, "replays of one request before it fails", ge=0)
    recovery_wait_s: float = setting(
        30.0, "a session that lost its cloud replica waits this long for one to come back, then "
              "fails `unavailable`; 0 = until its deadline", ge=0)
    discovery_s: float = setting(
        10.0, "re-resolve dns+tcp:// replica lists this often (services/dispatcher/placement.py)",
        gt=0)
    recovery_backoff_s: float = setting(
        0.05, "wait before the first replay; doubles with each replay (jittered)", ge=0)
    recovery_backoff_max_s: float = setting(2.0, "cap on the wait between replays", ge=0)
    replica_ban_failures: int = setting(
        3, "a replica failing this many times within replica_ban_window_s ...", ge=1)
    replica_ban_window_s: float = setting(30.0, "... (the window) ...", gt=0)
    replica_ban_s: float = setting(15.0, "... gets no new sessions for this long; 0 = never", ge=0)
    # --- per-client limits (common/security.py) ---
    client_max_sessions: int = setting(
        0, "requests one client may have in flight (busy beyond); 0 = no limit", ge=0)
    client_max_tokens: int = setting(
        0, "prompt + max_tokens one client may have in flight; 0 = no limit", ge=0)
    client_delegates: str = setting(
        "", "comma-separated NAME.key files of CURVE clients (API gateways) that may send requests "
            "for their own end clients (GenerateRequest.client)")
