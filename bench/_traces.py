"""Real torch profiler traces for the trace-import bench, made at bench time.

Owns :func:`torch_trace` (``torch.profiler`` around a small model's training steps on the CPU,
in one of the layouts :data:`TORCH_LAYOUTS`, written by torch's own ``export_chrome_trace``) and
:func:`vllm_trace` (a real vLLM 0.32 CPU server, ``tests/real``'s fixture, profiled through its
``/start_profile`` and ``/stop_profile`` while it serves completions; the trace its worker
writes). Run as a script, :func:`torch_trace` runs in the interpreter given (one with torch).
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: layout name -> ``torch.profiler.profile`` keyword arguments (CPU activity only).
TORCH_LAYOUTS: dict[str, dict[str, bool]] = {
    "torch-cpu": {},
    "torch-stacks": {"with_stack": True},
    "torch-shapes": {"record_shapes": True},
}


def _profile(layout: str, steps: int, out: Path) -> None:
    """In this process: profile ``steps`` training steps of a small MLP, export the trace."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU())], nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 64), torch.randint(0, 8, (16,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **TORCH_LAYOUTS[layout]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("servewatch.bench.step"):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            prof.step()
    prof.export_chrome_trace(str(out))


def torch_trace(layout: str, dest: Path, *, steps: int, timeout_s: float = 1800.0) -> Path:
    """Write a real torch trace of ``layout`` (:data:`TORCH_LAYOUTS`) to ``dest`` (a fresh
    interpreter with torch: this one). Returns ``dest``.

    Raises:
        subprocess.CalledProcessError, subprocess.TimeoutExpired: the profiling run failed.
    """
    subprocess.run([sys.executable, __file__, "--layout", layout, "--steps", str(steps), "--out", str(dest)],
                   check=True, timeout=timeout_s, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=ROOT)  # fmt: skip
    return dest


def vllm_trace(
    dest: Path, *, requests: int = 8, max_tokens: int = 16, max_iterations: int = 32, lock_timeout_s: float = 900.0
) -> tuple[Path | None, str]:
    """A real vLLM trace (gzip JSON, as vLLM writes it), or why there is none.

    Starts ``tests/real``'s vLLM server (TP=1, its cached install; under its machine-wide lock),
    starts the torch profiler over HTTP for at most ``max_iterations`` engine steps, sends
    ``requests`` completions, stops the profiler and
    copies the worker's trace (``rank0.*.pt.trace.json.gz``) to ``dest``. The server is stopped
    whatever happens. Waits at most ``lock_timeout_s`` for another session's server.

    Returns:
        (``dest`` or ``None``, a one-line note: the trace's size, or why none was made).
    """
    sys.path.insert(0, str(ROOT))
    try:
        from tests.real import install as real_install
        from tests.real.server import ServerStartError, VllmServer, server_lock
    except ImportError as exc:  # httpx/psutil missing: not this project's venv
        return None, f"no vLLM trace: {exc}"
    inst = real_install.ready()
    if inst is None:
        return None, "no vLLM trace: the real vLLM install is not ready (tests/real/install.py builds it)"
    import httpx

    try:
        with server_lock(lock_timeout_s):
            return _profile_vllm(VllmServer.start(inst), dest, requests, max_tokens, max_iterations)
    except (TimeoutError, ServerStartError, OSError, httpx.HTTPError) as exc:
        return None, f"no vLLM trace: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _profile_vllm(server: Any, dest: Path, requests: int, max_tokens: int, max_iterations: int) -> tuple[Path | None, str]:
    import httpx

    try:
        with httpx.Client(base_url=server.url, timeout=120.0, trust_env=False) as client:
            # vLLM's /start_profile body: stop by itself after max_iterations engine steps (a
            # with_stack trace of an idle engine loop grows by ~10^5 events a second)
            client.post("/start_profile", json={"max_iterations": max_iterations}).raise_for_status()
            for i in range(requests):
                try:  # the profiler's own stop (after max_iterations) may stall a request on a busy box
                    server.complete(f"request {i}: the quick brown fox", max_tokens=max_tokens, timeout_s=300.0)
                except httpx.HTTPError:
                    break
            try:  # vLLM 0.32 on CPU may answer late (or not at all): the trace file is what counts
                client.post("/stop_profile", timeout=60.0)
            except httpx.HTTPError:
                pass
        src = _settled(server.profile_dir, "rank0*.pt.trace.json*", timeout_s=180.0)
        if src is None:
            return None, f"no vLLM trace: none written to {server.profile_dir}"
        if src.name.endswith(".gz"):
            shutil.copyfile(src, dest)
        else:
            with src.open("rb") as fi, gzip.open(dest, "wb") as fo:
                shutil.copyfileobj(fi, fo)
    finally:
        server.discard()
    return dest, f"vLLM 0.32 CPU worker, tiny Llama, {requests} completions x {max_tokens} tokens, <= {max_iterations} engine steps"


def _settled(folder: Path, pattern: str, *, timeout_s: float) -> Path | None:
    """The newest file matching ``pattern`` once its size held for 2 s, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: tuple[Path, int, float] | None = None
    while time.monotonic() < deadline:
        found = sorted(folder.glob(pattern))
        if found:
            size = found[-1].stat().st_size
            if last is not None and last[0] == found[-1] and last[1] == size:
                if time.monotonic() - last[2] >= 2.0:
                    return found[-1]
            else:
                last = (found[-1], size, time.monotonic())
        time.sleep(0.5)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(TORCH_LAYOUTS), required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    _profile(args.layout, args.steps, args.out)


if __name__ == "__main__":
    main()
