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

The closed window's ``raw`` part carries a window with ``end_ns = 0``, so
``processor/durability.py`` never counts a collective window as closing a
rank's iteration windows; collective batches are admitted with end 0 for the
same reason (at most ``length_s`` of collective records is lost when a
processor is killed, never kernels or phases).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from trainscope.processor.model import ClosedWindow, WindowOutput
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2, telemetry_pb2

#: Longest plausible collective (a day): a longer one is a corrupt timestamp.
MAX_COLLECTIVE_NS = 24 * 3600 * 10**9
MAX_NAME = 64


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveWindowConfig:
    length_s: float = 2.0
    """Processor wall time a rank's collective window stays open (hang latency adds to it)."""
    max_records_per_window: int = 8192
    """Raw records kept per rank and window; beyond it records are summarised only."""
    max_groups_per_window: int = 1024
    """Distinct process groups kept per rank and window."""
    max_records_per_batch: int = 65_536
    """A batch with more records is refused (a collector ships every second)."""

    def __post_init__(self) -> None:
        if not self.length_s > 0:
            raise ConfigError("collectives.length_s", self.length_s, "must be > 0")
        for f in ("max_records_per_window", "max_groups_per_window", "max_records_per_batch"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 1):
                raise ConfigError(f"collectives.{f}", getattr(self, f), "must be an integer >= 1")


def size_class(nbytes: int) -> int:
    """floor(log2(bytes)): collectives of one bucket size are comparable (0 for empty payloads)."""
    return int(nbytes).bit_length() - 1 if nbytes > 0 else 0


def validate(batch: telemetry_pb2.CollectiveBatch, world_size: int, max_ts: int, metrics: SelfMetrics,
             config: CollectiveWindowConfig = CollectiveWindowConfig()) -> tuple[tuple, int, int]:
    """Step 1: (payload, records, end) where payload is ``(groups, records, now_ns, dropped)``.

    ``end`` is always 0: see the module docstring (durability)."""
    if len(batch.records) > config.max_records_per_batch:
        raise ValueError(f"collective batch of {len(batch.records)} records "
                         f"(limit {config.max_records_per_batch})")
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
    if not good:
        raise ValueError("collective batch with no valid records")
    now = batch.now_ns if 0 < batch.now_ns <= max_ts else max(max(r.end_ns, r.enqueue_ns) for r in good)
    return (tuple(groups), tuple(good), now, batch.dropped_records), len(good), 0


class _Open:
    __slots__ = ("opened", "groups", "group_index", "records", "now_ns", "dropped", "collector_dropped",
                 "durations", "lo", "hi")

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

    def add(self, resource: Resource, payload: tuple) -> None:
        """Step 2: file one validated batch under its rank's open window."""
        groups, records, now_ns, collector_dropped = payload
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
        for r in records:
            j = remap.get(r.group)
            if j is None:
                w.dropped += 1
                continue
            if r.end_ns:
                d, b = w.durations.setdefault((w.groups[j].id, r.op, size_class(r.bytes)), ([], []))
                d.append(r.end_ns - r.enqueue_ns)
                b.append(r.bytes)
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

    def tick(self) -> None:
        """Step 3: close windows open for ``length_s`` (call from the pipeline's idle check)."""
        now = self._clock()
        for key in [k for k, (_, w) in self._open.items() if now - w.opened >= self.config.length_s]:
            self._close(key)

    def flush(self) -> None:
        for key in list(self._open):
            self._close(key)

    def finish_rank(self, resource: Resource) -> None:
        key = (resource.job_id, resource.rank)
        if key in self._open:
            self._close(key)
        self._index.pop(key, None)

    @property
    def open_windows(self) -> int:
        return len(self._open)

    def _close(self, key: tuple[str, int]) -> None:
        res, w = self._open.pop(key)
        index = self._index.get(key, 0)
        self._index[key] = index + 1
        window = records_pb2.Window(kind=records_pb2.WINDOW_KIND_TIME, index=index,
                                    start_ns=w.lo if w.lo < 2**63 else 0, end_ns=w.hi)
        rec = records_pb2.CollectiveWindow(resource=res.to_pb(), window=window, groups=w.groups,
                                           records=w.records, now_ns=w.now_ns, records_dropped=w.dropped,
                                           collector_dropped=w.collector_dropped)
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


__all__ = ["CollectiveWindowConfig", "CollectiveWindows", "size_class", "validate", "MAX_COLLECTIVE_NS"]
