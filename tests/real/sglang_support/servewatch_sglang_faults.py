"""A forward hook for SGLang's ``--forward-hooks`` that hangs the forward of chosen TP ranks.

The real-SGLang fixture starts the server with ::

    --forward-hooks '[{"name": "servewatch_faults", "target_modules": ["model.layers.0"],
                       "hook_factory": "servewatch_sglang_faults:make_hook",
                       "config": {"fault_file": "<workdir>/fault"}}]'

so every scheduler process (one per TP rank) runs :func:`make_hook`'s hook after each forward of
the model's first decoder layer. The hook reads the fault file (``key=value`` lines):

- ``mode=hang`` (the default): a selected rank blocks, polling every 50 ms, for as long as the
  file exists and still selects it — a forward that does not return, with SGLang's real call stack
  above it (scheduler loop → model runner → the model → this hook);
- ``ranks``: comma-separated ranks (``torch.distributed.get_rank()``; the TP rank at DP=PP=1), or
  ``all`` (the default).

No file: the forward runs untouched (one ``stat`` per forward). Copied into the SGLang venv's
site-packages by ``tests/real/install_sglang.py``.

The detokenizer's side (no forward hook runs there): ``install_sglang.py`` also writes
``servewatch_sglang_faults.pth``, whose one line calls :func:`arm` in every interpreter of the
venv. With :data:`FAULT_FILE_ENV` set (the fixture sets it to the same fault file), :func:`arm`
patches ``DetokenizerManager._decode_batch_token_id_output`` as
``sglang.srt.managers.detokenizer_manager`` is imported (SGLang starts its detokenizer with
multiprocessing's ``spawn``: the ``.pth`` runs there too). ``mode=detokenizer_spin``: the
detokenizer's next incremental decode spins on the CPU (pure-Python work, the file read every
50 ms) for as long as the file says so, the real event loop and decode above it: the schedulers
go on generating, no answer leaves, and SGLang's ``/health`` (a one-token generation that waits
for the detokenizer) turns 503 (SGLang #26482, #34740). Without the variable :func:`arm` does
nothing.

The CUDA driver's side, where there is no GPU: with :data:`FAKE_DRIVER_ENV` naming the project's
fake driver (``tests/programs/fake_cuda_driver.py``), the hook factory (called once per scheduler
while its model loads, where CUDA init would be) loads it and starts it in this scheduler process
(:func:`fake_cuda_driver.start_in_thread`): the FIFO of ``CUDA_COREDUMP_PIPE`` with this
scheduler's pid, a reader thread, a core file per trigger. Its state goes to
``<FAKE_DRIVER_STATUS_DIR_ENV>/<pid>.json`` when that variable names a folder.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from typing import Any

_POLL_S = 0.05
#: Env var: the fault file, for the processes no forward hook reaches (the detokenizer).
FAULT_FILE_ENV = "REALSGLANG_FAULT_FILE"
#: The module whose detokenizer :func:`arm` patches on import.
DETOKENIZER_MODULE = "sglang.srt.managers.detokenizer_manager"
#: Env var: path of the fake CUDA driver to run in each scheduler (unset: none).
FAKE_DRIVER_ENV = "REALSGLANG_FAKE_CUDA_DRIVER"
#: Env var: folder for each scheduler's fake-driver state file ``<pid>.json`` (unset: none).
FAKE_DRIVER_STATUS_DIR_ENV = "REALSGLANG_FAKE_CUDA_STATUS_DIR"
_driver: Any = None


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


def _rank() -> int:
    try:
        import torch.distributed as dist

        return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001 - no process group: rank 0
        return 0


def _selected(fault: dict[str, str]) -> bool:
    ranks = fault.get("ranks", "all")
    if ranks in ("", "all"):
        return True
    return _rank() in {int(r) for r in ranks.split(",") if r.strip()}


def fault_point(path: str) -> None:
    """Apply the fault the file describes to this forward, if this rank is selected."""
    fault = _read_fault(path)
    if fault is None or fault.get("mode", "hang") != "hang" or not _selected(fault):
        return
    while True:  # until the file is gone or no longer selects this rank
        time.sleep(_POLL_S)
        now = _read_fault(path)
        if now is None or now.get("mode", "hang") != "hang" or not _selected(now):
            return


def _start_fake_driver() -> None:
    """Start the fake CUDA driver of :data:`FAKE_DRIVER_ENV` in this process, once."""
    global _driver
    path = os.environ.get(FAKE_DRIVER_ENV)
    if not path or _driver is not None:
        return
    spec = importlib.util.spec_from_file_location("servewatch_fake_cuda_driver", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = os.environ.get(FAKE_DRIVER_STATUS_DIR_ENV, "")
    _driver = module.start_in_thread(status=os.path.join(folder, f"{os.getpid()}.json") if folder else "") or False


def make_hook(config: dict[str, Any]) -> Any:
    """SGLang's hook factory: a forward hook ``(module, inputs, output)`` applying the fault
    (and, when asked, the fake CUDA driver started in this scheduler: see the module docstring)."""
    path = str(config["fault_file"])
    _start_fake_driver()

    def hook(module: Any, inputs: Any, output: Any) -> None:
        fault_point(path)

    return hook


def detokenizer_spin_point(path: str) -> None:
    """Spin on the CPU while the file says ``mode=detokenizer_spin`` (reading it every 50 ms), at
    the lowest CPU priority (nice 19) meanwhile: on a 2-core machine a spin at full priority takes
    a core from the scheduler's two OpenMP threads and slows its forward to a stall, where a
    serving host has cores to spare. Still runnable all along: py-spy sees it active."""
    fault = _read_fault(path)
    if fault is None or fault.get("mode") != "detokenizer_spin":
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    try:
        checked = time.monotonic()
        spins = 0
        while True:
            spins += sum(i * i for i in range(200)) & 1  # pure-Python work: a busy decode, not a wait
            if time.monotonic() - checked >= _POLL_S:
                checked = time.monotonic()
                now = _read_fault(path)
                if now is None or now.get("mode") != "detokenizer_spin":
                    return
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, before)
        except OSError:  # lowering it back needs CAP_SYS_NICE: it stays nice
            pass


def _patch_detokenizer(module: Any, path: str) -> None:
    cls: Any = getattr(module, "DetokenizerManager", None)
    inner = getattr(cls, "_decode_batch_token_id_output", None) if cls is not None else None
    if inner is None or getattr(inner, "_servewatch_fault", False):
        return

    def _decode_batch_token_id_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        detokenizer_spin_point(path)
        return inner(self, *args, **kwargs)

    _decode_batch_token_id_output._servewatch_fault = True  # type: ignore[attr-defined]
    cls._decode_batch_token_id_output = _decode_batch_token_id_output


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds :data:`DETOKENIZER_MODULE` through the other finders and patches it once executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != DETOKENIZER_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader: Any = spec.loader
        execute = loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _patch_detokenizer(module, self.path)

        loader.exec_module = exec_module
        return spec


def arm() -> None:
    """Called by ``servewatch_sglang_faults.pth`` at every interpreter start of the venv: with
    :data:`FAULT_FILE_ENV` set, patch the detokenizer when it is imported (at once if it is
    already); else nothing."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return
    if DETOKENIZER_MODULE in sys.modules:
        _patch_detokenizer(sys.modules[DETOKENIZER_MODULE], path)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(path))
