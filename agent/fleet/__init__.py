"""Fleet: the agent HTTP API and a job's agents (one incident, one trace, one verdict across every host).

Modules: :mod:`~agent.fleet.config` (settings, token file, TLS), :mod:`~agent.fleet.http` (h11
server on anyio), :mod:`~agent.fleet.api` (routes, auth, rate limit),
:mod:`~agent.fleet.proof` (signed requests, proven answers), :mod:`~agent.fleet.traceparent`
(W3C trace context), :mod:`~agent.fleet.peers` (who the peers are, asking one),
:mod:`~agent.fleet.identity` (a job incident's trace from the stuck collective),
:mod:`~agent.fleet.messages` (the job routes' bodies), :mod:`~agent.fleet.fanout` (bounded,
tree-shaped), :mod:`~agent.fleet.host_summary` (a host's compact evidence summary),
:mod:`~agent.fleet.jobverdict` (the job's verdict), :mod:`~agent.fleet.jobstate` and
:mod:`~agent.fleet.job` (the protocol's facade, :class:`Fleet`; its parts, on one
:mod:`~agent.fleet.fleetstate`: :mod:`~agent.fleet.senders`, :mod:`~agent.fleet.announce`,
:mod:`~agent.fleet.coordinator`, :mod:`~agent.fleet.intake`, :mod:`~agent.fleet.member`,
:mod:`~agent.fleet.contributions`, :mod:`~agent.fleet.backend`, :mod:`~agent.fleet.bundles`).
Nothing here imports a watcher or an actor; :mod:`agent.runtime.agent` starts :class:`Fleet`.
"""

from typing import Any

from agent.fleet.config import ApiConfig, FleetConfig


def __getattr__(name: str) -> Any:
    # the coordinator (h11, anyio, peers) loads on first use: settings alone stay a light import
    if name == "Fleet":
        from agent.fleet.job import Fleet

        return Fleet
    if name == "TraceParent":
        from agent.fleet.traceparent import TraceParent

        return TraceParent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ApiConfig", "Fleet", "FleetConfig", "TraceParent"]
