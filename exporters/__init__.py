"""The OTel side of servewatch: it mirrors what happened and decides nothing.

Owns :class:`Exporter`, the contract of a registered exporter, and :data:`EXPORTERS`, the exporter
registry (:mod:`agent.host.registry`): one line per exporter below. An exporter mirrors bus
events (``events`` and ``handle``: the runtime feeds it, :mod:`exporters.mirror.feed`); it is built
when the agent starts running or dumping (``BuildContext.stage`` ``start``, with
``BuildContext.telemetry`` to attach to) and its factory returns ``None`` at the ``build`` stage,
or when the settings turn it off. The telemetry pipeline (:mod:`exporters.otlp.provider`, table
``[export]``) and the SDK span shipper (:mod:`exporters.otlp.shipper`, table ``[spans]``) are no
registered exporters: the agent always has them and builds them itself
(:class:`agent.runtime.agent.Agent`). Importing this package imports no exporter, and no registry
until :data:`EXPORTERS` is first used.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from agent.host.registry import Registry
    from agent.model.events import Event

    #: The exporter registry: name -> (settings model, factory), built in this order.
    EXPORTERS: Registry[Exporter]

__all__ = ["EXPORTERS", "Exporter"]

_MADE = threading.Lock()


@runtime_checkable
class Exporter(Protocol):
    """What a registered exporter's factory returns (the span ``mirror``; a plugin's journal):
    the runtime subscribes it to its ``events`` on the bus and hands it each one; the registry
    refuses anything else (:meth:`agent.host.registry.Factory.create`).

    Optional: ``handles_on_loop = True`` (``handle`` touches loop-bound state, so it runs on the
    event loop) and ``close_open(reason=...)`` (called once after the last event, when the feed
    ends: the span mirror gives incidents left open their root span).
    """

    @property
    def events(self) -> Sequence[type[Event]]:
        """The event types it mirrors (subclasses included); empty: it is not fed."""
        ...

    def handle(self, event: Event) -> None:
        """Mirror one event; called in bus order, one at a time, off the event loop by default."""
        ...


def _exporters() -> Registry[Exporter]:
    from agent.host.registry import Registry

    registry: Registry[Exporter] = Registry("exporter", contract=Exporter)
    registry.register("mirror", factory="exporters.mirror.mirror:create")
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
