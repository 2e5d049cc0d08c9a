from dataclasses import dataclass

from common.config import ModelServiceConfig, setting


@dataclass
class VerifierConfig(ModelServiceConfig):
    max_batch_tokens: int = setting(512, "tokens in one forward call; longer prefills are chunked", ge=1)
    max_batch_sessions: int = setting(32, "sessions in one forward call", ge=1)
    stream_verify: bool = setting(True, "run the forward over draft batches as they arrive")
    max_tree_nodes: int = setting(
        64, "nodes in one token-tree round; a round over it is refused with too_large", ge=1)
    max_tree_depth: int = setting(
        32, "depth of one token-tree round (its longest root path); over it is too_large", ge=1)
    spec_threads: int = setting(
        0,
        "torch threads while a speculative session is open: the drafter then drafts beside us (on this "
        "machine under `tandem up`), so we keep to our share of the cores; 0 = threads", ge=0)
    kv_budget_bytes: int = setting(
        0, "bytes of KV cache for live sessions and cached prefixes together; a session that "
        "cannot fit is refused with busy; 0 = half the memory left after the weights load", ge=0)
    prefix_cache: bool = setting(
        True, "keep finished sessions' KV (prompt + output) and reuse it for prompts that start "
        "with the same tokens (exact: only where the runner's rows do not depend on chunking)")
    kv_reserve_tokens: int = setting(
        1024, "KV rows a speculative session reserves past its prompt when its SpecOpen does not "
        "say how many tokens it may generate", ge=1)
