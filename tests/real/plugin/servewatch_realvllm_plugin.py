"""A vLLM general plugin (entry point group ``vllm.general_plugins``) that injects faults into the
model's forward, inside the real worker processes, and into the EngineCore's own step.

vLLM loads general plugins in every one of its processes (API server, EngineCore, workers). This
one wraps ``LlamaForCausalLM.forward``: before each forward, a worker whose tensor-parallel rank is
selected reads the trigger file named by ``REALVLLM_FAULT_FILE`` and

- ``mode=hang`` (the default): blocks, polling every 50 ms, for as long as the file exists and
  still asks this rank to hang — a forward that never returns while the trigger is there, with
  the real call stack above it (rewriting the file to ``mode=slow`` lets it go on slowly);
- ``mode=slow``: sleeps ``delay_s`` seconds once per forward (a slow step, the engine still steps);
- ``mode=engine_hang``: the forward runs untouched; instead the EngineCore's own busy loop blocks
  (``EngineCore.step`` / ``step_with_batch_queue``, wrapped in the EngineCore process, where vLLM
  calls ``load_general_plugins()`` from ``EngineCore.__init__``): before its next step it polls
  every 50 ms for as long as the file still says ``engine_hang``, its workers idle waiting for
  work (a hang of the engine core itself, with the real busy loop above it);
- ``mode=api_hang``: in the API server (where vLLM loads general plugins while it parses its engine
  arguments), ``OpenAIServingCompletion.create_completion`` (an async handler, run on the API
  server's event loop) first calls a synchronous function that blocks, polling every 50 ms, for as
  long as the file still says ``api_hang``: the event loop answers nothing meanwhile, ``/health`` and
  ``/metrics`` included, while the EngineCore and its workers idle (the shape of vLLM PR #38157: a
  synchronous chat-template render inside an async handler).

- ``mode=load_hang``: in a worker whose tensor-parallel rank is selected, ``LlamaForCausalLM.load_weights``
  first blocks, polling every 50 ms, for as long as the file still says ``load_hang`` (a weight load
  from a hung network filesystem, before the first step: the server does not listen yet; the shape
  of vLLM #17167). Written before ``vllm serve`` starts, it hangs the start-up.

The file holds ``key=value`` lines: ``mode``, ``ranks`` (comma-separated TP ranks, or ``all``, the
default) and ``delay_s``. No file: the forward runs untouched (one ``stat`` per forward).
Installed into the vLLM venv by ``tests/real/install.py``; only test servers set the variable.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

FAULT_FILE_ENV = "REALVLLM_FAULT_FILE"
_POLL_S = 0.05


def _read_fault(path: str) -> dict[str, str] | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    fault: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fault[key.strip()] = value.strip()
    return fault


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialised (no TP group): rank 0
        return 0


def _selected(fault: dict[str, str]) -> bool:
    ranks = fault.get("ranks", "all")
    if ranks in ("", "all"):
        return True
    return _tp_rank() in {int(r) for r in ranks.split(",") if r.strip()}


def fault_point(path: str) -> None:
    """Apply the fault the trigger file describes to this forward, if this rank is selected."""
    fault = _read_fault(path)
    if fault is None or fault.get("mode", "hang") not in ("hang", "slow") or not _selected(fault):
        return
    if fault.get("mode", "hang") == "slow":
        time.sleep(float(fault.get("delay_s", "1.0")))
        return
    while True:  # until the file is gone, or no longer asks this rank to hang
        time.sleep(_POLL_S)
        now = _read_fault(path)
        if now is None or now.get("mode", "hang") != "hang" or not _selected(now):
            return


def engine_fault_point(path: str) -> None:
    """Block the EngineCore's step while the trigger file says ``mode=engine_hang`` (polling every
    50 ms: released within 50 ms of the file's removal or rewrite)."""
    fault = _read_fault(path)
    if fault is None or fault.get("mode") != "engine_hang":
        return
    while True:
        time.sleep(_POLL_S)
        now = _read_fault(path)
        if now is None or now.get("mode") != "engine_hang":
            return


def api_fault_point(path: str) -> None:
    """Block the calling thread (the API server's event loop) while the trigger file says
    ``mode=api_hang`` (polling every 50 ms)."""
    fault = _read_fault(path)
    if fault is None or fault.get("mode") != "api_hang":
        return
    while True:
        time.sleep(_POLL_S)
        now = _read_fault(path)
        if now is None or now.get("mode") != "api_hang":
            return


def load_fault_point(path: str) -> None:
    """Block the weight load while the trigger file says ``mode=load_hang`` for this rank
    (polling every 50 ms)."""
    fault = _read_fault(path)
    if fault is None or fault.get("mode") != "load_hang" or not _selected(fault):
        return
    while True:
        time.sleep(_POLL_S)
        now = _read_fault(path)
        if now is None or now.get("mode") != "load_hang" or not _selected(now):
            return


def _wrap_api_completions(path: str) -> None:
    """Wrap ``OpenAIServingCompletion.create_completion`` (looked up on the class at each request),
    in the API server only: the process vLLM has not retitled (``VLLM::EngineCore`` and
    ``VLLM::Worker_TP<i>`` are titled before they load the plugins)."""
    # the title as the kernel shows it: importing setproctitle here would set it up in the API
    # server too, which clobbers that process's own command line (vllm serve ... --profiler-config)
    try:
        with open("/proc/self/cmdline", "rb") as fh:
            if b"::" in fh.read().split(b"\0", 1)[0]:
                return
    except OSError:
        return
    try:
        from vllm.entrypoints.openai.completion import serving
    except Exception:  # noqa: BLE001 - another layout: nothing to wrap
        return
    cls: Any = serving.OpenAIServingCompletion
    inner = getattr(cls, "create_completion", None)
    if inner is None or getattr(inner, "_servewatch_fault", False):
        return

    @functools.wraps(inner)
    async def create_completion(self: Any, *args: Any, **kwargs: Any) -> Any:
        api_fault_point(path)  # synchronous, on the event loop
        return await inner(self, *args, **kwargs)

    create_completion._servewatch_fault = True  # type: ignore[attr-defined]
    cls.create_completion = create_completion


def _wrap_engine_steps(path: str) -> None:
    """Wrap vLLM's ``EngineCore.step`` and ``step_with_batch_queue`` (its busy loop calls one of
    them, ``self.step_fn``, bound in ``EngineCore.__init__`` after the plugins are loaded)."""
    try:
        from vllm.v1.engine import core
    except Exception:  # noqa: BLE001 - no v1 engine here: nothing to wrap
        return
    cls: Any = core.EngineCore
    for name in ("step", "step_with_batch_queue"):
        inner = getattr(cls, name, None)
        if inner is not None and not getattr(inner, "_servewatch_fault", False):
            setattr(cls, name, _before(inner, engine_fault_point, path))


def register() -> None:
    """The plugin's entry point: wrap the Llama forward and weight load, the EngineCore's step and
    the API server's completion handler when a fault file is configured."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return
    _wrap_engine_steps(path)
    _wrap_api_completions(path)
    from vllm.model_executor.models import llama

    cls: Any = llama.LlamaForCausalLM
    for name, point in (("forward", fault_point), ("load_weights", load_fault_point)):
        inner = getattr(cls, name)
        if not getattr(inner, "_servewatch_fault", False):
            setattr(cls, name, _before(inner, point, path))


def _before(inner: Any, point: Any, path: str) -> Any:
    """``inner`` (a method) wrapped to call ``point(path)`` first."""

    @functools.wraps(inner)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        point(path)
        return inner(self, *args, **kwargs)

    wrapped._servewatch_fault = True  # type: ignore[attr-defined]
    return wrapped
