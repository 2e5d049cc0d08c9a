from dataclasses import dataclass

from common.config import ServiceConfig


@dataclass
class VerifierConfig(ServiceConfig):
    target: str = "bundled"           # HF model directory of the target, or "bundled"
    dtype: str = "float32"            # float32 | bfloat16 | float16 (GPU)
    device: str = "cpu"               # cpu | cuda | cuda:N — weights and KV caches there (an error if torch has no such GPU)
    max_batch_tokens: int = 512       # tokens in one forward call; longer prefills are chunked
    max_batch_sessions: int = 32      # sessions in one forward call
    stream_verify: bool = True        # run the forward over draft batches as they arrive
    spec_threads: int = 0             # torch threads while a speculative session is open: the drafter then drafts beside us (on this machine under `tandem up`), so we keep to our share of the cores; 0 = threads
