"""agent.host.cudaenv: the one plan of a GPU server's diagnostic environment, shared by
``servewatch launch``, ``servewatch cuda-env`` and the coredump actor."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agent.actors.coredump import CoredumpConfig, core_file_templates
from agent.actors.coredump_target import TargetEnv, read_launch_record, record_launch
from agent.cli.launch import launch_env
from agent.host import cudaenv
from agent.host.cudaenv import (
    COREDUMP_VARIABLES,
    FR_BUFFER_ENV,
    check_dump_dir,
    cuda_coredump_env,
    export_lines,
    flight_recorder_env,
    format_exports,
)


def test_env_sets_sglang_defaults_and_creates_host_dir(tmp_path: Path) -> None:
    plan = cuda_coredump_env(tmp_path / "crash", {"PATH": "/usr/bin"}, host="node-7")
    assert dict(plan.set) == {
        "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
        "CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "1",
        "CUDA_COREDUMP_SHOW_PROGRESS": "1",
        "CUDA_COREDUMP_GENERATION_FLAGS": (
            "skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,"
            "skip_local_memory,skip_constbank_memory"
        ),
        "CUDA_COREDUMP_FILE": f"{tmp_path}/crash/%h/core.cuda.%t.%p",
        "CUDA_COREDUMP_PIPE": "/tmp/corepipe.cuda.%h.%p",
        "SPT_NOENV": "1",  # setproctitle must leave /proc/PID/environ readable
    }
    assert dict(plan.kept) == {}
    assert plan.env["PATH"] == "/usr/bin"
    assert plan.host_dir == tmp_path / "crash" / "node-7"
    assert plan.host_dir.is_dir()


def test_env_never_overrides_user_values(tmp_path: Path) -> None:
    user = {"CUDA_COREDUMP_FILE": "/data/mine/core.%p", "CUDA_COREDUMP_SHOW_PROGRESS": "", "HOME": "/root"}
    plan = cuda_coredump_env(tmp_path, user, host="h")
    assert dict(plan.kept) == {"CUDA_COREDUMP_FILE": "/data/mine/core.%p", "CUDA_COREDUMP_SHOW_PROGRESS": ""}
    assert "CUDA_COREDUMP_FILE" not in plan.set and "CUDA_COREDUMP_SHOW_PROGRESS" not in plan.set
    assert plan.env["CUDA_COREDUMP_FILE"] == "/data/mine/core.%p"
    assert plan.env["CUDA_COREDUMP_SHOW_PROGRESS"] == ""
    assert plan.env["CUDA_ENABLE_USER_TRIGGERED_COREDUMP"] == "1"
    assert user == {"CUDA_COREDUMP_FILE": "/data/mine/core.%p", "CUDA_COREDUMP_SHOW_PROGRESS": "", "HOME": "/root"}


def test_exports_parse_back_in_bash(tmp_path: Path) -> None:
    folder = tmp_path / "it's a \"dir\" $HOME"
    plan = cuda_coredump_env(folder, {"CUDA_COREDUMP_PIPE": "/run/p.%p"}, host="h")
    script = format_exports(plan)
    assert "# kept CUDA_COREDUMP_PIPE (already set)" in script
    out = subprocess.run(
        ["bash", "-c", 'eval "$1"; env -0', "bash", script],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    seen = dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)
    for name, value in plan.set.items():
        assert seen[name] == value
    assert seen["CUDA_COREDUMP_FILE"] == f"{folder}/%h/core.cuda.%t.%p"
    assert "CUDA_COREDUMP_PIPE" not in seen


def test_dump_dir_guard(tmp_path: Path) -> None:
    fresh = tmp_path / "a" / "b"
    ok, reason = check_dump_dir(fresh, min_free_bytes=0)
    assert ok and fresh.is_dir() and "bytes free" in reason
    ok, reason = check_dump_dir(fresh, min_free_bytes=1 << 62)
    assert not ok and "below min_free_bytes" in reason
    blocker = tmp_path / "file"
    blocker.write_text("x")
    ok, reason = check_dump_dir(blocker / "sub", min_free_bytes=0)
    assert not ok and "cannot be created" in reason
    ok, reason = check_dump_dir(blocker, min_free_bytes=0)
    assert not ok and "not a directory" in reason


def test_planning_creates_nothing_unless_asked(tmp_path: Path) -> None:
    plan = cuda_coredump_env(tmp_path / "crash", {}, host="h", create=False)
    assert plan.host_dir == tmp_path / "crash" / "h" and not (tmp_path / "crash").exists()


def test_the_plan_sets_exactly_the_coredump_variables() -> None:
    plan = cuda_coredump_env("/nonexistent/crash", {}, host="h", create=False)
    assert tuple(plan.set) == COREDUMP_VARIABLES
    assert all(getattr(cudaenv, name) in COREDUMP_VARIABLES for name in dir(cudaenv) if name.startswith("ENV_"))


def test_launch_arms_what_the_plan_says_plus_the_flight_recorder(tmp_path: Path) -> None:
    plan = cuda_coredump_env(tmp_path / "crash", {"HOME": "/h"}, host="node", pipe_template="/run/p.%h.%p")
    planned = launch_env({"HOME": "/h"}, crash_dump_folder=tmp_path / "crash", host="node",
                         pipe_template="/run/p.%h.%p", flight_recorder=64)
    assert dict(planned.set) == {**plan.set, **flight_recorder_env({}, buffer_size=64)[0]}
    assert planned.env["HOME"] == "/h" and planned.env[FR_BUFFER_ENV] == "64"


def test_what_launch_records_is_what_the_actor_reads_back(tmp_path: Path) -> None:
    plan = cuda_coredump_env(tmp_path / "crash", {"PATH": "/usr/bin"}, host="node")
    record_launch(tmp_path / "launched", 4242, 1000.5, {**plan.env, FR_BUFFER_ENV: "7"})
    recorded = read_launch_record([tmp_path / "launched"], 4242, 1000.5)
    assert recorded == dict(plan.set)  # the coredump variables only, as planned
    templates = core_file_templates(TargetEnv(values=recorded), CoredumpConfig(folder=tmp_path / "crash"))
    assert templates[0] == plan.set["CUDA_COREDUMP_FILE"] == f"{tmp_path}/crash/%h/core.cuda.%t.%p"


def test_flight_recorder_keeps_the_users_value() -> None:
    assert flight_recorder_env({}) == ({FR_BUFFER_ENV: "2000"}, {})
    assert flight_recorder_env({FR_BUFFER_ENV: "7"}, buffer_size=9) == ({}, {FR_BUFFER_ENV: "7"})
    assert export_lines({FR_BUFFER_ENV: "9"}, {"X": "y"}) == f"export {FR_BUFFER_ENV}=9\n# kept X (already set)\n"
    assert export_lines({}, {}) == ""


def test_cuda_env_prints_the_plan(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "SPT_", "TORCH_FR", "SERVEWATCH_"))}
    env["SERVEWATCH_DATA_DIR"] = str(tmp_path / "data")
    r = subprocess.run([sys.executable, "-m", "agent.cli.app", "cuda-env", "--folder", str(tmp_path / "crash")],
                       env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    plan = cuda_coredump_env(tmp_path / "crash", env, create=False)
    fr_set, fr_kept = flight_recorder_env(env)
    lines = [line for line in r.stdout.splitlines() if not line.startswith("mkdir ")]
    assert lines == (format_exports(plan) + export_lines(fr_set, fr_kept)).splitlines()
