"""The OTel side of servewatch: it mirrors what happened and decides nothing.

Owns :data:`EXPORTERS`, the exporter registry (:mod:`agent.host.registry`): one line per exporter
below. Exporters are built in two stages (``BuildContext.stage``): with the agent (``build``: the
watcher status board) and when it starts running or dumping (``start``: the telemetry pipeline
``otlp`` first, then what attaches to it); a factory returns ``None`` at the stage that is not its
own, or when the settings turn it off. An exporter that mirrors bus events is a
:class:`exporters.mirror.feed.Mirror` (``events`` and ``handle``: the runtime feeds it). Importing
this package imports no exporter, and no registry until :data:`EXPORTERS` is first used.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.host.registry import Registry

    #: The exporter registry: name -> (settings model, factory), built in this order.
    EXPORTERS: Registry[Any]

__all__ = ["EXPORTERS"]

_MADE = threading.Lock()


def _exporters() -> Registry[Any]:
    from agent.host.registry import Registry

    registry: Registry[Any] = Registry("exporter")
    registry.register("status", factory="agent.watchers.status:create_board")
    registry.register("otlp", config="exporters.config:ExportConfig", table="export", factory="exporters.otlp.provider:create")
    registry.register("mirror", factory="exporters.mirror.mirror:create")
    registry.register("span_shipper", config="exporters.config:SpansConfig", table="spans", factory="exporters.otlp.shipper:create")
    return registry


def __getattr__(name: str) -> Any:
    """:data:`EXPORTERS`, made at its first use: reading a bundle (``servewatch timeline``,
    ``report``) imports ``agent.views.bundle`` and needs no registry (it cost them ~2 ms)."""
    if name == "EXPORTERS":
        with _MADE:  # made once: a plugin's registration must land in the one registry
            if "EXPORTERS" not in globals():
                globals()["EXPORTERS"] = _exporters()
        return globals()["EXPORTERS"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
