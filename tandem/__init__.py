"""Tandem: one LLM served across an edge device and a cloud GPU. This package is the client SDK
(and the `tandem` command line)."""

from tandem.client import DEFAULT_ENDPOINT, AsyncClient, Chunk, Client, Result
from tandem.errors import (Busy, Cancelled, DeadlineExceeded, InvalidRequest, ServerError,
                           TandemError, Unavailable)
from tandem.stats import Stats

__all__ = ["Client", "AsyncClient", "Chunk", "Result", "Stats", "DEFAULT_ENDPOINT", "TandemError",
           "InvalidRequest", "Busy", "DeadlineExceeded", "Cancelled", "Unavailable",
           "ServerError"]
