"""No refusal is silent: a real ``servewatch dump`` / ``run`` against a real OTLP receiver that
refuses (401, 404 of a doubled path, 400) or rejects every span (OTLP partial success) says so at
once, once, with the status, the URL, the collector's words and the fix; keeps the spans under
``spool/rejected/`` (replayable); ``dump`` exits 1; ``servewatch status`` shows the ``export``
row blind."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.watchers.status import read_status_file, status_path
from exporters.otlp.otlp_json import iter_span_files, read_span_file
from tests.conftest import PROGRAMS_DIR
from tests.otlp_receiver import OtlpReceiver

REPO = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(PYTHONPATH=str(REPO), SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), OTEL_EXPORTER_OTLP_TIMEOUT="2000", **extra)
    return env


def _target(spawn, python: str, title: str, *args: str) -> subprocess.Popen[bytes]:
    proc = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), title, "--max-lifetime-s", "60", *args], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert select.select([proc.stdout], [], [], 30)[0] and proc.stdout.readline().startswith(b"ready")
    return proc


def _rejected_spans(data_dir: Path) -> list[str]:
    names = []
    for path in iter_span_files([data_dir]):
        if "rejected" in path.parts:
            names += [s.name for r in read_span_file(path) for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    return names


CASES = {
    # case: (protocol, receiver setup, endpoint suffix, words the line must hold)
    "401": ("http/protobuf", {"http_status": 401, "error_message": "missing bearer token"}, "",
            ["401 Unauthorized", "missing bearer token", "no authorization header is sent",
             "OTEL_EXPORTER_OTLP_HEADERS='authorization=Bearer"]),
    "404-doubled-path": ("http/protobuf", {}, "/v1/traces",
                         ["404 Not Found", "/v1/traces is doubled", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]),
    "400": ("http/protobuf", {"http_status": 400, "error_message": "unknown field 'resourceSpanz'"}, "",
            ["400 Bad Request", "unknown field 'resourceSpanz'"]),
    "all-rejected": ("grpc", {"reject_all": "dropped by the filter processor"}, "",
                     ["rejected all", "OTLP partial success: dropped by the filter processor"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dump_against_a_refusing_collector_says_it_once_keeps_the_spans_and_exits_1(
    otlp_receiver: OtlpReceiver, case: str, tmp_path: Path, spawn, python: str
) -> None:
    protocol, setup, suffix, words = CASES[case]
    for key, value in setup.items():
        setattr(otlp_receiver, key, value)
    title = f"ref{os.getpid()}::scheduler_TP0"
    _target(spawn, python, title)
    endpoint = otlp_receiver.endpoint(protocol) + suffix
    url = endpoint + "/v1/traces" if protocol != "grpc" else f"127.0.0.1:{otlp_receiver.grpc_port}"
    r = subprocess.run(
        [sys.executable, "-m", "agent.cli.app", "dump", "--match", title, "--data-dir", str(tmp_path / "data"),
         "--otlp-endpoint", endpoint, "--otlp-protocol", protocol],
        capture_output=True, text=True, timeout=90, cwd=tmp_path, env=_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 1, r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("servewatch: error: collector") and "span(s)" in line]
    assert len(said) == 1, r.stderr  # at once, once (servewatch's own metrics are said apart)
    assert f"collector {url} " in said[0]
    for word in words:
        assert word in said[0], said[0]
    rejected = tmp_path / "data" / os.uname().nodename / "spool" / "rejected"
    fixed = endpoint.removesuffix(suffix) if suffix == "/v1/traces" else endpoint  # the replay goes to the base endpoint
    assert f"kept under {rejected}; send them once fixed with: servewatch export --to {fixed} --protocol {protocol} {rejected}" in said[0]
    names = _rejected_spans(tmp_path / "data")
    assert "incident" in names and "pyspy.dump" in names
    assert f"servewatch: {len(names)} span(s) not delivered to OTLP {protocol} {endpoint}: {len(names)} refused or rejected" in r.stderr
    assert otlp_receiver.span_count == 0
    if case == "404-doubled-path":  # the command said, run as said, delivers them (nothing else was wrong)
        replay = said[0].split("send them once fixed with: ", 1)[1].split()
        assert replay[:2] == ["servewatch", "export"], replay
        sent = subprocess.run([sys.executable, "-m", "agent.cli.app", *replay[1:]], capture_output=True, text=True, timeout=90,
                              cwd=tmp_path, env=_env(tmp_path), stdin=subprocess.DEVNULL, check=False)  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        assert otlp_receiver.span_count == len(names), (sent.stdout, sent.stderr)


def test_run_against_a_refusing_collector_shows_the_export_row_blind_in_status(
    otlp_receiver: OtlpReceiver, tmp_path: Path, spawn, python: str
) -> None:
    otlp_receiver.http_status = 401
    title = f"rrun{os.getpid()}::scheduler_TP0"
    target = _target(spawn, python, title, "--exit-after-s", "6", "--exit-code", "3")  # a rank that dies: an incident
    data_dir = tmp_path / "data"
    agent = spawn(
        [python, "-m", "agent.cli.app", "run", "--pid", str(target.pid), "--data-dir", str(data_dir),
         "--otlp-endpoint", otlp_receiver.http_endpoint, "--otlp-protocol", "http/protobuf"],
        env=_env(tmp_path), stderr=subprocess.PIPE, cwd=tmp_path,
    )
    path = status_path(data_dir, os.uname().nodename)
    deadline = time.monotonic() + 60
    row = None
    while time.monotonic() < deadline:
        if path.exists():
            row = read_status_file(path).get("export")
            if row is not None and row.state.value == "blind":
                break
        time.sleep(0.2)
    assert row is not None and row.state.value == "blind", row
    assert "refused" in row.reason and "401 Unauthorized" in row.reason and "no authorization header is sent" in row.reason
    status = subprocess.run(
        [python, "-m", "agent.cli.app", "status", "--data-dir", str(data_dir), "--json"],
        capture_output=True, text=True, timeout=60, env=_env(tmp_path), check=False,
    )
    assert status.returncode == 1  # a blind row
    rows = {w["name"]: w for w in json.loads(status.stdout)["watchers"]}
    assert rows["export"]["state"] == "blind"
    agent.terminate()
    _, err = agent.communicate(timeout=60)
    lines = [line for line in err.decode().splitlines() if "refused" in line and "/v1/traces" in line]
    assert len(lines) == 1, err.decode()  # said once, not by the status board again
