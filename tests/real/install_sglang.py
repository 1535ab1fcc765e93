"""Install the real SGLang server the tests run: a separate venv and a tiny model, cached.

``python -m tests.real.install_sglang`` (what ``.ci/run`` calls after the vLLM install) makes,
under one cache folder keyed by the versions (default ``~/.cache/servewatch/realsglang/<key>``,
override ``REALSGLANG_DIR``):

- ``venv/``: ``torch==2.14.1`` (PyPI's default build, CUDA 13, runs on the CPU; ≈5 min and 5.4 GB
  the first time), ``sglang==0.5.23`` and ``torchvision==0.29.1`` without their dependency lists
  (SGLang's are CUDA serving stacks), then only the packages SGLang's CPU serving path imports
  (:data:`SERVING_DEPS`, pins SGLang's own where it pins): ≈6 GB in all.
- **the one deviation**: ``sgl_kernel`` is our own pure-torch stand-in
  (``sglang_support/sgl_kernel_cpu.py``, distribution ``sgl-kernel 0.0.0+servewatch.cpu``). PyPI's
  ``sgl-kernel`` / ``sglang-kernel`` are CUDA-only builds that fail to import here
  (``libnvrtc.so.12``), and SGLang's CPU engine imports a few ``*_cpu`` helpers from it at module
  load; on a CPU without AMX only ``assign_req_to_token_pool_cpu`` is called while serving.
- the fault hook (``sglang_support/servewatch_sglang_faults.py``, loaded by the server through
  ``--forward-hooks``), refreshed on every run like the vLLM plugin;
- ``model/``: the tiny random Llama of ``build_tiny_model.py`` (the vLLM fixture's), rebuilt when
  that script changes.

A ``ready.json`` written last says the folder is complete. Exit status: 0 ready; 75
(``EX_TEMPFAIL``) when the install failed for a network reason or a fresh install finds under
9 GiB free (:class:`NoRoom`; one line on stderr says so: CI
goes on and the real-SGLang tests skip with that reason, recorded in ``unavailable.txt``); 1 any
other failure. Concurrent installs of the same folder serialise on a lock in the cache root. Every
pip step is bounded (:data:`PIP_TIMEOUT_S`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.real.install import (
    InstallError,
    _purelib,
    _run,
    _write_dist,
    build_model,
    cache_root,
    installer_main,
    installing,
    model_hash,
    read_unavailable,
)

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.14.1"
TORCHVISION_VERSION = "0.29.1"
#: What SGLang 0.5.23's CPU serving path imports (found by import iteration on the reference
#: install), pinned where SGLang pins.
SERVING_DEPS = (
    "transformers==5.19.0", "tokenizers==0.23.2", "fastapi", "uvicorn>=0.51", "uvloop", "orjson", "pyzmq>=25.1.2",
    "msgspec", "pydantic", "prometheus-client>=0.20.0", "psutil", "setproctitle", "requests", "aiohttp", "pybase64",
    "python-multipart", "partial_json_parser", "interegular", "numpy", "einops", "py-spy", "pillow", "IPython",
    "sentencepiece==0.2.1", "apache-tvm-ffi==0.1.11", "compressed-tensors==0.18.0", "gguf", "openai==2.8.0",
    "jsonschema", "xgrammar==0.2.7", "soundfile==0.13.1", "dill",
)  # fmt: skip
#: Env var: the cache folder (venv + model) to use instead of the default.
DIR_ENV = "REALSGLANG_DIR"

HERE = Path(__file__).resolve().parent
SUPPORT_DIR = HERE / "sglang_support"
SHIM_SRC = SUPPORT_DIR / "sgl_kernel_cpu.py"
SHIM_VERSION = "0.0.0+servewatch.cpu"
HOOK_MODULE = "servewatch_sglang_faults"

#: Seconds one pip install may take (torch's is the longest: ≈5 min on an idle box).
PIP_TIMEOUT_S = 1800.0
#: Seconds the serving modules' import check may take (≈20 s idle; minutes on a loaded box).
SMOKE_TIMEOUT_S = 600.0
MODEL_TIMEOUT_S = 300.0

#: The modules a CPU server imports first: the install is usable when these import.
SMOKE_IMPORT = "import sglang.srt.managers.scheduler, sglang.srt.entrypoints.http_server, sglang.srt.models.llama"


@dataclass(frozen=True)
class SglangInstall:
    """A complete install: where the venv's interpreter and the model are."""

    root: Path
    python: Path
    model: Path

    @property
    def bin(self) -> Path:
        """The venv's ``bin`` (``py-spy`` is there: SGLang's watchdog runs it through the shell)."""
        return self.python.parent


def cache_key() -> str:
    """``sglang-0.5.23_torch-2.14.1_py3.11``: what the venv depends on."""
    return f"sglang-{SGLANG_VERSION}_torch-{TORCH_VERSION}_py{sys.version_info.major}.{sys.version_info.minor}"


def cache_dir() -> Path:
    """The cache folder: ``$REALSGLANG_DIR`` or ``~/.cache/servewatch/realsglang/<key>``."""
    return cache_root(DIR_ENV, "realsglang", cache_key())


def _layout(root: Path) -> SglangInstall:
    return SglangInstall(root=root, python=root / "venv" / "bin" / "python", model=root / "model")


def ready(root: Path | None = None) -> SglangInstall | None:
    """The install at ``root`` (default :func:`cache_dir`) if it is complete, else ``None``."""
    inst = _layout(root or cache_dir())
    if not ((inst.root / "ready.json").is_file() and inst.python.is_file() and (inst.model / "model.safetensors").is_file()):
        return None
    return inst


def unavailable_reason(root: Path | None = None) -> str | None:
    """The one-line reason the last install attempt recorded for failing, if any."""
    return read_unavailable(root or cache_dir())


def _log(msg: str) -> None:
    print(f"realsglang: {msg}", file=sys.stderr, flush=True)


def _pip(inst: SglangInstall, what: str, *args: str) -> None:
    t0 = time.monotonic()
    _run([str(inst.python), "-m", "pip", "install", "-q", *args], timeout_s=PIP_TIMEOUT_S, what=f"pip install {what}")
    _log(f"pip install {what} took {time.monotonic() - t0:.0f} s")


#: Free disk (bytes) a fresh install needs where the cache lives: the ≈6 GB venv plus pip's
#: unpacked wheels while it installs.
NEEDED_FREE_BYTES = 9 * 2**30


class NoRoom(InstallError):
    """The cache's filesystem has too little free space for a fresh install: a machine's limit, not a
    broken build (``main`` exits 75 with one line, as for an unreachable registry)."""


def _check_room(root: Path) -> None:
    """Raises :class:`NoRoom` when ``root``'s filesystem has under :data:`NEEDED_FREE_BYTES` free."""
    free = shutil.disk_usage(root).free
    if free < NEEDED_FREE_BYTES:
        raise NoRoom(f"disk: {free / 2**30:.1f} GiB free under {root}, a fresh install needs {NEEDED_FREE_BYTES / 2**30:.0f} GiB",
                     network=False)


def _make_venv(inst: SglangInstall) -> None:
    _check_room(inst.root)
    venv = inst.root / "venv"
    if venv.exists():
        shutil.rmtree(venv)
    _run([sys.executable, "-m", "venv", str(venv)], timeout_s=300, what="venv")
    _log(f"installing sglang=={SGLANG_VERSION} torch=={TORCH_VERSION} into {venv} (about 10 min, 6 GB)")
    _pip(inst, "torch", f"torch=={TORCH_VERSION}")
    _pip(inst, "sglang", "--no-deps", f"sglang=={SGLANG_VERSION}", f"torchvision=={TORCHVISION_VERSION}")
    _pip(inst, "sglang serving deps", *SERVING_DEPS)


def _add_shim(site: Path) -> None:
    """The deviation: our ``sgl_kernel`` stand-in replaces whatever ``sgl_kernel`` is there."""
    for old in site.glob("sgl_kernel*"):
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    pkg = site / "sgl_kernel"
    pkg.mkdir()
    shutil.copyfile(SHIM_SRC, pkg / "__init__.py")
    _write_dist(site, "sgl_kernel", SHIM_VERSION, files=("sgl_kernel/__init__.py",))


def _add_hook(site: Path) -> None:
    """Copy the fault hook module (atomically) and its ``.pth`` (arms the detokenizer's fault in
    every interpreter of the venv that has the fault file's variable)."""
    tmp = site / f".{HOOK_MODULE}.py.tmp"
    shutil.copyfile(SUPPORT_DIR / f"{HOOK_MODULE}.py", tmp)
    os.replace(tmp, site / f"{HOOK_MODULE}.py")
    tmp = site / f".{HOOK_MODULE}.pth.tmp"
    tmp.write_text(f"import {HOOK_MODULE}; {HOOK_MODULE}.arm()\n", encoding="utf-8")
    os.replace(tmp, site / f"{HOOK_MODULE}.pth")


def refresh_hook(inst: SglangInstall) -> None:
    """Copy this checkout's fault hook into the install (the test session calls it under the
    machine-wide server lock, so a server always runs the hook of the tests that fault it)."""
    _add_hook(_purelib(inst.python))


def _server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _check_venv(inst: SglangInstall, *, smoke: bool) -> None:
    """Fail unless the venv has the pinned versions and our ``sgl_kernel``; with ``smoke``, also
    import the serving modules (the CPU engine's imports of ``sgl_kernel`` included)."""
    code = (
        "import importlib.metadata as m, json\n"
        "def v(n):\n"
        "    try: return m.version(n)\n"
        "    except m.PackageNotFoundError: return None\n"
        "print(json.dumps({n: v(n) for n in ('sglang', 'torch', 'sgl_kernel', 'py-spy')}))"
    )
    found = json.loads(_run([str(inst.python), "-c", code], timeout_s=120, what="version check", env=_server_env()).strip().splitlines()[-1])
    want = {"sglang": SGLANG_VERSION, "torch": TORCH_VERSION, "sgl_kernel": SHIM_VERSION}
    wrong = {k: found[k] for k, v in want.items() if found[k] != v}
    if wrong or not found["py-spy"]:
        raise InstallError(f"venv {inst.root / 'venv'} has {wrong} py-spy {found['py-spy']} (want {want} and py-spy)", network=False)
    if smoke:
        t0 = time.monotonic()
        _run([str(inst.python), "-c", SMOKE_IMPORT], timeout_s=SMOKE_TIMEOUT_S, what="import check", env=_server_env())
        _log(f"the serving modules import ({time.monotonic() - t0:.0f} s)")


def ensure(root: Path | None = None) -> SglangInstall:
    """Make (or complete, or refresh) the install at ``root``; return it.

    Raises:
        InstallError: a step failed (``network`` says whether the registry was unreachable).
    """
    root = root or cache_dir()
    inst = _layout(root)
    meta = {"sglang": SGLANG_VERSION, "torch": TORCH_VERSION, "sgl_kernel": SHIM_VERSION, "python": sys.version.split()[0],
            "model": model_hash()}  # fmt: skip
    with installing(root, meta):
        fresh = not (root / "ready.json").is_file() or not inst.python.is_file()
        if fresh:
            (root / "ready.json").unlink(missing_ok=True)
            _make_venv(inst)
        site = _purelib(inst.python)
        _add_shim(site)
        _add_hook(site)
        _check_venv(inst, smoke=fresh)
        build_model(root, inst.python, inst.model, _server_env())
    return inst


def main(argv: list[str] | None = None) -> int:
    return installer_main(
        argv, prog="python -m tests.real.install_sglang", doc=__doc__, dir_env=DIR_ENV, default_dir=cache_dir(), server="SGLang",
        ensure=ensure, ready_line=lambda inst: f"{inst.python} -m sglang.launch_server --model-path {inst.model}",
        temporary=lambda exc: "network" if exc.network else "disk" if isinstance(exc, NoRoom) else None,
    )


if __name__ == "__main__":
    sys.exit(main())
