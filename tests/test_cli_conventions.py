"""CLI conventions (issue 13), checked on the installed ``servewatch`` console script.

One stderr line and exit 2 for every usage error (click's own too), ``--version``, help with
plain value names, no folder created by a read-only or failed command, unknown ``SERVEWATCH_*``
variables named, messages without doubled words.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.conftest import PROGRAMS_DIR
from tests.exporters.bundle_fixture import INCIDENT_ID, Bundle, write_bundle

COMMANDS = ("run", "status", "dump", "demo", "cuda-env", "launch", "export", "timeline", "report", "profile")


def _servewatch() -> str:
    """The console script installed beside this interpreter (``pip install -e .`` puts it there)."""
    path = shutil.which("servewatch", path=str(Path(sys.executable).parent)) or shutil.which("servewatch")
    assert path, "the servewatch console script is not installed (pip install -e .)"
    return path


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A private HOME, XDG folders, shm folder and working folder (``cwd``) under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_", "XDG_"))}
    for name in ("home", "cwd"):
        (tmp_path / name).mkdir(exist_ok=True)
    env.update(HOME=str(tmp_path / "home"), SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), **extra)
    env.update({f"XDG_{kind}_HOME": str(tmp_path / "xdg" / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA", "STATE")})
    return env


def sw(tmp_path: Path, *args: str, timeout_s: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = _env(tmp_path, **env)
    return subprocess.run(
        [_servewatch(), *args], check=False, capture_output=True, text=True, timeout=timeout_s, cwd=tmp_path / "cwd",
        env=full_env, stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["dump", "--pidx", "3"], "servewatch: no such option: --pidx"),
        (["dump", "--pid", "abc"], "servewatch: invalid value for '--pid'"),
        (["run", "--pid", "1", "--watchdog-timeout", "soon"], "servewatch: invalid value for '--watchdog-timeout'"),
        (["profile", "--steps", "5", "--activities", "FOO"], "servewatch: invalid --activities 'FOO': expected one or more of"),
        (["run", "--hard-targets"], "servewatch: option '--hard-targets' requires an argument"),
        (["run", "--pid", "1", "--hard-targets", "some"], "servewatch: invalid value for --hard-targets"),
        (["demo", "--tp", "9"], "servewatch: invalid value for '--tp'"),
        (["timeline", "a", "b"], "servewatch: got unexpected extra argument"),
        (["launch"], "servewatch: missing argument"),
        (["nope"], "servewatch: no such command 'nope'"),
        (["--nope"], "servewatch: no such option: --nope"),
        # an empty title glob matches nothing: a mistake (an unset shell variable), not "watch nothing"
        (["run", "--match", ""], "servewatch: invalid value for --match: an empty title glob matches no process"),
        (["dump", "--match", " "], "servewatch: invalid value for --match: an empty title glob matches no process"),
        # one rule for an endpoint given on the command line: it says its scheme
        (["run", "--match", "x", "--otlp-endpoint", "127.0.0.1:4317"],
         "servewatch: invalid value for --otlp-endpoint: the endpoint needs a scheme, e.g. http://127.0.0.1:4317 (plaintext)"),
        (["dump", "--pid", "1", "--otlp-endpoint", "otel:4317"],
         "servewatch: invalid value for --otlp-endpoint: the endpoint needs a scheme, e.g. http://otel:4317 (plaintext)"),
        (["export", "--to", "127.0.0.1:4317"],
         "servewatch: invalid value for --to: the endpoint needs a scheme, e.g. http://127.0.0.1:4317 (plaintext)"),
    ],
)
def test_every_usage_error_is_one_line_and_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    r = sw(tmp_path, *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), r.stderr
    assert r.stdout == ""


def test_bad_value_error_names_the_value_once_and_where_to_look(tmp_path: Path) -> None:
    r = sw(tmp_path, "dump", "--pid", "abc")
    assert r.stderr.count("'abc'") == 1, r.stderr
    assert r.stderr.rstrip().endswith("see 'servewatch dump --help'"), r.stderr


def test_no_arguments_prints_the_help(tmp_path: Path) -> None:
    r = sw(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == sw(tmp_path, "--help").stdout  # what --help prints, where it prints it
    assert r.stdout.startswith("Usage: servewatch") and "Commands:" in r.stdout
    assert r.stderr == ""


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["run", "--bogus"], "servewatch: no such option: --bogus; see 'servewatch run --help'"),
        (["run", "--mach", "x"], "servewatch: no such option: --mach (did you mean --match?); see 'servewatch run --help'"),
        (["dump", "--pidx", "3"], "servewatch: no such option: --pidx (did you mean --pid?); see 'servewatch dump --help'"),
    ],
)
def test_an_unknown_option_suggests_only_a_close_one(tmp_path: Path, args: list[str], line: str) -> None:
    r = sw(tmp_path, *args)
    assert r.returncode == 2
    assert r.stderr == line + "\n"


def test_version_prints_the_installed_version(tmp_path: Path) -> None:
    r = sw(tmp_path, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"servewatch {version('servewatch')}\n"


#: typer's type labels (``<int>``, ``<list[int]>``, ``<int range>``, ``<path>``...).
TYPE_LABEL = re.compile(r"<(?:list\[)?(?:str|int|float|bool|path|Path|text)(?: range)?\]?>")


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_shows_plain_value_names(tmp_path: Path, command: str) -> None:
    r = sw(tmp_path, *([command] if command else []), "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"Usage: servewatch {command}".rstrip()), r.stdout
    assert not TYPE_LABEL.search(r.stdout), TYPE_LABEL.findall(r.stdout)
    if command in ("run", "dump"):
        assert "--pid PID" in r.stdout and "--match GLOB" in r.stdout and "--data-dir DIR" in r.stdout


def test_unknown_servewatch_variable_is_one_warning_line(tmp_path: Path) -> None:
    r = sw(tmp_path, "status", "--data-dir", str(tmp_path / "data"), SERVEWATCH_WATCHDOG__TIMEOUTS="3")
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert warnings == [
        (
            "servewatch: warning: unknown variable SERVEWATCH_WATCHDOG__TIMEOUTS is ignored"
            " (did you mean SERVEWATCH_WATCHDOG__TIMEOUT_S?)"
        )
    ], r.stderr
    assert "SERVEWATCH_SHM_DIR" not in r.stderr  # the SDK's variable (set by _env) is known


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    return write_bundle(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize(
    "args",
    [
        ["cuda-env"],
        ["status"],
        ["timeline"],
        ["report"],
        ["report", "-o", "/nonexistent/servewatch-test/x.html"],
        ["export", "--to", "http://127.0.0.1:1"],
        ["run"],
        ["run", "--pid", "1", "--hard-targets", "some"],
        ["dump"],
        ["dump", "--match", "no-such-title-*"],
        ["launch", "--health-url", "ftp://x/", "--", "true"],
        ["profile", "--steps", "1", "--activities", "XYZ"],
        ["profile", "--steps", "1"],
        ["profile", "--steps", "1", "--pid", "1"],
    ],
)
def test_read_only_and_failed_commands_create_no_folder(tmp_path: Path, args: list[str]) -> None:
    _env(tmp_path)  # the private HOME and working folder exist before
    before = _tree(tmp_path)
    r = sw(tmp_path, *args)
    assert "Traceback" not in r.stderr, r.stderr
    assert _tree(tmp_path) == before, r.stderr
    assert not Path("/nonexistent/servewatch-test").exists()


def test_report_and_timeline_of_a_bundle_write_only_what_was_asked(tmp_path: Path, bundle: Bundle) -> None:
    _env(tmp_path)
    data = str(bundle.data_dir)
    before, data_before = _tree(tmp_path), _tree(bundle.data_dir)
    t = sw(tmp_path, "timeline", INCIDENT_ID, "--data-dir", data)
    assert t.returncode == 0 and INCIDENT_ID in t.stdout, t.stderr
    bad = sw(tmp_path, "report", INCIDENT_ID, "--data-dir", data, "-o", str(tmp_path / "no" / "r.html"))
    assert bad.returncode == 1
    assert bad.stderr == f"servewatch: cannot write '{tmp_path}/no/r.html': No such file or directory\n"
    page = sw(tmp_path, "report", INCIDENT_ID, "--data-dir", data, "-o", "-")
    assert page.returncode == 0, page.stderr
    assert page.stdout.startswith("<!DOCTYPE html>") and INCIDENT_ID in page.stdout
    assert _tree(tmp_path) == before  # no file named "-", no folder "no"
    assert _tree(bundle.data_dir) == data_before


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (["dump"], {"SERVEWATCH_TARGET__PIDS": "[0]"}, "servewatch: invalid setting target.pids.0 from SERVEWATCH_TARGET__PIDS: Input should be greater than 0 (got 0); see 'servewatch dump --help'"),
        (["run"], {"SERVEWATCH_TARGET__PIDS": "1,2"}, "servewatch: invalid setting target.pids from SERVEWATCH_TARGET__PIDS: list values are JSON, e.g. SERVEWATCH_TARGET__PIDS='[1, 2]'; see 'servewatch run --help'"),
        (["run"], {"SERVEWATCH_TARGET__MATCH": "a*,b"}, """servewatch: invalid setting target.match from SERVEWATCH_TARGET__MATCH: list values are JSON, e.g. SERVEWATCH_TARGET__MATCH='["a*", "b"]'; see 'servewatch run --help'"""),
        (["run", "--pid", "1"], {"SERVEWATCH_WATCHDOG__SIGNAL": "SIGFOO"}, "servewatch: invalid setting watchdog.signal from SERVEWATCH_WATCHDOG__SIGNAL: unknown signal 'SIGFOO'; see 'servewatch run --help'"),
        (["dump", "--pid", "1"], {"SERVEWATCH_HOST_NAME": ".."}, "servewatch: invalid setting host_name from SERVEWATCH_HOST_NAME: host name '..' cannot be a folder name; see 'servewatch dump --help'"),
        (["run", "--pid", "1"], {"SERVEWATCH_WATCHDOG__SIGNAL": "foo"}, "servewatch: invalid setting watchdog.signal from SERVEWATCH_WATCHDOG__SIGNAL: unknown signal 'foo'; see 'servewatch run --help'"),
        (["run", "--pid", "1", "--health-url", "ftp://x"], {}, "servewatch: invalid value for --health-url: expected an http(s):// URL, got 'ftp://x'; see 'servewatch run --help'"),
        (["run", "--pid", "1", "--metrics-preset", "foo"], {}, "servewatch: invalid value for --metrics-preset: Input should be 'sglang' or 'vllm' (got 'foo'); see 'servewatch run --help'"),
        (["run", "--pid", "1", "--watchdog-timeout", "-5"], {}, "servewatch: invalid value for --watchdog-timeout: Input should be greater than 0 (got -5.0); see 'servewatch run --help'"),
        (["dump", "--pid", "0"], {}, "servewatch: invalid value for --pid: Input should be greater than 0 (got 0); see 'servewatch dump --help'"),
        (["run", "--pid", "1", "--api-listen", "127.0.0.1:7", "--api-token-file", "/nope"], {}, "servewatch: invalid value for --api-token-file: no such file '/nope'; see 'servewatch run --help'"),
        (["run", "--pid", "1", "--api-listen", "127.0.0.1:7"], {"SERVEWATCH_API__TOKEN_FILE": "/nope"}, "servewatch: invalid setting api.token_file: no such file '/nope'; see 'servewatch run --help'"),
        (["export", "--to", "http://127.0.0.1:1", "/nope"], {}, "servewatch: no such file or folder '/nope'"),
        (["run", "--pid", "1", "--api-listen", "nope"], {}, "servewatch: invalid value for --api-listen: expected HOST:PORT, got 'nope'; see 'servewatch run --help'"),
    ],
)
def test_messages_say_each_thing_once(tmp_path: Path, args: list[str], env: dict[str, str], line: str) -> None:
    r = sw(tmp_path, *args, **env)
    assert r.returncode == 2
    assert r.stderr == line + "\n"


def test_a_toml_setting_is_named_by_its_key_and_says_its_value_once(tmp_path: Path) -> None:
    config = tmp_path / "servewatch.toml"
    config.write_text('[watchdog]\nsignal = "SIGFOO"\n')
    r = sw(tmp_path, "run", "--pid", "1", "--config", str(config))
    assert r.returncode == 2
    assert r.stderr == f"servewatch: invalid setting watchdog.signal in {config}: unknown signal 'SIGFOO'; see 'servewatch run --help'\n"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('data_dir = "x"\n[watchdog]\ntimeout_s = abc\n', "invalid config file '{config}': Invalid value (at line 3, column 13)"),
        ("[watchdog]\ntimeout_s = 'abc'\n", "invalid setting watchdog.timeout_s in {config}: Input should be a valid number"),
        ("[watchdogg]\ntimeout_s = 3\n", "invalid setting watchdogg in {config}: unknown key (did you mean watchdog?)"),
    ],
)
def test_a_config_file_error_names_the_file_the_setting_and_the_help(tmp_path: Path, text: str, says: str) -> None:
    config = tmp_path / "bad1.toml"
    config.write_text(text)
    r = sw(tmp_path, "status", "--config", str(config))
    assert r.returncode == 2
    assert r.stderr.startswith("servewatch: " + says.format(config=config)), r.stderr
    assert r.stderr.endswith("; see 'servewatch status --help'\n") and r.stderr.count("\n") == 1, r.stderr


def test_a_corrupt_status_file_is_named_once(tmp_path: Path) -> None:
    host_dir = tmp_path / "data" / "h"
    host_dir.mkdir(parents=True)
    (host_dir / "status.json").write_text("{x")
    r = sw(tmp_path, "status", "--data-dir", str(tmp_path / "data"), SERVEWATCH_HOST_NAME="h")
    assert r.returncode == 1
    assert r.stderr.startswith(f"servewatch: cannot read {host_dir / 'status.json'}: not valid JSON"), r.stderr
    assert r.stderr.count("status.json") == 1 and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("source", ["flag", "env", "config", "default"])
def test_status_without_an_agent_names_the_data_dir_and_where_it_came_from(tmp_path: Path, source: str) -> None:
    data = tmp_path / "elsewhere"
    config = tmp_path / "servewatch.toml"
    config.write_text(f'data_dir = "{data}"\n')
    args, env, named = {
        "flag": (["--data-dir", str(data)], {}, "--data-dir"),
        "env": ([], {"SERVEWATCH_DATA_DIR": str(data)}, "SERVEWATCH_DATA_DIR"),
        "config": (["--config", str(config)], {}, f"data_dir in {config}"),
        "default": ([], {}, "the default"),
    }[source]
    r = sw(tmp_path, "status", *args, **env)
    assert r.returncode == 1
    shown = "servewatch-data" if source == "default" else str(data)
    assert r.stderr.startswith(f"servewatch: no agent status in data dir '{shown}' (from {named}; expected "), r.stderr
    assert r.stderr.rstrip().endswith("is `servewatch run` using this data dir?") and "--data-dir?" not in r.stderr


def _titled(spawn, python: str, title: str) -> subprocess.Popen[bytes]:
    proc = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), title, "--max-lifetime-s", "60"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    assert ready and proc.stdout.readline().startswith(b"ready"), "target did not start"
    return proc


def test_dump_shows_the_verdict_once(tmp_path: Path, spawn, python: str) -> None:
    prefix = f"convtest{os.getpid()}::scheduler"
    _titled(spawn, python, f"{prefix}_TP0")
    _titled(spawn, python, f"{prefix}_TP1")
    r = sw(tmp_path, "dump", "--match", f"{prefix}_TP*", "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("Verdict:") == 1, r.stdout
    assert "Verdict" not in r.stderr, r.stderr


def test_run_shows_each_blind_watcher_once(tmp_path: Path, spawn) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = spawn(
        [_servewatch(), "run", "--health-url", f"http://127.0.0.1:{port}/health", "--metrics-url",
         f"http://127.0.0.1:{port}/metrics", "--data-dir", str(tmp_path / "data"), "--duration", "100"],
        stderr=subprocess.PIPE, text=True, env=_env(tmp_path), cwd=tmp_path / "cwd",
    )
    lines: list[str] = []
    deadline = time.monotonic() + 90
    assert proc.stderr is not None
    while sum("BLIND" in line for line in lines) < 2 and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 1)
        if ready:
            lines.append(proc.stderr.readline())
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=60)
    text = "".join(lines) + rest
    assert text.count("health: BLIND") == 1 and text.count("metrics: BLIND") == 1, text
    assert "servewatch: health: BLIND — connection refused" in text
    assert "WARNING servewatch.status" not in text


def _options(command: str) -> set[str]:
    import typer

    from agent.cli.app import app

    group = typer.main.get_command(app)
    return {opt for p in group.commands[command].params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("-")}


def test_launch_takes_every_flag_of_run_but_the_target_and_duration() -> None:
    run, launch = _options("run"), _options("launch")
    assert run - launch == {"--pid", "--root-pid", "--duration"}
    assert launch - run == {"--crash-dump-folder", "--mlx"}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--metrics-preset", "tgi"], "servewatch: invalid value for --metrics-preset"),
        (["--hard", "--hard-targets", "some"], "servewatch: invalid value for --hard-targets"),
        (["--cooldown", "0"], "servewatch: invalid value for --cooldown"),
        (["--profile-on-incident", "-1"], "servewatch: invalid value for '--profile-on-incident'"),
        (["--api-listen", "nope"], "servewatch: invalid value for --api-listen: expected HOST:PORT, got 'nope'"),
        (["--api-listen", "127.0.0.1:7207"], "servewatch: invalid setting api.token_file"),
        (["--job", "j", "--peer", "10.0.0.2:7207"], "servewatch: invalid setting api.enabled"),
        (["--otlp-protocol", "smtp"], "servewatch: invalid value for --otlp-protocol"),
        (["--uid", "-1"], "servewatch: invalid value for '--uid'"),
    ],
)
def test_launch_flags_reach_the_same_settings_as_run(tmp_path: Path, args: list[str], expected: str) -> None:
    data = ["--data-dir", str(tmp_path / "data")]
    for command in (["run", *data, "--pid", "1", *args], ["launch", *data, *args, "--", sys.executable, "-c", "raise SystemExit(5)"]):
        r = sw(tmp_path, *command)
        assert r.returncode == 2, (command, r.stderr)
        assert r.stderr.startswith(expected) and len(r.stderr.splitlines()) == 1, (command, r.stderr)
    assert not (tmp_path / "data").exists()


def test_launch_runs_the_server_with_run_s_flags(tmp_path: Path) -> None:
    r = sw(
        tmp_path, "launch", "--data-dir", str(tmp_path / "data"), "--metrics-preset", "vllm", "--uid", str(os.getuid()),
        "--hard-targets", "all", "--cooldown", "10", "--profile-on-incident", "0", "--otlp-protocol", "grpc",
        "--", sys.executable, "-c", "raise SystemExit(0)", timeout_s=120,
    )
    assert r.returncode == 0, r.stderr
    assert "Armed CUDA coredumps" in r.stderr


@pytest.mark.parametrize(
    ("cmd", "line", "rc"),
    [
        (["/nonexistent/cmd"], "servewatch: command not found: '/nonexistent/cmd'", 127),
        (["servewatch-no-such-command"], "servewatch: command not found: 'servewatch-no-such-command'", 127),
        (["/"], "servewatch: command not executable: '/'", 126),
    ],
)
def test_a_launch_that_cannot_start_arms_nothing_and_creates_no_folder(tmp_path: Path, cmd: list[str], line: str, rc: int) -> None:
    _env(tmp_path)  # its home and cwd folders
    before = _tree(tmp_path)
    r = sw(tmp_path, "launch", "--data-dir", str(tmp_path / "x" / "ld"), "--", *cmd)
    assert r.returncode == rc
    assert r.stderr == line + "\n"  # no "Armed ..." for a server that never started
    assert not (tmp_path / "x").exists()
    assert _tree(tmp_path) == before


def test_launch_says_armed_once_the_server_started(tmp_path: Path) -> None:
    r = sw(tmp_path, "launch", "--data-dir", str(tmp_path / "data"), "--", sys.executable, "-c", "print('child up', flush=True)", timeout_s=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "child up\n"
    assert r.stderr.count("servewatch: Armed CUDA coredumps into ") == 1, r.stderr


#: A timestamped logging line (``2026-12-01 03:47:24,480 WARNING servewatch.runtime: ...``).
TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def test_run_logs_warnings_as_servewatch_lines_and_timestamps_only_with_verbose(tmp_path: Path) -> None:
    glob = f"servewatch-test-nothing-{os.getpid()}*"
    # the warning comes with the first discovery, at once: 2 s of watching is plenty (5 s was not needed)
    quiet = sw(tmp_path, "run", "--match", glob, "--data-dir", str(tmp_path / "data"), "--duration", "2", timeout_s=90)
    assert quiet.returncode == 0, quiet.stderr
    lines = quiet.stderr.splitlines()
    assert all(line.startswith("servewatch: ") for line in lines), quiet.stderr
    assert any(line.startswith("servewatch: warning: no target process found yet") for line in lines), quiet.stderr
    loud = sw(tmp_path, "run", "-v", "--match", glob, "--data-dir", str(tmp_path / "data"), "--duration", "2", timeout_s=90)
    assert loud.returncode == 0, loud.stderr
    assert any(TIMESTAMPED.match(line) and "WARNING servewatch." in line for line in loud.stderr.splitlines()), loud.stderr
