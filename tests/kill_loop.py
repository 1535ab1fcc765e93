"""The kill loop: a real ``servewatch run`` agent SIGKILLed at random moments of real incidents,
against a real OTLP receiver, then every span the incident manifests record checked at the
receiver (lost, delivered once, delivered twice).

Used by ``tests/exporters/test_kill_loop.py`` (the proof, >= 50 kills) and
``bench/bench_kill_loop.py`` (the figures, with collector outages). One life of the agent:

1. the target (``tests/programs/fake_server.py``: an SDK step counter, a hang inside "forward"
   on request) runs; a fresh ``servewatch run --pid TARGET`` starts and watches its steps;
2. the target hangs: the watchdog (0.5 s) opens a stall incident: py-spy dumps it, the
   Flight Recorder and coredump actions run, the verdict is made, the bundle written, the spans
   mirrored write-ahead and shipped;
3. at a random moment after the incident's manifest appears (``max_delay_s``), the agent's
   process group gets SIGKILL; the target steps again.

Between lives the collector may go away (``outage_every``) and ``servewatch export`` may run on
the data dir (``export_every``), as an operator would. A last life without a kill lets the next
agent recover what the killed ones left (bundles to close, spans never made durable), deliver the
spool and stop with SIGTERM; a last ``servewatch export`` follows.

Expected spans: for each bundle, the root (``span_id`` of the manifest) and each action the
manifest records (its ``span_id``). A span is lost when the receiver never got it, duplicated
when it got it more than once (the documented at-least-once window: a request the collector
acknowledged while the agent was killed before it recorded the acknowledgement).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.otlp_receiver import OtlpReceiver
from tests.programs.fake_server import FakeServer

REPO = Path(__file__).resolve().parents[1]
#: ``host.name`` of the agents (the bundles' folder).
HOST = "killloop"


@dataclass
class KillLoopResult:
    """What a kill loop did and what arrived."""

    #: agent lives ended by SIGKILL
    kills: int = 0
    #: incidents (bundles) written
    incidents: int = 0
    #: spans the manifests record (roots + actions)
    expected: int = 0
    #: of those, received at least once
    delivered: int = 0
    #: span ids recorded but never received
    lost: list[str] = field(default_factory=list)
    #: spans received more than once (extra copies)
    duplicated: int = 0
    #: incidents left open or interrupted by a kill (closed by the next agent)
    interrupted: int = 0
    #: spans ``servewatch export`` sent between lives
    exported: int = 0
    #: seconds from the collector coming back (last outage) to every spooled span delivered
    recovery_s: list[float] = field(default_factory=list)
    #: kill moments, seconds after the incident's manifest appeared
    kill_delays_s: list[float] = field(default_factory=list)


def agent_env(shm_dir: Path, *, agent_repo: Path = REPO, quick_retry: bool = True) -> dict[str, str]:
    """The agents' environment: the code of ``agent_repo`` (a checkout; another one measures
    an older agent), the shared shm folder, a fixed host name; ``quick_retry``: spool replay
    retries at most every 0.5 s (the default backoff grows to 5 s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(PYTHONPATH=str(agent_repo), SERVEWATCH_SHM_DIR=str(shm_dir), SERVEWATCH_HOST_NAME=HOST,
               OTEL_EXPORTER_OTLP_TIMEOUT="2000")
    if quick_retry:
        env.update(SERVEWATCH_EXPORT__RETRY_MAX_BACKOFF_S="0.5", SERVEWATCH_EXPORT__SCHEDULE_DELAY_S="0.2")
    return env


def _kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def _manifests(data_dir: Path) -> dict[str, dict]:
    out = {}
    for path in (data_dir / HOST).glob("*/manifest.json"):
        try:
            out[path.parent.name] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written (atomically replaced): read next time
    return out


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"kill loop: {what} not within {timeout_s} s")
        time.sleep(interval_s)


def _steps_ready(data_dir: Path) -> bool:
    try:
        status = json.loads((data_dir / HOST / "status.json").read_text())
    except (OSError, ValueError):
        return False
    return any(w.get("name") == "steps" and w.get("state") == "ready" for w in status.get("watchers", ()))


def _spool_spans(data_dir: Path) -> int:
    spool = data_dir / HOST / "spool"
    total = 0
    for path in spool.rglob("*.binpb") if spool.exists() else ():
        if "rejected" in path.parts or path.name.endswith(".metrics.binpb"):
            continue
        try:
            total += int(path.name.removesuffix(".binpb").split("-")[1])
        except (IndexError, ValueError):
            continue
    return total


def _unfinished(data_dir: Path) -> list[str]:
    """Bundles still open or interrupted, or (an agent that tracks span ids) not yet marked with
    every span durable."""
    out = []
    for name, m in _manifests(data_dir).items():
        marked = (data_dir / HOST / name / "spans.durable").exists()
        if m.get("state") != "closed" or (m.get("spans_tracked") and not marked):
            out.append(name)
    return out


class KillLoop:
    """Drive agent lives against ``server`` and ``receiver``; see the module docstring.

    Args:
        data_dir: the agents' data dir (shared by every life, as on a node).
        receiver: the collector (started).
        server: the target (``fake_server`` started with the test's ``spawn``).
        shm_dir: the SDK shm folder the target uses.
        rng: the random source of kill moments.
        protocols: cycled through, one per life (``grpc``, ``http/protobuf``).
        max_delay_s: kill moments are uniform in ``[0, max_delay_s]`` after the incident's manifest appears.
        outage_every: every this many lives, the collector is down for that life (0: never).
        export_every: every this many lives, ``servewatch export`` runs after the kill (0: never).
        log: progress lines (``print`` in the bench, nothing in tests).
        agent_repo: the checkout whose agent runs (default: this one).
        quick_retry: see :func:`agent_env`.
    """

    def __init__(
        self, *, data_dir: Path, receiver: OtlpReceiver, server: FakeServer, shm_dir: Path, rng: random.Random,
        protocols: tuple[str, ...] = ("grpc", "http/protobuf"), max_delay_s: float = 0.8, outage_every: int = 0,
        export_every: int = 0, log: Callable[[str], None] = lambda line: None, agent_repo: Path = REPO,
        quick_retry: bool = True,
    ) -> None:
        self.data_dir = data_dir
        self.receiver = receiver
        self.server = server
        self.env = agent_env(shm_dir, agent_repo=agent_repo, quick_retry=quick_retry)
        #: the CLI module of that checkout: ``agent.cli`` in one from before the layout by layers
        self.cli = "agent.cli.app" if (agent_repo / "agent" / "cli" / "app.py").is_file() else "agent.cli"
        self.rng = rng
        self.protocols = protocols
        self.max_delay_s = max_delay_s
        self.outage_every = outage_every
        self.export_every = export_every
        self.log = log
        self.result = KillLoopResult()
        self._life = 0

    @staticmethod
    def target_env(shm_dir: Path) -> dict[str, str]:
        """The target's environment: the SDK's shm folder shared with the agents."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
        env.update(PYTHONPATH=str(REPO), SERVEWATCH_SHM_DIR=str(shm_dir))
        return env

    def _start_agent(self, protocol: str) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable, "-m", self.cli, "run", "--pid", str(self.server.pid), "--watchdog-timeout", "0.5",
            "--cooldown", "0.1", "--data-dir", str(self.data_dir), "--otlp-endpoint", self.receiver.endpoint(protocol),
            "--otlp-protocol", protocol,
        ]
        with open(self.data_dir.parent / "agents.log", "ab") as log:  # each life's stderr, for a failure's story
            log.write(f"--- life {self._life} ({protocol})\n".encode())
            log.flush()
            return subprocess.Popen(argv, cwd=self.data_dir.parent, env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)

    def life(self) -> None:
        """One agent life ended by SIGKILL mid-incident."""
        self._life += 1
        protocol = self.protocols[self._life % len(self.protocols)]
        outage = bool(self.outage_every) and self._life % self.outage_every == 0
        if outage:
            self.receiver.stop()
        self.server.control(mode="run")
        (self.data_dir / HOST / "status.json").unlink(missing_ok=True)
        known = set(_manifests(self.data_dir))
        agent = self._start_agent(protocol)
        try:
            _wait(lambda: _steps_ready(self.data_dir), 60, "the agent watching the target's steps")
            self.server.control(mode="freeze")
            _wait(lambda: bool(set(_manifests(self.data_dir)) - known), 30, "a stall incident")
            delay_s = self.rng.uniform(0.0, self.max_delay_s)
            time.sleep(delay_s)
            _kill_group(agent)
            agent.wait(10)
            self.result.kills += 1
            self.result.kill_delays_s.append(delay_s)
        finally:
            _kill_group(agent)
            agent.wait(10)
            self.server.control(mode="run")
        self.log(f"life {self._life} ({protocol}{', collector down' if outage else ''}): killed {delay_s:.2f} s after the incident opened")
        if outage:
            self.receiver.start()
        if self.export_every and self._life % self.export_every == 0:
            self.export(protocol)

    def export(self, protocol: str) -> None:
        """``servewatch export`` of the data dir, as an operator would run it (no agent running)."""
        r = subprocess.run(
            [sys.executable, "-m", self.cli, "export", "--to", self.receiver.endpoint(protocol), "--protocol", protocol,
             "--data-dir", str(self.data_dir)],
            cwd=self.data_dir.parent, env=self.env, capture_output=True, text=True, timeout=120, check=False,
        )
        line = next((x for x in r.stderr.splitlines() if x.startswith("Sent ")), r.stderr.strip()[-300:])
        self.result.exported += int(line.split()[1]) if line.startswith("Sent ") else 0
        self.log(f"export: {line}")

    def finish(self, *, timeout_s: float = 120.0) -> KillLoopResult:
        """The next agent recovers, delivers, and stops (SIGTERM); a last export; then count."""
        self.receiver.start()
        self.server.control(mode="run")
        came_back = time.monotonic()
        agent = self._start_agent(self.protocols[0])
        try:
            _wait(lambda: _spool_spans(self.data_dir) == 0 and not _unfinished(self.data_dir) and self._settled(), timeout_s,
                  "every bundle closed and marked, and the spool delivered", interval_s=0.1)
            self.result.recovery_s.append(time.monotonic() - came_back)
            _kill_group(agent, signal.SIGTERM)
            agent.wait(60)
        finally:
            _kill_group(agent)
            agent.wait(10)
        self.export(self.protocols[0])
        return self.count()

    def _settled(self) -> bool:
        """The receiver's span count has not moved for a second (the last sends arrived)."""
        count = self.receiver.span_count
        if count != getattr(self, "_last_count", None):
            self._last_count, self._last_change = count, time.monotonic()
        return time.monotonic() - self._last_change >= 1.0

    def count(self) -> KillLoopResult:
        """Compare what the manifests record with what the receiver got. A span is matched by
        what it is, not only by its id (so the same count runs on agents from before span ids
        were recorded): the root by ``servewatch.incident.id``, an action by incident, name and
        ``process.pid`` (as many as the manifest lists)."""
        result = self.result
        manifests = _manifests(self.data_dir)
        expected: Counter[tuple[str, str, int | None]] = Counter()
        for m in manifests.values():
            incident = m["incident_id"]
            expected[(incident, "incident", None)] += 1
            for a in m.get("actions", ()):
                expected[(incident, a["action"], a.get("pid"))] += 1
            result.interrupted += bool(m.get("interrupted"))
        received: Counter[tuple[str, str, int | None]] = Counter()
        copies: Counter[str] = Counter()
        for span in self.receiver.spans():
            attrs = span.attributes
            incident = attrs.get("servewatch.incident.id")
            if not isinstance(incident, str) or incident not in manifests:
                continue
            pid = attrs.get("process.pid") if span.name != "incident" else None
            received[(incident, span.name, pid if isinstance(pid, int) else None)] += 1
            copies[span.span_id] += 1
        result.incidents = len(manifests)
        result.expected = sum(expected.values())
        result.lost = sorted(f"{k[0]} {k[1]} pid {k[2]}" for k, n in expected.items() for _ in range(max(0, n - received[k])))
        result.delivered = result.expected - len(result.lost)
        # extra copies: the same span id more than once, or more spans of a kind than recorded
        result.duplicated = max(sum(n - 1 for n in copies.values() if n > 1),
                                sum(max(0, n - expected[k]) for k, n in received.items() if k in expected))
        return result
