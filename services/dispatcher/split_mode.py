"""Split mode (DySCo): the edge prefix runs layers [0, c), the cloud suffix runs [c, L) and
chooses the token. The dispatcher owns the loop:

    PrefixOpen(prompt) -> Hidden -> SuffixOpen -> SuffixToken
    token -> client; PrefixStep(token) -> Hidden -> SuffixStep -> SuffixToken; ...

Prefix caching (common/protocol.py): both sides keep finished sessions' rows, and a new
session's prompt that starts with cached tokens (a chat's next turn) reuses them: the prefix
reuses what it holds and sends the hidden states of the rest only (Hidden.start = the rows it
reused), and the suffix reuses as many. A suffix holding fewer answers with how many it holds;
the prefix session is then reopened to reuse no more than that (`_open`). The rows both reused
are the request's `cached_tokens`.

The cut-layer hidden state goes from the prefix's reply to the suffix as the same raw frame (no
decode, no copy). Both sessions are closed at the end, whatever ended it. A peer that disappears
(the heartbeat notices within peer_timeout_s) or loses a message (silence for stall_s) gets the
session replayed: a new prefix + suffix session pair, on a live suffix replica, prefills the
committed tokens and generation goes on from the stream's end (services/dispatcher/recovery.py).
If no suffix replica or no prefix is up within peer_wait_s, the request fails with
`unavailable`; other sessions never share its channels and are unaffected.
"""

from __future__ import annotations

import functools
import json
import time

from common import models, protocol
from common.protocol import ProtocolError
from services.dispatcher import recovery


@functools.lru_cache(maxsize=None)
def num_layers(target: str) -> int:
    path = models.resolve_target(target)
    return int(json.loads((path / "config.json").read_text())["num_hidden_layers"])


def check_cut(target: str, cut: int) -> int:
    L = num_layers(target)
    if not 1 <= cut <= L - 1:
        raise ProtocolError(protocol.BAD_FIELD, f"cut {cut} outside [1, {L - 1}]: the edge runs "
                                                f"layers [0, cut) of the {L}-layer model",
                            field="cut")
    return cut


def choose_cut(req) -> int:
    return check_cut(req.d.cfg.target, req.msg.cut or req.d.cfg.split.cut)


class Split:
    name = "split"
    policies = ("split",)

    def validate(self, d, msg) -> None:
        """A cut the model does not have is a bad field (before admission)."""
        check_cut(d.cfg.target, msg.cut or d.cfg.split.cut)

    def policy(self, d, msg) -> str:
        return self.name

    async def run(self, req) -> None:
        await run(req)


async def _reply(ch, kind, rec):
    """Next reply of type `kind` on a channel (anything else on it is a stale duplicate); a
    silence of `stall_s` is a lost message (services/dispatcher/recovery.py)."""
    while True:
        msg, frames = await rec.recv(ch)
        if isinstance(msg, kind):
            return msg, frames


async def run(req) -> None:
    cut = choose_cut(req)
    times = {"edge": 0.0, "cloud": 0.0, "queued": 0.0}
    t0 = time.monotonic()
    # a session survives its suffix (or prefix) dying or losing messages: both sides are
    # reopened on live services with the committed tokens as the prompt
    await recovery.with_recovery(req, req.d.suffixes, "suffix",
                                 functools.partial(_session, req, cut, times, t0),
                                 needs=(req.d.prefix,))
    total = time.monotonic() - t0
    req.stats.update(cut=cut, edge_forward_s=times["edge"], cloud_forward_s=times["cloud"],
                     cloud_queue_s=times["queued"],
                     wire_s=max(0.0, total - times["edge"] - times["cloud"] - times["queued"]))


async def _open(req, cut, times, rec: recovery.Recovery, pre, suf, suffix):
    """Open the prefix and suffix sessions on the committed tokens: (the first SuffixToken, the
    prompt rows both took from their prefix caches). The prefix reuses what it holds; a suffix
    that holds fewer of those rows says how many, and the prefix session is reopened to reuse no
    more than that (each retry reuses fewer rows, so this ends: with none, any suffix takes it).
    A suffix that keeps no rows (its heartbeat says so, or has not yet) is not asked to reuse any."""
    sid, prompt = rec.sid, rec.committed()
    max_tokens = req.max_tokens - len(req.tokens)
    max_cached = None if suffix.load is not None and suffix.load.prefix_cache else 0
    while True:
        await pre.send(protocol.PrefixOpen(sid=sid, seq=0, cut=cut, token_ids=prompt,
                                           max_tokens=max_tokens, max_cached=max_cached))
        hidden, frames = await _reply(pre, protocol.Hidden, rec)
        times["edge"] += hidden.seconds
        await suf.send(protocol.SuffixOpen(sid=sid, seq=0, cut=cut, start=hidden.start,
                                           hidden=hidden.hidden, token_ids=prompt,
                                           max_tokens=max_tokens, source=hidden.source,
                                           sampling=req.sampling, logprobs=req.msg.logprobs,
                                           constraint=req.msg.constraint,
                                           output=prompt[len(req.prompt_ids):]
                                           if req.msg.constraint is not None else []),
                       frames[1:])
        reply, _ = await _reply(suf, (protocol.SuffixToken, protocol.Ack), rec)
        if isinstance(reply, protocol.SuffixToken):
            times["cloud"] += reply.seconds
            times["queued"] += reply.queued
            return reply, hidden.start
        if reply.cached_tokens >= hidden.start:
            raise ProtocolError(protocol.INTERNAL, f"suffix {suffix.name}: refused to reuse "
                                f"{hidden.start} rows while holding {reply.cached_tokens}")
        max_cached = reply.cached_tokens
        await pre.send(protocol.Close(sid=sid, seq=1))
        await _reply(pre, protocol.Ack, rec)


async def _session(req, cut, times, t0, rec: recovery.Recovery, suffix) -> None:
    """One prefix + suffix session pair, from the stream's current end (a replay prefills every
    committed token on both sides)."""
    d, sid = req.d, rec.sid
    pre, suf = d.prefix.channel(), suffix.channel()
    try:
        tok, cached = await _open(req, cut, times, rec, pre, suf, suffix)
        req.stats.setdefault("cached_tokens", cached)
        req.stats.setdefault("prefill_s", time.monotonic() - t0)
        seq = 0
        while True:
            more = await req.emit([tok.token], logprobs=None if tok.logprob is None
                                  else [tok.logprob])
            rec.progress()
            if not more:
                return
            seq += 1
            await pre.send(protocol.PrefixStep(sid=sid, seq=seq, token_id=tok.token))
            hidden, frames = await _reply(pre, protocol.Hidden, rec)
            times["edge"] += hidden.seconds
            await suf.send(protocol.SuffixStep(sid=sid, seq=seq, start=hidden.start,
                                               hidden=hidden.hidden), frames[1:])
            tok, _ = await _reply(suf, protocol.SuffixToken, rec)
            times["cloud"] += tok.seconds
            times["queued"] += tok.queued
    finally:
        pre.close()
        suf.close()
        d.spawn(d.close_remote(d.prefix, sid))
        d.spawn(d.close_remote(suffix, sid))
