"""`servewatch --help`, `cuda-env` and the read-only commands import only what they need: never
grpc, torch, protobuf, httpx or the OpenTelemetry SDK's trace/metrics pipeline (checked on
sys.modules of a real subprocess; speed itself is measured in bench/bench_cli_start.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = (
    "grpc",
    "torch",
    "google.protobuf",
    "httpx",
    "opentelemetry.sdk.trace",
    "opentelemetry.sdk.metrics",
    "opentelemetry.sdk.resources",
    "opentelemetry.exporter",
    "opentelemetry.proto",
)

_PROBE = """
import json, sys
args, heavy_prefixes = json.loads(sys.argv[1]), tuple(json.loads(sys.argv[2]))
sys.argv = ["servewatch", *args]
from agent.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = sorted(m for m in sys.modules if m.startswith(heavy_prefixes))
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _modules_after(args: list[str], cwd: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args), json.dumps(list(HEAVY))],
        capture_output=True, text=True, timeout=120, cwd=cwd, check=False,
    )
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["dump", "--help"],
        ["run", "--help"],
        ["timeline", "--help"],
        ["status", "--help"],
        ["cuda-env", "--help"],
    ],
)
def test_help_imports_no_heavy_module(args: list[str], tmp_path: Path) -> None:
    got = _modules_after(args, tmp_path)
    assert got["code"] in (0, None)
    assert got["heavy"] == []


def test_cuda_env_imports_no_heavy_module(tmp_path: Path) -> None:
    got = _modules_after(["cuda-env", "--folder", str(tmp_path / "cores")], tmp_path)
    assert got["code"] in (0, None)
    assert got["heavy"] == []


def test_timeline_of_an_empty_data_dir_imports_no_export_pipeline(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    got = _modules_after(["timeline", "--data-dir", str(data)], tmp_path)
    assert got["code"] == 1  # no incident there
    assert not [m for m in got["heavy"] if m.startswith(("grpc", "torch", "httpx", "opentelemetry.sdk.metrics"))]
