"""A small HTTP/1.1 server on anyio streams with h11, run inside the agent's task group.

Owns :class:`HttpServer`, :class:`Request` and :class:`Response`. Why h11 on anyio rather than an
ASGI server (uvicorn, hypercorn): the agent already runs everything under one anyio task group,
and h11 (python-hyper's sans-IO HTTP/1.1 state machine, already installed as httpx's transport
dependency) lets the API be one more task in that group: cancelled with the agent, no second
event loop, no signal handlers or logging set-up taken over, no framework. It serves a handful of
JSON routes to peers and operators; h11 does the protocol (framing, keep-alive, malformed input)
and this module bounds everything around it:

* connections: at most ``max_connections`` at once, ``max_connections_per_client`` of them from
  one address (a new one from an address at its share takes the slot of that address's oldest
  unproven connection; with none, it is closed at accept: an idle flood from 127.0.0.1 never
  shuts out an operator on 127.0.0.1). A connection is *unproven* until a request head on it
  passes ``authenticate`` (valid credentials); unproven connections may hold at most
  ``max_connections - reserved_for_authenticated`` slots, and when they hold them all a new
  connection takes the slot of the oldest unproven one (closed), so idle or slow unauthenticated
  connections, even from many source addresses (any local user can use all of 127/8), never lock
  out a client with credentials; a proven connection is never closed to make room;
* time: the TLS handshake and every request head of an unproven connection must arrive within
  ``header_timeout_s``; a proven connection may idle ``idle_timeout_s`` between requests; a
  request must arrive whole within ``read_timeout_s`` (slow-loris); a handler gets
  ``handler_timeout_s``;
* pipelining: requests sent back to back on one connection are answered in order;
* size: headers by h11's ``max_incomplete_event_size``, bodies by ``max_body_bytes`` (413);
* TLS: an ``ssl.SSLContext`` (server certificate; with ``CERT_REQUIRED`` and a client CA, mutual
  TLS: a client without a certificate from that CA never gets past the handshake);
* the operator's path (``unix_path``): a unix socket (mode 0600, in a folder only the agent's
  user enters) with slots of its own (``max_unix_connections``), whose callers are admitted only
  when the kernel says (``SO_PEERCRED``) they run as one of ``unix_uids`` (root and the agent's
  user): no TCP flood, from any address, takes them; such a connection is proven from its start.

Imports anyio, h11 and the standard library only; the routes live in :mod:`agent.fleet.api`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import ssl
import stat
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio
import h11
from anyio.abc import ByteStream, SocketAttribute, SocketListener, TaskStatus
from anyio.streams.tls import TLSAttribute, TLSStream

__all__ = ["HttpServer", "HttpStatistics", "Request", "Response", "json_response"]

log = logging.getLogger("servewatch.fleet.http")

#: Largest request head (request line + headers), bytes.
MAX_HEAD_BYTES = 16 * 1024
#: Bytes read from the socket at a time.
RECEIVE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Request:
    """One HTTP request as the handler sees it.

    Attributes:
        method: ``GET``, ``POST``...
        path: the target without its query string.
        query: the raw query string (``""`` when none).
        headers: header names lower-cased; a repeated header keeps its last value.
        body: the whole body (at most ``max_body_bytes``).
        client: the peer's IP address.
        client_certificate: the verified client certificate (``ssl.getpeercert()``) under mutual
            TLS, else ``None``.
        proven_connection: an earlier request on this connection passed ``authenticate``.
        peer_uid: on the unix socket, the caller's uid (``SO_PEERCRED``; admitted: one of
            ``unix_uids``); ``None`` over TCP.
    """

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    client: str
    client_certificate: dict[str, Any] | None = None
    proven_connection: bool = False
    peer_uid: int | None = None


@dataclass(slots=True)
class Response:
    """What a handler returns."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


def json_response(status: int, doc: Any, headers: list[tuple[str, str]] | None = None) -> Response:
    """A JSON response (compact, UTF-8)."""
    return Response(status, json.dumps(doc, separators=(",", ":")).encode(), headers=list(headers or []))


class HttpStatistics(NamedTuple):
    """Counters of one server."""

    #: accepted connections
    connections: int
    #: closed at accept: too many open already (in all, or from that address)
    rejected_connections: int
    #: requests answered
    requests: int
    #: malformed, too large or too slow
    bad_requests: int
    #: handshakes that failed or timed out (no or bad client certificate, plain HTTP, silence)
    tls_failures: int
    #: open now
    open_connections: int
    #: unproven connections closed to make room for a new one
    evicted_connections: int = 0
    #: open now that passed authentication
    proven_connections: int = 0
    #: open now on the operator's unix socket
    unix_connections: int = 0
    #: closed at accept on the unix socket: a caller of another uid, or its slots all held
    unix_refused: int = 0


@dataclass(eq=False, slots=True)
class _Conn:
    """One open connection's bookkeeping."""

    client: str
    scope: anyio.CancelScope
    proven: bool = False
    evicted: bool = False
    peer_uid: int | None = None


Handler = Callable[[Request], Awaitable[Response]]
#: Whether a request (its head; the body is empty) carries valid credentials.
Authenticator = Callable[[Request], bool]


class _Closed(Exception):
    """The connection ended or must end (internal)."""


class HttpServer:
    """Serve ``handler`` on ``host:port`` until cancelled.

    Args:
        handler: called once per request; its exceptions become 500s (logged).
        host / port: where to listen; port 0 picks a free one (see :attr:`port` once started).
        ssl_context: serve HTTPS with it (mutual TLS when it requires client certificates).
        authenticate: says whether a request head carries valid credentials (the connection is
            then proven); ``None``: every connection counts as proven (no reservation).
        max_body_bytes / read_timeout_s / handler_timeout_s / max_connections /
        max_connections_per_client / reserved_for_authenticated / header_timeout_s /
        idle_timeout_s: bounds, above (seconds, bytes, connections).
        unix_path: also serve the operator's unix socket there (created mode 0600; a stale
            socket of a dead agent is replaced); ``None``: none.
        unix_uids: uids admitted on it (default: root and this process's effective uid).
        max_unix_connections: open unix-socket connections at most.

    Raises:
        ValueError: ``reserved_for_authenticated`` leaves no slot for a new connection.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        max_body_bytes: int = 64 * 1024,
        read_timeout_s: float = 10.0,
        handler_timeout_s: float = 30.0,
        max_connections: int = 64,
        server_header: str = "servewatch",
        authenticate: Authenticator | None = None,
        max_connections_per_client: int = 16,
        reserved_for_authenticated: int | None = None,
        header_timeout_s: float = 5.0,
        idle_timeout_s: float = 30.0,
        unix_path: str | None = None,
        unix_uids: Iterable[int] | None = None,
        max_unix_connections: int = 16,
    ) -> None:
        reserved = max_connections // 4 if reserved_for_authenticated is None else reserved_for_authenticated
        if not 0 <= reserved < max_connections:
            raise ValueError(f"reserved_for_authenticated must be in [0, {max_connections}), got {reserved}")
        self.handler = handler
        self.authenticate = authenticate
        self.max_connections_per_client = max_connections_per_client
        #: slots unproven connections may hold at most
        self.max_unproven = max_connections - reserved
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.handler_timeout_s = handler_timeout_s
        self.max_connections = max_connections
        self._server_header = server_header.encode()
        self._connections = 0
        self._rejected = 0
        self._requests = 0
        self._bad = 0
        self._tls_failures = 0
        self._evicted = 0
        #: open connections by client address
        self._per_client: dict[str, int] = {}
        #: open unproven connections, oldest first (the first to give up its slot)
        self._unproven: OrderedDict[int, _Conn] = OrderedDict()
        self._proven = 0
        self.unix_path = unix_path
        self.unix_uids = frozenset(unix_uids if unix_uids is not None else (0, os.geteuid()))
        self.max_unix_connections = max_unix_connections
        self._unix_open = 0
        self._unix_refused = 0

    @property
    def _open(self) -> int:
        return len(self._unproven) + self._proven

    def statistics(self) -> HttpStatistics:
        return HttpStatistics(self._connections, self._rejected, self._requests, self._bad, self._tls_failures, self._open,
                              self._evicted, self._proven, self._unix_open, self._unix_refused)

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, report started (``tg.start``) once bound, and serve until cancelled.

        Raises:
            OSError: the address cannot be bound (port in use, no such address). A unix socket
                that cannot be made (path too long, a live agent's socket there, not a socket) is
                logged, and the TCP API serves without it.
        """
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port, reuse_port=False)
        self.port = int(listener.extra(SocketAttribute.local_port))
        log.info("agent API listening on %s:%d (%s)", self.host, self.port, "https" if self.ssl_context else "http")
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(listener)
            tg = await stack.enter_async_context(anyio.create_task_group())
            if self.unix_path is not None:
                try:
                    unix, inode = await _unix_listener(self.unix_path)
                except OSError as exc:  # the TCP API still serves; the operator is told why there is no socket
                    log.error("agent API: no unix socket at %s: %s", self.unix_path, exc.strerror or exc)
                else:
                    stack.push_async_callback(_unlink_if, self.unix_path, inode)
                    await stack.enter_async_context(unix)
                    log.info("agent API for uid(s) %s on %s", ",".join(map(str, sorted(self.unix_uids))), self.unix_path)
                    tg.start_soon(unix.serve, self._accepted_unix)
            task_status.started()
            await listener.serve(self._accepted)

    # --- one connection ---------------------------------------------------------------------

    def _admit(self, client: str) -> bool:
        """Make room for a new connection from ``client``: ``False`` when it must be refused
        (its address holds its share in proven connections, or every slot is held by one)."""
        if self._per_client.get(client, 0) >= self.max_connections_per_client:
            # that address's oldest unproven connection gives up its slot (fairness within an address)
            same = next((c for c in self._unproven.values() if c.client == client), None)
            if same is None:
                return False
            self._evict(same)
        if len(self._unproven) >= self.max_unproven or self._open >= self.max_connections:
            if not self._unproven:
                return False
            self._evict(next(iter(self._unproven.values())))  # the oldest unproven gives up its slot
        return True

    def _evict(self, conn: _Conn) -> None:
        self._unproven.pop(id(conn), None)
        self._release(conn)
        conn.evicted = True
        conn.scope.cancel("evicted: its slot went to a newer connection")
        self._evicted += 1

    def _release(self, conn: _Conn) -> None:
        left = self._per_client.get(conn.client, 0) - 1
        if left > 0:
            self._per_client[conn.client] = left
        else:
            self._per_client.pop(conn.client, None)

    def _prove(self, conn: _Conn) -> None:
        if not conn.proven and not conn.evicted:
            self._unproven.pop(id(conn), None)
            conn.proven = True
            self._proven += 1

    async def _accepted(self, stream: ByteStream) -> None:
        try:
            client = str(stream.extra(SocketAttribute.remote_address)[0])
        except (anyio.TypedAttributeLookupError, TypeError, IndexError):
            client = "?"
        if not self._admit(client):
            self._rejected += 1
            await anyio.aclose_forcefully(stream)
            return
        self._connections += 1
        conn = _Conn(client, anyio.CancelScope())
        self._per_client[client] = self._per_client.get(client, 0) + 1
        self._unproven[id(conn)] = conn
        if self.authenticate is None:
            self._prove(conn)
        try:
            with conn.scope:
                await self._connection(stream, conn)
        except Exception:  # boundary: one connection never takes the agent down
            log.exception("API connection from %s failed", client)
        finally:
            if not conn.evicted:
                self._release(conn)
                if conn.proven:
                    self._proven -= 1
                else:
                    self._unproven.pop(id(conn), None)
            await anyio.aclose_forcefully(stream)

    async def _accepted_unix(self, stream: ByteStream) -> None:
        """A connection on the operator's unix socket: admitted when its caller's uid (the
        kernel's word, ``SO_PEERCRED``) is one of ``unix_uids`` and a unix slot is free."""
        uid: int | None = None
        try:
            raw = stream.extra(SocketAttribute.raw_socket)
            _pid, uid, _gid = struct.unpack("3i", raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        except (anyio.TypedAttributeLookupError, OSError, struct.error):
            uid = None
        if uid is None or uid not in self.unix_uids or self._unix_open >= self.max_unix_connections:
            self._unix_refused += 1
            if uid is not None and uid not in self.unix_uids:
                log.warning("agent API unix socket: refused a caller running as uid %d (admitted: %s)", uid,
                            ",".join(map(str, sorted(self.unix_uids))))
            await anyio.aclose_forcefully(stream)
            return
        self._connections += 1
        self._unix_open += 1
        conn = _Conn(f"unix:uid={uid}", anyio.CancelScope(), proven=True, peer_uid=uid)
        try:
            with conn.scope:
                await self._connection(stream, conn)
        except Exception:  # boundary: one connection never takes the agent down
            log.exception("API connection from %s failed", conn.client)
        finally:
            self._unix_open -= 1
            await anyio.aclose_forcefully(stream)

    async def _connection(self, stream: ByteStream, conn: _Conn) -> None:
        client = conn.client
        certificate: dict[str, Any] | None = None
        if self.ssl_context is not None and conn.peer_uid is None:
            with anyio.move_on_after(self.header_timeout_s) as scope:
                try:
                    stream = await TLSStream.wrap(stream, server_side=True, ssl_context=self.ssl_context, standard_compatible=False)
                except (ssl.SSLError, OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
                    self._tls_failures += 1
                    log.debug("TLS handshake with %s failed: %s", client, exc)
                    return
            if scope.cancelled_caught:
                self._tls_failures += 1
                return
            certificate = stream.extra(TLSAttribute.peer_certificate, None) or None
        h11conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        while True:
            try:
                request = await self._read_request(h11conn, stream, conn, certificate)
            except _Closed:
                return
            if isinstance(request, Response):  # malformed / too big / too slow: answer and close
                self._bad += 1
                await self._send(h11conn, stream, request, close=True)
                return
            response: Response
            with anyio.move_on_after(self.handler_timeout_s) as scope:
                try:
                    response = await self.handler(request)
                except Exception:  # boundary: a handler bug is a 500, never a dead agent
                    log.exception("API handler failed for %s %s", request.method, request.path)
                    response = json_response(500, {"error": "internal error"})
            if scope.cancelled_caught:
                response = json_response(503, {"error": "handler timed out"})
            self._requests += 1
            if not await self._send(h11conn, stream, response, close=False):
                return
            if h11conn.our_state is h11.MUST_CLOSE or h11conn.their_state is h11.MUST_CLOSE:
                return
            try:
                h11conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _read_request(
        self, conn: h11.Connection, stream: ByteStream, owner: _Conn, certificate: dict[str, Any] | None
    ) -> Request | Response:
        """Read one whole request. The head must arrive within ``header_timeout_s`` on an
        unproven connection (``idle_timeout_s`` on a proven one), the whole request within
        ``read_timeout_s`` of its first byte; a head with valid credentials proves the connection."""
        head: h11.Request | None = None
        body = bytearray()
        client = owner.client
        proven_before = owner.proven
        started: float | None = None  # anyio time of the request's first byte
        head_limit_s = self.idle_timeout_s if owner.proven else self.header_timeout_s
        with anyio.CancelScope(deadline=anyio.current_time() + head_limit_s) as scope:
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    return json_response(exc.error_status_hint, {"error": f"bad request: {exc}"})
                if event is h11.NEED_DATA:
                    started, refused = await self._receive_more(conn, stream, scope, started, head=head)
                    if refused is not None:
                        return refused
                    continue
                if isinstance(event, h11.Request):
                    head = event
                    too_large = self._on_head(event, owner, client, certificate, scope, started)
                    if too_large is not None:
                        return too_large
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > self.max_body_bytes:
                        return json_response(413, {"error": f"body larger than {self.max_body_bytes} bytes"})
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    raise _Closed
        if scope.cancelled_caught:
            return self._timed_out(conn, head, head_limit_s)
        assert head is not None
        return _request(head, bytes(body), client, certificate, proven_before, owner.peer_uid)

    def _on_head(
        self, event: h11.Request, owner: _Conn, client: str, certificate: dict[str, Any] | None, scope: anyio.CancelScope,
        started: float | None,
    ) -> Response | None:
        """A request's head: valid credentials prove the connection; the rest of the request is due
        within ``read_timeout_s`` of its first byte. A body announced too large: the 413 answer."""
        if not owner.proven and self.authenticate is not None and self.authenticate(
            _request(event, b"", client, certificate, False, None)
        ):
            self._prove(owner)
        # the rest of the request: within read_timeout_s of its first byte
        scope.deadline = (started if started is not None else anyio.current_time()) + self.read_timeout_s
        length = _content_length(event.headers)
        if length is not None and length > self.max_body_bytes:
            return json_response(413, {"error": f"body larger than {self.max_body_bytes} bytes"})
        return None

    def _timed_out(self, conn: h11.Connection, head: h11.Request | None, head_limit_s: float) -> Response:
        """The 408 answer to a request not read in time. Raises _Closed for an idle keep-alive connection."""
        if head is None and conn.their_state is h11.IDLE and not conn.trailing_data[0]:
            raise _Closed  # an idle keep-alive connection: close it quietly
        limit_s = head_limit_s if head is None else self.read_timeout_s
        return json_response(408, {"error": f"request not received within {limit_s:g} s"})

    async def _receive_more(
        self, conn: h11.Connection, stream: ByteStream, scope: anyio.CancelScope, started: float | None, *,
        head: h11.Request | None,
    ) -> tuple[float | None, Response | None]:
        """Feed h11 the next bytes of the request; the time of its first byte (once a request
        began it must arrive whole within ``read_timeout_s``: ``scope``'s deadline) and the
        answer to bytes that are no HTTP (``None``: go on).

        Raises:
            _Closed: the client closed a keep-alive connection between requests.
        """
        try:
            data = await stream.receive(RECEIVE_BYTES)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, ssl.SSLError):
            data = b""
        if not data and head is None and conn.their_state is h11.IDLE:
            raise _Closed
        if started is None and data:
            started = anyio.current_time()
            scope.deadline = min(scope.deadline, started + self.read_timeout_s)
        try:
            conn.receive_data(data)
        except h11.RemoteProtocolError as exc:
            return started, json_response(400, {"error": f"bad request: {exc}"})
        return started, None

    async def _send(self, conn: h11.Connection, stream: ByteStream, response: Response, *, close: bool) -> bool:
        headers = [
            ("content-type", response.content_type),
            ("content-length", str(len(response.body))),
            ("cache-control", "no-store"),
            ("server", self._server_header.decode()),
            *response.headers,
        ]
        if close:
            headers.append(("connection", "close"))
        try:
            data = conn.send(h11.Response(status_code=response.status, headers=headers))
            data += conn.send(h11.Data(data=response.body)) or b""
            data += conn.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError:
            return False
        try:
            with anyio.fail_after(self.read_timeout_s):
                await stream.send(data)
        except (TimeoutError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, ssl.SSLError):
            return False
        return True


def _request(head: h11.Request, body: bytes, client: str, certificate: dict[str, Any] | None, proven: bool,
             peer_uid: int | None) -> Request:
    target = head.target.decode("ascii", "replace")
    path, _, query = target.partition("?")
    headers = {name.decode("ascii", "replace").lower(): value.decode("latin-1") for name, value in head.headers}
    return Request(head.method.decode("ascii", "replace"), path, query, headers, body, client, certificate, proven, peer_uid)


async def _unix_listener(path: str) -> tuple[Any, int]:
    """A listening unix socket at ``path``, mode 0600, and its inode. A socket already there is
    replaced only when it is a socket owned by this uid that nobody listens on (a dead agent's).

    Raises:
        OSError: ``path`` is something else, or a live listener holds it, or it is too long.
    """
    sock, inode = await anyio.to_thread.run_sync(_bind_unix, path)
    try:
        return await SocketListener.from_socket(sock), inode
    except BaseException:
        sock.close()
        raise


def _bind_unix(path: str) -> tuple[socket.socket, int]:
    _clear_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), 0o600)  # the mode the socket file is created with (no window)
        sock.bind(path)
        os.chmod(path, 0o600, follow_symlinks=False)
        sock.listen(128)
        sock.setblocking(False)
        return sock, os.stat(path, follow_symlinks=False).st_ino
    except BaseException:
        sock.close()
        raise


def _clear_stale(path: str) -> None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(errno.EEXIST, f"{path} exists and is not this agent's socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a dead agent's
            return
    raise OSError(errno.EADDRINUSE, f"another agent serves {path}")


async def _unlink_if(path: str, inode: int) -> None:
    """Remove our socket at ``path`` (only while it is still ours: the same inode)."""

    def unlink() -> None:
        try:
            if os.stat(path, follow_symlinks=False).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass

    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(unlink)


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
