"""servewatch's exceptions, in one tree.

Exceptions are for bad configuration, bad input and programmer errors; what goes wrong with a
target during an incident crosses the bus as an :class:`~agent.events.Outcome`, never as one of
these. The tree::

    ServewatchError
    ├── SdkCallError            a control-socket call failed; .outcome sorts it
    ├── ManifestError           a manifest.json that is not JSON, not a manifest, or of an unknown
    │                           version (also a ValueError)
    └── BundleError             an incident bundle cannot be read (timeline, report)
        ├── BundleNotFoundError     no such incident, folder or manifest
        └── BundleCorruptError      its manifest does not read (the ManifestError's line)

Imports only the standard library (the SDK, inside a server, may import it too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.events import Outcome

__all__ = [
    "BundleCorruptError",
    "BundleError",
    "BundleNotFoundError",
    "ManifestError",
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


class ManifestError(ServewatchError, ValueError):
    """A manifest cannot be read (:func:`agent.manifest.load_manifest`): not JSON, not a
    servewatch incident manifest, or a version this servewatch cannot read. The message is one
    line naming the file (when there is one) and the problem."""


class BundleError(ServewatchError):
    """An incident bundle cannot be read (:func:`exporters.bundle.load_incident`); the message is
    one line naming the path and the reason."""


class BundleNotFoundError(BundleError):
    """No such incident, directory or manifest."""


class BundleCorruptError(BundleError):
    """The manifest exists but is not a servewatch incident manifest this servewatch reads."""
