"""Ring records straight to OTLP/JSON text (exporters.otlp.wire_json): the same lines, byte for
byte, as ring record -> protobuf bytes -> request -> ``request_to_json`` (the path the span files
took before), the same refusals, and the same bytes for whatever still needs them."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.resources import Resource

from exporters.otlp.encode import EncodedSpan, encode_spans_fast
from exporters.otlp.otlp_json import read_otlp_json_lines, request_to_json
from exporters.otlp.wire import encode_record
from exporters.otlp.wire_json import TextSpan, encode_record_text, spans_line
from tests.exporters.test_otlp_json import _reference_json
from tests.exporters.test_wire import RESOURCE, _payload, _random_record, _record

OTHER = Resource({"service.name": "other-llm", "process.pid": 7, "host.name": "node-b"}, "https://schema/1")
MAX = 3 * 1024 * 1024


def _old_line(payloads: list[bytes], resource: Resource = RESOURCE) -> str:
    """The span files' line before: protobuf bytes per record, one request, its JSON text."""
    return request_to_json(encode_spans_fast([encode_record(p, resource) for p in payloads]))


def _sdk_payloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Request and forward spans recorded by agent.sdk in this process: every attribute kind
    (str, bool, int, float, arrays of each, an empty array, non-ASCII, escapes), forward spans
    linked to their requests, errors with an exception event (status ERROR and its message)."""
    monkeypatch.setenv("SERVEWATCH_SHM_DIR", str(tmp_path))
    from agent import sdk
    from agent.sdk import channel
    from agent.sdk import ring as _ring

    channel.close()
    channel._state = 0  # the channel (re)reads its settings at the next span: a ring in tmp_path
    writer = channel.ring()
    assert writer is not None
    every_kind = {"s": "ünï \"quoted\"\n\u2028\t", "b": True, "f": False, "i": -(2**63), "big": 2**63 - 1, "d": 0.1,
                  "neg0": -0.0, "tiny": 1e-310, "ss": ["a", "", "é"], "bs": [True, False], "is": [1, -2, 0],
                  "ds": [1.5, -2.25], "empty": [], "": "empty key", "long": "y" * 300}
    try:
        for i in range(12):
            writer.words[_ring.W_HEARTBEAT] = time.monotonic_ns()  # an agent is attached: spans go to the ring
            with sdk.request_span(f"req-{i}", model="demo-tiny" if i % 3 else "模型", operation="text_completion",
                                  max_tokens=16, input_tokens=12, attributes=every_kind if i % 2 else {"n": i}) as req:
                req.set_output_tokens(i)
                for _ in range(2):
                    with sdk.forward_span([req]):
                        pass
            if i % 4 == 0:
                try:
                    with sdk.request_span(f"bad-{i}", model="demo-tiny"):
                        raise RuntimeError("CUDA error: an illegal memory access was encountered")
                except RuntimeError:
                    pass
        reader = _ring.RingReader(os.getpid(), trusted_uids={os.geteuid()}, directory=tmp_path)
        payloads = reader.take(10_000).payloads
        reader.close(detach=False)
    finally:
        channel.close()
        channel._state = 0
    assert len(payloads) == 12 * 3 + 3
    return payloads


def test_real_sdk_spans_give_the_same_line_as_the_protobuf_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payloads = _sdk_payloads(tmp_path, monkeypatch)
    joined = b"".join(payloads)
    for needed in (b'"exception"', b'"gen_ai.response.id"', b'"ds":[1.5,-2.25]', b'"empty":[]', b'"f":false'):
        assert needed in joined, needed
    spans = [encode_record_text(p, RESOURCE) for p in payloads]
    assert all(type(s) is TextSpan for s in spans)
    line = spans_line(spans, MAX)
    old = _old_line(payloads)
    assert line == old
    assert line == _reference_json(encode_spans_fast([encode_record(p, RESOURCE) for p in payloads]))  # json_format's
    # and each span's bytes, built when asked for, are encode_record's
    assert [s.data for s in spans] == [encode_record(p, RESOURCE).data for p in payloads]
    # the remembered texts give the same line the second time, and per span
    assert spans_line([encode_record_text(p, RESOURCE) for p in payloads], MAX) == old
    for p in payloads:
        assert spans_line([encode_record_text(p, RESOURCE)], MAX) == _old_line([p])


def test_generated_records_give_the_same_lines_refusals_and_bytes() -> None:
    """4,000 generated records (test_wire's: every value type, the int64/id/limit edges, bad
    shapes and types, refused names, lone surrogates), written with and without ASCII escapes:
    a record is refused by the text path exactly when the bytes path refuses it (the same
    exception type), and otherwise its line is the protobuf path's; its protobuf size is never
    above its text's length (what lets a short line skip the byte split)."""
    rng = random.Random(20261207)
    accepted = refused = 0
    for n in range(4000):
        rec = _random_record(rng)
        try:
            payload = json.dumps(rec, separators=(",", ":"), ensure_ascii=n % 2 == 0).encode()
        except UnicodeEncodeError:  # a lone surrogate written raw is not UTF-8: not a record either way
            continue
        try:
            old: Any = encode_record(payload, RESOURCE)
        except ValueError as exc:
            old = type(exc)
        try:
            new: Any = encode_record_text(payload, RESOURCE)
        except ValueError as exc:
            new = type(exc)
        if isinstance(old, type):
            assert new is old, payload[:300]
            refused += 1
            continue
        assert isinstance(new, EncodedSpan), payload[:300]
        line = spans_line([new], 1 << 40) if type(new) is TextSpan else None
        request = encode_spans_fast([old])
        if line is not None:
            assert line == request_to_json(request), payload[:300]
            assert request.ByteSize() <= len(line), payload[:300]
        assert new.data == old.data, payload[:300]
        accepted += 1
    assert accepted > 1000 and refused > 300


def test_a_batch_of_two_servers_keeps_groups_order_schema_and_the_split_limit() -> None:
    p = [_payload(_record(span_id=i + 1, name=f"s{i}")) for i in range(6)]
    resources = [RESOURCE, OTHER, RESOURCE, Resource(dict(RESOURCE.attributes)), OTHER, RESOURCE]  # the 4th: equal, not the same
    spans = [encode_record_text(x, r) for x, r in zip(p, resources)]
    expected = request_to_json(encode_spans_fast([encode_record(x, r) for x, r in zip(p, resources)]))
    line = spans_line(spans, MAX)
    assert line == expected
    assert '"schemaUrl":"https://schema/1"' in line
    # a line over the request size limit is left to the protobuf path (which splits the request)
    assert spans_line(spans, len(expected)) == expected
    assert spans_line(spans, len(expected) - 1) is None
    # anything but text spans (an agent's own span, bytes only): the protobuf path
    assert spans_line([*spans[:2], encode_record(p[2], RESOURCE)], MAX) is None
    assert spans_line([], MAX) is None


def test_the_span_files_get_the_text_path_and_the_same_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lossless processor writing the span files (no spool) writes a batch of text spans as
    their line, without building a request (none is encoded), and the file reads back as the
    spans; with a spool it takes the protobuf path."""
    from exporters.otlp import batch_sender
    from exporters.otlp.processor import LosslessSpanProcessor
    from exporters.otlp.spool import Spool
    from exporters.otlp.transport import FileSender

    payloads = [_payload(_record(span_id=i + 1, name=f"s{i}", attrs={"i": i, "m": "demo"})) for i in range(40)]
    encoded: list[int] = []
    real_encode = batch_sender.encode_spans
    monkeypatch.setattr(batch_sender, "encode_spans", lambda batch: encoded.append(len(batch)) or real_encode(batch))
    processor = LosslessSpanProcessor(FileSender(tmp_path / "spans", max_file_bytes=1 << 20, max_files=4), spool=None)
    assert processor.takes_text
    ticket = processor.submit([encode_record_text(p, RESOURCE) for p in payloads])
    assert ticket is not None and processor.wait_settled(ticket, 10.0)
    processor.shutdown(5)
    assert encoded == []
    assert processor.statistics().exported == 40
    (path,) = (tmp_path / "spans").iterdir()
    assert path.read_text() == _old_line(payloads) + "\n"
    assert [s.name for r in read_otlp_json_lines(path) for s in r.resource_spans[0].scope_spans[0].spans] == [f"s{i}" for i in range(40)]
    with_spool = LosslessSpanProcessor(FileSender(tmp_path / "s2", max_file_bytes=1 << 20, max_files=4),
                                       spool=Spool(tmp_path / "spool", max_bytes=1 << 20))
    try:
        assert not with_spool.takes_text
    finally:
        with_spool.shutdown(1)


def test_the_shipper_hands_text_spans_only_to_a_processor_that_takes_text(tmp_path: Path) -> None:
    from exporters.otlp.shipper import SpanShipper

    class Takes:
        takes_text = True

        def submit(self, spans: Any) -> int:
            return 0

    class Bytes(Takes):
        takes_text = False

    assert SpanShipper(Takes(), host_name="h", directory=tmp_path)._decode is encode_record_text  # type: ignore[arg-type]
    assert SpanShipper(Bytes(), host_name="h", directory=tmp_path)._decode is encode_record  # type: ignore[arg-type]


@pytest.mark.parametrize("text", [True, False])
def test_a_failed_write_is_counted_as_before(tmp_path: Path, text: bool) -> None:
    """A span file that cannot be written (its folder is a file): the batch is counted dropped and
    the failure said, whether the batch was written as text spans' line or as a request."""
    from exporters.otlp.processor import LosslessSpanProcessor
    from exporters.otlp.transport import FileSender

    blocked = tmp_path / "spans"
    blocked.write_text("not a folder")
    payloads = [_payload(_record(span_id=i + 1, name=f"s{i}")) for i in range(5)]
    encode = encode_record_text if text else encode_record
    processor = LosslessSpanProcessor(FileSender(blocked, max_file_bytes=1 << 20, max_files=4), spool=None)
    try:
        ticket = processor.submit([encode(p, RESOURCE) for p in payloads])
        assert ticket is not None and processor.wait_settled(ticket, 10.0)
        stats = processor.statistics()
        assert (stats.exported, stats.dropped, stats.export_failures) == (0, 5, 1)
        assert "file" in processor.last_error
    finally:
        processor.shutdown(1)


def test_a_line_still_being_written_at_the_shutdown_deadline_is_counted_dropped(tmp_path: Path) -> None:
    """Shutdown abandons a worker stuck writing a batch's line (no spool to keep it in): the
    batch is settled as dropped, and the late write's answer changes nothing."""
    import threading

    from exporters.otlp.processor import LosslessSpanProcessor
    from exporters.otlp.transport import FileSender, SendResult

    started, release = threading.Event(), threading.Event()

    class StuckFiles(FileSender):
        def send_line(self, line: str, spans: int, *, timeout_s: float) -> SendResult:
            started.set()
            release.wait(10)
            return super().send_line(line, spans, timeout_s=timeout_s)

    sender = StuckFiles(tmp_path / "spans", max_file_bytes=1 << 20, max_files=4)
    processor = LosslessSpanProcessor(sender, spool=None, schedule_delay_s=0.01)
    try:
        ticket = processor.submit([encode_record_text(_payload(_record(span_id=i + 1)), RESOURCE) for i in range(5)])
        assert ticket is not None and started.wait(10)
        processor.shutdown(0.2)
        stats = processor.statistics()
        assert (stats.exported, stats.dropped) == (0, 5)
        assert processor.settled() >= ticket
    finally:
        release.set()
        processor._thread.join(10)  # the abandoned worker's late write opens a file: close it (no leak into later tests)
        sender.close()
