"""Read the embedded-default OTLP/JSON span files (``<data_dir>/<host>/spans/*.jsonl``) in tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["any_value", "file_spans"]


def any_value(value: dict[str, Any]) -> object:
    """An OTLP/JSON ``AnyValue`` as a Python value (ints decoded, arrays as tuples)."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return tuple(any_value(v) for v in value["arrayValue"].get("values", []))
    return None


def file_spans(data_dir: Path) -> list[dict[str, Any]]:
    """Every span in the data dir's span files, with ``attributes`` as a plain dict."""
    out: list[dict[str, Any]] = []
    for path in sorted(Path(data_dir).glob("*/spans/*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            for rs in json.loads(line).get("resourceSpans", []):
                for ss in rs.get("scopeSpans", []):
                    for span in ss.get("spans", []):
                        attrs = {a["key"]: any_value(a.get("value", {})) for a in span.get("attributes", [])}
                        out.append({**span, "attributes": attrs})
    return out
