"""The SDK's local control socket: the agent asks a server process for status, profiles and
requests in flight.

Owns the unix-socket server and its JSON-lines protocol. Imports the standard library and the
SDK's own modules (:mod:`agent.sdk.profiler`, :mod:`agent.sdk.tracing`, :mod:`agent.sdk.exitnotice`:
:func:`serve_control` installs the death notice); never the agent side.
The server accepts in one daemon thread and serves each connection in its own short-lived
daemon thread (one deadline per connection), so a slow client never delays another; it never
touches torch: profile requests are queued for the model thread by :mod:`agent.sdk.profiler`.
``profile.start`` is bounded (:func:`check_profile_bounds`: steps, duration, and an output folder
that is the session folder the agent created, or one the server's operator allowed).

Security: the socket file is created with mode 0600 (chmod right after bind; the peer check
below covers the instant between) and every connection's peer uid is read with ``SO_PEERCRED``;
only this process's effective uid and root are served, others get one ``permission_denied``
reply and are disconnected.

Protocol: one JSON object per line each way; a reply echoes the request's ``id`` when given.

==================  ==========================================  ===================================
``cmd``             request fields                              reply (``ok: true``)
==================  ==========================================  ===================================
``status``          ``session_id`` (optional)                   ``pid``, ``forward_ct``,
                                                                ``profiler`` (profiler.status()),
                                                                ``inflight`` (count), ``session``
``profile.start``   :class:`~agent.sdk.profiler.ProfileRequest`  ``session_id``, ``session``
                    fields (``num_steps`` required)
``profile.stop``    -                                           ``status`` (``stopping`` |
                                                                ``stopped`` | ``already_stopped``),
                                                                ``session``
``inflight``        -                                           ``requests`` (tracing.inflight()),
                                                                ``completions``
                                                                (tracing.completions())
``fr_trace``        ``stack_traces`` (optional bool)            ``trace`` (the Flight Recorder dump,
                                                                :func:`agent.sdk.flightrec.fr_trace`)
==================  ==========================================  ===================================

``status`` also carries ``dist`` (``{rank, world_size, backend}`` once torch.distributed is
initialized, else ``null``) and ``torch_worker`` (the worker-server socket path, or ``null``).

Errors reply ``{"ok": false, "error": <code>, "detail": <one line>}`` with code
``invalid`` (bad JSON or fields), ``busy`` (a session is already pending/running),
``unsupported`` (torch/mlx missing), ``unknown_command`` or ``permission_denied``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.sdk import exitnotice, flightrec, profiler, tracing
from agent.sdk._files import remove_if_ours
from agent.sdk.folders import sdk_path, writer_path

__all__ = [
    "ENV_PROFILE_ALLOWED_DIRS",
    "MAX_DURATION_S",
    "MAX_LINE_BYTES",
    "MAX_NUM_STEPS",
    "ControlServer",
    "allowed_profile_dirs",
    "check_profile_bounds",
    "control_path",
    "handle_request",
    "serve_control",
    "session_folder_problem",
    "stop_control",
]

#: Longest request line accepted, bytes.
MAX_LINE_BYTES = 64 * 1024
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_log = logging.getLogger("servewatch.sdk")


def control_path(pid: int | None = None, directory: Path | None = None) -> Path:
    """Socket path of process ``pid`` (default: this one): ``servewatch-ctl.<pid>.sock`` in the
    private folder of its user, beside its step counter (:func:`agent.sdk.folders.sdk_path`),
    so the agent finds a server's socket from its pid alone."""
    return sdk_path(pid, f"servewatch-ctl.{os.getpid() if pid is None else pid}.sock", directory)


#: Most forward steps one ``profile.start`` over the socket may ask for.
MAX_NUM_STEPS = 100_000
#: Longest ``max_duration_s`` one ``profile.start`` over the socket may ask for, seconds.
MAX_DURATION_S = 3600.0
#: Folders (``os.pathsep``-separated) a ``profile.start`` over the socket may also write traces
#: under, set by the server's operator; unset (default): only the session folder the agent
#: created for this server (:func:`session_folder_problem`).
ENV_PROFILE_ALLOWED_DIRS = "SERVEWATCH_PROFILE_ALLOWED_DIRS"


def allowed_profile_dirs() -> list[str]:
    """Folders (resolved) a socket client may direct traces into besides a session folder: those
    of :data:`ENV_PROFILE_ALLOWED_DIRS`, none when it is unset."""
    env = os.environ.get(ENV_PROFILE_ALLOWED_DIRS, "")
    return [os.path.realpath(p) for p in env.split(os.pathsep) if p]


def session_folder_problem(path: str) -> str | None:
    """Why ``path`` is not a session folder the agent created for this server, or ``None``.

    The agent (:class:`agent.host.fsutil.SessionFolder`) hands a server an existing folder, mode
    0700, owned by the server's effective uid (given to it when the agent runs as another uid),
    never a symlink. ``/etc`` (0755) or a folder that does not exist is none of that.

    Returns:
        One phrase (``'/etc' has mode 755, a session folder is 0700``), or ``None``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return f"{path!r} does not exist (a session folder is created by the agent, never by the server)"
    except OSError as exc:
        return f"{path!r} cannot be opened as a folder without following a symlink ({exc.strerror or exc})"
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    euid = os.geteuid()
    if st.st_uid != euid:
        return f"{path!r} is owned by uid {st.st_uid}, not by this server's uid {euid}"
    if st.st_mode & 0o077:
        return f"{path!r} has mode {st.st_mode & 0o7777:o}, a session folder is 0700"
    return None


def check_profile_bounds(request: profiler.ProfileRequest) -> None:
    """Bound what a socket client may ask for: steps, duration, and where traces go.

    ``output_dir`` must be absolute and be the session folder the agent created for this server
    (:func:`session_folder_problem`: existing, 0700, this process's uid, not a symlink), or lie
    inside a folder the server's operator allowed (:data:`ENV_PROFILE_ALLOWED_DIRS`): the server
    never writes traces into, nor creates, a folder elsewhere on a client's word (``/etc``).

    Raises:
        ValueError: one line saying which bound was passed (and, for ``output_dir``, why).
    """
    if request.num_steps > MAX_NUM_STEPS:
        raise ValueError(f"num_steps must be <= {MAX_NUM_STEPS}, got {request.num_steps}")
    if not request.max_duration_s <= MAX_DURATION_S:
        raise ValueError(f"max_duration_s must be <= {MAX_DURATION_S:g}, got {request.max_duration_s!r}")
    if request.output_dir is None:
        return
    if "\0" in request.output_dir or not os.path.isabs(request.output_dir):
        raise ValueError(f"output_dir must be an absolute path, got {request.output_dir!r}")
    problem = session_folder_problem(request.output_dir)
    if problem is None:
        return
    real = os.path.realpath(request.output_dir)
    for base in allowed_profile_dirs():
        if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
            return
    raise ValueError(
        f"output_dir {request.output_dir!r} refused: not the session folder the agent created for this server:"
        f" {problem}; outside the allowed folders (set {ENV_PROFILE_ALLOWED_DIRS} to allow one)"
    )


def handle_request(req: Any) -> dict[str, Any]:
    """Answer one decoded request (the protocol table in the module docstring)."""
    if not isinstance(req, dict):
        return {"ok": False, "error": "invalid", "detail": "a request is a JSON object"}
    cmd = req.get("cmd")
    body = {k: v for k, v in req.items() if k not in ("cmd", "id")}
    handler = _HANDLERS.get(cmd) if isinstance(cmd, str) else None
    if handler is not None:
        return handler(body)
    return {"ok": False, "error": "unknown_command", "detail": f"unknown cmd {cmd!r}"}


def _status(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ok": True,
        "pid": os.getpid(),
        "forward_ct": profiler.status()["forward_ct"],
        "profiler": profiler.status(),
        "inflight": len(tracing.inflight()),
        "dist": flightrec.dist_info(),
        "torch_worker": str(flightrec._worker_path) if flightrec._worker_path else None,
    }
    if isinstance(body.get("session_id"), str):
        out["session"] = profiler.session(body["session_id"])
    return out


def _profile_start(body: dict[str, Any]) -> dict[str, Any]:
    try:
        request = profiler.ProfileRequest.from_dict(body)
        check_profile_bounds(request)
        sid = profiler.request_profile(request)
    except profiler.ProfilerBusyError as exc:
        return {"ok": False, "error": "busy", "detail": str(exc)}
    except ImportError as exc:
        return {"ok": False, "error": "unsupported", "detail": f"profiler backend unavailable: {exc}"}
    except ValueError as exc:
        return {"ok": False, "error": "invalid", "detail": str(exc)}
    return {"ok": True, "session_id": sid, "session": profiler.session(sid)}


def _profile_stop(body: dict[str, Any]) -> dict[str, Any]:
    result = profiler.request_stop()
    st = profiler.status()
    return {"ok": True, "status": result, "session": st["session"] or st["last"]}


def _inflight(body: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "requests": tracing.inflight(), "completions": tracing.completions()}


def _fr_trace(body: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"ok": True, "trace": flightrec.fr_trace(stack_traces=body.get("stack_traces") is True)}
    except ImportError as exc:
        return {"ok": False, "error": "unsupported", "detail": f"torch.distributed unavailable: {exc}"}
    except (RuntimeError, ValueError) as exc:
        return {"ok": False, "error": "failed", "detail": f"Flight Recorder dump failed: {exc}"}


#: :func:`handle_request`'s answer to each command.
_HANDLERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "status": _status,
    "profile.start": _profile_start,
    "profile.stop": _profile_stop,
    "inflight": _inflight,
    "fr_trace": _fr_trace,
}


class ControlServer:
    """A unix-socket server: one daemon thread accepts, each connection gets its own thread.

    Connections are served concurrently, so one slow or idle client never delays another (the
    agent's in-flight read at an incident). Each connection has one deadline for its whole
    life (not per read): a client that has not finished by then is disconnected. At most
    ``max_connections`` are served at once; more are closed at accept.

    The socket path is created like the step counter: a stale socket of our own uid is
    replaced; a path another user pre-created (or a symlink) is never touched, and
    :func:`serve_control` then logs one warning and serves nothing instead of failing.

    Args:
        path: socket path (default :func:`control_path`).
        request_timeout_s: deadline of one connection, from accept to close, seconds.
        poll_s: how often the accept loop checks for :meth:`close`, seconds.
        max_connections: connections served at once.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        request_timeout_s: float = 5.0,
        poll_s: float = 0.2,
        max_connections: int = 256,
    ) -> None:
        self.path = Path(path) if path is not None else writer_path(f"servewatch-ctl.{os.getpid()}.sock")
        self.request_timeout_s = request_timeout_s
        self.poll_s = poll_s
        self.max_connections = max_connections
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(max_connections)
        #: connections refused because of their peer uid
        self.refused = 0
        #: connections closed at accept because ``max_connections`` were open
        self.overflow = 0
        #: connections closed at their deadline
        self.expired = 0
        #: requests answered
        self.served = 0
        #: why the server is not serving (set by :func:`serve_control` when binding failed)
        self.error: str | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> ControlServer:
        """Bind (mode 0600) and start serving.

        Raises:
            FileExistsError: the path is taken by another user's file or a symlink.
            OSError: the path cannot be bound.
        """
        if self._thread is not None:
            return self
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        remove_if_ours(self.path)  # our own stale socket (same pid, earlier process) only
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))  # bind(2) never follows a symlink: it fails on any existing path
            os.chmod(self.path, 0o600)
            sock.listen(64)
            sock.settimeout(self.poll_s)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="servewatch-control", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving and remove the socket file; safe twice and before start."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            try:
                remove_if_ours(self.path)
            except OSError:
                pass

    def _allowed(self, conn: socket.socket) -> bool:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        _pid, uid, _gid = _PEERCRED.unpack(raw)
        return uid in (0, os.geteuid())

    def _serve(self) -> None:
        sock = self._sock
        while not self._stop.is_set() and sock is not None:
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self.overflow += 1
                conn.close()
                continue
            try:
                threading.Thread(target=self._connection, args=(conn,), name="servewatch-control-conn", daemon=True).start()
            except RuntimeError:  # cannot start a thread (interpreter shutting down)
                self._slots.release()
                conn.close()

    def _connection(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.request_timeout_s
        try:
            with conn:
                self._handle(conn, deadline)
        except OSError:
            pass  # the client went away or ran past its deadline
        except Exception:  # noqa: BLE001 - the control socket must outlive any request
            _log.debug("servewatch control request failed", exc_info=True)
        finally:
            self._slots.release()

    def _recv(self, conn: socket.socket, deadline: float) -> bytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.expired += 1
            raise TimeoutError("connection deadline passed")
        conn.settimeout(min(remaining, 1.0) if self._stop.is_set() else remaining)
        try:
            return conn.recv(65536)
        except TimeoutError:
            self.expired += 1
            raise

    def _handle(self, conn: socket.socket, deadline: float) -> None:
        if not self._allowed(conn):
            self.refused += 1
            # Read (briefly) what the peer sent before answering, so the refusal is not lost in
            # a reset from closing a socket with unread data.
            try:
                self._recv(conn, min(deadline, time.monotonic() + 1.0))
            except OSError:
                pass
            conn.settimeout(1.0)
            self._send(conn, {"ok": False, "error": "permission_denied", "detail": "peer uid not allowed"})
            return
        buf = b""
        while not self._stop.is_set():
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > MAX_LINE_BYTES:
                    self._send(conn, {"ok": False, "error": "invalid", "detail": "request line too long"})
                    return
                data = self._recv(conn, deadline)
                if not data:
                    return
                buf += data
                continue
            line, buf = buf[:nl], buf[nl + 1 :]
            if not line.strip():
                continue
            try:
                req = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                reply = {"ok": False, "error": "invalid", "detail": f"bad JSON: {exc}"}
            else:
                reply = handle_request(req)
                if isinstance(req, dict) and "id" in req:
                    reply["id"] = req["id"]
            self.served += 1
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            self._send(conn, reply)

    @staticmethod
    def _send(conn: socket.socket, reply: dict[str, Any]) -> None:
        conn.sendall(json.dumps(reply, separators=(",", ":")).encode() + b"\n")


_server: ControlServer | None = None
_server_lock = threading.Lock()


def serve_control(path: str | Path | None = None) -> ControlServer:
    """Start this process's control socket once (idempotent; later calls return the same server).

    Args:
        path: socket path; default :func:`control_path` of this pid.

    Returns:
        The :class:`ControlServer` (``.path`` is where it listens). When the socket cannot be
        bound (another user pre-created the path, the folder is not writable), the server keeps
        running without it: ``.running`` is ``False``, ``.error`` says why, one warning is logged.
    """
    global _server
    with _server_lock:
        if _server is None:
            server = ControlServer(path)
            try:
                server.start()
            except OSError as exc:
                server.error = str(exc)
                _log.warning("servewatch control socket not served at %s: %s", server.path, exc)
            else:
                atexit.register(stop_control)
            _server = server
    exitnotice.install()  # the SDK is in use: how this process ends, for the agent (agent.sdk.exitnotice)
    return _server


def stop_control() -> None:
    """Stop the server started by :func:`serve_control`; safe when none runs."""
    global _server
    with _server_lock:
        server, _server = _server, None
    if server is not None:
        server.close()


def _after_fork_in_child() -> None:
    # The parent's listening thread does not exist in the child; the child starts its own.
    global _server, _server_lock
    _server, _server_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
