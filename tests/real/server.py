"""Start, probe, fault and stop a real ``vllm serve`` on loopback (used by ``conftest.py`` and
``bench/bench_real_vllm.py``).

A :class:`VllmServer` is one server: ``vllm serve <tiny model>`` on ``127.0.0.1:<free port>``
with ``--max-model-len 256 --enforce-eager --dtype float32 --max-num-seqs 8
--max-num-batched-tokens 32 --block-size 32`` (a 200-token prompt is a chunked prefill of 7
steps, one KV block each), the torch
profiler configured (``--profiler-config``, traces in :attr:`VllmServer.profile_dir`),
``VLLM_CPU_KVCACHE_SPACE=1``, tensor parallel ``tp`` (1 or 2), its own session (``setsid``) and a
log file. float32, not bfloat16: on a CPU that reports ``amx_tile`` without ``amx_bf16`` (these
VMs), vLLM 0.32 picks its AMX attention kernel for bfloat16 and the worker dies of SIGILL at the
first request. Every wait is bounded; :meth:`VllmServer.stop` ends the whole tree — every process of
its session, found by session id, so a worker reparented after its parent died is found too —
and is safe to call twice.

Process tree (vLLM 0.32 on CPU): the API server (no title; comm ``vllm``), a multiprocessing
resource tracker, ``VLLM::EngineCore`` and its children ``VLLM::Worker`` (TP=1: on CPU vLLM
always uses the multiprocessing executor) or ``VLLM::Worker_TP0``, ``VLLM::Worker_TP1``.

:func:`server_lock` is the machine-wide lock (``flock`` on ``/tmp/servewatch-realvllm.lock``)
around any use of a real server: one real-vLLM session at a time on a shared 2-core box.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.real.install import Install

LOCK_PATH = Path("/tmp/servewatch-realvllm.lock")
#: Env var: seconds to wait for another session's real server (default 1500, under the 1800 s
#: per-test timeout of the real-server tests).
LOCK_TIMEOUT_ENV = "REALVLLM_LOCK_TIMEOUT_S"
#: Env var: seconds a server may take to start serving (default 420).
START_TIMEOUT_ENV = "REALVLLM_START_TIMEOUT_S"
#: Env var: "1" keeps each server's work folder (log, profiles, temp files) after it is discarded.
KEEP_ENV = "REALVLLM_KEEP_WORKDIRS"
FAULT_FILE_ENV = "REALVLLM_FAULT_FILE"
MODEL_NAME = "tiny"
#: Seconds a clean SIGTERM shutdown may take before the tree is killed.
STOP_GRACE_S = 30.0


class ServerStartError(RuntimeError):
    """The server exited or did not serve in time; the message ends with its log's tail."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_held_here = 0


@contextlib.contextmanager
def server_lock(timeout_s: float | None = None) -> Iterator[None]:
    """Hold the machine-wide real-vLLM lock; wait at most ``timeout_s`` (default from
    ``$REALVLLM_LOCK_TIMEOUT_S``, else 1500 s) for another holder. Re-entrant within
    one process.

    Raises:
        TimeoutError: the lock stayed held; the message names the holder the file records.
    """
    global _held_here
    if _held_here:
        _held_here += 1
        try:
            yield
        finally:
            _held_here -= 1
        return
    if timeout_s is None:
        timeout_s = float(os.environ.get(LOCK_TIMEOUT_ENV, "1500"))
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                    raise TimeoutError(f"{LOCK_PATH} held for {timeout_s:.0f} s by: {holder or '?'}") from None
                time.sleep(1.0)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%H:%M:%S')} cwd {os.getcwd()}\n".encode(), 0)
        _held_here = 1
        try:
            yield
        finally:
            _held_here = 0
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@dataclass
class VllmServer:
    """One real ``vllm serve`` process tree. Create with :meth:`start`."""

    install: Install
    tp: int
    port: int
    workdir: Path
    proc: subprocess.Popen[bytes]
    extra_args: tuple[str, ...] = ()
    #: the processes' title prefix (``VLLM_PROCESS_NAME_PREFIX``; ``VLLM::EngineCore``)
    title_prefix: str = "VLLM"
    #: pids seen in the tree while it served (API server, EngineCore, workers, helpers).
    known_pids: set[int] = field(default_factory=set)
    _stopped: set[int] = field(default_factory=set)

    # --- life cycle ------------------------------------------------------------------------

    @classmethod
    def start(cls, install: Install, *, tp: int = 1, extra_args: tuple[str, ...] = (), timeout_s: float | None = None,
              port: int | None = None, env: dict[str, str] | None = None, fault: dict[str, str] | None = None,
              wait: bool = True) -> VllmServer:
        """Start ``vllm serve`` and wait until it serves a completion (bounded). ``port``: listen
        there (a restart on the port of a stopped server; default a free one); ``env``: more
        variables for the server (e.g. ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``); ``fault``: the fault
        plugin's trigger, written before the server starts (``{"mode": "load_hang"}`` hangs its
        start-up); ``wait=False``: return once it is started, not serving.

        Raises:
            ServerStartError: it exited, or was not serving after ``timeout_s`` (default
                ``$REALVLLM_START_TIMEOUT_S`` or 420 s); the tree is killed first.
        """
        if timeout_s is None:
            timeout_s = float(os.environ.get(START_TIMEOUT_ENV, "420"))
        workdir = Path(tempfile.mkdtemp(prefix=f"realvllm-tp{tp}-"))
        (workdir / "profiles").mkdir()
        (workdir / "tmp").mkdir()
        port = port or _free_port()
        argv = [
            str(install.vllm), "serve", str(install.model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
            "--max-model-len", "256", "--enforce-eager", "--dtype", "float32", "--max-num-seqs", "8",
            # chunked prefill in steps of 32 tokens: a long prompt is several prefill-only steps,
            # each allocating a KV block of 32 (as in production, where a prefill chunk of
            # thousands of tokens spans many 16-token blocks)
            "--max-num-batched-tokens", "32", "--block-size", "32",
            "--tensor-parallel-size", str(tp),
            "--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(workdir / "profiles")}),
            *extra_args,
        ]  # fmt: skip
        extra_env = env
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(
            PATH=f"{install.vllm.parent}:{env.get('PATH', '/usr/bin:/bin')}",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_TARGET_DEVICE="cpu",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            # torch's export_chrome_trace stages a .json.gz trace in a temp file: a worker killed
            # while writing one leaves GBs behind; here it goes with the work folder
            TMPDIR=str(workdir / "tmp"),
            **{FAULT_FILE_ENV: str(workdir / "fault")},
        )
        env.update(extra_env or {})
        server_fault = workdir / "fault"
        if fault:
            server_fault.write_text("".join(f"{k}={v}\n" for k, v in fault.items()), encoding="utf-8")
        log = open(workdir / "server.log", "wb")  # noqa: SIM115 - the child owns it
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True)
        finally:
            log.close()
        server = cls(install=install, tp=tp, port=port, workdir=workdir, proc=proc, extra_args=extra_args,
                     title_prefix=env.get("VLLM_PROCESS_NAME_PREFIX", "VLLM"))
        if not wait:
            return server
        try:
            server.wait_serving(timeout_s)
        except BaseException:
            server.discard(grace_s=5.0)
            raise
        server.known_pids.update(p.pid for p in server.tree())
        return server

    def wait_serving(self, timeout_s: float) -> None:
        """Block until a 2-token completion succeeds (every 0.5 s, at most ``timeout_s`` seconds).

        Raises:
            ServerStartError: the server exited, or did not serve within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"vllm serve exited {self.proc.returncode} while starting; log tail:\n{self.log_tail()}")
            try:
                self.complete("hello", max_tokens=2, timeout_s=30.0)
                return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise ServerStartError(f"vllm serve not serving after {timeout_s:.0f} s; log tail:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self, sig: int = signal.SIGTERM, *, grace_s: float = STOP_GRACE_S) -> int | None:
        """Stop the server: SIGCONT every process of the tree, ``sig`` to the API server, wait up to
        ``grace_s``, then SIGKILL whatever of its session is left. Returns the API server's exit
        status (``None`` if it never exited). Safe to call twice."""
        self.clear_fault()
        procs = self._session_procs()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.resume()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        for p in self._session_procs():
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        psutil.wait_procs(procs, timeout=10)
        return self.proc.returncode

    def discard(self, sig: int = signal.SIGTERM, *, grace_s: float = STOP_GRACE_S) -> int | None:
        """:meth:`stop`, then remove the work folder (server log, profiles, temp files) unless
        ``$REALVLLM_KEEP_WORKDIRS`` is ``1``. Returns what :meth:`stop` returns."""
        try:
            return self.stop(sig, grace_s=grace_s)
        finally:
            if os.environ.get(KEEP_ENV) != "1":
                shutil.rmtree(self.workdir, ignore_errors=True)

    def _session_procs(self) -> list[psutil.Process]:
        """Every live process of the server's session (``setsid`` at start: sid = API server pid),
        plus the pids seen in its tree."""
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if p.pid in self.known_pids or os.getsid(p.pid) == self.proc.pid:
                    found[p.pid] = p
        return list(found.values())

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    # --- where things are ------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The API server's pid (the root of the tree; ``vllm serve`` itself)."""
        return self.proc.pid

    @property
    def profile_dir(self) -> Path:
        """Where vLLM writes torch profiler traces (``--profiler-config torch_profiler_dir``)."""
        return self.workdir / "profiles"

    @property
    def fault_file(self) -> Path:
        return self.workdir / "fault"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def tree(self) -> list[psutil.Process]:
        """The API server and its live descendants, parents first."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def titled(self, prefix: str) -> list[psutil.Process]:
        """Processes of the tree whose title (``/proc/PID/cmdline``) starts with ``prefix``,
        e.g. ``VLLM::Worker``, ``VLLM::EngineCore``; sorted by title."""
        out = []
        for p in self.tree():
            with contextlib.suppress(psutil.Error):
                cmd = p.cmdline()
                if cmd and cmd[0].startswith(prefix):
                    out.append((cmd[0], p))
        return [p for _, p in sorted(out, key=lambda t: t[0])]

    def engine_core(self) -> psutil.Process:
        (core,) = self.titled(f"{self.title_prefix}::EngineCore")
        return core

    def workers(self) -> list[psutil.Process]:
        """The workers, TP0 first (``VLLM::Worker`` at TP=1, ``VLLM::Worker_TP<n>`` above)."""
        return self.titled(f"{self.title_prefix}::Worker")

    # --- requests --------------------------------------------------------------------------

    def complete(self, prompt: str = "hello", *, max_tokens: int = 8, timeout_s: float = 60.0, **body: object) -> dict:
        """One ``/v1/completions`` request (bounded); the decoded JSON response.

        Raises:
            httpx.HTTPError: transport error, timeout or non-2xx status.
        """
        payload = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **body}
        r = httpx.post(f"{self.url}/v1/completions", json=payload, timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    @contextlib.contextmanager
    def load(self, *, concurrency: int = 2, max_tokens: int = 64, request_timeout_s: float = 120.0, max_requests: int = 10_000) -> Iterator[dict[str, int]]:
        """Send completions from ``concurrency`` threads until the block exits (or
        ``max_requests`` were sent); yields live counters ``ok``, ``failed``, ``tokens``. Each
        request is bounded by ``request_timeout_s``; exiting waits at most that long per thread."""
        stats = {"ok": 0, "failed": 0, "tokens": 0, "sent": 0}
        stop = threading.Event()
        lock = threading.Lock()

        def run(i: int) -> None:
            with httpx.Client(timeout=request_timeout_s) as client:
                while not stop.is_set():
                    with lock:
                        if stats["sent"] >= max_requests:
                            return
                        stats["sent"] += 1
                    body = {"model": MODEL_NAME, "prompt": f"hello world {i}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                    try:
                        r = client.post(f"{self.url}/v1/completions", json=body)
                        r.raise_for_status()
                        n = int(r.json()["usage"]["completion_tokens"])
                        with lock:
                            stats["ok"] += 1
                            stats["tokens"] += n
                    except (httpx.HTTPError, ValueError, KeyError):
                        with lock:
                            stats["failed"] += 1
                        stop.wait(0.5)

        threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"realvllm-load-{i}") for i in range(concurrency)]
        for t in threads:
            t.start()
        try:
            yield stats
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=request_timeout_s + 5)

    def tokens(self, text: str, timeout_s: float = 30.0) -> int:
        """How many tokens ``text`` is for the served model (``POST /tokenize``)."""
        r = httpx.post(f"{self.url}/tokenize", json={"model": MODEL_NAME, "prompt": text}, timeout=timeout_s)
        r.raise_for_status()
        return int(r.json()["count"])

    def metrics(self, timeout_s: float = 10.0) -> str:
        r = httpx.get(f"{self.url}/metrics", timeout=timeout_s)
        r.raise_for_status()
        return r.text

    # --- faults ----------------------------------------------------------------------------

    def hang(self, ranks: tuple[int, ...] | None = (0,)) -> None:
        """Make the forward of the given TP ranks (``None``: all) block until :meth:`clear_fault`
        (the fault plugin; takes effect at the next forward)."""
        self._write_fault({"mode": "hang", "ranks": "all" if ranks is None else ",".join(map(str, ranks))})

    def hang_engine(self) -> None:
        """Make the EngineCore's own busy loop block before its next step until :meth:`clear_fault`
        (the fault plugin's ``engine_hang``: its workers idle waiting for work; released within
        50 ms of the clear)."""
        self._write_fault({"mode": "engine_hang"})

    def hang_api_server(self) -> None:
        """Make the API server's next completion request block its event loop until
        :meth:`clear_fault` (the fault plugin's ``api_hang``: a synchronous wait inside the async
        handler; ``/health`` and ``/metrics`` time out meanwhile)."""
        self._write_fault({"mode": "api_hang"})

    def slow(self, delay_s: float, ranks: tuple[int, ...] | None = None) -> None:
        """Make every forward of the given TP ranks (``None``: all) sleep ``delay_s`` first."""
        self._write_fault({"mode": "slow", "delay_s": str(delay_s), "ranks": "all" if ranks is None else ",".join(map(str, ranks))})

    def _write_fault(self, fault: dict[str, str]) -> None:
        tmp = self.fault_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{k}={v}\n" for k, v in fault.items()), encoding="utf-8")
        os.replace(tmp, self.fault_file)

    def clear_fault(self) -> None:
        """Remove the trigger: a hung forward (or engine core step) returns within 50 ms."""
        self.fault_file.unlink(missing_ok=True)

    def sigstop(self, proc: psutil.Process) -> None:
        """SIGSTOP one process of the tree (SIGCONT by :meth:`resume_all` / :meth:`stop`)."""
        proc.suspend()
        self._stopped.add(proc.pid)

    def resume_all(self) -> None:
        for pid in self._stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._stopped.clear()

    def serves(self, timeout_s: float = 60.0) -> bool:
        """Whether a 2-token completion succeeds within ``timeout_s`` (``/health`` stays 200 through a
        hung forward, so it proves nothing)."""
        if not self.alive:
            return False
        try:
            self.complete("hello", max_tokens=2, timeout_s=timeout_s)
        except httpx.HTTPError:
            return False
        return True
