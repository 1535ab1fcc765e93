"""The ``[watchdog]`` and ``[startup]`` settings tables (:class:`WatchdogConfig`,
:class:`StartupConfig`), apart from the rules that hold them (:mod:`agent.host.stall`,
:class:`agent.host.startup.StartupRule`, which name them too): the settings model loads them
without the rules and what those import (the events, the bus, the /proc scan), e.g. for
``servewatch export``. Imports pydantic and the standard library only.
"""

from __future__ import annotations

import signal as _signal
from typing import Literal

from pydantic import BaseModel, Field, field_validator

__all__ = ["DEFAULT_BUDGET_S", "StartupConfig", "WatchdogConfig"]

#: ``startup.budget_s``'s default, seconds: below vLLM's own wait for its engine cores to start
#: (``VLLM_ENGINE_READY_TIMEOUT_S``, 600 s in vLLM 0.32), after which vLLM raises and takes its
#: engine down, so the evidence is taken while the ranks still live.
DEFAULT_BUDGET_S = 480.0


class StartupConfig(BaseModel):
    """The ``[startup]`` table: the start-up rule (:mod:`agent.host.startup`).

    Attributes:
        budget_s: seconds a server's ranks, seen starting, may take before their first step
            (weight loading, CUDA-graph capture, ``torch.compile``) before it is a
            ``startup_stall`` incident; counted from the oldest rank's creation. Default 480 s,
            below vLLM's own ``VLLM_ENGINE_READY_TIMEOUT_S`` (600 s: then vLLM takes its engine
            down); raise it, with vLLM's, for models that load for longer. 0 turns the rule off.
    """

    budget_s: float = Field(
        default=DEFAULT_BUDGET_S, ge=0,
        description="seconds from a rank's start to its first step (or the server's first HTTP answer) before a"
                    " startup_stall incident; 0: off",
    )


class WatchdogConfig(BaseModel):
    """User settings of the stall watchdog.

    Attributes:
        timeout_s: seconds busy without forward progress before a stall is reported. Default
            300, like SGLang's ``--watchdog-timeout``; a single decode step of a large model
            can take seconds, so keep it well above the slowest legitimate step (and above
            SGLang's own watchdog if you want our evidence first, set it *below* SGLang's).
        poll_interval_s: ceiling in seconds on the time between two readings while waiting
            (idle, warming up, or far from the deadline). Near the deadline the watchdog sleeps
            exactly until it. For a Prometheus source it is also the resolution of the
            last-progress time; while every series of the ``/metrics`` scrape is idle, its wait
            doubles up to 5 s (at most 1/20 of ``timeout_s``), and the first busy scrape after it
            is dated by the open requests. Default 1.0.
        hard: after the stall incident has captured its evidence, send ``signal`` to the
            target (executed by the incident code, not here). Default ``False`` (soft).
        signal: signal name for hard mode, e.g. ``"SIGABRT"`` (default: a core dump and a
            non-zero exit an orchestrator restarts on), ``"SIGKILL"``, ``"SIGTERM"``.
        hard_targets: who hard mode signals: ``"culprit"`` (default: the cross-rank verdict's
            culprit rank(s), never just the rank whose watchdog fired first) or ``"all"``.
    """

    timeout_s: float = Field(default=300.0, gt=0)
    poll_interval_s: float = Field(default=1.0, gt=0)
    hard: bool = False
    signal: str = "SIGABRT"
    hard_targets: Literal["culprit", "all"] = "culprit"

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        name = value.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        if not isinstance(getattr(_signal, name, None), _signal.Signals):
            raise ValueError(f"unknown signal {value!r}")
        return name

    @property
    def signal_number(self) -> int:
        """The hard-mode signal as a number (``signal.Signals``)."""
        return int(getattr(_signal, self.signal))
