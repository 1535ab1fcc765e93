"""The SDK's span channel: spans recorded in the server land in its ring while an agent polls it,
fall back (OTel path or counted drop) when none does, and never block."""

from __future__ import annotations

import json
import os
import stat
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import sdk
from agent.sdk import channel
from agent.sdk import ring as _ring


@pytest.fixture
def fresh_channel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A private ring folder and a channel that (re)reads its settings at the next span."""
    monkeypatch.setenv("SERVEWATCH_SHM_DIR", str(tmp_path))
    channel.close()
    channel._state = 0
    yield tmp_path
    channel.close()
    channel._state = 0


def _attach() -> _ring.RingReader:
    reader = _ring.RingReader(os.getpid(), trusted_uids={os.geteuid()})
    reader.heartbeat()
    return reader


def test_no_agent_falls_back_to_the_otel_path_and_counts_it(fresh_channel: Path, exporter) -> None:
    with sdk.request_span("r-1", model="m") as req, sdk.forward_span([req]):
        pass
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["chat m", "forward"]
    stats = channel.statistics()
    assert stats["fallback_spans"] == 2 and stats["written"] == 0 and stats["attached"] == 0
    path = _ring.ring_path(os.getpid(), fresh_channel)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()


def test_attached_agent_gets_the_spans_and_the_server_exports_nothing(fresh_channel: Path, exporter) -> None:
    channel.ring()
    reader = _attach()
    try:
        with sdk.request_span("r-2", model="m", max_tokens=8, input_tokens=3) as req:
            with sdk.forward_span([req, ("0" * 31 + "1", "0" * 15 + "2")]) as fwd:
                assert fwd.is_recording()
            req.set_output_tokens(5)
        with pytest.raises(ValueError), sdk.request_span("r-3", model="m"):
            raise ValueError("boom")
        assert exporter.get_finished_spans() == ()
        records = [json.loads(p) for p in reader.read()]
    finally:
        reader.close()
    assert [r[0] for r in records] == ["forward", "chat m", "chat m"]
    fwd_rec, req_rec, err_rec = records
    assert f"{req_rec[2]:032x}" == req.trace_id and f"{req_rec[3]:016x}" == req.span_id
    assert req_rec[1] == 0 and req_rec[4] == 0  # INTERNAL (GenAI semconv, model in-process), root
    assert req_rec[7] == {
        "gen_ai.operation.name": "chat", "gen_ai.response.id": "r-2", "gen_ai.request.model": "m",
        "gen_ai.request.max_tokens": 8, "gen_ai.usage.input_tokens": 3, "gen_ai.usage.output_tokens": 5,
    }
    assert fwd_rec[11] == [[req_rec[2], req_rec[3], {"gen_ai.response.id": "r-2"}], [1, 2, {}]]
    assert fwd_rec[7]["servewatch.forward.batch_size"] == 2
    assert err_rec[8] == 2 and err_rec[9] == "ValueError: boom"
    assert err_rec[10][0][0] == "exception" and err_rec[10][0][2]["exception.type"] == "ValueError"
    assert channel.statistics()["written"] == 3


def test_detach_falls_back_at_once(fresh_channel: Path, exporter) -> None:
    channel.ring()
    reader = _attach()
    reader.close()  # a clean agent exit zeroes the heartbeat
    with sdk.request_span("r-4"):
        pass
    assert len(exporter.get_finished_spans()) == 1


def test_a_span_open_when_the_agent_leaves_is_exported_by_the_server_with_its_ids(fresh_channel: Path, exporter) -> None:
    """The incident links to a request in flight; the agent stops before the request ends: the
    span must still reach the collector, with the ids the incident links to (issue 11)."""
    channel.ring()
    reader = _attach()
    with sdk.request_span("r-late", model="m") as req:
        req.set_output_tokens(1)
        reader.close()  # the agent exits (last drain done) while the request is still open
    (span,) = exporter.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == req.trace_id and f"{span.context.span_id:016x}" == req.span_id
    assert span.name == "chat m" and span.attributes["gen_ai.usage.output_tokens"] == 1
    assert span.instrumentation_scope.name == "servewatch.sdk"
    assert channel.statistics()["written"] == 0


def test_fallback_drop_counts_and_records_nothing(fresh_channel: Path, monkeypatch: pytest.MonkeyPatch, exporter) -> None:
    monkeypatch.setenv(channel.ENV_FALLBACK, "drop")
    with sdk.request_span("r-5") as req, sdk.forward_span([req]):
        pass
    assert exporter.get_finished_spans() == ()
    assert req.trace_id != "0" * 32  # the agent can still link to it (in-flight ids)
    assert channel.statistics()["dropped_no_agent"] == 2
    reader = _ring.RingReader(os.getpid(), trusted_uids={os.geteuid()})
    try:
        assert reader.statistics().dropped_no_agent == 2  # visible to the agent too
    finally:
        reader.close(detach=False)


def test_channel_off_makes_no_ring(fresh_channel: Path, monkeypatch: pytest.MonkeyPatch, exporter) -> None:
    monkeypatch.setenv(channel.ENV_CHANNEL, "0")
    with sdk.request_span("r-6"):
        pass
    assert len(exporter.get_finished_spans()) == 1
    assert not _ring.ring_path(os.getpid(), fresh_channel).exists()


def test_full_ring_drops_and_counts_never_blocks(fresh_channel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(channel.ENV_RING_BYTES, "4096")
    channel.ring()
    reader = _attach()
    try:
        for i in range(200):  # ~250 bytes each: far more than 4 KiB, and nobody reads
            with sdk.request_span(f"r-{i}", model="m"):
                pass
        stats = channel.statistics()
        assert stats["written"] > 0 and stats["dropped_full"] > 0
        assert stats["written"] + stats["dropped_full"] == 200
        assert reader.statistics().dropped_full == stats["dropped_full"]
        got = reader.read()
        assert len(got) == stats["written"]
        # space is free again after the read: the ring wraps and keeps going
        for i in range(30):
            with sdk.request_span(f"again-{i}", model="m"):
                pass
        more = [json.loads(p)[7]["gen_ai.response.id"] for p in reader.read()]
        assert more[:3] == ["again-0", "again-1", "again-2"]
        assert reader.corrupt == 0
    finally:
        reader.close()


def test_torn_record_is_counted_corrupt_and_skipped(tmp_path: Path) -> None:
    path = _ring.ring_path(os.getpid(), tmp_path)  # in this user's private folder
    writer = _ring.RingWriter(8192, path=path)
    try:
        reader = _ring.RingReader(os.getpid(), trusted_uids={os.geteuid()}, directory=tmp_path)
        assert writer.write(b'["a"]') and writer.write(b'["b"]')
        data_at = _ring.HEADER_BYTES + _ring.META_BYTES
        writer._buf[data_at + 8] ^= 0xFF  # damage the first payload
        assert reader.read() == [b'["b"]']
        assert reader.corrupt == 1
        reader.close()
    finally:
        writer.close()


def test_reader_trusts_only_a_private_regular_file_of_the_target(tmp_path: Path) -> None:
    pid = os.getpid()
    path = _ring.ring_path(pid, tmp_path)  # in this user's private folder (agent.sdk.folders)
    folder = path.parent
    real = folder / "elsewhere"
    writer = _ring.RingWriter(8192, path=real)
    try:
        path.symlink_to(real)
        with pytest.raises(_ring.RingError, match="cannot open"):  # O_NOFOLLOW
            _ring.RingReader(pid, trusted_uids={os.geteuid()}, directory=tmp_path)
        path.unlink()
        os.link(real, path)
        with pytest.raises(_ring.RingError, match="links"):
            _ring.RingReader(pid, trusted_uids={os.geteuid()}, directory=tmp_path)
        path.unlink()
    finally:
        writer.close()
    writer = _ring.RingWriter(8192, path=path)
    try:
        with pytest.raises(_ring.RingError, match="not the target"):
            _ring.RingReader(pid, trusted_uids={os.geteuid() + 1}, directory=tmp_path)
        os.chmod(path, 0o644)
        with pytest.raises(_ring.RingError, match="group/others"):
            _ring.RingReader(pid, trusted_uids={os.geteuid()}, directory=tmp_path)
        os.chmod(path, 0o600)
        os.rename(path, folder / "servewatch-spans.1")  # a ring claiming another pid (pid 1: root's, as we are)
        with pytest.raises(_ring.RingError, match="not 1"):
            _ring.RingReader(1, trusted_uids={os.geteuid()}, directory=tmp_path)
        writer.path = folder / "servewatch-spans.1"
    finally:
        writer.close()


def test_writer_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = tmp_path / f"servewatch-spans.{os.getpid()}"
    path.symlink_to(victim)
    writer = _ring.RingWriter(8192, path=path)  # our own link: removed, then created O_EXCL
    try:
        assert victim.read_text() == "keep"
        assert not path.is_symlink()
    finally:
        writer.close()


def test_forked_child_does_not_write_the_parent_ring(fresh_channel: Path) -> None:
    channel.ring()
    reader = _attach()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                with sdk.request_span("child"):
                    pass
                os._exit(0 if channel.ring() is None or channel.ring().pid == os.getpid() else 1)
            finally:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert reader.read() == []
    finally:
        reader.close()
        _ring.ring_path(pid, fresh_channel).unlink(missing_ok=True)


def test_records_no_agent_shipped_are_counted_when_the_server_closes_its_ring(fresh_channel: Path, exporter) -> None:
    """An agent took records but was killed before releasing them: while no agent is attached
    they are counted dropped_no_agent when the ring goes away (at exit), never silently."""
    channel.ring()
    reader = _attach()
    for i in range(3):
        with sdk.request_span(f"r-{i}"):
            pass
    assert len(reader.take().payloads) == 3  # taken, never committed: the agent dies here
    reader.close()  # its heartbeat is gone (a SIGKILLed one goes stale after SERVEWATCH_SPAN_STALE_S)
    writer = channel.ring()
    assert writer is not None and writer.unread_records() == 3
    before = channel._dropped_no_agent  # this process's count, kept after the ring is gone
    channel.close()
    assert channel.statistics()["dropped_no_agent"] == before + 3


def test_an_attached_agent_keeps_the_records_at_close(fresh_channel: Path, exporter) -> None:
    channel.ring()
    reader = _attach()
    try:
        with sdk.request_span("r-kept"):
            pass
        before = channel._dropped_no_agent  # this process's count, kept after the ring is gone
        channel.close()
        assert channel.statistics()["dropped_no_agent"] == before
        assert len(reader.read()) == 1  # the agent drains the file it holds open
    finally:
        reader.close()


def _raise_deep(depth: int) -> None:
    if depth:
        _and_deeper(depth - 1)  # two functions in turn: Python collapses only repeats of one frame
    raise RuntimeError("the final error line, what the on-call reads first")


def _and_deeper(depth: int) -> None:
    _raise_deep(depth)


def test_exception_stacktrace_fits_tempo_limit_and_keeps_the_error_line(fresh_channel: Path) -> None:
    # Tempo keeps the first 2,048 bytes of a string attribute: a deep trace must fit, with its
    # header, its innermost frames and the error line at the end.
    channel.ring()
    reader = _attach()
    try:
        with pytest.raises(RuntimeError), sdk.request_span("r-deep", model="m"):
            _raise_deep(60)
        [record] = [json.loads(p) for p in reader.read()]
    finally:
        reader.close()
    [[name, _ts, attrs]] = record[10]
    trace_text = attrs["exception.stacktrace"]
    assert name == "exception"
    assert len(trace_text.encode()) <= channel.MAX_STACKTRACE_BYTES == 2048
    lines = trace_text.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: the final error line, what the on-call reads first"
    assert any(line.startswith("  ... ") and line.endswith(" frame(s) omitted ...") for line in lines)
    assert 'raise RuntimeError("the final error line, what the on-call reads first")' in trace_text  # the innermost frame
    # a short trace is kept whole, in Python's own format
    try:
        _raise_deep(1)
    except RuntimeError as exc:
        assert channel.bounded_stacktrace(exc) == "".join(traceback.format_exception(exc))
        assert channel.bounded_stacktrace(RuntimeError("x" * 5000)) == "RuntimeError: " + "x" * (2048 - 14)


def test_the_servers_own_otel_export_bounds_the_stacktrace_too(fresh_channel: Path, exporter) -> None:
    # no agent attached: the span goes through the server's OTel SDK, whose record_exception
    # writes the whole trace; the SDK gives it the bounded one
    with pytest.raises(RuntimeError), sdk.request_span("r-deep-otel", model="m"):
        _raise_deep(60)
    [span] = exporter.get_finished_spans()
    [event] = span.events
    trace_text = event.attributes["exception.stacktrace"]
    assert len(trace_text.encode()) <= 2048
    assert trace_text.splitlines()[-1] == "RuntimeError: the final error line, what the on-call reads first"
