"""Run every bench in bench/ in one go and print one table: metric, baseline, ours, ratio, spread,
load during the run.

Each bench runs in its own process, one after the other, with ``SERVEWATCH_BENCH_RESULTS=1``:
it then prints one ``BENCH-RESULT {json}`` line per figure (:func:`_common.emit_result`) beside
its own report. While a bench runs, the 1-minute load average and the runnable tasks
(``/proc/loadavg``) are sampled every second; every row of the table carries the mean and max
load of its bench's run, so a figure taken on a busy machine says so. The benches' own output
goes to ``--log DIR`` (``DIR/<bench>.log``; by default a temporary folder, removed at the end, and a
failing bench's last lines are printed).

    python bench/run_all.py                       # every bench, the sizes below (~50 min)
    python bench/run_all.py --write-into docs/performance.md
    python bench/run_all.py --quick               # every bench at a tiny size (a smoke run, minutes)
    python bench/run_all.py --list

The sizes (:data:`BENCHES`) are each bench's defaults unless noted; the soak runs 10 minutes
(``--soak-s 3600`` for the 1-hour one). Nothing is asserted: a bench that fails is a row saying
so, and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import selectors
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import RESULT_PREFIX, RESULTS_ENV


@dataclass(frozen=True)
class Bench:
    """One bench: its script and its arguments for the full table and for ``--quick``."""

    name: str
    args: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    #: seconds the full run may take before it is stopped
    timeout_s: float = 1800.0


#: Every bench, in the order the table shows them (the CLI and stack capture first).
BENCHES: tuple[Bench, ...] = (
    Bench("cli_start", ("--repeat", "7", "--ks", "1,4,8"), ("--repeat", "1", "--ks", "1")),
    Bench("stacks", ("--k", "1", "4", "8", "--repeat", "9"), ("--k", "1", "--repeat", "1")),
    Bench("stall_latency", ("--runs", "20", "--timeout-s", "2.0"), ("--runs", "1", "--timeout-s", "0.5")),
    Bench("coredump", ("--k", "1", "8", "--repeat", "2"), ("--k", "1", "--repeat", "1", "--sglang-sleep-s", "0.2", "--sglang-wait-s", "0.5")),
    Bench("coredump_bounds", ("--k", "1", "4", "--repeat", "3"), ("--k", "1", "--repeat", "1")),
    Bench("fanout", ("--hosts", "8,64,256,1000", "--runs", "2"),
          ("--hosts", "8", "--runs", "1", "--modes", "race", "--tls", "plain", "--sample-ranks", "0"), timeout_s=5400.0),
    Bench("fleet_capture", ("--runs", "3"), ("--runs", "1", "--loads", "quiet"), timeout_s=1800.0),
    Bench("peer_client", ("--peers", "8", "64", "256", "--rounds", "7"), ("--peers", "8", "--rounds", "1")),
    Bench("verdict", ("--tp", "2", "4"), ("--tp", "2"), timeout_s=2400.0),
    Bench("export", ("--spans", "10000", "--repeat", "3"), ("--spans", "500", "--repeat", "1", "--skip-default-outage")),
    Bench("kill_loop", ("--kills", "30", "--outage-rounds", "3"), ("--kills", "2", "--outage-rounds", "1", "--outage-incidents", "1")),
    Bench("ship", ("--grpc", "--rounds", "3", "--window-s", "20"), ("--rounds", "1", "--window-s", "2", "--warmup-s", "1")),
    Bench("step", (), ("--calls", "10000", "--repeat", "1")),
    Bench("record_function", (), ("--calls", "2000", "--repeat", "1")),
    Bench("trace_import", ("--repeat", "3"), ("--layouts", "torch-cpu,synthetic", "--steps", "5", "--size-mb", "1", "--repeat", "1")),
    Bench("serving_overhead", ("--rounds", "4", "--window-s", "20"), ("--rounds", "1", "--window-s", "2", "--settle-s", "1")),
    Bench("real_vllm", ("--rounds", "3", "--window-s", "20"), ("--rounds", "1", "--window-s", "3", "--watch-s", "5"), timeout_s=2400.0),
    Bench("sglang_watchdog", ("--rounds", "2", "--timeout-s", "10"), ("--rounds", "1", "--timeout-s", "10", "--idle-s", "5"), timeout_s=1200.0),
    Bench("agent_cpu", ("--rates", "0,5", "--rounds", "2", "--window-s", "60"),
          ("--rates", "0", "--rounds", "2", "--window-s", "5", "--warmup-s", "3"), timeout_s=1800.0),
    Bench("soak", ("--duration", "600", "--warmup-s", "120"), ("--duration", "20", "--warmup-s", "5", "--sample-s", "5"), timeout_s=5400.0),
    # the day is the size: --quick plays the same day (~6 min)
    Bench("pagerday", (), (), timeout_s=900.0),
)


@dataclass
class LoadSampler:
    """Samples ``/proc/loadavg`` every ``interval_s`` in a thread while a bench runs."""

    interval_s: float = 1.0
    load1: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _sample(self) -> None:
        try:
            with open("/proc/loadavg", encoding="ascii") as fh:
                parts = fh.read().split()
            self.load1.append(float(parts[0]))
            self.running.append(int(parts[3].split("/")[0]) - 1)  # runnable tasks, this sampler's own excluded
        except (OSError, ValueError, IndexError):
            self.load1.append(os.getloadavg()[0])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> LoadSampler:  # noqa: PYI034 - not subclassed
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="load-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._sample()

    def summary(self) -> dict[str, float]:
        return {
            "load1_mean": statistics.fmean(self.load1) if self.load1 else float("nan"),
            "load1_max": max(self.load1, default=float("nan")),
            "runnable_mean": statistics.fmean(self.running) if self.running else float("nan"),
        }


def run_bench(bench: Bench, args: tuple[str, ...], log_path: Path, timeout_s: float, echo: bool) -> tuple[int | None, float, list[dict[str, Any]], dict[str, float]]:
    """Run one bench; returns (exit code or None if stopped at its timeout, seconds, result rows, load)."""
    argv = [sys.executable, str(HERE / f"bench_{bench.name}.py"), *args]
    env = {**os.environ, RESULTS_ENV: "1", "PYTHONUNBUFFERED": "1"}
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with LoadSampler() as load, log_path.open("w", encoding="utf-8") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True, text=True, bufsize=1)  # fmt: skip
        assert proc.stdout is not None
        code: int | None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            deadline = t0 + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if not sel.select(min(left, 5.0)):
                    continue
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith(RESULT_PREFIX):
                    rows.append(json.loads(line[len(RESULT_PREFIX):]))
                else:
                    log.write(line)
                    log.flush()
                    if echo:
                        print(f"  [{bench.name}] {line}", end="", flush=True)
        if proc.poll() is None and time.monotonic() >= t0 + timeout_s:
            os.killpg(proc.pid, 9)
            proc.wait(30)
            code = None
        else:
            code = proc.wait(60)
        proc.stdout.close()
    return code, time.monotonic() - t0, rows, load.summary()


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None or math.isnan(value):
        return ""
    a = abs(value)
    if a == 0:
        return f"0 {unit}".strip()
    text = f"{value:,.0f}" if a >= 1000 else f"{value:.1f}" if a >= 100 else f"{value:.3g}" if a >= 0.001 else f"{value:.2e}"
    return f"{text} {unit}".strip()


def metric_key(bench: str, metric: str) -> str:
    """A row's identity across runs: its bench and metric, durations left out (``soak 240 s, ...``
    and ``soak 600 s, ...`` are the same figure)."""
    return f"{bench}: " + re.sub(r"\b\d+(\.\d+)? s\b", "N s", metric)


def _number(cell: str) -> float | None:
    m = re.match(r"\s*(-?[\d,]*\.?\d+(?:e[-+]?\d+)?)", cell)
    try:
        return float(m.group(1).replace(",", "")) if m else None
    except ValueError:
        return None


def recorded_figures(path: Path) -> dict[str, tuple[float, str]]:
    """The figures of the table last written into ``path`` (between :data:`TABLE_START` and
    :data:`TABLE_END`): :func:`metric_key` -> (``ours``, load cell)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        return {}
    out: dict[str, tuple[float, str]] = {}
    header: list[str] | None = None
    for line in text[start:end].splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if header is None:
            header = cells
            continue
        row = dict(zip(header, cells, strict=False))
        value = _number(row.get("ours", ""))
        if value is not None and row.get("bench") and row.get("metric"):
            out[metric_key(row["bench"], row["metric"].strip("`"))] = (value, row.get("load 1-min mean (max)", ""))
    return out


#: A gated figure must also exceed the recorded one by this fraction to be a regression (a run
#: whose windows happened to agree measures no noise).
REGRESSION_MIN_FRACTION = 0.10


def gate(rows: list[dict[str, Any]], recorded: dict[str, tuple[float, str]]) -> list[str]:
    """Mark each gated row (one with a ``noise``: a cost, lower is better) against the figure
    recorded for it: ``r["vs_recorded"]`` says the recorded figure and the verdict. Returns one
    line per regression: above the recorded figure by more than this run's noise and by more
    than :data:`REGRESSION_MIN_FRACTION`."""
    regressions = []
    for r in rows:
        if r.get("noise") is None or r.get("ours") is None:
            continue
        key = metric_key(r["bench"], r["metric"])
        if key not in recorded:
            r["vs_recorded"] = "(none recorded)"
            continue
        before, load = recorded[key]
        ours, noise = float(r["ours"]), float(r["noise"])
        worse = ours - before > noise and ours > before * (1 + REGRESSION_MIN_FRACTION)
        better = before - ours > noise and ours < before * (1 - REGRESSION_MIN_FRACTION)
        verdict = "REGRESSION" if worse else "better" if better else "same within noise"
        r["vs_recorded"] = f"{_fmt(before)} recorded; noise ±{_fmt(noise)}: {verdict}"
        if worse:
            regressions.append(f"REGRESSION {key}: {_fmt(ours, r.get('unit', ''))} against {_fmt(before, r.get('unit', ''))}"
                               f" recorded (load then {load}); this run's noise ±{_fmt(noise)}")
    return regressions


def table(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Rows of the table: bench, metric, baseline (named), ours, baseline, ratio, spread, load,
    and the gate's verdict against the recorded figure (:func:`gate`)."""
    out = []
    for r in rows:
        spread = r.get("spread")
        ratio = r.get("ratio")
        spread_text = f"{spread[0]:.3g}..{spread[1]:.3g}" if spread else ""
        out.append([
            r["bench"], r["metric"], r.get("baseline_name", ""), _fmt(r["ours"], r.get("unit", "")),
            _fmt(r.get("baseline"), r.get("unit", "")), f"{ratio:.3g}x" if ratio is not None else "", spread_text,
            f"{r['load']['load1_mean']:.1f} (max {r['load']['load1_max']:.1f})", r.get("vs_recorded", ""),
        ])  # fmt: skip
    return out


HEADER = ["bench", "metric", "baseline", "ours", "baseline value", "ratio", "spread", "load 1-min mean (max)", "vs recorded"]


def markdown(rows: list[list[str]]) -> str:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plain(rows: list[list[str]]) -> str:
    widths = [min(60, max(len(h), *(len(r[i]) for r in rows))) if rows else len(h) for i, h in enumerate(HEADER)]

    def fit(cell: str, w: int) -> str:
        return cell if len(cell) <= w else cell[: w - 1] + "~"

    lines = ["  ".join(fit(h, w).ljust(w) for h, w in zip(HEADER, widths, strict=True))]
    lines += ["  ".join(fit(c, w).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


TABLE_START = "<!-- run_all table -->"
TABLE_END = "<!-- /run_all table -->"


def write_into(path: Path, block: str) -> None:
    """Replace what lies between the :data:`TABLE_START` and :data:`TABLE_END` lines of ``path``.

    Raises:
        SystemExit: ``path`` has no such pair of lines.
    """
    text = path.read_text(encoding="utf-8")
    start, end = text.find(TABLE_START + "\n"), text.find(TABLE_END)
    if start < 0 or end < start:
        raise SystemExit(f"--write-into {path}: no {TABLE_START} ... {TABLE_END} lines")
    head = text[: start + len(TABLE_START) + 1]
    path.write_text(head + block + text[end:], encoding="utf-8")


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=False)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10, check=False).stdout.strip()  # fmt: skip
        return out.stdout.strip() + ("+changes" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def _from_json(args: argparse.Namespace) -> int:
    """The table from earlier runs' ``--json`` files: a later file's rows replace an earlier
    file's rows of the same bench."""
    rows: list[dict[str, Any]] = []
    whens = []
    for path in args.from_json:
        doc = json.loads(path.read_text(encoding="utf-8"))
        benches = {r["bench"] for r in doc["rows"]}
        rows = [r for r in rows if r["bench"] not in benches] + doc["rows"]
        whens.append(f"{doc['when']} ({', '.join(sorted(benches)) if len(args.from_json) > 1 else 'every bench'})")
    order = {b.name: i for i, b in enumerate(BENCHES)}
    rows.sort(key=lambda r: order.get(r["bench"], len(order)))
    cells = table(rows)
    print(plain(cells))
    block = "Measured " + "; ".join(whens) + ", by `python bench/run_all.py`.\n\n" + markdown(cells)
    if args.markdown is not None:
        args.markdown.write_text(block, encoding="utf-8")
    for path in args.write_into:
        write_into(path, block)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="every bench at a tiny size (a smoke run)")
    ap.add_argument("--only", default="", help="comma-separated bench names (see --list)")
    ap.add_argument("--skip", default="", help="comma-separated bench names to leave out")
    ap.add_argument("--soak-s", type=float, default=None, help="the soak's duration, SECONDS (default 600)")
    ap.add_argument("--log", type=Path, default=None,
                    help="keep the benches' own output in this folder (default: a temporary one, removed; a failing bench's tail is printed)")
    ap.add_argument("--json", type=Path, default=None, help="also write every result row, with its load, to this JSON file")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown to this file")
    ap.add_argument("--write-into", type=Path, action="append", default=[],
                    help=f"replace the table between the {TABLE_START} and {TABLE_END} lines of this file"
                         " (docs/performance.md); repeatable")
    ap.add_argument("--echo", action="store_true", help="echo the benches' own output while they run")
    ap.add_argument("--from-json", type=Path, action="append", default=[],
                    help="run nothing: make the table from the rows of earlier runs' --json files, in order (a bench"
                         " rerun alone later replaces its rows of an earlier file); repeatable")
    ap.add_argument("--recorded", type=Path, default=ROOT / "docs" / "performance.md",
                    help="the figures a cost (agent CPU) is gated against: the table last written into this file")
    ap.add_argument("--list", action="store_true", help="list the benches and their arguments, then exit")
    args = ap.parse_args()
    known = {b.name: b for b in BENCHES}
    missing = sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py") if p.stem[len("bench_"):] not in known)
    if missing:
        ap.error(f"bench(es) not in run_all's list: {', '.join(missing)}")
    chosen = [b for b in BENCHES if not args.only or b.name in args.only.split(",")]
    chosen = [b for b in chosen if b.name not in args.skip.split(",")]
    bad = [n for n in (args.only + "," + args.skip).split(",") if n and n not in known]
    if bad:
        ap.error(f"--only/--skip: unknown bench(es) {', '.join(bad)} (see --list)")
    if args.from_json:
        return _from_json(args)
    if args.list:
        for b in chosen:
            print(f"{b.name:<18} full: {' '.join(b.args) or '(defaults)'}   quick: {' '.join(b.quick) or '(defaults)'}")
        return 0
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    with tempfile.TemporaryDirectory(prefix="servewatch-run-all-") as tmp:
        log_dir = args.log or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        return _run_all(args, chosen, stamp, log_dir)


def _run_all(args: argparse.Namespace, chosen: list[Bench], stamp: str, log_dir: Path) -> int:
    started = datetime.datetime.now().astimezone()
    print(f"run_all {stamp}: {len(chosen)} bench(es), {'quick' if args.quick else 'full'} sizes; commit {_commit()};"
          f" {platform.node()} {os.cpu_count()} CPUs, python {platform.python_version()}; logs in {log_dir}", flush=True)
    all_rows: list[dict[str, Any]] = []
    for b in chosen:
        bench_args = b.quick if args.quick else b.args
        if b.name == "soak" and args.soak_s is not None and not args.quick:
            bench_args = ("--duration", f"{args.soak_s:g}", "--warmup-s", f"{min(300.0, args.soak_s / 5):g}")
        timeout_s = 600.0 if args.quick else b.timeout_s + (args.soak_s or 0.0 if b.name == "soak" else 0.0)
        print(f"- {b.name} {' '.join(bench_args)} ...", end="", flush=True)
        code, took_s, rows, load = run_bench(b, tuple(bench_args), log_dir / f"{b.name}.log", timeout_s, args.echo)
        status = "ok" if code == 0 else f"stopped at {timeout_s:.0f} s" if code is None else f"FAILED (exit {code})"
        print(f" {status}, {took_s:.0f} s, {len(rows)} figure(s), load {load['load1_mean']:.1f} (max {load['load1_max']:.1f})", flush=True)
        if code != 0:
            tail = (log_dir / f"{b.name}.log").read_text(encoding="utf-8", errors="replace").splitlines()[-40:]
            print("\n".join(f"    | {line}" for line in tail), flush=True)
            rows.append({"metric": f"(bench {status})", "ours": None, "unit": ""})
        for r in rows:
            r["bench"] = b.name
            r["load"] = load
        all_rows.extend(rows)
    regressions = gate(all_rows, recorded_figures(args.recorded))
    cells = table(all_rows)
    print()
    print(plain(cells))
    for line in regressions:
        print(line, flush=True)
    when = f"{started:%Y-%m-%d %H:%M %Z}, commit {_commit()}, {platform.node()} ({os.cpu_count()} CPUs)"
    if args.json is not None:
        args.json.write_text(json.dumps({"when": when, "rows": all_rows}, indent=1) + "\n", encoding="utf-8")
    block = f"Measured {when}, by `python bench/run_all.py{' --quick' if args.quick else ''}`.\n\n" + markdown(cells)
    if args.markdown is not None:
        args.markdown.write_text(block, encoding="utf-8")
    for path in args.write_into:
        write_into(path, block)
    return 0 if all(r.get("ours") is not None for r in all_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
