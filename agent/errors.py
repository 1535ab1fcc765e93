"""servewatch's exceptions, in one tree.

Exceptions are for bad configuration, bad input and programmer errors; what goes wrong with a
target during an incident crosses the bus as an :class:`~agent.events.Outcome`, never as one of
these. The tree::

    ServewatchError
    └── SdkCallError            a control-socket call failed; .outcome sorts it

Imports only the standard library (the SDK, inside a server, may import it too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.events import Outcome

__all__ = [
    "SdkCallError",
    "ServewatchError",
]


class ServewatchError(Exception):
    """Base of every servewatch exception; ``str()`` is one line."""


class SdkCallError(ServewatchError):
    """A control-socket call failed (:func:`agent.sdkclient.sdk_call`).

    Attributes:
        outcome: how it failed: ``NO_SUCH_PROCESS``, ``PERMISSION_DENIED``, ``TIMED_OUT`` or
            ``FAILED``.
        detail: one line saying why.
    """

    def __init__(self, outcome: Outcome, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail
