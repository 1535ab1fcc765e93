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


def test_the_cost_gate_marks_a_figure_above_the_recorded_one_by_more_than_its_noise(tmp_path: Path) -> None:
    """run_all's gate: a row with a noise is compared with the same row (durations left out) in
    the table last written into the performance doc."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_run_all", BENCH / "run_all.py")
    assert spec is not None and spec.loader is not None
    run_all = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = run_all  # its dataclasses look their module up
    spec.loader.exec_module(run_all)  # it puts bench/ on sys.path for its own _common
    doc = tmp_path / "performance.md"
    doc.write_text(
        f"{run_all.TABLE_START}\n| " + " | ".join(run_all.HEADER[:-1]) + " |\n|" + "---|" * 8 + "\n"
        "| soak | soak 240 s, 5 req/s: agent CPU | (target) | 1.00 % of a core |  |  |  | 2.0 (max 3.0) |\n"
        f"{run_all.TABLE_END}\n",
        encoding="utf-8",
    )
    recorded = run_all.recorded_figures(doc)
    assert recorded == {"soak: soak N s, 5 req/s: agent CPU": (1.0, "2.0 (max 3.0)")}
    load = {"load1_mean": 1.0, "load1_max": 1.0}
    rows = [
        {"bench": "soak", "metric": "soak 600 s, 5 req/s: agent CPU", "ours": ours, "noise": noise, "unit": "%", "load": load}
        for ours, noise in ((1.5, 0.1), (1.05, 0.1), (1.5, 0.6), (0.5, 0.1))
    ] + [{"bench": "soak", "metric": "soak 600 s, 5 req/s: agent RSS slope", "ours": 9.0, "noise": None, "load": load}]
    regressions = run_all.gate(rows, recorded)
    assert len(regressions) == 1 and "REGRESSION soak: soak N s, 5 req/s: agent CPU" in regressions[0]
    assert [r.get("vs_recorded", "").rsplit(": ", 1)[-1] for r in rows] == [
        "REGRESSION", "same within noise", "same within noise", "better", ""]
    assert run_all.table(rows)[0][-1].endswith("REGRESSION")
