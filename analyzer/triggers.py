"""When to open a deep dive (issue #14): EROICA §4.1's triggers over the analyzer's verdicts.

A :class:`DeepDiveTriggers` is a ``DiagnosisSink``: it sees every verdict the
analyzer publishes (per job and window: the window's step time, the state, the
suspects) and decides, per job:

1. Degradation (EROICA §4.1 (1): "the average duration of the recent N
   iterations exceeds the recent shortest iteration time by more than 5 %").
   A window's step (``Verdict.step_s``, the mean over its iterations, so an
   average of ~10 iterations, not one) against the shortest window step of the
   last ``baseline_windows``; a window at or over ``1 + degradation`` times
   it is degraded, and ``sustain_windows`` degraded windows in a row fire
   (a single slow window is noise). Partial windows and windows without a step
   are not judged; the first ``min_windows`` only fill the baseline.
2. Stall (EROICA §4.1 (2): no iteration for 5x the mean): the first verdict
   of a stall (state ``stalled``) fires. The window opens only when iterations
   resume (a window starts at an iteration boundary); for a hang that never
   resumes the deep dive ends partial, and L5's stacks name the stuck frame.
3. Verdict (ARGUS §6.3: L4 confirms what L1-L3 named): the first verdict that
   names a suspect (culprit or link, not a waiter) fires, with the suspects
   in the reason.
4. Gates: one deep dive per job at a time (until the processor answered and
   the window's expected end passed), then ``cooldown_s`` before the next
   (the processor enforces both too); at most ``max_jobs`` jobs remembered.
5. Every decision is counted, ``trainscope_deep_dive_triggers_total{trigger,
   decision}``: ``fired``, ``cooldown``, ``busy``, ``disabled`` (no control path
   configured), then the outcome of the request: ``sent``, ``refused``,
   ``unreachable``, ``dropped`` (the request queue was full).
Requests go out on a daemon thread (``sender``: by default
``processor.control.request_all`` to the job's processors), never on the
analysis thread.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Iterator, Sequence

from trainscope.analyzer.model import MISSING, WAITER
from trainscope.proto.contracts import Trigger
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import control_pb2, records_pb2

log = logging.getLogger(__name__)

STALLED = "stalled"   # Verdict.state of a stall (merge.py)
DECISIONS = ("fired", "cooldown", "busy", "disabled", "sent", "refused", "unreachable", "dropped")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TriggerConfig:
    degradation: float = 0.05
    """A window this much slower than the recent shortest window step is degraded (EROICA: 5 %)."""
    baseline_windows: int = 30
    """Windows over which the shortest step is taken."""
    min_windows: int = 5
    """Windows seen before the degradation trigger judges any."""
    sustain_windows: int = 3
    """Degraded windows in a row that fire."""
    on_stall: bool = True
    """Fire on the first verdict of a stall."""
    on_verdict: bool = True
    """Fire on the first verdict naming a suspect."""
    iterations: int = 5
    """Iterations a triggered window covers."""
    cooldown_s: float = 600.0
    """After a deep dive of a job fired, the next one waits this long."""
    busy_s: float = 120.0
    """A fired deep dive counts as running this long (the processor also refuses a second one)."""
    max_jobs: int = 1000
    """Jobs remembered (least recently seen forgotten)."""

    def __post_init__(self) -> None:
        if not 0 < self.degradation < 10:
            raise ConfigError("triggers.degradation", self.degradation, "must be in (0, 10)")
        for f in ("baseline_windows", "min_windows", "sustain_windows", "iterations", "max_jobs"):
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise ConfigError(f"triggers.{f}", v, "must be an integer >= 1")
        if self.sustain_windows > self.baseline_windows:
            raise ConfigError("triggers.sustain_windows", self.sustain_windows, "must be <= baseline_windows")
        for f in ("cooldown_s", "busy_s"):
            if not getattr(self, f) >= 0:
                raise ConfigError(f"triggers.{f}", getattr(self, f), "must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """One trigger that fired for a job: what and why (the request follows it)."""

    job_id: str
    trigger: str
    reason: str
    window: int
    suspects: tuple[int, ...] = ()


class _JobState:
    __slots__ = ("steps", "degraded_run", "stalled", "named", "fired_at", "seen")

    def __init__(self, n: int) -> None:
        self.steps: collections.deque = collections.deque(maxlen=n)
        self.degraded_run = 0
        self.stalled = False
        self.named = False
        self.fired_at: float | None = None
        self.seen = 0.0


Sender = Callable[[control_pb2.DeepDiveRequest], Sequence[control_pb2.DeepDiveAck]]


class DeepDiveTriggers:
    """The triggers as a ``DiagnosisSink`` (and a Prometheus collector of their decisions)."""

    name = "deep-dive-triggers"

    def __init__(self, config: TriggerConfig = TriggerConfig(), *, sender: Sender | None = None,
                 clock: Callable[[], float] = time.monotonic, max_queue: int = 16) -> None:
        self.config = config
        self.sender = sender
        self._clock = clock
        self._jobs: "collections.OrderedDict[str, _JobState]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.fired: collections.deque[Decision] = collections.deque(maxlen=256)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ DiagnosisSink
    def publish(self, diagnoses, verdict: records_pb2.Verdict | None) -> None:
        if verdict is None:
            return
        for d in self.observe(verdict):
            self._request(d)

    def close(self) -> None:
        if self._thread is not None:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass
            self._thread.join(timeout=5.0)
            self._thread = None

    # ---------------------------------------------------------------- decisions
    def observe(self, v: records_pb2.Verdict) -> list[Decision]:
        """Steps 1-4 for one verdict; returns the decisions that fired (already counted)."""
        cfg = self.config
        st = self._job(v.job_id)
        candidates: list[Decision] = []
        # 2. stall: the first verdict of a stall
        stalled = v.state == STALLED
        if stalled and not st.stalled and cfg.on_stall:
            candidates.append(Decision(v.job_id, Trigger.STALL, "no iteration for 5x the mean iteration time",
                                       v.window.index, tuple(s.rank for s in v.ranks)))
        st.stalled = stalled
        # 3. verdict: the first naming a suspect that is not a waiter
        named = tuple(s.rank for s in v.ranks if s.role not in (WAITER, MISSING))
        if named and not st.named and cfg.on_verdict and not stalled:
            candidates.append(Decision(v.job_id, Trigger.VERDICT,
                                       f"verdict names rank(s) {', '.join(map(str, named[:8]))}",
                                       v.window.index, named))
        st.named = bool(named)
        # 1. degradation: sustained over the recent shortest window step
        if v.step_s > 0 and not v.partial and not stalled:
            st.steps.append(v.step_s)
            if len(st.steps) >= cfg.min_windows:
                best = min(st.steps)
                if v.step_s >= (1 + cfg.degradation) * best:
                    st.degraded_run += 1
                else:
                    st.degraded_run = 0
                if st.degraded_run >= cfg.sustain_windows:
                    st.degraded_run = 0
                    candidates.append(Decision(
                        v.job_id, Trigger.DEGRADATION,
                        f"step {v.step_s * 1e3:.1f} ms is {100 * (v.step_s / best - 1):.1f} % over the recent "
                        f"shortest {best * 1e3:.1f} ms for {cfg.sustain_windows} windows", v.window.index))
        # 4. gates: one at a time, then the cool-down; the first candidate is the one kept
        out = []
        now = self._clock()
        for d in candidates:
            if st.fired_at is not None and now - st.fired_at < cfg.busy_s:
                self._count(d.trigger, "busy")
            elif st.fired_at is not None and now - st.fired_at < cfg.cooldown_s:
                self._count(d.trigger, "cooldown")
            else:
                st.fired_at = now
                self._count(d.trigger, "fired")
                self.fired.append(d)
                out.append(d)
        return out

    def _job(self, job: str) -> _JobState:
        st = self._jobs.get(job)
        if st is None:
            if len(self._jobs) >= self.config.max_jobs:
                self._jobs.popitem(last=False)
            st = self._jobs[job] = _JobState(self.config.baseline_windows)
        else:
            self._jobs.move_to_end(job)
        st.seen = self._clock()
        return st

    def _count(self, trigger: str, decision: str) -> None:
        with self._lock:
            self.counts[(str(trigger), decision)] += 1

    # ----------------------------------------------------------------- requests
    def _request(self, d: Decision) -> None:
        if self.sender is None:
            self._count(d.trigger, "disabled")
            return
        req = control_pb2.DeepDiveRequest(job_id=d.job_id, iterations=self.config.iterations,
                                          trigger=str(d.trigger), reason=f"window {d.window}: {d.reason}")
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name="deep-dive-requests", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait((d, req))
        except queue.Full:
            self._count(d.trigger, "dropped")

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            d, req = item
            try:
                acks = list(self.sender(req))
            except Exception as e:
                self._count(d.trigger, "unreachable")
                log.warning("deep dive of job %s (%s) not requested: %s", d.job_id, d.trigger, e)
                continue
            if acks and all(a.accepted for a in acks):
                self._count(d.trigger, "sent")
                log.info("deep dive %s of job %s (%s): iterations %d-%d", acks[0].dive_id, d.job_id, d.trigger,
                         acks[0].start_iteration, acks[0].start_iteration + acks[0].iterations - 1)
            else:
                self._count(d.trigger, "refused")
                log.info("deep dive of job %s (%s) refused: %s", d.job_id, d.trigger,
                         "; ".join(a.detail for a in acks if not a.accepted) or "no processor")

    # --------------------------------------------------------------- Prometheus
    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        with self._lock:
            counts = dict(self.counts)
        fam = CounterMetricFamily("trainscope_deep_dive_triggers",
                                  "Deep-dive trigger decisions (EROICA §4.1): fired, suppressed (cooldown, busy, "
                                  "disabled) and the request's outcome (sent, refused, unreachable, dropped)",
                                  labels=["trigger", "decision"])
        for (trigger, decision), n in sorted(counts.items()):
            fam.add_metric([trigger, decision], n)
        yield fam


def processor_sender(targets: Sequence[str], **kw) -> Sender:
    """Requests to the job's processors (``processor/control.request_all``): the analyzer → processor leg."""
    from trainscope.processor.control import request_all

    def send(req: control_pb2.DeepDiveRequest):
        return request_all(list(targets), req, **kw)

    return send


__all__ = ["DECISIONS", "Decision", "DeepDiveTriggers", "TriggerConfig", "processor_sender"]
