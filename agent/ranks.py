"""Parallel ranks and roles of a server process, read from its process title.

Owns the title grammar of the serving frameworks (:func:`parse_title`), the rank label
(:func:`rank_label`), the rank in the server's world (:func:`rank_from_title`,
:func:`world_ranks`) and :func:`target_attributes`. Imports only the standard library.

Grammars (each framework sets its titles with setproctitle):

* vLLM (``vllm/v1/executor/multiproc_executor.py``, ``vllm/utils/system_utils.py``): ``<prefix>::<name>``
  with the prefix from ``VLLM_PROCESS_NAME_PREFIX`` (default ``VLLM``); workers
  ``Worker[_DP n][_PP n][_PCP n][_TP n][_DCP n][_EP n]`` (a coordinate only when its size is over
  1, so ``VLLM::Worker`` is the only worker of a TP=1 engine), ``EngineCore[_DP n]``,
  ``DPEngineCoreActor_DP n``, ``DPCoordinator``, ``APIServer_<i>`` / ``APIServer_DP n``.
* SGLang: ``sglang::scheduler[_DP n][_PP n][_ATTN_CP n][_MOE_DP n][_TP n][_EP n]``,
  ``sglang::detokenizer``, ``sglang::data_parallel_controller``, ``sglang::tokenizer``.

Roles: workers and schedulers are ranks; engine cores, DP coordinators and DP controllers are
coordinators; API servers, tokenizers and detokenizers are frontends; any other ``x::name``
with a ``TP`` coordinate is a rank (a server following SGLang's grammar); anything else is no rank.

The rank in the world is ``(pp * pcp_size + pcp) * tp_size + tp`` (vLLM's and SGLang's layout of
a world: pipeline stages outermost, tensor-parallel ranks innermost; DCP/ATTN_CP/MOE_DP/EP subdivide
other groups and add no rank). A DP coordinate names the replica (its own world), not a rank. In a
multi-node server the TP and PP numbers in titles are global, so the rank is the global rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "TitleInfo",
    "parse_title",
    "rank_from_title",
    "rank_label",
    "target_attributes",
    "world_ranks",
]

#: A coordinate token of a title (``TP3``); ``ATTN_CP``/``MOE_DP`` are two tokens (``ATTN``, ``CP1``).
_COORD_TOKEN = re.compile(r"^(PCP|DCP|DP|PP|TP|EP|CP)(\d+)$")
_COMPOUND = {("ATTN", "CP"): "ATTN_CP", ("MOE", "DP"): "MOE_DP"}

_RANK_NAMES = frozenset({"worker", "scheduler"})
_COORDINATOR_NAMES = frozenset({"enginecore", "dpenginecoreactor", "dpcoordinator", "data_parallel_controller"})
_FRONTEND_NAMES = frozenset({"apiserver", "detokenizer", "tokenizer", "tokenizer_manager"})


@dataclass(frozen=True, slots=True)
class TitleInfo:
    """A parsed ``prefix::name_COORDn...`` title.

    Attributes:
        prefix: before ``::`` (``VLLM``, ``sglang``, a custom ``VLLM_PROCESS_NAME_PREFIX``).
        name: the process kind (``Worker``, ``EngineCore``, ``scheduler``, ``detokenizer``).
        coords: ``(("DP", 0), ("TP", 1))`` in title order.
        role: ``rank``, ``coordinator``, ``frontend`` or ``""`` (not a server process we know).
    """

    prefix: str
    name: str
    coords: tuple[tuple[str, int], ...]
    role: str

    def get(self, kind: str) -> int | None:
        """The number of coordinate ``kind`` (``"TP"``), ``None`` when absent."""
        return next((n for k, n in self.coords if k == kind), None)

    @property
    def label(self) -> str:
        """``DP0_TP1``; ``""`` without coordinates."""
        return "_".join(f"{k}{n}" for k, n in self.coords)


def _coord_at(tokens: Sequence[str], i: int) -> tuple[str, int, int] | None:
    """The coordinate starting at ``tokens[i]``: ``(kind, number, tokens used)``, or ``None``."""
    nxt = _COORD_TOKEN.match(tokens[i + 1]) if i + 1 < len(tokens) else None
    if nxt is not None and (tokens[i], nxt.group(1)) in _COMPOUND:
        return _COMPOUND[(tokens[i], nxt.group(1))], int(nxt.group(2)), 2
    m = _COORD_TOKEN.match(tokens[i])
    if m is not None and m.group(1) != "CP":
        return m.group(1), int(m.group(2)), 1
    return None


def _split(rest: str) -> tuple[str, tuple[tuple[str, int], ...]]:
    """``scheduler_DP0_ATTN_CP1_TP2_tag`` -> ``("scheduler", (("DP", 0), ("ATTN_CP", 1), ("TP", 2)))``:
    the name is the tokens before the first coordinate; tokens after the coordinates that are none
    (a tag) are ignored; an index with no coordinate (``APIServer_0``) is not part of the name."""
    tokens = rest.split("_")
    name: list[str] = []
    coords: list[tuple[str, int]] = []
    i = 0
    while i < len(tokens):
        found = _coord_at(tokens, i)
        if found is not None:
            coords.append(found[:2])
            i += found[2]
            continue
        if not coords and not tokens[i].isdigit():
            name.append(tokens[i])
        i += 1
    return "_".join(name), tuple(coords)


def parse_title(title: str) -> TitleInfo | None:
    """The parts of a ``prefix::name[_COORDn...]`` title, or ``None`` for a title without ``::``."""
    prefix, sep, rest = (title or "").strip().partition("::")
    words = rest.split()
    if not sep or not words:
        return None
    name, coords = _split(words[0])
    base = name.lower()
    if base in _RANK_NAMES or (base not in _COORDINATOR_NAMES | _FRONTEND_NAMES and any(k == "TP" for k, _ in coords)):
        role = "rank"
    elif base in _COORDINATOR_NAMES:
        role = "coordinator"
    elif base in _FRONTEND_NAMES:
        role = "frontend"
    else:
        role = ""
    return TitleInfo(prefix=prefix, name=name, coords=coords, role=role)


def rank_label(title: str) -> str:
    """``"DP0_TP1"`` for ``sglang::scheduler_DP0_TP1``; ``""`` when the title names no coordinate."""
    info = parse_title(title)
    return info.label if info is not None else ""


def _rank(info: TitleInfo, tp_size: int, pcp_size: int) -> int:
    tp, pp, pcp = info.get("TP") or 0, info.get("PP") or 0, info.get("PCP") or 0
    return (pp * pcp_size + pcp) * tp_size + tp


def rank_from_title(title: str) -> int | None:
    """The rank a title names in its world, alone (sizes from its own coordinates): the TP index
    for ``sglang::scheduler_DP0_TP3`` (3) and ``VLLM::Worker_TP1`` (1), 0 for a TP=1 worker
    (``VLLM::Worker``, ``sglang::scheduler``); ``None`` for a process that is no rank. With PP or
    PCP coordinates the sizes of the others are needed: see :func:`world_ranks`."""
    info = parse_title(title)
    if info is None or info.role != "rank":
        return None
    tp = info.get("TP") or 0
    return _rank(info, tp + 1, (info.get("PCP") or 0) + 1)


def world_ranks(titles: Sequence[str]) -> list[int | None]:
    """The rank of each title in one server's world, the sizes read from all of them.

    ``tp_size`` is one more than the highest TP number seen (likewise PCP), so
    ``Worker_PP0_TP0``, ``Worker_PP0_TP1``, ``Worker_PP1_TP0``, ``Worker_PP1_TP1`` are ranks 0..3;
    titles with the same coordinates (two replicas) get the same rank, which the caller splits by
    world. ``None`` for a title that is no rank.
    """
    infos = [parse_title(t) for t in titles]
    ranks = [i for i in infos if i is not None and i.role == "rank"]
    tp_size = max([(i.get("TP") or 0) for i in ranks], default=0) + 1
    pcp_size = max([(i.get("PCP") or 0) for i in ranks], default=0) + 1
    return [(_rank(i, tp_size, pcp_size) if i is not None and i.role == "rank" else None) for i in infos]


def target_attributes(titles: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Span attributes for the ranks among ``titles``: ``{"servewatch.target.ranks": ("TP0", "TP1")}``
    (empty when none has a rank)."""
    labels = tuple(label for label in (rank_label(t) for t in titles) if label)
    return {"servewatch.target.ranks": labels} if labels else {}
