"""agent.host.agentfiles: which agents run on one data dir (presence files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from agent.host.agentfiles import agents_dir, live_agents, register, unregister


def test_register_names_the_live_agents_and_removes_what_killed_ones_left(tmp_path: Path, spawn) -> None:
    folder = agents_dir(tmp_path, "h1")
    folder.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.DEVNULL)
    gone.wait(timeout=30)
    (folder / f"{gone.pid}.json").write_text(json.dumps({"pid": gone.pid, "create_time_s": 1.0}))
    (folder / "1.json").write_text(json.dumps({"pid": 1, "create_time_s": 1.0}))  # pid 1 is no agent started then
    other = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    import psutil

    (folder / f"{other.pid}.json").write_text(json.dumps({"pid": other.pid,
                                                         "create_time_s": psutil.Process(other.pid).create_time()}))
    path, others = register(tmp_path, "h1")
    assert others == [other.pid]
    assert path == folder / f"{os.getpid()}.json" and oct(path.stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{other.pid}.json", f"{os.getpid()}.json"])
    assert set(live_agents(tmp_path, "h1")) == {other.pid, os.getpid()}
    unregister(path)
    unregister(path)  # twice: fine
    assert live_agents(tmp_path, "h1") == [other.pid]
    assert live_agents(tmp_path / "none", "h1") == []
