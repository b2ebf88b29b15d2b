"""gRPC ingest: receive ``TelemetryBatch`` streams, validate, hand over.

Bad input is rejected and counted, never fatal, and never costs the good
records around it:

* messages are taken off the wire as raw bytes and parsed here, so a
  malformed message rejects that message only (gRPC's own deserialiser would
  abort the whole stream);
* a batch whose columns disagree, whose rank is outside the job, or which
  carries nothing is rejected whole (``batches_rejected{reason}``);
* single records with zero, absurd or non-finite durations are removed from
  their batch (``records_rejected{reason}``), the rest of the batch goes on;
* a message over ``max_message_bytes`` is refused by gRPC itself with
  ``RESOURCE_EXHAUSTED``; the exporter drops that one and re-sends the rest;
* re-sent batches (the exporter re-sends what a broken stream did not
  confirm) are recognised by (job, rank, pid, seq) and dropped once;
* every value the arithmetic downstream relies on is bounded first
  (``processor/limits.py``: timestamps, clock jumps, world size, iteration
  numbers, name and stack lengths, sample counts, sequence steps);
* each rejected batch's reason goes back to the collector in
  ``IngestSummary.rejected_by_reason`` and is logged at WARNING, at most once
  per reason every 10 s.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Callable

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from trainscope.processor.durability import Durability, drop_stored
from trainscope.processor.limits import IngestLimits, RateLimitedLog
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.columnar import KernelColumns
from trainscope.processor import collectives
from trainscope.proto.contracts import BOOT_METADATA, INGEST_SERVICE, REPLAY_METADATA, SENDER_METADATA, Signal
from trainscope.proto.errors import BadInput
from trainscope.proto.model import Resource
from trainscope.proto.security import AUTH_METADATA, ServerSecurity
from trainscope.proto.v1 import telemetry_pb2

log = logging.getLogger(__name__)

#: Longest plausible single record: a kernel or phase longer than this is a
#: corrupt timestamp (e.g. a negative value cast to unsigned), not a slowdown.
MAX_RECORD_NS = 24 * 3600 * 10**9
_ONE = np.uint64(1)


@dataclasses.dataclass(frozen=True, slots=True)
class Decoded:
    """One validated batch, ready for windowing."""

    resource: Resource
    signal: str
    payload: object  # KernelColumns | tuple[PhaseTiming] | tuple[IterationMark] | tuple[StackSnapshot]
    records: int
    nbytes: int
    sent_unix_ns: int
    dropped_total: int
    seq: int = 0
    digest: int = 0    # the batch's identity for de-duplication (to forget it when refused)
    end_ns: int = 0    # latest record end (rank clock): when its window closes, the batch is durable


class _StreamState:
    """What the validator remembers of one sender (job, rank, pid): its highest seq."""

    __slots__ = ("max_seq",)

    def __init__(self) -> None:
        self.max_seq = 0


class _RankClock:
    """Per (job, rank), whichever process sends (windows are per (job, rank)): per signal the clock."""

    __slots__ = ("clock", "jumps")

    def __init__(self) -> None:
        self.clock: dict[str, tuple[int, float]] = {}     # signal -> (latest end, monotonic when)
        self.jumps: dict[str, list[int]] = {}              # signal -> ends of consecutive clock jumps


class Validator:
    """Turns raw bytes into ``Decoded`` or raises ``BadInput``; counts record-level rejects.

    Steps, in order (a batch is refused at the first it fails, and refused
    batches leave no trace in the per-stream state):

    1. parse the bytes; 2. resource: job id, ``0 <= rank < world <= max_world_size``;
    3. payload: shape, then per record (durations, timestamps, iterations, sample
       counts); over-long names and stacks are truncated and counted;
    4. clock: the batch may not reach further ahead of its rank's clock (per signal, per
       (job, rank) whichever pid sends) than ``max_clock_jump_s`` plus the wall time since
       that rank's last batch. A rank's first batch of a signal is held to the processor's
       wall clock (live collectors stamp ``time.time_ns``); with ``live_clock=False``
       (``replay``'s private processor: each trace has its own clock) it sets the clock;
    5. sequence: a batch is a duplicate only when these exact bytes (seq included) were
       received from its sender (a re-sent batch is byte-identical: the exporter keeps
       the bytes it wrote), so no forged, corrupt or far-jumped seq can make a real
       batch look like one; a seq more than ``max_seq_gap`` past the sender's highest is
       refused, and nothing moves that highest down, so no bad batch makes the real
       sender's next seq look far ahead either.
    """

    def __init__(self, metrics: SelfMetrics, limits: IngestLimits | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.metrics = metrics
        self.limits = limits or IngestLimits()
        self._streams: dict[tuple[str, int, int], _StreamState] = {}
        self._clocks: dict[tuple[str, int], _RankClock] = {}
        self._seen: dict[int, None] = {}  # digests of recent batches with a seq, oldest first
        # validated Resources by their wire bytes: a sender's identity repeats on every batch,
        # so it is built once, not per batch (bounded like the stream tables)
        self._resources: dict[bytes, Resource] = {}
        self._clock = clock
        self._wall_ns = wall_ns
        self._lock = threading.Lock()

    def decode(self, raw: bytes) -> Decoded:
        try:
            b = telemetry_pb2.TelemetryBatch.FromString(raw)
        except (DecodeError, RuntimeError, ValueError) as e:
            raise BadInput("malformed", f"not a TelemetryBatch: {e}", raw) from None
        res = self._resource(b)
        signal = b.WhichOneof("payload")
        if signal is None and not b.final:
            raise BadInput("empty", "batch carries no payload", raw)
        lim = self.limits
        if b.sent_unix_ns > lim.max_timestamp_ns:
            raise BadInput("timestamp", f"sent_unix_ns {b.sent_unix_ns} beyond {lim.max_timestamp_ns}")
        end = 0
        if signal is None:
            payload, n = None, 0
        elif signal == Signal.KERNELS:
            payload, n, end = self._kernels(b.kernels)
        elif signal == Signal.PHASES:
            payload, n, end = self._phases(b.phases.phases)
        elif signal == Signal.ITERATIONS:
            payload, n, end = self._iterations(b.iterations.marks)
        elif signal == Signal.COLLECTIVES:  # processor/collectives.py
            try:
                payload, n, end = collectives.validate(b.collectives, res.world_size, lim.max_timestamp_ns,
                                                       self.metrics)
            except ValueError as e:
                raise BadInput("empty", str(e), raw) from None
        else:
            payload, n, end = self._stacks(b.stacks.snapshots)
        digest = self._admit(res, signal, end, b.seq, raw)
        return Decoded(res, signal or "final", payload, n, len(raw), b.sent_unix_ns,
                       min(b.dropped_total, 2**53), b.seq, digest, end)

    def _resource(self, b: telemetry_pb2.TelemetryBatch) -> Resource:
        if not b.HasField("resource") or not b.resource.job_id:
            raise BadInput("resource", "batch has no resource or no job_id")
        r = b.resource
        lim = self.limits
        if len(r.job_id) > lim.max_name_chars:
            raise BadInput("resource", f"job_id of {len(r.job_id)} chars (limit {lim.max_name_chars})")
        if not 1 <= r.world_size <= lim.max_world_size:
            raise BadInput("world_size", f"world_size {r.world_size} outside 1..{lim.max_world_size}")
        if not 0 <= r.rank < r.world_size:
            raise BadInput("unknown_rank", f"rank {r.rank} outside world of {r.world_size}")
        key = r.SerializeToString()
        res = self._resources.get(key)
        if res is None:
            res = Resource.from_pb(r)
            with self._lock:
                if len(self._resources) >= min(self.limits.max_streams_tracked, 16384):
                    self._resources.pop(next(iter(self._resources)), None)  # oldest first
                self._resources[key] = res
        return res

    def release(self, d: Decoded) -> None:
        """Forget that ``d`` was received (it was refused after validation: it will come again)."""
        if not d.seq:
            return
        with self._lock:
            self._seen.pop(d.digest, None)

    def _bounded(self, table: dict, key, make):
        st = table.get(key)
        if st is None:
            if len(table) >= self.limits.max_streams_tracked:
                table.pop(next(iter(table)))  # oldest first: dicts keep order
            st = table[key] = make()
        return st

    def _reference(self, now: float) -> tuple[int, float] | None:
        """What a rank's first batch of a signal is held to: the processor's wall clock for live
        senders; nothing for replayed traces, whose clocks are their own."""
        return (self._wall_ns(), now) if self.limits.live_clock else None

    def _admit(self, res: Resource, signal: str | None, end: int, seq: int, raw: bytes) -> int:
        """Steps 4 and 5: check clock and seq against the rank and the sender, then commit both
        (or neither); returns the batch's digest (0 without a seq)."""
        lim = self.limits
        key = (res.job_id, res.rank, res.pid)
        now = self._clock()
        digest = hash(raw) if seq else 0  # raw holds resource and seq: equal bytes, same sender and seq
        with self._lock:
            st = self._bounded(self._streams, key, _StreamState)
            ck = self._bounded(self._clocks, (res.job_id, res.rank), _RankClock)
            rebase = False
            if signal is not None and end:
                prev = ck.clock.get(signal) or self._reference(now)
                if prev is not None:
                    allowed = prev[0] + lim.max_clock_jump_ns + int(max(0.0, now - prev[1]) * 1e9)
                    if end > allowed:
                        run = ck.jumps.setdefault(signal, [])
                        if run and abs(end - run[-1]) > lim.max_clock_jump_ns:
                            run.clear()  # jumps that disagree with each other are not a new clock
                        run.append(end)
                        if len(run) < lim.clock_reset_after:
                            raise BadInput("clock_jump",
                                           f"rank {res.rank} {signal} reach {(end - prev[0]) / 1e9:.0f} s "
                                           f"ahead of its clock (limit {lim.max_clock_jump_s:g} s)", raw)
                        rebase = True
            if seq:
                if digest in self._seen:
                    raise BadInput("duplicate", f"seq {seq} already received from {key}", raw)
                top = st.max_seq
                if top and seq > top + lim.max_seq_gap:
                    raise BadInput("seq_jump", f"seq {seq} is more than {lim.max_seq_gap} past {top}", raw)
                st.max_seq = max(top, seq)  # one far behind is a restarted sender: accepted, max kept
                self._seen[digest] = None
                if len(self._seen) > lim.max_batches_remembered:
                    del self._seen[next(iter(self._seen))]
            if signal is not None and end:
                if rebase:
                    self.metrics.inc("clock_rebased")
                    ck.clock[signal] = (end, now)
                else:
                    ck.clock[signal] = (max(end, ck.clock.get(signal, (0, 0.0))[0]), now)
                ck.jumps.pop(signal, None)
            return digest

    def _name(self, name: str, what: str) -> str:
        if len(name) > self.limits.max_name_chars:
            self.metrics.inc("records_truncated", 1, what=what)
            return name[: self.limits.max_name_chars]
        return name

    def _kernels(self, m: telemetry_pb2.KernelBatch) -> tuple[KernelColumns, int, int]:
        lim = self.limits
        if len(m.names) > lim.max_names_per_batch:
            raise BadInput("names", f"string table of {len(m.names)} names (limit {lim.max_names_per_batch})")
        cols = KernelColumns.from_pb(m)
        if not len(cols):
            raise BadInput("empty", "kernel batch with no records")
        if any(len(n) > lim.max_name_chars for n in cols.names):
            cols = dataclasses.replace(cols, names=tuple(self._name(n, "kernel_name") for n in cols.names))
        # fast path, one pass each: duration - 1 wraps 0 to 2**64 - 1, so one max checks both
        # bounds of the durations; start alone first (start + duration near 2**64 would wrap)
        start_hi = np.uint64(lim.max_timestamp_ns - MAX_RECORD_NS)
        if (int((cols.duration_ns - _ONE).max()) < MAX_RECORD_NS
                and int(cols.start_ns.max()) <= start_hi):
            return cols, len(cols), int((cols.start_ns + cols.duration_ns).max())
        bad_dur = (cols.duration_ns == 0) | (cols.duration_ns > MAX_RECORD_NS)
        bad_ts = (cols.start_ns > start_hi) & ~bad_dur
        bad = bad_dur | bad_ts
        nbad = int(bad.sum())
        if nbad:
            if bad_dur.any():
                self.metrics.inc("records_rejected", int(bad_dur.sum()), reason="duration")
            if bad_ts.any():
                self.metrics.inc("records_rejected", int(bad_ts.sum()), reason="timestamp")
            if nbad == len(cols):
                raise BadInput("duration" if bad_dur.any() else "timestamp",
                               f"all {nbad} kernel records have absurd durations or timestamps")
            cols = cols.take(~bad)
        end = int((cols.start_ns + cols.duration_ns).max())
        return cols, len(cols), end

    def _ts_ok(self, *values: int) -> bool:
        return all(v <= self.limits.max_timestamp_ns - MAX_RECORD_NS for v in values)

    def _phases(self, phases) -> tuple[tuple, int, int]:
        good, end = [], 0
        for ph in phases:
            if not ph.name:
                self.metrics.inc("records_rejected", 1, reason="phase_name")
            elif not 0 < ph.duration_ns <= MAX_RECORD_NS:
                self.metrics.inc("records_rejected", 1, reason="duration")
            elif not self._ts_ok(ph.start_ns):
                self.metrics.inc("records_rejected", 1, reason="timestamp")
            elif ph.iteration > self.limits.max_iteration:
                self.metrics.inc("records_rejected", 1, reason="iteration")
            else:
                if len(ph.name) > self.limits.max_name_chars:
                    ph.name = self._name(ph.name, "phase_name")
                good.append(ph)
                end = max(end, ph.start_ns + ph.duration_ns)
        if not good:
            raise BadInput("empty", "phase batch with no valid records")
        return tuple(good), len(good), end

    def _iterations(self, marks) -> tuple[tuple, int, int]:
        good, end = [], 0
        for m in marks:
            if m.end_ns < m.start_ns or not 0 < m.end_ns - m.start_ns <= MAX_RECORD_NS:
                self.metrics.inc("records_rejected", 1, reason="duration")
            elif not self._ts_ok(m.start_ns, m.end_ns):
                self.metrics.inc("records_rejected", 1, reason="timestamp")
            elif m.iteration > self.limits.max_iteration:
                self.metrics.inc("records_rejected", 1, reason="iteration")
            else:
                good.append(m)
                end = max(end, m.end_ns)
        if not good:
            raise BadInput("empty", "iteration batch with no valid records")
        return tuple(good), len(good), end

    def _stacks(self, snapshots) -> tuple[tuple, int, int]:
        lim = self.limits
        good, end = [], 0
        for s in snapshots:
            if (s.window_end_ns < s.window_start_ns or not self._ts_ok(s.window_start_ns, s.window_end_ns)):
                self.metrics.inc("records_rejected", 1, reason="timestamp")
                continue
            if s.samples > lim.max_stack_samples or any(fs.count > lim.max_stack_samples for fs in s.stacks):
                self.metrics.inc("records_rejected", 1, reason="samples")
                continue
            for fs in s.stacks:
                if len(fs.stack) > lim.max_stack_chars:
                    # keep the leaf end: the innermost frames say what the rank waits in
                    fs.stack = fs.stack[-lim.max_stack_chars:]
                    self.metrics.inc("records_truncated", 1, what="stack")
            good.append(s)
            end = max(end, s.window_end_ns)
        if not good:
            raise BadInput("empty", "stack batch with no valid snapshots")
        return tuple(good), len(good), end


def _peer(context) -> str:
    try:
        return context.peer()
    except Exception:
        return "?"


class IngestServicer:
    """The ``trainscope.v1.Ingest`` service: validates and forwards each message."""

    def __init__(self, accept: Callable[[Decoded], bool], metrics: SelfMetrics,
                 limits: IngestLimits | None = None, *, stream_idle_s: float = 10.0,
                 stream_max_s: float = 300.0, stream_max_malformed: int = 32,
                 security: ServerSecurity | None = None, durability: Durability | None = None) -> None:
        self._accept = accept
        self.security = security or ServerSecurity()
        self.durability = durability or Durability()
        self.metrics = metrics
        self.validator = Validator(metrics, limits)
        self._warn = RateLimitedLog(log)
        # Each open stream holds a handler thread: one that has no batch accepted for stream_idle_s
        # (idle, stalled, or trickling garbage), or that is open longer than stream_max_s (a
        # collector's stream ends within its confirm interval + max(5 s, it) + 5 s: 12 s by
        # default), is cancelled, so such senders cannot starve the real collectors.
        self.stream_idle_s = stream_idle_s
        self.stream_max_s = stream_max_s
        self.stream_max_malformed = stream_max_malformed
        self._open: dict[int, list] = {}   # id -> [context, last accepted batch, opened (monotonic)]
        self._open_lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        self._closed = threading.Event()

    def _reap(self) -> None:
        while not self._closed.wait(min(1.0, self.stream_idle_s / 4)):
            now = time.monotonic()
            with self._open_lock:
                idle = [c for c, last, _ in self._open.values() if now - last > self.stream_idle_s]
                old = [c for c, last, t0 in self._open.values()
                       if now - t0 > self.stream_max_s and now - last <= self.stream_idle_s]
            for ctx in idle:
                self.metrics.inc("streams_idle_closed")
                self._warn.warning("idle_stream", "closed an ingest stream from %s: no batch accepted for %.0f s",
                                   _peer(ctx), self.stream_idle_s)
                ctx.cancel()
            for ctx in old:
                self.metrics.inc("streams_cut", reason="lifetime")
                self._warn.warning("old_stream", "closed an ingest stream from %s open for over %.0f s",
                                   _peer(ctx), self.stream_max_s)
                ctx.cancel()

    def close(self) -> None:
        self._closed.set()

    def _track(self, context) -> int:
        key = id(context)
        with self._open_lock:
            now = time.monotonic()
            self._open[key] = [context, now, now]
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="ingest-reaper", daemon=True)
                self._reaper.start()
            self.metrics.set("open_streams", len(self._open))
        return key

    def _untrack(self, key: int) -> None:
        with self._open_lock:
            self._open.pop(key, None)
            self.metrics.set("open_streams", len(self._open))

    def Stream(self, request_iterator, context) -> telemetry_pb2.IngestSummary:
        md = dict(context.invocation_metadata())
        if self.security.token is not None:
            # constant-time comparison (proto/security.py); the token itself is never logged
            header = md.get(AUTH_METADATA)
            if not self.security.authorized(header):
                self.metrics.inc("auth_rejected", endpoint="ingest")
                self._warn.warning("unauthenticated", "refused an ingest stream from %s: %s bearer token",
                                   _peer(context), "wrong" if header else "no")
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        self.metrics.inc("streams")
        # first thing on every stream: who we are, so an exporter knows before it sends
        # anything whether we are the process it sent to before (processor/durability.py)
        context.send_initial_metadata(((BOOT_METADATA, self.durability.boot_id),) if self.durability.enabled else ())
        key = self._track(context)
        try:
            return self._stream(request_iterator, context, key, md.get(SENDER_METADATA, ""),
                                md.get(REPLAY_METADATA) == "1")
        finally:
            self._untrack(key)

    def _stream(self, request_iterator, context, key: int, sender: str = "",
                replay: bool = False) -> telemetry_pb2.IngestSummary:
        s = telemetry_pb2.IngestSummary()
        dur = self.durability
        entry = self._open.get(key)
        malformed = 0
        drops_seen: dict[tuple[str, int], int] = {}  # (job, rank) -> dropped_total set in this stream
        for raw in request_iterator:
            try:
                d = self.validator.decode(raw)
            except BadInput as e:
                s.batches_rejected += 1
                s.rejected_by_reason[e.reason] += 1
                self.metrics.inc("batches_rejected", reason=e.reason)
                self._warn.warning(e.reason, "rejected batch from %s: %s", _peer(context), e)
                malformed = malformed + 1 if e.reason == "malformed" else 0
                if malformed >= self.stream_max_malformed:  # no collector writes such bytes
                    self.metrics.inc("streams_cut", reason="malformed")
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"{malformed} messages in a row are not TelemetryBatch messages")
                continue
            malformed = 0
            if entry is not None:  # only an accepted batch is activity: trickled garbage is not
                entry[1] = time.monotonic()
            if replay and d.seq:
                until = dur.stored_until.get((d.resource.job_id, d.resource.rank))
                if until is not None:
                    d, n = drop_stored(d, until)
                    if n:
                        self.metrics.inc("records_rejected", n, reason="already_stored")
                    if d is None:  # all in windows the store holds: delivered, nothing to do
                        s.batches_accepted += 1
                        continue
            if not self._accept(d):
                # Back-pressure, not loss: end the stream with RESOURCE_EXHAUSTED, which the
                # exporter retries with everything this stream carried (what was accepted
                # before comes back as duplicates and is dropped once); this batch's seq is
                # released so that its resend is not taken for a duplicate.
                self.validator.release(d)
                self.metrics.inc("batches_rejected", reason="overloaded")
                self._warn.warning("overloaded", "refused a stream: processing queue full (back-pressure)")
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "processor overloaded: queue full, retry later")
            s.batches_accepted += 1
            s.records_accepted += d.records
            dur.admitted(sender, d.seq, d.resource.job_id, d.resource.rank, d.end_ns)
            if d.signal == "final":
                continue
            self.metrics.inc("batches_in", signal=d.signal)
            self.metrics.inc("events_in", d.records, signal=d.signal)
            self.metrics.inc("bytes_in", d.nbytes, signal=d.signal)
            # a running total; re-sent batches carry older values, so keep the highest (set once
            # per stream and rank, and again when it grows: the same value again changes nothing)
            rk = (d.resource.job_id, d.resource.rank)
            if drops_seen.get(rk, -1) < d.dropped_total:
                if len(drops_seen) >= 4096:  # a stream carrying ever more ranks: stay bounded
                    drops_seen.clear()
                drops_seen[rk] = d.dropped_total
                self.metrics.set_max("collector_dropped", d.dropped_total, job=d.resource.job_id,
                                     rank=str(d.resource.rank))
            if d.sent_unix_ns:
                lag = (time.time_ns() - d.sent_unix_ns) / 1e9
                if math.isfinite(lag):
                    self.metrics.set("lag_seconds", lag, signal=d.signal)
        if sender:
            s.durable_seq = dur.durable_seq(sender)
        return s

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(INGEST_SERVICE, {
            "Stream": grpc.stream_unary_rpc_method_handler(
                self.Stream,
                request_deserializer=None,  # raw bytes: parsed in Validator.decode
                response_serializer=telemetry_pb2.IngestSummary.SerializeToString,
            ),
        })

