"""servewatch's exceptions, in one tree.

Exceptions are for bad configuration, bad input and programmer errors; what goes wrong with a
target during an incident crosses the bus as an :class:`~agent.model.events.Outcome`, never as one of
these. Every message is one line; :attr:`ServewatchError.exit_code` is what the CLI exits with
when one reaches it (1 runtime failure, 2 usage error or invalid setting). The tree::

    ServewatchError                     exit 1
    ├── UsageError                      exit 2: a bad setting or command line
    │   ├── ConfigError (ValueError)        a setting is invalid; names every bad key
    │   ├── ExportConfigError (ValueError)  a telemetry setting or OTEL_* variable is invalid
    │   ├── TokenFileError (ValueError)     the API token file is missing, unsafe or empty
    │   ├── UnknownComponentError (KeyError) no registered watcher/actor/exporter has that name
    │   ├── UnsafeFolderError (OSError)     a folder root must not write into (another user's, a planted link)
    │   └── LaunchError                     the server command cannot be started (exit 126/127)
    ├── InputError (ValueError)         a file or header we read is not what it must be
    │   ├── ManifestError                   an incident manifest cannot be read
    │   ├── BundleError                     an incident bundle cannot be read
    │   │   ├── BundleNotFoundError             no such incident, folder or manifest
    │   │   └── BundleCorruptError              the manifest is not a readable servewatch manifest
    │   ├── TraceParentError                a W3C traceparent value is malformed
    │   └── TraceImportAborted              a trace file's import stopped by its budget (size, deadline, stop)
    ├── SdkCallError                    a control-socket call failed; .outcome sorts it
    ├── PeerRequestError                a peer agent gave no HTTP answer; .kind sorts it
    ├── BackendUnknownError             a URL's server is neither SGLang nor vLLM, or unreachable
    ├── SdkError                        raised by the in-process SDK into the server's code
    │   ├── ProfilerBusyError (RuntimeError)  a profiling session is already pending or running
    │   └── RingError (OSError)               a span ring file is missing, untrusted or not a ring
    └── DemoError (RuntimeError)        the demo server
        ├── DemoServerError                 it exited or was not ready in time (client side)
        └── StartupError                    a scheduler died or was not ready (server side)

The builtin second bases keep older ``except ValueError`` / ``except OSError`` callers working.
The classes are importable from the modules that raise them (``agent.runtime.settings.ConfigError``...)
as well as from here. Imports only the standard library: any layer, the SDK included, may
import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from agent.model.events import Outcome

__all__ = [
    "BackendUnknownError",
    "BundleCorruptError",
    "BundleError",
    "BundleNotFoundError",
    "ConfigError",
    "DemoError",
    "DemoServerError",
    "ExportConfigError",
    "InputError",
    "LaunchError",
    "ManifestError",
    "PeerRequestError",
    "ProfilerBusyError",
    "RingError",
    "SdkCallError",
    "SdkError",
    "ServewatchError",
    "StartupError",
    "TokenFileError",
    "TraceImportAborted",
    "TraceParentError",
    "UnknownComponentError",
    "UnsafeFolderError",
    "UsageError",
    "one_line",
]


def one_line(exc: BaseException) -> str:
    """``str(exc)`` on one line (whitespace runs, newlines included, become one space); the
    class name when the message is empty."""
    return " ".join(str(exc).split()) or type(exc).__name__


class ServewatchError(Exception):
    """Base of every servewatch exception; ``str()`` is one line."""

    #: The CLI's exit code when this error ends a command (:class:`agent.cli.app.ExitCode`).
    exit_code: ClassVar[int] = 1


# --- usage: bad settings or command line (exit 2) ------------------------------------------------


class UsageError(ServewatchError):
    """A bad setting or command line: the CLI prints one line and exits 2."""

    exit_code: ClassVar[int] = 2


class ConfigError(UsageError, ValueError):
    """A setting is invalid. ``str()`` is one line naming every bad key."""


class ExportConfigError(UsageError, ValueError):
    """A telemetry setting is invalid; the message names the setting (config key or env var)."""


class TokenFileError(UsageError, ValueError):
    """The API token file is missing, unsafe (not 0600, not ours, a symlink) or empty."""


class UnknownComponentError(UsageError, KeyError):
    """No component of this kind has that name. ``str()`` is one line listing the known names."""

    def __init__(self, kind: str, name: str, known: Sequence[str]) -> None:
        super().__init__(name)
        self.kind = kind
        self.name = name
        self.known = tuple(known)

    def __str__(self) -> str:
        return f"unknown {self.kind} {self.name!r}: expected one of {', '.join(self.known) or '(none registered)'}"


class UnsafeFolderError(UsageError, OSError):
    """A folder root must not write into (its one-line reason is ``str(exc)``): a component is
    owned by another user, a symlink another user planted, writable by others without the sticky
    bit, or not a folder (raised by :func:`agent.host.fsutil.open_trusted_dir`)."""


class LaunchError(UsageError):
    """The server command could not be started (a usage error, not a runtime failure).

    Attributes:
        exit_code: 127 when the command does not exist, 126 when it cannot be executed (as
            shells report it).
    """

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # per instance, unlike the others


# --- input: files and headers we read --------------------------------------------------------------


class InputError(ServewatchError, ValueError):
    """A file or header servewatch reads is not what it must be; the message names it."""


class ManifestError(InputError):
    """A manifest cannot be read (:func:`agent.host.manifest.load_manifest`): not JSON, not a
    servewatch incident manifest, or a version this servewatch cannot read. The message is one
    line naming the file (when there is one) and the problem."""


class BundleError(InputError):
    """An incident bundle cannot be read (:func:`agent.views.bundle.load_incident`); the message is
    one line naming the path and the reason."""


class BundleNotFoundError(BundleError):
    """No such incident, directory or manifest."""


class BundleCorruptError(BundleError):
    """The manifest exists but is not a servewatch incident manifest this servewatch reads."""


class TraceParentError(InputError):
    """A ``traceparent`` value is malformed (the message says which part)."""


class TraceImportAborted(InputError):
    """A trace file's import stopped by its budget: past its deadline, over its size cap, or
    cancelled (the agent stopping); a :class:`ValueError`, so callers treat it as a file that
    failed (raised by :mod:`exporters.mirror.torch_trace`)."""


# --- talking to servers and peers ------------------------------------------------------------------


class SdkCallError(ServewatchError):
    """A control-socket call failed (:func:`agent.host.sdkclient.sdk_call`).

    Attributes:
        outcome: how it failed: ``NO_SUCH_PROCESS``, ``PERMISSION_DENIED``, ``TIMED_OUT`` or
            ``FAILED``.
        detail: one line saying why.
    """

    def __init__(self, outcome: Outcome, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail


class PeerRequestError(ServewatchError):
    """A request to a peer agent did not get an HTTP answer.

    Attributes:
        kind: ``unreachable`` (no connection: refused, no route, TLS handshake refused) or
            ``bad_response`` (the peer answered something that is not HTTP, or too much).
        refused: the host at that address answered and refused (the connection, or the TLS
            handshake): no agent of the job listens there. ``False``: no answer at all (no route,
            a partition), or not known.
    """

    def __init__(self, kind: str, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.refused = refused


class BackendUnknownError(ServewatchError):
    """The server at a URL cannot be told to be SGLang or vLLM, or cannot be reached.

    Attributes:
        reachable: something answered (then ``--backend`` is the fix), else nothing did.
    """

    def __init__(self, message: str, *, reachable: bool) -> None:
        super().__init__(message)
        self.reachable = reachable


# --- the SDK, inside the server --------------------------------------------------------------------


class SdkError(ServewatchError):
    """Raised by the in-process SDK (:mod:`agent.sdk`) into the server's own code."""


class ProfilerBusyError(SdkError, RuntimeError):
    """A profiling session is already pending or running in this process (start refused)."""


class RingError(SdkError, OSError):
    """A ring file is missing, not ours to trust, or not a span ring."""


# --- the demo server -------------------------------------------------------------------------------


class DemoError(ServewatchError, RuntimeError):
    """The demo server (:mod:`agent.demo`) failed."""


class DemoServerError(DemoError):
    """The demo server exited or was not ready in time (message carries its stderr tail)."""


class StartupError(DemoError):
    """A scheduler died or did not report ready within ``startup_timeout_s``."""
