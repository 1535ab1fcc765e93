"""What the agent (often root) trusts, and what it lets out: the security checks in one place.

Owns:

- :func:`unsafe_dir_reason`: a folder (and every folder above it) must be owned by us or root
  and not writable by another user (parents may be shared with the sticky bit, like ``/tmp``);
- :func:`validate_host_name`: a host name used as one path component;
- :func:`trusted_owner` / :func:`open_trusted`: a file or socket planted by someone else (wrong
  owner, symlink) is not the target's;
- :func:`redact_cmdline`: secrets in command lines (``--api-key X``, ``--auth=X``, ``-k X``,
  ``"--api-key X"`` as one element, ``--private-key-pem=-----BEGIN...``, ``HF_TOKEN=X``,
  ``https://u:PASSWORD@h``, ``Authorization: Bearer X``, ``sk-...``, PEM private keys) never reach
  a manifest, by pattern families (listed above the function), not a list of flags;
- :func:`strip_control`: text a target chose (titles, thread, function and file names, request
  ids) never carries terminal escape sequences to an operator's terminal.

Imports: stdlib only (and :mod:`agent.sdk.folders`, stdlib only too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from agent.model.lazy import lazy_pattern

__all__ = [
    "REDACTED",
    "access_denied",
    "can_ptrace",
    "dumps_safe",
    "is_within",
    "open_trusted",
    "process_uids",
    "redact_cmdline",
    "redact_text",
    "redact_value",
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


def _user_name(uid: int) -> str:
    """``root``, ``alice``, or ``uid 1234`` when the uid has no name."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _run_as(owner: str) -> str:
    return "run as root (sudo)" if owner == "root" else f"run as {owner} or root"


def access_denied(path: str | os.PathLike[str]) -> str | None:
    """Why this process may not open ``path``, in one line ending with what to do, or ``None``.

    The folder (or file) that stops it is named with its owner and mode, as the engineer who
    forgot ``sudo`` needs it said: ``/dev/shm/servewatch-0 is owned by root (0700): run as root
    (sudo)``. ``None`` when ``path`` can be opened, or is missing for another reason than
    permissions. Blocking: ``stat`` calls.
    """
    p = Path(path)
    for folder in [*reversed(p.parents), p]:
        try:
            st = os.stat(folder)
        except PermissionError:  # its parent was searchable: an odd mount; name the parent
            return f"{folder.parent} refuses access to {folder.name}: {_run_as('root')}"
        except OSError:
            return None
        need = os.R_OK | os.X_OK if stat.S_ISDIR(st.st_mode) and folder == p else os.X_OK if stat.S_ISDIR(st.st_mode) else os.R_OK
        if not os.access(folder, need):
            owner = _user_name(st.st_uid)
            return f"{folder} is owned by {owner} ({stat.S_IMODE(st.st_mode):04o}): {_run_as(owner)}"
    return None


#: Bit of CAP_SYS_PTRACE in ``/proc/self/status``'s ``CapEff`` (linux/capability.h).
_CAP_SYS_PTRACE = 19


def can_ptrace(uid: int | None) -> bool:
    """Whether this process may read the memory of a process of real uid ``uid`` (py-spy needs
    it): root, the same uid, or CAP_SYS_PTRACE. ``True`` when ``uid`` is unknown. Blocking."""
    if uid is None or os.geteuid() in (0, uid):
        return True
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            caps = next((line.split()[1] for line in fh if line.startswith("CapEff:")), "0")
        return bool(int(caps, 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError):
        return False


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


_BAD_HOST_CHARS = lazy_pattern(r"[/\\\x00-\x1f\x7f]")


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
    # imported here: agent.sdk.folders loads the whole SDK package (read-only commands need none)
    from agent.sdk.folders import process_uids as sdk_process_uids

    return sdk_process_uids(pid)


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

# Secrets are recognised by pattern families, not a list of flags; each family is one rule below
# (README "Security model" names them):
#
# 1. a flag whose last word is a secret word (:data:`SECRET_WORDS`: ``--api-key``, ``--hf-token``,
#    ``--db-password``, ``--auth``, ``--bearer``, ``--credentials``, ``--client-secret``,
#    ``--passphrase``...), its plural (``--api-keys``, ``--tokens``, ``--secrets``) unless another
#    word of the name counts (:data:`COUNT_WORDS`: ``--max-tokens``, ``--num-keys``), or a word
#    that ends with a long one (``--accessToken``, ``--dbPassword``), or ``-k``: its value (the
#    next argument, or after ``=``);
# 2. ``NAME=value`` whose NAME holds a secret word (``HF_TOKEN=``, ``AWS_SECRET_ACCESS_KEY=``);
# 3. a password in a URL (``scheme://user:PASSWORD@host``) and secret-named query parameters
#    (``?token=``, ``&api_key=``);
# 4. a credential header (``Authorization:``, ``Proxy-Authorization:``, ``Cookie:``,
#    ``X-Api-Key:`` and any ``X-...-Token:``): everything after the colon;
# 5. well-known token shapes anywhere (OpenAI ``sk-``, Hugging Face ``hf_``, GitHub ``ghp_``...,
#    Slack ``xox?-``, AWS ``AKIA...`` access key ids, JWTs ``eyJ...``) and PEM private key blocks
#    (``-----BEGIN ... PRIVATE KEY-----`` to its ``END`` line, or to the end when cut).
#
# One argv element may hold a flag and its value together: ``"--api-key sk-abc"`` (a flag, a
# space, its value: a launcher that passed one string) and ``"--private-key-pem=-----BEGIN..."``
# (multi-line) are family 1 too; a value that starts with dashes but is no ``--flag`` (a PEM
# block after ``--private-key-pem``) is still the secret flag's value. A flag name's trailing
# format word (``pem``, ``der``, ``b64``, ``base64``, ``hex``, ``value``, ``data``, ``string``,
# ``raw``) is looked through: ``--private-key-pem`` is a ``key``.
#
# Secrets hide inside elements too, and every element is redacted as a command line of its own:
# the value of a ``--flag=value`` (``--header=Authorization:Bearer X``: family 4) or of a
# ``"--flag value"`` element, and the shell-like words of an element with spaces (``--dsn
# "host=x password=X"``: family 2; ``sh -c "vllm serve --api-key X"``; ``" --api-key X"``),
# quotes understood, to a depth of :data:`_MAX_DEPTH` (``bash -c 'sh -c "..."'``).
# A flag naming where a secret is (``--key-file``, ``--api-key-file``, ``--ssl-keyfile``) is not
# one: its value is a path (last word ``file``), kept for diagnosis.

#: Words that make a flag, variable, query parameter or header name a secret's (compared per
#: ``-``/``_``/``.`` separated word, case-insensitive; ``--tokenizer``, ``--max-tokens`` and
#: ``--keyboard`` are not secrets).
SECRET_WORDS = frozenset({
    "key", "apikey", "token", "secret", "password", "passwd", "pass", "pwd", "auth", "authorization",
    "bearer", "credential", "credentials", "creds", "cookie", "session", "signature", "sig", "privatekey",
    "passphrase",
})
#: A word ending with one of these is a secret word too (``accesstoken`` from ``--accessToken``,
#: ``sslpassword=`` in a DSN); short words (``key``, ``pass``) are not, ``--hotkey`` is no secret.
_SECRET_SUFFIXES = ("password", "passwd", "passphrase", "secret", "token", "apikey", "privatekey")
#: Words that make a plural secret word a count, not a secret (``--max-tokens``,
#: ``--max-num-batched-tokens``, ``--num-speculative-tokens``, ``--num-keys``, ``MAX_TOKENS=``).
COUNT_WORDS = frozenset({"max", "min", "maximum", "minimum", "num", "number", "n", "count", "total", "limit"})
#: Short flags whose value is a secret (``-k KEY``).
SECRET_SHORT_FLAGS = frozenset({"-k"})
#: Trailing words of a flag name that say a value's format, not what it is (``--private-key-pem``).
FORMAT_WORDS = frozenset({"pem", "der", "b64", "base64", "hex", "value", "data", "string", "str", "raw", "text"})
#: A next argument that is itself a flag (``--port``), not the value of a secret flag before it.
_FLAG_LIKE = lazy_pattern(r"^--[A-Za-z0-9][A-Za-z0-9_.-]*(?:=|$)")
_PEM_PRIVATE = lazy_pattern(
    r"-----BEGIN (?P<kind>[A-Z0-9 ]*PRIVATE KEY[A-Z0-9 ]*)-----.*?(?:-----END (?P=kind)-----|\Z)", re.DOTALL
)
_WORD_SPLIT = lazy_pattern(r"[-_.]+")
_ENV_ARG = lazy_pattern(r"^([A-Za-z_][A-Za-z0-9_]*)=")
_URL_USERINFO = lazy_pattern(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@:\s]*):(?P<pw>[^/@\s]+)@")
_QUERY_PARAM = lazy_pattern(r"(?P<sep>[?&;])(?P<name>[A-Za-z0-9_.-]+)=(?P<value>[^&#\s]*)")
_HEADER = lazy_pattern(
    r"^(?P<name>(?:proxy-)?authorization|cookie|set-cookie|x-api-key|api-key|x-[a-z0-9-]*(?:token|key|secret|auth))\s*:\s*.+$",
    re.IGNORECASE,
)
_TOKEN_SHAPES = lazy_pattern(
    r"\b(?:sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abposr]-[A-Za-z0-9-]{10,}|A[KS]IA[0-9A-Z]{16}|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*)"
)


def _secret_word(word: str, *, counted: bool) -> bool:
    """Whether one word (or two joined) is a secret word, one ending with a long secret word, or
    the plural of either; ``counted``: the name also holds a :data:`COUNT_WORDS` word, so a
    plural is a count (``max-tokens``)."""
    if word in SECRET_WORDS or word.endswith(_SECRET_SUFFIXES):
        return True
    if counted or len(word) < 4 or not word.endswith("s"):
        return False
    singular = word[:-1]
    return singular in SECRET_WORDS or singular.endswith(_SECRET_SUFFIXES)


def _secret_name(name: str, *, anywhere: bool = False) -> bool:
    """Whether a name names a secret: its last word (or last two joined: ``api-key``) is a
    secret word (:func:`_secret_word`); with ``anywhere`` (variables, query parameters), any of
    its words is."""
    words = [w for w in _WORD_SPLIT.split(name.lower().lstrip("-")) if w]
    while len(words) > 1 and words[-1] in FORMAT_WORDS:
        words.pop()
    if not words:
        return False
    counted = any(w in COUNT_WORDS for w in words)
    pairs = ["".join(words[i:i + 2]) for i in range(len(words) - 1)]
    if anywhere:
        return any(_secret_word(w, counted=counted) for w in (*words, *pairs))
    return _secret_word(words[-1], counted=counted) or (bool(pairs) and _secret_word(pairs[-1], counted=counted))


def _is_secret_flag(flag: str) -> bool:
    if flag in SECRET_SHORT_FLAGS:
        return True
    return flag.startswith("--") and _secret_name(flag)


def redact_value(text: str) -> str:
    """``text`` with the secrets of families 3, 4 and 5 replaced by :data:`REDACTED` (a URL's
    password and secret query parameters, a credential header's value, token shapes)."""
    text = _PEM_PRIVATE.sub(REDACTED, text)
    header = _HEADER.match(text.strip())
    if header:
        return f"{header.group('name')}: {REDACTED}"
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{m.group('user')}:{REDACTED}@", text)
    if "=" in text and ("?" in text or "&" in text or ";" in text):
        text = _QUERY_PARAM.sub(
            lambda m: f"{m.group('sep')}{m.group('name')}={REDACTED}" if _secret_name(m.group("name"), anywhere=True) else m.group(0),
            text,
        )
    return _TOKEN_SHAPES.sub(REDACTED, text)


_HEAD = lazy_pattern(r"^(?P<flag>[^\s=]+)(?P<sep>=|\s+)")


def _secret_flag_element(arg: str) -> str | None:
    """``arg`` redacted when it is a secret flag together with its value in one element
    (``--auth=X``, ``--api-key X``, ``--private-key-pem=<PEM, several lines>``), else ``None``."""
    m = _HEAD.match(arg)
    if m is None or not m.group("flag").startswith("-") or not _is_secret_flag(m.group("flag")):
        return None
    sep = "=" if m.group("sep") == "=" else " "
    return f"{m.group('flag')}{sep}{REDACTED}"


#: How deep elements are looked into (``--flag=value``, then the shell-like words of the value...).
_MAX_DEPTH = 4
#: One shell-like word: quoted parts (closed or cut at the end), escapes, other non-spaces.
_SHELL_WORD = lazy_pattern(r"""(?:'[^']*'?|"(?:\\.|[^"\\])*"?|\\.?|[^\s'"\\])+""", re.DOTALL)
_SHELL_QUOTING = lazy_pattern(r"""'([^']*)'?|"((?:\\.|[^"\\])*)"?|\\(.?)""", re.DOTALL)
_ESCAPED = lazy_pattern(r"\\(.)", re.DOTALL)
#: What makes a text more than one word as it is: spaces, quotes, escapes.
_SHELL_SYNTAX = lazy_pattern(r"""[\s'"\\]""")
#: A word, written as is (no quotes or escapes), that no rule can take alone: not a flag, no ``=``
#: (``NAME=value``, query), no ``:`` (a header); token shapes and URLs in it were redacted with
#: the text it came from. Skipping those keeps the look into words cheap (it stays linear).
_PLAIN_WORD = lazy_pattern(r"[^\s'\"\\=:-][^\s'\"\\=:]*")


def _unquote(word: str) -> str:
    """A shell-like word as the command it runs would see it (quotes removed, escapes undone)."""
    def one(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            return m.group(1)
        if m.group(2) is not None:
            return _ESCAPED.sub(r"\1", m.group(2))
        return m.group(3)
    return _SHELL_QUOTING.sub(one, word)


def _requote(word: str) -> str:
    return f"'{word}'" if re.search(r"\s", word) and "'" not in word else word


def _redact_words(text: str, depth: int) -> str:
    """``text`` with its shell-like words redacted as a command line (:func:`_redact_argv`);
    a word that changed is written back in place (quoted again when it holds spaces), the rest
    of ``text`` (spaces, quotes) as it was."""
    if depth >= _MAX_DEPTH or _SHELL_SYNTAX.search(text) is None:
        return text  # one word, as is
    spans = [m.span() for m in _SHELL_WORD.finditer(text)]
    words = [_unquote(text[a:b]) for a, b in spans]
    plain = [text[a:b] == w and _PLAIN_WORD.fullmatch(w) is not None for (a, b), w in zip(spans, words)]
    redacted = _redact_argv(words, depth + 1, plain)
    out, last = [], 0
    for (a, b), before, after in zip(spans, words, redacted):
        out.append(text[last:a])
        out.append(text[a:b] if after == before else _requote(after))
        last = b
    out.append(text[last:])
    return "".join(out)


def _redact_element(arg: str, depth: int) -> str:
    """One argv element redacted on its own: a secret flag with its value, ``NAME=value`` of a
    secret NAME, else the value of a ``--flag=value`` / ``"--flag value"`` redacted as an element
    of its own, else families 3 to 5 over the element and then its shell-like words. PEM private
    key blocks go first, whole: they span the spaces and dashes the splitting looks for."""
    arg = _PEM_PRIVATE.sub(REDACTED, arg)
    joined = _secret_flag_element(arg)
    if joined is not None:
        return joined
    m = _ENV_ARG.match(arg)
    if m and _secret_name(m.group(1), anywhere=True):
        return f"{m.group(1)}={REDACTED}"
    head = _HEAD.match(arg)
    if head is not None and head.group("flag").startswith("-") and depth < _MAX_DEPTH:
        return head.group(0) + _redact_element(arg[head.end():], depth + 1)
    return _redact_words(redact_value(arg), depth)


def _redact_argv(argv: Sequence[str], depth: int, plain: Sequence[bool] = ()) -> list[str]:
    """:func:`redact_cmdline` at a ``depth``; ``plain[i]``: ``argv[i]`` needs no look of its own
    (:data:`_PLAIN_WORD`), only the value-of-a-secret-flag rule."""
    out: list[str] = []
    redact_next = False
    for i, arg in enumerate(argv):
        if redact_next:
            redact_next = False
            if not _FLAG_LIKE.match(arg):
                out.append(REDACTED)
                continue
        if i < len(plain) and plain[i]:
            out.append(arg)
            continue
        if arg.startswith("-") and _HEAD.match(arg) is None and _is_secret_flag(arg):  # value next
            out.append(arg)
            redact_next = True
            continue
        out.append(_redact_element(arg, depth))
    return out


def redact_cmdline(argv: Sequence[str]) -> list[str]:
    """A copy of ``argv`` with secret values replaced by :data:`REDACTED`, by the pattern
    families above: the value of a secret flag (``--api-key X``, ``--auth=X``, ``-k X``,
    ``--api-keys X``, and one element holding both: ``"--api-key X"``,
    ``"--private-key-pem=-----BEGIN..."``; a next argument that is itself a ``--flag`` is not
    taken as the value, one that merely starts with dashes, a PEM block, is), ``NAME=value`` of
    a secret NAME, passwords in URLs, secret query parameters, credential headers
    (``-H 'Authorization: Bearer X'``, ``--header=Authorization:Bearer X``) and known token
    shapes (PEM private keys included) anywhere; inside an element too (the value of a
    ``--flag=value``, the words of ``sh -c "vllm serve --api-key X"`` or ``--dsn "password=X"``).

    Args:
        argv: a command line, one string per element (elements may hold spaces and newlines).

    Returns:
        A new list of the same length.
    """
    return _redact_argv(argv, 0)


# C0 controls except tab/newline, DEL, C1 controls (0x80-0x9f: 8-bit CSI/OSC), and the
# Unicode bidi marks, overrides and isolates that can reorder what an operator reads.
_CONTROL = lazy_pattern("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_CONTROL_NO_NEWLINE = lazy_pattern("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


#: What JSON output escapes beyond what :func:`json.dumps` does with ``ensure_ascii=False``: C1
#: controls, DEL, bidi embeddings/overrides/isolates, line/paragraph separators, BOM/zero widths.
_JSON_UNSAFE = lazy_pattern("[\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def dumps_safe(obj: Any, *, indent: int | None = 2) -> str:
    """``json.dumps`` for output a terminal may show: UTF-8 text stays readable, but every
    control character (C0 as JSON always does, plus C1, DEL) and every character that reorders
    or hides text (bidi overrides such as U+202E, zero-width marks) is written as a four-hex-digit ``\\u``
    escape, so the JSON means the same and shows no raw control to whoever reads it."""
    text = json.dumps(obj, ensure_ascii=False, indent=indent, default=str)
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text)


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
        return _sanitize_dataclass(obj, keep_newlines=keep_newlines)
    if isinstance(obj, tuple):
        return _sanitize_tuple(obj, keep_newlines=keep_newlines)  # type: ignore[return-value]
    if isinstance(obj, list):
        return [sanitize(v, keep_newlines=keep_newlines) for v in obj]  # type: ignore[return-value]
    if isinstance(obj, dict):
        return {sanitize(k, keep_newlines=keep_newlines): sanitize(v, keep_newlines=keep_newlines) for k, v in obj.items()}  # type: ignore[return-value]
    return obj


def _sanitize_dataclass(obj: Any, *, keep_newlines: bool) -> Any:
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        value = getattr(obj, f.name)
        clean = sanitize(value, keep_newlines=keep_newlines)
        if clean is not value:
            changes[f.name] = clean
    return dataclasses.replace(obj, **changes) if changes else obj


def _sanitize_tuple(obj: tuple[Any, ...], *, keep_newlines: bool) -> tuple[Any, ...]:
    """Itself when no item changed; a named tuple stays one."""
    items = [sanitize(v, keep_newlines=keep_newlines) for v in obj]
    if all(a is b for a, b in zip(items, obj)):
        return obj
    return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)


def redact_text(text: str) -> str:
    """:func:`redact_cmdline` for a command line held in one string (a title with arguments);
    PEM private key blocks are removed whole first (they span spaces and lines)."""
    text = _PEM_PRIVATE.sub(REDACTED, text)
    if " " not in text:
        return redact_cmdline([text])[0]
    return " ".join(redact_cmdline(text.split(" ")))
