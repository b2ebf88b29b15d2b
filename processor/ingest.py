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
  confirm) are recognised by (job, rank, pid, seq) and dropped once.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.contracts import Signal
from trainscope.proto.errors import BadInput
from trainscope.proto.model import Resource
from trainscope.proto.v1 import telemetry_pb2

log = logging.getLogger(__name__)

SERVICE = "trainscope.v1.Ingest"
#: Longest plausible single record: a kernel or phase longer than this is a
#: corrupt timestamp (e.g. a negative value cast to unsigned), not a slowdown.
MAX_RECORD_NS = 24 * 3600 * 10**9


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


class Validator:
    """Turns raw bytes into ``Decoded`` or raises ``BadInput``; counts record-level rejects."""

    def __init__(self, metrics: SelfMetrics, *, max_dedup_entries: int = 100_000) -> None:
        self.metrics = metrics
        self._last_seq: dict[tuple[str, int, int], int] = {}
        self._max_dedup = max_dedup_entries
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
        self._dedup(res, b.seq, raw)
        if signal is None:
            return Decoded(res, "final", None, 0, len(raw), b.sent_unix_ns, b.dropped_total)
        if signal == Signal.KERNELS:
            payload, n = self._kernels(b.kernels)
        elif signal == Signal.PHASES:
            payload, n = self._phases(b.phases.phases)
        elif signal == Signal.ITERATIONS:
            payload, n = self._iterations(b.iterations.marks)
        else:
            payload, n = tuple(b.stacks.snapshots), len(b.stacks.snapshots)
        return Decoded(res, signal, payload, n, len(raw), b.sent_unix_ns, b.dropped_total)

    def _resource(self, b: telemetry_pb2.TelemetryBatch) -> Resource:
        if not b.HasField("resource") or not b.resource.job_id:
            raise BadInput("resource", "batch has no resource or no job_id")
        r = b.resource
        if r.world_size < 1:
            raise BadInput("resource", f"world_size {r.world_size} < 1")
        if not 0 <= r.rank < r.world_size:
            raise BadInput("unknown_rank", f"rank {r.rank} outside world of {r.world_size}")
        return Resource.from_pb(r)

    def _dedup(self, res: Resource, seq: int, raw: bytes) -> None:
        if not seq:
            return
        key = (res.job_id, res.rank, res.pid)
        with self._lock:
            last = self._last_seq.get(key, 0)
            if seq <= last:
                raise BadInput("duplicate", f"seq {seq} already received from {key}", raw)
            if len(self._last_seq) >= self._max_dedup and key not in self._last_seq:
                self._last_seq.pop(next(iter(self._last_seq)))
            self._last_seq[key] = seq

    def _kernels(self, m: telemetry_pb2.KernelBatch) -> tuple[KernelColumns, int]:
        cols = KernelColumns.from_pb(m)
        if not len(cols):
            raise BadInput("empty", "kernel batch with no records")
        bad = (cols.duration_ns == 0) | (cols.duration_ns > MAX_RECORD_NS)
        nbad = int(bad.sum())
        if nbad:
            self.metrics.inc("records_rejected", nbad, reason="duration")
            if nbad == len(cols):
                raise BadInput("duration", f"all {nbad} kernel durations are zero or absurd")
            cols = cols.take(~bad)
        return cols, len(cols)

    def _phases(self, phases) -> tuple[tuple, int]:
        good = []
        for ph in phases:
            if not ph.name:
                self.metrics.inc("records_rejected", 1, reason="phase_name")
            elif not 0 < ph.duration_ns <= MAX_RECORD_NS:
                self.metrics.inc("records_rejected", 1, reason="duration")
            else:
                good.append(ph)
        if not good:
            raise BadInput("empty", "phase batch with no valid records")
        return tuple(good), len(good)

    def _iterations(self, marks) -> tuple[tuple, int]:
        good = []
        for m in marks:
            if not 0 < m.end_ns - m.start_ns <= MAX_RECORD_NS or m.end_ns < m.start_ns:
                self.metrics.inc("records_rejected", 1, reason="duration")
            else:
                good.append(m)
        if not good:
            raise BadInput("empty", "iteration batch with no valid records")
        return tuple(good), len(good)


class IngestServicer:
    """The ``trainscope.v1.Ingest`` service: validates and forwards each message."""

    def __init__(self, accept: Callable[[Decoded], bool], metrics: SelfMetrics) -> None:
        self._accept = accept
        self.metrics = metrics
        self.validator = Validator(metrics)

    def Stream(self, request_iterator, context) -> telemetry_pb2.IngestSummary:
        self.metrics.inc("streams")
        s = telemetry_pb2.IngestSummary()
        for raw in request_iterator:
            try:
                d = self.validator.decode(raw)
            except BadInput as e:
                s.batches_rejected += 1
                s.rejected_by_reason[e.reason] += 1
                self.metrics.inc("batches_rejected", reason=e.reason)
                log.debug("rejected batch: %s", e)
                continue
            if not self._accept(d):
                s.batches_rejected += 1
                s.rejected_by_reason["overloaded"] += 1
                self.metrics.inc("batches_rejected", reason="overloaded")
                continue
            s.batches_accepted += 1
            s.records_accepted += d.records
            if d.signal == "final":
                continue
            self.metrics.inc("batches_in", signal=d.signal)
            self.metrics.inc("events_in", d.records, signal=d.signal)
            self.metrics.inc("bytes_in", d.nbytes, signal=d.signal)
            # a running total; re-sent batches carry older values, so keep the highest
            self.metrics.set_max("collector_dropped", d.dropped_total, job=d.resource.job_id,
                                 rank=str(d.resource.rank))
            if d.sent_unix_ns:
                lag = (time.time_ns() - d.sent_unix_ns) / 1e9
                if math.isfinite(lag):
                    self.metrics.set("lag_seconds", lag, signal=d.signal)
        return s

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Stream": grpc.stream_unary_rpc_method_handler(
                self.Stream,
                request_deserializer=None,  # raw bytes: parsed in Validator.decode
                response_serializer=telemetry_pb2.IngestSummary.SerializeToString,
            ),
        })

