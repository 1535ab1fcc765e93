"""Trace and span ids, as the events carry them.

Owns making ids (random and non-zero, as the OTel SDK's ``RandomIdGenerator`` makes them),
writing them as the lowercase hex the events, manifests, OTLP/JSON and W3C ``traceparent`` use
(32 digits for a trace id, 16 for a span id) and reading them back. The incident layer picks an
incident's ids here; exporters turn the same ids into spans. Imports only the standard library
(no OTel SDK: ``servewatch cuda-env`` and friends start fast), so any layer may import it.
"""

from __future__ import annotations

import random

__all__ = [
    "SPAN_ID_HEX_DIGITS",
    "TRACE_ID_HEX_DIGITS",
    "new_span_id",
    "new_span_id_hex",
    "new_trace_id",
    "new_trace_id_hex",
    "parse_span_id",
    "parse_trace_id",
    "span_id_hex",
    "trace_id_hex",
]

#: Hex digits of a trace id (128 bits).
TRACE_ID_HEX_DIGITS = 32
#: Hex digits of a span id (64 bits).
SPAN_ID_HEX_DIGITS = 16


def _random_nonzero(bits: int) -> int:
    while True:
        value = random.getrandbits(bits)
        if value:
            return value


def new_trace_id() -> int:
    """A random valid (non-zero) 128-bit trace id."""
    return _random_nonzero(128)


def new_span_id() -> int:
    """A random valid (non-zero) 64-bit span id."""
    return _random_nonzero(64)


def trace_id_hex(trace_id: int) -> str:
    """32 lowercase hex digits, as OTLP/JSON and W3C ``traceparent`` write trace ids."""
    return f"{trace_id:032x}"


def span_id_hex(span_id: int) -> str:
    """16 lowercase hex digits."""
    return f"{span_id:016x}"


def new_trace_id_hex() -> str:
    """A new trace id as 32 lowercase hex digits."""
    return trace_id_hex(new_trace_id())


def new_span_id_hex() -> str:
    """A new span id as 16 lowercase hex digits."""
    return span_id_hex(new_span_id())


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def _parse(value: str, digits: int) -> int | None:
    if len(value) != digits or not _HEX_DIGITS.issuperset(value):
        return None  # int(..., 16) alone would take "0x", "+", "_" and spaces
    return int(value, 16) or None


def parse_trace_id(value: str) -> int | None:
    """The trace id written as ``value`` (32 hex digits, either case), or ``None``: empty,
    another length, not hex, or all zeros (the invalid id)."""
    return _parse(value, TRACE_ID_HEX_DIGITS)


def parse_span_id(value: str) -> int | None:
    """The span id written as ``value`` (16 hex digits, either case), or ``None``: empty,
    another length, not hex, or all zeros (the invalid id)."""
    return _parse(value, SPAN_ID_HEX_DIGITS)
