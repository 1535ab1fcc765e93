"""The profiler actor: one step-bounded profiling session of a live server, files found after.

Owns :class:`ProfilerActor` (its settings model, :class:`~agent.actors.config.ProfilerConfig`,
is in :mod:`agent.actors.config`), the three backends (the SDK control socket,
SGLang's and vLLM's HTTP endpoints), the bounded search for the trace files a session wrote
(:func:`find_new_files`) and :func:`profile_once` (``servewatch profile``). Imports anyio, httpx,
pydantic, :mod:`agent.model.events`, :mod:`agent.host.targets` and the SDK control-socket client
(:mod:`agent.host.sdkclient`); never a watcher or :mod:`agent.incidents.manager`. Returns
:class:`~agent.model.events.ActionResult` (action ``profile.session``) and publishes nothing itself.

A session, per backend:

``sdk``
    ``profile.start`` on ``<shm_dir>/servewatch-<uid>/servewatch-ctl.<pid>.sock``; the SDK starts torch.profiler
    on the model thread at its next ``step()`` and stops it by itself after exactly
    ``num_steps`` steps. The actor polls ``status`` (bounded) and takes the files, the steps
    captured and the state the SDK reports. At the deadline it sends ``profile.stop``
    (idempotent) and waits ``find_timeout_s`` more.
``sglang``
    ``POST /start_profile`` with SGLang's body fields (``output_dir``, ``num_steps``,
    ``start_step``, ``activities``, ``with_stack``, ``record_shapes``, ``profile_prefix``,
    per FIELD-NOTES); SGLang stops itself after ``num_steps``. The actor waits for new trace
    files in ``output_dir`` to appear and stop growing; past the deadline it calls
    ``POST /stop_profile``. SGLang answers a stop with nothing running with an error ("Profiling
    is not in progress", an HTTP 500; SGLang 0.5.23's body is a bare "Internal Server Error"):
    after its trace was written, that is ``already_stopped``, not a failure.
``vllm``
    vLLM's ``POST /start_profile`` with ``{"max_iterations": N, "profile_prefix": P}`` (vLLM
    0.32's body: its workers record exactly N engine steps and stop by themselves), then always
    ``POST /stop_profile`` (which also ends the API server's own profiler). Traces land in the
    folder vLLM was launched with (``--profiler-config`` ``torch_profiler_dir``), read from the
    server's command line (:func:`agent.host.profiletargets.vllm_trace_dir`); the session's files are
    the ones named with its unique prefix. An idle server (``/metrics``: no request running or
    waiting) is not profiled until a request comes, within the session's timeout: its workers
    would record their idle loop, a trace the real server took minutes to write, serving
    nothing meanwhile. They stay the server's: listed
    (``servewatch.profile.server_files``), never taken. Where the folder cannot be read (a remote
    server), the steps are followed on ``/metrics`` (``vllm:iteration_tokens_total_count``, one per
    engine step) and the result says where to look.

Every started or maybe-started session is stopped, always, bounded (``stop_timeout_s``, shielded
from cancellation): a ``/start_profile`` that timed out may still take effect when a stalled
engine resumes (vLLM: "A cancelled start may still take effect"), and an unstopped vLLM profile
records until the worker runs out of memory. A start the server refused (already profiling) is
never followed by a stop: servewatch stops only what it started.

In every backend the result is ``OK`` only when at least one new, complete trace file exists; a
session that produced no file is ``FAILED`` (or ``TIMED_OUT`` when the deadline ended it).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from pydantic import BaseModel, ConfigDict, Field

from agent.actors.config import (
    STALL_WINDOW_S,
    ProfilerConfig,
    activities_problem,
)
from agent.host.fsutil import OUTSIDE_SESSION, Claimed, SessionFolder, UnsafeFolderError
from agent.host.ownactions import PROFILE_MARGIN_S, OwnActionLog
from agent.host.sdkclient import (
    SdkCallError,
    control_path,
    control_socket_pids,
    read_step_counter,
    sdk_call,
)
from agent.host.stall import StallClock
from agent.host.startup import STARTUP_STALL
from agent.host.targets import Target
from agent.model.events import (
    Action,
    ActionResult,
    AttributeValue,
    IncidentOpened,
    Outcome,
    ProfileStopped,
    Trigger,
    frozen_attrs,
    now_ns,
)
from agent.model.lazy import LazyModule
from agent.sdk.folders import shm_dir

if TYPE_CHECKING:
    import httpx

    from agent.host.registry import BuildContext
    from agent.model.progress import ActionSink
else:
    httpx = LazyModule("httpx")  # imported at first use: a fast CLI cold start

__all__ = [
    "ACTION",
    "ProfilerActor",
    "ProfilerConfig",
    "SessionRequest",
    "activities_problem",
    "create",
    "find_new_files",
    "profile_once",
    "snapshot_dir",
]

logger = logging.getLogger(__name__)

#: Span/action name of one profiling session.
ACTION = Action.PROFILE_SESSION
#: Trace file name endings a session may write (torch Chrome traces, Metal captures, MLX steps).
TRACE_SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".gputrace", ".mlx-steps.json")
_NOT_IN_PROGRESS = "not in progress"
_ALREADY_RUNNING = "already in progress"


class SessionRequest(BaseModel):
    """One session's parameters (from config, CLI flags or the incident policy)."""

    model_config = ConfigDict(frozen=True)

    num_steps: int = Field(ge=1)
    start_step: int | None = None
    activities: tuple[str, ...] = ("CPU", "GPU")
    output_dir: Path
    timeout_s: float = Field(gt=0)


# --- files -----------------------------------------------------------------------------------


def _entry_size(path: Path) -> int:
    """Size of a file, or the total of a bundle folder (``.gputrace``), in bytes; ``-1`` when it
    cannot be read. Symlinks are never followed (``lstat``; a symlink counts as 0)."""
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            total = 0
            for root, _dirs, files in os.walk(path):  # never descends into a symlinked folder
                for name in files:
                    try:
                        total += os.lstat(os.path.join(root, name)).st_size
                    except OSError:
                        continue
            return total
        return st.st_size if stat.S_ISREG(st.st_mode) else 0
    except OSError:
        return -1


def snapshot_dir(directory: Path) -> dict[str, int]:
    """``{name: size_bytes}`` of the trace-like entries directly in ``directory`` (empty if absent)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    return {n: _entry_size(directory / n) for n in names if n.endswith(TRACE_SUFFIXES)}


async def find_new_files(
    directory: Path,
    before: dict[str, int],
    *,
    timeout_s: float,
    settle_s: float = 0.5,
    poll_interval_s: float = 0.1,
) -> list[Path]:
    """Wait (bounded) for new trace files in ``directory`` and for them to stop growing.

    Args:
        directory: the session's output folder.
        before: :func:`snapshot_dir` taken before the session started; entries in it are old
            unless their size changed.
        timeout_s: the bound of the whole wait, seconds.
        settle_s: a file is complete once its size is unchanged for this long, seconds.
        poll_interval_s: poll period, seconds.

    Returns:
        The new, non-empty files/bundles whose size was stable for ``settle_s`` (possibly fewer
        than were being written when the bound passed; none when nothing appeared).
    """
    deadline = time.monotonic() + timeout_s
    stable_since: dict[Path, tuple[int, float]] = {}
    settled: list[Path] = []
    while True:
        now = time.monotonic()

        def scan() -> dict[Path, int]:
            return {directory / n: s for n, s in snapshot_dir(directory).items() if before.get(n) != s}

        current = await anyio.to_thread.run_sync(scan)  # a folder walk: off the loop
        settled = []
        pending = False
        for path, size in current.items():
            if size <= 0:
                pending = True
                continue
            prev = stable_since.get(path)
            if prev is None or prev[0] != size:
                stable_since[path] = (size, now)
                pending = True
            elif now - prev[1] >= settle_s:
                settled.append(path)
            else:
                pending = True
        if settled and not pending:
            return sorted(settled)
        if now >= deadline:
            return sorted(settled)
        await anyio.sleep(min(poll_interval_s, max(0.0, deadline - now)))


def _writer_uid(pid: int) -> int | None:
    """The effective uid ``pid`` creates files with (``/proc/PID/status``), ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        return None
    return None


class _StallWatch:
    """Work pending on the target and no forward step for ``window_s`` seconds of that busy
    time: a session waiting for the next step would never start (read from the SDK counter).

    The window counts from the later of the last step and the first read that saw work pending
    since the target was last idle: a server idle for minutes that gets a request is not
    stalled until its next step is ``window_s`` late (the counter says when the last step was,
    not when work arrived)."""

    def __init__(self, pid: int, directory: Path | None, window_s: float = STALL_WINDOW_S) -> None:
        self.pid, self.directory = pid, directory
        #: the stall rule (agent.host.stall) with T = the window; a target that never stepped stalls too
        self.clock = StallClock(window_s, before_first_step=True)

    def stalled(self) -> bool:
        """Blocking (a tmpfs read): true once busy with no step for the window."""
        snap = read_step_counter(self.pid, self.directory)
        busy = snap is not None and snap.pending > 0  # idle (or no counter): not a stall
        last = snap.last_step_monotonic_ns if snap is not None and snap.forward_ct > 0 else None
        return self.clock.stalled(busy=busy, last_progress_ns=last, read_ns=time.monotonic_ns())


# --- the session -----------------------------------------------------------------------------



def _start_body(config: ProfilerConfig, req: SessionRequest) -> dict[str, Any]:
    """The SDK control socket's ``profile.start`` request for one session."""
    body: dict[str, Any] = {
        "cmd": "profile.start",
        "num_steps": req.num_steps,
        "activities": list(req.activities),
        "output_dir": str(req.output_dir),
        "with_stack": config.with_stack,
        "record_shapes": config.record_shapes,
        "profile_memory": config.profile_memory,
        "max_duration_s": req.timeout_s,
        "backend": config.sdk_profiler,
    }
    if req.start_step is not None:
        body["start_step"] = req.start_step
    return body


def _sdk_status_attributes(info: dict[str, Any], *, default_profiler: str) -> dict[str, AttributeValue]:
    """The span attributes of a session's status as the SDK reports it (``profile.status``)."""
    attrs: dict[str, AttributeValue] = {
        "servewatch.profile.state": str(info.get("state", "")),
        "servewatch.profile.steps_captured": int(info.get("steps_captured") or 0),
        "servewatch.profile.stop_reason": str(info.get("stop_reason", "")),
    }
    if info.get("forward_ct_at_start") is not None:
        attrs["servewatch.profile.forward_ct_at_start"] = int(info["forward_ct_at_start"])
    if info.get("activities_used"):
        attrs["servewatch.profile.activities_used"] = tuple(info["activities_used"])
    if "metal_trace_captured" in info:
        attrs["servewatch.profile.metal_trace_captured"] = bool(info["metal_trace_captured"])
    attrs["servewatch.profile.profiler"] = str(info.get("backend", default_profiler))
    return attrs

class _Session:
    """Collects what one session did, then becomes an :class:`ActionResult`."""

    def __init__(self, backend: str, req: SessionRequest, pid: int | None) -> None:
        self.backend = backend
        self.req = req
        self.pid = pid
        self.start_ns = now_ns()
        #: The folder this session's files are taken from (set once it exists).
        self.folder: SessionFolder | None = None
        self.attrs: dict[str, AttributeValue] = {
            "servewatch.profile.backend": backend,
            "servewatch.profile.num_steps": req.num_steps,
            "servewatch.profile.activities": tuple(req.activities),
            "servewatch.profile.output_dir": str(req.output_dir),
        }
        if req.start_step is not None:
            self.attrs["servewatch.profile.start_step"] = req.start_step
        if pid is not None:
            self.attrs["process.pid"] = pid

    async def aresult(self, outcome: Outcome, detail: str, files: Sequence[Path] = (), *, retryable: bool = False) -> ActionResult:
        """:meth:`result` from a worker thread: it takes ``files`` into the session folder (walks)."""
        return await anyio.to_thread.run_sync(partial(self.result, outcome, detail, files, retryable=retryable))

    def result(self, outcome: Outcome, detail: str, files: Sequence[Path] = (), *, retryable: bool = False) -> ActionResult:
        """The session's result. ``files`` (as the target reported them, or a scan found them)
        are taken only from inside the session folder (:meth:`SessionFolder.claim`); the rest is
        said, never touched. An ``OK`` session none of whose files could be taken is ``FAILED``."""
        if files:
            claimed = self.folder.claim(files) if self.folder is not None else Claimed(
                (), 0, tuple(f"{f}: {OUTSIDE_SESSION}" for f in files))
        else:
            claimed = Claimed((), 0, ())
        if claimed.ignored:
            self.attrs["servewatch.profile.ignored"] = claimed.ignored[:20]
            logger.warning("profile session: %d reported file(s) not taken: %s", len(claimed.ignored), "; ".join(claimed.ignored[:5]))
            detail += f"; {len(claimed.ignored)} reported file(s) not taken ({claimed.ignored[0]})"
            if outcome is Outcome.OK and not claimed.paths:
                outcome = Outcome.FAILED
        self.attrs["servewatch.profile.files"] = len(claimed.paths)
        self.attrs["servewatch.profile.size_bytes"] = claimed.size_bytes
        return ActionResult(
            action=ACTION,
            outcome=outcome,
            pid=self.pid,
            retryable=retryable,
            detail=detail,
            start_time_unix_nano=self.start_ns,
            end_time_unix_nano=now_ns(),
            artifact_paths=claimed.paths,
            attributes=frozen_attrs(self.attrs),
        )


class ProfilerActor:
    """Runs profiling sessions through the configured backend.

    Args:
        config: user settings (default :class:`ProfilerConfig`).
        transport: httpx transport for the HTTP backends (tests may pass one; default: real).
        stalled: tells whether the targets' watchdog saw them stalled (an incident's profile
            then ends at once).
        progress: called with one line saying what the session waits for now, each time that
            changes or the step count moves (``servewatch profile`` shows it); never for
            incidents.
    """

    name = "profiler"
    action = ACTION
    completed = ProfileStopped
    deferred = True

    def __init__(
        self,
        config: ProfilerConfig | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        stalled: Callable[[Sequence[Target]], bool] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config or ProfilerConfig()
        self._stalled = stalled
        self._progress = progress
        self._transport = transport
        self._busy = anyio.Lock()
        #: where each session is recorded while it runs (a profile's start, warm-up and trace
        #: writing stall the server: its stall rule is paused meanwhile); memory only by default
        self.own_actions = OwnActionLog(None)

    # -- entry points -------------------------------------------------------------------------

    def socket_for(self, pid: int) -> Path:
        """The SDK control socket path of ``pid`` (blocking: reads ``/proc`` and folders)."""
        return control_path(pid, self.config.socket_dir)

    def _has_socket(self, pid: int) -> bool:
        return self.socket_for(pid).exists()

    def request(
        self,
        *,
        num_steps: int | None = None,
        start_step: int | None = None,
        activities: Sequence[str] | None = None,
        output_dir: Path | None = None,
        timeout_s: float | None = None,
    ) -> SessionRequest:
        """A :class:`SessionRequest` with config defaults for what is not given (the folder made
        absolute lexically: symlinks are not resolved here, :class:`SessionFolder` judges them)."""
        c = self.config
        return SessionRequest(
            num_steps=num_steps or c.num_steps,
            start_step=start_step if start_step is not None else c.start_step,
            activities=tuple(activities or c.activities),
            # lexical, never resolved: a symlink planted on the way is refused by SessionFolder.create
            output_dir=Path(os.path.abspath(output_dir or c.output_dir or "profiles")),
            timeout_s=timeout_s or c.max_duration_s,
        )

    async def act(self, trigger: IncidentOpened, target: Target, *, timeout_s: float, artifact_dir: Path) -> ActionResult:
        """Profile ``target`` for the incident (``on_incident_steps`` steps, else ``num_steps``)."""
        make_request = partial(
            self.request,
            num_steps=self.config.on_incident_steps or self.config.num_steps,
            output_dir=self.config.output_dir or artifact_dir,
            timeout_s=min(timeout_s, self.config.max_duration_s),
        )
        req = await anyio.to_thread.run_sync(make_request)  # makes the folder absolute: reads the cwd
        return await self.profile(req, pid=target.pid)

    async def run_phase(
        self, opened: IncidentOpened, targets: Sequence[Target], artifact_dir: Path, report: ActionSink
    ) -> list[ActionResult]:
        """The incident phase (:class:`agent.actors.Actor`): :meth:`profile_incident`, skipped
        (one ``SKIPPED`` result) for a stall or a start-up stall (:mod:`agent.host.startup`: no first
        step yet), or when ``stalled(targets)`` says a target is busy with no step: a stalled
        server takes no steps, so waiting for them would only time out."""
        if opened.trigger == STARTUP_STALL:
            t = now_ns()
            return [ActionResult(action=ACTION, outcome=Outcome.SKIPPED, detail="no steps: server stuck in start-up",
                                 start_time_unix_nano=t, end_time_unix_nano=t)]
        stalled = self._stalled
        if opened.trigger == Trigger.STALL or (
            stalled is not None and await anyio.to_thread.run_sync(stalled, targets)  # shm counter reads
        ):
            t = now_ns()
            return [ActionResult(action=ACTION, outcome=Outcome.SKIPPED, detail="no steps: server stalled",
                                 start_time_unix_nano=t, end_time_unix_nano=t)]
        return await self.profile_incident(opened, list(targets), artifact_dir=artifact_dir)

    async def profile_incident(
        self, opened: IncidentOpened, targets: Sequence[Target], *, artifact_dir: Path
    ) -> list[ActionResult]:
        """The incident phase: profile the next ``on_incident_steps`` steps.

        ``sdk``: every target serving a control socket, in parallel (targets without one are
        skipped; if none has one, one ``SKIPPED`` result says so). ``sglang``/``vllm``: one
        session through the server's HTTP endpoint.
        """
        c = self.config
        make_request = partial(self.request, num_steps=c.on_incident_steps or c.num_steps, output_dir=c.output_dir or artifact_dir)
        req = await anyio.to_thread.run_sync(make_request)  # makes the folder absolute: reads the cwd
        if c.backend != "sdk":
            return [await self.profile(req)]
        with_socket = [t for t in targets if await anyio.to_thread.run_sync(self._has_socket, t.pid)]
        if not with_socket:
            s = _Session("sdk", req, None)
            return [s.result(Outcome.SKIPPED, "no target serves an SDK control socket (agent.sdk.serve_control())")]
        results: list[ActionResult | None] = [None] * len(with_socket)

        async def one(i: int, target: Target) -> None:
            out = req.output_dir / f"pid-{target.pid}" if len(with_socket) > 1 else req.output_dir
            results[i] = await self.profile(req.model_copy(update={"output_dir": out}), pid=target.pid)

        async with anyio.create_task_group() as tg:
            for i, t in enumerate(with_socket):
                tg.start_soon(one, i, t)
        return [r for r in results if r is not None]

    async def profile(self, req: SessionRequest, *, pid: int | None = None) -> ActionResult:
        """Run one session and return its result; never raises for the target's misbehaviour.

        While it runs it is recorded as a ``profile`` own action of ``pid`` (or of the server's
        port, for the HTTP backends), bounded by the session's own bound (``req.timeout_s`` plus
        the find and stop bounds) and :data:`agent.host.ownactions.PROFILE_MARGIN_S`: the server's
        stall rule is paused meanwhile (:mod:`agent.watchers.watchdog`).

        The target writes into a session folder the agent creates (:class:`SessionFolder`:
        ``req.output_dir`` itself when the agent makes it now or it is the agent's own private
        folder, else a fresh sub-folder); its files are taken only from there."""
        backend = self.config.backend
        if backend == "sdk" and pid is None:
            return _Session(backend, req, pid).result(Outcome.FAILED, "the sdk backend needs a target pid")
        c = self.config
        port = None if backend == "sdk" else _url_port(c.base_url)
        bound_s = req.timeout_s + c.find_timeout_s + c.stop_timeout_s + PROFILE_MARGIN_S
        with anyio.CancelScope(shield=True):
            server = pid if backend == "sdk" else await anyio.to_thread.run_sync(_local_listener, c.base_url)
            token = await anyio.to_thread.run_sync(partial(
                self.own_actions.begin, "profile", pid=server, port=port, bound_s=bound_s,
                detail=f"{req.num_steps} step(s), {backend}"))
        try:
            return await self._profile(req, pid=pid)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                await anyio.to_thread.run_sync(self.own_actions.end, token)

    async def _profile(self, req: SessionRequest, *, pid: int | None = None) -> ActionResult:
        backend = self.config.backend
        s = _Session(backend, req, pid)
        if backend == "vllm":  # vLLM writes to its own launch-time folder: nothing to create
            try:
                return await self._http_session(s)
            except Exception as exc:
                logger.exception("profiling session failed")
                return s.result(Outcome.FAILED, f"{type(exc).__name__}: {exc}")
        writer = await anyio.to_thread.run_sync(_writer_uid, pid) if backend == "sdk" and pid is not None else None
        try:
            s.folder = await anyio.to_thread.run_sync(partial(SessionFolder.create, req.output_dir, writer_uid=writer))
        except UnsafeFolderError as exc:  # another user's folder or symlink on the way: never followed
            return s.result(Outcome.FAILED, f"output folder {str(req.output_dir)!r} refused: {exc}")
        except OSError as exc:
            return s.result(Outcome.FAILED, f"cannot create {str(req.output_dir)!r}: {exc.strerror or exc}")
        if s.folder.path != req.output_dir:
            s.req = req.model_copy(update={"output_dir": s.folder.path})
            s.attrs["servewatch.profile.output_dir"] = str(s.folder.path)
        try:
            if backend == "sdk":
                sock = await anyio.to_thread.run_sync(self.socket_for, pid)  # type: ignore[arg-type]  # file system
                result = await self._sdk_session(s, sock)
            else:
                result = await self._http_session(s)
        except Exception as exc:
            logger.exception("profiling session failed")
            result = s.result(Outcome.FAILED, f"{type(exc).__name__}: {exc}")
        if not result.artifact_paths:  # a session with no trace leaves no folder behind
            await anyio.to_thread.run_sync(s.folder.remove_if_empty)
        return result

    # -- sdk ----------------------------------------------------------------------------------

    async def _sdk_session(self, s: _Session, sock: Path) -> ActionResult:
        c, req = self.config, s.req
        s.attrs["servewatch.profile.socket"] = str(sock)
        self._say(f"asking pid {s.pid} to profile its next {req.num_steps} forward step(s)")
        try:
            reply = await sdk_call(sock, _start_body(c, req), timeout_s=c.request_timeout_s, pid=s.pid)
        except SdkCallError as exc:
            return s.result(exc.outcome, exc.detail, retryable=exc.outcome is Outcome.TIMED_OUT)
        if not reply.get("ok"):
            code = reply.get("error", "")
            outcome = {"busy": Outcome.REFUSED, "unsupported": Outcome.UNSUPPORTED}.get(code, Outcome.FAILED)
            return s.result(outcome, f"profile.start refused ({code}): {reply.get('detail', '')}", retryable=code == "busy")
        sid = str(reply["session_id"])
        s.attrs["servewatch.profile.session_id"] = sid
        try:
            return await self._sdk_follow(s, sock, sid)
        except anyio.get_cancelled_exc_class():
            # Ctrl-C / shutdown: a session left pending would start at the server's next step and
            # refuse every other profile as busy until its own deadline; stop it, bounded
            with anyio.CancelScope(shield=True), anyio.move_on_after(c.request_timeout_s):
                try:
                    await sdk_call(sock, {"cmd": "profile.stop"}, timeout_s=c.request_timeout_s, pid=s.pid)
                except SdkCallError:
                    pass
            raise

    async def _sdk_follow(self, s: _Session, sock: Path, sid: str) -> ActionResult:
        """Wait for the started session ``sid`` to end (steps, stall, deadline) and read its result."""
        c, req = self.config, s.req
        # The SDK ends the session itself (steps or its own deadline); allow for the export.
        watch = _StallWatch(s.pid, c.socket_dir, c.stall_window_s) if s.pid is not None else None
        info = await self._sdk_wait(sock, sid, req.timeout_s + c.find_timeout_s, pid=s.pid, stall=watch)
        if info is not None and info.get("stalled"):
            await self._sdk_stop(sock, s.pid)  # cancels the pending session
            s.attrs["servewatch.profile.state"] = "stalled"
            s.attrs["servewatch.profile.steps_captured"] = 0
            return s.result(
                Outcome.SKIPPED,
                f"no steps: server stalled (work pending and no forward step for {c.stall_window_s:g} s)",
                retryable=True,
            )
        stopped_by_us = False
        if info is None or not info.get("finished"):
            stopped_by_us = True
            await self._sdk_stop(sock, s.pid)
            info = await self._sdk_wait(sock, sid, c.find_timeout_s, pid=s.pid) or info
        if info is None:
            return s.result(Outcome.FAILED, f"session {sid} vanished from the target's status")
        return await self._sdk_outcome(s, sid, info, stopped_by_us=stopped_by_us)

    async def _sdk_stop(self, sock: Path, pid: int | None) -> None:
        """``profile.stop``, its failure ignored."""
        try:
            await sdk_call(sock, {"cmd": "profile.stop"}, timeout_s=self.config.request_timeout_s, pid=pid)
        except SdkCallError:
            pass

    async def _sdk_outcome(self, s: _Session, sid: str, info: dict[str, Any], *, stopped_by_us: bool) -> ActionResult:
        """The result of an ended SDK session from its last status ``info``."""
        c, req = self.config, s.req
        state = str(info.get("state", ""))
        s.attrs.update(_sdk_status_attributes(info, default_profiler=c.sdk_profiler))
        # The SDK reports a session finished only after its export returned. What it reports is
        # taken only from inside the session folder (the target chose these strings).
        files = _sdk_reported_files(info)
        note = f"; {info['detail']}" if info.get("detail") else ""
        if not info.get("finished"):
            return s.result(Outcome.TIMED_OUT, f"session {sid} still {state} after the deadline (the model thread has not stepped){note}", retryable=True)
        if state in ("completed", "stopped") and files:
            return await s.aresult(Outcome.OK, f"{state}: {s.attrs['servewatch.profile.steps_captured']} steps, {len(files)} file{'' if len(files) == 1 else 's'}{note}", files)
        if state == "expired":
            steps = s.attrs["servewatch.profile.steps_captured"]
            return await s.aresult(
                Outcome.TIMED_OUT,
                f"session expired after {req.timeout_s} s with {steps} steps captured"
                + (" (idle server: no step came, no profiler was started)" if steps == 0 else "")
                + note,
                files,
                retryable=True,
            )
        if state == "cancelled":
            return s.result(Outcome.ALREADY_STOPPED, f"session cancelled before it started{note}")
        if state == "refused":  # the server's own profiler ran at the start step: left alone
            return s.result(Outcome.REFUSED, str(info.get("error") or "the server is already profiling"), retryable=True)
        err = info.get("error") or "the session produced no trace file"
        return await s.aresult(Outcome.FAILED, f"{state}: {err}{' (stopped by servewatch)' if stopped_by_us else ''}", files)

    async def _sdk_wait(
        self, sock: Path, sid: str, timeout_s: float, pid: int | None = None, stall: _StallWatch | None = None
    ) -> dict[str, Any] | None:
        """Poll the session's status until it finished or ``timeout_s`` passed; with ``stall``,
        a session still pending on a stalled target comes back at once with ``stalled: True``."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, Any] | None = None
        while True:
            try:
                reply = await sdk_call(sock, {"cmd": "status", "session_id": sid}, timeout_s=self.config.request_timeout_s, pid=pid)
            except SdkCallError:
                reply = {}
            if isinstance(reply.get("session"), dict):
                info = reply["session"]
                self._say_session(info, pid)
                if info.get("finished"):
                    return info
                if stall is not None and info.get("state") == "pending" and await anyio.to_thread.run_sync(stall.stalled):
                    return {**info, "stalled": True}
            if time.monotonic() >= deadline:
                return info
            await anyio.sleep(self.config.poll_interval_s)

    def _say(self, line: str) -> None:
        if self._progress is not None:
            self._progress(line)

    def _say_session(self, info: dict[str, Any], pid: int | None) -> None:
        """What a pending or running SDK session waits for, in words."""
        state, captured = info.get("state"), info.get("steps_captured") or 0
        if state == "pending":
            self._say(f"waiting for the next forward step of pid {pid} (no traffic? a hung rank?)")
        elif state == "running":
            self._say(f"recording pid {pid}: {captured}/{info.get('num_steps') or '?'} forward step(s)")
        elif state in ("exporting", "stopping"):
            self._say(f"pid {pid} is writing its trace")

    # -- sglang / vllm ------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.config.base_url, timeout=self.config.request_timeout_s, transport=self._transport
        )

    async def _http_session(self, s: _Session) -> ActionResult:
        s.attrs["url.full"] = self.config.base_url
        async with self._client() as client:
            if self.config.backend == "sglang":
                return await self._sglang_session(s, client)
            return await self._vllm_session(s, client)

    async def _start(self, s: _Session, client: httpx.AsyncClient, body: dict[str, Any]) -> ActionResult | bool:
        """``POST /start_profile``. Returns ``True`` (started), ``False`` (maybe started: no
        answer in time, the connection broke) or the result that ends the session (never
        reached, no endpoint, refused: nothing of ours runs)."""
        c = self.config
        start = await self._post(client, "/start_profile", body, timeout_s=c.request_timeout_s)
        if isinstance(start, httpx.HTTPError):
            if isinstance(start, (httpx.ConnectError, httpx.ConnectTimeout)):
                return s.result(Outcome.FAILED, f"POST /start_profile: {_error_text(start)}", retryable=True)
            s.attrs["servewatch.profile.start"] = "no_answer"
            return False
        if start.status_code == 404:
            hint = " (vLLM enables it only when launched with --profiler-config)" if c.backend == "vllm" else ""
            return s.result(Outcome.UNSUPPORTED, f"the server has no /start_profile endpoint{hint}")
        if start.status_code >= 400:
            text = start.text.strip()[:300]
            already = _ALREADY_RUNNING in text.lower() or "already active" in text.lower() or start.status_code == 409
            outcome = Outcome.REFUSED if already else Outcome.FAILED
            why = f"the server is already profiling (not ours: left running): {text}" if already else text
            return s.result(outcome, f"POST /start_profile -> {start.status_code}: {why}", retryable=already)
        s.attrs["servewatch.profile.start"] = "started"
        return True

    async def _stop(self, s: _Session, client: httpx.AsyncClient) -> str:
        """``POST /stop_profile``, bounded by ``stop_timeout_s`` and shielded from cancellation
        (a session cancelled by its incident's deadline still stops what it started)."""
        with anyio.CancelScope(shield=True):
            reply = await self._post(client, "/stop_profile", None, timeout_s=self.config.stop_timeout_s)
        status = _stop_status(reply, self.config.stop_timeout_s)
        s.attrs["servewatch.profile.stop"] = status
        return status

    async def _sglang_session(self, s: _Session, client: httpx.AsyncClient) -> ActionResult:
        c, req = self.config, s.req
        before = await anyio.to_thread.run_sync(snapshot_dir, req.output_dir)  # file system: off the loop
        body: dict[str, Any] = {
            "output_dir": str(req.output_dir),
            "num_steps": req.num_steps,
            "activities": list(req.activities),
            "with_stack": c.with_stack,
            "record_shapes": c.record_shapes,
            "profile_prefix": "servewatch",
        }
        if req.start_step is not None:
            body["start_step"] = req.start_step
        started = await self._start(s, client, body)
        if isinstance(started, ActionResult):
            return started
        deadline = time.monotonic() + req.timeout_s
        files: list[Path] = []
        try:
            # SGLang stops itself after num_steps and writes the trace: wait for it.
            self._say(f"waiting for SGLang at {c.base_url} to run {req.num_steps} forward step(s) and write its trace"
                      " (no traffic on the server?)")
            files = await find_new_files(
                req.output_dir, before, timeout_s=req.timeout_s, settle_s=c.settle_s, poll_interval_s=c.poll_interval_s
            )
        finally:
            stop_status = await self._stop(s, client)  # "not in progress" once it stopped itself
        if files and stop_status == "failed:500":
            # SGLang 0.5.23 raises "Profiling is not in progress" inside its handler: the client
            # gets a bare 500 ("Internal Server Error", the message only in the server's log).
            # Its trace was written before the stop: it stopped by itself after num_steps.
            stop_status = s.attrs["servewatch.profile.stop"] = "already_stopped"
        if not files:
            files = await find_new_files(
                req.output_dir, before, timeout_s=c.find_timeout_s, settle_s=c.settle_s, poll_interval_s=c.poll_interval_s
            )
        if files:
            return await s.aresult(Outcome.OK, f"{len(files)} trace file(s) in {req.output_dir} (stop: {stop_status})", files)
        timed_out = time.monotonic() >= deadline
        return s.result(
            Outcome.TIMED_OUT if timed_out else Outcome.FAILED,
            f"no trace file appeared in {req.output_dir} (stop: {stop_status})",
            retryable=True,
        )

    async def _vllm_session(self, s: _Session, client: httpx.AsyncClient) -> ActionResult:
        c, req = self.config, s.req
        folder, why = await self._vllm_folder(s)
        prefix = f"servewatch-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.urandom(3).hex()}"
        s.attrs["servewatch.profile.prefix"] = prefix
        work, waited_s, steps_before = await self._vllm_wait_for_work(client, req.timeout_s)
        if waited_s > 0:
            s.attrs["servewatch.profile.idle_wait_s"] = round(waited_s, 3)
        if not work:  # nothing started, nothing to stop: the server never recorded its idle loop
            s.attrs["servewatch.profile.start"] = "not_started_idle"
            s.attrs["servewatch.profile.engine_steps_seen"] = 0
            return s.result(Outcome.TIMED_OUT, f"no engine step: idle server (no request running or waiting in {req.timeout_s:g} s);"
                                               " its profiler was not started", retryable=True)
        if waited_s > 0:  # the rest of the budget for the steps
            req = req.model_copy(update={"timeout_s": max(0.001, req.timeout_s - waited_s)})
        started = await self._start(s, client, {"max_iterations": req.num_steps, "profile_prefix": prefix})
        if isinstance(started, ActionResult):
            return started
        worker: list[Path] = []
        try:
            if started:
                self._say(f"waiting for vLLM at {c.base_url} to profile {req.num_steps} engine step(s) and write its trace"
                          " (no traffic on the server?)")
                worker = await self._vllm_wait(client, folder, prefix, steps_before, req)
        finally:
            stop_status = await self._stop(s, client)
        # traces there before the stop: vLLM's workers stopped by themselves after N steps
        auto_stopped = bool(worker)
        files = await self._vllm_files(folder, prefix, worker, started=started)
        steps_after = await self._vllm_steps(client)
        stepped = steps_after - steps_before if steps_before is not None and steps_after is not None else None
        if stepped is not None:
            s.attrs["servewatch.profile.engine_steps_seen"] = stepped
        where = (f"{folder}" if folder is not None else
                 f"the folder vLLM was launched with (--profiler-config torch_profiler_dir; not readable from here: {why})")
        return self._vllm_outcome(s, req, files, where, prefix, stop_status, folder=folder, started=started,
                                  auto_stopped=auto_stopped, stepped=stepped)

    async def _vllm_folder(self, s: _Session) -> tuple[Path | None, str]:
        """Where vLLM writes its traces (``None``: not readable from here) and why not; noted in ``s``."""
        from agent.host.profiletargets import vllm_trace_dir

        c, req = self.config, s.req
        folder, why = await anyio.to_thread.run_sync(vllm_trace_dir, c.base_url)  # socket scan, /proc
        if folder is None and c.output_dir is not None:
            folder, why = Path(os.path.abspath(c.output_dir)), ""  # the user said where the server writes (--out)
        s.attrs["servewatch.profile.output_dir"] = str(folder) if folder is not None else ""
        if req.start_step is not None:
            s.attrs["servewatch.profile.start_step_ignored"] = True
        return folder, why

    async def _vllm_files(self, folder: Path | None, prefix: str, worker: list[Path], *, started: bool) -> list[Path]:
        """The session's trace files once stopped: those the workers wrote (``worker``), else the prefixed ones."""
        c = self.config
        files: list[Path] = worker
        if folder is not None and started:
            files = await _prefixed_files(folder, prefix, timeout_s=c.find_timeout_s, settle_s=c.settle_s, poll_s=c.poll_interval_s)
        elif folder is not None:  # the start is still queued in a stalled engine: nothing to wait for
            files = [folder / n for n in await anyio.to_thread.run_sync(_prefixed_names, folder, prefix)]
        return files

    def _vllm_outcome(
        self, s: _Session, req: SessionRequest, files: list[Path], where: str, prefix: str, stop_status: str, *,
        folder: Path | None, started: bool, auto_stopped: bool, stepped: float | None,
    ) -> ActionResult:
        """The result of a stopped vLLM session, from the files it left and the engine steps seen."""
        c = self.config
        traces = [f for f in files if ".async_llm." not in f.name]
        s.attrs["servewatch.profile.server_files"] = tuple(str(f) for f in files)[:50]
        wrote = f"vLLM wrote {len(files)} trace file(s) to {where} (its own folder; prefix {prefix}; stop: {stop_status})"
        if traces and auto_stopped:
            s.attrs["servewatch.profile.steps_captured"] = req.num_steps  # vLLM's max_iterations bound
            return s.result(Outcome.OK, wrote)
        if folder is None and stepped is not None and stepped > req.num_steps:
            s.attrs["servewatch.profile.steps_captured"] = req.num_steps
            return s.result(Outcome.OK, f"{req.num_steps} engine steps profiled; vLLM wrote the traces (prefix {prefix}) to {where} (stop: {stop_status})")
        if not started:
            return s.result(Outcome.TIMED_OUT, f"POST /start_profile: no answer in {c.request_timeout_s:g} s (engine stalled?); stop: {stop_status}", retryable=True)
        idle = " (no engine step: idle server?)" if stepped == 0 else ""
        if traces:  # cut short by our stop at the deadline: fewer than N steps in them
            return s.result(Outcome.TIMED_OUT, f"{req.num_steps} steps not reached within {s.req.timeout_s:g} s{idle}; {wrote}", retryable=True)
        return s.result(Outcome.TIMED_OUT, f"no trace of {req.num_steps} steps in {where} within {s.req.timeout_s:g} s{idle}; stop: {stop_status}", retryable=True)

    async def _vllm_wait(
        self, client: httpx.AsyncClient, folder: Path | None, prefix: str, steps_before: float | None, req: SessionRequest
    ) -> list[Path]:
        """Wait (bounded by ``req.timeout_s``) until the workers wrote their traces (they stop by
        themselves after ``max_iterations``), or, with no readable folder, until ``/metrics`` counted
        more than N engine steps; without either, ``vllm_duration_s``."""
        c = self.config
        deadline = time.monotonic() + req.timeout_s
        if folder is None and steps_before is None:
            await anyio.sleep(min(c.vllm_duration_s, req.timeout_s))
            return []
        while time.monotonic() < deadline:
            if folder is not None:
                names = await anyio.to_thread.run_sync(_prefixed_names, folder, prefix)
                if any(".async_llm." not in n for n in names):
                    return await _prefixed_files(folder, prefix, timeout_s=c.find_timeout_s, settle_s=c.settle_s, poll_s=c.poll_interval_s)
            else:
                now = await self._vllm_steps(client)
                if now is not None and steps_before is not None and now - steps_before > req.num_steps:
                    return []
            await anyio.sleep(max(c.poll_interval_s, 0.25))
        return []

    async def _vllm_steps(self, client: httpx.AsyncClient) -> float | None:
        """Engine steps so far: ``vllm:iteration_tokens_total_count`` summed over engines (one
        observation per engine step, prefill-only steps too), or None when not readable."""
        return (await self._vllm_metrics(client))[0]

    async def _vllm_metrics(self, client: httpx.AsyncClient) -> tuple[float | None, float | None]:
        """``(engine steps so far, requests in the server)`` from vLLM's ``/metrics``: steps as
        :meth:`_vllm_steps`; requests: ``vllm:num_requests_running`` plus
        ``vllm:num_requests_waiting`` (gauges, summed over engines; per FIELD-NOTES). Each is
        ``None`` when it cannot be read (no answer, not Prometheus text, the metric absent)."""
        reply = await self._post(client, "/metrics", None, timeout_s=self.config.request_timeout_s, method="GET")
        if isinstance(reply, httpx.HTTPError) or reply.status_code != 200:
            return None, None
        # the parser's first import reads /proc, and a large answer takes a while: off the loop
        return await anyio.to_thread.run_sync(_vllm_metric_values, reply.text)

    async def _vllm_wait_for_work(self, client: httpx.AsyncClient, timeout_s: float) -> tuple[bool, float, float | None]:
        """Until vLLM has a request running or waiting (``/metrics``), at most ``timeout_s``
        seconds. Returns ``(work seen, seconds waited, engine steps so far)``, the steps from
        the last ``/metrics`` read (:meth:`_vllm_steps`: the session's count starts there);
        work is seen when ``/metrics`` says nothing of requests (the start is not held back on
        a guess).

        Why: vLLM's workers record from ``/start_profile`` on, steps or not. On an idle server
        that is the workers' idle loop at full Python-stack detail; stopped 16 s later, a
        worker of the real vLLM 0.32.0 server was still gzipping that trace, taking no engine
        step, 120 s later. A step-bounded profile starts when there is a step to record."""
        c = self.config
        t0 = time.monotonic()
        steps, requests = await self._vllm_metrics(client)
        if requests is None or requests > 0:
            return True, 0.0, steps
        self._say(f"vLLM at {c.base_url} is idle (no request running or waiting): waiting up to {timeout_s:g} s for one"
                  " before starting its profiler (an idle server's profile records only its idle loop)")
        while time.monotonic() - t0 < timeout_s:
            await anyio.sleep(min(max(c.poll_interval_s, 0.25), max(0.0, timeout_s - (time.monotonic() - t0))))
            steps, requests = await self._vllm_metrics(client)
            if requests is None or requests > 0:
                return True, time.monotonic() - t0, steps
        return False, time.monotonic() - t0, steps

    @staticmethod
    async def _post(
        client: httpx.AsyncClient, path: str, body: dict[str, Any] | None, *, timeout_s: float, method: str = "POST"
    ) -> httpx.Response | httpx.HTTPError:
        try:
            if body is None:
                return await client.request(method, path, timeout=timeout_s)
            return await client.request(method, path, json=body, timeout=timeout_s)
        except httpx.HTTPError as exc:
            return exc


def _sdk_reported_files(info: dict[str, Any]) -> list[Path]:
    reported = info.get("files") or ()
    return [Path(f) for f in reported if isinstance(f, str)] if isinstance(reported, list) else []


def _vllm_metric_values(text: str) -> tuple[float | None, float | None]:
    """``(engine steps, requests running + waiting)`` in vLLM's Prometheus ``text``
    (:meth:`ProfilerActor._vllm_metrics`); ``(None, None)`` when it does not parse."""
    from prometheus_client import parser as prometheus_parser

    steps: float | None = None
    requests: float | None = None
    try:
        for family in prometheus_parser.text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:iteration_tokens_total_count":
                    steps = (steps or 0.0) + float(sample.value)
                elif sample.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                    requests = (requests or 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError):
        return None, None
    return steps, requests


def _url_port(url: str | None) -> int | None:
    """The port of ``url`` (:func:`agent.verdict.servers.port_of_url`), ``None`` without one."""
    from agent.verdict.servers import port_of_url

    return port_of_url(url) if url else None


def _local_listener(url: str | None) -> int | None:
    """The process listening on ``url``'s port when ``url`` names this host (loopback or
    ``localhost``): the server's frontend, whose process group holds its engine and workers;
    ``None`` for another host or when none is found (blocking: reads the socket table)."""
    from urllib.parse import urlsplit

    from agent.verdict.servers import listener_of_port

    port = _url_port(url)
    try:
        host = urlsplit(url or "").hostname or ""
    except ValueError:
        return None
    if port is None or host not in ("localhost", "127.0.0.1", "::1", "0.0.0.0"):
        return None
    return listener_of_port(port)


def _error_text(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}"[:160]


def _prefixed_names(folder: Path, prefix: str) -> list[str]:
    """Names of trace files in ``folder`` that a session with ``prefix`` wrote (a listing only)."""
    return sorted(n for n in snapshot_dir(folder) if n.startswith(f"{prefix}_"))


async def _prefixed_files(folder: Path, prefix: str, *, timeout_s: float, settle_s: float, poll_s: float) -> list[Path]:
    """The session's files in the server's folder once their sizes held still for ``settle_s``
    (bounded by ``timeout_s``; what has settled by then)."""
    deadline = time.monotonic() + timeout_s
    seen: dict[str, tuple[int, float]] = {}
    while True:
        sizes = await anyio.to_thread.run_sync(snapshot_dir, folder)
        now = time.monotonic()
        ours = {n: z for n, z in sizes.items() if n.startswith(f"{prefix}_")}
        settled = []
        for name, size in ours.items():
            prev = seen.get(name)
            if prev is None or prev[0] != size:
                seen[name] = (size, now)
            elif size > 0 and now - prev[1] >= settle_s:
                settled.append(name)
        if ours and len(settled) == len(ours) or now >= deadline:
            return [folder / n for n in sorted(settled)]
        await anyio.sleep(poll_s)


def _stop_status(reply: httpx.Response | httpx.HTTPError, timeout_s: float) -> str:
    """``stopping`` (accepted), ``already_stopped`` (nothing was running), ``sent_no_answer``
    (no answer within ``timeout_s``: the server applies it when its engine gets to it) or
    ``failed:<why>``.

    SGLang raises "Profiling is not in progress. Call /start_profile first." when nothing runs,
    which reaches the client as an HTTP error (500): that is ``already_stopped``.
    """
    if isinstance(reply, httpx.TimeoutException) and not isinstance(reply, httpx.ConnectTimeout):
        return f"sent_no_answer_in_{timeout_s:g}s"
    if isinstance(reply, httpx.HTTPError):
        return f"failed:{_error_text(reply)}"
    if reply.status_code < 400:
        return "stopping"
    if _NOT_IN_PROGRESS in reply.text.lower():
        return "already_stopped"
    return f"failed:{reply.status_code}"


# --- CLI and incident helpers ----------------------------------------------------------------


async def profile_once(
    config: ProfilerConfig,
    *,
    pid: int | None = None,
    steps: int | None = None,
    start_step: int | None = None,
    activities: Sequence[str] | None = None,
    out_dir: Path | None = None,
    timeout_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    own_actions: OwnActionLog | None = None,
) -> ActionResult:
    """``servewatch profile --steps N [--start-step S] [--activities CPU,GPU] [--out DIR]``.

    Args:
        config: profiler settings (backend, base_url...).
        pid: the target (``sdk`` backend); ``None`` picks the only SDK control socket in the
            socket folder (``FAILED`` when there are none or several).
        steps / start_step / activities / out_dir / timeout_s: override the config.
        progress: called with what the session waits for now (:class:`ProfilerActor`).
        own_actions: where the session is recorded while it runs (an agent watching the server
            on the same data dir pauses its stall rule meanwhile); ``None``: memory only.

    Returns:
        The session's result (``OK`` with the trace paths, or why not).
    """
    actor = ProfilerActor(config, progress=progress)
    if own_actions is not None:
        actor.own_actions = own_actions
    make_request = partial(
        actor.request, num_steps=steps, start_step=start_step, activities=activities, output_dir=out_dir, timeout_s=timeout_s
    )
    req = await anyio.to_thread.run_sync(make_request)  # makes the folder absolute: reads the cwd
    if config.backend == "sdk" and pid is None:
        folder = config.socket_dir or shm_dir()
        pids = await anyio.to_thread.run_sync(control_socket_pids, config.socket_dir)  # lists the folder
        if len(pids) != 1:
            s = _Session("sdk", req, None)
            found = "no" if not pids else f"{len(pids)} ({', '.join(map(str, pids))})"
            return s.result(Outcome.FAILED, f"{found} SDK control sockets in {folder}: pass --pid")
        pid = pids[0]
    return await actor.profile(req, pid=pid)


def create(config: ProfilerConfig, ctx: BuildContext) -> ProfilerActor | None:
    """Registry factory (:data:`agent.actors.ACTORS` ``profiler``): profiles the next
    ``on_incident_steps`` steps after an incident (deferred phase); ``None`` when that is 0.
    ``ctx.stalled`` tells it when a profile could never finish."""
    if config.on_incident_steps <= 0:
        return None
    actor = ProfilerActor(config, stalled=ctx.stalled)
    actor.own_actions = OwnActionLog(ctx.agent.data_dir, ctx.agent.host_name)
    return actor
