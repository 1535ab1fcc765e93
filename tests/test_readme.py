"""Every command block of README.md (and docs/*.md, deploy/README.md) is run by a test, or checked.

Each shell command line of the docs is classified by :data:`CHECKS` (first match wins; a line
no entry matches fails :func:`test_every_documented_command_has_a_check`, so a new README line
needs a check too):

* ``walkthrough`` / ``paged``: run verbatim, in README order, by the two scenarios below, each in
  fresh network, pid and mount namespaces (real ``unshare``) so the README's fixed ports (30000,
  4317), host-wide ``--match`` globs and ``/var/lib/servewatch`` are the scenario's own. Only the
  placeholders ``<scheduler pid>`` and ``<incident-id>`` are filled in.
* ``flags``: needs what this machine has not (a real SGLang/vLLM server, peers, DNS): its argv is
  parsed by the real CLI (every flag and value type checked as ``servewatch`` would) and the
  reason is given.
* ``shell``: not servewatch (docker, kubectl, pip from the network, environment lines): ``bash -n``
  checks its syntax; the reason says what else covers it (``.ci/run`` runs the install and test
  commands, ``tests/deploy`` the manifests and compose file, ``tests/test_cli.py`` ``servewatch demo``).

Every ``servewatch`` argv in the docs (placeholders given example values) is also parsed by the
real CLI. Python blocks are compiled and the SDK names they use must exist; the TOML block is
loaded by the settings loader.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.readme_blocks import ROOT, Command, commands, read_blocks, servewatch_argvs

#: every Markdown doc with command blocks, README first (the scenarios run their lines in this order:
#: the Paged section's traffic lines are the local demo's)
DOCS = ("README.md", "docs/targeting.md", "docs/collector.md", "docs/multi-node.md", "docs/local-demo.md",
        "docs/reference.md", "docs/security.md", "docs/performance.md", "docs/layout.md", "deploy/README.md")
SCENARIO = ROOT / "tests" / "programs" / "readme_scenario.py"

#: (pattern on the bare command, how it is checked, why / what covers it); first match wins
CHECKS: list[tuple[str, str, str]] = [
    # Quick start: the install and test commands are .ci/run's (asserted below); `servewatch demo`
    # itself runs in tests/test_cli.py::test_demo_runs_the_main_job_end_to_end
    (r"^python3 -m venv \.venv && \. \.venv/bin/activate && pip install torch==2\.13\.0 -e \. && servewatch demo$", "shell",
     ".ci/run runs this install; tests/test_cli.py runs `servewatch demo`"),
    (r"^python3 -m venv \.venv && \. \.venv/bin/activate$", "shell", ".ci/run creates the venv the same way"),
    (r"^pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cpu$", "shell",
     "needs download.pytorch.org (no network here); the next line is .ci/run's install"),
    (r"^pip install torch==2\.13\.0 -e \. && servewatch demo$", "shell", ".ci/run's install; tests/test_cli.py runs the demo"),
    (r"^python3 -m venv .* -e \.\[test,mlx\] && python -m pytest$", "shell", "exactly .ci/run's install and test lines"),
    # "Try run, dump and profile on the demo server": all of it, as written
    (r"^python -m agent\.demo\.server --tp 2 --port 30000$", "walkthrough", ""),
    (r"^servewatch run .*--match demo::scheduler\* --watchdog-timeout 10$", "walkthrough", ""),
    (r"127\.0\.0\.1:30000/(generate|debug/hang)", "walkthrough", ""),
    (r"^servewatch profile --steps 5$", "walkthrough", ""),
    (r"^servewatch profile --pid <scheduler pid>", "walkthrough", ""),
    (r"^servewatch dump --match demo::scheduler\*$", "walkthrough", ""),
    (r"^sleep 15; servewatch timeline latest$", "walkthrough", ""),
    (r"^servewatch timeline latest --data-dir \./servewatch-data$", "walkthrough", ""),
    (r"^servewatch report <incident-id> --data-dir \./servewatch-data -o report\.html$", "walkthrough", ""),
    (r"^servewatch export --to http://127\.0\.0\.1:4317 \./servewatch-data$", "walkthrough", ""),
    (r"^servewatch status --json$", "walkthrough", ""),
    # "Paged? Do this", on a server with SGLang's titles (the demo server, --title-prefix sglang)
    (r"^servewatch status --data-dir /var/lib/servewatch$", "paged", ""),
    (r"^servewatch timeline latest --data-dir /var/lib/servewatch$", "paged", ""),
    (r"^servewatch dump --match sglang::scheduler\*( \[--json\])?$", "paged", ""),
    ((r"^servewatch run --health-url http://127\.0\.0\.1:30000/health --metrics-url http://127\.0\.0\.1:30000/metrics "
      r"--match sglang::scheduler\* --watchdog-timeout 120 --profile-on-incident 5$"), "paged", ""),
    (r"^servewatch cuda-env --folder /var/crash/sglang$", "paged", ""),
    (r"localhost:30000/(generate|debug/hang)", "paged", ""),
    # what needs a real SGLang / vLLM / fleet
    (r"^servewatch launch .* -- python -m sglang\.launch_server \.\.\.$", "flags", "needs SGLang installed"),
    (r"^servewatch profile --url http://127\.0\.0\.1:30000 ", "flags",
     "needs SGLang's /start_profile (tests/test_cli_profile.py drives that backend on a fake SGLang)"),
    (r"--metrics-preset vllm --match VLLM::\*$", "flags", "needs a vLLM server (tests/real/ runs the real one)"),
    (r"^servewatch dump --pid 4242 --pid 4243$", "flags", "example pids (the walkthrough dumps real ranks)"),
    (r"^servewatch profile --pid 1234 ", "flags", "example pid (the walkthrough profiles a real rank)"),
    (r"--api-listen 0\.0\.0\.0:7207 .*--peers-dns ", "flags", "needs peers, a token file and DNS (tests/fleet/)"),
    (r"^export OTEL_EXPORTER_OTLP_", "shell", "environment for a fleet collector (tests/exporters check each variable)"),
    (r"^docker compose ", "shell", "needs Docker; tests/deploy validates compose.yaml and the collector configs"),
    (r"^docker (build|push) |^kubectl apply ", "shell", "needs Docker/Kubernetes; tests/deploy validates the manifests"),
    (r"^pytest tests/deploy$", "shell", "the suite runs tests/deploy"),
]


def _all_commands() -> list[Command]:
    return [c for doc in DOCS for b in read_blocks(doc) if b.lang == "bash" for c in commands(b)]


def _check_of(command: Command) -> tuple[str, str]:
    for pattern, how, why in CHECKS:
        if re.search(pattern, command.bare):
            return how, why
    return "", ""


def _commands_for(how: str) -> list[Command]:
    return [c for c in _all_commands() if _check_of(c)[0] == how]


# --- every line has a check; syntax; flags ------------------------------------------------------


def test_every_documented_command_has_a_check() -> None:
    missing = [f"{c.where()}: {c.bare}" for c in _all_commands() if not _check_of(c)[0]]
    assert not missing, "README command lines without a check in tests/test_readme.py CHECKS:\n" + "\n".join(missing)
    assert {_check_of(c)[0] for c in _all_commands()} >= {"walkthrough", "paged", "flags", "shell"}


def test_every_documented_command_is_valid_shell() -> None:
    bash = shutil.which("bash")
    assert bash
    for c in _all_commands():
        r = subprocess.run([bash, "-n", "-c", c.text], check=False, capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, f"{c.where()}: {r.stderr}"


#: example values for the README's placeholders, for the flag check
EXAMPLES = {"<scheduler pid>": "4242", "<incident-id>": "latest"}


def _parse_with_the_cli(argv: list[str]) -> None:
    """Parse ``argv`` (``servewatch ...``) as the CLI does, without running the command: every
    flag must exist and every value convert (click raises a UsageError otherwise)."""
    import typer.main

    from agent.cli.app import app

    group: Any = typer.main.get_command(app)  # typer's own click: a group by its methods
    ctx = group.make_context("servewatch", list(argv[1:]), resilient_parsing=False)
    protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
    name, sub, rest = group.resolve_command(ctx, [*protected, *ctx.args])
    assert sub is not None, name
    sub.make_context(name or "", rest, parent=ctx)


def test_every_servewatch_command_in_the_docs_parses_with_the_real_cli() -> None:
    seen = 0
    for c in _all_commands():
        text = c.text
        for placeholder, value in EXAMPLES.items():
            text = text.replace(placeholder, value)
        for argv in servewatch_argvs(Command(c.block, text, c.line)):
            try:
                _parse_with_the_cli(argv)
            except Exception as exc:  # noqa: BLE001 - typer's vendored click: UsageError, BadParameter, NoSuchOption
                pytest.fail(f"{c.where()}: {' '.join(argv)}: {exc}")
            seen += 1
    assert seen >= 25  # the docs' servewatch lines (a broken extraction finds none)


def test_the_flag_check_fails_on_a_flag_the_cli_does_not_have() -> None:
    with pytest.raises(Exception, match="--watchdog-timeout-s"):
        _parse_with_the_cli(["servewatch", "run", "--watchdog-timeout-s", "5"])
    with pytest.raises(Exception, match="valid integer"):
        _parse_with_the_cli(["servewatch", "profile", "--steps", "five"])


def test_quick_start_install_and_test_commands_are_the_ones_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    (test_line,) = [c for c in _all_commands() if c.bare.endswith("python -m pytest")]
    steps = [s.strip() for s in test_line.text.split("&&")]
    assert steps[0] == "python3 -m venv .venv" and "python3 -m venv .venv" in ci
    assert ". .venv/bin/activate" in ci
    assert 'pip install "torch==2.13.0" -e ".[test,mlx]"' in steps[2] and 'install -q "torch==2.13.0" -e ".[test,mlx]"' in ci
    assert steps[3] == "python -m pytest" and re.search(r"^python -m pytest$", ci, re.MULTILINE)
    demo = [c for c in _all_commands() if c.bare.endswith("servewatch demo")]
    assert len(demo) == 2 and all(c.text.rstrip().endswith("&& servewatch demo") for c in demo)


# --- python and toml blocks -------------------------------------------------------------------


def _blocks(lang: str) -> list[Any]:
    return [b for doc in DOCS for b in read_blocks(doc) if b.lang == lang]


def test_python_blocks_compile_and_use_only_names_the_sdk_has() -> None:
    import agent.sdk
    import agent.sdk.tracing

    blocks = _blocks("python")
    assert len(blocks) >= 3
    for b in blocks:
        tree = ast.parse(b.text, filename=f"{b.doc}:{b.line}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "sw":
                assert hasattr(agent.sdk, node.attr), f"{b.doc}:{b.line}: agent.sdk has no {node.attr}"
            if isinstance(node, ast.ImportFrom) and node.module:
                module = __import__(node.module, fromlist=["_"])
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{b.doc}:{b.line}: {node.module} has no {alias.name}"


def test_the_toml_example_loads_with_the_settings_loader(tmp_path: Path) -> None:
    from agent.runtime.settings import load_settings

    (block,) = _blocks("toml")
    path = tmp_path / "servewatch.toml"
    path.write_text(block.text, encoding="utf-8")
    settings = load_settings(config_file=path)
    assert settings.watchdog.timeout_s == 120 and settings.target.match == ["sglang::scheduler*"]
    assert str(settings.data_dir) == "/var/lib/servewatch"
    # every `# SERVEWATCH_...` comment names the variable of the key on its line
    from agent.runtime.settings import env_names

    names = env_names()
    table = ""
    for line in block.text.splitlines():
        if m := re.match(r"^\[(\w+)\]", line):
            table = m.group(1) + "."
        if m := re.match(r"^(\w+)\s*=.*#\s*(SERVEWATCH_\w+)", line):
            assert names.get(m.group(2)) == table + m.group(1), line


# --- the scenarios: README lines run as written, in namespaces ------------------------------------


def _unshare() -> list[str]:
    path = shutil.which("unshare")
    if path is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux unshare (fresh network/pid/mount namespaces)")
    return [path, "--net", "--pid", "--fork", "--mount-proc", "--mount", "--propagation", "private"]


def _step(command: Command, **extra: Any) -> dict[str, Any]:
    return {"id": _id(command), "cmd": command.text, "line": command.line, **extra}


def _id(command: Command) -> str:
    """A step's id: its doc and line (two docs' commands may share a line number; one id for both
    made the second step's output file truncate the first's, a running `run`'s stderr)."""
    return f"{command.block.doc.replace('/', '_')}-L{command.line}"


def _run_scenario(tmp_path: Path, plan: dict[str, Any], timeout_s: float) -> dict[str, dict[str, Any]]:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    shm = tmp_path / "shm"
    shm.mkdir()
    plan = {"cwd": str(cwd), **plan}
    plan_path, results_path = tmp_path / "plan.json", tmp_path / "results.json"
    plan_path.write_text(json.dumps(plan), encoding="utf-8")
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("SERVEWATCH_DATA_DIR", None)
    r = subprocess.run([*_unshare(), sys.executable, str(SCENARIO), str(plan_path), str(results_path)],
                       check=False, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(results_path.read_text(encoding="utf-8"))
    steps = {s["id"]: s for s in doc["steps"]}
    steps["_"] = {"otlp_spans": doc["otlp_spans"]}
    return steps


def _show(step: dict[str, Any]) -> str:
    return (f"$ {step.get('ran', step['cmd'])}\nrc={step.get('rc')}\n--- stdout\n{step.get('stdout', '')[-4000:]}"
            f"\n--- stderr\n{step.get('stderr', '')[-4000:]}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_walkthrough_runs_as_written_and_really_hangs_the_server(tmp_path: Path) -> None:
    """"Try run, dump and profile on the demo server", line by line, as three terminals would:
    the server, `run` watching it, then every line of the third terminal; the hang really
    happens (the request after /debug/hang), `run` captures it, `timeline latest` shows it, and
    the "Commands for any server" lines read and ship that incident."""
    lines = _commands_for("walkthrough")
    server, watcher = lines[0], lines[1]
    assert "agent.demo.server" in server.text and server.bare.startswith("python -m") and watcher.bare.startswith("servewatch run")
    steps: list[dict[str, Any]] = [
        _step(server, bg=True, ready=r'"scheduler_pids"', timeout_s=90),
        _step(watcher, bg=True, ready=r"process: watching \d+ target process", timeout_s=60),
    ]
    for c in lines[2:]:
        extra: dict[str, Any] = {"timeout_s": 120}
        if c.text.rstrip().endswith("&"):
            extra["timeout_s"] = 10
        if "timeline latest" in c.bare and c.bare.startswith("sleep "):
            # the README's `sleep 15` is a person's wait for the incident: the step waits for it
            # (run's verdict line) instead, then runs the rest of the line as written
            extra["wait"] = {"id": _id(watcher), "pattern": r"^Verdict:", "timeout_s": 90}
            extra["wait_replaces_sleep"] = True
        steps.append(_step(c, **extra))
    results = _run_scenario(tmp_path, {"steps": steps, "stop": [_id(watcher), _id(server)],
                                       "otlp_receiver_port": 4317}, timeout_s=280)
    by_text = {s["cmd"]: s for s in results.values() if "cmd" in s}

    def result(fragment: str) -> dict[str, Any]:
        (step,) = [s for text, s in by_text.items() if fragment in text]
        return step

    first = result('"hello", "max_new_tokens": 4')
    assert first["rc"] == 0 and '"output_ids"' in first["stdout"], _show(first)
    listing = result("servewatch profile --steps 5 ")
    assert listing["rc"] == 2, _show(listing)
    server_info = json.loads(next(line for line in results[_id(server)]["stdout"].splitlines() if "scheduler_pids" in line))
    for pid in server_info["scheduler_pids"]:
        assert str(pid) in listing["stderr"], _show(listing)
    prof = result("--pid <scheduler pid>")
    assert prof["rc"] == 0, _show(prof)
    traces = list((tmp_path / "cwd" / "profiles").rglob("*.json*"))
    assert traces and str(traces[0].name) in prof["stdout"] + prof["stderr"], _show(prof)
    dump = result("servewatch dump --match 'demo::scheduler*'")
    assert dump["rc"] == 0 and "Processes: 2 Errors: 0" in dump["stdout"] + dump["stderr"], _show(dump)
    armed = result("/debug/hang -d")
    assert armed["rc"] == 0 and '"armed": true' in armed["stdout"], _show(armed)
    watch = results[_id(watcher)]
    said = watch["stderr"]  # `run` says what it captured on stderr
    # the hang really happened: `run` opened a stall incident naming rank 1, stuck in its forward
    assert re.search(r"^Verdict: culprit rank 1 \(pid \d+\)", said, re.MULTILINE), _show(watch)
    assert "Incident " in said and "(stall)" in said, _show(watch)
    assert "_injected_hang_in_forward" in said, _show(watch)
    tl = result("; servewatch timeline latest")
    assert tl["waited_s"] is not None and tl["rc"] == 0, _show(tl)
    assert "culprit rank 1" in tl["stdout"] and "_injected_hang_in_forward" in tl["stdout"], _show(tl)
    assert "stall" in tl["stdout"], _show(tl)
    again = result("timeline latest --data-dir ./servewatch-data")
    assert again["rc"] == 0 and "culprit rank 1" in again["stdout"], _show(again)
    rep = result("servewatch report <incident-id>")
    assert rep["rc"] == 0 and (tmp_path / "cwd" / "report.html").is_file(), _show(rep)
    assert "culprit rank 1" in (tmp_path / "cwd" / "report.html").read_text(encoding="utf-8")
    shipped = result("servewatch export --to http://127.0.0.1:4317")
    assert shipped["rc"] == 0 and results["_"]["otlp_spans"] > 0, _show(shipped)
    status = result("servewatch status --json")
    assert status["rc"] in (0, 1), _show(status)
    doc = json.loads(status["stdout"])
    assert doc["agent_running"] is True and doc["incidents"], _show(status)
    # Ctrl-C (SIGINT) stops `run` cleanly, with one line: incidents opened, where the bundles are
    assert watch["rc"] == 0, _show(watch)
    last = said.rstrip().splitlines()[-1]
    assert re.match(r"servewatch: stopped after [^;]*; 1 incident\(s\) written \(1 stall\), last \S+-stall-\S+; bundles in servewatch-data/", last), last


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_paged_do_this_commands_run_as_written_on_a_hung_sglang_shaped_server(tmp_path: Path) -> None:
    """"Paged? Do this" on a hung server with SGLang's scheduler titles (the demo server started
    with ``--title-prefix sglang`` on SGLang's port 30000), an agent keeping its data in
    /var/lib/servewatch (a tmpfs of this mount namespace); the hang is made with the compose
    section's curl lines. The SGLang `run` line of "Usage per server" runs first and must see
    the server (health 200, metrics scraped, both schedulers found by title)."""
    lines = _commands_for("paged")
    sglang_run = next(c for c in lines if c.bare.startswith("servewatch run"))
    traffic = [c for c in lines if "localhost:30000" in c.text]
    paged = [c for c in lines if c not in traffic and c is not sglang_run]
    setup_server = {"id": "server", "cmd": "python -m agent.demo.server --tp 2 --port 30000 --title-prefix sglang",
                    "bg": True, "ready": r'"scheduler_pids"', "timeout_s": 90}
    agent = {"id": "agent", "bg": True, "ready": r"process: watching \d+ target process", "timeout_s": 60,
             "cmd": "servewatch run --data-dir /var/lib/servewatch --health-url http://127.0.0.1:30000/health"
                    " --metrics-url http://127.0.0.1:30000/metrics --match 'sglang::scheduler*' --watchdog-timeout 3"}
    steps: list[dict[str, Any]] = [
        setup_server,
        _step(sglang_run, bg=True, ready=r"process: watching \d+ target process", timeout_s=60),
        # Ctrl-C of that run, and wait (5 s at most) until it exited (gone, or a zombie: the
        # scenario reaps it at the end), not a fixed 3 s (12[0]: not this shell's own command line)
        {"id": "stop-sglang-run", "cmd": "P=$(pgrep -f -- '--watchdog-timeout 12[0]') && kill -INT $P && for p in $P; do"
                                         " for i in $(seq 50); do case $(ps -o stat= -p $p) in Z*|'') break;; esac;"
                                         " sleep 0.1; done; done"},
        agent,
        *[_step(c, timeout_s=30) for c in traffic],
    ]
    steps[-1]["timeout_s"] = 10
    for i, c in enumerate(paged):
        extra: dict[str, Any] = {"timeout_s": 120}
        if i == 0:
            extra["wait"] = {"id": "agent", "pattern": r"^Verdict:", "timeout_s": 90}
        steps.append(_step(c, **extra))
        if "[--json]" in c.text:  # the docs' optional flag: run both forms
            steps[-1]["cmd"] = c.text.replace(" [--json]", "")
            steps.append(_step(c, id=f"{_id(c)}-json", cmd=c.text.replace("[--json]", "--json"), timeout_s=120))
    results = _run_scenario(tmp_path, {"steps": steps, "stop": ["agent", "server"], "tmpfs": ["/var/lib"],
                                       "mkdir": ["/var/lib/servewatch"]}, timeout_s=280)
    first_run = results[_id(sglang_run)]
    assert first_run["ready_s"] is not None, _show(first_run)
    for watcher in ("health: 200 OK", "metrics", "process: watching 2 target processes"):
        assert f"servewatch: {watcher}" in first_run["stderr"], _show(first_run)
    assert "BLIND" not in first_run["stderr"], _show(first_run)
    hung = results["agent"]
    assert re.search(r"^Verdict: culprit rank 1 ", hung["stderr"], re.MULTILINE), _show(hung)
    by_bare = {s["cmd"]: s for s in results.values() if "cmd" in s}
    status = next(s for t, s in by_bare.items() if t.startswith("servewatch status --data-dir /var/lib/servewatch"))
    assert status["rc"] == 1 and "incident" in status["stdout"], _show(status)  # 1: a target is stalled
    tl = next(s for t, s in by_bare.items() if t.startswith("servewatch timeline latest --data-dir /var/lib/servewatch"))
    assert tl["rc"] == 0 and "culprit rank 1" in tl["stdout"], _show(tl)
    assert "_injected_hang_in_forward" in tl["stdout"] and "all_reduce" in tl["stdout"], _show(tl)
    dumps = [s for t, s in by_bare.items() if t.startswith("servewatch dump --match 'sglang::scheduler*'")]
    assert len(dumps) == 3  # "Paged?" line 3, and "Commands for any server" with and without --json
    for d in dumps:
        assert d["rc"] == 0 and "_injected_hang_in_forward" in d["stdout"], _show(d)
    assert any(d["stdout"].lstrip().startswith("{") for d in dumps)
    cuda_env = next(s for t, s in by_bare.items() if t.startswith("servewatch cuda-env"))
    assert cuda_env["rc"] == 0 and "export CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1" in cuda_env["stdout"], _show(cuda_env)


# --- the README is what a user reads; the reference lives in docs/ ---------------------------------


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_the_readme_is_the_users_part_and_every_doc_link_resolves() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 500
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
    checked = 0
    for doc in docs:
        text = doc.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            assert file.exists(), f"{doc.relative_to(ROOT)}: link to {target}: no such file"
            if anchor and file.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", file.read_text(encoding="utf-8"), re.MULTILINE)}
                assert anchor in headings, f"{doc.relative_to(ROOT)}: link to {target}: no such heading"
            checked += 1
    assert checked >= 20
