from dataclasses import dataclass

from common.config import ServiceConfig, setting


@dataclass
class DrafterConfig(ServiceConfig):
    drafter: str = setting(
        "bundled", "GGUF path, \"bundled\" (Q4_0, realistic) or \"bundled-q4_1\" (near-ideal)")
    n_ctx: int = setting(2048, "context of a session whose DraftOpen names no max_tokens", ge=16)
    n_batch: int = setting(256, "prompt tokens evaluated per llama.cpp decode call", ge=1)
    max_lookahead: int = setting(
        128, "one request never lets a session draft more than this past its end", ge=1)
    context_pool: int = setting(
        4, "closed sessions' contexts kept for new ones, with the KV of the tokens they evaluated "
        "(a new session skips creating a context and evaluating what it shares: a chat's next "
        "turn, the last answer included); 0: "
        "free each at close (idle ones are held beside max_sessions' contexts, ~25 MB per 1k tokens "
        "of context each)", ge=0)
    max_sessions: int = setting(64, "contexts held at once (each ~25 MB per 1k tokens of context)", ge=1)
    max_tree_nodes: int = setting(
        64, "most nodes one token-tree round may have (DraftOpen.tree_nodes asks up to this)",
        ge=1, le=256)
    verbose_llama: bool = setting(False, "let llama.cpp log to stderr")
