"""Issue 34 item 7: a secret flag and its value passed as ONE argv element (``"--api-key sk-…"``,
``"--private-key-pem=-----BEGIN…"`` over several lines), or a PEM block after
``--private-key-pem`` (it starts with dashes, like a flag), never reach ``manifest.json``.

The target is a real process of another uid (``nobody``, through ``setpriv``) whose
``/proc/PID/cmdline`` holds those elements; the agent (root) watches it by pid and writes a real
bundle (``dump``: the path that writes ``manifest.json``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path

import anyio

from tests.security._attack import NOBODY, NOBODY_PYTHON, needs_root, ready_line, run_as_nobody

pytestmark = needs_root

_SLEEPER = "import os, time; print('ready', os.getpid(), flush=True); time.sleep(120)"


def _pem(body: str) -> str:
    return f"-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC{body}\n{body}AgEAAoIBAQC7\n-----END PRIVATE KEY-----\n"


async def test_a_secret_flag_and_its_value_in_one_element_never_reach_the_manifest(
    spawn: Callable, tmp_path: Path, host_files: Path
) -> None:
    from agent.config import load_settings
    from agent.runtime import dump_once

    key = "sk-" + secrets.token_hex(6)  # too short for the sk- token shape: only the flag says it is secret
    bodies = [secrets.token_hex(12) for _ in range(3)]
    argv = [
        f"--api-key {key}",                     # a launcher passed "flag value" as one string
        f"--private-key-pem={_pem(bodies[0])}",  # flag=value over several lines
        "--private-key-pem", _pem(bodies[1]),   # a value that starts with dashes is still the value
        f"--private-key-pem {_pem(bodies[2])}",
        "--port", "8000", "--tokenizer /models/t",
    ]
    proc = await anyio.to_thread.run_sync(lambda: run_as_nobody(spawn, [NOBODY_PYTHON, "-c", _SLEEPER, *argv]))
    pid = int((await anyio.to_thread.run_sync(ready_line, proc)).split()[1])
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert key.encode() in cmdline and all(b.encode() in cmdline for b in bodies)  # the secrets are really there

    settings = load_settings({"data_dir": tmp_path / "data", "target": {"pids": [pid]}, "coredump": {"enabled": False},
                              "host_name": "node-a", "export": {"metrics": False}})
    with anyio.fail_after(120):
        record = await dump_once(settings)
    manifest = json.loads(record.manifest_path.read_text())
    [target] = manifest["targets"]
    assert target["pid"] == pid
    assert target["cmdline"][3:] == [
        "--api-key <redacted>",
        "--private-key-pem=<redacted>",
        "--private-key-pem", "<redacted>",
        "--private-key-pem <redacted>",
        "--port", "8000", "--tokenizer /models/t",
    ], target["cmdline"]
    files = [f for f in record.bundle_dir.rglob("*") if f.is_file()]
    assert record.manifest_path in files
    for f in files:
        text = f.read_text(errors="replace")
        for secret in (key, *bodies):
            assert secret not in text, (f, secret)
    assert Path(f"/proc/{pid}").stat().st_uid == NOBODY  # the target was the other uid's all along
