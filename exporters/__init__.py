"""The OTel side of servewatch: it mirrors what happened and decides nothing.

Owns :data:`EXPORTERS`, the exporter registry (:mod:`agent.registry`): one line per exporter
below. Exporters are built in two stages (``BuildContext.stage``): with the agent (``build``: the
watcher status board) and when it starts running or dumping (``start``: the telemetry pipeline
``otlp`` first, then what attaches to it); a factory returns ``None`` at the stage that is not its
own, or when the settings turn it off. Importing this package imports no exporter.
"""

from __future__ import annotations

from typing import Any

from agent.registry import Registry

__all__ = ["EXPORTERS"]

#: The exporter registry: name -> (settings model, factory), built in this order.
EXPORTERS: Registry[Any] = Registry("exporter")
EXPORTERS.register("status", factory="agent.watchers.status:create_board")
EXPORTERS.register("otlp", config="exporters.config:ExportConfig", table="export", factory="exporters.provider:create")
EXPORTERS.register("mirror", factory="exporters.mirror:create")
EXPORTERS.register("span_shipper", config="exporters.config:SpansConfig", table="spans", factory="exporters.shipper:create")
