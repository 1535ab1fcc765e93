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
    from agent.runtime.agent import dump_once
    from agent.runtime.settings import load_settings

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


async def test_plural_flags_values_inside_values_and_whole_commands_never_reach_the_manifest(
    spawn: Callable, tmp_path: Path, host_files: Path
) -> None:
    """The red-team shapes of family 1 (plurals, passphrases), family 2 inside a value (a DSN),
    family 4 inside a ``--flag=value``, a flag after leading whitespace and a whole command in one
    argument (``sh -c "..."``): the same real process of nobody, the same real ``dump``."""
    from agent.runtime.agent import dump_once
    from agent.runtime.settings import load_settings

    s = [secrets.token_hex(8) for _ in range(11)]  # plain hex: no token shape, only the pattern family says it
    argv = [
        "--api-keys", s[0], "--secrets", s[1], "--tokens", s[2], "--passwords", s[3], "--keys", s[4],
        "--passphrase", s[5],
        "--dsn", f"host=db password={s[6]} user=u",
        f"--header=Authorization:Bearer {s[7]}",
        f" --api-key {s[8]}",
        "-c", f"vllm serve --api-key {s[9]} --port 8000 --max-tokens 64 --header 'Cookie: {s[10]}'",
        "--max-tokens", "64", "--num-tokens", "8", "--num-keys", "4", "--key-file", "/etc/k.pem", "--tokenizer", "/m/t",
    ]
    proc = await anyio.to_thread.run_sync(lambda: run_as_nobody(spawn, [NOBODY_PYTHON, "-c", _SLEEPER, *argv]))
    pid = int((await anyio.to_thread.run_sync(ready_line, proc)).split()[1])
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert all(x.encode() in cmdline for x in s)  # the secrets are really there

    settings = load_settings({"data_dir": tmp_path / "data", "target": {"pids": [pid]}, "coredump": {"enabled": False},
                              "host_name": "node-a", "export": {"metrics": False}})
    with anyio.fail_after(120):
        record = await dump_once(settings)
    manifest = json.loads(record.manifest_path.read_text())
    [target] = manifest["targets"]
    assert target["pid"] == pid
    assert target["cmdline"][3:] == [
        "--api-keys", "<redacted>", "--secrets", "<redacted>", "--tokens", "<redacted>", "--passwords", "<redacted>",
        "--keys", "<redacted>", "--passphrase", "<redacted>",
        "--dsn", "host=db password=<redacted> user=u",
        "--header=Authorization: <redacted>",
        " --api-key <redacted>",
        "-c", "vllm serve --api-key <redacted> --port 8000 --max-tokens 64 --header 'Cookie: <redacted>'",
        "--max-tokens", "64", "--num-tokens", "8", "--num-keys", "4", "--key-file", "/etc/k.pem", "--tokenizer", "/m/t",
    ], target["cmdline"]
    files = [f for f in record.bundle_dir.rglob("*") if f.is_file()]
    assert record.manifest_path in files
    for f in files:
        text = f.read_text(errors="replace")
        for secret in s:
            assert secret not in text, (f, secret)
    assert Path(f"/proc/{pid}").stat().st_uid == NOBODY  # the target was the other uid's all along
