"""Flight Recorder access inside the server: torch's C++ worker server and a JSON dump.

Owns the per-process unix socket on which torch's ``_WorkerServer`` answers (its handlers run on
C++ threads, so ``POST /handler/fr_trace_json`` is answered even while the rank's Python thread
sits in a collective or a hung kernel launch), the Flight Recorder dump served through the SDK
control socket (``fr_trace``), and the rank identity the agent needs to read either.

Imports the standard library only; torch is imported lazily (a server without torch gets
``None`` / an ``unsupported`` error, never an ImportError at import time). Never imports the
agent side.

Facts (torch 2.13, measured with gloo on CPU): the Flight Recorder records only when
``TORCH_FR_BUFFER_SIZE`` is set before ``init_process_group``;
``torch._C._distributed_c10d._dump_fr_trace_json(include_collectives, include_stack_traces)``
returns ``{version, pg_config, pg_status, entries: [...]}``; ``_WorkerServer(path)`` serves HTTP on
a unix socket path.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from agent.sdk._files import remove_if_ours
from agent.sdk.folders import sdk_path, writer_path

__all__ = [
    "FR_BUFFER_ENV",
    "dist_info",
    "fr_trace",
    "serve_torch_worker",
    "stop_torch_worker",
    "worker_path",
]

#: torch's variable sizing the Flight Recorder ring buffer (entries); 0 or unset = off.
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"

_worker: Any = None
_worker_path: Path | None = None
_lock = threading.Lock()


def worker_path(pid: int | None = None, directory: Path | None = None) -> Path:
    """Socket of torch's worker server for ``pid``: ``servewatch-torch.<pid>.sock`` in its user's
    private folder, next to the SDK control socket (:func:`agent.sdk.control.control_path`), so
    the agent finds it from the pid alone."""
    return sdk_path(pid, f"servewatch-torch.{os.getpid() if pid is None else pid}.sock", directory)


def serve_torch_worker(path: str | Path | None = None) -> Path | None:
    """Start torch's C++ worker server on a unix socket (once per process; mode 0600).

    Args:
        path: socket path; default :func:`worker_path` of this pid.

    Returns:
        The socket path, or ``None`` when this torch has no ``_WorkerServer`` (or no torch).

    Raises:
        OSError: the socket cannot be bound.
    """
    global _worker, _worker_path
    with _lock:
        if _worker is not None:
            return _worker_path
        try:
            from torch._C._distributed_c10d import _WorkerServer
        except ImportError:
            return None
        target = Path(path) if path is not None else writer_path(f"servewatch-torch.{os.getpid()}.sock")
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        remove_if_ours(target)  # a stale socket of ours (FileExistsError, an OSError, for anyone else's)
        old_umask = os.umask(0o177)  # the socket file is created 0600, no window where others may connect
        try:
            server = _WorkerServer(str(target))
        except RuntimeError as exc:
            raise OSError(f"torch worker server on {target}: {exc}") from exc
        finally:
            os.umask(old_umask)
        os.chmod(target, 0o600)
        _worker, _worker_path = server, target
        atexit.register(stop_torch_worker)
        return target


def stop_torch_worker() -> None:
    """Stop the worker server and remove its socket; safe when none runs."""
    global _worker, _worker_path
    with _lock:
        server, path = _worker, _worker_path
        _worker, _worker_path = None, None
    if server is not None:
        try:
            server.shutdown()
        except RuntimeError:
            pass
    if path is not None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def dist_info() -> dict[str, Any] | None:
    """``{rank, world_size, backend}`` of the default process group, or ``None`` before init."""
    import sys

    dist = sys.modules.get("torch.distributed")  # never import torch just to answer "no"
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": str(dist.get_backend())}
    except (RuntimeError, ValueError):
        return None


def fr_trace(*, stack_traces: bool = False) -> dict[str, Any]:
    """This process's Flight Recorder dump as a dict (``entries``, ``pg_status``, ...).

    Adds ``"servewatch": {"pid", "rank", "world_size", "buffer_size"}`` so a reader knows whose
    dump it is (gloo dumps do not name their rank).

    Raises:
        ImportError: torch.distributed is not imported in this process (a process that never
            imported it has no process group and so no Flight Recorder: it is not imported
            here, which would cost seconds and hundreds of MB), or torch is missing.
    """
    if "torch.distributed" not in sys.modules:
        raise ImportError("torch.distributed is not imported in this process (no process group)")
    # private binding behind torch.distributed's dump_nccl_trace_json; torch's stubs omit it
    from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

    data = json.loads(_dump_fr_trace_json(True, stack_traces))
    info = dist_info() or {}
    data["servewatch"] = {
        "pid": os.getpid(),
        "rank": info.get("rank"),
        "world_size": info.get("world_size"),
        "buffer_size": os.environ.get(FR_BUFFER_ENV, ""),
    }
    return data


def _after_fork_in_child() -> None:
    global _worker, _worker_path, _lock
    _worker, _worker_path, _lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
