"""W3C Trace Context ``traceparent`` header: parse and format (https://www.w3.org/TR/trace-context/).

Owns :class:`TraceParent`. Version ``00`` is ``00-<32 hex trace id>-<16 hex parent id>-<2 hex
flags>``; a higher version may append ``-...`` fields, which are ignored, per the spec's
forward-compatibility rule. All-zero ids and version ``ff`` are invalid. Imports only the
standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.errors import TraceParentError

__all__ = ["TraceParent", "TraceParentError"]

_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A parsed ``traceparent``.

    Attributes:
        trace_id: 32 lowercase hex digits.
        parent_id: 16 lowercase hex digits (the caller's span).
        flags: trace flags (bit 0: sampled).
    """

    trace_id: str
    parent_id: str
    flags: int = 1

    @classmethod
    def parse(cls, value: str) -> TraceParent:
        """Parse a header value.

        Raises:
            TraceParentError: wrong shape, upper-case or non-hex digits, all-zero ids, version ff.
        """
        raw = value.strip()
        parts = raw.split("-")
        if len(parts) < 4:
            raise TraceParentError(f"traceparent: expected version-traceid-parentid-flags, got {raw[:80]!r}")
        version, trace_id, parent_id, flags = parts[:4]
        if len(version) != 2 or not _HEX.fullmatch(version) or version == "ff":
            raise TraceParentError(f"traceparent: bad version {version[:8]!r}")
        if version == "00" and len(parts) != 4:
            raise TraceParentError("traceparent: version 00 has exactly 4 fields")
        if len(trace_id) != 32 or not _HEX.fullmatch(trace_id) or set(trace_id) == {"0"}:
            raise TraceParentError("traceparent: trace id must be 32 lower-case hex digits, not all zero")
        if len(parent_id) != 16 or not _HEX.fullmatch(parent_id) or set(parent_id) == {"0"}:
            raise TraceParentError("traceparent: parent id must be 16 lower-case hex digits, not all zero")
        if len(flags) != 2 or not _HEX.fullmatch(flags):
            raise TraceParentError(f"traceparent: bad flags {flags[:8]!r}")
        return cls(trace_id=trace_id, parent_id=parent_id, flags=int(flags, 16))

    def header(self) -> str:
        """The header value (version 00)."""
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags:02x}"
