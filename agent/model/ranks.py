"""Parallel ranks and roles of a server process, read from its process title.

Owns the title grammar of the serving frameworks (:func:`parse_title`), the rank label
(:func:`rank_label`), the rank in the server's world (:func:`rank_from_title`,
:func:`world_ranks`), the rank a process's own environment names (:class:`RankEnviron`,
:func:`parse_rank_environ`) and :func:`target_attributes`. Imports only the standard library.

Where a rank comes from, best first: what the process itself says (torch.distributed's rank as
its Flight Recorder read or the SDK's step counter recorded it; ``RANK``/``WORLD_SIZE`` in its
environment), then its title. A title alone may name no rank: vLLM on Ray titles every worker
``ray::RayWorkerWrapper`` (vLLM #2479, #50835), and ``Worker_PP1_TP0`` is rank 2 at TP=2 but
rank 1 at TP=1 (the title does not say the TP size: see :func:`rank_from_title`).

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "RANK_VARIABLES",
    "RankEnviron",
    "TitleInfo",
    "distinct_env_ranks",
    "parse_rank_environ",
    "parse_title",
    "rank_among",
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
    """The rank a title names in its world, alone: the TP index for ``sglang::scheduler_DP0_TP3``
    (3) and ``VLLM::Worker_TP1`` (1), 0 for a TP=1 worker (``VLLM::Worker``, ``sglang::scheduler``),
    the stage for ``VLLM::Worker_PP1`` (TP=1: vLLM writes a coordinate only when its size is over
    1); ``None`` for a process that is no rank, and for a PP or PCP index over 0 with an inner
    coordinate (``Worker_PP1_TP0``: rank ``1 * tp_size``, and one title does not say ``tp_size``;
    never a guess): :func:`world_ranks` reads the sizes from all the server's titles."""
    info = parse_title(title)
    if info is None or info.role != "rank":
        return None
    has = {k for k, _ in info.coords}
    if ((info.get("PP") or 0) and has & {"PCP", "TP"}) or ((info.get("PCP") or 0) and "TP" in has):
        return None  # an outer index times a size the title does not say
    return _rank(info, 1, 1)


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


#: The variables of a rank's environment read for its identity, and no other: torch.distributed's
#: ``env://`` initialization reads ``RANK`` and ``WORLD_SIZE`` (torch.distributed docs,
#: "Environment variable initialization"); torchrun also sets ``LOCAL_RANK`` and
#: ``LOCAL_WORLD_SIZE`` (torchrun docs, "Environment Variables").
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True, slots=True)
class RankEnviron:
    """What a process's environment says of its rank (:data:`RANK_VARIABLES`; ``None``: unset or
    not a non-negative integer).

    Only the environment a process was started with is readable from outside
    (``/proc/PID/environ``): a variable it sets in ``os.environ`` later is not, and setproctitle
    blanks the whole area unless ``SPT_NOENV`` is set (Ray sets it for its workers,
    ray-project/ray #15056; SGLang and vLLM do not).
    """

    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None

    @property
    def global_rank(self) -> int | None:
        """``RANK``; else ``LOCAL_RANK`` when the job is one node (``LOCAL_WORLD_SIZE`` equals
        ``WORLD_SIZE``: the local rank is the global one); else ``None``."""
        if self.rank is not None:
            return self.rank
        one_node = self.world_size is not None and self.local_world_size == self.world_size
        return self.local_rank if one_node else None

    def describe(self) -> str:
        """``RANK=1, WORLD_SIZE=3`` (the variables set, in :data:`RANK_VARIABLES` order)."""
        values = (self.rank, self.local_rank, self.world_size, self.local_world_size)
        return ", ".join(f"{name}={v}" for name, v in zip(RANK_VARIABLES, values) if v is not None)

    @classmethod
    def of(cls, env: Mapping[str, str]) -> RankEnviron | None:
        """From an environment already read (``{name: value}``); ``None`` when no rank variable is set."""
        values = [_count(env.get(name, "")) for name in RANK_VARIABLES]
        return cls(*values) if any(v is not None for v in values) else None


def _count(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() and len(text) <= 9 else None


_RANK_PREFIXES = tuple(f"{name}=".encode() for name in RANK_VARIABLES)


def distinct_env_ranks(envs: Sequence[RankEnviron | None]) -> list[int | None]:
    """Each process's :attr:`RankEnviron.global_rank`, kept only where it tells the process apart
    from the others of its server: a value two of them share was inherited, not given (a launcher's
    ``RANK``, as a Kubernetes PyTorchJob pod's node rank, passed down to every worker it spawned),
    and names none of them (``None``)."""
    ranks = [env.global_rank if env is not None else None for env in envs]
    counts: dict[int, int] = {}
    for rank in ranks:
        if rank is not None:
            counts[rank] = counts.get(rank, 0) + 1
    return [rank if rank is not None and counts[rank] == 1 else None for rank in ranks]


def parse_rank_environ(data: bytes) -> RankEnviron | None:
    """The rank variables of ``/proc/PID/environ`` content (``NAME=value`` items separated by NUL).

    Only items whose name is one of :data:`RANK_VARIABLES` are decoded; every other item (tokens,
    keys, passwords) is skipped without its value being decoded or kept. ``None`` when none is set
    (also for a blank area: setproctitle without ``SPT_NOENV``).
    """
    found: dict[str, str] = {}
    for item in data.split(b"\0"):
        if item.startswith(_RANK_PREFIXES):
            name, _, value = item.partition(b"=")
            found.setdefault(name.decode("ascii"), value.decode("ascii", "replace"))
    return RankEnviron.of(found)


def rank_among(title: str, titles: Sequence[str]) -> int | None:
    """The rank ``title`` names in the world of ``titles`` (its server's processes: the sizes read
    from all of them, :func:`world_ranks`): ``VLLM::Worker_PP1_TP0`` among the titles of a PP=2 x
    TP=2 engine is 2. ``None`` for a title that is no rank."""
    return world_ranks([title, *titles])[0]


def target_attributes(titles: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Span attributes for the ranks among ``titles``: ``{"servewatch.target.ranks": ("TP0", "TP1")}``
    (empty when none has a rank)."""
    labels = tuple(label for label in (rank_label(t) for t in titles) if label)
    return {"servewatch.target.ranks": labels} if labels else {}
