"""Reading this host's incident bundles for the API: the listing and one manifest.

Owns :class:`BundleReader` (``GET /v1/incidents`` and ``GET /v1/incidents/{id}``: manifests read
from this host's folder of the data dir, :class:`~agent.model.datadir.DataDir`, without following
symlinks, bounded in count and size, on a worker thread) and :func:`incident_doc` (an opened
incident as the API answers it).

Imports anyio, :mod:`agent.fleet.fleetstate`, :mod:`agent.fleet.api` (the incident id pattern),
:mod:`agent.host.manifest` and :mod:`agent.model.events`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import anyio

from agent.fleet.api import INCIDENT_ID_PATTERN
from agent.fleet.fleetstate import FleetState
from agent.host.manifest import MANIFEST_NAME, ManifestError, parse_manifest
from agent.model.events import IncidentOpened

__all__ = ["MAX_LISTED", "MAX_MANIFEST_BYTES", "BundleReader", "incident_doc"]

log = logging.getLogger("servewatch.fleet")

#: Most incidents listed by ``GET /v1/incidents``.
MAX_LISTED = 200
#: Largest manifest served, bytes.
MAX_MANIFEST_BYTES = 4 * 1024 * 1024


class BundleReader:
    """This host's incidents as the API lists and serves them, on ``state``."""

    def __init__(self, state: FleetState) -> None:
        self.state = state

    async def list_incidents(self) -> list[dict[str, Any]]:
        """``GET /v1/incidents``: this host's incidents, newest first (ids start with their UTC
        time); the open one first. Manifests are read on a worker thread."""
        state = self.state
        out = await anyio.to_thread.run_sync(self._read_listing)
        for current in state.agent.incidents.running.values():  # every server's open one, first
            if all(i["incident_id"] != current.opened.incident_id for i in out):
                out.insert(0, {**incident_doc(state.host_name, current.opened), "open": True})
        return out

    def _read_listing(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            entries = sorted((e.name for e in os.scandir(self.state.layout.host) if e.is_dir(follow_symlinks=False)
                              and INCIDENT_ID_PATTERN.fullmatch(e.name)), reverse=True)
        except OSError:
            entries = []
        for name in entries[:MAX_LISTED]:
            manifest = self._read_manifest(name)
            if manifest is None:
                continue
            out.append({key: manifest.get(key) for key in ("incident_id", "trigger", "detail", "host.name", "trace_id",
                                                            "parent_span_id", "opened_time_unix_nano", "closed_time_unix_nano")})
        return out

    async def get_incident(self, incident_id: str) -> dict[str, Any] | None:
        """``GET /v1/incidents/{id}``: the manifest (read without following symlinks) as
        :class:`agent.host.manifest.Manifest` validates it, or None (no such incident, too big, or not
        a manifest this agent reads)."""
        return await anyio.to_thread.run_sync(self._read_manifest, incident_id)

    def _read_manifest(self, incident_id: str) -> dict[str, Any] | None:
        if not INCIDENT_ID_PATTERN.fullmatch(incident_id):
            return None
        path = self.state.layout.host / incident_id / MANIFEST_NAME
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError:
            return None
        if len(data) > MAX_MANIFEST_BYTES:
            return None
        try:
            return parse_manifest(data, source=str(path)).to_json_dict()
        except ManifestError as exc:  # not a manifest this agent reads: not served (listings poll: no warning)
            log.debug("%s", exc)
            return None


def incident_doc(host_name: str, opened: IncidentOpened | None) -> dict[str, Any]:
    """``opened`` (``None``: none) as the API answers it, on the host ``host_name``."""
    if opened is None:
        return {"host.name": host_name, "incident_id": None}
    return {"host.name": host_name, "incident_id": opened.incident_id, "trigger": opened.trigger,
            "trace_id": opened.trace_id, "span_id": opened.span_id, "parent_span_id": opened.parent_span_id,
            "opened_time_unix_nano": opened.time_unix_nano}
