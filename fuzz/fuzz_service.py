"""Coverage-guided fuzzing (atheris / libFuzzer) of Tandem's message path, for runs longer than
the test suite's (tests/integration/test_fuzz.py runs a bounded one under `-m slow`).

    python fuzz/fuzz_service.py decode   [libFuzzer flags, e.g. -max_total_time=600 corpus/]
    python fuzz/fuzz_service.py verifier [...]     # or drafter, prefix, suffix, dispatcher

`decode`: common/protocol.decode on arbitrary frames; anything but ProtocolError is a finding.
A service name: the real service runs in this process (its models loaded, its own event loop on
a thread, bound to a loopback port) and each input is sent to it as a ZMQ message from a DEALER,
the way a hostile peer would. A finding is: an `internal` error reply (a handler raised — a bug
by definition), no reply within 10 s (a stuck handler), or the service dying. What the input
opened is closed again after each input, so sessions do not pile up.

Input format: one byte = number of frames (1-8), then per frame a 2-byte big-endian length and
that many bytes. The corpus defaults to run/fuzz/WHAT/, seeded on first run with one valid
message of every type in that format, so mutations start from real structure.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import struct
import sys
import threading
import time
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

with atheris.instrument_imports(include=["common", "services"]):
    import msgpack
    import msgspec
    import zmq

    from common import protocol
    from common.config import ServiceConfig, load
    from stack.launcher import free_port
    from common.runtime import Service

LIMITS = protocol.Limits(max_frame_bytes=1 << 20, max_tokens=4096)


def split(data: bytes) -> list[bytes]:
    """Input bytes -> frames (the format the seed corpus uses)."""
    if not data:
        return [b""]
    n, i, frames = 1 + data[0] % 8, 1, []
    for _ in range(n):
        size = int.from_bytes(data[i:i + 2], "big") if i + 2 <= len(data) else 0
        i += 2
        frames.append(data[i:i + size])
        i += size
    return frames


def join(frames: list[bytes]) -> bytes:
    return bytes([len(frames) - 1]) + b"".join(struct.pack(">H", len(f)) + f for f in frames)


def seeds() -> list[bytes]:
    hidden = b"\0" * (2 * 576 * 4)
    ref = protocol.TensorRef(dtype="float32", shape=[2, 576], frame=0)
    msgs = [protocol.Ping(rid=1, t=1.0), protocol.Close(sid="s", rid=1),
            protocol.GenerateRequest(rid=1, prompt="Hello", max_tokens=2),
            protocol.GenerateRequest(rid=2, token_ids=[1, 2, 3], mode="split", cut=4, max_tokens=2),
            protocol.GenerateRequest(rid=3, token_ids=[1, 2, 3], mode="spec", max_tokens=2),
            protocol.Cancel(rid=1),
            protocol.CloudGenerate(sid="s", seq=1, rid=1, token_ids=[1, 2, 3], max_tokens=2),
            protocol.SpecOpen(sid="s", seq=1, rid=1, token_ids=[1, 2, 3]),
            protocol.DraftBatch(sid="s", seq=2, rid=1, round=1, start=3, token_ids=[4, 5],
                                probs=[0.9, 0.8]),
            protocol.VerifyRequest(sid="s", seq=3, rid=1, round=1, end=5),
            protocol.DraftOpen(sid="s", seq=1, rid=1, token_ids=[1, 2, 3], max_tokens=8),
            protocol.DraftRequest(sid="s", seq=1, rid=1, n=2),
            protocol.DraftRollback(sid="s", seq=2, rid=1, keep=3, append=[7]),
            protocol.PrefixOpen(sid="s", seq=0, rid=1, cut=4, token_ids=[1, 2]),
            protocol.PrefixStep(sid="s", seq=1, rid=1, token_id=5)]
    out = [join(protocol.encode(m)) for m in msgs]
    # the same messages with one value poisoned (NaN, inf, out of range), written with
    # msgpack-python since our own encoder would refuse nothing but the decoder would: mutations
    # then start next to the values that once killed an engine loop
    for m in msgs:
        head = msgspec.msgpack.decode(protocol.encode(m)[0])
        for key, value in (("sampling", {"temperature": float("nan")}),
                           ("sampling", {"temperature": float("inf"), "top_p": 1.0}),
                           ("deadline_s", float("inf")), ("probs", [float("nan")]),
                           ("max_tokens", 2**40), ("token_ids", [2**31 - 1])):
            if key in head or key == "sampling" and type(m).__name__ in (
                    "GenerateRequest", "CloudGenerate", "SpecOpen", "DraftOpen"):
                out.append(join([msgpack.packb({**head, key: value})]))
    return out
    for m in (protocol.SuffixOpen(sid="s", seq=0, rid=1, cut=4, start=0, hidden=ref),
              protocol.SuffixStep(sid="s", seq=1, rid=1, start=2, hidden=ref)):
        out.append(join([protocol.encode(m)[0], hidden]))
    return out


# ------------------------------------------------------------------------------------ decode

def decode_one(data: bytes) -> None:
    try:
        protocol.decode(split(data), LIMITS)
    except protocol.ProtocolError as e:
        assert e.code in protocol.ERROR_CODES, e.code


# ----------------------------------------------------------------------------------- service

class Target:
    """The real service on its own event-loop thread, and a DEALER that talks to it."""

    def __init__(self, name: str):
        with atheris.instrument_imports(include=["common", "services"]):
            cfg_mod = importlib.import_module(f"services.{name}.config")
            svc_mod = importlib.import_module(f"services.{name}.service")
        cfg_cls = next(c for _, c in inspect.getmembers(cfg_mod, inspect.isclass)
                       if issubclass(c, ServiceConfig) and c.__module__ == cfg_mod.__name__)
        svc_cls = next(c for _, c in inspect.getmembers(svc_mod, inspect.isclass)
                       if issubclass(c, Service) and c is not Service
                       and c.__module__ == svc_mod.__name__)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        argv = ["--bind", self.endpoint, "--http-port", "0", "--max-frame-bytes", str(1 << 20),
                "--log-level", "error"]
        if name == "dispatcher":
            argv += ["--peer-wait-s", "0.01"]   # no peers here: fail requests fast
        self.svc = svc_cls(load(cfg_cls, name, argv, env={}))
        self.name = name
        threading.Thread(target=lambda: asyncio.run(self.svc.serve()), daemon=True).start()
        end = time.monotonic() + 600
        while not self.svc.ready:
            if time.monotonic() > end:
                raise RuntimeError(f"{name} did not get ready")
            time.sleep(0.05)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)

    def state(self) -> str:
        """What a finding report needs: open sessions and background tasks."""
        sessions = [(s.sid, type(s).__name__, s.seq) for s in self.svc.sessions.values()]
        tasks = [(t.get_coro().__qualname__, t.done()) for t in list(self.svc._tasks)]
        return f"sessions={sessions} tasks={tasks}"

    def drain(self, wait_ms: int) -> list[dict]:
        out = []
        while self.sock.poll(wait_ms):
            head = msgpack.unpackb(self.sock.recv_multipart()[0], strict_map_key=False)
            out.append(head)
            wait_ms = 0
        return out

    def one(self, data: bytes) -> None:
        frames = split(data)
        self.drain(0)
        self.sock.send_multipart(frames)
        try:   # the header as the service's decoder (msgspec) reads it
            head = msgspec.msgpack.decode(frames[0])
        except Exception:  # noqa: BLE001 - garbage header: fine, it is the point
            head = None
        kind = head.get("type") if isinstance(head, dict) else None
        sid, _, rid = protocol.peek_ids(frames)
        replies = self.drain(10_000 if kind != "cancel" else 50)
        if kind != "cancel" and not replies:
            raise RuntimeError(f"{self.name}: no reply in 10 s to {frames[:1]!r}; "
                               f"service state: {self.state()}")
        for r in replies:
            if r.get("type") == "error" and r.get("code") == protocol.INTERNAL:
                raise RuntimeError(f"{self.name}: handler crashed on {frames!r}: {r}")
        # a reply alone does not show that the loops behind it still run (a NaN temperature was
        # answered, then killed the verifier's engine loop): readiness must still hold
        why = self.svc.not_ready_reason()
        if why:
            raise RuntimeError(f"{self.name}: not ready after {frames!r}: {why}; "
                               f"service state: {self.state()}")
        if sid:
            self.sock.send_multipart(protocol.encode(protocol.Close(sid=sid)))
        if self.name == "dispatcher" and 0 < rid < 2**63:
            self.sock.send_multipart(protocol.encode(protocol.Cancel(rid=rid)))
        self.drain(20)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    what = sys.argv.pop(1)
    corpus = ROOT / "run" / "fuzz" / what          # grows as libFuzzer finds new paths
    if not corpus.is_dir():
        corpus.mkdir(parents=True)
        for i, s in enumerate(seeds()):
            (corpus / f"seed-{i:02d}").write_bytes(s)
    if not any(not a.startswith("-") for a in sys.argv[1:]):
        sys.argv.append(str(corpus))   # no corpus given: run/fuzz/WHAT, seeded
    if what == "decode":
        fn = decode_one
    else:
        target = Target(what)
        fn = target.one
    atheris.Setup(sys.argv, fn)
    atheris.Fuzz()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    main()
