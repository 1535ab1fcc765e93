"""The agent HTTP API for real: bound by a running agent, called with httpx over TCP (and TLS)."""

from __future__ import annotations

import datetime
import os
import ssl
import subprocess
from pathlib import Path

import anyio
import httpx
import pytest

from agent.fleet.traceparent import TraceParent, TraceParentError
from agent.runtime.settings import ConfigError, load_settings
from exporters.otlp.spans import new_span_id, new_trace_id, span_id_hex, trace_id_hex
from tests.fleet._fleet import TOKEN, free_ports, running_agent, settings_for, token_file

AUTH = {"authorization": f"Bearer {TOKEN}"}


def _client(**kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=10, **kw)


async def test_everything_is_refused_without_the_token(tmp_path: Path) -> None:
    [port] = free_ports(1)
    async with running_agent(settings_for(tmp_path, "node-a", port)) as (agent, _), _client() as client:
        base = f"http://127.0.0.1:{agent.fleet.port}"
        for method, path in [("GET", "/v1/status"), ("GET", "/v1/incidents"), ("GET", "/v1/incidents/x"), ("POST", "/v1/incidents"),
                             ("GET", "/nope")]:
            r = await client.request(method, base + path)
            assert r.status_code == 401, (method, path)
            assert r.headers["www-authenticate"].startswith("Bearer")
            r = await client.request(method, base + path, headers={"authorization": "Bearer wrong"})
            assert r.status_code == 401
        assert agent.incidents.records == []  # the refused POST opened nothing
        r = await client.get(base + "/v1/status", headers=AUTH)
        assert r.status_code == 200
        status = r.json()
        assert status["host.name"] == "node-a"
        assert status["open_incident"] is None
        assert status["components"]["pyspy"]["status"] in ("ok", "permanent_error")
        assert status["schema"] == "servewatch.status/1"
        watchers = {w["name"]: w for w in status["watchers"]}
        assert watchers["pyspy"]["state"] in ("ready", "blind") and watchers["pyspy"]["reason"]
        assert status["fleet"]["job"] is None and status["fleet"]["api_port"] == agent.fleet.port
        assert agent.fleet.api.unauthorized == 10


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_token_file_others_can_read_is_refused_at_startup(tmp_path: Path, mode: int) -> None:
    path = token_file(tmp_path, mode=mode)
    with pytest.raises(ConfigError, match="api.token_file.*chmod 600"):
        load_settings({"data_dir": tmp_path, "api": {"enabled": True, "token_file": path}})


def test_a_symlinked_or_empty_token_file_is_refused(tmp_path: Path) -> None:
    real = token_file(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="symlink"):
        load_settings({"data_dir": tmp_path, "api": {"enabled": True, "token_file": link}})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    os.chmod(empty, 0o600)
    with pytest.raises(ConfigError, match="empty"):
        load_settings({"data_dir": tmp_path, "api": {"enabled": True, "token_file": empty}})


def test_the_api_never_runs_unauthenticated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="api.token_file"):
        load_settings({"data_dir": tmp_path, "api": {"enabled": True}})
    assert load_settings({"data_dir": tmp_path}).api.enabled is False  # off by default


async def test_rate_limit_answers_429_with_retry_after(tmp_path: Path) -> None:
    [port] = free_ports(1)
    settings = settings_for(tmp_path, "node-a", port, api={"rate_burst": 3, "rate_per_s": 0.5})
    async with running_agent(settings) as (agent, _), _client() as client:
        base = f"http://127.0.0.1:{agent.fleet.port}"
        codes = [(await client.get(base + "/v1/status", headers=AUTH)).status_code for _ in range(3)]
        r = await client.get(base + "/v1/status", headers=AUTH)
        assert codes == [200, 200, 200]
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        r = await client.get(base + "/v1/status")  # unauthenticated guesses are limited too
        assert r.status_code == 429


async def test_manual_incident_over_the_api_then_list_and_manifest(tmp_path: Path, spawn, python) -> None:
    target = spawn([python, str(Path(__file__).parents[1] / "programs" / "titled_target.py"), "demo::scheduler_TP3"],
                   stdout=subprocess.PIPE)
    assert target.stdout.readline().startswith(b"ready")
    [port] = free_ports(1)
    settings = settings_for(tmp_path, "node-a", port, target={"pids": [target.pid]}, coredump={"enabled": False})
    async with running_agent(settings) as (agent, records), _client() as client:
        base = f"http://127.0.0.1:{agent.fleet.port}"
        r = await client.post(base + "/v1/incidents", headers=AUTH, json={"detail": "operator asked"})
        assert r.status_code == 202, r.text
        opened = r.json()
        assert opened["status"] == "opened" and opened["host.name"] == "node-a" and opened["parent_span_id"] == ""
        with anyio.fail_after(60):
            while not records:
                await anyio.sleep(0.05)
        [record] = records
        assert record.opened.incident_id == opened["incident_id"]
        assert record.opened.trigger == "manual"
        assert record.opened.attributes["servewatch.target.ranks"] == ("TP3",)
        listing = (await client.get(base + "/v1/incidents", headers=AUTH)).json()["incidents"]
        assert [i["incident_id"] for i in listing] == [opened["incident_id"]]
        manifest = (await client.get(base + f"/v1/incidents/{opened['incident_id']}", headers=AUTH)).json()
        assert manifest["trace_id"] == opened["trace_id"] and manifest["actions"][0]["action"] == "pyspy.dump"
        assert (await client.get(base + "/v1/incidents/..", headers=AUTH)).status_code in (400, 404)
        assert (await client.get(base + "/v1/incidents/%2e%2e%2fx", headers=AUTH)).status_code == 400
        assert (await client.get(base + "/v1/incidents/20990101T000000Z-manual-abc", headers=AUTH)).status_code == 404
        assert (await client.delete(base + "/v1/incidents", headers=AUTH)).status_code == 405


async def test_post_with_traceparent_joins_that_trace(tmp_path: Path) -> None:
    [port] = free_ports(1)
    trace, parent = trace_id_hex(new_trace_id()), span_id_hex(new_span_id())
    async with running_agent(settings_for(tmp_path, "node-b", port)) as (agent, records), _client() as client:
        base = f"http://127.0.0.1:{agent.fleet.port}"
        r = await client.post(base + "/v1/incidents", headers={**AUTH, "traceparent": f"00-{trace}-{parent}-01"},
                              json={"incident_id": "inc-on-a", "origin_host": "node-a"})
        assert r.status_code == 202, r.text
        doc = r.json()
        assert doc["status"] == "opened" and doc["trace_id"] == trace and doc["host.name"] == "node-b"
        # the same trace again attaches (no second incident)
        r = await client.post(base + "/v1/incidents", headers={**AUTH, "traceparent": f"00-{trace}-{parent}-01"}, json={})
        assert r.json()["status"] == "attached" and r.json()["incident_id"] == doc["incident_id"]
        for bad in ("00-xyz-00f067aa0ba902b7-01", f"00-{'0' * 32}-{parent}-01", f"00-{trace.upper()}-{parent}-01"):
            r = await client.post(base + "/v1/incidents", headers={**AUTH, "traceparent": bad}, json={})
            assert r.status_code == 400 and "traceparent" in r.json()["error"]
        r = await client.post(base + "/v1/incidents", headers={**AUTH, "traceparent": f"00-{trace}-{parent}-01"},
                              json={"job": "another-job"})
        assert r.status_code == 409
        r = await client.post(base + "/v1/incidents", headers=AUTH, content=b"[1,2")
        assert r.status_code == 400
        r = await client.post(base + "/v1/incidents", headers=AUTH, content=b"x" * (70 * 1024))
        assert r.status_code == 413
        with anyio.fail_after(30):
            while not records:
                await anyio.sleep(0.05)
    [record] = records
    assert record.opened.trigger == "peer"
    assert (record.opened.trace_id, record.opened.parent_span_id) == (trace, parent)


def test_traceparent_parse_and_format() -> None:
    tp = TraceParent.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert (tp.trace_id, tp.parent_id, tp.flags) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1)
    assert tp.header() == "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    # a future version may add fields
    assert TraceParent.parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra").flags == 0
    for bad in ("", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"):
        with pytest.raises(TraceParentError):
            TraceParent.parse(bad)


# --- mutual TLS ------------------------------------------------------------------------------------


def _pki(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate and a client certificate (real X.509, cryptography)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def write(name: str, data: bytes) -> Path:
        path = folder / name
        path.write_bytes(data)
        os.chmod(path, 0o600)
        return path

    ca_key = key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "servewatch test job CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    out = {"ca": write("ca.pem", ca.public_bytes(serialization.Encoding.PEM))}
    for name in ("server", "client"):
        k = key()
        import ipaddress

        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"agent-{name}")]))
                .issuer_name(ca_name).public_key(k.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        out[name] = write(f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        out[f"{name}-key"] = write(f"{name}-key.pem", k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                                      serialization.NoEncryption()))
    return out


async def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path: Path) -> None:
    pki = _pki(tmp_path)
    [port] = free_ports(1)
    settings = load_settings({
        "data_dir": tmp_path / "d", "host_name": "node-a", "export": {"metrics": False},
        "api": {"enabled": True, "port": port, "tls_cert_file": pki["server"], "tls_key_file": pki["server-key"],
                "tls_client_ca_file": pki["ca"]},
    })
    async with running_agent(settings) as (agent, _):
        base = f"https://127.0.0.1:{agent.fleet.port}"
        bare = ssl.create_default_context(cafile=str(pki["ca"]))
        async with _client(verify=bare) as client:
            with pytest.raises(httpx.HTTPError):
                r = await client.get(base + "/v1/status")
                r.raise_for_status()
        async with _client() as client:  # plain HTTP to the TLS port
            with pytest.raises(httpx.HTTPError):
                await client.get(f"http://127.0.0.1:{agent.fleet.port}/v1/status")
        good = ssl.create_default_context(cafile=str(pki["ca"]))
        good.load_cert_chain(str(pki["client"]), str(pki["client-key"]))
        async with _client(verify=good) as client:
            r = await client.get(base + "/v1/status")
            assert r.status_code == 200 and r.json()["host.name"] == "node-a"
        assert agent.fleet.server.statistics().tls_failures >= 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--api-listen", "127.0.0.1:0"], "api.token_file: the API needs a bearer token file"),
        (["--api-listen", "127.0.0.1"], "invalid value for --api-listen: expected HOST:PORT"),
        (["--job", "j", "--peer", "127.0.0.1:7207"], "api.enabled: a job's agents reach each other through the API"),
        (["--api-listen", "127.0.0.1:0", "--api-token-file", "{loose}"], "invalid value for --api-token-file: '{loose}' has mode 0644 (run: chmod 600 {loose})"),
        (["--api-listen", "127.0.0.1:0", "--api-token-file", "{good}", "--job", "j", "--peer", "foo:bar", "--allow-insecure-peers"],
         "invalid value for --peer: 'foo:bar' is not HOST:PORT or http(s)://HOST:PORT"),
        (["--api-listen", "127.0.0.1:0", "--api-token-file", "{good}", "--job", "j", "--peer", "http://127.0.0.22:7207/x",
          "--allow-insecure-peers"], "invalid value for --peer: 'http://127.0.0.22:7207/x' is not HOST:PORT"),
        (["--api-listen", "127.0.0.1:0", "--api-token-file", "{good}", "--job", "j", "--peers-dns", "bad:port:x",
          "--allow-insecure-peers"], "invalid value for --peers-dns: 'bad:port:x' is not NAME[:PORT]"),
    ],
)
def test_run_refuses_bad_api_settings_with_exit_2_and_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    import sys

    loose = token_file(tmp_path, mode=0o644)
    (tmp_path / "good").mkdir(mode=0o700)
    good = token_file(tmp_path / "good")
    argv = [sys.executable, "-m", "agent.cli.app", "run", "--pid", str(os.getpid()), "--data-dir", str(tmp_path / "d"),
            *[a.replace("{loose}", str(loose)).replace("{good}", str(good)) for a in args]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert message.replace("{loose}", str(loose)) in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


async def test_peers_of_a_job_talk_over_mutual_tls(tmp_path: Path) -> None:
    pki = _pki(tmp_path)
    ports = free_ports(2)
    tls = {"tls_cert_file": pki["server"], "tls_key_file": pki["server-key"], "tls_client_ca_file": pki["ca"]}

    def settings(host: str, port: int):
        return load_settings({
            "data_dir": tmp_path / host, "host_name": host, "export": {"metrics": False},
            "api": {"enabled": True, "port": port, **tls},
            "fleet": {"job": "j", "peers": [f"127.0.0.1:{p}" for p in ports]},
        })

    async with running_agent(settings("node-a", ports[0])) as (a, _recs_a), running_agent(settings("node-b", ports[1])) as (_b, recs_b):
        record = await a.incidents.open_incident("manual")
        with anyio.fail_after(30):
            while not recs_b:
                await anyio.sleep(0.05)
    # node-a either asked node-b (it coordinates) or reported to it (node-b coordinates): over TLS,
    # the answer verified by node-b's certificate from the job CA
    [peer] = [r for r in record.results if r.action in ("peer.capture", "fleet.report")]
    assert peer.outcome.value == "ok", peer.detail
    assert peer.attributes["servewatch.peer.address"] == f"https://127.0.0.1:{ports[1]}"
    assert peer.attributes["servewatch.peer.verified"] is True
    assert recs_b[0].opened.trace_id == record.opened.trace_id
