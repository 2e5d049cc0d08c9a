"""The one error type Tandem raises on purpose, on both ends of every link.

A `TandemError` carries a stable wire `code` (common/protocol.py: bad_field, busy, ...), a
`message` for people, and the `field` to blame when one field is (a dotted path such as
`sampling.temperature`). A service refuses a request with `ProtocolError` (common/protocol.py),
a peer's refusal or silence comes back as `PeerError` (common/runtime.py), and the SDK raises
one subclass per code family (tandem/errors.py) — all of them TandemErrors.
"""

from __future__ import annotations


class TandemError(Exception):
    def __init__(self, code: str, message: str, field: str = "", retry_after_s: float = 0.0):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s   # busy: when the sender expects room; 0 = no estimate


class ConfigurationError(Exception):
    """What a service was told to serve cannot be served (an unsupported model, a missing file):
    the service exits with this one line instead of a traceback."""
