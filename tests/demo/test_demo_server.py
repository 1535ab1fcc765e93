"""The demo inference server, for real: spawned scheduler processes, a torch model, py-spy.

One server (TP=2) is shared by the module; the tests that hang a scheduler for good start their own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import anyio
import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

import agent.demo
import agent.demo.client
from agent.demo import TORCH_MISSING_MESSAGE, torch_available
from agent.demo.client import DemoServer, DemoServerError, generate, inject_hang
from agent.demo.server import DemoServerConfig, main
from agent.sdk import CounterSnapshot, counter_path, read_counter

pytestmark = pytest.mark.skipif(not torch_available(), reason=TORCH_MISSING_MESSAGE)

T = TypeVar("T")


def _poll(fn: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    """Call ``fn`` until it returns a truthy value; bounded."""
    event = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        value = fn()
        if value:
            return value
        event.wait(0.05)
    raise AssertionError(f"condition not met within {timeout_s} s")


def _counters(server: DemoServer) -> list[CounterSnapshot]:
    snaps = [read_counter(counter_path(pid)) for pid in server.scheduler_pids]
    assert all(s is not None for s in snaps), snaps
    return snaps  # type: ignore[return-value]


def _counters_when(server: DemoServer, pred: Callable[[CounterSnapshot, CounterSnapshot], bool], base: list[CounterSnapshot]) -> list[CounterSnapshot]:
    """Counters once ``pred(now, base)`` holds for every rank (followers step a moment after rank 0)."""

    def ready() -> list[CounterSnapshot] | None:
        snaps = _counters(server)
        return snaps if all(pred(now, b) for now, b in zip(snaps, base)) else None

    return _poll(ready)


def _metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels == {"model_name": "servewatch-demo-tiny"}
            values[sample.name] = sample.value
    return values


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    assert os.path.exists(found), "py-spy is a dependency of servewatch"
    return found


def _dump(pid: int) -> str:
    done = subprocess.run([_py_spy(), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def server() -> Iterator[DemoServer]:
    with DemoServer(tp=2) as srv:
        yield srv


def test_public_names_match_all() -> None:
    for module in (agent.demo, agent.demo.client):
        public = {n for n in vars(module) if not n.startswith("_")}
        assert set(module.__all__) <= public
    assert agent.demo.torch_available() is True
    assert "pip install 'servewatch[torch]'" in TORCH_MISSING_MESSAGE


def test_health_is_200_and_server_info_lists_ranks(server: DemoServer) -> None:
    r = httpx.get(f"{server.base_url}/health", timeout=10)
    assert r.status_code == 200
    info = httpx.get(f"{server.base_url}/server_info", timeout=10).json()
    assert info["pid"] == server.pid
    assert info["tp_size"] == 2
    assert info["scheduler_pids"] == server.scheduler_pids
    assert info["scheduler_titles"] == ["demo::scheduler_TP0", "demo::scheduler_TP1"]


def test_schedulers_are_titled_like_sglang_and_children_of_the_frontend(server: DemoServer) -> None:
    descendants = {p.pid for p in psutil.Process(server.pid).children(recursive=True)}
    for rank, pid in enumerate(server.scheduler_pids):
        assert pid in descendants
        cmdline = [a for a in psutil.Process(pid).cmdline() if a]
        assert cmdline[0] == f"demo::scheduler_TP{rank}"


def test_generate_returns_exactly_max_new_tokens_and_is_deterministic(server: DemoServer) -> None:
    a = generate(server.base_url, "The quick brown fox", max_new_tokens=7)
    b = generate(server.base_url, "The quick brown fox", max_new_tokens=7)
    assert len(a["output_ids"]) == 7
    assert all(0 <= t < DemoServerConfig().vocab_size for t in a["output_ids"])
    assert a["meta_info"]["prompt_tokens"] == len(b"The quick brown fox")
    assert a["meta_info"]["completion_tokens"] == 7
    assert a["output_ids"] == b["output_ids"]  # greedy decoding, same weights on every run
    # SGLang's request shape works too: input_ids plus sampling_params.max_new_tokens.
    r = httpx.post(
        f"{server.base_url}/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}},
        timeout=30,
    )
    assert r.status_code == 200
    assert len(r.json()["output_ids"]) == 3


def test_metrics_parse_with_sglang_names_and_count_tokens(server: DemoServer) -> None:
    before = _metrics(server.base_url)
    generate(server.base_url, "hello", max_new_tokens=5)
    after = _metrics(server.base_url)
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 5
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == len(b"hello")
    assert after["sglang:num_running_reqs"] == 0
    assert after["sglang:num_queue_reqs"] == 0


def test_every_rank_counts_one_step_per_decode_step(server: DemoServer) -> None:
    before = _counters(server)
    generate(server.base_url, "count my steps", max_new_tokens=4)
    after = _counters_when(server, lambda now, b: now.forward_ct >= b.forward_ct + 4, before)
    for rank, (b, a) in enumerate(zip(before, after)):
        assert a.pid == server.scheduler_pids[rank]
        assert a.forward_ct - b.forward_ct == 4  # one request alone: one forward per token
        assert a.pending == 0  # idle again
        assert a.last_step_monotonic_ns > b.last_step_monotonic_ns


def test_concurrent_requests_are_batched(server: DemoServer) -> None:
    lengths = [3, 5, 8, 2]
    before_metrics = _metrics(server.base_url)
    before = _counters(server)
    results: list[dict] = []
    threads = [
        threading.Thread(target=lambda n=n: results.append(generate(server.base_url, f"req {n}", max_new_tokens=n)))
        for n in lengths
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(len(r["output_ids"]) for r in results) == sorted(lengths)
    after_metrics = _metrics(server.base_url)
    assert after_metrics["sglang:generation_tokens_total"] - before_metrics["sglang:generation_tokens_total"] == sum(lengths)
    steps = _counters(server)[0].forward_ct - before[0].forward_ct  # rank 0 steps before it answers
    assert max(lengths) <= steps <= sum(lengths)


def test_bounded_hang_delays_a_request_which_then_completes(server: DemoServer) -> None:
    before = _counters(server)
    assert inject_hang(server.base_url, tp_rank=0, seconds=0.5) == {"armed": True, "tp_rank": 0, "seconds": 0.5}
    out = generate(server.base_url, "after the hang", max_new_tokens=3)
    assert len(out["output_ids"]) == 3
    after = _counters_when(server, lambda now, b: now.forward_ct >= b.forward_ct + 3, before)
    assert [a.forward_ct - b.forward_ct for a, b in zip(after, before)] == [3, 3]


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/generate", {"max_new_tokens": 3}, "exactly one of"),
        ("/generate", {"text": "x", "max_new_tokens": 0}, "greater than or equal to 1"),
        ("/generate", {"input_ids": [5000], "max_new_tokens": 1}, "input_ids must be in"),
        ("/debug/hang", {"tp_rank": 2}, "tp_rank must be in 0..1"),
        ("/debug/hang", {"tp_rank": 0, "seconds": -1}, "greater than or equal to 0"),
    ],
)
def test_bad_requests_get_400_naming_the_problem(server: DemoServer, path: str, body: dict, needle: str) -> None:
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=10)
    assert r.status_code == 400
    assert needle in r.json()["error"]


@pytest.mark.slow
def test_injected_hang_freezes_steps_with_work_pending_while_health_stays_200() -> None:
    with DemoServer(tp=2, extra_args=["--request-timeout", "60"]) as srv:
        generate(srv.base_url, "warm", max_new_tokens=2)
        before = _counters(srv)
        inject_hang(srv.base_url, tp_rank=1, seconds=None)
        failures: list[BaseException] = []

        def in_flight() -> None:
            try:
                generate(srv.base_url, "this one hangs", max_new_tokens=4, timeout_s=90)
            except httpx.HTTPError as exc:  # the server is stopped under it
                failures.append(exc)

        client = threading.Thread(target=in_flight, daemon=True)
        client.start()
        hung = _counters_when(srv, lambda now, b: now.pending > 0, before)
        # The hung rank shows the injected frame; rank 0 waits in the emulated all-reduce.
        assert "_injected_hang_in_forward" in _dump(srv.scheduler_pids[1])
        assert "_wait_for_all_reduce" in _dump(srv.scheduler_pids[0])
        later = _counters(srv)
        for b, h, x in zip(before, hung, later):
            assert h.forward_ct == b.forward_ct == x.forward_ct  # no step since the request came in
            assert x.pending == 1
        assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200
        assert _metrics(srv.base_url)["sglang:num_running_reqs"] == 1
        pids = [srv.pid, *srv.scheduler_pids]
    client.join(timeout=30)
    assert not client.is_alive()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    for pid in pids[1:]:
        assert not counter_path(pid).exists()  # schedulers removed their counter files on SIGTERM


def test_server_exits_2_with_install_hint_without_torch() -> None:
    code = (
        "import sys, runpy; sys.modules['torch'] = None; sys.argv = ['agent.demo.server', '--tp', '1'];"
        "runpy.run_module('agent.demo.server', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.strip() == TORCH_MISSING_MESSAGE


def test_bad_flag_value_is_usage_error_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--tp", "0"])
    assert exc.value.code == 2
    assert "--tp" in capsys.readouterr().err


def test_start_failure_raises_with_the_server_error() -> None:
    srv = DemoServer(tp=1, extra_args=["--max-batch-size", "0"])
    with pytest.raises(DemoServerError, match="--max-batch-size"):
        srv.start()
    assert srv.proc is not None and srv.proc.returncode == 2


def test_ready_file_is_json_with_the_bound_port(tmp_path: Path, spawn) -> None:
    ready = tmp_path / "ready.json"
    proc = spawn(
        [sys.executable, "-m", "agent.demo.server", "--tp", "1", "--port", "0", "--ready-file", str(ready)],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        info = agent.demo.client.wait_ready(ready, 60, proc=proc)
        assert info["port"] > 0 and info["base_url"] == f"http://127.0.0.1:{info['port']}"
        assert httpx.get(f"{info['base_url']}/health", timeout=10).status_code == 200
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.stdout.close()
    assert proc.returncode == 0  # SIGTERM is a clean stop
    assert json.loads(out.splitlines()[0]) == info  # the same JSON, one line on stdout
    assert not counter_path(info["scheduler_pids"][0]).exists()


@pytest.mark.slow
def test_collective_timeout_ends_the_peer_like_an_nccl_timeout() -> None:
    with DemoServer(tp=2, extra_args=["--collective-timeout", "1"]) as srv:
        generate(srv.base_url, "warm", max_new_tokens=2)
        inject_hang(srv.base_url, tp_rank=1, seconds=None)
        # Rank 0 gives up waiting for TP1 in the real gloo all_reduce and exits 1; the frontend
        # answers the request in flight with 503 and turns unhealthy (a process-exit trigger).
        with pytest.raises(httpx.HTTPStatusError) as exc:
            generate(srv.base_url, "stuck", max_new_tokens=4, timeout_s=60)
        assert exc.value.response.status_code == 503
        assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 503
        assert "_injected_hang_in_forward" in _dump(srv.scheduler_pids[1])
        log = srv.log_path.read_text() if srv.log_path else ""
        assert "all_reduce after step" in log and "timeout 1 s" in log and "Timed out" in log


async def test_async_helpers_generate_and_arm_a_bounded_hang(server: DemoServer) -> None:
    armed = await agent.demo.client.ainject_hang(server.base_url, tp_rank=1, seconds=0.2)
    assert armed == {"armed": True, "tp_rank": 1, "seconds": 0.2}
    out = await agent.demo.client.agenerate(server.base_url, "async", max_new_tokens=3)
    assert len(out["output_ids"]) == 3
    with pytest.raises(httpx.HTTPStatusError) as exc:
        await agent.demo.client.ainject_hang(server.base_url, tp_rank=5)
    assert exc.value.response.status_code == 400


async def test_async_server_turns_503_when_a_scheduler_dies_and_stops_cleanly() -> None:
    async with DemoServer(tp=1) as srv:
        out = await agent.demo.client.agenerate(srv.base_url, "a", max_new_tokens=2)
        assert out["meta_info"]["completion_tokens"] == 2
        psutil.Process(srv.scheduler_pids[0]).kill()
        counter_path(srv.scheduler_pids[0]).unlink(missing_ok=True)  # SIGKILL left it behind
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
            with anyio.fail_after(30):
                while (await client.get("/health")).status_code != 503:
                    await anyio.sleep(0.05)
            r = await client.post("/generate", json={"text": "x", "max_new_tokens": 1})
        assert r.status_code == 503  # fails fast instead of waiting out request_timeout_s
        assert r.json()["error"] == "a scheduler process exited"
        pid = srv.pid
    assert srv.proc is not None and srv.proc.returncode == 0  # stopped by SIGTERM, cleanly
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_async_start_failure_raises_with_the_server_error() -> None:
    srv = DemoServer(tp=1, extra_args=["--max-batch-size", "0"])
    with pytest.raises(DemoServerError, match="--max-batch-size"):
        await srv.astart()
    assert srv.proc is not None and srv.proc.returncode == 2


def test_a_client_that_gave_up_costs_no_traceback() -> None:
    """The README's `curl -m 60` on a hung rank gives up before the server's 504: the server's
    late answer meets a closed socket, which must not print a traceback on its stderr."""
    import socket
    import struct
    import time

    with DemoServer(tp=1, extra_args=["--request-timeout", "1"]) as srv:
        generate(srv.base_url, "warm", max_new_tokens=2)
        inject_hang(srv.base_url, tp_rank=0, seconds=3)
        host, port = srv.base_url.removeprefix("http://").split(":")
        body = json.dumps({"text": "this one hangs", "max_new_tokens": 2}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.3)  # the server has read the request and waits for rank 0
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        time.sleep(2.0)  # the 504 was due 1 s after the request, to a client that is gone
        assert generate(srv.base_url, "after", max_new_tokens=2)["output_ids"]
        log = srv.log_path.read_text() if srv.log_path else ""
    assert "Traceback" not in log and "BrokenPipeError" not in log and "ConnectionResetError" not in log, log
