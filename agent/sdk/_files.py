"""Files the SDK creates in the shared folder (counter, control socket, worker socket, ring).

Owns creating them safely next to other users' files: exclusive creation, and removing only
what is our own. Private to :mod:`agent.sdk`; imports only the standard library.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["create_exclusive", "remove_if_ours"]


def create_exclusive(path: Path, mode: int) -> int:
    """Create ``path`` with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and return its fd.

    A file already there is replaced only when it is a regular file (or socket) of our own
    effective uid, i.e. a stale one of an earlier process of ours with the same pid; anything
    else (another user's file, a symlink) is left alone.

    Raises:
        FileExistsError: the path is taken by something we do not own (or a symlink).
        OSError: any other creation failure.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, mode)
    except FileExistsError:
        remove_if_ours(path)
        return os.open(path, flags, mode)


def remove_if_ours(path: Path) -> None:
    """Unlink ``path`` when it is our own regular file or socket (never a symlink).

    Raises:
        FileExistsError: it is someone else's, or a symlink, or a folder.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid() or not (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
        raise FileExistsError(f"{path} already exists and is not ours (uid {st.st_uid}): not replaced")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
