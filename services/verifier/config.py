from dataclasses import dataclass

from common.config import ModelServiceConfig, setting


@dataclass
class VerifierConfig(ModelServiceConfig):
    max_batch_tokens: int = setting(512, "tokens in one forward call; longer prefills are chunked", ge=1)
    max_batch_sessions: int = setting(32, "sessions in one forward call", ge=1)
    stream_verify: bool = setting(True, "run the forward over draft batches as they arrive")
    max_queue_s: float = setting(
        5.0, "prompt work queued ahead of a new session, in seconds at the measured prefill rate; "
             "beyond it the session is answered busy (the dispatcher takes stall_s of silence "
             "from a session for a stall)", gt=0)
    max_tree_nodes: int = setting(
        64, "nodes in one token-tree round; a round over it is refused with too_large", ge=1)
    max_tree_depth: int = setting(
        32, "depth of one token-tree round (its longest root path); over it is too_large", ge=1)
    spec_threads: int = setting(
        0,
        "torch threads while a speculative session is open: the drafter then drafts beside us (on this "
        "machine under `tandem up`), so we keep to our share of the cores; 0 = threads", ge=0)
