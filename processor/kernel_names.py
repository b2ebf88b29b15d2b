"""A job's kernel-name dictionary: windows carry ids, each name travels once (issue #15 item 1).

On the real traces 83 % of a kernel summary's bytes were kernel names (14.1 KB per rank
per step). The processor now sends each ``KernelStats`` with a ``kernel_id`` and no name,
and each (job, id → name) entry once per sink, on its own record (``KernelNames``, topic
``<prefix>.kernel_names.v1``, compacted on Kafka). Consumers resolve ids
(``analyzer/kernel_names.py``, ``SqliteStore.records``).

Ids, and why they are hashes:

1. ``id(name)`` = the first 8 bytes (little-endian) of BLAKE2b(UTF-8 name), 0 made 1 (0
   means "no id: the name is inline"). Every processor of a job (one per host) and every
   restart gives a name the same id with no coordination, so ids never collide *across*
   processors by construction, the entries of several processors for one job agree, and
   an entry never changes: the dictionary only grows, a re-sent entry is a no-op, and a
   compacted topic keyed by (job, id) holds each entry once.
2. A per-processor counter would be 1-2 bytes smaller per ``KernelStats`` (a fixed64 id
   costs 9 bytes) but needs a namespace per processor (a random 32-bit one collides too,
   and makes one name several ids across hosts: consumers could then only compare ranks
   after resolving). The bench (``tests/benchmarks/bench_names.py``) prints both sizes.
3. Two names with one id (probability ~n²/2⁶⁵: 3·10⁻¹⁰ for 100,000 names): a processor that
   sees it keeps the first name's id and sends the later name inline (``kernel_id`` 0,
   ``kernel`` set), counted ``kernel_id_collisions``; never a wrong name. Across processors
   it cannot be seen here; the analyzer counts an entry that contradicts one it holds and
   keeps the first.

What each sink sends: ``WindowOutput.kernel_names`` holds the window's (id, name) entries;
a sink's :class:`Sent` keeps, per job, the ids it already delivered (bounded: forgetting
only means sending an entry again) and turns a window's entries into the ``KernelNames`` of
the new ones, which the sink writes *before* the window (same spool, same transaction).
``names_inline`` (``SummaryConfig``) keeps the names in the windows too, for consumers
older than the dictionary.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import socket
from typing import Iterable

from trainscope.proto.v1 import records_pb2

#: ``KernelNames.scheme``: ids are BLAKE2b-64 of the UTF-8 name.
SCHEME = 1
#: The signal-like name of the dictionary's topic (``topic_for(KERNEL_NAMES)``) and store table.
KERNEL_NAMES = "kernel_names"


def kernel_id(name: str) -> int:
    """Step 1: the id of ``name`` (never 0)."""
    h = int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return h or 1


def label(kid: int) -> str:
    """What an id no dictionary entry names is called: ``kernel#<16 hex digits>``."""
    return f"kernel#{kid:016x}"


def to_signed(kid: int) -> int:
    """An id as SQLite's signed 64-bit INTEGER."""
    return kid - (1 << 64) if kid >= 1 << 63 else kid


def from_signed(v: int) -> int:
    return v + (1 << 64) if v < 0 else v


@dataclasses.dataclass(frozen=True, slots=True)
class NameTable:
    """One window's dictionary entries: ``ids[i]`` names ``names[i]`` (ids distinct, never 0)."""

    job: str
    ids: tuple[int, ...]
    names: tuple[str, ...]


class KernelIds:
    """Name → id for the summariser, cached (one BLAKE2b per distinct name), bounded.

    ``of(names)`` gives each name's id, or 0 for a name whose hash another name took first
    (step 3: sent inline). Past ``max_names`` the cache starts over (memory stays bounded;
    the ids are the same, only recomputed).
    """

    def __init__(self, max_names: int = 200_000) -> None:
        self.max_names = max_names
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self.collisions = 0

    def of(self, names: list[str]) -> list[int]:
        ids = list(map(self._ids.get, names))
        if None in ids:
            for i, n in enumerate(names):
                if ids[i] is None:
                    ids[i] = self._add(n)
        return ids

    def _add(self, name: str) -> int:
        if len(self._ids) >= self.max_names:
            self._ids.clear()
            self._names.clear()
        kid = self._ids.get(name)   # a name repeated in one call
        if kid is not None:
            return kid
        kid = kernel_id(name)
        held = self._names.setdefault(kid, name)
        if held != name:
            self.collisions += 1
            kid = 0
        self._ids[name] = kid
        return kid


class Sent:
    """Per job, the dictionary ids one sink has delivered; bounded in jobs and ids per job.

    ``new(table)`` is the ``KernelNames`` of ``table``'s entries not delivered yet (None when
    there is none); the sink calls ``mark(record)`` once the record is safely handed on
    (spooled, committed), so an entry whose write failed is sent again with the next window.
    ``forget()`` (e.g. a broker that came back empty) makes every entry new again.
    """

    def __init__(self, max_jobs: int = 4096, max_ids_per_job: int = 1 << 20) -> None:
        self.max_jobs = max_jobs
        self.max_ids_per_job = max_ids_per_job
        self._jobs: collections.OrderedDict[str, set[int]] = collections.OrderedDict()
        self.processor = socket.gethostname()

    def new(self, table: NameTable | None) -> records_pb2.KernelNames | None:
        if table is None or not table.ids:
            return None
        known = self._jobs.get(table.job)
        if known is not None:
            self._jobs.move_to_end(table.job)
            if known.issuperset(table.ids):
                return None
        rec = records_pb2.KernelNames(job_id=table.job, scheme=SCHEME, processor=self.processor)
        for kid, name in zip(table.ids, table.names):
            if known is None or kid not in known:
                rec.names.add(id=kid, name=name)
        return rec

    def mark(self, rec: records_pb2.KernelNames) -> None:
        known = self._jobs.get(rec.job_id)
        if known is None:
            known = self._jobs[rec.job_id] = set()
            while len(self._jobs) > self.max_jobs:
                self._jobs.popitem(last=False)
        if len(known) + len(rec.names) > self.max_ids_per_job:
            known.clear()
        known.update(e.id for e in rec.names)

    def forget(self) -> None:
        self._jobs.clear()


def split(rec: records_pb2.KernelNames) -> Iterable[tuple[str, records_pb2.KernelNames]]:
    """One record per entry, keyed ``<job>/<id as 16 hex digits>``: a compacted topic then keeps
    every entry (compaction keeps the newest record per key)."""
    for e in rec.names:
        one = records_pb2.KernelNames(job_id=rec.job_id, scheme=rec.scheme, processor=rec.processor)
        one.names.add(id=e.id, name=e.name)
        yield f"{rec.job_id}/{e.id:016x}", one


def fill_names(kw: records_pb2.KernelWindow, lookup, *, label_unknown: bool = True) -> int:
    """Name every ``KernelStats`` of ``kw`` that has an id from ``lookup(id) -> name | None`` (one
    pass, ~0.3 µs per KernelStats); an id ``lookup`` does not know, on a record without its name
    inline, is labelled ``kernel#<id>`` when ``label_unknown``. Returns how many were unknown."""
    unknown = 0
    for ks in kw.kernels:
        kid = ks.kernel_id
        if kid:
            name = lookup(kid)
            if name is not None:
                ks.kernel = name
            elif not ks.kernel:
                unknown += 1
                if label_unknown:
                    ks.kernel = label(kid)
    return unknown
