"""The ``[incident]`` settings table (:class:`IncidentConfig`), apart from the incident logic
that holds it (:class:`agent.incidents.manager.IncidentManager`, which names it too): the
settings model loads it without the manager and what the manager imports (the verdict rules,
the manifest, the SDK client), e.g. for ``servewatch export``. Imports pydantic only.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["IncidentConfig"]


class IncidentConfig(BaseModel):
    """User settings of the incident logic."""

    cooldown_s: float = Field(
        300.0, gt=0, description="one incident per server and trigger cause per this many seconds")
    phase_timeout_s: float = Field(
        120.0, gt=0, description="upper bound on one phase (all dumps, all coredumps, ...), seconds"
    )
    on_exit_codes_only_nonzero: bool = Field(
        True, description="a target exiting with code 0 is not an incident (clean shutdown)"
    )
    capture_prompts: bool = Field(False, description="include prompt text in requests.json (off: may hold secrets)")
    operator_stop_is_incident: bool = Field(
        False, description="a target that exits after the operator's signal (forwarded by launch) opens an incident"
    )
    signal_stop_is_incident: bool = Field(
        False, description="a target that exits by SIGTERM or SIGINT (signal 15/2, or exit code 143/130) opens an"
        " incident; off: someone asked it to stop (an orderly shutdown), one log line and no incident"
    )
    hard_mode_exit_is_incident: bool = Field(
        False, description="a target that exits because hard mode signalled it opens a new incident"
    )
    hard_mode_exit_grace_s: float = Field(
        60.0, gt=0, description="after hard mode's signal, exits of that incident's other targets and their process"
        " trees within this many seconds are knock-on exits: recorded on it, no new incident"
    )
    exit_followup_s: float = Field(
        120.0, ge=0, description="a health failure, or a stall of the same server's ranks, within this many seconds"
        " of an exit incident is the same failure: recorded on that incident (logged), no second incident"
    )
    interrupt_grace_s: float = Field(
        10.0, gt=0, description="on SIGTERM/SIGINT, seconds the running phase may take to finish before the incident is cut short"
    )
