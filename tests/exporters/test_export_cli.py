"""`servewatch export` as a real subprocess: idempotent re-runs (ledger), OTEL_* defaults, an
endpoint without scheme refused, and every send failure explained (refused, protocol mismatch,
TLS, auth)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from exporters.otlp.provider import ExportConfig, build_telemetry
from exporters.otlp.spans import build_span, new_trace_id
from tests.otlp_receiver import OtlpReceiver

REPO = Path(__file__).resolve().parents[2]


def _export(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    base.update(env, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "agent.cli.app", "export", "--data-dir", str(tmp_path / "data"), *args],
        capture_output=True, text=True, timeout=90, cwd=tmp_path, env=base, stdin=subprocess.DEVNULL, check=False,
    )


def _write_span_files(tmp_path: Path, n: int) -> None:
    telemetry = build_telemetry(ExportConfig(metrics=False), data_dir=tmp_path / "data", host_name="h", environ={})
    try:
        trace_id = new_trace_id()
        for i in range(n):
            telemetry.sink.emit(build_span("offline", trace_id=trace_id, start_time_unix_nano=1 + i, end_time_unix_nano=2 + i))
        assert telemetry.processor.flush(10.0)
    finally:
        telemetry.shutdown(3.0)


def test_export_twice_sends_each_span_once_to_the_env_endpoint(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    _write_span_files(tmp_path, 25)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint(protocol), "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
    first = _export(tmp_path, **env)
    assert first.returncode == 0, first.stderr
    assert "Sent 25 span(s)" in first.stderr and f"({protocol})" in first.stderr
    second = _export(tmp_path, **env)
    assert second.returncode == 0, second.stderr
    assert "Sent 0 span(s)" in second.stderr and "Already sent earlier: 25" in second.stderr
    assert otlp_receiver.span_count == 25
    third = _export(tmp_path, "--resend", **env)
    assert third.returncode == 0 and "Sent 25 span(s)" in third.stderr


def _export_from(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`servewatch export ARGS` run in ``cwd``, without --data-dir (its default ./servewatch-data)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "agent.cli.app", "export", *args],
        capture_output=True, text=True, timeout=90, cwd=cwd, env=env, stdin=subprocess.DEVNULL, check=False,
    )


def test_export_from_another_folder_keeps_the_ledger_of_the_data_it_sends(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    _write_span_files(tmp_path, 25)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    to = ["--to", otlp_receiver.http_endpoint, "--protocol", "http/protobuf"]
    first = _export_from(elsewhere, *to, str(tmp_path / "data"))
    assert first.returncode == 0, first.stderr
    assert "Sent 25 span(s)" in first.stderr
    assert (tmp_path / "data" / "export-ledger.json").is_file()
    assert not (elsewhere / "servewatch-data").exists() and not (elsewhere / "export-ledger.json").exists()
    # again from another folder, naming the data dir, its spans folder (relative) or one file
    span_file = next((tmp_path / "data" / "h" / "spans").glob("*.jsonl"))
    for cwd, path in [(elsewhere, str(tmp_path / "data")), (tmp_path, "data/h/spans"), (elsewhere, str(span_file))]:
        again = _export_from(cwd, *to, path)
        assert again.returncode == 0, again.stderr
        assert "Sent 0 span(s)" in again.stderr and "Already sent earlier: 25" in again.stderr, (path, again.stderr)
    assert otlp_receiver.span_count == 25
    # a span file copied out of any data dir keeps its ledger beside it
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "copied.jsonl").write_bytes(span_file.read_bytes())
    assert "Sent 25 span(s)" in _export_from(elsewhere, *to, str(loose / "copied.jsonl")).stderr
    again = _export_from(tmp_path, *to, "loose")
    assert "Sent 0 span(s)" in again.stderr and "Already sent earlier: 25" in again.stderr, again.stderr
    assert (loose / "export-ledger.json").is_file()
    assert otlp_receiver.span_count == 50


def test_a_bare_otel_endpoint_variable_is_the_spec_s_grpc_form_as_for_run(tmp_path: Path, otlp_receiver: OtlpReceiver) -> None:
    """``OTEL_EXPORTER_OTLP_ENDPOINT=host:port`` (the OTLP spec allows it for gRPC) is read by
    `export` as by `run`: plaintext gRPC, unless OTEL_EXPORTER_OTLP_INSECURE=false."""
    _write_span_files(tmp_path, 3)
    bare = otlp_receiver.grpc_endpoint.removeprefix("http://")
    r = _export(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=bare)
    assert r.returncode == 0, r.stderr
    assert "Sent 3 span(s) from 1 file(s)" in r.stderr and f"to http://{bare} (grpc)" in r.stderr, r.stderr
    assert otlp_receiver.span_count == 3


def test_export_refuses_an_endpoint_without_scheme_or_any_endpoint(tmp_path: Path) -> None:
    r = _export(tmp_path, "--to", "127.0.0.1:4317")
    assert r.returncode == 2 and "needs a scheme" in r.stderr and "http://127.0.0.1:4317" in r.stderr
    r = _export(tmp_path)
    assert r.returncode == 2 and "no collector endpoint" in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["refused", "grpc-to-http-port", "http-to-grpc-port", "tls-to-plaintext", "auth"])
def test_export_says_why_a_send_failed(otlp_receiver: OtlpReceiver, case: str, tmp_path: Path) -> None:
    _write_span_files(tmp_path, 3)
    args: list[str]
    if case == "refused":
        args, expect = ["--to", f"http://127.0.0.1:{_free_port()}"], "connection refused"
    elif case == "grpc-to-http-port":
        args, expect = ["--to", otlp_receiver.http_endpoint, "--protocol", "grpc"], "protocol mismatch"
    elif case == "http-to-grpc-port":
        args, expect = ["--to", otlp_receiver.grpc_endpoint, "--protocol", "http/protobuf"], "protocol mismatch"
    elif case == "tls-to-plaintext":
        args, expect = ["--to", f"https://127.0.0.1:{otlp_receiver.grpc_port}"], "TLS handshake failed"
    else:
        otlp_receiver.grpc_error = grpc.StatusCode.UNAUTHENTICATED
        args, expect = ["--to", otlp_receiver.grpc_endpoint], "refused our credentials"
    r = _export(tmp_path, *args, "--timeout", "5")
    assert r.returncode == 1, r.stderr
    assert "Failed: 3" in r.stderr
    assert expect in r.stderr, r.stderr


def test_dump_with_the_collector_down_says_spooled_with_the_replay_command_and_no_sdk_lines(
    otlp_receiver: OtlpReceiver, tmp_path: Path, spawn, python: str
) -> None:
    import select
    import shlex

    from tests.conftest import PROGRAMS_DIR

    title = f"wal{os.getpid()}::scheduler_TP0"
    proc = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), title, "--max-lifetime-s", "60"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert select.select([proc.stdout], [], [], 30)[0] and proc.stdout.readline().startswith(b"ready")
    endpoint = otlp_receiver.grpc_endpoint
    otlp_receiver.stop()  # the collector is down for the whole dump
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    base.update(PYTHONPATH=str(REPO), SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                OTEL_EXPORTER_OTLP_TIMEOUT="1000")
    r = subprocess.run([sys.executable, "-m", "agent.cli.app", "dump", "--match", title, "--data-dir", str(tmp_path / "data")],
                       capture_output=True, text=True, timeout=90, cwd=tmp_path, env=base, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr
    assert "span(s) spooled under" in r.stderr and "connection refused" in r.stderr
    assert "opentelemetry" not in r.stderr and "Failed to export" not in r.stderr and "Handshake" not in r.stderr
    command = r.stderr.split("replay them now with: ", 1)[1].split("\n")[0].strip()
    argv = shlex.split(command)
    assert argv[:3] == ["servewatch", "export", "--to"]
    otlp_receiver.start()
    elsewhere = tmp_path / "elsewhere"  # the printed command works as it is, from any folder
    elsewhere.mkdir()
    again = subprocess.run([sys.executable, "-m", "agent.cli.app", *argv[1:]],
                           capture_output=True, text=True, timeout=90, cwd=elsewhere, env=base, stdin=subprocess.DEVNULL, check=False)
    assert again.returncode == 0, again.stderr
    names = {s.name for s in otlp_receiver.spans()}
    assert {"incident", "pyspy.dump"} <= names
    received = otlp_receiver.span_count
    twice = subprocess.run([sys.executable, "-m", "agent.cli.app", *argv[1:]],
                           capture_output=True, text=True, timeout=90, cwd=tmp_path, env=base, stdin=subprocess.DEVNULL, check=False)
    assert twice.returncode == 0, twice.stderr
    assert "Sent 0 span(s)" in twice.stderr and otlp_receiver.span_count == received
    assert not (elsewhere / "servewatch-data").exists()


def test_one_corrupt_line_in_a_span_file_is_skipped_and_counted_the_rest_delivered(
    otlp_receiver: OtlpReceiver, tmp_path: Path
) -> None:
    for _ in range(3):  # three lines (requests) of span files, 4 spans each
        _write_span_files(tmp_path, 4)
    files = sorted((tmp_path / "data" / "h" / "spans").glob("*.jsonl"))
    lines = b"".join(f.read_bytes() for f in files).splitlines(keepends=True)
    assert len(lines) == 3
    for f in files[1:]:
        f.unlink()
    middle = lines[1][:40] + b"\x00garbage" + lines[1][60:]  # damaged in the middle of the file
    files[0].write_bytes(lines[0] + middle + lines[2])
    r = _export(tmp_path, "--to", otlp_receiver.grpc_endpoint)
    assert "Sent 8 span(s) from 1 file(s) in 1 request(s)" in r.stderr, r.stderr
    assert f"Corrupt lines skipped: 1 (first: {files[0]}:2:" in r.stderr, r.stderr
    assert r.returncode == 1  # the spans of that line cannot be sent: said, and the exit status says it
    assert otlp_receiver.span_count == 8
    again = _export(tmp_path, "--to", otlp_receiver.grpc_endpoint)
    assert "Sent 0 span(s)" in again.stderr and "Already sent earlier: 8" in again.stderr, again.stderr
    assert otlp_receiver.span_count == 8


def test_export_batches_one_span_lines_by_size_like_the_live_path(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    """Span files of one span per line (what write-ahead groups and a slow trickle leave) go out
    in batches of ``export.batch_spans`` (512) spans, not one request per line."""
    telemetry = build_telemetry(ExportConfig(metrics=False, batch_spans=1), data_dir=tmp_path / "data", host_name="h", environ={})
    try:
        trace_id = new_trace_id()
        for i in range(1200):
            telemetry.sink.emit(build_span("trickle", trace_id=trace_id, start_time_unix_nano=1 + i, end_time_unix_nano=2 + i))
        assert telemetry.processor.flush(30.0)
    finally:
        telemetry.shutdown(3.0)
    lines = sum(len(f.read_bytes().splitlines()) for f in (tmp_path / "data" / "h" / "spans").glob("*.jsonl"))
    assert lines == 1200
    r = _export(tmp_path, "--to", otlp_receiver.grpc_endpoint)
    assert r.returncode == 0, r.stderr
    assert "Sent 1200 span(s) from 1 file(s) in 3 request(s)" in r.stderr, r.stderr
    assert [sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans) for _, req in otlp_receiver.trace_requests] == [512, 512, 176]
    assert len({s.span_id for s in otlp_receiver.spans()}) == 1200
    again = _export(tmp_path, "--to", otlp_receiver.grpc_endpoint)
    assert "Already sent earlier: 1200" in again.stderr and otlp_receiver.span_count == 1200


def test_export_dry_run_says_what_would_be_sent_and_sends_writes_and_removes_nothing(
    otlp_receiver: OtlpReceiver, tmp_path: Path
) -> None:
    _write_span_files(tmp_path, 25)
    to = ["--to", otlp_receiver.http_endpoint, "--protocol", "http/protobuf"]
    files = sorted((tmp_path / "data").rglob("*.jsonl"))
    dry = _export(tmp_path, *to, "--dry-run", "--remove-sent")
    assert dry.returncode == 0, dry.stderr
    assert dry.stderr.startswith("Dry run: would send 25 span(s) from 1 file(s) in 1 request(s) to "), dry.stderr
    assert "nothing sent." in dry.stderr and "Sent " not in dry.stderr
    assert otlp_receiver.span_count == 0 and otlp_receiver.request_headers == []  # no request came
    assert not (tmp_path / "data" / "export-ledger.json").exists()
    assert sorted((tmp_path / "data").rglob("*.jsonl")) == files  # --remove-sent removed nothing
    sent = _export(tmp_path, *to)
    assert sent.returncode == 0 and "Sent 25 span(s)" in sent.stderr, sent.stderr
    # after a real send, the dry run reads the ledger: nothing left to send
    again = _export(tmp_path, *to, "--dry-run")
    assert again.returncode == 0, again.stderr
    assert again.stderr.startswith("Dry run: would send 0 span(s)") and "Already sent earlier: 25" in again.stderr
    assert otlp_receiver.span_count == 25


def test_export_dry_run_connects_to_nothing(tmp_path: Path) -> None:
    _write_span_files(tmp_path, 3)
    with socket.socket() as s:  # a port nothing listens on: a real send would fail
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dry = _export(tmp_path, "--to", f"http://127.0.0.1:{port}", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stderr.startswith("Dry run: would send 3 span(s)"), dry.stderr
