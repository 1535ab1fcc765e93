"""The frontend rules (issue 32 item 1) on the evidence model: when a frontend is the culprit, and
when it is not (a manual dump of a busy server, a stopped progress, an engine core stuck in its own
code). The shapes themselves run on real process trees in tests/test_frontend_verdict.py."""

from __future__ import annotations

from agent.verdict.rules import Evidence, FrameClass, RankEvidence, Role, decide

HEALTH = "http://127.0.0.1:30000/health"
PROGRESS = "sglang:generation_tokens_total 120->480 in 2.0 s at http://127.0.0.1:30000/metrics"


def _rank(r: int, pid: int, cls: FrameClass, frame: str = "f (m.py:1)") -> RankEvidence:
    return RankEvidence(rank=r, pid=pid, title=f"sglang::scheduler_TP{r}", label=f"TP{r}", frame_class=cls, frame=frame)


def _detokenizer(cls: FrameClass = FrameClass.COMPUTE) -> RankEvidence:
    return RankEvidence(pid=43, role=Role.FRONTEND, title="sglang::detokenizer", frame_class=cls,
                        frame="DetokenizerManager._decode_incremental (sglang/srt/managers/detokenizer_manager.py:40)")


def _api_server(cls: FrameClass = FrameClass.IDLE, *, event_loop: bool = False) -> RankEvidence:
    return RankEvidence(pid=41, role=Role.FRONTEND, title="python -m vllm.entrypoints.openai.api_server", frame_class=cls,
                        frame="apply_hf_chat_template (vllm/entrypoints/chat_utils.py:19)", event_loop=event_loop)


def _spinning(trigger: str, progress: bool | None) -> Evidence:
    return Evidence.of([_rank(0, 50, FrameClass.COMPUTE), _rank(1, 51, FrameClass.COMPUTE), _detokenizer(), _api_server()],
                       trigger=trigger, server_progress=progress, server_progress_detail=PROGRESS if progress else "",
                       health_url=HEALTH if trigger == "health" else "")


def test_a_spinning_detokenizer_is_named_while_the_ranks_progress_never_a_scheduler() -> None:
    v = decide(_spinning("health", True))
    assert (v.kind, v.rule, v.culprit_pids, v.culprit_roles, v.confidence, v.hung) == (
        "frontend", "frontend_spins", (43,), ("frontend",), "high", True)
    assert v.reason == ("the detokenizer pid 43 'sglang::detokenizer' spins in DetokenizerManager._decode_incremental "
                        f"(sglang/srt/managers/detokenizer_manager.py:40) while the ranks progress ({PROGRESS}): "
                        f"{HEALTH} fails")
    assert v.next_step == "py-spy top --pid 43 (where it spins while the ranks generate; its answers never leave)"
    assert v.to_json()["culprit_roles"] == ["frontend"]
    assert v.attributes()["servewatch.verdict.culprit_roles"] == ("frontend",)


def test_the_api_server_seen_busy_beside_a_spinning_detokenizer_is_not_named() -> None:
    ev = Evidence.of([_rank(0, 50, FrameClass.COMPUTE), _detokenizer(), _api_server(FrameClass.COMPUTE)],
                     trigger="health", server_progress=True, server_progress_detail=PROGRESS, health_url=HEALTH)
    v = decide(ev)
    assert (v.rule, v.culprit_pids, v.confidence) == ("frontend_spins", (43,), "high"), v


def test_a_busy_detokenizer_in_a_manual_dump_or_without_progress_is_no_culprit() -> None:
    assert decide(_spinning("manual", True)).kind == "progressing"  # no failure: a busy decode is work
    v = decide(_spinning("health", False))  # the ranks stopped: not the frontend's doing
    assert v.kind != "frontend" and 43 not in v.culprit_pids, v


def _blocked(*, event_loop: bool = True, engine: FrameClass = FrameClass.IDLE, trigger: str = "health") -> Evidence:
    engine_core = RankEvidence(pid=42, role=Role.COORDINATOR, title="VLLM::EngineCore", frame_class=engine,
                               frame="run_busy_loop (vllm/v1/engine/core.py:20)")
    return Evidence.of([_rank(0, 60, FrameClass.IDLE), _rank(1, 61, FrameClass.IDLE), engine_core,
                        _api_server(FrameClass.COMPUTE, event_loop=event_loop)],
                       trigger=trigger, health_url=HEALTH if trigger == "health" else "", work_pending=True)


def test_the_api_servers_blocked_event_loop_is_named_while_the_engine_core_idles() -> None:
    v = decide(_blocked())
    assert (v.kind, v.rule, v.culprit_pids, v.culprit_roles, v.confidence) == (
        "frontend", "frontend_blocked", (41,), ("frontend",), "high")
    assert v.reason == ("the API server's event loop is blocked in apply_hf_chat_template (vllm/entrypoints/chat_utils.py"
                        ":19) (pid 41 'python -m vllm.entrypoints.openai.api_server'): "
                        f"{HEALTH} fails while the engine core and every rank idle (waiting for work)")
    assert v.next_step.startswith("py-spy dump --pid 41 (the synchronous call that holds its event loop")
    # no event loop on its stack: the same culprit, said plainly, at medium
    plain = decide(_blocked(event_loop=False))
    assert (plain.kind, plain.culprit_pids, plain.confidence) == ("frontend", (41,), "medium")
    assert plain.reason.startswith("the API server pid 41 'python -m vllm.entrypoints.openai.api_server' is stuck in ")


def test_an_engine_core_stuck_in_its_own_loop_is_still_the_culprit_not_the_frontend() -> None:
    """Issue 32 item 1b keeps working: the engine core computes, its workers idle."""
    v = decide(_blocked(engine=FrameClass.COMPUTE, trigger="stall"))
    assert (v.kind, v.culprit_pids) == ("coordinator", (42,)), v
    v = decide(_blocked(engine=FrameClass.COMPUTE))  # a health failure: the engine core is not idle, not the frontend's
    assert v.kind == "coordinator" and v.culprit_pids == (42,), v


def test_a_frontend_in_its_own_code_during_a_manual_dump_is_no_culprit() -> None:
    v = decide(_blocked(trigger="manual"))
    assert v.kind != "frontend" and 41 not in v.culprit_pids, v


def test_an_untitled_frontend_is_told_and_named_by_its_command_never_its_arguments() -> None:
    from agent.verdict.servers import command_words, frontend_command

    real = ["/venv/bin/python", "/venv/bin/vllm", "serve", "/models/tiny", "--api-key", "secret"]
    assert command_words(real) == "python vllm serve" and frontend_command(real)
    assert command_words(["/usr/bin/vllm", "serve", "m"]) == "vllm serve"
    sglang = ["/x/python3", "-u", "-m", "sglang.launch_server", "--model-path", "m"]
    assert command_words(sglang) == "python3 -m sglang.launch_server" and frontend_command(sglang)
    assert command_words(["python", "/srv/app.py", "--token", "t"]) == "python app.py"
    assert not frontend_command(["python", "/srv/app.py"]) and not frontend_command(["python", "-m", "sglang_router"])
