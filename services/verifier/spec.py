"""Speculative-mode sessions on the verifier (DESIGN.md §3)."""


def install(service) -> None:
    """Register the speculative-mode handlers on the verifier service."""
