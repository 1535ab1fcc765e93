"""Fixtures for tests on the real vLLM server (see ``tests/real/__init__.py``).

- ``vllm_tp1`` / ``vllm_tp2``: the shared server at TP=1 / TP=2 (started on first use, kept for the
  next test; restarted only when a test left it not serving — a destructive fault).
  ``vllm_tp1_ending``: the same TP=1 server for a test that stops or kills it (run after the
  other TP=1 tests: the first such test saves a server start). At teardown the
  fault trigger is removed, stopped processes get SIGCONT and the server must serve a completion
  within 60 s, else it is stopped and the next test gets a new one.
- ``real_vllm``: the session's :class:`RealVllm`, for a test that needs its own server(s)
  (``real_vllm.dedicated(tp=1)``; killed at that test's end, even when it fails), e.g. to SIGKILL a
  worker, shut one down, or run two on one host.

Only one server runs at a time besides a test's dedicated ones (a dedicated one stops the shared
one first). The machine-wide lock (``/tmp/servewatch-realvllm.lock``) is held from the first
real-server test that needs a server to the last of the run of such tests (they are collected
together): then the servers stop and the lock is let go, so a full suite does not keep it while
its other tests run. Without an install (``python -m tests.real.install``) the tests skip,
naming the reason; with ``REALVLLM_REQUIRED=1`` (what ``.ci/run`` sets after a
successful install) they fail instead.

SGLang (``install_sglang.py``, ``sglang_server.py``): ``sglang_tp1`` / ``sglang_tp2`` and
``real_sglang`` follow the same rules, under the same lock; the tests using them are collected
after the vLLM ones (a vLLM server is stopped before an SGLang one starts, and the other way
round) and carry the ``realsglang`` marker too. ``REALSGLANG_REQUIRED=1`` makes a missing SGLang
install a failure.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.real import install as installer
from tests.real import install_sglang as sglang_installer
from tests.real.server import VllmServer, server_lock
from tests.real.sglang_server import SglangServer

REAL_DIR = Path(__file__).resolve().parent
#: Env var: "1" makes a missing install a failure instead of a skip (CI sets it).
REQUIRED_ENV = "REALVLLM_REQUIRED"
#: Env var: the same for the real SGLang server (``python -m tests.real.install_sglang``).
SGLANG_REQUIRED_ENV = "REALSGLANG_REQUIRED"
#: Per-test timeout (s) for real-server tests: a first use may wait for the lock and a start.
REAL_TEST_TIMEOUT_S = 1800


#: Server groups in run order (:func:`_server_order`): the fixture a test names -> its group.
_GROUPS = {"vllm_tp1": 0, "vllm_tp1_ending": 1, "vllm_tp2": 3, "sglang_tp1": 4, "real_sglang": 5, "sglang_tp2": 6}
#: Tests naming none of :data:`_GROUPS` (``real_vllm``'s dedicated servers, or no server).
_DEDICATED = 2
#: Groups from this one on are SGLang's.
_FIRST_SGLANG = 4


def _server_order(item: pytest.Item) -> int:
    """vLLM: shared TP=1 tests first, then those that end the shared TP=1 server
    (``vllm_tp1_ending``), then tests with their own servers, then shared TP=2; then SGLang in the
    same order: each shared server starts once per run, the server a test ends is one that would
    be stopped next anyway, and the two kinds never run at once."""
    names = getattr(item, "fixturenames", ())
    for fixture in ("sglang_tp1", "sglang_tp2", "real_sglang", "vllm_tp1_ending", "vllm_tp1", "vllm_tp2"):
        if fixture in names:
            return _GROUPS[fixture]
    return _DEDICATED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slots = []
    for i, item in enumerate(items):
        if REAL_DIR in Path(str(item.path)).resolve().parents:
            slots.append(i)
            item.add_marker(pytest.mark.realvllm)
            item.add_marker(pytest.mark.slow)
            if _server_order(item) >= _FIRST_SGLANG:
                item.add_marker(pytest.mark.realsglang)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(REAL_TEST_TIMEOUT_S))
    ordered = sorted((items[i] for i in slots), key=_server_order)  # stable: file order within a group
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


class RealVllm:
    """The session's servers: one shared server (by TP size) and tests' dedicated ones."""

    def __init__(self, inst: installer.Install) -> None:
        self.install = inst
        self._shared: VllmServer | None = None
        self._dedicated: list[VllmServer] = []

    def shared(self, tp: int = 1) -> VllmServer:
        """The shared server at ``tp``, started (or restarted) if it is not the right one."""
        if self._shared is not None and (self._shared.tp != tp or not self._shared.alive):
            self._shared.discard()
            self._shared = None
        if self._shared is None:
            self._shared = VllmServer.start(self.install, tp=tp)
        return self._shared

    def dedicated(self, tp: int = 1, extra_args: tuple[str, ...] = (), *, port: int | None = None,
                  env: dict[str, str] | None = None, fault: dict[str, str] | None = None,
                  wait: bool = True) -> VllmServer:
        """A new server only the calling test uses (on ``port``, default a free one; ``env``: more
        variables for it; ``fault`` / ``wait``: as :meth:`VllmServer.start`); the shared one is
        stopped first."""
        self.drop_shared()
        server = VllmServer.start(self.install, tp=tp, extra_args=extra_args, port=port, env=env, fault=fault, wait=wait)
        self._dedicated.append(server)
        return server

    def drop_shared(self) -> None:
        if self._shared is not None:
            self._shared.discard()
            self._shared = None

    def end_test(self) -> None:
        """After each test: stop its dedicated servers; keep the shared one only if it serves."""
        while self._dedicated:
            self._dedicated.pop().discard(grace_s=10.0)
        if self._shared is not None:
            self._shared.clear_fault()
            self._shared.resume_all()
            if not self._shared.serves(timeout_s=60.0):
                self.drop_shared()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.end_test()
        self.drop_shared()


class RealSglang:
    """The session's SGLang servers: one shared server (by TP size) and tests' dedicated ones
    (the same rules as :class:`RealVllm`)."""

    def __init__(self, inst: sglang_installer.SglangInstall) -> None:
        self.install = inst
        self._shared: SglangServer | None = None
        self._dedicated: list[SglangServer] = []

    def shared(self, tp: int = 1) -> SglangServer:
        """The shared server at ``tp``, started (or restarted) if it is not the right one."""
        if self._shared is not None and (self._shared.tp != tp or not self._shared.alive):
            self.drop_shared()
        if self._shared is None:
            self._shared = SglangServer.start(self.install, tp=tp)
        return self._shared

    def dedicated(self, tp: int = 1, extra_args: tuple[str, ...] = (), *, env: dict[str, str] | None = None) -> SglangServer:
        """A new server only the calling test uses; the shared one is stopped first."""
        self.drop_shared()
        server = SglangServer.start(self.install, tp=tp, extra_args=extra_args, env=env)
        self._dedicated.append(server)
        return server

    def drop_shared(self) -> None:
        if self._shared is not None:
            self._shared.discard()
            self._shared = None

    def end_test(self) -> None:
        """After each test: stop its dedicated servers; keep the shared one only if it serves."""
        while self._dedicated:
            self._dedicated.pop().discard(grace_s=15.0)
        if self._shared is not None:
            self._shared.clear_fault()
            self._shared.resume_all()
            if not self._shared.serves(timeout_s=60.0):
                self.drop_shared()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.end_test()
        self.drop_shared()


def _unavailable(what: str, env: str, why: str) -> None:
    if os.environ.get(env) == "1":
        pytest.fail(f"real {what} required but {why}")
    pytest.skip(f"real {what}: {why}")


class _Holder:
    """The run's servers (vLLM's and SGLang's, never both running) and the lock, from the first
    test that needs them to the last of the consecutive real-server tests
    (:func:`pytest_runtest_teardown`) or the session's end."""

    def __init__(self) -> None:
        self.pool: RealVllm | None = None
        self.sglang: RealSglang | None = None
        self._stack: contextlib.ExitStack | None = None

    def _lock(self) -> None:
        if self._stack is None:
            stack = contextlib.ExitStack()
            stack.enter_context(server_lock())
            self._stack = stack

    def acquire(self) -> RealVllm:
        if self.pool is None:
            inst = installer.ready()
            if inst is None:
                why = installer.unavailable_reason() or f"not installed at {installer.cache_dir()} (run `python -m tests.real.install`)"
                _unavailable("vLLM", REQUIRED_ENV, why)
                raise AssertionError("unreachable")
            self._lock()
            installer.refresh_plugin(inst)
            self.pool = RealVllm(inst)
        if self.sglang is not None:
            self.sglang.drop_shared()
        return self.pool

    def acquire_sglang(self) -> RealSglang:
        if self.sglang is None:
            inst = sglang_installer.ready()
            if inst is None:
                why = sglang_installer.unavailable_reason() or (
                    f"not installed at {sglang_installer.cache_dir()} (run `python -m tests.real.install_sglang`)"
                )
                _unavailable("SGLang", SGLANG_REQUIRED_ENV, why)
                raise AssertionError("unreachable")
            self._lock()
            sglang_installer.refresh_hook(inst)
            self.sglang = RealSglang(inst)
        if self.pool is not None:
            self.pool.drop_shared()
        return self.sglang

    def release(self) -> None:
        pools: list[RealVllm | RealSglang | None] = [self.pool, self.sglang]
        self.pool = self.sglang = None
        stack, self._stack = self._stack, None
        try:
            for pool in pools:
                if pool is not None:
                    with contextlib.suppress(Exception):
                        pool.close()
        finally:
            if stack is not None:
                stack.close()


_HOLDER = _Holder()


def _is_real(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("realvllm") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the test's own fixtures are torn down first
    if _is_real(item) and not _is_real(nextitem):
        _HOLDER.release()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _HOLDER.release()


#: wall seconds (setup + call + teardown) and tests per real-server group, for the run's summary
_GROUP_S: dict[str, list[float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "realvllm" not in report.keywords:
        return
    group = "real SGLang" if "realsglang" in report.keywords else "real vLLM"
    spent = _GROUP_S.setdefault(group, [0.0, 0.0])
    spent[0] += report.duration
    if report.when == "call":
        spent[1] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per real-server group: how long its tests took (CI's time budget)."""
    for group, (seconds, tests) in sorted(_GROUP_S.items()):
        terminalreporter.write_line(f"{group} tests: {int(tests)} in {seconds:.0f} s (setup + call + teardown)")


@pytest.fixture
def real_vllm() -> Iterator[RealVllm]:
    """The run's servers; whatever this test started or faulted is cleaned up after it."""
    pool = _HOLDER.acquire()
    try:
        yield pool
    finally:
        pool.end_test()


@pytest.fixture
def vllm_tp1(real_vllm: RealVllm) -> VllmServer:
    """The shared real vLLM server at TP=1 (``VLLM::EngineCore`` + ``VLLM::Worker``)."""
    return real_vllm.shared(tp=1)


@pytest.fixture
def vllm_tp1_ending(real_vllm: RealVllm) -> VllmServer:
    """The shared real vLLM server at TP=1 for a test that stops or kills it: such tests run after
    every other test of the shared TP=1 server (the first of them gets the server those tests
    used, each next one a new start; the tests with their own servers come next, which would
    stop it anyway)."""
    return real_vllm.shared(tp=1)


@pytest.fixture
def vllm_tp2(real_vllm: RealVllm) -> VllmServer:
    """The shared real vLLM server at TP=2 (``VLLM::Worker_TP0``, ``VLLM::Worker_TP1``)."""
    return real_vllm.shared(tp=2)


@pytest.fixture
def real_sglang() -> Iterator[RealSglang]:
    """The run's SGLang servers; whatever this test started or faulted is cleaned up after it."""
    pool = _HOLDER.acquire_sglang()
    try:
        yield pool
    finally:
        pool.end_test()


@pytest.fixture
def sglang_tp1(real_sglang: RealSglang) -> SglangServer:
    """The shared real SGLang server at TP=1 (``sglang::scheduler``, no ``_TP`` suffix)."""
    return real_sglang.shared(tp=1)


@pytest.fixture
def sglang_tp2(real_sglang: RealSglang) -> SglangServer:
    """The shared real SGLang server at TP=2 (``sglang::scheduler_TP0``, ``sglang::scheduler_TP1``)."""
    return real_sglang.shared(tp=2)
