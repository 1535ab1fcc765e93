"""The agent's HTTP API: routes, authentication, rate limiting.

Owns :class:`AgentApi` (a :class:`~agent.fleet.http.HttpServer` handler) and the
:class:`ApiBackend` protocol it serves from. Routes (JSON in, JSON out):

* ``GET /v1/status``: watchers, targets, the open incident, the job's peers;
* ``GET /v1/incidents``: this host's incidents, newest first (summaries);
* ``GET /v1/incidents/{id}``: one incident's ``manifest.json``;
* ``POST /v1/incidents``: open a manual incident, or join a trace begun elsewhere: body
  ``{"incident_id", "job", "origin_host", "origin_time_unix_nano", "detail", "coordinator",
  "relay"}`` (all optional) with a W3C ``traceparent`` header (or a ``"traceparent"`` body
  field) naming the trace and the span to hang under; ``coordinator``: where the job's
  coordinator takes this host's evidence; ``relay``: peers this agent asks in turn (a
  tree-shaped fan-out). Answers 202 with this agent's incident once it opened (capture started); every
  answer to a join names the trace (``trace_id``).
* ``POST /v1/job/announce``, ``/v1/job/report``, ``/v1/job/evidence``, ``/v1/job/moved``: the
  job's coordination (:mod:`agent.fleet.messages`): the coordinator presents itself, a host
  reports a detection to it, a host sends it its evidence summary, a provisional coordinator that
  backed down tells the hosts whose evidence it took where the coordinator is.

Order of checks on every request: rate limit (429, before authentication, so guessing tokens is
slow too), then authentication (401 without a valid bearer token, or a peer's signature made with
it (:mod:`agent.fleet.proof`: fresh, not replayed, over this very body, made for *this* agent:
its ``Host`` one of this agent's own addresses or names (:attr:`AgentApi.own_host`) at its port;
one made for another agent is refused with that reason; its nonce, kept in the data dir, never
seen before, even by this agent before a restart; the port it names one the job's member list
gives the sender's address (:attr:`AgentApi.check_sender`)), when a token is configured; under mutual
TLS a client without a certificate never completes the handshake), then routing. A caller on the
operator's unix socket (:class:`agent.fleet.http.HttpServer`'s ``unix_path``), admitted by its
kernel-proven uid (``SO_PEERCRED``), is authenticated by that uid and never rate limited: no
TCP flood reaches that path.
An authenticated request that carries a nonce (:data:`agent.fleet.proof.NONCE_HEADER`) gets
the proof of its answer (:data:`agent.fleet.proof.PROOF_HEADER`): the caller knows the answer
comes from a holder of the job's token.

Token guesses are limited twice: per client address (the request rate limit), and for all
clients together (``guess_rate_per_s``/``guess_burst``: failed authentications), since any
local user can send from every address of 127/8. While the shared bucket is empty, every request
on a connection that has not shown valid credentials before is answered 429 *before* its token
is compared (a right guess must look like a wrong one); connections that already authenticated
(keep-alive) go on being served.

Imports anyio, :mod:`agent.fleet.http`, :mod:`agent.fleet.traceparent`, :mod:`agent.fleet.proof`,
:mod:`agent.fleet.messages` and the standard library.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from agent.fleet.http import Request, Response, json_response
from agent.fleet.messages import Announce, Evidence, Moved, Report, ValidationError, first_error
from agent.fleet.proof import (
    MAX_SKEW_S,
    NONCE_HEADER,
    PROOF_HEADER,
    NonceCache,
    RequestSignature,
    answer_proof,
    authority_host,
    misdirected,
    skew_refusal,
)
from agent.fleet.traceparent import TraceParent, TraceParentError

__all__ = ["INCIDENT_ID_PATTERN", "AgentApi", "ApiBackend", "JoinRequest", "RateLimiter", "Sender"]

log = logging.getLogger("servewatch.fleet.api")

#: What an incident id may look like in a URL (also rules out path tricks).
INCIDENT_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: Client addresses whose buckets are remembered (least recently seen forgotten first).
MAX_CLIENTS = 4096
#: Most peers one join may ask this agent to relay to.
MAX_RELAY = 4096
#: The job routes and the message model of each body.
#: Numbers in a refusal's text (:meth:`AgentApi._log_refusal` keys a reason on its words).
_DIGITS = re.compile(r"\d+")
JOB_ROUTES: dict[str, type[Announce | Report | Evidence | Moved]] = {
    "/v1/job/announce": Announce, "/v1/job/report": Report, "/v1/job/evidence": Evidence, "/v1/job/moved": Moved,
}


#: The answer to a request without valid credentials.
UNAUTHORIZED = "unauthorized: send 'Authorization: Bearer <token>'"
#: An inbound refusal is logged at most once per this many seconds per address and reason.
REFUSAL_LOG_INTERVAL_S = 60.0
#: Addresses and reasons whose last logged refusal is remembered (then forgotten all at once).
MAX_REFUSAL_KEYS = 1024


@dataclass(frozen=True, slots=True)
class Sender:
    """Who sent a request, as far as it is proven.

    Attributes:
        address: the IP address the request came from (TCP proves it), or ``unix:uid=N``.
        port: the sender's API port as its signature names it (:mod:`agent.fleet.proof`);
            ``None``: an operator's request (bearer token), or a ``v1`` signature.
        clock_offset_s: the sender's clock offset, seconds (see the field).
    """

    address: str
    port: int | None = None
    #: the sender's clock minus this host's as its signature's time says, seconds (whole-second
    #: signature times and the transit: about 1 s of error); ``None`` unsigned. Not part of the
    #: identity (equality and hashing leave it out).
    clock_offset_s: float | None = field(default=None, compare=False)

    @property
    def identity(self) -> str:
        """``address:port`` (``address`` alone without a port): what a job binds a host name to."""
        if self.port is None:
            return self.address
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    @classmethod
    def of(cls, request: Request) -> Sender:
        signature = RequestSignature.parse(request.headers.get("authorization", ""))
        if signature is None:
            return cls(request.client, None)
        return cls(request.client, signature.port, round(signature.skew_s(), 1))


class JoinRequest(dict[str, Any]):
    """Body of ``POST /v1/incidents`` after validation, plus ``traceparent`` (a :class:`TraceParent` or None)."""


class ApiBackend(Protocol):
    """What the API serves from (the agent's fleet coordinator)."""

    async def status(self) -> dict[str, Any]: ...
    async def list_incidents(self) -> list[dict[str, Any]]: ...
    async def get_incident(self, incident_id: str) -> dict[str, Any] | None: ...
    async def post_incident(self, request: JoinRequest, *, agent_id: str, sender: Sender) -> tuple[int, dict[str, Any]]: ...
    async def job_message(self, message: Announce | Report | Evidence | Moved, *, client: str, sender: Sender) -> tuple[int, dict[str, Any]]: ...


class RateLimiter:
    """Token bucket per client address: ``burst`` at once, ``rate_per_s`` sustained."""

    def __init__(self, rate_per_s: float, burst: int, clock=time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        #: requests refused so far
        self.limited = 0

    def allow(self, client: str) -> float:
        """Take one token for ``client``. Returns 0 when allowed, else seconds until the next token."""
        now = self._clock()
        tokens, last = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate_per_s)
        if tokens >= 1.0:
            self._buckets[client] = (tokens - 1.0, now)
            wait = 0.0
        else:
            self._buckets[client] = (tokens, now)
            self.limited += 1
            wait = (1.0 - tokens) / self.rate_per_s
        while len(self._buckets) > MAX_CLIENTS:
            self._buckets.popitem(last=False)
        return wait

    def _tokens(self, client: str) -> float:
        tokens, last = self._buckets.get(client, (float(self.burst), self._clock()))
        return min(float(self.burst), tokens + (self._clock() - last) * self.rate_per_s)

    def empty(self, client: str) -> bool:
        """Whether ``client`` has no whole token now (nothing is taken)."""
        return self._tokens(client) < 1.0

    def wait_s(self, client: str) -> float:
        """Seconds until ``client`` has a whole token (0 when it has one)."""
        return max(0.0, (1.0 - self._tokens(client)) / self.rate_per_s)


def _join_request(request: Request) -> JoinRequest | str:
    """What a ``POST /v1/incidents`` asks for, validated; else why it is a bad request (400)."""
    doc = _json_object(request.body)
    if doc is None:
        return "body must be a JSON object"
    join = JoinRequest()
    problem = _join_fields(doc, join)
    if problem:
        return problem
    raw = request.headers.get("traceparent") or doc.get("traceparent")
    join["traceparent"] = None
    if raw is not None:
        if not isinstance(raw, str):
            return "traceparent must be a string"
        try:
            join["traceparent"] = TraceParent.parse(raw)
        except TraceParentError as exc:
            return str(exc)
    return join


def _json_object(body: bytes) -> dict[str, Any] | None:
    """A request body's JSON object (an empty body: ``{}``); ``None`` when it is none."""
    if not body.strip():
        return {}
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _join_fields(doc: dict[str, Any], join: JoinRequest) -> str:
    """Copy a join's fields from ``doc`` into ``join``; ``""``, else the first one's problem."""
    for key in ("incident_id", "job", "origin_host", "detail", "coordinator"):
        value = doc.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > 512):
            return f"{key} must be a string of at most 512 characters"
        join[key] = value
    origin_time = doc.get("origin_time_unix_nano")
    if origin_time is not None and (not isinstance(origin_time, int) or isinstance(origin_time, bool) or origin_time < 0):
        return "origin_time_unix_nano must be a non-negative integer"
    join["origin_time_unix_nano"] = origin_time
    relay = doc.get("relay") or []
    if not isinstance(relay, list) or len(relay) > MAX_RELAY or not all(isinstance(r, str) and len(r) <= 300 for r in relay):
        return f"relay must be a list of at most {MAX_RELAY} peer addresses"
    join["relay"] = relay
    return ""


def _error(status: int, message: str, headers: list[tuple[str, str]] | None = None) -> Response:
    return json_response(status, {"error": message}, headers)


class AgentApi:
    """Route, authenticate and rate-limit requests for ``backend``.

    Args:
        backend: serves the routes.
        token: the bearer token (``None``: no token check, only allowed under mutual TLS).
        mutual_tls: the server requires client certificates (checked again per request).
        rate_per_s / rate_burst: per-client rate limit.
        guess_rate_per_s / guess_burst: failed authentications allowed, all clients together.
    """

    def __init__(
        self,
        backend: ApiBackend,
        *,
        token: bytes | None,
        mutual_tls: bool = False,
        rate_per_s: float = 5.0,
        rate_burst: int = 20,
        guess_rate_per_s: float = 1.0,
        guess_burst: int = 30,
    ) -> None:
        if token is None and not mutual_tls:
            raise ValueError("the API needs a bearer token or mutual TLS")
        self.backend = backend
        self._token = token
        self.mutual_tls = mutual_tls
        self.limiter = RateLimiter(rate_per_s, rate_burst)
        #: failed authentications of all clients together (one bucket)
        self.guesses = RateLimiter(guess_rate_per_s, guess_burst)
        #: nonces of signed peer requests seen recently (replays refused; persisted when it has a path)
        self.nonces = NonceCache()
        self._nonce_error = ""
        #: why a signed request's sender may not sign as it did (its address and signed port:
        #: the job's member list names the ports of an address), ``""`` when it may; ``None``: any
        self.check_sender: Callable[[Sender], Awaitable[str]] | None = None
        #: the port this API is served on, once bound (a peer's signature names it)
        self.port: int | None = None
        #: whether a host (an address or a name, lower-case, no brackets) is this agent's own: a
        #: peer's signature must name one of them; ``None``: the port alone is checked
        self.own_host: Callable[[str], bool] | None = None
        #: how a refusal names this agent (``node-b at 10.0.0.2:7207``)
        self.own_label = ""
        #: requests refused for lack of valid credentials
        self.unauthorized = 0
        #: genuine signed requests refused because they were made for another agent
        self.misdirected = 0
        #: genuine signed requests refused because their time was out of the window (a skewed clock)
        self.skewed = 0
        #: when a refusal from an address was last logged (monotonic seconds), and how many since
        self._refusals_logged: dict[str, tuple[float, int]] = {}

    def authorized(self, request: Request) -> bool:
        """Whether ``request`` (its head suffices) carries valid credentials (:meth:`refusal`)."""
        return not self.refusal(request)

    def refusal(self, request: Request) -> str:
        """Why ``request`` (its head) is not authenticated, one line; ``""`` when it is: the bearer
        token, or a peer's signature made with it for this agent (:mod:`agent.fleet.proof`; its
        body and nonce are checked once the whole request is in, :meth:`_body_refusal`), or a
        unix-socket caller the server admitted by its uid."""
        if request.peer_uid is not None:
            return ""  # the server admitted this unix-socket caller by its kernel-proven uid
        if self.mutual_tls and not request.client_certificate:
            return UNAUTHORIZED
        if self._token is None:
            return ""
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() == "bearer" and presented:
            return "" if hmac.compare_digest(presented.strip().encode("latin-1", "replace"), self._token) else UNAUTHORIZED
        signature = RequestSignature.parse(header)
        authority = request.headers.get("host", "")
        if signature is None or not signature.authentic(self._token, request.method, authority, request.path):
            return UNAUTHORIZED
        if abs(skew := signature.skew_s()) > MAX_SKEW_S:  # genuine: a member, whose clock is off
            return skew_refusal(skew)
        if not self._addressed_here(authority):
            return misdirected(authority, self.own_label or f"port {self.port}")
        return ""

    def _log_refusal(self, request: Request, refusal: str) -> None:
        """One warning line per refusing reason and address, at most one a minute (a guessing
        client must not flood the log); the next line counts those not said. A reason is its
        words: the numbers in it (a clock 90 s, then 89 s ahead) do not make another."""
        key = f"{request.client}|{_DIGITS.sub('N', refusal)}"
        now = time.monotonic()
        last, unsaid = self._refusals_logged.get(key, (-REFUSAL_LOG_INTERVAL_S, 0))
        if now - last < REFUSAL_LOG_INTERVAL_S:
            self._refusals_logged[key] = (last, unsaid + 1)
            return
        if len(self._refusals_logged) >= MAX_REFUSAL_KEYS:
            self._refusals_logged.clear()
        self._refusals_logged[key] = (now, 0)
        more = f" ({unsaid} more like it since the last line)" if unsaid else ""
        log.warning("refused %s %s from %s: %s%s", request.method, request.path, request.client, refusal, more)

    def _addressed_here(self, authority: str) -> bool:
        """The ``Host`` a signature was made for names this agent: its port, and one of its own
        addresses or names."""
        host, port = authority_host(authority)
        if self.port is not None and port != str(self.port):
            return False
        return self.own_host is None or self.own_host(host)

    def _body_refusal(self, request: Request) -> str:
        """A signed request: ``""`` when its body is the signed one and its nonce new here, else why."""
        signature = RequestSignature.parse(request.headers.get("authorization", ""))
        if signature is None or request.peer_uid is not None:
            return ""  # bearer (or mutual TLS alone, or the operator's socket)
        if not signature.covers(request.body):
            return "unauthorized: the body is not the signed one"
        if not self.nonces.first_use(signature.nonce, ts=signature.ts):
            return "unauthorized: a replay (this agent accepted that signed request before)"
        return ""

    async def _signed_refusal(self, request: Request) -> str:
        """A signed request whose head and body are good: its nonce persisted (a replay after a
        restart is refused too), then ``""`` when its sender may sign as it did (:attr:`check_sender`),
        else why."""
        signature = RequestSignature.parse(request.headers.get("authorization", ""))
        if signature is None or request.peer_uid is not None:
            return ""
        if self.nonces.path is not None:
            await anyio.to_thread.run_sync(self.nonces.persist, signature.nonce)
            if self.nonces.error and self.nonces.error != self._nonce_error:
                log.warning("agent API: %s (replays are refused until this agent restarts only)", self.nonces.error)
            self._nonce_error = self.nonces.error
        if self.check_sender is None:
            return ""
        return await self.check_sender(Sender.of(request))

    async def __call__(self, request: Request) -> Response:
        if request.peer_uid is None:
            limited = self._limited(request)
            if limited is not None:
                return limited
        refusal = self.refusal(request) or self._body_refusal(request) or await self._signed_refusal(request)
        if refusal:
            self.unauthorized += 1
            self.guesses.allow("")
            self.misdirected += refusal.startswith("unauthorized: signed for")
            self.skewed += refusal.startswith("unauthorized: a signed request whose time")
            self._log_refusal(request, refusal)
            return _error(401, refusal, [("www-authenticate", 'Bearer realm="servewatch"')])
        response = await self._route(request)
        nonce = request.headers.get(NONCE_HEADER, "")
        if self._token is not None and nonce and len(nonce) <= 64:
            response.headers.append((PROOF_HEADER, answer_proof(self._token, nonce, response.status, response.body)))
        return response

    def _limited(self, request: Request) -> Response | None:
        """The 429 of a client over its rate, or of an unproven connection while token guesses are
        limited for everyone; ``None``: go on."""
        wait_s = self.limiter.allow(request.client)
        if wait_s > 0:
            return _error(429, "rate limited", [("retry-after", str(max(1, round(wait_s + 0.5))))])
        if not request.proven_connection and self.guesses.empty(""):
            self.guesses.limited += 1
            wait_s = self.guesses.wait_s("")
            return _error(429, "rate limited: too many failed authentications", [("retry-after", str(max(1, round(wait_s + 0.5))))])
        return None

    async def _route(self, request: Request) -> Response:
        path = request.path.rstrip("/") or "/"
        if path in JOB_ROUTES:
            if request.method != "POST":
                return _error(405, "use POST", [("allow", "POST")])
            return await self._job_message(request, JOB_ROUTES[path])
        if path == "/v1/status":
            if request.method != "GET":
                return _error(405, "use GET", [("allow", "GET")])
            return json_response(200, await self.backend.status())
        if path == "/v1/incidents":
            if request.method == "GET":
                return json_response(200, {"incidents": await self.backend.list_incidents()})
            if request.method == "POST":
                return await self._post_incident(request)
            return _error(405, "use GET or POST", [("allow", "GET, POST")])
        if path.startswith("/v1/incidents/"):
            if request.method != "GET":
                return _error(405, "use GET", [("allow", "GET")])
            incident_id = path[len("/v1/incidents/"):]
            if not INCIDENT_ID_PATTERN.fullmatch(incident_id):
                return _error(400, "bad incident id")
            manifest = await self.backend.get_incident(incident_id)
            if manifest is None:
                return _error(404, f"no incident {incident_id}")
            return json_response(200, manifest)
        return _error(404, "not found")

    async def _job_message(self, request: Request, model: type[Announce | Report | Evidence | Moved]) -> Response:
        try:
            message = model.model_validate_json(request.body or b"{}")
        except ValidationError as exc:
            return _error(400, first_error(exc))
        status, body = await self.backend.job_message(message, client=request.client, sender=Sender.of(request))
        return json_response(status, body)

    async def _post_incident(self, request: Request) -> Response:
        join = _join_request(request)
        if isinstance(join, str):
            return _error(400, join)
        status, body = await self.backend.post_incident(join, agent_id=request.headers.get("x-servewatch-agent", ""),
                                                        sender=Sender.of(request))
        if status == 429 and isinstance(body.get("retry_after_s"), (int, float)):
            return json_response(status, body, [("retry-after", str(max(1, round(body["retry_after_s"] + 0.5))))])
        return json_response(status, body)
