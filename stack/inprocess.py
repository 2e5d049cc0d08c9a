"""Tandem in one process: the five services as objects on one event loop, joined by ZMQ's
inproc:// transport instead of TCP — the same Service, Peer and Channel code, the same wire
(every message is encoded, framed, decoded and validated), no processes and no ports.

vLLM keeps an in-process engine client beside its multiprocess one for the same reason: modes,
recovery and schedulers are exercised with the real service objects in a fast test, and a
program can embed Tandem without launching anything.

    async with InProcessStack(verifiers=2) as stack:
        async with stack.client() as c:
            r = await c.complete("def fibonacci(n):", mode="spec", max_tokens=32)
        await stack.stop("verifier")          # a replica goes away mid-run: sessions replay

`BackgroundStack` runs one on its own thread, for synchronous callers (the tests' fixtures).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field

import zmq.asyncio

from tandem.client import AsyncClient

ROLES = ("verifier", "drafter", "prefix", "suffix", "dispatcher")


@dataclass
class StackConfig:
    target: str = "bundled"        # HF directory of the target (verifier, prefix, suffix, tokenizer)
    drafter: str = "bundled"       # GGUF of the draft model
    verifiers: int = 1             # verifier replicas
    suffixes: int = 1              # suffix replicas
    threads: int = 1               # torch / llama.cpp threads of each service (they share cores)
    heartbeat_s: float = 0.5       # short, so a stopped replica is noticed within seconds
    peer_timeout_s: float = 4.0    # (not shorter: one loop serves every service, and a busy
                                   # machine can hold it for a second)
    overrides: dict[str, dict] = field(default_factory=dict)  # role -> extra config fields


class InProcessStack:
    def __init__(self, config: StackConfig | None = None, **kw):
        self.config = config or StackConfig(**kw)
        self.ctx = zmq.asyncio.Context()
        self.tag = uuid.uuid4().hex[:8]           # endpoints unique per stack in a process
        self.services: dict[str, object] = {}     # name ("verifier", "verifier-1", ...) -> service
        self.tasks: dict[str, asyncio.Task] = {}
        self.names = {"verifier": self._replicas("verifier", self.config.verifiers),
                      "suffix": self._replicas("suffix", self.config.suffixes),
                      "drafter": ["drafter"], "prefix": ["prefix"], "dispatcher": ["dispatcher"]}

    @staticmethod
    def _replicas(role: str, n: int) -> list[str]:
        return [role if i == 0 else f"{role}-{i}" for i in range(n)]

    def endpoint(self, name: str) -> str:
        return f"inproc://tandem-{self.tag}-{name}"

    def _make(self, name: str):
        """A fresh service object for `name` (also to restart one that was stopped)."""
        from services.dispatcher.config import DispatcherConfig
        from services.dispatcher.service import Dispatcher
        from services.drafter.config import DrafterConfig
        from services.drafter.service import Drafter
        from services.prefix.config import PrefixConfig
        from services.prefix.service import Prefix
        from services.suffix.config import SuffixConfig
        from services.suffix.service import Suffix
        from services.verifier.config import VerifierConfig
        from services.verifier.service import Verifier

        c = self.config
        role = name.split("-")[0]
        common = dict(bind=self.endpoint(name), http_port=0, threads=c.threads,
                      heartbeat_s=c.heartbeat_s, peer_timeout_s=c.peer_timeout_s,
                      **c.overrides.get(role, {}))
        if role == "dispatcher":
            cfg = DispatcherConfig(
                target=c.target, drafter=self.endpoint("drafter"), prefix=self.endpoint("prefix"),
                verifier=",".join(self.endpoint(n) for n in self.names["verifier"]),
                suffix=",".join(self.endpoint(n) for n in self.names["suffix"]), **common)
            return Dispatcher(cfg, self.ctx)
        cls, config_cls, model = {"verifier": (Verifier, VerifierConfig, {"target": c.target}),
                                  "suffix": (Suffix, SuffixConfig, {"target": c.target}),
                                  "prefix": (Prefix, PrefixConfig, {"target": c.target}),
                                  "drafter": (Drafter, DrafterConfig, {"drafter": c.drafter})}[role]
        return cls(config_cls(**model, **common), self.ctx)

    async def start(self, name: str | None = None, timeout: float = 300.0) -> None:
        """Start every service (or one, e.g. to restart a stopped replica), each ready before
        the next starts: model loading on threads at once trips transformers' lazy imports."""
        import torch
        torch.set_num_threads(self.config.threads)   # one process: torch's threads are shared
        loop = asyncio.get_running_loop()
        for n in [name] if name else [n for role in ROLES for n in self.names[role]]:
            svc = self.services[n] = self._make(n)
            task = self.tasks[n] = loop.create_task(svc.serve(), name=n)
            end = loop.time() + timeout
            while not svc.ready:
                if task.done():
                    raise RuntimeError(f"in-process {n} ended while starting: "
                                       f"{task.exception()!r}")
                if loop.time() > end:
                    raise TimeoutError(f"in-process {n} not ready within {timeout:.0f} s")
                await asyncio.sleep(0.02)
        if name is None:   # every peer of the dispatcher up: the first request finds them
            d = self.services["dispatcher"]
            await asyncio.gather(*(p.wait_up(timeout) for p in d.peers))

    async def stop(self, name: str | None = None) -> None:
        """Stop one service (as a crash or a shutdown would end it) or all of them."""
        names = [name] if name else list(reversed(self.tasks))
        for n in names:
            svc, task = self.services.get(n), self.tasks.pop(n, None)
            if svc is None or task is None:
                continue
            svc.stop()
            await asyncio.gather(task, return_exceptions=True)

    def client(self, **kw) -> AsyncClient:
        return AsyncClient(self.endpoint("dispatcher"), context=self.ctx, **kw)

    async def __aenter__(self) -> InProcessStack:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.stop()
        self.ctx.term()


class BackgroundStack:
    """An InProcessStack on a private event-loop thread, for synchronous code: `call(fn)` runs
    `await fn(stack)` on that loop (clients must live on it too) and returns the result."""

    def __init__(self, config: StackConfig | None = None, **kw):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="tandem-inprocess")
        self.thread.start()
        self.stack = InProcessStack(config, **kw)
        try:
            self._run(self.stack.start())
        except BaseException:
            self.close()
            raise

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, timeout: float | None = 600.0):
        return self._run(fn(self.stack), timeout)

    def complete(self, prompt, **kw):
        """One request through a fresh client: the SDK's Result."""
        async def go(stack):
            async with stack.client() as c:
                return await c.complete(prompt, **kw)
        return self.call(go)

    def complete_many(self, requests: list[tuple[list[int], dict]]):
        """Requests sent together, each through its own client (the services batch them, as they
        would concurrent users): their Results, in order."""
        async def go(stack):
            async def one(prompt, kw):
                async with stack.client() as c:
                    return await c.complete(prompt, **kw)
            return await asyncio.gather(*(one(p, kw) for p, kw in requests))
        return self.call(go)

    def close(self) -> None:
        if self.loop.is_running():
            try:
                self._run(self.stack.close(), timeout=60)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout=10)
