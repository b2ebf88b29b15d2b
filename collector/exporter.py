"""Streams telemetry batches from a training process to the host's processor.

Design rule (ARCHITECTURE.md, torchtitan): never hurt the training job.

* ``submit`` is the only call made on the training thread. It appends to a
  bounded deque under a lock and sets an Event: no I/O, no serialisation, no
  allocation proportional to the batch. When the deque is full the oldest
  batch is dropped and counted (``drop_policy="newest"`` drops the incoming
  one instead). It never raises.
* A daemon worker thread owns the gRPC channel. It keeps one client stream
  (``trainscope.v1.Ingest/Stream``) open and writes serialised batches to it.
  Client streaming has no per-message acknowledgement, so the worker closes
  the stream every ``confirm_interval_s`` and reads the processor's
  ``IngestSummary``: batches written since the last confirmation are kept in
  memory (inside the same byte bound) and re-sent on the next stream if the
  old one broke. The processor drops re-sent duplicates by (pid, seq).
* Reconnects use exponential backoff with full jitter; ``shutdown`` cuts the
  backoff short (after opentelemetry-python's OTLP exporter).
* After ``fork()`` the child's exporter is off: it drops and counts
  (``dropped["forked"]``) instead of touching gRPC, whose threads and
  sockets did not survive the fork (a gRPC channel created in a forked child
  can hang it). Forked children are data-loader workers and the like, which
  the collector does not trace anyway (ARGUS Appendix A); the parent is
  untouched.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import random
import threading
import time
import uuid
from typing import Callable, Deque, Iterator

import grpc

from trainscope.collector.exporter_config import RETRYABLE, ExporterConfig, ExporterStats
from trainscope.collector.exporter_socket import check_socket_dir
from trainscope.proto.contracts import BOOT_METADATA, INGEST_METHOD, REPLAY_METADATA, SENDER_METADATA
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.security import ClientSecurity
from trainscope.proto.v1 import telemetry_pb2

log = logging.getLogger(__name__)

#: The ``payload`` field of ``TelemetryBatch`` that holds each batch message, by message name.
_PAYLOAD_FIELD = {f.message_type.full_name: f.name
                  for f in telemetry_pb2.TelemetryBatch.DESCRIPTOR.oneofs_by_name["payload"].fields}


@dataclasses.dataclass(slots=True)
class _Pending:
    seq: int
    payload: object  # a *Batch message, or serialised bytes once written
    nbytes: int
    data: bytes | None = None
    resource: object = None  # a Resource message overriding the exporter's own
    sent: bool = False       # written to a stream at least once
    resent: bool = False     # written again (after a broken stream): a "duplicate" answer is delivery
    confirmed: bool = False  # counted in stats.confirmed (a replay is not counted again)
    replay: bool = False     # to be re-sent to a restarted processor on a replay stream


_FINAL = object()  # payload sentinel of the end-of-process marker


class _StreamBroken(Exception):
    def __init__(self, why: str, retryable: bool = True, reason: str = "non_retryable") -> None:
        super().__init__(why)
        self.retryable = retryable
        self.reason = reason  # the dropped[] key when not retryable


class BatchExporter:
    """Bounded, non-blocking, reconnecting client of the processor's ingest stream."""

    def __init__(
        self,
        resource: Resource,
        config: ExporterConfig = ExporterConfig(),
        *,
        channel_factory: Callable[[str], grpc.Channel] | None = None,
    ) -> None:
        self.config = config
        self._resource_pb = resource.to_pb()
        self.stats = ExporterStats()
        self._config_error: str | None = None
        try:
            self._security = config.security if config.security is not None else ClientSecurity.from_env()
        except ConfigError as e:  # never raise into the training job: say it once, send nothing
            log.warning("trainscope exporter: %s; telemetry will not be sent", e)
            self._config_error = str(e)
            self._security = ClientSecurity()
        self._channel_factory = channel_factory or self._security.channel
        self._init_state()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_in_child)

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._flush_requested = threading.Event()
        self._queue: Deque[_Pending] = collections.deque()
        self._unconfirmed: Deque[_Pending] = collections.deque()
        self._retained: Deque[_Pending] = collections.deque()  # confirmed, not yet durable
        self._retained_bytes = 0
        self._boot: str | None = None  # the processor process we last streamed to
        self._sender = uuid.uuid4().hex
        self._next_reject_log = 0.0
        self._next_fail_log = 0.0
        self._failing_since: float | None = None
        self._held_bytes = 0
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._forked = False

    def _after_fork_in_child(self) -> None:
        # The child must not reuse the parent's channel, thread or data, nor
        # start gRPC anew in a process forked from a threaded gRPC parent.
        self.stats = ExporterStats()
        self._init_state()
        self._forked = True

    # ------------------------------------------------------------------ API
    def submit(self, payload, nbytes: int, resource: Resource | None = None) -> bool:
        """Queue one payload (a ``KernelBatch``/``PhaseBatch``/... message, or a
        zero-argument callable that builds one on the worker thread).

        ``nbytes`` is the caller's estimate of its serialised size (exact for
        kernel columns). Returns False when the payload was dropped. Called on
        the training thread: O(1), never blocks on I/O, never raises.
        ``resource`` lets one exporter carry several ranks (the simulator
        batches many simulated ranks per process); it defaults to the
        exporter's own.
        """
        try:
            cfg = self.config
            with self._lock:
                if self._closed:
                    self.stats.dropped["closed"] += 1
                    return False
                if self._forked:
                    self.stats.dropped["forked"] += 1
                    return False
                if self._config_error is not None:
                    self.stats.dropped["config"] += 1
                    return False
                self.stats.submitted += 1
                if nbytes > cfg.max_batch_bytes:
                    self.stats.dropped["oversize"] += 1
                    return False
                while (len(self._queue) + len(self._unconfirmed) >= cfg.max_queue_batches
                       or self._held_bytes + nbytes > cfg.max_queue_bytes):
                    if cfg.drop_policy == "newest" or not self._queue:
                        self.stats.dropped["queue_full"] += 1
                        return False
                    old = self._queue.popleft()
                    self._held_bytes -= old.nbytes
                    self.stats.dropped["queue_full"] += 1
                    self.stats.confirmed -= old.confirmed  # a replayed batch: lost after all
                if self._thread is None:
                    try:
                        self._start_worker()
                    except RuntimeError:  # Python 3.12+ at interpreter shutdown: no new thread
                        self._thread = None
                        self.stats.dropped["interpreter_shutdown"] += 1
                        return False
                self._seq += 1
                self._queue.append(_Pending(self._seq, payload, nbytes,
                                            resource=None if resource is None else resource.to_pb()))
                self._held_bytes += nbytes
            self._wake.set()
            return True
        except Exception:  # never raise into user code
            log.debug("trainscope exporter submit failed", exc_info=True)
            self.stats.dropped["internal_error"] += 1
            return False

    def set_resource(self, resource: Resource) -> None:
        """Replace the exporter's identity (e.g. once torch.distributed knows the
        rank's groups); batches serialised from now on carry it."""
        self._resource_pb = resource.to_pb()

    def submit_final(self, resource: Resource | None = None) -> bool:
        """Queue the end-of-process marker (``TelemetryBatch.final``) for ``resource``.

        Sent by a normal shutdown so the analyzer can tell a finished job from
        a hung one; a crashed or hung process never sends it.
        """
        return self.submit(_FINAL, 16, resource=resource)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued was confirmed by the processor."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.config.shutdown_timeout_s)
        self._flush_requested.set()  # confirm as soon as the queue is empty, not at the interval
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue and not self._unconfirmed:
                    return True
                self._idle.clear()
            self._wake.set()
            self._idle.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        with self._lock:
            return not self._queue and not self._unconfirmed

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Flush (bounded), stop the worker, count whatever is left as dropped."""
        ok = self.flush(timeout_s)
        with self._lock:
            self._closed = True
            left = len(self._queue) + len(self._unconfirmed)
            if left:
                self.stats.dropped["shutdown"] += left
                self.stats.confirmed -= sum(p.confirmed for q in (self._queue, self._unconfirmed) for p in q)
            self._queue.clear()
            self._unconfirmed.clear()
            self._retained.clear()
            self._retained_bytes = 0
            self._held_bytes = 0
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)
        return ok

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + len(self._unconfirmed)

    # --------------------------------------------------------------- worker
    def _start_worker(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainscope-exporter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = self.config.backoff_initial_s
        channel = None
        while not self._stop.is_set():
            try:
                if channel is None:
                    try:
                        check_socket_dir(self.config.target)
                    except ConfigError as e:
                        log.warning("trainscope exporter refuses to connect to %s: %s", self.config.target, e.why)
                        raise _StreamBroken(f"refusing to connect: {e}") from None
                    try:
                        channel = self._channel_factory(self.config.target)
                    except ConfigError as e:  # e.g. the CA file is missing: it may appear later
                        raise _StreamBroken(str(e)) from None
                self._stream_once(channel)
                backoff = self.config.backoff_initial_s
                self._failing_since = None
            except _StreamBroken as e:
                log.debug("trainscope exporter stream broken: %s", e)
                if e.retryable:
                    self._requeue_unconfirmed()
                    self._note_failure(str(e))
                else:
                    self._drop_unconfirmed(e.reason, str(e))
                self.stats.reconnects += 1
                if channel is not None:
                    channel.close()
                    channel = None
                # full jitter; the stop event cuts the wait short
                self._stop.wait(random.uniform(0, backoff))
                backoff = min(backoff * 2, self.config.backoff_max_s)
            except RuntimeError as e:
                if "interpreter shutdown" not in str(e):
                    raise
                # Python 3.12+: no new thread (gRPC starts one per stream) once the interpreter
                # is finalizing; what is left cannot be sent: counted, not a traceback
                with self._lock:
                    left = len(self._queue) + len(self._unconfirmed)
                    if left:
                        self.stats.dropped["interpreter_shutdown"] += left
                    self._queue.clear()
                    self._unconfirmed.clear()
                    self._held_bytes = 0
                    self._idle.set()
                log.debug("trainscope exporter: interpreter shutting down, %d batches not sent", left)
                break
            except Exception:  # pragma: no cover - defensive: the worker must survive
                log.exception("trainscope exporter worker error")
                self._requeue_unconfirmed()
                self._stop.wait(backoff)
        if channel is not None:
            channel.close()

    def _note_failure(self, why: str) -> None:
        """A WARNING, at most one per 30 s, once delivery has failed for 5 s on end (a processor that
        restarts in a second says nothing; a TLS or address mistake is said, with gRPC's reason)."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if now - self._failing_since >= 5.0 and now >= self._next_fail_log:
            self._next_fail_log = now + 30.0
            log.warning("trainscope exporter cannot deliver to %s for %.0f s (%s); retrying, %d batches held",
                        self.config.target, now - self._failing_since, why, self.pending)

    def _requeue_unconfirmed(self) -> None:
        with self._lock:
            if self._unconfirmed:
                self.stats.resent += len(self._unconfirmed)
                self._queue.extendleft(reversed(self._unconfirmed))
                self._unconfirmed.clear()

    def _drop_unconfirmed(self, reason: str, why: str) -> None:
        with self._lock:
            n = len(self._unconfirmed)
            for p in self._unconfirmed:
                self._held_bytes -= p.nbytes
                self.stats.confirmed -= p.confirmed  # a replayed batch refused: lost after all
            self._unconfirmed.clear()
            self.stats.dropped[reason] += n
            if not self._queue:
                self._idle.set()
        if n:
            log.warning("trainscope exporter: %d batches dropped, the processor refused them (%s)", n, why)

    def _next_batch(self, replay: bool = False) -> _Pending | None:
        with self._lock:
            if not self._queue or (replay and not self._queue[0].replay):
                if not self._queue:
                    self._idle.set()
                return None
            p = self._queue.popleft()
            self._unconfirmed.append(p)
        if p.data is None:
            p.data = self._serialise(p)
        p.resent = p.sent
        p.sent = True
        return p

    def _processor_restarted(self, boot: str) -> None:
        """The processor is a new process: what the old one confirmed but had not made durable, and
        what it may have taken before the stream broke, goes first, on a replay stream."""
        with self._lock:
            again = list(self._retained)
            self._retained.clear()
            self._retained_bytes = 0
            again += [p for p in self._queue if p.sent]  # requeued after the broken stream
            for p in again:
                p.replay = True
            self._queue = collections.deque(again + [p for p in self._queue if not p.sent])
            self._held_bytes += sum(p.nbytes for p in again if p.confirmed)
            self.stats.processor_restarts += 1
            self.stats.replayed += len(again)
        if again:
            log.warning("trainscope exporter: the processor at %s restarted; re-sending %d batches it had "
                        "not yet written", self.config.target, len(again))

    def _forget_durable(self, durable_seq: int) -> None:
        """Called with the lock held: drop retained batches the processor has written."""
        while self._retained and self._retained[0].seq <= durable_seq:
            self._retained_bytes -= len(self._retained.popleft().data or b"")

    def _serialise(self, p: _Pending) -> bytes:
        b = telemetry_pb2.TelemetryBatch(
            resource=p.resource or self._resource_pb, seq=p.seq, sent_unix_ns=time.time_ns(),
            dropped_total=self.stats.dropped_total, submitted_total=self.stats.submitted,
        )
        if p.payload is _FINAL:
            b.final = True
        else:
            msg = p.payload() if callable(p.payload) else p.payload
            getattr(b, _PAYLOAD_FIELD[msg.DESCRIPTOR.full_name]).CopyFrom(msg)
        p.payload = None  # the bytes are kept instead
        return b.SerializeToString()

    def _stream_once(self, channel: grpc.Channel) -> None:
        """Open one stream, feed it until the confirm interval, close it, read the summary."""
        call = channel.stream_unary(
            INGEST_METHOD,
            request_serializer=None,  # we hand over bytes we serialised ourselves
            response_deserializer=telemetry_pb2.IngestSummary.FromString,
        )
        outbox: "queue.SimpleQueue[bytes | None]" = queue.SimpleQueue()

        def requests() -> Iterator[bytes]:
            while True:
                item = outbox.get()
                if item is None:
                    return
                yield item

        with self._lock:
            replay = bool(self._queue) and self._queue[0].replay
        md = [(SENDER_METADATA, self._sender)] + list(self._security.metadata() or ())
        if replay:
            md.append((REPLAY_METADATA, "1"))
        # a deadline bounds every wait below, a processor that accepts connections and never
        # answers included (the summary itself is waited for at most max(5 s, the interval))
        future = call.future(requests(), wait_for_ready=False, metadata=tuple(md),
                             timeout=self.config.confirm_interval_s + max(5.0, self.config.confirm_interval_s) + 5.0)
        # the processor names its process first thing (processor/durability.py); a new name
        # means the windows it held in memory are gone: re-send what they held before anything else
        boot = dict(future.initial_metadata() or ()).get(BOOT_METADATA)
        if boot and self._boot is not None and boot != self._boot and not replay:
            self._boot = boot
            self._processor_restarted(boot)
            outbox.put(None)  # this stream ends empty; the next one is the replay
            replay = None
        elif boot:
            self._boot = boot
        deadline = time.monotonic() + self.config.confirm_interval_s
        try:
            while replay is not None and time.monotonic() < deadline and not self._stop.is_set():
                if future.done():
                    break
                p = self._next_batch(replay)
                if p is None:
                    if replay:
                        break  # the replay stream carries the replayed batches only
                    if self._flush_requested.is_set() and self._unconfirmed:
                        self._flush_requested.clear()
                        break
                    self._wake.wait(max(0.0, min(0.05, deadline - time.monotonic())))
                    self._wake.clear()
                    continue
                if len(p.data) > self.config.max_batch_bytes:
                    with self._lock:
                        self._unconfirmed.remove(p)
                        self._held_bytes -= p.nbytes
                        self.stats.dropped["oversize"] += 1
                    continue
                outbox.put(p.data)
                self.stats.sent += 1
        finally:
            outbox.put(None)
        try:
            summary = future.result(timeout=max(5.0, self.config.confirm_interval_s))
        except grpc.FutureTimeoutError:
            future.cancel()
            raise _StreamBroken("processor did not answer the stream summary")
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else ""
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (details or ""):
                self._drop_oversize_head()
            reason = {grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
                      grpc.StatusCode.PERMISSION_DENIED: "permission_denied"}.get(code, "non_retryable")
            raise _StreamBroken(f"{code}: {e.details() if hasattr(e, 'details') else e}",
                                retryable=code is None or code in RETRYABLE, reason=reason)
        with self._lock:
            n = len(self._unconfirmed)
            again = sum(p.confirmed for p in self._unconfirmed)  # replayed: counted once already
            for p in self._unconfirmed:
                self._held_bytes -= p.nbytes
            # the summary answers for every batch of the stream: those it refused are
            # rejected, not confirmed (a rejected batch is gone, and the user must see it)
            # A duplicate is a re-sent batch the processor already holds: delivered. Only re-sent
            # ones can be: a "duplicate" of a batch sent once was not taken, so it is rejected.
            reasons = {k: v for k, v in summary.rejected_by_reason.items() if k != "duplicate"}
            unknown = summary.rejected_by_reason.get("duplicate", 0) - sum(p.resent for p in self._unconfirmed)
            if unknown > 0:
                reasons["duplicate"] = unknown
            rejected = min(n - again, sum(reasons.values()))
            self.stats.confirmed += n - again - rejected
            # kept until durable (re-sent if the processor restarts first); rejected ones are
            # not told apart by the summary, so all are kept: a replayed rejection is harmless
            for p in self._unconfirmed:
                p.confirmed, p.replay = True, False
                if self._boot is not None:  # a processor without a boot id offers no replay
                    self._retained.append(p)
                    self._retained_bytes += len(p.data or b"")
            self._unconfirmed.clear()
            self._forget_durable(summary.durable_seq)
            while self._retained_bytes > self.config.max_retained_bytes and self._retained:
                self._retained_bytes -= len(self._retained.popleft().data or b"")
                self.stats.retain_evicted += 1
            self.stats.rejected_by_processor += rejected
            self.stats.rejected_by_reason.update(reasons)
            warn = rejected and time.monotonic() >= self._next_reject_log
            if warn:
                self._next_reject_log = time.monotonic() + 10.0  # one line per 10 s, not per stream
            if not self._queue:
                self._idle.set()
        if warn:
            log.warning("processor rejected %d of %d batches (%s); %d rejected in all",
                        rejected, n, ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())),
                        self.stats.rejected_by_processor)

    def _drop_oversize_head(self) -> None:
        """The processor refused a message as too large: drop the largest unconfirmed one.

        gRPC does not say which message it was; everything before it was
        received, so the largest in-flight batch is the one over the limit.
        """
        with self._lock:
            if not self._unconfirmed:
                return
            big = max(self._unconfirmed, key=lambda p: len(p.data or b""))
            self._unconfirmed.remove(big)
            self._held_bytes -= big.nbytes
            self.stats.dropped["rejected_oversize"] += 1
