"""Run README command lines as a person would, inside fresh namespaces (``tests/test_readme.py``).

Usage::

    unshare --net --pid --fork --mount-proc --mount --propagation private \\
        python readme_scenario.py PLAN.json RESULTS.json

Run as the first process of new network, pid and mount namespaces: loopback is brought up (a
new network namespace has it down), so the README's fixed ports (30000, 4317) are free, and a
host-wide ``--match`` sees only the processes started here. Every process started here dies with
this one (the kernel kills a pid namespace with its first process).

PLAN is JSON::

    {"cwd": DIR, "tmpfs": [PATH, ...], "mkdir": [PATH, ...], "otlp_receiver_port": 4317 | null,
     "steps": [STEP, ...], "stop": [STEP_ID, ...], "copy_out": {PATH: DIR}}

and each STEP is ``{"id", "cmd", "bg": false, "ready": REGEX | null, "timeout_s": 60,
"wait": {"id", "pattern", "timeout_s"} | null, "env": {}}``: ``cmd`` is run by ``bash -c``
(a README line is shell), in the foreground (its exit code and output recorded) or in the
background (``bg``; ``ready``, when given, must appear in its stdout or stderr before the next
step starts). ``wait`` holds the step until an earlier background step printed ``pattern``;
with ``"wait_replaces_sleep": true`` a leading ``sleep N;`` of ``cmd`` (the README's pause for what
``wait`` saw) is then dropped, unless the pattern never came.
Two README placeholders are filled in: ``<scheduler pid>`` (the first of ``scheduler_pids`` a
demo server printed) and ``<incident-id>`` (the newest bundle under ``./servewatch-data``).
``stop`` lists background steps to end with SIGINT (as Ctrl-C would) at the end, in order.

RESULTS is JSON: one record per step with ``rc``, ``stdout``, ``stderr``, ``duration_s``,
``ready_s`` / ``waited_s`` (``null`` when the pattern never came), plus ``otlp_spans`` (spans the
receiver got).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """``ip link set lo up``, by ioctl (no iproute2 needed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


def mount_tmpfs(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, b"mode=0755") != 0:
        raise OSError(ctypes.get_errno(), f"mount tmpfs on {path}")


class Background:
    """A background step: its output goes to files, read back while waiting for a pattern."""

    def __init__(self, step: dict[str, Any], proc: subprocess.Popen[bytes], out: Path, err: Path) -> None:
        self.step, self.proc, self.out, self.err = step, proc, out, err
        self.started = time.monotonic()

    def text(self) -> str:
        return self.out.read_text(errors="replace") + "\n" + self.err.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        start = time.monotonic()
        while time.monotonic() < deadline:
            if re.search(pattern, self.text(), re.MULTILINE):
                return time.monotonic() - start
            if self.proc.poll() is not None:
                return time.monotonic() - start if re.search(pattern, self.text(), re.MULTILINE) else None
            time.sleep(0.2)
        return None


def newest_incident(cwd: Path) -> str:
    bundles = [p for p in (cwd / "servewatch-data").glob("*/*") if (p / "manifest.json").is_file()]
    return max(bundles, key=lambda p: p.name).name if bundles else "<no incident>"


def fill(cmd: str, cwd: Path, started: list[Background]) -> str:
    if "<scheduler pid>" in cmd:
        for bg in started:
            for line in bg.out.read_text(errors="replace").splitlines():
                if '"scheduler_pids"' in line:
                    cmd = cmd.replace("<scheduler pid>", str(json.loads(line)["scheduler_pids"][0]))
                    break
    if "<incident-id>" in cmd:
        cmd = cmd.replace("<incident-id>", newest_incident(cwd))
    return cmd


def main() -> int:
    plan = json.loads(Path(sys.argv[1]).read_text())
    results_path = Path(sys.argv[2])
    loopback_up()
    for path in plan.get("tmpfs", []):
        mount_tmpfs(path)
    for path in plan.get("mkdir", []):
        os.makedirs(path, mode=0o700, exist_ok=True)
    cwd = Path(plan["cwd"])
    logs = cwd.parent / "logs"
    logs.mkdir(exist_ok=True)
    receiver = None
    if plan.get("otlp_receiver_port"):
        from tests.otlp_receiver import OtlpReceiver

        receiver = OtlpReceiver()
        receiver.grpc_port = int(plan["otlp_receiver_port"])
        receiver.start()
    results: list[dict[str, Any]] = []
    started: dict[str, Background] = {}
    env_base = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    try:
        for step in plan["steps"]:
            record: dict[str, Any] = {"id": step["id"], "cmd": step["cmd"]}
            results.append(record)
            if step.get("wait"):
                w = step["wait"]
                record["waited_s"] = started[w["id"]].wait_for(w["pattern"], w.get("timeout_s", 60))
            cmd = fill(step["cmd"], cwd, list(started.values()))
            if step.get("wait_replaces_sleep") and record.get("waited_s") is not None:
                cmd = re.sub(r"^\s*sleep [0-9.]+\s*;\s*", "", cmd)
            record["ran"] = cmd
            env = {**env_base, **step.get("env", {})}
            t0 = time.monotonic()
            if step.get("bg"):
                out, err = logs / f"{step['id']}.out", logs / f"{step['id']}.err"
                with out.open("wb") as o, err.open("wb") as e:
                    proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdout=o, stderr=e,
                                            stdin=subprocess.DEVNULL)
                bg = started[step["id"]] = Background(step, proc, out, err)
                if step.get("ready"):
                    record["ready_s"] = bg.wait_for(step["ready"], step.get("timeout_s", 60))
                continue
            # output to files, and wait for bash itself (not for EOF on a pipe): a line ending in
            # `&` leaves its job running, holding its output open, as in a terminal
            out, err = logs / f"{step['id']}.out", logs / f"{step['id']}.err"
            with out.open("wb") as o, err.open("wb") as e:
                proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdout=o, stderr=e,
                                        stdin=subprocess.DEVNULL)
            try:
                rc: int | None = proc.wait(timeout=step.get("timeout_s", 60))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = None
            record.update(rc=rc, stdout=out.read_text(errors="replace"),
                          stderr=err.read_text(errors="replace") + ("" if rc is not None else "\n[timed out]"))
            record["duration_s"] = time.monotonic() - t0
        for step_id in plan.get("stop", []):
            bg = started[step_id]
            if bg.proc.poll() is None:
                # bash -c runs a single command by exec, so the signal reaches servewatch itself
                bg.proc.send_signal(signal.SIGINT)
            try:
                bg.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                bg.proc.kill()
                bg.proc.wait()
    finally:
        by_id = {r["id"]: r for r in results}
        for step_id, bg in started.items():
            by_id[step_id].update(rc=bg.proc.poll(), stdout=bg.out.read_text(errors="replace"),
                                  stderr=bg.err.read_text(errors="replace"))
        for src, dst in plan.get("copy_out", {}).items():
            if Path(src).exists():
                shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=True)
        payload = {"steps": results, "otlp_spans": 0}
        if receiver is not None:
            payload["otlp_spans"] = receiver.span_count
            receiver.stop()
        results_path.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
