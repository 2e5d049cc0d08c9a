"""Cloud-only mode: the target generates autoregressively in the cloud and streams tokens back.

The reference every other mode is measured against (and the baseline PipeSD calls cloud-only).
A session survives its verifier dying or losing messages: it is replayed on a live replica from
the tokens already streamed (services/dispatcher/recovery.py). Under mode "auto" it is also one
stretch of a request that switches to and from speculative mode (`stretch`)."""

from __future__ import annotations

import functools

from common import protocol
from services.dispatcher import recovery


class CloudOnly:
    name = "cloud-only"
    policies = ("cloud-only",)

    def validate(self, d, msg) -> None:
        """Nothing beyond what every request is checked for."""

    def policy(self, d, msg) -> str:
        return self.name

    async def run(self, req) -> None:
        await stretch(req)
        req.stats["cloud_forwards_per_token"] = 1.0


async def stretch(req, tag: str = "", adopt: tuple | None = None) -> tuple | None:
    """Generate until the request is done, or until it switches mode (`req.switch_due`, mode
    "auto"): then the verifier session is left open and its (peer, sid) returned, for the next
    stretch to adopt. `adopt`: the (peer, sid) of the session whose KV cache this one takes over
    (protocol ADOPT); `tag`: this stretch's session id suffix."""
    handover: list = []
    await recovery.with_recovery(req, req.d.verifiers, "verifier",
                                 functools.partial(_stream, req, adopt, handover), tag=tag,
                                 peer=adopt[0] if adopt else None)
    return handover[0] if handover else None


async def _stream(req, adopt, handover: list, rec: recovery.Recovery, peer) -> None:
    """One verifier session from the stream's current end until it is done (or switches)."""
    d = req.d
    sid, base = rec.sid, len(req.tokens)
    adopted = adopt[1] if adopt and rec.attempt == 0 and peer is adopt[0] else ""
    ch = peer.channel()
    try:
        await ch.send(protocol.CloudGenerate(
            sid=sid, seq=1, token_ids=rec.committed(), max_tokens=req.max_tokens - base,
            sampling=req.sampling, eos_token_id=req.eos, logprobs=req.msg.logprobs,
            adopt=adopted, **req.constraint_fields()))
        while True:
            msg, _ = await rec.recv(ch)
            if not isinstance(msg, protocol.CloudTokens):
                continue
            if msg.index == 0:   # the prompt's rows the verifier's prefix cache held
                req.stats.setdefault("cached_tokens", msg.cached_tokens)
            at = base + msg.index
            if at < len(req.tokens):
                continue  # a duplicate of a token already streamed
            if at > len(req.tokens):
                rec.gap(len(req.tokens), at)
            more = await req.emit(msg.token_ids, logprobs=msg.logprobs)
            rec.progress()
            if msg.done or not more:
                return
            if req.switch_due():
                handover.append((peer, sid))
                return
    finally:
        ch.close()
        if not handover and (not req.done or req.cancelled.is_set()):
            d.spawn(d.close_remote(peer, sid))
