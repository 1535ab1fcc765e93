"""The engineer who forgot sudo: ``profile``, ``dump``, ``run`` and ``status`` run as a real other
uid (``nobody`` through ``setpriv``) against root's real server and root's real data dir.

Each says, in one line, whose folder stops it and what to do; none prints a traceback; a watcher
that cannot see is BLIND with the reason. The CLI runs from a copy of ``agent/`` and
``exporters/`` nobody can read (the checkout may be closed to other users), with an interpreter
nobody can run: this one, else the system's of the same version with this venv's packages.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import PROGRAMS_DIR
from tests.security._attack import AS_NOBODY, NOBODY, REPO, needs_root

pytestmark = needs_root

ROOT_FOLDER_DENIED = "servewatch-0 is owned by root (0700): run as root (sudo)"


def _public_dir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


def _open_up(root: Path) -> None:
    """Folders 0755 and files 0644 (0755 when executable) under ``root``: readable by nobody
    whatever the umask was (077 in CI)."""
    for dirpath, _dirs, files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in files:
            path = Path(dirpath) / name
            path.chmod(0o755 if os.access(path, os.X_OK) else 0o644)


#: Installed packages the CLI never imports (torch and its kin, the linters): not copied for nobody.
_NOT_COPIED = ("torch", "torch-*", "functorch", "torchgen", "nvidia*", "triton*", "mlx*", "sympy*", "networkx*",
               "mypy*", "ruff*", "pip", "pip-*", "setuptools*", "__pycache__", "*.pyc")


def _nobody_env(code: Path, shm: Path, bin_dir: Path) -> dict[str, str]:
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": f"{code}:{code / 'site'}",
            "SERVEWATCH_SHM_DIR": str(shm), "HOME": "/tmp", "LANG": "C.UTF-8", "COLUMNS": "400"}


@pytest.fixture(scope="module")
def nobody_cli() -> Iterator[tuple[list[str], Path, Path]]:
    """``(argv prefix running servewatch as nobody, its code folder, its bin folder with py-spy)``;
    skips with one line when no interpreter nobody can run finds this venv's packages."""
    code = _public_dir("sw-noroot-code-")
    bin_dir = code / "bin"
    try:
        for pkg in ("agent", "exporters"):
            shutil.copytree(REPO / pkg, code / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        # this venv's packages, readable by nobody: under CI's umask 077 (and a venv in root's
        # home) nobody can read the installed ones, and every test here skipped
        shutil.copytree(sysconfig.get_paths()["purelib"], code / "site", ignore=shutil.ignore_patterns(*_NOT_COPIED))
        bin_dir.mkdir()
        pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
        if pyspy:
            shutil.copy(pyspy, bin_dir / "py-spy")
        _open_up(code)
        env = _nobody_env(code, Path("/tmp"), bin_dir)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        tried = []
        for exe in (sys.executable, shutil.which(version, path="/usr/bin:/usr/local/bin") or ""):
            if not exe:
                continue
            probe = subprocess.run([*AS_NOBODY, exe, "-c", "import typer, rich, anyio, psutil, pydantic, agent.cli.app"],
                                   env=env, capture_output=True, timeout=60, check=False, cwd="/tmp")
            if probe.returncode == 0:
                yield [*AS_NOBODY, exe, "-m", "agent.cli.entry"], code, bin_dir
                return
            tried.append(f"{exe}: {probe.stderr.decode(errors='replace').strip().splitlines()[-1:]}")
        pytest.skip(f"no interpreter nobody can run imports this venv's packages ({'; '.join(tried)})")
    finally:
        shutil.rmtree(code, ignore_errors=True)


@pytest.fixture
def root_server(spawn: Callable) -> Iterator[tuple[int, Path]]:
    """Root's real SDK server (step counter, control socket, span ring in root's 0700 folder of
    a 1777 shm folder): ``(pid, shm folder)``."""
    shm = Path(tempfile.mkdtemp(prefix="sw-noroot-shm-", dir="/tmp"))
    shm.chmod(0o1777)
    try:
        env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "PYTHONPATH": str(REPO)}
        proc = spawn([sys.executable, str(PROGRAMS_DIR / "sdk_server.py")], env=env, stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().startswith(b"pid ")
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert b'"control_running": true' in proc.stdout.readline()
        yield proc.pid, shm
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def nobody_home() -> Iterator[Path]:
    """nobody's own working folder (its data dirs go there)."""
    path = _public_dir("sw-noroot-home-")
    os.chown(path, NOBODY, NOBODY)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _as_nobody(cli: tuple[list[str], Path, Path], shm: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv, code, bin_dir = cli
    return subprocess.run([*argv, *args], env=_nobody_env(code, shm, bin_dir), cwd=home, capture_output=True,
                          text=True, timeout=120, check=False)


def _no_traceback(text: str) -> None:
    assert "Traceback" not in text and "Error:" not in text.replace("Errors:", ""), text


def test_profile_as_nobody_says_whose_socket_and_to_run_as_root(
    nobody_cli: tuple[list[str], Path, Path], root_server: tuple[int, Path], nobody_home: Path
) -> None:
    pid, shm = root_server
    done = _as_nobody(nobody_cli, shm, nobody_home, "profile", "--pid", str(pid), "--data-dir", "d")
    _no_traceback(done.stderr)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"servewatch: cannot reach the SDK control socket of pid {pid}: {shm}/{ROOT_FOLDER_DENIED}"]


def test_dump_as_nobody_says_each_denial_in_one_line_and_the_verdict_says_why_no_stack(
    nobody_cli: tuple[list[str], Path, Path], root_server: tuple[int, Path], nobody_home: Path
) -> None:
    pid, shm = root_server
    done = _as_nobody(nobody_cli, shm, nobody_home, "dump", "--pid", str(pid), "--data-dir", "d")
    text = done.stdout + done.stderr
    _no_traceback(text)
    assert done.returncode == 1, text
    assert (f"servewatch: warning: in-flight requests of pid {pid} unavailable: {shm}/{ROOT_FOLDER_DENIED}"
            in done.stderr.splitlines()), done.stderr
    fr = next(line for line in done.stdout.splitlines() if line.strip().startswith("flightrec.dump"))
    assert "permission_denied" in fr and fr.endswith(f"{shm}/{ROOT_FOLDER_DENIED}"), fr
    verdict = next(line for line in done.stdout.splitlines() if line.startswith("Verdict:"))
    assert verdict == (f"Verdict: 1 process (pid {pid}), not a distributed job: no stack; py-spy was denied:"
                       " run servewatch as root (sudo) or with CAP_SYS_PTRACE [confidence low]")
    lines = done.stdout.splitlines()
    assert lines[lines.index(verdict) + 1] == f"next: sudo py-spy dump --native --pid {pid} (where it is, native frames included)"
    assert len(text.splitlines()) <= 13, text


def _lines_until(proc: subprocess.Popen[str], wanted: Callable[[list[str]], bool], timeout_s: float) -> list[str]:
    """stderr lines of ``proc`` until ``wanted(lines)`` or ``timeout_s`` (a reader thread: every
    wait bounded)."""
    assert proc.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()
    stream = proc.stderr

    def read() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    try:
        while not wanted(seen):
            line = lines.get(timeout=timeout_s)
            if line is None:
                break
            seen.append(line)
    except queue.Empty:
        pass
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    return seen


def test_run_as_nobody_is_blind_with_the_fix_never_ready_and_never_blames_the_server(
    nobody_cli: tuple[list[str], Path, Path], root_server: tuple[int, Path], nobody_home: Path, spawn: Callable
) -> None:
    pid, shm = root_server
    argv, code, bin_dir = nobody_cli
    proc = spawn([*argv, "run", "--pid", str(pid), "--data-dir", "d"], env=_nobody_env(code, shm, bin_dir),
                 cwd=nobody_home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wanted = ("servewatch: steps: BLIND", "servewatch: pyspy: BLIND", "servewatch: spans: BLIND")
    lines = _lines_until(proc, lambda seen: all(any(s.startswith(w) for s in seen) for w in wanted), 60)
    text = "\n".join(lines)
    _no_traceback(text)
    assert f"servewatch: steps: BLIND — cannot open the step counter of pid {pid}: {shm}/{ROOT_FOLDER_DENIED}" in lines, text
    assert (f"servewatch: pyspy: BLIND — cannot read the stacks of pid {pid} (uid 0): py-spy needs root or"
            " CAP_SYS_PTRACE: run as root (sudo)") in lines, text
    assert (f"servewatch: spans: BLIND — span ring of pid {pid} not shipped: cannot open its span ring:"
            f" {shm}/{ROOT_FOLDER_DENIED}") in lines, text
    assert not [line for line in lines if line.startswith(("servewatch: pyspy: ready", "servewatch: steps: waiting"))], text
    assert "agent.sdk.step()" not in text
    assert lines[-1].startswith("servewatch: stopped after "), text


def test_status_as_nobody_on_roots_data_dir_says_owned_by_root(
    nobody_cli: tuple[list[str], Path, Path], root_server: tuple[int, Path], nobody_home: Path, tmp_path: Path
) -> None:
    pid, shm = root_server
    parent = _public_dir("sw-noroot-data-")
    try:
        data = parent / "data"
        env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "PYTHONPATH": str(REPO)}
        root_run = subprocess.run([sys.executable, "-m", "agent.cli.entry", "run", "--pid", str(pid), "--duration", "1",
                                   "--data-dir", str(data)], env=env, cwd=tmp_path, capture_output=True, text=True,
                                  timeout=120, check=False)
        assert root_run.returncode == 0, root_run.stderr
        assert data.stat().st_mode & 0o777 == 0o700
        done = _as_nobody(nobody_cli, shm, nobody_home, "status", "--data-dir", str(data))
        _no_traceback(done.stderr)
        assert done.returncode == 1, done.stderr
        assert done.stderr.splitlines() == [
            f"servewatch: cannot read the agent status in {data}: {data} is owned by root (0700): run as root (sudo)"]
    finally:
        shutil.rmtree(parent, ignore_errors=True)


INCIDENT = "20261129T100000Z-stall-abc123"


@pytest.fixture
def roots_data() -> Iterator[Path]:
    """Root's 0700 data dir ``servewatch-data`` holding one bundle, in a folder anyone may enter."""
    parent = _public_dir("sw-noroot-data-")
    try:
        data = parent / "servewatch-data"
        bundle = data / "h1" / INCIDENT
        bundle.mkdir(parents=True)
        (bundle / "manifest.json").write_text(json.dumps({
            "schema": "servewatch.incident/1", "incident_id": INCIDENT, "trigger": "stall", "detail": "d",
            "host.name": "h1", "trace_id": "", "span_id": "", "opened_time_unix_nano": 1, "closed_time_unix_nano": 2,
            "duration_s": 1.0, "targets": [], "actions": [], "inflight_requests": 0}))
        data.chmod(0o700)
        yield data
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.parametrize("form", ["bundle", "missing", "latest", "id", "none"])
@pytest.mark.parametrize("command", ["timeline", "report"])
def test_timeline_and_report_as_nobody_on_roots_data_dir_say_owned_by_root(
    nobody_cli: tuple[list[str], Path, Path], nobody_home: Path, roots_data: Path, command: str, form: str
) -> None:
    """A bundle path, a path that does not exist under it, ``latest``, an id or nothing: one line
    naming root's folder and the fix, exit 1; never a traceback, never "no incident bundles"."""
    arg = {"bundle": [str(roots_data / "h1" / INCIDENT)], "missing": [str(roots_data / "nope")], "latest": ["latest"],
           "id": ["abc123"], "none": []}[form]
    out = ["-o", "x.html"] if command == "report" else []
    done = _as_nobody(nobody_cli, Path("/tmp"), nobody_home, command, *arg, *out, "--data-dir", str(roots_data))
    _no_traceback(done.stdout + done.stderr)
    assert done.returncode == 1, done.stderr
    what = arg[0] if form in ("bundle", "missing") else f"the incidents in {roots_data}"
    assert done.stderr.splitlines() == [
        f"servewatch: cannot read {what}: {roots_data} is owned by root (0700): run as root (sudo)"]
    assert not (nobody_home / "x.html").exists()


def test_profile_without_pid_as_nobody_says_candidates_may_hide_behind_roots_folder(
    nobody_cli: tuple[list[str], Path, Path], root_server: tuple[int, Path], nobody_home: Path
) -> None:
    """Root's SDK server runs but its folder is closed to nobody: not "no process serves an SDK
    control socket", but that candidates may be hidden there, whose it is and what to do."""
    _pid, shm = root_server
    done = _as_nobody(nobody_cli, shm, nobody_home, "profile", "--steps", "5", "--data-dir", "d")
    _no_traceback(done.stderr)
    (line,) = done.stderr.splitlines()
    assert line.startswith("servewatch: profile needs a target: --pid PID (SDK) or --url URL (SGLang, vLLM); "), line
    assert line.endswith(f"; candidates may be hidden: {shm}/{ROOT_FOLDER_DENIED}"), line
    assert "no process serves an SDK control socket" not in line, line
    assert done.returncode == (1 if "no candidates:" in line else 2), line


def test_dump_of_roots_ranks_as_nobody_says_why_no_stack_in_the_verdict_and_no_gpu_quietly(
    nobody_cli: tuple[list[str], Path, Path], nobody_home: Path, spawn: Callable
) -> None:
    """Two ranks py-spy may not read (root's, TP0 and TP1): the summary's verdict line says why
    there is no stack; on a host without a GPU the coredump line is root's quiet ``none: no GPU``,
    not a ``permission_denied`` per rank."""
    from agent.host.cudaenv import cuda_driver_present

    pids = []
    for rank in (0, 1):
        proc = spawn([sys.executable, str(PROGRAMS_DIR / "titled_target.py"), f"noroot{os.getpid()}::scheduler_TP{rank}",
                      "--max-lifetime-s", "60"], stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
        pids += ["--pid", str(proc.pid)]
    done = _as_nobody(nobody_cli, Path("/tmp"), nobody_home, "dump", *pids, "--data-dir", "d")
    text = done.stdout + done.stderr
    _no_traceback(text)
    verdict = next(line for line in done.stdout.splitlines() if line.startswith("Verdict:"))
    assert verdict == ("Verdict: no culprit rank -- no conclusive evidence (no Flight Recorder and no stacks);"
                       " py-spy was denied: run servewatch as root (sudo) or with CAP_SYS_PTRACE [confidence low]")
    lines = done.stdout.splitlines()
    assert lines[lines.index(verdict) + 1] == f"next: sudo servewatch dump {' '.join(pids)} (as root: py-spy was denied)"
    coredump = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("cuda.coredump")]
    if not cuda_driver_present():
        assert coredump == ["cuda.coredump   none: no GPU/CUDA driver on this host (2 process(es))"], text
        assert "cannot read /proc/" not in text
