"""Requests a local HTTP server has accepted and not answered yet, read from the kernel's TCP
state of the connections to its port (Linux ``sock_diag`` netlink, ``tcp_info``).

Owns: :class:`OpenRequests` and :func:`open_requests_on`. May import the standard library and
psutil only.

Why: vLLM and SGLang publish their running/waiting gauges only after an engine step, so a forward
that hangs in the first step after an idle spell leaves them at 0 (measured on vLLM 0.32: running,
waiting, every counter and ``vllm:kv_cache_usage_perc`` unchanged for as long as the forward
hangs; ``/health`` stays 200 and fast). The connections to the server's port do say it: the
kernel keeps, per TCP socket, the bytes received and sent and the time since the last data each
way. A server-side connection is an **open request** when

- it received data and sent none, or received data more recently than it last sent (a request
  read and not answered: a non-streaming completion), or
- it has been quiet both ways for at least ``quiet_s`` and is still open: uvicorn (vLLM's and
  SGLang's HTTP server) closes a keep-alive connection idle for 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``,
  ``--timeout-keep-alive``), so a connection held quiet longer is a response the server has not
  finished (a streaming completion whose headers went out before its first token).

An idle keep-alive connection (a Prometheus scraper, a load balancer's health check) last *sent*
its answer and goes away within the server's keep-alive: never an open request. The agent's own
connections (its scrapes of ``/metrics`` and ``/health``) are left out.

:class:`OpenRequestsReader` reads one port again and again (the Prometheus source's idle polls)
without asking the kernel for its connection table while nothing can have changed.

Reads only the agent's own network namespace (the server must listen on a local address of it);
any failure (no netlink, another OS) reads as ``None``: "not known", never "no request".
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["QUIET_S", "OpenRequests", "OpenRequestsReader", "local_port_of", "open_requests_on"]

#: Seconds a connection may stay quiet both ways and open before it is an open request (above
#: uvicorn's default keep-alive of 5 s).
QUIET_S = 10.0

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_INET_DIAG_INFO = 2
_TCP_ESTABLISHED = 1
_TCP_LISTEN = 10
_NLMSG_HDR = struct.Struct("=IHHII")
_REQ_V2 = struct.Struct("=BBBxI")  # family, protocol, ext, pad, states; then the 48-byte sockid
_MSG_HEAD = struct.Struct("=BBBB")  # family, state, timer, retrans
# a dump's filter (linux/inet_diag.h): an INET_DIAG_REQ_BYTECODE attribute after the request,
# ops of ``struct inet_diag_bc_op`` (code, yes, no: bytes to jump on each outcome; landing on the
# end accepts, 4 bytes past it rejects; the kernel's audit follows the ``yes`` jumps through
# every op, so an "or" goes through a JMP, which always takes ``no``, as ss(8) compiles it); a
# port comparison's port is the next op's ``no``
_INET_DIAG_REQ_BYTECODE = 1
_BC_JMP, _BC_S_EQ, _BC_D_EQ = 1, 11, 12
_BC_OP = struct.Struct("=BBH")


def _port_filter(port: int) -> bytes:
    """The attribute that keeps a dump to ``port``'s sockets: local port or peer port equal to it
    (the kernel then copies only those: a busy host's other connections cost no parsing here)."""
    ops = (_BC_OP.pack(_BC_S_EQ, 8, 12) + _BC_OP.pack(0, 0, port)  # sport == port: to the JMP; else to dport
           + _BC_OP.pack(_BC_JMP, 4, 12)  # to the end: accept
           + _BC_OP.pack(_BC_D_EQ, 8, 12) + _BC_OP.pack(0, 0, port))  # dport == port: accept; else past the end: reject
    return _RTA.pack(_RTA.size + len(ops), _INET_DIAG_REQ_BYTECODE) + ops
_MSG_LEN = 72  # inet_diag_msg: 4 + sockid 48 + expires, rqueue, wqueue, uid, inode
_RTA = struct.Struct("=HH")
# struct tcp_info offsets (linux/tcp.h)
_LAST_DATA_SENT, _LAST_DATA_RECV = 44, 52
_BYTES_ACKED, _BYTES_RECEIVED, _BYTES_SENT = 120, 128, 200


@dataclass(frozen=True, slots=True)
class OpenRequests:
    """Connections to a server's port, as the kernel sees them.

    Attributes:
        open: connections holding a request not yet answered (see the module's rules).
        connections: established connections to the port, the agent's own left out.
        open_since_ns: when the oldest of them became an open request (``CLOCK_MONOTONIC`` ns:
            the kernel's time since its last data received, or since it turned quiet for
            ``quiet_s``); ``None`` when none is. Not compared.
    """

    open: int
    connections: int
    open_since_ns: int | None = field(default=None, compare=False)


def local_port_of(url: str) -> int | None:
    """The port of ``url`` when its host is an address of this machine (loopback, ``localhost``,
    one of its interfaces' addresses), else ``None`` (a remote server's connections are not ours
    to read)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None
    if host == "localhost":
        return port
    addr: ipaddress.IPv4Address | ipaddress.IPv6Address
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        if host != socket.gethostname():
            return None
        try:
            addr = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return None
    if addr.is_loopback or addr.is_unspecified:
        return port
    try:
        import psutil

        local = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    except Exception:  # noqa: BLE001 - no interface list: not known to be local
        return None
    return port if str(addr) in local else None


def _own_socket_inodes() -> set[int]:
    inodes: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _dump(family: int, state: int = _TCP_ESTABLISHED, port: int | None = None) -> list[tuple[int, int, int, bytes]]:
    """TCP sockets of ``family`` in ``state``: ``(local port, peer port, inode, tcp_info)``
    (``tcp_info`` only for established ones); with ``port``, only those whose local or peer port
    it is (filtered by the kernel).

    The kernel walks its whole established-socket hash table for a dump of established sockets
    (about 1 ms of CPU per family on a small VM, whatever the number of sockets); a dump of
    listening sockets walks only the listening table (tens of microseconds). Unfiltered, every
    other connection of the host is copied and parsed too (on a busy host, most of the cost)."""
    ext = 1 << (_INET_DIAG_INFO - 1) if state == _TCP_ESTABLISHED else 0
    req = _REQ_V2.pack(family, socket.IPPROTO_TCP, ext, 1 << state) + bytes(48)
    if port is not None:
        req += _port_filter(port)
    msg = _NLMSG_HDR.pack(_NLMSG_HDR.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + req
    found: list[tuple[int, int, int, bytes]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(2.0)
        nl.sendto(msg, (0, 0))
        while True:
            data = nl.recv(1 << 16)
            offset = 0
            while offset + _NLMSG_HDR.size <= len(data):
                length, kind, _, _, _ = _NLMSG_HDR.unpack_from(data, offset)
                if length < _NLMSG_HDR.size:
                    return found
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR:
                    raise OSError("sock_diag answered an error")
                body = data[offset + _NLMSG_HDR.size : offset + length]
                if len(body) >= _MSG_LEN:
                    sport, dport = struct.unpack_from("!HH", body, 4)
                    inode = struct.unpack_from("=I", body, 68)[0]
                    info = b""
                    at = _MSG_LEN
                    while at + _RTA.size <= len(body):
                        rta_len, rta_type = _RTA.unpack_from(body, at)
                        if rta_len < _RTA.size:
                            break
                        if rta_type == _INET_DIAG_INFO:
                            info = body[at + _RTA.size : at + rta_len]
                        at += (rta_len + 3) & ~3
                    found.append((sport, dport, inode, info))
                offset += (length + 3) & ~3


def _u32(info: bytes, at: int) -> int | None:
    return struct.unpack_from("=I", info, at)[0] if len(info) >= at + 4 else None


def _u64(info: bytes, at: int) -> int | None:
    return struct.unpack_from("=Q", info, at)[0] if len(info) >= at + 8 else None


def open_for_ms(info: bytes, quiet_s: float = QUIET_S) -> float | None:
    """How long (ms) a server-side connection's ``tcp_info`` says it has held a request not yet
    answered: since its last data received (a request read and not answered), or since it
    turned quiet both ways for ``quiet_s``; ``None`` when it holds none."""
    last_sent, last_recv = _u32(info, _LAST_DATA_SENT), _u32(info, _LAST_DATA_RECV)
    received = _u64(info, _BYTES_RECEIVED)
    sent = _u64(info, _BYTES_SENT)
    if sent is None:
        sent = _u64(info, _BYTES_ACKED)
    if last_sent is None or last_recv is None or received is None or sent is None:
        return None
    if received > 0 and (sent == 0 or last_recv < last_sent):
        return float(last_recv)  # read a request, not answered (ms since the last data each way)
    quiet_ms = min(last_sent, last_recv)
    return quiet_ms - quiet_s * 1000 if quiet_ms >= quiet_s * 1000 else None


def is_open_request(info: bytes, quiet_s: float = QUIET_S) -> bool:
    """Whether a server-side connection's ``tcp_info`` says it holds a request not yet answered."""
    return open_for_ms(info, quiet_s) is not None


def _port_sockets(port: int) -> list[tuple[int, int, int, bytes]]:
    """The established TCP sockets of the address families that may hold ``port``'s connections."""
    # only the families with a socket listening on the port hold its connections (a server
    # on 0.0.0.0 or 127.0.0.1 has no IPv6 ones; one on [::] takes IPv4 clients as IPv6
    # sockets); both when none listens (a server going down may still hold connections)
    families = [f for f in (socket.AF_INET, socket.AF_INET6) if any(sport == port for sport, *_ in _dump(f, _TCP_LISTEN, port))]
    return [s for f in families or (socket.AF_INET, socket.AF_INET6) for s in _dump(f, port=port)]


def _server_side(sockets: list[tuple[int, int, int, bytes]], port: int) -> list[bytes]:
    """The ``tcp_info`` of the server side of ``port``'s connections, the agent's own left out."""
    own = _own_socket_inodes()
    own_ports = {sport for sport, dport, inode, _ in sockets if dport == port and inode in own}
    return [info for sport, dport, _, info in sockets if sport == port and dport not in own_ports]


def open_requests_on(port: int, *, quiet_s: float = QUIET_S) -> OpenRequests | None:
    """The open requests on local TCP ``port`` (the server side of its established connections),
    the agent's own connections left out; ``None`` when the kernel cannot be asked (not Linux, no
    ``sock_diag``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        sockets = _port_sockets(port)
    except (OSError, struct.error):
        return None
    now_ns = time.monotonic_ns()
    server_side = _server_side(sockets, port)
    ages = [ms for ms in (open_for_ms(info, quiet_s) for info in server_side) if ms is not None]
    return OpenRequests(open=len(ages), connections=len(server_side),
                        open_since_ns=now_ns - int(max(ages) * 1e6) if ages else None)


def _passive_opens() -> int | None:
    """TCP connections this network namespace has accepted so far (``PassiveOpens`` of
    ``/proc/net/snmp``: IPv4 and IPv6 share the TCP counters), ``None`` when unreadable."""
    try:
        with open("/proc/net/snmp", encoding="ascii") as fh:
            tcp = [line.split() for line in fh if line.startswith("Tcp:")]
        return int(tcp[1][tcp[0].index("PassiveOpens")])
    except (OSError, ValueError, IndexError):
        return None


#: Longest time an :class:`OpenRequestsReader` answers from its last reading, seconds.
REUSE_MAX_S = 5.0


class OpenRequestsReader:
    """:func:`open_requests_on` for one ``port``, read at every idle poll, without asking the
    kernel to walk its whole connection table (about 1 ms of CPU per address family, however
    few sockets there are) when the answer is known:

    * the last reading found no connection to the port (the agent's own left out) and the host
      has accepted no TCP connection since (``PassiveOpens``, read before each full reading): no
      request can be open; at most :data:`REUSE_MAX_S`;
    * the last reading found no open request and is younger than ``idle_reuse_s``: a request
      opened since is found at the next full reading, and its ``open_since_ns`` is when it was
      received (the kernel's clock), so a stall clock started from it loses nothing.

    A reading that found an open request is never reused. Blocking (``/proc`` and netlink): call
    it off the event loop; one caller at a time.
    """

    def __init__(self, port: int, *, quiet_s: float = QUIET_S, idle_reuse_s: float = 0.0) -> None:
        self.port = port
        self.quiet_s = quiet_s
        self.idle_reuse_s = idle_reuse_s
        #: full readings taken, and readings answered from the last one
        self.full_reads = 0
        self.reused = 0
        self._last: OpenRequests | None = None
        self._opens: int | None = None
        self._at = 0.0

    def recent(self) -> OpenRequests | None:
        """The last reading when it stands without asking anything (no open request in it, and
        younger than ``idle_reuse_s``), else ``None``. Does not block: the event loop asks this
        first, and hops to a worker thread for :meth:`read` only when it says ``None``."""
        last = self._last
        if last is not None and last.open == 0 and time.monotonic() - self._at < self.idle_reuse_s:
            self.reused += 1
            return last
        return None

    def read(self) -> OpenRequests | None:
        """The open requests on the port now (``None``: not known); see the class."""
        recent = self.recent()
        if recent is not None:
            return recent
        opens = _passive_opens()
        now = time.monotonic()
        last = self._last
        if (last is not None and last.open == 0 and last.connections == 0 and opens is not None and opens == self._opens
                and now - self._at < REUSE_MAX_S):
            self.reused += 1
            return last
        found = open_requests_on(self.port, quiet_s=self.quiet_s)
        self.full_reads += 1
        self._last, self._opens, self._at = found, opens, now
        return found
