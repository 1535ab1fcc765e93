"""Where the SDK's files live: one private folder per user, which no other user can squat.

Owns the folder layout, a public API of both sides: the server's SDK creates its files with
:func:`own_file`; the agent finds a process's files with :func:`sdk_path` (from its pid and its
uids) and lists them with :func:`sdk_folders`. Imports only the standard library (it runs inside
the server).

Layout, in ``base`` (``$SERVEWATCH_SHM_DIR``, else ``/dev/shm``, else the temp dir)::

    <base>/servewatch-<uid>/               mode 0700, owned by <uid> (the server's effective uid)
        servewatch-steps.<pid>             step counter (agent.sdk.counter)
        servewatch-ctl.<pid>.sock          control socket (agent.sdk.control)
        servewatch-spans.<pid>             span ring (agent.sdk.ring)
        servewatch-torch.<pid>.sock        torch's worker server (agent.sdk.flightrec)
        servewatch-exit.<pid>[.fault|.sigN] death notice (agent.sdk.exitnotice)

Why a folder per user: ``/dev/shm`` is shared (mode 1777), so any local user can create a name
there first. Flat names (``/dev/shm/servewatch-steps.<pid>``) let another user pre-create them
for the next thousands of pids: a server that then started could not publish its counter, and a
hang went unseen. Inside a 0700 folder of the server's own uid nobody else can create, rename or
remove a name. When ``servewatch-<uid>`` itself is taken (another user's folder or file, or a
symlink), the SDK uses ``<base>/servewatch-<uid>.<random>`` instead, created exclusively
(``mkdtemp``: 0700, a name nobody can guess beforehand); the agent trusts such a folder for a
process only when it is a real folder owned by the process's uid (or root) with no group or
other access, which only that user (or root) can have made. What it refuses it says, once per
name: ``counter refused: /dev/shm/servewatch-0 is owned by uid 65534`` (:func:`refusals`).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "ENV_SHM_DIR",
    "FOLDER_PREFIX",
    "folder_problem",
    "own_dir",
    "own_file",
    "process_uids",
    "refusals",
    "sdk_folders",
    "sdk_path",
    "shm_dir",
    "writer_path",
]

#: Environment variable naming the base folder of the SDK's files (default ``/dev/shm``).
ENV_SHM_DIR = "SERVEWATCH_SHM_DIR"
#: Name of a user's folder without its uid: ``servewatch-<uid>`` (fallback ``servewatch-<uid>.<random>``).
FOLDER_PREFIX = "servewatch-"

_log = logging.getLogger("servewatch.sdk")
_lock = threading.Lock()
#: this process's folder per (base, euid), once chosen
_own: dict[tuple[str, int], Path] = {}


def shm_dir() -> Path:
    """Base folder of the SDK's files: ``$SERVEWATCH_SHM_DIR``, ``/dev/shm`` or the temp dir."""
    env = os.environ.get(ENV_SHM_DIR)
    if env:
        return Path(env)
    if os.path.isdir("/dev/shm"):
        return Path("/dev/shm")
    return Path(tempfile.gettempdir())


def folder_problem(st: os.stat_result, uids: Iterable[int]) -> str | None:
    """Why a folder (``lstat`` result) is not a private folder of one of ``uids`` (or root), or ``None``."""
    if stat.S_ISLNK(st.st_mode):
        return f"is a symlink owned by uid {st.st_uid}"
    if not stat.S_ISDIR(st.st_mode):
        return f"is not a folder (owned by uid {st.st_uid})"
    if st.st_uid != 0 and st.st_uid not in set(uids):
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"is open to other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _ours(path: Path, uid: int) -> bool:
    """Whether ``path`` is a real folder of ``uid`` (made private when it is ours but too open)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        return False
    if st.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)  # a real folder of ours (lstat): in a sticky base only we may replace it
        except OSError:
            return False
    return True


def own_dir(base: Path | None = None) -> Path:
    """The server side: this process's private folder in ``base`` (default :func:`shm_dir`),
    created 0700 on first use (see the module docstring for the fallback when its name is taken).

    Raises:
        OSError: no folder could be created (``base`` missing and not creatable, no space...).
    """
    folder_base = base or shm_dir()
    uid = os.geteuid()
    key = (str(folder_base), uid)
    with _lock:
        known = _own.get(key)
        if known is not None and _ours(known, uid):
            return known
        if not folder_base.is_dir():
            folder_base.mkdir(parents=True, exist_ok=True)
        canonical = folder_base / f"{FOLDER_PREFIX}{uid}"
        try:
            os.mkdir(canonical, 0o700)
        except FileExistsError:
            pass
        if _ours(canonical, uid):
            chosen = canonical
        else:
            chosen = next((p for p in _fallbacks(folder_base, uid) if _ours(p, uid)), None) or Path(
                tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{uid}.", dir=folder_base)
            )
            try:
                owner = os.lstat(canonical).st_uid
            except OSError:
                owner = -1
            _log.warning("servewatch: %s is taken (uid %d), not ours: the SDK's files go to %s", canonical, owner, chosen)
        _own[key] = chosen
        return chosen


def own_file(name: str, base: Path | None = None) -> Path:
    """Path of this process's file ``name`` in its private folder (created if needed).

    Raises:
        OSError: as :func:`own_dir`.
    """
    return own_dir(base) / name


def writer_path(name: str, base: Path | None = None) -> Path:
    """:func:`own_file`, or when no folder can be made, where the canonical one would be (the
    caller's create then fails and says why): for writers that report errors themselves."""
    try:
        return own_file(name, base)
    except OSError:
        return (base or shm_dir()) / f"{FOLDER_PREFIX}{os.geteuid()}" / name


def _fallbacks(base: Path, uid: int) -> list[Path]:
    try:
        return sorted(base.glob(f"{FOLDER_PREFIX}{uid}.*"))
    except OSError:
        return []


def process_uids(pid: int) -> tuple[int, ...]:
    """The uids whose folder may hold ``pid``'s files: its ``/proc/PID`` owner and its real and
    effective uids; empty when it is gone."""
    uids: list[int] = []
    try:
        uids.append(os.stat(f"/proc/{pid}").st_uid)
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    uids.extend(int(x) for x in line.split()[1:3])
                    break
    except (OSError, ValueError):
        return tuple(dict.fromkeys(uids))
    return tuple(dict.fromkeys(uids))


def _trusted_folders(base: Path, uids: Iterable[int]) -> list[Path]:
    """The private folders of ``uids`` in ``base``, each canonical one first."""
    out: list[Path] = []
    wanted = tuple(dict.fromkeys(uids))
    for uid in wanted:
        for folder in (base / f"{FOLDER_PREFIX}{uid}", *_fallbacks(base, uid)):
            try:
                st = os.lstat(folder)
            except OSError:
                continue
            if folder_problem(st, wanted) is None:
                out.append(folder)
    return out


def sdk_path(pid: int | None, name: str, base: Path | None = None, uids: Iterable[int] | None = None) -> Path:
    """Where process ``pid``'s file ``name`` is: in the first private folder of its uids that
    holds it, else where its canonical folder would hold it (it may not exist). When that name is
    taken by someone else (see :func:`refusals`), a path under ``/dev/null`` that no call can
    open: a path through another user's folder is never returned. ``pid`` of ``None`` or this
    process: this process's own folder (created if needed: :func:`writer_path`).

    Args:
        pid: the process.
        name: the file name (``servewatch-steps.<pid>``...).
        base: the base folder (default :func:`shm_dir`).
        uids: the process's uids when known (default: read from ``/proc``, else this process's).
    """
    folder_base = base or shm_dir()
    if pid is None or pid == os.getpid():
        return writer_path(name, folder_base)
    owners = tuple(uids) if uids is not None else process_uids(pid)
    if not owners:
        owners = (os.geteuid(),)
    for uid in owners:  # the usual case without listing the shared folder (another user's files there)
        canonical = folder_base / f"{FOLDER_PREFIX}{uid}"
        try:
            if folder_problem(os.lstat(canonical), owners) is None and os.path.lexists(canonical / name):
                return canonical / name
        except OSError:
            continue
    folders = _trusted_folders(folder_base, owners)
    for folder in folders:
        path = folder / name
        if os.path.lexists(path):
            return path
    if folders:
        return folders[0] / name
    canonical = folder_base / f"{FOLDER_PREFIX}{owners[-1]}"
    if not os.path.lexists(canonical):
        return canonical / name  # nothing there yet (what is found there later is checked when read)
    # the name is another user's (or a symlink): a path nothing can be opened through
    return Path(os.devnull) / f"refused-{canonical.name}" / name


def sdk_folders(base: Path | None = None) -> list[tuple[int, Path]]:
    """Every private folder in ``base`` (default :func:`shm_dir`): ``(uid, folder)``, the uid its
    name carries, owned by that uid (or root), not a symlink, no group/other access. What each
    holds is for the reader to check against the process it claims to be."""
    folder_base = base or shm_dir()
    try:
        entries = list(folder_base.glob(f"{FOLDER_PREFIX}*"))
    except OSError:
        return []
    out: list[tuple[int, Path]] = []
    for folder in sorted(entries):
        uid_text = folder.name[len(FOLDER_PREFIX):].split(".", 1)[0]
        if not uid_text.isdigit():
            continue
        uid = int(uid_text)
        try:
            st = os.lstat(folder)
        except OSError:
            continue
        if folder_problem(st, (uid,)) is None:
            out.append((uid, folder))
    return out


def refusals(uids: Iterable[int], base: Path | None = None) -> list[str]:
    """Why a canonical folder of ``uids`` was not trusted (another user took the name), one
    line each: ``/dev/shm/servewatch-0 is owned by uid 65534``; empty when none was."""
    folder_base = base or shm_dir()
    wanted = tuple(dict.fromkeys(uids))
    out = []
    for uid in wanted:
        folder = folder_base / f"{FOLDER_PREFIX}{uid}"
        try:
            st = os.lstat(folder)
        except OSError:
            continue
        problem = folder_problem(st, wanted)
        if problem is not None:
            out.append(f"{folder} {problem}")
    return out
