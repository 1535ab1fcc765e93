"""Settings of the agent HTTP API and of the job's peers; reading the API token safely.

Owns :class:`ApiConfig`, :class:`FleetConfig`, :func:`check_fleet_settings` (the cross-checks run
when settings load), :func:`read_token_file` (a bearer token only from a private file) and
:func:`server_ssl_context` / :func:`client_ssl_context` (TLS and mutual TLS). Imports pydantic and
the standard library only, so :mod:`agent.runtime.settings` can import it.
"""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, Field

from agent.errors import TokenFileError

__all__ = [
    "DEFAULT_API_PORT",
    "ApiConfig",
    "FleetConfig",
    "TokenFileError",
    "check_fleet_settings",
    "client_ssl_context",
    "parse_listen",
    "read_token_file",
    "server_ssl_context",
]

#: Default port of the agent API (peers of a job all use the same one).
DEFAULT_API_PORT = 7207
#: Largest token file read, bytes.
MAX_TOKEN_BYTES = 4096


class ApiConfig(BaseModel):
    """The agent's HTTP API (``/v1/status``, ``/v1/incidents``). Off by default.

    Every request must authenticate: a bearer token read from ``token_file`` (mode 0600 or
    stricter, owned by the agent's user) and/or mutual TLS (``tls_client_ca_file``). With both
    set, both are required. The API refuses to start with neither.
    """

    enabled: bool = Field(False, description="serve the API")
    host: str = Field("127.0.0.1", description="bind address (0.0.0.0 / :: to reach it from peers)")
    port: int = Field(DEFAULT_API_PORT, ge=0, le=65535, description="bind port; 0 picks a free one")
    token_file: Path | None = Field(None, description="bearer token file, mode 0600; peers of a job share it")
    tls_cert_file: Path | None = Field(None, description="server certificate (PEM): serve HTTPS; also the client certificate towards peers")
    tls_key_file: Path | None = Field(None, description="private key of tls_cert_file (PEM)")
    tls_client_ca_file: Path | None = Field(
        None, description="CA (PEM) that signs clients' certificates: mutual TLS; also verifies peers' servers"
    )
    rate_per_s: float = Field(5.0, gt=0, description="sustained requests per second allowed per client address")
    rate_burst: int = Field(20, ge=1, description="requests a client may send at once before rate limiting")
    max_body_bytes: int = Field(64 * 1024, ge=1024, description="largest request body, bytes")
    read_timeout_s: float = Field(10.0, gt=0, description="a request must arrive whole within this, seconds")
    max_connections: int = Field(128, ge=2, description="open connections at most")
    max_connections_per_client: int = Field(16, ge=1, description="open connections from one client address at most")
    reserved_for_authenticated: int = Field(
        32, ge=1, description="connection slots only clients that authenticated may hold (less than max_connections)"
    )
    header_timeout_s: float = Field(
        5.0, gt=0, description="a TLS handshake, and each request head of a client not yet authenticated, must arrive within this, seconds"
    )
    idle_timeout_s: float = Field(30.0, gt=0, description="an authenticated keep-alive connection may idle this long, seconds")
    guess_rate_per_s: float = Field(
        1.0, gt=0, description="failed authentications per second allowed, all client addresses together (token guessing)"
    )
    guess_burst: int = Field(30, ge=1, description="failed authentications allowed at once, all client addresses together")
    # `default=[]`, not `default_factory=list` (see agent.host.config.TargetConfig.pids)
    names: list[str] = Field(
        default=[], max_length=64,
        description="other names or addresses peers reach this agent by (a DNS name, a NAT address): a peer's signed"
                    " request must be made for one of this agent's own addresses or names (its interfaces', its host"
                    " name, these)",
    )
    unix_socket: str = Field(
        "auto", max_length=107,
        description="the operator's unix socket (no TCP flood reaches it; callers admitted by uid, SO_PEERCRED):"
                    " 'auto' = <data_dir>/<host name>.api.sock, '' = none, or a path",
    )
    unix_socket_uids: list[int] = Field(
        default=[], max_length=64, description="uids admitted on the unix socket besides root and the agent's own"
    )

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def mutual_tls(self) -> bool:
        return self.tls_client_ca_file is not None


class FleetConfig(BaseModel):
    """A job: the agents of one multi-node server, which capture together, in one trace.

    Every host derives the incident's trace from facts that cost nothing at detection (the job
    and the detection time bucket: :mod:`agent.fleet.identity`), reports its detection to the
    job's coordinator (the host of global rank 0, else the lowest live host), which asks the
    hosts that did not detect to capture (``POST /v1/incidents`` with a W3C ``traceparent``),
    collects every host's evidence summary and makes the job's verdict (:mod:`agent.fleet.job` runs
    it; its parts: :mod:`agent.fleet.member`, :mod:`agent.fleet.coordinator`,
    :mod:`agent.fleet.intake`).
    """

    job: str | None = Field(None, min_length=1, max_length=128, description="job name; peers refuse joins for another job")
    peers: list[str] = Field(
        default=[], description="peer agents: host:port or http(s)://host:port (this agent is skipped)"
    )
    peers_dns: str | None = Field(
        None, description="name[:port] resolving to every peer (a Kubernetes headless service); resolved at each incident"
    )
    peer_timeout_s: float = Field(2.0, gt=0, description="bound on asking one peer, seconds (never delays local capture)")
    dedup_window_s: float = Field(
        60.0, gt=0, description="detections of the job within this many seconds of a job incident join it, seconds"
    )
    accept_timeout_s: float = Field(
        1.0, gt=0, description="a peer answers a join once its incident opened, or after this many seconds"
    )
    allow_insecure_peers: bool = Field(
        False, description="talk to peers over plain HTTP although a token is set (requests stay signed, never carry the token)"
    )
    time_bucket_s: float = Field(
        10.0, gt=0, description="detections of the job in the same bucket of this many seconds share a trace"
    )
    report_grace_s: float = Field(
        0.05, ge=0, description="the coordinator asks the hosts that did not report once no report came for this long, seconds"
    )
    first_report_wait_s: float = Field(
        0.2, ge=0, description="a coordinator that detected the hang itself waits this long for the others' first report, seconds"
    )
    report_window_s: float = Field(
        0.5, ge=0, description="the coordinator waits for reports at most this long while they keep coming, seconds"
    )
    fanout_concurrency: int = Field(32, ge=1, le=1024, description="peers the coordinator asks at once")
    tree_threshold: int = Field(
        64, ge=2, description="above this many peers to ask, the coordinator asks relays that each ask a share of them"
    )
    announce_interval_s: float = Field(
        30.0, gt=0, description="the host of global rank 0 presents itself to every peer this often, seconds"
    )
    trace_detail_max_hosts: int = Field(
        64, ge=1, description="in a larger job each host's action spans go to a trace of its own, linked from its incident span"
    )
    evidence_timeout_s: float = Field(
        60.0, gt=0, description="the coordinator waits this long for every host's evidence before its job verdict, seconds"
    )


def check_fleet_settings(api: ApiConfig, fleet: FleetConfig) -> list[str]:
    """Problems with the API and job settings, each ``key: what to do`` (empty: fine)."""
    problems = _api_auth_problems(api)
    if (fleet.peers or fleet.peers_dns) and not fleet.job:
        problems.append("fleet.job: peers need a job name (--job)")
    problems += _peer_address_problems(fleet)
    problems += _insecure_peers(api, fleet)
    if fleet.job and not api.enabled:
        problems.append("api.enabled: a job's agents reach each other through the API (--api-listen)")
    if api.enabled:
        problems += _api_file_problems(api)
    return problems


def _api_auth_problems(api: ApiConfig) -> list[str]:
    """How the API authenticates: a token file or mutual TLS, and TLS settings that go together."""
    problems: list[str] = []
    if api.enabled and api.token_file is None and not api.mutual_tls:
        problems.append("api.token_file: the API needs a bearer token file (mode 0600) or mutual TLS (api.tls_client_ca_file)")
    if (api.tls_cert_file is None) != (api.tls_key_file is None):
        problems.append("api.tls_key_file: give both api.tls_cert_file and api.tls_key_file")
    if api.mutual_tls and not api.tls:
        problems.append("api.tls_client_ca_file: mutual TLS needs api.tls_cert_file and api.tls_key_file")
    return problems


def _api_file_problems(api: ApiConfig) -> list[str]:
    """An enabled API's token file (read as it will be) and TLS files (they exist)."""
    problems: list[str] = []
    if api.token_file is not None:
        try:
            read_token_file(api.token_file)
        except TokenFileError as exc:
            problems.append(f"api.token_file: {exc}")
    for key, path in (("api.tls_cert_file", api.tls_cert_file), ("api.tls_key_file", api.tls_key_file),
                      ("api.tls_client_ca_file", api.tls_client_ca_file)):
        if path is not None and not Path(path).is_file():
            problems.append(f"{key}: no such file {str(path)!r}")
    return problems


def _peer_address_problems(fleet: FleetConfig) -> list[str]:
    """One problem per peer that is no ``host[:port]`` / ``http(s)://host[:port]`` (the forms
    :func:`agent.fleet.peers.parse_peer` takes; the port 1-65535), and for a ``peers_dns`` that is
    no ``name[:port]``: said at load, never a traceback at the first incident."""
    problems = [f"fleet.peers: {spec!r} is not HOST:PORT or http(s)://HOST:PORT" for spec in fleet.peers if not _peer_ok(spec)]
    if fleet.peers_dns is not None and not _peers_dns_ok(fleet.peers_dns):
        problems.append(f"fleet.peers_dns: {fleet.peers_dns!r} is not NAME[:PORT]")
    return problems


def _peer_ok(spec: str) -> bool:
    """Whether ``spec`` is ``host[:port]`` or ``http(s)://host[:port]`` (the port 1-65535)."""
    raw = spec.strip()
    parts = urlsplit(raw if "://" in raw else f"http://{raw}")
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:  # not a number, or out of range
        port_ok = False
    return bool(raw) and parts.scheme in ("http", "https") and bool(parts.hostname) and parts.path in ("", "/") and port_ok


def _peers_dns_ok(value: str) -> bool:
    """Whether ``value`` is ``name[:port]`` (the port 1-65535)."""
    name, sep, port = value.rpartition(":") if ":" in value else (value, "", "")
    return bool(name) and ":" not in name and not (sep and not (port.isdigit() and 0 < int(port) < 65536))


def _insecure_peers(api: ApiConfig, fleet: FleetConfig) -> list[str]:
    """A token set and a peer reached over plain HTTP: it would receive the token in clear."""
    if api.token_file is None or fleet.allow_insecure_peers or not (fleet.peers or fleet.peers_dns):
        return []
    plain = [p for p in fleet.peers if p.strip().lower().startswith("http://")]
    if not api.tls:
        plain = plain or fleet.peers or [fleet.peers_dns or ""]
    if not plain:
        return []
    why = (f"fleet.allow_insecure_peers: peer {plain[0]!r} is reached over plain HTTP (job data in clear, answers"
           " spoofable by whoever holds its address); serve the API over TLS (api.tls_cert_file, api.tls_key_file)"
           " or pass --allow-insecure-peers")
    return [why]


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as ``(host, port)``.

    Raises:
        ValueError: not of that shape, or a port outside 0-65535.
    """
    raw = value.strip()
    host, sep, port_text = raw.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port {port} is out of range")
    return host, port


def read_token_file(path: Path) -> bytes:
    """Read a bearer token, refusing a file others could read or swap.

    The file must be a regular file (not a symlink: opened with ``O_NOFOLLOW``), owned by this
    process's user, with no group or other permission bits (0600 or 0400), non-empty.

    Returns:
        The token, surrounding whitespace stripped.

    Raises:
        TokenFileError: with the reason and the fix.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise TokenFileError(f"no such file {str(path)!r}") from None
    except OSError as exc:
        why = "is a symlink (refused)" if exc.errno == 40 else (exc.strerror or str(exc))
        raise TokenFileError(f"cannot open {str(path)!r}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"{str(path)!r} is not a regular file")
        if st.st_uid != os.geteuid():
            raise TokenFileError(f"{str(path)!r} is owned by uid {st.st_uid}, not by this agent's user (uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise TokenFileError(f"{str(path)!r} has mode {stat.S_IMODE(st.st_mode):04o} (run: chmod 600 {path})")
        data = os.read(fd, MAX_TOKEN_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_BYTES:
        raise TokenFileError(f"{str(path)!r} is larger than {MAX_TOKEN_BYTES} bytes")
    token = data.strip()
    if not token:
        raise TokenFileError(f"{str(path)!r} is empty")
    if any(c < 0x21 or c > 0x7E for c in token):
        raise TokenFileError(f"{str(path)!r}: the token must be printable ASCII without spaces")
    return token


def server_ssl_context(api: ApiConfig) -> ssl.SSLContext | None:
    """The API's TLS context (``None``: plain HTTP). Mutual TLS requires a client certificate."""
    if not api.tls:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(api.tls_cert_file), str(api.tls_key_file))
    if api.tls_client_ca_file is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(api.tls_client_ca_file))
    return ctx


def client_ssl_context(api: ApiConfig) -> ssl.SSLContext | None:
    """TLS context for calling peers: present our certificate and verify theirs.

    With a job CA (``tls_client_ca_file``) a peer's server certificate must chain to that CA; its
    host name is not checked, since peers are reached by the addresses a headless service
    resolves to and membership of the job is what the CA vouches for. Without one, the system
    CAs and the usual host-name check apply.
    """
    if not api.tls:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(api.tls_client_ca_file) if api.tls_client_ca_file else None)
    if api.tls_client_ca_file is not None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(api.tls_cert_file), str(api.tls_key_file))
    return ctx
