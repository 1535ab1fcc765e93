"""The agent ships what servers record: real server processes using agent.sdk, the span ring,
the agent's lossless processor, a real OTLP receiver."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.resources import Resource

from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings
from agent.sdk import ring as _ring
from agent.watchers.status import WatcherState, read_status_file, status_path
from exporters.otlp.encode import EncodedSpan
from exporters.otlp.provider import ExportConfig, build_telemetry
from exporters.otlp.shipper import MAX_REFUSED, SpanShipper, decode_record
from tests.conftest import PROGRAMS_DIR
from tests.otlp_receiver import OtlpReceiver
from tests.sdk._helpers import read_line

SPAN_SERVER = str(PROGRAMS_DIR / "span_server.py")


def _start(spawn, shm: Path, *args: str, env: dict[str, str] | None = None, argv0: list[str] | None = None) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "OTEL_SERVICE_NAME": "tiny-llm",
                "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,service.version=1.2", **(env or {})}
    full_env["PYTHONPATH"] = str(PROGRAMS_DIR.parent.parent)
    proc = spawn([*(argv0 or []), sys.executable, SPAN_SERVER, *args], env=full_env, stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    assert read_line(proc).startswith("ready")
    return proc


def _ask(proc: subprocess.Popen[bytes]) -> dict:
    assert proc.stdin is not None
    proc.stdin.write(b"stats\n")
    proc.stdin.flush()
    return json.loads(read_line(proc, timeout_s=30))


def _leftover(pid: int, directory: Path) -> int:
    """Records still unread in ``pid``'s ring (read without attaching)."""
    reader = _ring.RingReader(pid, trusted_uids={os.geteuid()}, directory=directory)
    try:
        return len(reader.read())
    finally:
        reader.close(detach=False)


def _poll_until(shipper: SpanShipper, predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, shipper.statistics()
        shipper.poll()
        time.sleep(0.05)


def test_server_spans_reach_the_collector_under_the_server_resource(
    spawn, tmp_path: Path, otlp_receiver: OtlpReceiver
) -> None:
    proc = _start(spawn, tmp_path, "--rate", "200", "--error-every", "7")
    telemetry = build_telemetry(
        ExportConfig(endpoint=otlp_receiver.endpoint("grpc"), protocol="grpc", metrics=False),
        data_dir=tmp_path / "data", host_name="node-a",
    )
    shipper = SpanShipper(telemetry.processor, host_name="node-a", directory=tmp_path)
    try:
        assert shipper.attach(proc.pid, os.geteuid())
        _poll_until(shipper, lambda: shipper.statistics().shipped >= 200)
        shipper.close()  # detaches: the server falls back to its own (no-op) path
        time.sleep(0.5)  # spans open at the detach end and land in the ring
        leftover = _leftover(proc.pid, tmp_path)
        server = _ask(proc)
        telemetry.processor.flush(10)
        got = otlp_receiver.spans()
    finally:
        telemetry.shutdown(5)
    stats = shipper.statistics()
    assert stats.corrupt == stats.invalid == stats.dropped_full == 0
    assert server["heavy_modules"] == []  # the server never loaded an encoder or a network client
    # every span written to the ring was shipped, or is still there (open at the detach)
    assert server["channel"]["written"] == stats.shipped + leftover and leftover <= 2
    assert server["channel"]["attached"] == 0 and server["channel"]["fallback_spans"] >= stats.fallback_spans
    assert len(got) == stats.shipped
    resources = {json.dumps(s.resource, sort_keys=True) for s in got}
    assert len(resources) == 1
    resource = got[0].resource
    assert resource["service.name"] == "tiny-llm" and resource["process.pid"] == proc.pid
    assert resource["host.name"] == "node-a" and resource["deployment.environment"] == "test"
    assert {s.scope for s in got} == {"servewatch.sdk"}
    requests = {s.span_id: s for s in got if s.name == "chat tiny"}
    forwards = [s for s in got if s.name == "forward"]
    assert requests and forwards
    linked = [fw for fw in forwards if fw.span.links and fw.span.links[0].span_id.hex() in requests]
    assert len(linked) >= len(forwards) - 1  # the last forward's request may still be open
    one = next(iter(requests.values()))
    assert one.attributes["gen_ai.operation.name"] == "chat" and one.attributes["gen_ai.usage.output_tokens"] == 4
    assert one.attributes["gen_ai.request.model"] == "tiny" and one.attributes["gen_ai.usage.input_tokens"] == 3
    errors = [s for s in requests.values() if s.span.status.code == 2]
    assert errors and all(e.span.events[0].name == "exception" for e in errors)
    assert all(s.span.kind == 1 for s in requests.values())  # SPAN_KIND_INTERNAL (GenAI semconv, model in-process)


#: A ring writer nobody can run: the system interpreter, stdlib only (the venv may sit behind a
#: 0700 home). It writes one valid span record a millisecond until killed.
_NOBODY_WRITER = (
    "import sys, time, json; from agent.sdk.ring import RingWriter;"
    "w = RingWriter(65536, metadata={'resource': {'service.name': 'nobody-svc'}}); print('ready', flush=True);"
    "i = 0\n"
    "while True:\n"
    "    i += 1; w.write(json.dumps(['chat', 1, i, i, 0, 1, 2, {}, 0, '', [], []]).encode()); time.sleep(0.001)"
)


def test_ring_of_another_uid_is_refused_and_the_targets_uid_accepted(spawn, request: pytest.FixtureRequest) -> None:
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root (and /usr/bin/python3) to run the server as uid 65534")
    shm = Path(tempfile.mkdtemp(prefix="sw-ring-", dir="/tmp"))
    os.chown(shm, 65534, 65534)
    request.addfinalizer(lambda: shutil.rmtree(shm, ignore_errors=True))
    setpriv = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    env = {"PATH": os.environ.get("PATH", ""), "SERVEWATCH_SHM_DIR": str(shm), "PYTHONPATH": str(PROGRAMS_DIR.parent.parent)}
    proc = spawn([*setpriv, "/usr/bin/python3", "-c", _NOBODY_WRITER], env=env, stdout=subprocess.PIPE)
    assert read_line(proc).startswith("ready")
    assert os.stat(_ring.ring_path(proc.pid, shm)).st_uid == 65534
    collected: list = []

    class Collect:
        def on_end(self, span) -> None:
            collected.append(span)

    shipper = SpanShipper(Collect(), host_name="h", directory=shm)  # type: ignore[arg-type]
    assert not shipper.attach(proc.pid, 1000)  # "the target is uid 1000": the file is not its
    assert shipper.attach(proc.pid, 65534)
    _poll_until(shipper, lambda: len(collected) >= 10)
    # killed before its exit handler: the agent drains the ring, then removes it from tmpfs
    os.kill(proc.pid, 9)
    proc.wait(10)
    _poll_until(shipper, lambda: not shipper.attached_pids())
    assert not _ring.ring_path(proc.pid, shm).exists()
    assert shipper.statistics().shipped == len(collected)
    shipper.close()
    assert {s.resource.attributes["process.pid"] for s in collected} == {proc.pid}
    assert {s.resource.attributes["service.name"] for s in collected} == {"nobody-svc"}


@pytest.mark.parametrize("lossless", [False, True], ids=["span-processor", "lossless-submit"])
def test_invalid_records_are_counted_never_exported(tmp_path: Path, lossless: bool) -> None:
    """Through a plain SpanProcessor (``decode_record``: ReadableSpans) and through the lossless
    processor's ``submit`` (``exporters.otlp.wire.encode_record``: encoded spans)."""
    path = _ring.ring_path(os.getpid(), tmp_path)
    writer = _ring.RingWriter(65536, path=path, metadata={"resource": {"service.name": "x", "process.pid": 1}})
    sent: list = []

    class Collect:
        def on_end(self, span) -> None:
            sent.append(span)

    class Submit(Collect):  # the lossless processor's side of the shipper's contract
        def submit(self, spans) -> int:
            sent.extend(spans)
            return len(sent)

        def room(self) -> int:
            return 1 << 20

        def settled(self) -> int:
            return len(sent)

    shipper = SpanShipper(Submit() if lossless else Collect(), host_name="h", directory=tmp_path)  # type: ignore[arg-type]
    try:
        assert shipper.attach(os.getpid(), os.geteuid())
        good = [["ok", 0, 5, 6, 0, 10, 20, {"a": [1, 2]}, 0, "", [], []]]
        for payload in (
            json.dumps(good[0]), "not json", json.dumps(["short"]), json.dumps(["n", 0, 0, 6, 0, 1, 2, {}, 0, "", [], []]),
            json.dumps(["n", 9, 5, 6, 0, 1, 2, {}, 0, "", [], []]), json.dumps(["n", 0, 5, 6, 0, 1, 2, {"x": {"y": 1}}, 0, "", [], []]),
            json.dumps(["n", 0, 5, 6, 0, 1, 2, {"x": [1, "a"]}, 0, "", [], []]),
            json.dumps(["n", [], 5, 6, 0, 1, 2, {}, 0, "", [], []]),  # unhashable kind (was a TypeError)
            '["n",0,5,6,0,1,2,{"x":' + "[" * 3000 + "1" + "]" * 3000 + '},0,"",[],[]]',  # JSON past the recursion limit
            json.dumps(["ok2", 0, 5, 7, 0, 10, 20, {}, 0, "", [], []]),
        ):
            assert writer.write(payload.encode())
        shipper.poll()
        stats = shipper.statistics()
        # one bad record never loses its batch: the good ones around it are shipped
        assert [s.name for s in sent] == ["ok", "ok2"] and stats.invalid == 8 and stats.shipped == 2
        assert sent[0].resource.attributes["process.pid"] == os.getpid()  # not what the file claims
        if lossless:
            assert isinstance(sent[0], EncodedSpan)
            values = {kv.key: kv.value for kv in Span.FromString(sent[0].data).attributes}
            assert [v.int_value for v in values["a"].array_value.values] == [1, 2]
        else:
            assert sent[0].attributes["a"] == (1, 2)
    finally:
        shipper.close()
        writer.close()


def test_decode_keeps_ids_times_links_and_error_status() -> None:
    rec = ["forward", 0, 2**100, 7, 9, 100, 90, {"k": "v"}, 2, "boom", [["exception", 95, {"exception.type": "E"}]],
           [[3, 4, {"gen_ai.response.id": "r"}]]]
    span = decode_record(json.dumps(rec).encode(), Resource({"service.name": "s"}))
    assert span.context.trace_id == 2**100 and span.context.span_id == 7 and span.parent.span_id == 9
    assert span.start_time == 100 and span.end_time == 100  # never ends before it starts
    assert span.status.status_code.name == "ERROR" and span.status.description == "boom"
    assert span.links[0].context.trace_id == 3 and span.links[0].attributes["gen_ai.response.id"] == "r"
    assert span.events[0].name == "exception"


async def test_agent_ships_a_watched_servers_spans_and_counts_its_drops(
    spawn, tmp_path: Path, otlp_receiver: OtlpReceiver
) -> None:
    shm = Path(os.environ["SERVEWATCH_SHM_DIR"])
    # a tiny ring the agent drains a few times a second: some spans must be dropped, and counted.
    # 4 KiB holds ~3 records, so each drain ships ~3: 60 shipped is ~20 drains (~10 s), each one
    # behind a full ring (300 took ~50 s and proved nothing more)
    proc = _start(spawn, shm, "--rate", "400", env={"SERVEWATCH_SPAN_RING_BYTES": "4096"})
    settings = load_settings(
        {
            "data_dir": tmp_path,
            "host_name": "node-b",
            "target": {"pids": [proc.pid]},
            "coredump": {"enabled": False},
            "spans": {"poll_interval_s": 0.5},
            "export": {"endpoint": otlp_receiver.endpoint("http/protobuf"), "protocol": "http/protobuf", "metrics": False},
        }
    )
    agent = Agent(settings)
    nice_of_drain: list[int] = []
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            while (
                agent.shipper.statistics().shipped < 60
                or agent.shipper.statistics().dropped_full == 0
                or "dropped" not in getattr(agent.status.get("spans"), "reason", "")
            ):
                await anyio.sleep(0.1)
            drain = agent.shipper._thread
            nice_of_drain.append(os.getpriority(os.PRIO_PROCESS, drain.native_id))
            agent.stop()
    # rings are drained on a background-priority thread: the served process comes first
    assert nice_of_drain == [max(10, os.getpriority(os.PRIO_PROCESS, 0))]
    await anyio.sleep(0.5)
    leftover = _leftover(proc.pid, shm)
    # `servewatch status` shows the shipping counts, server-side drops included
    spans_status = read_status_file(status_path(tmp_path, "node-b")).get("spans")
    assert spans_status is not None and spans_status.state is WatcherState.READY
    assert re.search(r"\d+ shipped; dropped [1-9]\d* \(ring full [1-9]", spans_status.reason), spans_status.reason
    server = _ask(proc)
    stats = agent.shipper.statistics()
    assert otlp_receiver.wait_for_spans(stats.shipped, timeout_s=10)
    got = otlp_receiver.spans()
    assert len(got) == stats.shipped
    assert {s.resource["process.pid"] for s in got} == {proc.pid}
    assert {s.resource["service.name"] for s in got} == {"tiny-llm"}
    # drops are counted on both sides and agree
    assert stats.dropped_full > 0 and server["channel"]["dropped_full"] >= stats.dropped_full
    assert server["channel"]["written"] == stats.shipped + leftover
    assert server["channel"]["attached"] == 0  # the agent detached at stop: the server falls back


def test_refused_rings_of_exited_processes_are_forgotten_past_the_bound(spawn, tmp_path: Path) -> None:
    # rings the shipper will not trust (group-readable) for pids that do not exist any more: the
    # refusals of exited processes go, a live one (a real process) stays
    live = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = [
        int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True, timeout=60).stdout)
        for _ in range(3)
    ]
    dead = exited + [4_194_304 + i for i in range(MAX_REFUSED + 50)]  # exited pids, then ones above any pid_max
    from agent.sdk.folders import own_dir

    own_dir(tmp_path)  # our user's private folder: where the rings of our uid (and of gone pids) are looked for
    for pid in [live.pid, *dead]:
        path = _ring.ring_path(pid, tmp_path)
        path.write_bytes(b"\0" * 64)
        path.chmod(0o644)
    shipper = SpanShipper(_Discard(), host_name="h", directory=tmp_path)  # type: ignore[arg-type]
    try:
        for pid in [live.pid, *dead]:
            assert not shipper.attach(pid, os.geteuid())
        refused = shipper.refused()
        assert len(refused) <= MAX_REFUSED
        assert "accessible to group/others" in refused[live.pid]
        assert dead[-1] in refused  # the newest refusal is kept
    finally:
        shipper.close()


class _Discard:
    def on_end(self, span) -> None:
        pass


def test_a_target_without_a_ring_is_looked_for_again_when_a_folder_changes(spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watched server with no span ring is not looked for at every poll (each look reads /proc
    and lists the SDK's folders): again at the first poll after a file is created in a folder,
    and at least every ``ABSENT_RETRY_S``."""
    from agent.sdk.ring import RingError
    from exporters.otlp import shipper as shipper_mod

    server = spawn([sys.executable, "-c", "import time; time.sleep(120)"])
    folder = tmp_path / f"servewatch-{os.geteuid()}"
    folder.mkdir(mode=0o700)
    old = time.time() - 60
    for path in (folder, tmp_path):
        os.utime(path, (old, old))
    looks: list[int] = []

    def no_ring(pid: int, **_: object) -> None:
        looks.append(pid)
        raise RingError(f"no span ring at {folder / f'servewatch-spans.{pid}'}")

    monkeypatch.setattr(shipper_mod, "RingReader", no_ring)
    monkeypatch.setattr(shipper_mod._presence.Declarations, "update", lambda self, targets: [])
    shipper = SpanShipper(SpanProcessorStub(), host_name="node-a", directory=tmp_path)
    try:
        shipper.watch({server.pid: os.geteuid()})
        for _ in range(5):
            shipper.poll()
        assert looks == [server.pid]
        (folder / "servewatch-spans.other").write_bytes(b"")  # a file created in its folder
        os.utime(folder, (old + 1, old + 1))
        shipper.poll()
        shipper.poll()
        assert looks == [server.pid] * 2
        monkeypatch.setattr(shipper_mod, "ABSENT_RETRY_S", 0.0)
        shipper.poll()
        assert looks == [server.pid] * 3
    finally:
        shipper.close()


class SpanProcessorStub:
    """A span processor that takes nothing (no ring is ever attached here)."""

    def on_end(self, span: object) -> None:
        raise AssertionError("no span expected")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def test_an_idle_rings_polls_space_out_to_one_a_second_and_a_span_restores_the_interval() -> None:
    from exporters.otlp.shipper import IDLE_POLL_MAX_S, next_poll_wait_s

    waits, wait = [], 0.25
    for _ in range(5):  # polls that find nothing
        wait = next_poll_wait_s(0.25, wait, 0)
        waits.append(wait)
    assert waits == [0.5, 1.0, 1.0, 1.0, 1.0] and IDLE_POLL_MAX_S == 1.0
    assert next_poll_wait_s(0.25, 1.0, 3) == 0.25  # a span back: the configured interval at once
    assert next_poll_wait_s(2.0, 2.0, 0) == 2.0  # a longer configured interval stands
