"""Shared helpers of the SDK tests: a small real torch model stepped through agent.sdk.step()."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import agent.sdk as sdk
from agent.sdk import profiler

torch = profiler._import_torch()


class TinyModel:
    """A real (small) torch MLP; ``forward_step()`` runs one batch and counts one step."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        self.x = torch.randn(4, 32)

    def forward_step(self, pending: int = 1) -> int:
        with torch.no_grad():
            self.net(self.x)
        return sdk.step(pending=pending)


def load_trace(path: str | Path) -> dict[str, Any]:
    """Load a (small) torch Chrome trace written by the test."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def profiler_steps(trace: dict[str, Any]) -> list[str]:
    """Names of the ``ProfilerStep#k`` CPU ranges in a trace, in time order."""
    evs = [
        e for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    return [e["name"] for e in sorted(evs, key=lambda e: e["ts"])]


def drain(model: TinyModel, max_steps: int = 50) -> None:
    """Leave the process's profiler idle: cancel a pending session, step a running one out."""
    profiler.request_stop()
    for _ in range(max_steps):
        if profiler.status()["state"] == "idle":
            return
        model.forward_step(pending=0)
    raise AssertionError(f"profiler not idle after {max_steps} steps: {profiler.status()}")
