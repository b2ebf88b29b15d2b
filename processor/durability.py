"""What a processor may tell a collector it can forget: restarts lose nothing silently (issue #11 item 5).

A batch the processor confirmed is only in memory (an open window) until its
window closes and the sinks have it. A processor killed with SIGKILL loses
those windows, while the exporter had counted their batches as delivered.
So the ingest contract has two more parts (their metadata keys: ``proto/contracts.py``):

1. **Boot id.** Every ingest stream starts with initial metadata
   ``trainscope-boot: <random id of this processor process>``. An exporter that
   sees the id change knows the processor restarted.
2. **Durable sequence.** Each exporter names itself (``trainscope-sender``
   metadata, random per exporter); the summary that ends a stream carries
   ``durable_seq``: every batch of that sender up to it is in a closed window
   handed to the sinks (and, with a store, written: no store backlog). The
   exporter keeps confirmed batches above it (bounded bytes) and re-sends them
   first, on a stream of their own flagged ``trainscope-replay: 1``, when the
   boot id changes. Offered only by a processor with a store (step 4 needs it).

Steps of :class:`Durability` (sender state is per sender, in seq order):

1. ``admitted(sender, seq, job, rank, end)``: an accepted batch waits, with the
   latest end time (rank clock) of its records;
2. ``export(out)`` (a sink, last in the list): a closed window of (job, rank)
   moves that rank's ``closed_until`` to the window's end, unless the store
   still holds failed windows in its backlog;
3. ``durable_seq(sender)``: batches are released from the front while their end
   is at or before their rank's ``closed_until``; the answer is the last
   released seq (everything when nothing waits);
4. after a restart, ``stored_until`` (read from the store at start) drops
   replayed records of windows the previous process had already stored, so a
   replay never stores a window twice (``records_rejected{reason="already_stored"}``).

Assumption: a record belongs to the window its start falls in, and a rank's
windows close in time order (``processor/windows.py``).
"""
from __future__ import annotations

import collections
import threading
import uuid
from typing import Callable

from trainscope.processor.model import WindowOutput
from trainscope.proto.contracts import Signal


class _Sender:
    __slots__ = ("waiting", "last_seq")

    def __init__(self) -> None:
        self.waiting: collections.deque[tuple[int, tuple[str, int], int]] = collections.deque()
        self.last_seq = 0


class Durability:
    """Tracks which confirmed batches are safe in closed, written windows. Also a Sink."""

    name = "durability"

    def __init__(self, *, enabled: bool = True, store_backlog: Callable[[], int] = lambda: 0,
                 stored_until: dict[tuple[str, int], int] | None = None,
                 max_senders: int = 4096, max_waiting: int = 65_536) -> None:
        self.boot_id = uuid.uuid4().hex
        #: Offer the replay (send the boot id) only when windows outlive the process, in a store whose
        #: ``stored_until`` keeps a replay from writing a window twice; without one, a restarted
        #: processor could tell neither what was lost nor what was already delivered.
        self.enabled = enabled
        self._store_backlog = store_backlog
        self.stored_until = dict(stored_until or {})
        self._closed_until: dict[tuple[str, int], int] = {}
        self._senders: collections.OrderedDict[str, _Sender] = collections.OrderedDict()
        self._max_senders = max_senders
        self._max_waiting = max_waiting
        self._lock = threading.Lock()

    # -- step 1: ingest threads
    def admitted(self, sender: str, seq: int, job: str, rank: int, end_ns: int) -> None:
        if not self.enabled or not sender or not seq:
            return  # no replay offered: nothing to track
        with self._lock:
            st = self._senders.get(sender)
            if st is None:
                if len(self._senders) >= self._max_senders:
                    self._senders.popitem(last=False)
                st = self._senders[sender] = _Sender()
            else:
                self._senders.move_to_end(sender)
            if len(st.waiting) >= self._max_waiting:
                st.waiting.popleft()
            st.waiting.append((seq, (job, rank), end_ns))
            st.last_seq = max(st.last_seq, seq)

    # -- step 3
    def durable_seq(self, sender: str) -> int:
        with self._lock:
            st = self._senders.get(sender)
            if st is None:
                return 0
            while st.waiting:
                seq, key, end = st.waiting[0]
                if end and end > self._closed_until.get(key, -1):
                    return seq - 1  # everything before the first batch still in an open window
                st.waiting.popleft()
            return st.last_seq

    # -- step 2: the Sink protocol (processing thread)
    def export(self, out: WindowOutput) -> None:
        if self._store_backlog():
            return  # not written yet: a restart would lose it, so nobody may forget it
        res, w = out.raw.resource, out.raw.window
        key = (res.job_id, res.rank)
        with self._lock:
            if w.end_ns > self._closed_until.get(key, -1):
                self._closed_until[key] = w.end_ns

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True

    def close(self) -> None:
        pass


def stored_until(store) -> dict[tuple[str, int], int]:
    """Per (job, rank), the end of the latest window the store holds (read once at start)."""
    try:
        rows = store._db.execute("SELECT job, rank, MAX(window_end) FROM records WHERE signal != ?"
                                 " GROUP BY job, rank", (Signal.COLLECTIVES.value,)).fetchall()
    except Exception:  # an unreadable store is the store sink's to report; replays are then not filtered
        return {}
    return {(job, int(rank)): int(end) for job, rank, end in rows}


def drop_stored(d, until: int):
    """Step 4: ``d`` (a ``Decoded`` batch being replayed) without the records of windows the store
    already holds (start before ``until``); returns (batch or None when nothing is left, dropped)."""
    import dataclasses

    import numpy as np

    p = d.payload
    if d.signal == Signal.KERNELS:
        keep = p.start_ns >= np.uint64(until)
        n = int((~keep).sum())
        if not n:
            return d, 0
        if not keep.any():
            return None, n
        return dataclasses.replace(d, payload=p.take(keep), records=int(keep.sum())), n
    if d.signal in (Signal.PHASES, Signal.ITERATIONS, Signal.STACKS):
        start = (lambda r: r.window_start_ns) if d.signal == Signal.STACKS else (lambda r: r.start_ns)
        kept = tuple(r for r in p if start(r) >= until)
        n = len(p) - len(kept)
        if not n:
            return d, 0
        if not kept:
            return None, n
        return dataclasses.replace(d, payload=kept, records=len(kept)), n
    return d, 0
