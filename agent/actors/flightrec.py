"""Flight Recorder actor: each rank's collective history, read during an incident.

Owns reading torch's collective Flight Recorder (per process group: collective sequence ids, op,
sizes, state, timestamps) out of every target rank, one bounded action per rank
(``flightrec.dump``) and the artifact ``flightrec-rank<r>-<pid>.json`` per rank. The launch
environment that arms the recorder (``TORCH_FR_BUFFER_SIZE``) is :mod:`agent.host.cudaenv`'s.

Sources, tried in this order until one answers (per rank, all within ``timeout_s`` scaled with the
rank's recorder size, ``TORCH_FR_BUFFER_SIZE`` over its default, up to 4x; a try that runs out
of time is tried once more, and a ``timed_out`` detail names the source each try waited on):

1. ``sdk_worker``: torch's C++ worker server that :func:`agent.sdk.serve_torch_worker` serves on
   ``<socket_dir>/servewatch-<uid>/servewatch-torch.<pid>.sock`` (``POST /handler/fr_trace_json``; answered on C++
   threads, so also while the rank's Python thread is stuck);
2. ``sdk_control``: the SDK control socket's ``fr_trace`` command (``_dump_fr_trace_json``);
3. ``debug_server``: torch's own per-rank worker server, where the server started it
   (``torch.distributed.debug.start_debug_server``). Only a port that can be one is asked: torch's
   ``_WorkerServer`` listens on the IPv6 wildcard ``::`` (``WorkerServer.cpp``: "Server listening
   to TCP :::PORT"), gloo's pairs on an interface address (a vLLM worker at TP=2 listens on 13
   such ``127.0.0.1`` ports), so only ``::`` listeners are asked, less the job's TCPStore
   (``MASTER_PORT``, which binds ``::`` too);
4. ``nccl_pipe``: the NCCL debug-info pipe (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``, per rank
   ``<stem><rank>.pipe``), where armed: one byte written makes the NCCL watchdog dump the
   recorder to ``TORCH_FR_DUMP_TEMP_FILE`` / ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` + rank (pickle,
   read with an unpickler that builds plain containers only).

Outcomes, one per rank: ``ok``; ``not_enabled`` (a source answered with an empty recorder: the
buffer is 0); ``no_source`` ("not available": no socket, debug server or armed pipe — not an
error); ``timed_out``; ``failed``.

Imports anyio, psutil, httpx (at first use: the worker and debug servers' HTTP), :mod:`agent.model.events`,
:mod:`agent.host.targets`, :mod:`agent.host.fsutil`, the SDK's path helpers and the control-socket client
:mod:`agent.host.sdkclient`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import psutil

from agent.actors.config import FlightRecorderConfig
from agent.host.cudaenv import FR_BUFFER_DEFAULT, FR_BUFFER_ENV
from agent.host.fsutil import atomic_write_text
from agent.host.security import access_denied, open_trusted, process_uids, trusted_owner
from agent.host.targets import Target
from agent.model.events import (
    Action,
    ActionResult,
    AttributeValue,
    FlightRecorderDumped,
    IncidentOpened,
    Outcome,
    now_ns,
)
from agent.model.lazy import LazyModule
from agent.model.ranks import RankEnviron, rank_from_title

if TYPE_CHECKING:
    import httpx

    from agent.host.registry import BuildContext
    from agent.model.progress import ActionSink
else:
    httpx = LazyModule("httpx")  # imported at first use: a dump without torch worker servers never imports it


__all__ = [
    "ACTION",
    "RANK_SOURCE_ATTR",
    "SOURCES",
    "FlightRecorderActor",
    "FlightRecorderConfig",
    "create",
    "summarize_trace",
]

log = logging.getLogger("servewatch.flightrec")

#: Span name of one rank's Flight Recorder read.
ACTION = Action.FLIGHTREC_DUMP
#: Where ``servewatch.flightrec.rank`` came from: ``sdk`` (torch.distributed, through the SDK),
#: ``environ`` (``RANK`` in the process's environment) or ``title`` (its title alone).
RANK_SOURCE_ATTR = "servewatch.flightrec.rank_source"
#: Tries of a rank's read that timed out before its outcome is ``timed_out`` (each with the whole budget).
READ_RETRIES = 1

#: The most a rank's read budget is scaled up for a recorder larger than the default.
MAX_BUDGET_SCALE = 4.0

#: Source names, in the order they are tried.
SOURCES = ("sdk_worker", "sdk_control", "debug_server", "nccl_pipe")
#: torch's NCCL debug-info pipe stem and dump-file variables (per rank: stem + rank).
NCCL_PIPE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
NCCL_DUMP_ENVS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
NCCL_DUMP_DEFAULT = "/tmp/nccl_trace_rank_"
#: Largest reply or dump read, bytes (a 20k-entry recorder with stacks is a few MiB).
MAX_TRACE_BYTES = 64 * 1024 * 1024


def summarize_trace(trace: Mapping[str, Any]) -> dict[str, AttributeValue]:
    """Bounded span attributes of one Flight Recorder dump.

    ``last_enqueued`` / ``last_completed`` are those of process group ``0`` (the default group)
    when present, else of the first group.
    """
    entries = trace.get("entries") or []
    status = trace.get("pg_status") or {}
    attrs: dict[str, AttributeValue] = {"servewatch.flightrec.entries": len(entries) if isinstance(entries, list) else 0}
    if isinstance(status, dict) and status:
        pg = "0" if "0" in status else min(status)
        st = status.get(pg) or {}
        for key, name in (("last_enqueued_collective", "last_enqueued"), ("last_completed_collective", "last_completed")):
            try:
                attrs[f"servewatch.flightrec.{name}"] = int(st[key])
            except (KeyError, TypeError, ValueError):
                pass
        attrs["servewatch.flightrec.process_groups"] = len(status)
    if isinstance(entries, list) and entries and isinstance(entries[-1], dict):
        last = entries[-1]
        attrs["servewatch.flightrec.last_op"] = f"{last.get('profiling_name', '?')} #{last.get('collective_seq_id', '?')}"
    return attrs


class _SourceMissing(Exception):
    """This source does not exist for the target (try the next one)."""


class _SourceFailed(Exception):
    """This source exists but did not give a dump."""


class _Restricted(pickle.Unpickler):
    """Unpickles plain containers only: a target-written file never runs code in the agent."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in {"set", "frozenset", "list", "dict", "tuple"}:
            return getattr(__import__("builtins"), name)
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


@dataclass(frozen=True, slots=True)
class _Read:
    source: str
    trace: dict[str, Any]
    detail: str = ""


async def _permission_detail(exc: PermissionError) -> str:
    why = await anyio.to_thread.run_sync(access_denied, exc.filename) if exc.filename else None
    return why or f"{exc.strerror}: {exc.filename}"


def _timed_out_detail(budget_s: float, waited_on: list[str], tried: list[str]) -> str:
    also = f"; also tried: {'; '.join(dict.fromkeys(tried))}" if tried else ""
    return (f"no Flight Recorder dump within {budget_s:g}s, {len(waited_on)} tries "
            f"(waiting on: {', '.join(waited_on)}){also}")


def _no_source_detail(tried: list[str]) -> str:
    return "not available: " + ("; ".join(tried) if tried else "no SDK socket, torch debug server or armed NCCL pipe")


def _rank_in_trace(trace: dict[str, Any]) -> int | None:
    """The rank the SDK wrote into the dump's ``servewatch`` part (``None``: none)."""
    meta = trace.get("servewatch")
    if not isinstance(meta, dict):
        meta = {}
    if isinstance(meta.get("rank"), int):
        return meta["rank"]
    return None


def _artifact_name(rank: int | None, pid: int) -> str:
    return f"flightrec-rank{rank if rank is not None else 'x'}-{pid}.json"


def _ok_detail(attrs: dict[str, AttributeValue], read: _Read) -> str:
    n = attrs.get("servewatch.flightrec.entries", 0)
    return f"{n} entries via {read.source}{', ' + read.detail if read.detail else ''}"


class FlightRecorderActor:
    """Reads each rank's Flight Recorder (see the module docstring for sources and outcomes).

    Args:
        config: settings.
        environ_of: returns a target's environment as servewatch knows it (``launch`` knows the
            child's; otherwise ``/proc/<pid>/environ`` is read, which setproctitle may blank).
    """

    name = "flightrec"
    action = ACTION
    completed = FlightRecorderDumped
    deferred = False

    def __init__(self, config: FlightRecorderConfig | None = None, *, environ_of: Any = None) -> None:
        self.config = config or FlightRecorderConfig()
        self._environ_of = environ_of

    async def run_phase(
        self, opened: IncidentOpened, targets: Sequence[Target], artifact_dir: Path, report: ActionSink
    ) -> list[ActionResult]:
        """The incident phase (:class:`agent.actors.Actor`): :meth:`collect_all`."""
        return await self.collect_all(opened, targets, artifact_dir=artifact_dir, report=report)

    async def collect_all(
        self, trigger: IncidentOpened, targets: Sequence[Target], *, artifact_dir: Path, report: ActionSink | None = None
    ) -> list[ActionResult]:
        """One read per target, all in parallel; results in target order (each also sent to
        ``report`` as soon as it is done)."""
        from agent.actors import act_all

        return await act_all(self, trigger, targets, timeout_s=self.config.timeout_s, artifact_dir=artifact_dir,
                             report=report)

    async def act(self, trigger: IncidentOpened, target: Target, *, timeout_s: float, artifact_dir: Path) -> ActionResult:
        start = now_ns()
        rank: int | None = None
        rank_source = ""
        attrs: dict[str, AttributeValue] = {"process.title": target.title} if target.title else {}

        def result(outcome: Outcome, detail: str, *, paths: tuple[str, ...] = (), retryable: bool = False) -> ActionResult:
            if rank is not None:
                attrs["servewatch.flightrec.rank"] = rank
                attrs[RANK_SOURCE_ATTR] = rank_source
            return ActionResult(
                action=ACTION, outcome=outcome, pid=target.pid, detail=detail, retryable=retryable,
                start_time_unix_nano=start, end_time_unix_nano=now_ns(), artifact_paths=paths, attributes=dict(attrs),
            )

        read: _Read | None = None
        tried: list[str] = []
        budget_s = await anyio.to_thread.run_sync(self._budget_s, target.pid, timeout_s)  # /proc/PID/environ
        waited_on: list[str] = []  # per timed-out try: the source it was waiting on
        for _ in range(1 + READ_RETRIES):  # a loaded host answers late, not never: one more try
            trying: list[str] = []
            with anyio.move_on_after(budget_s) as scope:
                try:
                    rank, rank_source = await self._rank(target)
                    read = await self._read(target, rank, tried, trying)
                except PermissionError as exc:  # another user's SDK folder (root's server, no sudo): say the fix
                    return result(Outcome.PERMISSION_DENIED, await _permission_detail(exc))
                except Exception as exc:  # an actor's boundary: an outcome, never a crash
                    log.exception("Flight Recorder read of pid %d failed", target.pid)
                    return result(Outcome.FAILED, f"{type(exc).__name__}: {exc}")
            if not scope.cancelled_caught:
                break
            waited_on.append(trying[-1] if trying else "the rank's identity")
        else:
            return result(Outcome.TIMED_OUT, _timed_out_detail(budget_s, waited_on, tried), retryable=True)
        if read is None:
            return result(Outcome.NO_SOURCE, _no_source_detail(tried))
        trace = read.trace
        if rank is None and (traced_rank := _rank_in_trace(trace)) is not None:
            rank, rank_source = traced_rank, "sdk"
        attrs["servewatch.flightrec.source"] = read.source
        attrs.update(summarize_trace(trace))
        if not trace.get("entries") and not trace.get("pg_status"):
            # an armed recorder before its first collective reads the same as one never armed
            return result(Outcome.NOT_ENABLED, f"{read.source}: the Flight Recorder holds no collective: none ran yet since"
                                               f" init_process_group, or it is off ({FR_BUFFER_ENV} unset before init_process_group)")
        doc = {"pid": target.pid, "title": target.title, "rank": rank, "source": read.source,
               "captured_time_unix_nano": now_ns(), "trace": trace}
        path = Path(artifact_dir) / _artifact_name(rank, target.pid)
        try:
            await anyio.to_thread.run_sync(atomic_write_text, path, json.dumps(doc))
        except OSError as exc:
            return result(Outcome.FAILED, f"cannot write {path}: {exc}")
        return result(Outcome.OK, _ok_detail(attrs, read), paths=(str(path),))

    # -- rank ---------------------------------------------------------------------------------

    async def _rank(self, target: Target) -> tuple[int | None, str]:
        """The target's rank and where it came from (:data:`RANK_SOURCE_ATTR`): the SDK's ``status``
        (torch.distributed: ``sdk``), else its title alone when it names one
        (:func:`agent.model.ranks.rank_from_title`: ``title``; none for ``ray::RayWorkerWrapper``, nor for
        ``Worker_PP1_TP0``, whose rank depends on the TP size), else ``RANK`` in its environment
        (:class:`agent.model.ranks.RankEnviron`: ``environ``; before the title it could be a launcher's,
        inherited by every worker: the judge, which sees them all, tells); ``(None, "")`` when none
        says it."""
        from agent.host.sdkclient import SdkCallError, control_path, sdk_call

        path = await anyio.to_thread.run_sync(control_path, target.pid, self.config.socket_dir)  # file system
        if await anyio.Path(path).exists():
            try:
                with anyio.move_on_after(min(1.0, self.config.timeout_s / 2)):
                    reply = await sdk_call(path, {"cmd": "status"}, timeout_s=1.0)
                    dist = reply.get("dist")
                    if not isinstance(dist, dict):
                        dist = {}
                    if isinstance(dist.get("rank"), int):
                        return int(dist["rank"]), "sdk"
            except SdkCallError:
                pass
        by_title = rank_from_title(target.title)
        if by_title is not None:
            return by_title, "title"
        env = RankEnviron.of(await anyio.to_thread.run_sync(self._environ, target.pid))  # /proc/PID/environ
        if env is not None and env.global_rank is not None:
            return env.global_rank, "environ"
        return None, ""

    def _environ(self, pid: int) -> dict[str, str]:
        if self._environ_of is not None:
            try:
                env = self._environ_of(pid)
            except Exception:  # noqa: BLE001 - a hint only
                env = None
            if env:
                return dict(env)
        try:
            return dict(psutil.Process(pid).environ())
        except (psutil.Error, OSError):
            return {}

    # -- sources ------------------------------------------------------------------------------

    def _budget_s(self, pid: int, timeout_s: float) -> float:
        """One try's budget: ``timeout_s`` scaled with the recorder the rank was asked to keep
        (its ``TORCH_FR_BUFFER_SIZE`` entries over the default's, 1x to :data:`MAX_BUDGET_SCALE`x):
        a larger recorder is a larger dump to serialize and send."""
        try:
            entries = int(self._environ(pid).get(FR_BUFFER_ENV, FR_BUFFER_DEFAULT))
        except ValueError:
            entries = int(FR_BUFFER_DEFAULT)
        return round(timeout_s * min(MAX_BUDGET_SCALE, max(1.0, entries / int(FR_BUFFER_DEFAULT))), 3)

    async def _read(self, target: Target, rank: int | None, tried: list[str], trying: list[str] | None = None) -> _Read | None:
        """The first source that answers (``tried``: why the others did not; ``trying``: the
        source asked now, for a caller whose deadline cuts it short)."""
        trying = [] if trying is None else trying
        readers = [("sdk_worker", self._from_worker), ("sdk_control", self._from_control)]
        if self.config.debug_server:
            readers.append(("debug_server", self._from_debug_server))
        if self.config.nccl_pipe:
            readers.append(("nccl_pipe", self._from_nccl_pipe))
        for source, reader in readers:
            trying.append(source)
            try:
                trace, detail = await reader(target, rank)
            except _SourceMissing:
                continue
            except _SourceFailed as exc:
                tried.append(f"{source}: {exc}")
                continue
            if not isinstance(trace, dict):
                tried.append(f"{source}: reply is not a JSON object")
                continue
            return _Read(source, trace, detail)
        return None

    async def _from_worker(self, target: Target, rank: int | None) -> tuple[Any, str]:
        from agent.sdk.flightrec import worker_path

        path = await anyio.to_thread.run_sync(worker_path, target.pid, self.config.socket_dir)  # file system
        try:
            st = await anyio.to_thread.run_sync(os.lstat, path)
        except (FileNotFoundError, NotADirectoryError):  # NotADirectory: its user's SDK folder name was taken
            raise _SourceMissing from None
        owners = await anyio.to_thread.run_sync(process_uids, target.pid)
        if not stat.S_ISSOCK(st.st_mode) or not trusted_owner(st, owners):
            raise _SourceFailed(f"{path} is not a socket owned by the target's user (uid {st.st_uid}): not trusted")
        try:
            body = await _http_post("fr_trace_json", uds=str(path))
        except httpx.ConnectError as exc:  # refused, or gone since: no server there
            raise _SourceMissing from exc
        except httpx.TransportError as exc:
            raise _SourceFailed(f"{path}: {exc}") from None
        return _parse_json(body, str(path)), ""

    async def _from_control(self, target: Target, rank: int | None) -> tuple[Any, str]:
        from agent.host.sdkclient import SdkCallError, control_path, sdk_call

        path = await anyio.to_thread.run_sync(control_path, target.pid, self.config.socket_dir)  # file system
        if not await anyio.Path(path).exists():
            raise _SourceMissing
        try:
            reply = await sdk_call(path, {"cmd": "fr_trace"}, timeout_s=self.config.timeout_s)
        except SdkCallError as exc:
            if exc.outcome is Outcome.NO_SUCH_PROCESS:
                raise _SourceMissing from None
            raise _SourceFailed(exc.detail) from None
        if not reply.get("ok"):
            raise _SourceFailed(f"{reply.get('error')}: {reply.get('detail', '')}")
        return reply.get("trace"), ""

    async def _from_debug_server(self, target: Target, rank: int | None) -> tuple[Any, str]:
        ports = await anyio.to_thread.run_sync(_debug_server_ports, target.pid, self._environ)
        if not ports:
            raise _SourceMissing
        for port in ports:
            try:
                with anyio.fail_after(min(0.5, self.config.timeout_s / 2)):
                    body = await _http_post("fr_trace_json", port=port)
            except (TimeoutError, httpx.TransportError, _SourceFailed):
                continue
            try:
                trace = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(trace, dict) and ("entries" in trace or "pg_status" in trace or "version" in trace):
                return trace, f"port {port}"
        raise _SourceMissing

    async def _from_nccl_pipe(self, target: Target, rank: int | None) -> tuple[Any, str]:
        env = await anyio.to_thread.run_sync(self._environ, target.pid)  # /proc/PID/environ
        stem = env.get(NCCL_PIPE_ENV, "")
        if not stem or rank is None:
            raise _SourceMissing
        pipe = Path(f"{stem}{rank}.pipe")
        if not pipe.is_absolute():
            pipe = Path(f"/proc/{target.pid}/cwd") / pipe
        try:
            if not stat.S_ISFIFO((await anyio.Path(pipe).stat()).st_mode):
                raise _SourceFailed(f"{pipe} is not a FIFO")
        except FileNotFoundError:
            raise _SourceMissing from None
        dump_stem = next((env[k] for k in NCCL_DUMP_ENVS if env.get(k)), NCCL_DUMP_DEFAULT)
        dump = Path(f"{dump_stem}{rank}")
        if not dump.is_absolute():
            dump = Path(f"/proc/{target.pid}/cwd") / dump
        before = await anyio.to_thread.run_sync(_mtime_and_size, dump)
        await anyio.to_thread.run_sync(_poke_pipe, pipe)
        # the NCCL watchdog polls the pipe about once a second, then writes the dump
        last_size = -1
        while True:
            now = await anyio.to_thread.run_sync(_mtime_and_size, dump)
            if now is not None and (before is None or now[0] != before[0]):
                size = now[1]
                if size == last_size and size > 0:
                    break
                last_size = size
            await anyio.sleep(0.05)
        owners = await anyio.to_thread.run_sync(process_uids, target.pid)
        data = await anyio.to_thread.run_sync(_read_pickle, dump, owners)
        return data, f"{pipe} -> {dump}"


def _poke_pipe(pipe: Path) -> None:
    """Write one byte to the NCCL debug pipe (non-blocking open: ENXIO when nobody reads it)."""
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:  # ENXIO: nobody reads it (the watchdog thread is gone)
        raise _SourceFailed(f"{pipe}: {exc.strerror or exc}") from None
    try:
        os.write(fd, b"1")
    finally:
        os.close(fd)


def _mtime_and_size(path: Path) -> tuple[int, int] | None:
    """``(st_mtime_ns, st_size)`` of ``path``, ``None`` when it cannot be stat'ed."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _read_pickle(path: Path, owner_uids: Sequence[int]) -> Any:
    """The NCCL dump file: a regular file of the target's user (or root), never via a symlink."""
    raw = open_trusted(path, owner_uids, max_bytes=MAX_TRACE_BYTES + 1)
    if raw is None:
        raise _SourceFailed(f"{path}: not a regular file owned by the target's user: not read")
    if len(raw) > MAX_TRACE_BYTES:
        raise _SourceFailed(f"{path}: dump larger than {MAX_TRACE_BYTES} bytes")
    if raw[:1] == b"{":
        return json.loads(raw)
    try:
        return _jsonable(_Restricted(io.BytesIO(raw)).load())
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise _SourceFailed(f"{path}: cannot read the dump: {exc}") from None


def _debug_server_ports(pid: int, environ_of: Any) -> list[int]:
    """The ports of ``pid`` that can be torch's debug worker server: TCP listeners on the IPv6
    wildcard ``::`` (how ``_WorkerServer`` binds), less ``MASTER_PORT`` (the job's TCPStore binds
    ``::`` as well) from its environment or its parent's. Never gloo's interface-bound ports."""
    try:
        proc = psutil.Process(pid)
        conns = proc.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    ports = {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.ip == "::"}
    if not ports:
        return []
    store = environ_of(pid).get("MASTER_PORT", "")
    if not store:
        try:
            parent = proc.ppid()
        except (psutil.Error, OSError):
            parent = 0
        store = environ_of(parent).get("MASTER_PORT", "") if parent > 1 else ""
    return sorted(p for p in ports if str(p) != store)


async def _http_post(handler: str, *, uds: str | None = None, port: int | None = None) -> bytes:
    """``POST /handler/<handler>`` to torch's worker server (over its unix socket ``uds``, else on
    ``127.0.0.1:port``), one request with httpx; the body (at most :data:`MAX_TRACE_BYTES`). The
    caller bounds it in time.

    Raises:
        _SourceFailed: not an HTTP 200 answer, or a body too large.
        httpx.TransportError: no connection (refused, reset).
    """
    url = f"http://localhost/handler/{handler}" if uds is not None else f"http://127.0.0.1:{port}/handler/{handler}"
    transport = httpx.AsyncHTTPTransport(uds=uds) if uds is not None else None
    async with httpx.AsyncClient(transport=transport, timeout=None) as client, client.stream("POST", url) as response:
        if response.status_code != 200:
            raise _SourceFailed(f"HTTP {response.status_code} from the worker server")
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_TRACE_BYTES:
                raise _SourceFailed(f"reply larger than {MAX_TRACE_BYTES} bytes")
    return bytes(body)


def _parse_json(body: bytes, where: str) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _SourceFailed(f"{where}: bad JSON: {exc}") from None


def create(config: FlightRecorderConfig, ctx: BuildContext) -> FlightRecorderActor | None:
    """Registry factory (:data:`agent.actors.ACTORS` ``flightrec``): the Flight Recorder reader of
    ``config`` (``[flightrec]``; its SDK sockets default to the agent's SDK socket folder,
    ``ctx.agent.sdk_socket_dir``: they sit together), or ``None`` with ``enabled`` off."""
    if not config.enabled:
        return None
    if config.socket_dir is None and ctx.agent.sdk_socket_dir is not None:
        config = config.model_copy(update={"socket_dir": ctx.agent.sdk_socket_dir})
    return FlightRecorderActor(config)
