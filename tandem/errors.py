"""Typed exceptions of the SDK, one per stable error code family (common/protocol.py)."""

from __future__ import annotations

from common import protocol
from common.errors import TandemError

__all__ = ["TandemError", "InvalidRequest", "Busy", "DeadlineExceeded", "Cancelled",
           "Unavailable", "ServerError", "error_from_code"]


class InvalidRequest(TandemError):
    """The request was malformed or out of range (bad_field, too_large, bad_frame, ...)."""


class Busy(TandemError):
    """The service is over capacity; retry later."""


class DeadlineExceeded(TandemError):
    """The request's deadline passed before it finished."""


class Cancelled(TandemError):
    """The request was cancelled."""


class Unavailable(TandemError):
    """A service the request needs is down or unreachable."""


class ServerError(TandemError):
    """A bug on the server side (internal)."""


_BY_CODE = {
    protocol.BUSY: Busy,
    protocol.DEADLINE: DeadlineExceeded,
    protocol.CANCELLED: Cancelled,
    protocol.UNAVAILABLE: Unavailable,
    protocol.INTERNAL: ServerError,
}


def error_from_code(code: str, message: str, field: str = "",
                    retry_after_s: float = 0.0) -> TandemError:
    return _BY_CODE.get(code, InvalidRequest)(code, message, field, retry_after_s)
