"""Step-counter sources against a real stepping subprocess (the fake server) and its /metrics."""

from __future__ import annotations

import http.server
import itertools
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import anyio
import pytest

from agent.model.bus import RecordingBus
from agent.model.events import StepsAdvanced
from agent.sdk.counter import W_START, SharedCounter, counter_path
from agent.watchers.steps import (
    PRESETS,
    SERIES_FORGET_SCRAPES,
    PrometheusStepSource,
    RecentReading,
    ShmStepSource,
    StepReading,
    StepsWatcher,
    discover_shm_counters,
)
from tests.programs import fake_server
from tests.programs.fake_server import TOKENS_PER_STEP
from tests.watchers import server_env, wait_until


async def _reading(source: ShmStepSource | PrometheusStepSource, *, started: bool = True) -> StepReading:
    """First non-None reading (with forward_ct > 0 when ``started``), bounded."""
    with anyio.fail_after(15):
        while True:
            reading = await source.read()
            if reading is not None and (reading.forward_ct > 0 or not started):
                return reading
            await anyio.sleep(0.01)


async def test_shm_source_follows_a_real_stepping_process(spawn, tmp_path: Path) -> None:
    server = fake_server.start(spawn, env=server_env(tmp_path))
    source = ShmStepSource(server.pid, directory=tmp_path)

    first = await _reading(source)
    assert first.pid == server.pid
    assert first.busy
    assert first.last_progress_monotonic_ns is not None
    assert 0 < first.last_progress_monotonic_ns <= first.read_monotonic_ns
    await wait_until(lambda: (r := source.read_now()) is not None and r.forward_ct > first.forward_ct + 2)
    later = source.read_now()
    assert later is not None and later.last_progress_monotonic_ns is not None
    assert later.last_progress_monotonic_ns > first.last_progress_monotonic_ns

    state = await anyio.to_thread.run_sync(lambda: server.control(mode="freeze"))
    assert state["mode"] == "freeze"
    await anyio.sleep(0.05)  # let a step that raced the control call land
    frozen = source.read_now()
    await anyio.sleep(0.2)
    still = source.read_now()
    assert frozen is not None and still is not None
    assert still.forward_ct == frozen.forward_ct
    assert still.last_progress_monotonic_ns == frozen.last_progress_monotonic_ns
    assert still.busy  # frozen *with work pending*


async def test_shm_source_warmup_reads_busy_without_progress(spawn, tmp_path: Path) -> None:
    server = fake_server.start(spawn, "--warmup-s", "60", env=server_env(tmp_path))
    source = ShmStepSource(server.pid, directory=tmp_path)
    reading = await _reading(source, started=False)
    assert reading.forward_ct == 0
    assert reading.busy
    assert reading.last_progress_monotonic_ns is None


async def test_shm_source_none_when_missing_stale_or_reused(spawn, python, tmp_path: Path) -> None:
    # No file yet: the target has not stepped.
    assert await ShmStepSource(os.getpid(), directory=tmp_path).read() is None

    # A file left behind by a process that is gone.
    dead = spawn([python, "-c", "pass"])
    dead.wait(timeout=30)
    stale = SharedCounter(counter_path(dead.pid, tmp_path), pid=dead.pid)
    try:
        assert await ShmStepSource(dead.pid, directory=tmp_path).read() is None
    finally:
        stale.close()

    # A file whose writer pid is not the pid in its name.
    other = SharedCounter(counter_path(os.getpid(), tmp_path), pid=os.getpid() + 1)
    try:
        assert await ShmStepSource(os.getpid(), directory=tmp_path).read() is None
    finally:
        other.close()

    # A file created before the process now holding the pid started: pid reuse.
    reused = SharedCounter(counter_path(os.getpid(), tmp_path))
    try:
        source = ShmStepSource(os.getpid(), directory=tmp_path)
        assert await source.read() is not None
        reused.words[W_START] = 1_000_000_000  # created in 1970
        assert await source.read() is None
    finally:
        reused.close()


async def test_discover_shm_counters_finds_live_writers_only(spawn, python, tmp_path: Path) -> None:
    server = fake_server.start(spawn, env=server_env(tmp_path))
    dead = spawn([python, "-c", "pass"])
    dead.wait(timeout=30)
    stale = SharedCounter(counter_path(dead.pid, tmp_path), pid=dead.pid)
    try:
        await wait_until(lambda: server.pid in discover_shm_counters(directory=tmp_path))
        found = discover_shm_counters(directory=tmp_path)
        assert found == {server.pid: counter_path(server.pid, tmp_path)}
        assert discover_shm_counters([dead.pid], directory=tmp_path) == {}
        assert discover_shm_counters([server.pid + 1], directory=tmp_path) == {}
    finally:
        stale.close()


@pytest.mark.parametrize(
    ("kwargs", "counter", "gauge"),
    [
        # the fake server has no per-step series: the presets fall back to generated tokens
        ({"preset": "sglang"}, "sglang:generation_tokens_total", "sglang:num_running_reqs + sglang:num_queue_reqs"),
        ({"preset": "vllm"}, "vllm:generation_tokens_total", "vllm:num_requests_running + vllm:num_requests_waiting"),
        ({"preset": None, "counter": "fake:progress_total", "busy_gauge": "fake:busy"}, "fake:progress_total", "fake:busy"),
        # the family name without "_total" (as prometheus_client's parser reports counters)
        ({"preset": "sglang", "counter": "fake:progress", "busy_gauge": "fake:busy"}, "fake:progress", "fake:busy"),
    ],
    ids=["sglang", "vllm", "override", "override-family-name"],
)
async def test_prometheus_source_reads_the_fake_servers_metrics(spawn, tmp_path: Path, kwargs, counter, gauge) -> None:
    server = fake_server.start(spawn, env=server_env(tmp_path))
    source = PrometheusStepSource(server.metrics_url, **kwargs)
    try:
        first = await _reading(source)
        assert (source.counter, source.busy_gauge) == (counter, gauge)
        assert first.busy
        assert first.pid is None
        assert first.last_progress_monotonic_ns == first.read_monotonic_ns  # clock starts at first scrape
        shm = ShmStepSource(server.pid, directory=tmp_path).read_now()
        assert shm is not None
        # summed over both tp_rank label sets: TOKENS_PER_STEP per step, read just before shm
        assert first.forward_ct % TOKENS_PER_STEP == 0
        assert 0 < first.forward_ct <= shm.forward_ct * TOKENS_PER_STEP

        with anyio.fail_after(15):
            while (moved := await source.read()) is None or moved.forward_ct == first.forward_ct:
                await anyio.sleep(0.02)
        assert moved.last_progress_monotonic_ns == moved.read_monotonic_ns

        await anyio.to_thread.run_sync(lambda: server.control(mode="freeze"))
        await anyio.sleep(0.05)
        frozen = await source.read()
        again = await source.read()
        assert frozen is not None and again is not None
        assert again.forward_ct == frozen.forward_ct
        assert again.last_progress_monotonic_ns == frozen.last_progress_monotonic_ns
        assert again.read_monotonic_ns > again.last_progress_monotonic_ns
        assert again.busy

        await anyio.to_thread.run_sync(lambda: server.control(mode="idle"))
        with anyio.fail_after(15):
            while (idle := await source.read()) is None or idle.busy:
                await anyio.sleep(0.02)
        assert idle.forward_ct == again.forward_ct
    finally:
        await source.aclose()


def test_prometheus_parse_sums_label_sets_and_ignores_created() -> None:
    source = PrometheusStepSource("http://127.0.0.1:1/metrics", preset="sglang")
    text = (
        "# HELP sglang:generation_tokens_total Generated tokens.\n"
        "# TYPE sglang:generation_tokens_total counter\n"
        'sglang:generation_tokens_total{tp_rank="0"} 10.0\n'
        'sglang:generation_tokens_total{tp_rank="1"} 5.0\n'
        'sglang:generation_tokens_created{tp_rank="0"} 1.7e9\n'
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{tp_rank="0"} 0.0\n'
        'sglang:num_running_reqs{tp_rank="1"} 3.0\n'
    )
    assert source.parse(text) == (15.0, 3.0)
    # untyped exposition (no TYPE lines) parses too
    assert source.parse("sglang:generation_tokens_total 7\nsglang:num_running_reqs 0\n") == (7.0, 0.0)
    assert source.parse("sglang:generation_tokens_total 7\n") is None  # gauge missing
    assert source.parse("sglang:num_running_reqs 1\n") is None  # counter missing
    assert source.parse("this is { not prometheus\n") is None


def test_prometheus_source_rejects_bad_names() -> None:
    with pytest.raises(ValueError, match="unknown metrics preset"):
        PrometheusStepSource("http://127.0.0.1:1/metrics", preset="tgi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both"):
        PrometheusStepSource("http://127.0.0.1:1/metrics", preset=None, counter="x_total")
    assert set(PRESETS) == {"sglang", "vllm"}


async def test_prometheus_source_refused_reads_none() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    source = PrometheusStepSource(f"http://127.0.0.1:{port}/metrics", timeout_s=2.0)
    try:
        assert await source.read() is None
        assert source.failed_scrapes == 1
    finally:
        await source.aclose()
        await source.aclose()  # safe twice


async def test_steps_watcher_publishes_counter_movement(spawn, tmp_path: Path) -> None:
    server = fake_server.start(spawn, env=server_env(tmp_path))
    bus = RecordingBus()
    watcher = StepsWatcher(ShmStepSource(server.pid, directory=tmp_path), interval_s=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run, bus)
        await wait_until(lambda: len(bus.of_type(StepsAdvanced)) >= 3)
        tg.cancel_scope.cancel()
    events = bus.of_type(StepsAdvanced)
    assert all(e.pid == server.pid and e.delta > 0 and e.busy and e.source == "steps" for e in events)
    counts = [e.forward_ct for e in events]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    assert all(b.forward_ct - a.forward_ct == b.delta for a, b in itertools.pairwise(events))


class _ChurningMetrics(http.server.BaseHTTPRequestHandler):
    """/metrics whose ``request`` label is new at every scrape (a label set that churns), beside
    one steady series (``request="steady"``) that progresses."""

    scrapes = 0

    def do_GET(self) -> None:
        cls = type(self)
        cls.scrapes += 1
        n = cls.scrapes
        body = (
            "# TYPE sglang:generation_tokens counter\n"
            f'sglang:generation_tokens_total{{request="steady"}} {n}\n'
            f'sglang:generation_tokens_total{{request="r{n}"}} 1\n'
            "sglang:num_running_reqs 1\n"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


async def test_prometheus_source_forgets_label_sets_that_went_away() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ChurningMetrics)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    source = PrometheusStepSource(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout_s=10.0)
    try:
        scrapes = 3 * SERIES_FORGET_SCRAPES
        sizes = []
        for _ in range(scrapes):
            readings = await source.read_series()
            assert readings is not None and len(readings) == 2
            sizes.append(source.tracked_series)
        # one steady series plus the churned ones still inside their forget window, never more
        assert max(sizes) == SERIES_FORGET_SCRAPES + 1
        assert sizes[-1] == SERIES_FORGET_SCRAPES + 1
        steady = next(r for r in readings if r.series == 'request="steady"')
        assert steady.forward_ct == scrapes  # the steady series kept its track throughout
        assert steady.last_progress_monotonic_ns == steady.read_monotonic_ns
    finally:
        await source.aclose()
        server.shutdown()
        server.server_close()
        thread.join(10)


async def test_sdk_watchdog_and_step_watcher_share_one_counter_read(spawn, tmp_path: Path) -> None:
    """A target's SDK watchdog and step watcher read its counter file once between them: the step
    watcher reuses the watchdog's recent reading and still publishes every movement."""
    from agent.host.targets import Target
    from agent.watchers.watchdog import (
        STEPS_SHARED_MAX_AGE_S,
        SdkStepWatchers,
        Watchdog,
        WatchdogConfig,
    )

    server = fake_server.start(spawn, env=dict(os.environ))  # the test run's private shm dir
    await wait_until(lambda: ShmStepSource(server.pid).read_now() is not None)
    watchers = SdkStepWatchers(WatchdogConfig(timeout_s=60, poll_interval_s=0.2)).watchers_for(Target(pid=server.pid))
    assert watchers is not None
    dog, steps = watchers
    assert isinstance(dog, Watchdog) and isinstance(steps, StepsWatcher)
    assert isinstance(steps.source, RecentReading) and steps.source.source is dog.source
    bus = RecordingBus()
    async with anyio.create_task_group() as tg:
        await tg.start(dog.run, bus)
        await tg.start(steps.run, bus)
        await wait_until(lambda: len(bus.of_type(StepsAdvanced)) >= 3)
        tg.cancel_scope.cancel()
    events = bus.of_type(StepsAdvanced)
    assert all(e.pid == server.pid and e.delta > 0 for e in events)
    assert all(b.forward_ct - a.forward_ct == b.delta for a, b in itertools.pairwise(events))
    assert steps.source.own_reads <= 1  # at most its first reading, before the watchdog's first
    assert STEPS_SHARED_MAX_AGE_S > 1.0  # above both readers' periods (1 s), or it would read itself


async def test_recent_reading_reads_the_file_itself_when_the_shared_reading_is_old(spawn, tmp_path: Path) -> None:
    server = fake_server.start(spawn, env=server_env(tmp_path))
    source = ShmStepSource(server.pid, directory=tmp_path)
    first = await _reading(source)
    recent = RecentReading(source, max_age_s=60)
    assert await recent.read() is first and recent.own_reads == 0  # recent enough: reused
    shared = RecentReading(source, max_age_s=0.001)
    await anyio.sleep(0.01)
    fresh = await shared.read()
    assert shared.own_reads == 1 and fresh is not None and fresh.read_monotonic_ns > first.read_monotonic_ns
    assert source.last is fresh
    with pytest.raises(ValueError, match="max_age_s"):
        RecentReading(source, max_age_s=0)


@pytest.mark.parametrize("memory", [True, False], ids=["tmpfs", "disk"])
async def test_shm_source_reads_on_the_loop_only_from_a_memory_filesystem(spawn, tmp_path: Path, monkeypatch, memory: bool) -> None:
    """A counter on tmpfs (``/dev/shm``): the first reading takes a worker thread (it reads /proc to
    verify the file), the next ones are read on the loop (no ~100 us thread hop each; blockbuster
    checks nothing else blocks). On a disk folder every reading takes a worker thread."""
    from agent.host.fsutil import memory_backed

    if memory:
        if not os.path.isdir("/dev/shm") or not memory_backed("/dev/shm"):
            pytest.skip("no tmpfs /dev/shm")
        directory = Path(tempfile.mkdtemp(prefix="servewatch-test-", dir="/dev/shm"))
    else:
        if memory_backed(tmp_path):
            pytest.skip("the temp folder is on tmpfs")
        directory = tmp_path
    try:
        from agent.watchers import steps

        mounts_read = 0
        real_memory_backed = steps.memory_backed

        def counted_memory_backed(path):
            nonlocal mounts_read
            mounts_read += 1
            return real_memory_backed(path)

        monkeypatch.setattr(steps, "memory_backed", counted_memory_backed)
        server = fake_server.start(spawn, env=server_env(directory))
        source = ShmStepSource(server.pid, directory=directory)
        await _reading(source)
        hops = 0
        real = anyio.to_thread.run_sync

        async def counted(*args, **kwargs):
            nonlocal hops
            hops += 1
            return await real(*args, **kwargs)

        monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
        readings = [await source.read() for _ in range(20)]
        assert all(r is not None and r.pid == server.pid for r in readings)
        assert readings[-1].forward_ct >= readings[0].forward_ct  # type: ignore[union-attr]
        assert hops == (0 if memory else 20)
        assert mounts_read == 1  # the filesystem is decided once per source, not at every reading
    finally:
        if memory:
            shutil.rmtree(directory, ignore_errors=True)


# SGLang's /metrics as its documentation lays it out (production_metrics: scheduler labels,
# `sglang:cuda_graph_passes_total{mode}` one per forward pass, running and queued gauges).
_SGLANG_METRICS = """\
# HELP sglang:cuda_graph_passes_total Forward passes categorized by graph use.
# TYPE sglang:cuda_graph_passes_total counter
sglang:cuda_graph_passes_total{{engine_type="unified",mode="prefill_none",model_name="m",tp_rank="0"}} {prefill}
sglang:cuda_graph_passes_total{{engine_type="unified",mode="decode_cuda_graph",model_name="m",tp_rank="0"}} {decode}
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{engine_type="unified",model_name="m",tp_rank="0"}} 40.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{engine_type="unified",model_name="m",tp_rank="0"}} {running}
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{engine_type="unified",model_name="m",tp_rank="0"}} {queued}
"""


async def test_sglang_preset_counts_forward_passes_of_every_mode_as_one_series_and_queued_as_busy() -> None:
    from tests.watchers.scripted_http import scripted_http

    state = {"prefill": 3.0, "decode": 10.0, "running": 0.0, "queued": 2.0}
    with scripted_http() as srv:
        srv.route("/metrics", lambda _req: (200, {}, _SGLANG_METRICS.format(**state).encode()))
        source = PrometheusStepSource(srv.base + "/metrics", preset="sglang", timeout_s=5.0)
        try:
            first = await source.read_series()
            state["prefill"] = 4.0  # a prefill-only pass: no token generated, still progress
            second = await source.read_series()
        finally:
            await source.aclose()
    assert first is not None and second is not None
    assert source.counter == "sglang:cuda_graph_passes_total"
    assert [r.series for r in second] == ['engine_type="unified",model_name="m",tp_rank="0"']  # modes summed
    assert (first[0].forward_ct, second[0].forward_ct) == (13, 14)
    assert second[0].last_progress_monotonic_ns == second[0].read_monotonic_ns
    # nothing running but requests queued: busy (a server that schedules nothing is stalled)
    assert first[0].busy and second[0].busy


# vLLM 0.32's /metrics during a chunked prefill: no counter moves, the scheduler's KV usage does.
_VLLM_METRICS = """\
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_count{{engine="0",model_name="tiny"}} 2.0
vllm:iteration_tokens_total_sum{{engine="0",model_name="tiny"}} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="tiny"}} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="tiny"}} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {kv}
"""


async def test_vllm_preset_takes_a_kv_usage_change_as_a_step_when_no_counter_moves() -> None:
    from tests.watchers.scripted_http import scripted_http

    state = {"kv": 6.1e-05}
    with scripted_http() as srv:
        srv.route("/metrics", lambda _req: (200, {}, _VLLM_METRICS.format(**state).encode()))
        source = PrometheusStepSource(srv.base + "/metrics", preset="vllm", timeout_s=5.0)
        try:
            first = await source.read_series()
            state["kv"] = 1.22e-04  # a prefill chunk allocated a block: the engine stepped
            second = await source.read_series()
            third = await source.read_series()  # nothing changed: no step
        finally:
            await source.aclose()
    assert first is not None and second is not None and third is not None
    assert source.counter == "vllm:iteration_tokens_total_count"
    assert [r.forward_ct for r in (*first, *second, *third)] == [2, 2, 2]
    assert second[0].last_progress_monotonic_ns == second[0].read_monotonic_ns > first[0].read_monotonic_ns
    assert third[0].last_progress_monotonic_ns == second[0].read_monotonic_ns


_VLLM_CHURN = _VLLM_METRICS + """\
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{engine="0",model_name="tiny"}} {preempted}
"""


async def test_vllm_preset_takes_no_kv_usage_change_with_a_preemption_as_a_step() -> None:
    """vLLM #25538: preempted and resumed every step, no output token; the KV usage moves with
    each preemption and is no step. A move without a preemption (a prefill chunk) still is one."""
    from tests.watchers.scripted_http import scripted_http

    state = {"kv": 0.5, "preempted": 3.0}
    with scripted_http() as srv:
        srv.route("/metrics", lambda _req: (200, {}, _VLLM_CHURN.format(**state).encode()))
        source = PrometheusStepSource(srv.base + "/metrics", preset="vllm", timeout_s=5.0)
        try:
            first = await source.read_series()
            state.update(kv=0.75, preempted=5.0)  # two preemptions, KV usage moved: churn
            second = await source.read_series()
            state.update(kv=0.5, preempted=9.0)
            third = await source.read()  # the sum over series (the one-shot verdict's view)
            state.update(kv=0.625)  # a move without a preemption: a step
            fourth = await source.read_series()
        finally:
            await source.aclose()
    assert first is not None and second is not None and third is not None and fourth is not None
    assert source.churn_counter == "vllm:num_preemptions_total"
    start = first[0].last_progress_monotonic_ns
    assert start == first[0].read_monotonic_ns  # the counter is > 0 at the first reading
    assert second[0].last_progress_monotonic_ns == start
    assert (first[0].preempted_since_progress, second[0].preempted_since_progress) == (0, 2)
    assert second[0].preempted_since_ns == start
    assert third.last_progress_monotonic_ns == start and third.preempted_since_progress == 6
    assert fourth[0].last_progress_monotonic_ns == fourth[0].read_monotonic_ns > start
    assert fourth[0].preempted_since_progress == 0
