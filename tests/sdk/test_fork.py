"""A forked server process (pre-fork workers, ``multiprocessing`` "fork") makes its own span
ids: the SDK's id generators are reseeded in the child, or every span of the child would carry
the parent's trace and span ids and a backend would merge or drop them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_forked_child_records_spans_with_ids_of_its_own(tmp_path: Path) -> None:
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.programs.forked_spans", "50"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    by_pid: dict[int, list[tuple[str, str]]] = {}
    for line in lines:
        by_pid.setdefault(line["pid"], []).extend(tuple(i) for i in line["ids"])
    assert len(by_pid) == 2, lines  # the parent (2 lines: before and after the fork) and the child
    parent_pid = lines[0]["pid"]
    parent = by_pid.pop(parent_pid)
    (child,) = by_pid.values()
    assert len(parent) == 51 and len(child) == 50
    assert not {t for t, _ in parent} & {t for t, _ in child}, "the child repeated the parent's trace ids"
    assert not {s for _, s in parent} & {s for _, s in child}, "the child repeated the parent's span ids"
