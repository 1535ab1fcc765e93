"""Who speaks for a host: a request's sender, the port it stands for, and the host names it proved.

Owns :class:`Senders`: the sender checks of the job's API (:class:`~agent.fleet.api.Sender`: the
address a request came from and the port its signature names, which must be a port the member
list gives that address), whether a sender is a given member (a name resolved), and the claims of
host names per job incident (the first identity to prove a host name keeps it; a conflict is
logged, counted in :attr:`FleetState.identity_conflicts` and said in the job verdict). Used by
every part that takes or answers a message (:mod:`agent.fleet.announce`,
:mod:`agent.fleet.coordinator`, :mod:`agent.fleet.intake`, :mod:`agent.fleet.member`,
:mod:`agent.fleet.backend`).

Imports anyio, :mod:`agent.fleet.fleetstate` and the fleet's API, message, peer and job state types.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any

import anyio

from agent.fleet.api import Sender
from agent.fleet.fleetstate import FleetState, is_ip_literal, same_ip
from agent.fleet.jobstate import JobIncident
from agent.fleet.messages import Announce, Report
from agent.fleet.peers import Peer

__all__ = ["Senders"]

log = logging.getLogger("servewatch.fleet")


class Senders:
    """Sender identity checks and host-name claims, on ``state``."""

    def __init__(self, state: FleetState) -> None:
        self.state = state

    def claim(self, job: JobIncident, host: str, sender: Sender, what: str, *, asked: bool = False) -> str:
        """``""`` when ``sender`` may speak for ``host`` in ``job`` (the first identity to prove a
        host name keeps it; this agent's own name is its own), else the conflict (logged, counted,
        said in the job verdict and the status). A sender whose request names no port (mutual TLS
        without a token) is the host proven at its address. ``asked``: the verified answer of the
        listed member this agent asked (``sender``: the address and port it called): it proves the
        host name there even against an earlier claim (:meth:`JobIncident.prove`)."""
        state = self.state
        job.prove(state.host_name, "this agent")
        identity = sender.identity
        known = job.proven.get(host)
        if sender.port is None and known is not None and same_ip(known.rpartition(":")[0], sender.address):
            identity = known
        conflicts = job.conflicts_total
        line = job.prove(host, identity, what, asked=asked)
        if line or job.conflicts_total > conflicts:
            state.identity_conflicts += 1
            log.warning("job %s: %s", state.config.job, line or job.conflicts[-1])
        return line

    def static_ports(self, address: str) -> set[int]:
        """The ports the static member list gives ``address`` (IP literals)."""
        resolver = self.state.resolver
        static = resolver.static if resolver is not None else []
        return {p.port for p in static if is_ip_literal(p.host) and same_ip(p.host, address)}

    async def refusal(self, sender: Sender) -> str:
        """Why a signed request from ``sender`` is refused, ``""`` when it is not: the port its
        signature names must be one the member list gives its address (else, an address it does
        not list by IP, the job's API port, or the port of a member listed by a name that resolves
        there; no member list at all: any port). One address is then one identity per listed agent,
        not one per port it may name. The member list's DNS name is resolved only when the static
        list does not settle it."""
        resolver = self.state.resolver
        if sender.port is None or resolver is None or sender.address.startswith("unix:"):
            return ""
        if not resolver.static and not resolver.dns_name:
            return ""  # no member list: nothing names an address's port
        ports = self.static_ports(sender.address)
        if self._port_listed(sender, ports):
            return ""
        members, _ = await resolver.resolve_all()
        ports |= {p.port for p in members if is_ip_literal(p.host) and same_ip(p.host, sender.address)}
        if self._port_listed(sender, ports) or await self._named_member_at(members, sender):
            return ""
        allowed = ", ".join(str(p) for p in sorted(ports or {resolver.default_port}))
        return (f"unauthorized: signed as the agent at {sender.identity}, but the job's agent at {sender.address} listens"
                f" on port {allowed}: a signature naming another port is never accepted (one address, one identity)")

    def _port_listed(self, sender: Sender, ports: set[int]) -> bool:
        """Whether ``sender``'s port is one of ``ports`` (none: the job's API port)."""
        assert self.state.resolver is not None
        return sender.port in ports or (not ports and sender.port == self.state.resolver.default_port)

    async def _named_member_at(self, members: Sequence[Peer], sender: Sender) -> bool:
        """Whether a member listed by a name at ``sender``'s port resolves to ``sender``'s address."""
        for peer in members:
            if not is_ip_literal(peer.host) and peer.port == sender.port and await self.at(peer, sender):
                return True
        return False

    def identity(self, sender: Sender) -> Sender:
        """``sender`` with the port it stands for when its request named none (a ``v1`` signature,
        a bearer token, mutual TLS alone): the one port the static member list gives its address,
        else (none listed) the job's API port; several listed ports: its address alone."""
        resolver = self.state.resolver
        if sender.port is not None or resolver is None or sender.address.startswith("unix:"):
            return sender
        ports = self.static_ports(sender.address)
        if len(ports) > 1:
            return sender
        return Sender(sender.address, ports.pop() if ports else resolver.default_port)

    async def at(self, peer: Peer, sender: Sender) -> bool:
        """Whether ``sender`` (its address, and its signed port when it names one) is ``peer``: a
        name is resolved (bounded by ``peer_timeout_s``)."""
        if sender.port is not None and sender.port != peer.port:
            return False
        if is_ip_literal(peer.host):
            return same_ip(peer.host, sender.address)
        infos: list[Any] = []
        with anyio.move_on_after(self.state.config.peer_timeout_s):
            try:
                infos = await anyio.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
            except OSError:
                infos = []
        return any(same_ip(str(info[4][0]).split("%")[0], sender.address) for info in infos)

    async def peer_of(self, message: Announce | Report, sender: Sender) -> Peer:
        """Who sent ``message``: its entry in our own member list when it names one we list and
        it came from there, else the address it called from at its API port."""
        resolver = self.state.resolver
        if message.address and resolver is not None:
            members, _ = await resolver.resolve_all()
            listed = next((p for p in members if p.url == message.address), None)
            if listed is not None and await self.at(listed, sender):
                return listed
        return Peer(sender.address, message.api_port, message.scheme)
