"""At 80 and 120 columns, in a real terminal (tmux): `run`'s and `dump`'s incident summaries and
`status` wrap at words with a hanging indent; in a file or pipe their lines stay whole.

Each command runs twice in the same tmux shell: once into a file (the lines as machines read
them) and once on the terminal. Every row on screen fits the width; each of the file's lines
appears on screen as its first row (same indent) plus continuation rows indented
:data:`agent.cli.app.HANG_INDENT` more, whose words, read in order, are the line's words: a word
split across rows, or a row wrapped by the terminal instead of by servewatch, fails. Numbers and
incident ids are compared as shapes (two runs differ in pids, durations, ids).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cli.app import HANG_INDENT
from tests.test_cli import assert_verdict_box_lines_hang, write_verdict_bundle
from tests.test_terminal import Tmux

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROWS = 50

RUN_SH = """python -c 'import time; time.sleep(3); raise SystemExit(3)' & P=$!
servewatch run --root-pid $P --data-dir rd --duration 60 --cooldown 3600
"""
# the target says "up" once started (a dump during its start-up would show another frame)
DUMP_SH = """rm -f up.txt; python -c 'import time; print("up", flush=True); time.sleep(120)' > up.txt & P=$!
for i in $(seq 300); do [ -s up.txt ] && break; sleep 0.1; done
servewatch dump --pid $P --data-dir dd
kill $P
"""
# the target's control socket is a plain file: the dump logs "in-flight requests ... unavailable"
# while its progress line shows (a short shm folder: the path it names fits a row)
DUMP_WARN_SH = """export SERVEWATCH_SHM_DIR=/tmp/sw-$$; rm -f up.txt; python -c '
import time
from agent.sdk.control import control_path
control_path().write_text("")
print("up", flush=True)
time.sleep(120)' > up.txt & P=$!
for i in $(seq 300); do [ -s up.txt ] && break; sleep 0.1; done
servewatch dump --pid $P --data-dir dw
kill $P; rm -rf "$SERVEWATCH_SHM_DIR"
"""
STATUS_SH = "servewatch status --data-dir sd\n"
# at 120 columns a data dir this long makes the "spans: DIR/ (... replay with servewatch export)"
# step line wider than a row, while its bundle's path (one word) still fits a row
DEMO_SH = "SERVEWATCH_HOST_NAME=h servewatch demo --watchdog-timeout 1.5 --data-dir {data_dir}\n"
LONG_DATA_DIR = "demo-data-dir-long-enough-that-the-spans-line-passes-120-cols"


def _shape(token: str) -> str:
    """A token with its run-to-run differences erased: incident ids' random part, numbers."""
    return re.sub(r"\d+", "0", re.sub(r"-[0-9a-f]{6}\b", "-ID", token))


def _words(text: str) -> list[str]:
    return [_shape(w) for w in text.split()]


def _lead(row: str) -> int:
    return len(row) - len(row.lstrip(" "))


def _check_wrapped(rows: list[str], lines: list[str], columns: int) -> int:
    """Assert ``rows`` (the terminal) show ``lines`` (the file), each wrapped at words with a
    hanging indent (see the module docstring); returns how many continuation rows there were.
    Chatter lines whose timing differs between the two runs (``servewatch: ...`` status lines)
    may be on one side only; every other line must be on both."""
    assert rows and all(len(r) <= columns for r in rows), "\n".join(rows)
    left = [(_lead(ln), _words(ln)) for ln in lines if ln.strip()]
    continued = 0
    i = 0
    while i < len(rows):
        row = rows[i]
        lead, words = _lead(row), _words(row)
        match = next((k for k, (lw, ws) in enumerate(left) if lw == lead and ws[: len(words)] == words), None)
        if match is None:
            assert row.startswith("servewatch: "), f"row {i} {row!r} starts no line of the file:\n" + "\n".join(rows)
            want: list[str] | None = None
        else:
            want = left.pop(match)[1]
        got = list(words)
        i += 1
        while i < len(rows) and (want is None or len(got) < len(want)):
            nxt = rows[i]
            if want is None and _lead(nxt) != lead + HANG_INDENT:
                break
            assert _lead(nxt) == lead + HANG_INDENT, (
                f"row {i} {nxt!r} continues a line with indent {lead} but is not indented {lead + HANG_INDENT}:\n"
                + "\n".join(rows))
            got += _words(nxt)
            continued += 1
            i += 1
        if want is not None:
            assert got == want, f"rows up to {i} split a word or a line:\n{got}\n{want}\n" + "\n".join(rows)
    missing = [" ".join(ws) for ws in left if not ws[0].startswith("servewatch:")]
    assert not missing, f"lines of the file not on screen: {missing}\n" + "\n".join(rows)
    return continued


@pytest.fixture
def shell(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Tmux, Path]]:
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux (a real terminal): apt-get install tmux")
    columns = request.param
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_", "TMUX"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", SERVEWATCH_SHM_DIR=str(tmp_path / "shm"),
               PS1="$ ", TERM="xterm-256color", HOME=str(tmp_path), LANG="C.UTF-8", LC_ALL="C.UTF-8",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    t = Tmux(tmp_path / "tmux.sock", env, cwd)
    t("-f", "/dev/null", "new-session", "-d", "-s", "w", "-x", str(columns), "-y", str(ROWS), "-c", str(cwd),
      "bash --norc --noprofile")
    t("set-option", "-g", "history-limit", "20000")
    t.type("w:0", "PS1='$ '; clear")
    try:
        yield t, cwd
    finally:
        subprocess.run([shutil.which("tmux") or "tmux", "-S", t.socket, "kill-server"], capture_output=True, timeout=20,
                       check=False)


def _on_screen(t: Tmux, n: int, command: str) -> list[str]:
    """The rows ``command`` left on the terminal (between two marker lines), trailing spaces cut."""
    t.type("w:0", f"echo BEGIN-{n}; {command}; echo END-{n}")
    text = t.wait("w:0", rf"^END-{n}$", 120, history=True)
    rows = [r.rstrip() for r in text.splitlines()]
    start = max(k for k, r in enumerate(rows) if r == f"BEGIN-{n}")
    end = max(k for k, r in enumerate(rows) if r == f"END-{n}")
    return [r for r in rows[start + 1:end] if r]


def _compare(t: Tmux, cwd: Path, script: str, columns: int) -> int:
    (cwd / "case.sh").write_text(script)
    in_file = _on_screen(t, 1, "bash case.sh > file.txt 2>&1")
    assert in_file == [], in_file
    lines = (cwd / "file.txt").read_text().splitlines()
    assert "Traceback" not in "\n".join(lines)
    rows = _on_screen(t, 2, "bash case.sh")
    return _check_wrapped(rows, lines, columns)


def _long(lines: list[str], columns: int) -> bool:
    return any(len(ln) > columns for ln in lines)


@pytest.mark.parametrize("shell", [80, 120], indirect=True, ids=["80cols", "120cols"])
def test_run_incident_summary_wraps_at_words_with_a_hanging_indent(shell: tuple[Tmux, Path]) -> None:
    t, cwd = shell
    columns = int(t("display-message", "-p", "#{window_width}"))
    continued = _compare(t, cwd, RUN_SH, columns)
    file_lines = (cwd / "file.txt").read_text().splitlines()
    assert any(ln.startswith("Verdict: ") for ln in file_lines) and any(ln.startswith("View: ") for ln in file_lines)
    assert _long(file_lines, columns) and continued > 0  # the file keeps whole lines the terminal wraps


@pytest.mark.parametrize("shell", [80, 120], indirect=True, ids=["80cols", "120cols"])
def test_dump_summary_wraps_at_words_with_a_hanging_indent(shell: tuple[Tmux, Path]) -> None:
    t, cwd = shell
    columns = int(t("display-message", "-p", "#{window_width}"))
    continued = _compare(t, cwd, DUMP_SH, columns)
    file_lines = (cwd / "file.txt").read_text().splitlines()
    assert any(ln.startswith("Verdict: ") for ln in file_lines) and any(ln.startswith("View: ") for ln in file_lines)
    assert _long(file_lines, columns) and continued > 0


@pytest.mark.parametrize("shell", [80, 120], indirect=True, ids=["80cols", "120cols"])
def test_status_wraps_at_words_with_a_hanging_indent(shell: tuple[Tmux, Path]) -> None:
    t, cwd = shell
    columns = int(t("display-message", "-p", "#{window_width}"))
    (cwd / "status.sh").write_text(RUN_SH.replace("rd", "sd"))  # an agent's last word in sd/
    t.type("w:0", "bash status.sh > /dev/null 2>&1; echo DONE-0")
    t.wait("w:0", r"^DONE-0$", 120, history=True)
    continued = _compare(t, cwd, STATUS_SH, columns)
    file_lines = (cwd / "file.txt").read_text().splitlines()
    assert any("is NOT running" in ln for ln in file_lines), file_lines
    assert _long(file_lines, columns) and continued > 0


@pytest.mark.parametrize("shell", [80, 120], indirect=True, ids=["80cols", "120cols"])
def test_a_warning_during_dump_is_its_own_wrapped_line_not_glued_to_the_progress_line(shell: tuple[Tmux, Path]) -> None:
    """Before: ``servewatch: dump: finding the processes, opening the incident…servewatch: warnin``
    / ``g: in-flight requests ...``: the warning was written on the progress line's row."""
    t, cwd = shell
    columns = int(t("display-message", "-p", "#{window_width}"))
    _compare(t, cwd, DUMP_WARN_SH, columns)
    file_lines = (cwd / "file.txt").read_text().splitlines()
    warning = next(ln for ln in file_lines if ln.startswith("servewatch: warning: in-flight requests of pid "))
    rows = _on_screen(t, 3, "bash case.sh")
    assert not any("servewatch: dump" in r for r in rows), "\n".join(rows)  # the progress line: erased, never kept
    at = next((i for i, r in enumerate(rows) if r.startswith("servewatch: warning: in-flight")), None)
    assert at is not None, "\n".join(rows)
    got = _words(rows[at])
    for row in rows[at + 1:]:
        if _lead(row) != HANG_INDENT:
            break
        got += _words(row)
    assert got == _words(warning), "\n".join(rows)


@pytest.mark.parametrize("shell", [80, 120], indirect=True, ids=["80cols", "120cols"])
def test_demo_step_lines_wrap_at_words_with_a_hanging_indent(shell: tuple[Tmux, Path]) -> None:
    """Before: the demo's step lines were written whole (rich, soft wrap) and the terminal broke
    them mid-word: ``(TP=2, a small torch model per sched`` / ``uler)``, ``replay with servewat`` /
    ``ch export)``."""
    pytest.importorskip("torch")
    t, cwd = shell
    columns = int(t("display-message", "-p", "#{window_width}"))
    continued = _compare(t, cwd, DEMO_SH.format(data_dir="dm" if columns < 120 else LONG_DATA_DIR), columns)
    file_lines = (cwd / "file.txt").read_text().splitlines()
    steps = [ln for ln in file_lines if re.match(r"\[ *\d+\.\ds\] ", ln)]
    assert any("starting the demo inference server" in ln for ln in steps), file_lines
    assert any("replay with servewatch export" in ln for ln in steps), file_lines
    assert _long(steps, columns) and continued > 0  # a step line the terminal shows wrapped by servewatch


@pytest.mark.parametrize("shell", [80, 120], indirect=True, ids=["80cols", "120cols"])
def test_timeline_verdict_box_lines_hang_under_their_own_text(shell: tuple[Tmux, Path]) -> None:
    """Before: in `timeline`'s top verdict box a rank line's continuation row started at the box's
    left edge, left of ``  rank 0 pid ...`` itself."""
    t, cwd = shell
    columns = int(t("display-message", "-p", "#{window_width}"))
    incident_id = write_verdict_bundle(cwd / "tl")
    rows = _on_screen(t, 1, f"servewatch timeline {incident_id} --data-dir tl")  # on the terminal: its width
    assert rows and all(len(r) <= columns for r in rows), "\n".join(rows)
    assert assert_verdict_box_lines_hang("\n".join(rows)) > 0, "\n".join(rows)
