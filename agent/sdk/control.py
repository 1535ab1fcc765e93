"""The SDK's local control socket: the agent asks a server process for status, profiles and
requests in flight.

Owns the unix-socket server and its JSON-lines protocol. Imports the standard library and the
SDK's own modules (:mod:`agent.sdk.profiler`, :mod:`agent.sdk.tracing`); never the agent side.
The server runs in one daemon thread (the one thread the SDK starts); it never touches torch:
profile requests are queued for the model thread by :mod:`agent.sdk.profiler`.

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
``inflight``        -                                           ``requests`` (tracing.inflight())
==================  ==========================================  ===================================

Errors reply ``{"ok": false, "error": <code>, "detail": <one line>}`` with code
``invalid`` (bad JSON or fields), ``busy`` (a session is already pending/running),
``unsupported`` (torch/mlx missing), ``unknown_command`` or ``permission_denied``.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from agent.sdk import profiler, tracing
from agent.sdk._counter import shm_dir

__all__ = ["ControlServer", "control_path", "serve_control", "stop_control", "handle_request", "MAX_LINE_BYTES"]

#: Longest request line accepted, bytes.
MAX_LINE_BYTES = 64 * 1024
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def control_path(pid: int | None = None, directory: Path | None = None) -> Path:
    """Socket path of process ``pid`` (default: this one): ``<shm_dir>/servewatch-ctl.<pid>.sock``.

    ``shm_dir`` is the counter files' folder (``$SERVEWATCH_SHM_DIR``, else ``/dev/shm``), so
    the agent finds a server's socket from its pid alone.
    """
    return (directory or shm_dir()) / f"servewatch-ctl.{os.getpid() if pid is None else pid}.sock"


def handle_request(req: Any) -> dict[str, Any]:
    """Answer one decoded request (the protocol table in the module docstring)."""
    if not isinstance(req, dict):
        return {"ok": False, "error": "invalid", "detail": "a request is a JSON object"}
    cmd = req.get("cmd")
    body = {k: v for k, v in req.items() if k not in ("cmd", "id")}
    if cmd == "status":
        out: dict[str, Any] = {
            "ok": True,
            "pid": os.getpid(),
            "forward_ct": profiler.status()["forward_ct"],
            "profiler": profiler.status(),
            "inflight": len(tracing.inflight()),
        }
        if isinstance(body.get("session_id"), str):
            out["session"] = profiler.session(body["session_id"])
        return out
    if cmd == "profile.start":
        try:
            request = profiler.ProfileRequest.from_dict(body)
            sid = profiler.request_profile(request)
        except profiler.ProfilerBusyError as exc:
            return {"ok": False, "error": "busy", "detail": str(exc)}
        except ImportError as exc:
            return {"ok": False, "error": "unsupported", "detail": f"profiler backend unavailable: {exc}"}
        except ValueError as exc:
            return {"ok": False, "error": "invalid", "detail": str(exc)}
        return {"ok": True, "session_id": sid, "session": profiler.session(sid)}
    if cmd == "profile.stop":
        result = profiler.request_stop()
        st = profiler.status()
        return {"ok": True, "status": result, "session": st["session"] or st["last"]}
    if cmd == "inflight":
        return {"ok": True, "requests": tracing.inflight()}
    return {"ok": False, "error": "unknown_command", "detail": f"unknown cmd {cmd!r}"}


class ControlServer:
    """A unix-socket server in one daemon thread.

    Args:
        path: socket path (default :func:`control_path`); an existing socket file there is
            replaced.
        request_timeout_s: a connection idle longer than this is closed, seconds.
        poll_s: how often the accept loop checks for :meth:`close`, seconds.
    """

    def __init__(self, path: str | Path | None = None, *, request_timeout_s: float = 5.0, poll_s: float = 0.2) -> None:
        self.path = Path(path) if path is not None else control_path()
        self.request_timeout_s = request_timeout_s
        self.poll_s = poll_s
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        #: connections refused because of their peer uid
        self.refused = 0
        #: requests answered
        self.served = 0

    def start(self) -> ControlServer:
        """Bind (mode 0600) and start serving; raises OSError when the path cannot be bound."""
        if self._thread is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if self.path.is_socket():
                self.path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            sock.listen(8)
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
                self.path.unlink()
            except FileNotFoundError:
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
            except socket.timeout:
                continue
            except OSError:
                return  # closed
            with conn:
                try:
                    self._handle(conn)
                except OSError:
                    continue  # the client went away or timed out: serve the next one
                except Exception:  # noqa: BLE001 - the control thread must outlive any request
                    continue

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(self.request_timeout_s)
        if not self._allowed(conn):
            self.refused += 1
            # Read (briefly) what the peer sent before answering, so the refusal is not lost in
            # a reset from closing a socket with unread data.
            conn.settimeout(min(1.0, self.request_timeout_s))
            try:
                conn.recv(MAX_LINE_BYTES)
            except OSError:
                pass
            self._send(conn, {"ok": False, "error": "permission_denied", "detail": "peer uid not allowed"})
            return
        buf = b""
        while not self._stop.is_set():
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > MAX_LINE_BYTES:
                    self._send(conn, {"ok": False, "error": "invalid", "detail": "request line too long"})
                    return
                data = conn.recv(65536)
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
        The running :class:`ControlServer` (``.path`` is where it listens).

    Raises:
        OSError: the socket cannot be bound.
    """
    global _server
    with _server_lock:
        if _server is None:
            _server = ControlServer(path).start()
            atexit.register(stop_control)
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
