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


def test_a_stuck_detokenizer_at_a_stall_while_every_scheduler_idles_is_named() -> None:
    """The real SGLang shape (tests/real/test_sglang_real.py): the detokenizer stuck in its decode, the
    schedulers done with their work and polling for more, requests open with no answer: the stall
    names the detokenizer, never a scheduler; the same evidence at a manual dump blames nobody."""
    idle = [_rank(0, 50, FrameClass.IDLE, "Scheduler.get_next_batch_to_run (scheduler.py:4015)"),
            _rank(1, 51, FrameClass.IDLE, "Scheduler.get_next_batch_to_run (scheduler.py:4015)")]
    v = decide([*idle, _detokenizer(), _api_server()], trigger="stall")
    assert (v.kind, v.rule, v.culprit_pids, v.culprit_roles, v.confidence, v.hung) == (
        "frontend", "frontend_blocked", (43,), ("frontend",), "high", True), v
    assert v.reason == ("the detokenizer pid 43 'sglang::detokenizer' is stuck in DetokenizerManager._decode_incremental "
                        "(sglang/srt/managers/detokenizer_manager.py:40): requests wait with no progress while every "
                        "rank idles (waiting for work)")
    assert v.next_step == "py-spy top --pid 43 (where it is stuck while the ranks idle; its answers never leave)"
    assert decide([*idle, _detokenizer(), _api_server()], trigger="manual").kind != "frontend"
    # a scheduler at work (in its forward) at the stall: the rank rules decide
    busy = _rank(1, 51, FrameClass.COMPUTE, "LlamaForCausalLM.forward (llama.py:9)")
    assert decide([idle[0], busy, _detokenizer()], trigger="stall").rule != "frontend_blocked"


def test_sglangs_scheduler_polling_for_work_on_the_cpu_is_idle_and_in_its_forward_is_not() -> None:
    """SGLang's scheduler loop receives without blocking (no --sleep-on-idle): py-spy sees an idle
    scheduler active in recv_requests, get_next_batch_to_run or its stage metrics (SGLang 0.5.23's
    frames, as dumped from the real server); in a batch run it is at work."""
    from agent.model.stacks import Frame, ThreadStack, thread_is_idle

    site = "/v/lib/python3.11/site-packages/"

    def frame(name: str, path: str, line: int = 1) -> Frame:
        return Frame(name=name, filename=site + path, short_filename=path.rsplit("/", 1)[-1], line=line)

    loop = (frame("Scheduler.event_loop_normal", "sglang/srt/managers/scheduler.py", 2039),
            frame("decorate_context", "torch/utils/_contextlib.py", 124),
            frame("Scheduler.run_event_loop", "sglang/srt/managers/scheduler.py", 2010))
    stage = frame("scheduler_stage_method.<locals>.decorator.<locals>.wrapper", "sglang/srt/managers/scheduler_stage_metrics.py", 186)
    polling = {
        "recv": (frame("Socket.recv_pyobj", "zmq/sugar/socket.py", 1033),
                 frame("SchedulerRequestReceiver._pull_raw_reqs", "sglang/srt/managers/scheduler_components/request_receiver.py", 130),
                 frame("Scheduler.ingest_requests", "sglang/srt/managers/scheduler.py", 2205)),
        "next batch": (frame("UnifiedRadixCache.session_records", "sglang/srt/mem_cache/unified_radix_cache.py", 3802),
                       frame("Scheduler.get_next_batch_to_run", "sglang/srt/managers/scheduler.py", 4015), stage),
        "metrics": (frame("SchedulerStageMetricsRecorder._sample", "sglang/srt/managers/scheduler_stage_metrics.py", 150), stage),
    }
    for what, inner in polling.items():
        thread = ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=True, frames=(*inner, *loop))
        assert thread_is_idle(thread), what
    working = (frame("fault_point", "servewatch_sglang_faults.py", 80), frame("_call_impl", "torch/nn/modules/module.py", 1775),
               frame("LlamaForCausalLM.forward", "sglang/srt/models/llama.py", 470),
               frame("Scheduler.run_batch", "sglang/srt/managers/scheduler.py", 3100))
    thread = ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=True, frames=(*working, *loop))
    assert not thread_is_idle(thread)
    assert not thread_is_idle(ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=True,
                                          frames=polling["next batch"][:2]))  # no scheduler loop under it: at work
    # its watchdog thread between two checks (a --native dump: time.sleep's C function innermost) is idle too
    native = (Frame(name="clock_nanosleep", filename="libc.so.6", module="libc.so.6"),
              Frame(name="time_sleep", filename="libpython3.11.so.1.0", module="libpython3.11.so.1.0"))
    bootstrap = (Frame(name="Thread.run", filename="/usr/lib/python3.11/threading.py", short_filename="threading.py", line=982),)
    checker = (frame("WatchdogRaw._watchdog_once", "sglang/srt/utils/watchdog.py", 147),
               frame("WatchdogRaw._watchdog_thread", "sglang/srt/utils/watchdog.py", 127), *bootstrap)
    watchdog = ThreadStack(pid=1, thread_id=2, os_thread_id=2, thread_name="Thread-1 (_watchdog_thread)", active=False,
                           frames=(*native, *checker))
    assert thread_is_idle(watchdog)
    # without time.sleep innermost (a lock, a wait in its own code), or on the main thread: not idle
    assert not thread_is_idle(ThreadStack(pid=1, thread_id=2, os_thread_id=2, thread_name="Thread-1", active=False,
                                          frames=(native[0], *checker)))
    assert not thread_is_idle(ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=False,
                                          frames=(*native, *checker)))
