"""Titles → roles, coordinates and ranks (agent.model.ranks), per the frameworks' own grammars:
vLLM ``Worker[_DP n][_PP n][_PCP n][_TP n][_DCP n][_EP n]`` (vllm/v1/executor/multiproc_executor.py),
``EngineCore[_DP n]``, ``VLLM_PROCESS_NAME_PREFIX``; SGLang
``scheduler[_DP n][_PP n][_ATTN_CP n][_MOE_DP n][_TP n][_EP n]``."""

from __future__ import annotations

import pytest

import agent.model.ranks as ranks_mod
from agent.model.ranks import (
    RankEnviron,
    distinct_env_ranks,
    parse_rank_environ,
    parse_title,
    rank_among,
    rank_from_title,
    rank_label,
    world_ranks,
)


def test_public_names_match_all() -> None:
    assert all(hasattr(ranks_mod, n) for n in ranks_mod.__all__)


@pytest.mark.parametrize(("title", "role", "label", "rank"), [
    ("VLLM::Worker", "rank", "", 0),  # TP=1: no coordinate, the only rank
    ("VLLM::Worker_TP1", "rank", "TP1", 1),
    # PCP1_TP1 is rank 1 * tp_size + 1: one title does not say tp_size (world_ranks reads it from all)
    ("VLLM::Worker_DP1_PP0_PCP1_TP1_DCP0_EP3", "rank", "DP1_PP0_PCP1_TP1_DCP0_EP3", None),
    ("VLLM::Worker_PP1_TP0", "rank", "PP1_TP0", None),  # rank 2 at TP=2, 4 at TP=4: never a guess (1)
    ("VLLM::Worker_PP1", "rank", "PP1", 1),  # TP=1: vLLM writes no TP coordinate
    ("VLLM::Worker_TP1_EP1", "rank", "TP1_EP1", 1),
    ("ray::RayWorkerWrapper", "", "", None),  # vLLM on Ray: the title names no rank (vLLM #50835)
    ("myprefix::Worker_TP2", "rank", "TP2", 2),  # VLLM_PROCESS_NAME_PREFIX
    ("VLLM::EngineCore", "coordinator", "", None),
    ("VLLM::EngineCore_DP1", "coordinator", "DP1", None),
    ("VLLM::DPCoordinator", "coordinator", "", None),
    ("VLLM::APIServer_0", "frontend", "", None),
    ("VLLM::APIServer_DP1", "frontend", "DP1", None),
    ("sglang::scheduler", "rank", "", 0),
    ("sglang::scheduler_DP1_PP0_ATTN_CP1_MOE_DP0_TP2_EP1", "rank", "DP1_PP0_ATTN_CP1_MOE_DP0_TP2_EP1", 2),
    ("sglang::scheduler_TP3_d41d8c", "rank", "TP3", 3),  # a tag after the coordinates
    ("sglang::detokenizer", "frontend", "", None),
    ("sglang::data_parallel_controller", "coordinator", "", None),
    ("fix::main", "", "", None),  # not a rank: never a made-up number
    ("sglang::schedul", "", "", None),  # a zombie's comm, cut at 15 characters
    ("python3 serve.py", None, "", None),
])
def test_titles_give_role_coordinates_and_rank(title: str, role: str | None, label: str, rank: int | None) -> None:
    info = parse_title(title)
    assert (info.role if info is not None else None) == role
    assert rank_label(title) == label
    assert rank_from_title(title) == rank


def test_world_ranks_are_stable_and_global_with_pipeline_stages() -> None:
    """Worker_PP0_TP0 and Worker_PP1_TP0 are different ranks (never both 0, never numbered in
    discovery order); on the second node of a PP=2 server the ranks are the global ones."""
    titles = ["VLLM::Worker_PP1_TP1", "VLLM::Worker_PP0_TP0", "VLLM::EngineCore", "VLLM::Worker_PP1_TP0",
              "VLLM::Worker_PP0_TP1"]
    assert world_ranks(titles) == [3, 0, None, 2, 1]
    assert world_ranks(list(reversed(titles))) == [1, 2, None, 0, 3]  # same ranks in any order
    assert world_ranks(["VLLM::Worker_PP1_TP0", "VLLM::Worker_PP1_TP1"]) == [2, 3]  # node 2 of PP=2, TP=2
    # one title among its server's (what timeline and report number a process by)
    assert rank_among("VLLM::Worker_PP1_TP0", titles) == 2 and rank_among("VLLM::Worker_PP0_TP1", titles) == 1
    assert rank_among("VLLM::EngineCore", titles) is None and rank_among("sglang::scheduler_TP1", []) == 1


def test_the_rank_environ_reads_the_rank_variables_and_nothing_else() -> None:
    """/proc/PID/environ content: RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE (torch.distributed's
    env:// and torchrun's variables) are read; no other value is kept; a blank area (setproctitle
    without SPT_NOENV) says nothing."""
    data = b"HF_TOKEN=hf_secret\0XRANK=7\0RANK=2\0LOCAL_RANK=0\0WORLD_SIZE=4\0LOCAL_WORLD_SIZE=2\0PATH=/bin\0"
    env = parse_rank_environ(data)
    assert env == RankEnviron(rank=2, local_rank=0, world_size=4, local_world_size=2)
    assert env.global_rank == 2 and "hf_secret" not in repr(env)
    assert env.describe() == "RANK=2, LOCAL_RANK=0, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2"
    assert parse_rank_environ(b"\0" * 64) is None  # blanked by setproctitle
    assert parse_rank_environ(b"RANK=x\0PATH=/bin") is None
    # LOCAL_RANK is the global rank only on one node (LOCAL_WORLD_SIZE == WORLD_SIZE)
    assert parse_rank_environ(b"LOCAL_RANK=1\0WORLD_SIZE=2\0LOCAL_WORLD_SIZE=2").global_rank == 1
    assert parse_rank_environ(b"LOCAL_RANK=1\0WORLD_SIZE=4\0LOCAL_WORLD_SIZE=2").global_rank is None


def test_a_live_process_environment_gives_its_rank(tmp_path) -> None:
    """A real child with RANK in its environment (SPT_NOENV: setproctitle leaves it readable, as
    Ray sets it) and one titled without SPT_NOENV (the area blanked: nothing read)."""
    import os
    import subprocess
    import sys

    from agent.host.targets import rank_environ

    code = "import setproctitle, sys; setproctitle.setproctitle('ray::RayWorkerWrapper'); print('up', flush=True); sys.stdin.read()"
    procs = []
    try:
        for noenv in ("1", None):
            env = {**os.environ, "RANK": "3", "WORLD_SIZE": "4", "HF_TOKEN": "hf_secret"}
            env.pop("SPT_NOENV", None)
            if noenv:
                env["SPT_NOENV"] = noenv
            proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            procs.append(proc)
            assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        assert rank_environ(procs[0].pid) == RankEnviron(rank=3, world_size=4)
        assert rank_environ(procs[1].pid) is None
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate(timeout=10)  # reaps it and closes its pipes


def test_a_rank_several_processes_share_was_inherited_and_names_none() -> None:
    """A Kubernetes PyTorchJob pod's RANK (its node rank) passed down to every worker: no worker's
    rank; distinct ones are kept."""
    env = RankEnviron
    assert distinct_env_ranks([env(rank=1), env(rank=1), None]) == [None, None, None]
    assert distinct_env_ranks([env(rank=0), env(rank=2), env(local_rank=1), None]) == [0, 2, None, None]
