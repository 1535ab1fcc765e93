"""Modules imported, and regular expressions compiled, on first use, for a fast command-line cold start.

Owns :class:`LazyModule` and :func:`lazy_pattern`: ``grpc = LazyModule("grpc")`` at the top of a module reads like the
import it replaces, but ``grpc`` is imported only when an attribute is first read (a gRPC sender
is built, an ``except grpc.RpcError`` clause is evaluated). `servewatch --help`, ``cuda-env``,
``timeline`` and a ``dump`` to the embedded span files never pay for grpc or httpx.
:func:`lazy_pattern` is ``re.compile`` at first use (the ~24 patterns of :mod:`agent.host.security` and
:mod:`agent.model.stacks` cost every command importing them ~2 ms, matching or not).
:func:`mark_absent` spares a watching agent a ``sys.path`` search per HTTP request. Imports the
standard library only.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType
from typing import Any, cast

__all__ = ["LazyModule", "LazyPattern", "lazy_pattern", "mark_absent"]

#: Modules a library imports again and again, inside a ``try``, to learn whether they are
#: installed: httpcore asks ``import sniffio`` at every lock and event it sets up (several times
#: per HTTP request); without sniffio (anyio 4 no longer needs it) each ask searches ``sys.path``
#: again (~30 us).
PROBED_MODULES = ("sniffio",)


def mark_absent(names: tuple[str, ...] = PROBED_MODULES) -> list[str]:
    """Record each of ``names`` that is not installed as absent in ``sys.modules`` (``None``:
    ``import`` then raises ``ImportError`` at once, as it would after searching); returns those
    marked. A module that is installed is left alone."""
    import importlib.util
    import sys

    marked = []
    for name in names:
        if name in sys.modules:
            continue
        try:
            absent = importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            continue
        if absent:
            sys.modules[name] = None  # type: ignore[assignment]
            marked.append(name)
    return marked


class LazyModule:
    """A stand-in for module ``name`` that imports it at the first attribute access.

    Attribute writes and deletes go to the real module (so tests can monkeypatch through it).
    ``sys.modules`` holds ``name`` only once it was really imported.
    """

    __slots__ = ("_lazy_module", "_lazy_name")

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_lazy_name", name)
        object.__setattr__(self, "_lazy_module", None)

    def _load(self) -> ModuleType:
        module = object.__getattribute__(self, "_lazy_module")
        if module is None:
            module = importlib.import_module(object.__getattribute__(self, "_lazy_name"))
            object.__setattr__(self, "_lazy_module", module)
        return module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._load(), attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(self._load(), attr)

    def __repr__(self) -> str:
        name = object.__getattribute__(self, "_lazy_name")
        loaded = object.__getattribute__(self, "_lazy_module") is not None
        return f"<lazy module {name!r}{'' if loaded else ' (not imported yet)'}>"


class LazyPattern:
    """A regular expression compiled at its first use: every attribute (``sub``, ``match``,
    ``pattern``...) is the compiled :class:`re.Pattern`'s. Made by :func:`lazy_pattern`."""

    __slots__ = ("_compiled", "_flags", "_pattern")

    def __init__(self, pattern: str, flags: int = 0) -> None:
        self._pattern = pattern
        self._flags = flags
        self._compiled: re.Pattern[str] | None = None

    def __getattr__(self, attr: str) -> Any:
        compiled = self._compiled
        if compiled is None:  # two threads at once compile twice: the same pattern either way
            compiled = self._compiled = re.compile(self._pattern, self._flags)
        return getattr(compiled, attr)

    def __repr__(self) -> str:
        return f"lazy_pattern({self._pattern!r})"


def lazy_pattern(pattern: str, flags: int = 0) -> re.Pattern[str]:
    """``re.compile(pattern, flags)``, done at the pattern's first use (typed as the pattern)."""
    return cast("re.Pattern[str]", LazyPattern(pattern, flags))
