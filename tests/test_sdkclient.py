"""agent.host.sdkclient: the agent side of the SDK control socket, against real unix sockets.

The SDK's own server is exercised end to end in tests/actors/test_profiler.py and
tests/test_security.py; here a minimal JSON-lines server (the documented protocol boundary)
answers what a broken or foreign server could answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from agent.errors import SdkCallError, ServewatchError
from agent.host.sdkclient import control_socket_pids, read_inflight, sdk_call
from agent.host.targets import Target
from agent.model.events import Outcome
from agent.sdk.control import control_path


@asynccontextmanager
async def _server(path: Path, reply: bytes) -> AsyncIterator[list[dict]]:
    """A unix socket at ``path`` that reads one request line and answers ``reply``."""
    seen: list[dict] = []
    listener = await anyio.create_unix_listener(path)

    async def serve(stream: SocketStream) -> None:
        async with stream:
            data = b""
            while not data.endswith(b"\n"):
                data += await stream.receive()
            seen.append(json.loads(data))
            await stream.send(reply)

    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        try:
            yield seen
        finally:
            tg.cancel_scope.cancel("test done")
            await listener.aclose()


async def test_a_call_sends_one_line_and_returns_the_reply_object(tmp_path: Path) -> None:
    path = control_path(os.getpid(), tmp_path)
    async with _server(path, b'{"ok": true, "pid": 7}\n') as seen:
        reply = await sdk_call(path, {"cmd": "status"}, timeout_s=10)
    assert reply == {"ok": True, "pid": 7}
    assert seen == [{"cmd": "status"}]


@pytest.mark.parametrize(
    ("reply", "outcome", "words"),
    [
        (b"[1, 2]\n", Outcome.FAILED, "not an object"),
        (b"{not json\n", Outcome.FAILED, "bad reply"),
        (b'{"ok": false, "error": "permission_denied", "detail": "uid 5"}\n', Outcome.PERMISSION_DENIED, "uid 5"),
    ],
)
async def test_a_bad_reply_is_an_sdk_call_error_with_its_outcome(
    tmp_path: Path, reply: bytes, outcome: Outcome, words: str
) -> None:
    path = control_path(os.getpid(), tmp_path)
    async with _server(path, reply):
        with pytest.raises(SdkCallError) as info:
            await sdk_call(path, {"cmd": "status"}, timeout_s=10)
    assert info.value.outcome is outcome and words in info.value.detail
    assert isinstance(info.value, ServewatchError)


async def test_a_missing_socket_is_no_such_process_and_a_plain_file_is_not_trusted(tmp_path: Path) -> None:
    with pytest.raises(SdkCallError) as missing:
        await sdk_call(tmp_path / "absent.sock", {"cmd": "status"}, timeout_s=5)
    assert missing.value.outcome is Outcome.NO_SUCH_PROCESS and "serve_control" in missing.value.detail
    plain = tmp_path / "plain.sock"
    plain.write_text("")
    with pytest.raises(SdkCallError) as untrusted:
        await sdk_call(plain, {"cmd": "status"}, timeout_s=5)
    assert untrusted.value.outcome is Outcome.PERMISSION_DENIED and "not a socket" in untrusted.value.detail


async def test_a_silent_server_times_out(tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    listener = await anyio.create_unix_listener(path)
    try:
        with pytest.raises(SdkCallError) as info:
            await sdk_call(path, {"cmd": "status"}, timeout_s=0.5)  # accepted by the backlog, never answered
    finally:
        await listener.aclose()
    assert info.value.outcome is Outcome.TIMED_OUT


def test_socket_pids_are_the_live_ones_named_in_the_folder(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead_pid = int(dead.stdout)
    from agent.sdk.folders import own_dir

    folder = own_dir(tmp_path)
    for name in (f"servewatch-ctl.{os.getpid()}.sock", f"servewatch-ctl.{dead_pid}.sock", "servewatch-ctl.x.sock",
                 f"servewatch-steps.{os.getppid()}"):
        (folder / name).write_text("")
    assert control_socket_pids(tmp_path) == [os.getpid()]
    assert control_socket_pids(tmp_path / "absent") == []


async def test_inflight_requests_are_read_from_each_target_socket(tmp_path: Path) -> None:
    now_ns = time.time_ns()
    requests = [
        {"request_id": "req-1", "trace_id": "a" * 32, "span_id": "b" * 16, "start_time_unix_nano": now_ns - 2_000_000_000,
         "input_tokens": 8, "output_tokens": 3},
        "not a request",
    ]
    path = control_path(os.getpid(), tmp_path)
    targets = [Target(pid=os.getpid(), title="me"), Target(pid=1, title="no socket")]
    async with _server(path, json.dumps({"ok": True, "requests": requests}).encode() + b"\n") as seen:
        inflight = await read_inflight(targets, socket_dir=tmp_path)
    assert seen == [{"cmd": "inflight"}]
    assert [(r.pid, r.request_id, r.trace_id, r.span_id, r.prompt_tokens, r.generated_tokens) for r in inflight] == [
        (os.getpid(), "req-1", "a" * 32, "b" * 16, 8, 3)
    ]
    assert 2.0 <= inflight[0].age_s < 600
    assert inflight[0].to_json(with_prompt=True)["age_s"] == round(inflight[0].age_s, 6)


async def test_a_rank_dying_mid_read_loses_only_its_own_inflight_requests(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two real SDK ranks with requests in flight; one hangs (SIGSTOP: the kernel still accepts
    the connection and the request) and is SIGKILLed while the agent waits for its answer (a
    connection reset). The live rank's requests are kept; the dead one is one warning line."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(tmp_path), "PYTHONPATH": str(repo)}
    procs = []
    try:
        pids = []
        for _ in range(2):
            proc = await anyio.open_process([sys.executable, "-m", "tests.programs.inflight_rank", "3"], env=env, cwd=repo)
            procs.append(proc)
            assert proc.stdout is not None
            with anyio.fail_after(30):
                line = await BufferedByteReceiveStream(proc.stdout).receive_until(b"\n", 1024)
            pids.append(int(line.split()[1]))
        live, dying = pids
        os.kill(dying, signal.SIGSTOP)

        async def kill_mid_read() -> None:
            await anyio.sleep(0.3)
            os.kill(dying, signal.SIGKILL)

        caplog.set_level(logging.WARNING)
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_mid_read)
            inflight = await read_inflight([Target(pid=p, title="rank") for p in pids], timeout_s=5.0, socket_dir=tmp_path)
    finally:
        with anyio.CancelScope(shield=True):
            for proc in procs:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):  # the killed one may be reaped already
                        proc.kill()
                await proc.aclose()
    assert sorted(r.request_id for r in inflight) == [f"req-{live}-{k}" for k in range(3)]
    assert not [r for r in caplog.records if r.exc_info], "a dying rank must not print a traceback"
    said = [r.getMessage() for r in caplog.records if str(dying) in r.getMessage()]
    assert len(said) == 1 and "exited during the call" in said[0], said


async def test_a_flight_recorder_read_of_a_process_without_torch_distributed_never_imports_torch(tmp_path: Path, spawn) -> None:
    """An SDK process that never imported torch.distributed (no process group: a request-serving
    frontend, a torch-free server) answers ``fr_trace`` at once, ``unsupported``, and does not
    import torch to say so (that took seconds and ~200 MB, and timed the read out twice)."""
    program = ("import os, sys, time\nimport agent.sdk as sw\nsw.serve_control()\nprint('ready', flush=True)\n"
               "time.sleep(60)\n")
    proc = spawn([sys.executable, "-c", program], stdout=subprocess.PIPE, env={**os.environ, "SERVEWATCH_SHM_DIR": str(tmp_path)})
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    proc.stdout.close()
    reply = await sdk_call(control_path(proc.pid, tmp_path), {"cmd": "fr_trace"}, timeout_s=10)
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert reply["ok"] is False and reply["error"] == "unsupported", reply
    assert "torch.distributed is not imported in this process" in reply["detail"]
    assert "libtorch" not in maps
