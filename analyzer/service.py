"""The analyzer: consume window records, run L1–L3, publish diagnoses.

Steps, continuously (``step`` / ``run``):
1. Poll the source (embedded bus, local store or Kafka) and file every record
   under (job, window) with its rank; remember each rank's iteration times
   (bounded history) and when iterations last arrived.
2. A window is analysed once every rank of the job has reported it in every
   signal the job sends (stacks excepted), each rank's collective records
   have reached the window's end, and ``grace_s`` passed without more
   records for it, or once (its collectives in too) most ranks are
   ``progress_windows`` windows further on (not while the source says
   records still wait to be read: a Kafka backlog is read partition by
   partition), or ``window_timeout_s`` after its
   first record (then the ranks that never reported are evidence too).
3. L2 (phases across ranks) and L3 (kernel distributions across ranks) run on
   the window; L1 runs on the job's iteration-time history and keeps what
   overlaps this window's iterations (ARGUS §6: the levels run in parallel).
   When any of them found something, L5 compares the ranks' py-spy stacks
   (``l5_stacks.py``) to name a host-side cause.
4. Findings merge into one verdict per job and window (``merge.py``), which
   goes to every DiagnosisSink: the local store, a bus/Kafka topic,
   Prometheus flagged series.
5. Stall rule (EROICA §4.1): no iteration for ``stall_factor`` times the
   recent mean interval between iteration reports → a ``stall`` diagnosis.
   Arrival times are the analyzer's own clock, so host clock skew and a
   simulated clock change nothing. A job whose ranks said they shut down
   (``Window.final``, sent by a normal collector shutdown) has ended, not
   stalled; a crashed or hung one never says so.
6. Collective hang (Mycroft §4.3): collective records (their own topic, filed
   by (group, seq) in ``collectives.CollectiveState``) are checked on every
   step: a collective some ranks wait in for ``collectives.hang_timeout_s``
   while others never entered it names the first-stuck rank and the seq.

State is bounded: jobs, open windows per job, iteration history per rank.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from trainscope.analyzer import (
    collectives, consistent, individual, job_pace, l1_iteration, l2_groups, l2_phases, l3_kernels, l5_stacks, stall,
)
from trainscope.analyzer.history import IterationHistory
from trainscope.analyzer.impact import ImpactConfig, apply_floor, window_scale
from trainscope.analyzer.levels import (
    Collectives, ConsistentShift, Detector, JobPace, L1Iterations, L2Phases, L3Kernels, L5Stacks, OwnHistory,
    SiblingGroups,
    WindowContext,
)
from trainscope.analyzer.merge import merge
from trainscope.analyzer.model import CULPRIT, LINK, MISSING, Finding, JobWindow, Scope, SuspectRank
from trainscope.analyzer.sequential import SequentialConfig
from trainscope.analyzer.significance import Persistence
from trainscope.analyzer.metrics import AnalyzerMetrics
from trainscope.analyzer.sources import RecordSource
from trainscope.proto.contracts import SIGNALS, Signal
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2

log = logging.getLogger(__name__)


#: Detector levels, in the order they run (corroborating L5 last).
LEVEL_NAMES = ("L2", "L3", "groups", "history", "consistent", "collectives", "L1", "pace", "L5")
# comparisons counted per level are named by what was compared with what:
# L1/L2/L3 "peers", sibling_groups, own_history, pair


class DiagnosisSink(Protocol):
    name: str

    def publish(self, diagnoses: list[records_pb2.Diagnosis], verdict: records_pb2.Verdict | None) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AnalyzerConfig:
    l1: l1_iteration.L1Config = dataclasses.field(default_factory=l1_iteration.L1Config)
    """L1 (iteration time) thresholds."""
    l2: l2_phases.L2Config = dataclasses.field(default_factory=l2_phases.L2Config)
    """L2 (phases across ranks) thresholds and routing."""
    l3: l3_kernels.L3Config = dataclasses.field(default_factory=l3_kernels.L3Config)
    """L3 (kernel distributions across ranks) thresholds."""
    l5: l5_stacks.L5Config = dataclasses.field(default_factory=l5_stacks.L5Config)
    """L5 (host-side stacks) thresholds; L5 only corroborates windows other levels flagged."""
    groups: l2_groups.GroupsConfig = dataclasses.field(default_factory=l2_groups.GroupsConfig)
    """Sibling-group comparison (a whole group slower than its siblings)."""
    individual: individual.IndividualConfig = dataclasses.field(default_factory=individual.IndividualConfig)
    """Small jobs: own history and pairs."""
    consistent: consistent.ConsistentConfig = dataclasses.field(default_factory=consistent.ConsistentConfig)
    """Weak but consistent shifts from the peers, over windows."""
    impact: ImpactConfig = dataclasses.field(default_factory=ImpactConfig)
    """The impact floor below which findings are informational."""
    collectives: collectives.CollectivesConfig = dataclasses.field(default_factory=collectives.CollectivesConfig)
    """Late start and hang from per-collective records (Mycroft §4.3, §5)."""
    pace: job_pace.PaceConfig = dataclasses.field(default_factory=job_pace.PaceConfig)
    """The job's step against its own recent pace (slower than itself, no rank to blame)."""
    levels: tuple[str, ...] = ("L1", "L2", "L3", "L5", "groups", "history", "consistent", "collectives", "pace")
    """Which levels run."""
    sequential: SequentialConfig = dataclasses.field(default_factory=SequentialConfig)
    """Evidence accumulated per iteration (CUSUM) that names a rank flagged against its peers."""
    persist_k: int = 2
    """A rank is named once flagged in persist_k ..."""
    persist_n: int = 3
    """... of the last persist_n windows (stalls and hangs at once)."""
    grace_s: float = 0.5
    """Wait this long after a complete window's last record before analysing it."""
    window_timeout_s: float = 60.0
    """Analyse a window this long after its first record even if ranks are missing."""
    collectives_wait_s: float = 10.0
    """Wait at most this long after a window's last record for its ranks' collective records to reach its
    end (they trail the other signals by the processor's collective window; a job may pause its collectives)."""
    progress_windows: int = 2
    """...or once more than half the ranks are this many windows further on."""
    history_iterations: int = 4096
    """Iteration durations kept per rank for L1."""
    warmup_iterations: int = 5
    """A rank's first iterations are warm-up (allocation, compilation): kept out of L1's history; a CPU job's
    window holding them names nobody by persistence (merge step 3d)."""
    max_jobs: int = 1000
    """Jobs tracked at once; the least recently seen is forgotten beyond it."""
    max_open_windows: int = 64
    """Open windows per job; the oldest is analysed early beyond it."""
    stall_factor: float = 5.0
    """EROICA §4.1: stalled after this many mean iteration-report intervals without one."""
    min_stall_s: float = 10.0
    """Never call a stall before this many seconds without an iteration."""
    forget_after_s: float = 3600.0
    """Forget a job (state and its Prometheus series) after this long without records."""

    def __post_init__(self) -> None:
        bad = [lv for lv in self.levels if lv not in LEVEL_NAMES]
        if bad:
            raise ConfigError("analyzer.levels", self.levels, f"only {', '.join(LEVEL_NAMES)}")
        for f in ("grace_s", "window_timeout_s", "collectives_wait_s", "stall_factor", "min_stall_s", "forget_after_s"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"analyzer.{f}", getattr(self, f), "must be > 0")
        if not (isinstance(self.persist_k, int) and isinstance(self.persist_n, int)
                and 1 <= self.persist_k <= self.persist_n):
            raise ConfigError("analyzer.persist_k", (self.persist_k, self.persist_n),
                              "need integers 1 <= persist_k <= persist_n")
        if not (isinstance(self.warmup_iterations, int) and self.warmup_iterations >= 0):
            raise ConfigError("analyzer.warmup_iterations", self.warmup_iterations, "must be an integer >= 0")
        for f in ("progress_windows", "history_iterations", "max_jobs", "max_open_windows"):
            if getattr(self, f) < 1:
                raise ConfigError(f"analyzer.{f}", getattr(self, f), "must be >= 1")


#: The signals filed by window (``Window.signals`` may name these; collectives are joined by (group, seq)).
_WINDOWED = frozenset(SIGNALS) - {Signal.COLLECTIVES}


@dataclasses.dataclass(slots=True)
class _Open:
    jw: JobWindow
    first_seen: float
    last_seen: float
    #: per rank, the signals its processor said it emitted for this window (``Window.signals``)
    owed: dict[int, frozenset] = dataclasses.field(default_factory=dict)


class _Job:
    def __init__(self, job_id: str, history: int, persist_k: int = 2, persist_n: int = 3,
                 sequential: SequentialConfig | None = None) -> None:
        self.job_id = job_id
        self.world_size = 0
        self.resources: dict[int, Resource] = {}
        self.open: dict[tuple[int, int], _Open] = {}
        self.done_upto: dict[int, int] = {}            # window kind -> highest analysed index
        self.latest: dict[int, int] = {}                # rank -> highest window index seen
        self.history: dict[int, IterationHistory] = collections.defaultdict(
            lambda: IterationHistory(history))  # rank -> (iteration, duration_ns) rows, columnar
        self.last_iteration_at = 0.0
        self.newest_iteration_window = -1
        self.iteration_gaps: collections.deque = collections.deque(maxlen=32)
        self.reported_l1: set[tuple] = set()
        self.persistence = Persistence(persist_k, persist_n, sequential=sequential)
        self.stalled = False
        self.last_seen = 0.0
        self.ended: set[int] = set()   # ranks whose process shut down normally (Window.final)
        self.signals: set[str] = set()  # signals this job sends (a window waits for all of them)
        self.last_iter_end: dict[int, int] = {}   # rank -> end of its last iteration (rank clock)
        self.watermark: dict[int, int] = {}       # rank -> latest end of anything it reported
        self.iterations_upto: dict[int, int] = {}  # rank -> highest iterations window its iteration record came in
        self.own_history = None                   # individual.History, kept by the OwnHistory level
        self.shift_ratios = None                  # consistent.Ratios, kept by the ConsistentShift level
        self.first_iteration: dict[int, int] = {}  # rank -> first iteration it reported
        self.collectives = None                   # collectives.CollectiveState: records joined by (group, seq)
        self.pace_baseline = None                 # job_pace.Baseline, kept by the JobPace level
        self.l2_spread = None                     # l2_phases.PhaseSpread, kept by the L2 level


class Analyzer:
    def __init__(self, config: AnalyzerConfig, source: RecordSource, sinks: Sequence[DiagnosisSink] = (),
                 *, metrics: AnalyzerMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 window_gate: Callable[[str, JobWindow, float], bool] | None = None,
                 before_analysis: Callable[[JobWindow], None] | None = None) -> None:
        """``window_gate(job, jw, first_seen)``: False holds a window that is otherwise ready (not
        past ``window_timeout_s``); ``before_analysis(jw)`` may add to a window before its levels
        run. Both are for the partitioned mode (``partition.py``: the L3 partials of the group)."""
        self.config = config
        self.window_gate = window_gate
        self.before_analysis = before_analysis
        self.source = source
        self.metrics = metrics or AnalyzerMetrics()
        self.sinks = list(sinks)
        if self.metrics not in self.sinks:
            self.sinks.append(self.metrics)
        self._clock = clock
        self._jobs: dict[str, _Job] = {}
        self.verdicts: collections.deque[records_pb2.Verdict] = collections.deque(maxlen=10_000)
        self.detectors: list[Detector] = default_detectors(config, self.metrics)

    # ---------------------------------------------------------------- input
    def ingest(self, signal: str, rec) -> None:
        now = self._clock()
        res = Resource.from_pb(rec.resource)
        job = self._job(res.job_id, now)
        job.world_size = max(job.world_size, res.world_size)
        job.resources[res.rank] = res
        if signal == Signal.COLLECTIVES:   # their own short windows: joined by (group, seq), not by window
            if job.collectives is None:
                job.collectives = collectives.CollectiveState(self.config.collectives)
            job.collectives.absorb(res.rank, rec)
            self.metrics.counters["records_in"] += 1
            return
        w = rec.window
        key = (w.kind, w.index)
        if signal != Signal.STACKS:  # stacks come from an optional sidecar: never waited for
            job.signals.add(signal)
        if signal == Signal.ITERATIONS:
            self._note_iterations(job, rec, now)
        if w.index <= job.done_upto.get(w.kind, -1) and key not in job.open:
            self.metrics.counters["late_records"] += 1
            return
        o = job.open.get(key)
        if o is None:
            o = job.open[key] = _Open(JobWindow(job.job_id, w), now, now)
            if len(job.open) > self.config.max_open_windows:
                self._analyse(job, min(job.open), "bound")
        o.last_seen = now
        jw = o.jw
        jw.resources[res.rank] = res
        getattr(jw, signal)[res.rank] = rec
        owed = _WINDOWED.intersection(w.signals)   # a name this analyzer does not know owes nothing
        if owed:
            o.owed[res.rank] = owed
        if w.start_ns and (not jw.window.start_ns or w.start_ns < jw.window.start_ns):
            jw.window.start_ns = w.start_ns
        jw.window.end_ns = max(jw.window.end_ns, w.end_ns)
        job.latest[res.rank] = max(job.latest.get(res.rank, -1), w.index)
        if w.final:
            job.ended.add(res.rank)
        # the stall rule's telemetry clock: the phases or kernels of a window of iterations whose iteration
        # record has not come yet (topics are read at different rates) put the rank's watermark ten
        # iterations past its last known one (a healthy DDP job beside a busy process read "stalled", its
        # slowest-read rank the culprit); a window's own activity past its last iteration (a hang's aborted
        # collectives) counts once its iteration record is in
        if w.kind == records_pb2.WINDOW_KIND_ITERATIONS and signal == Signal.ITERATIONS:
            job.iterations_upto[res.rank] = max(job.iterations_upto.get(res.rank, -1), w.index)
        ahead = (w.kind == records_pb2.WINDOW_KIND_ITERATIONS and res.rank in job.iterations_upto
                 and w.index > job.iterations_upto[res.rank])
        if not ahead and w.end_ns > job.watermark.get(res.rank, 0):
            job.watermark[res.rank] = w.end_ns
        self.metrics.counters["records_in"] += 1

    def _warmup(self, job: _Job, window) -> bool:
        """The iterations window holds some of the job's first ``warmup_iterations`` (merge step 3d)."""
        if window.kind != records_pb2.WINDOW_KIND_ITERATIONS or not job.first_iteration:
            return False
        return int(window.first_iteration) < min(job.first_iteration.values()) + self.config.warmup_iterations

    def _note_iterations(self, job: _Job, rec, now: float) -> None:
        """Iteration history (L1) and progress (stall rule); late records count too."""
        w = rec.window
        rank = rec.resource.rank
        hist = job.history[rank]
        if rec.marks:
            marks = np.array([(m.iteration, m.start_ns, m.end_ns) for m in rec.marks], dtype=np.int64)
            first = job.first_iteration.setdefault(rank, int(marks[:, 0].min()))
            # warm-up (allocation, compilation, caches) is not the job's pace
            marks = marks[marks[:, 0] >= first + self.config.warmup_iterations]
            if marks.size:
                hist.extend(marks[:, 0], marks[:, 2] - marks[:, 1])
                end = int(marks[:, 2].max())
                if end > job.last_iter_end.get(rank, 0):
                    job.last_iter_end[rank] = end
        else:
            job.first_iteration.setdefault(rank, 0)
        # the job made progress when a newer window's iterations arrive (any rank)
        if rec.marks and w.index > job.newest_iteration_window:
            job.newest_iteration_window = w.index
            if job.last_iteration_at:
                job.iteration_gaps.append(now - job.last_iteration_at)
            job.last_iteration_at = now
            if job.stalled:
                job.stalled = False
                self.metrics.set_stalled(job.job_id, False)

    def _job(self, job_id: str, now: float) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            if len(self._jobs) >= self.config.max_jobs:
                oldest = min(self._jobs.values(), key=lambda j: j.last_seen)
                del self._jobs[oldest.job_id]
            job = self._jobs[job_id] = _Job(job_id, self.config.history_iterations,
                                            self.config.persist_k, self.config.persist_n, self.config.sequential)
        job.last_seen = now
        return job

    # ---------------------------------------------------------------- loop
    def step(self, timeout_s: float = 0.2) -> list[records_pb2.Verdict]:
        for signal, rec in self.source.poll(timeout_s):
            self.ingest(signal, rec)
        self.metrics.counters["bad_records"] = getattr(self.source, "bad_total", 0)
        self.metrics.counters.update({f"kernel_names.{k}": v for k, v in   # the dictionary's counts
                                      getattr(getattr(self.source, "names", None), "counters", {}).items()})
        out = []
        now = self._clock()
        behind = bool(getattr(self.source, "backlog", False))
        for job in list(self._jobs.values()):
            for key in sorted(job.open):
                reason = self._ready(job, job.open[key], now, behind)
                if reason:
                    out.append(self._analyse(job, key, reason))
            self._check_stall(job, now)
            self._check_hang(job)
        return out

    def run(self, stop: threading.Event, timeout_s: float = 0.2) -> None:
        while not stop.is_set():
            try:
                self.step(timeout_s)
            except Exception:  # a bad window must not stop the service
                log.exception("analyzer step failed")

    def finish(self) -> list[records_pb2.Verdict]:
        """Read what is left and analyse every open window (end of a replay)."""
        while True:
            recs = self.source.poll(0)
            if not recs:
                break
            for signal, rec in recs:
                self.ingest(signal, rec)
        for signal, rec in getattr(getattr(self.source, "names", None), "flush", list)():
            self.ingest(signal, rec)   # kernel windows still waiting for names: ids labelled
        out = []
        for job in list(self._jobs.values()):
            self._check_hang(job, final=True)   # a replay of a hung job: its collectives say who never entered
            keys = sorted(job.open)
            for i, key in enumerate(keys):
                out.append(self._analyse(job, key, "finish", last=i == len(keys) - 1))
        return out

    def _ready(self, job: _Job, o: _Open, now: float, behind: bool = False) -> str | None:
        """Why the window is analysed now (step 2), or None. ``behind``: the source still holds records it
        has not handed over (``KafkaSource.backlog``): ranks further on then say nothing about the ranks
        whose records are still in the log, so "progress" waits (an analyzer reading a finished healthy
        job from Kafka beside a busy core called a window of 32 ranks "unknown": most of its ranks'
        partitions had not been read)."""
        jw = o.jw
        if now - o.first_seen < self.config.window_timeout_s and self.window_gate is not None \
                and not self.window_gate(job.job_id, jw, o.first_seen):
            return None
        def caught_up() -> bool:      # read only where the window is otherwise ready
            return now - o.last_seen >= self.config.collectives_wait_s or self._collectives_caught_up(job, o)

        if job.world_size and now - o.last_seen >= self.config.grace_s and self._complete(job, o) and caught_up():
            return "complete"
        ahead = sum(1 for r, idx in job.latest.items() if idx >= o.jw.window.index + self.config.progress_windows)
        if job.world_size and ahead * 2 > job.world_size and not behind and caught_up():
            return "progress"
        if now - o.first_seen >= self.config.window_timeout_s:
            return "timeout"
        return None

    @staticmethod
    def _collectives_caught_up(job: _Job, o: _Open) -> bool:
        """Every rank that sends collective records (and has not ended) has sent them up to the end of
        its part of the window (step 2): they travel in the processor's own short windows, seconds behind
        the phases and iterations, and a window judged without them judges its collectives with the
        next window's, or not at all (a live analyzer beside a busy process missed an FSDP2 rank's late
        all-gathers that the same records, judged once all were in, named)."""
        state = job.collectives
        if state is None or not state.now_ns:
            return True
        jw = o.jw
        for rank, seen in state.now_ns.items():
            if rank in job.ended:
                continue
            end = max((getattr(jw, sig)[rank].window.end_ns for sig in _WINDOWED if rank in getattr(jw, sig)),
                      default=0)
            if seen < end:
                return False
        return True

    @staticmethod
    def _complete(job: _Job, o: _Open) -> bool:
        """Every rank of the job has sent every record of the window it owes (step 2).

        What a rank owes is what its processor stamped on the records (``Window.signals``): a backlog
        read topic by topic at different rates (Kafka, beside a busy core) once had a window whose
        stacks and phases were in, and whose kernels and iterations were not, called complete, and
        the verdict compared nobody. A rank whose records carry no stamp (an older producer) owes
        every signal the job has sent so far, stacks excepted (an optional sidecar)."""
        jw = o.jw
        if len(jw.resources) < job.world_size or not (job.signals or o.owed):
            return False
        for rank in jw.resources:
            for sig in o.owed.get(rank, job.signals):
                if rank not in getattr(jw, sig):
                    return False
        return True

    # ------------------------------------------------------------ analysis
    def _analyse(self, job: _Job, key: tuple[int, int], reason: str, last: bool = False) -> records_pb2.Verdict:
        """Analyse one window; ``last``: the job's final window at the end of a replay."""
        o = job.open.pop(key)
        jw = o.jw
        job.done_upto[key[0]] = max(job.done_upto.get(key[0], -1), key[1])
        if self.before_analysis is not None:
            self.before_analysis(jw)
        scale = window_scale(jw)
        ctx = WindowContext(jw, scale, job.history, reported=job.reported_l1, job_state=job)
        for det in self.detectors:
            if det.corroborating and not any(not f.informational for f in ctx.findings):
                continue   # corroboration only: never raises an alarm on its own
            try:
                ctx.findings += det.analyze(ctx)
            except Exception:
                self.metrics.detector_failures[det.level] += 1
                log.exception("detector %s failed on job %s window %s", det.level, job.job_id, key)
        findings = apply_floor(ctx.findings, scale, self.config.impact)
        missing = self._missing_ranks(job, jw, reason)
        if missing is not None:
            findings.append(missing)
        if not job.stalled:
            hang = stall.telemetry_stall(job.job_id, jw.window, last_iter_end=job.last_iter_end,
                                         watermark=job.watermark, history=job.history, ended=job.ended,
                                         factor=self.config.stall_factor)
            if hang is not None:
                job.stalled = True
                self.metrics.set_stalled(job.job_id, True)
                findings.append(dataclasses.replace(hang, step_ns=scale.step_ns))
        verdict = merge(job.job_id, jw.window, findings, jw.resources, jw=jw, step_ns=scale.step_ns,
                        iterations=scale.iterations, persistence=job.persistence,
                        comparisons=ctx.comparisons, partial=missing is not None, final=last,
                        job_loss=ctx.job_loss, warmup=self._warmup(job, jw.window))
        base = getattr(job, "pace_baseline", None)
        if base is not None and any(s.role in (CULPRIT, LINK) for s in verdict.ranks):
            base.discard(int(jw.window.index))     # job_pace step 2: a window that named a rank is no healthy pace
        self._publish(list(verdict.findings), verdict)
        self.metrics.counters["windows_analyzed"] += 1
        return verdict

    def _publish(self, diagnoses: list[records_pb2.Diagnosis], verdict: records_pb2.Verdict) -> None:
        for s in self.sinks:
            try:
                s.publish(diagnoses, verdict)
            except Exception:
                log.exception("diagnosis sink %s failed", getattr(s, "name", s))
        self.verdicts.append(verdict)

    def _missing_ranks(self, job: _Job, jw: JobWindow, reason: str) -> Finding | None:
        """Ranks the job has (or that reported before) but not in this window: the window is partial.

        Any missing rank makes it partial, however few ranks are present (a
        time window holding 8 of 256 ranks compared those 8 among themselves
        and named a wrong rank each window). The missing ranks are listed as
        ``missing`` (never as culprits of a slowdown); ``merge`` names no
        suspect among the ranks present (their findings only feed persistence).
        """
        if reason == "complete" or not job.world_size:
            return None
        seen = set(jw.resources)
        # expected: every rank the job has (world size) or that ever reported, but the ones that
        # said they shut down; a window holding 3 of 8 ranks is as partial as one missing one rank
        expected = (set(range(job.world_size)) | set(job.resources)) - job.ended
        missing = sorted(expected - seen)
        if not missing:
            return None
        return Finding(level="L2", kind="missing_rank", job_id=job.job_id, window=jw.window,
                       scope=Scope(group="job"), comparison="job",
                       suspects=tuple(SuspectRank(r, 1.0, {"reported_ranks": len(seen)}, role=MISSING)
                                      for r in missing),
                       severity=len(missing) / max(len(expected), 1),
                       evidence={"missing": missing, "reason": reason})

    def open_windows(self, job_id: str) -> set[tuple[int, int]]:
        """The (kind, index) of the job's windows not analysed yet."""
        job = self._jobs.get(job_id)
        return set(job.open) if job is not None else set()

    def analysed(self, job_id: str, kind: int, index: int) -> bool:
        """Whether the job's window (kind, index) was analysed already (records for it come too late)."""
        job = self._jobs.get(job_id)
        return job is not None and (kind, index) not in job.open and index <= job.done_upto.get(kind, -1)

    def forget_job(self, job_id: str) -> None:
        """Drop a job's state (its records moved to another analyzer of the group)."""
        job = self._jobs.get(job_id)
        if job is not None:
            self._forget(job)

    def _forget(self, job: _Job) -> None:
        self._jobs.pop(job.job_id, None)
        self.metrics.forget_job(job.job_id)

    def _check_stall(self, job: _Job, now: float) -> None:
        if job.ended and len(job.ended) * 2 >= max(len(job.resources), 1):
            # the job finished (its processes said so): silence is not a stall
            if job.stalled:
                job.stalled = False
                self.metrics.set_stalled(job.job_id, False)
            if not job.open and now - job.last_seen >= self.config.forget_after_s:
                self._forget(job)
            return
        if now - job.last_seen >= self.config.forget_after_s and not job.open:
            self._forget(job)
            return
        if job.stalled or not job.last_iteration_at or len(job.iteration_gaps) < 3:
            return
        window = records_pb2.Window(index=max(job.latest.values(), default=0))
        f = stall.arrival_stall(job.job_id, window, quiet_s=now - job.last_iteration_at,
                                mean_gap_s=float(np.mean(job.iteration_gaps)),
                                factor=self.config.stall_factor, floor_s=self.config.min_stall_s)
        if f is not None:
            job.stalled = True
            self.metrics.set_stalled(job.job_id, True)
            self._publish([f.to_pb()], merge(job.job_id, window, [f], job.resources))


    def _check_hang(self, job: _Job, final: bool = False) -> None:
        """Step 6: a collective some ranks wait in and others never entered (``collectives.py``); ``final``:
        everything has been read (no window still on its way)."""
        if job.collectives is None:
            return
        window = records_pb2.Window(index=max(job.latest.values(), default=0))
        found = job.collectives.hangs(job.job_id, window, job.ended, final=final)
        if found:
            job.stalled = True
            self.metrics.set_stalled(job.job_id, True)
            self._publish([f.to_pb() for f in found], merge(job.job_id, window, found, job.resources))


def default_detectors(config: AnalyzerConfig, metrics: AnalyzerMetrics | None = None) -> list[Detector]:
    """The levels the service runs, in order (``AnalyzerConfig.levels`` picks them)."""
    made = {
        "L2": lambda: L2Phases(config.l2),
        "L3": lambda: L3Kernels(config.l3),
        "groups": lambda: SiblingGroups(config.groups),
        "history": lambda: OwnHistory(config.individual, config.groups),
        "consistent": lambda: ConsistentShift(config.consistent, config.groups),
        "collectives": lambda: Collectives(config.collectives, config.impact.floor_pct),
        "L1": lambda: L1Iterations(config.l1),
        "pace": lambda: JobPace(config.pace, config.warmup_iterations),
        "L5": lambda: L5Stacks(config.l5),
    }
    return [made[lv]() for lv in LEVEL_NAMES if lv in config.levels]
