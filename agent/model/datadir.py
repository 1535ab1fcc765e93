"""The data dir's layout: every path servewatch keeps under ``data_dir``, built in one place.

Owns :class:`DataDir` (constructed from the data dir and the host name: ``DataDir(data_dir,
host_name)``; components get it as ``ctx.agent.layout``, :attr:`agent.host.registry.AgentValues.layout`)
and the names of the files and folders in it. Nothing else in ``agent/`` or ``exporters/`` joins
the data dir with a host name or one of these names (``tests/test_datadir.py`` reads the source).
The layout is what users' data dirs and the other servewatch processes on the host already hold,
so a path here never changes::

    <data_dir>/
      <host_name>/                 host            this host's folder (one per host: data dirs may be shared)
        <incident_id>/             incident(id)    an incident's bundle (manifest.json, stacks, ...)
        status.json                status_file     the agent's status, rewritten on every change
        agents/<pid>.json          agents          presence files of the agents running on this data dir
        own-actions/<token>.json   own_actions     what servewatch itself is doing to a process (bounded)
        spans/                     spans           OTLP/JSON span files (no collector configured)
        spool/                     spool           spans a collector did not take yet (``pid-<pid>/``,
                                                   ``rejected/`` inside)
        spool/metrics/             metrics_spool   servewatch's own metrics a collector did not take yet
        metrics/                   metrics         servewatch's own metrics as files (no collector)
      launched/                    launches        what ``servewatch launch`` armed each server with
      cuda_coredumps/              cuda_coredumps  ``coredump.folder``'s default (the driver adds ``<host>/``)
      fleet/nonces-<host>          fleet_nonces    the fleet API's nonce cache (in ``fleet/``: ``fleet``)
      <host_name>.api.sock         fleet_api_socket ``api.unix_socket = "auto"``
      export-ledger.json           export_ledger   what the collector acknowledged of the span files
      trace-imports/               trace_imports   the torch trace importer's ledger

Imports the standard library only (pure path arithmetic: nothing is created or read here).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "AGENTS_DIR",
    "API_SOCKET_SUFFIX",
    "CUDA_COREDUMPS_DIR",
    "EXPORT_LEDGER_FILE",
    "FLEET_DIR",
    "LAUNCH_RECORD_DIR",
    "METRICS_DIR",
    "METRICS_SPOOL_DIR",
    "NONCES_PREFIX",
    "OWN_ACTIONS_DIR",
    "SPANS_DIR",
    "SPOOL_DIR",
    "STATUS_FILE",
    "TRACE_IMPORTS_DIR",
    "DataDir",
]

# --- under <data_dir>/<host_name>/ ---------------------------------------------------------------
#: The agent's status file (:mod:`agent.watchers.status`).
STATUS_FILE = "status.json"
#: The folder of presence files, one per running agent (:mod:`agent.host.agentfiles`).
AGENTS_DIR = "agents"
#: The folder of own-action files (:mod:`agent.host.ownactions`).
OWN_ACTIONS_DIR = "own-actions"
#: The embedded default's span files (no collector configured: :mod:`exporters.otlp.provider`).
SPANS_DIR = "spans"
#: The span spool (:mod:`exporters.otlp.spool`).
SPOOL_DIR = "spool"
#: The metrics sub-spool, inside a span spool folder (``spool/metrics``, ``spool/pid-<pid>/metrics``).
METRICS_SPOOL_DIR = "metrics"
#: servewatch's own metrics as files (no collector for metrics).
METRICS_DIR = "metrics"

# --- under <data_dir>/ -----------------------------------------------------------------------------
#: What ``servewatch launch`` armed each server with (:mod:`agent.actors.coredump_target`).
LAUNCH_RECORD_DIR = "launched"
#: ``coredump.folder``'s default.
CUDA_COREDUMPS_DIR = "cuda_coredumps"
#: The fleet's files (the API's nonce caches).
FLEET_DIR = "fleet"
#: Name prefix of a host's nonce cache in :data:`FLEET_DIR`.
NONCES_PREFIX = "nonces-"
#: Name suffix of the operator's unix socket (``<host_name>.api.sock``, ``api.unix_socket = "auto"``).
API_SOCKET_SUFFIX = ".api.sock"
#: The export ledger of the span files (:mod:`exporters.otlp.replay`).
EXPORT_LEDGER_FILE = "export-ledger.json"
#: The torch trace importer's ledger folder (:mod:`exporters.mirror.trace_imports`).
TRACE_IMPORTS_DIR = "trace-imports"


def _file_name_part(name: str) -> str:
    """``name`` as one file name component (letters, digits, ``._-``; at most 100)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100].lstrip(".") or "agent"


@dataclass(frozen=True, slots=True)
class DataDir:
    """Every path under one data dir, for one host (see the module docstring for the tree).

    Args:
        root: the data dir (``data_dir``: ``--data-dir``, ``SERVEWATCH_DATA_DIR``); a ``str`` or
            path-like is made a :class:`~pathlib.Path` (never resolved: paths stay as given).
        host_name: the host's folder in it (``host_name``: ``host.name`` on spans; the settings
            check it is one path component).
    """

    root: Path
    host_name: str

    def __post_init__(self) -> None:
        if not isinstance(self.root, Path):
            object.__setattr__(self, "root", Path(os.fspath(self.root)))

    # --- this host's folder ------------------------------------------------------------------------

    @property
    def host(self) -> Path:
        """``<data_dir>/<host_name>``: this host's folder (bundles, status, spans, spool...)."""
        return self.root / self.host_name

    def incident(self, incident_id: str) -> Path:
        """``<data_dir>/<host_name>/<incident_id>``: one incident's bundle folder."""
        return self.host / incident_id

    @property
    def status_file(self) -> Path:
        """``<data_dir>/<host_name>/status.json``: the agent's status, rewritten on every change."""
        return self.host / STATUS_FILE

    @property
    def agents(self) -> Path:
        """``<data_dir>/<host_name>/agents``: one presence file (``<pid>.json``) per running agent."""
        return self.host / AGENTS_DIR

    @property
    def own_actions(self) -> Path:
        """``<data_dir>/<host_name>/own-actions``: one file per action servewatch is taking on a process."""
        return self.host / OWN_ACTIONS_DIR

    @property
    def spans(self) -> Path:
        """``<data_dir>/<host_name>/spans``: OTLP/JSON span files, when no collector is configured."""
        return self.host / SPANS_DIR

    @property
    def spool(self) -> Path:
        """``<data_dir>/<host_name>/spool``: the span spool's root (spans a collector did not take yet)."""
        return self.host / SPOOL_DIR

    @property
    def metrics_spool(self) -> Path:
        """``<data_dir>/<host_name>/spool/metrics``: servewatch's own metrics a collector did not take
        yet (when the span spool claimed a ``pid-<pid>/`` folder, the sub-spool is in that one)."""
        return self.spool / METRICS_SPOOL_DIR

    @property
    def metrics(self) -> Path:
        """``<data_dir>/<host_name>/metrics``: servewatch's own metrics as files (no metrics collector)."""
        return self.host / METRICS_DIR

    # --- beside the host folders -------------------------------------------------------------------

    @property
    def launches(self) -> Path:
        """``<data_dir>/launched``: what ``servewatch launch`` armed each server with (``<pid>-<start>.json``)."""
        return self.root / LAUNCH_RECORD_DIR

    @property
    def cuda_coredumps(self) -> Path:
        """``<data_dir>/cuda_coredumps``: ``coredump.folder``'s default (the driver writes to ``<host>/`` in it)."""
        return self.root / CUDA_COREDUMPS_DIR

    @property
    def fleet(self) -> Path:
        """``<data_dir>/fleet``: the fleet API's files."""
        return self.root / FLEET_DIR

    @property
    def fleet_nonces(self) -> Path:
        """``<data_dir>/fleet/nonces-<host_name>``: the fleet API's nonce cache (the host name made a
        safe file name: letters, digits, ``._-``)."""
        return self.fleet / f"{NONCES_PREFIX}{_file_name_part(self.host_name)}"

    @property
    def fleet_api_socket(self) -> Path:
        """``<data_dir>/<host_name>.api.sock``: the operator's unix socket of ``api.unix_socket = "auto"``."""
        return self.root / f"{self.host_name}{API_SOCKET_SUFFIX}"

    @property
    def export_ledger(self) -> Path:
        """``<data_dir>/export-ledger.json``: what the collector acknowledged of this data dir's span files."""
        return self.ledger_beside(self.root)

    @property
    def trace_imports(self) -> Path:
        """``<data_dir>/trace-imports``: the torch trace importer's ledger folder."""
        return self.root / TRACE_IMPORTS_DIR

    @staticmethod
    def ledger_beside(folder: str | os.PathLike[str]) -> Path:
        """``<folder>/export-ledger.json``: the export ledger of ``folder`` (a data dir's, or the one
        of span files copied out of a data dir, kept beside them)."""
        return Path(folder) / EXPORT_LEDGER_FILE
