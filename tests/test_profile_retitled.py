"""``profile --url`` on a vLLM server whose listening process is retitled (issue 32 item 8):
``vllm serve --api-server-count N`` listens in children titled ``VLLM::APIServer_<i>`` by the
real ``setproctitle``, whose ``/proc/<pid>/cmdline`` is only that title. The folder vLLM writes
its traces to is read from the parent's launch arguments; where no process says it, the answer
names the retitled process and how to pass the folder (``--out``), never "not launched with
--profiler-config" (what it said before, for a server that was)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

from agent.host.profiletargets import vllm_trace_dir

PROGRAM = Path(__file__).resolve().parent / "programs" / "retitled_listener.py"


def _start(spawn, *args: str) -> tuple[str, int, subprocess.Popen[str]]:
    proc = spawn([sys.executable, str(PROGRAM), *args], stdout=subprocess.PIPE, text=True)
    ready = proc.stdout.readline().split()
    assert ready[:1] == ["READY"], ready
    return f"http://127.0.0.1:{ready[1]}", int(ready[2]), proc


def test_the_folder_of_a_retitled_api_server_is_read_from_its_vllm_serve_parent(spawn, tmp_path: Path) -> None:
    folder = tmp_path / "vllm-traces"
    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(folder)})
    url, child, _ = _start(spawn, "--", "serve", "tiny", "--profiler-config", config)
    assert [a for a in psutil.Process(child).cmdline() if a] == ["VLLM::APIServer_0"]  # the real title: no arguments left
    assert vllm_trace_dir(url) == (folder, "")


def test_a_retitled_server_no_process_of_which_says_the_folder_is_named_with_how_to_pass_it(spawn, tmp_path: Path) -> None:
    url, child, _ = _start(spawn, "--orphan")
    folder, why = vllm_trace_dir(url)
    assert folder is None
    assert f"pid {child} 'VLLM::APIServer_0' is retitled (setproctitle)" in why, why
    assert "pass that folder with --out DIR" in why and "not launched with" not in why, why


def test_a_parent_that_exits_while_it_is_read_ends_the_walk_not_the_answer(spawn, tmp_path: Path, monkeypatch) -> None:
    """CI: the launcher exited between being found as the parent and having its command line read
    (psutil's ZombieProcess); the answer was "cannot read pid N's command line"."""
    url, child, launcher = _start(spawn)
    real_cmdline = psutil.Process.cmdline

    def cmdline(self: psutil.Process) -> list[str]:
        if self.pid == launcher.pid:
            raise psutil.ZombieProcess(self.pid)
        return real_cmdline(self)

    monkeypatch.setattr(psutil.Process, "cmdline", cmdline)
    folder, why = vllm_trace_dir(url)
    assert folder is None and f"pid {child} 'VLLM::APIServer_0' is retitled (setproctitle)" in why, why


def test_a_parent_caught_exiting_is_not_named_retitled(spawn, tmp_path: Path, monkeypatch) -> None:
    """CI: ``--orphan``'s launcher was read while it exited, its memory (so its command line)
    already released but not yet a zombie: ``cmdline()`` read ``[]`` and the answer named it
    "pid N '' is retitled" beside the real retitled API server."""
    url, child, launcher = _start(spawn)
    real_cmdline = psutil.Process.cmdline

    def cmdline(self: psutil.Process) -> list[str]:
        return [] if self.pid == launcher.pid else real_cmdline(self)

    monkeypatch.setattr(psutil.Process, "cmdline", cmdline)
    folder, why = vllm_trace_dir(url)
    assert folder is None
    assert why.startswith(f"pid {child} 'VLLM::APIServer_0' is retitled (setproctitle):"), why
    assert f"pid {launcher.pid}" not in why, why
