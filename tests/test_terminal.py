"""What the paged engineer sees, in a real terminal: tmux at 80 columns, the demo server.

The path of someone paged at 3 a.m., typed into a real shell in a real tmux pane: `servewatch
run` watching the server (window 0); in a second window a profile with no traffic (its progress
line says what it waits for, then goes), some traffic, the hang, and once `run` printed the
incident, `servewatch timeline latest`; its last screen must show the verdict and each rank's
hung frame. Ctrl-C in window 0 leaves `run`'s one summary line on screen.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.client import DemoServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

COLUMNS, ROWS = 80, 24


class Tmux:
    """A private tmux server (its own socket) with one session, killed at the end."""

    def __init__(self, socket_path: Path, env: dict[str, str], cwd: Path) -> None:
        self.socket, self.env, self.cwd = str(socket_path), env, cwd

    def __call__(self, *args: str) -> str:
        tmux = shutil.which("tmux")
        assert tmux is not None
        r = subprocess.run([tmux, "-S", self.socket, *args], capture_output=True, text=True, timeout=20,
                           env=self.env, cwd=self.cwd, check=False)
        assert r.returncode == 0, f"tmux {' '.join(args)}: {r.stderr}"
        return r.stdout

    def type(self, target: str, line: str) -> None:
        """Type ``line`` and Enter into ``target``, as a person would."""
        self("send-keys", "-t", target, "-l", line)
        self("send-keys", "-t", target, "Enter")

    def screen(self, target: str, *, history: bool = False) -> str:
        """What the pane shows now (``history``: its scrollback too)."""
        return self("capture-pane", "-p", "-J" if history else "-N", "-t", target, *(["-S", "-"] if history else []))

    def wait(self, target: str, pattern: str, timeout_s: float, *, history: bool = False) -> str:
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.screen(target, history=history)
            if re.search(pattern, text, re.MULTILINE):
                return text
            time.sleep(0.25)
        raise AssertionError(f"{pattern!r} not on screen of {target} within {timeout_s} s:\n{text}")


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux (a real terminal)")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_", "TMUX"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", SERVEWATCH_SHM_DIR=str(tmp_path / "shm"),
               PS1="$ ", TERM="xterm-256color", HOME=str(tmp_path), LANG="C.UTF-8", LC_ALL="C.UTF-8")
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    t = Tmux(tmp_path / "tmux.sock", env, cwd)
    t("-f", "/dev/null", "new-session", "-d", "-s", "paged", "-x", str(COLUMNS), "-y", str(ROWS), "-c", str(cwd),
      "bash --norc --noprofile")
    t("set-option", "-g", "history-limit", "20000")
    t("new-window", "-t", "paged", "-c", str(cwd), "bash --norc --noprofile")
    for window in ("paged:0", "paged:1"):
        t.type(window, "PS1='$ '; clear")
    try:
        yield t
    finally:
        subprocess.run([shutil.which("tmux") or "tmux", "-S", t.socket, "kill-server"], capture_output=True, timeout=20,
                       check=False)


def _unboxed(text: str) -> str:
    return " ".join(text.replace("│", " ").replace("╭", " ").replace("╰", " ").replace("─", " ").split())


def test_paged_engineer_path_at_80_columns_ends_with_the_verdict_and_every_hung_frame_on_screen(
    tmux: Tmux, tmp_path: Path
) -> None:
    prefix = f"tty{os.getpid()}"
    env = {**tmux.env}
    with DemoServer(tp=2, title_prefix=prefix, env=env) as server:
        url = server.base_url
        tp0, tp1 = server.scheduler_pids
        watch, shell = "paged:0", "paged:1"
        tmux.type(watch, f"servewatch run --health-url {url}/health --match '{prefix}::scheduler*' --watchdog-timeout 3")
        tmux.wait(watch, r"process: watching 2 target processes", 60, history=True)

        # a profile of an idle server: its progress line says what it waits for, on one line, then goes
        tmux.type(shell, f"servewatch profile --pid {tp0} --steps 2 --timeout 4")
        waiting = tmux.wait(shell, rf"waiting for the next forward step of pid {tp0} .*\(\d+ s\)", 30)
        line = next(ln for ln in waiting.splitlines() if "waiting for the next forward step" in ln)
        assert len(line) <= COLUMNS, line
        done = tmux.wait(shell, r"^Profile timed_out: ", 60)
        assert "waiting for the next forward step" not in done, done  # erased before the result

        # traffic, then rank 1 hangs inside its forward at the next request
        tmux.type(shell, "clear")
        tmux.type(shell, f"for i in $(seq 20); do curl -s -o /dev/null -XPOST {url}/generate -d '{{\"text\": \"hi\", \"max_new_tokens\": 64}}'; done")
        tmux.type(shell, f"curl -s -XPOST {url}/debug/hang -d '{{\"tp_rank\": 1, \"seconds\": null}}'; echo")
        tmux.type(shell, f"curl -s -m 60 -XPOST {url}/generate -d '{{\"text\": \"this one hangs\", \"max_new_tokens\": 4}}' >/dev/null &")
        tmux.wait(watch, r"^View: servewatch timeline ", 90, history=True)

        # the timeline, read where the engineer is: the screen it leaves shows the verdict and the frames
        tmux.type(shell, "clear; servewatch timeline latest")
        tmux.wait(shell, r"╰─+╯\s*\n\$ $", 60)
        screen = tmux.screen(shell)
        lines = screen.splitlines()
        assert len(lines) <= ROWS and max(len(ln) for ln in lines) <= COLUMNS, screen
        seen = _unboxed(screen)
        assert re.search(rf"Verdict: culprit rank 1 \(pid {tp1}\) -- behind: rank 1 never entered all_reduce #\d+ of pg 0", seen), screen
        assert f"rank 1 pid {tp1} (culprit): _injected_hang_in_forward (agent/demo/model.py:" in seen, screen
        assert re.search(rf"rank 0 pid {tp0}: all_reduce \(torch/distributed/distributed_c10d\.py:\d+\)", seen), screen

        # the report to hand on: the server's story before the evidence, from what the agent saw
        tmux.type(shell, "clear; servewatch report latest -o report.html")
        tmux.wait(shell, r"Wrote report of incident ", 60)
        _check_report(tmp_path / "cwd" / "report.html", tp0, tp1)

        # Ctrl-C: `run` stops and says, on one line, what it opened and where the bundles are
        tmux("send-keys", "-t", watch, "C-c")
        stopped = tmux.wait(watch, r"servewatch: stopped after .*", 60, history=True)
        last = _unboxed(stopped.split("servewatch: stopped after", 1)[1])
        assert "1 incident(s) written (1 stall)" in last and "bundles in servewatch-data/" in last, stopped
        assert "tabulate" not in stopped and "Traceback" not in stopped, stopped  # no library chatter
    manifest = json.loads(next((tmp_path / "cwd" / "servewatch-data").glob("*/*/manifest.json")).read_text())
    assert manifest["verdict"]["culprit_pids"] == [tp1]
    # the history the agent kept: both ranks' last steps, then rank 1's progress stopping, then the watchdog
    kinds = [(h["kind"], h["pid"]) for h in manifest["history"]]
    assert ("step", tp0) in kinds and ("step", tp1) in kinds
    hung = [k for k, pid in kinds if pid == tp1]
    assert "progress_stopped" in hung and "stall" in hung, kinds
    assert hung.index("step") < hung.index("progress_stopped") < hung.index("stall"), kinds
    assert all(h["time_unix_nano"] <= manifest["opened_time_unix_nano"] for h in manifest["history"])


def _check_report(page: Path, tp0: int, tp1: int) -> None:
    """The report of the real incident: verdict, each rank's evidence and the summary come
    first; the timeline tells the server's story (steps, progress stopping, the request in
    flight, the watchdog) before the evidence."""
    from tests.exporters.test_report import parse_dom

    root = parse_dom(page.read_text(encoding="utf-8"))
    order: dict[str, int] = {}
    for i, node in enumerate(root.iter()):
        key = node.attrs.get("id") or ("summary" if node.tag == "dl" else "")
        order.setdefault(key, i)
    assert order["verdict"] < order["rank-table"] < order["summary"] < order["history"] < order["capture"]
    culprit = next(r for r in root.by_id("rank-table").find_all("tr", "rank") if "culprit" in r.classes)
    assert culprit.attrs["data-pid"] == str(tp1) and "_injected_hang_in_forward" in culprit.text
    kinds = [r.attrs["data-kind"] for r in root.by_id("history").find_all("tr")[1:]]
    first = {k: kinds.index(k) for k in ("step", "progress_stopped", "request", "stall", "opened", "evidence")}
    assert first["step"] < first["progress_stopped"] < first["stall"] <= first["opened"] < first["evidence"]
    assert first["request"] < first["opened"]
