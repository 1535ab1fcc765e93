"""The spool: FIFO on disk, size cap evicting the oldest (counted), recovery, rejected batches."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from exporters.otlp.otlp_json import read_span_file
from exporters.otlp.spans import build_span, new_trace_id
from exporters.otlp.spool import Spool, disk_bytes


def _batch(n: int, tag: str):
    trace_id = new_trace_id()
    return encode_spans(
        [build_span(f"{tag}-{i}", trace_id=trace_id, start_time_unix_nano=1_000 + i, end_time_unix_nano=2_000 + i) for i in range(n)]
    )


def _names(request) -> list[str]:
    return [s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]


def test_fifo_order_and_exact_removal(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10**7)
    for tag in ("a", "b", "c"):
        assert spool.append(_batch(3, tag), 3) == 0
    seen = []
    while (entry := spool.head()) is not None:
        request = spool.load(entry)
        assert request is not None
        seen.append(_names(request)[0])
        assert spool.remove(entry)
    assert seen == ["a-0", "b-0", "c-0"]
    stats = spool.statistics()
    assert (stats.written_spans, stats.delivered_spans, stats.spans, stats.files) == (9, 9, 0, 0)
    assert list(tmp_path.glob("*.binpb")) == []
    spool.close()


def test_cap_evicts_oldest_and_counts_their_spans(tmp_path: Path) -> None:
    size = len(_batch(4, "x").SerializeToString())  # the spool stores the request's protobuf bytes
    spool = Spool(tmp_path / "s", max_bytes=size * 3 + size // 2)
    evicted = [spool.append(_batch(4, tag), 4) for tag in ("a", "b", "c", "d", "e")]
    assert evicted == [0, 0, 0, 4, 4]
    stats = spool.statistics()
    assert stats.evicted_spans == 8 and stats.files == 3 and stats.spans == 12
    head = spool.head()
    assert head is not None and _names(spool.load(head))[0] == "c-0"  # a and b (oldest) are gone
    spool.close()


def test_batch_bigger_than_the_cap_is_counted_not_written(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=100)
    assert spool.append(_batch(5, "big"), 5) == 5
    assert spool.statistics().evicted_spans == 5 and len(spool) == 0
    spool.close()


def test_reopen_recovers_pending_batches_in_order(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10**7)
    spool.append(_batch(2, "a"), 2)
    spool.append(_batch(3, "b"), 3)
    spool.close()
    again = Spool(tmp_path, max_bytes=10**7)
    assert again.statistics().recovered_spans == 5
    again.append(_batch(1, "c"), 1)
    order = []
    while (entry := again.head()) is not None:
        order.append(_names(again.load(entry))[0])
        again.remove(entry)
    assert order == ["a-0", "b-0", "c-0"]
    again.close()


def test_second_process_on_the_same_dir_gets_its_own_spool(tmp_path: Path) -> None:
    first = Spool(tmp_path, max_bytes=10**6)
    second = Spool(tmp_path, max_bytes=10**6)  # same process, second lock holder
    assert second.directory != first.directory and second.directory.parent == first.directory
    first.close()
    second.close()


def test_unreadable_file_moves_to_rejected(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10**6)
    spool.append(_batch(2, "a"), 2)
    entry = spool.head()
    assert entry is not None
    entry.path.write_bytes(b"\xff\xff\xff\xff\xff")  # a truncated varint: not a protobuf message
    assert spool.load(entry) is None
    assert spool.statistics().rejected_spans == 2 and len(spool) == 0
    assert (tmp_path / "rejected" / entry.path.name).exists()
    spool.close()


def test_rejects_nonpositive_cap(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        Spool(tmp_path, max_bytes=0)


def test_rejected_batches_have_their_own_cap(tmp_path: Path) -> None:
    sample = tmp_path / "sample"
    sample.write_bytes(_batch(4, "x").SerializeToString())
    size = disk_bytes(sample.stat())  # rejected/ counts the blocks its files take on disk
    sample.unlink()
    spool = Spool(tmp_path, max_bytes=size * 2 + size // 2)
    for tag in ("a", "b", "c", "d"):
        spool.add_rejected(_batch(4, tag), 4)
    stats = spool.statistics()
    assert (stats.rejected_spans, stats.evicted_spans) == (16, 8)
    kept = sorted((tmp_path / "rejected").glob("*.binpb"))
    assert len(kept) == 2
    assert [_names(next(read_span_file(p)))[0] for p in kept] == ["c-0", "d-0"]  # the oldest went
    spool.close()


def test_metrics_spool_is_the_same_queue_capped_in_files_and_locked_per_process(tmp_path: Path) -> None:
    """servewatch's own metrics wait in a Spool of their own kind (``.metrics.binpb``): past its
    file cap the oldest export is dropped and its points counted lost; a second exporter on the
    same folder gets a folder of its own; the span spool never takes a metrics file."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    from exporters.otlp.metrics_export import SpoolingMetricExporter
    from exporters.otlp.transport import make_sender

    folder = tmp_path / "metrics-spool"
    first = SpoolingMetricExporter(make_sender("http://127.0.0.1:9", "grpc", signal="metrics"), folder, max_files=2)
    second = SpoolingMetricExporter(make_sender("http://127.0.0.1:9", "grpc", signal="metrics"), folder, max_files=2)
    try:
        assert isinstance(first.spool, Spool) and second.spool_dir != first.spool_dir  # each its own lock
        for points in (5, 6, 7):
            first._spool(ExportMetricsServiceRequest(), points)
        stats = first.statistics()
        assert (stats.spooled, stats.lost, stats.spool_points) == (18, 5, 13)
        assert sorted(p.name.split("-", 1)[1] for p in first.spool_dir.glob("*.metrics.binpb")) == ["6.metrics.binpb", "7.metrics.binpb"]
    finally:
        first.shutdown()
        second.shutdown()
    spans = Spool(first.spool_dir, max_bytes=10**7)  # a span spool there: no metrics file is a span batch
    assert len(spans) == 0
    spans.close()
    again = Spool(folder, max_bytes=10**7, suffix=".metrics.binpb")  # the next start finds both
    assert len(again) == 2 and again.pending_spans == 13
    again.close()


def test_an_unreadable_metrics_spool_file_is_dropped_and_its_points_counted_lost(tmp_path: Path) -> None:
    """A spooled metrics export that no longer parses (disk corruption) must not block the
    exports behind it: dropped, its data points (from its name) counted lost."""
    import time

    from exporters.otlp.metrics_export import SpoolingMetricExporter
    from exporters.otlp.transport import make_sender

    folder = tmp_path / "metrics-spool"
    folder.mkdir(mode=0o700)
    (folder / "0000000000000001-4.metrics.binpb").write_bytes(b"\xff\xff\xff\xff")
    exporter = SpoolingMetricExporter(make_sender("http://127.0.0.1:9", "grpc", signal="metrics"), folder)
    try:
        assert exporter.statistics().spool_points == 4
        assert exporter._replay(time.monotonic() + 1.0)  # nothing left to send
        stats = exporter.statistics()
        assert (stats.lost, stats.spool_points) == (4, 0)
        assert not list(folder.glob("*.metrics.binpb"))
    finally:
        exporter.shutdown()


def test_rejected_is_capped_in_files_too_adopted_ones_included_and_the_deletions_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rejected = tmp_path / "rejected"
    rejected.mkdir(mode=0o700)
    adopted = rejected / "adopted-pid-77-0000000000000001-3.binpb"  # a dead agent's, moved here: the oldest
    adopted.write_bytes(_batch(3, "old").SerializeToString())
    os.utime(adopted, (1, 1))
    with caplog.at_level(logging.WARNING, logger="exporters.otlp.spool"):
        spool = Spool(tmp_path, max_bytes=10**7, max_rejected_files=2)
        assert spool.statistics().rejected_files == 1
        for tag in ("a", "b", "c", "d"):
            spool.add_rejected(_batch(2, tag), 2)
    stats = spool.statistics()
    spool.close()
    assert not adopted.exists() and stats.rejected_files == 2 == len(list(rejected.iterdir()))
    assert (stats.rejected_evicted_files, stats.rejected_evicted_spans, stats.evicted_spans) == (3, 3 + 2 + 2, 7)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "deleted the 1 oldest rejected batch file(s) (3 spans" in said[0], said  # the rest waits a minute


def test_rejected_cap_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_rejected_files"):
        Spool(tmp_path, max_bytes=10, max_rejected_files=0)
