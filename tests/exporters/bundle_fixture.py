"""Writes a realistic incident bundle into a folder, for the timeline and report tests.

The stacks are real: two scheduler-like targets (``tests/programs/titled_target.py``, titled
``demo::scheduler_TP0/1``, hung in ``hung_in_fake_allreduce``) are started and dumped with the real
py-spy (``dump --json`` and the text form), then killed. The manifest around them follows
:mod:`agent.incidents.manager` (``servewatch.incident/1``) with fixed, known times so tests can assert
offsets; a third target has a hostile title (HTML and rich markup) and a ``permission_denied`` dump.
An OTLP/JSON lines span file with the incident's trace (plus an unrelated trace and a replayed,
duplicate line) is written under ``<data_dir>/spans/``.

Imports the standard library only (and runs py-spy and the test program as subprocesses).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROGRAMS_DIR = Path(__file__).resolve().parent.parent / "programs"
TITLED_TARGET = PROGRAMS_DIR / "titled_target.py"

HOST = "gpu-node-7"
INCIDENT_ID = "20251129T173501Z-stall-a1b2c3"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
ROOT_SPAN_ID = "00f067aa0ba902b7"
OPENED_NS = 1_764_437_701_000_000_000  # 2025-11-29T17:35:01Z
MS = 1_000_000  # ns per ms
EVIL_PID = 4242
EVIL_TITLE = "evil <script>alert(1)</script> <img src=x onerror=alert(2)> [bold]x[/bold]"
COREDUMP_SIZE_BYTES = 12_345_678
PROFILE_STEPS = 5
SECRET_PROMPT = "SECRET-PROMPT-TEXT never shown"
DETAIL = "busy and no forward progress for 31.0s (timeout 30s, forward_ct=1234, pid {pid})"


@dataclass(frozen=True)
class Bundle:
    """What was written, for tests to assert against.

    Attributes:
        data_dir: ``<data_dir>``; the bundle is ``<data_dir>/<HOST>/<INCIDENT_ID>/``.
        bundle_dir: the bundle folder.
        pids: pids of the two real scheduler targets (TP0, TP1); they are dead by now.
        hung_frames: pid -> py-spy label of the ``hung_in_fake_allreduce`` frame in that pid's dump.
        thread_names: pid -> names of the threads py-spy saw.
        span_file: the OTLP/JSON lines file.
    """

    data_dir: Path
    bundle_dir: Path
    pids: tuple[int, int]
    hung_frames: dict[int, str]
    thread_names: dict[int, list[str]]
    span_file: Path


def _py_spy() -> str:
    candidate = Path(sys.executable).with_name("py-spy")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("py-spy")
    if found is None:
        raise RuntimeError("py-spy not found next to the interpreter or on PATH")
    return found


def _dump(pid: int, *flags: str) -> bytes:
    done = subprocess.run([_py_spy(), "dump", *flags, "--pid", str(pid)], capture_output=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"py-spy failed on {pid}: {done.stderr.decode(errors='replace')}")
    return done.stdout


def wait_until_hung(pid: int) -> bytes:
    """Dump ``pid`` until its stacks show ``hung_in_fake_allreduce`` (bounded: 100 dumps).

    ``titled_target.py`` prints "ready" just before its main thread enters that frame, so a dump
    right after "ready" can still see ``main``.

    Returns:
        The ``py-spy dump --json`` output that shows the frame.

    Raises:
        RuntimeError: py-spy failed, or the frame never showed up.
    """
    for _ in range(100):
        json_out = _dump(pid, "--json")
        if b"hung_in_fake_allreduce" in json_out:
            return json_out
        time.sleep(0.05)
    raise RuntimeError(f"pid {pid} never showed hung_in_fake_allreduce in 100 dumps")


def capture_real_stacks(out_dir: Path, titles: list[str]) -> dict[int, tuple[Path, Path]]:
    """Start one titled target per title, dump each with py-spy, kill them.

    Args:
        out_dir: where ``pyspy-<pid>.json`` and ``pyspy-<pid>.txt`` go.
        titles: process titles.

    Returns:
        pid -> (json path, text path), in ``titles`` order.

    Raises:
        RuntimeError: a target did not start or py-spy failed (its stderr is in the message).
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for title in titles:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(TITLED_TARGET), title, "--threads", "2", "--max-lifetime-s", "60"],
                    stdout=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        out: dict[int, tuple[Path, Path]] = {}
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().decode().split()
            if line[:1] != ["ready"]:
                raise RuntimeError(f"target {proc.pid} did not start: {line!r}")
            pid = proc.pid
            json_path = out_dir / f"pyspy-{pid}.json"
            txt_path = out_dir / f"pyspy-{pid}.txt"
            json_path.write_bytes(wait_until_hung(pid))
            txt_path.write_bytes(_dump(pid))
            out[pid] = (json_path, txt_path)
        return out
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def _hung_label(json_path: Path) -> tuple[str, list[str]]:
    threads = json.loads(json_path.read_text())
    names = [t["thread_name"] for t in threads]
    for thread in threads:
        for frame in thread["frames"]:
            if frame["name"] == "hung_in_fake_allreduce":
                return f"{frame['name']} ({frame['short_filename']}:{frame['line']})", names
    raise RuntimeError(f"{json_path}: no hung_in_fake_allreduce frame")


def _action(name: str, pid: int | None, outcome: str, start_ms: float, duration_ms: float, *,
            detail: str = "", retryable: bool = False, artifacts: list[Path] | None = None,
            attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    start = OPENED_NS + int(start_ms * MS)
    end = start + int(duration_ms * MS)
    return {
        "action": name,
        "pid": pid,
        "outcome": outcome,
        "retryable": retryable,
        "detail": detail,
        "start_time_unix_nano": start,
        "end_time_unix_nano": end,
        "duration_s": round((end - start) / 1e9, 6),
        "artifact_paths": [str(p) for p in artifacts or []],
        "attributes": {"process.pid": pid, **(attributes or {})} if pid is not None else dict(attributes or {}),
    }


def _otlp_attr(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    return {"key": key, "value": {"stringValue": str(value)}}


def _otlp_span(name: str, span_id: str, parent: str, start_ms: float, duration_ms: float, *,
               trace_id: str = TRACE_ID, attrs: dict[str, Any] | None = None,
               links: list[dict[str, Any]] | None = None, status_code: int = 0) -> dict[str, Any]:
    start = OPENED_NS + int(start_ms * MS)
    span: dict[str, Any] = {
        "traceId": trace_id,
        "spanId": span_id,
        "name": name,
        "kind": 1,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(start + int(duration_ms * MS)),
        "attributes": [_otlp_attr(k, v) for k, v in (attrs or {}).items()],
        "status": {"code": status_code} if status_code else {},
    }
    if parent:
        span["parentSpanId"] = parent
    if links:
        span["links"] = links
    return span


def _request_line(spans: list[dict[str, Any]]) -> str:
    return json.dumps({
        "resourceSpans": [{
            "resource": {"attributes": [_otlp_attr("service.name", "servewatch"), _otlp_attr("host.name", HOST)]},
            "scopeSpans": [{"scope": {"name": "servewatch", "version": "0.1.0"}, "spans": spans}],
        }]
    })


REQUESTS = [
    {"request_id": "req-0001", "trace_id": "a" * 32, "span_id": "1" * 16, "age_s": 31.25,
     "prompt_tokens": 812, "generated_tokens": 97},
    {"request_id": "req-0002", "trace_id": "b" * 32, "span_id": "2" * 16, "age_s": 12.5,
     "prompt_tokens": 4096, "generated_tokens": 0},
    {"request_id": "req-0003", "trace_id": "c" * 32, "span_id": "3" * 16, "age_s": 0.75,
     "prompt_tokens": 33, "generated_tokens": 1, "prompt": SECRET_PROMPT},
]


def write_bundle(data_dir: Path) -> Bundle:
    """Write the realistic bundle (real stacks) and a span file under ``data_dir``.

    Timeline (ms after open): pyspy TP0 12.5+850 ok, TP1 13+910 ok, evil 13.5+4 permission_denied;
    coredump TP0 925+2500 ok (12,345,678-byte sparse core file), TP1 926+5000 timed_out;
    profile.session TP0 5930+1500 ok, 5 steps, one trace file; closed at 7500.

    Args:
        data_dir: the agent data dir to write into (created).

    Returns:
        What was written.
    """
    bundle_dir = data_dir / HOST / INCIDENT_ID
    bundle_dir.mkdir(parents=True)
    stacks = capture_real_stacks(bundle_dir, ["demo::scheduler_TP0", "demo::scheduler_TP1"])
    (tp0, (json0, txt0)), (tp1, (json1, txt1)) = stacks.items()
    hung0, names0 = _hung_label(json0)
    hung1, names1 = _hung_label(json1)

    core = bundle_dir / f"core.{tp0}.nvcudmp"
    with open(core, "wb") as fh:
        fh.truncate(COREDUMP_SIZE_BYTES)  # sparse: the size of a real GPU core without the disk
    trace = bundle_dir / "profile" / f"trace-{tp0}.pt.trace.json"
    trace.parent.mkdir()
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "ProfilerStep#3", "ts": 0, "dur": 120_000, "pid": tp0, "tid": 1},
        {"ph": "X", "name": "aten::mm", "ts": 1_000, "dur": 40_000, "pid": tp0, "tid": 1},
    ]}))

    actions = [
        _action("pyspy.dump", tp0, "ok", 12.5, 850, detail=f"{len(names0)} threads; main thread in hung_in_fake_allreduce",
                artifacts=[json0, txt0],
                attributes={"servewatch.pyspy.thread_count": len(names0), "servewatch.pyspy.hung_frame": hung0,
                            "servewatch.pyspy.top_frames": [f"MainThread: {hung0}"]}),
        _action("pyspy.dump", tp1, "ok", 13, 910, artifacts=[json1, txt1]),  # no summary: read the JSON
        _action("pyspy.dump", EVIL_PID, "permission_denied", 13.5, 4,
                detail="Permission denied (needs CAP_SYS_PTRACE)", retryable=False),
        _action("cuda.coredump", tp0, "ok", 925, 2500, artifacts=[core],
                attributes={"servewatch.coredump.path": str(core), "servewatch.coredump.size_bytes": COREDUMP_SIZE_BYTES}),
        _action("cuda.coredump", tp1, "timed_out", 926, 5000, detail="no core after 5s", retryable=True),
        _action("profile.session", tp0, "ok", 5930, 1500, artifacts=[trace],
                attributes={"servewatch.profile.steps_captured": PROFILE_STEPS,
                            "servewatch.profile.backend": "torch"}),
    ]
    targets = [
        {"pid": tp0, "title": "demo::scheduler_TP0", "create_time_s": OPENED_NS / 1e9 - 600,
         "cmdline": [sys.executable, str(TITLED_TARGET), "demo::scheduler_TP0"]},
        {"pid": tp1, "title": "demo::scheduler_TP1", "create_time_s": OPENED_NS / 1e9 - 600,
         "cmdline": [sys.executable, str(TITLED_TARGET), "demo::scheduler_TP1"]},
        {"pid": EVIL_PID, "title": EVIL_TITLE, "create_time_s": OPENED_NS / 1e9 - 5, "cmdline": ["evil"]},
    ]
    requests = [{"pid": tp0, **r} for r in REQUESTS]
    manifest = {
        "schema": "servewatch.incident/1",
        "incident_id": INCIDENT_ID,
        "trigger": "stall",
        "detail": DETAIL.format(pid=tp0),
        "host.name": HOST,
        "trace_id": TRACE_ID,
        "span_id": ROOT_SPAN_ID,
        "opened_time_unix_nano": OPENED_NS,
        "closed_time_unix_nano": OPENED_NS + 7500 * MS,
        "duration_s": 7.5,
        "targets": targets,
        "actions": actions,
        "inflight_requests": len(requests),
        "hard_signal_sent": {},
    }
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (bundle_dir / "requests.json").write_text(json.dumps(
        {"incident_id": INCIDENT_ID, "captured_time_unix_nano": OPENED_NS, "requests": requests}, indent=2))

    links = [{"traceId": r["trace_id"], "spanId": r["span_id"]} for r in REQUESTS]
    incident_line = _request_line([
        _otlp_span("incident", ROOT_SPAN_ID, "", 0, 7500, links=links,
                   attrs={"servewatch.incident.id": INCIDENT_ID, "servewatch.incident.trigger": "stall"}),
        _otlp_span("pyspy.dump", "0000000000000001", ROOT_SPAN_ID, 12.5, 850, attrs={"process.pid": tp0}),
        _otlp_span("cuda.coredump", "0000000000000004", ROOT_SPAN_ID, 926, 5000, status_code=2),
        _otlp_span("profile.session", "0000000000000005", ROOT_SPAN_ID, 5930, 1500),
        _otlp_span("ProfilerStep#3", "0000000000000006", "0000000000000005", 6000, 120),
        _otlp_span("aten::mm", "0000000000000007", "0000000000000006", 6001, 40),
    ])
    other_line = _request_line([_otlp_span("incident", "00000000000000ff", "", 0, 10, trace_id="f" * 32)])
    span_file = data_dir / "spans" / "spans-20251129T173400Z-1-000001.jsonl"
    span_file.parent.mkdir()
    span_file.write_text(f"{other_line}\n{incident_line}\n{incident_line}\n")  # the replay repeats a line
    return Bundle(
        data_dir=data_dir,
        bundle_dir=bundle_dir,
        pids=(tp0, tp1),
        hung_frames={tp0: hung0, tp1: hung1},
        thread_names={tp0: names0, tp1: names1},
        span_file=span_file,
    )
