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
4. NCCL profiler plugin (opt-in: ``NCCL_PROFILER_PLUGIN`` or
   ``TRAINSCOPE_NCCL_DIR`` set in this process's environment, or a ``RingFile``
   passed in): each ship first polls this process's ring
   (``nccl_profiler.RingFile``, ``<nccl ring dir>/ring-<pid>``) on this thread,
   never the training thread. Communicators map to groups by (size, this
   rank's position): the first group, in order of first use, of that size
   whose member at the communicator rank is this process's global rank
   (unmatched: ``nccl:<hash>``, comm ranks kept, tried again next ship). A
   plugin record joins the hooks' record of the same (group, seq) still here
   (in flight, buffered or held): the plugin's start, end, algorithm, steps,
   send busy and receive wait replace the hooks' times; the hooks' enqueue,
   op, bytes and iteration stay. A different op there: not joined, counted
   (``nccl_unjoined``: the two sources number the group's collectives
   differently, e.g. all-to-all, which NCCL runs as point-to-point calls). A
   key shipped already: counted (``nccl_late``). No hooks record (the hooks
   did not see that collective, e.g. one issued from C++): shipped on its own.
   While the ring is live, a completed hooks record waits one ship for its
   plugin record (written at the same moment). Channel states go in
   ``CollectiveBatch.states``. At ``stop`` the ring file, made by this process's
   plugin, is removed.
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

from trainscope.collector.nccl_profiler import RingFile
from trainscope.proto import env
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
    nccl: Any = None        # the plugin's CollectiveRecord joined to this one (step 4)
    held: bool = False      # waited one ship for its plugin record


#: hooks op -> the NCCL function the plugin names (torch runs a barrier as an all-reduce)
NCCL_OP = {"barrier": "allreduce"}
#: shipped (group, seq) keys remembered, so a late plugin record is not shipped twice
SHIPPED_KEYS = 8192


def nccl_ring(environ=os.environ) -> RingFile | None:
    """This process's plugin ring when the user turned the plugin on (step 4's opt-in), else None."""
    if not (env.text(env.NCCL_PROFILER_PLUGIN, "", environ) or env.text(env.NCCL_DIR, "", environ)):
        return None
    return RingFile(os.path.join(env.nccl_ring_dir(environ), f"ring-{os.getpid()}"))


class CollectiveLog:
    """Step 1-3 of the module docstring; thread-safe (DDP hooks run on autograd threads)."""

    def __init__(self, submit, config: CollectiveLogConfig = CollectiveLogConfig(), *,
                 nccl: RingFile | None | str = "auto", rank: int | None = None) -> None:
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
        # step 4
        if rank is None:
            ident = env.identity(os.environ)
            rank = ident[0] if ident else None
        self.rank = rank
        self._nccl = nccl_ring() if nccl == "auto" else nccl
        if self._nccl is not None:
            self._nccl.assembler.on_comm = self._match_comm
        self._by_key: dict[tuple[str, int], Pending] = {}      # not shipped yet, by (group, seq)
        self._held: list[Pending] = []
        self._shipped: collections.deque = collections.deque(maxlen=SHIPPED_KEYS)
        self._shipped_set: set[tuple[str, int]] = set()
        self._comm_group: dict[int, str] = {}
        self.nccl = collections.Counter()   # joined, own, unjoined, late
        self._ship_lock = threading.Lock()   # one ship at a time (the thread's, stop's): one ring reader
        if self._nccl is not None:
            self._ensure_thread()            # collectives the hooks never see still ship

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
                    gone = self._inflight.pop(next(iter(self._inflight)))   # oldest first
                    self._by_key.pop((gone.group, gone.seq), None)
                    self.dropped += 1
                self._inflight[p.key] = p
                if self._nccl is not None:
                    self._by_key[(group, p.seq)] = p
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
                    self._by_key.pop((p.group, p.seq), None)
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

    def _match_comm(self, comm: int, rank: int, size: int):
        """Step 4: the members of the group this communicator is (None: not known yet)."""
        with self._lock:
            name = self._comm_group.get(comm)
            if name is None:
                taken = set(self._comm_group.values())
                for g, members in self._groups.items():
                    if (g not in taken and len(members) == size and 0 <= rank < size
                            and (self.rank is None or members[rank] == self.rank)):
                        name = self._comm_group[comm] = g
                        break
            return self._groups.get(name) if name is not None else None

    def _poll_nccl(self):
        """Step 4 (this thread only): plugin records joined to the hooks' or kept as their own."""
        try:
            recs, states = self._nccl.poll()
        except Exception:
            log.debug("reading the NCCL plugin ring failed", exc_info=True)
            return [], []
        own = []
        with self._lock:
            for comm, rec in recs:
                g = self._comm_group.get(comm) or f"nccl:{comm:016x}"
                key = (g, int(rec.seq))
                p = self._by_key.get(key)
                if p is not None:
                    if NCCL_OP.get(p.op, p.op) != rec.op:
                        self.nccl["unjoined"] += 1
                    else:
                        p.nccl = rec
                        self.nccl["joined"] += 1
                elif key in self._shipped_set:
                    self.nccl["late"] += 1
                else:
                    own.append((g, rec))
                    self.nccl["own"] += 1
            rows = [(self._comm_group.get(st.comm) or f"nccl:{st.comm:016x}", st) for st in states]
        return own, rows

    def _shipped_key(self, key: tuple[str, int]) -> None:
        if len(self._shipped) == self._shipped.maxlen:
            self._shipped_set.discard(self._shipped[0])
        self._shipped.append(key)
        self._shipped_set.add(key)

    def ship(self, final: bool = False) -> bool:
        """Hand completed and long in-flight records to the exporter; False when it dropped them."""
        with self._ship_lock:
            return self._ship(final)

    def _ship(self, final: bool) -> bool:
        own, states = self._poll_nccl() if self._nccl is not None else ([], [])
        now = time.time_ns()
        late = now - int(self.config.inflight_report_s * 1e9)
        with self._lock:
            done, self._done = self._held + self._done, []
            self._held = []
            if self._nccl is not None and self._nccl.reader is not None and not final:
                # step 4: a record whose plugin record has not come yet waits one ship
                send = []
                for p in done:
                    if p.nccl is None and not p.held:
                        p.held = True
                        self._held.append(p)
                    else:
                        send.append(p)
                done = send
            for p in done:
                if self._by_key.pop((p.group, p.seq), None) is not None:
                    self._shipped_key((p.group, p.seq))
            stuck = [dataclasses.replace(p) for p in self._inflight.values() if p.enqueue_ns <= late]
            groups = dict(self._groups)
            dropped = self.dropped
        rows = done + stuck
        if not rows and not own and not states:
            return True

        def build(rows=rows, own=own, states=states, groups=groups, now=now, dropped=dropped):
            names = sorted({p.group for p in rows} | {g for g, _ in own} | {g for g, _ in states})
            index = {g: i for i, g in enumerate(names)}
            records = []
            for p in rows:
                if p.nccl is not None and p.end_ns:
                    r = telemetry_pb2.CollectiveRecord()
                    r.CopyFrom(p.nccl)
                    r.group, r.op, r.bytes, r.dtype = index[p.group], p.op, p.nbytes, p.dtype
                    r.enqueue_ns, r.iteration = p.enqueue_ns, p.iteration
                    r.start_ns = max(r.start_ns, p.enqueue_ns)
                    records.append(r)
                else:
                    records.append(telemetry_pb2.CollectiveRecord(
                        group=index[p.group], seq=p.seq, op=p.op, bytes=p.nbytes, dtype=p.dtype,
                        enqueue_ns=p.enqueue_ns, start_ns=p.start_ns or p.enqueue_ns, end_ns=p.end_ns,
                        iteration=p.iteration))
            for g, rec in own:
                r = telemetry_pb2.CollectiveRecord()
                r.CopyFrom(rec)
                r.group = index[g]
                records.append(r)
            return telemetry_pb2.CollectiveBatch(
                groups=[telemetry_pb2.CollectiveGroup(id=g, members=groups.get(g, ())) for g in names],
                records=records, now_ns=now, dropped_records=dropped,
                states=[st.to_proto(index[g]) for g, st in states])

        ok = bool(self._submit(build, 64 * (len(rows) + len(own) + len(states))))
        if not ok:
            with self._lock:
                self.dropped += len(done) + len(own)
        return ok

    def stop(self) -> None:
        """Ship what is left (the end of the process)."""
        self._stop.set()
        try:
            self.ship(final=True)
        except Exception:
            log.debug("final collective ship failed", exc_info=True)
        ring = self._nccl
        if ring is not None and ring.reader is not None and os.getpid() == self._pid:
            try:   # made by the plugin in this process (ring-<our pid>), read to the end above
                if os.path.basename(ring.path) == f"ring-{os.getpid()}":
                    os.unlink(ring.path)
            except OSError:
                pass

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = {"recorded": self.recorded, "dropped": self.dropped, "inflight": len(self._inflight)}
            if self._nccl is not None:
                out["nccl"] = {**{k: self.nccl[k] for k in ("joined", "own", "unjoined", "late")},
                               **self._nccl.stats()}
            return out


__all__ = ["CollectiveLog", "CollectiveLogConfig", "NCCL_OP", "Pending", "nccl_ring"]
