"""The export modules' ``__all__`` lists exactly their public names (httpx's exported-members check)."""

from __future__ import annotations

import importlib
import inspect

import pytest

MODULES = [
    "exporters.otlp.transport",
    "exporters.otlp.otlp_json",
    "exporters.otlp.spool",
    "exporters.otlp.processor",
    "exporters.otlp.provider",
    "exporters.otlp.metrics",
    "exporters.mirror.mirror",
    "exporters.otlp.replay",
]


@pytest.mark.parametrize("name", MODULES)
def test_all_matches_public_definitions(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(module.__all__)
    assert len(exported) == len(module.__all__), "duplicate in __all__"
    assert all(hasattr(module, n) for n in exported)
    defined = {
        n
        for n, obj in vars(module).items()
        if not n.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name
    }
    assert defined <= exported, f"public but not exported: {sorted(defined - exported)}"


@pytest.mark.parametrize("name", MODULES)
def test_module_docstring_says_what_it_owns_and_imports(name: str) -> None:
    doc = importlib.import_module(name).__doc__ or ""
    assert "Owns" in doc and "Imports" in doc
