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
from typing import Literal
from pathlib import Path

import yaml

from common.protocol import Limits


def setting(default=dataclasses.MISSING, help: str = "", *, factory=None, ge=None, gt=None,
            le=None, lt=None):
    """A config field: its default, the help text `--help` shows, and its range (checked when a
    config is made, from whatever source: a bad value never reaches a service). Choices are the
    field's type: `Literal["fifo", "cascade"]`."""
    rules = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    meta = {"help": help, "rules": rules}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ServiceConfig:
    """Fields every service has."""
    bind: str = setting("", "ZMQ ROUTER endpoint to bind; \"\" = the service's default port on 127.0.0.1")
    http_host: str = setting("127.0.0.1", "/metrics, /healthz, /readyz; loopback unless configured")
    http_port: int = setting(-1, "-1 = the service's default port; 0 = ephemeral", ge=-1, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = setting("info", "log verbosity")
    threads: int = setting(
        0, "torch/llama threads; 0 = as planned by `tandem up` / `tandem serve` (common/resources.py)", ge=0)
    cpus: str = setting(
        "", "cores to run on, e.g. 0-3,6; \"\" = as planned (applied by `tandem up` / `tandem serve`)")
    heartbeat_s: float = setting(2.0, "interval between heartbeats to peers", gt=0)
    peer_timeout_s: float = setting(6.0, "a peer silent this long is marked down", gt=0)
    peer_idle_timeout_s: float = setting(
        30.0,
        "sessions of a client (ZMQ identity) silent this long, heartbeats included, are dropped; 0 = "
        "never", ge=0)
    max_sessions: int = setting(256, "sessions held at once; more are answered `busy`", ge=1)
    max_header_bytes: int = setting(64 * 1024, "wire limit: header frame", ge=1024)
    max_frame_bytes: int = setting(64 * 1024 * 1024, "wire limit: one tensor frame", ge=1)
    max_frames: int = setting(8, "wire limit: frames per message", ge=1)
    max_tokens: int = setting(4096, "wire limit: token ids per message", ge=1)
    max_prompt_tokens: int = setting(8192, "longest prompt a session may open with", ge=1)
    max_constraint_bytes: int = setting(
        32 * 1024, "longest output constraint (a JSON schema, a regex) a request may carry; it "
        "travels in the header (max_header_bytes)", ge=1)
    handshake_s: float = setting(
        30.0, "a peer that has not finished the ZMQ handshake by then is dropped", gt=0)
    drain_s: float = setting(
        10.0, "on SIGTERM: not ready, no new sessions, this long for open ones to finish; the rest "
        "are handed back (`unavailable`, replayed elsewhere), then exit; 0 = exit at once", ge=0)
    # --- CURVE on ZMQ links (common/security.py; keys from `tandem keys`); empty = plaintext ---
    curve_secret_key: str = setting("", "this service's NAME.key_secret: bind as a CURVE server")
    curve_allow_dir: str = setting("", "directory of client public keys (NAME.key) allowed to connect")
    curve_client_key: str = setting("", "this service's NAME.key_secret, used when dialling CURVE peers")
    curve_server_keys: str = setting("", "peer=NAME.key,... public key of each peer that runs CURVE")

    def __post_init__(self) -> None:
        check(self)   # a value out of range is refused when the config is made, whatever made it
    allow_plaintext: bool = setting(
        False, "bind beyond loopback without CURVE (logged as a warning at start-up); off = such a "
        "bind is refused")

    def limits(self) -> Limits:
        return Limits(max_header_bytes=self.max_header_bytes, max_frame_bytes=self.max_frame_bytes,
                      max_frames=self.max_frames, max_tokens=self.max_tokens,
                      max_prompt_tokens=self.max_prompt_tokens,
                      max_constraint_bytes=self.max_constraint_bytes)


@dataclass
class ModelServiceConfig(ServiceConfig):
    """Fields of every service that runs the target model (verifier, prefix, suffix)."""
    target: str = setting("bundled", "HF model directory of the target, or \"bundled\"")
    dtype: Literal["float32", "bfloat16", "float16"] = setting(
        "float32", "compute dtype (float16 and bfloat16 on a GPU)")
    device: str = setting(
        "cpu", "cpu | cuda | cuda:N — weights and KV caches there (an error if torch has no such GPU)")
    # the KV budget and prefix cache (common/prefix_cache.py)
    kv_budget_bytes: int = setting(
        0, "bytes of KV cache for live sessions and cached prefixes together; a session that "
        "cannot fit is refused with busy; 0 = half the memory left after the weights load", ge=0)
    prefix_cache: bool = setting(
        True, "keep finished sessions' KV (prompt + output) and reuse it for prompts that start "
        "with the same tokens (exact: only where the runner's rows do not depend on chunking)")
    kv_reserve_tokens: int = setting(
        1024, "KV rows a session reserves past its prompt when its open does not say how many "
        "tokens it may generate", ge=1)


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


_RULES = {"ge": (lambda x, b: x >= b, ">="), "gt": (lambda x, b: x > b, ">"),
          "le": (lambda x, b: x <= b, "<="), "lt": (lambda x, b: x < b, "<")}


def check(cfg, prefix: str = "") -> None:
    """Every field of `cfg` (and of its sections) in its range and among its choices; else
    ValueError naming the field as its flag and environment spell it."""
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        value, name = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check(value, name + "_")
            continue
        choices = _choices(hints[f.name])
        if choices and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
        for rule, bound in f.metadata.get("rules", {}).items():
            ok, sign = _RULES[rule]
            if isinstance(value, (int, float)) and not ok(value, bound):
                raise ValueError(f"{name} must be {sign} {bound}, got {value}")


def _choices(tp) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ()


def _convert(tp, value):
    """Convert a string (env/CLI) or YAML value to the field's type."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        tp = args[0]
    if origin is typing.Literal:
        kinds = {type(c) for c in typing.get_args(tp)}
        return _convert(kinds.pop(), value) if len(kinds) == 1 else value
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


def settings(cls: type, prefix: str = "") -> dict[str, tuple[tuple[str, ...], object, dict]]:
    """Every setting of a config class by its flat name (`spec_r1` for field `r1` of section
    `spec`): (path of field names, type, field metadata). Flags, environment variables and flat
    YAML keys use the flat name; YAML may also nest a section (`spec: {r1: 0.9}`)."""
    hints = typing.get_type_hints(cls)
    out: dict = {}
    for f in fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            for flat, (path, sub_tp, meta) in settings(tp).items():
                out[f"{f.name}_{flat}"] = ((f.name, *path), sub_tp, meta)
        else:
            out[prefix + f.name] = ((f.name,), tp, f.metadata)
    return out


def _help(tp, meta) -> str:
    text = meta.get("help", "")
    choices = _choices(tp)
    if choices:
        text += f" [{' | '.join(map(str, choices))}]"
    rules = meta.get("rules", {})
    if rules:
        text += " [" + ", ".join(f"{_RULES[r][1]} {b}" for r, b in rules.items()) + "]"
    return text.replace("%", "%%")


def _build(cls: type, values: dict[tuple[str, ...], object]):
    """An instance of `cls` from {path: value}, sections built from their own paths."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            sub = {p[1:]: v for p, v in values.items() if p[0] == f.name}
            kw[f.name] = _build(hints[f.name], sub)
        elif (f.name,) in values:
            kw[f.name] = values[(f.name,)]
    return cls(**kw)


def load(cls: type, service: str, argv: list[str] | None = None, env: dict | None = None):
    """Build a `cls` config from YAML < env < CLI. Unknown keys anywhere are an error."""
    env = os.environ if env is None else env
    known = settings(cls)
    parser = argparse.ArgumentParser(prog=f"tandem serve {service}",
                                     description=f"Run the Tandem {service} service.")
    parser.add_argument("--config", help="YAML file of field: value")
    for flat, (_, tp, meta) in known.items():
        parser.add_argument("--" + flat.replace("_", "-"), dest=flat, default=None,
                            help=_help(tp, meta))
    args = parser.parse_args(argv)  # None = sys.argv[1:]

    values: dict = {}
    if args.config:
        data = yaml.safe_load(Path(args.config).read_text()) or {}
        hints = typing.get_type_hints(cls)
        sections = {f.name for f in fields(cls) if dataclasses.is_dataclass(hints[f.name])}

        def flatten(d: dict) -> dict:
            out = {}
            for k, v in d.items():
                if k in sections and isinstance(v, dict):     # nested: spec: {r1: 0.9}
                    out.update({f"{k}_{sk}": sv for sk, sv in v.items()})
                elif not isinstance(v, dict):                 # (a dict: another service's)
                    out[k] = v
            return out
        flat_data = flatten(data)
        if isinstance(data.get(service), dict):   # a file for several services: ours wins
            flat_data.update(flatten(data[service]))
        unknown = set(flat_data) - set(known)
        if unknown:
            raise SystemExit(f"{args.config}: unknown {service} settings {sorted(unknown)}")
        values.update(flat_data)
    for flat in known:
        for key in (f"TANDEM_{flat.upper()}", f"TANDEM_{service.upper()}_{flat.upper()}"):
            if key in env:
                values[flat] = env[key]
    for flat in known:
        if getattr(args, flat) is not None:
            values[flat] = getattr(args, flat)
    converted = {}
    for flat, v in values.items():
        path, tp, _ = known[flat]
        try:
            converted[path] = _convert(tp, v)
        except ValueError as e:
            raise SystemExit(f"bad {service} setting {flat.replace('_', '-')}: {e}") from None
    try:
        cfg = _build(cls, converted)
    except ValueError as e:
        raise SystemExit(f"bad {service} setting: {e}") from None
    if isinstance(cfg, ServiceConfig):
        zmq_port, http_port = DEFAULT_PORTS.get(service, (0, 0))
        if not cfg.bind:
            cfg.bind = f"tcp://127.0.0.1:{zmq_port}"
        if cfg.http_port < 0:
            cfg.http_port = http_port
    return cfg


def as_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


__all__ = ["ServiceConfig", "ModelServiceConfig", "DEFAULT_PORTS", "default_endpoint", "load", "as_dict", "field",
           "setting", "settings", "check"]
