"""Step-bounded in-process profiling (torch.profiler or MLX), driven by ``agent.sdk.step()``.

Owns the profiling session state machine of this process. Imports the standard library,
:mod:`agent.sdk` (step hooks, counter) and :mod:`agent.sdk.tracing` (the range flag); torch and
mlx are imported lazily, opentelemetry-api only for MLX per-step spans. Never the agent side.

Threading rule (the reason this module exists): every ``torch.profiler`` start, step, stop and
export happens on the thread that calls :func:`agent.sdk.step` - the model loop. Stopping a
torch profiler on another thread than the one that started it can crash the process at export
(per FIELD-NOTES), so the public functions here only *queue* requests; a step hook applies them
at the next step, and a hook running on any other thread than the session's owner ignores it.

Session life (``state``)::

    pending --(step with forward_ct >= start_step)--> running --(N more steps)--> completed
       |                                                 |--(request_stop: next step)---> stopped
       |                                                 '--(deadline: next step)-------> expired
       |--(request_stop, any thread)---> cancelled        (no profiler was ever started)
       '--(deadline passed, no step came)--> expired       (steps_captured=0, no profiler started)
       |--(another torch profiler runs at the start step)--> refused   (nothing started)
    any start/stop/export error, or no file written ---> failed

Wall-clock bound (``max_duration_s``, from the request): a session that has not started when
the deadline passes expires with ``steps_captured=0`` and no profiler was ever started (an idle
server never starts one, because starting needs a step). A running session past its deadline is
marked ``stopping`` and is stopped and exported at the next step on its own thread; if the
server never steps again the profiler stays open - no API can stop it elsewhere. Deadlines are
evaluated at each step and whenever a client looks (:func:`status`, :func:`wait`,
:func:`request_profile`, :func:`request_stop`); no extra thread is started.

Never take down the server profiled: a torch profiler already running in this process (the
server's own, e.g. SGLang's ``/start_profile`` in progress or an always-on
``torch.profiler.profile()``) is never joined, ended or stopped. :func:`request_profile` refuses
("the server is already profiling") while one runs (``torch.autograd.profiler._is_profiler_enabled``
or the autograd/kineto state ``torch.autograd._profiler_enabled()``), and a pending session whose
start step finds one ends as ``refused`` without starting anything. Only the profiler this module
started is ever stopped (starting a second kineto session ends the first one; stopping the
operator's later crashed the server with SIGSEGV).

Counting: the session starts in the hook of step ``s`` (``forward_ct == s``); each later step
is one captured step; in the hook of step ``s + N`` the profiler is stopped instead of stepped.
torch therefore writes exactly N ``ProfilerStep#k`` ranges (k = 0..N-1), each covering one
forward step plus the loop around it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import ProfilerBusyError
from agent.sdk import steps as _sdk
from agent.sdk import tracing as _tracing
from agent.sdk.counter import W_PROFILING

__all__ = [
    "ACTIVITIES",
    "BACKENDS",
    "ENV_PROFILE_DIR",
    "ProfileRequest",
    "ProfilerBusyError",
    "request_profile",
    "request_stop",
    "session",
    "status",
    "wait",
]

#: Environment variable naming the default trace folder (else ``$SGLANG_TORCH_PROFILER_DIR``,
#: else the temp dir), read when a request leaves ``output_dir`` unset.
ENV_PROFILE_DIR = "SERVEWATCH_PROFILE_DIR"
#: Activities a request may name (SGLang's words; ``MEM`` turns on ``profile_memory``).
ACTIVITIES = frozenset({"CPU", "GPU", "MEM"})
#: In-process profiler backends.
BACKENDS = frozenset({"torch", "mlx"})
#: Finished sessions kept for :func:`session` lookups.
HISTORY = 16
#: ``MTL_CAPTURE_ENABLED`` as the process had it when this module was imported (Metal reads it
#: at launch; setting it later has no effect).
_MTL_CAPTURE_AT_LAUNCH = os.environ.get("MTL_CAPTURE_ENABLED", "") == "1"

_FINISHED = frozenset({"completed", "stopped", "expired", "cancelled", "failed"})


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRequest:
    """What to profile.

    Attributes:
        num_steps: forward steps to capture (>= 1), counted by :func:`agent.sdk.step`.
        start_step: start once ``forward_ct`` >= this value (the first captured step is the
            one after); ``None`` starts at the next step. Per SGLang's ``start_step``.
        activities: ``CPU``, ``GPU`` (CUDA/XPU when torch supports it here), ``MEM`` (memory
            profiling). Unsupported activities are dropped and reported in the result.
        output_dir: folder for the trace; ``None`` uses ``$SERVEWATCH_PROFILE_DIR``, then
            ``$SGLANG_TORCH_PROFILER_DIR``, then the temp dir. Over the control socket it must
            be the session folder the agent created for this server (an existing 0700 folder of
            this process's uid, not a symlink) or lie in ``$SERVEWATCH_PROFILE_ALLOWED_DIRS``
            (:func:`agent.sdk.control.check_profile_bounds`).
        with_stack / record_shapes / profile_memory: torch.profiler options (off by default).
        max_duration_s: wall-clock bound of the whole session from the request, seconds.
        backend: ``torch`` or ``mlx``.
        prefix: file name prefix (default ``servewatch``).
    """

    num_steps: int
    start_step: int | None = None
    activities: tuple[str, ...] = ("CPU", "GPU")
    output_dir: str | None = None
    with_stack: bool = False
    record_shapes: bool = False
    profile_memory: bool = False
    max_duration_s: float = 60.0
    backend: str = "torch"
    prefix: str = "servewatch"

    def __post_init__(self) -> None:
        if not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {self.num_steps!r}")
        if self.start_step is not None and (not isinstance(self.start_step, int) or self.start_step < 0):
            raise ValueError(f"start_step must be an int >= 0 or None, got {self.start_step!r}")
        bad = [a for a in self.activities if a not in ACTIVITIES]
        if bad or not self.activities:
            raise ValueError(f"activities must be a non-empty subset of {sorted(ACTIVITIES)}, got {list(self.activities)}")
        if not self.max_duration_s > 0:
            raise ValueError(f"max_duration_s must be > 0, got {self.max_duration_s!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        if not self.prefix or "/" in self.prefix or "\0" in self.prefix:
            raise ValueError(f"prefix must be a plain file name part, got {self.prefix!r}")

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> ProfileRequest:
        """Build from a JSON body (the control socket's ``profile.start``); raises ValueError."""
        known = {
            "num_steps", "start_step", "activities", "output_dir", "with_stack", "record_shapes",
            "profile_memory", "max_duration_s", "backend", "prefix",
        }
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"unknown profile.start fields: {unknown}")
        args = dict(body)
        if "activities" in args:
            acts = args["activities"]
            if isinstance(acts, str):
                acts = [a.strip() for a in acts.split(",") if a.strip()]
            args["activities"] = tuple(str(a).upper() for a in acts)
        if "num_steps" not in args:
            raise ValueError("profile.start needs num_steps")
        try:
            return cls(**args)
        except TypeError as exc:
            raise ValueError(str(exc)) from None


def _default_dir() -> Path:
    for env in (ENV_PROFILE_DIR, "SGLANG_TORCH_PROFILER_DIR"):
        value = os.environ.get(env)
        if value:
            return Path(value)
    import tempfile

    return Path(tempfile.gettempdir())


@dataclass(slots=True)
class _Session:
    session_id: str
    request: ProfileRequest
    output_dir: Path
    requested_unix_nano: int
    deadline_monotonic_s: float
    state: str = "pending"
    stop_reason: str = ""
    owner_thread: int = 0
    forward_ct_at_start: int | None = None
    steps_captured: int = 0
    start_time_unix_nano: int = 0
    end_time_unix_nano: int = 0
    files: list[str] = field(default_factory=list)
    error: str = ""
    detail: str = ""
    activities_used: tuple[str, ...] = ()
    run: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        req = self.request
        return {
            "session_id": self.session_id,
            "backend": req.backend,
            "state": self.state,
            "finished": self.state in _FINISHED,
            "stop_reason": self.stop_reason,
            "num_steps": req.num_steps,
            "start_step": req.start_step,
            "activities": list(req.activities),
            "activities_used": list(self.activities_used),
            "output_dir": str(self.output_dir),
            "max_duration_s": req.max_duration_s,
            "requested_unix_nano": self.requested_unix_nano,
            "forward_ct_at_start": self.forward_ct_at_start,
            "steps_captured": self.steps_captured,
            "start_time_unix_nano": self.start_time_unix_nano,
            "end_time_unix_nano": self.end_time_unix_nano,
            "files": list(self.files),
            "error": self.error,
            "detail": self.detail,
            **self.extra,
        }


_lock = threading.Lock()
_cond = threading.Condition(_lock)
_current: _Session | None = None
_history: deque[_Session] = deque(maxlen=HISTORY)
_seq = itertools.count(1)


# --- backends (each object is used for one session, on the model thread only) --------------


def _import_torch() -> Any:
    # torch warns at import when numpy is absent; that is not the server's business here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
        import torch.profiler
    return torch


class _TorchRun:
    """One torch.profiler session: a fresh ``profile`` object, a unique file."""

    def __init__(self, s: _Session) -> None:
        self.s = s
        self.prof: Any = None
        self.path = s.output_dir / f"{s.request.prefix}-{os.getpid()}-{s.session_id}.trace.json.gz"

    def start(self) -> None:
        torch = _import_torch()
        from torch.profiler import ProfilerAction, ProfilerActivity

        req = self.s.request
        supported = torch.profiler.supported_activities()
        acts: list[Any] = []
        used: list[str] = []
        if "CPU" in req.activities and ProfilerActivity.CPU in supported:
            acts.append(ProfilerActivity.CPU)
            used.append("CPU")
        if "GPU" in req.activities:
            for name in ("CUDA", "XPU", "MTIA"):
                act = getattr(ProfilerActivity, name, None)
                if act is not None and act in supported:
                    acts.append(act)
                    used.append("GPU")
                    break
        if not acts:
            raise RuntimeError(f"none of the activities {list(req.activities)} is supported by this torch build")
        self.s.activities_used = tuple(used)
        dropped = [a for a in req.activities if a not in used and a != "MEM"]
        if dropped:
            self.s.detail = f"{', '.join(dropped)} {'activity' if len(dropped) == 1 else 'activities'} not supported here, skipped"
        # A schedule that always records makes torch emit ProfilerStep#k ranges on prof.step().
        self.prof = torch.profiler.profile(
            activities=acts,
            schedule=lambda _step: ProfilerAction.RECORD,
            record_shapes=req.record_shapes,
            profile_memory=req.profile_memory or "MEM" in req.activities,
            with_stack=req.with_stack,
        )
        self.prof.start()
        _tracing._set_profiling(True)

    def step(self, n: int) -> None:
        self.prof.step()

    def stop(self) -> list[str]:
        _tracing._set_profiling(False)
        prof, self.prof = self.prof, None
        prof.stop()
        # created 0600 first: torch (and gzip) write into it and keep its mode, so the trace
        # (code paths, shapes) is never readable by other users, not even while written
        with contextlib.suppress(FileExistsError):
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        prof.export_chrome_trace(str(self.path))
        return [str(self.path)]

    def abort(self) -> None:
        """Best-effort cleanup after an error (model thread only)."""
        _tracing._set_profiling(False)
        prof, self.prof = self.prof, None
        if prof is not None:
            # already failing; the first error is the one reported
            with contextlib.suppress(Exception):
                prof.stop()


def _mlx_memory(mx: Any) -> dict[str, int]:
    """MLX memory counters in bytes (top-level API in mlx >= 0.22, ``mx.metal.*`` before)."""
    out: dict[str, int] = {}
    for key, fn in (("active", "get_active_memory"), ("peak", "get_peak_memory"), ("cache", "get_cache_memory")):
        getter = getattr(mx, fn, None) or getattr(mx.metal, fn, None)
        if getter is not None:
            out[key] = int(getter())
    return out


class _MlxRun:
    """One MLX session: a Metal ``.gputrace`` capture where Metal capture works, else per-step
    spans with MLX memory counters (and a JSON file of them) and a result that says no Metal
    trace was captured."""

    def __init__(self, s: _Session) -> None:
        self.s = s
        base = f"{s.request.prefix}-{os.getpid()}-{s.session_id}"
        self.gputrace = s.output_dir / f"{base}.gputrace"
        self.steps_file = s.output_dir / f"{base}.mlx-steps.json"
        self.mx: Any = None
        self.capturing = False
        self.steps: list[dict[str, Any]] = []
        self.last_ns = 0
        self.tracer: Any = None

    def start(self) -> None:
        import mlx.core as mx

        self.mx = mx
        if not mx.metal.is_available():
            reason = "Metal is not available (mx.metal.is_available() is False; on Linux MLX capture is a no-op)"
        elif not _MTL_CAPTURE_AT_LAUNCH:
            reason = "MTL_CAPTURE_ENABLED=1 was not set when the process launched"
        else:
            reason = ""
        if reason:
            self.s.extra["metal_trace_captured"] = False
            self.s.detail = f"no Metal trace captured: {reason}; recorded per-step MLX memory counters instead"
        else:
            mx.metal.start_capture(str(self.gputrace))
            self.capturing = True
            self.s.extra["metal_trace_captured"] = True
        self.s.activities_used = ("GPU",) if self.capturing else ()
        self.tracer = _tracing.get_tracer()
        if hasattr(mx, "reset_peak_memory"):
            mx.reset_peak_memory()
        self.last_ns = time.time_ns()

    def _record(self, n: int) -> None:
        now = time.time_ns()
        mem = _mlx_memory(self.mx)
        rec = {"forward_ct": n, "start_time_unix_nano": self.last_ns, "end_time_unix_nano": now}
        rec.update({f"{k}_memory_bytes": v for k, v in mem.items()})
        self.steps.append(rec)
        attrs = {"servewatch.forward_ct": n, "servewatch.profile.session_id": self.s.session_id}
        attrs.update({f"mlx.memory.{k}_bytes": v for k, v in mem.items()})
        span = self.tracer.start_span("mlx.step", start_time=self.last_ns, attributes=attrs)
        span.end(end_time=now)
        self.last_ns = now

    def step(self, n: int) -> None:
        self._record(n)

    def stop(self) -> list[str]:
        # The hook of the last captured step calls stop() instead of step(): record it here.
        self._record(self.s.forward_ct_at_start + self.s.steps_captured)  # type: ignore[operator]
        files: list[str] = []
        if self.capturing:
            self.capturing = False
            self.mx.metal.stop_capture()
            if self.gputrace.exists():
                files.append(str(self.gputrace))
        body = {
            "session_id": self.s.session_id,
            "metal_trace_captured": bool(files),
            "detail": self.s.detail,
            "steps": self.steps,
        }
        tmp = self.steps_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.steps_file)
        files.append(str(self.steps_file))
        return files

    def abort(self) -> None:
        if self.capturing:
            self.capturing = False
            # already failing; the first error is the one reported
            with contextlib.suppress(Exception):
                self.mx.metal.stop_capture()


# --- state machine ---------------------------------------------------------------------------


def _set_profiling_word(active: bool) -> None:
    words = _sdk._words
    if words is not None:
        words[W_PROFILING] = 1 if active else 0


def _finish_locked(s: _Session, state: str, *, error: str = "") -> None:
    global _current
    s.state = state
    if error:
        s.error = error
    s.end_time_unix_nano = time.time_ns()
    s.run = None
    if _current is s:
        _current = None
        _sdk.remove_step_hook(_on_step)
    _history.append(s)
    _set_profiling_word(False)
    _cond.notify_all()


def _reap_locked() -> None:
    """Apply the wall-clock bound (any thread): expire a pending session, mark a running one."""
    s = _current
    if s is None or time.monotonic() < s.deadline_monotonic_s:
        return
    if s.state == "pending":
        s.stop_reason = "deadline"
        _finish_locked(s, "expired")
    elif s.state == "running":
        s.state = "stopping"
        s.stop_reason = "deadline"


def _on_step(n: int) -> None:
    """Step hook: runs on the thread that called :func:`agent.sdk.step`.

    The lock guards state changes only; the profiler's own start/step/stop/export run outside
    it (only the owner thread touches ``run``), so status queries never wait on an export.
    """
    s = _current
    if s is None:
        return
    me = threading.get_ident()
    if s.state == "pending":
        _start_pending(s, n, me)
        return
    if s.owner_thread != me or s.state not in ("running", "stopping"):
        return  # only the thread that started the profiler may step or stop it
    with _lock:
        s.steps_captured += 1
        _reap_locked()
        done = s.steps_captured >= s.request.num_steps or s.state == "stopping"
        if done and s.state == "running":
            s.state = "stopping"
            s.stop_reason = "num_steps"
        run = s.run
    if not done:
        try:
            run.step(n)
        except Exception as exc:  # noqa: BLE001
            run.abort()
            with _lock:
                _finish_locked(s, "failed", error=f"profiler step failed: {type(exc).__name__}: {exc}")
        return
    _stop_run(s, run)


def _start_pending(s: _Session, n: int, me: int) -> None:
    """Step ``n`` of a pending session: start its profiler on this thread (``me``) once due."""
    with _lock:
        if _current is not s or s.state != "pending":
            return
        _reap_locked()
        if s.state != "pending":
            return
        if s.request.start_step is not None and n < s.request.start_step:
            return
        if s.request.backend == "torch" and foreign_profiler_active():
            _finish_locked(s, "refused", error=ALREADY_PROFILING)
            return
        s.owner_thread = me
        s.forward_ct_at_start = n
        s.state = "running"
        run = _TorchRun(s) if s.request.backend == "torch" else _MlxRun(s)
        s.run = run
    try:
        s.output_dir.mkdir(parents=True, exist_ok=True)
        run.start()
    except Exception as exc:  # noqa: BLE001 - a profiler failure must not kill the server
        run.abort()
        with _lock:
            _finish_locked(s, "failed", error=f"profiler start failed: {type(exc).__name__}: {exc}")
        return
    with _lock:
        s.start_time_unix_nano = time.time_ns()
        _set_profiling_word(True)
        _cond.notify_all()


def _stop_run(s: _Session, run: Any) -> None:
    """Stop the profiler of a session that is done, export its trace and finish the session."""
    final = {"num_steps": "completed", "deadline": "expired"}.get(s.stop_reason, "stopped")
    try:
        files = run.stop()
    except Exception as exc:  # noqa: BLE001
        run.abort()
        with _lock:
            _finish_locked(s, "failed", error=f"profiler stop/export failed: {type(exc).__name__}: {exc}")
        return
    kept = [f for f in files if _nonempty(f)]
    with _lock:
        s.files = kept
        if not kept:
            _finish_locked(s, "failed", error=f"the profiler wrote no trace file (expected {files})")
        else:
            _finish_locked(s, final)


#: Why a session is refused while the server's own profiler runs (control-socket error detail).
ALREADY_PROFILING = "the server is already profiling (a torch profiler servewatch did not start is running); not started"


def foreign_profiler_active() -> bool:
    """Whether a torch profiler this module did not start runs in this process (torch imported
    only if the server already did): ``torch.autograd.profiler._is_profiler_enabled`` (set by
    ``profile.__enter__``/``start``) or autograd's profiler state (kineto, per
    ``torch.autograd._profiler_enabled()``). Call with no session of ours running."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
            return True
        return bool(torch.autograd._profiler_enabled())
    except Exception:  # noqa: BLE001 - a torch without these: cannot tell, assume none
        return False


def _nonempty(path: str) -> bool:
    try:
        p = Path(path)
        return p.is_dir() or p.stat().st_size > 0
    except OSError:
        return False


# --- public API (any thread) -----------------------------------------------------------------


def request_profile(req: ProfileRequest) -> str:
    """Queue a profiling session; it starts at the next step (or once ``start_step`` is reached).

    Thread-safe. The profiler itself is started by the next :func:`agent.sdk.step` call on the
    model thread, never here.

    Args:
        req: what to profile.

    Returns:
        The new session id (unique in this process: ``<seq>-<random hex>``).

    Raises:
        ProfilerBusyError: a session is already pending or running (start while running is
            refused; stop it first), or a torch profiler servewatch did not start runs in this
            process (the server is already profiling: never joined nor stopped).
        ImportError: the backend's library (torch / mlx) is not importable in this process.
    """
    global _current
    if req.backend == "torch":
        _import_torch()
    else:
        import mlx.core  # noqa: F401
    out_dir = Path(req.output_dir) if req.output_dir else _default_dir()
    with _lock:
        _reap_locked()
        if _current is not None:
            cur = _current
            raise ProfilerBusyError(
                f"profiling session {cur.session_id} is already {cur.state}; stop it first (profile.stop)"
            )
        if req.backend == "torch" and foreign_profiler_active():
            raise ProfilerBusyError(ALREADY_PROFILING)
        sid = f"{next(_seq)}-{os.urandom(4).hex()}"
        s = _Session(
            session_id=sid,
            request=req,
            output_dir=out_dir,
            requested_unix_nano=time.time_ns(),
            deadline_monotonic_s=time.monotonic() + req.max_duration_s,
        )
        _current = s
        _sdk.add_step_hook(_on_step)
        _cond.notify_all()
        return sid


def request_stop() -> str:
    """Ask the current session to stop. Thread-safe and idempotent.

    Returns:
        ``"stopping"`` when a running session will be stopped and exported at the next step on
        its own thread; ``"stopped"`` when a session still waiting for its start step was
        cancelled (no profiler was started); ``"already_stopped"`` when nothing runs.
    """
    with _lock:
        _reap_locked()
        s = _current
        if s is None:
            return "already_stopped"
        if s.state == "pending":
            s.stop_reason = "requested"
            _finish_locked(s, "cancelled")
            return "stopped"
        if s.state == "running":
            s.state = "stopping"
            s.stop_reason = "requested"
        return "stopping"


def status() -> dict[str, Any]:
    """This process's profiling state (JSON-ready).

    Returns:
        ``{"state": "idle"|"pending"|"running"|"stopping", "session": <current or None>,
        "last": <last finished or None>, "forward_ct": int, "pid": int}``.
    """
    with _lock:
        _reap_locked()
        s = _current
        last = _history[-1] if _history else None
        return {
            "pid": os.getpid(),
            "state": "idle" if s is None else s.state,
            "session": None if s is None else s.to_dict(),
            "last": None if last is None else last.to_dict(),
            "forward_ct": _sdk.forward_ct(),
        }


def session(session_id: str) -> dict[str, Any] | None:
    """One session (current or among the last ``HISTORY`` finished), or ``None`` if unknown."""
    with _lock:
        _reap_locked()
        return _find_locked(session_id)


def _find_locked(session_id: str) -> dict[str, Any] | None:
    if _current is not None and _current.session_id == session_id:
        return _current.to_dict()
    for s in reversed(_history):
        if s.session_id == session_id:
            return s.to_dict()
    return None


def wait(session_id: str, timeout_s: float) -> dict[str, Any] | None:
    """Block until a session is finished or ``timeout_s`` passes (never call it on the model
    thread: the session only progresses when that thread steps).

    Returns:
        The session dict (check ``finished``), or ``None`` when the id is unknown.
    """
    deadline = time.monotonic() + timeout_s
    with _lock:
        while True:
            _reap_locked()
            found = _find_locked(session_id)
            if found is None or found["finished"]:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return found
            # Wake at least every 50 ms so a deadline passing is noticed without a step.
            _cond.wait(timeout=min(left, 0.05))


def _after_fork_in_child() -> None:
    global _lock, _cond, _current
    _lock = threading.Lock()
    _cond = threading.Condition(_lock)
    _current = None
    _history.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
