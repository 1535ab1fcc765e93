"""Progress on the real vLLM server (issue 21 item 9): a long chunked prefill produces no token
while the engine steps. vLLM 0.32 counts no prefill-only step in any counter (its
``iteration_tokens_total`` observes steps with output), but its scheduler statistics reach
``/metrics`` after every step and each chunk allocates KV blocks: the vLLM preset takes a change
of ``vllm:kv_cache_usage_perc`` as a step, so the prefill is no stall, where generated tokens
alone (the old preset) call it one."""

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


def _watch(server: VllmServer, data_dir: Path, **env: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``servewatch run`` on the server's /metrics (vLLM preset, watchdog 4 s), bounded to 120 s;
    its stderr lines collect in the returned list."""
    argv = [
        sys.executable, "-m", "agent.cli.entry", "run", "--metrics-url", f"{server.url}/metrics", "--metrics-preset", "vllm",
        "--watchdog-timeout", "4", "--duration", "120", "--no-pyspy", "--data-dir", str(data_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, start_new_session=True)  # fmt: skip
    lines: list[str] = []

    def pump() -> None:
        assert proc.stderr is not None
        lines.extend(proc.stderr)  # one line at a time, as the agent writes them

    threading.Thread(target=pump, daemon=True, name=f"stderr-of-{proc.pid}").start()
    return proc, lines


def _ready(lines: list[str], server: VllmServer) -> bool:
    """The agent has scraped the server (its metrics status line says what it reads)."""
    return any(line.startswith("servewatch: metrics: vllm:") and f"from {server.url}/metrics" in line for line in lines)


def _triggers(data_dir: Path) -> list[str]:
    return [json.loads(m.read_text())["trigger"] for m in sorted(data_dir.glob("*/*/manifest.json"))]


def test_a_long_chunked_prefill_is_progress_not_a_stall(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    prompt = _prompt(vllm_tp1, 200)  # 7 prefill-only steps of 32 tokens, a KV block each
    (steps, steps_err) = _watch(vllm_tp1, tmp_path / "steps")
    (tokens, tokens_err) = _watch(vllm_tp1, tmp_path / "tokens", SERVEWATCH_METRICS__COUNTER="vllm:generation_tokens_total")
    done: dict = {}
    try:
        deadline = time.monotonic() + 90
        while not (_ready(steps_err, vllm_tp1) and _ready(tokens_err, vllm_tp1)):
            assert time.monotonic() < deadline, (steps_err, tokens_err)
            time.sleep(0.2)
        vllm_tp1.slow(delay_s=1.5)  # every forward takes 1.5 s: ~10 s of prefill, no token generated
        done.update(vllm_tp1.complete(prompt, max_tokens=1, timeout_s=120))
    finally:
        vllm_tp1.clear_fault()
        for proc in (steps, tokens):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for t in threading.enumerate():  # the stderr pumps end at EOF; then their pipes close
            if t.name in (f"stderr-of-{steps.pid}", f"stderr-of-{tokens.pid}"):
                t.join(timeout=10)
        for proc in (steps, tokens):
            if proc.stderr is not None:
                proc.stderr.close()
    assert done.get("usage", {}).get("prompt_tokens", 0) >= 180, done
    # the old progress series (generated tokens) sees a stall in the same window ...
    assert "stall" in _triggers(tmp_path / "tokens"), "".join(tokens_err)
    # ... the engine's per-step statistics see it working
    assert _triggers(tmp_path / "steps") == [], "".join(steps_err)
