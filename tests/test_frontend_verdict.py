"""Frontend processes are part of the server (issue 32 item 1), each shape on real process trees
(stand-ins of vLLM's and SGLang's servers with their real module paths and setproctitle titles,
tests/programs/frontend_cases.py), the real agent watching with the README's title globs, real
py-spy: the health incident dumps the whole server tree, each process in its role, and its verdict
names the frontend that is the culprit (kind ``frontend``), by pid, role and frame, at the confidence
its evidence supports, never the idle engine core or the progressing schedulers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.programs.frontend_cases import FRONTEND_SHAPES

pytestmark = pytest.mark.slow


def _dumped(record) -> dict[int, str]:
    return {r.pid: r.outcome.value for r in record.results if r.action == "pyspy.dump"}


async def test_the_api_servers_blocked_event_loop_is_named_while_the_engine_core_idles(tmp_path: Path) -> None:
    """(b) vLLM PR #38157: the chat template renders on the event loop; /health and /metrics time out."""
    result = await FRONTEND_SHAPES["api_server_blocked"](tmp_path)
    v, record = result.verdict, result.record
    assert result.correct, (result.problems(), v.get("headline"), v.get("evidence"))
    [api] = v["culprit_pids"]
    assert v["rule"] == "frontend_blocked" and v["hung"] and v["culprit_roles"] == ["frontend"], v
    assert re.match(r"the API server's event loop is blocked in apply_hf_chat_template "
                    rf"\(vllm/entrypoints/chat_utils\.py:\d+\) \(pid {api} '", v["reason"]), v["reason"]
    assert v["reason"].endswith("/health fails while the engine core and every rank idle (waiting for work)"), v["reason"]
    # the untitled API server, matched by no glob, was dumped with the engine core and both workers
    titles = {t.pid: t.title for t in record.targets}
    assert api in titles and sum(t.startswith("VLLM::Worker_TP") for t in titles.values()) == 2, titles
    assert any(t == "VLLM::EngineCore" for t in titles.values()), titles
    assert set(_dumped(record)) == set(titles) and set(_dumped(record).values()) == {"ok"}, _dumped(record)
    # each process is said in its role
    evidence = "\n".join(v["evidence"])
    assert re.search(rf"pid {api} '[^']*vllm\.entrypoints\.openai\.api_server[^']*'; frontend; compute: "
                     r"apply_hf_chat_template", evidence), evidence
    assert re.search(r"'VLLM::EngineCore'; coordinator; idle", evidence), evidence
    assert v["next"].startswith(f"py-spy dump --pid {api} (the synchronous call that holds its event loop"), v["next"]


async def test_a_health_url_watched_alone_finds_the_server_tree_from_its_listener(tmp_path: Path) -> None:
    """(b) again, the agent given only the server's /health and /metrics (no --match, no --pid): the
    incident dumps the tree of the process listening on the health URL's port, and names it."""
    result = await FRONTEND_SHAPES["api_server_blocked_health_only"](tmp_path)
    v, record = result.verdict, result.record
    assert result.correct, (result.problems(), v.get("headline"), v.get("evidence"))
    titles = sorted(t.title for t in record.targets)
    assert [t for t in titles if t.startswith("VLLM::")] == ["VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    assert len(titles) == 4, titles  # and the API server
    assert v["reason"].startswith("the API server's event loop is blocked in apply_hf_chat_template ("), v["reason"]


async def test_the_spinning_detokenizer_is_named_while_the_schedulers_generate(tmp_path: Path) -> None:
    """(a) SGLang #26482, #34740: the README's --match 'sglang::scheduler*' never matched the
    detokenizer; the health incident dumps it and names it, with the ranks' progress read from
    /metrics (not "one snapshot without a progress source"), never a progressing scheduler."""
    result = await FRONTEND_SHAPES["detokenizer_spins"](tmp_path)
    _assert_detokenizer_named(result)


async def test_an_agent_started_after_the_hang_reads_the_503_as_a_failure_not_start_up(tmp_path: Path) -> None:
    """(c) The detokenizer spins before the agent starts: /health never answered it 200, yet the
    server's /metrics already counts generated tokens: not start-up; the incident opens and names it."""
    result = await FRONTEND_SHAPES["agent_after_hang"](tmp_path)
    _assert_detokenizer_named(result)


def _assert_detokenizer_named(result) -> None:
    v, record = result.verdict, result.record
    assert result.correct, (result.problems(), v.get("headline"), v.get("evidence"))
    [detok] = v["culprit_pids"]
    assert v["rule"] == "frontend_spins" and v["hung"] and v["culprit_roles"] == ["frontend"], v
    assert re.match(rf"the detokenizer pid {detok} 'sglang::detokenizer' spins in "
                    r"DetokenizerManager\._decode_incremental \(sglang/srt/managers/detokenizer_manager\.py:\d+\) "
                    r"while the ranks progress \(sglang:generation_tokens_total \d+->\d+ in ", v["reason"]), v["reason"]
    assert "one snapshot" not in v["reason"] and v["reason"].endswith("/health fails"), v["reason"]
    titles = {t.pid: t.title for t in record.targets}
    assert titles[detok] == "sglang::detokenizer", titles
    assert sorted(t for t in titles.values() if t.startswith("sglang::scheduler")) == [
        "sglang::scheduler_TP0", "sglang::scheduler_TP1"], titles
    # the main process (no title: its command line), the API server with its tokenizer manager
    assert any("-m sglang.launch_server" in " ".join(t.cmdline) for t in record.targets), titles
    assert set(_dumped(record)) == set(titles), (_dumped(record), titles)
    evidence = "\n".join(v["evidence"])
    assert f"pid {detok} 'sglang::detokenizer'; frontend; compute: DetokenizerManager._decode_incremental" in evidence
    assert v["next"].startswith(f"py-spy top --pid {detok} (where it spins"), v["next"]
