"""API keys: `Authorization: Bearer <key>` on the /v1 routes when any key is configured.

Keys come from `api_key` (comma-separated; `--api-key` may be given more than once) and
`api_keys_file` (one key per line; blank lines and `#` comments skipped). With none configured
the API is open, as before. A key is also a client identity: the gateway sends each request with
`end_client` = the key's fingerprint, so the dispatcher's per-client limits (client_max_sessions,
client_max_tokens) count one key's requests as one client, whoever holds the key and however
many connections it opens. The key itself never leaves the gateway (not on the wire, not in
logs, not in metrics).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path


class KeysError(ValueError):
    """A keys setting the gateway cannot start with."""


def fingerprint(key: str) -> str:
    """The identity a key stands for at the dispatcher: not the key, not reversible to it."""
    return "apikey-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _check(key: str, where: str) -> str:
    if not key.isprintable() or any(c.isspace() for c in key) or "," in key:
        raise KeysError(f"{where}: an API key is printable characters without spaces or commas")
    if len(key) < 8:
        raise KeysError(f"{where}: an API key of {len(key)} characters is too easy to guess "
                        f"(at least 8; `python -c 'import secrets; print(secrets.token_urlsafe())'`"
                        f" makes a good one)")
    return key


def load_keys(api_key: str, api_keys_file: str) -> list[str]:
    """Every configured key (duplicates dropped), checked; [] = the API is open."""
    keys = [_check(k.strip(), "api_key") for k in api_key.split(",") if k.strip()]
    if api_keys_file:
        path = Path(api_keys_file)
        try:
            text = path.read_text()
        except OSError as e:
            raise KeysError(f"api_keys_file {path}: {e.strerror or e}") from None
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(_check(line, f"api_keys_file {path} line {n}"))
        if not any(ln.strip() and not ln.strip().startswith("#") for ln in text.splitlines()):
            raise KeysError(f"api_keys_file {path} holds no key (an empty file would lock "
                            f"everyone out; leave the setting empty for an open API)")
    return list(dict.fromkeys(keys))


class Keys:
    """The configured keys, compared in constant time: every presented key is hashed and
    checked against every configured key's hash with hmac.compare_digest, without stopping at a
    match, so the time taken tells neither which key matched nor how much of one did."""

    def __init__(self, keys: list[str]):
        self._digests = [(hashlib.sha256(k.encode()).digest(), fingerprint(k)) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def identity(self, authorization: str | None) -> str | None:
        """The presented key's identity, or None when it is missing or matches no key."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        found = None
        for digest, ident in self._digests:
            if hmac.compare_digest(presented, digest):
                found = ident
        return found
