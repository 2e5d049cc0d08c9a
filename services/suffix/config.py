from dataclasses import dataclass

from common.config import ServiceConfig


@dataclass
class SuffixConfig(ServiceConfig):
    target: str = "bundled"           # HF model directory of the target, or "bundled"
    dtype: str = "float32"            # compute dtype: float32 | bfloat16 | float16 (GPU)
    device: str = "cpu"               # cpu | cuda | cuda:N — weights and KV caches there (an error if torch has no such GPU)
    scheduler: str = "cascade"        # fifo | exact | interleave | dsb | cascade (DESIGN.md §4)
    window_ms: float = 8.0            # exact/dsb/cascade: longest the oldest ready step waits for its window
    max_size: int = 8                 # exact/dsb/cascade: steps per window (fifo/interleave: always 1)
    early_close: bool = False         # close a window at once when every open session's step is in it (off = the paper's timer)
    paper_padding: bool = True        # exact/dsb batch like the DySCo prototype: KV left-padded per call, split back after
