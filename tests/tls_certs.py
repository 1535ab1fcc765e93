"""Generated TLS material for tests and benchmarks: a private CA, a server certificate for
127.0.0.1/localhost, and a client certificate (mTLS), written as PEM files.

Made with the ``cryptography`` package at run time (EC P-256, valid one day); nothing is checked in.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["TlsMaterial", "make_tls_material"]


@dataclass(frozen=True)
class TlsMaterial:
    """PEM file paths (and bytes) of one generated PKI."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    #: a second CA that signed nothing we serve (a client trusting only it must fail the handshake)
    other_ca_cert: Path

    def read(self, name: str) -> bytes:
        return Path(getattr(self, name)).read_bytes()


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    path.chmod(0o600)


def _ca(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str, *, server: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(ca_key, hashes.SHA256()), key


def make_tls_material(directory: Path) -> TlsMaterial:
    """Write a CA, a server pair (SAN localhost, 127.0.0.1), a client pair and an unrelated CA
    under ``directory`` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca("servewatch test CA")
    other, _ = _ca("unrelated CA")
    server, server_key = _leaf(ca, ca_key, "otlp-receiver", server=True)
    client, client_key = _leaf(ca, ca_key, "servewatch-agent", server=False)
    pem = serialization.Encoding.PEM
    files = TlsMaterial(
        ca_cert=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        client_cert=directory / "client.pem",
        client_key=directory / "client-key.pem",
        other_ca_cert=directory / "other-ca.pem",
    )
    files.ca_cert.write_bytes(ca.public_bytes(pem))
    files.other_ca_cert.write_bytes(other.public_bytes(pem))
    files.server_cert.write_bytes(server.public_bytes(pem))
    files.client_cert.write_bytes(client.public_bytes(pem))
    _write_key(files.server_key, server_key)
    _write_key(files.client_key, client_key)
    return files
