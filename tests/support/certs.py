"""A throwaway CA with server and client certificates for TLS tests (``cryptography``).

Everything is written 0600 under a test's tmp directory; the server
certificate names ``localhost`` and ``127.0.0.1``.
"""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return str(path)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _issue(cn: str, key, ca_key, ca_name: x509.Name, *, ca: bool = False, sans=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b.sign(ca_key, hashes.SHA256())


def make_pki(d: Path, prefix: str = "") -> Pki:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed by it."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{prefix}trainscope test CA")
    ca = _issue(f"{prefix}trainscope test CA", ca_key, ca_key, ca_name, ca=True)
    s_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue("localhost", s_key, ca_key, ca_name,
                    sans=(x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))))
    c_key = ec.generate_private_key(ec.SECP256R1())
    client = _issue("rank-0", c_key, ca_key, ca_name)
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM)  # noqa: E731
    return Pki(
        ca=_write(d / f"{prefix}ca.pem", pem(ca)),
        server_cert=_write(d / f"{prefix}server.pem", pem(server)),
        server_key=_write(d / f"{prefix}server.key", _key_pem(s_key)),
        client_cert=_write(d / f"{prefix}client.pem", pem(client)),
        client_key=_write(d / f"{prefix}client.key", _key_pem(c_key)),
    )
