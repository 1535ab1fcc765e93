"""The ``[target]``, ``[watchdog]`` and ``[startup]`` settings tables (:class:`TargetConfig`,
:class:`WatchdogConfig`, :class:`StartupConfig`), apart from the code that holds them
(:mod:`agent.host.targets`, :mod:`agent.host.stall`, :class:`agent.host.startup.StartupRule`,
which name them too): the settings model loads them without that code and what it imports
(psutil, the events, the bus, the /proc scan), e.g. for ``servewatch export``. Imports pydantic
and the standard library only.
"""

from __future__ import annotations

import signal as _signal
from typing import Literal

from pydantic import BaseModel, Field, PositiveInt, field_validator

__all__ = ["DEFAULT_BUDGET_S", "StartupConfig", "TargetConfig", "WatchdogConfig"]

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


class TargetConfig(BaseModel):
    """Which processes to watch and act on (discovery).

    Any combination: explicit ``pids``, descendants of ``root_pid``, and every process whose
    title matches one of the ``match`` globs (e.g. ``sglang::scheduler*``, ``VLLM::Worker*``).
    """

    # `default=[]`, not `default_factory=list`: pydantic copies a mutable default for each model,
    # and reads a factory's signature (a builtin's is tokenized from its text: ~0.5 ms a field, at
    # every start of every command)
    pids: list[PositiveInt] = Field(default=[], description="explicit target pids")
    root_pid: PositiveInt | None = Field(None, description="watch this pid's descendants (e.g. the server's main process)")
    match: list[str] = Field(default=[], description="process-title globs (fnmatch)")
    uids: list[int] = Field(
        default=[],
        description="the server's real uids: only processes of these (or root) are targets (empty: the uid of root_pid and"
        " pids, else servewatch's own); coredumps of these uids may also go outside coredump.folder",
    )
    any_uid: bool = Field(
        False, description="act on matched processes of any uid (else another user's process titled like a glob is refused)"
    )
    server_tree: bool = Field(
        True,
        description="on a health incident, also dump the rest of each watched server's process tree, each with its"
        " role: its frontend (API server, tokenizer, detokenizer), engine core, DP coordinator and unmatched ranks"
        " (a --match 'sglang::scheduler*' leaves them out; a frontend can be the culprit)",
    )

    @field_validator("match")
    @classmethod
    def _globs_name_something(cls, value: list[str]) -> list[str]:
        """An empty (or blank) glob matches no process title: a mistake (an unset shell
        variable), never a way to watch nothing."""
        if any(not glob.strip() for glob in value):
            raise ValueError("an empty title glob matches no process; give one such as 'sglang::scheduler*'")
        return value
