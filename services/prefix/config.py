from dataclasses import dataclass
from typing import Literal

from common.config import ModelServiceConfig, setting


@dataclass
class PrefixConfig(ModelServiceConfig):
    c_max: int = setting(0, "layers held: [0, c_max); 0 = all but the last (L - 1)", ge=0)
    wire_dtype: Literal["auto", "float16", "bfloat16", "float32"] = setting(
        "auto", "hidden states on the wire: auto (= dtype: lossless) | float16 | bfloat16 | float32")
    max_batch_sessions: int = setting(32, "sessions advanced in one batched prefix step", ge=1)
