"""The dispatcher's modes: each is a `Mode`, found by its name in the request.

A mode checks its own request fields before the request is admitted (`validate`: a bad cut or
policy is refused like any other bad field, never admitted nor counted), names the policy its
metrics carry, and runs one admitted request to its end (`run`), emitting tokens through
`Request.emit`. Per-dispatcher state a mode needs (spec's link model and tuners) lives on its
Mode object, made once per dispatcher by `make_modes`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from common import protocol
from services.dispatcher.cloud_only import CloudOnly
from services.dispatcher.spec.mode import Spec
from services.dispatcher.split_mode import Split

if TYPE_CHECKING:
    from services.dispatcher.config import DispatcherConfig
    from services.dispatcher.request import Request
    from services.dispatcher.service import Dispatcher


class Mode(Protocol):
    name: str                      # what GenerateRequest.mode says
    policies: tuple[str, ...]      # the policy label values its metrics may carry

    def validate(self, d: Dispatcher, msg: protocol.GenerateRequest) -> None:
        """Raise ProtocolError (bad_field, naming the field) for a request this mode refuses."""

    def policy(self, d: Dispatcher, msg: protocol.GenerateRequest) -> str:
        """The policy label of an admitted request."""

    async def run(self, req: Request) -> None:
        """Serve the request until it is done (tokens through `req.emit`)."""


def make_modes(cfg: DispatcherConfig) -> dict[str, Mode]:
    modes: list[Mode] = [CloudOnly(), Spec(cfg), Split()]
    return {m.name: m for m in modes}
