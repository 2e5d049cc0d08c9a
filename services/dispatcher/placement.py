"""Where a new cloud session goes: replica discovery and least-outstanding-work placement.

Pure logic (no sockets, no clock): the dispatcher's `Replicas` (services/dispatcher/recovery.py)
feeds it what the replicas report and what this dispatcher placed, and asks it for a replica.

Discovery. A replica list is comma-separated targets, each either an endpoint
(`tcp://10.0.0.5:5551`) or a DNS name whose every A/AAAA record is a replica
(`dns+tcp://verifier.tandem.svc.cluster.local:5551`: a Kubernetes headless Service resolves to
one record per ready pod). `resolve` expands the list; the dispatcher re-resolves it every
`discovery_s` and `diff` says which replicas appeared and which went away.

Placement. Every replica reports its load in each heartbeat reply (Pong: sessions held, tokens
queued for a forward, KV bytes; `admitting` is False while it drains). A new session goes to the
replica with the least outstanding work — sessions first, then queued tokens, then KV bytes —
among those up and admitting. A report is up to one heartbeat old, so the sessions this
dispatcher placed since a replica's last report are added to it (`Estimate`); ties go to the
replica after the one chosen last (taking turns), so a burst of sessions from several
dispatchers spreads instead of piling onto the replica that looked emptiest a moment ago. A
session then stays on its replica for its life (its KV cache lives there); only a failure or a
drain moves it, by a replay.

Affinity. A conversation's next turn re-sends the turns before it, whose KV the replica that
served them holds in its prefix cache. `Affinity` remembers, by a hash chain over whole blocks
of tokens, which replica last held each prefix; among the replicas tied for the fewest
sessions, a new session goes to the one holding its longest remembered prefix. Only ties are
broken this way, so placement balances exactly as without it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable
from urllib.parse import urlsplit

DNS_SCHEME = "dns+tcp://"


@dataclass(frozen=True)
class Report:
    """One replica's load as it last reported it (a Pong), or zeros before any report."""
    sessions: int = 0
    queued_tokens: int = 0
    kv_bytes: int = 0
    admitting: bool = True


@dataclass
class Estimate:
    """One replica as placement sees it."""
    name: str
    up: bool                 # answering heartbeats and ready
    report: Report
    placed: int = 0          # sessions this dispatcher holds on it now
    placed_at_report: int = 0  # ... when the report was taken (its sessions include those)
    suspect: bool = False    # refused a session since its last report (draining, restarting)

    @property
    def eligible(self) -> bool:
        return self.up and self.report.admitting and not self.suspect

    def sessions(self) -> int:
        """Sessions it holds now, as best known: the report, plus this dispatcher's placements
        since (never below this dispatcher's own count)."""
        since = self.placed - self.placed_at_report
        return max(self.placed, self.report.sessions + since)

    def work(self) -> tuple[int, int, int]:
        """Outstanding work, compared lexicographically: sessions, queued tokens, KV bytes."""
        return self.sessions(), self.report.queued_tokens, self.report.kv_bytes


def choose(replicas: list[Estimate], turn: int = 0, prefer: str | None = None) -> int | None:
    """Index of the eligible replica with the least outstanding work; among equals, the first
    at or after `turn` (cyclically), or `prefer` (the replica holding the session's prefix)
    when it holds no more sessions than that one. None when no replica is eligible."""
    n = len(replicas)
    best, best_key = None, None
    for k in range(n):
        i = (turn + k) % n
        r = replicas[i]
        if not r.eligible:
            continue
        key = r.work()
        if best_key is None or key < best_key:
            best, best_key = i, key
    if best is not None and prefer is not None:
        for i, r in enumerate(replicas):
            if r.name == prefer and r.eligible and r.sessions() <= replicas[best].sessions():
                return i
    return best


class Affinity:
    """Which replica last held each prefix of the token sequences its sessions ended with, by a
    hash chain over whole `block`-token blocks (the last `entries` blocks remembered, least
    recently used forgotten first)."""

    def __init__(self, block: int = 64, entries: int = 1 << 16):
        self.block = block
        self.entries = entries
        self.where: OrderedDict[int, str] = OrderedDict()   # chain hash -> replica name

    def _chain(self, tokens: list[int]) -> list[int]:
        out, h = [], 0
        for k in range(len(tokens) // self.block):
            h = hash((h, tuple(tokens[k * self.block:(k + 1) * self.block])))
            out.append(h)
        return out

    def remember(self, tokens: list[int], replica: str) -> None:
        for h in self._chain(tokens):
            self.where[h] = replica
            self.where.move_to_end(h)
        while len(self.where) > self.entries:
            self.where.popitem(last=False)

    def lookup(self, tokens: list[int]) -> tuple[str | None, int]:
        """The replica holding the longest remembered prefix of `tokens`, and its length."""
        chain = self._chain(tokens)
        for k in range(len(chain) - 1, -1, -1):
            replica = self.where.get(chain[k])
            if replica is not None:
                return replica, (k + 1) * self.block
        return None, 0


def imbalance(sessions: Iterable[int]) -> int:
    """Most sessions on one replica minus fewest on another (the balance goal: < 2)."""
    s = list(sessions)
    return max(s) - min(s) if s else 0


# --- discovery ---------------------------------------------------------------------------------
Lookup = Callable[[str, int], list[str]]


def dns_lookup(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (all A and AAAA records), as the system resolver
    returns them."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def _endpoint(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"tcp://[{host}]:{port}"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


def targets(spec: str) -> list[str]:
    """The comma-separated targets of a replica list, validated; raises ValueError naming a
    malformed one."""
    out = [t.strip() for t in spec.split(",") if t.strip()]
    for t in out:
        if t.startswith(DNS_SCHEME):
            parts = urlsplit("tcp://" + t[len(DNS_SCHEME):])
            if not parts.hostname or parts.port is None:
                raise ValueError(f"{t!r}: a DNS target is dns+tcp://NAME:PORT")
        elif "://" not in t:
            raise ValueError(f"{t!r}: a replica is an endpoint (tcp://HOST:PORT, ipc://PATH) or "
                             f"dns+tcp://NAME:PORT")
    return out


def is_dynamic(spec: str) -> bool:
    """Whether a replica list names DNS targets (and so needs refreshing)."""
    return any(t.startswith(DNS_SCHEME) for t in targets(spec))


def resolve(spec: str, lookup: Lookup = dns_lookup) -> list[str]:
    """The endpoints a replica list stands for, in a stable order, each once. A DNS target that
    does not resolve (no pod ready yet) contributes none; the others still count."""
    out: list[str] = []
    for t in targets(spec):
        if t.startswith(DNS_SCHEME):
            parts = urlsplit("tcp://" + t[len(DNS_SCHEME):])
            try:
                addrs = lookup(parts.hostname, parts.port)
            except OSError:
                addrs = []
            eps = sorted({_endpoint(a, parts.port) for a in addrs})
        else:
            eps = [t]
        out += [e for e in eps if e not in out]
    return out


def diff(current: list[str], resolved: list[str]) -> tuple[list[str], list[str]]:
    """(appeared, gone): endpoints to add and endpoints to retire."""
    return ([e for e in resolved if e not in current], [e for e in current if e not in resolved])
