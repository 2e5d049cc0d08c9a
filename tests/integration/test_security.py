"""Security: CURVE on the dispatcher -> verifier link, ports bound to loopback, per-client limits.

The cluster here runs CURVE with keys written by `tandem keys`: the verifier lets in only the
dispatcher's public key. Checked: generation through the encrypted link equals transformers';
the bytes on the wire (a TCP tap between the two) never show the protocol in clear; a client with
an unknown key, no key, or the wrong server key gets no answer, and its request never reaches a
handler (the verifier's message counters do not move); HTTP and ZMQ bind to 127.0.0.1 unless
configured; one client over its session or token limit gets `busy` / `too_large`.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

from common import protocol, security
from common.config import ServiceConfig, load
from stack.launcher import Cluster, free_port
from common.runtime import Service
from tandem import Busy, Client, InvalidRequest
from tests import _reliability as rel
from tests.conftest import PROMPTS


class Tap:
    """A TCP forwarder that keeps a copy of every byte, both ways."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.seen = bytearray()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _start(self):
        return await asyncio.start_server(self._conn, "127.0.0.1", 0)

    async def _conn(self, r1, w1):
        try:
            r2, w2 = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            w1.close()
            return

        async def pump(r, w):
            try:
                while data := await r.read(65536):
                    self.seen += data
                    w.write(data)
                    await w.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                w.close()
        await asyncio.gather(pump(r1, w2), pump(r2, w1))

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


def keys_cli(*args) -> str:
    out = subprocess.run([sys.executable, "-m", "stack.cli", "keys", *args], check=True,
                         capture_output=True, text=True, timeout=60)
    return out.stdout


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    keys_cli("create", "verifier", "dispatcher", "intruder", "--dir", str(d),
             "--allow", "dispatcher")
    return d


@pytest.fixture(scope="module")
def env(model_paths, keys, tmp_path_factory):
    c = Cluster(services=("verifier", "dispatcher"), ephemeral=True,
                logdir=tmp_path_factory.mktemp("security-logs"),
                extra={"verifier": rel.ONE_THREAD + [
                           "--curve-secret-key", keys / "verifier.key_secret",
                           "--curve-allow-dir", keys / "allowed"],
                       "dispatcher": [
                           "--curve-client-key", keys / "dispatcher.key_secret",
                           "--curve-server-keys", f"verifier={keys / 'verifier.key'}",
                           "--client-max-sessions", "1", "--client-max-tokens", "120"]})
    tap = Tap(int(c.endpoint("verifier").rsplit(":", 1)[1]))
    c.extra["dispatcher"] += ["--verifier", f"tcp://127.0.0.1:{tap.port}"]
    with rel.running(c):
        yield c, tap
    tap.close()


def metric(c: Cluster, name: str, service: str = "verifier") -> dict[str, float]:
    with urllib.request.urlopen(c.procs[service].url("/metrics"), timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


# ---------------------------------------------------------------------------------- CURVE

def test_allowed_key_generates_over_encrypted_link(env, tokenizer, reference,
                                                   assert_same_tokens):
    c, tap = env
    ids = tokenizer.encode(PROMPTS["plain"])
    with Client(c.endpoint("dispatcher"), timeout_s=120) as client:
        r = client.complete(ids, max_tokens=12, stop_at_eos=False)
    assert_same_tokens(ids, r.token_ids, reference(ids, 12), "curve")
    seen = bytes(tap.seen)
    assert len(seen) > 1000, "nothing crossed the tap"
    assert b"CURVE" in seen[:200]                     # the ZMTP greeting names the mechanism
    for clear in (b"cloud_generate", b"cloud_tokens", b"pong", b"ping", b"NULL"):
        assert clear not in seen, f"{clear!r} crossed the link in clear"
    rel.record("security", "CURVE dispatcher->verifier", allowed_key="generates, output "
               "identical to transformers", wire_bytes=len(seen), plaintext_markers_seen=0)


def _intruder(endpoint: str, socket_keys: tuple | None) -> int:
    """Send a Ping and a CloudGenerate; return how many replies came back in 3 s."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if socket_keys is not None:
        public, secret, server = socket_keys
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = public, secret, server
    s.connect(endpoint)
    s.send_multipart(protocol.encode(protocol.Ping(rid=1, t=time.monotonic())))
    s.send_multipart(protocol.encode(protocol.CloudGenerate(sid="intruder", seq=1, rid=2,
                                                            token_ids=[1, 2, 3], max_tokens=2)))
    replies = 0
    end = time.monotonic() + 3
    while time.monotonic() < end:
        if s.poll(100):
            s.recv_multipart()
            replies += 1
    s.close()
    ctx.term()
    return replies


def test_unknown_keys_cannot_connect_or_send(env, keys):
    c, _ = env
    verifier_pub = security.load_public(keys / "verifier.key")
    intruder_pub, intruder_sec = security.load_secret(keys / "intruder.key_secret")
    allowed_pub, allowed_sec = security.load_secret(keys / "dispatcher.key_secret")
    wrong_server = security.load_public(keys / "intruder.key")
    before = metric(c, "tandem_messages_total")
    cases = {"unknown client key": (intruder_pub, intruder_sec, verifier_pub),
             "no CURVE (plaintext)": None,
             "allowed key, wrong server key": (allowed_pub, allowed_sec, wrong_server)}
    replies = {name: _intruder(c.endpoint("verifier"), k) for name, k in cases.items()}
    assert replies == {name: 0 for name in cases}, replies
    after = metric(c, "tandem_messages_total")
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # the dispatcher's own heartbeats (pings) keep coming; nothing else may appear
    assert not any("cloud_generate" in k for k in grew), grew
    assert metric(c, "tandem_sessions").get('tandem_sessions{service="verifier"}', 0) == 0
    # and the allowed key, from a raw socket, does get through
    assert _intruder(c.endpoint("verifier"), (allowed_pub, allowed_sec, verifier_pub)) >= 1
    rel.record("security", "CURVE rejects unknown peers", attempts=list(cases),
               replies=replies, reached_handler=0,
               allowed_key_raw_socket="answered")


def test_sdk_curve_to_dispatcher(model_paths, tmp_path):
    """The dispatcher's client-facing socket under CURVE, reached through the SDK: an
    allowlisted key pair is answered; an unknown key, or no CURVE at all, gets no answer (the
    SDK's own Unavailable: no dispatcher reachable) and its request never reaches a handler."""
    from tandem import AsyncClient, DeadlineExceeded, Unavailable
    from tandem.client import curve_keys

    d = tmp_path / "keys"
    keys_cli("create", "dispatcher", "app", "stranger", "--dir", str(d), "--allow", "app")
    dead = f"tcp://127.0.0.1:{free_port()}"       # no cloud needed: invalid requests only
    c = Cluster(services=("dispatcher",), ephemeral=True, logdir=tmp_path / "logs",
                extra={"dispatcher": ["--curve-secret-key", d / "dispatcher.key_secret",
                                      "--curve-allow-dir", d / "allowed", "--verifier", dead,
                                      "--drafter", dead, "--prefix", dead, "--suffix", dead]})
    server = d / "dispatcher.key"

    async def ask(**curve):
        async with AsyncClient(c.endpoint("dispatcher"), **curve) as cl:
            try:
                await cl.complete("hi", mode="no-such-mode", max_tokens=1, deadline_s=0.5)
            except InvalidRequest:
                return "answered"
            except Unavailable:
                return "no answer"
            except DeadlineExceeded:
                return "sent, never answered"
        return "?"

    async def all_clients():
        return await asyncio.gather(
            ask(curve_server_key=server, curve_client_key=d / "app.key_secret"),
            ask(curve_server_key=security.public_key_z85(server),   # the key as z85 text
                curve_client_key=d / "app.key_secret"),
            ask(curve_server_key=server, curve_client_key=d / "stranger.key_secret"),
            ask())

    with rel.running(c):
        got = asyncio.run(all_clients())
        generate = sum(v for k, v in metric(c, "tandem_messages_total", "dispatcher").items()
                       if 'type="generate"' in k)
    assert got == ["answered", "answered", "no answer", "no answer"], got
    assert generate == 2, generate     # only the allowlisted client's requests got in
    with pytest.raises(ValueError, match="both"):
        curve_keys(server, None)
    rel.record("security", "CURVE client -> dispatcher (SDK)",
               allowed_key="answered", unknown_key="no answer", plaintext="no answer",
               reached_handler=0)


def test_key_config_errors_are_clear(keys, tmp_path):
    def cfg(**kw):
        base = dict(curve_secret_key="", curve_allow_dir="", curve_client_key="",
                    curve_server_keys="")
        return SimpleNamespace(**{**base, **kw})
    with pytest.raises(security.KeyFileError, match="curve_allow_dir"):
        security.server_keys(cfg(curve_secret_key=str(keys / "verifier.key_secret")))
    with pytest.raises(security.KeyFileError, match="no secret key"):
        security.server_keys(cfg(curve_secret_key=str(keys / "verifier.key"),
                                 curve_allow_dir=str(keys / "allowed")))
    with pytest.raises(security.KeyFileError, match="curve_client_key"):
        security.client_keys(cfg(curve_server_keys=f"verifier={keys / 'verifier.key'}"),
                             "verifier")
    with pytest.raises(security.KeyFileError, match="peer=path"):
        security.parse_server_keys("verifier")
    good = cfg(curve_client_key=str(keys / "dispatcher.key_secret"),
               curve_server_keys=f"verifier={keys / 'verifier.key'}")
    assert security.client_keys(good, "verifier-1") == security.client_keys(good, "verifier")
    assert security.client_keys(good, "drafter") is None     # edge-local links stay plaintext
    assert security.server_keys(cfg()) is None
    # `tandem keys` refuses to overwrite a secret, and an allowlist takes public keys only
    r = subprocess.run([sys.executable, "-m", "stack.cli", "keys", "create", "verifier",
                        "--dir", str(keys)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "exists" in r.stderr
    with pytest.raises(security.KeyFileError, match="public keys"):
        security.allow(keys / "verifier.key_secret", tmp_path)


def test_client_id_is_the_curve_key(keys):
    """Two sockets of one CURVE client count as one client for the per-client limits."""
    async def body():
        ctx = zmq.asyncio.Context()
        server = security.ServerKeys(*security.load_secret(keys / "verifier.key_secret"),
                                     keys / "allowed")
        auth = security.start_authenticator(ctx, server)
        router = ctx.socket(zmq.ROUTER)
        security.apply_server(router, server)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = security.ClientKeys(*security.load_secret(keys / "dispatcher.key_secret"),
                                     server.public)
        ids = []
        for _ in range(2):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            security.apply_client(s, client)
            s.connect(f"tcp://127.0.0.1:{port}")
            await s.send(b"x")
            frames = await asyncio.wait_for(router.recv_multipart(copy=False), 10)
            ids.append((frames[0].bytes, security.client_id(frames[0].bytes, frames[1:])))
            s.close()
        router.close()
        auth.stop()
        ctx.term()
        return ids
    (ident_a, id_a), (ident_b, id_b) = asyncio.run(body())
    assert ident_a != ident_b and id_a == id_b
    assert id_a == "key:" + security.public_key_z85(keys / "dispatcher.key")


# ------------------------------------------------------------------------------- loopback

def _listening(port: int) -> set[str]:
    """Local addresses listening on `port` (from /proc/net/tcp and tcp6)."""
    out = set()
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            addr, p = f[1].split(":")
            if int(p, 16) == port and f[3] == "0A":   # LISTEN
                if width == 8:
                    out.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    out.add("v6:" + addr)
    return out


def test_ports_bound_to_loopback_unless_configured(env):
    c, _ = env
    for name, p in c.procs.items():
        assert _listening(p.http_port) == {"127.0.0.1"}, name
        assert _listening(int(p.endpoint.rsplit(":", 1)[1])) == {"127.0.0.1"}, name
    # the defaults, as a deployment would get them
    d = load(ServiceConfig, "verifier", [])
    assert d.http_host == "127.0.0.1" and d.bind.startswith("tcp://127.0.0.1:")

    # configured: an HTTP port on every interface
    async def body():
        svc = Service(ServiceConfig(bind=f"tcp://127.0.0.1:{free_port()}", http_host="0.0.0.0",
                                    http_port=0))
        task = asyncio.get_running_loop().create_task(svc.serve())
        while not svc.ready:
            await asyncio.sleep(0.01)
        try:
            return _listening(svc.http_port)
        finally:
            svc.stop()
            await asyncio.wait_for(task, 5)
    assert asyncio.run(body()) == {"0.0.0.0"}
    rel.record("security", "ports bound to loopback", http="127.0.0.1 by default "
               "(0.0.0.0 only when configured)", zmq="127.0.0.1 by default",
               services_checked=sorted(c.procs))


# --------------------------------------------------------------------------- client limits

def test_per_client_limits(env, tokenizer):
    c, _ = env
    ids = tokenizer.encode(PROMPTS["plain"])
    with Client(c.endpoint("dispatcher"), timeout_s=120) as a, \
            Client(c.endpoint("dispatcher"), timeout_s=120) as b:
        with pytest.raises(InvalidRequest) as e:
            a.complete(ids, max_tokens=200, stop_at_eos=False)     # alone over 120 tokens
        assert e.value.code == "too_large"
        stream = a.generate(ids, max_tokens=40, stop_at_eos=False)
        next(stream)                                                # a has one in flight
        # no retries: the client's backoff (0.5 s, then 1 s) can outlast a's 40 tokens, and
        # the retry is then served
        with pytest.raises(Busy) as e2:
            a.complete(ids, max_tokens=4, stop_at_eos=False, max_retries=0)
        assert "per-client limit" in e2.value.message
        r = b.complete(ids, max_tokens=4, stop_at_eos=False)        # another client: served
        assert len(r.token_ids) == 4
        rest = list(stream)
        assert rest
        r2 = a.complete(ids, max_tokens=4, stop_at_eos=False)       # a's slot is free again
        assert len(r2.token_ids) == 4
    rel.record("security", "per-client limits", client_max_sessions=1, client_max_tokens=120,
               over_tokens=e.value.code, over_sessions=e2.value.code,
               other_client="served", after_release="served")
