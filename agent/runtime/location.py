"""Where a read-only command (``status``, ``timeline``, ``report``) reads: the data dir and host
name, without the full settings model.

The full settings (:func:`agent.runtime.settings.load_settings`) assemble every registered component's
table, which imports the components (incidents, verdict, SDK client, pydantic-settings): seconds
on a loaded host for a command that needs two values. :func:`read_only_location` resolves those
two by the same precedence (``--data-dir`` > ``SERVEWATCH_DATA_DIR`` > default; ``SERVEWATCH_HOST_NAME``
> this machine's name) when nothing else could matter: no ``--config`` file and no other
``SERVEWATCH_*`` variable (whose typo the full settings would warn about); otherwise it returns
``None`` and the caller loads the full settings. Imports the standard library,
:mod:`agent.model.datadir` and :mod:`agent.host.security` only.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from agent.model.datadir import DataDir

__all__ = ["DEFAULT_DATA_DIR", "ENV_DATA_DIR", "ENV_HOST_NAME", "ENV_PREFIX", "Location", "read_only_location"]

#: Prefix of servewatch's environment variables.
ENV_PREFIX = "SERVEWATCH_"
#: Folder for incident bundles and embedded-default span files (default ``./servewatch-data``).
ENV_DATA_DIR = "SERVEWATCH_DATA_DIR"
#: ``host.name`` on spans and the bundle folder's host component (default: this machine's name).
ENV_HOST_NAME = "SERVEWATCH_HOST_NAME"
#: ``data_dir``'s default.
DEFAULT_DATA_DIR = Path("servewatch-data")

#: Variables that change nothing a read-only command reads, or only where it reads: the SDK's
#: shared-memory folder is the server side's.
_LOCATION_ENV = frozenset({ENV_DATA_DIR, ENV_HOST_NAME, "SERVEWATCH_SHM_DIR"})


class Location(NamedTuple):
    """The two settings a read-only command needs."""

    #: ``data_dir``
    data_dir: Path
    #: ``host_name`` (one path component)
    host_name: str

    @property
    def layout(self) -> DataDir:
        """Every path under ``data_dir`` for ``host_name``, as the full settings' ``layout``."""
        return DataDir(self.data_dir, self.host_name)


def read_only_location(data_dir: Path | None, config: Path | None,
                       environ: Mapping[str, str] | None = None) -> Location | None:
    """``data_dir`` and ``host_name`` as the full settings would resolve them, or ``None`` when
    only the full settings can say (a ``--config`` file, another ``SERVEWATCH_*`` variable, a
    host name that is no folder name: the full settings name the problem)."""
    from agent.host.security import validate_host_name

    env = os.environ if environ is None else environ
    named = {k.upper(): v for k, v in env.items() if k.upper().startswith(ENV_PREFIX)}
    if config is not None or set(named) - _LOCATION_ENV:
        return None
    host_name = named.get(ENV_HOST_NAME, socket.gethostname())
    try:
        validate_host_name(host_name)
    except ValueError:
        return None
    folder = data_dir if data_dir is not None else Path(named.get(ENV_DATA_DIR, str(DEFAULT_DATA_DIR)))
    return Location(data_dir=folder, host_name=host_name)
