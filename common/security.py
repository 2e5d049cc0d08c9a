"""Who may talk to a service, and how much one client may ask of the dispatcher.

CURVE (ZMQ's elliptic-curve encryption + authentication, RFC 26) guards the edge–cloud links:
a cloud service (verifier, suffix) binds as a CURVE *server* with its secret key and lets in only
clients whose public key is in an allowlist directory, checked by ZMQ's ZAP handler
(`zmq.auth`'s asyncio authenticator) during the handshake — an unknown key never completes the
handshake, so none of its messages reach a handler. The edge side (dispatcher) connects as a
CURVE *client* with its own key pair and the server's public key. Keys are the files
`tandem keys` writes (zmq.auth.create_certificates): NAME.key (public) and NAME.key_secret
(public + secret, mode 0600).

Configuration (common/config.py, every service; all empty = plaintext, as before):
    curve_secret_key   this service's NAME.key_secret: bind as a CURVE server
    curve_allow_dir    directory of client NAME.key files allowed in (required with the above)
    curve_client_key   this service's NAME.key_secret, used when dialling CURVE peers
    curve_server_keys  "peer=path/to/peer.key,..." public key of each peer that runs CURVE;
                       replicas ("verifier-1") fall back to their role's key ("verifier")

`ClientQuota` caps what one client may hold at the dispatcher at once: requests in flight
(`busy` beyond) and tokens in flight, prompt + max_tokens (`too_large` for one request that
alone exceeds it, `busy` when the client's other requests leave no room).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from common import protocol
from common.protocol import ProtocolError

ZAP_DOMAIN = "tandem"
log = logging.getLogger("tandem.security")


class KeyFileError(ValueError):
    """A key file is missing, unreadable or of the wrong kind (a config error, not a bug)."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes      # z85, 40 bytes
    secret: bytes
    allow_dir: Path    # client public keys allowed in


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


# ----------------------------------------------------------------------------------- key files

def create_keys(directory: str | Path, name: str, force: bool = False) -> tuple[Path, Path]:
    """Write DIR/NAME.key and DIR/NAME.key_secret; refuse to overwrite a secret unless forced."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    secret = directory / f"{name}.key_secret"
    if secret.exists() and not force:
        raise KeyFileError(f"{secret} exists (use --force to replace it)")
    old_umask = os.umask(0o077)  # the secret is never readable by others, not even briefly
    try:
        public_file, secret_file = zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(old_umask)
    os.chmod(public_file, 0o644)
    return Path(public_file), Path(secret_file)


def allow(public_key_file: str | Path, allow_dir: str | Path) -> Path:
    """Add a client's public key to an allowlist directory."""
    allow_dir = Path(allow_dir)
    allow_dir.mkdir(parents=True, exist_ok=True)
    src = Path(public_key_file)
    if src.suffix != ".key":
        raise KeyFileError(f"{src}: an allowlist holds public keys (NAME.key), not secret ones")
    load_public(src)
    return Path(shutil.copy(src, allow_dir / src.name))


def load_secret(path: str | Path) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise KeyFileError(f"cannot read key pair {path}: {e}") from None
    if not secret:
        raise KeyFileError(f"{path} holds no secret key (pass NAME.key_secret, not NAME.key)")
    return public, secret


def load_public(path: str | Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise KeyFileError(f"cannot read public key {path}: {e}") from None
    return public


def public_key_z85(path: str | Path) -> str:
    return load_public(path).decode("ascii")


# ------------------------------------------------------------------------------- from config

def server_keys(cfg) -> ServerKeys | None:
    """The service's CURVE server keys, or None for a plaintext bind."""
    if not cfg.curve_secret_key:
        if cfg.curve_allow_dir:
            raise KeyFileError("curve_allow_dir is set but curve_secret_key is not")
        return None
    if not cfg.curve_allow_dir:
        raise KeyFileError("curve_secret_key needs curve_allow_dir: the public keys of the clients "
                        "allowed in (an empty directory lets nobody in)")
    allow_dir = Path(cfg.curve_allow_dir)
    if not allow_dir.is_dir():
        raise KeyFileError(f"curve_allow_dir {allow_dir} is not a directory")
    public, secret = load_secret(cfg.curve_secret_key)
    return ServerKeys(public, secret, allow_dir)


LOOPBACK = ("127.", "localhost", "::1", "[::1]")


def bind_is_local(endpoint: str) -> bool:
    """Whether a ZMQ bind endpoint is reachable from this host only (loopback, ipc, inproc)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return scheme in ("ipc", "inproc")
    host = rest.rsplit(":", 1)[0]
    return host.startswith(LOOPBACK)


def check_plaintext(cfg, service: str) -> None:
    """Secure by default across hosts: a service that binds beyond loopback runs CURVE, or says
    explicitly that it accepts plaintext (`allow_plaintext`), which is logged as a warning.
    Raises KeyFileError (a configuration error) otherwise."""
    if cfg.curve_secret_key or bind_is_local(cfg.bind):
        return
    if cfg.allow_plaintext:
        log.warning("%s binds %s in PLAINTEXT (allow_plaintext): anyone who can reach it can use "
                    "it and read its traffic; use CURVE keys across hosts (docs/deploy.md, "
                    "Security)", service, cfg.bind)
        return
    raise KeyFileError(f"{service} would bind {cfg.bind} in plaintext, reachable from other "
                       f"hosts: create CURVE keys (`tandem keys create ...`) and set "
                       f"curve_secret_key and curve_allow_dir, or set allow_plaintext=true "
                       f"(TANDEM_ALLOW_PLAINTEXT) to accept an unauthenticated link "
                       f"(docs/deploy.md, Security)")


def parse_server_keys(text: str) -> dict[str, str]:
    """"verifier=a.key,suffix=b.key" -> {"verifier": "a.key", "suffix": "b.key"}."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise KeyFileError(f"curve_server_keys: expected peer=path, got {item!r}")
        out[name.strip()] = path.strip()
    return out


def client_keys(cfg, peer: str) -> ClientKeys | None:
    """Keys for dialling `peer` (a name like "verifier" or the replica "verifier-1"), or None
    when that peer is not configured for CURVE."""
    servers = parse_server_keys(cfg.curve_server_keys)
    path = servers.get(peer) or servers.get(peer.rsplit("-", 1)[0])
    if path is None:
        return None
    if not cfg.curve_client_key:
        raise KeyFileError(f"curve_server_keys names {peer} but curve_client_key is not set")
    public, secret = load_secret(cfg.curve_client_key)
    return ClientKeys(public, secret, load_public(path))


# ------------------------------------------------------------------------------------ sockets

def apply_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def apply_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def start_authenticator(ctx: zmq.Context, keys: ServerKeys):
    """ZAP handler on the running asyncio loop: a CURVE client is let in only if its public key
    is a *.key file in the allowlist directory (read once, at start)."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    auth = AsyncioAuthenticator(ctx, log=logging.getLogger("tandem.security.zap"))
    auth.start()
    auth.configure_curve(domain=ZAP_DOMAIN, location=str(keys.allow_dir))
    n = len(list(keys.allow_dir.glob("*.key")))
    if n == 0:
        log.warning("CURVE allowlist %s is empty: no client can connect", keys.allow_dir)
    else:
        log.info("CURVE on; %d client key(s) allowed from %s", n, keys.allow_dir)
    return auth


def client_id(ident: bytes, frames: list, on_behalf: str = "",
              delegates: frozenset[str] = frozenset()) -> str:
    """Who a request counts against: its sender's CURVE public key when the socket
    authenticates clients (one key = one client, however many sockets it opens), else its ZMQ
    routing identity. A sender that names an end client (`on_behalf`, an API gateway's key
    identity) gets "<sender>/<end client>": one sub-client per end client, each with its own
    limits. Over CURVE only senders whose key is in `delegates` may do that (else one key could
    escape its own limits by naming new end clients); in plaintext any sender may, which gives
    it nothing it lacks already (a new socket is a new identity)."""
    sender = None
    if frames and isinstance(frames[0], zmq.Frame):
        try:
            user = frames[0].get("User-Id")
        except zmq.ZMQError:
            user = None
        if user:
            sender = f"key:{user}"
            if on_behalf and user not in delegates:
                raise ProtocolError(protocol.BAD_FIELD,
                                    "client: this client's CURVE key may not send requests for "
                                    "end clients (not in the dispatcher's client_delegates)",
                                    field="client")
    sender = sender or f"id:{ident.hex()}"
    return f"{sender}/{on_behalf}" if on_behalf else sender


def load_delegates(text: str) -> frozenset[str]:
    """client_delegates "a.key,b.key" -> the z85 public keys allowed to name end clients."""
    try:
        return frozenset(public_key_z85(p.strip()) for p in text.split(",") if p.strip())
    except KeyFileError as e:
        raise KeyFileError(f"client_delegates: {e}") from None


# ------------------------------------------------------------------------------ client quotas

class ClientQuota:
    """Per-client limits at the dispatcher; 0 = no limit."""

    def __init__(self, max_sessions: int = 0, max_tokens: int = 0):
        self.max_sessions = max_sessions   # requests one client may have in flight
        self.max_tokens = max_tokens       # prompt + max_tokens summed over those requests
        self.sessions: dict[str, int] = {}
        self.tokens: dict[str, int] = {}

    def admit(self, client: str, tokens: int) -> None:
        """Reserve one session and `tokens` for `client`, or raise busy / too_large."""
        if self.max_tokens and tokens > self.max_tokens:
            raise ProtocolError(protocol.TOO_LARGE,
                                f"request needs {tokens} tokens (prompt + max_tokens) > "
                                f"per-client limit {self.max_tokens}")
        held = self.sessions.get(client, 0)
        if self.max_sessions and held >= self.max_sessions:
            raise ProtocolError(protocol.BUSY, f"client has {held} requests in flight "
                                               f"(per-client limit {self.max_sessions})")
        used = self.tokens.get(client, 0)
        if self.max_tokens and used + tokens > self.max_tokens:
            raise ProtocolError(protocol.BUSY, f"client has {used} tokens in flight; "
                                               f"{tokens} more exceed the per-client limit "
                                               f"{self.max_tokens}")
        self.sessions[client] = held + 1
        self.tokens[client] = used + tokens

    def release(self, client: str, tokens: int) -> None:
        left = self.sessions.get(client, 0) - 1
        if left <= 0:
            self.sessions.pop(client, None)
            self.tokens.pop(client, None)
        else:
            self.sessions[client] = left
            self.tokens[client] = self.tokens.get(client, 0) - tokens
