"""A lean HTTP/1.1 client for the fan-out: one request per connection, h11 on anyio streams.

Owns :func:`post_json`, :class:`PeerAnswer` and :class:`PeerRequestError`. Why not httpx (the
project's HTTP client everywhere else): a fan-out sends one small request to each of N peers at once,
and httpx costs more per request for it: ``bench/bench_peer_client.py`` (N real agent API servers,
the same run) measured the whole fan-out at 2.3-3.0x the wall time and 2.8-4.0x the CPU through
httpx (a client per peer or one shared) at 8, 64 and 256 peers. A fresh connection per peer is one
TCP (and TLS) handshake, which on a LAN is cheap, and keeps each peer's failure its own.

Imports anyio, h11 and the standard library only.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import h11

from agent.errors import PeerRequestError

__all__ = ["PeerAnswer", "PeerRequestError", "post_json"]

#: Largest answer read, bytes.
MAX_RESPONSE_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class PeerAnswer:
    """One HTTP answer.

    Attributes:
        status / reason: the status line.
        doc: the body as a JSON object, or ``None`` (empty, not JSON, not an object).
        headers: header names lower-cased; a repeated header keeps its last value.
        body: the raw body (what an answer's proof covers, :mod:`agent.fleet.proof`).
    """

    status: int
    reason: str
    doc: dict[str, Any] | None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


async def post_json(
    host: str,
    port: int,
    path: str,
    body: dict[str, Any],
    *,
    headers: dict[str, str],
    ssl_context: ssl.SSLContext | None = None,
    sign: Callable[[bytes], dict[str, str]] | None = None,
    local_host: str | None = None,
    on_sent: Callable[[], None] | None = None,
) -> PeerAnswer:
    """POST ``body`` as JSON and read the answer. Unbounded in time: the caller bounds it.

    Args:
        sign: headers that sign the encoded body (:func:`agent.fleet.proof.sign_request`).
        local_host: the source address (this host's API address: the peer sees us where we listen).
        on_sent: called once the request is written to the connection (a caller whose bound cuts
            the call learns whether the peer ever got it: a slow answer, or no connection at all).

    Returns:
        The answer (:class:`PeerAnswer`).

    Raises:
        PeerRequestError: no connection, or not an HTTP answer.
    """
    payload = json.dumps(body, separators=(",", ":")).encode()
    if sign is not None:
        headers = {**headers, **sign(payload)}
    stream = await _connect(host, port, ssl_context, local_host)
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    request_headers = [("host", authority), ("content-type", "application/json"), ("content-length", str(len(payload))),
                       ("connection", "close"), *headers.items()]
    try:
        async with stream:
            data = conn.send(h11.Request(method="POST", target=path, headers=request_headers))
            data += conn.send(h11.Data(data=payload)) or b""
            data += conn.send(h11.EndOfMessage()) or b""
            await stream.send(data)
            if on_sent is not None:
                on_sent()
            status, reason, answer_headers, answer = await _read_answer(conn, stream)
    except h11.ProtocolError as exc:
        raise PeerRequestError("bad_response", f"not an HTTP answer: {exc}") from None
    except (OSError, ssl.SSLError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
        raise PeerRequestError("unreachable", f"{type(exc).__name__}: {exc}") from None
    if not status:
        raise PeerRequestError("bad_response", "connection closed before an answer")
    return PeerAnswer(status, reason, _json_object(answer), answer_headers, bytes(answer))


async def _connect(host: str, port: int, ssl_context: ssl.SSLContext | None, local_host: str | None) -> Any:
    """A TCP (with ``ssl_context``: TLS) stream to ``host:port``. Raises PeerRequestError: unreachable."""
    try:
        if ssl_context is None:
            return await anyio.connect_tcp(host, port, local_host=local_host)
        return await anyio.connect_tcp(host, port, local_host=local_host, ssl_context=ssl_context, tls_standard_compatible=False)
    except (OSError, ssl.SSLError, anyio.BrokenResourceError) as exc:
        refused = _refused(exc)
        raise PeerRequestError("unreachable", f"{type(refused or exc).__name__}: {refused or exc}", refused=refused is not None) from None


def _json_object(answer: bytearray) -> dict[str, Any] | None:
    """An answer's body as a JSON object (``None``: empty, not JSON, or no object)."""
    try:
        doc = json.loads(answer) if answer else None
    except (ValueError, UnicodeDecodeError):
        doc = None
    return doc if isinstance(doc, dict) else None


async def _read_answer(conn: h11.Connection, stream: Any) -> tuple[int, str, dict[str, str], bytearray]:
    """``(status, reason, headers, body)`` of the answer on ``stream`` (status 0: none came).

    Raises:
        PeerRequestError: an answer larger than :data:`MAX_RESPONSE_BYTES`.
        h11.ProtocolError: not HTTP.
    """
    status, reason, answer = 0, "", bytearray()
    answer_headers: dict[str, str] = {}
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                chunk = await stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                chunk = b""
            conn.receive_data(chunk)
            continue
        if isinstance(event, h11.Response):
            status, reason = event.status_code, event.reason.decode("latin-1")
            answer_headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        elif isinstance(event, h11.Data):
            answer += event.data
            if len(answer) > MAX_RESPONSE_BYTES:
                raise PeerRequestError("bad_response", f"answer larger than {MAX_RESPONSE_BYTES} bytes")
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return status, reason, answer_headers, answer


def _refused(exc: BaseException) -> BaseException | None:
    """The refusal in a failed connect (``exc``, its cause, or one of an exception group's
    members): a refused connection or TLS handshake, else ``None`` (no route, no answer)."""
    seen: list[BaseException] = [exc]
    for _ in range(64):  # bounded: a cause chain may loop
        if not seen:
            break
        e = seen.pop()
        if isinstance(e, (ConnectionRefusedError, ssl.SSLError)):
            return e
        members = getattr(e, "exceptions", None)  # an exception group (anyio's connect, every address tried)
        if isinstance(members, (tuple, list)):
            seen.extend(m for m in members[:16] if isinstance(m, BaseException))
        if e.__cause__ is not None:
            seen.append(e.__cause__)
    return None
