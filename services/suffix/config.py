from dataclasses import dataclass
from typing import Literal

from common.config import ModelServiceConfig, setting


@dataclass
class SuffixConfig(ModelServiceConfig):
    scheduler: Literal["fifo", "exact", "interleave", "dsb", "cascade"] = setting(
        "cascade", "how a window of steps at different cuts is batched (docs/design.md)")
    window_ms: float = setting(
        8.0, "exact/dsb/cascade: longest the oldest ready step waits for its window", ge=0)
    max_size: int = setting(8, "exact/dsb/cascade: steps per window (fifo/interleave: always 1)", ge=1)
    early_close: bool = setting(
        False, "close a window at once when every open session's step is in it (off = the paper's timer)")
    paper_padding: bool = setting(
        True, "exact/dsb batch like the DySCo prototype: KV left-padded per call, split back after")
