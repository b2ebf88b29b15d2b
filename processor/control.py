"""The processor's leg of the deep-dive control path (issue #14, ``proto/v1/control.proto``).

analyzer / ``trainscope profile`` ──Request──► processor (one per host) ──Subscribe──► collectors

The ``trainscope.v1.Control`` service sits on the processor's gRPC port beside
``Ingest``, behind the same TLS and bearer token:

1. ``Subscribe`` (server stream, opened by each collector: the training process
   listens on no port): the collector's ``ControlHello`` registers it under its
   (job, rank); commands for its job are written to the stream. A stream ends
   after ``stream_max_s`` (the collector reconnects at once), and at most
   ``max_subscribers`` are open: each holds one of the server's handler threads.
2. Latest iteration. Every validated iteration batch of the ingest stream is
   looked at (:meth:`ControlHub.observe`, O(marks)): the job's highest
   iteration number and its recent iteration times.
3. ``Request`` (analyzer → processor): one window at a time per job, and a
   cool-down after the last one ended. The start iteration is the request's
   (a second processor of a multi-host job is given the first one's), else the
   latest seen + a lead that covers the telemetry's delay: max(``lead_iterations``,
   ceil(``lead_s`` / median iteration time)) (EROICA §4.1: "the start set a few
   steps ahead to ensure no worker would miss it"). A duration is converted into
   iterations by the median iteration time, so every rank closes at the same
   boundary too. Iterations, duration and bytes are capped. The command goes to
   every subscribed collector of the job on this host (or the ranks asked for).
4. ``Report`` (collector → processor): each rank's outcome, iterations and
   trace path are kept with the deep dive and written to ``manifest.json`` in
   its trace directory (0600): what the analysis (``localize_traces``) and
   ``trainscope query deep-dive`` read. A worker thread here (not the training
   process: parsing a 5 MB trace holds a GIL for ~0.2 s) writes each trace's
   columnar summary, ``rank-<R>.summary.json`` (:func:`summarize_trace`), for a
   trace inside the dive's directory and under ``max_bytes`` only. With an uploader
   (``processor/dive_upload.py``, ``--deep-dive-url``) the trace and summary then go to object
   storage from its own worker thread, and ``manifest.json`` lists each rank's objects. A dive is complete when every rank it
   was sent to reported, or ``report_timeout_s`` after its expected end
   (then ``partial``).
5. ``Status``: the deep dives this processor knows (bounded: ``max_dives``).

The analyzer → processor leg is a unary gRPC call (:func:`request_deep_dive`), as
the processors are already gRPC servers the analyzer host can reach; with
several hosts the caller asks the first processor to pick the start iteration
and gives that to the others (:func:`request_all`).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import queue
import re
import secrets
import threading
import time
from typing import Callable, Iterable, Sequence

import grpc

from trainscope.proto import env
from trainscope.proto.contracts import (
    CONTROL_REQUEST, CONTROL_SERVICE, CONTROL_STATUS, DIVE_ID_PATTERN, Signal, Trigger)
from trainscope.proto.errors import ConfigError
from trainscope.proto.securefs import private_dir, write_private
from trainscope.proto.security import AUTH_METADATA, ClientSecurity, ServerSecurity
from trainscope.proto.v1 import control_pb2

log = logging.getLogger(__name__)

_DIVE_ID = re.compile(DIVE_ID_PATTERN)
_OUTCOME = control_pb2.DeepDiveOutcome


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ControlConfig:
    directory: str = dataclasses.field(default_factory=env.deep_dive_dir)
    """Root of the deep-dive traces on this host (the ranks write under it; manifests beside)."""
    lead_iterations: int = 3
    """Fewest iterations between the latest seen and the start of a window."""
    lead_s: float = 3.0
    """... and at least this much time at the job's pace (telemetry reaches us ~1-2 s late)."""
    default_iterations: int = 5
    """Iterations of a window when the request names neither iterations nor a duration."""
    max_iterations: int = 50
    """Cap on a window's iterations."""
    max_duration_s: float = 60.0
    """Cap on a window's wall time (the collector closes it at the first boundary past it)."""
    max_bytes: int = 256 << 20
    """Cap on one rank's trace; a larger one is removed by the collector."""
    cooldown_s: float = 60.0
    """Time after a deep dive of a job completed before another one of that job is accepted."""
    report_timeout_s: float = 60.0
    """After a window's expected end, how long missing ranks are waited for (then: partial)."""
    stream_max_s: float = 60.0
    """A Subscribe stream ends after this long; the collector reconnects at once."""
    max_subscribers: int = 32
    """Open Subscribe streams at most (each holds a gRPC handler thread)."""
    max_dives: int = 256
    """Deep dives remembered (oldest forgotten first)."""

    def __post_init__(self) -> None:
        for name in ("lead_iterations", "default_iterations", "max_iterations", "max_bytes",
                     "max_subscribers", "max_dives"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ConfigError(f"control.{name}", v, "must be an integer >= 1")
        for name in ("max_duration_s", "stream_max_s", "report_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"control.{name}", getattr(self, name), "must be > 0")
        for name in ("lead_s", "cooldown_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"control.{name}", getattr(self, name), "must be >= 0")


class _Subscriber:
    __slots__ = ("job", "rank", "queue", "available")

    def __init__(self, job: str, rank: int, available: bool) -> None:
        self.job, self.rank, self.available = job, rank, available
        self.queue: queue.Queue = queue.Queue(maxsize=8)


class _JobPace:
    """A job's highest iteration seen and its recent iteration times (bounded)."""

    __slots__ = ("latest", "durations")

    def __init__(self) -> None:
        self.latest = -1
        self.durations: collections.deque = collections.deque(maxlen=64)

    def median_s(self) -> float | None:
        if not self.durations:
            return None
        d = sorted(self.durations)
        return d[len(d) // 2] / 1e9


@dataclasses.dataclass
class Dive:
    record: control_pb2.DeepDiveRecord
    directory: str
    expected_end: float   # monotonic: when the window should have ended on every rank
    done_at: float | None = None


def _chunk(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


class ControlHub:
    """Subscribers per job, the jobs' pace, the deep dives; thread-safe."""

    def __init__(self, config: ControlConfig = ControlConfig(), *, clock: Callable[[], float] = time.monotonic,
                 uploader=None) -> None:
        self.config = config
        self.uploader = uploader  # processor/dive_upload.DiveUploader: traces to object storage, or None
        if uploader is not None:
            uploader.bind(self._manifest_doc, self._write_manifest)
        self._clock = clock
        self._lock = threading.Lock()
        self._manifest_lock = threading.RLock()   # _write_manifest: snapshot and write in one order (the uploader calls back)
        self._subs: dict[str, dict[int, _Subscriber]] = {}
        self._pace: dict[str, _JobPace] = {}
        self._dives: "collections.OrderedDict[str, Dive]" = collections.OrderedDict()
        self.stats: collections.Counter[str] = collections.Counter()
        self._summaries: queue.Queue = queue.Queue(maxsize=64)
        self._summarizer: threading.Thread | None = None

    # ------------------------------------------------------------ subscribers
    def subscribe(self, hello: control_pb2.ControlHello) -> _Subscriber | None:
        """Register a collector; None when ``max_subscribers`` are open."""
        res = hello.resource
        with self._lock:
            n = sum(len(v) for v in self._subs.values())
            old = self._subs.get(res.job_id, {}).get(res.rank)
            if old is None and n >= self.config.max_subscribers:
                self.stats["subscribers_refused"] += 1
                return None
            sub = _Subscriber(res.job_id, res.rank, hello.profiler_available)
            self._subs.setdefault(res.job_id, {})[res.rank] = sub
            if old is not None:
                old.queue.put_nowait(None) if not old.queue.full() else None  # the old stream ends
        self.stats["subscribed"] += 1
        return sub

    def unsubscribe(self, sub: _Subscriber) -> None:
        with self._lock:
            job = self._subs.get(sub.job)
            if job is not None and job.get(sub.rank) is sub:
                del job[sub.rank]
                if not job:
                    del self._subs[sub.job]

    def subscribers(self, job: str) -> list[int]:
        with self._lock:
            return sorted(self._subs.get(job, {}))

    def send(self, job: str, ranks, msg: control_pb2.ControlCommand) -> list[int]:
        """Queue ``msg`` on the streams of ``job``'s subscribed ``ranks`` (any thread; never blocks):
        the stack grid's dump command (``stack_grid.py``). Returns the ranks reached."""
        with self._lock:
            return self._queue_locked(job, ranks, msg)

    def _queue_locked(self, job: str, ranks, msg: control_pb2.ControlCommand) -> list[int]:
        """``msg`` on each subscribed rank's stream (caller holds the lock); a full queue is counted."""
        reached = []
        subs = self._subs.get(job, {})
        for r in ranks:
            sub = subs.get(r)
            if sub is None:
                continue
            try:
                sub.queue.put_nowait(msg)
                reached.append(r)
            except queue.Full:
                self.stats["commands_dropped"] += 1
        return reached

    # ------------------------------------------------------------------ pace
    def observe(self, d) -> None:
        """An accepted ingest batch (``processor.ingest.Decoded``): iteration marks update the job's pace."""
        if d.signal != Signal.ITERATIONS:
            return
        job = d.resource.job_id
        with self._lock:
            pace = self._pace.get(job)
            if pace is None:
                if len(self._pace) >= 4 * self.config.max_dives:  # bounded: forget the oldest job
                    self._pace.pop(next(iter(self._pace)))
                pace = self._pace[job] = _JobPace()
            for m in d.payload:
                if m.iteration > pace.latest:
                    pace.latest = m.iteration
                if d.resource.rank == 0 or not pace.durations or len(pace.durations) < 8:
                    pace.durations.append(m.end_ns - m.start_ns)

    def latest(self, job: str) -> tuple[int, float | None]:
        with self._lock:
            p = self._pace.get(job)
            return (p.latest, p.median_s()) if p is not None else (-1, None)

    # -------------------------------------------------------------- requests
    def request(self, req: control_pb2.DeepDiveRequest) -> control_pb2.DeepDiveAck:
        """Plan a deep dive of a job and send its command to the job's collectors on this host."""
        cfg = self.config
        ack = control_pb2.DeepDiveAck()
        job = req.job_id
        latest, median_s = self.latest(job)
        ack.latest_iteration = max(latest, 0)
        if not job:
            return self._refuse(ack, "no job id")
        if req.dive_id and not _DIVE_ID.fullmatch(req.dive_id):
            return self._refuse(ack, f"bad dive id {req.dive_id!r}")
        subs = self.subscribers(job)
        if not subs:
            return self._refuse(ack, f"no collector of job {job!r} is subscribed to this processor")
        ranks = sorted(set(req.ranks) & set(subs)) if req.ranks else subs
        if not ranks:
            return self._refuse(ack, f"none of the ranks {list(req.ranks)} is subscribed here (have {subs})")
        busy = self._busy(job)
        if busy:
            return self._refuse(ack, busy)
        if req.iterations:
            n = req.iterations
        elif req.duration_s > 0:
            if median_s is None or median_s <= 0:
                return self._refuse(ack, "the job's iteration time is not known yet: ask for --iterations")
            n = math.ceil(min(req.duration_s, cfg.max_duration_s) / median_s)
        else:
            n = cfg.default_iterations
        n = _chunk(n, 1, cfg.max_iterations)
        if req.start_iteration:
            start = req.start_iteration
            if latest >= 0 and start <= latest:
                return self._refuse(ack, f"start iteration {start} is not ahead of the latest seen ({latest})")
        else:
            if latest < 0:
                return self._refuse(ack, "no iteration of this job seen yet")
            lead = cfg.lead_iterations
            if median_s:
                lead = max(lead, math.ceil(cfg.lead_s / median_s))
            start = latest + lead
        dive_id = req.dive_id or time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)
        directory = env.deep_dive_trace_dir(cfg.directory, job, dive_id)
        try:
            for d in (cfg.directory, os.path.dirname(directory), directory):  # every level 0700, ours
                private_dir(d, "control.directory")
        except (OSError, ConfigError) as e:
            return self._refuse(ack, f"cannot create {directory}: {e}")
        cmd = control_pb2.DeepDiveCommand(
            dive_id=dive_id, job_id=job, start_iteration=start, iterations=n,
            max_duration_s=cfg.max_duration_s, max_bytes=cfg.max_bytes, with_stack=True,
            trigger=req.trigger or Trigger.MANUAL, ranks=ranks if req.ranks else [])
        it_s = median_s or 1.0
        expected_end = self._clock() + (start - max(latest, 0) + n) * it_s
        rec = control_pb2.DeepDiveRecord(dive_id=dive_id, job_id=job, trigger=cmd.trigger,
                                         requested_unix_ns=time.time_ns(), start_iteration=start,
                                         iterations=n, reason=req.reason)
        msg = control_pb2.ControlCommand(sent_unix_ns=time.time_ns(), deep_dive=cmd)
        with self._lock:
            reached = self._queue_locked(job, ranks, msg)
            rec.ranks_expected.extend(reached)
            self._dives[dive_id] = Dive(rec, directory, expected_end)
            while len(self._dives) > cfg.max_dives:
                self._dives.popitem(last=False)
        self._write_manifest(dive_id)
        self.stats["requests_accepted"] += 1
        ack.accepted, ack.dive_id, ack.start_iteration, ack.iterations = True, dive_id, start, n
        ack.ranks_reached, ack.directory = len(reached), directory
        return ack

    def _refuse(self, ack, why: str):
        self.stats["requests_refused"] += 1
        ack.accepted, ack.detail = False, why
        return ack

    def _busy(self, job: str) -> str | None:
        """Why a new deep dive of ``job`` cannot start now (one at a time, then a cool-down)."""
        now = self._clock()
        with self._lock:
            dives = [d for d in self._dives.values() if d.record.job_id == job]
        for d in dives:
            self._settle(d, now)
            if not d.record.complete:
                return f"deep dive {d.record.dive_id} of this job is still running (one at a time)"
            if d.done_at is not None and now - d.done_at < self.config.cooldown_s:
                return (f"cool-down: deep dive {d.record.dive_id} ended {now - d.done_at:.0f} s ago "
                        f"(next in {self.config.cooldown_s - (now - d.done_at):.0f} s)")
        return None

    def _settle(self, d: Dive, now: float) -> None:
        rec = d.record
        if rec.complete:
            return
        got = {r.resource.rank for r in rec.reports}
        if set(rec.ranks_expected) <= got:
            rec.complete = True
        elif now > d.expected_end + self.config.report_timeout_s:
            rec.complete = rec.partial = True
        if rec.complete:
            d.done_at = now
            self._write_manifest(rec.dive_id)

    # --------------------------------------------------------------- reports
    def report(self, rep: control_pb2.DeepDiveReport) -> control_pb2.ControlAck:
        with self._lock:
            d = self._dives.get(rep.dive_id)
            if d is None or d.record.job_id != rep.resource.job_id:
                self.stats["reports_unknown"] += 1
                return control_pb2.ControlAck(ok=False, detail="unknown deep dive")
            old = [i for i, r in enumerate(d.record.reports) if r.resource.rank == rep.resource.rank]
            for i in reversed(old):
                del d.record.reports[i]
            d.record.reports.append(rep)
        self.stats["reports"] += 1
        if rep.trace_path and not rep.summary_path:
            self._summarize_later(d, rep.resource.rank, rep.trace_path)
        if rep.trace_path and self.uploader is not None:
            self._upload_later(d, rep.resource.rank, rep.trace_path)
        self._settle(d, self._clock())
        self._write_manifest(rep.dive_id)
        return control_pb2.ControlAck(ok=True)

    def _summarize_later(self, d: Dive, rank: int, trace: str) -> None:
        """Queue a trace for its columnar summary (only one inside the dive's directory, under the cap)."""
        try:
            if os.path.dirname(os.path.realpath(trace)) != os.path.realpath(d.directory):
                self.stats["summaries_refused"] += 1
                return
            if self._summarizer is None or not self._summarizer.is_alive():
                self._summarizer = threading.Thread(target=self._summarize_loop, name="deep-dive-summaries",
                                                    daemon=True)
                self._summarizer.start()
            self._summaries.put_nowait((d.record.dive_id, rank, trace))
        except (OSError, queue.Full):
            self.stats["summaries_dropped"] += 1

    def _upload_later(self, d: Dive, rank: int, trace: str) -> None:
        """Queue a rank's trace for object storage (``dive_upload.py``): only one inside the dive's directory."""
        if os.path.dirname(os.path.realpath(trace)) != os.path.realpath(d.directory):
            self.stats["uploads_refused"] += 1
            return
        self.uploader.upload(d.record.job_id, d.record.dive_id, rank, trace, "trace", d.directory)

    def _summarize_loop(self) -> None:
        while True:
            dive_id, rank, trace = self._summaries.get()
            try:
                self._summarize_one(dive_id, rank, trace)
            finally:   # after the manifest names the summary: wait_summaries means "written and said"
                self._summaries.task_done()

    def _summarize_one(self, dive_id: str, rank: int, trace: str) -> None:
        try:
            if os.path.getsize(trace) > self.config.max_bytes:
                self.stats["summaries_refused"] += 1
                return
            out = os.path.join(os.path.dirname(trace), f"rank-{rank}.summary.json")
            write_private(out, json.dumps(summarize_trace(trace)))
        except Exception as e:  # a trace we cannot parse: said in its report, never fatal
            self.stats["summary_errors"] += 1
            log.warning("deep dive %s rank %d: no summary of %s: %s", dive_id, rank, trace, e)
            return
        with self._lock:
            d = self._dives.get(dive_id)
            for r in (d.record.reports if d is not None else ()):
                if r.resource.rank == rank and r.trace_path == trace:
                    r.summary_path = out
        self.stats["summaries"] += 1
        if self.uploader is not None and d is not None:
            self.uploader.upload(d.record.job_id, dive_id, rank, out, "summary", d.directory)
        self._write_manifest(dive_id)

    def wait_summaries(self, timeout_s: float = 10.0) -> bool:
        """Tests and shutdown: wait until the queued summaries are written (bounded)."""
        deadline = time.monotonic() + timeout_s
        while self._summaries.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._summaries.unfinished_tasks

    def status(self, q: control_pb2.DeepDiveQuery) -> control_pb2.DeepDiveStatus:
        now = self._clock()
        with self._lock:
            dives = [d for d in self._dives.values()
                     if (not q.job_id or d.record.job_id == q.job_id) and (not q.dive_id or d.record.dive_id == q.dive_id)]
        for d in dives:
            self._settle(d, now)
        return control_pb2.DeepDiveStatus(dives=[d.record for d in dives])

    def _manifest_doc(self, dive_id: str) -> dict | None:
        """The manifest document of a dive this hub knows (the uploader's step 4), None when forgotten."""
        with self._lock:
            d = self._dives.get(dive_id)
            return manifest_of(d.record) if d is not None else None

    def _write_manifest(self, dive_id: str) -> None:
        # one writer at a time, from snapshot to file: the summarizer thread and a report's thread each write
        # the manifest, and a snapshot taken first but written last lost a rank's report (seen in the suite)
        with self._manifest_lock:
            with self._lock:
                d = self._dives.get(dive_id)
                if d is None:
                    return
                doc = manifest_of(d.record)
            if self.uploader is not None:  # each rank's objects (key, URL, state) beside its local trace
                doc["objects"] = self.uploader.objects(dive_id)
                self.uploader.manifest(d.record.job_id, dive_id)
            try:
                write_private(os.path.join(d.directory, "manifest.json"), json.dumps(doc, indent=1))
            except OSError as e:
                self.stats["manifest_errors"] += 1
                log.warning("deep dive %s: cannot write its manifest: %s", dive_id, e)


def summarize_trace(path: str, limit: int = 2000) -> dict:
    """Columnar summary of a Chrome trace: per (category, name) count, total and max duration (us).

    Columns are parallel lists (``cat``, ``name``, ``count``, ``total_us``, ``max_us``), the
    ``limit`` rows with the most total time first, and the ``ProfilerStep#`` iterations seen.
    """
    with open(path, "rb") as f:
        doc = json.load(f)
    agg: dict[tuple[str, str], list] = {}
    steps = set()
    for e in doc.get("traceEvents", ()) if isinstance(doc, dict) else ():
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        name, cat = str(e.get("name", "")), str(e.get("cat", ""))
        try:
            dur = float(e.get("dur", 0) or 0)
        except (TypeError, ValueError):
            continue
        if name.startswith("ProfilerStep#") and name[13:].isdigit():
            steps.add(int(name[13:]))
        a = agg.get((cat, name))
        if a is None:
            agg[(cat, name)] = [1, dur, dur]
        else:
            a[0] += 1
            a[1] += dur
            a[2] = max(a[2], dur)
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])[:limit]
    return {"cat": [k[0] for k, _ in rows], "name": [k[1] for k, _ in rows],
            "count": [v[0] for _, v in rows], "total_us": [round(v[1], 3) for _, v in rows],
            "max_us": [round(v[2], 3) for _, v in rows], "iterations": sorted(steps), "rows_total": len(agg)}


def manifest_of(rec: control_pb2.DeepDiveRecord) -> dict:
    """The JSON of a deep dive's ``manifest.json``: its plan and every rank's report."""
    return {
        "dive_id": rec.dive_id, "job": rec.job_id, "trigger": rec.trigger, "reason": rec.reason,
        "requested_unix_ns": rec.requested_unix_ns, "start_iteration": rec.start_iteration,
        "iterations": rec.iterations, "ranks_expected": list(rec.ranks_expected),
        "complete": rec.complete, "partial": rec.partial,
        "ranks": {str(r.resource.rank): {
            "host": r.resource.host, "outcome": _OUTCOME.Name(r.outcome).removeprefix("DEEP_DIVE_OUTCOME_").lower(),
            "first_iteration": r.first_iteration, "last_iteration": r.last_iteration,
            "trace": r.trace_path, "summary": r.summary_path, "trace_bytes": r.trace_bytes,
            "start_unix_ns": r.start_unix_ns, "end_unix_ns": r.end_unix_ns,
            "profiler_stop_s": r.profiler_stop_s, "detail": r.detail} for r in rec.reports},
    }


# =================================================================== the service
class ControlServicer:
    """``trainscope.v1.Control`` on the processor's gRPC server."""

    def __init__(self, hub: ControlHub, security: ServerSecurity | None = None) -> None:
        self.hub = hub
        self.security = security or ServerSecurity()
        self._closed = threading.Event()

    def close(self) -> None:
        self._closed.set()

    def _auth(self, context) -> None:
        if self.security.token is None:
            return
        header = dict(context.invocation_metadata()).get(AUTH_METADATA)
        if not self.security.authorized(header):
            self.hub.stats["auth_rejected"] += 1
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    def Subscribe(self, hello: control_pb2.ControlHello, context) -> Iterable[control_pb2.ControlCommand]:
        self._auth(context)
        if not hello.resource.job_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ControlHello without a job id")
        sub = self.hub.subscribe(hello)
        if sub is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many control streams on this processor")
        end = time.monotonic() + self.hub.config.stream_max_s
        try:
            while context.is_active() and not self._closed.is_set() and time.monotonic() < end:
                try:
                    msg = sub.queue.get(timeout=0.25)
                except queue.Empty:
                    continue
                if msg is None:  # replaced by a newer stream of the same rank
                    return
                self.hub.stats["commands_sent"] += 1
                yield msg
        finally:
            self.hub.unsubscribe(sub)

    def Report(self, rep, context):
        self._auth(context)
        return self.hub.report(rep)

    def Request(self, req, context):
        self._auth(context)
        return self.hub.request(req)

    def Status(self, q, context):
        self._auth(context)
        return self.hub.status(q)

    def handler(self) -> grpc.GenericRpcHandler:
        pb = control_pb2
        return grpc.method_handlers_generic_handler(CONTROL_SERVICE, {
            "Subscribe": grpc.unary_stream_rpc_method_handler(
                self.Subscribe, request_deserializer=pb.ControlHello.FromString,
                response_serializer=pb.ControlCommand.SerializeToString),
            "Report": grpc.unary_unary_rpc_method_handler(
                self.Report, request_deserializer=pb.DeepDiveReport.FromString,
                response_serializer=pb.ControlAck.SerializeToString),
            "Request": grpc.unary_unary_rpc_method_handler(
                self.Request, request_deserializer=pb.DeepDiveRequest.FromString,
                response_serializer=pb.DeepDiveAck.SerializeToString),
            "Status": grpc.unary_unary_rpc_method_handler(
                self.Status, request_deserializer=pb.DeepDiveQuery.FromString,
                response_serializer=pb.DeepDiveStatus.SerializeToString),
        })


# ==================================================================== the client
def _call(target: str, method: str, msg, resp_type, *, security: ClientSecurity | None = None,
          timeout_s: float = 10.0):
    sec = security if security is not None else ClientSecurity.from_env()
    channel = sec.channel(target)
    try:
        rpc = channel.unary_unary(method, request_serializer=type(msg).SerializeToString,
                                  response_deserializer=resp_type.FromString)
        return rpc(msg, metadata=tuple(sec.metadata() or ()), timeout=timeout_s)
    finally:
        channel.close()


def request_deep_dive(target: str, req: control_pb2.DeepDiveRequest, **kw) -> control_pb2.DeepDiveAck:
    """Ask one processor for a deep dive (raises ``grpc.RpcError`` when it cannot be reached)."""
    return _call(target, CONTROL_REQUEST, req, control_pb2.DeepDiveAck, **kw)


def request_all(targets: Sequence[str], req: control_pb2.DeepDiveRequest, **kw) -> list:
    """One deep dive over several hosts' processors: the first picks the start iteration and the id,
    the others are given both, so every rank of the job opens its window at the same boundary."""
    acks = []
    for i, t in enumerate(targets):
        r = control_pb2.DeepDiveRequest()
        r.CopyFrom(req)
        if i and acks and acks[0].accepted:
            r.start_iteration, r.dive_id, r.iterations = acks[0].start_iteration, acks[0].dive_id, acks[0].iterations
        acks.append(request_deep_dive(t, r, **kw))
    return acks


def deep_dive_status(target: str, job_id: str = "", dive_id: str = "", **kw) -> control_pb2.DeepDiveStatus:
    return _call(target, CONTROL_STATUS, control_pb2.DeepDiveQuery(job_id=job_id, dive_id=dive_id),
                 control_pb2.DeepDiveStatus, **kw)


__all__ = ["ControlConfig", "ControlHub", "ControlServicer", "deep_dive_status", "manifest_of",
           "request_all", "request_deep_dive", "summarize_trace"]
