"""Crash-safe, symlink-safe file writes for everything servewatch puts on disk.

servewatch runs as root next to directories other users can write to. Every file it writes
goes through here so that:

- a file is replaced atomically (temp file in the same folder, ``fsync``, ``rename``, folder
  ``fsync``): a full disk or a kill leaves the previous complete file or none, never a torn one;
- a symlink planted where we write is never followed (``O_NOFOLLOW`` on the final component,
  ``O_EXCL`` on the temp file);
- files are 0600 and folders we create are 0700 (bundles can hold stacks and request ids).

Temp files are named ``.<name>.<random>.swtmp`` so that :func:`remove_stale_temps` can clean the
leftovers of a killed writer on the next start.

Imports: stdlib only (used by the agent, the exporters and the SDK alike).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.errors import UnsafeFolderError

__all__ = [
    "MEMORY_FILESYSTEMS",
    "TEMP_SUFFIX",
    "Claimed",
    "SessionFolder",
    "UnsafeFolderError",
    "atomic_write_bytes",
    "atomic_write_text",
    "ensure_private_dir",
    "memory_backed",
    "open_append_nofollow",
    "open_trusted_dir",
    "remove_stale_temps",
    "unsafe_folder_reason",
]

#: Suffix of the temp files :func:`atomic_write_bytes` creates (and :func:`remove_stale_temps` removes).
TEMP_SUFFIX = ".swtmp"

_FILE_MODE = 0o600
_DIR_MODE = 0o700
_O_PATH = getattr(os, "O_PATH", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def ensure_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and missing parents) as 0700 folders; refuse a symlink as the last component.

    Existing folders keep their mode (the data-dir check decides whether they are safe).

    Returns:
        The path as a :class:`~pathlib.Path`.

    Raises:
        NotADirectoryError: ``path`` exists and is a symlink or not a folder.
        OSError: the folder could not be created.
    """
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        old = os.umask(0o077)
        try:
            p.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        finally:
            os.umask(old)
        st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{p}: exists and is not a folder (symlinks are not followed)")
    return p


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int = _FILE_MODE, durable: bool = True) -> int:
    """Replace ``path`` with ``data`` atomically (temp + fsync + rename), never following a symlink.

    The temp file is created with ``O_EXCL | O_NOFOLLOW`` next to ``path``; on any failure it
    is removed and the previous ``path`` (if any) is left as it was.

    Args:
        path: destination file; its folder must exist.
        data: the whole content.
        mode: permission bits of the new file (default 0600).
        durable: fsync the file and its folder (default). ``False`` for a file rewritten every
            few seconds whose loss in a power cut does not matter (the status file): readers
            still see the old or the new content, never a mix.

    Returns:
        The number of bytes written.

    Raises:
        OSError: the write failed (``ENOSPC`` on a full disk, ``EACCES``, ...); ``path`` is unchanged.
    """
    dest = Path(path)
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        # rename(2) replaces a symlink at ``dest`` itself, never the file it points to.
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(dest.parent)
    return len(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, mode: int = _FILE_MODE, durable: bool = True) -> int:
    """:func:`atomic_write_bytes` for UTF-8 text; undecodable surrogates are written escaped.

    Returns:
        The number of bytes written.

    Raises:
        OSError: as :func:`atomic_write_bytes`.
    """
    return atomic_write_bytes(path, text.encode("utf-8", "backslashreplace"), mode=mode, durable=durable)


def open_append_nofollow(path: str | os.PathLike[str], *, mode: int = _FILE_MODE) -> int:
    """Open ``path`` for appending (created 0600 if missing) without following a symlink.

    Returns:
        A raw file descriptor (``O_WRONLY | O_APPEND | O_CLOEXEC``); the caller closes it.

    Raises:
        OSError: ``ELOOP`` when ``path`` is a symlink, or any other open failure.
    """
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def remove_stale_temps(directory: str | os.PathLike[str], *, recursive: bool = True) -> int:
    """Remove temp files a killed writer left under ``directory`` (names ending in ``.swtmp``).

    Symlinks are never followed. Missing folders count as clean.

    Returns:
        How many files were removed.
    """
    removed = 0
    root = Path(directory)
    if not root.is_dir() or root.is_symlink():
        return 0
    walker = os.walk(root, followlinks=False) if recursive else [(str(root), [], os.listdir(root))]
    for folder, _dirs, files in walker:
        for name in files:
            if name.startswith(".") and name.endswith(TEMP_SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
                    removed += 1
    return removed


#: Filesystems whose files live in memory: reading one never waits for a disk.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def memory_backed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is on a memory filesystem (tmpfs, ramfs), per the mount that holds it in
    ``/proc/self/mountinfo`` (the last one mounted on the longest matching mount point). ``False``
    when that cannot be read. Blocking (reads procfs): not on the event loop."""
    try:
        real = os.path.realpath(path)
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    best, fstype = "", ""
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right:
            continue
        # mount points escape space, tab, newline and backslash as \ooo octal
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, right.split()[0]
    return fstype in MEMORY_FILESYSTEMS



# --- trusted folders: every component opened without following a planted symlink --------------

#: Most symlinks one :func:`open_trusted_dir` walk follows (Linux's own limit is 40).
_MAX_LINKS = 40




def trusted_uids() -> frozenset[int]:
    """The uids whose folders a trusted walk goes through: root, the agent's effective uid and,
    for an agent run through ``sudo`` as root, the invoking user (``SUDO_UID``: whoever set it for
    a root process is root already), so ``sudo servewatch profile`` works from the user's home."""
    euid = os.geteuid()
    uids = {0, euid}
    sudo_uid = os.environ.get("SUDO_UID", "")
    if euid == 0 and sudo_uid.isdigit() and len(sudo_uid) <= 10:
        uids.add(int(sudo_uid))
    return frozenset(uids)


def _component_problem(where: str, st: os.stat_result, *, last: bool) -> str | None:
    """Why one component of a trusted walk is refused, or ``None`` (see :func:`open_trusted_dir`)."""
    uids = trusted_uids()
    if st.st_uid not in uids:
        what = "a symlink owned" if stat.S_ISLNK(st.st_mode) else "owned"
        euid = os.geteuid()
        sudo = sorted(uids - {0, euid})
        who = f"root, the agent's uid {euid} or sudo's user uid {sudo[0]}" if sudo else f"root or the agent's uid {euid}"
        return f"{where!r} is {what} by uid {st.st_uid}, not by {who}: not used"
    if stat.S_ISLNK(st.st_mode):
        return None
    if not stat.S_ISDIR(st.st_mode):
        return f"{where!r} is not a folder"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        which = "the folder asked for" if last else "a folder on its way"
        return f"{where!r} ({which}) is writable by other users without the sticky bit (mode {mode:o}): not used"
    return None


class _Walk:
    """One :func:`open_trusted_dir` walk: the descriptor reached so far and what it created."""

    def __init__(self, create: bool) -> None:
        self.create = create
        self.fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
        self.where = "/"
        self.created: list[str] = []
        self.links = 0

    def restart(self) -> None:
        os.close(self.fd)
        self.fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
        self.where = "/"

    def close(self) -> None:
        os.close(self.fd)

    def lstat(self, name: str) -> os.stat_result | None:
        """``name`` in the current folder (not followed); created 0700 when missing and asked to."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            if not self.create:
                raise
        try:
            os.mkdir(name, _DIR_MODE, dir_fd=self.fd)
            self.created.append(os.path.join(self.where, name))
        except FileExistsError:  # made meanwhile: judged like any other
            pass
        return None

    def _step(self, fd: int, where: str, st: os.stat_result | None, *, last: bool) -> None:
        """Make ``fd`` (just opened, ``where``) the current folder once it passes the checks."""
        try:
            got = os.fstat(fd)
            if st is not None and (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
                raise UnsafeFolderError(f"{where!r} changed while it was opened: not used")
            if where in self.created:
                os.fchmod(fd, _DIR_MODE)  # whatever the umask
                got = os.fstat(fd)
            problem = _component_problem(where, got, last=last)
            if problem is not None:
                raise UnsafeFolderError(problem)
        except BaseException:
            os.close(fd)
            raise
        os.close(self.fd)
        self.fd, self.where = fd, where

    def enter_parent(self, *, last: bool) -> None:
        """Step up (``..`` in a symlink's target), judged like any folder on the way."""
        fd = os.open("..", os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC, dir_fd=self.fd)
        self._step(fd, os.path.dirname(self.where) or "/", None, last=last)

    def enter(self, name: str, *, last: bool) -> list[str]:
        """Step into ``name``; a trusted symlink's target parts are returned to walk instead."""
        where = os.path.join(self.where, name)
        st = self.lstat(name)
        if st is not None:
            problem = _component_problem(where, st, last=last)
            if problem is not None:
                raise UnsafeFolderError(problem)
            if stat.S_ISLNK(st.st_mode):
                self.links += 1
                if self.links > _MAX_LINKS:
                    raise UnsafeFolderError(f"{where!r}: more than {_MAX_LINKS} symlinks on the way")
                target = os.readlink(name, dir_fd=self.fd)
                if target.startswith("/"):
                    self.restart()
                return [p for p in target.split("/") if p and p != "."]
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=self.fd)
        self._step(fd, where, st, last=last)
        return []


def open_trusted_dir(path: str | os.PathLike[str], *, create: bool = False) -> tuple[int, tuple[Path, ...]]:
    """Open the folder ``path`` one component at a time from ``/``, never through a symlink or
    folder another user controls.

    ``path`` is made absolute and normalised lexically (``..`` collapsed, nothing resolved).
    Each component is looked at with ``lstat`` relative to the folder above it and opened with
    ``O_NOFOLLOW`` relative to that folder's descriptor (``openat``); it must be owned by root,
    the agent's effective uid or the user who ran it through ``sudo`` (:func:`trusted_uids`), and a folder must not be writable by other users unless it has
    the sticky bit (``/tmp``). A symlink owned by root or the agent (``/var/run``) is followed
    by walking its target the same way; one owned by anyone else is refused, never followed.

    Args:
        path: the folder.
        create: make missing components, 0700, owned by the agent (``mkdirat``).

    Returns:
        ``(fd, created)``: a descriptor of the folder (``O_RDONLY | O_DIRECTORY``; the caller
        closes it) and the folders made now, deepest first.

    Raises:
        UnsafeFolderError: a component is refused (one line: which one and why), a symlink
            loop, or a component that is not a folder.
        FileNotFoundError: a component is missing and ``create`` is false.
        OSError: any other failure to open or create.
    """
    text = os.fspath(path)
    if "\0" in text:
        raise UnsafeFolderError(f"{text!r}: a NUL byte in the path")
    todo = [p for p in os.path.normpath(os.path.abspath(text)).split("/") if p]
    walk = _Walk(create)
    try:
        while todo:
            name = todo.pop(0)
            if name == "..":
                walk.enter_parent(last=not todo)
                continue
            todo[:0] = walk.enter(name, last=not todo)
    except BaseException:
        walk.close()
        raise
    return walk.fd, tuple(Path(p) for p in reversed(walk.created))


def unsafe_folder_reason(path: str | os.PathLike[str]) -> str | None:
    """Why :func:`open_trusted_dir` would refuse ``path`` (or the part of it that exists: the
    rest would be created 0700 by the agent), in one line; ``None`` when it would not. Checks
    only (it creates nothing): the walk at use stays the authority."""
    probe = os.path.normpath(os.path.abspath(os.fspath(path)))
    while not os.path.lexists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    try:
        fd, _ = open_trusted_dir(probe)
    except UnsafeFolderError as exc:
        return str(exc)
    except OSError as exc:
        return f"{probe!r}: {exc.strerror or exc}"
    os.close(fd)
    return None


# --- session folders: the only place root takes files a target names --------------------------

#: Bounds of one :meth:`SessionFolder.claim` walk (a ``.gputrace`` bundle is a folder tree).
_CLAIM_MAX_DEPTH = 16
_CLAIM_MAX_ENTRIES = 10_000
OUTSIDE_SESSION = "outside the session folder, ignored"


class _Refused(Exception):
    """One reported entry that is not taken (the message says why)."""


@dataclass(frozen=True, slots=True)
class Claimed:
    """What :meth:`SessionFolder.claim` took.

    Attributes:
        paths: the entries taken, as paths inside the session folder (never resolved): files
            0600, folders 0700, all owned by the agent now.
        size_bytes: their total size in bytes (folders: the files in them).
        ignored: one ``"<path as reported>: <why>"`` per entry not taken (outside the session
            folder, a symlink, a device or FIFO, owned by another uid, more than one link).
    """

    paths: tuple[str, ...]
    size_bytes: int
    ignored: tuple[str, ...]


def _open_probe(dir_fd: int, name: str) -> int:
    """``name`` in ``dir_fd`` opened without following a symlink (``O_PATH`` where there is one)."""
    try:
        return os.open(name, (_O_PATH or os.O_RDONLY | os.O_NONBLOCK) | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise _Refused("a symlink, never followed" if exc.errno == 40 else (exc.strerror or str(exc))) from None


def _check_kind(st: os.stat_result) -> None:
    """Refuse anything but a regular file or folder."""
    if stat.S_ISLNK(st.st_mode):
        raise _Refused("a symlink, never followed")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise _Refused("not a regular file or folder, ignored")


class SessionFolder:
    """A folder the agent created for one session: the one place it takes files a target names.

    A profiled server (another uid, or any process a ``--match`` glob picked) answers with the
    paths of the trace files it wrote. Root never resolves, opens, chmods, reads or copies such
    a path unless it lies (lexically) inside this folder; each component is then opened relative
    to the folder's descriptor with ``O_NOFOLLOW`` (``openat``), only regular files and folders
    owned by the writer's uid (with one link) are taken, and taking one means: the agent's own
    owner, mode 0600 (folders 0700), set through the descriptor. Once taken, the tree is the
    agent's alone: the target can no longer change what a later reader (the trace import, the
    report) opens.

    Create one with :meth:`create`; ``path`` is where the target is told to write.
    """

    def __init__(self, path: Path, writer_uid: int, *, created: tuple[Path, ...] = ()) -> None:
        self.path = path
        self.writer_uid = writer_uid
        self._created = created

    @classmethod
    def create(cls, base: str | os.PathLike[str], *, writer_uid: int | None = None, prefix: str = "session") -> SessionFolder:
        """A new session folder for ``base`` (the ``--out`` folder, or an incident's bundle).

        ``base`` is reached with :func:`open_trusted_dir` (every component opened with
        ``O_NOFOLLOW`` from ``/``, owned by root or the agent, no folder on the way writable by
        others without the sticky bit; missing ones created 0700), so a symlink or folder
        another user planted is refused, never followed. ``base`` itself is the session folder
        when the agent creates it now, or when it is already the agent's own private folder
        (owned by the agent's uid, mode 0700: no group or other bits) and the writer is the
        agent's uid. Otherwise a fresh ``<prefix>-<UTC time>-<random>`` folder is made inside it
        (``mkdirat``: never an existing one). A writer of another uid gets the session folder
        as its owner (mode 0700) so that it can write there; :meth:`claim` takes it back.

        Args:
            base: folder path (made absolute lexically: symlinks are not resolved first).
            writer_uid: the uid of the process that will write into it (default: the agent's).
            prefix: name prefix of a fresh sub-folder.

        Raises:
            UnsafeFolderError: ``base`` or a folder above it is refused (one line saying which
                and why: another user's folder or symlink, writable by others, not a folder).
            OSError: a folder could not be created (or given to ``writer_uid``).
        """
        euid = os.geteuid()
        writer = euid if writer_uid is None else writer_uid
        base = Path(os.path.normpath(os.path.abspath(base)))
        base_fd, made = open_trusted_dir(base, create=True)
        try:
            st = os.fstat(base_fd)
            own_private = st.st_uid == euid and not stat.S_IMODE(st.st_mode) & 0o077
            made_now = bool(made) and os.path.samestat(os.stat(made[0], follow_symlinks=False), st)
            if made_now or (writer == euid and own_private):
                path, fd = base, os.dup(base_fd)
            else:
                name = f"{prefix}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"
                os.mkdir(name, _DIR_MODE, dir_fd=base_fd)  # FileExistsError rather than reuse
                path = base / name
                made = (path, *made)
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=base_fd)
        finally:
            os.close(base_fd)
        try:
            if writer != euid:
                os.fchown(fd, writer, -1)
            os.fchmod(fd, _DIR_MODE)
        finally:
            os.close(fd)
        return cls(path, writer, created=made)

    def remove_if_empty(self) -> None:
        """Remove the folders :meth:`create` made (deepest first) while they are empty."""
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:  # not empty, or gone
                return

    def relative_parts(self, reported: str | os.PathLike[str]) -> tuple[str, ...] | None:
        """The components of ``reported`` below this folder, lexically (``..`` collapsed, no
        symlink resolved); ``None`` when it is not an absolute path strictly inside it."""
        text = os.fspath(reported)
        if not isinstance(text, str) or "\0" in text or not os.path.isabs(text):
            return None
        norm = os.path.normpath(text)
        root = os.path.normpath(str(self.path))
        if not norm.startswith(root.rstrip(os.sep) + os.sep):
            return None
        parts = tuple(norm[len(root.rstrip(os.sep)) + 1 :].split(os.sep))
        return parts if all(parts) else None

    def claim(self, reported: Iterable[str | os.PathLike[str]]) -> Claimed:
        """Take the entries a target reported, safely (see the class docstring).

        Blocking (file system): call it off the event loop.

        Args:
            reported: paths as the target (or a folder scan) gave them.

        Returns:
            What was taken and what was ignored, and why. Never raises for a hostile entry.
        """
        kept: list[str] = []
        ignored: list[str] = []
        total = 0
        try:
            dir_fd = self._open()
        except OSError as exc:
            return Claimed((), 0, tuple(f"{p}: session folder {self.path}: {exc.strerror or exc}" for p in reported))
        try:
            try:
                self._take(dir_fd, os.fstat(dir_fd), allow_agent=True)
            except _Refused as exc:
                return Claimed((), 0, tuple(f"{p}: session folder: {exc}" for p in reported))
            for p in dict.fromkeys(os.fspath(r) for r in reported):
                parts = self.relative_parts(p)
                if parts is None:
                    ignored.append(f"{p}: {OUTSIDE_SESSION}")
                    continue
                try:
                    total += self._claim_at(dir_fd, parts, ignored, p)
                except _Refused as exc:
                    ignored.append(f"{p}: {exc}")
                    continue
                kept.append(os.path.join(str(self.path), *parts))
        finally:
            os.close(dir_fd)
        return Claimed(tuple(kept), total, tuple(ignored))

    # -- the walk, one descriptor at a time -----------------------------------------------------

    def _open(self) -> int:
        """The session folder's descriptor: its parent through :func:`open_trusted_dir`, the
        folder itself with ``O_NOFOLLOW`` (it may be the writer's until it is taken)."""
        parent_fd, _ = open_trusted_dir(self.path.parent)
        try:
            return os.open(self.path.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=parent_fd)
        finally:
            os.close(parent_fd)

    def _take(self, fd: int, st: os.stat_result, *, allow_agent: bool = False) -> None:
        """Make the entry behind ``fd`` the agent's, private: owner check, then chown + chmod."""
        euid = os.geteuid()
        owners = {self.writer_uid, euid} if allow_agent else {self.writer_uid}
        if st.st_uid not in owners:
            raise _Refused(f"owned by uid {st.st_uid}, not the writer's ({self.writer_uid}), ignored")
        if stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
            raise _Refused(f"a file with {st.st_nlink} links (a hard link to another file?), ignored")
        try:
            if st.st_uid != euid:
                os.fchown(fd, euid, -1)
            os.fchmod(fd, _DIR_MODE if stat.S_ISDIR(st.st_mode) else _FILE_MODE)
        except OSError as exc:
            raise _Refused(f"cannot make it private: {exc.strerror or exc}") from None

    def _open_entry(self, dir_fd: int, name: str) -> tuple[int, os.stat_result]:
        """Open ``name`` in ``dir_fd`` without following a symlink or opening a device/FIFO."""
        if name in (".", "..") or os.sep in name:
            raise _Refused(OUTSIDE_SESSION)
        probe = _open_probe(dir_fd, name)
        try:
            st = os.fstat(probe)
            _check_kind(st)
            if not _O_PATH:
                return probe, st
            flags = os.O_RDONLY | _O_CLOEXEC | (os.O_DIRECTORY if stat.S_ISDIR(st.st_mode) else os.O_NONBLOCK)
            fd = os.open(f"/proc/self/fd/{probe}", flags)  # the same inode, now open for real
        except _Refused:
            os.close(probe)
            raise
        except OSError as exc:
            os.close(probe)
            raise _Refused(exc.strerror or str(exc)) from None
        os.close(probe)
        st2 = os.fstat(fd)
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            raise _Refused("changed while it was opened, ignored")
        return fd, st2

    def _claim_at(self, dir_fd: int, parts: tuple[str, ...], ignored: list[str], reported: str) -> int:
        """Take ``parts`` below ``dir_fd`` (folders on the way are taken too); its size in bytes."""
        fds: list[int] = []
        try:
            cur = dir_fd
            for name in parts[:-1]:
                fd, st = self._open_entry(cur, name)
                fds.append(fd)
                if not stat.S_ISDIR(st.st_mode):
                    raise _Refused("a path through something that is not a folder, ignored")
                self._take(fd, st)
                cur = fd
            fd, st = self._open_entry(cur, parts[-1])
            fds.append(fd)
            self._take(fd, st)
            if stat.S_ISDIR(st.st_mode):
                budget = [_CLAIM_MAX_ENTRIES]
                return self._claim_tree(fd, 1, ignored, reported, budget)
            return st.st_size
        finally:
            for fd in fds:
                os.close(fd)

    def _claim_tree(self, dir_fd: int, depth: int, ignored: list[str], where: str, budget: list[int]) -> int:
        """Take everything in a reported folder (a ``.gputrace`` bundle), bounded; its size."""
        total = 0
        for name in sorted(os.listdir(dir_fd)):
            budget[0] -= 1
            if budget[0] < 0 or depth > _CLAIM_MAX_DEPTH:
                ignored.append(f"{where}: more than {_CLAIM_MAX_ENTRIES} entries or {_CLAIM_MAX_DEPTH} levels, the rest ignored")
                return total
            try:
                fd, st = self._open_entry(dir_fd, name)
            except _Refused as exc:
                ignored.append(f"{where}/{name}: {exc}")
                continue
            try:
                self._take(fd, st)
                total += self._claim_tree(fd, depth + 1, ignored, f"{where}/{name}", budget) if stat.S_ISDIR(st.st_mode) else st.st_size
            except _Refused as exc:
                ignored.append(f"{where}/{name}: {exc}")
            finally:
                os.close(fd)
        return total
