"""``servewatch profile`` finds its target or says what to pass: candidates when none is given,
the right rank when a frontend's pid is given, the backend asked from the server behind ``--url``;
the traces it reports are private (0600) and the closing line says how to open them."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.host.profiletargets import BackendUnknownError, infer_backend
from tests.conftest import PROGRAMS_DIR
from tests.otlp_receiver import OtlpReceiver
from tests.sdk._helpers import ProgramLauncher, read_line
from tests.test_cli_conventions import sw


@pytest.fixture
def launch(spawn, python: str, tmp_path: Path) -> Iterator[ProgramLauncher]:
    launcher = ProgramLauncher(spawn, python, tmp_path / "shm")  # the shm folder sw() gives the CLI
    yield launcher
    launcher.close()


def _mode(path: str) -> int:
    return stat.S_IMODE(Path(path).stat().st_mode)


def test_no_target_is_a_usage_error_listing_the_candidates(tmp_path: Path, launch: ProgramLauncher) -> None:
    r = sw(tmp_path, "profile", "--steps", "1")
    assert r.returncode == 2
    assert r.stderr.startswith("servewatch: profile needs a target: --pid PID (SDK) or --url URL (SGLang, vLLM); ")
    assert len(r.stderr.splitlines()) == 1, r.stderr
    # an SGLang scheduler (by its title) is a candidate reached through its server's URL
    proc, line = launch.start("titled_target.py", "sglang::scheduler_TP0", "--max-lifetime-s", "60")
    assert line.startswith("ready")
    r = sw(tmp_path, "profile", "--steps", "1")
    assert r.returncode == 2
    assert f"pid {proc.pid} 'sglang::scheduler_TP0' (--url of its server)" in r.stderr, r.stderr
    # and its pid, given as --pid, says to use --url instead of "no such process"
    r = sw(tmp_path, "profile", "--steps", "1", "--pid", str(proc.pid))
    assert r.returncode == 2
    assert r.stderr == (
        f"servewatch: pid {proc.pid} 'sglang::scheduler_TP0' is a SGLang process without the SDK:"
        " profile it with --url of its HTTP server\n"
    )


def test_frontend_pid_names_its_ranks_and_the_only_rank_is_taken_by_default(
    tmp_path: Path, spawn, python: str
) -> None:
    env = {"SERVEWATCH_SHM_DIR": str(tmp_path / "shm")}
    frontend = spawn(
        [python, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))",
         python, str(PROGRAMS_DIR / "profiled_model.py"), "--max-runtime-s", "90"],
        stdout=subprocess.PIPE, env={**os.environ, **env},
    )
    ready = read_line(frontend)
    assert ready.startswith("READY"), ready
    rank = int(ready.split()[1])
    r = sw(tmp_path, "profile", "--steps", "2", "--pid", str(frontend.pid))
    assert r.returncode == 2
    assert r.stderr.startswith(f"servewatch: pid {frontend.pid} "), r.stderr
    assert f" serves no SDK control socket, but its child processes do: pid {rank} " in r.stderr
    assert r.stderr.endswith(f"; profile one of them with --pid {rank}\n") and len(r.stderr.splitlines()) == 1
    # nothing given: the one process serving a control socket is the target
    r = sw(tmp_path, "profile", "--steps", "2", "--activities", "CPU", "--out", "prof", "--json", "--data-dir", "data",
           timeout_s=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["pid"] == rank and result["outcome"] == "ok"
    [trace] = result["artifact_paths"]
    assert _mode(trace) == 0o600  # private, like every file servewatch captures
    assert Path(trace).parent == tmp_path / "cwd" / "prof" and _mode(tmp_path / "cwd" / "prof") == 0o700  # its folder too
    assert r.stderr.rstrip().endswith(f"Open {trace} in https://ui.perfetto.dev (Open trace file) or chrome://tracing")


def test_url_without_backend_asks_the_server(tmp_path: Path, launch: ProgramLauncher) -> None:
    _, line = launch.start("fake_sglang_server.py")
    url = f"http://127.0.0.1:{json.loads(line)['port']}"
    r = sw(tmp_path, "profile", "--url", url, "--steps", "3", "--activities", "CPU", "--out", "prof", "--data-dir", "data",
           timeout_s=120)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == f"servewatch: {url} answers as SGLang"
    [trace] = r.stdout.split()
    assert Path(trace).parent == tmp_path / "cwd" / "prof"
    assert _mode(trace) == 0o600  # SGLang wrote it with its umask (0644): made private
    assert _mode(tmp_path / "cwd" / "prof") == 0o700  # the folder servewatch created for it too
    assert lines[-1].startswith("Profile ok: 1 trace file(s) in ")  # said once, not "1 trace file(s) (1 trace file(s)"
    assert lines[-1].endswith(f"Open {trace} in https://ui.perfetto.dev (Open trace file) or chrome://tracing")


def test_url_of_neither_server_is_one_line(tmp_path: Path, launch: ProgramLauncher) -> None:
    _, line = launch.start("fake_sglang_server.py", "--flavor", "none")
    url = f"http://127.0.0.1:{json.loads(line)['port']}"
    r = sw(tmp_path, "profile", "--url", url, "--steps", "1")
    assert r.returncode == 2
    assert r.stderr == (
        f"servewatch: {url} is neither SGLang (no /get_model_info with a model_path) nor vLLM (no /version):"
        " pass --backend sglang or --backend vllm\n"
    )
    assert not (tmp_path / "cwd" / "profiles").exists()


def test_infer_backend_tells_sglang_from_vllm(launch: ProgramLauncher) -> None:
    for flavor in ("sglang", "vllm"):
        _, line = launch.start("fake_sglang_server.py", "--flavor", flavor)
        assert infer_backend(f"http://127.0.0.1:{json.loads(line)['port']}") == flavor
    with pytest.raises(BackendUnknownError) as info:
        infer_backend("http://127.0.0.1:1", timeout_s=2)
    assert not info.value.reachable and str(info.value).startswith("cannot reach http://127.0.0.1:1: ConnectError")


def test_steps_default_to_the_num_steps_setting_and_the_summary_reads_cleanly(
    tmp_path: Path, launch: ProgramLauncher
) -> None:
    """No ``--steps``: ``profiler.num_steps`` from the environment, else TOML (CLI > env > TOML);
    the closing line lists steps, files and what this torch build skipped as separate clauses."""
    _, line = launch.start("profiled_model.py")
    pid = line.split()[1]
    r = sw(tmp_path, "profile", "--pid", pid, "--out", "prof", "--json", "--data-dir", "data",
           timeout_s=120, SERVEWATCH_PROFILER__NUM_STEPS="3")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["attributes"]["servewatch.profile.steps_captured"] == 3
    # CPU-only torch here: the default GPU activity is skipped, said as its own clause
    assert "(completed: 3 steps, 1 file; GPU activity not supported here, skipped)" in r.stderr, r.stderr
    (tmp_path / "sw.toml").write_text("[profiler]\nnum_steps = 2\n", encoding="utf-8")
    r = sw(tmp_path, "profile", "--pid", pid, "--activities", "CPU", "--out", "prof", "--json", "--data-dir", "data",
           "--config", str(tmp_path / "sw.toml"), timeout_s=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["attributes"]["servewatch.profile.steps_captured"] == 2
    assert "(completed: 2 steps, 1 file); spans in trace " in r.stderr, r.stderr
    r = sw(tmp_path, "profile", "--pid", pid, "--steps", "1", "--activities", "CPU", "--out", "prof", "--json",
           "--data-dir", "data", "--config", str(tmp_path / "sw.toml"), timeout_s=120, SERVEWATCH_PROFILER__NUM_STEPS="3")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["attributes"]["servewatch.profile.steps_captured"] == 1  # the flag wins


def test_bad_activities_name_the_flag_and_every_accepted_value(tmp_path: Path, launch: ProgramLauncher) -> None:
    r = sw(tmp_path, "profile", "--steps", "5", "--activities", "FOO")
    assert r.returncode == 2
    assert r.stderr == (
        "servewatch: invalid --activities 'FOO': expected one or more of CPU, GPU, MEM, CUDA_PROFILER (sglang only),"
        " comma-separated\n"
    )
    _, line = launch.start("profiled_model.py", "--idle")
    r = sw(tmp_path, "profile", "--pid", line.split()[1], "--activities", "cpu,CUDA_PROFILER")
    assert r.returncode == 2
    assert r.stderr == (
        "servewatch: invalid --activities 'cpu,CUDA_PROFILER': CUDA_PROFILER is for the sglang backend only"
        " (this one is sdk)\n"
    )
    settings_doc = (Path(__file__).resolve().parent.parent / "docs" / "settings.md").read_text(encoding="utf-8")
    row = next(x for x in settings_doc.splitlines() if x.startswith("| `profiler.activities` "))
    assert all(f"`{a}`" in row for a in ("CPU", "GPU", "MEM", "CUDA_PROFILER")), row
    assert not (tmp_path / "cwd" / "profiles").exists() and not list((tmp_path / "cwd").iterdir())


def test_a_stalled_rank_ends_the_profile_early_and_a_failed_profile_leaves_no_folder(
    tmp_path: Path, launch: ProgramLauncher
) -> None:
    """Hung in its forward with work pending: ``no steps: server stalled`` after the
    ``profiler.stall_window_s`` window (set to 4 s here), well before the 60 s session bound, exit 1, and neither ``./profiles`` nor the data dir is left behind; an idle
    server (nothing pending) keeps the idle wording."""
    _, line = launch.start("profiled_model.py", "--hang-after-steps", "3")
    pid = line.split()[1]
    r = sw(tmp_path, "profile", "--pid", pid, "--steps", "5", "--out", "./profiles", "--timeout", "100", timeout_s=90,
           SERVEWATCH_PROFILER__STALL_WINDOW_S="4")
    assert r.returncode == 1, r.stderr
    assert "no steps: server stalled (work pending and no forward step for 4 s)" in r.stderr, r.stderr
    assert "idle server" not in r.stderr
    assert list((tmp_path / "cwd").iterdir()) == []  # no ./profiles, no ./servewatch-data
    _, line = launch.start("profiled_model.py", "--idle")
    r = sw(tmp_path, "profile", "--pid", line.split()[1], "--steps", "1", "--out", "a/b", "--timeout", "1",
           timeout_s=90, SERVEWATCH_PROFILER__FIND_TIMEOUT_S="1")
    assert r.returncode == 1, r.stderr
    assert "with 0 steps captured (idle server: no step came, no profiler was started)" in r.stderr, r.stderr
    assert list((tmp_path / "cwd").iterdir()) == []  # a/b removed, a too


def test_ctrl_c_stops_the_session_it_started_and_says_so(tmp_path: Path, launch: ProgramLauncher) -> None:
    """Ctrl-C while `profile` waits for an idle server's next step: exit 130 with one line, and
    the session it asked for is stopped in the server, so the next `profile` is not refused
    as busy (it was, until the SDK's own 60 s bound)."""
    import select
    import signal
    import time

    from tests.test_cli_conventions import _env, _servewatch

    _, line = launch.start("profiled_model.py", "--idle")
    pid = line.split()[1]
    proc = subprocess.Popen([_servewatch(), "profile", "--pid", pid, "--steps", "2", "--out", "prof"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path / "cwd", env=_env(tmp_path))
    try:
        assert proc.stderr is not None
        said = ""
        deadline = time.monotonic() + 60
        while "waiting for the next forward step" not in said and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stderr], [], [], 1)
            if ready:
                said += proc.stderr.readline()
        assert "waiting for the next forward step" in said, said
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 130, rest
    assert f"servewatch: interrupted (SIGINT): the profiling session of pid {pid} was stopped" in rest, rest
    assert "Traceback" not in rest
    r = sw(tmp_path, "profile", "--pid", pid, "--steps", "1", "--out", "prof", "--timeout", "1", timeout_s=90,
           SERVEWATCH_PROFILER__FIND_TIMEOUT_S="1")
    assert "refused (busy)" not in r.stderr, r.stderr
    assert "idle server: no step came" in r.stderr, r.stderr


def test_an_unsupported_http_profile_leaves_no_folder(tmp_path: Path, launch: ProgramLauncher) -> None:
    _, line = launch.start("fake_sglang_server.py", "--no-profile-endpoints")
    url = f"http://127.0.0.1:{json.loads(line)['port']}"
    out = tmp_path / "x" / "pf3"
    r = sw(tmp_path, "profile", "--url", url, "--backend", "sglang", "--steps", "1", "--out", str(out))
    assert r.returncode == 1, r.stderr
    assert "Profile unsupported" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()
    assert list((tmp_path / "cwd").iterdir()) == []  # no ./servewatch-data/<host>/spans


def test_a_failed_profile_is_still_exported_to_a_configured_collector(tmp_path: Path, launch: ProgramLauncher) -> None:
    """With a collector set, the record of a failed session is not lost: its ``profile.session``
    span reaches the collector (over real OTLP/gRPC) saying why; no profile folder is left, and
    the data dir holds only the export spool, as for any export to a collector."""
    receiver = OtlpReceiver().start()
    try:
        _, line = launch.start("profiled_model.py", "--idle")
        r = sw(tmp_path, "profile", "--pid", line.split()[1], "--steps", "1", "--out", "a/b", "--timeout", "1",
               "--otlp-endpoint", receiver.grpc_endpoint, timeout_s=90, SERVEWATCH_PROFILER__FIND_TIMEOUT_S="1")
        assert r.returncode == 1, r.stderr
        assert receiver.wait_for_spans(1, timeout_s=30), r.stderr
        (session,) = [s for s in receiver.spans() if s.name == "profile.session"]
        assert session.attributes["servewatch.outcome"] != "ok"
        assert "idle server" in str(session.attributes), session.attributes
        assert f"spans in trace {session.trace_id}" in r.stderr, r.stderr
        assert [p.name for p in (tmp_path / "cwd").iterdir()] == ["servewatch-data"]  # a/b removed, a too
        assert [p.name for p in (tmp_path / "cwd" / "servewatch-data").glob("*/*")] == ["spool"]
    finally:
        receiver.stop()
