"""What the ranks' Flight Recorders say together: desyncs, ranks behind, cycles across groups.

Owns the pure reading of torch's collective Flight Recorder dumps (one per rank, the JSON of
``_dump_fr_trace_json``: ``entries`` with ``pg_id``, ``process_group``, ``collective_seq_id``,
``profiling_name``, sizes, dtypes, ``time_created_ns``; ``pg_status`` with
``last_enqueued_collective`` / ``last_completed_collective`` per process group) into findings the
verdict's rules (:mod:`agent.verdict.rules`) turn into conclusions:

* :func:`find_desync`: at one sequence id of a group every rank recorded, the ranks issued
  different ops/sizes/dtypes (confirmed by torch's ``Op.match``);
* :func:`find_cycle`: ranks waiting in collectives of *different* process groups, each for a rank
  that waits in another group: an ordering deadlock. The missing ranks of each collective come
  from torch's own analyzer (``torch.distributed.flight_recorder``'s ``build_db``: a collective's
  ``missing_ranks``); only the wait-for cycle over them is ours;
* :func:`find_behind`: in one group the ranks disagree on the last collective enqueued;
* :func:`late_arrivals`: the rank that enters the group's collectives last, by far;
* :func:`pending_p2p`: the point-to-point op a rank has not completed and its peer (NCCL records
  ``nccl:recv 1<-0``; gloo records no P2P op).

No I/O, no clock; torch is imported lazily and optionally (without it, desyncs are compared by
signature alone and cycles are read from ``pg_status``). Imports the standard library only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Behind",
    "Cycle",
    "Desync",
    "RankRecorder",
    "find_behind",
    "find_cycle",
    "find_desync",
    "late_arrivals",
    "pending_p2p",
    "warm_up",
]


@dataclass(slots=True)
class RankRecorder:
    """One rank's recorder: per process group, its entries by sequence id, and
    ``(last enqueued, last completed)`` sequence ids.

    Attributes:
        entries: ``{pg: {seq: entry}}`` (collectives only, p2p left out).
        groups: ``{pg: (enqueued, completed)}`` from ``pg_status`` (else from the entries).
        names: ``{pg: name}`` from the entries' ``process_group`` ``[name, desc]``.
        raw: the dump as read (torch's analyzer reads it).
    """

    entries: dict[str, dict[int, Mapping[str, Any]]] = field(default_factory=dict)
    groups: dict[str, tuple[int, int]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(dump: Any) -> RankRecorder | None:
        """The view of one dump, or ``None`` when ``dump`` is not a mapping."""
        if not isinstance(dump, Mapping):
            return None
        fr = RankRecorder(raw=dump)
        for entry in dump.get("entries") or ():
            fr._add_entry(entry)
        status = dump.get("pg_status") or {}
        if isinstance(status, Mapping):
            for pg, st in status.items():
                pair = _status_pair(st)
                if pair is not None:
                    fr.groups[str(pg)] = pair
        for pg, by_seq in fr.entries.items():
            if pg not in fr.groups and by_seq:
                last = max(by_seq)
                fr.groups[pg] = (last, last if by_seq[last].get("state") == "completed" else last - 1)
        return fr

    def _add_entry(self, entry: Any) -> None:
        if not isinstance(entry, Mapping) or entry.get("is_p2p"):
            return
        pg = str(entry.get("pg_id", (entry.get("process_group") or ["?"])[0]))
        seq = entry.get("collective_seq_id")
        if isinstance(seq, int) and seq > 0:
            self.entries.setdefault(pg, {})[seq] = entry
            pgname = entry.get("process_group")
            if isinstance(pgname, (list, tuple)) and len(pgname) == 2:
                self.names[pg] = str(pgname[1] or pgname[0])

    @property
    def empty(self) -> bool:
        return not (self.entries or self.groups)

    def pg_text(self, pg: str) -> str:
        """``pg 1`` or ``pg 1 (tp_group)``."""
        name = self.names.get(pg, "")
        return f"pg {pg}" + (f" ({name})" if name and name not in (pg, "default_pg", "undefined") else "")


def _status_pair(st: Any) -> tuple[int, int] | None:
    if not isinstance(st, Mapping):
        return None
    try:
        return int(st.get("last_enqueued_collective", -1)), int(st.get("last_completed_collective", -1))
    except (TypeError, ValueError):
        return None


def op_name(entry: Mapping[str, Any]) -> str:
    """``all_reduce`` for ``gloo:all_reduce``."""
    name = str(entry.get("profiling_name") or "?")
    return name.split(":", 1)[1] if ":" in name else name


def _signature(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    def norm(v: Any) -> Any:
        return tuple(norm(x) for x in v) if isinstance(v, (list, tuple)) else v

    return (op_name(entry), norm(entry.get("input_sizes")), norm(entry.get("output_sizes")),
            norm(entry.get("input_dtypes")), norm(entry.get("output_dtypes")))


def _describe(entry: Mapping[str, Any]) -> str:
    return f"{op_name(entry)} {list(entry.get('input_sizes') or [])}"


def _ranks_text(ranks: Sequence[int]) -> str:
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(str(r) for r in rs)


# --- torch's analyzer ---------------------------------------------------------------------------


def _quiet(record: logging.LogRecord) -> bool:
    """Filter dropping every record of torch's analyzer's logger (its findings are worded here)."""
    return False


def _analyzer() -> tuple[Any, Any, Any] | None:
    """torch's analyzer: ``(build_db, MatchState, Op)``, or ``None`` when torch (optional on the
    agent side) is absent or broken. Its import-time chatter is not ours to show: torch warns when
    numpy is absent (a plain ``pip install torch``), the analyzer logs "tabulate is not installed"."""
    import warnings

    analyzer_log = logging.getLogger("Flight Recorder")  # its own stderr handler logs every finding
    if _quiet not in analyzer_log.filters:
        analyzer_log.addFilter(_quiet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            from torch.distributed.flight_recorder.components.builder import build_db
            from torch.distributed.flight_recorder.components.types import MatchState, Op
    except Exception:  # noqa: BLE001 - a broken install may raise more than ImportError
        return None
    return build_db, MatchState, Op


def warm_up() -> None:
    """Import torch's Flight Recorder analyzer now (seconds, once) rather than during an incident."""
    _analyzer()


def _torch_match(a: Mapping[str, Any], b: Mapping[str, Any], ranks: set[int]) -> tuple[bool, str] | None:
    """torch's own comparison of two entries (``Op.match`` of ``torch.distributed.flight_recorder``).

    States are set equal first (a hang leaves them apart by design). Returns
    ``(mismatch, torch's description)``, or ``None`` when torch's analyzer is not importable or
    cannot read the entries.
    """
    analyzer = _analyzer()
    if analyzer is None:
        return None
    _, MatchState, Op = analyzer
    try:
        pg = "pg"
        memberships = {pg: set(ranks)}
        base = {"p2p_seq_id": 0, "input_dtypes": [], "output_dtypes": [], "time_created_ns": 0}
        ea, eb = {**base, **a, "state": "completed"}, {**base, **b, "state": "completed"}
        info = Op(ea, memberships, pg).match(Op(eb, memberships, pg))
    except Exception:  # noqa: BLE001 - an entry torch's analyzer does not know
        return None
    return info.state not in (MatchState.FULLY_MATCHED, MatchState.UNDECIDED), str(info)


def _mismatch(a: Mapping[str, Any], b: Mapping[str, Any], ranks: set[int]) -> tuple[bool, str]:
    """Whether two ranks' entries at one sequence id disagree, and torch's words for it.

    Equal signatures (op, sizes, dtypes) match without asking torch; different ones are
    confirmed by torch's ``Op.match`` when importable (it knows which differences are legal,
    e.g. all_to_all sizes).
    """
    if _signature(a) == _signature(b):
        return False, ""
    by_torch = _torch_match(a, b, ranks)
    if by_torch is None:
        return True, ""
    mismatch, words = by_torch
    return mismatch or _signature(a)[0] != _signature(b)[0], words


def torch_missing_ranks(frs: Mapping[int, RankRecorder]) -> list[tuple[str, int, frozenset[int], frozenset[int]]] | None:
    """Collectives some member never joined, per torch's analyzer (``build_db``'s collectives
    with ``missing_ranks``): ``[(pg, seq, present ranks, missing ranks)]``; ``None`` when torch's
    analyzer is not importable or cannot read the dumps.

    gloo's recorder leaves ``pg_config`` empty, so each group's members are the ranks whose
    recorder has it (an entry, or the group in ``pg_status``); a group only one rank recorded
    (its peers never issued a collective on it) is taken to span every rank read.
    """
    analyzer = _analyzer()
    if analyzer is None:
        return None
    build_db = analyzer[0]
    members = _pg_members(frs)
    names = _pg_names(frs.values())
    config = {pg: {"name": names.get(pg, (pg, pg))[0], "desc": names.get(pg, (pg, pg))[1],
                   "ranks": json.dumps(sorted(ranks))} for pg, ranks in members.items()}
    details = {f"rank{r}": {**fr.raw, "rank": r, "pg_config": config} for r, fr in frs.items()}
    version = str(next(iter(frs.values())).raw.get("version", "2.10"))
    import argparse

    args = argparse.Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True, mismatch_cap=10,
                              selected_ranks=None, pg_filters=None)
    try:
        db = build_db(details, args, version)
    except (Exception, SystemExit):  # noqa: BLE001 - dumps torch's analyzer does not accept
        return None
    return _missing_of(db.collectives)


def _pg_members(frs: Mapping[int, RankRecorder]) -> dict[str, set[int]]:
    """Each group's member ranks: those whose recorder has it; all ranks read for a group only
    one rank recorded."""
    members: dict[str, set[int]] = {}
    for rank, fr in frs.items():
        for pg in (*fr.entries, *fr.groups):  # a group in pg_status: a member, entries or not
            members.setdefault(pg, set()).add(rank)
    for pg, ranks in members.items():
        if len(ranks) == 1:  # recorded by one rank only: its peers never touched it; all ranks may be
            members[pg] = set(frs)
    return members


def _pg_names(frs: Iterable[RankRecorder]) -> dict[str, tuple[str, str]]:
    """Each group's ``(name, desc)`` as the first recorder (of ``frs``, in order) holding an entry of it
    records them: a group the last rank never touched keeps its name too."""
    names: dict[str, tuple[str, str]] = {}
    for fr in frs:
        for pg, by_seq in fr.entries.items():
            pgname = next(iter(by_seq.values())).get("process_group")
            if pg not in names and isinstance(pgname, (list, tuple)) and len(pgname) == 2:
                names[pg] = (str(pgname[0]), str(pgname[1]))
    return names


def _missing_of(collectives: Iterable[Any]) -> list[tuple[str, int, frozenset[int], frozenset[int]]]:
    """``(pg, seq, present ranks, missing ranks)`` of the analyzer's collectives some rank missed."""
    out = []
    for c in collectives:
        missing = frozenset(int(r) for r in (c.missing_ranks or ()))
        if missing:
            present = frozenset(int(r) for r in c.expected_ranks) - missing
            out.append((str(c.group_id), int(c.collective_seq_id), present, missing))
    return out


# --- findings -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Desync:
    """Ranks issued different collectives at one sequence id.

    Attributes:
        seq / pg_text: where (``#42`` of ``pg 0``).
        culprits: the odd rank(s) out.
        settled: ``True`` when a majority or the group's own repeating pattern tells the odd one
            out; ``False`` when every rank involved is named.
        parts: ``rank 2: all_reduce [[8, 31]]; ranks 0,1,3: all_reduce [[8, 32]]``.
        torch_words: torch's analyzer's own classification (``SIZE_OR_SYNTAX_MISMATCH``), or ``""``.
    """

    seq: int
    pg_text: str
    culprits: tuple[int, ...]
    settled: bool
    parts: str
    torch_words: str = ""


def _expected(seq: int, agreed: Mapping[int, tuple[Any, ...]]) -> tuple[Any, ...] | None:
    """The signature the group's repeating pattern predicts at ``seq`` (from agreed ids before it)."""
    before = sorted(s for s in agreed if s < seq)
    for period in range(1, 9):
        window = [s for s in before if s >= seq - 3 * period]
        if len(window) < 2 * period or (seq - period) not in agreed:
            continue
        if all((s - period) not in agreed or agreed[s] == agreed[s - period] for s in window):
            return agreed[seq - period]
    return None


def _odd_ones(by_rank: Mapping[int, Mapping[str, Any]], seq: int,
              agreed: Mapping[int, tuple[Any, ...]]) -> tuple[list[int], bool, dict[tuple[Any, ...], list[int]]]:
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r, entry in by_rank.items():
        groups.setdefault(_signature(entry), []).append(r)
    ordered = sorted(groups.values(), key=len, reverse=True)
    if len(ordered) > 1 and len(ordered[0]) > len(ordered[1]) and len(ordered[0]) * 2 > len(by_rank):
        return [r for g in ordered[1:] for r in g], True, groups
    expected = _expected(seq, agreed)
    culprits = [r for r, e in by_rank.items() if expected is not None and _signature(e) != expected]
    if not culprits or len(culprits) == len(by_rank):
        return sorted(by_rank), False, groups
    return culprits, True, groups


def _desync_in(pg: str, frs: Mapping[int, RankRecorder]) -> Desync | None:
    common = set.intersection(*(set(fr.entries[pg]) for fr in frs.values()))
    agreed: dict[int, tuple[Any, ...]] = {}
    for seq in sorted(common):
        by_rank = {r: fr.entries[pg][seq] for r, fr in frs.items()}
        ref_rank = min(by_rank)
        checks = {r: _mismatch(by_rank[ref_rank], by_rank[r], set(by_rank)) for r in by_rank}
        odd = [r for r, (bad, _) in checks.items() if bad]
        if not odd:
            agreed[seq] = _signature(by_rank[ref_rank])
            continue
        culprits, settled, groups = _odd_ones(by_rank, seq, agreed)
        parts = "; ".join(
            f"{_ranks_text(g)}: {_describe(by_rank[g[0]])}" for g in sorted(groups.values(), key=lambda g: min(g))
        )
        words = next((w for r in odd if (w := checks[r][1])), "")
        return Desync(seq=seq, pg_text=frs[ref_rank].pg_text(pg), culprits=tuple(sorted(culprits)), settled=settled,
                      parts=parts, torch_words=words)
    return None


def find_desync(frs: Mapping[int, RankRecorder]) -> Desync | None:
    """The first sequence id (of the groups every rank recorded) where the ranks' entries disagree.

    The odd rank out is the minority when there is a strict majority, else the rank whose entry
    breaks the group's own repeating pattern before that id, else every rank involved.
    """
    pgs = set.intersection(*(set(fr.entries) for fr in frs.values())) if frs else set()
    for pg in sorted(pgs):
        found = _desync_in(pg, frs)
        if found is not None:
            return found
    return None


@dataclass(frozen=True, slots=True)
class Behind:
    """In one group the ranks disagree on the last collective enqueued.

    Attributes:
        pg_text / op / seq: the collective the others wait in (``all_reduce #42 of pg 0``).
        behind: ranks that never entered it (or are further behind).
        waiting: ranks that entered it.
        never_entered: every rank behind is exactly one collective short.
    """

    pg_text: str
    op: str
    seq: int
    behind: tuple[int, ...]
    waiting: tuple[int, ...]
    never_entered: bool


def find_behind(frs: Mapping[int, RankRecorder]) -> Behind | None:
    """The first group (``0`` first) whose ranks disagree on the last collective enqueued."""
    pgs = set.intersection(*(set(fr.groups) for fr in frs.values())) if frs else set()
    for pg in sorted(pgs, key=lambda p: (p != "0", p)):
        found = _behind_in(frs, pg)
        if found is not None:
            return found
    return None


def _behind_in(frs: Mapping[int, RankRecorder], pg: str) -> Behind | None:
    """:func:`find_behind` in group ``pg`` (every rank has it); None when its ranks agree."""
    enq = {r: fr.groups[pg][0] for r, fr in frs.items()}
    top = max(enq.values())
    behind = sorted(r for r, s in enq.items() if s < top)
    if not behind:
        return None
    waiting = sorted(r for r, s in enq.items() if s == top)
    entry = next((frs[r].entries.get(pg, {}).get(top) for r in waiting if frs[r].entries.get(pg, {}).get(top)), None)
    text = next((frs[r].pg_text(pg) for r in waiting if frs[r].names.get(pg)), f"pg {pg}")
    return Behind(pg_text=text, op=op_name(entry) if entry else "collective", seq=top, behind=tuple(behind),
                  waiting=tuple(waiting), never_entered=all(top - enq[r] == 1 for r in behind))


@dataclass(frozen=True, slots=True)
class Cycle:
    """An ordering deadlock: each rank waits in one group's collective for a rank that waits in
    another group's.

    Attributes:
        waits: one ``(rank, op, seq, pg_text, waits_for)`` per rank of the cycle, in cycle order.
        by_torch: the missing ranks came from torch's analyzer (``False``: from ``pg_status``).
    """

    waits: tuple[tuple[int, str, int, str, int], ...]
    by_torch: bool

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(w[0] for w in self.waits))

    def describe(self) -> str:
        """``rank 0 waits in all_reduce #4 of pg 1 for rank 1; rank 1 waits in all_reduce #4 of pg 2 for rank 0``."""
        return "; ".join(f"rank {r} waits in {op} #{seq} of {pg} for rank {other}" for r, op, seq, pg, other in self.waits)


def _open_waits(frs: Mapping[int, RankRecorder]) -> dict[int, tuple[str, int]]:
    """Per rank, the collective it waits in: the group whose last enqueued collective is not
    completed (the newest such entry when several)."""
    out: dict[int, tuple[str, int]] = {}
    for r, fr in frs.items():
        open_ = [(pg, enq) for pg, (enq, done) in fr.groups.items() if enq > done and enq > 0]
        if len(open_) == 1:
            out[r] = open_[0]
        elif open_:  # gloo's completion count may lag: the newest entry is where it waits
            out[r] = max(open_, key=lambda pe: _created(fr, pe[0], pe[1]))
    return out


def _created(fr: RankRecorder, pg: str, seq: int) -> int:
    t = fr.entries.get(pg, {}).get(seq, {}).get("time_created_ns")
    return t if isinstance(t, int) else -1


def _missing_from_status(frs: Mapping[int, RankRecorder]) -> list[tuple[str, int, frozenset[int], frozenset[int]]]:
    out = []
    pgs = {pg for fr in frs.values() for pg in fr.groups}
    for pg in pgs:
        enq = {r: fr.groups[pg][0] for r, fr in frs.items() if pg in fr.groups}
        if len(enq) == 1:  # one rank recorded it (see torch_missing_ranks): every rank read is a member
            enq = {r: frs[r].groups.get(pg, (0, 0))[0] for r in frs}
        top = max(enq.values())
        missing = frozenset(r for r, s in enq.items() if s < top)
        if missing:
            out.append((pg, top, frozenset(enq) - missing, missing))
    return out


def find_cycle(frs: Mapping[int, RankRecorder]) -> Cycle | None:
    """A wait-for cycle across process groups, or ``None``.

    Each rank waits in at most one collective (:func:`_open_waits`); it waits for that
    collective's missing ranks (torch's analyzer, else ``pg_status``). A cycle needs at least
    two groups: within one group the ranks behind are simply behind (:func:`find_behind`).
    """
    if len(frs) < 2:
        return None
    waiting_in = _open_waits(frs)
    missing = torch_missing_ranks(frs)
    by_torch = missing is not None
    if missing is None:
        missing = _missing_from_status(frs)
    waits_for: dict[int, tuple[str, int, int]] = {}
    for pg, seq, present, absent in missing:
        for r in present:
            if waiting_in.get(r) == (pg, seq) and absent:
                waits_for[r] = (pg, seq, min(absent))
    return _cycle_from(waits_for, frs, by_torch)


def _cycle_from(waits_for: Mapping[int, tuple[str, int, int]], frs: Mapping[int, RankRecorder],
                by_torch: bool) -> Cycle | None:
    for start in sorted(waits_for):
        path: list[int] = []
        r: int | None = start
        while r is not None and r in waits_for and r not in path:
            path.append(r)
            r = waits_for[r][2]
        if r is None or r not in path:
            continue
        loop = path[path.index(r):]
        if len({waits_for[x][0] for x in loop}) < 2:
            continue  # one group: not an ordering deadlock
        waits = []
        for x in loop:
            pg, seq, other = waits_for[x]
            entry = frs[x].entries.get(pg, {}).get(seq)
            waits.append((x, op_name(entry) if entry else "collective", seq, frs[x].pg_text(pg), other))
        return Cycle(waits=tuple(waits), by_torch=by_torch)
    return None


def late_arrivals(frs: Mapping[int, RankRecorder], window: int = 32) -> list[int]:
    """The rank that enters the group's collectives last, by far (recorder creation times).

    Over the last ``window`` sequence ids every rank recorded, each rank's lateness is the sum of
    how long after the first rank it entered; the latest rank is a straggler when its lateness
    is over twice everyone else's and at least 50 ms in all.
    """
    pgs = set.intersection(*(set(fr.entries) for fr in frs.values())) if frs else set()
    late: dict[int, int] = dict.fromkeys(frs, 0)
    for pg in pgs:
        common = sorted(set.intersection(*(set(fr.entries[pg]) for fr in frs.values())))[-window:]
        for seq in common:
            created = {r: fr.entries[pg][seq].get("time_created_ns") for r, fr in frs.items()}
            stamps = {r: t for r, t in created.items() if isinstance(t, int)}
            if len(stamps) != len(created):
                continue
            first = min(stamps.values())
            for r, t in stamps.items():
                late[r] += t - first
    if len(late) < 2:
        return []
    ordered = sorted(late.items(), key=lambda kv: kv[1], reverse=True)
    (top, top_ns), (_, next_ns) = ordered[0], ordered[1]
    return [top] if top_ns >= 50_000_000 and top_ns > 2 * next_ns else []


def _group_ranks(dump: Mapping[str, Any], pg: str) -> list[int] | None:
    """The global ranks of group ``pg`` in order (``pg_config``'s ``ranks``, a JSON list or a
    list), ``None`` when not recorded."""
    config = dump.get("pg_config")
    entry = config.get(pg) if isinstance(config, Mapping) else None
    ranks = entry.get("ranks") if isinstance(entry, Mapping) else None
    try:
        ranks = json.loads(ranks) if isinstance(ranks, str) else ranks
    except ValueError:
        return None
    return [int(r) for r in ranks] if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks) else None


def pending_p2p(dump: Any) -> tuple[str, int] | None:
    """The last point-to-point op of a rank's recorder not completed, and its peer's global rank.

    Torch names P2P entries ``<backend>:send <me>-><peer>`` and ``<backend>:recv <me><-<peer>``
    (``is_p2p``, group ranks; per ``flight_recorder``'s ``Op``); the peer is mapped to its global
    rank through ``pg_config`` (the default group's ranks are global already).

    Returns:
        ``("recv", 1)``; ``None`` when the dump holds no such entry (gloo records no P2P op) or the
        peer's global rank cannot be known.
    """
    entries = dump.get("entries") if isinstance(dump, Mapping) else None
    for entry in reversed(entries if isinstance(entries, list) else []):
        if not isinstance(entry, Mapping) or not entry.get("is_p2p") or entry.get("state") == "completed":
            continue
        return _p2p_peer(dump, entry)
    return None


def _p2p_peer(dump: Mapping[str, Any], entry: Mapping[str, Any]) -> tuple[str, int] | None:
    """:func:`pending_p2p` of its last pending P2P ``entry``: the op and its peer's global rank."""
    name = str(entry.get("profiling_name") or "").partition(":")[2]
    op, _, meta = name.partition(" ")
    arrow = {"send": "->", "recv": "<-"}.get(op)
    if arrow is None or arrow not in meta:
        return None
    try:
        peer = int(meta.split(arrow)[1])
    except ValueError:
        return None
    pgname = entry.get("process_group")
    pg = str(pgname[0]) if isinstance(pgname, (list, tuple)) and pgname else str(entry.get("pg_id", ""))
    ranks = _group_ranks(dump, pg)
    if ranks is not None:
        return (op, ranks[peer]) if 0 <= peer < len(ranks) else None
    return (op, peer) if pg == "0" else None
