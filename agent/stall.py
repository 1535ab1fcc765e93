"""The stall rule, "busy and no forward progress for ``watchdog.timeout_s``", and its settings.

Owns :class:`WatchdogConfig` (the ``[watchdog]`` table: the rule's timeout and poll interval,
and hard mode, which the incident logic carries out). Imports pydantic and the standard library
only: the watchers that apply the rule, the incidents and the settings all read it from here.
"""

from __future__ import annotations

import signal as _signal
from typing import Literal

from pydantic import BaseModel, Field, field_validator

__all__ = ["WatchdogConfig"]


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
            last-progress time. Default 1.0.
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
