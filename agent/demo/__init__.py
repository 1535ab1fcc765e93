"""A small real inference server used by ``servewatch demo`` and the tests.

Owns the demo package's public surface: whether torch is available and the one-line message
shown when it is not. Imports only the standard library here, so ``servewatch`` works without
torch; :mod:`agent.demo.server` (frontend), :mod:`agent.demo.scheduler` and
:mod:`agent.demo.model` (torch, inside the scheduler processes) and :mod:`agent.demo.client`
(start/stop it, send requests, inject the fault) hold the rest. Nothing here imports the agent
side: the demo server is a target, not part of servewatch.
"""

from __future__ import annotations

import importlib.util

__all__ = ["TORCH_MISSING_MESSAGE", "torch_available"]

#: One line telling the user how to get torch (CPU wheels are enough for the demo).
TORCH_MISSING_MESSAGE = (
    "servewatch demo needs torch, which is not installed: "
    "pip install 'servewatch[torch]' (or: pip install torch==2.13.0)"
)


def torch_available() -> bool:
    """True when ``import torch`` can succeed (checked without importing it)."""
    return importlib.util.find_spec("torch") is not None
