"""The exporter's settings, counters and retryable status codes (split from ``exporter.py``).

``ExporterConfig`` (validated at construction, STYLE.md point 4), ``ExporterStats``
(what a rank reports about its own delivery) and the status codes of the
``trainscope.v1.Ingest/Stream`` call worth retrying. The method and the stream
metadata of the restart contract are contracts of both ends: ``proto/contracts.py``.
"""
from __future__ import annotations

import collections
import dataclasses

import grpc

from trainscope.proto import env
from trainscope.proto.errors import ConfigError
from trainscope.proto.security import ClientSecurity

#: Codes after which sending the same batches again can help (otel-python's
#: retryable set, plus RESOURCE_EXHAUSTED, which the processor uses for an
#: oversize batch: that batch is dropped, the rest go on). After any other
#: code (UNIMPLEMENTED: not a trainscope processor; INVALID_ARGUMENT,
#: PERMISSION_DENIED, ...) the batches in flight are dropped, counted under
#: ``dropped["non_retryable"]`` (``dropped["unauthenticated"]`` for a missing or
#: wrong token), as OpenTelemetry's exporters do, with a WARNING; the exporter
#: still reconnects with backoff for the batches that follow.
RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
})

@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ExporterConfig:
    target: str = env.DEFAULT_PROCESSOR_TARGET
    """gRPC target of the host's processor: ``unix:///path`` (default) or ``host:port``."""
    max_queue_bytes: int = 64 << 20
    """Bound on the bytes held (queued plus sent-but-unconfirmed) before drops."""
    max_queue_batches: int = 4096
    """Bound on the number of batches held."""
    max_batch_bytes: int = 4 << 20
    """A serialised batch above this is dropped (counted ``oversize``) instead of sent."""
    drop_policy: str = "oldest"
    """Which batch to drop when full: ``oldest`` (keeps the newest data) or ``newest``."""
    confirm_interval_s: float = 2.0
    """How often the stream is closed and re-opened to learn what the processor received."""
    backoff_initial_s: float = 0.05
    """First reconnect delay; doubles per failure, with full jitter."""
    backoff_max_s: float = 5.0
    """Cap on the reconnect delay."""
    shutdown_timeout_s: float = 5.0
    """How long ``shutdown`` waits to deliver what is queued."""
    max_retained_bytes: int = 16 << 20
    """Bound on confirmed batches kept until the processor says they are durable (closed,
    written windows), to be re-sent if it restarts meanwhile; beyond it the oldest are
    forgotten and counted (``retain_evicted``)."""
    security: ClientSecurity | None = None
    """TLS (CA, client certificate) and bearer token for a ``host:port`` target; None reads them from
    the ``TRAINSCOPE_TLS_*``/``TRAINSCOPE_TOKEN*`` variables when the exporter is built."""

    def __post_init__(self) -> None:
        if not self.target:
            raise ConfigError("exporter.target", self.target, "must name a processor address")
        for name in ("max_queue_bytes", "max_queue_batches", "max_batch_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"exporter.{name}", getattr(self, name), "must be > 0")
        if self.drop_policy not in ("oldest", "newest"):
            raise ConfigError("exporter.drop_policy", self.drop_policy, "must be 'oldest' or 'newest'")
        for name in ("confirm_interval_s", "backoff_initial_s", "backoff_max_s", "shutdown_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"exporter.{name}", getattr(self, name), "must be > 0")


class ExporterStats:
    """Counters of one exporter; read with ``snapshot()``."""

    def __init__(self) -> None:
        self.submitted = 0
        self.sent = 0
        self.confirmed = 0
        self.resent = 0
        self.rejected_by_processor = 0
        self.rejected_by_reason: collections.Counter[str] = collections.Counter()
        self.reconnects = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.processor_restarts = 0  # boot id changes seen
        self.replayed = 0            # batches re-sent to a restarted processor
        self.retain_evicted = 0      # confirmed, not yet durable, forgotten for the retention bound

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def snapshot(self) -> dict:
        return {
            "submitted": self.submitted, "sent": self.sent, "confirmed": self.confirmed,
            "resent": self.resent, "rejected_by_processor": self.rejected_by_processor,
            "rejected_by_reason": dict(self.rejected_by_reason),
            "reconnects": self.reconnects, "dropped_total": self.dropped_total,
            "dropped": dict(self.dropped), "processor_restarts": self.processor_restarts,
            "replayed": self.replayed, "retain_evicted": self.retain_evicted,
        }
