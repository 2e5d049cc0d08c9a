"""One configuration model for every service: dataclasses with commented defaults.

Precedence, lowest to highest: field default < YAML file (`--config PATH`, a map of field names,
optionally nested under the service's name) < environment `TANDEM_<FIELD>` (or
`TANDEM_<SERVICE>_<FIELD>`, which wins) < command-line flags `--field-name VALUE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from common.protocol import Limits


@dataclass
class ServiceConfig:
    """Fields every service has."""
    bind: str = ""                    # ZMQ ROUTER endpoint to bind; "" = the service's default port on 127.0.0.1
    http_host: str = "127.0.0.1"      # /metrics, /healthz, /readyz; loopback unless configured
    http_port: int = -1               # -1 = the service's default port; 0 = ephemeral
    log_level: str = "info"           # debug | info | warning | error
    threads: int = 0                  # torch/llama threads; 0 = as planned by `tandem up` / `tandem serve` (common/resources.py)
    cpus: str = ""                    # cores to run on, e.g. 0-3,6; "" = as planned (applied by `tandem up` / `tandem serve`)
    heartbeat_s: float = 2.0          # interval between heartbeats to peers
    peer_timeout_s: float = 6.0       # a peer silent this long is marked down
    peer_idle_timeout_s: float = 30.0  # sessions of a client (ZMQ identity) silent this long, heartbeats included, are dropped; 0 = never
    max_sessions: int = 256           # sessions held at once; more are answered `busy`
    max_header_bytes: int = 64 * 1024        # wire limit: header frame
    max_frame_bytes: int = 64 * 1024 * 1024  # wire limit: one tensor frame
    max_frames: int = 8                      # wire limit: frames per message
    max_tokens: int = 4096                   # wire limit: token ids per message
    max_prompt_tokens: int = 8192            # longest prompt a session may open with
    handshake_s: float = 30.0         # a peer that has not finished the ZMQ handshake by then is dropped
    drain_s: float = 10.0             # on SIGTERM: not ready, no new sessions, this long for open ones to finish; the rest are handed back (`unavailable`, replayed elsewhere), then exit
    # --- CURVE on ZMQ links (common/security.py; keys from `tandem keys`); empty = plaintext ---
    curve_secret_key: str = ""        # this service's NAME.key_secret: bind as a CURVE server
    curve_allow_dir: str = ""         # directory of client public keys (NAME.key) allowed to connect
    curve_client_key: str = ""        # this service's NAME.key_secret, used when dialling CURVE peers
    curve_server_keys: str = ""       # peer=NAME.key,... public key of each peer that runs CURVE
    allow_plaintext: bool = False     # bind beyond loopback without CURVE (logged as a warning at start-up); off = such a bind is refused

    def limits(self) -> Limits:
        return Limits(max_header_bytes=self.max_header_bytes, max_frame_bytes=self.max_frame_bytes,
                      max_frames=self.max_frames, max_tokens=self.max_tokens,
                      max_prompt_tokens=self.max_prompt_tokens)


# Default ports: ZMQ endpoint and HTTP (metrics) port of each service.
DEFAULT_PORTS = {
    "dispatcher": (5550, 9550),
    "verifier": (5551, 9551),
    "drafter": (5552, 9552),
    "prefix": (5553, 9553),
    "suffix": (5554, 9554),
}
API_PORT = 8000   # the OpenAI-compatible HTTP gateway (api/): HTTP only, no ZMQ endpoint


def default_endpoint(service: str, host: str = "127.0.0.1") -> str:
    return f"tcp://{host}:{DEFAULT_PORTS[service][0]}"


def _convert(tp, value):
    """Convert a string (env/CLI) or YAML value to the field's type."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        tp = args[0]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean, got {value!r}")
    if tp is float:   # a NaN or an infinity passes every range check after it: refused here
        x = float(value)
        if not math.isfinite(x):
            raise ValueError(f"expected a finite number, got {value!r}")
        return x
    if tp in (int, str):
        return tp(value)
    return value


def load(cls: type, service: str, argv: list[str] | None = None, env: dict | None = None):
    """Build a `cls` config from YAML < env < CLI. Unknown keys anywhere are an error."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    parser = argparse.ArgumentParser(prog=f"tandem serve {service}",
                                     description=f"Run the Tandem {service} service.")
    parser.add_argument("--config", help="YAML file of field: value")
    for f in fields(cls):
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            help=_field_help(cls, f.name))
    args = parser.parse_args(argv)  # None = sys.argv[1:]

    values: dict = {}
    if args.config:
        data = yaml.safe_load(Path(args.config).read_text()) or {}
        if service in data and isinstance(data[service], dict):
            data = {**{k: v for k, v in data.items() if not isinstance(v, dict)}, **data[service]}
        unknown = set(data) - names
        if unknown:
            raise SystemExit(f"{args.config}: unknown {service} settings {sorted(unknown)}")
        values.update(data)
    for name in names:
        for key in (f"TANDEM_{name.upper()}", f"TANDEM_{service.upper()}_{name.upper()}"):
            if key in env:
                values[name] = env[key]
    for name in names:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    converted = {}
    for k, v in values.items():
        try:
            converted[k] = _convert(hints[k], v)
        except ValueError as e:
            raise SystemExit(f"bad {service} setting {k.replace('_', '-')}: {e}") from None
    try:
        cfg = cls(**converted)
    except ValueError as e:
        raise SystemExit(f"bad {service} setting: {e}") from None
    if isinstance(cfg, ServiceConfig):
        zmq_port, http_port = DEFAULT_PORTS.get(service, (0, 0))
        if not cfg.bind:
            cfg.bind = f"tcp://127.0.0.1:{zmq_port}"
        if cfg.http_port < 0:
            cfg.http_port = http_port
    return cfg


def _field_help(cls, name: str) -> str:
    """The field's trailing comment in the source, so --help matches the dataclass."""
    import inspect  # noqa: PLC0415

    for klass in cls.__mro__:
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for line in src.splitlines():
            s = line.strip()
            if s.startswith(f"{name}:") and "#" in s:
                return s.split("#", 1)[1].strip()
    return ""


def as_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


__all__ = ["ServiceConfig", "DEFAULT_PORTS", "default_endpoint", "load", "as_dict", "field"]
