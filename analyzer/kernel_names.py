"""The analyzer's side of the kernel-name dictionary (``processor/kernel_names.py``).

Kernel windows arrive with kernel ids and no names; the dictionary's entries arrive on their
own topic (Kafka: compacted, read by every analyzer from offset 0; the embedded bus and the
store the same way). :class:`NameResolver` sits in every record source, so the levels, the
store readers and the reports see ``KernelStats.kernel`` filled in as before.

1. Entries (``add``): per job, id → name. An entry with id 0 or no name is bad input
   (``names_bad``); one that names a known id differently is a conflict (``names_conflicts``:
   the first entry is kept, so every window of the job keeps resolving one way, and it is
   logged once per job). Bounded: ``max_jobs`` jobs (least recently used forgotten) and
   ``max_names_per_job`` (further entries refused and counted: their ids show as labels).
2. Records (``resolve``): in arrival order, per job. A kernel window whose ids are all known
   gets its names; one with an unknown id stops its job's queue — that window and every later
   record of the job wait, so the analyzer sees the job's records in their order, only later —
   until its names come (Kafka gives no order across two topics: the processor sends the entries
   first, a consumer may still see the window first).
3. A job's queue waits at most ``hold_s`` (and ``max_held`` records over all jobs): then its
   head is let through with every unknown id labelled ``kernel#<id>`` (``names_unknown`` counts
   those ids, ``windows_labelled`` the windows). Records of other jobs never wait for it.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from google.protobuf.message import DecodeError, Message

from trainscope.processor.kernel_names import fill_names
from trainscope.proto.contracts import Signal
from trainscope.proto.v1 import records_pb2

log = logging.getLogger(__name__)


class NameResolver:
    """Kernel ids → names for one record source (steps 1-3 of the module docstring)."""

    def __init__(self, *, hold_s: float = 5.0, max_held: int = 100_000, max_jobs: int = 4096,
                 max_names_per_job: int = 1_000_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self.max_held = max_held
        self.max_jobs = max_jobs
        self.max_names_per_job = max_names_per_job
        self._clock = clock
        self._books: collections.OrderedDict[str, dict[int, str]] = collections.OrderedDict()
        self._queues: dict[str, collections.deque] = {}   # job -> (signal, record, arrived)
        self.held = 0
        self.counters = collections.Counter({"names_in": 0, "names_bad": 0, "names_conflicts": 0,
                                             "names_refused": 0, "names_unknown": 0, "windows_held": 0,
                                             "windows_labelled": 0})
        self._conflict_said: set[str] = set()

    # -- step 1 -------------------------------------------------------------------
    def add_raw(self, raw: bytes) -> None:
        try:
            rec = records_pb2.KernelNames.FromString(raw)
        except (DecodeError, ValueError):
            self.counters["names_bad"] += 1
            return
        self.add(rec)

    def add(self, rec: records_pb2.KernelNames) -> None:
        if not rec.job_id:
            self.counters["names_bad"] += max(1, len(rec.names))
            return
        book = self._book(rec.job_id)
        for e in rec.names:
            if not e.id or not e.name:
                self.counters["names_bad"] += 1
                continue
            held = book.get(e.id)
            if held is None:
                if len(book) >= self.max_names_per_job:
                    self.counters["names_refused"] += 1
                    continue
                book[e.id] = e.name
                self.counters["names_in"] += 1
            elif held != e.name:
                self.counters["names_conflicts"] += 1
                if rec.job_id not in self._conflict_said and len(self._conflict_said) < 1000:
                    self._conflict_said.add(rec.job_id)
                    log.warning("job %s: kernel id %016x named %r and %r; keeping the first",
                                rec.job_id, e.id, held[:80], e.name[:80])

    def _book(self, job: str) -> dict[int, str]:
        book = self._books.get(job)
        if book is None:
            book = self._books[job] = {}
            while len(self._books) > self.max_jobs:
                self._books.popitem(last=False)
        else:
            self._books.move_to_end(job)
        return book

    def name(self, job: str, kid: int) -> str | None:
        book = self._books.get(job)
        return None if book is None else book.get(kid)

    # -- steps 2, 3 ---------------------------------------------------------------
    def resolve(self, records: list[tuple[str, Message]]) -> list[tuple[str, Message]]:
        """The records that can go on now, in order per job: ``records`` (just arrived) behind
        whatever of their jobs still waits."""
        now = self._clock()
        out: list[tuple[str, Message]] = []
        for signal, rec in records:
            job = rec.resource.job_id
            q = self._queues.get(job)
            if q is None:
                if self._try(signal, rec, final=False):
                    out.append((signal, rec))
                    continue
                q = self._queues[job] = collections.deque()
            q.append((signal, rec, now))
            self.held += 1
            if signal == Signal.KERNELS:
                self.counters["windows_held"] += 1
        if self._queues:
            self._release(now, out)
        return out

    def _try(self, signal: str, rec, final: bool) -> bool:
        if signal != Signal.KERNELS:
            return True
        book = self._books.get(rec.resource.job_id, {})
        unknown = fill_names(rec, book.get, label_unknown=final)   # known ids named even if it waits
        if unknown and final:
            self.counters["names_unknown"] += unknown
            self.counters["windows_labelled"] += 1
        return final or not unknown

    def _release(self, now: float, out: list) -> None:
        over = self.held > self.max_held
        for job in list(self._queues):
            q = self._queues[job]
            while q:
                signal, rec, since = q[0]
                late = over or now - since >= self.hold_s
                if not self._try(signal, rec, final=late):
                    break
                q.popleft()
                self.held -= 1
                out.append((signal, rec))
                over = self.held > self.max_held
            if not q:
                del self._queues[job]

    def flush(self) -> list[tuple[str, Message]]:
        """Everything still waiting, unknown ids labelled (the end of a replay)."""
        out: list = []
        self._release(float("inf"), out)
        return out
