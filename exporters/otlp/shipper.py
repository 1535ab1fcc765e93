"""The agent ships the request and forward spans its servers recorded.

Owns :class:`SpanShipper`: it attaches to the span ring (:mod:`agent.sdk.ring`) of each target
running the SDK, keeps its heartbeat fresh (so the server keeps recording into the ring instead
of exporting itself), drains the ring, validates every record, encodes it straight to OTLP
bytes (:func:`exporters.otlp.wire.encode_record`: no ``ReadableSpan``, no protobuf objects; half the
agent's CPU per shipped span of the ``ReadableSpan`` path, ``bench/bench_ship.py --grpc``), or, for
the span files, straight to its OTLP/JSON text (:func:`exporters.otlp.wire_json.encode_record_text`) under
the SERVER's resource (``service.name`` and the other attributes the server declared,
``host.name``, ``process.pid`` of the server) and hands it to the agent's span processor (the
lossless one: spool, replay, TLS, size-aware batches). A plain ``SpanProcessor`` gets
``ReadableSpan`` objects (:func:`decode_record`, the reference the encoder is tested against).

Trust: a ring is opened only when it is a regular file (never through a symlink), owned by the
target's uid or root, mode 0600, with one link, no larger than ``spans.max_ring_bytes``, and its
header names the target's pid. Records are untrusted input: sizes, types and ranges are
checked; a bad record is counted (``invalid``/``corrupt``), never exported half-built.

Identity: a shipped span's resource is the server's, but who wrote it is what the agent knows
first-hand: ``process.pid``, ``process.user.id`` (the writer's uid) and ``host.name`` are set by
the agent and win over anything the ring declares; declared ``servewatch.*`` resource keys are
dropped, and a ring declaring the agent's own ``service.name`` is refused (said in the
``spans`` status). A record that uses servewatch's span names (``incident``, ``pyspy.dump``...),
a ``servewatch.*`` attribute the SDK does not set, or an identity key as a span attribute is
refused and counted (``refused``), so a span under the agent's name is always the agent's.

Counts (:class:`ShipperStatistics`, the ``servewatch.spans.channel`` metric, and
``servewatch status``): ``received``/``shipped`` here, ``corrupt``/``invalid`` records, and the
servers' own ``dropped_full`` (ring full: this agent too slow), ``dropped_no_agent`` and
``dropped_too_large``, read from the ring headers and kept after a server exits.

Imports opentelemetry-api/sdk, :mod:`exporters.otlp.wire`, :mod:`exporters.otlp.wire_json` and :mod:`agent.sdk.ring` (stdlib only).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from agent.host.procinfo import pid_alive
from agent.host.security import access_denied
from agent.sdk import presence as _presence
from agent.sdk.folders import FOLDER_PREFIX, shm_dir
from agent.sdk.ring import MAX_CAPACITY, RingBatch, RingError, RingReader, RingStatistics, ring_path
from exporters.otlp.wire import (
    _INT64,
    IDENTITY_KEYS,
    MAX_ATTRIBUTES,
    MAX_EVENTS,
    MAX_LINKS,
    MAX_NAME,
    MAX_STRING,
    SDK_SCOPE,
    Reserved,
    _clean_attrs,
    _int,
    _Invalid,
    encode_record,
    parse_record,
)
from exporters.otlp.wire_json import encode_record_text

if TYPE_CHECKING:
    from exporters.config import SpansConfig
    from exporters.otlp.provider import Telemetry


__all__ = ["IDLE_POLL_MAX_S", "SDK_SCOPE", "ShipperStatistics", "SpanShipper", "create_shipper", "decode_record", "next_poll_wait_s"]

log = logging.getLogger("servewatch.shipper")

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_KINDS = {k.value: k for k in SpanKind}
_STATUS = {0: StatusCode.UNSET, 1: StatusCode.OK, 2: StatusCode.ERROR}
#: Most pids whose refused ring is remembered (:meth:`SpanShipper.refused`).
MAX_REFUSED = 256
#: A target without a span ring is looked for again at the next poll after a change in the SDK's
#: folders, and at least this often (seconds) without one.
ABSENT_RETRY_S = 5.0
#: Longest wait between two ring polls while every poll finds nothing, seconds: an idle server's
#: rings cost a poll a second instead of four; 1 s of spans at 600 spans/s is ~0.2 MB of a 2 MiB
#: ring (``agent.sdk.ring.DEFAULT_CAPACITY``), so the first burst after an idle spell fits.
IDLE_POLL_MAX_S = 1.0
#: Folder times this close to now (seconds) are not trusted to show the next change (a coarse
#: file system clock): a target is then looked for at every poll.
ABSENT_MTIME_MARGIN_S = 1.0
#: Nice value of the threads that drain rings and encode/export shipped spans.
BACKGROUND_NICE = 10
_PLAIN_STATUS = {StatusCode.UNSET: Status(StatusCode.UNSET), StatusCode.OK: Status(StatusCode.OK)}


def next_poll_wait_s(interval_s: float, last_wait_s: float, shipped: int) -> float:
    """Seconds to the next ring poll after one that shipped ``shipped`` spans, its wait having
    been ``last_wait_s``: ``interval_s`` when it shipped any, else double the last wait, at most
    :data:`IDLE_POLL_MAX_S` (never below ``interval_s``: a longer configured interval stands)."""
    if shipped:
        return interval_s
    return max(interval_s, min(IDLE_POLL_MAX_S, last_wait_s * 2))


@dataclass(frozen=True, slots=True)
class ShipperStatistics:
    """What the shipper saw, since it started (all counts of spans unless noted)."""

    #: rings attached now
    rings: int
    #: valid span records taken from the rings
    received: int
    #: handed to the span processor (its own statistics say what became of them)
    shipped: int
    #: records whose CRC or framing was wrong (torn or overwritten)
    corrupt: int
    #: records that were not a valid span (bad JSON, types, ids)
    invalid: int
    #: spans the servers dropped because their ring was full
    dropped_full: int
    #: spans the servers dropped while no agent was attached (fallback ``drop``)
    dropped_no_agent: int
    #: spans the servers dropped as larger than half their ring
    dropped_too_large: int
    #: spans the servers sent to their own OTel path while no agent was attached
    fallback_spans: int
    #: records refused for claiming servewatch's span names, attributes or identity keys
    refused: int = 0

    @property
    def dropped(self) -> int:
        """Spans lost between the servers and the processor."""
        return self.dropped_full + self.dropped_no_agent + self.dropped_too_large + self.corrupt + self.invalid + self.refused

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "dropped": self.dropped}

    def line(self) -> str:
        """One line for ``servewatch status``: shipped, every drop by cause, and the spans the
        servers sent to their own OTel path (``fallback``: not counted as dropped, since a server
        with the OTel SDK exports them, but a server without one drops them)."""
        return (
            f"shipping request spans of {self.rings} server process{'es' if self.rings != 1 else ''}: "
            f"{self.shipped} shipped; dropped {self.dropped} (ring full {self.dropped_full}, "
            f"no agent {self.dropped_no_agent}, too large {self.dropped_too_large}, corrupt {self.corrupt}, "
            f"invalid {self.invalid}{f', refused {self.refused} (servewatch reserved names)' if self.refused else ''}); fallback {self.fallback_spans} (sent to the server's own OTel path while "
            f"no agent was attached: lost unless it installed the OTel SDK)"
        )


def _ctx(trace_id: int, span_id: int) -> SpanContext:
    return SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)


def decode_record(payload: bytes, resource: Resource) -> ReadableSpan:
    """One ring record (:mod:`agent.sdk.channel` format) as a finished span.

    Raises:
        ValueError: not a valid span record.
    """
    name, kind, trace_id, span_id, parent_id, start, end, attrs, status, desc, events, links = parse_record(payload)
    evs: list[Event] = []
    for ev in events[:MAX_EVENTS]:
        if not isinstance(ev, list) or len(ev) != 3 or not isinstance(ev[0], str):
            raise _Invalid("bad event")
        evs.append(Event(ev[0][:MAX_NAME], _clean_attrs(ev[2]), timestamp=_int(ev[1], 0, _INT64[1])))
    lks = []
    for lk in links[:MAX_LINKS]:
        if not isinstance(lk, list) or len(lk) != 3:
            raise _Invalid("bad link")
        lks.append(Link(_ctx(_int(lk[0], 1, 2**128 - 1), _int(lk[1], 1, 2**64 - 1)), _clean_attrs(lk[2])))
    code = _STATUS[status]
    return ReadableSpan(
        name=name[:MAX_NAME],
        context=_ctx(trace_id, span_id),
        parent=_ctx(trace_id, parent_id) if parent_id else None,
        resource=resource,
        attributes=_clean_attrs(attrs),
        events=tuple(evs),
        links=tuple(lks),
        kind=_KINDS[kind],
        status=Status(code, desc[:MAX_STRING]) if code is StatusCode.ERROR else _PLAIN_STATUS[code],
        start_time=start,
        end_time=max(start, end),
        instrumentation_scope=SDK_SCOPE,
    )


def _server_resource(metadata: Mapping[str, Any], pid: int, host_name: str, uid: int | None) -> Resource:
    """The resource of a server's shipped spans: what its ring declares, except ``servewatch.*``
    keys, under the identity the agent knows first-hand (pid, uid, host), which always wins."""
    declared = metadata.get("resource")
    attrs: dict[str, Any] = {}
    if isinstance(declared, dict):
        for key, value in list(declared.items())[:MAX_ATTRIBUTES]:
            key = str(key)[:256]
            if key.startswith("servewatch") or key in IDENTITY_KEYS - {"service.name"}:
                continue
            if isinstance(value, (str, bool, int, float)) and not (isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]):
                attrs[key] = value[:MAX_STRING] if isinstance(value, str) else value
    attrs.setdefault("service.name", "unknown_service")
    attrs["process.pid"] = pid
    if uid is not None:
        attrs["process.user.id"] = uid
    attrs["host.name"] = host_name
    return Resource(attrs)


class _Attached:
    __slots__ = ("last", "pending", "reader", "resource")

    def __init__(self, reader: RingReader, resource: Resource) -> None:
        self.reader = reader
        self.resource = resource
        self.last: RingStatistics | None = None
        #: (processor ticket, ring position) of batches taken and not yet committed, oldest first
        self.pending: deque[tuple[int, int]] = deque()



def _decode_all(payloads: list[bytes], decode: Callable[[bytes, Resource], Any], resource: Resource) -> tuple[list[Any], int, int]:
    """``(spans, invalid, refused)`` of a ring batch's records."""
    spans: list[Any] = []
    invalid = refused = 0
    for payload in payloads:
        try:
            spans.append(decode(payload, resource))
        except Reserved:
            refused += 1
        except Exception:  # noqa: BLE001 - untrusted input (an unhashable kind, JSON nested past the
            invalid += 1  # recursion limit...): one bad record is counted, never loses its batch
    return spans, invalid, refused

class SpanShipper:
    """Drains the span rings of the targets into a span processor. Thread-safe; :meth:`poll`
    runs on a worker thread (the runtime's), everything else anywhere.

    Args:
        processor: where spans go (the agent's ``LosslessSpanProcessor``; ``on_end`` never blocks).
        host_name: ``host.name`` of shipped spans (the agent's, i.e. the server's node).
        directory: where ring files are (default: the SDK's shm folder).
        stale_s: another agent that polled a ring within this long owns it (we leave it alone).
        max_records_per_poll: bound on records taken from one ring in one poll.
        poll_interval_s: seconds between polls once the runtime starts it (``spans.poll_interval_s``).
        reserved_service_names: ``service.name`` values a ring may not declare (the agent's own).
        max_ring_bytes: largest ring attached, bytes (``spans.max_ring_bytes``).
    """

    def __init__(
        self,
        processor: SpanProcessor,
        *,
        host_name: str,
        directory: Path | None = None,
        stale_s: float = 2.0,
        max_records_per_poll: int = 8192,
        poll_interval_s: float = 0.25,
        reserved_service_names: Iterable[str] = ("servewatch",),
        max_ring_bytes: int = MAX_CAPACITY,
    ) -> None:
        self.reserved_service_names = frozenset(reserved_service_names)
        self.max_ring_bytes = max_ring_bytes
        self.processor = processor
        self.host_name = host_name
        self.directory = directory
        #: seconds between ring polls once started (``spans.poll_interval_s``)
        self.poll_interval_s = poll_interval_s
        self._stale_ns = int(stale_s * 1e9)
        self._max_records = max_records_per_poll
        self._rings: dict[int, _Attached] = {}
        self._lock = threading.Lock()  # guards _rings and the counters
        self._poll_lock = threading.Lock()  # one poll at a time
        self._received = 0
        self._shipped = 0
        self._invalid = 0
        self._refused_spans = 0
        self._corrupt_retired = 0
        self._server_retired = RingStatistics(0, 0, 0, 0, 0, 0, 0)
        self._refused: dict[int, str] = {}
        #: the targets (pid -> uid) the agent watches: their rings are attached as soon as they
        #: appear (at the next poll), and they are declared watched (agent.sdk.presence)
        self._targets: dict[int, int | None] = {}
        #: this agent's declarations that it watches the targets, in each one's private folder
        self._presence = _presence.Declarations(directory)
        self._said_declaration = False
        self._declare_lock = threading.Lock()
        self._closed = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: the processor's ``submit`` when it says when spans are safe (the lossless one)
        self._submit = getattr(processor, "submit", None)
        #: how a record becomes what the lossless processor takes: its OTLP/JSON text for the
        #: span files (no protobuf bytes unless asked for), else its protobuf bytes
        self._decode = encode_record_text if getattr(processor, "takes_text", False) is True else encode_record
        #: targets found with no ring file: pid -> (the SDK folders' signature then, when)
        self._absent: dict[int, tuple[tuple[int, ...], float]] = {}
        self._folders_at: tuple[int, list[str]] = (-1, [])

    # -- attaching ---------------------------------------------------------------------------

    def attach(self, pid: int, uid: int | None) -> bool:
        """Attach to ``pid``'s ring when it has a trustworthy one (idempotent, cheap when absent).

        Args:
            uid: the target's uid; the ring must belong to it or to root.

        Returns:
            Whether the ring is attached now.
        """
        return self._attach(pid, uid) == "attached"

    def _folders_signature(self) -> tuple[int, ...] | None:
        """The modification times (ns) of the SDK's base folder and of every private folder in
        it: a ring file created, renamed or removed in any of them, or a folder added, changes
        it. ``None`` when it cannot be read, or when a time is within
        :data:`ABSENT_MTIME_MARGIN_S` of now (a file system's coarse clock could give a change
        made just after it the same time)."""
        base = self.directory or shm_dir()
        try:
            st = os.stat(base)
            if self._folders_at[0] != st.st_mtime_ns:
                self._folders_at = (st.st_mtime_ns, sorted(e.name for e in os.scandir(base) if e.name.startswith(FOLDER_PREFIX)))
            sig = [st.st_mtime_ns]
            for name in self._folders_at[1]:
                try:
                    sig.append(os.stat(base / name).st_mtime_ns)
                except OSError:
                    sig.append(-1)
        except OSError:
            return None
        if time.time_ns() - max(sig) < ABSENT_MTIME_MARGIN_S * 1e9:
            return None
        return tuple(sig)

    def _attach(self, pid: int, uid: int | None) -> str:
        """:meth:`attach`: ``attached``, ``absent`` (no ring file) or ``refused`` (any other reason)."""
        with self._lock:
            if self._closed:
                return "refused"
            if pid in self._rings:
                return "attached"
        reader = self._open_ring(pid, uid)
        if isinstance(reader, str):
            return reader
        if not self._claim(pid, reader):
            return "refused"
        return self._keep(pid, uid, reader)

    def _open_ring(self, pid: int, uid: int | None) -> RingReader | str:
        """``pid``'s ring, or ``absent`` / ``refused`` (logged once per reason)."""
        trusted = {0} | ({uid} if uid is not None else set())
        try:
            reader = RingReader(pid, trusted_uids=trusted, directory=self.directory, max_capacity=self.max_ring_bytes)
            declared = reader.metadata.get("resource")
            service = declared.get("service.name") if isinstance(declared, dict) else None
            if isinstance(service, str) and service in self.reserved_service_names:
                reader.close(detach=False)
                raise RingError(f"it declares service.name {service[:64]!r}, the agent's own")
        except RingError as exc:
            reason = str(exc)
            if reason.endswith("Permission denied"):  # another user's folder (root's server, no sudo): the fix
                why = access_denied(ring_path(pid, self.directory))
                reason = f"cannot open its span ring: {why}" if why else reason
            if not reason.startswith("no span ring") and self._refused.get(pid) != reason:
                self._refuse(pid, reason)
                log.warning("not shipping spans of pid %d: %s", pid, reason)
            return "absent" if reason.startswith("no span ring") else "refused"
        return reader

    def _claim(self, pid: int, reader: RingReader) -> bool:
        """Whether the ring is ours to ship (no other agent ships it, our heartbeat is written);
        else the reader is closed."""
        other = reader.claimed_by_other(self._stale_ns)
        if other:
            reader.close(detach=False)
            why = f"shipped by another agent (pid {other})"
            if self._refused.get(pid) != why:
                self._refuse(pid, why)
                log.warning("spans of pid %d are shipped by another agent (pid %d)", pid, other)
            return False
        try:
            reader.heartbeat()
        except OSError as exc:
            reader.close(detach=False)
            log.warning("not shipping spans of pid %d: %s", pid, exc)
            return False
        return True

    def _keep(self, pid: int, uid: int | None, reader: RingReader) -> str:
        """Add the claimed ring to those shipped (unless closed or attached meanwhile)."""
        resource = _server_resource(reader.metadata, pid, self.host_name, uid if uid is not None else reader.uid)
        ring = _Attached(reader, resource)
        try:  # the server's counters so far (drops before we came) count from the first status on
            ring.last = reader.statistics()
        except OSError:
            pass
        with self._lock:
            if self._closed or pid in self._rings:
                reader.close(detach=pid not in self._rings)
                return "attached" if pid in self._rings else "refused"
            self._rings[pid] = ring
        with self._lock:
            self._refused.pop(pid, None)
        log.info("shipping request spans of pid %d (service.name %s)", pid, resource.attributes.get("service.name"))
        return "attached"

    def _refuse(self, pid: int, reason: str) -> None:
        """Remember why ``pid``'s ring is not shipped; past :data:`MAX_REFUSED` pids, those of
        exited processes are forgotten (then the oldest), so the map stays bounded."""
        with self._lock:
            self._refused[pid] = reason
            if len(self._refused) > MAX_REFUSED:
                for old in [p for p in self._refused if p != pid and not pid_alive(p)]:
                    del self._refused[old]
                while len(self._refused) > MAX_REFUSED:
                    del self._refused[next(iter(self._refused))]

    def refused(self) -> dict[int, str]:
        """Rings found but not attached, by pid: why (untrusted owner, another agent...)."""
        with self._lock:
            return dict(self._refused)

    def attached_pids(self) -> list[int]:
        with self._lock:
            return sorted(self._rings)

    def detach(self, pid: int, *, timeout_s: float = 2.0) -> None:
        """Drain and let go of ``pid``'s ring (the server falls back to its own path at once).
        Waits up to ``timeout_s`` seconds for the drained spans to be exported or spooled
        before releasing their records; past that they stay in the ring for the next agent."""
        with self._poll_lock:
            with self._lock:
                ring = self._rings.get(pid)
            if ring is not None:
                self._drain(pid, ring)
                self._settle_wait(ring, time.monotonic() + timeout_s)
                self._retire(pid, detach=True)

    # -- polling -----------------------------------------------------------------------------

    def watch(self, targets: Mapping[int, int | None]) -> None:
        """The agent's targets now (pid -> uid), from its discovery. Each poll attaches the ring
        of any of them that has one (a server creates it at its first span: attached within a
        poll interval, not at the next discovery round) and keeps this agent's declaration that
        it watches them (:mod:`agent.sdk.presence`) current, so a server holds its first spans in
        the ring for us instead of sending them to its own fallback. Declares and attaches now
        too (file system calls: call it off the event loop); any thread."""
        with self._lock:
            self._targets = dict(targets)
        if not self._closed:
            self._watch_targets()

    def _watch_targets(self) -> None:
        """Declare the targets not declared yet (withdrawing the ones gone) and attach the rings
        of the ones not attached yet (:meth:`watch`, and each poll)."""
        with self._lock:
            targets = dict(self._targets)
            attached = set(self._rings)
        with self._declare_lock:
            if not self._closed:
                self._declare(targets)
        sig: tuple[int, ...] | None = None
        now = time.monotonic()
        for pid, uid in targets.items():
            if pid in attached or not pid_alive(pid):
                continue
            # a target found without a ring is looked for again once a folder changed (a file
            # created there), or after ABSENT_RETRY_S: not every poll (each look reads /proc
            # and lists the folders)
            if sig is None:
                sig = self._folders_signature()
            if self._absent_still(pid, sig, now):
                continue
            if self._attach(pid, uid) == "absent" and sig is not None:
                self._absent[pid] = (sig, now)
            else:
                self._absent.pop(pid, None)
        if len(self._absent) > len(targets):
            for pid in [p for p in self._absent if p not in targets]:
                del self._absent[pid]

    def _absent_still(self, pid: int, sig: tuple[int, ...] | None, now: float) -> bool:
        """Whether ``pid`` was found without a ring under the same folders' signature, less than
        :data:`ABSENT_RETRY_S` ago (no need to look again)."""
        seen = self._absent.get(pid)
        return sig is not None and seen is not None and seen[0] == sig and now - seen[1] < ABSENT_RETRY_S

    def _declare(self, targets: Mapping[int, int | None]) -> None:
        """Declare the targets not declared yet, in their servers' private folders (O(1) each
        once declared; a server whose folder is not there yet is tried again later)."""
        problems = self._presence.update(targets)
        if problems and not self._said_declaration:  # the servers then fall back until we attach: said once
            log.warning("cannot declare the watched servers in %s yet: %s", self.directory or "the shm folder", "; ".join(problems[:3]))
            self._said_declaration = True

    def poll(self) -> int:
        """Attach the rings of new targets (:meth:`watch`), heartbeat and drain every attached ring
        once; rings of exited servers are drained and dropped. Returns the spans shipped by this
        poll. Never raises for one bad ring."""
        shipped = 0
        with self._poll_lock:
            if not self._closed:
                self._watch_targets()
            with self._lock:
                rings = list(self._rings.items())
            for pid, ring in rings:
                dead = not pid_alive(pid)
                gone = dead or not _same_file(ring.reader)
                if not gone:
                    try:
                        ring.reader.heartbeat()
                    except OSError:
                        gone = True
                shipped += self._drain(pid, ring)
                if gone:
                    if ring.pending and _same_file(ring.reader):
                        continue  # the file holds the records until their spans are exported or spooled
                    if dead and _same_file(ring.reader):
                        # a server killed before its exit handler leaves its ring in tmpfs: the
                        # agent drained it and its spans are safe, so remove it (unlink never
                        # follows a symlink)
                        _unlink_quiet(ring.reader.path)
                    self._retire(pid, detach=False)
        return shipped

    def _drain(self, pid: int, ring: _Attached) -> int:
        """Take what the ring holds past our cursor, hand the spans to the processor, and
        release (commit) the ring space of every earlier batch the processor has settled."""
        reader = ring.reader
        submit = self._submit
        max_records = self._max_records
        if submit is not None:
            max_records = min(max_records, self.processor.room())  # type: ignore[attr-defined]
        start = reader.cursor
        try:
            if max_records > 0:
                batch = reader.take(max_records)
            else:  # the processor's queue is full: the records wait in the ring (a full ring is counted)
                batch = RingBatch([], -1)
            ring.last = reader.statistics() or ring.last
        except OSError as exc:
            log.warning("span ring of pid %d unreadable: %s", pid, exc)
            return 0
        # the lossless processor takes encoded spans (exporters.otlp.wire: no ReadableSpan, no protobuf
        # objects), as their OTLP/JSON text when it writes the span files (exporters.otlp.wire_json);
        # a plain SpanProcessor gets ReadableSpans
        decode = self._decode if submit is not None else decode_record
        spans, invalid, refused = _decode_all(batch.payloads, decode, ring.resource)
        shipped = len(spans)
        if batch.end >= 0 and (batch.payloads or batch.end != start):
            ticket = self._hand_over(ring, spans)
            if ticket is None:  # the processor is shut down: the records stay for the next agent
                reader.rewind(start)
                shipped = invalid = refused = 0
            else:
                ring.pending.append((ticket, batch.end))
        self._commit_settled(pid, ring)
        with self._lock:
            self._received += shipped
            self._shipped += shipped
            self._invalid += invalid
            self._refused_spans += refused
        if invalid:
            log.warning("%d invalid span record(s) from pid %d", invalid, pid)
        if refused:
            log.warning("%d span record(s) from pid %d refused: they use servewatch's reserved names", refused, pid)
        return shipped

    def _hand_over(self, ring: _Attached, spans: list[Any]) -> int | None:
        """Give the spans to the processor; the ticket that settles them (``None``: it is shut down)."""
        submit = self._submit
        if submit is None:  # a plain SpanProcessor: no way to know when a span is safe
            for span in spans:
                self.processor.on_end(span)
            return 0
        return submit(spans) if spans else (ring.pending[-1][0] if ring.pending else 0)

    def _commit_settled(self, pid: int, ring: _Attached) -> None:
        """Release the ring space of the oldest batches whose spans the processor settled."""
        pending = ring.pending
        if not pending:
            return
        settled = self._settled()
        end = -1
        while pending and pending[0][0] <= settled:
            end = pending.popleft()[1]
        if end >= 0:
            try:
                ring.reader.commit(end)
            except OSError as exc:
                log.warning("span ring of pid %d: cannot commit its read position: %s", pid, exc)

    def _settled(self) -> int:
        settled = getattr(self.processor, "settled", None)
        return settled() if settled is not None else 2**63

    def _settle_wait(self, ring: _Attached, deadline: float) -> None:
        """Wait (until ``deadline``, monotonic) for the spans taken from ``ring`` to be settled,
        then commit them."""
        if ring.pending and self._submit is not None:
            self.processor.wait_settled(ring.pending[-1][0], max(0.0, deadline - time.monotonic()))  # type: ignore[attr-defined]
        self._commit_settled(ring.reader.pid, ring)

    def _retire(self, pid: int, *, detach: bool) -> None:
        with self._lock:
            ring = self._rings.pop(pid, None)
            if ring is None:
                return
            last = ring.last
            if last is not None:
                r = self._server_retired
                self._server_retired = RingStatistics(
                    written=r.written + last.written,
                    dropped_full=r.dropped_full + last.dropped_full,
                    dropped_no_agent=r.dropped_no_agent + last.dropped_no_agent,
                    dropped_too_large=r.dropped_too_large + last.dropped_too_large,
                    fallback_spans=r.fallback_spans + last.fallback_spans,
                    unread_bytes=0,
                    capacity=0,
                )
            self._corrupt_retired += ring.reader.corrupt
        try:
            ring.reader.close(detach=detach)
        except OSError:
            pass

    def heartbeat_all(self) -> None:
        """Tell every attached server the agent is here (one ``pwrite`` each; cheap enough for
        the event loop, so a starved drain thread never makes servers fall back)."""
        with self._lock:
            readers = [ring.reader for ring in self._rings.values()]
        for reader in readers:
            try:
                reader.heartbeat()
            except (OSError, ValueError):
                pass  # the next poll retires a ring that went away
        self._presence.touch()

    def start(self, interval_s: float, *, nice: int = BACKGROUND_NICE) -> threading.Thread:
        """Drain the rings every ``interval_s`` seconds on a dedicated thread running at
        ``nice`` (Linux per-thread priority): under CPU contention the served processes come
        first, the rings absorb the delay, and a full ring is counted, never a blocked server.
        While the rings stay empty the polls space out to :data:`IDLE_POLL_MAX_S`
        (:func:`next_poll_wait_s`); the first span back restores ``interval_s``."""

        def loop() -> None:
            lower_thread_priority(nice)
            wait_s = interval_s
            while not self._stopping.wait(wait_s):
                shipped = 0
                try:
                    shipped = self.poll()
                except Exception:  # boundary: shipping must never end the agent's thread
                    log.exception("span shipping failed")
                wait_s = next_poll_wait_s(interval_s, wait_s, shipped)

        thread = threading.Thread(target=loop, name="servewatch-span-shipper", daemon=True)
        self._thread = thread
        thread.start()
        return thread

    # -- reporting / shutdown ----------------------------------------------------------------

    def statistics(self) -> ShipperStatistics:
        with self._lock:
            rings = list(self._rings.values())
            r = self._server_retired
            lasts = [x.last for x in rings if x.last is not None]
            return ShipperStatistics(
                rings=len(rings),
                received=self._received,
                shipped=self._shipped,
                corrupt=self._corrupt_retired + sum(x.reader.corrupt for x in rings),
                invalid=self._invalid,
                dropped_full=r.dropped_full + sum(s.dropped_full for s in lasts),
                dropped_no_agent=r.dropped_no_agent + sum(s.dropped_no_agent for s in lasts),
                dropped_too_large=r.dropped_too_large + sum(s.dropped_too_large for s in lasts),
                fallback_spans=r.fallback_spans + sum(s.fallback_spans for s in lasts),
                refused=self._refused_spans,
            )

    def register_metrics(self, meter_provider: Any) -> None:
        """Report :meth:`statistics` as the ``servewatch.spans.channel`` counter (``{span}``),
        attribute ``servewatch.channel.outcome`` = ``shipped | corrupt | invalid | refused | dropped_full
        | dropped_no_agent | dropped_too_large | fallback``."""
        if meter_provider is None:
            return
        from opentelemetry.metrics import Observation

        def observe(options: Any) -> Iterable[Observation]:
            s = self.statistics()
            for outcome, value in (
                ("shipped", s.shipped), ("corrupt", s.corrupt), ("invalid", s.invalid), ("refused", s.refused),
                ("dropped_full", s.dropped_full), ("dropped_no_agent", s.dropped_no_agent),
                ("dropped_too_large", s.dropped_too_large), ("fallback", s.fallback_spans),
            ):
                yield Observation(value, {"servewatch.channel.outcome": outcome})

        meter = meter_provider.get_meter("servewatch", "0.1.0")
        meter.create_observable_counter(
            "servewatch.spans.channel", [observe], unit="{span}",
            description="Server request/forward spans through the local channel, by outcome (drops counted on both sides).",
        )

    def close(self, timeout_s: float = 2.0) -> ShipperStatistics:
        """Drain every ring one last time and detach (servers fall back at once); safe twice.

        Waits up to ``timeout_s`` seconds for the processor to export or spool the spans
        taken; the records of those it has not settled by then stay in the rings (the next
        agent ships them again: a duplicate is possible, a loss is not)."""
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        with self._poll_lock:
            with self._lock:
                self._closed = True
                rings = list(self._rings.items())
            with self._declare_lock:
                self._presence.withdraw_all()  # servers no longer wait for us
            for _, ring in rings:  # detach first: new spans take the servers' own path at once
                try:
                    ring.reader.heartbeat(detach=True)
                except OSError:
                    pass
            for pid, ring in rings:
                self._drain(pid, ring)
            deadline = time.monotonic() + timeout_s
            for pid, ring in rings:  # release only what is exported or spooled
                self._settle_wait(ring, deadline)
                self._retire(pid, detach=True)
        return self.statistics()


def lower_thread_priority(nice: int = 10, native_id: int | None = None) -> bool:
    """Set the nice value of one thread (default: the calling one); Linux threads are tasks
    with their own priority. Returns whether it worked (never raises)."""
    try:
        tid = threading.get_native_id() if native_id is None else native_id
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except (OSError, AttributeError):
        return False
    return True


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _same_file(reader: RingReader) -> bool:
    """The ring file is still the one we opened (not removed or replaced)."""
    try:
        a = os.fstat(reader.fd)
        b = os.stat(reader.path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def create_shipper(config: SpansConfig, telemetry: Telemetry, *, host_name: str) -> SpanShipper:
    """The running agent's SDK span shipper (``[spans]``, built by :class:`agent.runtime.agent.Agent`
    when ``ship`` is on; a one-shot dump ships none): ships the targets' spans through
    ``telemetry``'s processor and counts in its meter provider."""
    own_service = telemetry.resource.attributes.get("service.name") if getattr(telemetry, "resource", None) else None
    shipper = SpanShipper(
        telemetry.processor, host_name=host_name, directory=config.directory,
        poll_interval_s=config.poll_interval_s,
        reserved_service_names={"servewatch", *([own_service] if isinstance(own_service, str) else [])},
        max_ring_bytes=config.max_ring_bytes,
    )
    shipper.register_metrics(telemetry.meter_provider)
    return shipper
