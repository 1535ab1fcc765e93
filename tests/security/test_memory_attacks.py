"""A server's /metrics whose labels change at every scrape (issue 23, item 8).

Before, each new label set became a tracked series (kept for 60 scrapes, in the source and in
the watchdog): the agent's memory grew with every scrape (1.27 GB after 300 s, and rising). Now
a scrape with more than ``MAX_SERIES`` label sets makes the source blind with "too many series"
on the status board, and no per-series history is held beyond a fixed bound. (The ring half of
item 8 is in ``test_ring_attacks.py``.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from agent.watchers.status import read_status_file, status_path
from tests.security._attack import NOBODY_PYTHON, needs_root, ready_line, run_as_nobody

pytestmark = needs_root


@pytest.mark.slow
def test_metrics_whose_labels_change_every_scrape_cost_the_agent_no_memory(
    spawn: Callable, tmp_path: Path, attack_programs: Path, host_files: Path
) -> None:
    server = run_as_nobody(spawn, [NOBODY_PYTHON, str(attack_programs / "attack_metrics_churn.py"), "--series", "4000"])
    port = int(ready_line(server).split()[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_HOST_NAME="node-a", SERVEWATCH_WATCHDOG__POLL_INTERVAL_S="0.1", SERVEWATCH_COREDUMP__ENABLED="false")
    data = tmp_path / "data"
    agent = spawn([sys.executable, "-m", "agent.cli.app", "run", "--metrics-url", f"http://127.0.0.1:{port}/metrics",
                   "--duration", "20", "--data-dir", str(data)], env=env, cwd=tmp_path,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = psutil.Process(agent.pid)
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    while agent.poll() is None:
        try:
            samples.append((time.monotonic() - start, proc.memory_info().rss))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.25)
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err
    early = max(rss for t, rss in samples if 4 <= t <= 6)
    peak = max(rss for _, rss in samples)
    print(f"agent RSS at 5 s {early / 2**20:.0f} MiB, peak over 20 s {peak / 2**20:.0f} MiB")
    assert peak < 200 * 2**20 and peak - early < 30 * 2**20, (early, peak)
    metrics = read_status_file(status_path(data, "node-a")).get("metrics")
    assert metrics is not None and metrics.state.value == "blind" and "too many series: 4000 label sets" in metrics.reason, metrics
