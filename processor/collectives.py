"""Collective records: validation at ingest, short windows, per-(group, op, size) summaries.

Collective records (``CollectiveBatch``, Mycroft §4.2) are joined across ranks
by the analyzer on (group, seq), and a hang must be seen within seconds, so
they do not wait in a rank's iteration windows (which close only when the next
iterations arrive, or after ``idle_close_s`` when a hung rank stops stepping).
Instead:

1. ``validate`` (ingest threads): group indices, member ranks inside the world,
   timestamps, op/dtype names; bad records are dropped and counted
   (``records_rejected{reason=...}``), a batch with none left is refused.
2. ``CollectiveWindows.add`` (processing thread): each rank's records go into its
   open window; the group table is merged by group id. At most
   ``max_records_per_window`` raw records are kept per window; the rest are
   summarised only and counted (``drops{where="collectives"}``).
3. ``tick`` (every idle check of the pipeline): a window open for ``length_s``
   of the processor's wall time closes: one ``CollectiveWindow`` per rank with
   the raw records of that window only and summaries per (group, op, size class)
   (count, p50/p99/max of end − enqueue, bytes). Raw records of earlier windows
   are not kept here: the bus/Kafka/store retention decides how long they live.
   ``flush`` closes them all at once: at a drain that closes every window, and
   at the embedded simulator's barrier after each chunk (``Pipeline.drain(
   close_collectives=True)``), where the simulated clock runs far ahead of the
   processor's and 2 s of it would put a window's collectives after the
   iteration window they belong to.

Triggers (Mycroft §4.3, Algorithm 1), ``Triggers``: on a sample of at most
``sample_ranks`` members of each group (evenly spaced over the sorted members),

4. hang: a sampled member reports a collective in flight (a state record) for
   ``hang_s`` of its own clock without completing it → ``hang`` trigger for
   that group (once per (group, seq));
5. straggler: at each close of a sampled member's window, its completion
   interval on the group = (rank clock now − the completion that opens the
   span) / completions in the span, where the span reaches back to cover both
   ``horizon_s`` and ``min_completions`` completions (a longer span than one step
   keeps bunched collectives from looking irregular); throughput = their bytes
   over their summed durations (end − start). The interval at least ``slow_factor`` (2: "doubles") times,
   or the throughput at most 1/``slow_factor`` ("halves") of the baseline →
   ``straggler`` trigger, at most one per group and ``hot_s``. The baseline is the median of the last
   ``baseline_evals`` evaluations that did not trigger (Algorithm 1 line 9), at
   least 3 of them; after ``relearn_evals`` triggered evaluations in a row the
   new pace becomes the baseline (a lasting change is not an anomaly forever);
6. with ``raw_records="triggered"`` a closed window carries its summaries only;
   its raw records stay in the rank's ring of the last ``lookback_windows``
   windows. A trigger on a group makes it hot for ``hot_s`` (processor clock)
   and pulls that group's records of every member's ring at once (one extra
   ``CollectiveWindow`` per member, no summaries: they were emitted already);
   windows closing while their group is hot keep its raw records. The default,
   ``"always"``, keeps every window's raw records (the analyzer's late-start
   rule judges every window). Counted: ``collective_triggers{kind}``,
   ``collective_raw_records{fate=kept|pulled|summarised}``.

The stack grid (Mycroft §5 evidence; ``stack_grid.py``):

7. a trigger on a group (hang or straggler) sends one ``StackDumpCommand``
   through the control channel (``grids.control``: the host's ``ControlHub``) to
   every member of the group subscribed to this processor, at once, so their
   py-spy dumps are taken at about the same moment; at most one grid per
   (job, group) and ``grid_cooldown_s``. Counted:
   ``stack_grid_requests{outcome=sent|cooldown|unreachable|error}``.
8. the dumps come back on the ingest stream (``CollectiveBatch.dumps``),
   validated like records (bounded threads and stack lengths), and are
   emitted at once, each as a ``CollectiveWindow`` of its rank holding only
   the dump (no records, no summaries, ``now_ns`` 0 so the analyzer's rank
   clock is not moved); the analyzer clusters them (``analyzer/stack_grid.py``).
   Counted: ``stack_grid_dumps{outcome=ok|error}``.

Channel states (Mycroft §4.2 state log, ``CollectiveBatch.states``; read by
``analyzer/channel_states.py``):

9. ``validate`` checks each state like a record: its group index, a seq,
   ``time_ns`` inside the clock bound, ``stuck_ns`` under a day, a peer inside
   the world (or −1), counters ordered ① GPU_ready ≥ ② RDMA_transmitted ≥
   ③ RDMA_done (a chunk is made ready, then posted, then completed) and none
   above ``total_chunks``; a bad one is dropped and counted
   (``records_rejected{reason="channel_state"}``). A batch may hold only states.
10. ``add`` keeps the newest state per (group, seq, channel) of the rank's
   open window; a newer state whose counters went backwards (below the held
   one's) is dropped (``records_rejected{reason="channel_state_backwards"}``),
   an older one replaced (``channel_states{fate="superseded"}``). At most
   ``max_states_per_window`` are held; a state beyond it is dropped
   (``channel_states{fate="dropped"}``, and ``drops{where="channel_states"}``).
11. At the window's close only the states of collectives still in flight go
   out, in ``CollectiveWindow.states`` (a completion record of the same
   (group, seq) in the window supersedes them: ``channel_states{fate=
   "completed"}``; the rest ``fate="kept"``). With ``raw_records="triggered"``
   they go out whatever the group's heat (a stuck collective is what a hang
   trigger is about), and the rank's ring keeps them with its records, so a
   trigger's pulled window carries them too.

The closed window's ``raw`` part carries a window with ``end_ns = 0``, so
``processor/durability.py`` never counts a collective window as closing a
rank's iteration windows; collective batches are admitted with end 0 for the
same reason (at most ``length_s`` of collective records is lost when a
processor is killed, never kernels or phases).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable

import numpy as np

from trainscope.processor.model import ClosedWindow, WindowOutput
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.stack_grid import MAX_DUMPS_PER_BATCH, GridRequests, valid_dump
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2, telemetry_pb2

#: Longest plausible collective (a day): a longer one is a corrupt timestamp.
MAX_COLLECTIVE_NS = 24 * 3600 * 10**9
MAX_NAME = 64


RAW_MODES = ("always", "triggered")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TriggerConfig:
    """Steps 4-6 of the module docstring (Mycroft §4.3)."""

    raw_records: str = "always"
    """``always``: every window's raw records; ``triggered``: only around a trigger (step 6)."""
    sample_ranks: int = 10
    """Members of each group watched by the triggers (Mycroft samples at most 10)."""
    hang_s: float = 10.0
    """Step 4: in flight this long (rank clock) on a sampled member without completing."""
    horizon_s: float = 10.0
    """Step 5: shortest span a completion interval is measured over (Mycroft's Δ)."""
    min_completions: int = 8
    """Step 5: fewest completions in that span."""
    slow_factor: float = 2.0
    """Step 5: interval x this ("doubles") or throughput / this ("halves")."""
    baseline_evals: int = 30
    """Step 5: evaluations the baseline median is taken over (a minute of 2 s windows: the evaluations of a
    ramp, which overlap the change, stay a minority of it)."""
    relearn_evals: int = 30
    """Step 5: triggered evaluations in a row after which the pace is the new baseline."""
    hot_s: float = 30.0
    """Step 6: processor seconds a triggered group's raw records are kept."""
    lookback_windows: int = 5
    """Step 6: closed windows per rank whose raw records a trigger can still pull (5 x 2 s: Mycroft's Δ)."""
    max_groups: int = 10_000
    """(job, group) pairs watched; beyond it the oldest is forgotten (a killed job never says it ended)."""
    stack_grid: bool = True
    """Step 7: a trigger asks every member of its group for one py-spy dump (the stack grid)."""
    grid_cooldown_s: float = 60.0
    """Step 7: processor seconds between two grids of one (job, group)."""
    grid_timeout_s: float = 5.0
    """Step 7: a member's py-spy is killed after this long (its dump then carries the error)."""

    def __post_init__(self) -> None:
        if self.raw_records not in RAW_MODES:
            raise ConfigError("collectives.trigger.raw_records", self.raw_records, f"must be one of {RAW_MODES}")
        for f in ("hang_s", "horizon_s", "hot_s", "grid_timeout_s"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"collectives.trigger.{f}", getattr(self, f), "must be > 0")
        if not self.slow_factor > 1:
            raise ConfigError("collectives.trigger.slow_factor", self.slow_factor, "must be > 1")
        if not self.grid_cooldown_s >= 0:
            raise ConfigError("collectives.trigger.grid_cooldown_s", self.grid_cooldown_s, "must be >= 0")
        for f in ("sample_ranks", "min_completions", "baseline_evals", "relearn_evals", "lookback_windows",
                  "max_groups"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 1):
                raise ConfigError(f"collectives.trigger.{f}", getattr(self, f), "must be an integer >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class Trigger:
    """One trigger: a suspicious moment on a group, seen on one sampled member (Mycroft Algorithm 1's output)."""

    kind: str                    # hang | straggler
    job_id: str
    group: str
    members: tuple[int, ...]
    rank: int                    # the sampled member that saw it
    at_ns: int                   # that member's clock
    detail: dict


def sample(members: tuple[int, ...], k: int) -> frozenset[int]:
    """At most ``k`` members, evenly spaced over the sorted members (step 4)."""
    m = sorted(members)
    n = len(m)
    if n <= k:
        return frozenset(m)
    return frozenset(m[(i * n) // k] for i in range(k))


class _Series:
    __slots__ = ("ends", "nbytes", "durs", "base_iv", "base_tp", "streak", "members")

    def __init__(self, members: tuple[int, ...]) -> None:
        self.ends: collections.deque = collections.deque(maxlen=4096)     # completion end_ns, in order
        self.nbytes: collections.deque = collections.deque(maxlen=4096)
        self.durs: collections.deque = collections.deque(maxlen=4096)      # end - start
        self.base_iv: collections.deque = collections.deque()
        self.base_tp: collections.deque = collections.deque()
        self.streak = 0
        self.members = members


class Triggers:
    """Steps 4-5 for one processor (all jobs); the processing thread owns it."""

    def __init__(self, config: TriggerConfig, metrics: SelfMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._samples: dict[tuple[str, str], frozenset[int]] = {}
        self._series: dict[tuple[str, str, int], _Series] = {}
        self._by_rank: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
        self._hung: dict[tuple[str, str], int] = {}     # (job, group) -> highest seq a hang fired for
        self._fired: dict[tuple[str, str], int] = {}    # (job, group) -> rank clock of its last straggler trigger
        self.recent: collections.deque[Trigger] = collections.deque(maxlen=256)

    def sampled(self, job: str, gid: str, members, rank: int) -> bool:
        key = (job, gid)
        s = self._samples.get(key)
        if s is None:
            while len(self._samples) >= self.config.max_groups:
                self._drop(next(iter(self._samples)))   # the oldest watched group
            s = self._samples[key] = sample(tuple(members), self.config.sample_ranks)
        return rank in s

    def _drop(self, key: tuple[str, str]) -> None:
        job, gid = key
        for r in self._samples.pop(key, ()):
            if self._series.pop((job, gid, r), None) is not None:
                gids = self._by_rank.get((job, r))
                if gids is not None and gid in gids:
                    gids.remove(gid)
                    if not gids:
                        del self._by_rank[(job, r)]
        self._hung.pop(key, None)
        self._fired.pop(key, None)

    def observe(self, job: str, rank: int, group: telemetry_pb2.CollectiveGroup,
                r: telemetry_pb2.CollectiveRecord, now_ns: int) -> Trigger | None:
        """Step 4, and the completions step 5 measures; call for every record of a sampled member."""
        gid = group.id
        if r.end_ns:
            key = (job, gid, rank)
            s = self._series.get(key)
            if s is None:   # at most sample_ranks per watched group: bounded by max_groups
                s = self._series[key] = _Series(tuple(group.members))
                self._by_rank[(job, rank)].append(gid)
            if not s.ends or r.end_ns >= s.ends[-1]:
                s.ends.append(r.end_ns)
                s.nbytes.append(r.bytes)
                s.durs.append(max(r.end_ns - (r.start_ns or r.enqueue_ns), 1))
            return None
        waited = now_ns - r.enqueue_ns
        if waited >= self.config.hang_s * 1e9 and r.seq > self._hung.get((job, gid), 0):
            self._hung[(job, gid)] = r.seq
            return self._fire(Trigger("hang", job, gid, tuple(group.members), rank, now_ns,
                                      {"seq": r.seq, "op": r.op, "in_flight_s": round(waited / 1e9, 3)}))
        return None

    def evaluate(self, job: str, rank: int, now_ns: int) -> list[Trigger]:
        """Step 5 for every sampled series of this rank (call at the rank's window close)."""
        cfg = self.config
        out = []
        for gid in self._by_rank.get((job, rank), ()):
            s = self._series[(job, gid, rank)]
            n_all = len(s.ends)
            if n_all <= cfg.min_completions:
                continue
            now = max(now_ns, s.ends[-1])
            keep = now - int(2 * cfg.horizon_s * 1e9)   # two horizons of history, at least min_completions + 1
            while len(s.ends) > cfg.min_completions + 1 and s.ends[1] < keep:
                s.ends.popleft()
                s.nbytes.popleft()
                s.durs.popleft()
            n_all = len(s.ends)
            # the span: back to the completion that covers both horizon_s and min_completions after it
            horizon = now - int(cfg.horizon_s * 1e9)
            i = n_all - 1 - cfg.min_completions
            while i > 0 and s.ends[i] > horizon:
                i -= 1
            span = now - s.ends[i]
            if span <= 0 or (span < cfg.horizon_s * 1e9 and n_all < s.ends.maxlen):
                continue   # warming up: not a horizon of history yet (a full deque is as far back as it goes)
            count = n_all - 1 - i
            interval = span / count
            # the collectives' own throughput: their bytes over their durations (a slow transfer shows
            # here before it stretches the interval between completions)
            throughput = sum(itertools.islice(s.nbytes, i + 1, None)) / sum(itertools.islice(s.durs, i + 1, None)) * 1e9
            fired = None
            if len(s.base_iv) >= 3:
                base_iv = float(np.median(s.base_iv))
                base_tp = float(np.median(s.base_tp))
                if interval >= cfg.slow_factor * base_iv or (base_tp > 0 and throughput * cfg.slow_factor <= base_tp):
                    fired = Trigger("straggler", job, gid, s.members, rank, now, {
                        "interval_ms": round(interval / 1e6, 3), "usual_interval_ms": round(base_iv / 1e6, 3),
                        "throughput_Bps": round(throughput, 1), "usual_throughput_Bps": round(base_tp, 1)})
            if fired is not None and s.streak + 1 < cfg.relearn_evals:
                s.streak += 1          # Algorithm 1: the baseline is updated only when nothing triggered
            else:
                if fired is not None:  # a lasting change: relearn from here
                    s.base_iv.clear()
                    s.base_tp.clear()
                s.streak = 0
                s.base_iv.append(interval)
                s.base_tp.append(throughput)
                while len(s.base_iv) > cfg.baseline_evals:
                    s.base_iv.popleft()
                    s.base_tp.popleft()
            if fired is not None and now - self._fired.get((job, gid), 0) >= cfg.hot_s * 1e9:
                self._fired[(job, gid)] = now     # one per group and hot period, whichever member saw it
                out.append(self._fire(fired))
        return out

    def forget(self, job: str, rank: int) -> None:
        """A rank that ended (its final batch): its series go; its groups once no member has one."""
        for gid in self._by_rank.pop((job, rank), ()):
            self._series.pop((job, gid, rank), None)
            if not any((job, gid, r) in self._series for r in self._samples.get((job, gid), ())):
                self._drop((job, gid))

    def _fire(self, t: Trigger) -> Trigger:
        self.metrics.inc("collective_triggers", 1, kind=t.kind)
        self.recent.append(t)
        return t


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveWindowConfig:
    length_s: float = 2.0
    """Processor wall time a rank's collective window stays open (hang latency adds to it)."""
    max_records_per_window: int = 8192
    """Raw records kept per rank and window; beyond it records are summarised only."""
    max_groups_per_window: int = 1024
    """Distinct process groups kept per rank and window."""
    max_records_per_batch: int = 65_536
    """A batch with more records (or more channel states) is refused (a collector ships every second)."""
    max_states_per_window: int = 4096
    """Step 10: channel states held per rank and window (the newest per (group, seq, channel))."""
    trigger: TriggerConfig = dataclasses.field(default_factory=TriggerConfig)
    """Mycroft's triggers and the raw-record policy (steps 4-6)."""

    def __post_init__(self) -> None:
        if not self.length_s > 0:
            raise ConfigError("collectives.length_s", self.length_s, "must be > 0")
        for f in ("max_records_per_window", "max_groups_per_window", "max_records_per_batch",
                  "max_states_per_window"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 1):
                raise ConfigError(f"collectives.{f}", getattr(self, f), "must be an integer >= 1")


def size_class(nbytes: int) -> int:
    """floor(log2(bytes)): collectives of one bucket size are comparable (0 for empty payloads)."""
    return int(nbytes).bit_length() - 1 if nbytes > 0 else 0


def valid_state(s: telemetry_pb2.ChannelState, groups: list, world_size: int, max_ts: int) -> bool:
    """Step 9: one channel state's fields (the group table already checked)."""
    return (s.group < len(groups) and groups[s.group] is not None and s.seq > 0
            and 0 < s.time_ns <= max_ts and s.stuck_ns <= MAX_COLLECTIVE_NS
            and -1 <= s.peer < world_size
            and s.total_chunks >= s.gpu_ready >= s.rdma_transmitted >= s.rdma_done)


def validate(batch: telemetry_pb2.CollectiveBatch, world_size: int, max_ts: int, metrics: SelfMetrics,
             config: CollectiveWindowConfig = CollectiveWindowConfig()) -> tuple[tuple, int, int]:
    """Step 1: (payload, records, end) where payload is ``(groups, records, now_ns, dropped, dumps,
    states)`` (step 8's stack-grid dumps, step 9's channel states; a batch may hold only those).

    ``end`` is always 0: see the module docstring (durability)."""
    if len(batch.records) > config.max_records_per_batch or len(batch.states) > config.max_records_per_batch:
        raise ValueError(f"collective batch of {len(batch.records)} records and {len(batch.states)} channel "
                         f"states (limit {config.max_records_per_batch} each)")
    groups = []
    for g in batch.groups:
        if not g.id or len(g.id) > MAX_NAME or not g.members or any(m >= world_size for m in g.members):
            groups.append(None)
            continue
        groups.append(g)
    good = []
    for r in batch.records:
        reason = None
        if r.group >= len(groups) or groups[r.group] is None:
            reason = "collective_group"
        elif not r.seq or not r.op or len(r.op) > MAX_NAME or len(r.dtype) > MAX_NAME:
            reason = "collective_fields"
        elif not 0 < r.enqueue_ns <= max_ts or r.start_ns > max_ts or r.end_ns > max_ts:
            reason = "timestamp"
        elif r.end_ns and not (r.enqueue_ns <= r.end_ns <= r.enqueue_ns + MAX_COLLECTIVE_NS):
            reason = "duration"
        if reason:
            metrics.inc("records_rejected", 1, reason=reason)
        else:
            good.append(r)
    dumps = tuple(d for d in batch.dumps[:MAX_DUMPS_PER_BATCH] if valid_dump(d, world_size, metrics))
    if len(batch.dumps) > MAX_DUMPS_PER_BATCH:
        metrics.inc("records_rejected", len(batch.dumps) - MAX_DUMPS_PER_BATCH, reason="stack_dump")
    states = tuple(x for x in batch.states if valid_state(x, groups, world_size, max_ts))   # step 9
    if len(states) < len(batch.states):
        metrics.inc("records_rejected", len(batch.states) - len(states), reason="channel_state")
    if not good and not dumps and not states:
        raise ValueError("collective batch with no valid records")
    if 0 < batch.now_ns <= max_ts:
        now = batch.now_ns
    else:
        now = max([max(r.end_ns, r.enqueue_ns) for r in good] + [x.time_ns for x in states], default=0)
    return ((tuple(groups), tuple(good), now, batch.dropped_records, dumps, states),
            len(good) + len(dumps) + len(states), 0)


class _Open:
    __slots__ = ("opened", "groups", "group_index", "records", "now_ns", "dropped", "collector_dropped",
                 "durations", "lo", "hi", "states", "completed")

    def __init__(self, opened: float) -> None:
        self.opened = opened
        self.groups: list[telemetry_pb2.CollectiveGroup] = []
        self.group_index: dict[str, int] = {}
        self.records: list[telemetry_pb2.CollectiveRecord] = []
        self.now_ns = 0
        self.dropped = 0
        self.collector_dropped = 0
        # (group id, op, size class) -> [durations ns], [bytes]: summaries cover every record
        self.durations: dict[tuple[str, str, int], tuple[list, list]] = {}
        self.lo, self.hi = 2**63, 0
        # step 10: (group index, seq, channel) -> the newest ChannelState; step 11: (group index, seq) completed
        self.states: dict[tuple[int, int, int], telemetry_pb2.ChannelState] = {}
        self.completed: set[tuple[int, int]] = set()


class CollectiveWindows:
    """Per-(job, rank) collective windows on the processor's clock. One processing thread owns it."""

    def __init__(self, config: CollectiveWindowConfig, emit: Callable[[WindowOutput], None],
                 metrics: SelfMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._emit = emit
        self.metrics = metrics or SelfMetrics()
        self._clock = clock
        self._open: dict[tuple[str, int], tuple[Resource, _Open]] = {}
        self._index: dict[tuple[str, int], int] = {}
        self.triggers = Triggers(config.trigger, self.metrics)
        self._gated = config.trigger.raw_records == "triggered"
        # step 6: per rank, the raw records of its last closed windows: (resource, {group id: (group, [records])})
        self._rings: dict[tuple[str, int], collections.deque] = {}
        self._hot: dict[tuple[str, str], float] = {}     # (job, group) -> processor clock it stays hot until
        self._ring_seen: dict[tuple[str, int], float] = {}   # when each ring was last appended to
        self._swept = self._clock()
        self.grids = GridRequests(config.trigger, self.metrics, clock)
        """Step 7; its ``control`` is the host's ``ControlHub`` (None: no grids)."""

    def add(self, resource: Resource, payload: tuple) -> None:
        """Step 2: file one validated batch under its rank's open window (step 8: dumps go out at once)."""
        groups, records, now_ns, collector_dropped = payload[:4]
        states = payload[5] if len(payload) > 5 else ()
        if len(payload) > 4 and payload[4]:
            self._emit_dumps(resource, payload[4])
            if not records and not states:
                return
        key = (resource.job_id, resource.rank)
        held = self._open.get(key)
        if held is None:
            held = self._open[key] = (resource, _Open(self._clock()))
        w = held[1]
        w.now_ns = max(w.now_ns, now_ns)
        w.collector_dropped = max(w.collector_dropped, collector_dropped)
        remap: dict[int, int] = {}
        for i, g in enumerate(groups):
            if g is None:
                continue
            j = w.group_index.get(g.id)
            if j is None and len(w.groups) < self.config.max_groups_per_window:
                j = w.group_index[g.id] = len(w.groups)
                w.groups.append(g)
            if j is not None:
                remap[i] = j
        cap = self.config.max_records_per_window
        fired = []
        watched: dict[int, bool] = {}   # group index -> this rank is in its trigger sample (step 4)
        for r in records:
            j = remap.get(r.group)
            if j is None:
                w.dropped += 1
                continue
            on = watched.get(j)
            if on is None:
                g = w.groups[j]
                on = watched[j] = self.triggers.sampled(resource.job_id, g.id, g.members, resource.rank)
            if on:
                t = self.triggers.observe(resource.job_id, resource.rank, w.groups[j], r, now_ns)
                if t is not None:
                    fired.append(t)
            if r.end_ns:
                d, b = w.durations.setdefault((w.groups[j].id, r.op, size_class(r.bytes)), ([], []))
                d.append(r.end_ns - r.enqueue_ns)
                b.append(r.bytes)
                w.completed.add((j, r.seq))
            w.lo = min(w.lo, r.enqueue_ns)
            w.hi = max(w.hi, r.end_ns or now_ns)
            if len(w.records) >= cap:
                w.dropped += 1
                continue
            if j != r.group:
                r2 = telemetry_pb2.CollectiveRecord()
                r2.CopyFrom(r)   # every field, the ring decomposition's too
                r2.group = j
                r = r2
            w.records.append(r)
        if states:
            self._add_states(w, remap, states)
        for t in fired:
            self._on_trigger(t)

    def _add_states(self, w: _Open, remap: dict[int, int], states) -> None:
        """Step 10: the newest state per (group, seq, channel) of the window, bounded."""
        cap = self.config.max_states_per_window
        for x in states:
            j = remap.get(x.group)
            if j is None:
                self.metrics.inc("channel_states", 1, fate="dropped")
                continue
            key = (j, x.seq, x.channel)
            held = w.states.get(key)
            if held is not None:
                if x.time_ns < held.time_ns:
                    self.metrics.inc("channel_states", 1, fate="superseded")   # an older sample
                    continue
                if (x.gpu_ready < held.gpu_ready or x.rdma_transmitted < held.rdma_transmitted
                        or x.rdma_done < held.rdma_done or x.total_chunks != held.total_chunks):
                    self.metrics.inc("records_rejected", 1, reason="channel_state_backwards")
                    continue
                self.metrics.inc("channel_states", 1, fate="superseded")
            elif len(w.states) >= cap:
                self.metrics.inc("channel_states", 1, fate="dropped")
                self.metrics.inc("drops", 1, where="channel_states")
                continue
            if j != x.group:
                y = telemetry_pb2.ChannelState()
                y.CopyFrom(x)
                y.group = j
                x = y
            w.states[key] = x
            w.lo = min(w.lo, x.time_ns)
            w.hi = max(w.hi, x.time_ns)

    def _states_out(self, w: _Open) -> list:
        """Step 11: the held states of collectives with no completion in the window."""
        out = [x for k, x in w.states.items() if (k[0], k[1]) not in w.completed]
        if len(out) < len(w.states):
            self.metrics.inc("channel_states", len(w.states) - len(out), fate="completed")
        if out:
            self.metrics.inc("channel_states", len(out), fate="kept")
        return out

    def tick(self) -> None:
        """Step 3: close windows open for ``length_s`` (call from the pipeline's idle check)."""
        now = self._clock()
        for key in [k for k, (_, w) in self._open.items() if now - w.opened >= self.config.length_s]:
            self._close(key)
        if now - self._swept >= self.config.length_s:   # step 6's rings and hot groups of ranks gone quiet
            self._swept = now
            stale = now - self.config.length_s * (self.config.trigger.lookback_windows + 1)
            for key in [k for k, t in self._ring_seen.items() if t < stale and k not in self._open]:
                self._forget_ring(key)
            for key in [k for k, until in self._hot.items() if now >= until]:
                del self._hot[key]

    def _forget_ring(self, key: tuple[str, int]) -> None:
        ring = self._rings.pop(key, None)
        self._ring_seen.pop(key, None)
        n = sum(len(held[1]) for _, by_group in ring or () for held in by_group.values())
        if n:
            self.metrics.inc("collective_raw_records", n, fate="summarised")

    def flush(self) -> None:
        for key in list(self._open):
            self._close(key)

    def finish_rank(self, resource: Resource) -> None:
        key = (resource.job_id, resource.rank)
        if key in self._open:
            self._close(key)
        self._index.pop(key, None)
        self._forget_ring(key)
        self.triggers.forget(*key)

    @property
    def open_windows(self) -> int:
        return len(self._open)

    # ------------------------------------------------------------ step 6
    def hot(self, job: str, gid: str) -> bool:
        until = self._hot.get((job, gid))
        if until is None:
            return False
        if self._clock() >= until:
            del self._hot[(job, gid)]
            return False
        return True

    # ------------------------------------------------------------ steps 7-8
    def _emit_dumps(self, resource: Resource, dumps) -> None:
        """Step 8: a rank's dumps, each at once in a ``CollectiveWindow`` of their own."""
        key = (resource.job_id, resource.rank)
        for d in dumps:
            index = self._index.get(key, 0)
            self._index[key] = index + 1
            window = records_pb2.Window(kind=records_pb2.WINDOW_KIND_TIME, index=index)
            rec = records_pb2.CollectiveWindow(resource=resource.to_pb(), window=window, dumps=[d])
            self.metrics.inc("stack_grid_dumps", 1, outcome="error" if d.error else "ok")
            raw = ClosedWindow(resource=resource, window=records_pb2.Window(kind=window.kind, index=index),
                               kernels=KernelColumns.empty())
            self._emit(WindowOutput(raw=raw, collectives=rec))

    def _on_trigger(self, t: Trigger) -> None:
        """A trigger on a group: hot for ``hot_s``; pull the group's records from every member's ring;
        ask for its stack grid (step 7)."""
        self._hot[(t.job_id, t.group)] = self._clock() + self.config.trigger.hot_s
        self.grids.request(t)
        if not self._gated:
            return   # every window carries its raw records already
        for m in t.members:
            ring = self._rings.get((t.job_id, m))
            if not ring:
                continue
            res, group, rows, held_states = None, None, [], {}
            for res_i, by_group in ring:
                hit = by_group.pop(t.group, None)
                if hit is not None:
                    res, group = res_i, hit[0]
                    rows += hit[1]
                    for x in hit[2]:        # step 11: the newest state per (seq, channel) of the ring
                        held_states[(x.seq, x.channel)] = x
            if not rows and not held_states:
                continue
            index = self._index.get((t.job_id, m), 0)
            self._index[(t.job_id, m)] = index + 1
            copies = []
            for r in rows:   # the ingest batch's messages: copied, not renumbered in place
                c = telemetry_pb2.CollectiveRecord()
                c.CopyFrom(r)
                c.group = 0
                copies.append(c)
            rows = copies
            done = {r.seq for r in rows if r.end_ns}
            sts = []
            for x in held_states.values():
                if x.seq not in done:       # a later window's completion supersedes it
                    c = telemetry_pb2.ChannelState()
                    c.CopyFrom(x)
                    c.group = 0
                    sts.append(c)
            times = [t_ for r in rows for t_ in (r.enqueue_ns, r.end_ns)] + [x.time_ns for x in sts]
            window = records_pb2.Window(kind=records_pb2.WINDOW_KIND_TIME, index=index,
                                        start_ns=min((t_ for t_ in times if t_), default=0),
                                        end_ns=max(times, default=0))
            rec = records_pb2.CollectiveWindow(resource=res.to_pb(), window=window, groups=[group], records=rows,
                                               now_ns=max(times, default=0), states=sts)
            if rows:
                self.metrics.inc("collective_raw_records", len(rows), fate="pulled")
            raw = ClosedWindow(resource=res, window=records_pb2.Window(kind=window.kind, index=index),
                               kernels=KernelColumns.empty())
            self._emit(WindowOutput(raw=raw, collectives=rec))

    def _gate(self, key: tuple[str, int], res: Resource, w: _Open, states: list = ()) -> list:
        """Step 6: the records this window carries; the others go to the rank's ring (with the window's
        channel states, step 11, which the window carries in any case)."""
        if not self._gated:
            if w.records:
                self.metrics.inc("collective_raw_records", len(w.records), fate="kept")
            return w.records
        keep, held = [], {}

        def slot(g):
            return held.setdefault(g.id, (telemetry_pb2.CollectiveGroup(id=g.id, members=g.members), [], []))
        for r in w.records:
            g = w.groups[r.group]
            if self.hot(key[0], g.id):
                keep.append(r)
            else:
                slot(g)[1].append(r)
        for x in states:
            slot(w.groups[x.group])[2].append(x)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = collections.deque(maxlen=self.config.trigger.lookback_windows)
        if len(ring) == ring.maxlen:
            n = sum(len(h[1]) for _, by_group in [ring[0]] for h in by_group.values())
            if n:
                self.metrics.inc("collective_raw_records", n, fate="summarised")
        ring.append((res, held))
        self._ring_seen[key] = self._clock()
        if keep:
            self.metrics.inc("collective_raw_records", len(keep), fate="kept")
        return keep

    def _close(self, key: tuple[str, int]) -> None:
        res, w = self._open.pop(key)
        for t in self.triggers.evaluate(key[0], key[1], w.now_ns):   # step 5 at the rank's window close
            self._on_trigger(t)
        index = self._index.get(key, 0)
        self._index[key] = index + 1
        window = records_pb2.Window(kind=records_pb2.WINDOW_KIND_TIME, index=index,
                                    start_ns=w.lo if w.lo < 2**63 else 0, end_ns=w.hi)
        states = self._states_out(w)                                   # step 11
        rec = records_pb2.CollectiveWindow(resource=res.to_pb(), window=window, groups=w.groups,
                                           records=self._gate(key, res, w, states), now_ns=w.now_ns,
                                           records_dropped=w.dropped, collector_dropped=w.collector_dropped,
                                           states=states)
        for (gid, op, sc), (durs, nbytes) in sorted(w.durations.items()):
            a = np.asarray(durs, dtype=np.float64)
            p50, p99 = np.percentile(a, [50, 99])
            rec.stats.add(group=gid, op=op, size_class=sc, count=len(a), p50_ns=float(p50), p99_ns=float(p99),
                          max_ns=float(a.max()), total_bytes=float(sum(nbytes)))
        if w.dropped:
            self.metrics.inc("drops", w.dropped, where="collectives")
        self.metrics.inc("windows_closed", 1, trigger="collectives")
        # end_ns 0 on the raw side: a collective window never moves durability's closed_until
        raw = ClosedWindow(resource=res, window=records_pb2.Window(kind=window.kind, index=index),
                           kernels=KernelColumns.empty())
        self._emit(WindowOutput(raw=raw, collectives=rec))


__all__ = ["CollectiveWindowConfig", "CollectiveWindows", "MAX_COLLECTIVE_NS", "Trigger", "TriggerConfig", "Triggers",
           "sample", "size_class", "valid_state", "validate"]
