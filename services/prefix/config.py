from dataclasses import dataclass

from common.config import ServiceConfig


@dataclass
class PrefixConfig(ServiceConfig):
    target: str = "bundled"           # HF model directory of the target, or "bundled"
    dtype: str = "float32"            # compute dtype: float32 | bfloat16 | float16 (GPU)
    device: str = "cpu"               # cpu | cuda | cuda:N — weights and KV caches there (an error if torch has no such GPU)
    c_max: int = 0                    # layers held: [0, c_max); 0 = all but the last (L - 1)
    wire_dtype: str = "auto"          # hidden states on the wire: auto (= dtype: lossless) | float16 | bfloat16 | float32
    max_batch_sessions: int = 32      # sessions advanced in one batched prefix step
