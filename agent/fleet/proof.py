"""Peers prove they hold the job's token without ever sending it: signed requests, proven answers.

Owns :func:`sign_request` / :class:`RequestSignature` (a request signed with the token) and
:func:`answer_proof` / :func:`verify_answer` (an answer proven with it).

* **Requests between peers** carry ``Authorization: Servewatch-Sig ts=<unix s>,nonce=<hex>,
  sha256=<body digest>,port=<sender's API port>,sig=<HMAC-SHA256(token, "v2", method, host,
  path, ts, nonce, digest, port)>`` (newline-joined) instead of the bearer token: whoever
  listens at a peer's address (a rescheduled pod's IP, a port another user took over, a
  plain-HTTP wire) learns nothing that lets it call other agents. ``host`` is the receiver as
  the sender names it in its member list (``host:port``, the ``Host`` header): the receiver
  accepts a signature only when that names *itself* (one of its own addresses or names, and its
  port: every agent of a job listens on the same port, so a port alone names no one), whose time
  is within :data:`MAX_SKEW_S` of its clock and whose nonce its own cache has not seen (replays
  refused), and checks the body against the signed digest. A request signed for another agent
  is refused with that reason (:func:`misdirected`). ``port`` is the sender's own API port: with
  the address the request came from (TCP) it names the sender (:mod:`agent.fleet.job` binds a
  host name to it). A signature without ``port`` (``"v1"``) is still accepted; its sender is
  named by its address alone.
* **Answers** carry ``x-servewatch-proof: HMAC-SHA256(token, nonce "\\n" status "\\n" body)`` for
  the nonce the caller sent (:data:`NONCE_HEADER`): a forged answer from an impostor is never
  acted on (:mod:`agent.fleet.job` moves a running incident only on a proven answer). Under
  mutual TLS the peer's certificate, verified against the job CA, proves the same.

The receiver's nonce cache (:class:`NonceCache`) lives in its data dir too (``fleet/nonces-<host
name>``, 0600 in a 0700 folder; only nonces whose signature is still fresh, at most ``max_items``):
a signed request accepted before the agent restarted is refused after it, and a peer whose clock
differs by up to :data:`MAX_SKEW_S` is refused nothing but a replay.

Operators keep using the bearer token (``Authorization: Bearer``). Imports :mod:`agent.host.fsutil` and
the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from agent.host.fsutil import atomic_write_text, open_append_nofollow

__all__ = [
    "MAX_SKEW_S",
    "NONCE_HEADER",
    "NONCE_LOG_SLACK",
    "PROOF_HEADER",
    "SIGNATURE_SCHEME",
    "NonceCache",
    "RequestSignature",
    "answer_proof",
    "authority_host",
    "misdirected",
    "new_nonce",
    "sign_request",
    "skew_refusal",
    "verify_answer",
]

#: Request header carrying the caller's nonce (32 hex digits).
NONCE_HEADER = "x-servewatch-nonce"
#: Response header carrying the answer's proof (64 hex digits).
PROOF_HEADER = "x-servewatch-proof"
#: ``Authorization`` scheme of a signed peer request.
SIGNATURE_SCHEME = "Servewatch-Sig"
#: Largest difference between a signed request's time and the receiver's clock, seconds.
MAX_SKEW_S = 60.0

#: Lines the nonce file may hold beyond twice the live nonces before it is rewritten.
NONCE_LOG_SLACK = 1024
_NONCE_LINE_MAX = 160
_NONCE = re.compile(r"[0-9a-f]{16,128}")
_FIELDS = re.compile(r"(ts|nonce|sha256|sig|port)=([0-9a-f]{1,128})")


def new_nonce() -> str:
    """A fresh nonce (128 random bits, hex)."""
    return secrets.token_hex(16)


def _mac(token: bytes, *parts: str) -> str:
    return hmac.new(token, "\n".join(parts).encode("utf-8", "replace"), hashlib.sha256).hexdigest()


def _signed(token: bytes, method: str, host: str, path: str, ts: str, nonce: str, digest: str, port: int | None) -> str:
    if port is None:
        return _mac(token, "v1", method.upper(), host.lower(), path, ts, nonce, digest)
    return _mac(token, "v2", method.upper(), host.lower(), path, ts, nonce, digest, str(port))


def sign_request(token: bytes, method: str, host: str, path: str, body: bytes, *, nonce: str | None = None,
                 now_s: float | None = None, sender_port: int | None = None) -> str:
    """The ``Authorization`` header value of a request to ``host`` signed with ``token``.

    Args:
        host: the receiver as the sender names it (``host:port``, sent as the ``Host`` header).
        sender_port: the sender's own API port (bound into the signature); ``None``: a ``v1``
            signature that names no port.
    """
    ts = str(int(time.time() if now_s is None else now_s))
    nonce = nonce or new_nonce()
    digest = hashlib.sha256(body).hexdigest()
    sig = _signed(token, method, host, path, ts, nonce, digest, sender_port)
    port = f",port={sender_port}" if sender_port is not None else ""
    return f"{SIGNATURE_SCHEME} ts={ts},nonce={nonce},sha256={digest}{port},sig={sig}"


def authority_host(authority: str) -> tuple[str, str]:
    """``(host, port)`` of a ``Host`` header (``[v6]:port`` unbracketed; host lower-cased, port ``""`` when none)."""
    raw = authority.strip()
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit() or (host.count(":") and not host.startswith("[")):
        host, port = raw, ""
    return host.strip("[]").lower(), port


def misdirected(authority: str, own: str) -> str:
    """The reason a request genuinely signed for ``authority`` is refused by the agent at ``own``."""
    return (f"unauthorized: signed for {authority}, not this agent ({own}): a request made for another agent"
            " is never accepted here (captured and replayed?)")


@dataclass(frozen=True, slots=True)
class RequestSignature:
    """A parsed ``Servewatch-Sig`` header."""

    ts: int
    nonce: str
    sha256: str
    sig: str
    #: the sender's API port (``None``: a ``v1`` signature)
    port: int | None = None

    @classmethod
    def parse(cls, header: str) -> RequestSignature | None:
        scheme, _, rest = header.partition(" ")
        if scheme != SIGNATURE_SCHEME:
            return None
        fields = dict(_FIELDS.findall(rest))
        port = fields.pop("port", None)
        if set(fields) != {"ts", "nonce", "sha256", "sig"} or len(fields["nonce"]) < 16:
            return None
        if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
            return None
        return cls(int(fields["ts"]), fields["nonce"], fields["sha256"], fields["sig"], int(port) if port else None)

    def valid(self, token: bytes, method: str, host: str, path: str, *, now_s: float | None = None) -> bool:
        """The signature is the token's over this method, host, path, time, nonce and digest, and
        its time is within :data:`MAX_SKEW_S` (the body is checked against the digest separately)."""
        return abs(self.skew_s(now_s)) <= MAX_SKEW_S and self.authentic(token, method, host, path)

    def authentic(self, token: bytes, method: str, host: str, path: str) -> bool:
        """The signature is the token's over this method, host, path, time, nonce and digest,
        whatever its time (what lets a refusal name a skewed clock to a member, and to no one else)."""
        expected = _signed(token, method, host, path, str(self.ts), self.nonce, self.sha256, self.port)
        return hmac.compare_digest(expected, self.sig)

    def skew_s(self, now_s: float | None = None) -> float:
        """The signer's clock minus this host's (``now_s``, default now), seconds, as the
        signature's time says (positive: the signer is ahead; includes the request's transit)."""
        now = time.time() if now_s is None else now_s
        return float(self.ts) - now

    def covers(self, body: bytes) -> bool:
        return hmac.compare_digest(hashlib.sha256(body).hexdigest(), self.sha256)


def skew_refusal(skew_s: float) -> str:
    """The one-line refusal of a genuine signature whose time is outside :data:`MAX_SKEW_S`:
    names the skew and the limit (``"... the sender's clock is 75 s ahead of this agent's;
    limit 60 s ..."``)."""
    side = "ahead of" if skew_s > 0 else "behind"
    return (f"unauthorized: a signed request whose time is out of the window: the sender's clock is {abs(skew_s):.0f} s {side}"
            f" this agent's; limit {MAX_SKEW_S:g} s (synchronize both hosts' clocks, e.g. NTP)")


class NonceCache:
    """Nonces of signed requests whose signature is still fresh (a replay is refused).

    A nonce is kept until its signature's time is more than :data:`MAX_SKEW_S` in the past (no
    receiver accepts it after that), at most ``max_items``. With ``path`` (:meth:`load`) every
    nonce is also appended there (``<expiry> <nonce>`` lines, 0600; rewritten with only the
    live ones when it grew to twice as many plus :data:`NONCE_LOG_SLACK`), and the live ones are
    read back at start: a request accepted before a restart is refused after it too. File work is
    blocking: :meth:`load` and :meth:`persist` run on a worker thread.
    """

    def __init__(self, *, keep_s: float = 2 * MAX_SKEW_S, max_items: int = 100_000, path: str | None = None) -> None:
        self.keep_s = keep_s
        self.max_items = max_items
        self.path = path
        #: nonce -> wall time after which its signature is stale everywhere
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._fd: int | None = None
        self._logged = 0
        #: the last error writing the file ("" while none)
        self.error = ""

    def first_use(self, nonce: str, *, now_s: float | None = None, ts: float | None = None) -> bool:
        """Record ``nonce`` (of a signature made at ``ts``, wall time; default: now); False when
        it was seen already (a replay)."""
        now = time.time() if now_s is None else now_s
        while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) >= self.max_items):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = max(now + self.keep_s / 2, (now if ts is None else ts) + MAX_SKEW_S) + 1.0
        return True

    @classmethod
    def load(cls, path: str, *, now_s: float | None = None, max_items: int = 100_000) -> NonceCache:
        """A cache persisted at ``path`` (its folder: a private one the caller made), with the
        nonces still live there (a missing or unreadable file: none; a symlink is never followed)."""
        cache = cls(path=path, max_items=max_items)
        now = time.time() if now_s is None else now_s
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return cache
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(max_items * _NONCE_LINE_MAX)
        for line in raw.splitlines():
            expiry, _, nonce = line.decode("ascii", "replace").partition(" ")
            try:
                when = float(expiry)
            except ValueError:
                continue
            if when >= now and _NONCE.fullmatch(nonce):
                cache._seen[nonce] = when
        cache._seen = OrderedDict(sorted(cache._seen.items(), key=lambda kv: kv[1])[-max_items:])
        cache._rewrite()
        return cache

    def persist(self, nonce: str) -> None:
        """Append ``nonce`` (just recorded) to the file; rewrite the file when it grew too long.
        An error is remembered (:attr:`error`), never raised: the memory cache still refuses."""
        expiry = self._seen.get(nonce)
        if self.path is None or expiry is None:
            return
        try:
            if self._fd is None or self._logged > 2 * len(self._seen) + NONCE_LOG_SLACK:
                self._rewrite()
            else:
                os.write(self._fd, f"{expiry:.0f} {nonce}\n".encode("ascii"))
                self._logged += 1
            self.error = ""
        except OSError as exc:
            self.error = f"cannot write {self.path}: {exc}"

    def _rewrite(self) -> None:
        """The file holds the live nonces only; the append descriptor reopened."""
        assert self.path is not None
        self.close()
        atomic_write_text(self.path, "".join(f"{e:.0f} {n}\n" for n, e in self._seen.items()), durable=False)
        self._fd = open_append_nofollow(self.path)
        self._logged = len(self._seen)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def answer_proof(token: bytes, nonce: str, status: int, body: bytes) -> str:
    """The proof of one answer: HMAC-SHA256 keyed by the token over nonce, status and body."""
    mac = hmac.new(token, digestmod=hashlib.sha256)
    mac.update(nonce.encode("ascii", "replace"))
    mac.update(b"\n%d\n" % status)
    mac.update(body)
    return mac.hexdigest()


def verify_answer(token: bytes, nonce: str, status: int, body: bytes, proof: str | None) -> bool:
    """Whether ``proof`` is the answer's proof (constant-time comparison)."""
    if not proof:
        return False
    return hmac.compare_digest(answer_proof(token, nonce, status, body), proof.strip().lower())
