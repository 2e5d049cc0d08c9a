from dataclasses import dataclass
from typing import Literal

from common.config import ServiceConfig, setting


@dataclass
class VerifierConfig(ServiceConfig):
    target: str = setting("bundled", "HF model directory of the target, or \"bundled\"")
    dtype: Literal["float32", "bfloat16", "float16"] = setting(
        "float32", "compute dtype (float16 and bfloat16 on a GPU)")
    device: str = setting(
        "cpu", "cpu | cuda | cuda:N — weights and KV caches there (an error if torch has no such GPU)")
    max_batch_tokens: int = setting(512, "tokens in one forward call; longer prefills are chunked", ge=1)
    max_batch_sessions: int = setting(32, "sessions in one forward call", ge=1)
    stream_verify: bool = setting(True, "run the forward over draft batches as they arrive")
    spec_threads: int = setting(
        0,
        "torch threads while a speculative session is open: the drafter then drafts beside us (on this "
        "machine under `tandem up`), so we keep to our share of the cores; 0 = threads", ge=0)
