"""Modules imported on first use, for a fast command-line cold start.

Owns :class:`LazyModule`: ``grpc = LazyModule("grpc")`` at the top of a module reads like the
import it replaces, but ``grpc`` is imported only when an attribute is first read (a gRPC sender
is built, an ``except grpc.RpcError`` clause is evaluated). `servewatch --help`, ``cuda-env``,
``timeline`` and a ``dump`` to the embedded span files never pay for grpc or httpx. Imports the
standard library only.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["LazyModule"]


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
