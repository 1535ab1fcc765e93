"""Progress on the real vLLM server (issue 21 item 9): a long chunked prefill produces no token
while the engine steps; the vLLM preset follows engine steps (``vllm:iteration_tokens_total``),
so it is no stall, where generated tokens alone (the old preset) call it one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.real.server import VllmServer

WORDS = "the quick brown fox jumps over the lazy dog and hello world 0 1 2 3 4 5 6 7 8 9 "


def _prompt(server: VllmServer, tokens: int) -> str:
    text = ""
    while server.tokens(text + WORDS) < tokens:
        text += WORDS
    return text


def _watch(server: VllmServer, data_dir: Path, seconds: float, **env: str) -> subprocess.Popen[str]:
    argv = [
        sys.executable, "-m", "agent.entry", "run", "--metrics-url", f"{server.url}/metrics", "--metrics-preset", "vllm",
        "--watchdog-timeout", "3", "--duration", str(seconds), "--no-pyspy", "--data-dir", str(data_dir),
    ]  # fmt: skip
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def _triggers(data_dir: Path) -> list[str]:
    return [json.loads(m.read_text())["trigger"] for m in sorted(data_dir.glob("*/*/manifest.json"))]


def test_a_long_chunked_prefill_is_progress_not_a_stall(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    prompt = _prompt(vllm_tp1, 200)  # 7 prefill-only steps of 32 tokens
    vllm_tp1.slow(delay_s=1.5)  # every forward takes 1.5 s: ~10 s of prefill, no token generated
    before = vllm_tp1.metrics()
    steps = _watch(vllm_tp1, tmp_path / "steps", 16)
    tokens = _watch(vllm_tp1, tmp_path / "tokens", 16, SERVEWATCH_METRICS__COUNTER="vllm:generation_tokens_total")
    try:
        time.sleep(2.0)  # both agents have scraped the idle server
        done: dict = {}
        t = threading.Thread(target=lambda: done.update(vllm_tp1.complete(prompt, max_tokens=1, timeout_s=120)), daemon=True)
        t.start()
        for proc in (steps, tokens):
            proc.wait(timeout=60)
    finally:
        vllm_tp1.clear_fault()
        for proc in (steps, tokens):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    t.join(timeout=60)
    after = vllm_tp1.metrics()
    assert done.get("usage", {}).get("prompt_tokens", 0) >= 180, done

    def count(text: str, name: str) -> float:
        return sum(float(line.rsplit(None, 1)[-1]) for line in text.splitlines() if line.startswith(name + "{"))

    assert count(after, "vllm:iteration_tokens_total_count") - count(before, "vllm:iteration_tokens_total_count") >= 7
    # the old progress series (generated tokens) sees a stall in the same window ...
    assert "stall" in _triggers(tmp_path / "tokens"), tokens.stderr.read() if tokens.stderr else ""
    # ... the engine-step series sees the engine working
    assert _triggers(tmp_path / "steps") == [], steps.stderr.read() if steps.stderr else ""
