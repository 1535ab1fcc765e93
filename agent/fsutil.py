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
from pathlib import Path

__all__ = [
    "MEMORY_FILESYSTEMS",
    "TEMP_SUFFIX",
    "atomic_write_bytes",
    "atomic_write_text",
    "ensure_private_dir",
    "memory_backed",
    "open_append_nofollow",
    "remove_stale_temps",
]

#: Suffix of the temp files :func:`atomic_write_bytes` creates (and :func:`remove_stale_temps` removes).
TEMP_SUFFIX = ".swtmp"

_FILE_MODE = 0o600
_DIR_MODE = 0o700


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

