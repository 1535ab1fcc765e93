"""Early py-spy runs (agent.early): which command lines start them, that the py-spy actor takes
over the very run it would have started (real py-spy against a real titled process), that a run
nobody claims is killed and reaped with the target left running, and that a hung early run is
bounded by the actor's timeout like its own runs."""

from __future__ import annotations

import json
import os
import select
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent import early
from agent.actors.pyspy import PySpyActor, PySpyConfig
from agent.host.targets import Target, target_of
from agent.model.events import IncidentOpened, Outcome, Trigger
from tests.conftest import PROGRAMS_DIR
from tests.spanfiles import file_spans


@pytest.fixture(autouse=True)
def _no_runs_left() -> Any:
    yield
    early.discard_all()  # a failed test's early runs never outlive it


def _target(spawn, title: str = "sglang::scheduler_TP0") -> int:
    proc = spawn([sys.executable, str(PROGRAMS_DIR / "titled_target.py"), title, "--max-lifetime-s", "90"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and proc.stdout.readline().startswith(b"ready"), "target did not start"
    return proc.pid


def _live(pid: int) -> Target:
    target = target_of(pid)
    assert target is not None
    return target


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2]


@pytest.mark.parametrize(
    ("args", "pids"),
    [
        (["dump", "--pid", "12", "--pid=34"], [12, 34]),
        (["dump", "--pid", "12", "--json", "-v", "--data-dir", "d", "--otlp-endpoint=http://h:4317"], [12]),
        (["dump", "--pid", "12", "--pid", "12"], [12]),
        (["dump", "--pid", "12", "--config", "c.toml"], []),  # a settings file may change [pyspy]
        (["dump", "--root-pid", "12"], []),  # targets come from discovery
        (["dump", "--match", "sglang::*", "--pid", "12"], []),
        (["dump", "--pid", "12", "--uid", "0"], []),
        (["dump", "--pid", "x"], []),
        (["dump", "--pid", "0"], []),
        (["dump", "--pid"], []),
        (["dump", "--pid", "12", "--help"], []),
        (["run", "--pid", "12"], []),
        (["--help"], []),
        ([], []),
    ],
)
def test_only_a_plain_dump_by_pid_starts_early_runs(args: list[str], pids: list[int]) -> None:
    assert early.plan(args, environ={}) == pids


def test_a_pyspy_setting_in_the_environment_means_no_early_run() -> None:
    assert early.plan(["dump", "--pid", "12"], environ={"SERVEWATCH_PYSPY__NATIVE": "false"}) == []
    assert early.plan(["dump", "--pid", "12"], environ={"SERVEWATCH_DATA_DIR": "/x"}) == [12]


def test_early_runs_are_capped_at_the_actors_default_concurrency() -> None:
    args = ["dump", *[a for pid in range(1, 40) for a in ("--pid", str(pid))]]
    assert early.plan(args, environ={}) == list(range(1, early.MAX_EARLY + 1))
    assert early.MAX_EARLY == PySpyConfig().max_concurrency


def test_the_actor_takes_over_the_early_run_of_its_own_argv(spawn, tmp_path: Path) -> None:
    pid = _target(spawn)
    (run,) = early.start(["dump", "--pid", str(pid)])
    actor = PySpyActor()
    assert run.argv == early.pyspy_argv(str(actor.config.executable), pid, native=actor.native_enabled)

    async def main() -> Any:
        opened = IncidentOpened(incident_id="i", trigger=Trigger.MANUAL, detail="t")
        return await actor.dump_all(opened, [_live(pid)], artifact_dir=tmp_path)

    (result,) = anyio.run(main)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.pyspy.early_start"] is True
    assert result.start_time_unix_nano == run.started_unix_ns  # the span covers py-spy's whole run
    assert actor.statistics().attempts == 1 and early.pending() == 0
    assert run.process.returncode == 0  # reaped: the one py-spy process of this dump
    threads = json.loads((tmp_path / f"pyspy-{pid}.json").read_text())
    assert any(f["name"] == "hung_in_fake_allreduce" for t in threads for f in t["frames"])


def test_an_early_run_of_another_argv_is_not_taken_and_is_discarded_with_the_target_running(spawn, tmp_path: Path) -> None:
    pid = _target(spawn)
    (run,) = early.start(["dump", "--pid", str(pid)])
    actor = PySpyActor(PySpyConfig(native=False))  # a setting changed the argv: a run of its own

    async def main() -> Any:
        opened = IncidentOpened(incident_id="i", trigger=Trigger.MANUAL, detail="t")
        return await actor.dump_all(opened, [_live(pid)], artifact_dir=tmp_path)

    (result,) = anyio.run(main)
    assert result.outcome is Outcome.OK, result.detail
    assert "servewatch.pyspy.early_start" not in result.attributes
    assert early.pending() == 0  # the phase's end discarded what nobody claimed
    assert run.process.returncode is not None  # killed (or done) and reaped: no zombie, no orphan
    assert _state(pid) in "RS"  # the target runs on, never left stopped


def test_discard_kills_a_running_early_run_and_reaps_it(spawn, tmp_path: Path) -> None:
    pid = _target(spawn)
    fake = tmp_path / "py-spy"  # a py-spy that hangs: started, never claimed
    fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    (run,) = early.start(["dump", "--pid", str(pid)], exe=str(fake))
    assert run.process.poll() is None
    assert early.discard_all(grace_s=5) == 1
    assert run.process.returncode == -9
    assert _state(pid) in "RS"


def test_a_hung_early_run_is_bounded_by_the_actors_timeout(spawn, tmp_path: Path) -> None:
    pid = _target(spawn)
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    (run,) = early.start(["dump", "--pid", str(pid)], exe=str(fake))
    actor = PySpyActor(PySpyConfig(executable=str(fake), timeout_s=1.0, native=True))

    async def main() -> Any:
        opened = IncidentOpened(incident_id="i", trigger=Trigger.MANUAL, detail="t")
        return await actor.dump_all(opened, [_live(pid)], artifact_dir=tmp_path, timeout_s=1.0)

    t0 = time.monotonic()
    (result,) = anyio.run(main)
    assert result.outcome is Outcome.TIMED_OUT, result.detail
    assert result.attributes["servewatch.pyspy.killed"] is True
    assert result.attributes["servewatch.pyspy.early_start"] is True
    assert run.process.returncode == -9
    assert time.monotonic() - t0 < 30  # bounded (generous: the bound itself is 1 s)


def test_servewatch_dump_by_pid_starts_py_spy_before_its_imports(spawn, tmp_path: Path) -> None:
    """The console entry end to end: the span and manifest say the dump's run started early; the
    same command with a py-spy setting in the environment runs its own."""
    pid = _target(spawn)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), SERVEWATCH_COREDUMP__ENABLED="false")
    for data, extra, expected in (("a", {}, True), ("b", {"SERVEWATCH_PYSPY__TIMEOUT_S": "20"}, None)):
        r = subprocess.run(
            [sys.executable, "-m", "agent.cli.entry", "dump", "--pid", str(pid), "--data-dir", data],
            capture_output=True, text=True, timeout=110, cwd=tmp_path, env={**env, **extra}, stdin=subprocess.DEVNULL, check=False,
        )
        assert r.returncode == 0, r.stderr
        (manifest,) = (tmp_path / data).glob("*/*/manifest.json")
        (action,) = [a for a in json.loads(manifest.read_text())["actions"] if a["action"] == "pyspy.dump"]
        assert action["outcome"] == "ok"
        (span,) = [s for s in file_spans(tmp_path / data) if s["name"] == "pyspy.dump"]
        assert span["attributes"].get("servewatch.pyspy.early_start") is expected
    assert _no_pyspy_left(pid)


def _no_pyspy_left(pid: int) -> bool:
    """No py-spy process still aims at ``pid`` (every run was reaped)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"py-spy") and str(pid).encode() in argv:
                return False
    return True


#: Run by the console entry (agent.cli.entry.main) with early.start replaced: what is imported when
#: the early py-spy runs start, and the pids they would dump.
_AT_START_PROBE = """
import json, sys
from agent import early
def start(args, exe=None):
    print(json.dumps({"pids": early.plan(args), "modules": sorted(sys.modules)}), flush=True)
    raise SystemExit(0)
early.start = start
sys.argv = ["servewatch", *json.loads(sys.argv[1])]
from agent.cli.entry import main
main()
"""

#: What a one-shot dump imports only after its early py-spy runs started: the CLI framework, the
#: settings (pydantic, pydantic-settings), the event loop, process scans, the span pipeline (OTel,
#: protobuf), and (checked apart) every servewatch module but the entry, agent.early and the package.
_AFTER_EARLY = ("typer", "click", "rich", "pydantic", "pydantic_core", "pydantic_settings", "anyio", "psutil",
                "opentelemetry", "google", "grpc", "httpx", "torch")


def test_the_console_entry_starts_py_spy_before_any_import_but_the_standard_library(tmp_path: Path) -> None:
    """A dump's py-spy runs (a torch target: ~0.1 s of symbol reading) start while the
    interpreter has loaded the standard library, agent.cli.entry (and its package's docstring) and agent.early only: everything
    servewatch itself imports (~0.3 CPU-second) overlaps them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    r = subprocess.run(
        [sys.executable, "-c", _AT_START_PROBE, json.dumps(["dump", "--pid", "2147483646", "--data-dir", "d", "--json"])],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["pids"] == [2147483646]  # the probe saw the real start, for a dump it starts
    ours = sorted(m for m in got["modules"] if m == "agent" or m.startswith(("agent.", "exporters")))
    assert ours == ["agent", "agent.cli", "agent.cli.entry", "agent.early"]  # agent.cli: a docstring only
    assert [m for m in got["modules"] if m.split(".")[0] in _AFTER_EARLY] == []
