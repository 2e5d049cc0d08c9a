"""Cloud-only mode: the target generates autoregressively in the cloud and streams tokens back.

The reference every other mode is measured against (and the baseline PipeSD calls cloud-only)."""

from __future__ import annotations

from common import protocol


async def run(req) -> None:
    d = req.d
    await d.need(d.verifier, req)
    ch = d.verifier.channel()
    try:
        await ch.send(protocol.CloudGenerate(
            sid=req.sid, seq=1, token_ids=req.prompt_ids, max_tokens=req.max_tokens,
            sampling=req.sampling, eos_token_id=req.eos))
        while True:
            msg, _ = await ch.recv(timeout=req.remaining())
            if not isinstance(msg, protocol.CloudTokens):
                continue
            if msg.index != len(req.tokens):
                continue  # a duplicate of a token already streamed
            more = await req.emit(msg.token_ids)
            if msg.done or not more:
                break
        req.stats["cloud_forwards_per_token"] = 1.0
    finally:
        ch.close()
        if not req.done or req.cancelled.is_set():
            d.spawn(d.close_remote(d.verifier, req.sid))
