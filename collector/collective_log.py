"""Per-collective records of one rank (Mycroft §4.2), shipped without ever blocking training.

The torch hooks (``torch_collectives.py``) call ``begin`` when a collective is
entered and ``end`` when it completes. Steps:

1. ``begin``: the group's next sequence number (per group, counted by this
   rank: the n-th collective on a group is the same collective on every member,
   as long as every member issues them through the same code), the enqueue
   time, kept in an in-flight table.
2. ``end``: the end time; the record moves to a bounded buffer. A full buffer
   drops the record and counts it (``dropped``); nothing here waits or raises
   into the training thread (errors are swallowed and counted).
3. A daemon thread ships every ``interval_s``: the completed records plus a
   state record (``end_ns = 0``) for each collective in flight for longer than
   ``inflight_report_s`` (Mycroft's periodic state records: a rank stuck in a
   collective keeps saying so while its training thread is blocked), with the
   rank's clock (``now_ns``). The exporter's ``submit`` never blocks either: a
   full exporter queue drops the batch, counted.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Any

from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import telemetry_pb2

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveLogConfig:
    interval_s: float = 1.0
    """How often completed and in-flight records are shipped."""
    inflight_report_s: float = 1.0
    """A collective in flight longer than this is reported as a state record at each ship."""
    max_buffered: int = 65_536
    """Completed records waiting for the next ship; beyond it they are dropped and counted."""
    max_inflight: int = 4096
    """Collectives tracked in flight (async handles never waited on are forgotten beyond it)."""

    def __post_init__(self) -> None:
        for f in ("interval_s", "inflight_report_s"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"collectives.{f}", getattr(self, f), "must be > 0")
        for f in ("max_buffered", "max_inflight"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 1):
                raise ConfigError(f"collectives.{f}", getattr(self, f), "must be an integer >= 1")


@dataclasses.dataclass(slots=True)
class Pending:
    """One collective of this rank, in flight until ``end_ns`` is set."""

    group: str
    seq: int
    op: str
    nbytes: int
    dtype: str
    enqueue_ns: int
    iteration: int
    start_ns: int = 0
    end_ns: int = 0
    key: int = 0


class CollectiveLog:
    """Step 1-3 of the module docstring; thread-safe (DDP hooks run on autograd threads)."""

    def __init__(self, submit, config: CollectiveLogConfig = CollectiveLogConfig()) -> None:
        self._submit = submit            # exporter.submit(payload, nbytes) -> bool, never blocks
        self.config = config
        self._lock = threading.Lock()
        self._groups: dict[str, tuple[int, ...]] = {}
        self._seq: dict[str, int] = collections.defaultdict(int)
        self._inflight: dict[int, Pending] = {}
        self._done: list[Pending] = []
        self._keys = itertools.count(1)
        self.dropped = 0
        self.recorded = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pid = os.getpid()

    # ---------------------------------------------------------------- steps 1-2
    def begin(self, group: str, members: tuple[int, ...], op: str, nbytes: int, dtype: str,
              iteration: int = 0) -> Pending | None:
        try:
            now = time.time_ns()
            with self._lock:
                if group not in self._groups:
                    self._groups[group] = tuple(members)
                self._seq[group] += 1
                p = Pending(group, self._seq[group], op, int(nbytes), dtype, now, iteration, key=next(self._keys))
                if len(self._inflight) >= self.config.max_inflight:
                    self._inflight.pop(next(iter(self._inflight)))   # oldest first
                    self.dropped += 1
                self._inflight[p.key] = p
            self._ensure_thread()
            return p
        except Exception:
            self.dropped += 1
            return None

    def end(self, p: Pending | None, end_ns: int | None = None) -> None:
        if p is None:
            return
        try:
            p.end_ns = end_ns or time.time_ns()
            with self._lock:
                if self._inflight.pop(p.key, None) is None:
                    return   # forgotten (bound) or ended twice
                if len(self._done) >= self.config.max_buffered:
                    self.dropped += 1
                    return
                self._done.append(p)
                self.recorded += 1
        except Exception:
            self.dropped += 1

    # ---------------------------------------------------------------- step 3
    def _ensure_thread(self) -> None:
        if self._pid != os.getpid():   # a forked child is not a rank: never ship from it
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="trainscope-collectives", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.ship()
            except Exception:
                log.debug("shipping collective records failed", exc_info=True)

    def ship(self) -> bool:
        """Hand completed and long in-flight records to the exporter; False when it dropped them."""
        now = time.time_ns()
        late = now - int(self.config.inflight_report_s * 1e9)
        with self._lock:
            done, self._done = self._done, []
            stuck = [dataclasses.replace(p) for p in self._inflight.values() if p.enqueue_ns <= late]
            groups = dict(self._groups)
            dropped = self.dropped
        rows = done + stuck
        if not rows:
            return True

        def build(rows=rows, groups=groups, now=now, dropped=dropped):
            names = sorted({p.group for p in rows})
            index = {g: i for i, g in enumerate(names)}
            return telemetry_pb2.CollectiveBatch(
                groups=[telemetry_pb2.CollectiveGroup(id=g, members=groups.get(g, ())) for g in names],
                records=[telemetry_pb2.CollectiveRecord(
                    group=index[p.group], seq=p.seq, op=p.op, bytes=p.nbytes, dtype=p.dtype,
                    enqueue_ns=p.enqueue_ns, start_ns=p.start_ns or p.enqueue_ns, end_ns=p.end_ns,
                    iteration=p.iteration) for p in rows],
                now_ns=now, dropped_records=dropped)

        ok = bool(self._submit(build, 64 * len(rows)))
        if not ok:
            with self._lock:
                self.dropped += len(done)
        return ok

    def stop(self) -> None:
        """Ship what is left (the end of the process)."""
        self._stop.set()
        try:
            self.ship()
        except Exception:
            log.debug("final collective ship failed", exc_info=True)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"recorded": self.recorded, "dropped": self.dropped, "inflight": len(self._inflight)}


__all__ = ["CollectiveLog", "CollectiveLogConfig", "Pending"]
