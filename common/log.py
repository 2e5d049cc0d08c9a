"""Logging that reads well in a terminal (colour, short) and is plain and greppable otherwise."""

from __future__ import annotations

import logging
import sys

_COLOURS = {"DEBUG": "\033[2m", "INFO": "\033[36m", "WARNING": "\033[33m", "ERROR": "\033[31m",
            "CRITICAL": "\033[1;31m"}


class _TTYFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        colour = _COLOURS.get(record.levelname, "")
        t = self.formatTime(record, "%H:%M:%S")
        msg = (f"\033[2m{t}\033[0m {colour}{record.levelname[0]}\033[0m "
               f"\033[1m{record.name}\033[0m {record.getMessage()}")
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return msg


def setup(service: str, level: str = "info") -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    if sys.stderr.isatty():
        handler.setFormatter(_TTYFormatter())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("asyncio", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(f"tandem.{service}")
