"""One incident, one trace across every host of a job: the fleet coordinator.

Owns :class:`Fleet`: it serves the agent API (:mod:`agent.fleet.api` on
:mod:`agent.fleet.http`), asks the job's peers to capture when an incident opens here, opens a
joined incident when a peer asks, and keeps a job that detects one stall on several hosts to
one trace. It plugs into :class:`~agent.incidents.IncidentManager` through two hooks only:
``companions`` (started beside an incident's phases; the fan-out) and ``admit`` (a local
detection may be folded into a job incident).

Deduplication, per agent, with one "job incident" remembered for ``dedup_window_s``:

* a join (``POST /v1/incidents`` with a ``traceparent``) with no job incident in the window opens
  a joined incident: its root span hangs under the caller's root span, in the caller's trace;
* a join for the trace we are already in attaches (no second capture);
* a local detection inside the window is folded (no new incident; a ``fleet.detection_folded``
  span under the running incident records it), except a target exit after our incident in the
  job closed: a process that died later is a new fact, so it opens its own incident, placed in
  the job's trace under the origin's root span (no new fan-out: the peers are in that trace);
* two origins at once (two hosts detect within the network's round trip): the earlier origin
  (opened time, then host name) wins everywhere. A host whose own incident is the later one moves
  it into the earlier trace (:meth:`IncidentManager.retrace`) when the earlier origin's join
  reaches it, or when a peer answers its own join with "attached" and the earlier trace.

The fan-out never delays local capture: it runs in the fleet's own task group, each peer bounded
by ``peer_timeout_s``; its ``peer.capture`` results (one per peer: ok, refused, timed out,
unreachable) are collected when the incident's phases are done, into the manifest and spans.

Imports :mod:`agent.events`, :mod:`agent.incidents` (types), :mod:`agent.ranks` and the other
:mod:`agent.fleet` modules; never a watcher or an actor.
"""

from __future__ import annotations

import logging
import os
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from agent.events import (
    Action,
    ActionCompleted,
    ActionResult,
    ComponentStatusChanged,
    IncidentOpened,
    Outcome,
    Trigger,
    frozen_attrs,
    now_ns,
)
from agent.fleet.api import INCIDENT_ID_PATTERN, AgentApi, JoinRequest
from agent.fleet.config import (
    ApiConfig,
    FleetConfig,
    client_ssl_context,
    read_token_file,
    server_ssl_context,
)
from agent.fleet.http import HttpServer
from agent.fleet.peers import PeerResolver, ask_peer
from agent.fleet.traceparent import TraceParent
from agent.manifest import MANIFEST_NAME, ManifestError, parse_manifest
from agent.ranks import rank_label

__all__ = ["FOLDED_SPAN", "Fleet", "JobIncident"]

log = logging.getLogger("servewatch.fleet")

#: Span (action) name recording a local detection folded into the job incident.
FOLDED_SPAN = Action.DETECTION_FOLDED
#: Most incidents listed by ``GET /v1/incidents``.
MAX_LISTED = 200
#: Largest manifest served, bytes.
MAX_MANIFEST_BYTES = 4 * 1024 * 1024


class AgentView(Protocol):
    """What the fleet reads from the agent (:class:`agent.runtime.Agent`)."""

    settings: Any
    incidents: Any
    bus: Any

    def discover(self) -> list[Any]: ...

    @property
    def watched_step_pids(self) -> frozenset[int]: ...


@dataclass
class JobIncident:
    """The job incident this agent takes part in (one at a time, remembered for the window).

    Attributes:
        trace_id / root_span_id: the job's trace and the origin's root span (what joined
            incidents hang under); ``None`` while our own incident is still opening.
        origin_host / origin_time_unix_nano / origin_incident_id: who opened it first, when.
        local_incident_id: our incident in it (``None`` until it opened).
        started: monotonic time we learnt of it (the window runs from here).
        opened: set once our incident in it opened.
        move_local: our own incident (opening now) must move into this trace once it opens.
        extras: more action events for our incident (folded detections), collected at its end.
    """

    trace_id: str | None
    root_span_id: str | None
    origin_host: str
    origin_time_unix_nano: int
    origin_incident_id: str = ""
    local_incident_id: str | None = None
    started: float = field(default_factory=time.monotonic)
    opened: anyio.Event = field(default_factory=anyio.Event)
    move_local: bool = False
    extras: list[ActionCompleted] = field(default_factory=list)

    def origin_key(self) -> tuple[int, str]:
        return (self.origin_time_unix_nano, self.origin_host)

    def summary(self) -> dict[str, Any]:
        return {"trace_id": self.trace_id, "origin_host": self.origin_host, "origin_incident_id": self.origin_incident_id,
                "origin_time_unix_nano": self.origin_time_unix_nano, "local_incident_id": self.local_incident_id}


class Fleet:
    """Serve the API and coordinate the job's peers for ``agent``; run it in the agent's task group.

    Args:
        agent: the running agent (settings, incident manager, discovery, bus).
        api: API settings (enabled, bind, auth, limits).
        fleet: job settings (name, peers, timeouts, window).
    """

    def __init__(self, agent: AgentView, api: ApiConfig, fleet: FleetConfig) -> None:
        self.agent = agent
        self.api_config = api
        self.config = fleet
        self.host_name: str = agent.settings.host_name
        self.data_dir = Path(agent.settings.data_dir)
        #: random per run; a peer that answers with it is ourselves (an address we did not know)
        self.agent_id = secrets.token_hex(8)
        self.job: JobIncident | None = None
        self.server: HttpServer | None = None
        self.api: AgentApi | None = None
        self.resolver: PeerResolver | None = None
        self._tg: TaskGroup | None = None
        self._client_ssl: ssl.SSLContext | None = None
        self._token: bytes | None = None
        self._opened_waiters: list[tuple[Callable[[IncidentOpened], bool], anyio.Event, list[IncidentOpened]]] = []
        self._components: dict[str, tuple[str, str]] = {}
        self._started_s = time.time()
        #: local detections folded into a job incident
        self.folded = 0
        #: joins received (opened + attached + moved)
        self.joins = 0
        #: our incidents moved into an earlier origin's trace
        self.moved = 0
        #: fan-outs done, and peers asked in all
        self.fanouts = 0
        self.peers_asked = 0

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The API's bound port (after start)."""
        return self.server.port if self.server is not None else self.api_config.port

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the API (bound when this reports started) and serve until cancelled."""
        api = self.api_config
        # the token and TLS files: file reads, off the event loop
        self._token = await anyio.to_thread.run_sync(read_token_file, api.token_file) if api.token_file is not None else None
        ssl_context = await anyio.to_thread.run_sync(server_ssl_context, api)
        self.api = AgentApi(self, token=self._token, mutual_tls=api.mutual_tls, rate_per_s=api.rate_per_s, rate_burst=api.rate_burst,
                            guess_rate_per_s=api.guess_rate_per_s, guess_burst=api.guess_burst)
        self.server = HttpServer(
            self.api, host=api.host, port=api.port, ssl_context=ssl_context, max_body_bytes=api.max_body_bytes,
            read_timeout_s=api.read_timeout_s, max_connections=api.max_connections, authenticate=self.api.authorized,
            max_connections_per_client=api.max_connections_per_client,
            reserved_for_authenticated=min(api.reserved_for_authenticated, api.max_connections - 1),
            header_timeout_s=api.header_timeout_s, idle_timeout_s=api.idle_timeout_s,
        )
        cfg = self.config
        self._client_ssl = client_ssl_context(api)
        manager = self.agent.incidents
        status_sub = self.agent.bus.subscribe(ComponentStatusChanged, name="fleet-status", max_buffer=float("inf"))
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await tg.start(self.server.serve)
                scheme = "https" if api.tls else "http"
                self.resolver = PeerResolver(cfg.peers, dns_name=cfg.peers_dns, own_port=self.server.port,
                                             default_port=api.port or self.server.port, scheme=scheme, timeout_s=cfg.peer_timeout_s)
                manager.companions.append(self._companion)
                if cfg.job:
                    manager.admit = self._admit
                tg.start_soon(self._watch_status, status_sub)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            status_sub.close()
            if self._companion in manager.companions:
                manager.companions.remove(self._companion)
            if manager.admit == self._admit:
                manager.admit = None

    async def _watch_status(self, sub: Any) -> None:
        async for event in sub:
            self._components[event.component] = (str(event.status), event.detail)

    def _headers(self) -> dict[str, str]:
        headers = {"x-servewatch-agent": self.agent_id, "user-agent": "servewatch-fleet"}
        if self._token is not None:
            headers["authorization"] = f"Bearer {self._token.decode()}"
        return headers

    def _in_window(self, job: JobIncident | None) -> bool:
        return job is not None and time.monotonic() - job.started < self.config.dedup_window_s

    # -- hooks into the incident manager ---------------------------------------------------------

    def _admit(self, trigger: str, detail: str) -> bool:
        """A local detection: folded when a job incident is in its window, else it claims one."""
        job = self.job
        current = self.agent.incidents.current
        running = job is not None and current is not None and current.opened.incident_id == job.local_incident_id
        # a hang's symptoms (stall, failed health) on this host are the job incident's; a process
        # that exits after the job incident closed is a new fact and gets its own incident
        if self._in_window(job) and (running or trigger != Trigger.EXIT):
            assert job is not None
            self.folded += 1
            log.info("%s detection folded into job incident %s (trace %s)", trigger, job.origin_incident_id, job.trace_id)
            if running:
                t = now_ns()
                job.extras.append(ActionCompleted(
                    source="fleet", incident_id=job.local_incident_id or "",
                    result=ActionResult(action=FOLDED_SPAN, outcome=Outcome.SKIPPED, detail=f"local {trigger} detection: {detail}",
                                        start_time_unix_nano=t, end_time_unix_nano=t,
                                        attributes=frozen_attrs({"servewatch.incident.trigger": trigger})),
                ))
            return False
        if self._in_window(job) and job is not None and job.trace_id and job.root_span_id:
            # a target exit after our part of the job incident closed: its own incident, in the
            # job's trace (a child of the origin's root span), with no new fan-out
            job.local_incident_id = None
            job.move_local = True
            job.opened = anyio.Event()
            return True
        self.job = JobIncident(trace_id=None, root_span_id=None, origin_host=self.host_name, origin_time_unix_nano=now_ns())
        return True

    def _companion(self, opened: IncidentOpened) -> Callable[[], Awaitable[list[ActionCompleted]]]:
        """Called by the incident manager right after ``opened`` was published."""
        for predicate, event, box in list(self._opened_waiters):
            if predicate(opened):
                box.append(opened)
                event.set()
        job = self.job
        if opened.parent_span_id:  # a joined incident (a peer asked, or a user's traceparent)
            if job is not None and job.trace_id == opened.trace_id and job.local_incident_id is None:
                job.local_incident_id = opened.incident_id
                job.opened.set()
            return self._collector(job, opened, None)
        if not self.config.job:
            return _nothing
        if job is None or job.local_incident_id is not None or not self._in_window(job) or (job.trace_id and not job.move_local):
            # a manual incident, or a trigger that bypassed admit: a new job incident, ours
            job = JobIncident(trace_id=None, root_span_id=None, origin_host=self.host_name, origin_time_unix_nano=opened.time_unix_nano)
            self.job = job
        job.local_incident_id = opened.incident_id
        job.opened.set()
        job.origin_incident_id = job.origin_incident_id or opened.incident_id
        if job.move_local:  # an earlier origin's join arrived while ours was opening: join it
            done = anyio.Event()
            assert self._tg is not None and job.trace_id and job.root_span_id
            self._tg.start_soon(self._move, opened.incident_id, job.trace_id, job.root_span_id, done)
            return self._collector(job, opened, done)
        job.trace_id, job.root_span_id = opened.trace_id, opened.span_id
        results: list[ActionResult] = []
        done = anyio.Event()
        assert self._tg is not None
        self._tg.start_soon(self._fanout, opened, job, results, done)
        return self._collector(job, opened, done, results)

    def _collector(
        self, job: JobIncident | None, opened: IncidentOpened, done: anyio.Event | None, results: list[ActionResult] | None = None
    ) -> Callable[[], Awaitable[list[ActionCompleted]]]:
        async def collect() -> list[ActionCompleted]:
            if done is not None:
                await done.wait()
            events = [ActionCompleted(source="fleet", incident_id=opened.incident_id, result=r) for r in results or ()]
            if job is not None and job.local_incident_id == opened.incident_id:
                events += job.extras
                job.extras = []
            return events

        return collect

    async def _move(self, incident_id: str, trace_id: str, parent_span_id: str, done: anyio.Event | None = None) -> bool:
        try:
            moved = await self.agent.incidents.retrace(incident_id, trace_id, parent_span_id)
            if moved:
                self.moved += 1
                log.warning("incident %s moved into the job's trace %s (under span %s)", incident_id, trace_id, parent_span_id)
            return moved
        finally:
            if done is not None:
                done.set()

    # -- fan-out ------------------------------------------------------------------------------------

    async def _fanout(self, opened: IncidentOpened, job: JobIncident, results: list[ActionResult], done: anyio.Event) -> None:
        try:
            assert self.resolver is not None
            peers, problems = await self.resolver.resolve()
            results.extend(problems)
            self.fanouts += 1
            self.peers_asked += len(peers)
            traceparent = TraceParent(opened.trace_id, opened.span_id)
            body = {
                "job": self.config.job, "incident_id": opened.incident_id, "origin_host": self.host_name,
                "origin_time_unix_nano": job.origin_time_unix_nano, "detail": f"{opened.trigger}: {opened.detail}"[:500],
            }
            headers = self._headers()
            slots: list[ActionResult | None] = [None] * len(peers)

            async def one(i: int) -> None:
                result, answer = await ask_peer(peers[i], traceparent=traceparent, body=body, headers=headers,
                                                timeout_s=self.config.peer_timeout_s, ssl_context=self._client_ssl)
                if answer is not None and answer.get("error") == "self":
                    assert self.resolver is not None
                    self.resolver.self_peers.add(peers[i])
                    return
                slots[i] = result
                if answer is not None and answer.get("status") == "attached":
                    await self._maybe_yield(job, answer)

            async with anyio.create_task_group() as tg:
                for i in range(len(peers)):
                    tg.start_soon(one, i)
            results.extend(r for r in slots if r is not None)
            failed = sum(1 for r in results if r.outcome is not Outcome.OK)
            log.info("asked %d peer(s) of job %s to capture incident %s: %d ok, %d failed",
                     len(peers), self.config.job, opened.incident_id, len(peers) - failed, failed)
        except Exception:  # boundary: the fan-out never takes the agent down
            log.exception("fan-out of incident %s failed", opened.incident_id)
        finally:
            done.set()

    async def _maybe_yield(self, job: JobIncident, answer: dict[str, Any]) -> None:
        """A peer attached our join to another trace: if its origin is earlier, move ours there."""
        try:
            theirs = (int(answer["origin_time_unix_nano"]), str(answer["origin_host"]))
            tp = TraceParent.parse(str(answer["traceparent"]))
        except (KeyError, TypeError, ValueError):
            return
        if self.job is not job or job.trace_id == tp.trace_id or theirs >= job.origin_key():
            return
        local = job.local_incident_id
        self.job = JobIncident(trace_id=tp.trace_id, root_span_id=tp.parent_id, origin_host=theirs[1],
                               origin_time_unix_nano=theirs[0], origin_incident_id=str(answer.get("origin_incident_id", "")),
                               local_incident_id=local, started=job.started, extras=job.extras)
        self.job.opened.set()
        if local is not None:
            await self._move(local, tp.trace_id, tp.parent_id)

    # -- API backend ----------------------------------------------------------------------------------

    async def post_incident(self, request: JoinRequest, *, agent_id: str) -> tuple[int, dict[str, Any]]:
        """``POST /v1/incidents``: a manual incident, or a join of a trace begun elsewhere."""
        if agent_id and agent_id == self.agent_id:
            return 409, {"error": "self", "host.name": self.host_name}
        manager = self.agent.incidents
        tp: TraceParent | None = request.get("traceparent")
        detail = request.get("detail") or ""
        if tp is None:
            current = manager.current
            if current is not None:
                return 409, {"error": "an incident is running", **self._incident_doc(current.opened), "status": "busy"}
            # a manual incident pauses every rank (py-spy): it shares the cooldown of every trigger
            left_s, last_id = manager.claim_cooldown(Trigger.MANUAL, detail or "requested over the agent API")
            if left_s > 0:
                return 429, {"error": f"cooling down: incident {last_id or '(the last manual one)'} opened less than"
                             f" incident.cooldown_s ago; retry in {left_s:.0f} s", "status": "cooldown",
                             "incident_id": last_id, "retry_after_s": round(left_s, 1), "host.name": self.host_name}
            since = now_ns()
            opened = await self._open_and_wait(lambda o: not o.parent_span_id and o.time_unix_nano >= since,
                                               Trigger.MANUAL, detail or "requested over the agent API", None)
            if opened is not None:
                manager.cooldown_opened(Trigger.MANUAL, opened.incident_id)
            return 202, {"status": "opened" if opened else "accepted", **self._incident_doc(opened)}
        job_name = request.get("job")
        if job_name is not None and job_name != self.config.job:
            return 409, {"error": f"job mismatch: this agent is in job {self.config.job!r}", "host.name": self.host_name}
        self.joins += 1
        origin_host = request.get("origin_host") or "?"
        origin_time = request.get("origin_time_unix_nano") or now_ns()
        origin_id = request.get("incident_id") or ""
        job = self.job
        theirs = (origin_time, origin_host)
        if self._in_window(job):
            assert job is not None
            if job.trace_id == tp.trace_id:
                return 200, self._answer("attached", job)
            if theirs >= job.origin_key():
                return 200, self._answer("attached", job)  # ours is earlier: the caller moves into ours
            # theirs is earlier: everything of ours in this job moves into their trace
            local = job.local_incident_id
            moved_job = JobIncident(trace_id=tp.trace_id, root_span_id=tp.parent_id, origin_host=origin_host,
                                    origin_time_unix_nano=origin_time, origin_incident_id=origin_id,
                                    local_incident_id=local, started=job.started, extras=job.extras)
            self.job = moved_job
            if local is None:  # ours is still opening: it moves once it opened
                moved_job.move_local = True
                with anyio.move_on_after(self.config.accept_timeout_s):
                    await moved_job.opened.wait()
                return 202, self._answer("joined", moved_job)
            moved_job.opened.set()
            current = manager.current
            if current is not None and current.opened.incident_id == local:
                await self._move(local, tp.trace_id, tp.parent_id)
                return 200, self._answer("joined", moved_job)
            return 200, self._answer("attached", moved_job)  # ours already closed: its evidence stands
        job = JobIncident(trace_id=tp.trace_id, root_span_id=tp.parent_id, origin_host=origin_host,
                          origin_time_unix_nano=origin_time, origin_incident_id=origin_id)
        self.job = job
        why = f"job {self.config.job or '-'}: {origin_host} opened {origin_id or 'an incident'}" + (f" ({detail})" if detail else "")
        assert self._tg is not None
        self._tg.start_soon(self._open_joined, why[:500], tp)
        with anyio.move_on_after(self.config.accept_timeout_s):
            await job.opened.wait()
        return 202, self._answer("opened" if job.local_incident_id else "accepted", job)

    async def _open_joined(self, detail: str, tp: TraceParent) -> None:
        try:
            await self.agent.incidents.open_incident(Trigger.PEER, detail=detail, parent=(tp.trace_id, tp.parent_id))
        except Exception:  # boundary: a failed incident is logged, the agent goes on
            log.exception("joined incident failed")

    async def _open_and_wait(
        self, predicate: Callable[[IncidentOpened], bool], trigger: str, detail: str, parent: tuple[str, str] | None
    ) -> IncidentOpened | None:
        event, box = anyio.Event(), []  # type: ignore[var-annotated]
        waiter = (predicate, event, box)
        self._opened_waiters.append(waiter)
        try:
            assert self._tg is not None

            async def run() -> None:
                try:
                    await self.agent.incidents.open_incident(trigger, detail=detail, parent=parent)
                except Exception:
                    log.exception("incident requested over the API failed")

            self._tg.start_soon(run)
            with anyio.move_on_after(self.config.accept_timeout_s):
                await event.wait()
        finally:
            self._opened_waiters.remove(waiter)
        return box[0] if box else None

    def _ranks(self) -> list[str]:
        current = self.agent.incidents.current
        targets = current.targets if current is not None else []
        return [label for label in (rank_label(t.title) for t in targets) if label]

    def _answer(self, status: str, job: JobIncident) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "status": status, "host.name": self.host_name, "job": self.config.job, "incident_id": job.local_incident_id,
            "trace_id": job.trace_id, "origin_host": job.origin_host, "origin_time_unix_nano": job.origin_time_unix_nano,
            "origin_incident_id": job.origin_incident_id, "ranks": self._ranks(),
        }
        if job.trace_id and job.root_span_id:
            doc["traceparent"] = TraceParent(job.trace_id, job.root_span_id).header()
        return doc

    def _incident_doc(self, opened: IncidentOpened | None) -> dict[str, Any]:
        if opened is None:
            return {"host.name": self.host_name, "incident_id": None}
        return {"host.name": self.host_name, "incident_id": opened.incident_id, "trigger": opened.trigger,
                "trace_id": opened.trace_id, "span_id": opened.span_id, "parent_span_id": opened.parent_span_id,
                "opened_time_unix_nano": opened.time_unix_nano}

    async def status(self) -> dict[str, Any]:
        """``GET /v1/status``: the status file's content (schema ``servewatch.status/1``: every
        watcher ready / waiting / blind with its reason) plus targets, the open incident, the job.
        Discovery (a process scan) runs on a worker thread."""
        agent = self.agent
        manager = agent.incidents
        try:
            targets = await anyio.to_thread.run_sync(agent.discover)
        except Exception:  # discovery trouble is shown, never raised
            log.exception("target discovery failed")
            targets = []
        current = manager.current
        board = getattr(agent, "status", None)  # the watchers' status model (ready / waiting / blind)
        watchers: dict[str, Any] = board.snapshot().to_json() if board is not None else {}
        doc: dict[str, Any] = {
            **watchers,
            "host.name": self.host_name,
            "time_unix_nano": now_ns(),
            "uptime_s": round(time.time() - self._started_s, 3),
            "pid": os.getpid(),
            "components": {name: {"status": s, "detail": d} for name, (s, d) in sorted(self._components.items())},
            "targets": [{"pid": t.pid, "title": t.title, "rank": rank_label(t.title) or None,
                         "step_counter_watched": t.pid in agent.watched_step_pids} for t in targets],
            "open_incident": self._incident_doc(current.opened) if current is not None else None,
            "incidents": len(manager.records),
            "suppressed": manager.suppressed,
            "fleet": {
                "job": self.config.job,
                "api_port": self.port,
                "peers": [str(p) for p in (self.resolver.static if self.resolver else [])],
                "peers_dns": self.config.peers_dns,
                "job_incident": self.job.summary() if self._in_window(self.job) and self.job else None,
                "folded": self.folded, "joins": self.joins, "moved": self.moved,
                "fanouts": self.fanouts, "peers_asked": self.peers_asked,
            },
            "api": self.server.statistics()._asdict() if self.server else None,
            "bus": agent.bus.statistics()._asdict(),
        }
        return doc

    def _host_dir(self) -> Path:
        return self.data_dir / self.host_name

    async def list_incidents(self) -> list[dict[str, Any]]:
        """``GET /v1/incidents``: this host's incidents, newest first (ids start with their UTC
        time); the open one first. Manifests are read on a worker thread."""
        out = await anyio.to_thread.run_sync(self._read_listing)
        current = self.agent.incidents.current
        if current is not None and all(i["incident_id"] != current.opened.incident_id for i in out):
            out.insert(0, {**self._incident_doc(current.opened), "open": True})
        return out

    def _read_listing(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            entries = sorted((e.name for e in os.scandir(self._host_dir()) if e.is_dir(follow_symlinks=False)
                              and INCIDENT_ID_PATTERN.fullmatch(e.name)), reverse=True)
        except OSError:
            entries = []
        for name in entries[:MAX_LISTED]:
            manifest = self._read_manifest(name)
            if manifest is None:
                continue
            out.append({key: manifest.get(key) for key in ("incident_id", "trigger", "detail", "host.name", "trace_id",
                                                            "parent_span_id", "opened_time_unix_nano", "closed_time_unix_nano")})
        return out

    async def get_incident(self, incident_id: str) -> dict[str, Any] | None:
        """``GET /v1/incidents/{id}``: the manifest (read without following symlinks) as
        :class:`agent.manifest.Manifest` validates it, or None (no such incident, too big, or not
        a manifest this agent reads)."""
        return await anyio.to_thread.run_sync(self._read_manifest, incident_id)

    def _read_manifest(self, incident_id: str) -> dict[str, Any] | None:
        if not INCIDENT_ID_PATTERN.fullmatch(incident_id):
            return None
        path = self._host_dir() / incident_id / MANIFEST_NAME
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError:
            return None
        if len(data) > MAX_MANIFEST_BYTES:
            return None
        try:
            return parse_manifest(data, source=str(path)).to_json_dict()
        except ManifestError as exc:  # not a manifest this agent reads: not served (listings poll: no warning)
            log.debug("%s", exc)
            return None


async def _nothing() -> list[ActionCompleted]:
    return []
