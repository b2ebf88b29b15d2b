"""The simulator's vectorised encoding of collective records (collective_records.py step 4)
against messages built one record at a time, field by field, as protobuf would."""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.collector.sim import SimConfig, parse_fault
from trainscope.collector.sim.collective_records import _field
from trainscope.collector.sim.simulate import Simulation
from trainscope.proto.v1.telemetry_pb2 import CollectiveBatch, CollectiveRecord


def _reference(c, r: int) -> CollectiveBatch | None:
    """One Python message per record: the simulator's encoding before it was vectorised."""
    v = np.flatnonzero(c.valid[r])
    if not len(v):
        return None
    p, Kc = c.plan, len(c.plan.slots)
    recs = []
    for x in v.tolist():
        k, it = x % Kc, int(c.iterations[x // Kc])
        steps = int(p.ring_steps[r, k])
        recs.append(CollectiveRecord(
            group=int(p.group_of[r, k]), seq=it * int(p.per_iteration[r, k]) + int(p.seq_index[r, k]) + 1,
            op=p.ops[k], bytes=int(p.nbytes[k]), dtype=p.dtypes[k], enqueue_ns=int(c.enqueue[r, x]),
            start_ns=int(c.enqueue[r, x]), end_ns=int(c.end[r, x]), iteration=it, ring_steps=steps,
            ring_next=int(p.ring_next[r, k]) if steps else 0, send_busy_ns=int(c.busy[r, x]) if steps else 0,
            recv_wait_ns=int(c.wait[r, x]) if steps else 0))
    return CollectiveBatch(groups=p.groups[r], records=recs, now_ns=int(c.end[r, v].max()))


@pytest.mark.parametrize("cfg", [
    SimConfig(ranks=32, tp=4, pp=2, ep=2, iterations=12, seed=3, emit_every=5),
    SimConfig(ranks=32, tp=2, pp=2, iterations=30, seed=5,
              faults=(parse_fault("nic_degrade:rank=5,onset=3s,factor=3"), parse_fault("hang:rank=13,onset=15s"))),
], ids=["ep", "nic+hang"])
def test_encoded_batches_are_the_messages_built_record_by_record(cfg):
    chunks = 0
    for chunk in Simulation(cfg).chunks():
        c = chunk.collectives
        if c is None:
            continue
        chunks += 1
        for r in range(cfg.ranks):
            want = _reference(c, r)
            data = c.payload(r)
            got = c.batch(r)
            flying = [x for x in got.records if not x.end_ns] if got is not None else []
            if flying:   # step 7: in flight at the run's end: records with end 0, then the channel states
                assert want is None or len(got.records) == len(want.records) + len(flying)
                want = want or CollectiveBatch(groups=c.plan.groups[r])
                want.records.extend(flying)
                want.states.extend(got.states)
                want.now_ns = max(want.now_ns, max(x.time_ns for x in got.states))
                assert len(got.states) == 2 * len(flying) and got.now_ns == want.now_ns
            if want is None:
                assert data is None
                continue
            assert data == want.SerializeToString()          # canonical bytes, not only equal content
            assert got == want
    assert chunks >= 2


@pytest.mark.parametrize("values", [[0, 1, 127, 128, 300, 16383, 16384], [2**63 - 1, 2**62, 1 << 35, 5]])
def test_varint_field_matches_protobuf(values):
    m, n = _field(9, np.asarray(values, dtype=np.int64))
    for i, x in enumerate(values):
        got = bytes(m[: n[i], i])
        assert got == CollectiveRecord(iteration=x).SerializeToString()     # field 9; 0 is not written
