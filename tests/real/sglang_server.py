"""Start, probe, fault and stop a real SGLang server on loopback (used by ``conftest.py``).

A :class:`SglangServer` is one ``python -m sglang.launch_server`` of the install of
``install_sglang.py`` on ``127.0.0.1:<free port>``, CPU engine (``SGLANG_USE_CPU_ENGINE=1``,
``--device cpu --attention-backend torch_native --disable-cuda-graph --dtype bfloat16
--disable-overlap-schedule``), metrics on (``--enable-metrics``), the fault hook on
``model.layers.0`` (``--forward-hooks``), tensor parallel ``tp`` (1 or 2), its own session
(``setsid``: the launcher's pid is the group and session id) and a log file. The CUDA torch build
ships libnccl: ``SGLANG_NCCL_SO_PATH`` names a file that does not exist and
``--disable-custom-all-reduce`` is given (else TP=2 dies "Expected a cuda device"); at TP=2 each
rank gets its own core (``SGLANG_CPU_OMP_THREADS_BIND="0|1"``). Every wait is bounded;
:meth:`SglangServer.stop` SIGCONTs and SIGTERMs the process group, then SIGKILLs whatever of its
session is left, and is safe to call twice.

Process tree (SGLang 0.5.23 on CPU): the launcher (keeps its command line; runs the HTTP server
and the tokenizer manager), ``sglang::scheduler`` (TP=1, no suffix) or ``sglang::scheduler_TP0``
and ``sglang::scheduler_TP1``, and ``sglang::detokenizer``.

It shares :func:`tests.real.server.server_lock` with the vLLM fixture: one real server session
at a time on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.real.install_sglang import HOOK_MODULE, SglangInstall
from tests.real.server import (
    KEEP_ENV,
    START_TIMEOUT_ENV,
    STOP_GRACE_S,
    ServerStartError,
    _free_port,
)

MODEL_NAME = "tiny"
READY_LINE = "The server is fired up and ready to roll"
#: SGLang's own variable: a missing file makes it treat NCCL as absent (CPU gloo only).
MISSING_NCCL = "/nonexistent/servewatch/libnccl.so.2"


@dataclass
class SglangServer:
    """One real SGLang process tree. Create with :meth:`start`."""

    install: SglangInstall
    tp: int
    port: int
    workdir: Path
    proc: subprocess.Popen[bytes]
    extra_args: tuple[str, ...] = ()
    #: pids seen in the tree while it served (launcher, schedulers, detokenizer, helpers).
    known_pids: set[int] = field(default_factory=set)
    _stopped: set[int] = field(default_factory=set)

    # --- life cycle ------------------------------------------------------------------------

    @classmethod
    def start(cls, install: SglangInstall, *, tp: int = 1, extra_args: tuple[str, ...] = (), timeout_s: float | None = None,
              port: int | None = None, env: dict[str, str] | None = None) -> SglangServer:
        """Start the server and wait until it answers a completion (bounded).

        Raises:
            ServerStartError: it exited, or was not serving after ``timeout_s`` (default
                ``$REALVLLM_START_TIMEOUT_S`` or 420 s); the tree is killed first.
        """
        if timeout_s is None:
            timeout_s = float(os.environ.get(START_TIMEOUT_ENV, "420"))
        workdir = Path(tempfile.mkdtemp(prefix=f"realsglang-tp{tp}-"))
        port = port or _free_port()
        argv, env = cls.command(install, workdir, tp=tp, port=port, extra_args=extra_args, env=env)
        log = open(workdir / "server.log", "wb")  # noqa: SIM115 - the child owns it
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                    start_new_session=True)  # fmt: skip
        finally:
            log.close()
        server = cls(install=install, tp=tp, port=port, workdir=workdir, proc=proc, extra_args=extra_args)
        try:
            server._wait_serving(timeout_s)
        except BaseException:
            server.discard(grace_s=5.0)
            raise
        server.known_pids.update(p.pid for p in server.tree())
        return server

    @staticmethod
    def command(install: SglangInstall, workdir: Path, *, tp: int, port: int, extra_args: tuple[str, ...] = (),
                env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
        """The server's command line and environment (its work folder ``workdir`` gets
        ``profiles/`` and ``tmp/``; the fault file is ``workdir/fault``)."""
        (workdir / "profiles").mkdir(exist_ok=True)
        (workdir / "tmp").mkdir(exist_ok=True)
        hooks = [{"name": "servewatch_faults", "target_modules": ["model.layers.0"], "hook_factory": f"{HOOK_MODULE}:make_hook",
                  "config": {"fault_file": str(workdir / "fault")}}]  # fmt: skip
        argv = [
            str(install.python), "-m", "sglang.launch_server", "--model-path", str(install.model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--tp", str(tp),
            "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--dtype", "bfloat16",
            "--disable-overlap-schedule", "--disable-custom-all-reduce", "--enable-metrics",
            "--max-total-tokens", "4096", "--max-running-requests", "8",
            "--forward-hooks", json.dumps(hooks),
            *extra_args,
        ]  # fmt: skip
        full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        full.update(
            # SGLang's watchdog runs `py-spy dump` through the shell: the venv's py-spy first
            PATH=f"{install.bin}:{full.get('PATH', '/usr/bin:/bin')}",
            SGLANG_USE_CPU_ENGINE="1",
            SGLANG_NCCL_SO_PATH=MISSING_NCCL,
            SGLANG_TORCH_PROFILER_DIR=str(workdir / "profiles"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TMPDIR=str(workdir / "tmp"),
            # the fault file for the detokenizer (the fault module's .pth arms it; see detokenizer_spin)
            REALSGLANG_FAULT_FILE=str(workdir / "fault"),
        )
        if tp > 1:  # one core per rank, else SGLang's CPU init asserts tp <= NUMA nodes
            full["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        full.update(env or {})
        return argv, full

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"sglang exited {self.proc.returncode} while starting; log tail:\n{self.log_tail()}")
            if READY_LINE in self.log_text():
                try:
                    self.complete("hello", max_tokens=2, timeout_s=30.0)
                    return
                except httpx.HTTPError:
                    pass
            if time.monotonic() >= deadline:
                raise ServerStartError(f"sglang not serving after {timeout_s:.0f} s; log tail:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, sig: int = signal.SIGTERM, *, grace_s: float = STOP_GRACE_S) -> int | None:
        """Stop the server: remove the fault, SIGCONT every process of its session, ``sig`` to its
        process group, wait up to ``grace_s`` for the launcher, then SIGKILL whatever of the session
        is left. Returns the launcher's exit status. Safe to call twice."""
        self.clear_fault()
        procs = self._session_procs()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.resume()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
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
        """:meth:`stop`, then remove the work folder unless ``$REALVLLM_KEEP_WORKDIRS`` is ``1``."""
        try:
            return self.stop(sig, grace_s=grace_s)
        finally:
            if os.environ.get(KEEP_ENV) != "1":
                shutil.rmtree(self.workdir, ignore_errors=True)

    def _session_procs(self) -> list[psutil.Process]:
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
        """The launcher's pid (HTTP server + tokenizer manager; the root of the tree)."""
        return self.proc.pid

    @property
    def profile_dir(self) -> Path:
        return self.workdir / "profiles"

    @property
    def fault_file(self) -> Path:
        return self.workdir / "fault"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:]) or "(no log)"

    def tree(self) -> list[psutil.Process]:
        """The launcher and its live descendants, parents first."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def titled(self, prefix: str) -> list[psutil.Process]:
        """Processes of the tree whose title starts with ``prefix``; sorted by title."""
        out = []
        for p in self.tree():
            with contextlib.suppress(psutil.Error):
                cmd = p.cmdline()
                if cmd and cmd[0].startswith(prefix):
                    out.append((cmd[0], p))
        return [p for _, p in sorted(out, key=lambda t: t[0])]

    def schedulers(self) -> list[psutil.Process]:
        """``sglang::scheduler`` (TP=1) or ``sglang::scheduler_TP0``, ``_TP1``..., TP0 first."""
        return self.titled("sglang::scheduler")

    def detokenizer(self) -> psutil.Process:
        (d,) = self.titled("sglang::detokenizer")
        return d

    # --- requests --------------------------------------------------------------------------

    def complete(self, prompt: str = "hello", *, max_tokens: int = 8, timeout_s: float = 60.0) -> dict:
        """One ``/v1/completions`` request (bounded); the decoded JSON response.

        Raises:
            httpx.HTTPError: transport error, timeout or non-2xx status.
        """
        payload = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{self.url}/v1/completions", json=payload, timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    @contextlib.contextmanager
    def load(self, *, concurrency: int = 2, max_tokens: int = 48, request_timeout_s: float = 120.0) -> Iterator[dict[str, int]]:
        """Send completions from ``concurrency`` threads until the block exits; yields live
        counters ``ok`` and ``failed``. Each request is bounded by ``request_timeout_s``; exiting
        waits at most that long per thread."""
        stats = {"ok": 0, "failed": 0}
        stop = threading.Event()

        def run(i: int) -> None:
            while not stop.is_set():
                try:
                    self.complete(f"hello world {i}", max_tokens=max_tokens, timeout_s=request_timeout_s)
                    stats["ok"] += 1
                except httpx.HTTPError:
                    stats["failed"] += 1
                    stop.wait(0.5)

        threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"realsglang-load-{i}") for i in range(concurrency)]
        for t in threads:
            t.start()
        try:
            yield stats
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=request_timeout_s + 5)

    def metrics(self, timeout_s: float = 10.0) -> str:
        r = httpx.get(f"{self.url}/metrics", timeout=timeout_s)
        r.raise_for_status()
        return r.text

    # --- faults ----------------------------------------------------------------------------

    def hang(self, ranks: tuple[int, ...] | None = (0,)) -> None:
        """Make the forward of the given ranks (``None``: all) block until :meth:`clear_fault`
        (the hook; takes effect at the next forward of ``model.layers.0``)."""
        tmp = self.fault_file.with_suffix(".tmp")
        tmp.write_text(f"mode=hang\nranks={'all' if ranks is None else ','.join(map(str, ranks))}\n", encoding="utf-8")
        os.replace(tmp, self.fault_file)

    def spin_detokenizer(self) -> None:
        """Make the detokenizer's next incremental decode spin on the CPU until :meth:`clear_fault`
        (the fault module's ``detokenizer_spin``; the schedulers go on generating)."""
        tmp = self.fault_file.with_suffix(".tmp")
        tmp.write_text("mode=detokenizer_spin\n", encoding="utf-8")
        os.replace(tmp, self.fault_file)

    def clear_fault(self) -> None:
        """Remove the trigger: a hung forward returns (or a spinning detokenizer goes on) within 50 ms."""
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
        """Whether a 2-token completion succeeds within ``timeout_s``."""
        if not self.alive:
            return False
        try:
            self.complete("hello", max_tokens=2, timeout_s=timeout_s)
        except httpx.HTTPError:
            return False
        return True
