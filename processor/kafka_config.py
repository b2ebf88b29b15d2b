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
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
#: librdkafka settings this sink owns: its guarantees depend on them.
_OWNED = frozenset({
    "bootstrap.servers", "client.id", "enable.idempotence", "acks", "request.required.acks",
    "compression.type", "compression.codec", "linger.ms", "queue.buffering.max.ms",
    "message.timeout.ms", "delivery.timeout.ms", "error_cb", "on_delivery", "logger",
})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
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
