"""Proof that an answer comes from a holder of the job's token, without sending the token.

Owns :func:`new_nonce`, :func:`answer_proof` and :func:`verify_answer`. A caller sends a fresh
random nonce with its request (header :data:`NONCE_HEADER`); a peer that holds the job's bearer
token answers with ``HMAC-SHA256(token, nonce || status || body)`` (header
:data:`PROOF_HEADER`). Whoever took over a peer's address (a rescheduled pod's IP, a spoofed
DNS answer) can answer, but cannot forge the proof, so its answer is never trusted to move an
incident into another trace. Under mutual TLS the peer's certificate, verified against the job
CA, proves the same; the proof is then optional. Imports the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["NONCE_HEADER", "PROOF_HEADER", "answer_proof", "new_nonce", "verify_answer"]

#: Request header carrying the caller's nonce (32 hex digits).
NONCE_HEADER = "x-servewatch-nonce"
#: Response header carrying the answer's proof (64 hex digits).
PROOF_HEADER = "x-servewatch-proof"


def new_nonce() -> str:
    """A fresh nonce (128 random bits, hex)."""
    return secrets.token_hex(16)


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
