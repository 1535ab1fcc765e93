"""Server boundaries: which of an incident's processes belong to one server.

Owns :func:`server_groups`: a host-wide ``--match`` can pick the processes of two servers (two
vLLM engines, two SGLang data-parallel replicas); a verdict over them as one job numbers one
server's process as another's rank and blames the wrong server. Processes are grouped by facts,
never by "all matched processes are one job":

1. **process tree**: the nearest ancestor that is not itself a target (a server's main process,
   its engine core, torchrun's agent, the launcher: :func:`agent.host.targets.server_of`), from the
   parent recorded at discovery when a process is already gone;
2. **torch.distributed world**: within a tree, the ranks of one world are connected to each other
   by TCP (gloo's pairs, the TCPStore its ranks share, NCCL's bootstrap): the connected components
   of the targets' TCP connections split a tree that holds two worlds (SGLang ``--dp 2`` without
   DP attention: two replicas under one controller). A rank with no connection read (gone, or a
   world of one) joins the component whose ranks share its DP coordinate;
3. when no connection can be read, the ranks' own coordinates: titles whose world ranks repeat
   across DP coordinates are separate replicas (with DP attention the TP numbers are unique across
   DP, one world).

A process whose tree is unreadable (gone and reaped, no parent recorded) joins a group only when
exactly one group has its title's prefix and lacks its coordinates; else it stands alone.

:func:`listener_of_port` finds the process listening on a port (the server whose ``/metrics`` or
``/health`` endpoint stalled; :func:`port_of_url` reads the port off the URL). Imports psutil and :mod:`agent.host.targets` / :mod:`agent.model.ranks`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil

from agent.host.targets import (
    Target,
    command_words,
    descendants,
    parent_pid,
    psutil_errors,
    server_of,
    target_of,
)
from agent.model.ranks import parse_title, world_ranks

__all__ = ["ServerGroup", "ancestors", "command_words", "frontend_command", "listener_of_port", "listening_ports",
           "port_of_url", "server_groups", "server_tree", "tcp_components"]


@dataclass(frozen=True, slots=True)
class ServerGroup:
    """One server's processes.

    Attributes:
        pids: its targets' pids (the order of the targets given).
        root: the process the group hangs off (its tree's root), ``None`` when unknown.
        how: how the group was told apart (``process tree of pid 12``, ``... world of pids 14,15``).
    """

    pids: tuple[int, ...]
    root: int | None
    how: str


def _parent(target: Target) -> int | None:
    live = parent_pid(target.pid)
    return live if live is not None else target.ppid


def _tree_root(target: Target, pids: set[int], by_pid: dict[int, Target]) -> int | None:
    """The nearest ancestor of ``target`` that is not a target (recorded parents for the gone)."""
    seen: set[int] = set()
    parent = _parent(target)
    while parent is not None and parent in pids and parent not in seen:
        seen.add(parent)
        parent = _parent(by_pid[parent])
    return parent


def ancestors(pid: int, limit: int = 64) -> list[int]:
    """``pid``'s ancestors, nearest first (live ``/proc`` reads, bounded)."""
    out: list[int] = []
    parent = parent_pid(pid)
    while parent is not None and parent > 1 and parent not in out and len(out) < limit:
        out.append(parent)
        parent = parent_pid(parent)
    return out


def _connections(pid: int) -> list[tuple[tuple[str, int], tuple[str, int] | None, str]]:
    """``(laddr, raddr, status)`` of a live process's TCP sockets; empty when unreadable."""
    conns: list[tuple[tuple[str, int], tuple[str, int] | None, str]] = []
    with psutil_errors():
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            laddr = (c.laddr.ip, c.laddr.port) if c.laddr else None
            raddr = (c.raddr.ip, c.raddr.port) if c.raddr else None
            if laddr is not None:
                conns.append((laddr, raddr, c.status))
    return conns


_WILDCARDS = ("0.0.0.0", "::", "")


def tcp_components(pids: Iterable[int]) -> list[set[int]]:
    """The pids' connected components over their TCP connections to each other (a connection of
    one to an address another holds, or to a port another listens on). Pids with no connection to
    another are left out."""
    pids = list(pids)
    conns = {pid: _connections(pid) for pid in pids}
    owner: dict[tuple[str, int], int] = {}
    listening: dict[int, int] = {}
    for pid, cs in conns.items():
        for laddr, _, status in cs:
            owner[laddr] = pid
            if status == psutil.CONN_LISTEN:
                listening.setdefault(laddr[1], pid)
    parent = {pid: pid for pid in pids}

    def find(p: int) -> int:
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    linked: set[int] = set()
    for pid, cs in conns.items():
        for _, raddr, status in cs:
            if raddr is None or status == psutil.CONN_LISTEN:
                continue
            other = owner.get(raddr, listening.get(raddr[1]))
            if other is not None and other != pid:
                parent[find(pid)] = find(other)
                linked.update((pid, other))
    comps: dict[int, set[int]] = {}
    for pid in linked:
        comps.setdefault(find(pid), set()).add(pid)
    return sorted(comps.values(), key=min)


def listener_of_port(port: int) -> int | None:
    """The pid listening on TCP ``port`` on this host (the server behind a URL), or ``None``."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


def listening_ports(pid: int) -> list[int]:
    """The TCP ports ``pid`` listens on, sorted (``[]`` when none or unreadable)."""
    ports = {laddr[1] for laddr, _, status in _connections(pid) if status == psutil.CONN_LISTEN}
    return sorted(ports)


def port_of_url(url: str) -> int | None:
    """The TCP port a URL names (its scheme's default when none is written: 80, 443), ``None``
    when it names none (not http(s), or malformed)."""
    try:
        parts = urlsplit(url)
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def _dp(target: Target) -> int | None:
    info = parse_title(target.title)
    return info.get("DP") if info is not None else None


def _is_rank(target: Target) -> bool:
    info = parse_title(target.title)
    return info is not None and info.role == "rank"


def _split_world(members: list[Target]) -> list[list[Target]] | None:
    """Split one tree's targets into worlds (TCP components, else repeating coordinates)."""
    ranks = [t for t in members if _is_rank(t)]
    if len(ranks) < 2:
        return None
    comps = [c for c in tcp_components(t.pid for t in ranks) if len(c) > 0]
    if len(comps) >= 2:
        return _assign(members, comps)
    if comps and len(comps[0]) == len(ranks):
        return None  # one world
    return _split_by_dp(members, ranks)


def _assign(members: list[Target], comps: list[set[int]]) -> list[list[Target]]:
    """Members to components: connected ranks where they are; the rest by DP coordinate, or by
    being an ancestor of a component's ranks; what fits no single component stands apart."""
    groups: list[list[Target]] = [[] for _ in comps]
    loose: list[Target] = []
    comp_dp = [{_dp(t) for t in members if t.pid in c} for c in comps]
    for t in members:
        idx = _component_of(t, comps, comp_dp)
        if idx is None:
            loose.append(t)
        else:
            groups[idx].append(t)
    return [g for g in groups if g] + [[t] for t in loose]


def _component_of(t: Target, comps: list[set[int]], comp_dp: list[set[int | None]]) -> int | None:
    """The index of ``t``'s component in ``comps``: the one holding it, else the only one whose DP
    coordinates are ``t``'s alone, else the only one of whose ranks it is an ancestor; None when
    no single one fits."""
    idx = next((i for i, c in enumerate(comps) if t.pid in c), None)
    if idx is not None:
        return idx
    fits = [i for i, dps in enumerate(comp_dp) if _dp(t) is not None and dps == {_dp(t)}]
    if not fits:
        fits = [i for i, c in enumerate(comps) if any(t.pid in ancestors(p) for p in c)]
    return fits[0] if len(fits) == 1 else None


def _split_by_dp(members: list[Target], ranks: list[Target]) -> list[list[Target]] | None:
    """Replicas told apart by their coordinates: world ranks that repeat across DP numbers."""
    numbers = world_ranks([t.title for t in ranks])
    by_dp: dict[int | None, list[int | None]] = {}
    for t, r in zip(ranks, numbers):
        by_dp.setdefault(_dp(t), []).append(r)
    repeats = len(by_dp) > 1 and None not in by_dp and len({r for rs in by_dp.values() for r in rs}) < len(ranks)
    if not repeats:
        return None
    groups: dict[int | None, list[Target]] = {}
    for t in members:
        groups.setdefault(_dp(t), []).append(t)
    return [groups[k] for k in sorted(groups, key=lambda d: -1 if d is None else d)]


def _fits(target: Target, group: list[Target]) -> bool:
    info = parse_title(target.title)
    if info is None:
        return False
    infos = [parse_title(t.title) for t in group]
    same_prefix = any(i is not None and i.prefix == info.prefix for i in infos)
    taken = any(i is not None and i.label == info.label and i.name == info.name for i in infos)
    return same_prefix and not taken


def server_groups(targets: Sequence[Target]) -> list[ServerGroup]:
    """The targets grouped by server (see the module docstring), groups ordered by their first pid.

    Args:
        targets: the incident's processes (live, zombie or gone), each with its title and, where
            discovery read it, its parent pid.

    Returns:
        One :class:`ServerGroup` per server; a target that fits no group stands alone.
    """
    by_pid = {t.pid: t for t in targets}
    pids = set(by_pid)
    trees: dict[int, list[Target]] = {}
    orphans: list[Target] = []
    for t in targets:
        root = _tree_root(t, pids, by_pid)
        if root is None:
            orphans.append(t)
        else:
            trees.setdefault(root, []).append(t)
    groups: list[tuple[list[Target], int | None, str]] = []
    for root, members in trees.items():
        parts = _split_world(members) or [members]
        for part in parts:
            how = f"process tree of pid {root}" + (f", world of pids {','.join(str(t.pid) for t in part)}"
                                                   if len(parts) > 1 else "")
            groups.append((part, root, how))
    for t in orphans:
        fits = [g for g in groups if _fits(t, g[0])]
        if len(fits) == 1:
            fits[0][0].append(t)
        else:
            groups.append(([t], None, f"pid {t.pid} alone (its process tree is gone)"))
    out = [ServerGroup(pids=tuple(t.pid for t in members), root=root, how=how) for members, root, how in groups]
    return sorted(out, key=lambda g: min(g.pids))


# --- the whole server tree (issue 32 item 1) ----------------------------------------------------

#: The command line of a serving framework's HTTP frontend, which keeps no title: SGLang's main
#: process (``python -m sglang.launch_server``, ``sglang serve``: its HTTP server and tokenizer
#: manager), vLLM's API server (``vllm serve``, ``python -m vllm.entrypoints.openai.api_server``).
_FRONTEND_COMMAND = re.compile(
    r"(^|[\s/])(sglang\.launch_server|sglang\s+serve|vllm\s+serve|vllm\.entrypoints\.[\w.]*api_server)(\s|$)")

#: Most ancestors climbed from a process tree's root to the server's top process.
_MAX_CLIMB = 8


def frontend_command(cmdline: Sequence[str]) -> bool:
    """``cmdline`` is a serving framework's untitled HTTP frontend (see :data:`_FRONTEND_COMMAND`:
    ``python -m sglang.launch_server ...``, ``vllm serve MODEL``)."""
    if not cmdline:
        return False
    words = [os.path.basename(cmdline[0]), *cmdline[1:]]
    return bool(_FRONTEND_COMMAND.search(" ".join(words)))


def _of_role(target: Target) -> bool:
    """Titled with a role (:func:`agent.model.ranks.parse_title`) or a frontend's command line."""
    info = parse_title(target.title)
    return (info is not None and bool(info.role)) or frontend_command(target.cmdline)


def _server_top(root: int, *, own: int, stop: set[int], listeners: set[int],
                allowed: frozenset[int] | None) -> Target | None:
    """The topmost process of the server whose process tree hangs off ``root``: ``root`` when it
    is a server's process (a role, a frontend's command line, or a TCP listener: an HTTP frontend
    under any name), then its ancestors while each has a role, a frontend's command line or
    listens on a watched URL's port (``listeners``), each of an allowed uid; never servewatch
    itself (``own``), never past one of ``stop`` (a ``--root-pid``: its tree is whole already).
    ``None`` when ``root`` is no server's process."""
    top: Target | None = None
    pid: int | None = root
    for _ in range(_MAX_CLIMB):
        if pid is None or pid <= 1 or pid == own:
            break
        found = target_of(pid)
        if found is None or (allowed is not None and found.uid not in allowed):
            break
        serving = _of_role(found) or pid in listeners or (top is None and bool(listening_ports(pid)))
        if not serving:
            break
        top = found
        if pid in stop:
            break
        pid = parent_pid(pid)
    return top


def server_tree(targets: Sequence[Target], *, uids: frozenset[int] | None = None, stop: Iterable[int] = (),
                listeners: Iterable[int] = ()) -> list[Target]:
    """The other processes of the servers ``targets`` belong to (issue 32 item 1): what a
    ``--match 'sglang::scheduler*'`` leaves out and a health incident needs (the frontend that
    stopped answering, the detokenizer that spins while the schedulers generate).

    For each tree root of the targets (the nearest ancestor that is not a target:
    :func:`agent.host.targets.server_of`), the server's top is that root when it is a server's process
    (a titled role, a frontend's command line, a TCP listener), then its ancestors while each has a
    role, a frontend's command line or listens on a watched URL's port (:func:`_server_top`); the processes
    added are that top and its live descendants with a role: frontends (``sglang::detokenizer``,
    ``VLLM::APIServer_0``, an untitled ``vllm serve``), coordinators (``VLLM::EngineCore``,
    ``VLLM::DPCoordinator``, ``sglang::data_parallel_controller``) and ranks not matched. Blocking
    (``/proc`` reads, the tops' sockets).

    Args:
        targets: the incident's targets (live ones are climbed from).
        uids: the server's uids: a process of another uid is never added (``None``: any uid).
        stop: pids never climbed past (a ``--root-pid``); servewatch itself is never added.
        listeners: the pids listening on the watched URLs' ports (the health URL's server); the
            trees climbed from when there is no target (``--health-url`` alone).

    Returns:
        The processes to add (none of ``targets``), sorted by pid.
    """
    have = {t.pid for t in targets}
    own, stop_set, heard = os.getpid(), set(stop), set(listeners)
    found: dict[int, Target] = {}
    # no target (a health URL watched alone): the processes listening on the watched URLs are the roots
    for root in {server_of(t.pid, have) for t in targets} or heard:
        if root is None:
            continue
        top = _server_top(root, own=own, stop=stop_set, listeners=heard, allowed=uids)
        if top is None:
            continue
        found[top.pid] = top
        found.update(_tree_roles(top, have, own, uids))
    return [found[p] for p in sorted(found) if p not in have]


def _tree_roles(top: Target, have: set[int], own: int, uids: frozenset[int] | None) -> dict[int, Target]:
    """The live descendants of ``top`` with a role, by pid: none of ``have``, never servewatch
    itself (``own``), each of ``uids`` (``None``: any uid)."""
    found: dict[int, Target] = {}
    members: list[psutil.Process] = []
    with psutil_errors():
        members = descendants(psutil.Process(top.pid))
    for proc in members:
        member = target_of(proc.pid)
        if member is None or member.pid in have or member.pid == own or not _of_role(member):
            continue
        if uids is None or member.uid in uids:
            found[member.pid] = member
    return found
