"""servewatch's watchdog side by side with SGLang's own soft watchdog, on the same real hang.

A real SGLang 0.5.23 CPU server (``tests/real``'s installer and fixture; TP=2 by default, under the
machine-wide real-server lock) starts with ``--soft-watchdog-timeout T`` (SGLang's own: after T s
of a batch making no progress it logs debug info and runs ``py-spy dump --native`` through the
shell); ``servewatch run --root-pid <launcher> --metrics-url ... --health-url ...
--watchdog-timeout T`` watches the same server. The fault hook hangs one rank's forward (TP1 by
default) and a request is sent: the hang starts with that request's first forward. Per round:

- **SGLang**: seconds from the request to each scheduler's ``Pyspy dump for PID <pid>`` in the
  server's log (the bench reads the log every 0.1 s), whether the dump has native frames and names
  the hung frame (``fault_point``), and what reached a collector (nothing: a log line);
- **servewatch**: seconds from the request to the stall incident's opening
  (``opened_time_unix_nano``) and to its last scheduler ``pyspy.dump`` ending (stacks complete),
  the processes dumped, the verdict's culprit, whether the hung frame is named, and whether any
  dump failed (both tools attach py-spy to the same processes within seconds of each other);
- the agent's CPU (fraction of one core) over ``--idle-s`` of an idle server before the hang.

Target (issue 33): servewatch's stacks complete <= T + 2 s and <= 0.7x SGLang's own at the same
timeout. Nothing is asserted; the figures print as a table (and result rows for
``bench/run_all.py``). Needs ``python -m tests.real.install_sglang`` first (exits 2 otherwise).

Usage: ``python bench/bench_sglang_watchdog.py [--timeout-s 10] [--tp 2] [--rank 1] [--rounds 1] [--idle-s 15]
[--match 'sglang::scheduler*']``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import emit_result

from tests.real import install_sglang
from tests.real.server import server_lock
from tests.real.sglang_server import SglangServer

SERVEWATCH = [sys.executable, "-m", "agent.cli.entry"]
_DUMP = re.compile(r"Pyspy dump for PID (\d+) \(([^)]*)\)")


def _agent(server: SglangServer, data_dir: Path, timeout_s: float, match: str | None) -> tuple[subprocess.Popen[bytes], Path]:
    err = data_dir.parent / f"{data_dir.name}.err"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_")) and k != "VIRTUAL_ENV"}
    env.update(SERVEWATCH_SHM_DIR=str(data_dir.parent / "shm"), SERVEWATCH_COREDUMP__ENABLED="false")
    argv = [*SERVEWATCH, "run", "--root-pid", str(server.pid), "--metrics-url", f"{server.url}/metrics", "--health-url",
            f"{server.url}/health", "--watchdog-timeout", f"{timeout_s:g}", "--data-dir", str(data_dir),
            *(["--match", match] if match else [])]  # fmt: skip
    with err.open("wb") as fh:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=fh, cwd=ROOT, env=env,
                                start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while "health: 200 OK" not in err.read_text(errors="replace") or "metrics: sglang:" not in err.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"servewatch run not watching:\n{err.read_text(errors='replace')[-3000:]}")
        time.sleep(0.25)
    return proc, err


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _sglang_dumps(log: str, since: int, schedulers: dict[int, str]) -> dict[int, str]:
    """The soft watchdog's dump text per scheduler pid, from the log after character ``since``."""
    found: dict[int, str] = {}
    text = log[since:]
    for m in _DUMP.finditer(text):
        pid = int(m.group(1))
        if pid in schedulers and pid not in found:
            end = text.find("\n[20", m.end())
            found[pid] = text[m.end() : end if end > 0 else len(text)]
    return found


def one_round(server: SglangServer, rank: int, timeout_s: float, idle_s: float, work: Path, match: str | None) -> dict[str, Any]:
    schedulers = {p.pid: p.cmdline()[0] for p in server.schedulers()}
    hung_pid = next(pid for pid, title in schedulers.items() if title.endswith(f"_TP{rank}") or (len(schedulers) == 1))
    data = work / "data"
    agent, err = _agent(server, data, timeout_s, match)
    row: dict[str, Any] = {"schedulers": schedulers, "hung_pid": hung_pid}
    try:
        c0, w0 = _cpu_s(agent.pid), time.monotonic()
        time.sleep(idle_s)
        row["agent_idle_core"] = (_cpu_s(agent.pid) - c0) / (time.monotonic() - w0)
        since = len(server.log_text())
        server.hang(ranks=(rank,))
        sent_ns, sent = time.time_ns(), time.monotonic()

        def request() -> None:
            try:
                server.complete("hello", max_tokens=4, timeout_s=300)
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=request, daemon=True)
        t.start()
        seen: dict[int, float] = {}
        deadline = sent + max(90.0, 6 * timeout_s)
        while time.monotonic() < deadline:
            dumps = _sglang_dumps(server.log_text(), since, schedulers)
            for pid in dumps:
                seen.setdefault(pid, time.monotonic() - sent)
            incident_done = "\nIncident " in err.read_text(errors="replace")
            if len(seen) == len(schedulers) and incident_done:
                break
            time.sleep(0.1)
        dumps = _sglang_dumps(server.log_text(), since, schedulers)
        row["sglang_dump_s"] = seen
        row["sglang_native"] = {pid: "--native" in server.log_text()[since:] and (".so" in text or "native" in text.lower())
                                for pid, text in dumps.items()}  # fmt: skip
        row["sglang_hung_frame"] = {pid: "fault_point" in text for pid, text in dumps.items()}
        row["sglang_pyspy_failed"] = server.log_text()[since:].count("Pyspy failed")
        time.sleep(3.0)  # the incident's manifest final
    finally:
        server.clear_fault()
        _stop(agent)
    manifests = [json.loads(p.read_text()) for p in sorted(data.glob("*/*/manifest.json"))]
    row["incidents"] = [m["trigger"] for m in manifests]
    if manifests:
        m = manifests[0]
        row["sw_opened_s"] = (m["opened_time_unix_nano"] - sent_ns) / 1e9
        dumps = [a for a in m["actions"] if a["action"] == "pyspy.dump"]
        sched = [a for a in dumps if a["pid"] in schedulers]
        row["sw_stacks_s"] = (max(a["end_time_unix_nano"] for a in sched) - sent_ns) / 1e9 if sched else None
        row["sw_dumped"] = {a["pid"]: a["outcome"] for a in dumps}
        row["sw_culprit"] = (m.get("verdict") or {}).get("culprit_pids")
        row["sw_hung_frame"] = "fault_point" in json.dumps(m.get("verdict") or {})
        row["sw_failed"] = [a for a in dumps if a["outcome"] != "ok"]
        # servewatch's dumps that met SGLang's own py-spy run on the same process (waited for it)
        row["sw_saw_sglang_watchdog"] = sorted(a["pid"] for a in dumps if "servewatch.pyspy.server_watchdog_pid" in a.get("attributes", {}))
        row["sw_rank_dumps_s"] = {a["pid"]: round((a["end_time_unix_nano"] - m["opened_time_unix_nano"]) / 1e9, 2) for a in sched}
    t.join(timeout=120)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description="servewatch's watchdog vs SGLang's own --soft-watchdog-timeout on the same real hang (SGLang 0.5.23 CPU).")
    ap.add_argument("--timeout-s", type=float, default=10.0, help="SECONDS: SGLang's --soft-watchdog-timeout and servewatch's --watchdog-timeout")
    ap.add_argument("--tp", type=int, default=2, help="tensor parallel size")
    ap.add_argument("--rank", type=int, default=1, help="the rank whose forward hangs")
    ap.add_argument("--rounds", type=int, default=1, help="hangs, one after the other on the same server")
    ap.add_argument("--idle-s", type=float, default=15.0, help="SECONDS the idle agent's CPU is measured before each hang")
    ap.add_argument("--match", default=None, help="servewatch's --match GLOB besides --root-pid, e.g. 'sglang::scheduler*' (README's"
                    " SGLang line: only the schedulers are dumped); default: every process of the tree")
    args = ap.parse_args()
    inst = install_sglang.ready()
    if inst is None:
        print(f"bench_sglang_watchdog: no real SGLang install ({install_sglang.unavailable_reason() or 'run python -m tests.real.install_sglang'})",
              file=sys.stderr)  # fmt: skip
        return 2
    rows = []
    with server_lock():
        install_sglang.refresh_hook(inst)
        t0 = time.monotonic()
        server = SglangServer.start(inst, tp=args.tp, extra_args=("--soft-watchdog-timeout", f"{args.timeout_s:g}"))
        print(f"real SGLang 0.5.23 (CPU) TP={args.tp} serving after {time.monotonic() - t0:.0f} s at {server.url};"
              f" load average {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
        try:
            for i in range(args.rounds):
                with tempfile.TemporaryDirectory(prefix="bench-sglang-wd-") as work:
                    row = one_round(server, args.rank, args.timeout_s, args.idle_s, Path(work), args.match)
                rows.append(row)
                print(json.dumps({"round": i + 1, **{k: v for k, v in row.items() if k != "schedulers"}}, default=str))
                if not server.serves(timeout_s=120):
                    print("server no longer serves after the round; stopping", file=sys.stderr)
                    break
        finally:
            server.discard()
    T = args.timeout_s
    sw = [r["sw_stacks_s"] for r in rows if r.get("sw_stacks_s") is not None]
    sg = [max(r["sglang_dump_s"].values()) for r in rows if len(r["sglang_dump_s"]) == len(r["schedulers"])]
    print(f"\nT = {T:g} s, TP={args.tp}, rank {args.rank} hung, servewatch --match {args.match or '(none: the whole tree)'};"
          f" load average {os.getloadavg()[0]:.1f}")
    print(f"{'':34} {'SGLang soft watchdog':>22} {'servewatch':>12}")
    if sg:
        print(f"{'all scheduler stacks after (s)':34} {statistics.median(sg):>22.1f} {statistics.median(sw) if sw else float('nan'):>12.1f}")
    for r in rows:
        print(f"{'incident opened after (s)':34} {'-':>22} {r.get('sw_opened_s', float('nan')):>12.1f}")
        print(f"{'processes dumped':34} {len(r['sglang_dump_s']):>22} {len(r.get('sw_dumped', {})):>12}")
        print(f"{'hung frame named':34} {any(r['sglang_hung_frame'].values())!s:>22} {r.get('sw_hung_frame')!s:>12}")
        print(f"{'culprit named':34} {'no':>22} {r.get('sw_culprit') == [r['hung_pid']]!s:>12}")
        print(f"{'dump failures':34} {r['sglang_pyspy_failed']:>22} {len(r.get('sw_failed', [])):>12}")
        print(f"{'SGLang watchdog seen by servewatch':34} {'-':>22} {','.join(map(str, r.get('sw_saw_sglang_watchdog', []))) or 'no':>12}")
        print(f"{'reached a collector':34} {'log lines only':>22} {'incident trace':>12}")
        print(f"{'agent CPU idle (% core)':34} {'-':>22} {100 * r['agent_idle_core']:>12.2f}")
        print(f"{'incidents':34} {'-':>22} {','.join(r['incidents']):>12}")
    if sw:
        emit_result(f"SGLang TP={args.tp} hang -> all scheduler stacks, servewatch", ours=statistics.median(sw), baseline=statistics.median(sg) if sg else None,
                    baseline_name=f"SGLang --soft-watchdog-timeout {T:g}", unit="s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
