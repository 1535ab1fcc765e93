"""What ``servewatch profile`` can profile, and which HTTP backend a server URL speaks.

Owns :func:`candidates` (the processes serving the SDK control socket, and the SGLang and vLLM
processes found by title), :func:`pid_problem` (what is wrong with a ``--pid`` that serves no
control socket, e.g. a server's frontend) and :func:`infer_backend` (``sglang`` or ``vllm`` from
the server's own endpoints). Imports psutil, httpx (at first use), :mod:`agent.host.targets`,
:mod:`agent.host.sdkclient` and :mod:`agent.errors`; never an actor, a watcher or an exporter.

How the backends are told apart (their HTTP APIs):

* SGLang serves ``GET /get_model_info`` (``/model_info`` in newer releases): a JSON object with
  ``model_path``. vLLM has neither.
* vLLM serves ``GET /version``: ``{"version": "..."}``; its ``/metrics`` names start ``vllm:``.

Where a server's HTTP port is: a rank (``VLLM::Worker_TP0``, an SGLang scheduler) listens on its
own TCP ports too (gloo pairs, the TCPStore, ZeroMQ), never the HTTP one. The HTTP server is the
ancestor whose command line names the ``--port`` it listens on (``vllm serve --port``, SGLang's
``--port``), else the outermost ancestor of the server that listens (the API server is the root of
vLLM's and SGLang's trees).

Where a vLLM server writes its torch traces (:func:`vllm_trace_dir`): the folder it was launched
with, ``--profiler-config '{"profiler": "torch", "torch_profiler_dir": DIR}'`` (or the dotted
``--profiler-config.torch_profiler_dir DIR``; vLLM before 0.11: env ``VLLM_TORCH_PROFILER_DIR``),
made absolute against the server's working folder as vLLM does. Its ``/start_profile`` body takes no
folder (vLLM 0.32: ``profile_prefix``, ``delay_iterations``, ``max_iterations`` only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.errors import BackendUnknownError
from agent.model.lazy import LazyModule

if TYPE_CHECKING:
    import httpx
else:
    httpx = LazyModule("httpx")

__all__ = [
    "SERVER_TITLES",
    "BackendUnknownError",
    "Candidate",
    "candidates",
    "describe_candidates",
    "hidden_sdk_folders",
    "infer_backend",
    "pid_problem",
    "server_pid",
    "vllm_trace_dir",
]

#: Process-title globs of the server ranks ``profile`` reaches through their server's URL.
SERVER_TITLES: dict[str, tuple[str, ...]] = {
    "sglang": ("sglang::scheduler*",),
    "vllm": ("VLLM::EngineCore*", "VLLM::Worker*"),
}
#: At most this many candidates are named in one line.
MAX_SHOWN = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A process ``servewatch profile`` could profile.

    Attributes:
        pid: its pid.
        title: its process title (or command line).
        backend: ``sdk`` (it serves the control socket), ``sglang`` or ``vllm``.
        flag: what to pass to profile it: ``--pid 4242``, ``--url http://127.0.0.1:30000``, or
            ``--url`` alone when its server's port is not known.
    """

    pid: int
    title: str
    backend: str
    flag: str

    def describe(self) -> str:
        """``pid 4242 'demo::scheduler_TP0' (--pid 4242)``."""
        return f"pid {self.pid} {self.title!r} ({self.flag})"


def _listening(pid: int) -> list[tuple[int, str]]:
    """``(port, ip)`` of the TCP sockets ``pid`` listens on, by port; empty when unreadable."""
    import psutil

    try:
        proc = psutil.Process(pid)
        conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return sorted((c.laddr.port, c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN and c.laddr)


def _url(port: int, ip: str) -> str:
    host = "127.0.0.1" if ip in ("0.0.0.0", "::", "") else (f"[{ip}]" if ":" in ip else ip)
    return f"http://{host}:{port}"


def _port_flag(pid: int) -> int | None:
    """The ``--port N`` / ``--port=N`` of ``pid``'s command line, or None."""
    import psutil

    try:
        argv = psutil.Process(pid).cmdline()
    except (psutil.Error, OSError):
        return None
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--port" and i + 1 < len(argv) else arg.removeprefix("--port=") if arg.startswith("--port=") else None
        if value is not None and value.isdigit():
            return int(value)
    return None


def _server_url(pid: int) -> str | None:
    """The HTTP address of the server ``pid`` (a rank, an engine, or the API server itself)
    belongs to: the listening port a process of its ancestry names with ``--port``, else the
    lowest port of the outermost listening ancestor (ranks' own gloo/TCPStore/ZeroMQ ports are
    never it). ``None`` when no process of the ancestry listens."""
    from agent.host.targets import parent_pid

    chain: list[int] = []
    current: int | None = pid
    while current and current > 1 and len(chain) < 6:
        chain.append(current)
        current = parent_pid(current)
    outermost: str | None = None
    for p in chain:
        ports = _listening(p)
        if not ports:
            continue
        flag = _port_flag(p)
        named = [(port, ip) for port, ip in ports if port == flag]
        if named:
            return _url(*named[0])
        outermost = _url(*ports[0])
    return outermost


def server_pid(url: str) -> int | None:
    """The pid of the local process listening on ``url``'s port (a system-wide socket scan:
    milliseconds; other users' sockets need root), or None (a remote server, or not found)."""
    import urllib.parse

    import psutil

    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


def _profiler_dir_arg(argv: Sequence[str]) -> str | None:
    """``torch_profiler_dir`` from vLLM's ``--profiler-config`` (JSON, or the dotted form)."""
    import json

    for i, arg in enumerate(argv):
        key, eq, inline = arg.partition("=")
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if key == "--profiler-config.torch_profiler_dir" and value:
            return value
        if key == "--profiler-config" and value:
            try:
                cfg = json.loads(value)
            except ValueError:
                continue
            if isinstance(cfg, dict) and isinstance(cfg.get("torch_profiler_dir"), str) and cfg["torch_profiler_dir"]:
                return str(cfg["torch_profiler_dir"])
    return None


#: Processes walked from the listening one up its parents for vLLM's launch arguments (an API
#: server child of ``vllm serve --api-server-count N``, a launcher wrapper).
MAX_PARENTS_WALKED = 4


def _retitled(argv: Sequence[str]) -> bool:
    """Whether a command line is a title set by setproctitle in the serving frameworks' form
    (``VLLM::APIServer_0``, ``sglang::scheduler_TP0``): nothing, or one word with ``::`` (the
    real setproctitle pads the old arguments' room with NULs: empty arguments after it)."""
    words = [a for a in argv if a]
    return not words or (len(words) == 1 and "::" in words[0])


def _launch_dir(proc: Any, retitled: list[str]) -> tuple[str | None, Any]:
    """``torch_profiler_dir`` as ``proc`` or one of its parents (at most
    :data:`MAX_PARENTS_WALKED`) was launched with, and the process that says it; ``(None,
    None)`` when none does. Appends the retitled processes met to ``retitled``.

    Raises:
        psutil.Error: ``proc`` itself cannot be read (a parent that cannot ends the walk).
    """
    import psutil

    for depth in range(MAX_PARENTS_WALKED + 1):
        if proc is None or proc.pid <= 1:
            break
        try:
            argv = proc.cmdline()
        except (psutil.ZombieProcess, psutil.AccessDenied):  # a parent that exited meanwhile, another user's
            if depth == 0:
                raise
            break
        if depth and not any(argv):  # a parent exiting now (its memory, so its command line, already gone)
            break
        raw = _profiler_dir_arg(argv)
        if raw is None:
            with contextlib.suppress(psutil.Error, OSError):
                raw = proc.environ().get("VLLM_TORCH_PROFILER_DIR") or None
        if raw is not None:
            return raw, proc
        if _retitled(argv):
            retitled.append(f"pid {proc.pid} {' '.join(a for a in argv if a)[:60]!r}")
        try:
            proc = proc.parent()
        except psutil.Error:  # gone since
            break
    return None, None


def vllm_trace_dir(url: str) -> tuple[Path | None, str]:
    """The folder the vLLM server at ``url`` writes its torch traces to (blocking: a socket scan
    and ``/proc`` reads).

    Read from ``--profiler-config`` (``torch_profiler_dir``) in the command line, else
    ``VLLM_TORCH_PROFILER_DIR`` in the environment, of the listening process and then of its
    parents (at most :data:`MAX_PARENTS_WALKED`): an API server retitled by setproctitle
    (``VLLM::APIServer_0``) has neither readable, its ``vllm serve`` parent has both.

    Returns:
        ``(folder, "")``, or ``(None, why)`` when it cannot be read from here (a remote server,
        another user's process without root, no torch profiler configured, a URI folder, a
        retitled process whose parents do not say); ``why`` says how to pass the folder.
    """
    import os

    import psutil

    pid = server_pid(url)
    if pid is None:
        return None, f"no local process listens on {url}"
    retitled: list[str] = []
    try:
        raw, proc = _launch_dir(psutil.Process(pid), retitled)
        if raw is None or proc is None:
            how = "; pass that folder with --out DIR (profiler.output_dir) to have the traces listed"
            if retitled:
                return None, (f"{', '.join(retitled)} is retitled (setproctitle): its launch arguments and environment"
                              f" are not readable, nor --profiler-config torch_profiler_dir in its parents{how}")
            return None, f"pid {pid} was not launched with --profiler-config torch_profiler_dir (nor its parents){how}"
        if "://" in raw:
            return None, f"pid {proc.pid} writes traces to {raw} (not a local folder)"
        if raw.startswith("~"):
            home = proc.environ().get("HOME")
            raw = raw.replace("~", home, 1) if home else raw
        folder = Path(raw)
        if not folder.is_absolute():
            folder = Path(proc.cwd()) / folder
    except (psutil.Error, OSError) as exc:
        return None, f"cannot read pid {pid}'s command line: {type(exc).__name__}"
    return Path(os.path.normpath(folder)), ""


def candidates(socket_dir: Path | None = None) -> list[Candidate]:
    """Every process ``profile`` could reach now (synchronous; a process scan, milliseconds).

    Args:
        socket_dir: the SDK control sockets' folder (default: the SDK's shm folder).

    Returns:
        Processes serving an SDK control socket (``--pid``), then SGLang schedulers and vLLM
        engines (``--url`` of their server, found from the port an ancestor listens on), by pid.
    """
    from agent.host.sdkclient import control_socket_pids
    from agent.host.targets import discover

    found: list[Candidate] = []
    sdk_pids = control_socket_pids(socket_dir)
    for target in discover(pids=sdk_pids) if sdk_pids else []:
        found.append(Candidate(pid=target.pid, title=target.title, backend="sdk", flag=f"--pid {target.pid}"))
    for backend, globs in SERVER_TITLES.items():
        urls: dict[int, str | None] = {}
        for target in discover(title_globs=globs):
            if target.pid in sdk_pids:
                continue
            if target.pid not in urls:
                urls[target.pid] = _server_url(target.pid)
            url = urls[target.pid]
            flag = f"--url {url}" if url else "--url of its server"
            found.append(Candidate(pid=target.pid, title=target.title, backend=backend, flag=flag))
    return found


def hidden_sdk_folders(socket_dir: Path | None = None) -> list[str]:
    """The SDK folders in ``socket_dir`` (default: the SDK's shm folder) this user may not list,
    whose servers' control sockets :func:`candidates` cannot see: one line each, naming the
    folder, its owner and what to do (``/dev/shm/servewatch-0 is owned by root (0700): run as
    root (sudo)``). Empty when every folder is readable (root always). Blocking: ``stat`` calls."""
    from agent.host.security import access_denied
    from agent.sdk.folders import sdk_folders

    return [why for _uid, folder in sdk_folders(socket_dir) if (why := access_denied(folder)) is not None]


def describe_candidates(found: Sequence[Candidate], hidden: Sequence[str] = ()) -> str:
    """``candidates: pid 1 'a' (--pid 1), ...`` (at most :data:`MAX_SHOWN`), or ``no candidates: ...``;
    then, for the SDK folders this user may not list (:func:`hidden_sdk_folders`), that more
    candidates may be hidden there and what to do."""
    behind = f"; candidates may be hidden: {'; '.join(hidden)}" if hidden else ""
    if not found:
        sdk = "no process this user can see serves" if hidden else "no process serves"
        return (f"no candidates: {sdk} an SDK control socket (agent.sdk.serve_control()) and no SGLang or vLLM"
                f" process runs{behind}")
    shown = ", ".join(c.describe() for c in found[:MAX_SHOWN])
    more = f" and {len(found) - MAX_SHOWN} more" if len(found) > MAX_SHOWN else ""
    return f"candidates: {shown}{more}{behind}"


def pid_problem(pid: int, socket_dir: Path | None = None) -> str | None:
    """What is wrong with profiling ``pid`` through the SDK, in one line; None when nothing is.

    Args:
        pid: the ``--pid`` given.
        socket_dir: the SDK control sockets' folder (default: the SDK's shm folder).

    Returns:
        None when ``pid`` serves a control socket; else why not and what to pass instead: no
        such process; a server's frontend whose ranks serve the socket (``--pid RANK``); an
        SGLang or vLLM process (``--url``); a process without the SDK; or a socket this user may
        not reach (``... is owned by root (0700): run as root (sudo)``).
    """
    import psutil

    from agent.host.sdkclient import control_path, control_socket_pids
    from agent.host.security import access_denied
    from agent.host.targets import discover
    from agent.sdk.folders import shm_dir

    path = control_path(pid, socket_dir)
    denied = access_denied(path)
    if denied is not None:  # the engineer who forgot sudo: not a usage error, one line with the fix
        return f"cannot reach the SDK control socket of pid {pid}: {denied}"
    if path.exists() and pid in control_socket_pids(socket_dir):
        return None
    if not psutil.pid_exists(pid):
        return f"no such process: pid {pid}"
    title = next((t.title for t in discover(pids=[pid])), "")
    sockets = set(control_socket_pids(socket_dir))
    ranks = [t for t in discover(root_pids=[pid], include_roots=False) if t.pid in sockets]
    if ranks:
        shown = ", ".join(f"pid {t.pid} {t.title!r}" for t in ranks[:MAX_SHOWN])
        return (
            f"pid {pid} {title!r} serves no SDK control socket, but its child processes do: {shown};"
            f" profile one of them with --pid {ranks[0].pid}"
        )
    server = _server_without_sdk(pid, title)
    if server is not None:
        return server
    return (
        f"pid {pid} {title!r} serves no SDK control socket (it does not call agent.sdk.serve_control(),"
        f" or its SERVEWATCH_SHM_DIR differs from {socket_dir or shm_dir()})"
    )


def _server_without_sdk(pid: int, title: str) -> str | None:
    """:func:`pid_problem`'s line for an SGLang or vLLM process tree (``pid``'s); ``None``: not one."""
    import fnmatch

    from agent.host.targets import discover

    for backend, globs in SERVER_TITLES.items():
        tree = [pid, *(t.pid for t in discover(root_pids=[pid], include_roots=False))]
        titled = [t for t in discover(pids=tree) if any(fnmatch.fnmatchcase(t.title, g) for g in globs)]
        if titled:
            url = _server_url(pid)
            where = f"--url {url}" if url else "--url of its HTTP server"
            return f"pid {pid} {title!r} is a {'SGLang' if backend == 'sglang' else 'vLLM'} process without the SDK: profile it with {where}"
    return None


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def infer_backend(url: str, *, timeout_s: float = 5.0, transport: httpx.BaseTransport | None = None) -> str:
    """``sglang`` or ``vllm``: which server answers at ``url`` (a few bounded GET requests).

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:30000``.
        timeout_s: bound of each request, seconds.
        transport: httpx transport (tests); default a real connection.

    Raises:
        BackendUnknownError: nothing answers, or it is neither (one line saying which endpoints
            were tried and to pass ``--backend``).
    """
    try:
        with httpx.Client(base_url=url, timeout=timeout_s, transport=transport) as client:
            for path in ("/get_model_info", "/model_info"):
                body = _json(client.get(path))
                if isinstance(body, dict) and "model_path" in body:
                    return "sglang"
            body = _json(client.get("/version"))
            if isinstance(body, dict) and isinstance(body.get("version"), str):
                return "vllm"
            metrics = client.get("/metrics")
            if metrics.status_code == 200 and "\nvllm:" in f"\n{metrics.text}":
                return "vllm"
    except httpx.HTTPError as exc:
        raise BackendUnknownError(f"cannot reach {url}: {type(exc).__name__}: {exc}", reachable=False) from None
    raise BackendUnknownError(
        f"{url} is neither SGLang (no /get_model_info with a model_path) nor vLLM (no /version):"
        " pass --backend sglang or --backend vllm",
        reachable=True,
    )
