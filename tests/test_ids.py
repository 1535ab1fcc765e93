"""agent.model.ids: trace/span ids as the events carry them (hex) and as spans need them (ints)."""

from __future__ import annotations

import pytest
from opentelemetry import trace as trace_api

from agent.model.ids import (
    new_span_id,
    new_span_id_hex,
    new_trace_id,
    new_trace_id_hex,
    parse_span_id,
    parse_trace_id,
    span_id_hex,
    trace_id_hex,
)


def test_new_ids_are_valid_distinct_and_of_the_right_width() -> None:
    traces = {new_trace_id() for _ in range(1000)}
    spans = {new_span_id() for _ in range(1000)}
    assert len(traces) == 1000 and len(spans) == 1000
    assert all(0 < t < 2**128 for t in traces) and all(0 < s < 2**64 for s in spans)
    assert max(traces) >= 2**120 and max(spans) >= 2**56  # the whole width is used
    assert trace_api.SpanContext(new_trace_id(), new_span_id(), is_remote=False).is_valid


def test_hex_is_what_otel_writes_and_reads_back() -> None:
    for _ in range(100):
        t, s = new_trace_id(), new_span_id()
        assert trace_id_hex(t) == trace_api.format_trace_id(t) and span_id_hex(s) == trace_api.format_span_id(s)
        assert parse_trace_id(trace_id_hex(t)) == t and parse_span_id(span_id_hex(s)) == s
    assert trace_id_hex(1) == "0" * 31 + "1" and span_id_hex(255) == "00000000000000ff"
    hex_trace, hex_span = new_trace_id_hex(), new_span_id_hex()
    assert len(hex_trace) == 32 and len(hex_span) == 16 and (hex_trace + hex_span).islower()
    assert parse_trace_id(hex_trace.upper()) == int(hex_trace, 16)


@pytest.mark.parametrize(
    "value",
    ["", "0" * 32, "a" * 31, "a" * 33, "g" * 32, "0x" + "a" * 30, "+" + "a" * 31, "_".join(["a" * 15, "a" * 16]), " " + "a" * 31],
)
def test_a_malformed_or_invalid_trace_id_is_none(value: str) -> None:
    assert parse_trace_id(value) is None


@pytest.mark.parametrize("value", ["", "0" * 16, "a" * 15, "a" * 32, "0x" + "a" * 14, "-" + "1" * 15])
def test_a_malformed_or_invalid_span_id_is_none(value: str) -> None:
    assert parse_span_id(value) is None
