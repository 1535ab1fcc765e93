"""The job's peers: who they are (static list, DNS name) and asking them to capture.

Owns :class:`Peer`, :func:`parse_peer`, :class:`PeerResolver` (static peers plus every address a
DNS name resolves to, e.g. a Kubernetes headless service; this agent's own address is skipped) and
:func:`ask_peer` (one ``POST /v1/incidents`` with the trace context, bounded, its outcome sorted
into our terms: ``ok``, ``refused`` (HTTP 4xx/5xx), ``timed_out`` (slow), ``failed`` (unreachable,
or not answering HTTP)).

Imports anyio, psutil, :mod:`agent.fleet.client`, :mod:`agent.events` and :mod:`agent.fleet.traceparent`.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio
import psutil

from agent.events import Action, ActionResult, Outcome, frozen_attrs, now_ns
from agent.fleet.client import PeerRequestError, post_json
from agent.fleet.traceparent import TraceParent

__all__ = ["PEER_SPAN", "RESOLVE_SPAN", "Peer", "PeerResolver", "ask_peer", "local_addresses", "parse_peer"]

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
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

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


class PeerResolver:
    """The peers to ask at each incident.

    Args:
        static: peer specs (``host:port``...).
        dns_name: ``name[:port]`` resolving to every peer (resolved at each call, so pods that
            came or went are seen), or ``None``.
        own_port: this agent's API port (an address of this machine on this port is us).
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
        default_port: int,
        scheme: str = "http",
        timeout_s: float = 2.0,
    ) -> None:
        self.static = [parse_peer(s, default_port=default_port, scheme=scheme) for s in static]
        self.dns_name = dns_name
        self.own_port = own_port
        self.default_port = default_port
        self.scheme = scheme
        self.timeout_s = timeout_s
        self._local = local_addresses()
        #: peers found to be this agent (it answered with our own agent id)
        self.self_peers: set[Peer] = set()

    def is_self(self, peer: Peer) -> bool:
        if peer in self.self_peers:
            return True
        return peer.port == self.own_port and (peer.host in self._local or peer.host == "localhost")

    async def resolve(self) -> tuple[list[Peer], list[ActionResult]]:
        """Peers to ask now, and a failed ``peer.resolve`` result when the DNS name did not resolve."""
        peers = [p for p in self.static if not self.is_self(p)]
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
                if peer not in seen and not self.is_self(peer):
                    seen.add(peer)
                    peers.append(peer)
            if error:
                problems.append(
                    ActionResult(action=RESOLVE_SPAN, outcome=Outcome.TIMED_OUT if scope.cancelled_caught else Outcome.FAILED,
                                 retryable=True, detail=error, start_time_unix_nano=start, end_time_unix_nano=now_ns(),
                                 attributes=frozen_attrs({"servewatch.peer.dns_name": self.dns_name}))
                )
        return peers, problems


async def ask_peer(
    peer: Peer,
    *,
    traceparent: TraceParent,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[ActionResult, dict[str, Any] | None]:
    """Ask one peer to capture (``POST /v1/incidents``), bounded by ``timeout_s``.

    Returns:
        The ``peer.capture`` result (outcome: ``ok``; ``refused`` for an HTTP error answer;
        ``timed_out``; ``failed`` when unreachable or not answering HTTP) and the peer's JSON
        answer (``None`` if none).
    """
    start = now_ns()
    t0 = time.monotonic()
    attributes: dict[str, Any] = {"servewatch.peer.address": peer.url, "server.address": peer.host, "server.port": peer.port}
    answer: dict[str, Any] | None = None
    outcome, detail, retryable = Outcome.OK, "", False
    with anyio.move_on_after(timeout_s) as scope:
        try:
            status, reason, answer = await post_json(
                peer.host, peer.port, "/v1/incidents", body, headers={**headers, "traceparent": traceparent.header()},
                ssl_context=ssl_context if peer.scheme == "https" else None,
            )
        except PeerRequestError as exc:
            outcome, detail, retryable = Outcome.FAILED, f"{peer} {exc.kind.replace('_', ' ')}: {exc}", True
            attributes["servewatch.peer.error"] = exc.kind
        else:
            attributes["http.response.status_code"] = status
            if status >= 400:
                why = (answer or {}).get("error") or reason
                outcome, detail = Outcome.REFUSED, f"{peer} refused: HTTP {status} {why}"
                retryable = status in (408, 429) or status >= 500
                attributes["servewatch.peer.error"] = "refused"
            elif answer is not None:
                for key, attr in (("host.name", "servewatch.peer.host.name"), ("incident_id", "servewatch.peer.incident.id"),
                                  ("status", "servewatch.peer.status"), ("trace_id", "servewatch.peer.trace_id")):
                    if isinstance(answer.get(key), str):
                        attributes[attr] = answer[key]
                ranks = answer.get("ranks")
                if isinstance(ranks, list) and all(isinstance(r, str) for r in ranks):
                    attributes["servewatch.peer.ranks"] = tuple(ranks)
                detail = f"{answer.get('host.name', peer)}: {answer.get('status', 'accepted')}"
    if scope.cancelled_caught:
        outcome, detail, retryable = Outcome.TIMED_OUT, f"{peer} did not answer within {timeout_s:g} s", True
        attributes["servewatch.peer.error"] = "timeout"
    attributes["servewatch.peer.latency_s"] = round(time.monotonic() - t0, 6)
    result = ActionResult(action=PEER_SPAN, outcome=outcome, retryable=retryable, detail=detail,
                          start_time_unix_nano=start, end_time_unix_nano=now_ns(), attributes=frozen_attrs(attributes))
    return result, answer
