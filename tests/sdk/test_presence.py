"""agent.sdk.presence: a server trusts an agent's declaration that it watches it only when the file
is root's or the server's own, fresh, and its agent alive; another user's planted file never
makes a server hold its spans."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agent.sdk import presence

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]


def test_a_fresh_declaration_of_a_live_agent_names_its_targets(tmp_path: Path) -> None:
    path = presence.write_declaration([os.getpid(), 4242], tmp_path)
    assert path.name == f"servewatch-agent.{os.getpid()}" and oct(path.stat().st_mode & 0o777) == "0o644"
    assert presence.watched(os.getpid(), tmp_path) and presence.watched(4242, tmp_path)
    assert not presence.watched(4343, tmp_path)
    # stale: its agent stopped touching it
    assert not presence.watched(os.getpid(), tmp_path, now_s=time.time() + presence.STALE_S + 1)
    presence.remove_declaration(tmp_path)
    assert not presence.watched(os.getpid(), tmp_path)


def test_the_declaration_of_a_dead_agent_does_not_count(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    (tmp_path / f"servewatch-agent.{pid}").write_text(json.dumps({"pid": pid, "targets": [os.getpid()]}))
    assert not presence.watched(os.getpid(), tmp_path)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to act as another uid")
def test_a_declaration_planted_by_another_user_is_ignored() -> None:
    shared = Path(tempfile.mkdtemp(prefix="sw-shm-", dir="/tmp"))
    shared.chmod(0o1777)  # like /dev/shm: everyone may create files
    try:
        _planted(shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _planted(shared: Path) -> None:
    planted = shared / f"servewatch-agent.{os.getpid()}"  # names a live process (this one) as its agent
    body = json.dumps({"pid": os.getpid(), "targets": [os.getpid()]})
    subprocess.run([*AS_NOBODY, sys.executable, "-c", f"open({str(planted)!r}, 'w').write({body!r})"], check=True, timeout=30)
    assert planted.stat().st_uid == NOBODY
    assert not presence.watched(os.getpid(), shared)
