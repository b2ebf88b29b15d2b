"""The NCCL profiler plugin ring reader (collector/nccl_profiler.py) on hand-made rings.

No GPU and no plugin here: ``Ring`` below writes slots the way the C plugin does
(collector/nccl_plugin/: claim an index, zero the slot's seq, fill it, store its
seq last), so the reader's contract is tested, not NCCL's behaviour; the plugin
itself is driven in tests/integration/test_nccl_plugin.py. Unverified on a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.collector import nccl_profiler as nc

ALLREDUCE, RING, SIMPLE, FLOAT32 = 5, 2, 3, 7
COMM_HASH = 0xABCDEF0123456789


class Ring:
    """A plugin stand-in over a bytearray: ``claim`` then ``commit`` (seq last), or ``put`` both."""

    def __init__(self, capacity: int = 16) -> None:
        self.buf = bytearray(nc.HEADER.itemsize + capacity * nc.SLOT.itemsize)
        h = np.frombuffer(self.buf, nc.HEADER, count=1)
        h["magic"], h["version"], h["slot_bytes"], h["capacity"] = nc.MAGIC, nc.VERSION, 64, capacity
        self.head = np.frombuffer(self.buf, "<u8", count=1, offset=24)
        self.slots = np.frombuffer(self.buf, nc.SLOT, count=capacity, offset=64)
        self.capacity = capacity

    def claim(self, **fields) -> int:
        i = int(self.head[0])
        self.head[0] = i + 1
        s = self.slots[i % self.capacity]
        s["seq"] = 0
        for k, v in fields.items():
            s[k] = v
        return i

    def commit(self, i: int) -> None:
        self.slots[i % self.capacity]["seq"] = i + 1

    def put(self, **fields) -> int:
        i = self.claim(**fields)
        self.commit(i)
        return i


def test_the_reader_returns_committed_slots_in_order_and_waits_for_a_claimed_one():
    ring = Ring()
    reader = nc.RingReader(ring.buf)
    assert len(reader.poll()) == 0
    for k in range(3):
        ring.put(kind=nc.COMM, comm=k)
    pending = ring.claim(kind=nc.COMM, comm=3)       # claimed by a writer, not yet committed
    ring.put(kind=nc.COMM, comm=4)
    got = reader.poll()
    assert got["comm"].tolist() == [0, 1, 2] and reader.next == 3 and reader.lost == 0
    ring.commit(pending)
    assert reader.poll()["comm"].tolist() == [3, 4]


def test_lapped_and_rewritten_slots_are_counted_lost_never_decoded():
    ring = Ring(capacity=8)
    reader = nc.RingReader(ring.buf)
    for k in range(8 + 5):                           # the writers went round once past the reader
        ring.put(kind=nc.COMM, comm=k)
    got = reader.poll()
    assert got["comm"].tolist() == list(range(5, 13)) and reader.lost == 5
    i = ring.put(kind=nc.COMM, comm=99)
    ring.slots[i % 8]["seq"] = i + 1 + 8             # rewritten by a writer a lap ahead while we read
    assert len(reader.poll()) == 0 and reader.lost == 6


@pytest.mark.parametrize("bad", [b"", b"x" * 64, bytes(Ring(capacity=8).buf)[:100]])
def test_a_file_that_is_not_a_ring_is_refused_in_one_line(bad):
    with pytest.raises(nc.RingError):
        nc.RingReader(bad)


def completed_allreduce(ring: Ring, nseq: int = 41, flows: int = 6, declared: int | None = None) -> None:
    """Rank 1 of a 4-rank comm, ring all-reduce: 2(n-1) = 6 flows to its ring successor (comm rank 2),
    written out of step order, then the RECV total and the COLL slot (flow count last)."""
    t0 = 1_700_000_000_000_000_000
    for step in reversed(range(flows)):
        ring.put(kind=nc.FLOW, comm=COMM_HASH, coll_seq=nseq, channel=step % 2,
                 a=2_000 + step * 1_000, b=2_000 + step * 1_000 + 700, c=1 << 20, d=step, e=2)
    ring.put(kind=nc.RECV, comm=COMM_HASH, coll_seq=nseq, a=1_500, c=flows)
    ring.put(kind=nc.COLL, comm=COMM_HASH, coll_seq=nseq, func=ALLREDUCE, algo=RING, proto=SIMPLE, dtype=FLOAT32,
             a=t0, b=t0 + 9_000, c=6 << 20, d=1, e=flows if declared is None else declared)


def test_a_completed_collective_becomes_a_record_with_its_steps_on_global_ranks():
    ring = Ring(capacity=64)
    ring.put(kind=nc.COMM, comm=COMM_HASH, d=1, e=4)
    completed_allreduce(ring)
    asm = nc.Assembler({COMM_HASH: (4, 5, 6, 7)})
    (comm, rec), = asm.feed(nc.RingReader(ring.buf).poll())[0]
    assert comm == COMM_HASH and asm.comms[COMM_HASH] == (1, 4)
    t0 = 1_700_000_000_000_000_000
    assert (rec.seq, rec.op, rec.dtype, rec.bytes) == (42, "allreduce", "float32", 6 << 20)
    assert (rec.enqueue_ns, rec.start_ns, rec.end_ns) == (t0, t0 + 1_000, t0 + 9_000)
    assert rec.algo == "ring" and list(rec.step_index) == [0, 1, 2, 3, 4, 5]
    assert list(rec.step_dst) == [6] * 6                   # comm rank 2 of (4, 5, 6, 7)
    assert list(rec.step_start_ns) == [1_000 + 1_000 * s for s in range(6)]   # from start_ns, not enqueue
    assert list(rec.step_end_ns) == [1_700 + 1_000 * s for s in range(6)]
    assert rec.send_busy_ns == 6 * 700 and rec.recv_wait_ns == 1_500 and asm.dropped == 0


def test_a_collective_whose_flows_were_lost_keeps_no_partial_steps():
    ring = Ring(capacity=64)
    completed_allreduce(ring, declared=7)                  # the plugin wrote 7, one never arrived
    asm = nc.Assembler()
    (_, rec), = asm.feed(nc.RingReader(ring.buf).poll())[0]
    assert rec.seq == 42 and not rec.step_index and asm.dropped == 6
    assert list(nc.Assembler({}).feed(np.empty(0, nc.SLOT))[0]) == []


def test_flows_waiting_for_their_collective_are_bounded():
    ring = Ring(capacity=64)
    for nseq in range(5):
        ring.put(kind=nc.FLOW, comm=COMM_HASH, coll_seq=nseq, d=0, e=1)
    asm = nc.Assembler(max_pending=3)
    asm.feed(nc.RingReader(ring.buf).poll())
    assert asm.dropped == 2 and sorted(k[1] for k in asm._flows) == [2, 3, 4]


def test_mycroft_table_4_on_the_channel_counters():
    ready, sent, done, total = zip((0, 0, 0, 16), (8, 5, 5, 16), (8, 8, 5, 16), (8, 8, 8, 16), (16, 16, 16, 16),
                                   (9, 6, 3, 16))
    got = [nc.STATES[i] for i in nc.classify(ready, sent, done, total)]
    assert got == ["not started", "not transmitted", "not delivered", "GPU not ready", "done", "not transmitted"]


def test_state_records_say_how_long_a_channels_counters_have_not_moved():
    ring = Ring(capacity=64)
    reader, asm = nc.RingReader(ring.buf), nc.Assembler()
    t = 1_700_000_000_000_000_000
    for dt, counts in ((0, (8, 5, 5)), (100_000_000, (8, 5, 5)), (200_000_000, (9, 6, 5))):
        ring.put(kind=nc.STATE, comm=COMM_HASH, coll_seq=7, channel=3, a=t + dt, d=counts[0], e=counts[1],
                 b=counts[2], c=16)
    _, states = asm.feed(reader.poll())
    assert [s.stuck_ns for s in states] == [0, 100_000_000, 0]
    assert [s.state for s in states] == ["not transmitted", "not transmitted", "not transmitted"]
    s = states[2]
    assert (s.seq, s.channel, s.gpu_ready, s.rdma_transmitted, s.rdma_done, s.total_chunks) == (8, 3, 9, 6, 5, 16)


def test_the_plugins_counters_and_a_channels_peer_reach_the_wire_row():
    ring = Ring(capacity=16)
    np.frombuffer(ring.buf, "<u8", count=4, offset=32)[:] = (3, 2, 1, 0)   # the plugin's header counters
    reader = nc.RingReader(ring.buf)
    assert reader.counters() == {"dropped": 3, "detached": 2, "truncated": 1, "stale": 0}
    ring.put(kind=nc.STATE, comm=COMM_HASH, coll_seq=4, channel=2, a=5, d=6, e=6, b=6, c=6, flags=2 + 1)
    ring.put(kind=nc.STATE, comm=COMM_HASH, coll_seq=4, channel=3, a=5, d=1, e=0, b=0, c=6, flags=0)
    known, unknown = nc.Assembler({COMM_HASH: (4, 5, 6, 7)}).feed(reader.poll())[1]
    assert (known.peer, known.state, unknown.peer, unknown.state) == (6, "done", -1, "not transmitted")
    row = known.to_proto(group=1)
    assert (row.group, row.seq, row.channel, row.time_ns, row.total_chunks, row.rdma_done, row.peer) == \
        (1, 5, 2, 5, 6, 6, 6)
