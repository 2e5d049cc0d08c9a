"""The gateway's settings: field default < YAML (`--config`) < env `TANDEM_<FIELD>` /
`TANDEM_API_<FIELD>` < `--field-name`, as every service (common/config.load)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.config import API_PORT, check, default_endpoint, setting


@dataclass
class ApiConfig:
    host: str = setting("127.0.0.1", "HTTP address to listen on; loopback unless configured")
    port: int = setting(
        API_PORT, "HTTP port (the API, /metrics, /healthz, /readyz); 0 = ephemeral", ge=0, le=65535)
    dispatcher: str = setting(default_endpoint("dispatcher"), "the dispatcher's ZMQ endpoint")
    target: str = setting("bundled", "HF dir of the served model: its tokenizer and chat template")
    model: str = setting(
        "tandem", "the model id /v1/models lists; requests must name it (or the target's directory name)")
    default_mode: Literal["auto", "cloud-only", "spec", "split"] = setting(
        "auto", "mode of a request that names none; auto = the dispatcher chooses")
    default_policy: str = setting("", "spec policy of a request that names none; \"\" = the dispatcher's")
    default_cut: int = setting(0, "split cut of a request that names none; 0 = the dispatcher's", ge=0)
    default_temperature: float = setting(
        1.0, "temperature of a request that names none (OpenAI's default; 0 = greedy)", ge=0, le=2)
    default_max_tokens: int = setting(256, "max_tokens of a request that names none", ge=1)
    request_timeout_s: float = setting(300.0, "deadline of a request that names no deadline_s", gt=0)
    connect_timeout_s: float = setting(5.0, "no dispatcher connected by then: 503", gt=0)
    dispatcher_heartbeat_s: float = setting(
        1.0, "interval between pings to the dispatcher (its loss is noticed by them)", gt=0)
    dispatcher_timeout_s: float = setting(
        4.0, "the dispatcher silent this long is lost: streams in flight resume on its return",
        gt=0)
    max_resumes: int = setting(
        3, "times one stream is resumed (continued from its tokens) after a lost dispatcher; "
        "0 = a lost dispatcher ends it with 503", ge=0)
    max_body_bytes: int = setting(1024 * 1024, "larger request bodies are answered 413", ge=1)
    max_messages: int = setting(256, "chat messages per request", ge=1)
    max_prompt_tokens: int = setting(8192, "longest prompt (after the chat template), in tokens", ge=1)
    max_stop: int = setting(4, "stop strings per request (OpenAI's limit)", ge=1)
    max_constraint_bytes: int = setting(
        32 * 1024, "longest response_format schema / guided_regex, in bytes (the services' "
        "max_constraint_bytes must allow it)", ge=1)
    max_n: int = setting(16, "choices per request (`n`): each one generation on the dispatcher",
                         ge=1, le=128)
    max_top_logprobs: int = setting(
        20, "alternatives per token a request may ask for (`top_logprobs`, completions' "
        "`logprobs`)", ge=0, le=20)
    retry_after_s: int = setting(
        1, "Retry-After of a 429 whose busy service gave no estimate of its own", ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = setting(
        "info", "log verbosity")
    threads: int = setting(
        0, "unused (the gateway is one asyncio thread); accepted like every service's", ge=0)
    cpus: str = setting("", "cores to run on (applied by `tandem up`); \"\" = inherited")
    curve_server_key: str = setting("", "the dispatcher's NAME.key when it runs CURVE")
    curve_client_key: str = setting("", "this gateway's NAME.key_secret, allowlisted by the dispatcher")
    api_key: str = setting(
        "",
        "API key(s) clients must send as \"Authorization: Bearer KEY\", comma-separated (--api-key may "
        "repeat); \"\" and no keys file = open API")
    api_keys_file: str = setting(
        "",
        "file of API keys, one per line (# comments); each key is one client for the dispatcher's "
        "per-client limits")

    def __post_init__(self) -> None:
        check(self)   # ranges and choices of the fields above, however the config was made
        if not self.dispatcher_timeout_s > self.dispatcher_heartbeat_s:
            raise ValueError(f"dispatcher_timeout_s ({self.dispatcher_timeout_s}) must be over "
                             f"dispatcher_heartbeat_s ({self.dispatcher_heartbeat_s})")
