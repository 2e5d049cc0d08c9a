from dataclasses import dataclass

from common.config import ServiceConfig


@dataclass
class DrafterConfig(ServiceConfig):
    drafter: str = "bundled"        # GGUF path, "bundled" (Q4_0, realistic) or "bundled-q4_1" (near-ideal)
    n_ctx: int = 2048               # context of a session whose DraftOpen names no max_tokens
    n_batch: int = 256              # prompt tokens evaluated per llama.cpp decode call
    max_lookahead: int = 128        # one request never lets a session draft more than this past its end
    max_sessions: int = 64          # contexts held at once (each ~25 MB per 1k tokens of context)
    verbose_llama: bool = False     # let llama.cpp log to stderr
