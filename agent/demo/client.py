"""Drive the demo server from outside: start/stop it, send requests, inject the fault.

Owns :class:`DemoServer` (the server subprocess in its own process group, always cleaned up) and
small sync/async HTTP helpers. Imports the standard library, httpx, anyio and psutil; never
torch (the server's schedulers import it) and never the agent side, so ``servewatch demo`` can use
it next to the agent.

Typical use::

    with DemoServer(tp=2) as server:
        generate(server.base_url, "hello", max_new_tokens=8)
        inject_hang(server.base_url, tp_rank=0)          # the next forward of TP0 hangs
        ...                                               # the agent watches server.scheduler_pids
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO

import anyio
import httpx
import psutil

from agent.errors import DemoServerError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = [
    "DemoServer",
    "DemoServerError",
    "agenerate",
    "ainject_hang",
    "await_ready",
    "generate",
    "inject_hang",
    "wait_ready",
]

_POLL_S = 0.05
# The server is node-local: never route its requests through an HTTP(S)_PROXY from the
# environment (trust_env=False on every request).
_LOG_TAIL_BYTES = 2000


def _read_ready(ready_file: Path) -> dict[str, Any] | None:
    try:
        return json.loads(ready_file.read_text())
    except (OSError, ValueError):
        return None  # not written yet (the server writes it atomically, so no partial file)


def _exited_error(proc: subprocess.Popen[bytes], log_path: Path | None) -> DemoServerError:
    tail = ""
    if log_path is not None:
        try:
            raw = log_path.read_bytes()[-_LOG_TAIL_BYTES:]
            tail = ": " + raw.decode("utf-8", "replace").strip()
        except OSError:
            pass
    return DemoServerError(f"demo server exited with code {proc.returncode} before it was ready{tail}")


def wait_ready(
    ready_file: Path,
    timeout_s: float,
    *,
    proc: subprocess.Popen[bytes] | None = None,
    log_path: Path | None = None,
) -> dict[str, Any]:
    """Wait until the server wrote its ready file.

    Args:
        ready_file: the server's ``--ready-file``.
        timeout_s: longest wait, in seconds.
        proc: the server process; its exit ends the wait early.
        log_path: the server's stderr file, quoted in the error.

    Returns:
        The ready document (``base_url``, ``pid``, ``scheduler_pids``, ...).

    Raises:
        DemoServerError: the process exited, or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        doc = _read_ready(ready_file)
        if doc is not None:
            return doc
        if proc is not None and proc.poll() is not None:
            raise _exited_error(proc, log_path)
        if time.monotonic() >= deadline:
            raise DemoServerError(f"demo server not ready after {timeout_s} s")
        time.sleep(_POLL_S)


async def await_ready(
    ready_file: Path,
    timeout_s: float,
    *,
    proc: subprocess.Popen[bytes] | None = None,
    log_path: Path | None = None,
) -> dict[str, Any]:
    """Async :func:`wait_ready` (polls with ``anyio.sleep``; same arguments, result and errors)."""
    with anyio.move_on_after(timeout_s):
        while True:
            doc = await anyio.to_thread.run_sync(_read_ready, ready_file)
            if doc is not None:
                return doc
            if proc is not None and proc.poll() is not None:
                raise await anyio.to_thread.run_sync(_exited_error, proc, log_path)  # reads the log
            await anyio.sleep(_POLL_S)
    raise DemoServerError(f"demo server not ready after {timeout_s} s")


def _generate_body(text: str, max_new_tokens: int) -> dict[str, Any]:
    return {"text": text, "max_new_tokens": max_new_tokens}


def generate(base_url: str, text: str, max_new_tokens: int = 16, timeout_s: float = 60.0) -> dict[str, Any]:
    """POST ``/generate`` and return its JSON (``output_ids``, ``meta_info``).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        text: the prompt (tokenized by the server as UTF-8 bytes).
        max_new_tokens: tokens to generate.
        timeout_s: whole-request timeout, in seconds.

    Raises:
        httpx.HTTPError: connection failure, timeout, or a non-2xx answer (504 when the server
            gave up waiting, e.g. during an injected hang).
    """
    r = httpx.post(f"{base_url}/generate", json=_generate_body(text, max_new_tokens), timeout=timeout_s, trust_env=False)
    r.raise_for_status()
    return r.json()


async def agenerate(
    base_url: str, text: str, max_new_tokens: int = 16, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Async :func:`generate` (same arguments, result and errors)."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        r = await client.post(f"{base_url}/generate", json=_generate_body(text, max_new_tokens))
        r.raise_for_status()
        return r.json()


def inject_hang(base_url: str, tp_rank: int = 0, seconds: float | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """Arm the demo's fault: rank ``tp_rank``'s next forward hangs in ``_injected_hang_in_forward``.

    Args:
        base_url: the server.
        tp_rank: which scheduler hangs.
        seconds: hang length in seconds; ``None`` hangs until the server stops.
        timeout_s: HTTP timeout, in seconds.

    Returns:
        ``{"armed": true, "tp_rank": ..., "seconds": ...}``.

    Raises:
        httpx.HTTPError: connection failure or a non-2xx answer (400 for a bad rank).
    """
    r = httpx.post(
        f"{base_url}/debug/hang", json={"tp_rank": tp_rank, "seconds": seconds}, timeout=timeout_s, trust_env=False
    )
    r.raise_for_status()
    return r.json()


async def ainject_hang(
    base_url: str, tp_rank: int = 0, seconds: float | None = None, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Async :func:`inject_hang` (same arguments, result and errors)."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        r = await client.post(f"{base_url}/debug/hang", json={"tp_rank": tp_rank, "seconds": seconds})
        r.raise_for_status()
        return r.json()


class DemoServer:
    """The demo server as a subprocess in its own process group; a (sync or async) context manager.

    On exit the server gets SIGTERM (it stops its schedulers, which remove their step-counter
    files), then after ``stop_timeout_s`` the whole process group gets SIGKILL. Every wait is
    bounded. The server runs with ``--exit-with-parent``, so it also goes away if this process dies.

    Args:
        tp: scheduler processes (``--tp``).
        port: TCP port, 0 = any free port.
        title_prefix: scheduler titles ``<prefix>::scheduler_TP<n>``.
        extra_args: more ``agent.demo.server`` flags (e.g. ``["--max-batch-size", "4"]``).
        python: interpreter to run it with (default: this one).
        env: environment (default: this one).
        ready_timeout_s: longest wait for the ready file, in seconds (torch import included).
        stop_timeout_s: grace period after SIGTERM before SIGKILL, in seconds.
    """

    def __init__(
        self,
        *,
        tp: int = 1,
        port: int = 0,
        title_prefix: str = "demo",
        extra_args: Sequence[str] = (),
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 120.0,
        stop_timeout_s: float = 15.0,
    ) -> None:
        self.tp = tp
        self.port = port
        self.title_prefix = title_prefix
        self.extra_args = tuple(extra_args)
        self.python = python or sys.executable
        self.env = dict(env) if env is not None else None
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self._dir: Path | None = None
        self._log: BinaryIO | None = None

    # -- what the caller reads --------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running server."""
        return str(self.info["base_url"])

    @property
    def pid(self) -> int:
        """The frontend (HTTP server) pid; the schedulers are its children."""
        return int(self.info["pid"])

    @property
    def scheduler_pids(self) -> list[int]:
        """Scheduler pids, index = TP rank."""
        return [int(p) for p in self.info["scheduler_pids"]]

    @property
    def log_path(self) -> Path | None:
        """The server's stderr (kept until :meth:`stop`)."""
        return None if self._dir is None else self._dir / "server.log"

    def argv(self, ready_file: Path) -> list[str]:
        """The server's command line."""
        return [
            self.python, "-m", "agent.demo.server",
            "--tp", str(self.tp),
            "--port", str(self.port),
            "--title-prefix", self.title_prefix,
            "--ready-file", str(ready_file),
            "--exit-with-parent",
            *self.extra_args,
        ]  # fmt: skip

    # -- lifecycle ---------------------------------------------------------------------------

    def _launch(self) -> Path:
        self._dir = Path(tempfile.mkdtemp(prefix="servewatch-demo-"))
        ready_file = self._dir / "ready.json"
        self._log = open(self._dir / "server.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv(ready_file),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            env=self.env,
            start_new_session=True,
        )
        return ready_file

    def start(self) -> Self:
        """Start the server and wait until it is ready.

        Raises:
            DemoServerError: it exited or was not ready within ``ready_timeout_s`` (it is stopped).
        """
        ready_file = self._launch()
        assert self.proc is not None
        try:
            self.info = wait_ready(ready_file, self.ready_timeout_s, proc=self.proc, log_path=self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    async def astart(self) -> Self:
        """Async :meth:`start`."""
        ready_file = await anyio.to_thread.run_sync(self._launch)  # a temporary folder, a log file
        assert self.proc is not None
        try:
            self.info = await await_ready(ready_file, self.ready_timeout_s, proc=self.proc, log_path=self.log_path)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop)
            raise
        return self

    def stop(self) -> int | None:
        """Stop the server and everything in its process group; safe twice.

        Returns:
            The server's exit code (negative: killed by that signal), ``None`` if never started.
        """
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers: schedulers, resource tracker
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._wait_gone([int(p) for p in self.info.get("scheduler_pids", ())], timeout_s=self.stop_timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        return proc.returncode

    @staticmethod
    def _wait_gone(pids: list[int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for pid in pids:
            while time.monotonic() < deadline:
                try:
                    if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.Error:
                    break  # gone (or no longer ours to see)
                time.sleep(_POLL_S)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)
