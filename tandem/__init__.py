"""Tandem: one LLM served across an edge device and a cloud GPU. This package is the client SDK
(the `tandem` command line lives in stack/cli.py)."""

from importlib.metadata import PackageNotFoundError, version

from common.protocol import Constraint
from tandem.client import DEFAULT_ENDPOINT, AsyncClient, AsyncStream, Chunk, Client, Result, Stream
from tandem.errors import (Busy, Cancelled, DeadlineExceeded, InvalidRequest, ServerError,
                           TandemError, Unavailable)
from tandem.stats import Stats

try:
    __version__ = version("tandem")   # the installed distribution's (pyproject.toml)
except PackageNotFoundError:          # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["Client", "AsyncClient", "Constraint", "Stream", "AsyncStream", "Chunk", "Result", "Stats",
           "DEFAULT_ENDPOINT", "TandemError", "InvalidRequest", "Busy", "DeadlineExceeded", "Cancelled", "Unavailable",
           "ServerError", "__version__"]
