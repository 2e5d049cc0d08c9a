"""Tandem's wire protocol (DESIGN.md §2).

A message is one msgpack header frame followed by zero or more raw buffer frames:

    [routing-id]   (ROUTER side only, added/stripped by ZMQ)
    header         msgpack map: {"v": 1, "type": "...", "sid": "...", "seq": n, "rid": n, ...}
    buffer*        raw tensor bytes, referenced from the header as {"dtype", "shape", "frame"}

Headers are msgspec `Struct`s tagged by `type`, so decoding is typed and validated in one step;
any msgpack client can speak the protocol (the tests decode everything with msgpack-python).
Tensors never travel as lists of floats and nothing is ever pickled.

Decoding never raises anything but `ProtocolError`, which carries a stable `code` that the service
sends back in an `Error` message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import msgspec
import numpy as np

from common.errors import TandemError

VERSION = 1

# ---------------------------------------------------------------------------------------------
# Stable error codes: clients switch on these, so they never change meaning.
BAD_FRAME = "bad_frame"              # not a msgpack header / missing frames
BAD_VERSION = "bad_version"          # protocol version we do not speak
UNKNOWN_TYPE = "unknown_type"        # message type we do not know
BAD_FIELD = "bad_field"              # a field of the wrong type or out of range
TOO_LARGE = "too_large"              # a frame, header, frame count, prompt or token list over a limit
BAD_TENSOR = "bad_tensor"            # dtype/shape disagree with the bytes, or unsupported dtype
UNKNOWN_SESSION = "unknown_session"  # no such session (never opened, closed, or evicted)
UNKNOWN_ROUND = "unknown_round"      # spec mode: a batch or NAV for a round the session never had
SESSION_EXISTS = "session_exists"    # open for a session id already in use
BUSY = "busy"                        # admission control: over capacity, try later
DEADLINE = "deadline"                # the request's deadline passed
CANCELLED = "cancelled"              # the client cancelled the request
UNAVAILABLE = "unavailable"          # a peer service is down or unreachable
WRONG_SERVICE = "wrong_service"      # a valid message sent to a service that doesn't serve it
INTERNAL = "internal"                # a bug: logged with a traceback on the service
CONSTRAINT = "constraint"            # the output constraint leaves no allowed token: the request ends

ERROR_CODES = (BAD_FRAME, BAD_VERSION, UNKNOWN_TYPE, BAD_FIELD, TOO_LARGE, BAD_TENSOR,
               UNKNOWN_SESSION, UNKNOWN_ROUND, SESSION_EXISTS, BUSY, DEADLINE, CANCELLED, UNAVAILABLE,
               WRONG_SERVICE, INTERNAL, CONSTRAINT)


class ProtocolError(TandemError):
    """A request the receiver refuses; `field` travels in `Error.field`."""


@dataclass
class Limits:
    """Hard limits on what a peer may send. All are configuration (see common/config.py)."""
    max_header_bytes: int = 64 * 1024        # a header is small: ids, scalars, tensor refs
    max_frame_bytes: int = 64 * 1024 * 1024  # one tensor frame (a 4k-token prefill hidden state is 4.7 MB fp16)
    max_frames: int = 8                      # header + tensor frames in one message
    max_tokens: int = 4096                   # token ids in one message (prompts, drafts)
    max_prompt_tokens: int = 8192            # prompt length a session may open with
    max_constraint_bytes: int = 32 * 1024    # an output constraint's text (a JSON schema, a regex)


# ---------------------------------------------------------------------------------------------
# Value rules, in the types: every message is checked against them while it is decoded, so no
# service can forget one. Floats have two finite bounds (a NaN fails every comparison and an
# infinity the upper one, so both are refused); integers stay in the range msgpack and torch
# can hold. What depends on the receiver (the vocabulary size, max_new_tokens, the model's
# layer count) is checked where it is known, at admission.
INT64_MAX = 2**63 - 1
MAX_TEMPERATURE = 100.0      # far past the point where the distribution is flat to fp32
MAX_SECONDS = 1e6            # ~11.6 days: deadlines, durations, clock readings in seconds
MAX_ID = 2**31 - 1           # token ids, sizes, positions: int32 is what every runtime indexes with

Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]        # seq, rid, round numbers
Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]            # positions, lengths, cuts
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]         # < vocabulary size: at admission
Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
Clock = Annotated[float, msgspec.Meta(ge=-1e12, le=1e12)]       # a sender's monotonic clock
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Threshold = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]      # PipeSD's R1, R2
Seed = Annotated[int, msgspec.Meta(ge=-2**63, le=INT64_MAX)]
Entropy = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]      # nats (ln of a vocabulary < 100)
MAX_TOP_LOGPROBS = 20        # alternatives per token a request may ask for (OpenAI's limit)
LOGPROB_FLOOR = -9999.0      # log-probabilities are clamped here (OpenAI's value for "never")
LogProb = Annotated[float, msgspec.Meta(ge=LOGPROB_FLOOR, le=0.0)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]


# ---------------------------------------------------------------------------------------------
# Tensors travel by reference: the header says where and what, the bytes are a raw frame.

DTYPES = ("float16", "bfloat16", "float32", "int32", "int64")
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, "int64": 8}


class TensorRef(msgspec.Struct, array_like=False):
    dtype: str
    shape: Annotated[list[Size], msgspec.Meta(max_length=4)]
    frame: Size  # index into the buffer frames that follow the header (0 = first after header)


class Sampling(msgspec.Struct, omit_defaults=True):
    """How the next token is chosen. temperature 0 = greedy (argmax)."""
    temperature: Temperature = 0.0
    top_k: Size = 0       # 0 = off; <= the vocabulary size (checked where the model is known)
    top_p: TopP = 1.0     # 1 = off
    seed: Seed | None = None
    # how draft and target randomness are coupled when sampling (common/sampling.py): "gumbel"
    # (Gumbel-max keyed by (seed, position): the output depends only on the seed and the prompt,
    # whatever the mode, policy or link did) or "rejection" (speculative sampling: more drafts
    # accepted); None = the dispatcher's `sampling_coupling` setting
    coupling: Literal["gumbel", "rejection"] | None = None


def check_sampling(s: Sampling, vocab_size: int) -> None:
    """The sampling rule that depends on the model (the types hold the others)."""
    if s.top_k > vocab_size:
        raise ProtocolError(BAD_FIELD, f"sampling.top_k: {s.top_k} is over the vocabulary size "
                                       f"{vocab_size}", field="sampling.top_k")


class TokenLogprob(msgspec.Struct):
    """The target's log-probability of one emitted token and its `top` most likely alternatives,
    from the unmodified distribution: log_softmax of the logits, before temperature, top-k and
    top-p (vLLM's default "raw logprobs"). top_ids are in descending order of top_logprobs."""
    logprob: LogProb
    top_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)] = \
        msgspec.field(default_factory=list)
    top_logprobs: Annotated[list[LogProb], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)] = \
        msgspec.field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Messages. Every message has v (version), sid (session id), seq (per-session sequence number,
# the idempotency key for retries) and rid (request id, matches replies to requests on a
# connection). Replies and stream events echo the request's rid.

class Msg(msgspec.Struct, tag_field="type", kw_only=True):
    v: int = VERSION
    sid: Annotated[str, msgspec.Meta(max_length=256)] = ""
    seq: Count = 0
    rid: Count = 0


# --- every service --------------------------------------------------------------------------
class Ping(Msg, tag="ping"):
    t: Clock = 0.0           # sender's clock, echoed back for RTT


class Pong(Msg, tag="pong"):
    t: Clock = 0.0
    service: str = ""
    ready: bool = True
    # the replica's load, for placement across replicas (services/dispatcher/placement.py)
    sessions: Count = 0        # sessions it holds
    queued_tokens: Count = 0   # tokens waiting for a forward (prefills, drafts, steps)
    kv_bytes: Count = 0        # bytes of KV cache held
    admitting: bool = True     # False while draining (SIGTERM): it opens no new session
    # this run of the service (random per process start): a client that sees it change knows its
    # requests in flight died with the previous run (the SDK resumes them, tandem/link.py)
    instance: Annotated[str, msgspec.Meta(max_length=64)] = ""
    prefix_cache: bool = False   # it keeps finished sessions' KV rows for reuse (split mode asks)


class Error(Msg, tag="error"):
    code: str
    message: str
    field: str = ""          # the offending field (dotted path) of a bad_field / too_large error
    # busy: the sender's estimate of when a retry can be admitted (seconds); 0 = no estimate
    retry_after_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.0


class Ack(Msg, tag="ack"):
    cached_tokens: Size = 0
    # ^ a SpecOpen's Ack: prompt tokens whose KV the prefix cache held; a SuffixOpen's Ack (in
    #   place of its SuffixToken): the suffix holds only this many of the `start` rows the open
    #   asked it to reuse, and opened nothing (split mode, below)


class Close(Msg, tag="close"):
    """Drop a session's state (KV cache, drafter context). Idempotent."""


# --- client <-> dispatcher ------------------------------------------------------------------
class ChatMessage(msgspec.Struct):
    """One turn of a conversation (GenerateRequest.messages); common/chat.py renders it."""
    role: Literal["system", "developer", "user", "assistant"]
    content: str


class Constraint(msgspec.Struct, forbid_unknown_fields=True):
    """An output constraint (common/constraint.py): the output is a JSON object
    ("json_object", no value), an instance of a JSON schema ("json_schema", value: the schema
    as JSON text) or a match of a regular expression ("regex", value: the pattern). Its size is
    limited by max_constraint_bytes; the services compile it with their tokenizer."""
    kind: Literal["json_object", "json_schema", "regex"]
    value: str = ""


class GenerateRequest(Msg, tag="generate"):
    prompt: str = ""
    token_ids: list[TokenId] | None = None   # pre-tokenised prompt instead of `prompt`
    chat: bool = False                   # apply the model's chat template to `prompt`
    mode: str = "cloud-only"             # "auto" | "spec" | "split" | "cloud-only"
    policy: str = ""                     # spec policy; "" = the dispatcher's default
    cut: Size = 0                        # split cut layer; 0 = the dispatcher's default
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_ID)] = 64
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    stop_at_eos: bool = True
    deadline_s: Seconds = 0.0            # wall-clock budget for the whole request; 0 = none
    allow_edge_only: bool = False        # spec mode: continue on the drafter alone if the cloud is gone
    nav_thresholds: Annotated[list[Threshold], msgspec.Meta(min_length=2, max_length=2)] | None = None
    # ^ spec mode: fixed [R1, R2] for this request, the autotuner neither used nor fed (tuning
    #   benchmarks)
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=1024)] | None = None
    # ^ a conversation instead of `prompt`, through the target's chat template (common/chat.py)
    client: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # ^ the end client a gateway sends this request for (an API key's identity): the dispatcher's
    #   per-client limits count it as "<sender>/<client>" (common/security.client_id)
    policy_knobs: Annotated[dict[str, Annotated[float, msgspec.Meta(gt=0.0, le=1024.0)]],
                            msgspec.Meta(max_length=4)] | None = None
    # ^ spec mode: this request's policy held at these knob values, the autotuner neither used nor
    #   fed (tuning every policy alike in benchmarks): "n" vanilla's draft length, "r1"/"r2" the
    #   pipesd/HSL/EdgeLLM thresholds, "c" EdgeLLM's constant; POLICY_KNOBS
    #   (services/dispatcher/spec/mode.py) lists them
    logprobs: TopLogprobs | None = None
    # ^ send each token's TokenLogprob with this many alternatives; None = none (nothing computed)
    constraint: Constraint | None = None   # the output is constrained (every mode, exactly)
    tpt_slo_ms: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS * 1000)] = 0.0
    # ^ auto mode: a target time per output token after the first (Stats.tpot_s) in
    #   milliseconds; the dispatcher then chooses the mode
    #   with the least cloud work that meets it (services/dispatcher/auto_policy.py); 0 = the
    #   dispatcher's auto_tpt_slo_ms
    resume_ids: list[TokenId] | None = None
    # ^ a continuation: the tokens this request already delivered (its dispatcher was lost
    #   mid-stream). The dispatcher continues after prompt + resume_ids at the same absolute
    #   positions, so draws keyed by (seed, position) are the uninterrupted run's; max_tokens
    #   stays the request's total and TokenEvent indices continue from len(resume_ids)


class Cancel(Msg, tag="cancel"):
    pass


class TokenEvent(Msg, tag="tokens"):
    """Tokens appended to the client's stream; `index` is the position of the first one."""
    index: Size
    token_ids: list[TokenId]
    text: str = ""
    degraded: bool = False   # produced by the edge drafter alone (cloud unreachable)
    logprobs: list[TokenLogprob] | None = None   # one per token when the request asked for them


class Done(Msg, tag="done"):
    finish_reason: str           # "length" | "eos" | "cancelled"
    stats: dict[str, Any] = msgspec.field(default_factory=dict)


# --- dispatcher <-> verifier: cloud-only generation ------------------------------------------
class CloudGenerate(Msg, tag="cloud_generate"):
    """Prefill `token_ids`, then decode up to `max_tokens` autoregressively, streaming tokens."""
    token_ids: list[TokenId]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_ID)]
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    eos_token_id: TokenId | None = None
    logprobs: TopLogprobs | None = None   # send each token's TokenLogprob; None = none
    constraint: Constraint | None = None
    # ^ the output (the tokens past constrained_from) is constrained: every token is chosen from
    #   the masked logits (common/constraint.py)
    constrained_from: Size | None = None   # where the output starts in token_ids; None = its end
    adopt: Annotated[str, msgspec.Meta(max_length=256)] = ""
    # ^ ADOPT (below): a session of this sender whose KV cache this one takes over


# ADOPT. A cloud-only or speculative open may name, in `adopt`, another session of the same
# sender on this verifier (of either kind) whose KV cache holds a prefix of `token_ids`: that
# session ends and the new one takes its cache, keeping the cached tokens up to the last one or
# two of `token_ids` and prefilling only the rest. The dispatcher switches a request between
# speculative and cloud-only so (mode="auto"), without prefilling it again; `token_ids` then has
# at least two tokens.


class CloudTokens(Msg, tag="cloud_tokens"):
    index: Size
    token_ids: list[TokenId]
    done: bool = False
    finish_reason: str = ""
    logprobs: list[TokenLogprob] | None = None   # one per token, when CloudGenerate asked
    cached_tokens: Size = 0   # prompt tokens whose KV the prefix cache held (on index 0)


# --- dispatcher <-> verifier: speculative mode ----------------------------------------------
class SpecOpen(Msg, tag="spec_open"):
    """Prefill the prompt; the reply is an Ack once the KV cache holds it. `stream` asks for
    streaming verification (forward over each batch as it arrives, early reject); the
    verifier's `stream_verify` setting must allow it."""
    token_ids: list[TokenId]
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    stream: bool = False
    logprobs: TopLogprobs | None = None   # every VerifyResult carries its tokens' TokenLogprobs
    constraint: Constraint | None = None
    # ^ the output (the tokens past constrained_from) is constrained: every token is chosen from
    #   the masked logits (common/constraint.py)
    constrained_from: Size | None = None   # where the output starts in token_ids; None = its end
    adopt: Annotated[str, msgspec.Meta(max_length=256)] = ""   # see ADOPT above
    max_tokens: Size = 0   # tokens the request may generate, for the KV reservation (0: unknown)


class DraftBatch(Msg, tag="draft_batch"):
    """A batch of draft tokens of round `round`, starting at absolute position `start`.

    `probs` is each token's draft probability. When sampling, `q_ids`/`q_probs` carry each
    token's sparse (top-k truncated) draft distribution as tensor refs of shape [n, k].
    `parent` > 0 marks proactive tokens drafted while round `parent` was being verified.

    A *tree round* (`parents` set) carries nodes numbered 0..N-1 within the round in topological
    order; this batch holds nodes first_node .. first_node + len(token_ids) - 1 (a round's
    batches arrive in order and contiguous, all with the round's first position as `start`).
    parents[i] is the round-global index of node first_node + i's parent, -1 for a child of the
    round's root (the session's last committed token); parents[i] < first_node + i. A node sits
    at position start + depth; siblings carry distinct tokens; the *main path* (from the root,
    always the lowest-index child) is the drafter's own chain. probs[i] / q rows are node i's.
    """
    round: Count
    start: Size
    token_ids: list[TokenId]
    probs: list[Probability] = msgspec.field(default_factory=list)
    q_ids: TensorRef | None = None
    q_probs: TensorRef | None = None
    parent: Count = 0
    parents: list[Annotated[int, msgspec.Meta(ge=-1, le=MAX_ID)]] | None = None  # None = a chain
    first_node: Size = 0     # tree round: the round-global index of this batch's first node


class VerifyRequest(Msg, tag="verify"):
    """NAV: verify every draft token of `round` up to absolute position `end` (exclusive); for
    a tree round, every node in [0, nodes) (`end` is then ignored)."""
    round: Count
    end: Size
    nodes: Size = 0          # tree round: the node count to verify; 0 = a chain round


class VerifyResult(Msg, tag="verify_result"):
    """`accepted` draft tokens of the round were accepted; `token` is the target's next token
    (a correction, or the bonus token after full acceptance). `early` = sent before the NAV
    request, because streaming verification already found a mismatch. For a tree round `path`
    holds the accepted root path's node indices (len == accepted) and `token` is the target's
    token at position start + accepted."""
    round: Count
    start: Size
    accepted: Size
    token: TokenId
    early: bool = False
    forwards: Count = 0    # forward passes that included this session so far (prefill included)
    path: list[Size] = msgspec.field(default_factory=list)   # tree round: accepted node indices
    logprobs: list[TokenLogprob] | None = None
    # ^ when SpecOpen asked: one per committed token, the accepted drafts then `token`


# --- dispatcher <-> drafter -----------------------------------------------------------------
class DraftOpen(Msg, tag="draft_open"):
    """Prefill the prompt; the reply is an Ack once the drafter's context holds it."""
    token_ids: list[TokenId]
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    top_k: Annotated[int, msgspec.Meta(ge=1, le=64)] = 16  # sparse q width when sampling
    max_tokens: Size = 0          # positions past the prompt the session may reach (sizes its context);
    #                               0 = the drafter's default
    features: bool = False        # send each token's entropy and top-2 margin (pipesd-learned)
    tree_nodes: Annotated[int, msgspec.Meta(ge=0, le=256)] = 0
    # ^ token trees: the most nodes one tree round of this session may have (sizes the context's
    #   extra KV cells and sequences); 0 = chains only
    constraint: Constraint | None = None
    # ^ the output (the tokens past constrained_from) is constrained: every token is chosen from
    #   the masked logits (common/constraint.py)
    constrained_from: Size | None = None   # where the output starts in token_ids; None = its end


class TreeRequest(msgspec.Struct, omit_defaults=True):
    """The shape rule of one token-tree round (common/tree_shape.py). The drafter grows the tree
    best-first by estimated path-acceptance probability P (the product over the path of
    q(node) × accept_scale[depth][rank]) and adds a node only while P × token_value_s >=
    node_cost_s[n] (n = nodes so far) + depth_cost_s for a node opening a new depth, else
    + width_cost_s; within max_nodes, max_depth and max_width children per node."""
    max_nodes: Annotated[int, msgspec.Meta(ge=1, le=256)]
    max_depth: Annotated[int, msgspec.Meta(ge=1, le=256)]
    max_width: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    token_value_s: Seconds = 0.0        # what one more accepted token saves (the TPT)
    node_cost_s: Annotated[list[Seconds], msgspec.Meta(max_length=256)] = \
        msgspec.field(default_factory=list)   # marginal verify cost of node n+1; last repeats
    depth_cost_s: Seconds = 0.0         # one more drafter decode (a new depth)
    width_cost_s: Seconds = 0.0         # one more node in a depth that is decoded anyway
    accept_scale: Annotated[list[Annotated[float, msgspec.Meta(ge=0.0, le=16.0)]],
                            msgspec.Meta(max_length=256)] = msgspec.field(default_factory=list)
    # ^ row-major [depth][rank] (rows of max_width; missing entries = 1): measured acceptance over
    #   q at that depth and sibling rank, the calibration of q as an acceptance estimate


class DraftRequest(Msg, tag="draft"):
    """Draft `n` more tokens after the current end of the session's context, or, with `until`
    > 0, keep drafting until the context holds `until` tokens (absolute; pauses there). Tokens
    stream back one DraftTokens message each, tagged with `seq` = the drafter epoch (the seq of
    the last DraftRollback), so the dispatcher can drop tokens drafted before a rollback.

    With `tree`: draft one token-tree round rooted at the current end of the context (its
    nodes stream back one DraftTokens per depth, with `parents`; the last has `tree_done`),
    then go on as a chain along the tree's main path up to `until` (proactive drafting)."""
    n: Size = 0
    until: Size = 0
    tree: TreeRequest | None = None


class DraftTokens(Msg, tag="draft_tokens"):
    """Drafted tokens at positions start, start+1, ... (a chain), or, with `parents`, nodes
    first_node, first_node+1, ... of a tree round whose root children sit at `start`
    (DESIGN.md §3's tree format: parents[i] = -1 for a root child, else a round-global index
    < first_node + i). q_ids/q_probs row i = the sparse q node i was drawn from."""
    start: Size
    token_ids: list[TokenId]
    probs: list[Probability]
    seconds: Seconds = 0.0    # drafter compute time for these tokens (γ estimation)
    q_ids: TensorRef | None = None
    q_probs: TensorRef | None = None
    parents: list[Annotated[int, msgspec.Meta(ge=-1, le=MAX_ID)]] | None = None
    first_node: Size = 0
    tree_done: bool = False   # the tree round's last message (it may carry no node)
    rows: Size = 0            # tree rounds: rows of the one batched decode `seconds` timed (the
    #                           dispatcher's drafter-cost curve); 0 = not one decode
    # per token, when DraftOpen asked for features: entropy (nats) and top-1 minus top-2
    # probability of the drafter's distribution at that position
    entropies: list[Entropy] | None = None
    margins: list[Probability] | None = None


class DraftRollback(Msg, tag="draft_rollback"):
    """Keep the first `keep` tokens of the context, then append `append` (the target's token).
    `seq` is the new drafter epoch (strictly increasing; a repeated seq is a no-op retry);
    `until` > 0 then continues drafting up to that absolute length (as DraftRequest.until)."""
    keep: Size
    append: list[TokenId] = msgspec.field(default_factory=list)
    until: Size = 0
    path: list[Size] = msgspec.field(default_factory=list)
    # ^ after a tree round: its accepted node indices, root to leaf; the context's tokens from
    #   the round's start become that path's (then keep/append apply as for a chain)


# --- dispatcher <-> prefix / suffix: split mode ---------------------------------------------
# Prefix caching. The prefix and the suffix each keep finished sessions' rows (common/
# prefix_cache.py) and the edge decides how many a new session reuses: the prefix reuses the
# longest cached prefix of its prompt (at most `max_cached` rows) and sends the hidden states of
# the rest only (`Hidden.start` = the rows it reused). The SuffixOpen then asks the suffix to reuse
# exactly `start` rows of its own cache for that cut, fed by that prefix (`source`), and prefill
# the hidden states that follow. A suffix holding fewer answers Ack(cached_tokens=its rows) and
# opens nothing; the dispatcher then reopens the prefix session with max_cached = that many and
# opens the suffix again. Both sides so reuse the same rows and compute the same rest.


class PrefixOpen(Msg, tag="prefix_open"):
    cut: Annotated[int, msgspec.Meta(ge=1, le=MAX_ID)]
    token_ids: list[TokenId]
    max_tokens: Size = 0   # tokens the session may generate, for the KV reservation (0: unknown)
    max_cached: Size | None = None   # most cached rows to reuse; None = all the cache holds


class PrefixStep(Msg, tag="prefix_step"):
    token_id: TokenId


class Hidden(Msg, tag="hidden"):
    """Cut-layer hidden states [n, hidden] for tokens at positions start .. start+n-1."""
    cut: Size
    start: Size
    hidden: TensorRef
    seconds: Seconds = 0.0  # edge compute time of the step that produced it (latency breakdown)
    source: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # ^ the prefix process that computed it (its instance): what the suffix's cached rows of it
    #   are keyed by


class SuffixOpen(Msg, tag="suffix_open"):
    """`hidden` holds the prompt's cut-layer states from position `start` on; the suffix's prefix
    cache holds the first `start` rows (see Prefix caching above). `token_ids`: the whole prompt,
    what cached rows are matched and kept by; without it nothing is cached and `start` is 0."""
    cut: Annotated[int, msgspec.Meta(ge=1, le=MAX_ID)]
    start: Size
    hidden: TensorRef
    token_ids: list[TokenId] = msgspec.field(default_factory=list)
    max_tokens: Size = 0   # tokens the session may generate, for the KV reservation (0: unknown)
    source: Annotated[str, msgspec.Meta(max_length=64)] = ""   # Hidden.source of `hidden`
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    logprobs: TopLogprobs | None = None   # every SuffixToken carries its TokenLogprob
    constraint: Constraint | None = None   # the output is constrained (common/constraint.py)
    output: list[TokenId] = msgspec.field(default_factory=list)
    # ^ with a constraint: the output tokens the session starts after (a replay's), which the
    #   constraint's state advances over


class SuffixStep(Msg, tag="suffix_step"):
    start: Size
    hidden: TensorRef


class SuffixToken(Msg, tag="suffix_token"):
    position: Size     # absolute position the token is generated for
    token: TokenId
    seconds: Seconds = 0.0  # cloud compute time of the window step that produced it
    queued: Seconds = 0.0    # time the hidden state waited in the suffix before that step
    logprob: TokenLogprob | None = None   # when SuffixOpen asked


MESSAGE_TYPES = (Ping, Pong, Error, Ack, Close, GenerateRequest, Cancel, TokenEvent, Done,
                 CloudGenerate, CloudTokens, SpecOpen, DraftBatch, VerifyRequest, VerifyResult,
                 DraftOpen, DraftRequest, DraftTokens, DraftRollback, PrefixOpen, PrefixStep,
                 Hidden, SuffixOpen, SuffixStep, SuffixToken)
AnyMsg = Union[MESSAGE_TYPES]  # type: ignore[valid-type]
TYPE_NAMES = frozenset(t.__struct_config__.tag for t in MESSAGE_TYPES)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMsg)
_probe = msgspec.msgpack.Decoder(dict)


# ---------------------------------------------------------------------------------------------
def encode(msg: Msg, buffers: list | tuple = ()) -> list:
    """Header + raw buffers, ready for `socket.send_multipart`."""
    return [_encoder.encode(msg), *buffers]


def tensor_frame(array, frame: int) -> tuple[TensorRef, memoryview]:
    """Describe a numpy array or torch tensor as a TensorRef and give its bytes (zero-copy).

    bfloat16 torch tensors travel as their raw 2-byte pattern."""
    if hasattr(array, "detach"):  # torch.Tensor, without importing torch here
        t = array.detach().contiguous().cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ProtocolError(BAD_TENSOR, f"dtype {dtype} cannot travel")
        shape = list(t.shape)
        import torch
        raw = t.view(torch.int16) if dtype == "bfloat16" else t
        data = memoryview(raw.numpy()).cast("B")
        return TensorRef(dtype=dtype, shape=shape, frame=frame), data
    arr = np.ascontiguousarray(array)
    dtype = str(arr.dtype)
    if dtype not in DTYPES:
        raise ProtocolError(BAD_TENSOR, f"dtype {dtype} cannot travel")
    return TensorRef(dtype=dtype, shape=list(arr.shape), frame=frame), memoryview(arr).cast("B")


def decode(frames: list, limits: Limits) -> Msg:
    """Validate and decode a message (header + buffers, routing id already stripped).

    Raises ProtocolError with a stable code on anything malformed."""
    if not frames:
        raise ProtocolError(BAD_FRAME, "empty message")
    if len(frames) > limits.max_frames:
        raise ProtocolError(TOO_LARGE, f"{len(frames)} frames > limit {limits.max_frames}")
    header = frames[0]
    hbytes = header.bytes if hasattr(header, "bytes") else header
    if len(hbytes) > limits.max_header_bytes:
        raise ProtocolError(TOO_LARGE, header_too_large(len(hbytes), limits), field="header")
    for f in frames[1:]:
        n = len(f.buffer) if hasattr(f, "buffer") else len(f)
        if n > limits.max_frame_bytes:
            raise ProtocolError(TOO_LARGE, f"frame of {n} bytes > limit {limits.max_frame_bytes}")
    try:
        msg = _decoder.decode(hbytes)
    except msgspec.ValidationError as e:
        raise _classify(hbytes, e) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(BAD_FRAME, f"header is not valid msgpack: {e}") from None
    if msg.v != VERSION:
        raise ProtocolError(BAD_VERSION, f"protocol version {msg.v} not supported (speak {VERSION})")
    _check_sizes(msg, limits)
    for ref in _tensor_refs(msg):
        _check_tensor(ref, frames)
    return msg


def header_too_large(n: int, limits: Limits) -> str:
    """In the user's terms: the header is where a prompt's text travels."""
    return (f"request of {n / 1000:.1f} kB is over this service's limit of "
            f"{limits.max_header_bytes / 1000:.1f} kB (max_header_bytes). A request carries its "
            f"prompt text (or token ids) in that header, so prompts are limited to about "
            f"{limits.max_header_bytes // 1000} kB of text and to max_prompt_tokens = "
            f"{limits.max_prompt_tokens} tokens. To allow longer prompts raise both on every "
            f"service (TANDEM_MAX_HEADER_BYTES, TANDEM_MAX_PROMPT_TOKENS, or --max-header-bytes"
            f" / --max-prompt-tokens), up to the model's context length.")


def _classify(hbytes: bytes, err: Exception) -> ProtocolError:
    """Turn a msgspec validation failure into the most specific stable code."""
    try:
        raw = _probe.decode(hbytes)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ProtocolError(BAD_FRAME, "header is not a msgpack map")
    if raw.get("v", VERSION) != VERSION:
        return ProtocolError(BAD_VERSION,
                             f"protocol version {raw.get('v')!r} not supported (speak {VERSION})")
    if "type" not in raw:
        return ProtocolError(BAD_FIELD, "header has no `type`")
    if not isinstance(raw["type"], str) or raw["type"] not in TYPE_NAMES:
        return ProtocolError(UNKNOWN_TYPE, f"unknown message type {str(raw['type'])[:64]!r}")
    return field_error(err)


def field_error(err: Exception) -> ProtocolError:
    """A msgspec ValidationError as `bad_field` naming the field: "Expected `float` <= 100.0 -
    at `$.sampling.temperature`" -> field "sampling.temperature", message "sampling.temperature:
    expected a finite `float` <= 100.0". A bad tensor reference is `bad_tensor`."""
    text = str(err)
    what, sep, where = text.rpartition(" - at `$")
    if not sep:
        return ProtocolError(BAD_FIELD, text)
    path = where.rstrip("`").lstrip(".")
    what = what[0].lower() + what[1:] if what else "invalid"
    if "float" in what and ("<" in what or ">" in what):
        what = what.replace("`float`", "a finite `float`")   # NaN and inf fail these bounds too
    code = BAD_TENSOR if path.split(".")[0] in TENSOR_FIELDS else BAD_FIELD
    return ProtocolError(code, f"{path}: {what}", field=path)


def check(msg: Msg) -> Msg:
    """Apply the decoder's rules to a message built in Python (the SDK checks its requests
    before they leave, so a bad argument is refused at once, naming the argument): raises
    ProtocolError, returns the message unchanged."""
    try:
        _decoder.decode(_encoder.encode(msg))
    except msgspec.ValidationError as e:
        raise field_error(e) from None
    except (TypeError, OverflowError) as e:   # not encodable at all (an int over 64 bits, ...)
        raise ProtocolError(BAD_FIELD, str(e)) from None
    return msg


def _check_sizes(msg: Msg, limits: Limits) -> None:
    c = getattr(msg, "constraint", None)
    if c is not None and len(c.value) > limits.max_constraint_bytes:
        raise ProtocolError(TOO_LARGE, f"constraint of {len(c.value)} characters > limit "
                            f"{limits.max_constraint_bytes} (max_constraint_bytes)",
                            field="constraint")
    for name in ("token_ids", "probs", "append", "entropies", "margins", "output", "resume_ids"):
        value = getattr(msg, name, None)
        if value is not None and len(value) > limits.max_tokens:
            raise ProtocolError(TOO_LARGE,
                                f"{name} has {len(value)} entries > limit {limits.max_tokens} "
                                f"(max_tokens)", field=name)
    for name in ("parents", "path"):      # token trees: one entry per node
        value = getattr(msg, name, None)
        if value is not None and len(value) > limits.max_tokens:
            raise ProtocolError(TOO_LARGE,
                                f"{name} has {len(value)} entries > limit {limits.max_tokens} "
                                f"(max_tokens)", field=name)
    rows = getattr(msg, "rows", 0)   # DraftTokens: the decoded depth came in one message
    if rows > limits.max_tokens:
        raise ProtocolError(TOO_LARGE, f"rows = {rows} > limit {limits.max_tokens} (max_tokens)",
                            field="rows")
    logprobs = getattr(msg, "logprobs", None)
    if isinstance(logprobs, list):   # one per token: TokenEvent, CloudTokens, VerifyResult
        tokens = len(msg.token_ids) if hasattr(msg, "token_ids") else msg.accepted + 1
        if len(logprobs) != tokens:
            raise ProtocolError(BAD_FIELD, f"logprobs has {len(logprobs)} entries for {tokens} "
                                           f"tokens", field="logprobs")
    for i, lp in enumerate(logprobs if isinstance(logprobs, list) else
                           [getattr(msg, "logprob", None)]):
        if lp is not None and len(lp.top_ids) != len(lp.top_logprobs):
            raise ProtocolError(BAD_FIELD, f"logprobs[{i}]: {len(lp.top_ids)} top_ids, "
                                           f"{len(lp.top_logprobs)} top_logprobs",
                                field="logprobs")
    parents = getattr(msg, "parents", None)
    if parents is not None and hasattr(msg, "token_ids"):   # DraftBatch, DraftTokens
        check_parents(parents, msg.token_ids, getattr(msg, "first_node", 0))


def check_parents(parents: list[int], token_ids: list[int], first_node: int) -> None:
    """The tree rules a batch shows by itself (DraftBatch / DraftTokens): one parent per node,
    each parent the root (-1) or an earlier node. What needs the round (first_node continuity,
    node and depth limits, distinct siblings across batches) is checked by the receiver."""
    if len(parents) != len(token_ids):
        raise ProtocolError(BAD_FIELD, f"parents has {len(parents)} entries for "
                                       f"{len(token_ids)} tokens", field="parents")
    for i, p in enumerate(parents):
        if not -1 <= p < first_node + i:
            raise ProtocolError(BAD_FIELD, f"parents[{i}] = {p}: node {first_node + i}'s parent "
                                           f"must be -1 (the root) or an earlier node",
                                field="parents")


TENSOR_FIELDS = ("hidden", "q_ids", "q_probs")


def _tensor_refs(msg: Msg):
    for name in TENSOR_FIELDS:
        ref = getattr(msg, name, None)
        if ref is not None:
            yield ref


def _check_tensor(ref: TensorRef, frames: list) -> None:
    if ref.dtype not in DTYPES:
        raise ProtocolError(BAD_TENSOR, f"dtype {ref.dtype!r} not one of {DTYPES}")
    if not 0 <= ref.frame < len(frames) - 1:
        raise ProtocolError(BAD_FRAME, f"tensor refers to frame {ref.frame}, "
                                       f"message has {len(frames) - 1} buffer frames")
    want = _ITEMSIZE[ref.dtype] * int(np.prod(ref.shape, dtype=np.int64))
    f = frames[ref.frame + 1]
    got = len(f.buffer) if hasattr(f, "buffer") else len(f)
    if want != got:
        raise ProtocolError(BAD_TENSOR, f"{ref.dtype}{ref.shape} needs {want} bytes, frame has {got}")


def tensor_numpy(ref: TensorRef, frames: list) -> np.ndarray:
    """The referenced frame as a numpy array (bfloat16 comes back as float32)."""
    f = frames[ref.frame + 1]
    buf = f.buffer if hasattr(f, "buffer") else f
    if ref.dtype == "bfloat16":
        raw = np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(ref.shape)
    return np.frombuffer(buf, dtype=ref.dtype).reshape(ref.shape)


def tensor_torch(ref: TensorRef, frames: list):
    """The referenced frame as a torch tensor (copy; bfloat16 preserved)."""
    import torch

    f = frames[ref.frame + 1]
    buf = bytearray(f.buffer if hasattr(f, "buffer") else f)
    if not buf:
        return torch.empty(ref.shape, dtype=getattr(torch, ref.dtype))
    return torch.frombuffer(buf, dtype=getattr(torch, ref.dtype)).reshape(ref.shape)


def error_reply(req: Msg | None, code: str, message: str, field: str = "",
                retry_after_s: float = 0.0) -> Error:
    if req is None:
        return Error(code=code, message=message, field=field, retry_after_s=retry_after_s)
    return Error(sid=req.sid, seq=req.seq, rid=req.rid, code=code, message=message, field=field,
                 retry_after_s=retry_after_s)


def peek_ids(frames: list) -> tuple[str, int, int]:
    """Best-effort (sid, seq, rid) of a message that failed to decode, so the error still
    reaches the waiting request."""
    try:
        raw = _probe.decode(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0])
        sid = raw.get("sid", "")
        seq = raw.get("seq", 0)
        rid = raw.get("rid", 0)
        return (sid if isinstance(sid, str) else "", seq if isinstance(seq, int) else 0,
                rid if isinstance(rid, int) and rid >= 0 else 0)
    except Exception:  # noqa: BLE001 - anything unparseable just has no ids
        return "", 0, 0
