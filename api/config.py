"""The gateway's settings: field default < YAML (`--config`) < env `TANDEM_<FIELD>` /
`TANDEM_API_<FIELD>` < `--field-name`, as every service (common/config.load)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import API_PORT, default_endpoint


@dataclass
class ApiConfig:
    host: str = "127.0.0.1"                       # HTTP address to listen on; loopback unless configured
    port: int = API_PORT                          # HTTP port (the API, /metrics, /healthz, /readyz); 0 = ephemeral
    dispatcher: str = default_endpoint("dispatcher")  # the dispatcher's ZMQ endpoint
    target: str = "bundled"                       # HF dir of the served model: its tokenizer and chat template
    model: str = "tandem"                         # the model id /v1/models lists; requests must name it (or the target's directory name)
    default_mode: str = "cloud-only"              # mode of a request that names none: spec | split | cloud-only
    default_policy: str = ""                      # spec policy of a request that names none; "" = the dispatcher's
    default_cut: int = 0                          # split cut of a request that names none; 0 = the dispatcher's
    default_temperature: float = 1.0              # temperature of a request that names none (OpenAI's default; 0 = greedy)
    default_max_tokens: int = 256                 # max_tokens of a request that names none
    request_timeout_s: float = 300.0              # deadline of a request that names no deadline_s
    connect_timeout_s: float = 5.0                # no dispatcher connected by then: 503
    max_body_bytes: int = 1024 * 1024             # larger request bodies are answered 413
    max_messages: int = 256                       # chat messages per request
    max_prompt_tokens: int = 8192                 # longest prompt (after the chat template), in tokens
    max_stop: int = 4                             # stop strings per request (OpenAI's limit)
    retry_after_s: int = 1                        # Retry-After of a 429 (dispatcher busy)
    log_level: str = "info"                       # debug | info | warning | error
    threads: int = 0                              # unused (the gateway is one asyncio thread); accepted like every service's
    cpus: str = ""                                # cores to run on (applied by `tandem up`); "" = inherited
    curve_server_key: str = ""                    # the dispatcher's NAME.key when it runs CURVE
    curve_client_key: str = ""                    # this gateway's NAME.key_secret, allowlisted by the dispatcher
    api_key: str = ""                             # API key(s) clients must send as "Authorization: Bearer KEY", comma-separated (--api-key may repeat); "" and no keys file = open API
    api_keys_file: str = ""                       # file of API keys, one per line (# comments); each key is one client for the dispatcher's per-client limits

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages", "max_prompt_tokens", "default_max_tokens",
                     "max_stop"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
