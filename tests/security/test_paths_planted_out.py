"""Issue 34 item 2: a symlink (or folder) another user planted never makes root create folders
anywhere.

The attacker is a real other uid (``nobody``, through ``setpriv``): it plants a symlink in the
sticky ``/tmp`` pointing at root's files (a 0755 tree like ``/etc``), or owns a folder on the way,
and serves a real SDK control socket whose ``profile.start`` writes a "trace" into the folder it
is handed (so a folder made for it stays). The surfaces are the real ones: ``servewatch
profile --out`` run as a subprocess (root), and an incident of a real agent whose configured
``profiler.output_dir`` is the planted path. Before the fix the path was resolved first: root
made ``session-*`` inside the link's target and gave it to uid 65534.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from tests.security._attack import (
    AS_NOBODY,
    NOBODY,
    NOBODY_PYTHON,
    REPO,
    hostile_sdk_source,
    needs_root,
    ready_line,
    run_as_nobody,
    snapshot,
)

pytestmark = needs_root

#: A hostile "SDK" (run as nobody): answers profile.start by writing a trace into the folder it
#: is handed, and reports it.
_HOSTILE_SDK = hostile_sdk_source("""
    try:
        with open(os.path.join(out, "owned.trace.json"), "w") as f:
            f.write('{"traceEvents": []}')
        files = [os.path.join(out, "owned.trace.json")]
    except OSError:
        pass
""")


def _hostile_sdk(spawn: Callable, shm: Path) -> int:
    template = str(shm / f"servewatch-{NOBODY}" / "servewatch-ctl.{pid}.sock")
    proc = run_as_nobody(spawn, [NOBODY_PYTHON, "-c", _HOSTILE_SDK, template])
    return int(ready_line(proc).split()[1])


@pytest.fixture
def root_tree() -> Iterator[Path]:
    """Root's own files like ``/etc``: a 0755 tree in /tmp that anyone may pass through (so a
    folder root gave to 65534 there is one it can use); asserted unchanged afterwards."""
    root = Path(tempfile.mkdtemp(prefix="sw-rootetc-", dir="/tmp"))
    (root / "etc").mkdir()
    (root / "etc" / "config").write_text("keep\n")
    for p, mode in ((root, 0o755), (root / "etc", 0o755), (root / "etc" / "config", 0o644)):
        p.chmod(mode)
    before = snapshot(root)
    try:
        yield root
        assert snapshot(root) == before, "root's tree changed: a folder was made or given away there"
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def planted_link(root_tree: Path) -> Iterator[Path]:
    """``/tmp/sw-planted-<random>``: a symlink nobody made in the sticky /tmp, pointing at
    ``root_tree`` (removed afterwards; root may remove it in a sticky folder)."""
    link = Path(f"/tmp/sw-planted-{secrets.token_hex(6)}")
    subprocess.run([*AS_NOBODY, "ln", "-s", str(root_tree), str(link)], check=True, timeout=30)
    assert link.is_symlink() and link.lstat().st_uid == NOBODY
    try:
        yield link
    finally:
        link.unlink(missing_ok=True)


def _names(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _cli(cwd: Path, shm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_PROFILER__SOCKET_DIR=str(shm), SERVEWATCH_PROFILER__FIND_TIMEOUT_S="2",
               SERVEWATCH_PROFILER__REQUEST_TIMEOUT_S="5", SERVEWATCH_HOST_NAME="node-a", COLUMNS="400",
               PYTHONPATH=str(REPO))  # this checkout's agent, whatever the venv installed
    return subprocess.run([sys.executable, "-m", "agent.cli.app", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env, check=False)


@pytest.mark.parametrize(
    ("shape", "why"),
    [
        ("the planted link", "is a symlink owned by uid 65534, not by root or the agent's uid 0"),
        ("a folder through the planted link", "is a symlink owned by uid 65534, not by root or the agent's uid 0"),
        ("a folder inside nobody's folder", "is owned by uid 65534, not by root or the agent's uid 0"),
    ],
)
def test_profile_out_through_another_users_link_or_folder_is_refused_in_one_line(
    spawn: Callable, tmp_path: Path, shared_tmpfs: Path, root_tree: Path, planted_link: Path, nobody_dir: Path,
    shape: str, why: str,
) -> None:
    pid = _hostile_sdk(spawn, shared_tmpfs)
    out = {"the planted link": planted_link, "a folder through the planted link": planted_link / "etc",
           "a folder inside nobody's folder": nobody_dir / "profiles"}[shape]
    before = _names(root_tree)
    done = _cli(tmp_path, shared_tmpfs, "profile", "--pid", str(pid), "--steps", "1", "--timeout", "5",
                "--out", str(out), "--data-dir", str(tmp_path / "data"))
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"servewatch: --out {str(out)!r} refused: "), done.stderr
    assert why in lines[0] and lines[0].endswith("with every folder above it, belongs to root or uid 0"), lines[0]
    assert _names(root_tree) == before  # no session-* in root's etc, nothing given to 65534
    assert not list(nobody_dir.iterdir())  # nothing made in the attacker's folder either
    assert done.stdout == ""


async def test_an_incident_profile_into_a_planted_output_dir_fails_with_the_reason(
    spawn: Callable, tmp_path: Path, shared_tmpfs: Path, root_tree: Path, planted_link: Path
) -> None:
    from agent.runtime.agent import dump_once
    from agent.runtime.settings import load_settings

    pid = await anyio.to_thread.run_sync(_hostile_sdk, spawn, shared_tmpfs)
    before = _names(root_tree)
    settings = load_settings({
        "data_dir": tmp_path / "data", "host_name": "node-a", "target": {"pids": [pid]},
        "coredump": {"enabled": False}, "export": {"metrics": False},
        "profiler": {"on_incident_steps": 1, "output_dir": str(planted_link / "etc"), "socket_dir": str(shared_tmpfs),
                     "find_timeout_s": 2, "request_timeout_s": 5, "max_duration_s": 5},
    })
    with anyio.fail_after(120):
        record = await dump_once(settings)
    manifest = json.loads(record.manifest_path.read_text())
    [profile] = [a for a in manifest["actions"] if a["action"] == "profile.session"]
    assert profile["outcome"] == "failed", profile
    assert profile["detail"] == (
        f"output folder {str(planted_link / 'etc')!r} refused: {str(planted_link)!r} is a symlink owned by uid 65534,"
        " not by root or the agent's uid 0: not used"
    ), profile
    assert profile["artifact_paths"] == []
    assert _names(root_tree) == before


def test_a_planted_profiler_output_dir_stops_run_and_dump_at_start_in_one_line(
    tmp_path: Path, shared_tmpfs: Path, root_tree: Path, planted_link: Path
) -> None:
    """``profiler.output_dir`` through another user's link is said when the agent starts (exit 2,
    one line), not at the first incident's profile, hours later."""
    before = _names(root_tree)
    for command in (["dump", "--pid", str(os.getpid())], ["run", "--pid", str(os.getpid()), "--duration", "5"]):
        env_args = ("--data-dir", str(tmp_path / "data"))
        done = subprocess.run(
            [sys.executable, "-m", "agent.cli.app", *command, *env_args], capture_output=True, text=True, timeout=120,
            cwd=tmp_path, check=False,
            env={**{k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))},
                 "SERVEWATCH_PROFILER__OUTPUT_DIR": str(planted_link / "etc"), "COLUMNS": "400", "PYTHONPATH": str(REPO)},
        )
        assert done.returncode == 2, (command, done.returncode, done.stderr)
        lines = done.stderr.strip().splitlines()
        want = (f"servewatch: profiler.output_dir {str(planted_link / 'etc')!r} refused: {str(planted_link)!r} is a symlink"
                " owned by uid 65534, not by root or the agent's uid 0: not used")
        assert lines == [want], (command, done.stderr)
    assert _names(root_tree) == before
