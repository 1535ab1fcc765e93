"""The local attack surface of an agent running as root (issue 10), tried as an attacker would.

Every unprivileged case runs as a real other uid (``nobody``, 65534) through
``setpriv --reuid 65534 --regid 65534 --clear-groups``; the agent side runs as root, as in
production. Hang guards only stop a broken test; nothing here measures speed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from agent.actors.coredump import CoredumpActor, CoredumpConfig
from agent.host.targets import discover, target_of
from agent.model.events import IncidentOpened, Outcome
from tests.conftest import PROGRAMS_DIR

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
HOST = socket.gethostname()
REPO = Path(__file__).resolve().parent.parent
#: An interpreter nobody can exec again (the venv's may sit behind a 0700 home); stdlib + PYTHONPATH.
NOBODY_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to act as another uid"
)


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A folder under /tmp owned by nobody (the attacker's own files), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="sw-nobody-", dir="/tmp"))
    os.chown(path, NOBODY, NOBODY)
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def wait_for(predicate: Callable[[], object], *, timeout_s: float = 30.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _ready(proc: subprocess.Popen[bytes]) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(b"ready"), line
    return proc.pid


# --- discovery by title: uid filter, and coredump folders a foreign target chose ---------------


#: A stdlib-only process of nobody whose title (argv[0]) is chosen by its owner (nobody cannot
#: import the root interpreter's setproctitle; exec with a new argv[0] is the same to /proc).
_TITLED = (
    "import os, sys; os.execv(sys.executable, [sys.argv[1], '-c',"
    " 'import sys, time; print(\"ready\", flush=True); time.sleep(float(sys.argv[1]))', sys.argv[2]])"
)


def titled_as_nobody(spawn: Callable, python: str, title: str, lifetime_s: float = 60.0) -> int:
    proc = spawn([*AS_NOBODY, NOBODY_PYTHON, "-c", _TITLED, title, str(lifetime_s)], stdout=subprocess.PIPE)
    return _ready(proc)


def test_uid_filter_keeps_only_given_uids(spawn: Callable, python: str) -> None:
    title = f"sglang::scheduler_TP0_{uuid.uuid4().hex[:6]}"
    titled_as_nobody(spawn, python, title)
    assert discover(title_globs=[title]) == []  # not the server's uid (ours, with a title only): refused
    assert discover(title_globs=[title], uids=[0]) == []
    assert [t.uid for t in discover(title_globs=[title], uids=[0, NOBODY])] == [NOBODY]
    assert [t.uid for t in discover(title_globs=[title], any_uid=True)] == [NOBODY]


def _start_nobody_driver(spawn: Callable, python: str, home: Path, core_template: str) -> tuple[int, Path]:
    status = home / "status.json"
    env = {
        "PATH": os.environ["PATH"],
        "CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "1",
        "CUDA_COREDUMP_PIPE": str(home / "corepipe.%p"),
        "CUDA_COREDUMP_FILE": core_template,
    }
    proc = spawn([*AS_NOBODY, NOBODY_PYTHON, str(PROGRAMS_DIR / "fake_cuda_driver.py"), "--status", str(status)],
                 env=env, cwd=str(home), stdout=subprocess.PIPE)
    _ready(proc)
    return proc.pid, status


@pytest.mark.parametrize("trusted", [False, True])
async def test_foreign_target_cannot_make_root_create_its_core_folder(
    spawn: Callable, python: str, tmp_path: Path, nobody_dir: Path, trusted: bool
) -> None:
    planted = tmp_path / "root-only" / "planted"  # where nobody wants root to create folders
    pid, status = _start_nobody_driver(spawn, python, nobody_dir, f"{planted}/%h/core.%p")
    target = target_of(pid)
    assert target is not None and target.uid == NOBODY
    config = CoredumpConfig(folder=tmp_path / "dumps", min_free_bytes=0, completion_timeout_s=110.0)
    actor = CoredumpActor(config, host=HOST, trusted_uids=[NOBODY] if trusted else [])
    opened = IncidentOpened(incident_id="inc-sec", trigger="manual", source="test")
    with anyio.fail_after(60):  # the 110 s completion wait is never entered
        result = await actor.act(opened, target, timeout_s=115.0, artifact_dir=tmp_path)
    assert result.outcome is Outcome.REFUSED
    assert ("not trusted" in result.detail) != trusted
    assert "not created" in result.detail or not trusted
    assert not (tmp_path / "root-only").exists()
    assert json.loads(status.read_text())["bytes_read"] == 0  # never triggered: nothing to wait for


# --- the data dir -----------------------------------------------------------------------------

CLI = [sys.executable, "-m", "agent.cli.app"]


def _cli(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    base.update(SERVEWATCH_SHM_DIR=str(cwd / "shm"), **env)
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=base,
                          stdin=subprocess.DEVNULL, check=False)


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("parent-owned-by-nobody", "owned by uid 65534"),
        ("parent-world-writable", "without the sticky bit"),
        ("data-dir-owned-by-nobody", "owned by uid 65534"),
        ("data-dir-group-writable", "writable by group/other"),
        ("symlink-of-nobody", "owned by uid 65534"),
    ],
)
def test_unsafe_data_dir_is_refused_with_one_line(tmp_path: Path, nobody_dir: Path, case: str, why: str) -> None:
    if case == "parent-owned-by-nobody":
        data = nobody_dir / "data"  # nobody could rename it away and plant a symlink in its place
    elif case == "parent-world-writable":
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        data = shared / "data"
    elif case == "data-dir-owned-by-nobody":
        data = tmp_path / "data"
        data.mkdir()
        os.chown(data, NOBODY, NOBODY)
    elif case == "data-dir-group-writable":
        data = tmp_path / "data"
        data.mkdir()
        data.chmod(0o770)
    else:
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        data = nobody_dir / "link"
        subprocess.run([*AS_NOBODY, "ln", "-s", str(real), str(data)], check=True)
    done = _cli(tmp_path, "dump", "--pid", str(os.getpid()), "--data-dir", str(data))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servewatch: invalid setting data_dir: unsafe folder"), lines
    assert why in lines[0]


def test_safe_data_dirs_pass(tmp_path: Path) -> None:
    from agent.runtime.settings import check_data_dir

    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: shared, but nobody can rename our folder in it
    check_data_dir(sticky / "data")
    assert stat.S_IMODE((sticky / "data").stat().st_mode) == 0o700
    check_data_dir(tmp_path / "a" / "b")


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../../etc", "", "x\x1b[41m", "a\\b"])
def test_host_name_must_be_one_path_component(name: str) -> None:
    from agent.runtime.settings import ConfigError, load_settings

    with pytest.raises(ConfigError, match="host_name"):
        load_settings({"host_name": name})


def test_host_name_from_environment_is_checked(tmp_path: Path) -> None:
    done = _cli(tmp_path, "dump", "--pid", str(os.getpid()), "--data-dir", str(tmp_path / "d"),
                SERVEWATCH_HOST_NAME="../../escape")
    assert done.returncode == 2 and "invalid setting host_name" in done.stderr
    assert not (tmp_path / "escape").exists()


# --- files servewatch writes: symlinks never followed, 0600/0700, atomic ------------------------


def test_planted_symlink_in_span_folder_is_not_followed(tmp_path: Path) -> None:
    from exporters.otlp.otlp_json import RotatingJsonLinesWriter

    victim = tmp_path / "root-only"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    spans = tmp_path / "spans"
    spans.mkdir()
    writer = RotatingJsonLinesWriter(spans, prefix="spans", max_file_bytes=1 << 20, max_files=0)
    # the attacker guesses the next file name (stamp, pid, sequence are predictable) and plants a link
    planned = spans / f"spans-{writer._stamp}-{os.getpid()}-000001.jsonl"
    planned.symlink_to(victim)
    with pytest.raises(OSError):
        writer.write_line('{"resourceSpans": []}')
    writer.close()
    assert victim.read_text() == "precious\n"


def test_bundle_files_are_private_and_manifest_atomic(tmp_path: Path) -> None:
    from agent.incidents import manager as incidents

    bundle = tmp_path / "data" / "host" / "inc-1"
    from agent.host.fsutil import ensure_private_dir

    ensure_private_dir(bundle)
    manifest = bundle / "manifest.json"
    planted = tmp_path / "victim"
    planted.write_text("keep")
    manifest.symlink_to(planted)  # a planted link is replaced, never written through
    assert incidents._write_json(manifest, {"a": 1})
    assert planted.read_text() == "keep"
    assert json.loads(manifest.read_text()) == {"a": 1}
    assert stat.S_IMODE(manifest.lstat().st_mode) == 0o600
    for d in (bundle, bundle.parent, bundle.parent.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs, to fill up (skipped where mounting is not allowed)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, timeout=30, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30, check=False)


def test_full_disk_keeps_previous_manifest_or_none(tiny_tmpfs: Path) -> None:
    from agent.incidents import manager as incidents

    manifest = tiny_tmpfs / "manifest.json"
    assert incidents._write_json(manifest, {"version": 1})
    filler = tiny_tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # fill the disk to the last block
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    big = {"version": 2, "pad": "x" * 200_000}
    assert not incidents._write_json(manifest, big)  # ENOSPC: logged, not raised
    assert json.loads(manifest.read_text()) == {"version": 1}
    fresh = tiny_tmpfs / "other.json"
    assert not incidents._write_json(fresh, big)
    assert not fresh.exists()
    assert [p.name for p in tiny_tmpfs.iterdir() if p.name.endswith(".swtmp")] == []


async def test_leftover_temp_files_are_removed_on_start(spawn: Callable, python: str, tmp_path: Path) -> None:
    from agent.runtime.agent import dump_once
    from agent.runtime.settings import load_settings

    data = tmp_path / "data"
    old = data / "host" / "inc-old"
    old.mkdir(parents=True, mode=0o700)
    leftover = old / ".manifest.json.1a2b3c4d.swtmp"
    leftover.write_text('{"trunc')
    proc = spawn([python, "-c", "import time; time.sleep(60)"])
    settings = load_settings({"data_dir": data, "target": {"pids": [proc.pid]},
                              "coredump": {"enabled": False}, "host_name": "host"})
    with anyio.fail_after(90):
        record = await dump_once(settings)
    assert not leftover.exists()
    assert record.manifest_path.exists()
    assert stat.S_IMODE(record.bundle_dir.stat().st_mode) == 0o700
    for f in record.bundle_dir.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


# --- SDK counter and control socket: planted by another user --------------------------------


@pytest.fixture
def shared_shm() -> Iterator[Path]:
    """A folder like /dev/shm (1777: everyone may create files, only owners remove theirs)."""
    path = Path(tempfile.mkdtemp(prefix="sw-shm-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _as_nobody(*argv: str, timeout_s: float = 30) -> None:
    subprocess.run([*AS_NOBODY, *argv], check=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


_FORGE_COUNTER = """
import os, struct, sys, time
from agent.sdk.counter import MAGIC
pid = int(sys.argv[2])
os.makedirs(os.path.dirname(sys.argv[1]), mode=0o777, exist_ok=True)  # the victim user's folder name, taken
# busy, one step long ago: a stall as soon as anyone believes it
words = [MAGIC, pid, time.time_ns(), 5, 1, 7, 0, 0]
with open(sys.argv[1], "xb") as f:
    f.write(struct.pack("<8q", *words))
"""


def test_counter_forged_by_another_user_is_ignored(spawn: Callable, python: str, shared_shm: Path) -> None:
    from agent.sdk.counter import counter_path, read_counter
    from agent.watchers.steps import ShmStepSource, discover_shm_counters

    victim = spawn([python, "-c", "import time; time.sleep(60)"])  # a root server without the SDK
    path = shared_shm / "servewatch-0" / f"servewatch-steps.{victim.pid}"  # where root's counter would be
    _as_nobody("env", f"PYTHONPATH={REPO}", NOBODY_PYTHON, "-c", _FORGE_COUNTER, str(path), str(victim.pid))
    assert path.stat().st_uid == NOBODY and read_counter(path) is not None  # a well-formed forgery
    assert ShmStepSource(victim.pid, directory=shared_shm).read_now() is None
    assert discover_shm_counters(directory=shared_shm) == {}
    assert str(counter_path(victim.pid, shared_shm)).startswith(os.devnull + "/")  # never a path through nobody's folder


def test_counter_folder_symlink_is_not_followed(spawn: Callable, python: str, shared_shm: Path, nobody_dir: Path) -> None:
    from agent.verdict.judge import read_steps
    from agent.watchers.steps import ShmStepSource

    victim = spawn([python, "-c", "import time; time.sleep(60)"])
    forged = nobody_dir / "forged" / f"servewatch-steps.{victim.pid}"
    _as_nobody("env", f"PYTHONPATH={REPO}", NOBODY_PYTHON, "-c", _FORGE_COUNTER, str(forged), str(victim.pid))
    os.chown(forged, 0, 0)  # even a root-owned file behind the link is not read through it
    os.chown(forged.parent, 0, 0)
    forged.parent.chmod(0o700)
    _as_nobody("ln", "-s", str(forged.parent), str(shared_shm / "servewatch-0"))
    assert ShmStepSource(victim.pid, directory=shared_shm).read_now() is None
    assert read_steps([victim.pid], shared_shm) == {}  # nor by the verdict's step reader


_SQUAT_SOCKET = """
import json, os, socket, sys, time
path, log = sys.argv[1], sys.argv[2]
os.makedirs(os.path.dirname(path), mode=0o777, exist_ok=True)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
s.listen(8)
print("ready", flush=True)
s.settimeout(60)
while True:
    try:
        c, _ = s.accept()
    except OSError:
        break
    with open(log, "a") as f:
        f.write("connected\\n")
    reqs = [{"request_id": f"forged-{i}", "trace_id": "0" * 32, "span_id": "0" * 16} for i in range(100001)]
    c.sendall(json.dumps({"ok": True, "requests": reqs}).encode() + b"\\n")
    c.close()
"""


def _start_sdk_server(spawn: Callable, python: str, shm: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "PYTHONPATH": str(REPO)}
    proc = spawn([python, str(PROGRAMS_DIR / "sdk_server.py")], env=env, stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(b"pid "), line
    return proc


async def test_sdk_survives_paths_squatted_by_another_user_and_agent_ignores_them(
    spawn: Callable, python: str, shared_shm: Path, nobody_dir: Path
) -> None:
    from agent.host.sdkclient import read_inflight
    from agent.sdk.control import control_path
    from agent.sdk.counter import counter_path

    server = _start_sdk_server(spawn, python, shared_shm)
    squatted = shared_shm / "servewatch-0"  # the name of root's private SDK folder, taken first
    log = nobody_dir / "connections.log"
    sock = squatted / f"servewatch-ctl.{server.pid}.sock"
    squatter = spawn([*AS_NOBODY, NOBODY_PYTHON, "-c", _SQUAT_SOCKET, str(sock), str(log)], stdout=subprocess.PIPE)
    _ready(squatter)
    _as_nobody("touch", str(squatted / f"servewatch-steps.{server.pid}"))
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(b"go\n")
    server.stdin.flush()
    state = json.loads(server.stdout.readline())
    assert state["forward_ct"] == 1  # the server stepped and runs on
    assert state["published"] is True and state["control_running"] is True  # in a folder nobody could squat
    own = Path(state["counter"]).parent
    assert own.name.startswith("servewatch-0.") and own.stat().st_uid == 0 and stat.S_IMODE(own.stat().st_mode) == 0o700
    await anyio.sleep(0.3)
    assert server.poll() is None
    assert counter_path(server.pid, shared_shm).parent == own and control_path(server.pid, shared_shm).parent == own
    target = target_of(server.pid)
    assert target is not None
    with anyio.fail_after(30):
        inflight = await read_inflight([target], socket_dir=shared_shm)
    assert inflight == []  # the server's own answer (no requests), not the squatter's 100001
    assert not log.exists()  # the agent never even connected to the squatted socket


def test_sdk_replaces_its_own_stale_files(spawn: Callable, python: str, shared_shm: Path) -> None:
    # a file of our own uid at our pid's path is a stale one (pid reuse): replaced, not an error
    from agent.sdk.folders import own_dir

    server = _start_sdk_server(spawn, python, shared_shm)
    (own_dir(shared_shm) / f"servewatch-steps.{server.pid}").write_bytes(b"stale")  # root's folder: the server's too
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(b"go\n")
    server.stdin.flush()
    state = json.loads(server.stdout.readline())
    assert state["published"] is True and state["control_running"] is True


# --- control socket: concurrent, bounded ------------------------------------------------------


async def test_idle_and_slow_clients_do_not_block_the_inflight_read(
    spawn: Callable, python: str, shared_shm: Path
) -> None:
    from agent.host.sdkclient import sdk_call
    from agent.sdk.control import control_path

    server = _start_sdk_server(spawn, python, shared_shm)
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(b"go\n")
    server.stdin.flush()
    assert json.loads(server.stdout.readline())["control_running"]
    path = control_path(server.pid, shared_shm)
    idle: list[socket.socket] = []
    try:
        for _ in range(50):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(path))
            idle.append(c)
        slow = idle[0]
        slow.sendall(b'{"cmd": "inf')  # a request that never ends
        # served at once, not after the idle ones: a serial server would take 50 x 5 s here
        with anyio.fail_after(30):
            reply = await sdk_call(path, {"cmd": "inflight"}, timeout_s=30, pid=server.pid)
        assert reply["ok"] is True and reply["requests"] == []
        # each connection has one deadline (5 s by default), not one per read: idle ones are closed
        slow.settimeout(60)
        assert slow.recv(100) == b""
    finally:
        for c in idle:
            c.close()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"num_steps": 10**9}, "num_steps must be <="),
        ({"num_steps": 1, "max_duration_s": 10**7}, "max_duration_s must be <="),
        ({"num_steps": 1, "output_dir": "/etc/servewatch-evil"}, "outside the allowed folders"),
        ({"num_steps": 1, "output_dir": "relative/dir"}, "absolute"),
    ],
)
def test_profile_start_over_the_socket_is_bounded(body: dict, error: str) -> None:
    from agent.sdk.control import handle_request

    reply = handle_request({"cmd": "profile.start", **body})
    assert reply["ok"] is False and reply["error"] == "invalid" and error in reply["detail"]
    assert not Path("/etc/servewatch-evil").exists()


# --- what leaves the process: secrets, escapes -------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve", "--api-key", "sk-1", "--port", "1"], ["serve", "--api-key", "<redacted>", "--port", "1"]),
        (["serve", "--token=abc", "--password", "pw"], ["serve", "--token=<redacted>", "--password", "<redacted>"]),
        (["x", "--hf-key", "k", "--client-secret=s", "--model", "m"], ["x", "--hf-key", "<redacted>", "--client-secret=<redacted>", "--model", "m"]),
        (["env", "HF_TOKEN=hf_x", "API_KEY=1", "AWS_SECRET_ACCESS_KEY=2", "PATH=/bin"],
         ["env", "HF_TOKEN=<redacted>", "API_KEY=<redacted>", "AWS_SECRET_ACCESS_KEY=<redacted>", "PATH=/bin"]),
        (["x", "--keyboard", "us", "--tokenizer", "t"], ["x", "--keyboard", "us", "--tokenizer", "t"]),
        # a flag and its value in one element; a value that starts with dashes (a PEM block)
        (["x", "--api-key sk-abc", "--auth\tA", "--tokenizer /m/t"], ["x", "--api-key <redacted>", "--auth <redacted>", "--tokenizer /m/t"]),
        (["x", "--private-key-pem=-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----"], ["x", "--private-key-pem=<redacted>"]),
        (["x", "--private-key-pem", "-----BEGIN RSA PRIVATE KEY-----\nMIIE"], ["x", "--private-key-pem", "<redacted>"]),
        (["x", "--api-key", "--port", "1", "--ssl-cert-pem", "/c.pem"], ["x", "--api-key", "--port", "1", "--ssl-cert-pem", "/c.pem"]),
        (["x", "cert=-----BEGIN EC PRIVATE KEY-----\nMIIE\n-----END EC PRIVATE KEY----- tail"], ["x", "cert=<redacted> tail"]),
        # family 1: plural secret words (FastChat's --api-keys), passphrases, camelCase compounds
        (["x", "--api-keys", "a,b", "--secrets", "s", "--tokens", "t", "--passwords", "p", "--keys", "k"],
         ["x", "--api-keys", "<redacted>", "--secrets", "<redacted>", "--tokens", "<redacted>", "--passwords", "<redacted>",
          "--keys", "<redacted>"]),
        (["x", "--passphrase", "p", "--db-passphrase=p", "--accessToken", "t", "--dbPassword=p"],
         ["x", "--passphrase", "<redacted>", "--db-passphrase=<redacted>", "--accessToken", "<redacted>", "--dbPassword=<redacted>"]),
        # ...but counts of tokens or keys are not secrets; a key FILE is a path, not the key
        (["x", "--max-tokens", "64", "--num-tokens", "8", "--max-num-batched-tokens", "8192", "--num-keys", "4",
          "--max-new-tokens", "9", "--num-speculative-tokens", "5", "--key-file", "/k.pem", "--api-key-file=/a"],
         ["x", "--max-tokens", "64", "--num-tokens", "8", "--max-num-batched-tokens", "8192", "--num-keys", "4",
          "--max-new-tokens", "9", "--num-speculative-tokens", "5", "--key-file", "/k.pem", "--api-key-file=/a"]),
        (["env", "MAX_TOKENS=64", "API_KEYS=a", "TOKENIZERS_PARALLELISM=false"],
         ["env", "MAX_TOKENS=64", "API_KEYS=<redacted>", "TOKENIZERS_PARALLELISM=false"]),
        # family 2 inside a value (a libpq DSN), family 4 inside a --flag=value
        (["x", "--dsn", "host=x password=pw sslpassword=pw2 user=u", "--dsn=host=y password=pw"],
         ["x", "--dsn", "host=x password=<redacted> sslpassword=<redacted> user=u", "--dsn=host=y password=<redacted>"]),
        (["x", "--header=Authorization:Bearer abc", "--header X-Api-Key: abc", "--header=Accept: text/plain"],
         ["x", "--header=Authorization: <redacted>", "--header X-Api-Key: <redacted>", "--header=Accept: text/plain"]),
        # a flag after leading whitespace; a whole command in one argument (sh -c), quotes and all
        (["x", " --api-key abc", "\t--token=abc --port 1"], ["x", " --api-key <redacted>", "\t--token=<redacted> --port 1"]),
        (["sh", "-c", "vllm serve --api-key abc --port 8000 --max-tokens 64"],
         ["sh", "-c", "vllm serve --api-key <redacted> --port 8000 --max-tokens 64"]),
        (["sh", "-c", "exec env HF_TOKEN=abc curl -H 'Authorization: Bearer abc' \"$URL\" && bash -c 'x --password \"a b\"'"],
         ["sh", "-c", "exec env HF_TOKEN=<redacted> curl -H 'Authorization: <redacted>' \"$URL\" && bash -c 'x --password <redacted>'"]),
    ],
)
def test_redact_cmdline(argv: list[str], expected: list[str]) -> None:
    from agent.host.security import redact_cmdline

    assert redact_cmdline(argv) == expected


async def test_manifest_cmdline_has_no_secrets(spawn: Callable, python: str, tmp_path: Path) -> None:
    from agent.runtime.agent import dump_once
    from agent.runtime.settings import load_settings

    secret = "sk-" + uuid.uuid4().hex
    proc = spawn([python, "-c", "import time; time.sleep(60)", "--api-key", secret, f"--db-password={secret}",
                  f"OPENAI_API_KEY={secret}"])
    wait_for(lambda: secret.encode() in Path(f"/proc/{proc.pid}/cmdline").read_bytes(), what="exec")
    settings = load_settings({"data_dir": tmp_path / "data", "target": {"pids": [proc.pid]},
                              "coredump": {"enabled": False}, "host_name": "host"})
    with anyio.fail_after(90):
        record = await dump_once(settings)
    manifest = json.loads(record.manifest_path.read_text())
    assert manifest["targets"][0]["cmdline"][-3:] == ["<redacted>", "--db-password=<redacted>", "OPENAI_API_KEY=<redacted>"]
    for f in record.bundle_dir.rglob("*"):
        if f.is_file():
            assert secret not in f.read_text(errors="replace"), f


def test_strip_control_removes_escapes() -> None:
    from agent.host.security import strip_control

    assert strip_control("a\x1b]0;pwned\x07b\x1b[41mc\x9b2J\u202ed") == "a?]0;pwned?b?[41mc?2J?d"
    assert strip_control("l1\nl2\tx", keep_newlines=True) == "l1\nl2\tx"


def test_hostile_title_never_reaches_the_terminal_and_is_escaped_in_html(
    spawn: Callable, python: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    title = f"sglang::scheduler_TP0_{tag}\x1b]0;pwned\x07\x1b[41m<script>alert(1)</script>"
    titled_as_nobody(spawn, python, title)
    data = tmp_path / "data"
    dump = _cli(tmp_path, "dump", "--match", f"sglang::scheduler_TP0_{tag}*", "--uid", str(NOBODY), "--data-dir", str(data),
                SERVEWATCH_COREDUMP__ENABLED="false")
    assert dump.returncode == 0, dump.stderr
    assert f"scheduler_TP0_{tag}" in dump.stdout  # the title is shown...
    assert "\x1b" not in dump.stdout + dump.stderr and "\x07" not in dump.stdout + dump.stderr  # ...defused
    manifest = json.loads(next(data.rglob("manifest.json")).read_text())
    assert manifest["targets"][0]["title"] == title  # the bundle keeps the truth (JSON-escaped)
    timeline = _cli(tmp_path, "timeline", "--data-dir", str(data))
    assert timeline.returncode == 0, timeline.stderr
    assert f"scheduler_TP0_{tag}" in timeline.stdout and "\x1b" not in timeline.stdout + timeline.stderr
    report = _cli(tmp_path, "report", "-o", str(tmp_path / "r.html"), "--data-dir", str(data))
    assert report.returncode == 0, report.stderr
    html_text = (tmp_path / "r.html").read_text()
    assert "<script>alert(1)</script>" not in html_text and "&lt;script&gt;alert(1)&lt;/script&gt;" in html_text


# --- report / timeline on a copied bundle; torn span lines ---------------------------------------


def _pyspy_json(frame_name: str) -> str:
    return json.dumps([{
        "pid": 1, "thread_id": 1, "thread_name": "MainThread", "os_thread_id": 1, "active": True, "owns_gil": False,
        "frames": [{"name": frame_name, "filename": "/srv/model.py", "module": None, "short_filename": "model.py",
                    "line": 7, "locals": None}],
    }])


def _span_line(trace_id: str, span_id: str, name: str) -> str:
    span = {"traceId": trace_id, "spanId": span_id, "name": name, "kind": 1,
            "startTimeUnixNano": "1764437701000000000", "endTimeUnixNano": "1764437701500000000"}
    return json.dumps({"resourceSpans": [{"resource": {"attributes": []},
                                          "scopeSpans": [{"scope": {"name": "servewatch"}, "spans": [span]}]}]})


TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _copied_bundle(tmp_path: Path) -> tuple[Path, Path]:
    """A bundle copied away from its data dir whose manifest and files point outside it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text(_pyspy_json("SECRET_OUTSIDE_FRAME"))
    (outside / "requests.json").write_text(json.dumps({"requests": [{"request_id": "SECRET_REQUEST"}]}))
    inc = "20251129T173501Z-manual-abc123"
    bundle = tmp_path / "copied" / inc
    bundle.mkdir(parents=True)
    (bundle / "pyspy-79.json").write_text(_pyspy_json("INSIDE_FRAME"))
    (bundle / "pyspy-78.json").symlink_to(outside / "secret.json")  # a link out of the bundle
    (bundle / "requests.json").symlink_to(outside / "requests.json")
    action = {"action": "pyspy.dump", "outcome": "ok", "start_time_unix_nano": 1764437701000000000,
              "end_time_unix_nano": 1764437701100000000, "attributes": {}}
    manifest = {
        "schema": "servewatch.incident/1", "incident_id": inc, "trigger": "manual", "detail": "",
        "host.name": "h", "trace_id": TRACE, "span_id": "00f067aa0ba902b7",
        "opened_time_unix_nano": 1764437701000000000, "closed_time_unix_nano": 1764437702000000000,
        "targets": [{"pid": p, "title": f"t{p}", "create_time_s": 0, "cmdline": []} for p in (77, 78, 79)],
        "actions": [
            {**action, "pid": 77, "artifact_paths": [str(outside / "secret.json")]},  # absolute, outside
            {**action, "pid": 78, "artifact_paths": [str(bundle / "pyspy-78.json")]},
            # recorded where the bundle was written; found again inside the copy
            {**action, "pid": 79, "artifact_paths": [f"/var/lib/servewatch/h/{inc}/pyspy-79.json"]},
        ],
        "inflight_requests": 0,
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle, outside


def test_report_on_a_copied_bundle_reads_only_inside_it(tmp_path: Path) -> None:
    bundle, _ = _copied_bundle(tmp_path)
    timeline = _cli(tmp_path, "timeline", str(bundle), "--json", "--data-dir", str(tmp_path / "d"))
    assert timeline.returncode == 0, timeline.stderr
    report = _cli(tmp_path, "report", str(bundle), "-o", str(tmp_path / "r.html"), "--data-dir", str(tmp_path / "d"))
    assert report.returncode == 0, report.stderr
    html_text = (tmp_path / "r.html").read_text()
    for text in (timeline.stdout, html_text):
        assert "INSIDE_FRAME" in text
        assert "SECRET_OUTSIDE_FRAME" not in text and "SECRET_REQUEST" not in text
    assert "outside the bundle" in timeline.stdout


def test_torn_last_span_line_costs_that_line_only(tmp_path: Path) -> None:
    from exporters.otlp.replay import replay
    from tests.otlp_receiver import OtlpReceiver

    bundle, _ = _copied_bundle(tmp_path)
    spans = bundle / "spans-1.jsonl"
    full = _span_line(TRACE, "00f067aa0ba902b7", "incident") + "\n" + _span_line(TRACE, "1111111111111111", "pyspy.dump") + "\n"
    torn = _span_line(TRACE, "2222222222222222", "cuda.coredump")
    spans.write_text(full + torn[: len(torn) // 2])  # the disk filled up mid-line
    timeline = _cli(tmp_path, "timeline", str(bundle), "--json", "--data-dir", str(tmp_path / "d"))
    assert timeline.returncode == 0, timeline.stderr
    data = json.loads(timeline.stdout)
    assert sorted(s["name"] for s in data["spans"]) == ["incident", "pyspy.dump"]
    assert any("1 torn line" in w for w in data["warnings"])
    receiver = OtlpReceiver().start()
    try:
        result = replay([spans], endpoint=receiver.grpc_endpoint, protocol="grpc", timeout_s=20)
        assert (result.sent, result.failed, result.bad_files, result.torn_lines) == (2, 0, 0, 1)
        exported = _cli(tmp_path, "export", "--to", receiver.grpc_endpoint, str(spans), "--data-dir", str(tmp_path / "d"))
        assert exported.returncode == 0, exported.stderr
        assert "Torn lines skipped: 1" in exported.stderr
    finally:
        receiver.stop()


# --- launch: the server never outlives a killed launcher ----------------------------------------


def test_killed_launcher_does_not_orphan_the_server(spawn: Callable, python: str, tmp_path: Path) -> None:
    import psutil

    from agent.host.targets import ProcessState, process_state

    marker = f"orphan-check-{uuid.uuid4().hex[:8]}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    base.update(SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), SERVEWATCH_COREDUMP__ENABLED="false")
    launcher = spawn([*CLI, "launch", "--data-dir", str(tmp_path / "data"), "--",
                      python, "-c", "import sys, time; print('up', flush=True); time.sleep(120)", marker],
                     env=base, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert launcher.stdout is not None
    assert launcher.stdout.readline().startswith(b"up")
    server = wait_for(
        lambda: next((p for p in psutil.Process(launcher.pid).children() if marker in p.cmdline()), None),
        what="the launched server",
    )
    assert isinstance(server, psutil.Process)
    try:
        launcher.kill()  # SIGKILL: no handler of servewatch runs
        launcher.wait(timeout=30)
        state = wait_for(
            lambda: process_state(server.pid, create_time_s=server.create_time()) in (ProcessState.GONE, ProcessState.ZOMBIE),
            what="the orphaned server to die",
        )
        assert state
    finally:
        try:
            server.kill()
        except psutil.NoSuchProcess:
            pass


def test_hostile_title_never_reaches_the_terminal_from_run(spawn: Callable, python: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    title = f"sglang::scheduler_TP0_{tag}\x1b]0;pwned\x07\x1b[41m"
    titled_as_nobody(spawn, python, title)
    with socket.socket() as s:  # a port nobody listens on: the health check fails at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = _cli(
        tmp_path, "run", "-v", "--match", f"sglang::scheduler_TP0_{tag}*", "--uid", str(NOBODY),
        "--health-url", f"http://127.0.0.1:{port}/health",
        "--duration", "15", "--data-dir", str(tmp_path / "data"),
        SERVEWATCH_COREDUMP__ENABLED="false", SERVEWATCH_HEALTH__INTERVAL_S="0.2",
        SERVEWATCH_HEALTH__UNHEALTHY_AFTER="1", SERVEWATCH_HEALTH__STARTUP_TIMEOUT_S="0.1",
    )
    assert run.returncode == 0, run.stderr
    assert f"scheduler_TP0_{tag}" in run.stderr  # the incident summary names it...
    assert "\x1b" not in run.stdout + run.stderr and "\x07" not in run.stdout + run.stderr  # ...defused


@pytest.mark.parametrize("planter", ["root", "nobody"])
def test_span_and_spool_files_are_private_and_never_follow_links(tmp_path: Path, shared_shm: Path, planter: str) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from exporters.otlp.otlp_json import RotatingJsonLinesWriter
    from exporters.otlp.spool import Spool

    victim = tmp_path / "root-only"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    shared = shared_shm  # where another user can create names (a sticky folder, like /tmp)
    writer = RotatingJsonLinesWriter(shared / "spans", prefix="spans", max_file_bytes=1 << 20, max_files=0)
    first = writer.write_line('{"resourceSpans": []}')
    assert stat.S_IMODE(first.stat().st_mode) == 0o600 and stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    writer.close()
    planted = shared / f"spans-{writer._stamp}-{os.getpid()}-000001.jsonl"
    if planter == "nobody":
        _as_nobody("ln", "-s", str(victim), str(planted))
    else:
        planted.symlink_to(victim)
    other = RotatingJsonLinesWriter(shared, prefix="spans", max_file_bytes=1 << 20, max_files=0)
    other._stamp = writer._stamp
    with pytest.raises(OSError):
        other.write_line('{"resourceSpans": []}')
    other.close()
    assert victim.read_text() == "precious\n"
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    spool.append(ExportTraceServiceRequest(), 0)
    files = [p for p in (tmp_path / "spool").rglob("*") if p.is_file() and p.name != ".lock"]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert stat.S_IMODE((tmp_path / "spool").stat().st_mode) == 0o700


def test_report_output_never_written_through_a_planted_link(tmp_path: Path, shared_shm: Path) -> None:
    bundle, _ = _copied_bundle(tmp_path)
    victim = tmp_path / "root-only"
    victim.write_text("precious\n")
    out = shared_shm / "report.html"  # an output folder another user can create names in
    _as_nobody("ln", "-s", str(victim), str(out))
    done = _cli(tmp_path, "report", str(bundle), "-o", str(out), "--data-dir", str(tmp_path / "d"))
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "precious\n"
    assert not out.is_symlink() and "INSIDE_FRAME" in out.read_text()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert [p.name for p in shared_shm.iterdir() if p.name.endswith(".swtmp")] == []
