"""The agent's side of the SDK control socket: one bounded call, the requests in flight.

Owns :func:`sdk_call` (one JSON-lines request to a server's control socket, served by
:mod:`agent.sdk.control` inside the server), :class:`SdkCallError` (a failed call, sorted into
an :class:`~agent.model.events.Outcome`), :func:`control_socket_pids` (the live servers whose sockets
are in a folder), :func:`read_step_counter` (a server's forward-step counter file, checked to be
its own) and :func:`read_inflight` with its :class:`InflightRequest` items (span links
and ``requests.json`` of an incident).

Used by the actors (:mod:`agent.actors.profiler`, :mod:`agent.actors.flightrec`) and by the
incident layer (:mod:`agent.incidents.manager`, through :mod:`agent.runtime.agent`). May import the stdlib,
anyio, :mod:`agent.model.events`, :mod:`agent.errors`, :mod:`agent.host.procinfo`, :mod:`agent.host.security`,
:mod:`agent.host.targets`, the SDK's path helper :func:`agent.sdk.control.control_path` and its public
counter layout (:mod:`agent.sdk.counter`); never an
actor, a watcher, the incident layer or an exporter (``tests/test_layers.py`` checks it).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from agent.errors import SdkCallError
from agent.host.procinfo import pid_alive
from agent.host.security import access_denied, open_trusted, process_uids, trusted_owner
from agent.host.targets import ProcessState, Target, process_state
from agent.model.events import Outcome
from agent.sdk.control import control_path
from agent.sdk.counter import SIZE_BYTES, CounterSnapshot, counter_path, parse_counter
from agent.sdk.folders import sdk_folders

__all__ = [
    "MAX_INFLIGHT_PER_TARGET",
    "MAX_REPLY_BYTES",
    "InflightRequest",
    "SdkCallError",
    "control_path",
    "control_socket_pids",
    "read_inflight",
    "read_step_counter",
    "sdk_call",
]

log = logging.getLogger(__name__)

#: Most in-flight requests kept per target at an incident.
MAX_INFLIGHT_PER_TARGET = 10_000
#: Largest reply line read from a control socket, bytes.
MAX_REPLY_BYTES = 16 * 1024 * 1024
#: Control socket file names: ``servewatch-ctl.<pid>.sock`` (per :func:`agent.sdk.control.control_path`).
_SOCKET_GLOB = "servewatch-ctl.*.sock"


@dataclass(frozen=True, slots=True)
class InflightRequest:
    """A request that was in flight in a target when an incident opened.

    Per the SDK's ``inflight`` control command; prompt text only when the user opted in.

    Attributes:
        pid: the target that served it.
        request_id: the server's request id.
        trace_id: 32 hex digits of the request's span (empty when it has none).
        span_id: 16 hex digits of the request's span (empty when it has none).
        age_s: seconds since the request started, at the time of the read.
        prompt_tokens: input tokens, when the server reported them.
        generated_tokens: output tokens so far, when the server reported them.
        prompt: the prompt text (only with ``incident.capture_prompts``).
        start_time_unix_nano: when the request's span started (the server's wall clock; 0: unknown).
        model / operation: ``gen_ai.request.model`` / ``gen_ai.operation.name`` (``""``: unknown).
        parent_span_id: hex id of the request span's parent (``""``: a trace root, or unknown).
    """

    pid: int
    request_id: str
    trace_id: str
    span_id: str
    age_s: float
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    prompt: str | None = None
    start_time_unix_nano: int = 0
    model: str = ""
    operation: str = ""
    parent_span_id: str = ""

    def to_json(self, *, with_prompt: bool) -> dict[str, Any]:
        """The ``requests.json`` entry (the prompt only when ``with_prompt`` and known)."""
        out: dict[str, Any] = {
            "pid": self.pid,
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "age_s": round(self.age_s, 6),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
        }
        if with_prompt and self.prompt is not None:
            out["prompt"] = self.prompt
        return out


def _span_hex(value: object) -> str:
    """A span id as the SDK reports it (16 hex digits, not all zero), else ``""`` (untrusted input)."""
    text = str(value or "")
    if len(text) != 16:
        return ""
    try:
        return text.lower() if int(text, 16) else ""
    except ValueError:
        return ""


def _socket_owner_problem(path: Path, owner_uids: Sequence[int]) -> str | None:
    """Why the socket file at ``path`` is not trusted (symlink, not a socket, foreign owner), or ``None``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None  # connect() reports it
    except OSError as exc:
        return f"cannot inspect {path}: {exc.strerror or exc}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket (symlinks are not followed)"
    if not trusted_owner(st, owner_uids):
        return f"{path} is owned by uid {st.st_uid}, not by the target's uid {list(owner_uids)} or root"
    return None


def _target_uids(pid: int | None) -> tuple[int, ...]:
    """The uids whose control sockets count as the target's: its ``/proc/PID`` owner (we, without a pid)."""
    if pid is None:
        return (os.geteuid(),)
    return process_uids(pid)


async def sdk_call(path: Path, request: dict[str, Any], *, timeout_s: float, pid: int | None = None) -> dict[str, Any]:
    """One JSON-lines request to an SDK control socket (see :mod:`agent.sdk.control`).

    The socket is trusted only when it is a socket (not a symlink) owned by the target's uid
    (``pid``'s, else ours) or root, and the peer serving it (``SO_PEERCRED``) runs as one of
    them: a socket squatted in ``/dev/shm`` by another user is never talked to.

    Args:
        path: the socket, e.g. ``control_path(pid, socket_dir)``.
        request: the command object (``{"cmd": "status"}``...), sent as one JSON line.
        timeout_s: bound on connecting, sending and reading the reply, seconds.
        pid: the target that should serve the socket; ``None``: one of ours.

    Returns:
        The reply object (``ok`` false replies other than ``permission_denied`` included).

    Raises:
        SdkCallError: ``NO_SUCH_PROCESS`` (no socket / nobody listening, or ``pid`` exited
            during the call), ``PERMISSION_DENIED`` (socket mode or peer-uid refusal),
            ``TIMED_OUT``, ``FAILED`` (bad reply, over :data:`MAX_REPLY_BYTES`, the connection
            closed mid-call).
    """
    # /proc/PID's owner and the socket's lstat: file system calls, off the loop
    owners = await anyio.to_thread.run_sync(_target_uids, pid)
    problem = await anyio.to_thread.run_sync(_socket_owner_problem, path, owners)
    if problem is not None:
        raise SdkCallError(Outcome.PERMISSION_DENIED, f"untrusted control socket: {problem}")
    try:
        with anyio.fail_after(timeout_s):
            async with await anyio.connect_unix(str(path)) as stream:
                raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
                _peer_pid, peer_uid, _gid = struct.unpack(
                    "3i", raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                )
                if peer_uid not in (0, *owners):
                    raise SdkCallError(
                        Outcome.PERMISSION_DENIED,
                        f"untrusted control socket: {path} is served by uid {peer_uid}, not the target's",
                    )
                await stream.send(json.dumps(request).encode() + b"\n")
                reader = BufferedByteReceiveStream(stream)
                line = await reader.receive_until(b"\n", MAX_REPLY_BYTES)
    except TimeoutError:
        raise SdkCallError(Outcome.TIMED_OUT, f"control socket {path} did not answer within {timeout_s} s") from None
    except (FileNotFoundError, NotADirectoryError, ConnectionRefusedError):  # NotADirectory: see agent.sdk.folders
        raise SdkCallError(Outcome.NO_SUCH_PROCESS, f"no SDK control socket at {path} (agent.sdk.serve_control() not called?)") from None
    except PermissionError:
        raise SdkCallError(Outcome.PERMISSION_DENIED, f"permission denied on {path} (run servewatch as the server's user or root)") from None
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, anyio.IncompleteRead) as exc:
        # the server went away mid-call (a rank that died, or was killed, while we waited)
        raise await _broken_call(path, pid, exc) from None
    except (OSError, anyio.DelimiterNotFound) as exc:
        raise SdkCallError(Outcome.FAILED, f"control socket {path}: {type(exc).__name__}: {exc}") from None
    return _reply(path, line)


async def _broken_call(path: Path, pid: int | None, exc: BaseException) -> SdkCallError:
    """The error for a connection that broke mid-call: ``pid`` exited, or the server closed it."""
    gone = pid is not None and await anyio.to_thread.run_sync(_exited_soon, pid)
    why = f"pid {pid} exited during the call" if gone else "the server closed the connection mid-call"
    cause = exc.__cause__ or exc
    return SdkCallError(
        Outcome.NO_SUCH_PROCESS if gone else Outcome.FAILED,
        f"control socket {path}: {why} ({type(cause).__name__}{': ' + str(cause) if str(cause) else ''})",
    )


def _reply(path: Path, line: bytes) -> dict[str, Any]:
    """The reply object in ``line`` (:func:`sdk_call`'s errors for a bad or refusing one)."""
    try:
        reply = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SdkCallError(Outcome.FAILED, f"control socket {path}: bad reply: {exc}") from None
    if not isinstance(reply, dict):
        raise SdkCallError(Outcome.FAILED, f"control socket {path}: reply is not an object")
    if reply.get("error") == "permission_denied":
        raise SdkCallError(Outcome.PERMISSION_DENIED, f"control socket {path}: {reply.get('detail', '')}")
    return reply


def _exited_soon(pid: int, within_s: float = 0.2) -> bool:
    """Whether ``pid`` is gone or a zombie now or within ``within_s`` seconds (a process killed
    closes its sockets a moment before it becomes a zombie). Blocking."""
    deadline = time.monotonic() + within_s
    while True:
        if process_state(pid) in (ProcessState.GONE, ProcessState.ZOMBIE):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def read_step_counter(pid: int, directory: Path | None = None) -> CounterSnapshot | None:
    """The forward-step counter of ``pid`` (``servewatch-steps.<pid>`` in its user's private folder
    in ``directory``, default the SDK's shm folder: :mod:`agent.sdk.folders`), or ``None`` when it is missing, not owned by the process's user, or
    written by another pid. Blocking (a tmpfs read, microseconds)."""
    uids = process_uids(pid)
    if not uids:
        return None
    raw = open_trusted(counter_path(pid, directory), uids, max_bytes=SIZE_BYTES)
    snap = None if raw is None else parse_counter(raw)
    return snap if snap is not None and snap.pid == pid else None


def control_socket_pids(socket_dir: Path | None = None) -> list[int]:
    """Pids of the live processes whose control socket file is in a user's private folder in
    ``socket_dir`` (:func:`agent.sdk.folders.sdk_folders`), ascending.

    A killed server leaves its socket file behind: only pids still alive count. Names only (a
    directory listing); :func:`sdk_call` decides whether a socket is trusted.

    Args:
        socket_dir: the sockets' folder; default the SDK's shm folder.
    """
    names: list[str] = []
    for _uid, folder in sdk_folders(socket_dir):
        try:
            names += [p.name for p in folder.glob(_SOCKET_GLOB)]
        except OSError:
            continue
    pids = sorted({int(part) for name in names if (part := name.split(".")[1]).isdigit()})
    return [p for p in pids if pid_alive(p)]


async def read_inflight(
    targets: Sequence[Target], *, timeout_s: float = 2.0, socket_dir: Path | None = None
) -> list[InflightRequest]:
    """Requests in flight in every target that serves an SDK control socket (bounded, parallel).

    Targets without a socket, that do not answer within ``timeout_s``, or that fail mid-call
    (a rank dying while it is asked) contribute nothing, with one warning line each: the others'
    requests are kept. At most :data:`MAX_INFLIGHT_PER_TARGET` requests are kept per target.

    Args:
        targets: the processes to ask.
        timeout_s: bound of each target's call, seconds (the whole read: ``timeout_s + 1``).
        socket_dir: the sockets' folder; default the SDK's shm folder.

    Returns:
        The requests (pid, request id, span ids, age, token counts), in no particular order.
    """
    out: list[InflightRequest] = []

    async def one(target: Target) -> None:
        path = await anyio.to_thread.run_sync(control_path, target.pid, socket_dir)  # lists folders, reads /proc
        denied = await anyio.to_thread.run_sync(access_denied, path)
        if denied is not None:  # another user's folder (root's server, no sudo): one line, no traceback
            log.warning("in-flight requests of pid %d unavailable: %s", target.pid, denied)
            return
        if not await anyio.Path(path).exists():
            return
        try:
            reply = await sdk_call(path, {"cmd": "inflight"}, timeout_s=timeout_s, pid=target.pid)
        except SdkCallError as exc:
            log.warning("in-flight requests of pid %d unavailable: %s", target.pid, exc)
            return
        except Exception as exc:  # noqa: BLE001 - one target's boundary: a rank that misbehaves costs its own links only
            log.warning("in-flight requests of pid %d unavailable: %s: %s", target.pid, type(exc).__name__, exc)
            return
        now = time.time_ns()  # after the reply: a request admitted meanwhile has a real age
        requests = reply.get("requests") or ()
        if not isinstance(requests, list):
            return
        if len(requests) > MAX_INFLIGHT_PER_TARGET:
            log.warning("pid %d reported %d requests in flight; keeping the first %d",
                        target.pid, len(requests), MAX_INFLIGHT_PER_TARGET)
            requests = requests[:MAX_INFLIGHT_PER_TARGET]
        for r in requests:
            if not isinstance(r, dict):
                continue
            start = int(r.get("start_time_unix_nano") or now)
            out.append(
                InflightRequest(
                    pid=target.pid,
                    request_id=str(r.get("request_id", "")),
                    trace_id=str(r.get("trace_id", "")),
                    span_id=str(r.get("span_id", "")),
                    age_s=max(0.0, (now - start) / 1e9),
                    prompt_tokens=r.get("input_tokens"),
                    generated_tokens=r.get("output_tokens"),
                    start_time_unix_nano=start,
                    model=str(r.get("model") or ""),
                    operation=str(r.get("operation") or ""),
                    parent_span_id=_span_hex(r.get("parent_span_id")),
                )
            )

    with anyio.move_on_after(timeout_s + 1.0):
        async with anyio.create_task_group() as tg:
            for t in targets:
                tg.start_soon(one, t)
    return out
