"""Kafka sink configuration: :class:`KafkaSinkConfig` and the librdkafka settings it resolves to.

Validated at start-up (a bad value raises ``ConfigError`` naming the
``kafka.*`` setting).
"""
from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import types
from typing import Mapping

from trainscope.proto.errors import ConfigError

COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")
#: How kernel windows are keyed (``KafkaSinkConfig.key_by``).
KEY_BY = ("job", "group")
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
#: librdkafka settings this sink owns: its guarantees depend on them.
_OWNED = frozenset({
    "bootstrap.servers", "client.id", "enable.idempotence", "acks", "request.required.acks",
    "compression.type", "compression.codec", "linger.ms", "queue.buffering.max.ms",
    "message.timeout.ms", "delivery.timeout.ms", "error_cb", "on_delivery", "logger",
})


#: librdkafka ``security.protocol`` values and the SASL mechanisms its wheels build in.
SECURITY_PROTOCOLS = ("plaintext", "ssl", "sasl_plaintext", "sasl_ssl")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")


def security_settings(*, protocol: str | None = None, mechanism: str | None = None,
                      username: str | None = None, password_file: str | None = None,
                      ca: str | None = None, cert: str | None = None, key: str | None = None,
                      key_password_file: str | None = None,
                      environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """librdkafka security settings (``security.protocol``, ``sasl.*``, ``ssl.*``) from flags, then
    the ``KAFKA_*`` environment variables (``proto/env.py``); empty when none is set.

    Shared by the processor's sink and the analyzer's source and diagnosis sink.
    Passwords come from a file (``--kafka-sasl-password-file``,
    ``KAFKA_SASL_PASSWORD_FILE``) or ``KAFKA_SASL_PASSWORD``, never from argv;
    a bad combination is a ConfigError naming the setting and never its secret.
    """
    from trainscope.proto import env
    from trainscope.proto.security import resolve_secret

    e = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for key_, flag, var in (("security.protocol", protocol, env.KAFKA_SECURITY_PROTOCOL),
                            ("sasl.mechanism", mechanism, env.KAFKA_SASL_MECHANISM),
                            ("sasl.username", username, env.KAFKA_SASL_USERNAME),
                            ("ssl.ca.location", ca, env.KAFKA_SSL_CA),
                            ("ssl.certificate.location", cert, env.KAFKA_SSL_CERT),
                            ("ssl.key.location", key, env.KAFKA_SSL_KEY)):
        v = flag or e.get(var)
        if v:
            out[key_] = v.strip()
    pw = resolve_secret(password_file, env.KAFKA_SASL_PASSWORD_FILE, env.KAFKA_SASL_PASSWORD,
                        "--kafka-sasl-password-file", e)
    if pw is not None:
        out["sasl.password"] = pw.reveal()
    kpw = resolve_secret(key_password_file, env.KAFKA_SSL_KEY_PASSWORD_FILE, env.KAFKA_SSL_KEY_PASSWORD,
                         "--kafka-ssl-key-password-file", e)
    if kpw is not None:
        out["ssl.key.password"] = kpw.reveal()
    if not out:
        return out
    proto = out.get("security.protocol", "").lower()
    if "security.protocol" in out:
        if proto not in SECURITY_PROTOCOLS:
            raise ConfigError("kafka.security.protocol", out["security.protocol"],
                              f"one of {', '.join(SECURITY_PROTOCOLS)}")
        out["security.protocol"] = proto
    sasl = {k for k in out if k.startswith("sasl.")}
    if sasl and not proto.startswith("sasl_"):
        raise ConfigError("kafka.security.protocol", proto or "(unset)",
                          f"{', '.join(sorted(sasl))} given: use sasl_ssl (or sasl_plaintext on a trusted network)")
    if proto.startswith("sasl_"):
        mech = out.get("sasl.mechanism", "")
        if mech.upper() not in SASL_MECHANISMS:
            raise ConfigError("kafka.sasl.mechanism", mech or "(unset)", f"one of {', '.join(SASL_MECHANISMS)}")
        out["sasl.mechanism"] = mech.upper()
        if mech.upper() in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512") and not (
                out.get("sasl.username") and out.get("sasl.password")):
            raise ConfigError("kafka.sasl.username", out.get("sasl.username", "(unset)"),
                              f"{mech.upper()} needs a username and a password (--kafka-sasl-password-file)")
    if any(k.startswith("ssl.") for k in out) and proto not in ("ssl", "sasl_ssl"):
        raise ConfigError("kafka.security.protocol", proto or "(unset)", "ssl.* settings given: use ssl or sasl_ssl")
    if bool(out.get("ssl.certificate.location")) != bool(out.get("ssl.key.location")):
        raise ConfigError("kafka.ssl.certificate.location", out.get("ssl.certificate.location", "(unset)"),
                          "a client certificate needs its key (ssl.key.location) and the reverse")
    for k in ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location"):
        if k in out and not os.path.isfile(out[k]):
            raise ConfigError(f"kafka.{k}", out[k], "no such file")
    return out


def redacted(settings: Mapping[str, object]) -> dict[str, object]:
    """``settings`` fit for a log line or an error: secrets (passwords, tokens, keys) as ``***``."""
    from trainscope.proto.errors import redact
    return {k: redact(k, v) for k, v in settings.items()}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False)
class KafkaSinkConfig:
    """Where and how window summaries go to Kafka."""

    bootstrap: str
    """Comma-separated ``host:port`` list of brokers to bootstrap from."""
    topic_prefix: str = "trainscope"
    """Topics are ``<prefix>.<signal>.v1``; separate deployments on one cluster use different prefixes."""
    client_id: str = "trainscope-processor"
    """Client id shown in broker logs and quotas; also names the default spool directory."""
    compression: str = "zstd"
    """Batch compression: one of none, gzip, snappy, lz4, zstd (all verified against Tansu 0.6)."""
    linger_ms: int = 50
    """How long librdkafka waits to fill a batch; summaries arrive in bursts at window close."""
    spool_dir: str = ""
    """Directory of the on-disk spool; empty means ``<tmp>/trainscope-kafka-spool/<client_id>``.
    Put it on a persistent volume so a restarted processor replays what it had not delivered."""
    spool_max_bytes: int = 1 << 30
    """Disk bound of the spool; records beyond it are dropped and counted."""
    create_topics: bool = True
    """Create missing topics at start and after a broker comes back empty (else rely on the cluster)."""
    partitions: int = 6
    """Partitions per topic when this sink creates it (upper bound on analyzer consumers per topic)."""
    replication_factor: int = -1
    """Replicas per created topic; -1 means the broker's default."""
    delivery_timeout_s: float = 30.0
    """librdkafka ``message.timeout.ms``: how long it retries one batch before failing it back to us."""
    probe_interval_s: float = 2.0
    """Longest wait between metadata probes while the broker is unreachable (backoff starts at 0.1 s)."""
    close_timeout_s: float = 10.0
    """How long ``close`` tries to drain the spool; the rest stays on disk for the next start."""
    key_by: str = "job"
    """Record key of the kernel windows: ``job`` (every rank of a job on one partition: one analyzer
    sees the whole job) or ``group`` (``<job>/dp<index>``: each data-parallel comparison group on its
    own key, so a job's kernel windows spread over the partitions and the analyzer group's members
    share the job's L3, ``analyzer/partition.py``). Other signals are always keyed by job."""
    extra: Mapping[str, object] = dataclasses.field(default_factory=dict)
    """More librdkafka settings (``security.protocol``, ``sasl.*``, ``ssl.*`` ...). Settings this
    sink owns (idempotence, acks, compression, linger, timeouts, callbacks) are rejected."""

    def __post_init__(self) -> None:
        servers = self.bootstrap.split(",") if isinstance(self.bootstrap, str) else [""]
        checks = (
            ("bootstrap", not all(re.match(r"^\s*\[?[^\s,]+\]?:\d+\s*$", s) for s in servers),
             "need host:port[,host:port...]"),
            ("topic_prefix", not _NAME.match(self.topic_prefix) or len(self.topic_prefix) > 200,
             "letters, digits, '.', '_', '-' only, at most 200"),
            ("client_id", not _NAME.match(self.client_id), "letters, digits, '.', '_', '-' only"),
            ("compression", self.compression not in COMPRESSIONS, f"one of {', '.join(COMPRESSIONS)}"),
            ("linger_ms", not 0 <= self.linger_ms <= 60_000, "must be in [0, 60000]"),
            ("spool_max_bytes", self.spool_max_bytes < 4096, "must be at least 4096"),
            ("partitions", self.partitions < 1, "must be >= 1"),
            ("key_by", self.key_by not in KEY_BY, f"one of {', '.join(KEY_BY)}"),
            ("replication_factor", self.replication_factor != -1 and self.replication_factor < 1,
             "-1 (broker default) or >= 1"),
            ("delivery_timeout_s", not self.delivery_timeout_s * 1000 > max(self.linger_ms, 0),
             "must be > 0 and exceed linger_ms"),
            ("probe_interval_s", not self.probe_interval_s > 0, "must be > 0"),
            ("close_timeout_s", not self.close_timeout_s > 0, "must be > 0"),
        )
        for name, bad, why in checks:
            if bad:
                raise ConfigError(f"kafka.{name}", getattr(self, name), why)
        bad = sorted(k for k in self.extra if not isinstance(k, str) or k in _OWNED)
        if bad:
            raise ConfigError("kafka.extra", bad, "set these through the sink's own settings")
        object.__setattr__(self, "extra", types.MappingProxyType(dict(self.extra)))
        if not self.spool_dir:
            default = os.path.join(tempfile.gettempdir(), "trainscope-kafka-spool", self.client_id)
            object.__setattr__(self, "spool_dir", default)

    def __repr__(self) -> str:  # extra may hold sasl.password / ssl.key.password: never printed
        fields = ", ".join(f"{f.name}={redacted(self.extra) if f.name == 'extra' else getattr(self, f.name)!r}"
                           for f in dataclasses.fields(self))
        return f"KafkaSinkConfig({fields})"

    def producer_settings(self) -> dict[str, object]:
        """The librdkafka producer configuration (callbacks added by the sink)."""
        return {
            "reconnect.backoff.max.ms": int(min(self.probe_interval_s, 10.0) * 1000),
            "log.connection.close": False,
            **self.extra,
            "bootstrap.servers": self.bootstrap,
            "client.id": self.client_id,
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": self.compression,
            "linger.ms": self.linger_ms,
            "message.timeout.ms": int(self.delivery_timeout_s * 1000),
        }

    def admin_settings(self) -> dict[str, object]:
        keep = ("security.", "sasl.", "ssl.", "socket.", "broker.address.family", "client.dns.lookup")
        return {
            # Reconnect quickly so a probe notices a returning broker soon.
            "reconnect.backoff.max.ms": int(min(self.probe_interval_s, 10.0) * 1000),
            "log.connection.close": False,
            **{k: v for k, v in self.extra.items() if k.startswith(keep)},
            "bootstrap.servers": self.bootstrap,
            "client.id": self.client_id + "-admin",
        }
