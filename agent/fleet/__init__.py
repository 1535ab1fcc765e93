"""Fleet: the agent HTTP API and a job's peers (one incident, one trace across every host).

Modules: :mod:`~agent.fleet.config` (settings, token file, TLS), :mod:`~agent.fleet.http` (h11
server on anyio), :mod:`~agent.fleet.api` (routes, auth, rate limit),
:mod:`~agent.fleet.traceparent` (W3C trace context), :mod:`~agent.fleet.peers` (who the peers
are, asking one), :mod:`~agent.fleet.job` (the coordinator: fan-out, joins, deduplication).
Nothing here imports a watcher or an actor; :mod:`agent.runtime` starts :class:`Fleet`.
"""

from agent.fleet.config import ApiConfig, FleetConfig
from agent.fleet.job import Fleet
from agent.fleet.traceparent import TraceParent

__all__ = ["ApiConfig", "Fleet", "FleetConfig", "TraceParent"]
