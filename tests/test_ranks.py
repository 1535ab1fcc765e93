"""Titles → roles, coordinates and ranks (agent.ranks), per the frameworks' own grammars:
vLLM ``Worker[_DP n][_PP n][_PCP n][_TP n][_DCP n][_EP n]`` (vllm/v1/executor/multiproc_executor.py),
``EngineCore[_DP n]``, ``VLLM_PROCESS_NAME_PREFIX``; SGLang
``scheduler[_DP n][_PP n][_ATTN_CP n][_MOE_DP n][_TP n][_EP n]``."""

from __future__ import annotations

import pytest

import agent.ranks as ranks_mod
from agent.ranks import parse_title, rank_from_title, rank_label, world_ranks


def test_public_names_match_all() -> None:
    assert all(hasattr(ranks_mod, n) for n in ranks_mod.__all__)


@pytest.mark.parametrize(("title", "role", "label", "rank"), [
    ("VLLM::Worker", "rank", "", 0),  # TP=1: no coordinate, the only rank
    ("VLLM::Worker_TP1", "rank", "TP1", 1),
    ("VLLM::Worker_DP1_PP0_PCP1_TP1_DCP0_EP3", "rank", "DP1_PP0_PCP1_TP1_DCP0_EP3", 3),
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
