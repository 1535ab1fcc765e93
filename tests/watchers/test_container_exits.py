"""A container's init's exit from its runtime's own record (agent.host.containerexits), on real
kernel shapes: the init is pid 1 of a real new pid namespace, in a real cgroup named as the
runtime names it (``crio-ID.scope``, ``docker-ID.scope``), its monitor a faithful stand-in for
conmon and for Docker's shim and daemon (tests/programs/fake_conmon.py: subreaper, ``waitpid``,
``128 + signal``, the record written as conmon and moby write it). The agent is in a pod: no
kernel exit events (refused outside the host's network namespace, shown for real below), and
the monitor reaps the init before its zombie can be read."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest

from agent.host.containerexits import DEFAULT_RECORDS, container_init_of, record_paths, runtime_exit
from agent.host.targets import Target
from agent.model.bus import RecordingBus
from agent.model.events import ExitKind, ExitSource, TargetExited
from agent.watchers.config import ProcessConfig
from agent.watchers.process import ProcessWatcher
from tests.conftest import PROGRAMS_DIR
from tests.watchers import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not hasattr(os, "pidfd_open"),
                                reason="needs root (a new pid namespace, a cgroup, root-owned records)")

SLEEP = "import time; time.sleep(120)"


def _cgroup_root() -> Path | None:
    """A cgroup hierarchy this test may make a group in: v2 first, else v1's name=systemd."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    v2 = [m.split()[1] for m in mounts if m.split()[2] == "cgroup2"]
    v1 = [m.split()[1] for m in mounts if m.split()[2] == "cgroup" and "name=systemd" in m.split()[3]]
    for root in (*v2, *v1):
        probe = Path(root, f"servewatch-probe-{secrets.token_hex(4)}")
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError:
            continue
        return Path(root)
    return None


@pytest.fixture
def container_cgroup() -> Iterator:
    """``make(prefix)``: a new cgroup ``servewatch-test-X.slice/{prefix}-ID.scope`` (the runtime's
    systemd naming) and the id; emptied and removed at teardown."""
    root = _cgroup_root()
    if root is None:
        pytest.skip("no cgroup hierarchy this test can make a group in")
    made: list[Path] = []

    def make(prefix: str) -> tuple[Path, str]:
        cid = secrets.token_hex(32)
        group = root / f"servewatch-test-{secrets.token_hex(4)}.slice" / f"{prefix}-{cid}.scope"
        group.mkdir(parents=True)
        made.append(group)
        return group, cid

    yield make
    for group in made:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                group.rmdir()
                group.parent.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def _start(spawn, group: Path, cid: str, argv: list[str], **dirs: Path) -> tuple[subprocess.Popen[bytes], int]:
    """The monitor and its container's init (pid 1 of its own pid namespace, in ``group``)."""
    flags = [x for name, path in dirs.items() for x in (f"--{name.replace('_', '-')}", str(path))]
    monitor = spawn([sys.executable, str(PROGRAMS_DIR / "fake_conmon.py"), "--cid", cid, "--cgroup", str(group),
                     *flags, "--", *argv], stdout=subprocess.PIPE)
    assert monitor.stdout is not None
    init = int(monitor.stdout.readline())
    monitor.stdout.close()
    deadline = time.monotonic() + 10  # in its cgroup, running its command
    while str(init) not in (group / "cgroup.procs").read_text().split() or \
            "fake_conmon.py" in " ".join(psutil.Process(init).cmdline()):  # not yet exec'd
        assert time.monotonic() < deadline, "the container's init never started"
        time.sleep(0.01)
    return monitor, init


def _pod(monkeypatch) -> None:
    """The agent in a pod: no kernel exit events (what ``KernelExits.open`` says outside the
    host's network namespace: shown by test_kernel_exit_events_are_refused_outside_the_host_netns),
    and the monitor, blocked in ``waitpid``, reaps the init before its zombie is read."""
    from agent.host.exits import KernelExits

    monkeypatch.setattr(KernelExits, "open", classmethod(lambda cls: None))
    monkeypatch.setattr("agent.watchers.process.zombie_exit_status", lambda pid: None)


def _records(tmp_path: Path) -> tuple[str, ...]:
    """The default records mounted under ``tmp_path`` (a DaemonSet's ``/host``)."""
    return tuple(str(tmp_path) + t for t in DEFAULT_RECORDS)


async def _exits(watcher: ProcessWatcher, count: int, *, then) -> list[TargetExited]:
    bus = RecordingBus()
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run, bus)
        await wait_until(lambda: all(w.lineage_read_s for w in watcher._watched.values()))
        then()
        await wait_until(lambda: len(bus.of_type(TargetExited)) >= count, timeout_s=30)
        tg.cancel_scope.cancel()
    return bus.of_type(TargetExited)


def test_kernel_exit_events_are_refused_outside_the_host_netns() -> None:
    """The premise: in its own network namespace (a pod without hostNetwork) the agent gets no
    kernel exit events, so a container's init reaped by its monitor leaves nothing else."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("util-linux unshare")
    code = "from agent.host.exits import KernelExits as K; k = K.open(); print(k is None, K.unavailable)"
    out = subprocess.run([unshare, "--net", sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(PROGRAMS_DIR.parent.parent)}, check=True).stdout
    assert out.startswith("True kernel exit events refused"), out


async def test_a_sigkilled_crio_container_init_is_told_by_conmons_exit_file(
        spawn, container_cgroup, tmp_path, monkeypatch) -> None:
    _pod(monkeypatch)
    group, cid = container_cgroup("crio")
    persist = tmp_path / f"var/lib/containers/storage/overlay-containers/{cid}/userdata"
    exits = tmp_path / "var/run/crio/exits"
    persist.mkdir(parents=True)
    exits.mkdir(parents=True)
    monitor, init = _start(spawn, group, cid, [sys.executable, "-c", SLEEP], persist_dir=persist, exit_dir=exits)

    seen = container_init_of(init)
    assert seen is not None and (seen.container_id, seen.engine) == (cid, "cri-o"), seen
    started = psutil.Process(init).create_time()
    assert abs(seen.started_unix_nano / 1e9 - started) < 1.0
    watcher = ProcessWatcher([Target(pid=init, create_time_s=started, title="vllm")], poll_interval_s=0.1,
                             container_exit_records=_records(tmp_path))
    (exited,) = await _exits(watcher, 1, then=lambda: os.kill(init, signal.SIGKILL))
    assert monitor.wait(timeout=10) == 137  # conmon's main returns the container's status
    assert (persist / "exit").read_bytes() == b"137" == (exits / cid).read_bytes()
    fact = exited.fact
    assert fact is not None
    assert (fact.source, fact.kind, fact.signal, fact.exit_code) == (ExitSource.RUNTIME, ExitKind.SIGNAL, 9, None), fact
    assert fact.ended_source == "runtime"
    assert fact.ended_time_unix_nano == (persist / "exit").stat().st_ctime_ns  # CRI-O's finish time: the file's ctime
    from agent.cli.summary import exit_lines

    assert exit_lines(watcher.exits, {})[0].endswith("killed by SIGKILL [its container runtime's exit record]")


async def test_a_docker_container_init_is_told_by_its_config_state_and_another_process_never_by_its_container(
        spawn, container_cgroup, tmp_path, monkeypatch) -> None:
    """The container's init takes the container's code; its child (pid 2 of the namespace, in
    the same cgroup), SIGKILLed and reaped by the init, does not: its status stays unknown."""
    _pod(monkeypatch)
    group, cid = container_cgroup("docker")
    folder = tmp_path / f"var/lib/docker/containers/{cid}"
    folder.mkdir(parents=True)
    script = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
              " sys.exit(3 if p.wait() else 0)")
    monitor, init = _start(spawn, group, cid, [sys.executable, "-c", script], docker_dir=folder)
    await wait_until(lambda: psutil.Process(init).children())
    (child,) = psutil.Process(init).children()
    assert container_init_of(child.pid) is None  # pid 2 of its namespace: not the container's init
    assert container_init_of(init) is not None

    targets = [Target(pid=p.pid, create_time_s=p.create_time(), title=t) for p, t in
               ((psutil.Process(init), "launcher"), (child, "rank0"))]
    watcher = ProcessWatcher(targets, poll_interval_s=0.1, container_exit_records=_records(tmp_path))
    events = await _exits(watcher, 2, then=lambda: os.kill(child.pid, signal.SIGKILL))
    assert monitor.wait(timeout=10) == 3
    facts = {e.pid: e.fact for e in events}
    rank, launcher = facts[child.pid], facts[init]
    assert rank is not None and launcher is not None
    assert (rank.source, rank.exit_code, rank.signal) == (ExitSource.NONE, None, None), rank
    assert (launcher.source, launcher.kind, launcher.exit_code) == (ExitSource.RUNTIME, ExitKind.CODE, 3), launcher
    finished = json.loads((folder / "config.v2.json").read_text())["State"]["FinishedAt"]
    assert launcher.ended_source == "runtime" and finished.startswith(
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(launcher.ended_time_unix_nano // 10**9)))


def test_records_that_are_not_the_runtimes_own_are_refused(spawn, container_cgroup, tmp_path) -> None:
    """A symlink, a file another user owns, a record older than the process (a previous run of
    the same container), Docker's state of a running container or of an earlier run: none is
    read as this init's exit."""
    group, cid = container_cgroup("crio")
    stale = tmp_path / f"var/lib/containers/storage/overlay-containers/{cid}/userdata"
    stale.mkdir(parents=True)
    (stale / "exit").write_text("0")  # the container's previous run, before this init started
    time.sleep(0.05)
    monitor, pid = _start(spawn, group, cid, [sys.executable, "-c", SLEEP])
    init = container_init_of(pid)
    assert init is not None
    records = _records(tmp_path)
    assert runtime_exit(init, records) is None  # stale
    exits = tmp_path / "var/run/crio/exits"
    exits.mkdir(parents=True)
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("0")
    (exits / cid).symlink_to(elsewhere)
    assert runtime_exit(init, records) is None  # a symlink
    (exits / cid).unlink()
    (exits / cid).write_text("0")
    os.chown(exits / cid, 65534, 65534)
    assert runtime_exit(init, records) is None  # not root's
    os.chown(exits / cid, 0, 0)
    found = runtime_exit(init, records)  # the same file, root's and fresh: read
    assert found is not None and (found.exit_code, found.signal, found.path) == (0, None, str(exits / cid))
    (stale / "exit").write_text("137")  # conmon's persist dir, now this run's, with its OOM mark beside it
    (stale / "oom").touch()
    found = runtime_exit(init, records)
    assert found is not None and (found.exit_code, found.signal, found.oom) == (None, 9, True)
    assert found.path == str(stale / "exit") and found.oom_evidence == f"runtime record {stale / 'oom'}"
    os.kill(pid, signal.SIGKILL)
    assert monitor.wait(timeout=10) == 137


def test_dockers_state_of_a_running_or_earlier_run_is_refused(spawn, container_cgroup, tmp_path) -> None:
    group, cid = container_cgroup("docker")
    folder = tmp_path / f"var/lib/docker/containers/{cid}"
    folder.mkdir(parents=True)
    monitor, pid = _start(spawn, group, cid, [sys.executable, "-c", SLEEP], docker_dir=folder)
    init = container_init_of(pid)
    assert init is not None and init.engine == "docker"
    records = _records(tmp_path)
    assert json.loads((folder / "config.v2.json").read_text())["State"]["Running"] is True
    assert runtime_exit(init, records) is None  # written at its start: running
    earlier = {"Running": False, "Restarting": False, "OOMKilled": False, "Pid": 0, "ExitCode": 137,
               "StartedAt": "2020-01-01T00:00:00.5Z", "FinishedAt": "2020-01-01T00:00:01.123456789Z"}
    (folder / "config.v2.json").write_text(json.dumps({"ID": cid, "State": earlier}))
    assert runtime_exit(init, records) is None  # an earlier run's exit, though the file is new
    seconds, frac = divmod(time.time_ns(), 10**9)  # after the init's start; RFC 3339 with an offset
    now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds - 3600)) + f".{frac:09d}-01:00"
    (folder / "config.v2.json").write_text(json.dumps({"ID": cid, "State": {**earlier, "FinishedAt": now,
                                                                           "OOMKilled": True}}))
    found = runtime_exit(init, records)
    assert found is not None and (found.signal, found.oom) == (9, True) and "OOMKilled" in found.oom_evidence
    os.kill(pid, signal.SIGKILL)
    monitor.wait(timeout=10)


def test_the_runtime_is_named_by_the_cgroup_and_containerd_keeps_no_record() -> None:
    from agent.host.containerexits import ContainerInit, _container_in

    cid = "ab" * 32
    for text, engine, path in [
        (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podx.slice/crio-{cid}.scope", "cri-o", None),
        (f"0::/../../kubepods-besteffort-pody.slice/cri-containerd-{cid}.scope", "containerd", None),
        (f"0::/system.slice/docker-{cid}.scope", "docker", None),
        (f"12:memory:/docker/{cid}\n0::/", "docker", f"/docker/{cid}"),  # cgroup v1, cgroupfs driver
        (f"0::/machine.slice/libpod-{cid}.scope/container", "podman", None),
        (f"0::/kubepods/burstable/pod0b1c/{cid}", "", None),  # cgroupfs: the runtime not said
    ]:
        assert _container_in(text) == (cid, engine, path or text[3:]), text
    assert _container_in(f"0::/system.slice/crio-conmon-{cid}.scope") is None  # conmon's own cgroup
    containerd = ContainerInit(pid=1, container_id=cid, engine="containerd", cgroup="", started_unix_nano=1)
    assert record_paths(containerd) == []
    docker = ContainerInit(pid=1, container_id=cid, engine="docker", cgroup="", started_unix_nano=1)
    assert [p.name for p in record_paths(docker)] == ["config.v2.json"]
    assert ProcessConfig().container_exit_records == DEFAULT_RECORDS
    with pytest.raises(ValueError, match="container's id"):
        ProcessConfig(container_exit_records=("/var/run/crio/exits",))
