"""Network security settings shared by the collector, the processor and the analyzer (issue #11 item 8).

In ``proto/`` because both ends of the ingest stream use them and the
collector may import only ``proto/``. Standard library only; ``grpc`` and
``ssl`` are used where a credential is built.

* :class:`Secret`: a token or password that never prints (``repr`` and ``str``
  are ``***``), read from a file (preferred: not in ``ps``, not in the
  environment of every child) or an environment variable, never from argv.
* :class:`ServerSecurity`: what a server (the processor's gRPC port, the
  ``/metrics`` endpoints) offers: a TLS certificate and key, optionally a CA
  whose client certificates it then requires (mutual TLS), and a bearer token
  it compares in constant time (``hmac.compare_digest``).
* :class:`ClientSecurity`: what the collector's exporter presents: the CA to
  verify the processor with, optionally its own certificate and key, and the
  token sent as ``authorization: Bearer <token>`` metadata.

Keys must be unencrypted PEM (gRPC's Python API takes no passphrase); a key
file readable by other users is refused, as ssh refuses such a private key.
"""
from __future__ import annotations

import dataclasses
import hmac
import os
import stat
from typing import Mapping

from trainscope.proto import env
from trainscope.proto.errors import ConfigError

#: The gRPC metadata key and the HTTP header carrying the token (lower case: gRPC requires it).
AUTH_METADATA = "authorization"
BEARER = "Bearer "


class Secret:
    """A secret value: kept for the code that needs it, never shown (``***``)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def matches(self, presented: str | bytes | None) -> bool:
        """Constant-time comparison (a timing difference must not tell how much of a guess was right)."""
        if presented is None:
            return False
        if isinstance(presented, str):
            presented = presented.encode("utf-8", "surrogateescape")
        return hmac.compare_digest(presented, self._value.encode("utf-8", "surrogateescape"))

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(other._value.encode(), self._value.encode())

    def __hash__(self) -> int:
        return hash(type(self))


def read_secret_file(path: str, setting: str) -> Secret:
    """The first line of ``path`` as a secret; a missing, empty or other-readable file is a ConfigError."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            data = f.read(65536)
    except OSError as e:
        raise ConfigError(setting, path, f"cannot read it: {e.strerror}") from None
    if st.st_mode & 0o077 and stat.S_ISREG(st.st_mode):
        raise ConfigError(setting, path, f"other users can read it (mode {stat.S_IMODE(st.st_mode):o}); "
                                         "chmod 600 it")
    value = data.decode("utf-8", "replace").splitlines()[0].strip() if data.strip() else ""
    if not value:
        raise ConfigError(setting, path, "is empty")
    return Secret(value)


def resolve_secret(file_flag: str | None, file_var: str, value_var: str, setting: str,
                   environ: Mapping[str, str] | None = None) -> Secret | None:
    """A secret from, in order: a file named by a flag, a file named by ``file_var``, the value of
    ``value_var``; None when none is set."""
    environ = os.environ if environ is None else environ
    path = file_flag or environ.get(file_var)
    if path:
        return read_secret_file(path, setting if file_flag else file_var)
    value = environ.get(value_var)
    if value:
        return Secret(value.strip())
    return None


def _read(path: str, setting: str, *, private: bool = False) -> bytes:
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError as e:
        raise ConfigError(setting, path, f"cannot read it: {e.strerror}") from None
    if private and st.st_mode & 0o077:
        raise ConfigError(setting, path, f"a private key other users can read (mode "
                                         f"{stat.S_IMODE(st.st_mode):o}); chmod 600 it")
    if b"-----BEGIN" not in data:
        raise ConfigError(setting, path, "is not a PEM file")
    if private and b"ENCRYPTED" in data:
        raise ConfigError(setting, path, "is an encrypted key; gRPC needs it unencrypted (keep it 0600)")
    return data


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ServerSecurity:
    """TLS and token of one server (the gRPC ingest port, a ``/metrics`` endpoint)."""

    cert_file: str = ""
    """PEM certificate chain the server presents; empty: no TLS."""
    key_file: str = ""
    """PEM private key of ``cert_file`` (unencrypted, mode 0600)."""
    client_ca_file: str = ""
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    token: Secret | None = None
    """Bearer token every request must carry; None: no token required."""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("tls.cert/tls.key", self.cert_file or self.key_file, "give both or neither")
        if self.client_ca_file and not self.cert_file:
            raise ConfigError("tls.client_ca", self.client_ca_file, "needs a server certificate and key too")
        if self.cert_file:  # read now: a bad file fails at start-up, naming the setting
            _read(self.cert_file, "tls.cert")
            _read(self.key_file, "tls.key", private=True)
        if self.client_ca_file:
            _read(self.client_ca_file, "tls.client_ca")

    @property
    def tls(self) -> bool:
        return bool(self.cert_file)

    def grpc_credentials(self):
        """``grpc.ServerCredentials`` for ``add_secure_port``."""
        import grpc
        return grpc.ssl_server_credentials(
            [(_read(self.key_file, "tls.key", private=True), _read(self.cert_file, "tls.cert"))],
            root_certificates=_read(self.client_ca_file, "tls.client_ca") if self.client_ca_file else None,
            require_client_auth=bool(self.client_ca_file),
        )

    def ssl_context(self):
        """A server-side ``ssl.SSLContext`` (TLS 1.2+) for the HTTP endpoints."""
        import ssl
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca_file:
            ctx.load_verify_locations(self.client_ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def authorized(self, header: str | bytes | None) -> bool:
        """Whether an ``authorization`` value carries the token (always true when none is required)."""
        if self.token is None:
            return True
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        if not header or not header.startswith(BEARER):
            return False
        return self.token.matches(header[len(BEARER):].strip())


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClientSecurity:
    """What the exporter presents to a processor over TCP."""

    ca_file: str = ""
    """PEM CA bundle to verify the processor's certificate; empty: plain text (unless ``tls``)."""
    cert_file: str = ""
    """Client certificate for mutual TLS (with ``key_file``)."""
    key_file: str = ""
    """Private key of ``cert_file`` (unencrypted, mode 0600)."""
    server_name: str = ""
    """Name to check the processor's certificate against instead of the target's host."""
    token: Secret | None = None
    """Bearer token sent with every stream."""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("tls.client_cert/tls.client_key", self.cert_file or self.key_file,
                              "give both or neither")
        if self.cert_file and not self.ca_file:
            raise ConfigError(env.TLS_CA, "", "a client certificate needs the processor's CA too")

    @property
    def tls(self) -> bool:
        return bool(self.ca_file)

    def channel(self, target: str):
        """A gRPC channel to ``target``: TLS when a CA is set, else plain text."""
        import grpc
        if not self.tls:
            return grpc.insecure_channel(target)
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, env.TLS_CA),
            private_key=_read(self.key_file, env.TLS_CLIENT_KEY, private=True) if self.key_file else None,
            certificate_chain=_read(self.cert_file, env.TLS_CLIENT_CERT) if self.cert_file else None,
        )
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(target, creds, options=options)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Call metadata carrying the token, or None."""
        if self.token is None:
            return None
        return ((AUTH_METADATA, BEARER + self.token.reveal()),)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ClientSecurity":
        """The collector's side, from the ``TRAINSCOPE_TLS_*`` and ``TRAINSCOPE_TOKEN*`` variables."""
        e = os.environ if environ is None else environ
        return cls(
            ca_file=e.get(env.TLS_CA, ""), cert_file=e.get(env.TLS_CLIENT_CERT, ""),
            key_file=e.get(env.TLS_CLIENT_KEY, ""), server_name=e.get(env.TLS_SERVER_NAME, ""),
            token=resolve_secret(None, env.TOKEN_FILE, env.TOKEN, env.TOKEN_FILE, e),
        )
