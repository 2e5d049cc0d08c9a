"""The dispatcher: the edge-side brain. Clients (the SDK) talk to it; it owns each request's loop
and streams tokens back as they are committed.

Each mode is a `Mode` (services/dispatcher/modes.py: `validate` before admission, `run` for one
request):
* cloud-only  services/dispatcher/cloud_only.py  target autoregressive in the cloud
* spec        services/dispatcher/spec/mode.py   PipeSD speculative decoding
* split       services/dispatcher/split_mode.py  DySCo split computing
`mode="auto"` chooses one of them per request (services/dispatcher/auto_mode.py) and the request
is admitted as that mode.
A request (services/dispatcher/request.py) reaches its client only through `Request.emit`.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import msgspec

from common import chat, constraint, metrics, protocol, security
from common.protocol import ProtocolError
from common.runtime import PeerError, Service
from services.dispatcher import auto_mode, recovery
from services.dispatcher.config import DispatcherConfig
from services.dispatcher.modes import Mode, make_modes
from services.dispatcher.request import Request


class Dispatcher(Service):
    name = "dispatcher"

    def __init__(self, cfg: DispatcherConfig, ctx=None):
        super().__init__(cfg, ctx)
        self.cfg: DispatcherConfig = cfg
        self.requests: dict[tuple[bytes, int], Request] = {}
        self.verifiers = recovery.replicas(self, "verifier", cfg.verifier)  # comma-separated
        self.verifier = self.verifiers[0] if self.verifiers else None   # none yet: discovery
        self.drafter = self.peer("drafter", cfg.drafter)
        self.prefix = self.peer("prefix", cfg.prefix)
        self.suffixes = recovery.replicas(self, "suffix", cfg.suffix)
        self.suffix = self.suffixes[0] if self.suffixes else None
        self.quota = security.ClientQuota(cfg.client_max_sessions, cfg.client_max_tokens)
        self.delegates: frozenset[str] = frozenset()   # gateways' keys (setup)
        self.modes: dict[str, Mode] = make_modes(cfg)
        self.auto = auto_mode.Auto(cfg)
        self.route(protocol.GenerateRequest, self.on_generate)
        self.route(protocol.Cancel, self.on_cancel)

    async def setup(self) -> None:
        from common import models, tokenizer

        self.delegates = security.load_delegates(self.cfg.client_delegates)
        path = models.resolve_target(self.cfg.target)
        self.tokenizer = await asyncio.to_thread(tokenizer.load, path)
        self.eos_token_id = self.tokenizer.eos_token_id
        # the label sets known now, at 0
        metrics.declare_dispatcher(self.name, {name: list(m.policies)
                                               for name, m in self.modes.items()})
        auto_mode.declare_metrics(self.name, self.auto.policies())
        for reps in (self.verifiers, self.suffixes):
            if recovery.placement.is_dynamic(reps.spec):
                self.spawn(self._discover(reps))

    async def _discover(self, reps: recovery.Replicas) -> None:
        """Re-resolve a dns+tcp:// replica list (every A record of a headless service) every
        discovery_s: pods that appear get a Peer, pods that vanish get no new sessions."""
        while True:
            try:
                reps.refresh(await self._lookup_all(reps.spec))
            except Exception:
                self.log.exception("re-resolving %s failed", reps.spec)
            await asyncio.sleep(max(0.5, self.cfg.discovery_s))

    async def _lookup_all(self, spec: str):
        """A lookup function answering from addresses resolved off the event loop."""
        names = {}
        for t in recovery.placement.targets(spec):
            if t.startswith(recovery.placement.DNS_SCHEME):
                parts = urlsplit("tcp://" + t[len(recovery.placement.DNS_SCHEME):])
                try:
                    names[(parts.hostname, parts.port)] = await asyncio.to_thread(
                        recovery.placement.dns_lookup, parts.hostname, parts.port)
                except OSError as e:
                    self.log.warning("cannot resolve %s: %s", parts.hostname, e)
                    names[(parts.hostname, parts.port)] = []
        return lambda host, port: names.get((host, port), [])

    def in_flight(self) -> int:
        """A draining dispatcher waits for its requests in flight."""
        return len(self.requests)

    # --- client requests ----------------------------------------------------------------------
    def need_chat_template(self, field: str) -> None:
        if not getattr(self.tokenizer, "chat_template", None):   # e.g. a base model
            raise ProtocolError(protocol.BAD_FIELD, f"{field}: this model has no chat template; "
                                "send a plain prompt", field=field)

    def prompt_ids(self, msg: protocol.GenerateRequest) -> list[int]:
        if msg.messages is not None and (msg.prompt or msg.token_ids is not None):
            raise ProtocolError(protocol.BAD_FIELD, "messages: send a prompt, token_ids or "
                                "messages, not more than one", field="messages")
        if msg.token_ids is not None:
            ids = list(msg.token_ids)
            bad = [t for t in ids if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise ProtocolError(protocol.BAD_FIELD, f"token ids outside the vocabulary: {bad[:5]}",
                                    field="token_ids")
        elif msg.messages is not None:
            self.need_chat_template("messages")
            ids = chat.render_ids(self.tokenizer, chat.normalize(msg.messages, len(msg.messages)))
        elif msg.chat:
            self.need_chat_template("chat")
            ids = chat.render_ids(self.tokenizer, [{"role": "user", "content": msg.prompt}])
        else:
            ids = self.tokenizer.encode(msg.prompt)
        if not ids:
            raise ProtocolError(protocol.BAD_FIELD, "empty prompt", field="prompt")
        if len(ids) > self.limits.max_prompt_tokens:
            raise ProtocolError(protocol.TOO_LARGE, f"prompt of {len(ids)} tokens is over "
                                f"max_prompt_tokens = {self.limits.max_prompt_tokens} (raise it on "
                                f"every service with TANDEM_MAX_PROMPT_TOKENS or "
                                f"--max-prompt-tokens, up to the model's context length)",
                                field="prompt")
        return ids

    def resume_ids(self, msg: protocol.GenerateRequest, prompt_len: int) -> list[int]:
        """A continuation's committed tokens, checked: it must leave tokens to generate, lie in
        the vocabulary, not run past an EOS the request stops at, and fit the prompt limit with
        the prompt (the dispatcher prefills both)."""
        ids = list(msg.resume_ids or ())
        if not ids:
            return ids
        if len(ids) >= msg.max_tokens:
            raise ProtocolError(protocol.BAD_FIELD, f"resume_ids: {len(ids)} tokens already "
                                f"delivered leave nothing of max_tokens = {msg.max_tokens}",
                                field="resume_ids")
        bad = [t for t in ids if not 0 <= t < len(self.tokenizer)]
        if bad:
            raise ProtocolError(protocol.BAD_FIELD, f"resume_ids: token ids outside the "
                                f"vocabulary: {bad[:5]}", field="resume_ids")
        if msg.stop_at_eos and self.eos_token_id in ids:
            raise ProtocolError(protocol.BAD_FIELD, "resume_ids: holds the EOS token, so the "
                                "request had already ended", field="resume_ids")
        if prompt_len + len(ids) > self.limits.max_prompt_tokens:
            raise ProtocolError(protocol.TOO_LARGE, f"prompt of {prompt_len} tokens + "
                                f"{len(ids)} resumed is over max_prompt_tokens = "
                                f"{self.limits.max_prompt_tokens}", field="resume_ids")
        return ids

    async def on_generate(self, ident: bytes, msg: protocol.GenerateRequest, frames) -> None:
        key = (ident, msg.rid)
        if key in self.requests:
            return  # a retry of a request already running: its stream continues
        mode = msg.mode or self.cfg.default_mode
        if mode not in self.modes and mode != auto_mode.NAME:
            raise ProtocolError(protocol.BAD_FIELD, f"unknown mode {mode!r}; one of "
                                                    f"{sorted([*self.modes, auto_mode.NAME])}",
                                field="mode")
        if not 1 <= msg.max_tokens <= self.cfg.max_new_tokens:
            raise ProtocolError(protocol.BAD_FIELD,
                                f"max_tokens must be in [1, {self.cfg.max_new_tokens}]",
                                field="max_tokens")
        s = msg.sampling
        protocol.check_sampling(s, len(self.tokenizer))
        if msg.constraint is not None:
            if not msg.stop_at_eos:
                raise ProtocolError(protocol.BAD_FIELD, "constraint: the output ends where the "
                                    "constraint is complete, at EOS; stop_at_eos must be on",
                                    field="constraint")
            constraint.check(msg.constraint, self.limits.max_constraint_bytes)
        auto = mode == auto_mode.NAME
        if auto:
            self.auto.candidates(self, msg)    # the policy or cut it names, checked
        else:
            self.modes[mode].validate(self, msg)   # its own fields (cut, policy): before admission
        if len(self.requests) >= self.cfg.max_sessions:
            raise ProtocolError(protocol.BUSY, f"{len(self.requests)} requests in flight")
        ids = self.prompt_ids(msg)
        choice = partner = None
        if auto:   # admitted as the mode chosen for it
            msg, choice, partner = self.auto.admit(self, msg)
            mode = msg.mode
            # a seed gives one text whatever mode auto picks only under the Gumbel coupling
            # (rejection sampling's text depends on the drafts): a seeded request that names no
            # coupling gets it
            if msg.sampling.seed is not None and not msg.sampling.coupling:
                msg = msgspec.structs.replace(msg, sampling=msgspec.structs.replace(
                    msg.sampling, coupling="gumbel"))
        policy = self.modes[mode].policy(self, msg)
        resumed = self.resume_ids(msg, len(ids))
        req = Request(self, ident, msg, ids + resumed, mode, policy, resumed=len(resumed))
        req.choice, req.switch_to = choice, partner
        req.client = security.client_id(ident, frames, msg.client, self.delegates)
        req.quota = len(req.prompt_ids) + req.max_tokens   # a continuation's: the original's
        self.quota.admit(req.client, req.quota)       # per-client limits: busy / too_large
        self.requests[key] = req
        metrics.ACTIVE_SESSIONS.labels(self.name, mode).inc()
        metrics.PROMPT_TOKENS.labels(self.name, mode).inc(len(ids))
        if msg.resume_ids is not None:
            metrics.RESUMED_REQUESTS.labels(self.name, mode).inc()
        self.spawn(self.serve_request(key, req))

    async def on_cancel(self, ident: bytes, msg: protocol.Cancel, frames) -> None:
        req = self.requests.get((ident, msg.rid))
        if req is not None:
            req.cancelled.set()

    async def serve_request(self, key, req: Request) -> None:
        labels = (self.name, req.mode, req.policy)
        outcome = "ok"
        reply = None  # the request's last message: Done, or (code, message) for an Error
        runner = asyncio.ensure_future(self.auto.run(req) if req.switch_to is not None
                                       else self.modes[req.mode].run(req))
        cancel = asyncio.ensure_future(req.cancelled.wait())
        try:
            done, _ = await asyncio.wait([runner, cancel], timeout=req.remaining(),
                                         return_when=asyncio.FIRST_COMPLETED)
            if runner in done:
                runner.result()  # re-raise the mode's failure
                req.finish_reason = req.finish_reason or "length"
                reply = protocol.Done(sid=req.msg.sid, rid=req.rid,
                                      finish_reason=req.finish_reason, stats=req.summary())
            elif cancel in done:
                outcome = "cancelled"
                req.finish_reason = "cancelled"   # Done is built once the mode has cleaned up
            else:
                outcome = "deadline"
                reply = (protocol.DEADLINE, f"deadline passed after {len(req.tokens)} tokens")
        except (PeerError, ProtocolError) as e:
            outcome = "error"
            reply = (e.code, e.message, e.field, e.retry_after_s)   # a peer's refusal names its field
        except Exception:
            outcome = "error"
            self.log.exception("request %s failed", req.sid)
            reply = (protocol.INTERNAL, f"dispatcher: internal error while serving request "
                                        f"{req.sid!r} in {req.mode} mode; the request was ended "
                                        f"(details in the dispatcher log)")
        finally:
            for t in (runner, cancel):
                t.cancel()
            await asyncio.gather(runner, cancel, return_exceptions=True)
            if outcome == "cancelled":   # the mode's cleanup has added its figures (recoveries)
                reply = protocol.Done(sid=req.msg.sid, rid=req.rid, finish_reason="cancelled",
                                      stats=req.summary())
            # free the request's slots before the client hears it is over, so a client that
            # resubmits at once is never refused by its own finished request
            self.requests.pop(key, None)
            self.quota.release(req.client, req.quota)
            if req.tokens and outcome == "ok":
                # before the reply: the client's next request is chosen with this one's figures
                try:   # every mode's figures teach auto; a figure it cannot use ends nothing
                    self.auto.observe(self, reply.stats)
                except (KeyError, TypeError, ValueError):
                    self.log.exception("auto: request %s taught nothing", req.sid)
            if isinstance(reply, tuple):
                await self.error(req.ident, req.msg, *reply)
            elif reply is not None:
                await self.send(req.ident, reply)
            metrics.ACTIVE_SESSIONS.labels(self.name, req.mode).dec()
            metrics.REQUESTS.labels(*labels, outcome).inc()
            if req.tokens and outcome == "ok":
                total = time.monotonic() - req.start
                metrics.E2E.labels(*labels).observe(total)
                metrics.TPT.labels(*labels).observe(total / len(req.tokens))

    async def need(self, peer, req: Request) -> None:
        """Wait (bounded by the request's deadline) for a peer to be up."""
        if not await peer.wait_up(min(self.cfg.peer_wait_s, req.remaining())):
            raise PeerError(protocol.UNAVAILABLE, f"{peer.name} at {peer.endpoint} is unreachable")

    async def close_remote(self, peer, sid: str) -> None:
        """Best-effort: free a session's state on a peer."""
        try:
            await peer.request(protocol.Close(sid=sid), timeout=2.0)
        except PeerError:
            pass


def main(argv=None) -> None:
    Dispatcher.launch(DispatcherConfig, argv)


if __name__ == "__main__":
    main()
