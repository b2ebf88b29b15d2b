"""The processor's leg of the stack grid (Mycroft §5 evidence; steps 7-8 of ``collectives.py``).

Mycroft attaches to a collective trigger the py-spy stacks of every rank of
the group, taken at the same moment, so an engineer sees at a glance which
rank is somewhere else ("rank 2 in ``time.sleep``; ranks 0, 1, 3 in
``all_reduce``"). Here:

1. ``GridRequests.request`` (the processing thread, on a hang or straggler
   trigger): one ``StackDumpCommand`` to every member of the group that holds a
   control stream to this processor (``ControlHub.subscribers``), queued on
   all of their streams in one pass (``ControlHub.send``, never blocks), so
   the dumps are taken within the streams' delivery time of each other. At
   most one grid per (job, group) and ``grid_cooldown_s``; counted in
   ``stack_grid_requests{outcome=sent|cooldown|unreachable|error}``.
2. Each collector runs py-spy out of process (``collector/stacks.StackDumper``)
   and returns its dump on the ingest stream in a ``CollectiveBatch``;
   ``valid_dump`` bounds it at ingest (threads, stack length, ids), and
   ``CollectiveWindows`` emits it at once (``stack_grid_dumps{outcome}``). The
   dump carries the rank's Flight Recorder view (per process group the newest
   seq entered and the last entries, ``collector/flight_recorder.view``), bounded
   here too (step 2b), and how the rank's read of its recorder went, counted here
   (step 2c): ``flight_recorder_views{outcome=ok|off|error}``,
   ``flight_recorder_entries`` (entries torch's dumps held),
   ``flight_recorder_read_seconds_sum`` and ``_max`` (the dumpers' read time).
3. The analyzer clusters the dumps by stack (``analyzer/stack_grid.py``).

Assumption: a group's members reach this processor's control channel; the
members on other hosts are only dumped by their own processor when it
triggers too (a hang's grid id is ``<group>-hang-<seq>`` on every processor,
so the analyzer merges them). A member without a control stream is listed by
the analyzer as "no dump".
"""
from __future__ import annotations

import collections
import re
import time
from typing import Callable

from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.v1 import control_pb2, telemetry_pb2

#: Step 2's bounds on one dump: threads, characters of a thread's folded stack (the innermost end kept).
MAX_DUMP_THREADS = 64
MAX_DUMP_STACK = 8192
MAX_DUMPS_PER_BATCH = 4
MAX_NAME = 64
#: Step 2b's bounds on a dump's Flight Recorder view: groups, entries per group (newest kept), sizes text.
MAX_FR_GROUPS = 16
MAX_FR_ENTRIES = 32
MAX_FR_SIZES = 128
FR_STATES = ("scheduled", "started", "completed")
FR_OUTCOMES = ("ok", "off", "error")
#: Step 2c: a read time above this (a clock jump, a bad sender) is not added to the sums.
MAX_FR_READ_S = 600.0
GRID_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,95}")


def valid_dump(d: telemetry_pb2.StackDump, world_size: int, metrics: SelfMetrics) -> bool:
    """Step 2: a dump names its grid, group and trigger; its threads are bounded (a long stack keeps
    its innermost end, where the grid looks). A bad dump is rejected and counted."""
    if (not GRID_ID.fullmatch(d.grid_id) or not d.group or len(d.group) > MAX_NAME
            or d.trigger not in ("hang", "straggler") or len(d.threads) > MAX_DUMP_THREADS
            or len(d.expected_ranks) > world_size or any(not 0 <= r < world_size for r in d.expected_ranks)):
        metrics.inc("records_rejected", 1, reason="stack_dump")
        return False
    for t in d.threads:
        if len(t.stack) > MAX_DUMP_STACK:
            t.stack = t.stack[-MAX_DUMP_STACK:]
            metrics.inc("records_truncated", 1, what="stack")
    if len(d.error) > 256:
        d.error = d.error[:256]
    _count_flight_recorder(d, _bound_flight_recorder(d, metrics), metrics)
    return True


def _bound_flight_recorder(d: telemetry_pb2.StackDump, metrics: SelfMetrics) -> bool:
    """Step 2b: the dump's Flight Recorder view bounded (groups, newest entries kept); a view with a
    malformed field is dropped (the stack dump stays), its reason in ``flight_recorder_error``. True
    when it was dropped."""
    if len(d.flight_recorder_error) > 256:
        d.flight_recorder_error = d.flight_recorder_error[:256]
    if len(d.flight_recorder) > MAX_FR_GROUPS:
        del d.flight_recorder[MAX_FR_GROUPS:]
        metrics.inc("records_truncated", 1, what="flight_recorder")
    bad = ""
    for g in d.flight_recorder:
        if not g.group or len(g.group) > MAX_NAME or len(g.desc) > MAX_NAME or g.last_completed_seq < -1:
            bad = "group"
        if len(g.entries) > MAX_FR_ENTRIES:
            del g.entries[:len(g.entries) - MAX_FR_ENTRIES]
            metrics.inc("records_truncated", 1, what="flight_recorder")
        for e in g.entries:
            if (e.state not in FR_STATES or not e.op or len(e.op) > MAX_NAME or len(e.sizes) > MAX_FR_SIZES
                    or e.seq > g.newest_seq):
                bad = "entry"
    if bad:
        del d.flight_recorder[:]
        d.flight_recorder_error = f"Flight Recorder view rejected by the processor (malformed {bad})"
        metrics.inc("records_rejected", 1, reason="flight_recorder")
    return bool(bad)


def _count_flight_recorder(d: telemetry_pb2.StackDump, rejected: bool, metrics: SelfMetrics) -> None:
    """Step 2c: the rank's Flight Recorder read counted where an operator sees it. The outcome is the
    collector's (``flight_recorder_outcome``), except: a view rejected in step 2b, an ``ok`` without a
    view and an unknown outcome are errors; a collector older than the field sent none (ok with a view,
    else off). The outcome is written back on the dump, so the analyzer reads the same."""
    outcome, has_view = d.flight_recorder_outcome, len(d.flight_recorder) > 0
    if not outcome:
        outcome = "ok" if has_view else "off"
    elif outcome not in FR_OUTCOMES or (outcome == "ok" and not has_view):
        outcome = "error"
    if rejected:
        outcome = "error"
    d.flight_recorder_outcome = outcome
    metrics.inc("flight_recorder_views", 1, outcome=outcome)
    metrics.inc("flight_recorder_entries", d.flight_recorder_entries)
    took = d.flight_recorder_read_s
    if 0 <= took <= MAX_FR_READ_S:      # NaN fails both
        metrics.inc("flight_recorder_read_seconds_sum", took)
        metrics.set_max("flight_recorder_read_seconds_max", took)


def grid_id(group: str, kind: str, seq: int) -> str:
    """``<group>-hang-<seq>`` (the same on every processor of the job), else ``<group>-<kind>-<unix ms>``."""
    tail = str(seq) if seq else str(time.time_ns() // 10**6)
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', group)[:48]}-{kind}-{tail}"


class GridRequests:
    """Step 1 for one processor; the processing thread owns it."""

    def __init__(self, config, metrics: SelfMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config            # collectives.TriggerConfig: stack_grid, grid_cooldown_s, grid_timeout_s
        self.metrics = metrics
        self._clock = clock
        self.control = None
        """The host's ``ControlHub`` (``subscribers(job)``, ``send(job, ranks, command)``); None: no grids."""
        self._last: "collections.OrderedDict[tuple[str, str], float]" = collections.OrderedDict()

    def request(self, t) -> list[int]:
        """Ask every subscribed member of trigger ``t``'s group for one dump; the ranks reached."""
        cfg = self.config
        if self.control is None or not cfg.stack_grid:
            return []
        try:
            return self._request(t)
        except Exception:   # evidence only: a failed request must not cost the trigger its records
            self.metrics.inc("stack_grid_requests", 1, outcome="error")
            return []

    def _request(self, t) -> list[int]:
        cfg = self.config
        key = (t.job_id, t.group)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < cfg.grid_cooldown_s:
            self.metrics.inc("stack_grid_requests", 1, outcome="cooldown")
            return []
        ranks = sorted(set(t.members) & set(self.control.subscribers(t.job_id)))
        reached = []
        if ranks:
            seq = int(t.detail.get("seq", 0)) if t.kind == "hang" else 0
            cmd = control_pb2.StackDumpCommand(grid_id=grid_id(t.group, t.kind, seq), job_id=t.job_id,
                                               group=t.group, trigger=t.kind, seq=seq, ranks=ranks,
                                               timeout_s=cfg.grid_timeout_s)
            reached = self.control.send(t.job_id, ranks, control_pb2.ControlCommand(
                sent_unix_ns=time.time_ns(), stack_dump=cmd))
        if not reached:
            self.metrics.inc("stack_grid_requests", 1, outcome="unreachable")
            return []
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > cfg.max_groups:
            self._last.popitem(last=False)
        self.metrics.inc("stack_grid_requests", 1, outcome="sent")
        return reached


__all__ = ["FR_OUTCOMES", "FR_STATES", "GRID_ID", "GridRequests", "MAX_DUMPS_PER_BATCH", "MAX_FR_ENTRIES", "MAX_FR_GROUPS", "MAX_DUMP_STACK", "MAX_DUMP_THREADS", "grid_id",
           "valid_dump"]
