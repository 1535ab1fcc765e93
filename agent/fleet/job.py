"""One incident, one trace across every host of a job, one coordinator, one verdict.

Owns :class:`Fleet`: it serves the agent API (:mod:`agent.fleet.api` on :mod:`agent.fleet.http`)
and runs a job's protocol. It contributes three things to
:class:`~agent.incidents.manager.IncidentManager`, which the runtime passes to the manager's
constructor (the fleet is built first and never writes into the manager): :meth:`Fleet.admit` (a
local detection inside a job incident's window is folded), :meth:`Fleet.place` (names an
incident's trace before it opens) and :meth:`Fleet.companion` (runs beside an incident's phases).
They are inert until :meth:`Fleet.run` has started the API (every trigger admitted, no placement,
nothing beside the phases), and again once it ends; ``admit`` and ``place`` only act for a job
(``fleet.job``).

The protocol, per job incident:

1. **Capture first; trace identity without messages.** A host that detects derives the trace id
   from facts that cost nothing at detection (:mod:`agent.fleet.identity`): the job and the
   detection time bucket. Nothing is read from the ranks first: the local capture starts at once.
   The stuck collective (from every host's Flight Recorder windows, read by the capture itself)
   is recorded later, in the job verdict and on its root span. Its incident opens under the
   job's root span ``job.incident``, whose id is derived from the
   trace id: every host's incident hangs under one root, whoever detects first.
2. **One coordinator.** The host of global rank 0 (it announces itself to every peer every
   ``announce_interval_s``; the answers tell it every host's name and ranks), else the lowest
   live host in the job's member list (every host sorts the same list alike). A host that
   detects reports to the coordinator (``POST /v1/job/report``): a report whose answer times out
   is sent again to the first candidate (:data:`REPORT_TRIES`; a report is idempotent there),
   then the next candidate is tried, and this host coordinates itself when its own turn comes.
   A host that knows its coordinator redirects every report there. The coordinator's answer
   names the job's trace: a host whose key differed moves its running incident into it, only
   when the answer is verified (mutual TLS, or the token's proof: :mod:`agent.fleet.proof`).
   A host that coordinates only because the candidates before it did not answer is provisional
   (``JobIncident.ahead``): a verified join answer saying one of them coordinates the trace (or
   follows one), a join from one of them, or its first choice answering a ``provisional`` report
   (after its fan-out, and before its verdict) makes it back down (no verdict; its evidence goes
   there, marked ``backed_down``, recorded by the coordinator; evidence sent to it is redirected
   there, answered 503 until it is settled). A host that reached no other
   host while a candidate before it may be alive is cut off: its view is partial, said on its own
   incident (``servewatch.job.partial``, hosts named as they proved themselves), never a job
   verdict; its evidence is retried there until ``dedup_window_s``, marked ``partial``.
3. **Fan-out only for hosts that did not detect**, from the coordinator only, once reports stop
   coming (``report_grace_s`` without one, at most ``report_window_s``: the reports of a lockstep
   hang arrive within milliseconds of each other): at most
   ``fanout_concurrency`` at once, through about sqrt(N) relays above ``tree_threshold`` peers
   (:mod:`agent.fleet.fanout`). Requests per job incident: one report per detecting host, one
   join per other host: at most 2N.
4. **A job verdict.** When its capture is done, every host sends the coordinator a compact
   evidence summary (:mod:`agent.fleet.host_summary`); the coordinator judges the whole job
   (:mod:`agent.fleet.jobverdict`) once every member's summary arrived or ``evidence_timeout_s``
   passed, writes ``job-verdict.json`` into its bundle and emits the job's root span with the
   verdict (:class:`~agent.model.events.JobIncidentClosed`): one ``job.incident`` per trace, from the
   one coordinator. Evidence after the verdict is kept, not judged (``late_evidence``).

Who speaks for a host: every member holds the same token, so a signature says "a member", not
which one. A request's sender is the address it came from (TCP) and the API port its signature
names (:class:`~agent.fleet.api.Sender`), which must be a port the member list gives that address
(an address it does not list by IP: the job's API port), else the request is refused (401, why):
one address is not many identities. A request naming no port stands for that one port. Per job
incident a host name belongs to the first identity that proved it (a report, evidence, a verified
join answer), except that the verified join answer of the listed member the coordinator asked
proves the host name at that address over an earlier claim from another identity: that claim is
the conflict and what it sent for the host is dropped. One identity is only ever one host:
evidence or a report for a host from another identity is refused (409), logged, counted
(``identity_conflicts``) and said in the job verdict and the status, one line each. Only the coordinator moves a job incident into another trace (the one this
host reported to, else a join naming its own sender as coordinator); a coordinating host's trace
is the job's and no join relabels it.

Deduplication: one job incident is remembered for ``dedup_window_s``; a local detection inside
it is folded (a ``fleet.detection_folded`` span), a join or a manual request attaches (the
answer always names the trace). A target exit after our part of the job incident closed is a
new fact: its own incident, in the job's trace.

The trace stays bounded: the coordinator's fan-out is one ``fleet.fanout`` span (per-peer
``peer.capture`` spans only for small jobs and for failures, at most :data:`MAX_PEER_SPANS`);
every peer's outcome is in the bundle's ``fanout.json``. In a job of more than
``trace_detail_max_hosts`` hosts each host's action spans (stacks, recorder reads, coredumps) go
to a trace of that host's incident, linked from its ``incident`` span, which stays in the job's
trace as the host's summary (outcome counts, verdict, bundle path): 1,000 hosts of 8 ranks stay
under a backend's per-trace limit (Tempo: 5 MB), every host's detail one click away.

Where each part lives (built by composition in :class:`Fleet`, every part handed the one
:class:`~agent.fleet.fleetstate.FleetState` of the run explicitly):

- :mod:`agent.fleet.fleetstate`: the shared per-run state (the job incident, members, counters,
  credentials, judged traces) and the helpers every part uses on it;
- :mod:`agent.fleet.senders`: who speaks for a host (sender checks, host-name claims);
- :mod:`agent.fleet.announce`: the announce loop of rank 0's host, and its receiving side;
- :mod:`agent.fleet.coordinator`: the coordinator's fan-out (and a relay's), recheck, back-down,
  telling moved, cut-off (steps 2 and 3);
- :mod:`agent.fleet.intake`: the coordinator's evidence intake and the job verdict (step 4);
- :mod:`agent.fleet.member`: a detecting host's reports, following the coordinator, its evidence
  sent, and ``moved`` (steps 1 and 2);
- :mod:`agent.fleet.contributions`: admission, placement and the companion (the manager's side);
- :mod:`agent.fleet.backend`: the API's report and join handlers, manual incidents;
- :mod:`agent.fleet.bundles`: this host's incidents as the API lists and serves them.

Imports run one way: ``fleetstate`` <- ``senders`` <- ``announce``, ``coordinator`` <-
``intake`` <- ``member`` <- ``contributions``, ``backend`` (which also imports ``bundles``);
this module imports them all, none imports it. :class:`Fleet` itself keeps the lifecycle (the API
server, the nonce cache, the unix socket), the public contributions (inert while it does not
serve), the API backend entry points (forwarded to the parts) and the status.

Imports :mod:`agent.model.events`, :mod:`agent.incidents.manager` (types), the :mod:`agent.fleet`
modules; never a watcher or an actor (the Flight Recorder reader is handed in).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from agent.fleet.announce import Announcer
from agent.fleet.api import AgentApi, JoinRequest, Sender
from agent.fleet.backend import Backend
from agent.fleet.bundles import BundleReader, incident_doc
from agent.fleet.config import (
    ApiConfig,
    FleetConfig,
    client_ssl_context,
    read_token_file,
    server_ssl_context,
)
from agent.fleet.contributions import FOLDED_SPAN, Contributions, nothing
from agent.fleet.coordinator import MAX_PEER_SPANS, Coordinator
from agent.fleet.fleetstate import MAX_COORDINATOR_TRIES, REPORT_TRIES, AgentView, FleetState
from agent.fleet.http import HttpServer
from agent.fleet.intake import JOB_VERDICT_FILE, EvidenceIntake
from agent.fleet.intake import job_stuck_collective as _stuck_collective  # noqa: F401 (read here by tests)
from agent.fleet.jobstate import JobIncident
from agent.fleet.member import Member
from agent.fleet.messages import Announce, Evidence, Moved, Report
from agent.fleet.peers import PeerCredentials, PeerResolver
from agent.fleet.proof import NonceCache
from agent.fleet.senders import Senders
from agent.host.fsutil import UnsafeFolderError, open_trusted_dir
from agent.model.events import ActionCompleted, ComponentStatusChanged, IncidentOpened, now_ns
from agent.model.ranks import rank_label

__all__ = ["FOLDED_SPAN", "JOB_VERDICT_FILE", "MAX_COORDINATOR_TRIES", "MAX_PEER_SPANS", "REPORT_TRIES", "AgentView", "Fleet",
           "JobIncident"]

log = logging.getLogger("servewatch.fleet")

#: Longest unix socket path, bytes (``sun_path`` less its NUL).
MAX_UNIX_PATH = 107


class _Shared:
    """A read-only attribute of :class:`Fleet` that is its :class:`FleetState`'s (the status, tests and benches read them)."""

    def __init__(self, name: str = "") -> None:
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, fleet: Fleet | None, owner: type | None = None) -> Any:
        return self if fleet is None else getattr(fleet.state, self.name)

    def __set__(self, fleet: Fleet, value: Any) -> None:
        raise AttributeError(f"Fleet.{self.name} is read-only: set fleet.state.{self.name}")


class Fleet:
    """Serve the API and run the job's protocol for ``agent``; run it in the agent's task group.

    The facade of the protocol's parts (:mod:`agent.fleet.job`'s docstring says which module owns
    what); the per-run state and counters are :attr:`state`'s, read here as attributes.

    Args:
        agent: the running agent (settings, incident manager, discovery, bus).
        api: API settings (enabled, bind, auth, limits).
        fleet: job settings (name, peers, timeouts in seconds, window).
    """

    host_name = _Shared()
    layout = _Shared()
    agent_id = _Shared()
    own_names = _Shared()
    job = _Shared()
    announced = _Shared()
    local_ranks = _Shared()
    world_size = _Shared()
    members = _Shared()
    announce_complete = _Shared()
    server = _Shared()
    resolver = _Shared()
    credentials = _Shared()
    port = _Shared()
    scheme = _Shared()
    announces_received = _Shared()
    folded = _Shared()
    joins = _Shared()
    moved = _Shared()
    fanouts = _Shared()
    peers_asked = _Shared()
    reports_sent = _Shared()
    reports_received = _Shared()
    evidence_received = _Shared()
    unverified_answers = _Shared()
    verdicts = _Shared()
    identity_conflicts = _Shared()
    #: job incidents this agent coordinated and judged, by trace
    _judged = _Shared("judged")

    def __init__(self, agent: AgentView, api: ApiConfig, fleet: FleetConfig) -> None:
        self.agent = agent
        self.api_config = api
        self.config = fleet
        #: what every part shares for this run (the job incident, members, counters, credentials)
        self.state = FleetState(agent, api, fleet)
        #: what :meth:`run` serves now: ``None`` (not running: the contributions are inert), ``api``
        #: (the companion acts) or ``job`` (with a job: admission and placement act too)
        self._serving: str | None = None
        self.api: AgentApi | None = None
        self._components: dict[str, tuple[str, str]] = {}
        state = self.state
        self.senders = Senders(state)
        self.announcer = Announcer(state, self.senders)
        self.coordinator = Coordinator(state, self.senders)
        self.intake = EvidenceIntake(state, self.senders, self.coordinator)
        self.member = Member(state, self.senders, self.coordinator, self.intake)
        self.contributions = Contributions(state, self.member, self.coordinator)
        self.backend = Backend(state, self.senders, self.coordinator, self.member)
        self.bundles = BundleReader(state)

    @property
    def _announce_missed(self) -> set[str] | None:
        """The members the last announce round missed (:attr:`Announcer.missed`)."""
        return self.announcer.missed

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the API (bound when this reports started) and serve until cancelled. Raises
        what reading the token or TLS files, or binding the API, raises (:class:`OSError`, ...)."""
        api, state = self.api_config, self.state
        # the token and TLS files: file reads, off the event loop
        token = await anyio.to_thread.run_sync(read_token_file, api.token_file) if api.token_file is not None else None
        ssl_context = await anyio.to_thread.run_sync(server_ssl_context, api)
        self.api = AgentApi(self, token=token, mutual_tls=api.mutual_tls, rate_per_s=api.rate_per_s, rate_burst=api.rate_burst,
                            guess_rate_per_s=api.guess_rate_per_s, guess_burst=api.guess_burst)
        self.api.nonces = await anyio.to_thread.run_sync(self._nonce_cache)
        self.api.check_sender = self.senders.refusal
        server = state.server = HttpServer(
            self.api, host=api.host, port=api.port, ssl_context=ssl_context, max_body_bytes=api.max_body_bytes,
            read_timeout_s=api.read_timeout_s, max_connections=api.max_connections, authenticate=self.api.authorized,
            max_connections_per_client=api.max_connections_per_client,
            reserved_for_authenticated=min(api.reserved_for_authenticated, api.max_connections - 1),
            header_timeout_s=api.header_timeout_s, idle_timeout_s=api.idle_timeout_s,
            unix_path=await anyio.to_thread.run_sync(self._unix_path), unix_uids={0, os.geteuid(), *api.unix_socket_uids},
        )
        cfg = self.config
        # the Flight Recorder status read that names a job incident's trace: imported now, not mid-incident
        await anyio.to_thread.run_sync(_warm_imports)
        state.credentials = PeerCredentials(token=token, ssl_context=client_ssl_context(api), job_ca=api.mutual_tls,
                                            allow_insecure=cfg.allow_insecure_peers, agent_id=state.agent_id,
                                            local_host=_concrete_ip(api.host))
        status_sub = self.agent.bus.subscribe(ComponentStatusChanged, name="fleet-status", max_buffer=float("inf"))
        try:
            async with anyio.create_task_group() as tg:
                state.tg = tg
                await tg.start(server.serve)
                self.api.port = server.port
                self.api.own_host = state.own_names
                self.api.own_label = f"{state.host_name} at {state.own_names.label(server.port)}"
                state.credentials = replace(state.credentials, own_port=server.port)
                state.resolver = PeerResolver(cfg.peers, dns_name=cfg.peers_dns, own_port=server.port, own_host=api.host,
                                              default_port=api.port or server.port, scheme=state.scheme, timeout_s=cfg.peer_timeout_s)
                self._serving = "job" if cfg.job else "api"  # the contributions act from now on
                if cfg.job:
                    tg.start_soon(self.announcer.run)
                tg.start_soon(self._watch_status, status_sub)
                tg.start_soon(self._own_member_names)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._serving = None  # inert again
            status_sub.close()
            self.api.nonces.close()

    def _nonce_cache(self) -> NonceCache:
        """The API's nonce cache, kept in ``<data_dir>/fleet/nonces-<host name>`` (0600 in a 0700
        folder): a signed request accepted before a restart is refused after it. In memory only
        (said once) when that folder is refused or cannot be written. A worker thread."""
        path = self.state.layout.fleet_nonces
        try:
            fd, _ = open_trusted_dir(path.parent, create=True)
            os.close(fd)
            return NonceCache.load(str(path))
        except (UnsafeFolderError, OSError) as exc:
            log.warning("agent API: replays refused in memory only (a restart forgets them): %s", exc)
            return NonceCache()

    def _unix_path(self) -> str | None:
        """The operator's unix socket (``api.unix_socket``: ``auto`` is ``<data_dir>/<host name>.api.sock``,
        the data dir made 0700 if missing), or ``None``: off, or (said once) a path too long for a
        socket, or a folder another user controls (:func:`agent.host.fsutil.open_trusted_dir`). A file
        system walk: a worker thread."""
        raw = self.api_config.unix_socket
        if not raw:
            return None
        path = self.state.layout.fleet_api_socket if raw == "auto" else Path(raw)
        if len(os.fsencode(str(path))) > MAX_UNIX_PATH:
            log.warning("agent API: no unix socket: %s is longer than %d bytes (set api.unix_socket)", path, MAX_UNIX_PATH)
            return None
        try:
            fd, _ = open_trusted_dir(path.parent, create=raw == "auto")
        except (UnsafeFolderError, OSError) as exc:
            log.warning("agent API: no unix socket at %s: %s", path, exc)
            return None
        os.close(fd)
        return str(path)

    async def _own_member_names(self) -> None:
        """Names of the member list that resolve to this agent (at its port) are its own too: a
        peer that lists it by name signs for that name."""
        state = self.state
        assert state.resolver is not None
        for peer in state.resolver.static:
            if peer.port != state.port or state.own_names(peer.host):
                continue
            with anyio.move_on_after(self.config.peer_timeout_s):
                try:
                    infos = await anyio.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
                except OSError:
                    infos = []
                if any(state.own_names(str(info[4][0]).split("%")[0]) for info in infos):
                    state.own_names.add(peer.host)

    async def _watch_status(self, sub: Any) -> None:
        async for event in sub:
            self._components[event.component] = (str(event.status), event.detail)

    # -- contributions to the incident manager (passed to its constructor) ---------------------

    def admit(self, trigger: str, detail: str) -> bool:
        """Whether a local detection (``trigger``, its one-line ``detail``) opens an incident here
        (the manager's ``admit``): ``False`` when it is folded into a job incident in its window.
        ``True`` while no job is served (:meth:`run` not running, or no ``fleet.job``)."""
        return self._serving != "job" or self.contributions.admit(trigger, detail)

    async def place(self, trigger: str, targets: Sequence[Any], detected_ns: int,
                    parent: tuple[str, str] | None) -> tuple[str, str, dict[str, Any]] | None:
        """The trace of an incident about to open (the manager's ``place``,
        :data:`agent.incidents.manager.Placement`): ``(trace_id, parent_span_id, root attributes)``
        hex, or ``None`` (its parent's, else its own) while no job is served."""
        return self.contributions.place(detected_ns, parent) if self._serving == "job" else None

    def companion(self, opened: IncidentOpened) -> Callable[[], Awaitable[list[ActionCompleted]]]:
        """Started by the manager right after ``opened`` was published (the manager's
        ``companions``, :data:`agent.incidents.manager.Companion`); returns how to collect its
        action events (none while :meth:`run` is not running)."""
        return self.contributions.companion(opened) if self._serving is not None else nothing

    # -- API backend (:class:`agent.fleet.api.AgentApi` calls these) ---------------------------

    async def job_message(self, message: Announce | Report | Evidence | Moved, *, client: str,
                          sender: Sender | None = None) -> tuple[int, dict[str, Any]]:
        """``POST /v1/job/announce|report|evidence|moved`` (bodies validated by :mod:`agent.fleet.messages`);
        ``sender``: who sent it as far as it is proven (default: ``client`` alone). Returns
        ``(HTTP status, answer)``: 409 for another job, or this agent itself."""
        state = self.state
        if message.job != self.config.job:
            return 409, {"error": f"job mismatch: this agent is in job {self.config.job!r}", "host.name": state.host_name}
        if message.agent_id and message.agent_id == state.agent_id:
            return 409, {"error": "self", "host.name": state.host_name}
        who = self.senders.identity(sender or Sender(client))
        if isinstance(message, Announce):
            return await self.announcer.on_announce(message, who)
        if isinstance(message, Report):
            return await self._on_report(message, who)
        if isinstance(message, Moved):
            return await self.member.on_moved(message, who)
        return self.intake.on_evidence(message, who)

    async def _on_report(self, report: Report, sender: Sender) -> tuple[int, dict[str, Any]]:
        """A report (:meth:`Backend.on_report`); looked up on the instance, so a test may wrap it."""
        return await self.backend.on_report(report, sender)

    async def post_incident(self, request: JoinRequest, *, agent_id: str, sender: Sender | None = None) -> tuple[int, dict[str, Any]]:
        """``POST /v1/incidents``: a manual incident, or a join of the job's trace (or a user's):
        :meth:`Backend.post_incident`. Returns ``(HTTP status, answer)``."""
        return await self.backend.post_incident(request, agent_id=agent_id, sender=sender)

    async def list_incidents(self) -> list[dict[str, Any]]:
        """``GET /v1/incidents``: :meth:`BundleReader.list_incidents`."""
        return await self.bundles.list_incidents()

    async def get_incident(self, incident_id: str) -> dict[str, Any] | None:
        """``GET /v1/incidents/{id}``: :meth:`BundleReader.get_incident` (``None``: not served)."""
        return await self.bundles.get_incident(incident_id)

    async def status(self) -> dict[str, Any]:
        """``GET /v1/status``: the status file's content (schema ``servewatch.status/1``: every
        watcher ready / waiting / blind with its reason) plus targets, the open incident, the job.
        Discovery (a process scan) runs on a worker thread; its errors are logged, never raised."""
        agent, state = self.agent, self.state
        manager = agent.incidents
        try:
            targets = await anyio.to_thread.run_sync(agent.discover)
        except Exception:  # discovery trouble is shown, never raised
            log.exception("target discovery failed")
            targets = []
        current = manager.current
        board = getattr(agent, "status", None)  # the watchers' status model (ready / waiting / blind)
        watchers: dict[str, Any] = board.snapshot().to_json() if board is not None else {}
        return {
            **watchers,
            "host.name": state.host_name,
            "time_unix_nano": now_ns(),
            "uptime_s": round(time.time() - state.started_s, 3),
            "pid": os.getpid(),
            "components": {name: {"status": s, "detail": d} for name, (s, d) in sorted(self._components.items())},
            "targets": [{"pid": t.pid, "title": t.title, "rank": rank_label(t.title) or None,
                         "step_counter_watched": t.pid in agent.watched_step_pids} for t in targets],
            "open_incident": incident_doc(state.host_name, current.opened) if current is not None else None,
            "incidents": len(manager.records),
            "suppressed": manager.suppressed,
            "fleet": self._fleet_status(),
            "api": state.server.statistics()._asdict() if state.server else None,
            "bus": agent.bus.statistics()._asdict(),
        }

    def _fleet_status(self) -> dict[str, Any]:
        """The status's ``fleet`` section: the job, its members, this host's job incident, the counters."""
        state = self.state
        announced = state.announced
        return {
            "job": self.config.job,
            "api_port": state.port,
            "peers": [str(p) for p in (state.resolver.static if state.resolver else [])],
            "peers_dns": self.config.peers_dns,
            "ranks": list(state.local_ranks),
            "coordinator": ({"address": announced.peer.url, "host.name": announced.host_name}
                            if announced is not None else None),
            "members_known": len(state.members),
            "job_incident": state.job.summary() if state.in_window(state.job) and state.job else None,
            "folded": state.folded, "joins": state.joins, "moved": state.moved,
            "fanouts": state.fanouts, "peers_asked": state.peers_asked, "reports_sent": state.reports_sent,
            "reports_received": state.reports_received, "evidence_received": state.evidence_received,
            "unverified_answers": state.unverified_answers,
            "verdicts": state.verdicts,
            "identity_conflicts": state.identity_conflicts,
        }


def _concrete_ip(host: str) -> str | None:
    """``host`` when it is one IP address (not a wildcard, not loopback's default), else ``None``."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return None if ip.is_unspecified or str(ip) in ("127.0.0.1", "::1") else str(ip)


def _warm_imports() -> None:
    import agent.host.sdkclient
    import agent.sdk.flightrec  # noqa: F401
