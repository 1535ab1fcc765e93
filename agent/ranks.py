"""Parallel ranks of a server process, read from its process title.

Owns :func:`rank_label`, :func:`rank_from_title` and :func:`target_attributes`. SGLang titles schedulers
``sglang::scheduler`` with suffixes ``_DP{d}``, ``_PP{p}``, ``_ATTN_CP{c}``, ``_MOE_DP{m}``,
``_TP{t}``, ``_EP{e}`` in that order (FIELD-NOTES); vLLM ``VLLM::Worker_TP0`` and
``VLLM::EngineCore_DP0``. In a multi-node server the numbers are global ranks, so the labels
tell which part of the job a host holds. Imports only the standard library.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["rank_from_title", "rank_label", "target_attributes"]

_RANK = re.compile(r"(?<![A-Za-z])(ATTN_CP|MOE_DP|DP|PP|TP|EP)(\d+)(?![A-Za-z])")
_TP_RE = re.compile(r"_TP(\d+)(?:_|$)")


def rank_label(title: str) -> str:
    """``"DP0_TP1"`` for ``sglang::scheduler_DP0_TP1``; ``""`` when the title names no rank."""
    _, sep, name = title.partition("::")
    if not sep:
        return ""
    return "_".join(f"{kind}{num}" for kind, num in _RANK.findall(name))


def rank_from_title(title: str) -> int | None:
    """The TP rank in an SGLang-style title (``sglang::scheduler_DP0_TP3`` -> 3), else ``None``."""
    m = _TP_RE.search(title or "")
    return int(m.group(1)) if m else None


def target_attributes(titles: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Span attributes for the ranks among ``titles``: ``{"servewatch.target.ranks": ("TP0", "TP1")}``
    (empty when none has a rank)."""
    labels = tuple(label for label in (rank_label(t) for t in titles) if label)
    return {"servewatch.target.ranks": labels} if labels else {}
