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

Imports :mod:`agent.model.events`, :mod:`agent.incidents.manager` (types), :mod:`agent.model.ranks` and the other
:mod:`agent.fleet` modules; never a watcher or an actor (the Flight Recorder reader is handed in).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from agent.fleet.api import INCIDENT_ID_PATTERN, AgentApi, JoinRequest, Sender
from agent.fleet.config import (
    ApiConfig,
    FleetConfig,
    client_ssl_context,
    read_token_file,
    server_ssl_context,
)
from agent.fleet.fanout import bounded, plan
from agent.fleet.host_summary import fit, host_evidence
from agent.fleet.http import HttpServer
from agent.fleet.identity import (
    JobKey,
    job_trace,
    repeat_trace,
    root_span_of,
    stuck_collective,
    time_bucket_key,
)
from agent.fleet.jobstate import Announced, JobIncident, PeerOutcome
from agent.fleet.jobverdict import CLOCK_OFFSET_SAID_S, JobVerdict, MissingHost, judge_job
from agent.fleet.messages import Announce, Evidence, MemberInfo, Moved, RelayedPeer, Report
from agent.fleet.peers import (
    OwnNames,
    Peer,
    PeerCredentials,
    PeerReply,
    PeerResolver,
    call_peer,
    parse_peer,
)
from agent.fleet.proof import NonceCache
from agent.fleet.traceparent import TraceParent
from agent.host.fsutil import UnsafeFolderError, atomic_write_text, open_trusted_dir
from agent.host.manifest import MANIFEST_NAME, ManifestError, parse_manifest
from agent.model.datadir import DataDir
from agent.model.events import (
    TRACE_DETAIL_ATTR,
    Action,
    ActionCompleted,
    ActionResult,
    ComponentStatusChanged,
    IncidentOpened,
    JobIncidentClosed,
    Outcome,
    Trigger,
    frozen_attrs,
    now_ns,
)
from agent.model.manifest_view import JOB_VERDICT_NAME
from agent.model.ranks import distinct_env_ranks, rank_label, world_ranks

__all__ = ["FOLDED_SPAN", "JOB_VERDICT_FILE", "MAX_PEER_SPANS", "Fleet", "JobIncident"]

log = logging.getLogger("servewatch.fleet")

#: Span (action) name recording a local detection folded into the job incident.
FOLDED_SPAN = Action.DETECTION_FOLDED
#: Most incidents listed by ``GET /v1/incidents``.
MAX_LISTED = 200
#: Largest manifest served, bytes.
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
#: Most per-peer ``peer.capture`` spans one fan-out emits (the rest are in ``fanout.json``).
MAX_PEER_SPANS = 16
#: The coordinator's job verdict, in its bundle (read back by ``timeline`` and ``report``).
JOB_VERDICT_FILE = JOB_VERDICT_NAME
#: Every peer's outcome of a fan-out, in the coordinator's bundle.
FANOUT_FILE = "fanout.json"
#: Trace ids of closed job incidents remembered (a repeated key gets a fresh trace).
MAX_PAST_TRACES = 1024
#: Most hosts whose evidence one job incident holds.
MAX_EVIDENCE_HOSTS = 100_000
#: Judged job incidents remembered for late reports and evidence.
MAX_JUDGED = 16
#: Root-span attribute of a job incident: its stuck collective, ``"<pg>:<seq>"`` (the Flight
#: Recorder sequence id of the first collective of process group ``pg`` not completed by all ranks).
STUCK_COLLECTIVE_ATTR = "servewatch.job.stuck_collective"
#: Root-span attribute of a job incident: the hosts whose clock is off the coordinator's by more
#: than :data:`CLOCK_OFFSET_SAID_S`, as ``"<host>=<offset s, signed>"`` (their spans' times are
#: off by that much in the trace).
CLOCK_OFFSETS_ATTR = "servewatch.job.clock_offsets_s"
#: Coordinator candidates a detecting host tries before it coordinates its own view.
MAX_COORDINATOR_TRIES = 3
#: Tries of one report to the first coordinator candidate while its answer times out (each bounded
#: by ``peer_timeout_s``): a slow coordinator still coordinates, and a second one never starts.
REPORT_TRIES = 3
#: Longest wait between two tries of a host's evidence to a coordinator it cannot reach, seconds.
EVIDENCE_RETRY_MAX_S = 8.0
#: Longest unix socket path, bytes (``sun_path`` less its NUL).
MAX_UNIX_PATH = 107



class AgentView(Protocol):
    """What the fleet reads from the agent (:class:`agent.runtime.agent.Agent`)."""

    settings: Any
    incidents: Any
    bus: Any

    def discover(self) -> list[Any]: ...

    @property
    def watched_step_pids(self) -> frozenset[int]: ...


class Fleet:
    """Serve the API and run the job's protocol for ``agent``; run it in the agent's task group.

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
        #: every path under the data dir for this host (bundles, the nonce cache, the API socket)
        self.layout = DataDir(Path(agent.settings.data_dir), self.host_name)
        #: random per run; a peer that answers with it is ourselves (an address we did not know)
        self.agent_id = secrets.token_hex(8)
        self.job: JobIncident | None = None
        #: what :meth:`run` serves now: ``None`` (not running: the contributions are inert), ``api``
        #: (the companion acts) or ``job`` (with a job: admission and placement act too)
        self._serving: str | None = None
        self.announced: Announced | None = None
        #: this host's global ranks, as of the last look (announce loop)
        self.local_ranks: tuple[int, ...] = ()
        self.world_size: int | None = None
        #: what each member said of itself (the announce's answers): address -> info
        self.members: dict[str, MemberInfo] = {}
        #: the last announce reached every member of the job (this host then coordinates as rank 0's)
        self.announce_complete = False
        #: members (URLs) the last announce round missed: the quick rounds (every 2 s) ask only
        #: them; ``None``: the next round asks every member
        self._announce_missed: set[str] | None = None
        #: when the next announce round asks every member again (monotonic seconds): every
        #: ``announce_interval_s`` (a member that restarted learns the coordinator again)
        self._announce_full_at = 0.0
        #: announces received (the rank-0 host's)
        self.announces_received = 0
        self.server: HttpServer | None = None
        self.api: AgentApi | None = None
        self.resolver: PeerResolver | None = None
        self.credentials = PeerCredentials()
        self._tg: TaskGroup | None = None
        self._opened_waiters: list[tuple[Callable[[IncidentOpened], bool], anyio.Event, list[IncidentOpened]]] = []
        self._components: dict[str, tuple[str, str]] = {}
        self._past_traces: OrderedDict[str, int] = OrderedDict()
        #: job incidents this agent coordinated and judged, by trace (late reports and evidence)
        self._judged: OrderedDict[str, JobIncident] = OrderedDict()
        self._self_peer: Peer | None = None
        #: members of the job as last resolved (static peers and the DNS name's addresses)
        self._members_seen = 0
        self._started_s = time.time()
        #: local detections folded into a job incident
        self.folded = 0
        #: joins received (opened + attached + moved)
        self.joins = 0
        #: our incidents moved into the coordinator's trace
        self.moved = 0
        #: fan-outs run (as coordinator), peers asked in all, reports sent and received
        self.fanouts = 0
        self.peers_asked = 0
        self.reports_sent = 0
        self.reports_received = 0
        self.evidence_received = 0
        #: answers that could not be verified (never acted on)
        self.unverified_answers = 0
        #: job verdicts made (as coordinator)
        self.verdicts = 0
        #: messages refused because their sender claimed an identity another sender proved
        self.identity_conflicts = 0
        #: this agent's own addresses and names (a peer's signed request must name one)
        self.own_names = OwnNames(api.host, [self.host_name, socket.gethostname(), *api.names])

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The API's bound port (after start)."""
        return self.server.port if self.server is not None else self.api_config.port

    @property
    def scheme(self) -> str:
        return "https" if self.api_config.tls else "http"

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the API (bound when this reports started) and serve until cancelled."""
        api = self.api_config
        # the token and TLS files: file reads, off the event loop
        token = await anyio.to_thread.run_sync(read_token_file, api.token_file) if api.token_file is not None else None
        ssl_context = await anyio.to_thread.run_sync(server_ssl_context, api)
        self.api = AgentApi(self, token=token, mutual_tls=api.mutual_tls, rate_per_s=api.rate_per_s, rate_burst=api.rate_burst,
                            guess_rate_per_s=api.guess_rate_per_s, guess_burst=api.guess_burst)
        self.api.nonces = await anyio.to_thread.run_sync(self._nonce_cache)
        self.api.check_sender = self._sender_refusal
        self.server = HttpServer(
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
        self.credentials = PeerCredentials(token=token, ssl_context=client_ssl_context(api), job_ca=api.mutual_tls,
                                           allow_insecure=cfg.allow_insecure_peers, agent_id=self.agent_id,
                                           local_host=_concrete_ip(api.host))
        status_sub = self.agent.bus.subscribe(ComponentStatusChanged, name="fleet-status", max_buffer=float("inf"))
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await tg.start(self.server.serve)
                self.api.port = self.server.port
                self.api.own_host = self.own_names
                self.api.own_label = f"{self.host_name} at {self.own_names.label(self.server.port)}"
                self.credentials = replace(self.credentials, own_port=self.server.port)
                self.resolver = PeerResolver(cfg.peers, dns_name=cfg.peers_dns, own_port=self.server.port, own_host=api.host,
                                             default_port=api.port or self.server.port, scheme=self.scheme, timeout_s=cfg.peer_timeout_s)
                self._serving = "job" if cfg.job else "api"  # the contributions act from now on
                if cfg.job:
                    tg.start_soon(self._announce_loop)
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
        path = self.layout.fleet_nonces
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
        path = self.layout.fleet_api_socket if raw == "auto" else Path(raw)
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
        assert self.resolver is not None
        for peer in self.resolver.static:
            if peer.port != self.port or self.own_names(peer.host):
                continue
            with anyio.move_on_after(self.config.peer_timeout_s):
                try:
                    infos = await anyio.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
                except OSError:
                    infos = []
                if any(self.own_names(str(info[4][0]).split("%")[0]) for info in infos):
                    self.own_names.add(peer.host)

    async def _watch_status(self, sub: Any) -> None:
        async for event in sub:
            self._components[event.component] = (str(event.status), event.detail)

    def _in_window(self, job: JobIncident | None) -> bool:
        """A job incident is remembered ``dedup_window_s`` from its start, or from the last report
        its coordinator received (a job whose hosts keep reporting stays one incident)."""
        return job is not None and job.in_window(self.config.dedup_window_s)

    def _spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn, *args)

    # -- who is who ---------------------------------------------------------------------------

    def _local_ranks_now(self) -> tuple[int, ...]:
        """This host's global ranks: ``RANK`` in a target's environment, else its title's rank in
        this server's world (:func:`agent.model.ranks.world_ranks`). A /proc scan: a worker thread; of
        the environment only the rank variables are read (:func:`agent.host.targets.rank_environ`)."""
        from agent.host.targets import rank_environ

        targets = self.agent.discover()
        ranks: set[int] = set()
        by_env = distinct_env_ranks([rank_environ(t.pid) for t in targets])  # a shared RANK was inherited: none
        for target, env_rank, by_title in zip(targets, by_env, world_ranks([t.title or "" for t in targets])):
            rank = env_rank if env_rank is not None else by_title
            if rank is not None:
                ranks.add(rank)
        return tuple(sorted(ranks))

    async def _self_address(self, members: Sequence[Peer]) -> Peer:
        """This agent as the job's member list names it; when the list leaves it out, its address
        towards the first member (what that member sees), at its API port."""
        assert self.resolver is not None
        for p in members:
            if self.resolver.is_self(p):
                return p
        if self._self_peer is None:
            host = await anyio.to_thread.run_sync(_route_address, [(p.host, p.port) for p in members[:4]])
            self._self_peer = Peer(host, self.port, self.scheme)
        return self._self_peer

    async def _coordinator_order(self) -> tuple[list[Peer], Peer]:
        """Candidates for coordinator, first first: the announced host of global rank 0, then the
        job's members, lowest first (this agent among them); and this agent's own entry."""
        assert self.resolver is not None
        members, _ = await self.resolver.resolve_all()
        self._members_seen = len(members)
        me = await self._self_address(members)
        if me not in members:
            members = [*members, me]
        order = PeerResolver.candidates(members)
        if 0 in self.local_ranks and self.announce_complete:
            return [me], me  # every live member knows this host holds global rank 0
        a = self.announced
        if a is not None and a.peer != me and time.monotonic() - a.time_s < 3 * self.config.announce_interval_s:
            order = [a.peer, *(p for p in order if p != a.peer)]
        return order, me

    async def _head(self, skip: Sequence[str]) -> tuple[Peer, Peer]:
        """The first coordinator candidate not in ``skip`` (URLs), and this agent's own entry."""
        order, me = await self._coordinator_order()
        return next((p for p in order if p.url not in skip), me), me

    # -- contributions to the incident manager (passed to its constructor) ---------------------

    def admit(self, trigger: str, detail: str) -> bool:
        """Whether a local detection (``trigger``, its one-line ``detail``) opens an incident here
        (the manager's ``admit``): ``False`` when it is folded into a job incident in its window.
        ``True`` while no job is served (:meth:`run` not running, or no ``fleet.job``)."""
        return self._serving != "job" or self._admit(trigger, detail)

    async def place(self, trigger: str, targets: Sequence[Any], detected_ns: int,
                    parent: tuple[str, str] | None) -> tuple[str, str, dict[str, Any]] | None:
        """The trace of an incident about to open (the manager's ``place``,
        :data:`agent.incidents.manager.Placement`): ``(trace_id, parent_span_id, root attributes)``
        hex, or ``None`` (its parent's, else its own) while no job is served."""
        return await self._place(trigger, targets, detected_ns, parent) if self._serving == "job" else None

    def companion(self, opened: IncidentOpened) -> Callable[[], Awaitable[list[ActionCompleted]]]:
        """Started by the manager right after ``opened`` was published (the manager's
        ``companions``, :data:`agent.incidents.manager.Companion`); returns how to collect its
        action events (none while :meth:`run` is not running)."""
        return self._companion(opened) if self._serving is not None else _nothing

    def _admit(self, trigger: str, detail: str) -> bool:
        """A local detection: folded when a job incident is in its window, else it claims one."""
        job = self.job
        running = job is not None and job.local_incident_id is not None and job.local_incident_id in self.agent.incidents.running
        # a hang's symptoms (stall, failed health) on this host are the job incident's; a process
        # that exits after the job incident closed is a new fact and gets its own incident
        if self._in_window(job) and (running or trigger != Trigger.EXIT or not job.placed.is_set()):  # type: ignore[union-attr]
            assert job is not None
            self.folded += 1
            log.info("%s detection folded into job incident (trace %s)", trigger, job.trace_id or "being placed")
            if running:
                t = now_ns()
                job.extras.append(ActionCompleted(
                    source="fleet", incident_id=job.local_incident_id or "",
                    result=ActionResult(action=FOLDED_SPAN, outcome=Outcome.SKIPPED, detail=f"local {trigger} detection: {detail}",
                                        start_time_unix_nano=t, end_time_unix_nano=t,
                                        attributes=frozen_attrs({"servewatch.incident.trigger": trigger})),
                ))
            return False
        if not self._in_window(job):
            self.job = JobIncident(detected_time_unix_nano=now_ns())  # claimed: placed before it opens
        return True

    def _detail(self) -> dict[str, Any]:
        """Root attributes of this host's incidents in a job too large for every action span in
        the job's trace: they go to a trace of the host's own, linked (:data:`TRACE_DETAIL_ATTR`)."""
        hosts = max(len(self.resolver.static) if self.resolver is not None else 0, self._members_seen)
        return {TRACE_DETAIL_ATTR: "linked"} if hosts > self.config.trace_detail_max_hosts else {}

    async def _place(self, trigger: str, targets: Sequence[Any], detected_ns: int,
                     parent: tuple[str, str] | None) -> tuple[str, str, dict[str, Any]] | None:
        """The trace of an incident about to open here (:data:`agent.incidents.manager.Placement`);
        ``detected_ns``: the trigger event's time (the time bucket's, without a Flight Recorder);
        ``parent``: the trace it was opened in (a join), kept."""
        if parent is not None:
            return (*parent, self._detail())
        placed = self._placed(detected_ns)
        return (*placed, self._detail()) if placed is not None else None

    def _placed(self, detected_ns: int) -> tuple[str, str] | None:
        job = self.job
        if self._in_window(job) and job is not None and job.placed.is_set():
            if job.move_to is not None:
                return job.move_to
            return job.trace_id, job.root_span_id  # a follow-up (an exit after our part closed)
        if job is None or not self._in_window(job):
            job = self.job = JobIncident(detected_time_unix_nano=detected_ns)  # a manual incident
        job.detected_time_unix_nano = detected_ns
        # from what costs nothing at detection: the capture never waits for the trace's name
        key = time_bucket_key(detected_ns, self.config.time_bucket_s)
        trace_id, root = job_trace(self.config.job or "", key)
        if not job.placed.is_set():
            job.trace_id, job.root_span_id, job.key = trace_id, root, str(key)
            job.detected_here = True
            job.placed.set()
        return job.move_to or (job.trace_id, job.root_span_id)

    def _companion(self, opened: IncidentOpened) -> Callable[[], Awaitable[list[ActionCompleted]]]:
        """Called by the incident manager right after ``opened`` was published."""
        for predicate, event, box in list(self._opened_waiters):
            if predicate(opened):
                box.append(opened)
                event.set()
        job = self.job
        if job is None or not job.placed.is_set() or job.local_incident_id is not None:
            return _nothing  # not a job incident, or a follow-up in its trace (no new report or fan-out)
        if opened.trace_id not in (job.trace_id, (job.move_to or ("",))[0]):
            return _nothing  # another trace (a user's own traceparent)
        job.local_incident_id = opened.incident_id
        job.opened.set()
        if job.move_to is not None and job.move_to[0] != opened.trace_id:
            self._spawn(self._move, opened.incident_id, *job.move_to)
        if job.move_to is not None:
            job.trace_id, job.root_span_id = job.move_to
            job.move_to = None
        if job.joined:
            if job.relay:
                self._spawn(self._relay, job)
            else:
                job.done.set()
        else:
            self._spawn(self._start_job, job, opened)
        return self._collector(job, opened)

    def _collector(self, job: JobIncident, opened: IncidentOpened) -> Callable[[], Awaitable[list[ActionCompleted]]]:
        async def collect() -> list[ActionCompleted]:
            cfg = self.config
            # reports (the first candidate's timeouts retried), then the fan-out: bounded
            with anyio.move_on_after(cfg.peer_timeout_s * (2 * REPORT_TRIES + 2 * MAX_COORDINATOR_TRIES + 3) + cfg.report_window_s + 5):
                await job.done.wait()
            events = [ActionCompleted(source="fleet", incident_id=opened.incident_id, result=r) for r in job.results]
            events += job.extras
            job.extras = []
            record = self.agent.incidents.running.get(opened.incident_id)
            if record is not None:
                record.attributes.update(job.view)  # a cut-off host's partial view: on its own incident
                judge = getattr(self.agent.incidents, "judge", None)
                judged = list(judge.last_evidence) if judge is not None and record.verdict is not None else []
                self._spawn(self._share_evidence, job, record.opened.incident_id, str(record.bundle_dir), judged, record.verdict)
            return events

        return collect

    async def _move(self, incident_id: str, trace_id: str, parent_span_id: str) -> bool:
        moved = await self.agent.incidents.retrace(incident_id, trace_id, parent_span_id)
        if moved:
            self.moved += 1
            log.warning("incident %s moved into the job's trace %s (under span %s)", incident_id, trace_id, parent_span_id)
        return bool(moved)

    # -- a detecting host: report, or coordinate ---------------------------------------------------

    async def _start_job(self, job: JobIncident, opened: IncidentOpened) -> None:
        try:
            if job.coordinating:
                await self._fanout(job)
                if job.coordinating and job.ahead:
                    await self._recheck(job)  # provisional (a reporter could not reach those before us)
                return
            if job.coordinator is not None:
                return  # the coordinator's join reached us first: it knows we are in (no report needed)
            order, me = await self._coordinator_order()
            unreachable: list[str] = []
            silent: list[str] = []  # of those, the ones that may be alive and coordinating (no answer at all, or busy)
            job.reporting = anyio.Event()
            try:
                if await self._report_in_order(job, opened, order, me, unreachable, silent):
                    return
            finally:
                job.reporting.set()
            if not job.coordinating:
                # provisional: the candidates before us did not answer in time; we back down when
                # one of them (or a host that follows one) says it coordinates this trace
                job.ahead = list(dict.fromkeys(unreachable))
            job.coordinating = True
            job.cut_off = bool(unreachable)
            log.info("coordinating job incident %s (trace %s)%s", opened.incident_id, job.trace_id,
                     f"; unreachable: {', '.join(unreachable)}" if unreachable else "")
            await self._fanout(job)
            await self._after_own_fanout(job, order, unreachable, silent)
        except Exception:  # boundary: the protocol never takes the agent down
            log.exception("job protocol of incident %s failed", opened.incident_id)
        finally:
            job.done.set()

    async def _report_in_order(self, job: JobIncident, opened: IncidentOpened, order: Sequence[Peer], me: Peer,
                               unreachable: list[str], silent: list[str]) -> bool:
        """Report to the candidates before us in ``order``: True when we are done (one coordinates,
        or the coordinator asked us meanwhile), False when we coordinate."""
        for i, candidate in enumerate(order):
            if job.coordinator is not None and not unreachable:
                return True  # asked by the coordinator while we were about to report
            if job.coordinating or candidate == me or (self.resolver is not None and self.resolver.is_self(candidate)):
                return False
            if await self._report(job, opened, candidate, me, unreachable, silent, tries=REPORT_TRIES if i == 0 else 1):
                return True
            if len(unreachable) >= MAX_COORDINATOR_TRIES:  # a partitioned host coordinates its own view
                return False
        return False

    async def _after_own_fanout(self, job: JobIncident, order: Sequence[Peer], unreachable: list[str], silent: list[str]) -> None:
        if silent and job.coordinating and not job.reported and not any(o.outcome is Outcome.OK for o in job.asked.values()):
            # no other host answered, and a candidate before us may be alive behind a
            # partition: our view is partial (candidates that all refused us, or the
            # connection, are no coordinators: then we are the job's, and judge it)
            first = next((p for p in order if p.url == silent[0]), None)  # else a redirect's target
            self._cut_off(job, first or parse_peer(silent[0], default_port=self.port, scheme=self.scheme), unreachable)
        elif job.coordinating and job.ahead:
            await self._recheck(job)  # before any evidence comes here: a back-down now redirects it all

    async def _report(self, job: JobIncident, opened: IncidentOpened, candidate: Peer, me: Peer, unreachable: list[str],
                      silent: list[str] | None = None, *, tries: int = 1) -> bool:
        """Report our detection to ``candidate``. True when it coordinates (or named who does and
        that one answered); False: try the next one (its URL added to ``unreachable``, and to
        ``silent`` when it may still be a live coordinator: :func:`_may_coordinate`). ``tries``:
        reports sent to ``candidate`` while its answer times out (it may have taken the report and
        coordinate: a report is idempotent there), each bounded by ``peer_timeout_s``."""
        body = Report.model_validate({
            "job": self.config.job, "host.name": self.host_name, "agent_id": self.agent_id, "api_port": self.port,
            "scheme": self.scheme, "incident_id": opened.incident_id, "trace_id": job.trace_id, "key": job.key,
            "detected_time_unix_nano": job.detected_time_unix_nano or opened.time_unix_nano, "trigger": opened.trigger,
            "ranks": list(self.local_ranks), "world_size": self.world_size, "unreachable": unreachable, "address": me.url,
        }).model_dump(by_alias=True)
        for _hop in range(2):  # one redirect at most
            reply = await self._send_report(candidate, body, tries)
            doc = reply.doc or {}
            if reply.result.outcome is not Outcome.OK:
                unreachable.append(candidate.url)
                if silent is not None and _may_coordinate(reply.result):
                    silent.append(candidate.url)
                job.results.append(reply.result)
                return False
            if not reply.verified:
                self.unverified_answers += 1
                log.warning("%s answered our report without proof of the job's token: ignored", candidate)
                unreachable.append(candidate.url)
                job.results.append(_with(reply.result, outcome=Outcome.REFUSED, detail=f"{candidate}: answer not verified (ignored)"))
                return False
            if doc.get("status") == "redirect":
                target = self._redirect_target(doc)
                if target is None or target == me:
                    return False
                candidate = target
                continue
            job.coordinator, job.coordinator_host = candidate, str(doc.get("host.name") or candidate)
            if job.coordinating:  # a report reached us meanwhile and we took it: one coordinator, theirs
                job.coordinating, job.backed_down = False, True
                log.warning("job %s: %s coordinates trace %s: backing down (reports sent to us are redirected there)",
                            self.config.job, job.coordinator_host, job.trace_id)
                self._tell_moved(job)
            job.results.append(reply.result)
            await self._follow(job, doc)
            return True
        return False

    async def _send_report(self, candidate: Peer, body: dict[str, Any], tries: int) -> PeerReply:
        """``body`` sent to ``candidate`` up to ``tries`` times while it times out; the reply says the tries when more than one."""
        for attempt in range(1, max(1, tries) + 1):
            self.reports_sent += 1
            reply = await call_peer(candidate, "/v1/job/report", body, credentials=self._as_listed(),
                                    timeout_s=self.config.peer_timeout_s, action=Action.REPORT, attempts=3)
            if reply.result.outcome is not Outcome.TIMED_OUT or attempt == tries:
                break  # timed out: sent again (connect_timeout too: a sender starved of CPU sees its own connect time out)
            log.warning("job %s: our report to %s got no answer within %.1f s (try %d of %d): sent again",
                        self.config.job, candidate, self.config.peer_timeout_s, attempt, tries)
        if attempt > 1:
            reply = PeerReply(_with(reply.result, attributes=frozen_attrs({**reply.result.attributes, "servewatch.report.tries": attempt})),
                              reply.doc, reply.verified)
        return reply

    def _redirect_target(self, doc: dict[str, Any]) -> Peer | None:
        raw = doc.get("coordinator")
        if not isinstance(raw, str):
            return None
        try:
            return parse_peer(raw, default_port=self.port, scheme=self.scheme)
        except ValueError:
            return None

    async def _follow(self, job: JobIncident, doc: dict[str, Any]) -> None:
        """A verified coordinator's answer names the job's trace: move ours there if it differs."""
        try:
            tp = TraceParent.parse(str(doc.get("traceparent", "")))
        except ValueError:
            return
        if tp.trace_id == job.trace_id:
            return
        job.trace_id, job.root_span_id = tp.trace_id, tp.parent_id
        if job.local_incident_id is not None:
            await self._move(job.local_incident_id, tp.trace_id, tp.parent_id)

    # -- the coordinator's fan-out ------------------------------------------------------------------

    async def _fanout(self, job: JobIncident) -> None:
        """Ask every member that did not report to capture into the job's trace (bounded, maybe
        through relays); one ``fleet.fanout`` result (and a few ``peer.capture`` ones)."""
        await self._quiet(job)  # a lockstep hang's reports arrive within a few ms of each other
        assert self.resolver is not None
        start = now_ns()
        members, problems = await self.resolver.resolve_all()
        self._members_seen = len(members)
        job.results.extend(problems)
        me = await self._self_address(members)
        job.members = [p.url for p in members if p != me and not self.resolver.is_self(p)] + [me.url]
        to_ask = [p for p in members if p != me and not self.resolver.is_self(p) and p.url not in job.reported]
        self.fanouts += 1
        self.peers_asked += len(to_ask)
        shape = plan(to_ask, threshold=self.config.tree_threshold)
        replies: list[tuple[Peer, PeerReply, int]] = []

        async def ask(item: tuple[Peer, list[Peer]]) -> None:
            peer, relay = item
            reply = await call_peer(peer, "/v1/incidents", self._join_body(job, me, relay), credentials=self.credentials,
                                    timeout_s=self.config.peer_timeout_s, attempts=2,
                                    headers={"traceparent": TraceParent(job.trace_id, job.root_span_id).header()})
            if reply.result.outcome is Outcome.OK and not reply.verified:  # an impostor at a member's address
                reply = PeerReply(_with(reply.result, outcome=Outcome.REFUSED, detail=f"{peer}: answer not verified (ignored)"),
                                  None, False)
                self.unverified_answers += 1
            replies.append((peer, reply, len(relay)))
            self._note_answer(job, peer, reply)

        await bounded(shape, ask, limit=self.config.fanout_concurrency)
        await anyio.to_thread.run_sync(lambda: self._fanout_results(job, replies, start, relays=sum(1 for _, r in shape if r)))

    async def _quiet(self, job: JobIncident) -> None:
        """Until no report came for ``report_grace_s`` (before the first one: ``first_report_wait_s``
        when this host detected the hang itself: the others did too, most likely), at most
        ``report_window_s``."""
        cfg = self.config
        start = time.monotonic()
        first = cfg.first_report_wait_s if job.detected_here else cfg.report_grace_s
        while True:
            since_last = max(job.last_report_s, start) + cfg.report_grace_s if job.last_report_s else start + first
            until = min(since_last, start + cfg.report_window_s)
            if until <= time.monotonic():
                return
            await anyio.sleep(until - time.monotonic())

    def _join_body(self, job: JobIncident, me: Peer, relay: Sequence[Peer]) -> dict[str, Any]:
        return {"job": self.config.job, "origin_host": self.host_name, "incident_id": job.local_incident_id,
                "origin_time_unix_nano": job.detected_time_unix_nano, "detail": f"job incident {job.key}"[:500],
                "coordinator": me.url, "relay": [p.url for p in relay]}

    def _note_answer(self, job: JobIncident, peer: Peer, reply: PeerReply) -> None:
        doc = reply.doc or {}
        host = str(doc.get("host.name") or "")
        ranks = _doc_ranks(doc)
        job.asked[peer.url] = PeerOutcome(peer.url, reply.result.outcome, reply.result.detail, host, ranks)
        answered = reply.verified and reply.result.outcome is Outcome.OK
        if answered and job.ahead and doc.get("trace_id") == job.trace_id:
            self._back_down_if_ahead(job, peer, host, doc)
        if answered and host:
            if _is_ip_literal(peer.host) and self._claim(job, host, Sender(peer.host, peer.port), "a join's answer", asked=True):
                return  # an answer at one member's address naming another member's host: not believed
            job.member_info[peer.url] = MemberInfo.model_validate({"job": self.config.job or "-", "host.name": host, "ranks": list(ranks)})
        if reply.doc is not None and not reply.verified:
            self.unverified_answers += 1

    def _back_down_if_ahead(self, job: JobIncident, peer: Peer, host: str, doc: dict[str, Any]) -> None:
        """A verified join answer (same trace) from a candidate ahead of us, or naming one it follows: we back down."""
        follows = doc.get("coordinator")
        if doc.get("coordinating") is True and peer.url in job.ahead:
            self._back_down(job, peer, host, f"{host or peer} answered our join: it coordinates this job incident")
        elif isinstance(follows, str) and follows in job.ahead:
            target = self._redirect_target(doc)
            if target is not None:
                self._back_down(job, target, self._proven_name(job, target.url, bare=True),
                                f"{host or peer} answered our join: it follows {self._proven_name(job, follows)}")

    async def _recheck(self, job: JobIncident) -> None:
        """After a provisional coordinator's fan-out, and again before its verdict: ask its first
        choice (``job.ahead[0]``) whether it coordinates this trace after all (a report marked
        ``provisional``, tried :data:`REPORT_TRIES` times while it times out); a verified
        ``coordinating`` answer for the same trace makes this host back down."""
        assert self.resolver is not None
        try:
            first = parse_peer(job.ahead[0], default_port=self.port, scheme=self.scheme)
        except ValueError:
            return
        members, _ = await self.resolver.resolve_all()
        me = await self._self_address(members)
        body = Report.model_validate({
            "job": self.config.job, "host.name": self.host_name, "agent_id": self.agent_id, "api_port": self.port,
            "scheme": self.scheme, "incident_id": job.local_incident_id or "unknown", "trace_id": job.trace_id, "key": job.key[:80],
            "detected_time_unix_nano": job.detected_time_unix_nano, "ranks": list(self.local_ranks), "world_size": self.world_size,
            "address": me.url, "provisional": True,
        }).model_dump(by_alias=True)
        for _ in range(REPORT_TRIES):
            self.reports_sent += 1
            reply = await call_peer(first, "/v1/job/report", body, credentials=self._as_listed(),
                                    timeout_s=self.config.peer_timeout_s, action=Action.REPORT, attempts=3)
            if reply.result.outcome is not Outcome.TIMED_OUT:
                break
        doc = reply.doc or {}
        if reply.result.outcome is Outcome.OK and reply.verified and doc.get("status") == "coordinating" and doc.get("trace_id") == job.trace_id:
            self._back_down(job, first, str(doc.get("host.name") or ""), f"{doc.get('host.name') or first} answered late: it coordinates")

    def _back_down(self, job: JobIncident, coordinator: Peer, host: str, why: str) -> None:
        """A provisional coordinator (``job.ahead``) learnt that one before it coordinates the same
        trace: it stops coordinating, emits no job verdict and sends its evidence there."""
        if not job.coordinating or not job.ahead:
            return
        job.coordinating, job.backed_down, job.cut_off = False, True, False
        job.coordinator, job.coordinator_host = coordinator, host
        log.warning("job %s: backing down as coordinator of trace %s: %s; our evidence goes to %s", self.config.job,
                    job.trace_id, why, host or coordinator)
        job.evidence_changed.set()  # a verdict waiting for evidence stops waiting
        job.evidence_changed = anyio.Event()
        self._tell_moved(job)

    def _tell_moved(self, job: JobIncident) -> None:
        """Having backed down, tell every host whose evidence we took (in the background) where
        the coordinator is (``POST /v1/job/moved``): each sends it there again. Without this
        their evidence, answered ``received`` here, never reached the job verdict."""
        held = {h: s for h, s in job.evidence_senders.items() if h != self.host_name}
        job.evidence_senders.clear()
        job.moved_hosts = sorted(held)[:1024]  # said on our own evidence: the coordinator waits for them
        if held and job.coordinator is not None and self._tg is not None:
            self._spawn(self._send_moved, job, job.coordinator, held)

    async def _send_moved(self, job: JobIncident, coordinator: Peer, held: dict[str, Sender]) -> None:
        resolver = self.resolver
        assert resolver is not None
        try:
            members, _ = await resolver.resolve_all()
            body = Moved.model_validate({
                "job": self.config.job, "host.name": self.host_name, "agent_id": self.agent_id, "trace_id": job.trace_id,
                "coordinator": coordinator.url, "coordinator_host": job.coordinator_host[:255],
            }).model_dump(by_alias=True)

            async def tell(item: tuple[str, Sender]) -> None:
                host, sender = item
                peer = None
                for member in members:
                    if not resolver.is_self(member) and await self._at(member, sender):
                        peer = member
                        break
                if peer is None:
                    log.warning("job %s: cannot tell %s where the coordinator is (%s is no member we list): its evidence"
                                " taken here is not in the job verdict", self.config.job, host, sender.identity)
                    return
                reply = await call_peer(peer, "/v1/job/moved", body, credentials=self._as_listed(),
                                        timeout_s=self.config.peer_timeout_s, action="fleet.moved", attempts=3)
                if reply.result.outcome is not Outcome.OK:
                    log.warning("job %s: telling %s where the coordinator is failed (%s): its evidence taken here is not"
                                " in the job verdict", self.config.job, host, reply.result.detail)

            await bounded(list(held.items()), tell, limit=self.config.fanout_concurrency)
        except Exception:  # boundary
            log.exception("telling the hosts whose evidence we took where the coordinator is failed")

    async def _on_moved(self, message: Moved, sender: Sender) -> tuple[int, dict[str, Any]]:
        """The coordinator we sent our evidence to backed down (:meth:`_tell_moved`): follow the
        one it names and send our evidence there again. Taken only from that coordinator, for
        this host's job incident (409 otherwise)."""
        job = self.job
        if job is None or not self._in_window(job) or message.trace_id != job.trace_id:
            return 409, {"error": "not the job incident of this agent", "host.name": self.host_name,
                         **(self._trace_doc(job) if job is not None else {})}
        if job.coordinating or job.coordinator is None or not await self._at(job.coordinator, sender):
            return 409, {"error": "only the coordinator this agent follows says where it moved", "host.name": self.host_name,
                         **self._trace_doc(job)}
        target = self._redirect_target({"coordinator": message.coordinator})
        if target is None:
            return 400, {"error": "coordinator is not a peer address", "host.name": self.host_name}
        job.coordinator, job.coordinator_host = target, message.coordinator_host or target.url
        log.warning("job %s: %s backed down as coordinator: our evidence goes to %s", self.config.job, message.host_name,
                    job.coordinator_host)
        if job.sent_evidence is not None:
            self._spawn(self._send_evidence, job, job.sent_evidence)
        return 200, {"status": "following", "host.name": self.host_name, **self._trace_doc(job)}

    def _cut_off(self, job: JobIncident, first: Peer, unreachable: Sequence[str]) -> None:
        """This host reached no other host of the job: its view is partial. No job verdict from
        here (the reachable side makes the job's); its own incident says so (``job.view``) and its
        evidence goes to its first choice later, marked partial (retried, bounded)."""
        job.coordinating, job.partial = False, True
        job.coordinator, job.coordinator_host = first, self._proven_name(job, first.url, bare=True)
        names = tuple(self._proven_name(job, u) for u in dict.fromkeys(unreachable))
        job.view = {"servewatch.job.partial": True, "servewatch.job.coordinator": self._proven_name(job, first.url),
                    "servewatch.job.unreachable": names,
                    "servewatch.job.partial_reason": f"reached no other host of job {self.config.job}: no job verdict from here;"
                                                     f" evidence sent later to {self._proven_name(job, first.url)}, marked partial"}
        log.warning("job %s: cut off (no other host answered: %s): no job verdict from this host; our evidence goes to %s later,"
                    " marked partial", self.config.job, ", ".join(names), names[0] if names else first)

    def _proven_name(self, job: JobIncident, url: str, *, bare: bool = False) -> str:
        """The host name the member at ``url`` proved (its verified answer to our announce, its
        own announce, a verified join answer, its report), else ``"<url> (host name not proven)"``
        (``bare``: ``""``): a host is never named by its address alone."""
        known = self.members.get(url) or job.member_info.get(url)
        if known is not None and known.host_name:
            return known.host_name
        outcome = job.asked.get(url)
        if outcome is not None and outcome.host_name and outcome.outcome is Outcome.OK:
            return outcome.host_name
        a = self.announced
        if a is not None and a.peer.url == url:
            return a.host_name
        return "" if bare else f"{url} (host name not proven)"

    def _fanout_results(self, job: JobIncident, replies: list[tuple[Peer, PeerReply, int]], start: int, *, relays: int) -> None:
        results = [r.result for _, r, _ in replies]
        failed = [r for r in results if r.outcome is not Outcome.OK]
        path = ""
        if job.local_incident_id is not None:
            folder = self.layout.incident(job.local_incident_id)
            doc = {"trace_id": job.trace_id, "reported": job.reported, "asked": [r.to_manifest() for r in results]}
            try:
                atomic_write_text(folder / FANOUT_FILE, json.dumps(doc))
                path = str(folder / FANOUT_FILE)
            except OSError as exc:
                log.warning("cannot write %s: %s", folder / FANOUT_FILE, exc)
        attrs: dict[str, Any] = {"servewatch.fanout.asked": len(results), "servewatch.fanout.ok": len(results) - len(failed),
                                 "servewatch.fanout.failed": len(failed), "servewatch.fanout.relays": relays,
                                 "servewatch.fanout.reported": len(job.reported),
                                 "servewatch.fanout.failures": tuple(r.detail[:200] for r in failed[:MAX_PEER_SPANS])}
        outcome = Outcome.OK if not failed else Outcome.FAILED
        detail = (f"asked {len(results)} host(s) that did not report ({relays} relays): {len(results) - len(failed)} ok,"
                  f" {len(failed)} failed; {len(job.reported)} reported on their own")
        job.results.append(ActionResult(action=Action.FANOUT, outcome=outcome, detail=detail, start_time_unix_nano=start,
                                        end_time_unix_nano=now_ns(), artifact_paths=(path,) if path else (),
                                        attributes=frozen_attrs(attrs)))
        shown = results if len(results) <= MAX_PEER_SPANS else failed[:MAX_PEER_SPANS]
        job.results.extend(shown)
        log.info("job %s: asked %d host(s): %d ok, %d failed", self.config.job, len(results), len(results) - len(failed), len(failed))

    async def _relay(self, job: JobIncident) -> None:
        """Ask the peers the coordinator handed us (members of our own peer list only)."""
        try:
            assert self.resolver is not None
            members, _ = await self.resolver.resolve_all()
            known = {p.url: p for p in members}
            targets: list[Peer] = []
            for raw in job.relay:
                try:
                    peer = parse_peer(raw, default_port=self.port, scheme=self.scheme)
                except ValueError:
                    peer = None
                if peer is None or peer.url not in known:
                    job.relayed.append(PeerOutcome(raw[:300], Outcome.REFUSED, "not a member of this agent's peer list: not asked"))
                    continue
                targets.append(peer)
            coordinator = job.coordinator or Peer("127.0.0.1", self.port)

            async def ask(peer: Peer) -> None:
                body = self._join_body(job, coordinator, ())
                body["origin_host"] = job.coordinator_host or body["origin_host"]
                reply = await call_peer(peer, "/v1/incidents", body, credentials=self.credentials, timeout_s=self.config.peer_timeout_s,
                                        headers={"traceparent": TraceParent(job.trace_id, job.root_span_id).header()})
                doc = reply.doc or {}
                ranks = _doc_ranks(doc)
                job.relayed.append(PeerOutcome(peer.url, reply.result.outcome, reply.result.detail[:300], str(doc.get("host.name") or ""), ranks))

            await bounded(targets, ask, limit=self.config.fanout_concurrency)
        except Exception:  # boundary
            log.exception("relaying the job's join failed")
        finally:
            job.done.set()

    # -- evidence and the job verdict --------------------------------------------------------------

    async def _share_evidence(self, job: JobIncident, incident_id: str, bundle_dir: str, judged: list[Any], verdict: Any) -> None:
        try:
            evidence = await anyio.to_thread.run_sync(self._evidence, job, incident_id, bundle_dir, judged, verdict)
            if job.coordinating:
                job.add_evidence(evidence)
                if not job.verdict_started:
                    job.verdict_started = True
                    await self._job_verdict(job, bundle_dir)
                if job.coordinating:
                    return
            if job.coordinator is None:
                return  # nobody to tell (a follow-up, or the coordinator never answered)
            await self._send_evidence(job, evidence)
        except Exception:  # boundary
            log.exception("sharing the evidence of incident %s failed", incident_id)

    async def _send_evidence(self, job: JobIncident, evidence: Evidence) -> None:
        """Send our evidence to the job's coordinator (``job.coordinator``; a redirect to the one it
        follows is taken once), marked partial or backed down as this host is. A coordinator that
        does not answer, or answers busy (HTTP 503: a provisional one not settled yet), is tried
        again (backoff up to :data:`EVIDENCE_RETRY_MAX_S`) until ``dedup_window_s`` from the job
        incident's start: a partitioned host's evidence arrives when the partition heals. Any
        other refusal is final (logged)."""
        assert job.coordinator is not None
        job.sent_evidence = evidence
        evidence = evidence.model_copy(update={"partial": job.partial, "backed_down": job.backed_down,
                                               "moved_hosts": job.moved_hosts if job.backed_down else []})
        body = json.loads(fit(evidence, self.api_config.max_body_bytes - 1024))
        target, hops, delay_s = job.coordinator, 0, 1.0
        deadline = job.started + self.config.dedup_window_s
        while True:
            reply = await call_peer(target, "/v1/job/evidence", body, credentials=self._as_listed(),
                                    timeout_s=self.config.peer_timeout_s, action="fleet.evidence", attempts=4)
            redirected = self._evidence_redirect(reply, target) if hops == 0 else None
            if redirected is not None:
                target, hops = redirected, 1
                continue
            if reply.result.outcome is Outcome.OK:
                if job.partial:
                    log.warning("job %s: our partial evidence reached %s", self.config.job, job.coordinator_host or target)
                return
            if (reply.result.outcome is Outcome.REFUSED and not reply.result.retryable) or time.monotonic() + delay_s > deadline:
                log.warning("sending our evidence to the coordinator failed: %s", reply.result.detail)
                return
            log.info("job %s: the coordinator %s did not take our evidence (%s): again in %.0f s", self.config.job,
                     job.coordinator_host or target, reply.result.detail, delay_s)
            await anyio.sleep(delay_s)
            delay_s = min(EVIDENCE_RETRY_MAX_S, delay_s * 2)

    def _evidence_redirect(self, reply: PeerReply, target: Peer) -> Peer | None:
        """Where a verified redirect answering our evidence sends it (``None``: no redirect, or back to ``target``)."""
        doc = reply.doc or {}
        if not (reply.result.outcome is Outcome.OK and reply.verified and doc.get("status") == "redirect"):
            return None
        redirected = self._redirect_target(doc)
        return redirected if redirected is not None and redirected != target else None

    def _evidence(self, job: JobIncident, incident_id: str, bundle_dir: str, judged: list[Any], verdict: Any) -> Evidence:
        evidence = host_evidence(job=self.config.job or "-", host_name=self.host_name, agent_id=self.agent_id, trace_id=job.trace_id,
                                 incident_id=incident_id, bundle_dir=bundle_dir, judged=judged, verdict=verdict)
        if evidence.world_size is not None:
            self.world_size = evidence.world_size
        relayed = [RelayedPeer.model_validate({"address": o.address, "outcome": str(o.outcome) if str(o.outcome) in
                                               ("ok", "refused", "timed_out", "failed") else "failed", "detail": o.detail,
                                               "host.name": o.host_name, "ranks": list(o.ranks)}) for o in job.relayed]
        return evidence.model_copy(update={"relayed": relayed}) if relayed else evidence

    async def _job_verdict(self, job: JobIncident, bundle_dir: str) -> None:
        """Wait for every member's evidence (bounded), judge the job, emit its root span."""
        deadline = job.started + self.config.evidence_timeout_s
        while job.coordinating and job.waits_for() and time.monotonic() < deadline:
            changed = job.evidence_changed
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                await changed.wait()
        if job.coordinating and job.ahead:
            await self._recheck(job)
        if not job.coordinating:
            return  # backed down: our evidence goes to the coordinator (the caller sends it)
        verdict = await anyio.to_thread.run_sync(self._judge, job)
        job.verdict = verdict
        self.verdicts += 1
        stuck = _stuck_collective(job)
        election = (f"{self.host_name} coordinates: {', '.join(self._proven_name(job, u) for u in job.ahead)} did not answer in time"
                    if job.ahead else "")
        doc = self._verdict_doc(job, verdict, stuck, election)
        try:
            await anyio.to_thread.run_sync(atomic_write_text, Path(bundle_dir) / JOB_VERDICT_FILE, json.dumps(doc, indent=1))
        except OSError as exc:
            log.warning("cannot write %s: %s", Path(bundle_dir) / JOB_VERDICT_FILE, exc)
        log.warning("job %s: %s", self.config.job, verdict.headline())
        attrs = self._verdict_attrs(job, verdict, stuck, election, bundle_dir)
        # one root by construction: a host cut off from every other host never gets here (its
        # view is partial: its own incident says so, its evidence goes to the coordinator later)
        await self.agent.bus.publish(JobIncidentClosed(
            source="fleet", job=self.config.job or "", trace_id=job.trace_id, span_id=job.root_span_id,
            start_time_unix_nano=job.detected_time_unix_nano or now_ns(), incident_id=job.local_incident_id or "",
            attributes=frozen_attrs(attrs),
        ))
        self._remember_judged(job)

    def _verdict_doc(self, job: JobIncident, verdict: JobVerdict, stuck: JobKey | None, election: str) -> dict[str, Any]:
        """The content of ``job-verdict.json``."""
        return {"job": self.config.job, "trace_id": job.trace_id, "root_span_id": job.root_span_id, "key": job.key,
                "election": election, "backed_down": sorted(job.backed_down_hosts), "partial_evidence": sorted(job.partial_evidence),
                "stuck_collective": str(stuck.value) if stuck is not None else None, "coordinator": self.host_name,
                "hosts_expected": job.expected_hosts(), "hosts_with_evidence": len(job.evidence),
                "reported": sorted(job.reported.values()),
                "clock_offsets_s": dict(sorted(job.clock_offsets_s.items())),
                "verdict": verdict.to_json(), "bundles": {h: e.bundle_dir for h, e in sorted(job.evidence.items())}}

    def _verdict_attrs(self, job: JobIncident, verdict: JobVerdict, stuck: JobKey | None, election: str,
                       bundle_dir: str) -> dict[str, Any]:
        """The job root span's attributes (a skew of host clocks is logged as they are built)."""
        attrs: dict[str, Any] = {**verdict.attributes(), "servewatch.job.trace_key": job.key,
                                 **({STUCK_COLLECTIVE_ATTR: stuck.value} if stuck is not None else {}),
                                 "servewatch.job.hosts": job.expected_hosts(), "servewatch.job.hosts_with_evidence": len(job.evidence),
                                 "servewatch.job.reported": len(job.reported), "servewatch.job.verdict_path": str(Path(bundle_dir) / JOB_VERDICT_FILE)}
        if election:
            attrs["servewatch.job.election"] = election
        skewed = {h: o for h, o in sorted(job.clock_offsets_s.items()) if abs(o) > CLOCK_OFFSET_SAID_S}
        if skewed:  # each host's spans carry its own clock: said where the trace is read
            attrs[CLOCK_OFFSETS_ATTR] = tuple(f"{h}={o:+.1f}" for h, o in skewed.items())
            log.warning("job %s: host clocks off this one's by more than %g s: %s (their spans in trace %s are off by as much)",
                        self.config.job, CLOCK_OFFSET_SAID_S, ", ".join(f"{h} {o:+.1f} s" for h, o in skewed.items()), job.trace_id)
        if job.backed_down_hosts:
            attrs["servewatch.job.backed_down"] = tuple(sorted(job.backed_down_hosts))
        if job.partial_evidence:
            attrs["servewatch.job.partial_evidence"] = tuple(sorted(job.partial_evidence))
        return attrs

    def _remember_judged(self, job: JobIncident) -> None:
        self._past_traces[job.trace_id] = self._past_traces.get(job.trace_id, 0) + 1
        while len(self._past_traces) > MAX_PAST_TRACES:
            self._past_traces.popitem(last=False)
        self._judged[job.trace_id] = job
        while len(self._judged) > MAX_JUDGED:
            self._judged.popitem(last=False)

    def _judge(self, job: JobIncident) -> JobVerdict:
        missing: list[MissingHost] = []
        have = set(job.evidence)
        known = dict(self.members)
        a = self.announced
        if a is not None:  # the coordinator that announced itself said who it is
            known.setdefault(a.peer.url, MemberInfo.model_validate({"job": self.config.job or "-", "host.name": a.host_name,
                                                                     "ranks": list(a.ranks)}))
        for address, outcome in sorted(job.asked.items()):
            info = job.member_info.get(address) or known.get(address)
            # named as it proved itself; a host that never did is its address, said so (never a name)
            host = outcome.host_name or (info.host_name if info else "") or f"{address} (host name not proven)"
            if host in have:
                continue
            ranks = outcome.ranks or (tuple(info.ranks) if info else ())
            missing.append(MissingHost(host, tuple(sorted(ranks)), _missing_why(outcome.outcome)))
        for address, host in job.reported.items():
            if host not in have and address not in job.asked:
                missing.append(MissingHost(host, tuple(sorted(job.member_info[address].ranks)) if address in job.member_info else (),
                                           "no evidence (reported a detection, then nothing)"))
        return judge_job(list(job.evidence.values()), missing_hosts=missing, world_size=self.world_size, conflicts=job.conflicts,
                         clock_offsets_s=job.clock_offsets_s)

    # -- announce -----------------------------------------------------------------------------------

    async def _announce_loop(self) -> None:
        """Look at this host's ranks every ``announce_interval_s``; the host of global rank 0
        announces itself to every member (again every ``announce_interval_s``), and sooner (every
        2 s at most) to the members that missed it until every one acknowledged it (at 1,000
        hosts one slow member no longer costs 999 announces every 2 s)."""
        while True:
            try:
                ranks = await anyio.to_thread.run_sync(self._local_ranks_now)
                self.local_ranks = ranks
                if 0 in ranks:
                    await self._announce(ranks)
                else:
                    self.announce_complete, self._announce_missed = False, None
            except Exception:  # boundary: membership is a nicety; detection and capture go on
                log.exception("announcing this agent to the job failed")
            interval = self.config.announce_interval_s
            await anyio.sleep(interval if self.announce_complete or 0 not in self.local_ranks else min(interval, 2.0))

    async def _announce(self, ranks: tuple[int, ...]) -> None:
        assert self.resolver is not None
        members, _ = await self.resolver.resolve_all()
        me = await self._self_address(members)
        peers = [p for p in members if p != me and not self.resolver.is_self(p)]
        if self._announce_missed is not None and time.monotonic() < self._announce_full_at:
            peers = [p for p in peers if p.url in self._announce_missed]  # a quick round: the members that missed the last
        else:
            self._announce_full_at = time.monotonic() + self.config.announce_interval_s
        body = Announce.model_validate({"job": self.config.job, "host.name": self.host_name, "agent_id": self.agent_id,
                                        "api_port": self.port, "scheme": self.scheme, "ranks": list(ranks),
                                        "address": me.url}).model_dump(by_alias=True)

        missed: list[str] = []

        async def one(peer: Peer) -> None:
            reply = await call_peer(peer, "/v1/job/announce", body, credentials=self.credentials,
                                    timeout_s=self.config.peer_timeout_s, action="fleet.announce")
            if reply.result.outcome is Outcome.OK and reply.verified and reply.doc is not None:
                try:
                    self.members[peer.url] = MemberInfo.model_validate(reply.doc)
                except ValueError:
                    missed.append(peer.url)
            else:
                missed.append(peer.url)  # it may not know us: until every member does, the lowest host coordinates

        await bounded(peers, one, limit=self.config.fanout_concurrency)
        self.announce_complete = not missed
        self._announce_missed = set(missed) if missed else None

    # -- API backend ----------------------------------------------------------------------------------

    async def job_message(self, message: Announce | Report | Evidence | Moved, *, client: str,
                          sender: Sender | None = None) -> tuple[int, dict[str, Any]]:
        """``POST /v1/job/announce|report|evidence|moved`` (bodies validated by :mod:`agent.fleet.messages`);
        ``sender``: who sent it as far as it is proven (default: ``client`` alone)."""
        if message.job != self.config.job:
            return 409, {"error": f"job mismatch: this agent is in job {self.config.job!r}", "host.name": self.host_name}
        if message.agent_id and message.agent_id == self.agent_id:
            return 409, {"error": "self", "host.name": self.host_name}
        who = self._identity(sender or Sender(client))
        if isinstance(message, Announce):
            return await self._on_announce(message, who)
        if isinstance(message, Report):
            return await self._on_report(message, who)
        if isinstance(message, Moved):
            return await self._on_moved(message, who)
        return self._on_evidence(message, who)

    def _as_listed(self) -> PeerCredentials:
        """Our credentials, sending from this agent's address in the member list when the API is
        bound to a wildcard (a multi-homed host's report and evidence come from where the
        coordinator knows it: the identity its answers proved)."""
        creds = self.credentials
        if creds.local_host or self.resolver is None:
            return creds
        me = next((p for p in self.resolver.static if _is_ip_literal(p.host) and not _is_loopback(p.host)
                   and self.resolver.is_self(p)), None)
        return replace(creds, local_host=me.host) if me is not None else creds

    def _claim(self, job: JobIncident, host: str, sender: Sender, what: str, *, asked: bool = False) -> str:
        """``""`` when ``sender`` may speak for ``host`` in ``job`` (the first identity to prove a
        host name keeps it; this agent's own name is its own), else the conflict (logged, counted,
        said in the job verdict and the status). A sender whose request names no port (mutual TLS
        without a token) is the host proven at its address. ``asked``: the verified answer of the
        listed member this agent asked (``sender``: the address and port it called): it proves the
        host name there even against an earlier claim (:meth:`JobIncident.prove`)."""
        job.prove(self.host_name, "this agent")
        identity = sender.identity
        known = job.proven.get(host)
        if sender.port is None and known is not None and _same_ip(known.rpartition(":")[0], sender.address):
            identity = known
        conflicts = job.conflicts_total
        line = job.prove(host, identity, what, asked=asked)
        if line or job.conflicts_total > conflicts:
            self.identity_conflicts += 1
            log.warning("job %s: %s", self.config.job, line or job.conflicts[-1])
        return line

    def _static_ports(self, address: str) -> set[int]:
        """The ports the static member list gives ``address`` (IP literals)."""
        static = self.resolver.static if self.resolver is not None else []
        return {p.port for p in static if _is_ip_literal(p.host) and _same_ip(p.host, address)}

    async def _sender_refusal(self, sender: Sender) -> str:
        """Why a signed request from ``sender`` is refused, ``""`` when it is not: the port its
        signature names must be one the member list gives its address (else, an address it does
        not list by IP, the job's API port, or the port of a member listed by a name that resolves
        there; no member list at all: any port). One address is then one identity per listed agent,
        not one per port it may name. The member list's DNS name is resolved only when the static
        list does not settle it."""
        if sender.port is None or self.resolver is None or sender.address.startswith("unix:"):
            return ""
        if not self.resolver.static and not self.resolver.dns_name:
            return ""  # no member list: nothing names an address's port
        ports = self._static_ports(sender.address)
        if self._port_listed(sender, ports):
            return ""
        members, _ = await self.resolver.resolve_all()
        ports |= {p.port for p in members if _is_ip_literal(p.host) and _same_ip(p.host, sender.address)}
        if self._port_listed(sender, ports) or await self._named_member_at(members, sender):
            return ""
        allowed = ", ".join(str(p) for p in sorted(ports or {self.resolver.default_port}))
        return (f"unauthorized: signed as the agent at {sender.identity}, but the job's agent at {sender.address} listens"
                f" on port {allowed}: a signature naming another port is never accepted (one address, one identity)")

    def _port_listed(self, sender: Sender, ports: set[int]) -> bool:
        """Whether ``sender``'s port is one of ``ports`` (none: the job's API port)."""
        assert self.resolver is not None
        return sender.port in ports or (not ports and sender.port == self.resolver.default_port)

    async def _named_member_at(self, members: Sequence[Peer], sender: Sender) -> bool:
        """Whether a member listed by a name at ``sender``'s port resolves to ``sender``'s address."""
        for peer in members:
            if not _is_ip_literal(peer.host) and peer.port == sender.port and await self._at(peer, sender):
                return True
        return False

    def _identity(self, sender: Sender) -> Sender:
        """``sender`` with the port it stands for when its request named none (a ``v1`` signature,
        a bearer token, mutual TLS alone): the one port the static member list gives its address,
        else (none listed) the job's API port; several listed ports: its address alone."""
        if sender.port is not None or self.resolver is None or sender.address.startswith("unix:"):
            return sender
        ports = self._static_ports(sender.address)
        if len(ports) > 1:
            return sender
        return Sender(sender.address, ports.pop() if ports else self.resolver.default_port)

    async def _at(self, peer: Peer, sender: Sender) -> bool:
        """Whether ``sender`` (its address, and its signed port when it names one) is ``peer``: a
        name is resolved (bounded by ``peer_timeout_s``)."""
        if sender.port is not None and sender.port != peer.port:
            return False
        if _is_ip_literal(peer.host):
            return _same_ip(peer.host, sender.address)
        infos: list[Any] = []
        with anyio.move_on_after(self.config.peer_timeout_s):
            try:
                infos = await anyio.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
            except OSError:
                infos = []
        return any(_same_ip(str(info[4][0]).split("%")[0], sender.address) for info in infos)

    async def _sender(self, message: Announce | Report, sender: Sender) -> Peer:
        """Who sent ``message``: its entry in our own member list when it names one we list and
        it came from there, else the address it called from at its API port."""
        if message.address and self.resolver is not None:
            members, _ = await self.resolver.resolve_all()
            listed = next((p for p in members if p.url == message.address), None)
            if listed is not None and await self._at(listed, sender):
                return listed
        return Peer(sender.address, message.api_port, message.scheme)

    async def _on_announce(self, message: Announce, sender: Sender) -> tuple[int, dict[str, Any]]:
        self.announces_received += 1
        peer = await self._sender(message, sender)
        self.announced = Announced(peer, message.host_name, tuple(message.ranks), time.monotonic())
        return 200, {"job": self.config.job, "host.name": self.host_name, "agent_id": self.agent_id,
                     "ranks": list(self.local_ranks), "world_size": self.world_size, "status": "member"}

    async def _on_report(self, report: Report, sender: Sender) -> tuple[int, dict[str, Any]]:
        self.reports_received += 1
        reporter = await self._sender(report, sender)
        if report.provisional:
            return self._on_provisional(report, reporter, sender)
        job = self.job
        if self._in_window(job) and job is not None and not job.placed.is_set():
            with anyio.move_on_after(self.config.accept_timeout_s):
                await job.placed.wait()  # ours is being placed right now
        if self._in_window(job) and job is not None and job.placed.is_set():
            redirect = await self._take_report(job, report, reporter)
            if redirect is not None:
                return redirect
        else:
            opened = await self._report_opens(report, reporter)
            if isinstance(opened, tuple):
                return opened
            job = opened
        conflict = self._claim(job, report.host_name, sender, "a report")
        if conflict:
            return 409, {"error": conflict, "host.name": self.host_name, **self._trace_doc(job)}
        job.reported[reporter.url] = report.host_name
        job.reported_by[reporter.url] = job.proven.get(report.host_name, "")
        job.last_report_s = time.monotonic()
        job.detected_time_unix_nano = min(job.detected_time_unix_nano or report.detected_time_unix_nano, report.detected_time_unix_nano)
        job.member_info[reporter.url] = MemberInfo.model_validate({"job": report.job, "host.name": report.host_name,
                                                                   "ranks": report.ranks, "world_size": report.world_size})
        self.world_size = self.world_size or report.world_size
        return 200, {"status": "coordinating", "host.name": self.host_name, "coordinator": "", **self._trace_doc(job)}

    async def _take_report(self, job: JobIncident, report: Report, reporter: Peer) -> tuple[int, dict[str, Any]] | None:
        """A report for our placed job incident: a redirect to the coordinator we follow, else ``None`` (we coordinate)."""
        if not job.coordinating and job.reporting is not None:
            with anyio.move_on_after(self.config.peer_timeout_s * (REPORT_TRIES + 1)):
                await job.reporting.wait()  # our own report is on its way (tried again on timeouts): its answer says who coordinates
        if not job.coordinating and job.coordinator is not None:
            # one coordinator: even one the reporter could not reach (it tries once more, then
            # its evidence goes there later); never a second one here
            return 200, {"status": "redirect", "coordinator": job.coordinator.url, "host.name": self.host_name,
                         **self._trace_doc(job)}
        if not job.coordinating:
            job.ahead = [u for u in report.unreachable if u != reporter.url]
        job.coordinating = True
        return None

    async def _report_opens(self, report: Report, reporter: Peer) -> JobIncident | tuple[int, dict[str, Any]]:
        """A report with no job incident here yet: the job incident we open and coordinate, else the answer (a redirect,
        or a late report of a job incident already judged)."""
        # coordinate only when first in this host's own order (the candidates before us
        # unreachable for the reporter), else say who is
        head, me = await self._head([*report.unreachable, reporter.url])
        if head != me and not (self.resolver is not None and self.resolver.is_self(head)):
            return 200, {"status": "redirect", "coordinator": head.url, "host.name": self.host_name, "trace_id": None}
        judged = self._judged.get(report.trace_id)
        if judged is not None and abs(report.detected_time_unix_nano - judged.detected_time_unix_nano) < self.config.dedup_window_s * 1e9:
            # a late report of the job incident already judged (its host detected it as the
            # others did, then took long): the same trace, no new incident
            judged.reported[reporter.url] = report.host_name
            return 200, {"status": "coordinating", "host.name": self.host_name, "coordinator": "", "late": True,
                         **self._trace_doc(judged)}
        trace_id, root = report.trace_id, root_span_of(report.trace_id)
        if trace_id in self._past_traces:  # a restarted job hanging at the same collective: a new trace
            trace_id, root = repeat_trace(trace_id, self._past_traces[trace_id])
        # provisional when the reporter could not reach the candidates before us (``ahead``)
        job = self.job = JobIncident(trace_id=trace_id, root_span_id=root, key=report.key, coordinating=True,
                                     detected_time_unix_nano=report.detected_time_unix_nano,
                                     ahead=[u for u in report.unreachable if u != reporter.url])
        job.placed.set()
        why = f"job {self.config.job}: {report.host_name} detected {report.trigger or 'a hang'} ({report.key})"
        self._spawn(self._open_joined, why[:500], TraceParent(trace_id, root))
        return job

    def _on_provisional(self, report: Report, reporter: Peer, sender: Sender) -> tuple[int, dict[str, Any]]:
        """A host coordinated ``report``'s trace because we did not answer it in time, and asks
        whether we coordinate it: ``coordinating`` (it backs down; recorded here) when we do (or
        judged it already), else ``not_coordinating``; never a new job incident."""
        job = self.job
        target = self._judged.get(report.trace_id)
        if target is None and job is not None and self._in_window(job) and job.trace_id == report.trace_id and job.coordinating and not job.ahead:
            target = job
        if target is None:
            return 200, {"status": "not_coordinating", "host.name": self.host_name, "trace_id": report.trace_id}
        conflict = self._claim(target, report.host_name, sender, "a report")
        if conflict:
            return 409, {"error": conflict, "host.name": self.host_name, **self._trace_doc(target)}
        target.reported.setdefault(reporter.url, report.host_name)
        if report.host_name not in target.backed_down_hosts:
            target.backed_down_hosts.append(report.host_name)
        log.warning("job %s: %s coordinated trace %s while we did not answer it in time: it backs down to us", self.config.job,
                    report.host_name, report.trace_id)
        return 200, {"status": "coordinating", "host.name": self.host_name, "coordinator": "", **self._trace_doc(target)}

    def _on_evidence(self, evidence: Evidence, sender: Sender) -> tuple[int, dict[str, Any]]:
        job = self.job
        judged = self._judged.get(evidence.trace_id)
        target = judged if judged is not None else job
        if target is not None and evidence.trace_id == target.trace_id:
            conflict = self._claim(target, evidence.host_name, sender, "evidence")
            if conflict:  # a token holder speaking for another host: never judged, said
                return 409, {"error": conflict, "host.name": self.host_name, **self._trace_doc(target)}
        if judged is not None and (judged is not job or judged.verdict is not None):  # after the verdict: kept, said, not re-judged
            return self._late_evidence(judged, evidence)
        refused = self._evidence_not_taken(job, evidence)
        if refused is not None:
            return refused
        assert job is not None
        if len(job.evidence) >= MAX_EVIDENCE_HOSTS and evidence.host_name not in job.evidence:
            return 413, {"error": "too many hosts"}
        self.evidence_received += 1
        job.add_evidence(evidence, job.proven.get(evidence.host_name, ""))
        job.evidence_senders[evidence.host_name] = sender
        if sender.clock_offset_s is not None and len(job.clock_offsets_s) < MAX_EVIDENCE_HOSTS:
            job.clock_offsets_s[evidence.host_name] = sender.clock_offset_s
        return 200, {"status": "received", "host.name": self.host_name, **self._trace_doc(job)}

    def _late_evidence(self, judged: JobIncident, evidence: Evidence) -> tuple[int, dict[str, Any]]:
        self.evidence_received += 1
        judged.add_evidence(evidence, judged.proven.get(evidence.host_name, ""))
        if evidence.host_name not in judged.late_evidence:
            judged.late_evidence.append(evidence.host_name)
        log.warning("job %s: evidence of %s came after the job verdict (kept, not judged)%s", self.config.job,
                    evidence.host_name, "; marked partial: it reached no other host for a while" if evidence.partial else "")
        return 200, {"status": "late", "host.name": self.host_name, **self._trace_doc(judged)}

    def _evidence_not_taken(self, job: JobIncident | None, evidence: Evidence) -> tuple[int, dict[str, Any]] | None:
        """The answer to evidence this agent does not judge now (a redirect, retry later, or not ours); ``None``: taken."""
        if (job is not None and not job.coordinating and job.coordinator is not None and evidence.trace_id == job.trace_id
                and self._in_window(job)):
            # we backed down (or never coordinated): the coordinator we follow takes it
            return 200, {"status": "redirect", "coordinator": job.coordinator.url, "host.name": self.host_name, **self._trace_doc(job)}
        if job is not None and job.coordinating and job.ahead and not job.done.is_set() and evidence.trace_id == job.trace_id:
            # provisional, not settled yet (we may back down): the sender tries again shortly
            return 503, {"error": "this agent coordinates provisionally and is asking the coordinator before it; retry",
                         "status": "retry", "retry_after_s": 1, "host.name": self.host_name, **self._trace_doc(job)}
        if job is None or not job.coordinating or evidence.trace_id != job.trace_id:
            return 409, {"error": "not the job incident this agent coordinates", "host.name": self.host_name,
                         **(self._trace_doc(job) if job is not None else {})}
        return None

    def _trace_doc(self, job: JobIncident) -> dict[str, Any]:
        doc: dict[str, Any] = {"trace_id": job.trace_id or None}
        if job.trace_id and job.root_span_id:
            doc["traceparent"] = TraceParent(job.trace_id, job.root_span_id).header()
        return doc

    async def post_incident(self, request: JoinRequest, *, agent_id: str, sender: Sender | None = None) -> tuple[int, dict[str, Any]]:
        """``POST /v1/incidents``: a manual incident, or a join of the job's trace (or a user's).

        ``sender``: who sent it as far as it is proven (``None``: a caller in this process). A
        join that names another trace than this host's job incident moves it only when it comes
        from the job's coordinator (:meth:`_may_retrace`); else it is refused (409) and said."""
        if agent_id and agent_id == self.agent_id:
            return 409, {"error": "self", "host.name": self.host_name}
        tp: TraceParent | None = request.get("traceparent")
        if tp is None:
            return await self._manual(request)
        job_name = request.get("job")
        if job_name is not None and job_name != self.config.job:
            return 409, {"error": f"job mismatch: this agent is in job {self.config.job!r}", "host.name": self.host_name}
        self.joins += 1
        job = self.job
        if self._in_window(job) and job is not None:
            return await self._join_ours(job, request, tp, sender)
        return await self._join_new(request, tp)

    async def _join_ours(self, job: JobIncident, request: JoinRequest, tp: TraceParent,
                         sender: Sender | None) -> tuple[int, dict[str, Any]]:
        """A join while our job incident is in its window: attached, joined, moved into the coordinator's trace, or refused."""
        if job.trace_id != tp.trace_id and not await self._may_retrace(job, request, sender):
            return self._refuse_retrace(job, tp, sender)
        if not job.placed.is_set() or (job.local_incident_id is None and job.trace_id != tp.trace_id and not job.joined):
            # ours is being placed or opened: the coordinator's trace wins, once it opened
            job.move_to = (tp.trace_id, tp.parent_id)
            with anyio.move_on_after(self.config.accept_timeout_s):
                await job.opened.wait()
            self._adopt_coordinator(job, request)
            return 202, self._answer("joined", job)
        if job.coordinating and job.ahead and job.trace_id == tp.trace_id and sender is not None:
            await self._back_down_if_join_ahead(job, request, sender)
        self._adopt_coordinator(job, request)
        if job.trace_id == tp.trace_id:
            return 200, self._answer("attached", job)
        # a request that passed authentication names another trace: the coordinator's wins
        job.trace_id, job.root_span_id = tp.trace_id, tp.parent_id
        if job.local_incident_id is not None and job.local_incident_id in self.agent.incidents.running:
            await self._move(job.local_incident_id, tp.trace_id, tp.parent_id)
            return 200, self._answer("moved", job)
        return 200, self._answer("attached", job)

    async def _back_down_if_join_ahead(self, job: JobIncident, request: JoinRequest, sender: Sender) -> None:
        claimed = self._redirect_target({"coordinator": request.get("coordinator")})
        if claimed is not None and claimed.url in job.ahead and await self._at(claimed, sender):
            self._back_down(job, claimed, request.get("origin_host") or "", "its join reached us: it coordinates this job incident")

    async def _join_new(self, request: JoinRequest, tp: TraceParent) -> tuple[int, dict[str, Any]]:
        """A join with no job incident here: ours opens in its trace."""
        job = self.job = JobIncident(trace_id=tp.trace_id, root_span_id=tp.parent_id, joined=True, key="join",
                                     detected_time_unix_nano=request.get("origin_time_unix_nano") or now_ns())
        job.placed.set()
        job.relay = list(request.get("relay") or [])
        self._adopt_coordinator(job, request)
        origin = request.get("origin_host") or "?"
        detail = request.get("detail") or ""
        why = f"job {self.config.job or '-'}: {origin} opened {request.get('incident_id') or 'an incident'}" + (f" ({detail})" if detail else "")
        self._spawn(self._open_joined, why[:500], tp)
        with anyio.move_on_after(self.config.accept_timeout_s):
            await job.opened.wait()
        return 202, self._answer("opened" if job.local_incident_id else "accepted", job)

    async def _may_retrace(self, job: JobIncident, request: JoinRequest, sender: Sender | None) -> bool:
        """Only the job's coordinator moves this host's job incident into another trace: the
        coordinator this host knows (its report's answer), else a join naming its own sender as
        the coordinator; never a coordinating host's (its trace is the job's)."""
        if sender is None:
            return True
        if job.coordinating:
            return False
        if job.coordinator is not None:
            return await self._at(job.coordinator, sender)
        raw = request.get("coordinator")
        try:
            claimed = parse_peer(raw, default_port=self.port, scheme=self.scheme) if isinstance(raw, str) else None
        except ValueError:
            claimed = None
        return claimed is not None and await self._at(claimed, sender)

    def _refuse_retrace(self, job: JobIncident, tp: TraceParent, sender: Sender | None) -> tuple[int, dict[str, Any]]:
        who = sender.identity if sender is not None else "?"
        coordinator = "this agent" if job.coordinating else (job.coordinator.url if job.coordinator else "not known yet")
        line = job.conflict(f"a join from {who} naming trace {tp.trace_id} refused: this job incident's trace is"
                            f" {job.trace_id or '(being placed)'}, its coordinator {coordinator}")
        self.identity_conflicts += 1
        log.warning("job %s: %s", self.config.job, line)
        return 409, {"error": line, "status": "refused", "host.name": self.host_name, **self._trace_doc(job)}

    def _adopt_coordinator(self, job: JobIncident, request: JoinRequest) -> None:
        raw = request.get("coordinator")
        if job.coordinating or job.coordinator is not None or not isinstance(raw, str):
            return
        try:
            job.coordinator = parse_peer(raw, default_port=self.port, scheme=self.scheme)
            job.coordinator_host = request.get("origin_host") or ""
        except ValueError:
            pass

    async def _manual(self, request: JoinRequest) -> tuple[int, dict[str, Any]]:
        manager = self.agent.incidents
        job = self.job
        if self.config.job and self._in_window(job) and job is not None:
            with anyio.move_on_after(self.config.accept_timeout_s):
                await job.placed.wait()
            return 200, self._answer("attached", job)  # the job incident holds this host's evidence already
        current = manager.current
        if current is not None:
            return 409, {"error": "an incident is running", **self._incident_doc(current.opened), "status": "busy"}
        detail = request.get("detail") or "requested over the agent API"
        # a manual incident pauses every rank (py-spy): it shares the cooldown of every trigger
        left_s, last_id = manager.claim_cooldown(Trigger.MANUAL, detail)
        if left_s > 0:
            return 429, {"error": f"cooling down: incident {last_id or '(the last manual one)'} opened less than"
                         f" incident.cooldown_s ago; retry in {left_s:.0f} s", "status": "cooldown",
                         "incident_id": last_id, "retry_after_s": round(left_s, 1), "host.name": self.host_name}
        since = now_ns()
        opened = await self._open_and_wait(lambda o: o.time_unix_nano >= since, Trigger.MANUAL, detail, None)
        if opened is not None:
            manager.cooldown_opened(Trigger.MANUAL, opened.incident_id)
        return 202, {"status": "opened" if opened else "accepted", **self._incident_doc(opened)}

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
            async def run() -> None:
                try:
                    await self.agent.incidents.open_incident(trigger, detail=detail, parent=parent)
                except Exception:
                    log.exception("incident requested over the API failed")

            self._spawn(run)
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
        """A join's answer; ``coordinating``: this host coordinates the job incident (not
        provisionally); ``coordinator``: the one it follows (a provisional coordinator asking backs
        down when it is one it could not reach)."""
        return {"status": status, "host.name": self.host_name, "job": self.config.job, "incident_id": job.local_incident_id,
                "ranks": list(self.local_ranks), "rank_labels": self._ranks(), "agent_id": self.agent_id,
                "coordinating": job.coordinating and not job.ahead, "coordinator": job.coordinator.url if job.coordinator else None,
                **self._trace_doc(job)}

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
        announced = self.announced
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
                "ranks": list(self.local_ranks),
                "coordinator": ({"address": announced.peer.url, "host.name": announced.host_name}
                                if announced is not None else None),
                "members_known": len(self.members),
                "job_incident": self.job.summary() if self._in_window(self.job) and self.job else None,
                "folded": self.folded, "joins": self.joins, "moved": self.moved,
                "fanouts": self.fanouts, "peers_asked": self.peers_asked, "reports_sent": self.reports_sent,
                "reports_received": self.reports_received, "evidence_received": self.evidence_received,
                "unverified_answers": self.unverified_answers,
                "verdicts": self.verdicts,
                "identity_conflicts": self.identity_conflicts,
            },
            "api": self.server.statistics()._asdict() if self.server else None,
            "bus": agent.bus.statistics()._asdict(),
        }
        return doc

    def _host_dir(self) -> Path:
        return self.layout.host

    async def list_incidents(self) -> list[dict[str, Any]]:
        """``GET /v1/incidents``: this host's incidents, newest first (ids start with their UTC
        time); the open one first. Manifests are read on a worker thread."""
        out = await anyio.to_thread.run_sync(self._read_listing)
        for current in self.agent.incidents.running.values():  # every server's open one, first
            if all(i["incident_id"] != current.opened.incident_id for i in out):
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
        :class:`agent.host.manifest.Manifest` validates it, or None (no such incident, too big, or not
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


def _is_ip_literal(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(host.strip("[]")).is_loopback


def _same_ip(a: str, b: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(a.strip("[]")) == ipaddress.ip_address(b.strip("[]"))
    except ValueError:
        return False


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


def _route_address(destinations: Sequence[tuple[str, int]]) -> str:
    """This machine's address on the route to the first reachable destination (a UDP socket
    connected, no packet sent); ``127.0.0.1`` when there is none."""
    for host, port in destinations:
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, port))
                return str(s.getsockname()[0])
        except OSError:
            continue
    return "127.0.0.1"


def _stuck_collective(job: JobIncident) -> JobKey | None:
    """The job's stuck collective (``"<pg>:<seq>"``) from every host's ranks' Flight Recorder
    windows in their evidence: read after capture, never before it (``None`` without one)."""
    return stuck_collective([r.fr for e in job.evidence.values() for r in e.ranks if isinstance(r.fr, dict)])


def _doc_ranks(doc: dict[str, Any]) -> tuple[int, ...]:
    """The ranks an answer names (integers only)."""
    return tuple(r for r in doc.get("ranks") or () if isinstance(r, int) and not isinstance(r, bool))


_MISSING_WHY = {Outcome.OK: "no evidence (its agent answered the join, then nothing)",
                Outcome.TIMED_OUT: "agent unreachable (timed out: host down or partitioned)",
                Outcome.REFUSED: "agent refused"}


def _missing_why(outcome: Outcome) -> str:
    """Why a member the coordinator asked has no evidence, by its join's outcome."""
    return _MISSING_WHY.get(outcome, "agent unreachable (connection failed)")


def _may_coordinate(result: ActionResult) -> bool:
    """Whether a coordinator candidate whose report failed with ``result`` may still be alive and
    coordinating: no answer in time, no route (a partition looks like this), or a busy answer
    (HTTP 408/429/5xx). A refused connection or TLS handshake, a refusal (another job, another
    token), an answer without the job's proof or not HTTP at all: no agent of the job there."""
    if result.outcome is Outcome.TIMED_OUT:
        return True
    if result.outcome is Outcome.REFUSED:
        return result.retryable
    attrs = result.attributes
    return attrs.get("servewatch.peer.error") == "unreachable" and not attrs.get("servewatch.peer.refused")


def _with(result: ActionResult, **changes: Any) -> ActionResult:
    return replace(result, **changes)


async def _nothing() -> list[ActionCompleted]:
    return []

