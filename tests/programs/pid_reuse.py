"""Pid reuse, for real, inside a pid namespace (run as ``unshare --pid --fork --mount-proc python
pid_reuse.py MODE``): a culprit is identified (its :class:`~agent.host.targets.Target`, as discovery
makes it), then dies and is reaped; an innocent process is started on exactly its pid (the
namespace's ``/proc/sys/kernel/ns_last_pid``); then the agent sends the signal it had decided on.

MODE ``hard``: hard mode's SIGABRT to the verdict's culprit (:class:`agent.incidents.manager.IncidentManager`);
``sigcont``: py-spy's SIGCONT through :func:`agent.host.pidfds.send_signal` to a target identified but
not held. Prints one JSON line: ``{"culprit_pid", "newcomer_pid", "newcomer_alive", "results"}``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def newcomer_on(pid: int) -> subprocess.Popen[bytes]:
    """Start ``sleep`` on exactly ``pid`` (the next pid the namespace hands out is ns_last_pid + 1)."""
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write(str(pid - 1))
    proc = subprocess.Popen(["sleep", "60"])
    if proc.pid != pid:
        raise SystemExit(f"the newcomer got pid {proc.pid}, not {pid}")
    return proc


def hard(culprit: subprocess.Popen[bytes]) -> list[dict]:
    from agent.host import pidfds
    from agent.host.targets import target_of
    from agent.incidents.manager import IncidentConfig, IncidentManager, IncidentRecord
    from agent.model.bus import EventBus
    from agent.model.events import IncidentOpened
    from agent.verdict.rules import Verdict

    target = target_of(culprit.pid)
    assert target is not None
    pidfds.hold(target)  # identified: what the runtime's discovery does for every target
    culprit.kill()
    culprit.wait()
    newcomer = newcomer_on(target.pid)
    manager = IncidentManager(bus=EventBus(), config=IncidentConfig(), data_dir=Path(tempfile.mkdtemp()),
                              host_name="ns", discover=list, hard_signal=int(signal.SIGABRT))
    record = IncidentRecord(opened=IncidentOpened(incident_id="i", trigger="stall"), targets=[target])
    record.verdict = Verdict(kind="behind", hung=True, culprit_ranks=(0,), culprit_pids=(target.pid,),
                             reason="rank 0 behind", confidence="high")
    results = manager._send_hard_signal(record, target.pid)
    time.sleep(0.5)
    alive = newcomer.poll() is None
    newcomer.kill()
    newcomer.wait()
    return [{"pid": r.pid, "outcome": r.outcome.value, "detail": r.detail, "alive": alive} for r in results]


def sigcont(culprit: subprocess.Popen[bytes]) -> list[dict]:
    from agent.host import pidfds
    from agent.host.targets import target_of

    target = target_of(culprit.pid)  # identified (never held: the pidfd is opened and verified at send)
    assert target is not None
    culprit.kill()
    culprit.wait()
    newcomer = newcomer_on(target.pid)
    os.kill(newcomer.pid, signal.SIGSTOP)
    try:
        pidfds.send_signal(target, signal.SIGCONT)
        outcome = "sent"
    except ProcessLookupError as exc:
        outcome = f"refused: {exc}"
    time.sleep(0.3)
    with open(f"/proc/{newcomer.pid}/stat", "rb") as fh:
        state = fh.read().rsplit(b")", 1)[1].split()[0].decode()
    newcomer.kill()
    newcomer.wait()
    return [{"pid": target.pid, "outcome": outcome, "newcomer_state": state}]


def main() -> None:
    mode = sys.argv[1]
    culprit = subprocess.Popen(["sleep", "60"])
    time.sleep(0.1)
    results = (hard if mode == "hard" else sigcont)(culprit)
    print(json.dumps({"culprit_pid": culprit.pid, "results": results}), flush=True)


if __name__ == "__main__":
    main()
