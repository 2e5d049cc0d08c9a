from dataclasses import dataclass

from common.config import ServiceConfig, default_endpoint


@dataclass
class DispatcherConfig(ServiceConfig):
    verifier: str = default_endpoint("verifier")  # cloud: target model (cloud-only and spec modes)
    drafter: str = default_endpoint("drafter")    # edge: draft model (spec mode)
    prefix: str = default_endpoint("prefix")      # edge: layers [0, c) (split mode)
    suffix: str = default_endpoint("suffix")      # cloud: layers [c, L) (split mode)
    target: str = "bundled"                       # HF dir whose tokenizer the dispatcher uses
    default_mode: str = "cloud-only"              # mode of a request that names none
    default_policy: str = "pipesd"                # spec policy of a request that names none
    default_cut: int = 4                          # split cut of a request that names none
    max_new_tokens: int = 4096                    # largest max_tokens a request may ask for
    request_timeout_s: float = 120.0              # a request with no deadline gets this one
    peer_wait_s: float = 10.0                     # wait this long for a down peer before failing
