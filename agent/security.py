"""What the agent (often root) trusts, and what it lets out: the security checks in one place.

Owns:

- :func:`unsafe_dir_reason`: a folder (and every folder above it) must be owned by us or root
  and not writable by another user (parents may be shared with the sticky bit, like ``/tmp``);
- :func:`validate_host_name`: a host name used as one path component;
- :func:`trusted_owner` / :func:`open_trusted`: a file or socket planted by someone else (wrong
  owner, symlink) is not the target's;
- :func:`redact_cmdline`: secrets in command lines (``--api-key X``, ``--token=X``,
  ``HF_TOKEN=X``) never reach a manifest;
- :func:`strip_control`: text a target chose (titles, thread, function and file names, request
  ids) never carries terminal escape sequences to an operator's terminal.

Imports: stdlib only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "REDACTED",
    "is_within",
    "open_trusted",
    "process_uids",
    "redact_cmdline",
    "redact_text",
    "sanitize",
    "strip_control",
    "trusted_owner",
    "unsafe_dir_reason",
    "validate_host_name",
]

#: What a redacted secret reads as.
REDACTED = "<redacted>"


# --- folders -------------------------------------------------------------------------------


def _trusted_uids() -> frozenset[int]:
    return frozenset({0, os.geteuid()})


def _dir_problem(path: str, st: os.stat_result, *, is_leaf: bool) -> str | None:
    if st.st_uid not in _trusted_uids():
        return f"{path!r} is owned by uid {st.st_uid}, not by us (uid {os.geteuid()}) or root"
    if stat.S_ISLNK(st.st_mode):
        return None  # a symlink's own mode bits mean nothing; its target is checked separately
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and (is_leaf or not st.st_mode & stat.S_ISVTX):
        which = "group/other" if is_leaf else "another user, without the sticky bit"
        return f"{path!r} is writable by {which} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _prefixes(path: str) -> list[str]:
    parts = Path(path).parts
    return [str(Path(*parts[: i + 1])) for i in range(len(parts))]


def unsafe_dir_reason(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a safe folder for root to write into, or ``None`` when it is.

    Safe means: ``path`` and every folder above it (as given, symlinks included, and as
    resolved) are owned by this process's effective uid or root; none of the folders above is
    writable by another user unless it has the sticky bit (``/tmp``); ``path`` itself is not
    group- or other-writable at all. Otherwise another local user could swap a folder or plant
    a symlink between our check and our write.

    Args:
        path: the folder (must exist).

    Returns:
        One line naming the offending folder, or ``None``.
    """
    given = os.path.abspath(path)
    real = os.path.realpath(given)
    seen: set[str] = set()
    for chain, follow in ((given, False), (real, True)):
        prefixes = _prefixes(chain)
        for i, prefix in enumerate(prefixes):
            key = f"{prefix}\0{follow}"
            if key in seen:
                continue
            seen.add(key)
            try:
                st = os.stat(prefix) if follow else os.lstat(prefix)
            except OSError as exc:
                return f"cannot inspect {prefix!r}: {exc.strerror or exc}"
            if not follow and not stat.S_ISLNK(st.st_mode):
                continue  # real folders are judged on the resolved chain
            problem = _dir_problem(prefix, st, is_leaf=(i == len(prefixes) - 1) and follow)
            if problem is not None:
                return problem
    return None


_BAD_HOST_CHARS = re.compile(r"[/\\\x00-\x1f\x7f]")


def validate_host_name(name: str) -> str:
    """Check that ``name`` is usable as exactly one path component (bundles go to ``<data_dir>/<host>/``).

    Raises:
        ValueError: empty, ``.``/``..``, longer than 255 bytes, or holding ``/``, ``\\``, NUL
            or a control character.
    """
    if not name or name in (".", ".."):
        raise ValueError(f"host name {name!r} cannot be a folder name")
    if _BAD_HOST_CHARS.search(name):
        raise ValueError(f"host name {name!r} must be one path component (no '/', '\\\\' or control characters)")
    if len(name.encode("utf-8", "surrogateescape")) > 255:
        raise ValueError("host name longer than 255 bytes")
    return name


def is_within(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """Whether ``path`` resolves (symlinks followed) to ``folder`` or something inside it."""
    base = os.path.realpath(folder)
    real = os.path.realpath(path)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


# --- files and sockets of a target ------------------------------------------------------------


def process_uids(pid: int) -> tuple[int, ...]:
    """The uids a process's own files may carry: its ``/proc/PID`` owner and its real and
    effective uids (``/proc/PID/status``); empty when it is gone."""
    uids: list[int] = []
    try:
        uids.append(os.stat(f"/proc/{pid}").st_uid)
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    uids.extend(int(x) for x in line.split()[1:3])
                    break
    except (OSError, ValueError):
        return tuple(uids)
    return tuple(dict.fromkeys(uids))


def trusted_owner(st: os.stat_result, owner_uids: Iterable[int | None]) -> bool:
    """Whether a file (``lstat`` result) is not a symlink and is owned by root or one of ``owner_uids``."""
    if stat.S_ISLNK(st.st_mode):
        return False
    allowed = {0, *(u for u in owner_uids if u is not None)}
    return st.st_uid in allowed


def open_trusted(path: str | os.PathLike[str], owner_uids: Iterable[int | None], *, max_bytes: int) -> bytes | None:
    """Read at most ``max_bytes`` of a regular file owned by root or ``owner_uids``, never via a symlink.

    Returns:
        The bytes, or ``None`` when the file is missing, a symlink, not a regular file, owned by
        someone else, or unreadable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not trusted_owner(st, owner_uids):
            return None
        return os.read(fd, max_bytes)
    except OSError:
        return None
    finally:
        os.close(fd)


# --- what leaves the process -------------------------------------------------------------------

#: Flags whose value is a secret: ``--api-key``, ``--token``, ``--password`` and any
#: ``--*-key``, ``--*-secret``, ``--*-token``, ``--*-password`` (case-insensitive, ``_`` or ``-``).
_SECRET_FLAG = re.compile(
    r"^--?(?:api[-_]?key|token|password|passwd|secret|(?:[a-z0-9]+[-_])+(?:key|secret|token|password|passwd))$",
    re.IGNORECASE,
)
#: ``NAME=value`` arguments whose name looks like a secret (``HF_TOKEN=``, ``AWS_SECRET_ACCESS_KEY=``, ``API_KEY=``).
_SECRET_ENV = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)[A-Za-z0-9_]*)=", re.IGNORECASE)


def redact_cmdline(argv: Sequence[str]) -> list[str]:
    """A copy of ``argv`` with secret values replaced by :data:`REDACTED`.

    Redacts the value after ``--api-key``, ``--token``, ``--password``, ``--*-key``,
    ``--*-secret`` (also ``--flag=value``), and the value of ``KEY=…``-style arguments whose name
    contains KEY, TOKEN, SECRET or PASSWORD.
    """
    out: list[str] = []
    redact_next = False
    for arg in argv:
        if redact_next:
            out.append(REDACTED)
            redact_next = False
            continue
        flag, eq, _value = arg.partition("=")
        if flag.startswith("-") and _SECRET_FLAG.match(flag):
            if eq:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(arg)
                redact_next = True
            continue
        m = _SECRET_ENV.match(arg)
        if m:
            out.append(f"{m.group(1)}={REDACTED}")
            continue
        out.append(arg)
    return out


# C0 controls except tab/newline, DEL, C1 controls (0x80-0x9f: 8-bit CSI/OSC), and the
# Unicode bidi overrides that can reorder what an operator reads.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_CONTROL_NO_NEWLINE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def strip_control(text: object, *, keep_newlines: bool = False) -> str:
    """``str(text)`` with control characters (ESC, BEL, C1, bidi overrides) replaced by ``?``.

    Args:
        text: anything a target chose (its title, thread, function or file names, request ids).
        keep_newlines: keep ``\\n`` and ``\\t`` (multi-line renderings); otherwise they go too.
    """
    pattern = _CONTROL if keep_newlines else _CONTROL_NO_NEWLINE
    return pattern.sub("?", str(text))


_T = TypeVar("_T")


def sanitize(obj: _T, *, keep_newlines: bool = False) -> _T:
    """A copy of ``obj`` with :func:`strip_control` applied to every string inside it.

    Walks dataclass instances (their init fields), tuples, lists and dicts; other values are
    returned as they are. Used before a whole model (an incident timeline) reaches a terminal.
    """
    if isinstance(obj, str):
        return strip_control(obj, keep_newlines=keep_newlines)  # type: ignore[return-value]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            value = getattr(obj, f.name)
            clean = sanitize(value, keep_newlines=keep_newlines)
            if clean is not value:
                changes[f.name] = clean
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, tuple):
        items = [sanitize(v, keep_newlines=keep_newlines) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)  # type: ignore[return-value]
    if isinstance(obj, list):
        return [sanitize(v, keep_newlines=keep_newlines) for v in obj]  # type: ignore[return-value]
    if isinstance(obj, dict):
        return {sanitize(k, keep_newlines=keep_newlines): sanitize(v, keep_newlines=keep_newlines) for k, v in obj.items()}  # type: ignore[return-value]
    return obj


def redact_text(text: str) -> str:
    """:func:`redact_cmdline` for a command line held in one string (a title with arguments)."""
    if " " not in text:
        return redact_cmdline([text])[0]
    return " ".join(redact_cmdline(text.split(" ")))
