"""The benches in bench/ start: each one's ``--help`` runs (its imports and argument parser), and
``bench/run_all.py`` lists every ``bench_*.py`` (it refuses to run when one is missing from its
table). The benches themselves are not run here: figures come from ``bench/run_all.py``."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def test_run_all_lists_every_bench() -> None:
    done = _run([str(BENCH / "run_all.py"), "--list"])
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert listed == {p.stem.removeprefix("bench_") for p in BENCH.glob("bench_*.py")}


def test_every_bench_answers_help() -> None:
    scripts = sorted(BENCH.glob("bench_*.py"))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda p: (p.name, _run([str(p), "--help"])), scripts))
    failed = {name: r.stderr[-500:] for name, r in results if r.returncode != 0 or "usage:" not in r.stdout}
    assert failed == {}
