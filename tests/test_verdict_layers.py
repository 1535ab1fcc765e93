"""Communication layers beyond torch.distributed's collectives (issue 32 item 2): point-to-point
send/recv (torch.distributed, vLLM's and SGLang's pipeline-parallel ``GroupCoordinator`` wrappers),
DeepEP's dispatch/combine, pynccl, the custom all-reduces and NVSHMEM spins. Each layer is read off
a stack whose frames carry the real module paths and function names (vLLM 0.32, SGLang 0.5.23,
torch 2.13's gloo, DeepEP's ``deep_ep/buffer.py``); the verdict then names the P2P ordering deadlock,
or the rank outside the layer."""

from __future__ import annotations

import pytest

import agent.verdict.rules as verdict_mod
from agent.model.stacks import Frame, ThreadStack, comm_layer
from agent.verdict.rules import (
    Evidence,
    FrameClass,
    RankEvidence,
    StackClass,
    classify_wait,
    decide,
)

_SP = "/v/lib/python3.11/site-packages/"
_C10D = _SP + "torch/distributed/distributed_c10d.py"
_VLLM_PS = _SP + "vllm/distributed/parallel_state.py"
_SGL_PS = _SP + "sglang/srt/distributed/parallel_state.py"
_VLLM_DC = _SP + "vllm/distributed/device_communicators/"
_SGL_DC = _SP + "sglang/srt/distributed/device_communicators/"


def _py(name: str, path: str, line: int = 1) -> Frame:
    return Frame(name=name, filename=path, short_filename=path.split("site-packages/")[-1], line=line)


def _native(name: str, lib: str = "libtorch_cpu.so") -> Frame:
    return Frame(name=name, filename=lib, module=lib)


def _main(*frames: Frame, active: bool = False) -> list[ThreadStack]:
    return [ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=active,
                        frames=(*frames, _py("execute_model", "/app/worker.py", 40), _py("<module>", "/app/main.py", 1)))]


#: The innermost frames a py-spy --native dump shows (gloo recv as seen on torch 2.13 here).
_GLOO_RECV = (_native("pthread_cond_timedwait", "libc.so.6"), _native("gloo::transport::tcp::UnboundBuffer::waitRecv"),
              _native("c10d::ProcessGroupGloo::RecvWork::wait"), _native("pybind11::cpp_function::dispatcher",
                                                                         "libtorch_python.so"))

P2P_STACKS = {
    "torch recv": ((*_GLOO_RECV, _py("recv", _C10D, 2799)), "recv", "recv (torch/distributed/distributed_c10d.py:2799)"),
    "torch send": ((_py("send", _C10D, 2750),), "send", "send (torch/distributed/distributed_c10d.py:2750)"),
    "torch isend": ((_py("isend", _C10D, 2680),), "send", "isend (torch/distributed/distributed_c10d.py:2680)"),
    "torch irecv": ((_py("irecv", _C10D, 2710),), "recv", "irecv (torch/distributed/distributed_c10d.py:2710)"),
    "torch batch_isend_irecv": ((_py("batch_isend_irecv", _C10D, 2900),), "send/recv",
                                "batch_isend_irecv (torch/distributed/distributed_c10d.py:2900)"),
    # irecv(...).wait(): no Python frame of torch's, the Work's native wait says it
    "Work.wait of irecv": (_GLOO_RECV, "recv", "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)"),
    "vLLM recv_tensor_dict": ((_py("recv", _C10D, 2799), _py("GroupCoordinator.recv_object", _VLLM_PS, 940),
                               _py("GroupCoordinator.recv_tensor_dict", _VLLM_PS, 1262)), "recv",
                              "recv (torch/distributed/distributed_c10d.py:2799)"),
    "vLLM send_tensor_dict": ((_py("GroupCoordinator.send_tensor_dict", _VLLM_PS, 1100),), "send",
                              "GroupCoordinator.send_tensor_dict (vllm/distributed/parallel_state.py:1100)"),
    "vLLM send_object": ((_py("GroupCoordinator.send_object", _VLLM_PS, 910),), "send",
                         "GroupCoordinator.send_object (vllm/distributed/parallel_state.py:910)"),
    "vLLM recv_object": ((_py("GroupCoordinator.recv_object", _VLLM_PS, 930),), "recv",
                         "GroupCoordinator.recv_object (vllm/distributed/parallel_state.py:930)"),
    "vLLM cpu_communicator recv_tensor_dict": (
        (_py("CpuCommunicator.recv_tensor_dict", _VLLM_DC + "cpu_communicator.py", 165),
         _py("GroupCoordinator.recv_tensor_dict", _VLLM_PS, 1262)), "recv",
        "CpuCommunicator.recv_tensor_dict (vllm/distributed/device_communicators/cpu_communicator.py:165)"),
    "vLLM pynccl recv": ((_py("PyNcclCommunicator.recv", _VLLM_DC + "pynccl.py", 520),
                          _py("GroupCoordinator.recv", _VLLM_PS, 1395)), "recv",
                         "PyNcclCommunicator.recv (vllm/distributed/device_communicators/pynccl.py:520)"),
    "SGLang recv_tensor_dict": ((_py("GroupCoordinator.recv_tensor_dict", _SGL_PS, 1850),), "recv",
                                "GroupCoordinator.recv_tensor_dict (sglang/srt/distributed/parallel_state.py:1850)"),
    "SGLang send_tensor_dict": ((_py("GroupCoordinator.send_tensor_dict", _SGL_PS, 1790),), "send",
                                "GroupCoordinator.send_tensor_dict (sglang/srt/distributed/parallel_state.py:1790)"),
    "SGLang send_object": ((_py("GroupCoordinator.send_object", _SGL_PS, 1620),), "send",
                           "GroupCoordinator.send_object (sglang/srt/distributed/parallel_state.py:1620)"),
    "SGLang recv_object": ((_py("GroupCoordinator.recv_object", _SGL_PS, 1670),), "recv",
                           "GroupCoordinator.recv_object (sglang/srt/distributed/parallel_state.py:1670)"),
    "SGLang pynccl send": ((_py("PyNcclCommunicator.send", _SGL_DC + "pynccl.py", 300),), "send",
                           "PyNcclCommunicator.send (sglang/srt/distributed/device_communicators/pynccl.py:300)"),
}


@pytest.mark.parametrize("case", sorted(P2P_STACKS))
def test_point_to_point_sends_and_receives_are_waits_in_a_p2p_layer(case: str) -> None:
    frames, op, label = P2P_STACKS[case]
    assert classify_wait(_main(*frames)) == StackClass(FrameClass.COLLECTIVE, label, op)
    layers = {layer.kind for f in frames if (layer := comm_layer(f)) is not None}
    assert layers == {"p2p"}, (case, layers)


#: stack, the layer it is in, the frame named
LAYER_STACKS = {
    "DeepEP dispatch": ((_py("Buffer.dispatch", _SP + "deep_ep/buffer.py", 320),
                         _py("DeepEPNormalDispatcher.dispatch_b", _SP + "sglang/srt/layers/moe/token_dispatcher/deepep.py", 668)),
                        "DeepEP expert-parallel dispatch/combine", "Buffer.dispatch (deep_ep/buffer.py:320)"),
    "DeepEP combine": ((_py("Buffer.combine", _SP + "deep_ep/buffer.py", 400),),
                       "DeepEP expert-parallel dispatch/combine", "Buffer.combine (deep_ep/buffer.py:400)"),
    "DeepEP low_latency_dispatch": (
        (_py("Buffer.low_latency_dispatch", _SP + "deep_ep/buffer.py", 520),
         _py("DeepEPLLPrepareAndFinalize.prepare", _SP + "vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py", 294)),
        "DeepEP expert-parallel dispatch/combine", "Buffer.low_latency_dispatch (deep_ep/buffer.py:520)"),
    "DeepEP low_latency_combine": ((_py("Buffer.low_latency_combine", _SP + "deep_ep/buffer.py", 600),),
                                   "DeepEP expert-parallel dispatch/combine",
                                   "Buffer.low_latency_combine (deep_ep/buffer.py:600)"),
    "DeepEP native intranode_dispatch": ((_native("deep_ep::Buffer::intranode_dispatch", "deep_ep_cpp.so"),
                                          _py("forward", "/app/moe.py", 9)),
                                         "DeepEP expert-parallel dispatch/combine",
                                         "deep_ep::Buffer::intranode_dispatch (deep_ep_cpp.so)"),
    "vLLM pynccl all_reduce": ((_py("PyNcclCommunicator.all_reduce", _VLLM_DC + "pynccl.py", 150),
                                _py("CudaCommunicator.all_reduce", _VLLM_DC + "cuda_communicator.py", 200)),
                               "vLLM/SGLang pynccl",
                               "PyNcclCommunicator.all_reduce (vllm/distributed/device_communicators/pynccl.py:150)"),
    "SGLang pynccl all_reduce": ((_py("PyNcclCommunicator.all_reduce", _SGL_DC + "pynccl.py", 160),),
                                 "vLLM/SGLang pynccl",
                                 "PyNcclCommunicator.all_reduce (sglang/srt/distributed/device_communicators/pynccl.py:160)"),
    "vLLM custom all-reduce": ((_py("CustomAllreduce.custom_all_reduce", _VLLM_DC + "custom_all_reduce.py", 300),),
                               "vLLM/SGLang custom all-reduce",
                               "CustomAllreduce.custom_all_reduce (vllm/distributed/device_communicators/custom_all_reduce.py:300)"),
    "SGLang custom all-reduce": ((_py("CustomAllreduce.all_reduce", _SGL_DC + "custom_all_reduce.py", 380),),
                                 "vLLM/SGLang custom all-reduce",
                                 "CustomAllreduce.all_reduce (sglang/srt/distributed/device_communicators/custom_all_reduce.py:380)"),
    "NVSHMEM native barrier": ((_native("nvshmem_barrier_all", "libnvshmem_host.so.3"), _py("forward", "/app/moe.py", 9)),
                               "NVSHMEM", "nvshmem_barrier_all (libnvshmem_host.so.3)"),
    "NVSHMEM python": ((_py("barrier_all", _SP + "nvshmem/core/collective.py", 40),), "NVSHMEM",
                       "barrier_all (nvshmem/core/collective.py:40)"),
}


@pytest.mark.parametrize("case", sorted(LAYER_STACKS))
def test_deepep_pynccl_custom_all_reduce_and_nvshmem_are_collective_waits(case: str) -> None:
    frames, layer, label = LAYER_STACKS[case]
    # a host-side spin: py-spy sees the thread on CPU (active), never idle
    assert classify_wait(_main(*frames, active=True)) == StackClass(FrameClass.COLLECTIVE, label, "")
    assert comm_layer(frames[0]) is not None and comm_layer(frames[0]).name == layer  # type: ignore[union-attr]


def test_deepep_helpers_that_do_not_wait_are_not_the_layer() -> None:
    """Only the dispatch/combine entry points wait for every expert-parallel rank; computing the
    layout is the rank's own work."""
    layout = _py("Buffer.get_dispatch_layout", _SP + "deep_ep/buffer.py", 250)
    assert comm_layer(layout) is None
    assert classify_wait(_main(layout, active=True)).frame_class is FrameClass.COMPUTE


def _rank(r: int, stack: list[ThreadStack], **kw: object) -> RankEvidence:
    found = classify_wait(stack)
    return RankEvidence(rank=r, pid=40 + r, frame_class=found.frame_class, frame=found.frame, p2p=found.p2p, **kw)  # type: ignore[arg-type]


def test_both_pipeline_stages_receiving_first_is_a_named_p2p_ordering_deadlock() -> None:
    """PyTorch #172668: both stages post recv first; each waits for the other to send."""
    ranks = [_rank(r, _main(*_GLOO_RECV, _py("recv", _C10D, 2799)), steps_before=7, steps_after=7) for r in (0, 1)]
    v = verdict_mod.judge(Evidence.of(ranks, trigger="stall"))
    assert (v.kind, v.rule, v.culprit_ranks, v.culprit_pids, v.confidence, v.hung) == (
        "deadlock", "p2p_deadlock", (0, 1), (40, 41), "high", True)
    assert v.reason == ("P2P ordering deadlock: rank 0 waits in recv, rank 1 waits in recv: each waits for the other "
                        "to send first")
    assert v.evidence[0] == "rank 0 pid 40; p2p recv: recv (torch/distributed/distributed_c10d.py:2799); steps 7->7"
    # the call sites tell the order: never --locals
    assert v.next_step == ("py-spy dump --pid 40; py-spy dump --pid 41 (each one's send/recv call site: one stage "
                           "must send before it receives)")
    assert verdict_mod.next_step_of({**v.to_json(), "next": ""}) == v.next_step
    # hard mode may act: a high-confidence verdict naming both
    assert verdict_mod.hard_signal_plan(v, target_pids=[40, 41], stalled_pid=40)[0] == [40, 41]


def test_p2p_deadlock_confidence_and_where_it_does_not_apply() -> None:
    recv = _main(_py("GroupCoordinator.recv_tensor_dict", _VLLM_PS, 1262))
    send = _main(_py("GroupCoordinator.send_tensor_dict", _VLLM_PS, 1100))
    # three stages, mixed directions: still every rank in P2P, but which pair is wrong is not known
    mixed = decide([_rank(0, send), _rank(1, recv), _rank(2, recv)], trigger="stall")
    assert (mixed.kind, mixed.culprit_ranks, mixed.confidence) == ("deadlock", (0, 1, 2), "medium")
    assert mixed.reason == ("P2P ordering deadlock: rank 0 waits in send, rank 1 waits in recv, rank 2 waits in recv: "
                            "no rank's send meets its peer's receive (mismatched peers or order)")
    # no progress reading (a one-shot dump): medium
    assert decide([_rank(0, recv), _rank(1, recv)]).confidence == "medium"
    # a rank of the world unseen (it may be the one about to send): not a deadlock
    unseen = decide(Evidence.of([_rank(0, recv), _rank(1, recv)], trigger="stall", world_size=3))
    assert unseen.rule != "p2p_deadlock"
    # steps advancing: not hung
    moving = decide([_rank(r, recv, steps_before=1, steps_after=5) for r in (0, 1)])
    assert moving.kind == "progressing"


def test_a_stage_receiving_from_a_stage_hung_in_compute_names_the_hung_stage() -> None:
    """Rank 0 waits in recv for rank 1, which hangs in its forward: rank 1 is behind, the culprit."""
    recv = _main(_py("recv", _C10D, 2799), _py("GroupCoordinator.recv_object", _SGL_PS, 1670))
    hung = _main(_py("_hang_in_compute", "/app/model.py", 12), active=True)
    v = decide([_rank(0, recv), _rank(1, hung)], trigger="stall")
    assert (v.kind, v.rule, v.culprit_ranks, v.culprit_pids, v.confidence) == ("behind", "stacks_behind", (1,), (41,), "medium")
    assert v.reason == ("behind: rank 1 not in a collective (rank 1 in compute: _hang_in_compute (/app/model.py:12)); "
                        "rank 0 waits in a P2P recv for it")


def test_ranks_spinning_in_deepep_dispatch_name_the_rank_that_never_dispatched() -> None:
    """SGLang #26482: ranks spin host-side in DeepEP's dispatch (no torch.distributed call) while one
    rank hangs before it: that rank, not 'all ranks in compute'."""
    spin = _main(_py("Buffer.dispatch", _SP + "deep_ep/buffer.py", 320),
                 _py("DeepEPNormalDispatcher.dispatch_b", _SP + "sglang/srt/layers/moe/token_dispatcher/deepep.py", 668),
                 active=True)
    hung = _main(_py("_hang_in_compute", "/app/model.py", 12), active=True)
    v = decide([_rank(0, spin), _rank(1, hung), _rank(2, spin)], trigger="stall")
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.confidence) == ("behind", (1,), (41,), "medium")
    assert v.reason == ("behind: rank 1 not in a collective (rank 1 in compute: _hang_in_compute (/app/model.py:12)); "
                        "ranks 0,2 wait in one")


def _nccl_fr(me: int, op: str, peer: int, *, pg: str = "0", ranks: str = "[0, 1]", state: str = "scheduled") -> dict:
    """A rank's NCCL Flight Recorder with one all_reduce done, then a P2P op (torch's names:
    ``nccl:send 0->1``, ``nccl:recv 0<-1``, in group ranks)."""
    done = {"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 1, "p2p_seq_id": 0,
            "is_p2p": False, "profiling_name": "nccl:all_reduce", "state": "completed"}
    arrow = "->" if op == "send" else "<-"
    p2p = {"pg_id": int(pg), "process_group": [pg, "pp_group"], "collective_seq_id": 0, "p2p_seq_id": 1,
           "is_p2p": True, "profiling_name": f"nccl:{op} {me}{arrow}{peer}", "state": state}
    return {"entries": [done, p2p], "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
                                                  pg: {"name": pg, "desc": "pp_group", "ranks": ranks}},
            "pg_status": {"0": {"last_enqueued_collective": 1, "last_completed_collective": 1}}}


def test_the_peer_of_a_p2p_wait_is_named_from_an_nccl_flight_recorder() -> None:
    from agent.verdict.flightrec import pending_p2p

    # the pipeline group of global ranks 1 and 3: group rank 1 is global rank 3
    assert pending_p2p(_nccl_fr(0, "recv", 1, pg="2", ranks="[1, 3]")) == ("recv", 3)
    assert pending_p2p(_nccl_fr(1, "send", 0)) == ("send", 0)
    assert pending_p2p(_nccl_fr(1, "send", 0, state="completed")) is None
    assert pending_p2p({"entries": [], "pg_status": {}}) is None  # gloo: no P2P entry
    recv = _main(_py("PyNcclCommunicator.recv", _VLLM_DC + "pynccl.py", 520))
    ranks = [_rank(r, recv, fr=_nccl_fr(r, "recv", 1 - r)) for r in (0, 1)]
    v = decide(ranks, trigger="stall")
    assert (v.kind, v.culprit_ranks, v.confidence) == ("deadlock", (0, 1), "high")
    assert v.reason == ("P2P ordering deadlock: rank 0 waits in recv from rank 1, rank 1 waits in recv from rank 0: "
                        "each waits for the other to send first")


def test_a_p2p_deadlock_across_two_hosts_is_named_by_the_job_verdict() -> None:
    """Pipeline stages on two nodes, both in recv: the wait's P2P op crosses the wire in each host's
    evidence summary, and the coordinator's job verdict names the deadlock (an older agent's
    summary, without it, reads as no P2P wait)."""
    from agent.fleet.host_summary import host_evidence
    from agent.fleet.jobverdict import judge_job
    from agent.fleet.messages import Evidence as HostEvidence

    recv = _main(*_GLOO_RECV, _py("recv", _C10D, 2799))
    hosts = []
    for r, host in enumerate(("node-a", "node-b")):
        sent = host_evidence(job="j", host_name=host, agent_id=f"agent-{host}", trace_id="c" * 32,
                             incident_id=f"inc-{host}", bundle_dir="/b",
                             judged=[Evidence.of([_rank(r, recv, steps_before=3, steps_after=3)], trigger="stall",
                                                 world_size=2)])
        hosts.append(HostEvidence.model_validate_json(sent.model_dump_json(by_alias=True)))
    assert [h.ranks[0].p2p for h in hosts] == ["recv", "recv"]
    v = judge_job(hosts, world_size=2)
    assert (v.kind, v.culprit_ranks, v.confidence) == ("deadlock", (0, 1), "high")
    assert v.reason.startswith("P2P ordering deadlock: rank 0 waits in recv, rank 1 waits in recv: each waits for the "
                               "other to send first"), v.reason
    old = HostEvidence.model_validate({**hosts[0].model_dump(by_alias=True), "ranks": [
        {k: val for k, val in hosts[0].ranks[0].model_dump().items() if k != "p2p"}]})
    assert old.ranks[0].p2p == ""


def _unranked(pid: int, title: str, cls: FrameClass, frame: str) -> RankEvidence:
    """A process no source names a rank of (vLLM on Ray: every worker ``ray::RayWorkerWrapper``,
    its environment overwritten by its title, no SDK, no Flight Recorder)."""
    return RankEvidence(pid=pid, role=verdict_mod.Role.PROCESS, title=title, frame_class=cls, frame=frame)


def test_workers_with_no_rank_readable_are_told_apart_by_their_stacks_and_named_by_pid() -> None:
    """Issue 32 item 3: the stacks show which worker is outside the all-reduce although none has a
    rank; a process of another title (the Ray raylet, a frontend) running its own code is not blamed."""
    ray = "ray::RayWorkerWrapper"
    wait = "all_reduce (torch/distributed/distributed_c10d.py:3252)"
    procs = [_unranked(41, ray, FrameClass.COLLECTIVE, wait), _unranked(42, ray, FrameClass.COMPUTE, "forward (/app/model.py:12)"),
             _unranked(43, ray, FrameClass.COLLECTIVE, wait), _unranked(50, "raylet", FrameClass.COMPUTE, "poll (ray/_raylet.py:9)")]
    v = decide(procs, trigger="stall")
    assert (v.kind, v.rule, v.culprit_ranks, v.culprit_pids, v.confidence) == ("behind", "stacks_behind_by_pid", (), (42,), "low")
    assert v.reason == ("behind: pid 42 'ray::RayWorkerWrapper' not in a collective (in compute: forward (/app/model.py:12)); "
                        "pids 41, 43 wait in one (no process's rank could be read: named by pid)")
    # nobody of the waiters' title outside the collective: no culprit by pid
    v = decide([procs[0], procs[2], procs[3]], trigger="stall")
    assert v.rule != "stacks_behind_by_pid" and 50 not in v.culprit_pids, v
    # one process known as a rank: the rank rules decide, not this one
    ranked = RankEvidence(rank=0, pid=41, frame_class=FrameClass.COLLECTIVE, frame=wait)
    assert decide([ranked, *procs[1:]], trigger="stall").rule != "stacks_behind_by_pid"
