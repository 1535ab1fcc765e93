"""agent.errors: one exception tree, drawn in its docstring (as httpx's _exceptions.py), that the
modules raising them re-export and the CLI turns into one line and an exit code."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent import errors
from agent.errors import LaunchError, ServewatchError, UsageError, one_line

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "agent.cli.app"]
_TREE_LINE = re.compile(r"^(?P<indent>[ │├└─]*)(?P<name>[A-Z][A-Za-z]+)\b")


def _drawn_tree() -> dict[str, str | None]:
    """name -> parent name, as drawn in agent.errors' docstring."""
    doc = errors.__doc__ or ""
    block = doc.split("The tree::", 1)[1].split("\n\n", 2)[1]
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        m = _TREE_LINE.match(line.strip("\n")[4:])  # the block is indented by 4
        assert m, line
        depth = len(m["indent"])
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[m["name"]] = stack[-1][1] if stack else None
        stack.append((depth, m["name"]))
    return parents


def test_the_docstring_draws_the_real_tree() -> None:
    classes = {n: getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    real = {
        name: next((b.__name__ for b in cls.__bases__ if issubclass(b, ServewatchError)), None)
        for name, cls in classes.items()
    }
    assert _drawn_tree() == real


def test_all_names_are_exported() -> None:
    public = {n for n, v in vars(errors).items() if not n.startswith("_") and getattr(v, "__module__", "") == errors.__name__}
    assert public == set(errors.__all__)


def _exception_classes_defined_outside_errors() -> list[str]:
    found = []
    for folder in ("agent", "exporters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "agent" / "errors.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                    if any(b.endswith(("Error", "Exception")) for b in bases):
                        found.append(f"{path.relative_to(ROOT)}:{node.name}")
    return found


def test_public_exceptions_are_defined_in_one_module() -> None:
    assert _exception_classes_defined_outside_errors() == []


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("agent.runtime.settings", "ConfigError"),
        ("exporters.otlp.provider", "ExportConfigError"),
        ("agent.fleet.config", "TokenFileError"),
        ("agent.cli.launch", "LaunchError"),
        ("agent.host.manifest", "ManifestError"),
        ("agent.views.bundle", "BundleError"),
        ("agent.views.bundle", "BundleNotFoundError"),
        ("agent.views.bundle", "BundleCorruptError"),
        ("agent.fleet.traceparent", "TraceParentError"),
        ("agent.host.sdkclient", "SdkCallError"),
        ("agent.fleet.client", "PeerRequestError"),
        ("agent.sdk.profiler", "ProfilerBusyError"),
        ("agent.sdk.ring", "RingError"),
        ("agent.demo.client", "DemoServerError"),
        ("agent.demo.server", "StartupError"),
        ("agent.host.registry", "UnknownComponentError"),
        ("agent.host.profiletargets", "BackendUnknownError"),
    ],
)
def test_the_raising_modules_re_export_the_tree_s_classes(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_usage_errors_exit_2_others_1_and_builtin_bases_still_catch() -> None:
    assert errors.ConfigError("x").exit_code == errors.ExportConfigError("x").exit_code == UsageError.exit_code == 2
    assert errors.BundleNotFoundError("x").exit_code == errors.SdkError("x").exit_code == ServewatchError.exit_code == 1
    assert LaunchError("gone", exit_code=127).exit_code == 127 and LaunchError.exit_code == 2
    assert isinstance(errors.ConfigError("x"), ValueError) and isinstance(errors.ManifestError("x"), ValueError)
    assert errors.UnknownComponentError("actor", "x", ["pyspy"]).exit_code == 2
    assert str(errors.UnknownComponentError("actor", "x", ["pyspy"])) == "unknown actor 'x': expected one of pyspy"
    assert isinstance(errors.RingError("x"), OSError) and isinstance(errors.ProfilerBusyError("x"), RuntimeError)
    assert one_line(errors.BundleError("a\n  b")) == "a b" and one_line(errors.SdkError()) == "SdkError"


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env["SERVEWATCH_SHM_DIR"] = str(tmp_path / "shm")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, check=False)


def test_the_cli_prints_a_tree_error_as_one_line_with_its_exit_code(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    missing = _cli(tmp_path, "timeline", "no-such-incident", "--data-dir", str(tmp_path / "data"))  # BundleNotFoundError
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and missing.stderr.startswith("servewatch: ") and "no incident bundles" in missing.stderr
    not_found = _cli(tmp_path, "launch", "--data-dir", str(tmp_path / "d"), "--crash-dump-folder", str(tmp_path / "c"),
                     "--", str(tmp_path / "no-such-server"))  # LaunchError, shells' 127
    assert not_found.returncode == 127, not_found.stderr
    assert not_found.stderr.splitlines()[-1] == f"servewatch: command not found: {str(tmp_path / 'no-such-server')!r}"
    assert "Traceback" not in missing.stderr + not_found.stderr
