"""CUDA coredump triggering, measured end to end: servewatch at its defaults vs SGLang's own sequence.

For K = 1 and 8 (``--k``) fake-CUDA-driver targets (tests/programs/fake_cuda_driver.py: a real
FIFO held open by a real Python process that writes a core file gradually on a trigger: the
documented driver boundary, faked), each repetition runs both sides, alternating which goes
first, against the same drivers, and times them with the wall clock from "incident open":

* servewatch, for real and at default settings (:class:`CoredumpConfig` defaults: ``settle_s``
  2.0, ``poll_interval_s`` 0.1; only ``folder`` points at the drivers' crash folder): the
  incident's py-spy dumps (:meth:`PySpyActor.dump_all`), then :meth:`CoredumpActor.trigger_all`
  the moment they finish. "triggered" is the last trigger write the results record; "done" is
  when ``trigger_all`` returned with every core file complete.
* SGLang's sequence, run for real (per ``RequestLogManager.dump_requests_before_crash`` in
  python/sglang/srt/managers/tokenizer_manager_components/request_log_manager.py and the helpers
  in python/sglang/srt/utils/cudacore_pyspy_dump_utils.py): sleep 5 s ("to let GPU activity
  settle"); for each scheduler in turn ``py-spy dump --native --pid P``, again without
  ``--native`` if that fails (no timeout); then for each in turn open its
  ``CUDA_COREDUMP_PIPE`` (``%h`` host, ``%p`` pid) ``O_WRONLY | O_NONBLOCK``, write ``b"1"``,
  close; then sleep ``SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS`` (default 60 s). "triggered"
  is after the last pipe write, "done" after the fixed wait. ``--sglang-sleep-s`` and
  ``--sglang-wait-s`` change the two sleeps (default: SGLang's 5 and 60).

Also printed: whether every core file was complete when each side was done (SGLang's wait is
blind: a core that takes longer than it is cut off when the process exits).

Prints medians per K, the paired ratios ours / SGLang's (median and spread over repetitions).
Printed, not asserted. Every process it starts is killed on exit (try/finally), the work
folder removed.

    python bench/bench_coredump.py [--k 1 8] [--repeat 2] [--sglang-wait-s 60]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from _common import emit_result, kill_groups, run_timed

from agent.actors.coredump import CoredumpActor, CoredumpConfig
from agent.actors.pyspy import PySpyActor, default_executable
from agent.host.cudaenv import cuda_coredump_env
from agent.host.targets import Target
from agent.model.events import IncidentOpened, Outcome, now_ns

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "programs" / "fake_cuda_driver.py"
READY_TIMEOUT_S = 60.0
CHUNKS, CHUNK_BYTES = 8, 256 * 1024
#: SGLang's defaults: the sleep before its diagnostics, and SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS.
SGLANG_SLEEP_BEFORE_DUMP_S = 5.0
SGLANG_WAIT_AFTER_TRIGGER_S = 60.0


def start_targets(k: int, workdir: Path, procs: list[subprocess.Popen[bytes]]) -> tuple[list[Target], list[Path], str]:
    """Start k armed fake drivers (appended to ``procs`` at once) and wait until each is armed.

    Returns:
        The targets, their status files and the ``CUDA_COREDUMP_PIPE`` template they use.
    """
    base = {name: value for name, value in os.environ.items() if not name.startswith("CUDA_")}
    pipe_template = str(workdir / "pipes" / "corepipe.cuda.%h.%p")
    base["CUDA_COREDUMP_PIPE"] = pipe_template
    env = dict(cuda_coredump_env(workdir / "crash", base).env)
    statuses = []
    for i in range(k):
        status = workdir / f"fake-{i}.json"
        argv = [sys.executable, str(FAKE), "--status", str(status), "--chunks", str(CHUNKS), "--chunk-bytes", str(CHUNK_BYTES)]
        procs.append(
            subprocess.Popen(argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        )
        statuses.append(status)
    deadline = time.monotonic() + READY_TIMEOUT_S
    for status in statuses:
        while not (status.exists() and _status(status).get("armed")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake driver {status} not armed within {READY_TIMEOUT_S} s")
            time.sleep(0.02)
    return [Target(pid=p.pid, title="fake-cuda") for p in procs[-k:]], statuses, pipe_template


def _status(path: Path) -> dict[str, object]:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):  # being replaced right now: read again
        time.sleep(0.01)
        return json.loads(path.read_text())  # type: ignore[no-any-return]


def _cores(statuses: list[Path]) -> list[int]:
    return [len(_status(s)["cores"]) for s in statuses]  # type: ignore[arg-type]


def _complete_since(statuses: list[Path], before: list[int]) -> bool:
    """Every driver finished a new, whole core file since ``before`` (core counts)."""
    for status, n in zip(statuses, before, strict=True):
        cores = _status(status)["cores"]
        assert isinstance(cores, list)
        if len(cores) <= n or cores[-1]["size_bytes"] != CHUNKS * CHUNK_BYTES:
            return False
    return True


async def ours(pyspy: PySpyActor, actor: CoredumpActor, targets: list[Target], bundle: Path, incident_id: str) -> dict[str, float]:
    """servewatch: dump stacks, trigger coredumps, wait until complete; seconds since open."""
    opened = IncidentOpened(incident_id=incident_id, trigger="manual", pids=tuple(t.pid for t in targets))
    t0 = now_ns()
    await pyspy.dump_all(opened, targets, artifact_dir=bundle)
    t_dumps = now_ns()
    cores = await actor.trigger_all(opened, targets, artifact_dir=bundle)
    t_done = now_ns()
    bad = [r for r in cores if r.outcome is not Outcome.OK]
    if bad:
        raise RuntimeError(f"coredump failed: {bad[0].outcome}: {bad[0].detail}")
    t_triggered = max(int(r.attributes["servewatch.coredump.trigger_time_unix_nano"]) for r in cores)
    return {"dumps_s": (t_dumps - t0) / 1e9, "triggered_s": (t_triggered - t0) / 1e9, "done_s": (t_done - t0) / 1e9}


def sglang(targets: list[Target], pipe_template: str, sleep_s: float, wait_s: float) -> dict[str, float]:
    """SGLang's sequence, for real: sleep, sequential py-spy dumps, sequential FIFO writes, fixed wait."""
    exe = default_executable() or "py-spy"
    t0 = time.perf_counter()
    time.sleep(sleep_s)
    for t in targets:
        for native in (["--native"], []):
            if run_timed([exe, "dump", *native, "--pid", str(t.pid)], timeout_s=600).returncode == 0:
                break
    t_dumps = time.perf_counter()
    host = socket.gethostname()  # platform.node(), as SGLang expands %h
    for t in targets:
        path = pipe_template.replace("%h", host).replace("%p", str(t.pid)).replace("%t", str(int(time.time())))
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"1")
        finally:
            os.close(fd)
    t_triggered = time.perf_counter()
    time.sleep(wait_s)
    t_done = time.perf_counter()
    return {"dumps_s": t_dumps - t0 - sleep_s, "triggered_s": t_triggered - t0, "done_s": t_done - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeat", type=int, default=2, help="repetitions of both sides per K")
    parser.add_argument("--sglang-sleep-s", type=float, default=SGLANG_SLEEP_BEFORE_DUMP_S, help="SGLang's sleep before its dumps, SECONDS")
    parser.add_argument("--sglang-wait-s", type=float, default=SGLANG_WAIT_AFTER_TRIGGER_S,
                        help="SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS, SECONDS (default 60)")
    args = parser.parse_args()

    print(f"host={socket.gethostname()} cpus={os.cpu_count()} python={sys.version.split()[0]}", file=sys.stderr)
    print(f"{'K':>3} {'side':<9} {'dumps':>8} {'triggered':>10} {'done':>9}  cores complete when done")
    for k in args.k:
        procs: list[subprocess.Popen[bytes]] = []
        rows: dict[str, list[dict[str, float]]] = {"ours": [], "sglang": []}
        complete: dict[str, list[bool]] = {"ours": [], "sglang": []}
        with tempfile.TemporaryDirectory(prefix="bench-coredump-") as tmp:
            workdir = Path(tmp)
            try:
                targets, statuses, pipe_template = start_targets(k, workdir, procs)
                actor = CoredumpActor(CoredumpConfig(folder=workdir / "crash"))  # defaults otherwise
                pyspy = PySpyActor()
                for rep in range(args.repeat):
                    for side in (("ours", "sglang") if rep % 2 == 0 else ("sglang", "ours")):
                        before = _cores(statuses)
                        if side == "ours":
                            bundle = workdir / f"inc-{rep}"
                            bundle.mkdir()
                            rows[side].append(anyio.run(ours, pyspy, actor, targets, bundle, f"bench-{k}-{rep}"))
                        else:
                            rows[side].append(sglang(targets, pipe_template, args.sglang_sleep_s, args.sglang_wait_s))
                        complete[side].append(_complete_since(statuses, before))
                        deadline = time.monotonic() + 30  # both sides start from idle drivers
                        while not _complete_since(statuses, before) and time.monotonic() < deadline:
                            time.sleep(0.05)
            finally:
                kill_groups(procs, timeout_s=10)
        for side in ("ours", "sglang"):
            med = {key: statistics.median(r[key] for r in rows[side]) for key in ("dumps_s", "triggered_s", "done_s")}
            print(f"{k:>3} {side:<9} {med['dumps_s']:>7.3f}s {med['triggered_s']:>9.3f}s {med['done_s']:>8.3f}s"
                  f"  {sum(complete[side])}/{len(complete[side])}")
        for key, label in (("triggered_s", "open -> last trigger"), ("done_s", "open -> done")):
            ratios = [o[key] / s[key] for o, s in zip(rows["ours"], rows["sglang"], strict=True)]
            o_med, s_med = statistics.median(r[key] for r in rows["ours"]), statistics.median(r[key] for r in rows["sglang"])
            print(f"    K={k} {label}: ours/SGLang {statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}..{max(ratios):.3f})")
            emit_result(f"coredump K={k}: {label}", ours=o_med, baseline=s_med, unit="s",
                        baseline_name=f"SGLang's crash sequence (sleep {args.sglang_sleep_s:g} s, sequential py-spy, FIFO writes, wait {args.sglang_wait_s:g} s)",
                        ratio=statistics.median(ratios), spread=(min(ratios), max(ratios)), note=f"{args.repeat} rounds, fake CUDA driver")
    print(
        "dumps = the py-spy stack dumps; triggered = open -> last coredump trigger written; done = ours: every core"
        " file complete (settle_s 2.0 default), SGLang: after its fixed wait; medians",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
