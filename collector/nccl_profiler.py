"""Reader of the NCCL profiler plugin's ring: collective records with steps, Mycroft's channel states.

The C plugin this reads (``collector/nccl_plugin/trainscope_nccl_profiler.c``,
built by ``trainscope nccl-plugin build`` into ``libnccl-profiler-trainscope.so``
and loaded by NCCL through ``NCCL_PROFILER_PLUGIN``) is written and verified
against a C driver that calls it as NCCL's user and proxy threads do
(``tests/support/nccl_driver.c``, ``tests/integration/test_nccl_plugin.py``).
UNVERIFIED WITH REAL NCCL ON A GPU: the completion rule, the algorithm-step
formula and the timing are checked against NCCL 2.30's source, not a run.
Design and slot table: ``docs/collectives.md`` ("NCCL profiler plugin").

The plugin keeps its per-event work in C on NCCL's threads (counters in the
collective's and proxy op's handles, Mycroft §4.2 "chunk-level" aggregation) and
writes fixed 64-byte slots to a shared-memory ring (one per process,
``<TRAINSCOPE_NCCL_DIR or runtime dir/nccl>/ring-<pid>``, 0600) that this
reader maps and polls from the collector's collectives thread
(``collective_log.py``), never the training thread:

1. ``COMM`` at ``init``: communicator hash, this rank in it, its size.
2. ``FLOW`` slots, then one ``COLL`` slot, when a collective completes (its Coll
   stopped, no proxy op or kernel channel left live): per (algorithm step,
   destination) the bytes and the start/end offsets of the proxy steps that
   carried them (fields 14-19 of ``CollectiveRecord``), then the collective
   itself (enqueue, end, bytes, op, algorithm, protocol, datatype, how many
   flows precede it). ``RECV`` (before ``COLL``): the time its receive steps
   waited in ``RecvWait`` (field 13). ``coll_seq`` is the collective's number
   on its communicator, from 0, every function counted (NCCL's own
   ``seqNumber`` counts per function), so seq = ``coll_seq`` + 1 is the same on
   every member and matches the torch hooks' per-group count.
3. ``STATE`` every 100 ms per collective in flight for 100 ms or more and per
   channel with send ops (Mycroft's real-time state log): GPU_ready,
   RDMA_transmitted, RDMA_done and the channel's chunk total, counted from the
   ProxyStep states; ``flags`` = the channel's send peer (comm rank) + 1.

Ring layout (little-endian): a 64-byte header (``HEADER``: magic
``TSNCCLR1``, version 1, slot size 64, capacity a power of two, ``head`` = slots
claimed so far, then the plugin's counters: events dropped because a handle
pool was empty, events whose parent was not its own (PXN, dropped parent),
flows beyond a collective's table, collectives retired without completing),
then ``capacity`` slots (``SLOT``). A writer claims index ``i`` with an atomic
fetch-add on ``head``, sets the slot's ``seq`` to 0, fills it and stores
``seq = i + 1`` last, with release ordering. The reader (steps 4-6):

4. ``RingReader.poll``: from its next index to ``head``; a gap larger than the
   capacity is counted lost (the writers lapped it) and skipped; slots are
   copied out, then their ``seq`` read again (a seqlock: a slot rewritten
   while it was copied is counted lost, never decoded torn); the first slot
   claimed but not yet committed ends the poll (read next time).
5. ``Assembler.feed``: ``FLOW``/``RECV`` slots wait for their ``COLL`` (bounded,
   oldest dropped and counted); each ``COLL`` becomes a ``CollectiveRecord``
   (seq = ``coll_seq`` + 1, comm ranks mapped to global ranks by the group
   table the torch hooks know, flows sorted by step) with its flows as step
   records; ``STATE`` slots become ``ChannelState`` rows (``to_proto``: the
   wire's ``telemetry_pb2.ChannelState``) with the time the channel's counters
   last moved (Mycroft's stuck_time; 0 at a channel's first report).
6. ``classify``: Mycroft Table 4 on (GPU_ready, RDMA_transmitted, RDMA_done,
   total), vectorised: not started, not transmitted (receiver not ready / RDMA),
   not delivered (RDMA / receiver failed), GPU not ready, done.

``RingFile`` does steps 4-5 on this process's ring file (mapped read-only,
mapped again when the plugin made a new one). Assumptions (unverified on a
GPU): the plugin's clock is CLOCK_REALTIME (the torch hooks' ``time.time_ns``);
x86-64 ordering (the seqlock re-read suffices).
"""
from __future__ import annotations

import collections
import dataclasses
import mmap
import os
import stat
from typing import Mapping, Sequence

import numpy as np

from trainscope.proto.v1 import telemetry_pb2

MAGIC = b"TSNCCLR1"
VERSION = 1
HEADER = np.dtype([("magic", "S8"), ("version", "<u4"), ("slot_bytes", "<u4"), ("capacity", "<u8"),
                   ("head", "<u8"), ("dropped", "<u8"), ("detached", "<u8"), ("truncated", "<u8"),
                   ("stale", "<u8")])
#: the plugin's counters in the header (what each one counts: the module docstring)
COUNTERS = ("dropped", "detached", "truncated", "stale")
SLOT = np.dtype([("seq", "<u8"), ("kind", "u1"), ("channel", "u1"), ("algo", "u1"), ("proto", "u1"),
                 ("func", "u1"), ("dtype", "u1"), ("flags", "<u2"), ("comm", "<u8"), ("coll_seq", "<u8"),
                 ("a", "<u8"), ("b", "<u8"), ("c", "<u8"), ("d", "<u4"), ("e", "<u4")])
assert HEADER.itemsize == 64 and SLOT.itemsize == 64

# slot kinds and what a, b, c, d, e hold (docs/collectives.md has the table)
COMM, COLL, FLOW, RECV, STATE = 1, 2, 3, 4, 5
#: codes the plugin writes for NCCL's strings (func, algorithm, protocol, ncclDataType_t order)
FUNCS = {1: "broadcast", 2: "reduce", 3: "allgather", 4: "reducescatter", 5: "allreduce", 6: "send", 7: "recv",
         8: "alltoall"}
ALGOS = {1: "tree", 2: "ring", 3: "collnet_direct", 4: "collnet_chain", 5: "nvls", 6: "nvls_tree", 7: "pat"}
PROTOS = {1: "ll", 2: "ll128", 3: "simple"}
DTYPES = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16", 7: "float32",
          8: "float64", 9: "bfloat16", 10: "float8_e4m3", 11: "float8_e5m2"}
#: step 6's verdicts, in ``classify``'s codes
STATES = ("not started", "not transmitted", "not delivered", "GPU not ready", "done")


class RingError(ValueError):
    """The mapped file is not a ring this reader understands (one line)."""


class RingReader:
    """Step 4 over a buffer (an ``mmap`` of the plugin's ring, or bytes in tests)."""

    def __init__(self, buf) -> None:
        mv = memoryview(buf)
        if mv.nbytes < HEADER.itemsize:
            raise RingError(f"ring of {mv.nbytes} bytes: shorter than its header")
        h = np.frombuffer(mv, HEADER, count=1)[0]
        if bytes(h["magic"]) != MAGIC or int(h["version"]) != VERSION or int(h["slot_bytes"]) != SLOT.itemsize:
            raise RingError(f"not a trainscope NCCL ring v{VERSION} (magic {bytes(h['magic'])!r}, "
                            f"version {int(h['version'])}, slot {int(h['slot_bytes'])} bytes)")
        cap = int(h["capacity"])
        if cap < 1 or cap & (cap - 1) or mv.nbytes < HEADER.itemsize + cap * SLOT.itemsize:
            raise RingError(f"ring capacity {cap}: not a power of two or larger than the file")
        self.capacity = cap
        self._head = np.frombuffer(mv, "<u8", count=1, offset=24)        # live: the writers move it
        self._counters = np.frombuffer(mv, "<u8", count=len(COUNTERS), offset=32)
        self._slots = np.frombuffer(mv, SLOT, count=cap, offset=HEADER.itemsize)
        self.next = 0
        self.lost = 0

    def counters(self) -> dict[str, int]:
        """The plugin's running counters (``COUNTERS``), read now."""
        return dict(zip(COUNTERS, (int(v) for v in self._counters)))

    def poll(self, max_slots: int = 1 << 16) -> np.ndarray:
        """The slots committed since the last poll, in claim order (a copy, safe to keep)."""
        head = int(self._head[0])
        if head - self.next > self.capacity:          # lapped: those are gone
            self.lost += head - self.next - self.capacity
            self.next = head - self.capacity
        n = min(head - self.next, max_slots)
        if n <= 0:
            return np.empty(0, SLOT)
        want = np.arange(self.next, self.next + n, dtype=np.uint64) + 1
        idx = (want - 1) % np.uint64(self.capacity)
        got = self._slots[idx]                         # fancy indexing copies
        again = self._slots["seq"][idx]                # seqlock: the seq again, after the copy
        pending = got["seq"] < want
        end = int(np.argmax(pending)) if pending.any() else n
        ok = (got["seq"][:end] == want[:end]) & (again[:end] == want[:end])
        self.lost += int(end - ok.sum())
        self.next += end
        return got[:end][ok]


@dataclasses.dataclass(frozen=True, slots=True)
class ChannelState:
    """One channel of one collective in flight at one moment (Mycroft §4.2 state log, Table 2 "Chunk")."""

    comm: int
    seq: int                # trainscope seq: NCCL seqNumber + 1
    channel: int
    t_ns: int
    gpu_ready: int
    rdma_transmitted: int
    rdma_done: int
    total_chunks: int
    stuck_ns: int           # since the counters last moved (0: they moved in this report)
    state: str              # step 6
    peer: int = -1          # the global rank this channel sends to (-1: unknown)

    def to_proto(self, group: int = 0) -> telemetry_pb2.ChannelState:
        """The wire row (``CollectiveBatch.states``); ``group`` indexes the batch's groups."""
        return telemetry_pb2.ChannelState(
            group=group, seq=self.seq, channel=self.channel, time_ns=self.t_ns, total_chunks=self.total_chunks,
            gpu_ready=self.gpu_ready, rdma_transmitted=self.rdma_transmitted, rdma_done=self.rdma_done,
            stuck_ns=self.stuck_ns, peer=self.peer)


def classify(ready, transmitted, done, total) -> np.ndarray:
    """Step 6 (Mycroft Table 4), vectorised: indices into ``STATES``. When several conditions hold
    the first in the table's order wins (not transmitted before not delivered)."""
    r, t, d, n = (np.asarray(x, dtype=np.int64) for x in (ready, transmitted, done, total))
    out = np.full(r.shape, 3, dtype=np.int8)                  # 1 = 2 = 3 > 0: the GPU is behind
    out[(d >= n) & (n > 0)] = 4
    out[t > d] = 2
    out[r > t] = 1
    out[(r == 0) & (t == 0) & (d == 0)] = 0
    return out


class Assembler:
    """Step 5: slots -> (comm, CollectiveRecord) and ChannelState rows. Bounded; one thread owns it."""

    def __init__(self, members: Mapping[int, Sequence[int]] | None = None, *, max_pending: int = 65_536) -> None:
        self.members = dict(members or {})
        """comm hash -> global ranks in comm-rank order (from the torch hooks' group table)."""
        self.comms: dict[int, tuple[int, int]] = {}          # comm -> (this rank in it, size)
        self._flows: collections.OrderedDict = collections.OrderedDict()   # (comm, seq) -> [slots]
        self._held = 0                                         # flows waiting in _flows
        self._recv: collections.OrderedDict = collections.OrderedDict()    # (comm, seq) -> (wait ns, steps)
        self._moved: dict[tuple[int, int, int], tuple[tuple, int]] = {}  # channel -> (counters, t when moved)
        self.max_pending = max_pending
        self.dropped = 0
        self.on_comm = None
        """Called as ``on_comm(comm, rank, size)`` for a communicator without members; returns its
        global ranks in comm-rank order, or None (asked again at the next feed)."""

    def _global(self, comm: int, r: int) -> int:
        m = self.members.get(comm)
        return int(m[r]) if m is not None and 0 <= r < len(m) else int(r)

    def feed(self, slots: np.ndarray) -> tuple[list, list[ChannelState]]:
        records, states = [], []
        for k in np.flatnonzero(slots["kind"] == COMM):
            s = slots[k]
            self.comms[int(s["comm"])] = (int(s["d"]), int(s["e"]))
        if self.on_comm is not None:
            for comm, (r, n) in self.comms.items():
                if comm not in self.members:
                    m = self.on_comm(comm, r, n)
                    if m is not None:
                        self.members[comm] = tuple(m)
        for s in slots[(slots["kind"] == FLOW) | (slots["kind"] == RECV)]:
            key = (int(s["comm"]), int(s["coll_seq"]))
            if s["kind"] == RECV:
                self._recv[key] = (int(s["a"]), int(s["c"]))
                if len(self._recv) > self.max_pending:
                    self._recv.popitem(last=False)
                    self.dropped += 1
                continue
            self._flows.setdefault(key, []).append(s)
            self._held += 1
            while self._held > self.max_pending:   # bound: the oldest collective's flows go first
                _, gone = self._flows.popitem(last=False)
                self._held -= len(gone)
                self.dropped += len(gone)
        for s in slots[slots["kind"] == COLL]:
            records.append(self._record(s))
        st = slots[slots["kind"] == STATE]
        if len(st):
            verdict = classify(st["d"], st["e"], st["b"], st["c"])
            for s, v in zip(st, verdict):
                key = (int(s["comm"]), int(s["coll_seq"]), int(s["channel"]))
                now = (int(s["d"]), int(s["e"]), int(s["b"]))
                t = int(s["a"])
                seen = self._moved.get(key)
                since = t if seen is None or seen[0] != now else seen[1]
                self._moved[key] = (now, since)
                peer = int(s["flags"]) - 1
                states.append(ChannelState(key[0], key[1] + 1, key[2], t, now[0], now[1], now[2], int(s["c"]),
                                           t - since, STATES[int(v)],
                                           self._global(key[0], peer) if peer >= 0 else -1))
            while len(self._moved) > self.max_pending:
                self._moved.pop(next(iter(self._moved)))
        return records, states

    def _record(self, s) -> tuple[int, telemetry_pb2.CollectiveRecord]:
        comm, nseq = int(s["comm"]), int(s["coll_seq"])
        enqueue, end, start_off = int(s["a"]), int(s["b"]), int(s["d"]) * 1000
        rec = telemetry_pb2.CollectiveRecord(
            seq=nseq + 1, op=FUNCS.get(int(s["func"]), "unknown"), bytes=int(s["c"]),
            dtype=DTYPES.get(int(s["dtype"]), ""), enqueue_ns=enqueue, start_ns=enqueue + start_off, end_ns=end,
            algo=ALGOS.get(int(s["algo"]), ""))
        flows = self._flows.pop((comm, nseq), [])
        self._held -= len(flows)
        if len(flows) != int(s["e"]):
            self.dropped += len(flows)      # some flows lost (lapped or evicted): no partial steps
            flows = []
        if flows:
            f = np.array(flows, dtype=SLOT)
            f = f[np.lexsort((f["e"], f["d"]))]                      # by step, then destination
            rec.step_index.extend(f["d"].tolist())
            rec.step_dst.extend(self._global(comm, int(r)) for r in f["e"])
            rec.step_bytes.extend(f["c"].tolist())
            # offsets from start_ns (fields 18-19 are on that base); the plugin's are from enqueue
            rec.step_start_ns.extend(np.maximum(f["a"].astype(np.int64) - start_off, 0).tolist())
            rec.step_end_ns.extend(np.maximum(f["b"].astype(np.int64) - start_off, 0).tolist())
            rec.send_busy_ns = int((f["b"].astype(np.int64) - f["a"].astype(np.int64)).clip(0).sum())
        recv = self._recv.pop((comm, nseq), None)
        if recv is not None:
            rec.recv_wait_ns = recv[0]
        return comm, rec


class RingFile:
    """Steps 4-5 on one process's ring file, for the collectives thread (one thread owns it).

    The file is mapped read-only once it is a plain file of this user, 0600, with a whole
    header (the plugin writes its magic last); a ring the plugin made again (a new inode: NCCL
    loaded it again) is mapped again. A missing or refused file is counted and polled again
    next time; nothing here raises."""

    def __init__(self, path: str, members: Mapping[int, Sequence[int]] | None = None, *,
                 max_pending: int = 65_536) -> None:
        self.path = path
        self.assembler = Assembler(members, max_pending=max_pending)
        self.reader: RingReader | None = None
        self.refused = 0
        self._ident: tuple[int, int] | None = None

    def _open(self) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return self.reader is not None          # removed: what is mapped can still be read
        if (st.st_dev, st.st_ino) == self._ident:
            return True
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            self.refused += 1
            return self.reader is not None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                m = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            reader = RingReader(m)
        except (OSError, ValueError):               # RingError is a ValueError: header not written yet
            return self.reader is not None
        self.reader, self._ident = reader, (st.st_dev, st.st_ino)
        return True

    def poll(self) -> tuple[list, list[ChannelState]]:
        """New (comm, CollectiveRecord) pairs and ChannelState rows since the last poll."""
        if not self._open() or self.reader is None:
            return [], []
        return self.assembler.feed(self.reader.poll())

    def stats(self) -> dict[str, int]:
        r = self.reader
        out = {"lost": r.lost if r else 0, "unassembled": self.assembler.dropped, "refused": self.refused}
        out.update(r.counters() if r else dict.fromkeys(COUNTERS, 0))
        return out


__all__ = ["ALGOS", "Assembler", "COLL", "COMM", "COUNTERS", "ChannelState", "RingFile", "DTYPES", "FLOW", "FUNCS", "HEADER", "MAGIC",
           "PROTOS", "RECV", "RingError", "RingReader", "SLOT", "STATE", "STATES", "VERSION", "classify"]
