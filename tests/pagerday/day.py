"""A pager day on one host, played on real demo servers, and the incidents it should page on
(issue 31, item 5).

Owns the day's script (:func:`play_day`), its expectations (:data:`EVENTS`, the table below),
the attribution of the incidents the agent opened to the day's events (:func:`judge`) and the
table printed from it (:func:`format_table`). ``tests/pagerday/test_pagerday.py`` asserts on it;
``bench/bench_pagerday.py`` prints it. Imports the standard library, httpx, psutil,
:mod:`agent.demo.client` (to start, load and hang the demo servers) and :mod:`agent.host.manifest` (to
read the bundles); the agent itself runs as one ``servewatch run`` subprocess, as an operator runs
it.

The host
--------
* Servers **A** and **B**: two real demo servers (``python -m agent.demo.server --tp 2``, torch
  model, gloo ranks, SDK step counters) with **identical titles** ``<prefix>::scheduler_TP<i>``,
  each on its own fixed loopback port (a restart comes back on it).
* Server **C**: a tiny supervisor (``tests/pagerday/supervisor.py``) restarting an engine titled
  ``<prefix>::scheduler_TP0`` that exits 1 after 2.5 s (the crash loop).
* Server **D**: a frontend whose two ranks do not follow it when it dies
  (``tests/pagerday/orphan_server.py``; the demo server's own ranks exit when orphaned, so they
  cannot play this).
* One host-wide ``servewatch run --match '<prefix>::scheduler*'`` (no ``--root-pid``), given both
  A's and B's ``--health-url`` and ``--metrics-url`` (repeated: the form issue 31 item 1 asks for;
  a ``run`` that takes one value keeps the last, B's), ``--watchdog-timeout 5``, ``--cooldown 300``
  (the default, so a suppression shows), health probes every second
  (``SERVEWATCH_HEALTH__INTERVAL_S=1``; ``run``'s default is 5 s: the same three failed probes
  in a row, in a fifth of the time), ``-v`` (its log is ``<workdir>/agent-0.log``). For the
  last event the operator stops it (SIGTERM) and re-runs it with ``--hard`` and A's URLs only
  (B is down by then); that one logs to ``agent-1.log``. Both write to ``<workdir>/data``, as do
  the ``servewatch profile`` runs (one data dir per host, as an operator has).

``<prefix>`` is ``demo-pd<pid of the test>``: the titles are the demo's, but unique to this run,
since another demo on a shared host is not ours to page on (nor to py-spy, nor to SIGABRT with
``--hard``). Step counters and SDK sockets go to a private ``SERVEWATCH_SHM_DIR``.

The day (:data:`EVENTS`; every event's expected incidents)
-----------------------------------------------------------
========== ====== ===================================================== ==========================
event      server what happens                                          expected incidents
========== ====== ===================================================== ==========================
deploy     A      SIGTERM A; 5 s later (the new version loads) start    none
                  it again on its port (new pids)
restart    B      the same for B: restart with new pids                 none
profile    A, B   ``servewatch profile --pid <TP0> --steps 3`` of each   none
                  server at once, under traffic
load       A, B   48 requests at once to A; an 8,000-token prompt to B  none
                  whose prefill forward takes 2.5 s (half the watchdog)
hangs      A, B   A's TP1 hangs (28 s), B's TP0 hangs 20 s later (10 s) stall A/TP1, stall B/TP0
crash      A      A's TP1 dies of SIGSEGV; once paged (the agent judged  exit A/TP1
                  A's failing health, at most 10 s) the operator
                  restarts A
crash_loop C      the engine exits 1 after 2.5 s, restarted 5 times     one incident C/engine
stop       B      the operator's SIGTERM to B (B stays down)            none
orphan     D      D's frontend SIGKILLed: its 2 ranks live on; 15 s     one finding D, naming
                  later the operator SIGTERMs them                      both live ranks
hard       A      the operator re-runs the agent with ``--hard``; A's   stall A/TP1 (SIGABRT's
                  TP1 hangs for good; the agent SIGABRTs it             knock-on: nothing more)
========== ====== ===================================================== ==========================

How incidents are counted
-------------------------
Every bundle under ``<data-dir>/<host>/*/manifest.json`` is one opened incident: its trigger, its
``opened_time_unix_nano``, its target pids and its verdict's culprit pids. The day knows every pid
it started (server and role: ``frontend``, ``TP0``, ``TP1``, ``engine``, ``supervisor``, ...),
across restarts. An incident belongs to the event whose window (from the event's start to the
next one's) holds its opening time. Within an event, an expected incident is **met** by an opened
one whose trigger is one of the expected ones, whose verdict names the expected role's pid of the
expected server (when a culprit is expected), whose bundle holds only that server's processes,
and (orphans) that holds every process left alive. An opened incident of an accepted trigger that
fails one of these checks is paired with the expectation and counted **missed** with the reason
(wrong culprit, another server's pids in the bundle), not false; an expectation with no candidate
is **missed** (not opened); an opened incident paired with no expectation is **false**. Time to
open is the incident's opening time minus the fault's (the hang armed, the signal sent); the
table shows it for the incidents that met their expectation, and in brackets, ``(5.2s wrong)``,
for those paired with one they missed. Under the table, per event with an incident, what opened,
each false and missed one with why, and the agent's own log lines of the window about incidents
(``suppressed by cooldown``, ``no incident``...).

Triggers: a stall is ``stall``, the rank crash ``exit``. Issue 31 names no trigger for a crash
loop or for processes left alive, so those two accept any trigger name; what counts there is
that there is exactly one incident, about that server, naming the engine (crash loop) or holding
both orphaned ranks (orphan). A "finding" of left-alive processes is counted only as an incident
bundle: a status or log line pages nobody.

Timing: about 3.5 minutes on a quiet 2-core machine (the demo servers start in ~2 s there). Most
of it is the lifecycle events' quiet time: a closed port fails three probes (~3 s), the agent holds
that failure 30 s for the processes' exits (``HEALTH_SETTLE_S``), then decides, and each of deploy,
restart and stop waits for that decision (its log line, else :data:`LIFECYCLE_SETTLE_S`) so that a
false health incident lands in its own row. Elsewhere the day waits on conditions (the agent's log
line that it watches a server or its steps, the culprit gone) rather than fixed sleeps, and starts
A and B at once. Every
wait is bounded and every process the day starts is killed at its end, also after a failure.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from agent.demo.client import DemoServer, generate, inject_hang

__all__ = [
    "EVENTS",
    "Event",
    "Expected",
    "Opened",
    "Row",
    "format_table",
    "judge",
    "play_day",
    "totals",
]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TITLED = ROOT / "tests" / "programs" / "titled_target.py"
SUPERVISOR = HERE / "supervisor.py"
ORPHAN_SERVER = HERE / "orphan_server.py"

#: The agent's watchdog timeout, seconds (short, so a hang is seen in seconds).
WATCHDOG_TIMEOUT_S = 5.0
#: The agent's cooldown, seconds: ``run``'s default, so a suppression bug shows.
COOLDOWN_S = 300.0
#: A legitimately long forward (the long prefill), seconds: half the watchdog timeout.
LONG_PREFILL_S = 2.5
#: The agent's health probe interval, seconds (``health.interval_s``, set through
#: ``SERVEWATCH_HEALTH__INTERVAL_S``; ``run``'s default is 5 s). Probing every second, the three
#: failed probes (``run``'s default ``unhealthy_after``) of a stop + start take ~3 s, not ~15 s, so
#: a deploy's gap can be a few seconds and still fail three probes in a row: the day plays the same
#: health failure at a fifth of the time.
HEALTH_INTERVAL_S = 1.0
#: Failed probes in a row before the health watcher fails (``run``'s default ``unhealthy_after``).
HEALTH_FAILURES = 3
#: How long the agent holds a failed health check before judging it (``agent.incidents.admission``'s
#: ``HEALTH_SETTLE_S``): 30 s for a closed port, 5 s for a 5xx.
HEALTH_SETTLE_REFUSED_S = 30.0
HEALTH_SETTLE_5XX_S = 5.0
#: Quiet time after a server's port closed (deploy, restart, the operator's stop, the crash's
#: restart), seconds, counted from the close: the health watcher fails after three probes (~3 s),
#: the agent holds that failure 30 s for the processes' exits, then files its incident or not; the
#: window holds that decision, and some.
LIFECYCLE_SETTLE_S = HEALTH_FAILURES * HEALTH_INTERVAL_S + HEALTH_SETTLE_REFUSED_S + 4.0
#: Quiet time after hard mode's signal, seconds: three failed probes (503) and the 5xx hold.
HARD_SETTLE_S = HEALTH_FAILURES * HEALTH_INTERVAL_S + HEALTH_SETTLE_5XX_S + 5.0
#: Both quiet times end early, this many seconds after the agent logged its decision on that
#: health failure (a line naming ``<url>/health failed``: the incident it opened, its cooldown, the
#: incident it joined); an agent that words it otherwise gets the whole quiet time.
DECIDED_MARGIN_S = 1.0
#: Seconds from the rank crash to the operator's restart of A, at most (sooner once the agent
#: decided on A's failing health check: the 503s after TP1's death, three probes and the 5xx hold).
CRASH_RESTART_S = 10.0
#: Seconds between a server's stop and its new start in a deploy or restart: the new version's
#: image and weights loading (a real server takes tens of seconds; the demo starts in ~2 s on a
#: quiet host). With the demo's own start, the port stays closed ~7 s: at least five probes, three
#: failed in a row with room to spare.
RESTART_GAP_S = 5.0
#: The two hangs: A's TP1 hangs this long ...
HANG_A_S = 28.0
#: ... B's TP0 hangs this many seconds after A's (more than the watchdog timeout and the first
#: incident's capture: two distinct incidents, the second well inside the first's cooldown, while
#: A is still hung: both stalls at once) ...
HANG_GAP_S = 20.0
#: ... for this long (twice the watchdog timeout; it ends just after A's).
HANG_B_S = 10.0
#: Quiet time after the load spike, the crash's restart, the crash loop and the orphan's cleanup,
#: seconds: a stall or exit of theirs opens while they run or at once; this holds its opening.
QUIET_S = 3.0
#: Quiet time after the profiles, seconds: the agent re-arms the stall rule with a fresh watchdog
#: clock when a profile ends, so a forward the profile left stuck fires within that.
PROFILE_QUIET_S = WATCHDOG_TIMEOUT_S

STALL = frozenset({"stall"})
EXIT = frozenset({"exit"})
ANY: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Expected:
    """One incident an event should open.

    Attributes:
        triggers: accepted trigger names (empty: any).
        server: the server it is about (``A``...``D``).
        culprit: the role whose pid the verdict must name (``TP1``, ``engine``), ``None``: any.
        holds: roles whose pids the bundle must hold (the processes left alive).
    """

    triggers: frozenset[str]
    server: str
    culprit: str | None = None
    holds: tuple[str, ...] = ()

    def describe(self) -> str:
        trig = "/".join(sorted(self.triggers)) or "any"
        who = f"{self.server}/{self.culprit}" if self.culprit else self.server
        held = f" holding {'+'.join(self.holds)}" if self.holds else ""
        return f"{trig} {who}{held}"


@dataclass(frozen=True)
class Event:
    """One event of the day: its name, the server(s) it touches, what happens, what should open."""

    name: str
    servers: str
    what: str
    expected: tuple[Expected, ...] = ()


#: The day, in order, with the incidents each event should open (none for most).
EVENTS: tuple[Event, ...] = (
    Event("deploy", "A", f"SIGTERM A; {RESTART_GAP_S:g} s later start it again on its port (new pids)"),
    Event("restart", "B", f"restart B with new pids ({RESTART_GAP_S:g} s from its stop to the new start)"),
    Event("profile", "A,B", "servewatch profile --pid <TP0> --steps 3 of each server at once, under traffic"),
    Event("load", "A,B", f"48 requests at once to A; an 8,000-token prompt to B, prefill forward {LONG_PREFILL_S:g} s"),
    Event("hangs", "A,B", f"A's TP1 hangs ({HANG_A_S:g} s); {HANG_GAP_S:g} s later B's TP0 hangs ({HANG_B_S:g} s)",
          (Expected(STALL, "A", "TP1"), Expected(STALL, "B", "TP0"))),
    Event("crash", "A", f"A's TP1 dies of SIGSEGV; the operator restarts A once paged (<= {CRASH_RESTART_S:g} s)",
          (Expected(EXIT, "A", "TP1"),)),
    Event("crash_loop", "C", "a supervisor restarts an engine that exits 1 after 2.5 s, 5 times",
          (Expected(ANY, "C", "engine"),)),
    Event("stop", "B", "the operator's SIGTERM to B (B stays down)"),
    Event("orphan", "D", "D's frontend SIGKILLed, its 2 ranks live on; 15 s later the operator SIGTERMs them",
          (Expected(ANY, "D", None, holds=("TP0", "TP1")),)),
    Event("hard", "A", "agent re-run with --hard; A's TP1 hangs for good; the agent SIGABRTs it",
          (Expected(STALL, "A", "TP1"),)),
)


@dataclass(frozen=True)
class Opened:
    """One incident the agent opened, as its manifest says."""

    incident_id: str
    trigger: str
    opened_s: float
    target_pids: frozenset[int]
    culprit_pids: frozenset[int]
    headline: str
    state: str


@dataclass
class Row:
    """One event's line of the table.

    Attributes:
        event / servers / what: the event (:class:`Event`).
        expected: what should open, in words.
        opened: what opened in the event's window (id, trigger, the server and role of its
            culprit), in words.
        false: opened incidents that no expectation was met or missed by, each with why.
        missed: expectations not met, each with why.
        time_to_open_s: per met expectation, seconds from the fault to the incident's opening.
        time_to_open_wrong_s: the same for incidents paired with an expectation they miss
            (wrong culprit or bundle): opened, but not what should page.
        log: the agent's own lines about incidents in the window (suppressed, no incident...).
        start_s / end_s: the window, seconds since the epoch.
    """

    event: str
    servers: str
    what: str
    expected: list[str]
    opened: list[str] = field(default_factory=list)
    false: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    time_to_open_s: list[float] = field(default_factory=list)
    time_to_open_wrong_s: list[float] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0


# -- the host -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_group(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)


class _Host:
    """Everything the day started, with every pid's server and role; :meth:`close` kills it all."""

    def __init__(self, workdir: Path, say: Callable[[str], None]) -> None:
        self.workdir = workdir
        self.say = say
        self.prefix = f"demo-pd{os.getpid()}"
        self.glob = f"{self.prefix}::scheduler*"
        self.data_dir = workdir / "data"
        shm = workdir / "shm"
        shm.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        self.env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        self.roles: dict[int, tuple[str, str]] = {}
        self.ports = {"A": _free_port(), "B": _free_port()}
        self.servers: dict[str, DemoServer] = {}
        self.others: list[subprocess.Popen] = []  # supervisor, orphan frontend, profiles
        self.stray: list[psutil.Process] = []  # orphans: killed one by one at the end, if still the same
        self.agent: subprocess.Popen | None = None
        self.agent_logs: list[Path] = []
        self.threads: list[threading.Thread] = []

    # servers A and B ------------------------------------------------------------------------

    def start(self, name: str) -> DemoServer:
        srv = DemoServer(tp=2, port=self.ports[name], title_prefix=self.prefix, env=self.env,
                         extra_args=["--request-timeout", "120"], ready_timeout_s=180.0, stop_timeout_s=15.0)
        srv.start()
        self.servers[name] = srv
        self.roles[srv.pid] = (name, "frontend")
        for rank, pid in enumerate(srv.scheduler_pids):
            self.roles[pid] = (name, f"TP{rank}")
        self.say(f"server {name}: frontend {srv.pid}, ranks {srv.scheduler_pids} at {srv.base_url}")
        return srv

    def stop(self, name: str) -> float:
        """Stop server ``name`` (SIGTERM, its whole tree); returns when it stopped (monotonic)."""
        srv = self.servers.pop(name, None)
        if srv is not None:
            code = srv.stop()
            self.say(f"server {name} stopped (exit {code})")
        return time.monotonic()

    def start_all(self, names: list[str]) -> None:
        """Start servers ``names`` at once (a host boots its servers in parallel)."""
        _parallel([lambda name=name: self.start(name) for name in names])

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def warm(self, name: str, timeout_s: float = 60.0) -> None:
        """One request (every rank steps), then wait until the agent watches the ranks' steps."""
        srv = self.servers[name]
        generate(srv.base_url, "warm-up", max_new_tokens=4, timeout_s=timeout_s)
        self.wait_log([f"watching forward steps of pid {pid} " for pid in srv.scheduler_pids], timeout_s)

    def warm_all(self, names: list[str]) -> None:
        _parallel([lambda name=name: self.warm(name) for name in names])

    def log_size(self) -> int:
        """Bytes in the agent's log now (where to look from for what comes next)."""
        try:
            return self.agent_logs[-1].stat().st_size
        except (IndexError, OSError):
            return 0

    def wait_health_decided(self, name: str, offset: int, until: float) -> None:
        """Until the agent logged (past ``offset``) its decision on server ``name``'s failed health
        check, and :data:`DECIDED_MARGIN_S` more; at most until ``until`` (monotonic)."""
        needle = f"{self.url(name)}/health failed".encode()
        while time.monotonic() < until:
            with contextlib.suppress(OSError, IndexError), self.agent_logs[-1].open("rb") as fh:
                fh.seek(offset)
                if needle in fh.read():
                    _until(min(until, time.monotonic() + DECIDED_MARGIN_S))
                    return
            time.sleep(0.2)

    def wait_log(self, needles: list[str], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.agent_logs[-1].read_text(errors="replace") if self.agent_logs else ""
            if all(n in text for n in needles):
                return True
            time.sleep(0.2)
        self.say(f"(not in the agent's log within {timeout_s:g} s: {needles})")
        return False

    def background(self, fn: Callable[[], object]) -> None:
        def run() -> None:
            with contextlib.suppress(httpx.HTTPError, OSError):
                fn()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    # the agent ------------------------------------------------------------------------------

    def start_agent(self, names: list[str], *, hard: bool = False) -> None:
        log = self.workdir / f"agent-{len(self.agent_logs)}.log"
        self.agent_logs.append(log)
        argv = [sys.executable, "-m", "agent.cli.entry", "run", "--match", self.glob,
                "--watchdog-timeout", f"{WATCHDOG_TIMEOUT_S:g}", "--cooldown", f"{COOLDOWN_S:g}",
                "--data-dir", str(self.data_dir), "-v"]
        for name in names:
            argv += ["--health-url", f"{self.url(name)}/health", "--metrics-url", f"{self.url(name)}/metrics"]
        if hard:
            argv.append("--hard")
        env = {**self.env, "SERVEWATCH_HEALTH__INTERVAL_S": f"{HEALTH_INTERVAL_S:g}"}
        with log.open("wb") as fh:
            self.agent = subprocess.Popen(argv, env=env, cwd=self.workdir, stdin=subprocess.DEVNULL,
                                          stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.say(f"agent {self.agent.pid}: {' '.join(argv[3:])} (health probes every {HEALTH_INTERVAL_S:g} s)")

    def wait_agent(self) -> None:
        """Until the agent watches its first targets."""
        self.wait_log(["process: watching"], 60.0)

    def stop_agent(self) -> None:
        agent, self.agent = self.agent, None
        if agent is None or agent.poll() is not None:
            return
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.say("agent did not stop within 40 s of SIGTERM: killed")
            _kill_group(agent)

    # everything ------------------------------------------------------------------------------

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_agent()
        for name in list(self.servers):
            with contextlib.suppress(Exception):
                self.stop(name)
        for proc in self.others:
            _kill_group(proc)
        for proc in self.stray:
            with contextlib.suppress(psutil.Error):
                proc.kill()  # psutil checks it is still the process it was (no pid reuse)
        if self.agent is not None:
            _kill_group(self.agent)
        for t in self.threads:
            t.join(timeout=1)


# -- the events ----------------------------------------------------------------------------------


def _parallel(fns: list[Callable[[], object]], timeout_s: float = 240.0) -> None:
    """Run ``fns`` at once in threads; re-raise the first one's exception."""
    errors: list[BaseException] = []

    def run(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]


def _until(when: float) -> None:
    """Sleep until ``when`` (monotonic)."""
    time.sleep(max(0.0, when - time.monotonic()))


def _redeploy(h: _Host, name: str) -> None:
    offset = h.log_size()
    closed = h.stop(name)
    time.sleep(RESTART_GAP_S)
    h.start(name)
    h.warm(name)
    h.wait_health_decided(name, offset, closed + LIFECYCLE_SETTLE_S)


def _deploy(h: _Host, faults: dict[str, float]) -> None:
    _redeploy(h, "A")


def _restart(h: _Host, faults: dict[str, float]) -> None:
    _redeploy(h, "B")


def _traffic(url: str, until: threading.Event) -> None:
    while not until.is_set():
        with contextlib.suppress(httpx.HTTPError):
            generate(url, "profile me", max_new_tokens=8, timeout_s=60)


def _profile(h: _Host, faults: dict[str, float]) -> None:
    done = threading.Event()
    for name in ("A", "B"):
        h.background(lambda name=name: _traffic(h.url(name), done))
    procs = []
    for name in ("A", "B"):
        pid = h.servers[name].scheduler_pids[0]
        argv = [sys.executable, "-m", "agent.cli.entry", "profile", "--pid", str(pid), "--steps", "3", "--timeout", "90",
                "--out", str(h.workdir / "profiles" / name), "--data-dir", str(h.data_dir)]
        log = (h.workdir / f"profile-{name}.log").open("wb")
        proc = subprocess.Popen(argv, env=h.env, cwd=h.workdir, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        h.others.append(proc)
        procs.append((name, proc))
    for name, proc in procs:
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
        h.say(f"profile of {name}: exit {code}")
    done.set()
    time.sleep(PROFILE_QUIET_S)


def _load(h: _Host, faults: dict[str, float]) -> None:
    failed: list[str] = []

    def one(i: int) -> None:
        try:
            generate(h.url("A"), f"spike {i}", max_new_tokens=24, timeout_s=120)
        except httpx.HTTPError as exc:  # the demo's listen backlog is small: a reset is the client's to retry
            failed.append(type(exc).__name__)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(48)]
    for t in threads:
        t.start()
    inject_hang(h.url("B"), tp_rank=0, seconds=LONG_PREFILL_S)  # the prefill's forward is long, not hung
    with contextlib.suppress(httpx.HTTPError):
        generate(h.url("B"), "x" * 8000, max_new_tokens=4, timeout_s=120)
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    h.say(f"load spike: {48 - len(failed)} of 48 requests answered ({', '.join(sorted(set(failed))) or 'no errors'})")
    time.sleep(QUIET_S)


def _hang(h: _Host, name: str, rank: int, seconds: float | None, faults: dict[str, float]) -> None:
    inject_hang(h.url(name), tp_rank=rank, seconds=seconds)
    faults[name] = time.time()
    h.background(lambda: generate(h.url(name), "this one meets the hang", max_new_tokens=4, timeout_s=150))


def _hangs(h: _Host, faults: dict[str, float]) -> None:
    _hang(h, "A", 1, HANG_A_S, faults)
    time.sleep(HANG_GAP_S)
    _hang(h, "B", 0, HANG_B_S, faults)
    time.sleep(HANG_B_S + QUIET_S)  # both hangs over, their requests answered


def _crash(h: _Host, faults: dict[str, float]) -> None:
    offset = h.log_size()
    os.kill(h.servers["A"].scheduler_pids[1], signal.SIGSEGV)
    faults["A"] = time.time()
    # paged; the operator restarts the server once the agent judged A's failing health (503: TP1
    # is gone), at most 10 s later
    h.wait_health_decided("A", offset, time.monotonic() + CRASH_RESTART_S)
    h.stop("A")
    h.start("A")
    h.warm("A")
    time.sleep(QUIET_S)


def _crash_loop(h: _Host, faults: dict[str, float]) -> None:
    engine = [sys.executable, str(TITLED), f"{h.prefix}::scheduler_TP0", "--idle", "--exit-after-s", "2.5",
              "--exit-code", "1", "--max-lifetime-s", "60"]
    sup = subprocess.Popen([sys.executable, str(SUPERVISOR), "--runs", "5", "--restart-delay-s", "0.5", "--", *engine],
                           env=h.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
    h.others.append(sup)
    h.roles[sup.pid] = ("C", "supervisor")
    faults["C"] = time.time()
    assert sup.stdout is not None
    deadline = time.monotonic() + 60
    for line in sup.stdout:  # ends when the supervisor exits (bounded by its runs, and the kill below)
        words = line.split()
        if words[:1] == [b"started"]:
            h.roles[int(words[1])] = ("C", "engine")
        if time.monotonic() > deadline:
            _kill_group(sup)
            break
    sup.stdout.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        sup.wait(timeout=10)
    engines = [p for p, (s, r) in h.roles.items() if s == "C" and r == "engine"]
    h.say(f"crash loop: supervisor {sup.pid}, engines {engines}")
    time.sleep(QUIET_S)


def _stop(h: _Host, faults: dict[str, float]) -> None:
    offset = h.log_size()
    h.wait_health_decided("B", offset, h.stop("B") + LIFECYCLE_SETTLE_S)


def _orphan(h: _Host, faults: dict[str, float]) -> None:
    ready = h.workdir / "orphan-ready.json"
    proc = subprocess.Popen([sys.executable, str(ORPHAN_SERVER), "--title-prefix", h.prefix, "--ready-file", str(ready)],
                            env=h.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    h.others.append(proc)
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    doc = json.loads(ready.read_text())
    h.roles[doc["frontend"]] = ("D", "frontend")
    for rank, pid in enumerate(doc["ranks"]):
        h.roles[pid] = ("D", f"TP{rank}")
        with contextlib.suppress(psutil.Error):
            h.stray.append(psutil.Process(pid))
    h.say(f"server D: frontend {doc['frontend']}, ranks {doc['ranks']}")
    # the agent watches D (its status line names the new server; its full scans run every 10 s
    # once its targets are stable), then a moment
    h.wait_log([f"pid {doc['frontend']} ("], 15.0)
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)
    faults["D"] = time.time()
    proc.wait(timeout=10)  # its parent reaps it (a shell, systemd); the ranks live on
    alive = [pid for pid in doc["ranks"] if psutil.pid_exists(pid)]
    h.say(f"server D's frontend killed; still alive: {alive}")
    time.sleep(15.0)
    for proc in h.stray:  # the operator cleans up
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    time.sleep(QUIET_S)


def _hard(h: _Host, faults: dict[str, float]) -> None:
    h.stop_agent()
    h.start_agent(["A"], hard=True)
    h.wait_agent()
    h.warm("A")
    time.sleep(1.0)
    offset = h.log_size()
    _hang(h, "A", 1, None, faults)
    culprit = h.servers["A"].scheduler_pids[1]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(culprit):
        time.sleep(0.2)
    h.say(f"A's TP1 {'still there' if _alive(culprit) else 'signalled and gone'}; waiting out the knock-on")
    h.wait_health_decided("A", offset, time.monotonic() + HARD_SETTLE_S)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


SCRIPT: dict[str, Callable[[_Host, dict[str, float]], None]] = {
    "deploy": _deploy, "restart": _restart, "profile": _profile, "load": _load, "hangs": _hangs, "crash": _crash,
    "crash_loop": _crash_loop, "stop": _stop, "orphan": _orphan, "hard": _hard,
}


# -- what opened ------------------------------------------------------------------------------


def read_incidents(data_dir: Path) -> list[Opened]:
    """Every bundle's manifest under ``data_dir`` (``<host>/<incident-id>/manifest.json``), by opening time."""
    from agent.host.manifest import ManifestError, load_manifest

    out = []
    for path in sorted(data_dir.glob("*/*/manifest.json")):
        try:
            m = load_manifest(path)
        except (ManifestError, OSError):
            continue
        v = m.verdict
        out.append(Opened(
            incident_id=m.incident_id, trigger=str(m.trigger), opened_s=m.opened_time_unix_nano / 1e9,
            target_pids=frozenset(t.pid for t in m.targets), culprit_pids=frozenset(v.culprit_pids if v else ()),
            headline=(v.headline if v else "") or m.detail, state=str(m.state),
        ))  # fmt: skip
    return sorted(out, key=lambda o: o.opened_s)


def _wait_closed(data_dir: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(o.state != "open" for o in read_incidents(data_dir)):
            return
        time.sleep(1.0)


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+) (servewatch[\w.]*): (.*)$")
_LOG_WORDS = re.compile(r"incident|suppress|cooldown|stall|exited|health: |no incident|stopped|hard", re.IGNORECASE)


def _agent_lines(logs: list[Path]) -> list[tuple[float, str]]:
    lines = []
    for log in logs:
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                m = _LOG_TIME.match(line)
                if m is None or not _LOG_WORDS.search(m.group(4)):
                    continue
                when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                lines.append((when, f"{m.group(1)[11:19]} {m.group(4)[:220]}"))
    return lines


# -- judging ---------------------------------------------------------------------------------


def _who(pid: int, roles: dict[int, tuple[str, str]]) -> str:
    server, role = roles.get(pid, ("?", "?"))
    return f"{server}/{role}"


def _problems(inc: Opened, exp: Expected, roles: dict[int, tuple[str, str]]) -> list[str]:
    """Why ``inc`` does not meet ``exp`` (empty: it does)."""
    problems = []
    if exp.triggers and inc.trigger not in exp.triggers:
        problems.append(f"trigger {inc.trigger}, not {'/'.join(sorted(exp.triggers))}")
    if exp.culprit is not None:
        named = sorted(_who(p, roles) for p in inc.culprit_pids)
        if f"{exp.server}/{exp.culprit}" not in named:
            problems.append(f"culprit {', '.join(named) or 'none'}, not {exp.server}/{exp.culprit}")
    others = sorted({_who(p, roles) for p in inc.target_pids if roles.get(p, ("?",))[0] != exp.server})
    if others:
        problems.append(f"bundle also holds {', '.join(others)}")
    for role in exp.holds:
        pids = {p for p, sr in roles.items() if sr == (exp.server, role)}
        if not pids <= inc.target_pids:
            problems.append(f"bundle lacks {exp.server}/{role}")
    return problems


def _involves(inc: Opened, server: str, roles: dict[int, tuple[str, str]]) -> bool:
    return any(roles.get(p, ("?",))[0] == server for p in inc.target_pids | inc.culprit_pids)


def _describe(inc: Opened, roles: dict[int, tuple[str, str]]) -> str:
    culprit = ",".join(sorted(_who(p, roles) for p in inc.culprit_pids)) or "no culprit"
    servers = "".join(sorted({roles.get(p, ("?",))[0] for p in inc.target_pids})) or "-"
    return f"{inc.trigger} {culprit} (bundle {servers})"


def judge(windows: list[tuple[Event, float, float, dict[str, float]]], incidents: list[Opened],
          roles: dict[int, tuple[str, str]], agent_lines: list[tuple[float, str]] = ()) -> list[Row]:
    """Attribute every opened incident to its event's window and count false and missed ones.

    Args:
        windows: per event, (event, start, end, fault time per server), seconds since the epoch.
        incidents: what opened (:func:`read_incidents`).
        roles: pid -> (server, role) of every process the day started.
        agent_lines: (time, line) of the agent's log, for the rows' ``log``.

    Returns:
        One :class:`Row` per event; an incident opened before the first window or after the last
        is a false one of the nearest event.
    """
    rows = []
    for i, (event, start, end, faults) in enumerate(windows):
        first, last = i == 0, i == len(windows) - 1
        mine = [o for o in incidents if (first or o.opened_s >= start) and (last or o.opened_s < end)]
        row = Row(event.name, event.servers, event.what, [e.describe() for e in event.expected] or ["none"],
                  start_s=start, end_s=end)
        row.opened = [f"{o.incident_id.split('-')[-1]} {_describe(o, roles)} +{o.opened_s - start:.0f}s" for o in mine]
        row.log = [text for when, text in agent_lines if start <= when < end]
        free = list(mine)
        pending = list(event.expected)
        for exp in list(pending):  # first: incidents that meet an expectation
            ok = next((o for o in free if not _problems(o, exp, roles)), None)
            if ok is not None:
                free.remove(ok)
                pending.remove(exp)
                row.time_to_open_s.append(ok.opened_s - faults.get(exp.server, start))
        for exp in pending:  # then: the right kind of incident, about that server, but wrong
            near = next((o for o in free if (not exp.triggers or o.trigger in exp.triggers)
                         and _involves(o, exp.server, roles)), None)
            if near is None:
                row.missed.append(f"{exp.describe()}: not opened")
            else:
                free.remove(near)
                row.time_to_open_wrong_s.append(near.opened_s - faults.get(exp.server, start))
                row.missed.append(f"{exp.describe()}: {'; '.join(_problems(near, exp, roles))}")
        row.false = [f"{_describe(o, roles)}: {o.headline[:160]}" for o in free]
        rows.append(row)
    return rows


def totals(rows: list[Row]) -> tuple[int, int, int, int]:
    """(expected, opened, false, missed) over the day."""
    expected = sum(len(EVENTS_BY_NAME[r.event].expected) for r in rows)
    return expected, sum(len(r.opened) for r in rows), sum(len(r.false) for r in rows), sum(len(r.missed) for r in rows)


EVENTS_BY_NAME = {e.name: e for e in EVENTS}


def format_table(rows: list[Row], *, with_log: bool = True) -> str:
    """The table (event, servers, expected, opened, false, missed, time to open), then per event
    the false and missed incidents with why, and the agent's own lines in its window."""
    head = ("event", "srv", "expected", "opened", "false", "missed", "time to open")
    cells = [(r.event, r.servers, "; ".join(r.expected), str(len(r.opened)), str(len(r.false)), str(len(r.missed)),
              ", ".join([f"{t:.1f}s" for t in r.time_to_open_s] + [f"({t:.1f}s wrong)" for t in r.time_to_open_wrong_s])
              or "-") for r in rows]
    expected, opened, false, missed = totals(rows)
    cells.append(("TOTAL", "", f"{expected} incident(s)", str(opened), str(false), str(missed), ""))
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    for r in rows:
        if not (r.opened or r.false or r.missed):
            continue
        lines.append(f"\n[{r.event}] {r.what}")
        lines += [f"  opened: {o}" for o in r.opened]
        lines += [f"  FALSE:  {f}" for f in r.false]
        lines += [f"  MISSED: {m}" for m in r.missed]
        if with_log and (r.false or r.missed):
            lines += [f"  agent:  {line}" for line in r.log[-12:]]
    return "\n".join(lines)


# -- the day ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _host(workdir: Path, say: Callable[[str], None]) -> Iterator[_Host]:
    h = _Host(workdir, say)
    try:
        yield h
    finally:
        h.close()


def play_day(workdir: Path, *, say: Callable[[str], None] | None = None) -> list[Row]:
    """Play :data:`EVENTS` on this host and judge what the agent opened.

    Args:
        workdir: an empty folder: the data dir (``data/``), the agent's logs (``agent-<n>.log``),
            the profiles, the private shm folder.
        say: progress lines (default: stderr, with seconds since the start).

    Returns:
        One :class:`Row` per event (:func:`format_table` prints them).

    Raises:
        agent.errors.DemoServerError: a demo server did not start (everything is stopped first).
    """
    t0 = time.monotonic()
    if say is None:
        def say(msg: str) -> None:
            print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    windows: list[tuple[Event, float, float, dict[str, float]]] = []
    with _host(workdir, say) as h:
        h.start_agent(["A", "B"])  # --match waits for its servers
        h.start_all(["A", "B"])
        h.wait_agent()
        h.warm_all(["A", "B"])
        time.sleep(1.0)
        for event in EVENTS:
            faults: dict[str, float] = {}
            start = time.time()
            say(f"-- {event.name}: {event.what}")
            SCRIPT[event.name](h, faults)
            windows.append((event, start, time.time(), faults))
        _wait_closed(h.data_dir, 120.0)
        h.stop_agent()
        logs = list(h.agent_logs)
        roles = dict(h.roles)
    say(f"day over in {time.monotonic() - t0:.0f} s")
    return judge(windows, read_incidents(workdir / "data"), roles, _agent_lines(logs))
