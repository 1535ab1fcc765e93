"""What a target chooses must not act on the operator's terminal nor leak secrets (issue 23,
items 10 and 11), tried with a real process of another uid.

Its title carries ``ESC]0;...BEL`` (set the window title), ``ESC[2J`` (clear the screen), an
8-bit CSI (U+009B) and a bidi override (U+202E); its command line carries one secret in every
form the redactor must know. The operator watches it on purpose (``--uid 65534``).
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from tests.fleet._fleet import TOKEN, free_ports, running_agent, settings_for
from tests.security._attack import NOBODY, NOBODY_PYTHON, needs_root, ready_line, run_as_nobody

pytestmark = needs_root

RAW = ("\x1b", "\x07", "\x9b", "\u202e")


def _hostile(spawn: Callable, attack_programs: Path) -> tuple[str, str, int]:
    tag = uuid.uuid4().hex[:8]
    title = f"sglang::scheduler_TP0_{tag}\x1b]0;pwned\x07\x1b[2J\u009b31m\u202eevil"
    secret = "S3cr3t" + uuid.uuid4().hex
    proc = run_as_nobody(spawn, [NOBODY_PYTHON, str(attack_programs / "attack_hostile_argv.py"), title, secret])
    return f"sglang::scheduler_TP0_{tag}*", secret, int(ready_line(proc).split()[1])


def _cli(cwd: Path, *args: str, tty: bool = False) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_COREDUMP__ENABLED="false", SERVEWATCH_HOST_NAME="node-a")
    argv = [sys.executable, "-m", "agent.cli.app", *args]
    if not tty:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=90, cwd=cwd, env=env, check=False)
        return done.returncode, done.stdout, done.stderr
    master, slave = pty.openpty()  # stdout is a real terminal
    proc = subprocess.Popen(argv, stdout=slave, stderr=subprocess.PIPE, cwd=cwd, env=env, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, b"".join(chunks).decode("utf-8", "replace"), err.decode()


@pytest.mark.slow
def test_a_hostile_title_reaches_no_terminal_raw_and_json_escapes_it(
    spawn: Callable, tmp_path: Path, attack_programs: Path, host_files: Path
) -> None:
    glob, _, pid = _hostile(spawn, attack_programs)
    data = str(tmp_path / "data")
    rc, out, err = _cli(tmp_path, "dump", "--match", glob, "--uid", str(NOBODY), "--json", "--data-dir", data)
    assert rc in (0, 1), err
    for text in (out, err):
        assert not [c for c in RAW if c in text], text
    dumped = json.loads(out)  # the same text, escaped: nothing lost
    assert next(p["title"] for p in dumped["processes"]).endswith("\x1b]0;pwned\x07\x1b[2J\u009b31m\u202eevil")
    assert "\\u009b" in out and "\\u202e" in out and "\\u001b" in out
    rc, out, err = _cli(tmp_path, "timeline", "--json", "--data-dir", data)
    assert rc == 0, err
    assert not [c for c in RAW if c in out + err] and "\\u202e" in out
    rc, out, err = _cli(tmp_path, "timeline", "--data-dir", data, tty=True)
    assert rc == 0, err
    assert str(pid) in out and not [c for c in ("\x1b]", "\x07", "\x9b", "\u202e", "\x1b[2J") if c in out + err]
    rc, out, err = _cli(tmp_path, "report", "-o", "-", "--data-dir", data, tty=True)
    assert rc == 0, err
    assert "sglang::scheduler_TP0_" in out and not [c for c in RAW if c in out + err]


async def test_secrets_in_a_targets_command_line_never_reach_a_token_holder(
    spawn: Callable, tmp_path: Path, attack_programs: Path, host_files: Path, nobody_dir: Path
) -> None:
    _, secret, pid = await anyio.to_thread.run_sync(_hostile, spawn, attack_programs)
    [port] = free_ports(1)
    token = nobody_dir / "token"  # a token holder of another uid reads manifests over the API
    token.write_text(TOKEN)
    os.chown(token, NOBODY, NOBODY)  # the holder's own token, whatever the umask
    settings = settings_for(tmp_path, "node-a", port, target={"pids": [pid]}, coredump={"enabled": False})
    async with running_agent(settings) as (agent, _records):
        record = await agent.incidents.open_incident("manual")
        reader = run_as_nobody(spawn, [NOBODY_PYTHON, str(attack_programs / "attack_api_requests.py"), "--port", str(port),
                                       "--count", "1", "--path", f"/v1/incidents/{record.opened.incident_id}",
                                       "--token-file", str(token), "--body"])
        out, _ = await anyio.to_thread.run_sync(reader.communicate)
    got = json.loads(out)
    assert got["status"] == {"200": 1}
    manifest = json.loads(got["body"])
    cmdline = manifest["targets"][0]["cmdline"]
    assert secret not in got["body"], cmdline
    assert cmdline[3:] == ["-k", "<redacted>", "--key", "<redacted>", "--auth", "<redacted>", "--bearer", "<redacted>",
                           "--credentials", "<redacted>", "--db-password=<redacted>",
                           "https://admin:<redacted>@db.internal:5432/x?api_key=<redacted>&model=m",
                           "Authorization: <redacted>", "HF_TOKEN=<redacted>", "<redacted>"], cmdline
    for f in record.bundle_dir.rglob("*"):
        if f.is_file():
            assert secret not in f.read_text(errors="replace"), f
