"""An exporter added to servewatch by this module and one registration line (:func:`register`), as
a newcomer adds one: nothing in ``agent/`` or ``exporters/`` names it.

``journal`` writes one JSON line per incident opened and closed (``IncidentOpened``,
``IncidentClosed``) to a file of its own: an :class:`exporters.Exporter` (``events`` and
``handle``; its factory says so, so mypy checks it), built at the ``start`` stage from its own
settings table ``[journal]`` (``SERVEWATCH_JOURNAL__*``). Used by tests/test_extension_points.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from pydantic import BaseModel, Field

from agent.host.registry import BuildContext
from agent.model.events import Event, IncidentClosed, IncidentOpened
from exporters import EXPORTERS, Exporter

NAME = "journal"


class JournalConfig(BaseModel):
    """Settings of the ``journal`` exporter (table ``[journal]``)."""

    path: Path | None = Field(None, description="the JSON-lines file written; unset: no journal")


class Journal:
    """One JSON line per incident event: ``{"event": "IncidentOpened", "incident_id": ...}``."""

    events = (IncidentOpened, IncidentClosed)

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def handle(self, event: Event) -> None:
        assert isinstance(event, IncidentOpened | IncidentClosed)
        line = {"event": type(event).__name__, "incident_id": event.incident_id, "trigger": event.trigger,
                "time_unix_nano": event.time_unix_nano}
        with self._lock, self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")


def create(config: JournalConfig, ctx: BuildContext) -> Exporter | None:
    """Registry factory: a journal at the ``start`` stage when a path is set."""
    if ctx.stage != "start" or config.path is None:
        return None
    return Journal(config.path)


def register() -> None:
    """The one registration line."""
    EXPORTERS.register(NAME, config="tests.plugin_journal:JournalConfig", factory="tests.plugin_journal:create")
