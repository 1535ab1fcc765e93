"""Complexity gate (issue 37): no function, method or closure of agent/ or exporters/ above radon's
cyclomatic complexity 15. radon also counts boolean operators, which ruff's C901 (the other gate,
``pyproject.toml``) does not. jinja2's compiled report template (``agent/views/templates/compiled/``,
written by :func:`agent.views.report.compile_template`) is generated code and left out.

See where a figure comes from with ``python -m radon cc -s -n C agent exporters``."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from radon.complexity import cc_visit_ast
from radon.visitors import Class, Function

ROOT = Path(__file__).resolve().parent.parent
#: the largest radon complexity a function may have
MAX_COMPLEXITY = 15
#: generated code, not ours to shape
EXCLUDED = (ROOT / "agent" / "views" / "templates" / "compiled",)


def _blocks(items: Iterable[Function | Class], prefix: str = "") -> Iterator[tuple[str, int, int]]:
    """``(qualified name, line, complexity)`` of every function, method and closure in ``items``."""
    for block in items:
        if isinstance(block, Class):
            yield from _blocks(block.methods, f"{prefix}{block.name}.")
            yield from _blocks(block.inner_classes, f"{prefix}{block.name}.")
        else:
            yield f"{prefix}{block.name}", block.lineno, block.complexity
            yield from _blocks(block.closures, f"{prefix}{block.name}.<locals>.")


def over_limit(source: str, limit: int = MAX_COMPLEXITY) -> list[tuple[str, int, int]]:
    """Functions of ``source`` above ``limit``: ``[(qualified name, line, complexity)]`` (a method
    once, under its class's name, though radon also lists it alone). radon does not look into a
    class defined inside a function: each class is also measured on its own, and a block seen
    twice (a top-level class's) counts once, by its line."""
    tree = ast.parse(source)
    top = [b for b in cc_visit_ast(tree) if isinstance(b, Class) or not b.is_method]
    found = {line: (name, c) for name, line, c in _blocks(top)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            alone = cc_visit_ast(ast.Module(body=[node], type_ignores=[]))
            for name, line, c in _blocks([b for b in alone if isinstance(b, Class)]):
                found.setdefault(line, (name, c))
    return sorted(((name, line, c) for line, (name, c) in found.items() if c > limit), key=lambda x: x[1])


def _sources() -> list[Path]:
    return sorted(p for folder in ("agent", "exporters") for p in (ROOT / folder).rglob("*.py")
                  if not any(p.is_relative_to(e) for e in EXCLUDED))


def test_no_function_of_agent_or_exporters_is_above_radon_15() -> None:
    sources = _sources()
    assert ROOT / "agent" / "fleet" / "job.py" in sources and len(sources) > 100
    found = [f"{p.relative_to(ROOT)}:{line} {name} ({c})" for p in sources
             for name, line, c in over_limit(p.read_text(encoding="utf-8"))]
    assert not found, f"{len(found)} function(s) above radon {MAX_COMPLEXITY}:\n" + "\n".join(found)


def _fn(name: str, branches: int, indent: str = "") -> str:
    """A function of radon complexity ``1 + 2 * branches`` (each ``if ... and ...``: 2)."""
    body = "".join(f"{indent}    if x == {i} and y:\n{indent}        return {i}\n" for i in range(branches))
    return f"{indent}def {name}(x, y):\n{body}{indent}    return -1\n"


@pytest.mark.parametrize(("source", "expected"), [
    (_fn("f", 8), [("f", 1, 17)]),
    (_fn("f", 7), []),  # 15: at the limit
    ("class K:\n" + _fn("m", 8, "    "), [("K.m", 2, 17)]),
    ("def outer():\n" + _fn("inner", 8, "    ") + "    return inner\n", [("outer.<locals>.inner", 2, 17)]),
    ("class K:\n    class Inner:\n" + _fn("m", 9, "        "), [("K.Inner.m", 3, 19)]),
    ("def factory():\n    class Local:\n" + _fn("m", 8, "        ") + "    return Local\n", [("Local.m", 3, 17)]),
], ids=["function", "at-the-limit", "method", "closure", "inner-class-method", "function-local-class-method"])
def test_the_gate_sees_functions_methods_and_closures_above_the_limit(source: str, expected: list[tuple[str, int, int]]) -> None:
    assert over_limit(source) == expected


def test_the_compiled_template_is_the_only_code_left_out() -> None:
    compiled = [p for p in (ROOT / "agent").rglob("*.py") if p.is_relative_to(EXCLUDED[0])]
    assert compiled, "the compiled report template moved: update EXCLUDED"
    assert all(p.parent == EXCLUDED[0] for p in compiled)
    assert not set(compiled) & set(_sources())
