"""The ports an ephemeral cluster (tests, fuzzing) gives its services: stack/launcher.free_port."""

from __future__ import annotations

import socket

from stack import launcher


def test_ports_come_from_below_the_kernels_ephemeral_range_once_each():
    """Outgoing connections take their source ports from the ephemeral range; a listening
    port picked there could be taken by one before the service binds it (a CI failure)."""
    lo, _ = launcher._ephemeral_range()
    ports = [launcher.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < lo for p in ports), (lo, min(ports), max(ports))


def test_a_port_in_use_is_skipped(monkeypatch):
    lo, _ = launcher._ephemeral_range()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        held.listen()
        free = next(p for p in range(lo - 1, 1024, -1)
                    if p not in launcher._handed_out and _bindable(p))
        picks = iter([busy, free])

        class Dice:
            def randrange(self, a, b):
                return next(picks)

        monkeypatch.setattr(launcher, "_rng", Dice())
        assert launcher.free_port() == free


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
