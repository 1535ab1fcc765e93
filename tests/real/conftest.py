"""Fixtures for tests on the real vLLM server (see ``tests/real/__init__.py``).

- ``vllm_tp1`` / ``vllm_tp2``: the shared server at TP=1 / TP=2 (started on first use, kept for the
  next test; restarted only when a test left it not serving — a destructive fault). At teardown the
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
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real import install as installer
from tests.real.server import VllmServer, server_lock

REAL_DIR = Path(__file__).resolve().parent
#: Env var: "1" makes a missing install a failure instead of a skip (CI sets it).
REQUIRED_ENV = "REALVLLM_REQUIRED"
#: Per-test timeout (s) for real-server tests: a first use may wait for the lock and a start.
REAL_TEST_TIMEOUT_S = 1800


def _server_order(item: pytest.Item) -> int:
    """Shared TP=1 tests first, then tests with their own servers, then shared TP=2: each shared
    server starts once per run."""
    names = getattr(item, "fixturenames", ())
    return 0 if "vllm_tp1" in names else 2 if "vllm_tp2" in names else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slots = []
    for i, item in enumerate(items):
        if REAL_DIR in Path(str(item.path)).resolve().parents:
            slots.append(i)
            item.add_marker(pytest.mark.realvllm)
            item.add_marker(pytest.mark.slow)
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

    def dedicated(self, tp: int = 1, extra_args: tuple[str, ...] = ()) -> VllmServer:
        """A new server only the calling test uses; the shared one is stopped first."""
        self.drop_shared()
        server = VllmServer.start(self.install, tp=tp, extra_args=extra_args)
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


class _Holder:
    """The run's servers and the lock, from the first test that needs them to the last of the
    consecutive real-server tests (:func:`pytest_runtest_teardown`) or the session's end."""

    def __init__(self) -> None:
        self.pool: RealVllm | None = None
        self._stack = contextlib.ExitStack()

    def acquire(self) -> RealVllm:
        if self.pool is None:
            inst = installer.ready()
            if inst is None:
                why = installer.unavailable_reason() or f"not installed at {installer.cache_dir()} (run `python -m tests.real.install`)"
                if os.environ.get(REQUIRED_ENV) == "1":
                    pytest.fail(f"real vLLM required but {why}")
                pytest.skip(f"real vLLM: {why}")
            self._stack.enter_context(server_lock())
            installer.refresh_plugin(inst)
            self.pool = RealVllm(inst)
        return self.pool

    def release(self) -> None:
        pool, self.pool = self.pool, None
        try:
            if pool is not None:
                pool.close()
        finally:
            self._stack.close()


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
def vllm_tp2(real_vllm: RealVllm) -> VllmServer:
    """The shared real vLLM server at TP=2 (``VLLM::Worker_TP0``, ``VLLM::Worker_TP1``)."""
    return real_vllm.shared(tp=2)
