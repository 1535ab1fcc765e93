"""`servewatch --help`, `cuda-env`, `timeline` and `dump` import only what they need: never grpc,
torch, httpx or the OpenTelemetry SDK's metrics pipeline and exporters they do not use; `--help`
not even pydantic, anyio or the settings (checked on sys.modules of a real subprocess; speed itself
is measured in bench/bench_cli_start.py)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROGRAMS_DIR

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

#: What `dump` to the embedded span files (no collector configured) must not import: the OTLP
#: network senders, the metrics SDK and its encoders, the Prometheus parser, torch, ctypes (only the
#: long-running agent trims its heap: agent.host.memory loads it at first use).
DUMP_HEAVY = (
    "grpc",
    "ctypes",
    "httpx",
    "torch",
    "prometheus_client",
    "opentelemetry.sdk.metrics",
    "opentelemetry.exporter.otlp.proto.grpc",
    "opentelemetry.exporter.otlp.proto.http",
    "opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder",
    "opentelemetry.proto.collector.metrics",
    "exporters.otlp.metrics_export",
)

#: What the read-only commands (`status`, `timeline`, `report`) must not import: the full settings
#: model (every component's table: incidents, verdict, SDK client, pydantic-settings) and the
#: export pipeline's destination checks. They need the data dir and the host name, nothing more
#: (the protobuf span reader stays: `timeline` enriches the bundle from the span files).
READ_ONLY_HEAVY = ("grpc", "torch", "httpx", "opentelemetry.sdk", "opentelemetry.exporter", "agent.runtime.settings", "pydantic_settings", "agent.incidents.manager", "agent.verdict.rules", "agent.host.sdkclient",
                   "agent.runtime.agent", "agent.actors", "agent.fleet", "exporters.otlp.provider", "exporters.config")

#: What the top-level `--help` must not import: the CLI module and typer are all it needs.
HELP_HEAVY = (*HEAVY, "pydantic", "pydantic_settings", "anyio", "rich", "psutil", "opentelemetry", "agent.runtime.settings", "agent.runtime.agent", "exporters")

# The probe runs the real entry point. Its report is written when the process ends whichever way
# main() ends it: SystemExit, or os._exit (one-shot commands skip the interpreter's teardown).
_PROBE = """
import json, os, sys
args, heavy_prefixes, heavy_names = json.loads(sys.argv[1]), tuple(json.loads(sys.argv[2])), set(json.loads(sys.argv[3]))
sys.argv = ["servewatch", *args]

def report(code):
    heavy = sorted(m for m in sys.modules if m.startswith(heavy_prefixes) or m in heavy_names)
    sys.stdout.flush()
    print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr, flush=True)

real_exit = os._exit
def probe_exit(code):
    report(code)
    real_exit(code)
os._exit = probe_exit
from agent.cli.entry import main
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
report(code)
"""


def _env(tmp_path: Path) -> dict[str, str]:
    """The caller's environment without any collector or servewatch setting (a CI runner's
    OTEL_EXPORTER_OTLP_ENDPOINT would rightly make `dump` import an exporter)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env["SERVEWATCH_SHM_DIR"] = str(tmp_path / "shm")
    return env


def _modules_after(args: list[str], cwd: Path, heavy: tuple[str, ...] = HEAVY, names: tuple[str, ...] = ()) -> dict:
    """What the command ``args`` imported of ``heavy`` (module name prefixes) and ``names``
    (exact module names: ``agent.host.manifest`` but not ``agent.model.manifest_view``)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args), json.dumps(list(heavy)), json.dumps(list(names))],
        capture_output=True, text=True, timeout=120, cwd=cwd, check=False, env=_env(cwd), stdin=subprocess.DEVNULL,
    )
    assert proc.stderr.strip(), f"probe printed nothing (rc {proc.returncode})"
    return json.loads(proc.stderr.strip().splitlines()[-1])


def _titled_target(spawn, title: str) -> int:
    proc = spawn([sys.executable, str(PROGRAMS_DIR / "titled_target.py"), title, "--max-lifetime-s", "60"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    assert ready and proc.stdout.readline().startswith(b"ready"), "target did not start"
    return proc.pid


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


@pytest.mark.parametrize("args", [["--help"], ["-h"], []])
def test_top_level_help_imports_only_the_cli(args: list[str], tmp_path: Path) -> None:
    got = _modules_after(args, tmp_path, HELP_HEAVY)
    assert got["code"] in (0, 2, None)  # no arguments: help on stderr, usage exit
    assert got["heavy"] == []


def test_the_probe_sees_what_a_command_imports(tmp_path: Path) -> None:
    """The probe is not blind: `dump` does import the settings and pydantic (pydantic-settings only
    when a --config or a SERVEWATCH_* setting could matter: PLAIN_DUMP_DEFERRED)."""
    got = _modules_after(["dump", "--pid", "2147483646", "--data-dir", str(tmp_path / "data")], tmp_path,
                         ("pydantic", "agent.runtime.settings"))
    assert got["code"] == 1  # no such process
    assert {"agent.runtime.settings", "pydantic"} <= set(got["heavy"])


def test_dump_to_span_files_and_its_timeline_import_no_exporter_metrics_sdk_or_torch(spawn, tmp_path: Path) -> None:
    # two ranks: a multi-target incident, where a watching agent starts loading torch's analyzer
    pid = _titled_target(spawn, "coldstart::scheduler_TP0")
    pid1 = _titled_target(spawn, "coldstart::scheduler_TP1")
    data = tmp_path / "data"
    got = _modules_after(["dump", "--pid", str(pid), "--pid", str(pid1), "--data-dir", str(data)], tmp_path,
                         (*DUMP_HEAVY, "exporters.otlp.spans"))
    assert got["code"] == 0
    assert got["heavy"] == ["exporters.otlp.spans"]  # it did build spans, through nothing heavier
    host_dir = next(data.iterdir())
    assert list((host_dir / "spans").glob("*.jsonl")), "the dump wrote no span file"
    assert not (host_dir / "metrics").exists()  # one-shot: no MeterProvider, no metrics files
    bundles = list(host_dir.glob(f"*-manual-*/pyspy-{pid}.json"))
    assert bundles, "no stack dump in the bundle"

    # reading that bundle back needs no span pipeline at all: no SDK tracer, no sender
    reader_heavy = (*DUMP_HEAVY, "opentelemetry.sdk.trace", "exporters.otlp.transport", "exporters.otlp.processor", "agent.views.timeline")
    got = _modules_after(["timeline", bundles[0].parent.name, "--data-dir", str(data)], tmp_path, reader_heavy)
    assert got["code"] == 0
    assert got["heavy"] == ["agent.views.timeline"]  # it did render the timeline


def test_status_and_timeline_import_no_settings_model_and_no_component(tmp_path: Path) -> None:
    """Read-only commands took 4-7 s on a loaded host (vs 0.7-2.5 s for --version): they loaded
    the full settings model, which imports every component. They read two settings."""
    data = tmp_path / "data"
    bundle = data / "h1" / "20261201T190000Z-stall-bbbbbb"
    bundle.mkdir(parents=True)
    (bundle / "manifest.json").write_text(json.dumps({
        "schema": "servewatch.incident/1", "incident_id": bundle.name, "trigger": "stall", "detail": "d",
        "host.name": "h1", "trace_id": "", "span_id": "", "opened_time_unix_nano": 10**18,
        "closed_time_unix_nano": 10**18 + 10**9, "duration_s": 1.0, "targets": [], "actions": [], "inflight_requests": 0}))
    (data / "h1" / "status.json").write_text(json.dumps({
        "schema": "servewatch.status/1", "host.name": "h1", "agent_pid": 2147483646, "updated_time_unix_nano": 10**18,
        "watchers": []}))
    for args, code in ((["status", "--data-dir", str(data)], 0),  # another host's agent: taken as running
                       (["timeline", "--data-dir", str(data)], 0),
                       (["timeline", "latest", "--data-dir", str(data)], 0)):
        got = _modules_after(args, tmp_path, READ_ONLY_HEAVY)
        assert (got["code"], got["heavy"]) == (code, []), args


def test_read_only_location_resolves_like_the_full_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The light path (no settings model) gives what the full settings give, or defers to them."""
    from agent.runtime.location import read_only_location
    from agent.runtime.settings import load_settings

    for key in [k for k in os.environ if k.upper().startswith("SERVEWATCH_")]:
        monkeypatch.delenv(key)
    cases = [(None, {}), (tmp_path / "flag", {}), (None, {"SERVEWATCH_DATA_DIR": str(tmp_path / "env")}),
             (tmp_path / "flag", {"SERVEWATCH_DATA_DIR": str(tmp_path / "env"), "SERVEWATCH_HOST_NAME": "h7"})]
    for flag, env in cases:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        full = load_settings({"data_dir": flag})
        assert read_only_location(flag, None) == (full.data_dir, full.host_name), (flag, env)
        for key in env:
            monkeypatch.delenv(key)
    # anything else could matter: the full settings decide (and name every problem)
    assert read_only_location(None, tmp_path / "servewatch.toml") is None
    assert read_only_location(None, None, {"SERVEWATCH_WATCHDOG__TIMEOUTS": "3"}) is None
    assert read_only_location(None, None, {"SERVEWATCH_HOST_NAME": "a/b"}) is None


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


@pytest.mark.parametrize(
    ("args", "one_shot"),
    [
        ([], True),
        (["--help"], True),
        (["--version"], True),
        (["dump", "--pid", "1"], True),
        (["timeline", "x"], True),
        (["cuda-env"], True),
        (["status"], True),
        (["report", "x"], True),
        (["run", "--pid", "1"], False),
        (["launch", "--", "python", "-m", "dump"], False),
        (["profile", "--pid", "1"], False),
        (["export"], False),
        (["demo", "--tp", "1"], False),
    ],
)
def test_only_bounded_commands_skip_the_collector_and_teardown(args: list[str], one_shot: bool) -> None:
    from agent.cli.app import _one_shot

    assert _one_shot(args) is one_shot


def test_in_process_callers_get_system_exit_not_a_process_exit(capsys: pytest.CaptureFixture[str]) -> None:
    import gc

    from agent.cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert "servewatch" in capsys.readouterr().out
    assert gc.isenabled()


#: What no read-only command (`status`, `timeline`, `report`) imports: the event loop, the OTel
#: SDK and its senders, the settings model, the agent's runtime, the
#: event dataclasses (the names a bundle holds are agent.model.kinds').
READ_ONLY_NEVER = ("anyio", "sniffio", "opentelemetry.sdk", "opentelemetry.exporter", "grpc", "httpx", "torch",
                   "pydantic_settings", "agent.runtime.settings", "agent.runtime.agent", "agent.actors", "agent.model.bus",
                   "agent.sdk", "agent.model.events", "exporters.otlp.provider", "exporters.otlp.spans")
#: What no read-only command imports by its exact name: the manifest's pydantic model (a manifest
#: as the agent writes it is read by agent.model.manifest_view; the model only sees any other).
READ_ONLY_NEVER_NAMED = ("agent.host.manifest",)
#: What each needs even less: `status` reads one JSON file (no protobuf, no rich, no
#: exporter); `report` writes HTML and `timeline --json` JSON (no rich); a drawn timeline no
#: rich emoji table (its titles are Text, its console has no emoji codes).
READ_ONLY_ALSO = {"status": ("google.protobuf", "opentelemetry", "rich", "jinja2", "exporters"),
                  "report": ("rich",), "timeline": ("jinja2", "rich._emoji_codes"), "timeline --json": ("jinja2", "rich")}


def test_read_only_commands_import_only_what_they_use(tmp_path: Path) -> None:
    """`status`, `timeline` (terminal and --json) and `report` of a realistic bundle (real py-spy
    stacks, a span file) import none of the runtime: they read files."""
    from tests.exporters.bundle_fixture import HOST, write_bundle

    data = tmp_path / "data"
    bundle = write_bundle(data)
    (data / HOST / "status.json").write_text(json.dumps({
        "schema": "servewatch.status/1", "host.name": HOST, "agent_pid": 2147483646, "updated_time_unix_nano": 10**18,
        "watchers": []}))
    runs = {"status": ["status", "--data-dir", str(data)], "status --json": ["status", "--json", "--data-dir", str(data)],
            "timeline": ["timeline", "latest", "--data-dir", str(data)],
            "timeline --json": ["timeline", "--json", "--data-dir", str(data)],
            "report": ["report", "-o", str(tmp_path / "r.html"), "--data-dir", str(data)]}
    for name, args in runs.items():
        got = _modules_after(args, tmp_path, (*READ_ONLY_NEVER, *READ_ONLY_ALSO.get(name, READ_ONLY_ALSO[name.split()[0]])),
                             READ_ONLY_NEVER_NAMED)
        assert got["heavy"] == [], name
        assert got["code"] in (0, 1), name  # status: 1, its agent is not running
    assert (tmp_path / "r.html").stat().st_size > 0
    assert bundle.bundle_dir.is_dir()


def test_report_renders_the_template_compiled_ahead_and_a_bad_manifest_still_gets_the_model(tmp_path: Path) -> None:
    """`report` loads the page template jinja2 compiled ahead (through jinja2.ModuleLoader: no
    compile at each run), and a manifest that is not as the agent writes it still goes through
    the pydantic model: its one-line error, exit 1."""
    from tests.exporters.bundle_fixture import write_bundle

    data = tmp_path / "data"
    bundle = write_bundle(data)
    got = _modules_after(["report", "-o", str(tmp_path / "r.html"), "--data-dir", str(data)], tmp_path,
                         ("_jinja2_module_templates_",), ("agent.host.manifest",))
    assert got["code"] == 0
    import jinja2

    from agent.views import report

    # jinja2.ModuleLoader's package module (it drops the template's own module once loaded), unless
    # this jinja2 is not the one the template was compiled by (then the source is compiled)
    current = report._COMPILED_STAMP.read_text(encoding="utf-8") == report._stamp(jinja2)
    assert bool([m for m in got["heavy"] if m.startswith("_jinja2_module_templates_")]) is current, got["heavy"]
    assert "agent.host.manifest" not in got["heavy"]

    manifest = bundle.bundle_dir / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"opened_time_unix_nano"', '"opened_time"', 1))
    for args in (["report", "-o", str(tmp_path / "bad.html")], ["timeline"]):
        proc = subprocess.run([sys.executable, "-m", "agent.cli.app", *args, "--data-dir", str(data)], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path, env=_env(tmp_path), stdin=subprocess.DEVNULL, check=False)
        assert proc.returncode == 1, (args, proc.stderr)
        assert proc.stderr.strip().splitlines() == [
            f"servewatch: {manifest}: not a servewatch incident manifest: opened_time_unix_nano: field required"], args
    assert not (tmp_path / "bad.html").exists()


#: What the plain one-shot `servewatch dump --pid N ...` never imports (issue 38: the dump at the
#: import floor): the CLI framework (typer, its vendored click, shellingham) and the command-line
#: module built on it. The console entry runs the plain form without them (agent.cli.common).
PLAIN_DUMP_NEVER = ("typer", "click", "shellingham", "agent.cli.app")

#: What the plain dump does not need when only its flags give settings: pydantic-settings (no
#: --config, no SERVEWATCH_* setting: the settings validate on their plain pydantic base) and, with
#: no ``OTEL_EXPORTER_OTLP_*HEADERS``, the SDK's header parser (regular expressions compiled at import).
PLAIN_DUMP_DEFERRED = ("pydantic_settings", "dotenv", "opentelemetry.util.re")

# As _PROBE, and also what was imported when the py-spy actor claimed the early py-spy run (its
# stacks about to be read): the modules loaded before the stacks are in.
_CLAIM_PROBE = """
import json, os, sys
args, heavy_prefixes = json.loads(sys.argv[1]), tuple(json.loads(sys.argv[2]))
sys.argv = ["servewatch", *args]
from agent import early
at_claim = []
real_claim = early.claim
def claim(argv):
    run = real_claim(argv)
    if run is not None and not at_claim:
        at_claim.append(sorted(m for m in sys.modules if m.startswith(heavy_prefixes)))
    return run
early.claim = claim
real_exit = os._exit
def probe_exit(code):
    heavy = sorted(m for m in sys.modules if m.startswith(heavy_prefixes))
    sys.stdout.flush()
    print(json.dumps({"code": code, "heavy": heavy, "at_claim": at_claim}), file=sys.stderr, flush=True)
    real_exit(code)
os._exit = probe_exit
from agent.cli.entry import main
main()
"""


def test_plain_dump_imports_no_cli_framework_before_or_after_the_stacks(spawn, tmp_path: Path) -> None:
    """The plain `dump --pid N` claims its early py-spy run (the stacks) without typer or the
    CLI module loaded, and never loads them: the same bundle, through agent.cli.common only."""
    pid = _titled_target(spawn, "coldstart::scheduler_TP0")
    data = tmp_path / "data"
    proc = subprocess.run(
        [sys.executable, "-c", _CLAIM_PROBE, json.dumps(["dump", "--pid", str(pid), "--data-dir", str(data)]),
         json.dumps([*PLAIN_DUMP_NEVER, *PLAIN_DUMP_DEFERRED, "agent.cli.common", "agent.actors.pyspy"])],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False, env=_env(tmp_path), stdin=subprocess.DEVNULL,
    )
    got = json.loads(proc.stderr.strip().splitlines()[-1])
    assert got["code"] == 0, proc.stderr
    assert got["at_claim"] == [["agent.actors.pyspy", "agent.cli.common"]], got  # claimed, with no CLI framework loaded
    assert got["heavy"] == ["agent.actors.pyspy", "agent.cli.common"]
    assert list(next(data.iterdir()).glob(f"*-manual-*/pyspy-{pid}.json")), "no stack dump in the bundle"
    assert f"pid {pid}" in proc.stdout and "Errors: 0" in proc.stdout


def test_a_dump_form_typer_must_parse_still_loads_it(tmp_path: Path) -> None:
    """Any other form of `dump` (here --match) goes through typer as before: the probe sees it."""
    got = _modules_after(["dump", "--match", "nothing-is-titled-so-*", "--data-dir", str(tmp_path / "data")], tmp_path,
                         PLAIN_DUMP_NEVER)
    assert got["code"] == 1  # nothing matched
    assert {"typer", "agent.cli.app"} <= set(got["heavy"])


@pytest.mark.parametrize(
    "args",
    [
        ["dump", "--pid", "41"],
        ["dump", "--pid=41", "--pid", "7", "--pid", "41", "--json"],
        ["dump", "-v", "--pid", "007", "--data-dir", "d1", "--data-dir=d2", "--verbose"],
        ["dump", "--otlp-endpoint", "http://127.0.0.1:4317", "--otlp-protocol=grpc", "--pid", "3", "--data-dir", "x=y"],
    ],
)
def test_plain_dump_arguments_are_what_typer_passes(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """plain_dump_args reads a plain `dump` command line exactly as typer does (repeats, the
    last of a repeated option, `--opt=value`, leading zeros)."""
    from agent.cli import app
    from agent.cli.common import plain_dump_args

    seen: list[dict] = []

    def capture(**kwargs: object) -> None:
        seen.append(kwargs)

    monkeypatch.setattr(app, "run_dump", capture)
    with pytest.raises(SystemExit) as exc:
        app.main(args)
    assert exc.value.code == 0
    assert plain_dump_args(args) == seen[0]


@pytest.mark.parametrize(
    "args",
    [
        ["dump"], ["dump", "--help"], ["dump", "--pid", "0"], ["dump", "--pid", "-1"], ["dump", "--pid", "+4"],
        ["dump", "--pid", "4", "--config", "c.toml"], ["dump", "--pid", "4", "--match", "x"], ["dump", "--pid", "4", "--data-dir"],
        ["dump", "--pid", "4", "--data-dir", "--json"], ["dump", "--pid", "4", "--data-dir="], ["dump", "--pid", "4", "-vv"],
        ["dump", "--pid", "4", "--"], ["run", "--pid", "4"], ["--pid", "4", "dump"],
    ],
)
def test_other_dump_forms_are_left_to_typer(args: list[str]) -> None:
    from agent.cli.common import plain_dump_args

    assert plain_dump_args(args) is None


def test_plain_dump_with_an_invalid_setting_says_it_as_typer_does(tmp_path: Path) -> None:
    """An invalid setting in the plain form: the command runs again through typer, whose line
    names the flag and the command's help; the unknown-variable warning is said once."""
    env = {**_env(tmp_path), "SERVEWATCH_NO_SUCH_SETTING": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", "from agent.cli.entry import main; main()", "dump", "--pid", "2147483646",
         "--data-dir", str(tmp_path / "data"), "--otlp-protocol", "bogus"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False, env=env, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "servewatch: warning: unknown variable SERVEWATCH_NO_SUCH_SETTING is ignored (see the settings reference in docs/settings.md)",
        ("servewatch: invalid value for --otlp-protocol: Input should be 'grpc' or 'http/protobuf' (got 'bogus');"
         " see 'servewatch dump --help'"),
    ]
    assert not (tmp_path / "data").exists()


#: What `export --dry-run` (a read-only command: it connects to nothing and writes nothing) must
#: not import: the CLI framework (its plain form runs through agent.cli.common, as the plain dump
#: does), the network senders, the runtime, and, with no --config and no SERVEWATCH_* variable but
#: the location's, the full settings model (pydantic-settings, every component's table, the
#: incident manager and the verdict rules, the stall and start-up rules, the events and the bus).
EXPORT_DRY_RUN_NEVER = (*PLAIN_DUMP_NEVER, "grpc", "httpx", "torch", "rich", "jinja2", "psutil", "anyio", "opentelemetry.sdk.trace",
                        "opentelemetry.sdk.metrics", "opentelemetry.exporter", "pydantic_settings", "agent.runtime.settings",
                        "agent.runtime.agent", "agent.actors", "agent.watchers", "agent.incidents", "agent.verdict",
                        "agent.host.stall", "agent.host.startup", "agent.host.procinfo", "agent.host.exits", "agent.host.targets",
                        "agent.model.events", "agent.model.bus", "agent.sdk")


def test_export_dry_run_imports_no_cli_framework_and_no_runtime(tmp_path: Path) -> None:
    """`export --dry-run` of a data dir with a real span file reads the files and the [export]
    table, nothing more: no typer, no settings model, no incident manager, no events."""
    from tests.exporters.bundle_fixture import write_bundle

    data = tmp_path / "data"
    write_bundle(data)
    got = _modules_after(["export", "--dry-run", "--to", "http://127.0.0.1:4317", "--data-dir", str(data)], tmp_path,
                         EXPORT_DRY_RUN_NEVER)
    assert got == {"code": 0, "heavy": []}


@pytest.mark.parametrize(
    "args",
    [
        ["export", "--dry-run", "--to", "http://127.0.0.1:4317"],
        ["export", "a", "--to=http://h:4318", "--protocol", "http/protobuf", "b", "--dry-run", "--resend", "--remove-sent"],
        ["export", "--data-dir", "d1", "--to", "http://h:1", "--to", "https://h:2", "--data-dir=d2", "x=y"],
        ["export"],
    ],
)
def test_plain_export_arguments_are_what_typer_passes(args: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """plain_export_args reads a plain `export` command line exactly as typer does (PATHs between
    options, the last of a repeated option, `--opt=value`)."""
    from agent.cli import app
    from agent.cli.common import plain_export_args

    seen: list[dict] = []

    def capture(**kwargs: object) -> None:
        seen.append(kwargs)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(app, "run_export", capture)
    with pytest.raises(SystemExit) as exc:
        app.main(args)
    assert exc.value.code == 0
    assert plain_export_args(args) == seen[0]


@pytest.mark.parametrize(
    "args",
    [
        ["export", "--help"], ["export", "--timeout", "3"], ["export", "--config", "c.toml"], ["export", "--to"],
        ["export", "--to="], ["export", "--to", "--dry-run"], ["export", "--dry-run", "--"], ["export", "-"],
        ["export", ""], ["export", "--dry-run", "-x"], ["export", "--data-dir", "a\0b"], ["--dry-run", "export"],
    ],
)
def test_other_export_forms_are_left_to_typer(args: list[str]) -> None:
    from agent.cli.common import plain_export_args

    assert plain_export_args(args) is None


def test_an_unreadable_export_path_is_left_to_typer(tmp_path: Path) -> None:
    """typer refuses a PATH that exists but cannot be read (its own message): the plain form
    leaves that to it; a PATH that does not exist is the command's to say."""
    from agent.cli.common import plain_export_args

    (shut := tmp_path / "shut").mkdir(mode=0o000)
    try:
        if os.access(shut, os.R_OK):
            pytest.skip("running as root: every path is readable")
        assert plain_export_args(["export", str(shut)]) is None
    finally:
        shut.chmod(0o700)
    assert plain_export_args(["export", str(tmp_path / "none")])["paths"] == [tmp_path / "none"]


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--dry-run"], {}),  # no collector endpoint
        (["--dry-run", "--to", "127.0.0.1:4317"], {}),  # no scheme
        (["--dry-run", "--to", "ftp://x"], {}),
        (["--dry-run", "--to", "http://h:1", "--protocol", "bogus"], {}),
        (["--dry-run", "--to", "http://h:1", "no-such-folder"], {}),
        (["--dry-run", "--to", "http://h:1"], {"SERVEWATCH_EXPORT__BATCH_SPANS": "many"}),  # typer says it
        (["--dry-run", "--to", "http://h:1"], {"SERVEWATCH_NO_SUCH_SETTING": "1"}),
        (["--dry-run"], {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4317"}),
        (["--dry-run", "--to", "http://127.0.0.1:4317", "--protocol", "http/protobuf", "--resend"], {}),
    ],
)
def test_plain_export_says_what_typer_says(args: list[str], env: dict[str, str], tmp_path: Path) -> None:
    """The console entry's plain `export` gives the same stdout, stderr lines and exit code as
    the command run through typer, on a bad value, a missing endpoint or path, an invalid
    setting, an unknown variable and a good dry run of a real span file."""
    from tests.exporters.bundle_fixture import write_bundle

    write_bundle(tmp_path / "data")
    runs = [
        subprocess.run([sys.executable, "-c", f"from agent.cli.{mod} import main; main()", "export", *args,
                        "--data-dir", str(tmp_path / "data")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
                       env={**_env(tmp_path), **env}, stdin=subprocess.DEVNULL)
        for mod in ("entry", "app")
    ]
    plain, typer_run = ((r.returncode, r.stdout, r.stderr) for r in runs)
    assert plain == typer_run
    assert plain[0] in (0, 2) and plain[2].strip(), plain


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--dry-run", "--to", "http://127.0.0.1:4317"], {}),
        (["--dry-run"], {}),
        (["--dry-run", "--to", "ftp://x"], {}),
        (["--dry-run"], {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}),
        (["--dry-run"], {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://h:4318/v1/traces", "OTEL_EXPORTER_OTLP_COMPRESSION": "zip"}),
        (["--dry-run", "--to", "http://h:1"], {"SERVEWATCH_HOST_NAME": "a/b"}),
        (["--dry-run", "--to", "http://h:1"], {"SERVEWATCH_HOST_NAME": "other"}),
    ],
)
def test_export_without_the_settings_model_says_what_the_full_settings_say(args: list[str], env: dict[str, str],
                                                                           tmp_path: Path) -> None:
    """`export` with no --config and no other SERVEWATCH_* variable reads the [export] table's
    defaults without the settings model: the same lines and exit code as with the full settings
    (here forced by an empty --config file), OTEL_* variables and a bad host name included."""
    from tests.exporters.bundle_fixture import write_bundle

    write_bundle(tmp_path / "data")
    (empty := tmp_path / "empty.toml").write_text("")
    runs = [
        subprocess.run([sys.executable, "-c", "from agent.cli.entry import main; main()", "export", *args, *more,
                        "--data-dir", str(tmp_path / "data")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
                       env={**_env(tmp_path), **env}, stdin=subprocess.DEVNULL)
        for more in ([], ["--config", str(empty)])
    ]
    light, full = ((r.returncode, r.stdout, r.stderr) for r in runs)
    assert light == full
    assert light[2].strip(), light
