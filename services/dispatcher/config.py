from dataclasses import dataclass

from common.config import ServiceConfig, default_endpoint


@dataclass
class DispatcherConfig(ServiceConfig):
    verifier: str = default_endpoint("verifier")  # cloud: target model (cloud-only and spec modes); comma-separated replicas, dns+tcp://NAME:PORT = every A record
    drafter: str = default_endpoint("drafter")    # edge: draft model (spec mode)
    prefix: str = default_endpoint("prefix")      # edge: layers [0, c) (split mode)
    suffix: str = default_endpoint("suffix")      # cloud: layers [c, L) (split mode); comma-separated replicas, dns+tcp://NAME:PORT = every A record
    target: str = "bundled"                       # HF dir whose tokenizer the dispatcher uses
    default_mode: str = "cloud-only"              # mode of a request that names none
    default_policy: str = "pipesd"                # spec policy of a request that names none
    default_cut: int = 4                          # split cut of a request that names none
    max_new_tokens: int = 4096                    # largest max_tokens a request may ask for
    request_timeout_s: float = 120.0              # a request with no deadline gets this one
    peer_wait_s: float = 10.0                     # wait this long for a down peer before failing
    # --- speculative mode (PipeSD), services/dispatcher/spec_mode.py ---
    spec_lookahead: int = 96                      # drafter may run this many tokens past the committed prefix
    spec_r1: float = 0.90                         # dual-threshold R1 (cumulative) before/without tuning
    spec_r2: float = 0.94                         # dual-threshold R2 (single token); HSL's threshold too
    spec_bo: bool = True                          # BO autotuner moves (R1, R2) of the pipesd policies on live traffic
    spec_bo_window_tokens: int = 96               # accepted tokens per autotuner evaluation (longer: less prompt-to-prompt noise, slower search)
    spec_max_draft: int = 64                      # cap on draft tokens per round (every threshold policy)
    spec_fixed_length: int = 8                    # draft length N of the vanilla policy
    spec_proactive_depth: int = 1                 # proactive rounds in flight behind the active one (PipeSD: 1)
    spec_q_width: int = 16                        # sparse draft distribution width when sampling (<= 64)
    spec_alpha_s: float = 0.002                   # α seed: per-batch transmission cost before measurements
    spec_beta_s: float = 0.0002                   # β seed: per-token transmission cost before measurements
    spec_gamma_s: float = 0.015                   # γ seed: drafter seconds per token before measurements
    # --- reliability (services/dispatcher/recovery.py) and per-client limits (common/security.py) ---
    stall_s: float = 20.0                         # a session that hears nothing this long (time left) is replayed
    max_recoveries: int = 8                       # replays of one request before it fails
    recovery_backoff_s: float = 0.05              # wait before the first replay; doubles each replay (jittered)
    recovery_backoff_max_s: float = 2.0           # cap on the wait between replays
    replica_ban_failures: int = 3                 # a replica failing this many sessions within replica_ban_window_s ...
    replica_ban_window_s: float = 30.0            # ... (the window) ...
    replica_ban_s: float = 15.0                   # ... gets no new sessions for this long; 0 = never banned
    recovery_wait_s: float = 30.0                 # a session that lost its cloud replica waits this long for one to come back, then fails `unavailable`; 0 = until its deadline
    discovery_s: float = 10.0                     # re-resolve dns+tcp:// replica lists this often (services/dispatcher/placement.py)
    client_max_sessions: int = 0                  # requests one client may have in flight (busy beyond); 0 = no limit
    client_max_tokens: int = 0                    # prompt + max_tokens one client may have in flight; 0 = no limit

    def __post_init__(self) -> None:
        # settings a request would otherwise trip over mid-stream: refused at start-up instead
        for name in ("spec_lookahead", "spec_max_draft", "spec_fixed_length",
                     "spec_proactive_depth", "spec_bo_window_tokens", "max_new_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= int(self.spec_q_width) <= 64:
            raise ValueError(f"spec_q_width must be in 1..64, got {self.spec_q_width}")
        if not (0 < self.spec_r1 <= 1 and 0 < self.spec_r2 <= 1):
            raise ValueError(f"spec_r1 and spec_r2 must be in (0, 1], got {self.spec_r1}, "
                             f"{self.spec_r2}")
