"""One stuck request while the server serves others (issue 32 item 6, vLLM #54003): a real process
using the SDK serves requests at a steady rate, each inside ``agent.sdk.request_span``; one
request's structured-output grammar compiles forever on the grammar thread (which holds the request:
``RequestHandle.held_here``) while the others complete and the engine loop keeps stepping. The
real agent opens a ``request_stall`` incident naming that request and the thread holding it (by
its name, tid and frame, from the real py-spy dump); the rule's bound comes from the server's own
completions."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import anyio
import pytest

from agent.model.events import RequestStalled
from agent.watchers.config import RequestStallConfig
from agent.watchers.requests import stuck_requests
from tests.programs.fault_matrix import _read_lines, _start, _watch, stop_ranks

GRAMMAR = Path(__file__).parent / "programs" / "grammar_stall.py"


@pytest.mark.slow
async def test_one_request_stuck_in_its_grammar_compile_is_named_with_the_thread_holding_it(tmp_path: Path) -> None:
    proc = _start([sys.executable, str(GRAMMAR), "--stuck-at", "20"], tmp_path)
    try:
        seen = await anyio.to_thread.run_sync(lambda: _read_lines(proc, lambda s: "READY" in s and "STUCK" in s))
        pid = int(seen["READY"][0][0])
        rid, tid = seen["STUCK"][0][0], int(seen["STUCK"][0][1])
        settings = {"target": {"pids": [pid]},
                    "request_stall": {"min_s": 3.0, "p99_multiple": 10.0, "min_completions": 5, "interval_s": 0.5}}
        record = await _watch(settings, tmp_path, wait_trigger="request_stall", deadline_s=60.0)
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [proc])
    assert record.opened.trigger == "request_stall"
    v = record.verdict
    assert v is not None, "no verdict"
    assert v.kind == "request", v.reason
    assert v.hung is False
    assert v.culprit_pids == (pid,) and v.culprit_ranks == (), v.reason
    assert v.confidence == "high", v.reason
    assert str(pid) in re.findall(r"\d+", v.next_step), v.next_step  # what to do next names its process
    assert f"request {rid} (pid {pid}) in flight" in v.reason, v.reason
    assert f"held by thread 'structured_output_grammar_0' (tid {tid}, busy) in compile_grammar (" in v.reason, v.reason
    assert "while the server completes others" in v.reason


def _reply(now_ns: int, *, age_s: float, p99_s: float = 0.05, recent: int = 40, last_end_ago_s: float = 0.1) -> dict:
    return {"requests": [{"request_id": "r-1", "start_time_unix_nano": now_ns - int(age_s * 1e9), "thread_id": 7,
                          "native_thread_id": 8}],
            "completions": {"count": recent, "recent": recent, "p99_s": p99_s,
                            "last_end_unix_nano": now_ns - int(last_end_ago_s * 1e9)}}


@pytest.mark.parametrize(("age_s", "p99_s", "recent", "last_end_ago_s", "stuck"), [
    (61.0, 0.05, 40, 0.1, True),    # past the 60 s floor (10 x p99 is 0.5 s)
    (59.0, 0.05, 40, 0.1, False),   # under the floor
    (61.0, 8.0, 40, 0.1, False),    # under 10 x a p99 of 8 s
    (81.0, 8.0, 40, 0.1, True),
    (61.0, 0.05, 10, 0.1, False),   # too few completions to trust their p99
    (61.0, 0.05, 40, 70.0, False),  # nothing completed since it began: a stalled server, not one request
])
def test_the_rule_is_a_multiple_of_the_p99_bounded_below_while_others_complete(
        age_s: float, p99_s: float, recent: int, last_end_ago_s: float, stuck: bool) -> None:
    now = 10**18
    found = stuck_requests(42, _reply(now, age_s=age_s, p99_s=p99_s, recent=recent, last_end_ago_s=last_end_ago_s),
                           now, RequestStallConfig())
    assert bool(found) is stuck
    if stuck:
        (event,) = found
        assert isinstance(event, RequestStalled)
        assert (event.pid, event.request_id, event.thread_id, event.native_thread_id) == (42, "r-1", 7, 8)
        assert event.threshold_s == max(60.0, 10 * p99_s)
