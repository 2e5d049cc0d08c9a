"""Cloud-only mode: the target generates autoregressively in the cloud and streams tokens back.

The reference every other mode is measured against (and the baseline PipeSD calls cloud-only).
A session survives its verifier dying or losing messages: it is replayed on a live replica from
the tokens already streamed (services/dispatcher/recovery.py)."""

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
        await recovery.with_recovery(req, req.d.verifiers, "verifier",
                                     functools.partial(_stream, req))
        req.stats["cloud_forwards_per_token"] = 1.0


async def _stream(req, rec: recovery.Recovery, peer) -> None:
    """One verifier session from the stream's current end until it is done."""
    d = req.d
    sid, base = rec.sid, len(req.tokens)
    ch = peer.channel()
    try:
        await ch.send(protocol.CloudGenerate(
            sid=sid, seq=1, token_ids=rec.committed(), max_tokens=req.max_tokens - base,
            sampling=req.sampling, eos_token_id=req.eos, logprobs=req.msg.logprobs,
            **req.constraint_fields()))
        while True:
            msg, _ = await rec.recv(ch)
            if not isinstance(msg, protocol.CloudTokens):
                continue
            at = base + msg.index
            if at < len(req.tokens):
                continue  # a duplicate of a token already streamed
            if at > len(req.tokens):
                rec.gap(len(req.tokens), at)
            more = await req.emit(msg.token_ids, logprobs=msg.logprobs)
            rec.progress()
            if msg.done or not more:
                return
    finally:
        ch.close()
        if not req.done or req.cancelled.is_set():
            d.spawn(d.close_remote(peer, sid))
