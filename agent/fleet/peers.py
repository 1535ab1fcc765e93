"""The job's peers: who they are (static list, DNS name) and asking them to capture.

Owns :class:`Peer`, :func:`parse_peer`, :class:`PeerResolver` (static peers plus every address a
DNS name resolves to, e.g. a Kubernetes headless service; this agent's own address is skipped),
:class:`OwnNames` (this agent's own addresses and names: a peer's signed request must be made for
one of them) and
:func:`call_peer` (one bounded ``POST`` to a peer, its outcome sorted into our terms: ``ok``,
``refused`` (HTTP 4xx/5xx, or not asked: the token never goes over plain HTTP unless allowed),
``timed_out`` (slow), ``failed`` (unreachable, or not answering HTTP)) with
:class:`PeerCredentials` (what we send, and whether an answer provably comes from a member of the
job: mutual TLS, or the token's proof of :mod:`agent.fleet.proof`).

Imports anyio, psutil, :mod:`agent.fleet.client`, :mod:`agent.fleet.proof` and :mod:`agent.model.events`.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import anyio
import psutil

from agent.fleet.client import PeerAnswer, PeerRequestError, post_json
from agent.fleet.proof import NONCE_HEADER, PROOF_HEADER, new_nonce, sign_request, verify_answer
from agent.model.backoff import Backoff
from agent.model.events import Action, ActionResult, Outcome, frozen_attrs, now_ns

__all__ = [
    "PEER_SPAN",
    "RESOLVE_SPAN",
    "OwnNames",
    "Peer",
    "PeerCredentials",
    "PeerReply",
    "PeerResolver",
    "call_peer",
    "local_addresses",
    "parse_peer",
]

log = logging.getLogger("servewatch.fleet.peers")

#: Span (action) name of asking one peer to capture.
PEER_SPAN = Action.PEER_CAPTURE
#: Span (action) name of resolving the peers' DNS name, when it fails.
RESOLVE_SPAN = Action.PEER_RESOLVE


@dataclass(frozen=True, slots=True)
class Peer:
    """One peer agent's API address."""

    host: str
    port: int
    scheme: str = "http"

    @property
    def authority(self) -> str:
        """``host:port`` as the ``Host`` header names it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.authority}"

    def __str__(self) -> str:
        return self.url


def parse_peer(spec: str, *, default_port: int, scheme: str = "http") -> Peer:
    """``host``, ``host:port``, ``[v6]:port`` or ``http(s)://host:port`` as a :class:`Peer`.

    Raises:
        ValueError: not an address.
    """
    raw = spec.strip()
    if not raw:
        raise ValueError("empty peer address")
    parts = urlsplit(raw if "://" in raw else f"{scheme}://{raw}")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"peer {spec!r}: expected host:port or http(s)://host:port")
    port = parts.port or default_port
    return Peer(parts.hostname, port, parts.scheme)


def local_addresses() -> frozenset[str]:
    """This machine's IP addresses (every interface), for skipping ourselves in a peer list."""
    found = {"127.0.0.1", "::1"}
    try:
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    found.add(a.address.split("%")[0])
    except (OSError, psutil.Error):
        pass
    return frozenset(found)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class OwnNames:
    """This agent's own addresses and names (what a peer's signed request may be made for).

    Bound to one address (``api.host`` an IP), that address; bound to a wildcard, every address
    of this machine's interfaces (looked up again, at most every :attr:`REFRESH_S` seconds, when
    an unknown address is asked about: a pod's address may change). Always: ``names`` (this
    agent's host name, the kernel's, ``api.names``, names of the member list that resolve to it).

    Args:
        bind_host: the API's bind address.
        names: names (or addresses) that are this agent's too.
    """

    REFRESH_S = 5.0

    def __init__(self, bind_host: str, names: Iterable[str] = ()) -> None:
        self.bind = bind_host.strip("[]").lower()
        self.concrete = _is_ip(self.bind) and not ipaddress.ip_address(self.bind).is_unspecified
        self.names = {n.strip("[]").lower() for n in names if n}
        self._local = local_addresses()
        self._looked = time.monotonic()

    def add(self, name: str) -> None:
        """``name`` (an address or a name) is this agent's too."""
        self.names.add(name.strip("[]").lower())

    def __call__(self, host: str) -> bool:
        """Whether ``host`` (an address or a name) is this agent's."""
        h = host.strip("[]").lower()
        if h in self.names:
            return True
        if self.concrete:
            return h == self.bind or (h == "localhost" and ipaddress.ip_address(self.bind).is_loopback)
        if h == "localhost" or h in self._local:
            return True
        if _is_ip(h) and time.monotonic() - self._looked > self.REFRESH_S:
            self._local, self._looked = local_addresses(), time.monotonic()
            return h in self._local
        return False

    def label(self, port: int) -> str:
        """How a refusal names this agent (``10.0.0.2:7207``, ``*:7207``)."""
        return f"{self.bind if self.concrete else '*'}:{port}"


class PeerResolver:
    """The peers to ask at each incident.

    Args:
        static: peer specs (``host:port``...).
        dns_name: ``name[:port]`` resolving to every peer (resolved at each call, so pods that
            came or went are seen), or ``None``.
        own_port: this agent's API port (an address of this machine on this port is us).
        own_host: the API's bind address (when not a wildcard, that address on our port is us).
        default_port: port for peers given without one.
        scheme: ``http`` or ``https``.
        timeout_s: bound on DNS resolution, seconds.
    """

    def __init__(
        self,
        static: list[str],
        *,
        dns_name: str | None,
        own_port: int,
        own_host: str = "",
        default_port: int,
        scheme: str = "http",
        timeout_s: float = 2.0,
    ) -> None:
        self.static = [parse_peer(s, default_port=default_port, scheme=scheme) for s in static]
        self.dns_name = dns_name
        self.own_port = own_port
        self.own_host = own_host
        self.default_port = default_port
        self.scheme = scheme
        self.timeout_s = timeout_s
        self._local = local_addresses()
        #: peers found to be this agent (it answered with our own agent id)
        self.self_peers: set[Peer] = set()

    def is_self(self, peer: Peer) -> bool:
        if peer in self.self_peers:
            return True
        if peer.port != self.own_port:
            return False
        if self.own_host and self.own_host not in ("0.0.0.0", "::") and _is_ip(peer.host) and _is_ip(self.own_host):
            return peer.host == self.own_host or (peer.host in ("127.0.0.1", "::1") and self.own_host in ("127.0.0.1", "::1"))
        return peer.host in self._local or peer.host == "localhost"

    async def resolve(self) -> tuple[list[Peer], list[ActionResult]]:
        """Peers to ask now (this agent left out), and a failed ``peer.resolve`` result when the
        DNS name did not resolve."""
        members, problems = await self.resolve_all()
        return [p for p in members if not self.is_self(p)], problems

    async def resolve_all(self) -> tuple[list[Peer], list[ActionResult]]:
        """Every member of the job as listed (static peers, then what the DNS name resolves to),
        this agent's own address included when listed: the order every host of the job computes
        alike (:meth:`candidates`)."""
        peers = list(dict.fromkeys(self.static))
        problems: list[ActionResult] = []
        if self.dns_name:
            start = now_ns()
            name, _, port_text = self.dns_name.rpartition(":") if self.dns_name.count(":") == 1 else (self.dns_name, "", "")
            port = int(port_text) if port_text.isdigit() else self.default_port
            error = ""
            infos: list[Any] = []
            with anyio.move_on_after(self.timeout_s) as scope:
                try:
                    infos = await anyio.getaddrinfo(name, port, type=socket.SOCK_STREAM)
                except OSError as exc:
                    error = f"cannot resolve {name!r}: {exc}"
            if scope.cancelled_caught:
                error = f"resolving {name!r} took longer than {self.timeout_s:g} s"
            seen = set(peers)
            for info in infos:
                peer = Peer(str(info[4][0]).split("%")[0], port, self.scheme)
                if peer not in seen:
                    seen.add(peer)
                    peers.append(peer)
            if error:
                problems.append(
                    ActionResult(action=RESOLVE_SPAN, outcome=Outcome.TIMED_OUT if scope.cancelled_caught else Outcome.FAILED,
                                 retryable=True, detail=error, start_time_unix_nano=start, end_time_unix_nano=now_ns(),
                                 attributes=frozen_attrs({"servewatch.peer.dns_name": self.dns_name}))
                )
        return peers, problems

    @staticmethod
    def candidates(members: list[Peer]) -> list[Peer]:
        """The job's members in coordinator order (lowest first): by host, then port. Every host
        that lists the same members computes the same order."""
        ips = sorted((p for p in members if _is_ip(p.host)), key=lambda p: (ipaddress.ip_address(p.host).version,
                                                                            int(ipaddress.ip_address(p.host)), p.port))
        names = sorted((p for p in members if not _is_ip(p.host)), key=lambda p: (p.host, p.port))
        return ips + names


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """How this agent authenticates to its peers and checks who answered.

    Attributes:
        token: the job's bearer token (``None``: mutual TLS only).
        ssl_context: TLS context for ``https`` peers (our certificate; theirs verified).
        job_ca: ``ssl_context`` verifies peers' certificates against the job CA (mutual TLS):
            an answer over TLS then comes from a member of the job.
        allow_insecure: talk to plain-HTTP peers too (``--allow-insecure-peers``).
        agent_id: this agent's random id (a peer answering with it is ourselves).
        local_host: source address of requests (the API's bind address when it is one IP).
        own_port: this agent's API port, bound into every signature (the receiver names the
            sender by the address the request came from and this port).
    """

    token: bytes | None = None
    ssl_context: ssl.SSLContext | None = None
    job_ca: bool = False
    allow_insecure: bool = False
    agent_id: str = ""
    local_host: str | None = None
    own_port: int | None = None

    def source(self, peer: Peer) -> str | None:
        """The source address towards ``peer`` (same address family only)."""
        if not self.local_host or not _is_ip(peer.host):
            return None
        return self.local_host if (":" in self.local_host) == (":" in peer.host) else None

    def refusal(self, peer: Peer) -> str:
        """Why ``peer`` must not be asked (``""``: it may): a job with a token talks TLS unless
        plain HTTP is allowed."""
        if self.token is not None and peer.scheme != "https" and not self.allow_insecure:
            return (f"{peer} not asked: a plain-HTTP peer of a job with a token"
                    " (serve the API over TLS, or --allow-insecure-peers)")
        return ""

    def headers(self, peer: Peer, nonce: str) -> dict[str, str]:
        return {"x-servewatch-agent": self.agent_id, "user-agent": "servewatch-fleet", NONCE_HEADER: nonce}

    def signer(self, peer: Peer, method: str, path: str) -> Callable[[bytes], dict[str, str]] | None:
        """Signs a request to ``peer`` with the token (the token itself is never sent to a peer)."""
        token = self.token
        if token is None:
            return None
        port = self.own_port
        return lambda body: {"authorization": sign_request(token, method, peer.authority, path, body, sender_port=port)}

    def verified(self, peer: Peer, answer: PeerAnswer, nonce: str) -> bool:
        """Whether ``answer`` provably comes from a member of the job: over TLS verified against
        the job CA, or carrying the proof of the token (:mod:`agent.fleet.proof`)."""
        if peer.scheme == "https" and self.job_ca and self.ssl_context is not None:
            return True
        if self.token is None:
            return False
        return verify_answer(self.token, nonce, answer.status, answer.body, answer.headers.get(PROOF_HEADER))


@dataclass(frozen=True, slots=True)
class PeerReply:
    """A peer's answer to one request.

    Attributes:
        result: the request as an action result (``action`` as asked; outcome ``ok``,
            ``refused`` (an HTTP error, or not asked), ``timed_out``, ``failed``).
        doc: the peer's JSON answer (``None``: none).
        verified: the answer provably comes from a member of the job (:meth:`PeerCredentials.verified`).
    """

    result: ActionResult
    doc: dict[str, Any] | None
    verified: bool = False


#: A failure this fast is a refusal at the door (a busy peer shedding connections), worth a retry.
QUICK_FAILURE_S = 1.0


async def call_peer(
    peer: Peer,
    path: str,
    body: dict[str, Any],
    *,
    credentials: PeerCredentials,
    timeout_s: float,
    action: str = PEER_SPAN,
    headers: dict[str, str] | None = None,
    attempts: int = 1,
) -> PeerReply:
    """POST ``body`` to one peer's ``path``, bounded by ``timeout_s`` per attempt; never raises for the peer.

    Args:
        attempts: tries in all; a try that failed fast (connection refused or shed at accept, HTTP
            429/503) is retried after a jittered backoff (a coordinator that 1,000 hosts report to
            at once sheds the excess at accept); a timeout never is.

    Returns:
        The :class:`PeerReply`: its result's attributes name the peer (``servewatch.peer.address``,
        ``server.address``, ``server.port``), the answering host (``servewatch.peer.host.name``),
        its status and trace id, whether the answer was verified
        (``servewatch.peer.verified``), the error kind (``servewatch.peer.error``; of a timeout:
        ``timeout`` when the request was sent and no answer came in time, ``connect_timeout`` when
        no connection was made within the bound, so the peer never got it), the latency and the
        attempts.
    """
    reply = await _call_once(peer, path, body, credentials=credentials, timeout_s=timeout_s, action=action, headers=headers)
    backoff = Backoff(0.1, 6.4, jitter=0.5)  # 0.05-0.15 s, doubling
    for attempt in range(1, attempts):
        attrs = reply.result.attributes
        latency = attrs.get("servewatch.peer.latency_s")
        fast = isinstance(latency, (int, float)) and latency < QUICK_FAILURE_S
        shed = attrs.get("http.response.status_code") in (429, 503) or (reply.result.outcome is Outcome.FAILED and fast)
        if not shed:
            break
        await anyio.sleep(backoff.next_delay_s())
        reply = await _call_once(peer, path, body, credentials=credentials, timeout_s=timeout_s, action=action, headers=headers)
        reply = PeerReply(replace(reply.result, attributes=frozen_attrs({**reply.result.attributes, "servewatch.peer.attempts": attempt + 1})),
                          reply.doc, reply.verified)
    return reply


async def _call_once(
    peer: Peer,
    path: str,
    body: dict[str, Any],
    *,
    credentials: PeerCredentials,
    timeout_s: float,
    action: str,
    headers: dict[str, str] | None,
) -> PeerReply:
    start = now_ns()
    t0 = time.monotonic()
    attributes: dict[str, Any] = {"servewatch.peer.address": peer.url, "server.address": peer.host, "server.port": peer.port}
    doc: dict[str, Any] | None = None
    verified = False
    outcome, detail, retryable = Outcome.OK, "", False
    refusal = credentials.refusal(peer)
    nonce = new_nonce()
    sent: list[bool] = []
    with anyio.move_on_after(timeout_s) as scope:
        if refusal:
            outcome, detail = Outcome.REFUSED, refusal
            attributes["servewatch.peer.error"] = "insecure"
        else:
            try:
                answer = await post_json(
                    peer.host, peer.port, path, body, headers={**credentials.headers(peer, nonce), **(headers or {})},
                    ssl_context=credentials.ssl_context if peer.scheme == "https" else None,
                    sign=credentials.signer(peer, "POST", path), local_host=credentials.source(peer),
                    on_sent=lambda: sent.append(True),
                )
            except PeerRequestError as exc:
                outcome, detail, retryable = Outcome.FAILED, f"{peer} {exc.kind.replace('_', ' ')}: {exc}", True
                attributes["servewatch.peer.error"] = exc.kind
                if exc.refused:  # a host answered there and refused: no agent listens (not a partition)
                    attributes["servewatch.peer.refused"] = True
            else:
                doc = answer.doc
                verified = credentials.verified(peer, answer, nonce)
                outcome, detail, retryable = _answered(peer, answer, verified, attributes)
    if scope.cancelled_caught and sent:
        outcome, detail, retryable = Outcome.TIMED_OUT, f"{peer} did not answer within {timeout_s:g} s", True
        attributes["servewatch.peer.error"] = "timeout"
    elif scope.cancelled_caught:  # it never got the request: no connection (a dead host, a partition)
        outcome, detail, retryable = Outcome.TIMED_OUT, f"{peer} accepted no connection within {timeout_s:g} s", True
        attributes["servewatch.peer.error"] = "connect_timeout"
    attributes["servewatch.peer.latency_s"] = round(time.monotonic() - t0, 6)
    result = ActionResult(action=action, outcome=outcome, retryable=retryable, detail=detail,
                          start_time_unix_nano=start, end_time_unix_nano=now_ns(), attributes=frozen_attrs(attributes))
    return PeerReply(result, doc, verified)


def _answered(peer: Peer, answer: PeerAnswer, verified: bool, attributes: dict[str, Any]) -> tuple[Outcome, str, bool]:
    """The outcome, detail and retryability of ``peer``'s answer; what it says goes into ``attributes``."""
    doc = answer.doc
    attributes["http.response.status_code"] = answer.status
    attributes["servewatch.peer.verified"] = verified
    if answer.status >= 400:
        why = (doc or {}).get("error") or answer.reason
        attributes["servewatch.peer.error"] = "refused"
        return (Outcome.REFUSED, f"{peer} refused: HTTP {answer.status} {why}",
                answer.status in (408, 429) or answer.status >= 500)
    if doc is None:
        return Outcome.OK, "", False
    for key, attr in (("host.name", "servewatch.peer.host.name"), ("incident_id", "servewatch.peer.incident.id"),
                      ("status", "servewatch.peer.status"), ("trace_id", "servewatch.peer.trace_id")):
        if isinstance(doc.get(key), str):
            attributes[attr] = doc[key]
    ranks = doc.get("ranks")
    if isinstance(ranks, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        attributes["servewatch.peer.ranks"] = tuple(ranks)
    detail = f"{doc.get('host.name', peer)}: {doc.get('status', 'accepted')}"
    if not verified:
        detail += " (answer not verified)"
    return Outcome.OK, detail, False
