"""The manifest read back without the pydantic model (agent.model.manifest_view): its field table is the
model's, it reads a manifest into exactly what the model holds or leaves it to the model (which
coerces or refuses with its own one-line error), and reading needs no pydantic."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from agent.errors import ManifestError
from agent.host.manifest import (
    KNOWN_SCHEMAS,
    Manifest,
    ManifestAction,
    ManifestHistoryPoint,
    ManifestTarget,
    ManifestVerdict,
    load_manifest,
    parse_manifest,
)
from agent.model import manifest_view
from agent.model.manifest_view import view_of_data, view_of_model
from agent.views.bundle import BundleCorruptError, read_manifest
from tests.test_manifest import _full

_TABLES = ((Manifest, manifest_view._MANIFEST), (ManifestTarget, manifest_view._TARGET),
           (ManifestAction, manifest_view._ACTION), (ManifestVerdict, manifest_view._VERDICT),
           (ManifestHistoryPoint, manifest_view._HISTORY))


@pytest.mark.parametrize(("model", "table"), _TABLES, ids=[m.__name__ for m, _ in _TABLES])
def test_the_table_is_the_models_fields(model: type[BaseModel], table: Any) -> None:
    """A field added to the model (always with a default, within a version) must be added here too."""
    assert [name for name, *_ in table] == list(model.model_fields)
    for name, keys, _check, default in table:
        info = model.model_fields[name]
        alias = info.validation_alias
        assert keys == (tuple(alias.choices) if alias is not None else (name,)), name  # type: ignore[union-attr]
        if info.is_required():
            assert default is manifest_view._REQUIRED, name
        elif info.default_factory is not None:
            assert callable(default) and default() == info.default_factory(), name  # type: ignore[call-arg]
        else:
            assert default == info.default, name
    assert manifest_view.KNOWN_SCHEMAS == KNOWN_SCHEMAS


def _rich() -> dict[str, Any]:
    """A manifest with every part: targets, actions, a verdict, history, lifecycle lines."""
    data = _full().to_json_dict()
    data["history"] = [{"time_unix_nano": 5, "kind": "step", "pid": 42, "forward_ct": 7, "detail": "step 7"},
                       {"time_unix_nano": 6, "kind": "stall"}]
    data["lifecycle"] = ["left alive"]
    data["exits_after_hard_signal"] = {"42": "killed by SIGABRT"}
    return data


_ODD_VALUES: tuple[Any, ...] = ("42", "", 42, -1, 0, 1.0, 2.5, float("nan"), float("inf"), True, False, None, [], ["x"], [1],
                                {}, {"a": 1}, "open", "interrupted", "servewatch.incident/2", 10**30)


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


def _mutate(data: dict[str, Any], rnd: random.Random) -> dict[str, Any]:
    data = copy.deepcopy(data)
    for _ in range(rnd.randint(1, 3)):
        path = rnd.choice(_paths(data)[1:])
        parent = data
        for step in path[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and rnd.random() < 0.3:
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(rnd.choice(_ODD_VALUES))
    return data


def test_a_manifest_read_here_is_what_the_model_holds_and_the_rest_is_the_models() -> None:
    rnd = random.Random(1234)
    base = _rich()
    assert view_of_data(base) == view_of_model(parse_manifest(base))  # the usual case: read here
    read_here = refused = coerced = 0
    for _ in range(3000):
        data = _mutate(base, rnd)
        view = view_of_data(data)
        try:
            model = parse_manifest(json.dumps(data))
        except ManifestError:
            assert view is None, data  # the model refuses it: never read here
            refused += 1
            continue
        if view is None:
            coerced += 1
        else:
            assert view == view_of_model(model), data
            read_here += 1
    assert read_here > 100 and refused > 100 and coerced > 100


def test_the_file_reader_gives_the_models_error_and_reads_what_the_model_coerces(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    good = _rich()
    cases = [("{not json", None), ("[1]", None), (json.dumps({**good, "schema": "servewatch.incident/9"}), None),
             (json.dumps({k: v for k, v in good.items() if k != "opened_time_unix_nano"}), None),
             (json.dumps({**good, "duration_s": 2, "inflight_requests": "3"}), {"duration_s": 2.0, "inflight_requests": 3}),
             (json.dumps(good), {})]
    for text, expect in cases:
        path.write_text(text)
        if expect is None:
            with pytest.raises(ManifestError) as want:
                load_manifest(path)
            with pytest.raises(BundleCorruptError) as got:
                read_manifest(path)
            assert str(got.value) == str(want.value)
        else:
            view = read_manifest(path)
            assert view == view_of_model(load_manifest(path))
            assert {k: getattr(view, k) for k in expect} == expect


def test_reading_a_manifest_as_the_agent_writes_it_imports_no_pydantic(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(_full().to_json())
    code = ("import sys, pathlib; from agent.views.bundle import read_manifest;"
            " v = read_manifest(pathlib.Path(sys.argv[1], 'manifest.json'));"
            " assert v.incident_id and v.verdict['kind'] == 'behind', v;"
            " print(sorted(m for m in sys.modules if m.startswith(('pydantic', 'agent.host.manifest', 'agent.model.manifest'))))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                         check=True, cwd=Path(__file__).resolve().parent.parent).stdout
    assert out.strip() == "['agent.model.manifest_view']"
