"""agent.model.lazy.mark_absent: a module that is not installed is recorded absent once, so a library
that asks for it at every call (httpcore's ``import sniffio``) gets its ImportError without a
``sys.path`` search; an installed module is left alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_an_absent_module_is_marked_and_still_fails_to_import_and_a_present_one_is_left_alone() -> None:
    code = textwrap.dedent(
        """
        import importlib.util, sys
        from agent.model.lazy import mark_absent
        assert mark_absent(("servewatch_no_such_module", "json")) == ["servewatch_no_such_module"]
        assert sys.modules["servewatch_no_such_module"] is None
        assert importlib.util.find_spec("servewatch_no_such_module") is None
        try:
            import servewatch_no_such_module  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("imported")
        import json
        assert json.dumps(1) == "1"
        assert mark_absent(("servewatch_no_such_module",)) == []
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_lazy_pattern_compiles_at_first_use_and_is_the_pattern() -> None:
    import re

    from agent.model.lazy import LazyPattern, lazy_pattern

    pattern = lazy_pattern(r"a(?P<b>b+)", re.IGNORECASE)
    assert isinstance(pattern, LazyPattern) and object.__getattribute__(pattern, "_compiled") is None
    match = pattern.match("ABBc")
    assert match is not None and match["b"] == "BB"
    assert pattern.sub("-", "xab") == "x-" and pattern.pattern == r"a(?P<b>b+)" and pattern.flags & re.IGNORECASE
    assert isinstance(object.__getattribute__(pattern, "_compiled"), re.Pattern)


def test_security_and_stacks_compile_no_pattern_at_import() -> None:
    import subprocess
    import sys

    code = ("import re, agent.host.security, agent.model.stacks; from agent.model.lazy import LazyPattern;"
            " mods = (agent.host.security, agent.model.stacks);"
            " print(sorted(n for m in mods for n, v in vars(m).items() if isinstance(v, re.Pattern)),"
            " sum(isinstance(v, LazyPattern) for m in mods for v in vars(m).values()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split()[0] == "[]" and int(out.split()[1]) >= 20
