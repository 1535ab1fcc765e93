"""``launch``'s crash-dump folder (issue 23, item 12): the server's CUDA driver writes GPU cores
there, so it gets the data dir's checks. Before, it was made 0755 and never checked: a 0777
folder another user made in advance (to read the cores, or swap a folder for a symlink) was
taken as it was.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.security._attack import AS_NOBODY, NOBODY, needs_root

pytestmark = needs_root


def _launch(cwd: Path, folder: Path, marker: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-m", "agent.cli.app", "launch", "--crash-dump-folder", str(folder), "--data-dir", str(cwd / "data"),
         "--", sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
        capture_output=True, text=True, timeout=90, cwd=cwd, env=env, check=False,
    )


@pytest.mark.parametrize(("case", "why"), [("nobody-0777", "owned by uid 65534"), ("world-writable-parent", "without the sticky bit")])
def test_a_crash_dump_folder_another_user_controls_is_refused(
    tmp_path: Path, nobody_dir: Path, host_files: Path, case: str, why: str
) -> None:
    if case == "nobody-0777":
        folder = nobody_dir / "crash"  # made by the other user, open to all
        subprocess.run([*AS_NOBODY, "mkdir", "-m", "0777", str(folder)], check=True, timeout=30)
        assert folder.stat().st_uid == NOBODY
    else:
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        folder = shared / "crash"
    marker = tmp_path / "server-ran"
    done = _launch(tmp_path, folder, marker)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servewatch: invalid setting coredump.folder: unsafe folder"), lines
    assert why in lines[0]
    assert not marker.exists()  # refused before the server started
    assert not (folder / socket.gethostname()).exists()  # and nothing was made in it


def test_a_new_crash_dump_folder_is_private(tmp_path: Path, host_files: Path) -> None:
    folder = tmp_path / "crash"
    marker = tmp_path / "server-ran"
    done = _launch(tmp_path, folder, marker)
    assert done.returncode == 0, done.stderr
    assert marker.exists()
    for made in (folder, folder / socket.gethostname()):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
