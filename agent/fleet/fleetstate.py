"""What every part of a job's protocol shares on one agent: one :class:`FleetState` per run.

Owns :class:`FleetState` (the agent and its settings, who this agent is, the job incident, what
the members said, the peer resolver and credentials, the task group, the judged job incidents,
the counters the status reads), the few helpers every part uses on it (the job incident's window,
this agent's own member entry, a trace's answer fields, a member's proven name, moving an
incident into another trace), the protocol's shared bounds (:data:`REPORT_TRIES`,
:data:`MAX_COORDINATOR_TRIES`) and small address helpers. Built by :class:`agent.fleet.job.Fleet`
and handed to each part (:mod:`agent.fleet.senders`, :mod:`agent.fleet.announce`,
:mod:`agent.fleet.coordinator`, :mod:`agent.fleet.intake`, :mod:`agent.fleet.member`,
:mod:`agent.fleet.contributions`, :mod:`agent.fleet.backend`, :mod:`agent.fleet.bundles`):
every part reads and writes it explicitly, none reaches into another part's state.

Imports anyio and the :mod:`agent.fleet` modules below the protocol (peers, jobstate, messages,
traceparent, config); never a protocol part.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.abc import TaskGroup

from agent.fleet.config import ApiConfig, FleetConfig
from agent.fleet.jobstate import Announced, JobIncident
from agent.fleet.messages import MemberInfo
from agent.fleet.peers import OwnNames, Peer, PeerCredentials, PeerResolver, parse_peer
from agent.fleet.traceparent import TraceParent
from agent.model.datadir import DataDir
from agent.model.events import ActionResult, IncidentOpened, Outcome

if TYPE_CHECKING:
    from agent.fleet.http import HttpServer

__all__ = ["MAX_COORDINATOR_TRIES", "REPORT_TRIES", "AgentView", "FleetState"]

log = logging.getLogger("servewatch.fleet")

#: Coordinator candidates a detecting host tries before it coordinates its own view.
MAX_COORDINATOR_TRIES = 3
#: Tries of one report to the first coordinator candidate while its answer times out (each bounded
#: by ``peer_timeout_s``): a slow coordinator still coordinates, and a second one never starts.
REPORT_TRIES = 3

#: One waiter for an incident opened over the API: its predicate, the event set, the box it lands in.
OpenedWaiter = tuple[Callable[[IncidentOpened], bool], anyio.Event, list[IncidentOpened]]


class AgentView(Protocol):
    """What the fleet reads from the agent (:class:`agent.runtime.agent.Agent`)."""

    settings: Any
    incidents: Any
    bus: Any

    def discover(self) -> list[Any]: ...

    @property
    def watched_step_pids(self) -> frozenset[int]: ...


class FleetState:
    """The per-run state every part of the job protocol shares (one per :class:`~agent.fleet.job.Fleet`).

    Args:
        agent: the running agent (settings, incident manager, discovery, bus).
        api: API settings (bind address and port, TLS, names).
        fleet: job settings (name, peers, timeouts in seconds, window).
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
        #: this agent's own addresses and names (a peer's signed request must name one)
        self.own_names = OwnNames(api.host, [self.host_name, socket.gethostname(), *api.names])
        self.job: JobIncident | None = None
        self.announced: Announced | None = None
        #: this host's global ranks, as of the last look (announce loop)
        self.local_ranks: tuple[int, ...] = ()
        self.world_size: int | None = None
        #: what each member said of itself (the announce's answers): address -> info
        self.members: dict[str, MemberInfo] = {}
        #: the last announce reached every member of the job (this host then coordinates as rank 0's)
        self.announce_complete = False
        self.server: HttpServer | None = None
        self.resolver: PeerResolver | None = None
        self.credentials = PeerCredentials()
        self.tg: TaskGroup | None = None
        #: incidents requested over the API, waited for until they open
        self.opened_waiters: list[OpenedWaiter] = []
        #: trace ids of closed job incidents, with how often each was judged (a repeat gets a fresh trace)
        self.past_traces: OrderedDict[str, int] = OrderedDict()
        #: job incidents this agent coordinated and judged, by trace (late reports and evidence)
        self.judged: OrderedDict[str, JobIncident] = OrderedDict()
        self.self_peer: Peer | None = None
        #: members of the job as last resolved (static peers and the DNS name's addresses)
        self.members_seen = 0
        self.started_s = time.time()
        #: announces received (the rank-0 host's)
        self.announces_received = 0
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

    @property
    def port(self) -> int:
        """The API's bound port (after start; before it, the configured one)."""
        return self.server.port if self.server is not None else self.api_config.port

    @property
    def scheme(self) -> str:
        """``https`` with TLS on the API, else ``http``."""
        return "https" if self.api_config.tls else "http"

    def in_window(self, job: JobIncident | None) -> bool:
        """A job incident is remembered ``dedup_window_s`` from its start, or from the last report
        its coordinator received (a job whose hosts keep reporting stays one incident)."""
        return job is not None and job.in_window(self.config.dedup_window_s)

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the fleet's task group (only while :meth:`Fleet.run` runs: AssertionError before)."""
        assert self.tg is not None
        self.tg.start_soon(fn, *args)

    async def self_address(self, members: Sequence[Peer]) -> Peer:
        """This agent as the job's member list names it; when the list leaves it out, its address
        towards the first member (what that member sees), at its API port."""
        assert self.resolver is not None
        for p in members:
            if self.resolver.is_self(p):
                return p
        if self.self_peer is None:
            host = await anyio.to_thread.run_sync(route_address, [(p.host, p.port) for p in members[:4]])
            self.self_peer = Peer(host, self.port, self.scheme)
        return self.self_peer

    def as_listed(self) -> PeerCredentials:
        """Our credentials, sending from this agent's address in the member list when the API is
        bound to a wildcard (a multi-homed host's report and evidence come from where the
        coordinator knows it: the identity its answers proved)."""
        creds = self.credentials
        if creds.local_host or self.resolver is None:
            return creds
        me = next((p for p in self.resolver.static if is_ip_literal(p.host) and not is_loopback(p.host)
                   and self.resolver.is_self(p)), None)
        return replace(creds, local_host=me.host) if me is not None else creds

    def redirect_target(self, doc: dict[str, Any]) -> Peer | None:
        """The peer a ``coordinator`` field names (``None``: none, or not a peer address)."""
        raw = doc.get("coordinator")
        if not isinstance(raw, str):
            return None
        try:
            return parse_peer(raw, default_port=self.port, scheme=self.scheme)
        except ValueError:
            return None

    def trace_doc(self, job: JobIncident) -> dict[str, Any]:
        """An answer's trace fields: ``trace_id`` (``None`` while being placed) and ``traceparent``."""
        doc: dict[str, Any] = {"trace_id": job.trace_id or None}
        if job.trace_id and job.root_span_id:
            doc["traceparent"] = TraceParent(job.trace_id, job.root_span_id).header()
        return doc

    def proven_name(self, job: JobIncident, url: str, *, bare: bool = False) -> str:
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

    async def move(self, incident_id: str, trace_id: str, parent_span_id: str) -> bool:
        """Move the running incident ``incident_id`` into ``trace_id`` under ``parent_span_id``; whether it moved."""
        moved = await self.agent.incidents.retrace(incident_id, trace_id, parent_span_id)
        if moved:
            self.moved += 1
            log.warning("incident %s moved into the job's trace %s (under span %s)", incident_id, trace_id, parent_span_id)
        return bool(moved)


def is_ip_literal(host: str) -> bool:
    """Whether ``host`` is one IP address (brackets allowed)."""
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether the IP literal ``host`` is a loopback address (ValueError: not an IP literal)."""
    import ipaddress

    return ipaddress.ip_address(host.strip("[]")).is_loopback


def same_ip(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are the same IP address (``False`` when either is not one)."""
    import ipaddress

    try:
        return ipaddress.ip_address(a.strip("[]")) == ipaddress.ip_address(b.strip("[]"))
    except ValueError:
        return False


def route_address(destinations: Sequence[tuple[str, int]]) -> str:
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


def doc_ranks(doc: dict[str, Any]) -> tuple[int, ...]:
    """The ranks an answer names (integers only)."""
    return tuple(r for r in doc.get("ranks") or () if isinstance(r, int) and not isinstance(r, bool))


def with_(result: ActionResult, **changes: Any) -> ActionResult:
    """``result`` with ``changes``."""
    return replace(result, **changes)
