"""The spool's rejected folder against a collector that refuses everything (issue 34, item 6).

Batches a collector refuses permanently are kept under ``spool/rejected/``. Before, its cap
counted the bytes written: a collector refusing every batch of a quiet server (one tiny batch
after another) filled the disk with files of a few bytes that each take a 4 KiB block, and an
earlier run's 100,000 rejected files (406 MB on disk) counted as 600 KB, stayed forever, and a
replay of the folder wrote one warning line per torn file. Now the folder is capped by the blocks
its files take and by a file count (at open too), what is deleted is counted and said in one
line, and a replay says unreadable files in one line past the first few.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from exporters.otlp import spool as spool_module
from exporters.otlp.replay import replay
from exporters.otlp.spans import build_span, new_trace_id
from exporters.otlp.spool import Spool
from exporters.otlp.transport import Delivery, SendResult
from tests.security._attack import needs_root

pytestmark = needs_root

#: An earlier run's rejected files (the issue's figure), 6 bytes each.
EARLIER = 100_000
#: Files ``rejected/`` keeps at most by default (``exporters.otlp.spool.REJECTED_MAX_FILES``).
REJECTED_MAX_FILES = 10_000
#: A valid 6-byte ExportTraceServiceRequest (one empty resource), and a torn one.
TINY, TORN = b"\n\x04\n\x02\n\x00", b"\xff\xff\xff\xff\xff\xff"


def _usage(folder: Path) -> tuple[int, int]:
    """``(files, bytes on disk)`` of ``folder``: what ``du`` would say, allocated blocks."""
    files = size = 0
    with os.scandir(folder) as it:
        for item in it:
            st = item.stat(follow_symlinks=False)
            files, size = files + 1, size + st.st_blocks * 512
    return files, size


@pytest.fixture
def data_dir(shared_tmpfs: Path) -> Iterator[Path]:
    """The agent's private data dir on a real tmpfs (its blocks are what fills the disk)."""
    root = shared_tmpfs / "data"
    root.mkdir(mode=0o700)
    root.chmod(0o700)
    yield root


def test_a_collector_refusing_every_tiny_batch_cannot_fill_the_disk_through_rejected(data_dir: Path) -> None:
    spool = Spool(data_dir / "h" / "spool", max_bytes=8 * 1024 * 1024)
    try:
        for i in range(3000):  # what the processor does with each batch the collector refuses permanently
            spool.add_rejected(encode_spans([build_span(f"s{i}", trace_id=new_trace_id(), start_time_unix_nano=1_000, end_time_unix_nano=2_000)]), 1)
        files, on_disk = _usage(spool.directory / "rejected")
        stats = spool.statistics()
    finally:
        spool.close()
    print(f"rejected/ after 3000 refused 1-span batches: {files} files, {on_disk} bytes on disk; {stats}")
    # each file takes a 4 KiB block: the 8 MiB cap holds 2048 of them (before: all 3000, 12 MB, "counted" 0.3 MB)
    assert on_disk <= 8 * 1024 * 1024 and files < 3000, (files, on_disk)
    assert stats.rejected_files == files and stats.rejected_disk_bytes == on_disk
    assert stats.rejected_evicted_files == 3000 - files and stats.rejected_evicted_spans == 3000 - files
    assert stats.rejected_spans == 3000 and stats.evicted_spans == 3000 - files


def test_an_earlier_runs_hundred_thousand_rejected_files_are_capped_at_open_and_said(
    data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rejected = data_dir / "h" / "spool" / "rejected"
    rejected.mkdir(parents=True, mode=0o700)
    for seq in range(1, EARLIER + 1):
        fd = os.open(rejected / f"{seq:016d}-1.binpb", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, TORN if seq % 2 else TINY)
        os.close(fd)
    files_before, disk_before = _usage(rejected)
    assert files_before == EARLIER
    with caplog.at_level(logging.WARNING, logger="exporters.otlp.spool"):
        spool = Spool(data_dir / "h" / "spool", max_bytes=1 << 30)  # bytes alone would keep them all
    try:
        stats = spool.statistics()
    finally:
        spool.close()
    files_after, disk_after = _usage(rejected)
    print(f"rejected/: {files_before} files, {disk_before} bytes on disk before open; {files_after} files, {disk_after} after")
    assert files_after == REJECTED_MAX_FILES
    assert getattr(spool_module, "REJECTED_MAX_FILES", None) == REJECTED_MAX_FILES == stats.rejected_files
    assert stats.rejected_evicted_files == EARLIER - REJECTED_MAX_FILES == stats.rejected_evicted_spans
    assert disk_after * (EARLIER // REJECTED_MAX_FILES) <= disk_before
    kept = sorted(p.name for p in rejected.iterdir())
    assert kept[0] == f"{EARLIER - REJECTED_MAX_FILES + 1:016d}-1.binpb"  # the newest kept, the oldest gone
    said = [r.getMessage() for r in caplog.records if "rejected over its cap" in r.getMessage()]
    assert len(said) == 1 and f"deleted the {EARLIER - REJECTED_MAX_FILES} oldest rejected batch file(s)" in said[0], said

    class Collector:  # a replay of the folder (servewatch export) to a collector taking everything
        def send(self, request: object, *, timeout_s: float) -> SendResult:
            return SendResult(Delivery.OK)

        def close(self) -> None:
            pass

    with caplog.at_level(logging.WARNING, logger="exporters.otlp.replay"):
        caplog.clear()
        result = replay([data_dir], endpoint="http://127.0.0.1:9", sender=Collector())
    # the torn half of what is kept is skipped, said in a few lines, not one line per file
    assert result.files == REJECTED_MAX_FILES and result.bad_files == REJECTED_MAX_FILES // 2, result
    assert len([r for r in caplog.records if r.name == "exporters.otlp.replay"]) <= 5
