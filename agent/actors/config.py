"""The actors' settings models, one per registered actor (a table of the settings each, named by
the actor's registration line in :mod:`agent.actors`): light, so that the settings load without
importing an actor.

Owns :class:`PySpyConfig` (``[pyspy]``), :class:`FlightRecorderConfig` (``[flightrec]``),
:class:`CoredumpConfig` (``[coredump]``) and :class:`ProfilerConfig` (``[profiler]``, with the
activity rule :func:`activities_problem`). Imports pydantic, :mod:`agent.host.cudaenv` (the CUDA
environment's names), :mod:`agent.early` (py-spy's default binary) and, for types,
:mod:`agent.host.registry` (the agent-wide values a default depends on); never an actor module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agent.early import default_executable
from agent.host.cudaenv import FR_BUFFER_DEFAULT, SGLANG_PIPE_TEMPLATE

if TYPE_CHECKING:
    from agent.host.registry import AgentValues

__all__ = [
    "ACTIVITIES",
    "SGLANG_ONLY_ACTIVITIES",
    "STALL_WINDOW_S",
    "CoredumpConfig",
    "FlightRecorderConfig",
    "ProfilerConfig",
    "PySpyConfig",
    "activities_problem",
]

class PySpyConfig(BaseModel):
    """User settings of the py-spy actor (TOML table ``[pyspy]``, env ``SERVEWATCH_PYSPY__*``).

    Attributes:
        enabled: dump stacks during incidents (default True). ``False`` (SGLang's
            ``SGLANG_PYSPY_DUMP_BEFORE_CRASH=0`` analogue, env ``SERVEWATCH_PYSPY__ENABLED``)
            records each target as ``skipped`` without running py-spy; a dead target is still
            reported as ``dead``.
        executable: path of the py-spy binary; default: the one installed next to the Python
            running servewatch, else ``py-spy`` on ``PATH``. ``None`` (not found) makes every dump
            ``MISSING_TOOL`` and :meth:`PySpyActor.check` ``PERMANENT_ERROR``.
        timeout_s: bound of one py-spy attempt, in seconds (default 10). A hung py-spy is killed
            with its whole process group when it passes.
        native: try ``--native`` first (C/C++/CUDA frames of extensions) and fall back to a plain
            dump when it fails (default True, as SGLang does it).
        nonblocking: pass ``--nonblocking`` (don't pause the target; stacks may be torn). py-spy
            cannot combine it with ``--native``, so it disables ``native`` (default False).
        locals: pass ``--locals`` so the dump files hold each frame's local variables (default
            False: locals can hold secrets and request payloads; never put in span attributes).
        max_concurrency: py-spy processes running at once across all targets (default: twice
            the number of CPUs, at least 8). At least 8 so that every scheduler of a TP8 node is
            sampled at about the same moment (a collective hang reads best from simultaneous
            stacks) and the CPUs stay busy even on a 2-CPU sidecar, where the agent's own event
            loop competes with py-spy to start the next dump. Measured here (py-spy 0.4.3,
            torch-importing targets, ``--native``): a dump costs ~0.1 CPU-second and ~100 MB RSS
            (libtorch's symbols); K=8 on 2 CPUs took 0.54-0.59x the sequential time with 8 at
            once, 0.59-0.64x with 4.
        max_output_bytes: most stdout kept from one attempt, in bytes (default 32 MiB); more is
            read and discarded, and the dump is reported ``FAILED``.
        max_threads: threads summarised in span attributes (default 16); all go to the files.
        max_frames: innermost frames per thread summarised in span attributes (default 5).
        kill_grace_s: bound of the cleanup after a timeout (kill the group, reap it, continue
            the target), in seconds (default 2).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    executable: str | None = Field(
        default_factory=default_executable, json_schema_extra={"shown_default": "py-spy next to this Python, else on PATH"}
    )
    timeout_s: float = Field(default=10.0, gt=0)
    native: bool = True
    nonblocking: bool = False
    locals: bool = False
    max_concurrency: int = Field(
        default_factory=lambda: max(8, 2 * (os.cpu_count() or 1)), ge=1,
        json_schema_extra={"shown_default": "2 per CPU, at least 8"},
    )
    max_output_bytes: int = Field(default=32 * 1024 * 1024, ge=4096)
    max_threads: int = Field(default=16, ge=1)
    max_frames: int = Field(default=5, ge=1)
    kill_grace_s: float = Field(default=2.0, gt=0)


class FlightRecorderConfig(BaseModel):
    """User settings of the Flight Recorder actor."""

    enabled: bool = Field(True, description="read every rank's collective Flight Recorder during an incident")
    timeout_s: float = Field(2.0, gt=0, description="budget of one try of one rank's read, all sources together, seconds (scaled up to 4x with its TORCH_FR_BUFFER_SIZE; a try that runs out is made once more)")
    socket_dir: Path | None = Field(None, description="folder of the SDK sockets (default: the SDK's shm folder)")
    debug_server: bool = Field(True, description="also look for torch's debug worker server on the target's TCP ports")
    nccl_pipe: bool = Field(True, description="also trigger the NCCL debug-info pipe where the target armed it")
    buffer_size: int = Field(
        int(FR_BUFFER_DEFAULT), ge=1, description="TORCH_FR_BUFFER_SIZE armed by launch / cuda-env (user values kept)"
    )


class CoredumpConfig(BaseModel):
    """User configuration of the ``cuda_coredump`` actor (TOML table ``[coredump]``, env ``SERVEWATCH_COREDUMP__*``).

    Attributes:
        enabled: trigger coredumps during incidents. Default ``True`` (targets that were not
            armed simply report ``not_armed``).
        folder: crash-dump folder; core files go to ``{folder}/<host>/core.cuda.<time>.<pid>``
            when servewatch arms the target. Default ``/var/lib/servewatch/cuda_coredumps``.
        pipe_template: ``CUDA_COREDUMP_PIPE`` servewatch sets when arming, and a name the FIFO
            scan accepts. Default SGLang's ``/tmp/corepipe.cuda.%h.%p``.
        min_free_bytes: refuse to trigger when the dump directory has less free space, in
            bytes. Default 2 GiB (a lightweight dump is far smaller; a full one can be GBs).
        trigger_timeout_s: bound on opening and writing the FIFO, in seconds. Default 5.
        consume_timeout_s: the driver must read the trigger (the pipe empty again, ``FIONREAD``)
            within this long, else ``not consumed``, in seconds. Default 1 (a driver thread reads
            it at once).
        start_timeout_s: after the trigger was read, a new core file must appear (or be opened
            by the target) within this long, else ``not started``, in seconds. Default 30.
        stall_timeout_s: a core file the target still holds open whose size has not changed for
            this long is ``stalled at N bytes``, in seconds. Default 20.
        completion_timeout_s: outer bound on waiting for a steadily growing core file, in
            seconds. Default 100, so that ``delay_s + trigger_timeout_s + consume_timeout_s +
            completion_timeout_s`` (:attr:`CoredumpActor.budget_s`, 106 s) fits the incident's
            phase limit (``incident.phase_timeout_s``, 120 s).
        settle_s: the core file counts as complete once its size has not changed for this long
            and the target no longer holds it open, in seconds. Default 2.
        poll_interval_s: how often the core file is checked, in seconds. Default 0.1.
        delay_s: wait this long after the stacks were dumped before triggering (SGLang's
            ``SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS`` analogue: time for in-flight GPU
            work to reach the state worth dumping), in seconds. Default 0, at most 60.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    folder: Path = Field(Path("/var/lib/servewatch/cuda_coredumps"), json_schema_extra={"shown_default": "<data_dir>/cuda_coredumps"})
    pipe_template: str = SGLANG_PIPE_TEMPLATE
    min_free_bytes: int = Field(default=2 * 1024**3, ge=0)
    trigger_timeout_s: float = Field(default=5.0, gt=0)
    consume_timeout_s: float = Field(default=1.0, gt=0)
    start_timeout_s: float = Field(default=30.0, gt=0)
    stall_timeout_s: float = Field(default=20.0, gt=0)
    completion_timeout_s: float = Field(default=100.0, gt=0)
    settle_s: float = Field(default=2.0, ge=0)
    poll_interval_s: float = Field(default=0.1, gt=0)
    delay_s: float = Field(default=0.0, ge=0, le=60)

    def with_agent_values(self, values: AgentValues) -> CoredumpConfig:
        """Core files go beside the bundles (``<data_dir>/cuda_coredumps``) unless a folder was given."""
        if "folder" in self.model_fields_set:
            return self
        return self.model_copy(update={"folder": values.layout.cuda_coredumps})


#: Accepted activities, each backend: ``CUDA_PROFILER`` (cudaProfilerStart/Stop, for nsys) is SGLang's.
ACTIVITIES = ("CPU", "GPU", "MEM", "CUDA_PROFILER")
SGLANG_ONLY_ACTIVITIES = ("CUDA_PROFILER",)
#: Default of ``profiler.stall_window_s``: a session that has not started ends as ``no steps:
#: server stalled`` once its target has had work pending (SDK ``pending > 0``) and taken no
#: forward step for this long, seconds.
STALL_WINDOW_S = 10.0


class ProfilerConfig(BaseModel):
    """User settings of the profiler actor (TOML table ``[profiler]``, env ``SERVEWATCH_PROFILER__*``).

    Attributes:
        backend: ``sdk`` (the SDK control socket of each target, default), ``sglang`` or ``vllm``
            (the server's HTTP endpoints at ``base_url``).
        base_url: the server's HTTP address for ``sglang``/``vllm`` (default
            ``http://127.0.0.1:30000``, SGLang's default port).
        output_dir: where traces are written; ``None`` = the incident bundle folder (incidents)
            or ``./profiles`` (``servewatch profile``). It and every folder above it must be
            root's or the agent's user's, with no folder on the way writable by others without
            the sticky bit and no symlink of another user (never resolved first): else the
            session is ``FAILED`` with the reason. For ``vllm`` set it to the folder vLLM was
            launched with (only read, never created).
        num_steps: forward steps per session for ``servewatch profile`` when ``--steps`` is not given
            (default 5).
        start_step: start once the target's ``forward_ct`` reaches this (default: next step).
        activities: any of ``CPU``, ``GPU``, ``MEM`` and, with the ``sglang`` backend only,
            ``CUDA_PROFILER`` (default CPU and GPU).
        with_stack / record_shapes / profile_memory: torch.profiler options (default off).
        on_incident_steps: profile this many steps after an incident opens; 0 (default) = never.
        max_duration_s: wall-clock bound of one session, seconds (default 60): the SDK ends it
            itself then; the actor stops waiting and sends a stop.
        find_timeout_s: how long to wait for trace files after the session ended, seconds
            (default 30; big traces take a while to export and gzip).
        settle_s: a file counts as complete when its size has not changed for this long,
            seconds (default 0.5).
        poll_interval_s: status/file poll period, seconds (default 0.1).
        request_timeout_s: bound of one control-socket or HTTP request, seconds (default 10;
            SGLang's ``/start_profile`` waits for the scheduler).
        stop_timeout_s: bound of ``POST /stop_profile``, seconds (default 60: vLLM 0.32 answers
            only once its traces are written, 20 s for a 5 s profile on 2 CPU cores).
        vllm_duration_s: how long a ``vllm`` session records before the stop when neither the
            server's trace folder nor its ``/metrics`` can be read, seconds (default 5).
        stall_window_s: a session not yet started ends as ``no steps: server stalled`` once the
            target (``sdk`` backend) has had work pending and taken no forward step for this
            long, seconds (default 10; the watchdog's stall rule, applied to one session).
        socket_dir: folder of the SDK control sockets (default: the SDK's shm folder).
        sdk_profiler: the in-process profiler the ``sdk`` backend asks for: ``torch`` (default)
            or ``mlx`` (a Metal ``.gputrace`` where Metal capture works; elsewhere per-step MLX
            memory counters, and the result says no Metal trace was captured).
    """

    #: agent-wide values set in this table (:class:`~agent.host.registry.AgentValues`): the SDK's
    #: control sockets, where the agent also reads requests in flight and the Flight Recorder
    provides: ClassVar[Mapping[str, str]] = {"sdk_socket_dir": "socket_dir"}
    #: the first example turns the actor on (its defaults leave it off: ``on_incident_steps = 0``)
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra={"examples": [{"on_incident_steps": 3}]})

    backend: Literal["sdk", "sglang", "vllm"] = "sdk"
    base_url: str = "http://127.0.0.1:30000"
    output_dir: Path | None = None
    num_steps: int = Field(default=5, ge=1)
    start_step: int | None = Field(default=None, ge=0)
    activities: tuple[str, ...] = ("CPU", "GPU")
    with_stack: bool = False
    record_shapes: bool = False
    profile_memory: bool = False
    on_incident_steps: int = Field(default=0, ge=0)
    max_duration_s: float = Field(default=60.0, gt=0)
    find_timeout_s: float = Field(default=30.0, gt=0)
    settle_s: float = Field(default=0.5, ge=0)
    poll_interval_s: float = Field(default=0.1, gt=0)
    request_timeout_s: float = Field(default=10.0, gt=0)
    stop_timeout_s: float = Field(default=60.0, gt=0)
    vllm_duration_s: float = Field(default=5.0, gt=0)
    stall_window_s: float = Field(default=STALL_WINDOW_S, gt=0)
    socket_dir: Path | None = None
    sdk_profiler: Literal["torch", "mlx"] = "torch"

    @field_validator("activities", mode="before")
    @classmethod
    def _split_activities(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        out = tuple(str(v).upper() for v in value)
        problem = activities_problem(out, "sglang")
        if problem is not None:
            raise ValueError(f"{problem}, got {list(value)}")
        return out

    @model_validator(mode="after")
    def _backend_activities(self) -> ProfilerConfig:
        problem = activities_problem(self.activities, self.backend)
        if problem is not None:
            raise ValueError(f"activities: {problem}")
        return self


def activities_problem(activities: Sequence[str], backend: str) -> str | None:
    """Why ``activities`` (upper case) cannot be profiled by ``backend``, or ``None`` when they can.

    Returns:
        One phrase (``expected one or more of CPU, GPU, MEM, CUDA_PROFILER (sglang only)``...).
    """
    allowed = [a for a in ACTIVITIES if backend == "sglang" or a not in SGLANG_ONLY_ACTIVITIES]
    bad = [a for a in activities if a not in ACTIVITIES]
    if bad or not activities:
        return "expected one or more of " + ", ".join(
            f"{a} (sglang only)" if a in SGLANG_ONLY_ACTIVITIES else a for a in ACTIVITIES
        ) + ", comma-separated"
    wrong = [a for a in activities if a not in allowed]
    if wrong:
        return f"{', '.join(wrong)} is for the sglang backend only (this one is {backend})"
    return None
