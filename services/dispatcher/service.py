"""The dispatcher: the edge-side brain. Clients (the SDK) talk to it; it owns each request's loop
and streams tokens back as they are committed.

Each mode is one module with `async def run(req: Request) -> None`:
* cloud-only  services/dispatcher/cloud_only.py  target autoregressive in the cloud
* spec        services/dispatcher/spec_mode.py   PipeSD speculative decoding
* split       services/dispatcher/split_mode.py  DySCo split computing
`Request.emit` is the only way tokens reach a client: it numbers them, stops at max_tokens / EOS,
and never sends a token twice, whatever the mode does (DESIGN.md §5, invariant 5).
"""

from __future__ import annotations

import asyncio
import importlib
import time
import uuid
from urllib.parse import urlsplit

from common import metrics, protocol, security
from common.protocol import ProtocolError
from common.runtime import PeerError, Service
from services.dispatcher import recovery
from services.dispatcher.config import DispatcherConfig

MODES = {"cloud-only": "services.dispatcher.cloud_only",
         "spec": "services.dispatcher.spec_mode",
         "split": "services.dispatcher.split_mode"}


class Detokenizer:
    """Incremental detokenisation: emit text only once a token sequence decodes to whole
    characters (a multi-byte character may span tokens)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset],
                                 skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""


class Request:
    """One client request in flight."""

    def __init__(self, d: "Dispatcher", ident: bytes, msg: protocol.GenerateRequest,
                 prompt_ids: list[int], mode: str, policy: str):
        self.d = d
        self.ident = ident
        self.msg = msg
        self.rid = msg.rid
        self.sid = f"{msg.sid or 'req'}-{uuid.uuid4().hex[:10]}"   # unique across clients
        self.prompt_ids = prompt_ids
        self.mode = mode
        self.policy = policy
        self.sampling = msg.sampling
        self.max_tokens = msg.max_tokens
        self.eos = d.eos_token_id if msg.stop_at_eos else None
        self.tokens: list[int] = []
        self.finish_reason = ""
        self.start = time.monotonic()
        budget = msg.deadline_s if msg.deadline_s > 0 else d.cfg.request_timeout_s
        self.deadline = self.start + budget
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.stats: dict = {}            # mode-specific figures, returned in Done.stats
        self.cancelled = asyncio.Event()
        self.detok = Detokenizer(d.tokenizer)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def emit(self, token_ids: list[int], degraded: bool = False) -> bool:
        """Append committed tokens to the client's stream. Returns False once the request is
        complete (max_tokens reached or EOS emitted); tokens past that point are dropped."""
        if self.done:
            return False
        out = []
        for t in token_ids:
            out.append(t)
            if self.eos is not None and t == self.eos:
                self.finish_reason = "eos"
                break
            if len(self.tokens) + len(out) >= self.max_tokens:
                self.finish_reason = "length"
                break
        if not out:
            return not self.done
        now = time.monotonic()
        labels = (self.d.name, self.mode, self.policy)
        if not self.tokens:
            self.first_token_at = now
            metrics.TTFT.labels(*labels).observe(now - self.start)
        else:
            gap = (now - self.last_token_at) / len(out)
            for _ in out:
                metrics.ITL.labels(*labels).observe(gap)
        self.last_token_at = now
        index = len(self.tokens)
        self.tokens.extend(out)
        metrics.GENERATED_TOKENS.labels(*labels).inc(len(out))
        await self.d.send(self.ident, protocol.TokenEvent(
            sid=self.msg.sid, rid=self.rid, index=index, token_ids=out,
            text=self.detok.push(out), degraded=degraded))
        return not self.done

    def summary(self) -> dict:
        end = time.monotonic()
        n = len(self.tokens)
        stats = {"mode": self.mode, "policy": self.policy, "prompt_tokens": len(self.prompt_ids),
                 "generated_tokens": n, "duration_s": end - self.start,
                 "ttft_s": (self.first_token_at - self.start) if n else None,
                 "tpt_s": (end - self.start) / n if n else None}
        stats.update(self.stats)
        return stats


class Dispatcher(Service):
    name = "dispatcher"

    def __init__(self, cfg: DispatcherConfig):
        super().__init__(cfg)
        self.cfg: DispatcherConfig = cfg
        self.requests: dict[tuple[bytes, int], Request] = {}
        self.verifiers = recovery.replicas(self, "verifier", cfg.verifier)  # comma-separated
        self.verifier = self.verifiers[0] if self.verifiers else None   # none yet: discovery
        self.drafter = self.peer("drafter", cfg.drafter)
        self.prefix = self.peer("prefix", cfg.prefix)
        self.suffixes = recovery.replicas(self, "suffix", cfg.suffix)
        self.suffix = self.suffixes[0] if self.suffixes else None
        self.quota = security.ClientQuota(cfg.client_max_sessions, cfg.client_max_tokens)
        self.modes: dict = {}
        self.route(protocol.GenerateRequest, self.on_generate)
        self.route(protocol.Cancel, self.on_cancel)

    async def setup(self) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415

        from common import models  # noqa: PLC0415

        path = models.resolve_target(self.cfg.target)
        self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(path))
        self.eos_token_id = self.tokenizer.eos_token_id
        for mode, module in MODES.items():
            try:
                self.modes[mode] = importlib.import_module(module)
            except ImportError as e:  # a deployment may ship only some modes
                self.log.warning("mode %s unavailable: %s", mode, e)
        policies = {mode: [mode] for mode in self.modes}   # the label sets known now, at 0
        if "spec" in self.modes:
            policies["spec"] = list(self.modes["spec"].POLICIES)
        metrics.declare_dispatcher(self.name, policies)
        for reps in (self.verifiers, self.suffixes):
            if recovery.placement.is_dynamic(reps.spec):
                self.spawn(self._discover(reps))

    async def _discover(self, reps: recovery.Replicas) -> None:
        """Re-resolve a dns+tcp:// replica list (every A record of a headless service) every
        discovery_s: pods that appear get a Peer, pods that vanish get no new sessions."""
        while True:
            try:
                reps.refresh(await self._lookup_all(reps.spec))
            except Exception:  # noqa: BLE001 - discovery must outlive a resolver hiccup
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
    def prompt_ids(self, msg: protocol.GenerateRequest) -> list[int]:
        if msg.token_ids is not None:
            ids = list(msg.token_ids)
            bad = [t for t in ids if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise ProtocolError(protocol.BAD_FIELD, f"token ids outside the vocabulary: {bad[:5]}",
                                    field="token_ids")
        elif msg.chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": msg.prompt}], add_generation_prompt=True,
                tokenize=True, return_dict=False)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
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

    async def on_generate(self, ident: bytes, msg: protocol.GenerateRequest, frames) -> None:
        key = (ident, msg.rid)
        if key in self.requests:
            return  # a retry of a request already running: its stream continues
        mode = msg.mode or self.cfg.default_mode
        if mode not in MODES:
            raise ProtocolError(protocol.BAD_FIELD, f"unknown mode {mode!r}; one of {sorted(MODES)}",
                                field="mode")
        if mode not in self.modes:
            raise ProtocolError(protocol.UNAVAILABLE, f"mode {mode!r} is not available here")
        if not 1 <= msg.max_tokens <= self.cfg.max_new_tokens:
            raise ProtocolError(protocol.BAD_FIELD,
                                f"max_tokens must be in [1, {self.cfg.max_new_tokens}]",
                                field="max_tokens")
        s = msg.sampling
        protocol.check_sampling(s, len(self.tokenizer))
        validate = getattr(self.modes[mode], "validate", None)   # the mode's own fields (cut,
        if validate is not None:                                  # policy): before admission too
            validate(self, msg)
        if len(self.requests) >= self.cfg.max_sessions:
            raise ProtocolError(protocol.BUSY, f"{len(self.requests)} requests in flight")
        policy = (msg.policy or self.cfg.default_policy) if mode == "spec" else mode
        req = Request(self, ident, msg, self.prompt_ids(msg), mode, policy)
        req.client = security.client_id(ident, frames)
        req.quota = len(req.prompt_ids) + msg.max_tokens
        self.quota.admit(req.client, req.quota)       # per-client limits: busy / too_large
        self.requests[key] = req
        metrics.ACTIVE_SESSIONS.labels(self.name, mode).inc()
        metrics.PROMPT_TOKENS.labels(self.name, mode).inc(len(req.prompt_ids))
        self.spawn(self.serve_request(key, req))

    async def on_cancel(self, ident: bytes, msg: protocol.Cancel, frames) -> None:
        req = self.requests.get((ident, msg.rid))
        if req is not None:
            req.cancelled.set()

    async def serve_request(self, key, req: Request) -> None:
        labels = (self.name, req.mode, req.policy)
        outcome = "ok"
        reply = None  # the request's last message: Done, or (code, message) for an Error
        runner = asyncio.ensure_future(self.modes[req.mode].run(req))
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
            reply = (e.code, e.message)
        except Exception:  # noqa: BLE001 - a bug ends this request only; the traceback is logged
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
