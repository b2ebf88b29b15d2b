"""The simulator's Mycroft channel states (§4.2 state log): counters of the collectives in flight.

``collective_records.py`` step 7 calls it for the collectives a run ends inside
(entered, never ended: a hang, a failed NIC); tests call ``states_at`` for any
instant. Per (rank, collective) one state row, every channel alike:

1. Chunks: a channel carries 1/``CHANNELS`` of every step of the algorithm;
   ``total_chunks`` = the ring steps (n−1 for all-to-all) x the chunks of one
   step (its bytes / (n x CHANNELS x ``CHUNK_BYTES``), at least 1).
2. The sample: the last ``STATE_PERIOD_NS`` tick at or before ``until``.
3. Counters of the flow r → next(r) (Mycroft Table 4's reading, §5.3):
   through a dead NIC (either end, inter-host group): one step's chunks
   made ready and posted, none delivered (② > ③), not moving since both
   ends were there and the NIC died; to a member that has not entered: one
   step ready, none posted (① > ②: receiver not ready) since its own entry;
   otherwise one step sent and done, the GPU waiting for its upstream's data
   (① = ② = ③ > 0) since both ends were there.
4. With ``end`` (a collective that will end): from the later of the two
   ends' arrivals to ``end`` the transfer advances one chunk at a time, ready
   one chunk ahead of posted, posted one ahead of done; the stuck time is
   the time since the last chunk boundary (a moving flow is never stuck).
5. ``flight_payloads``: per rank its in-flight records (``end_ns`` 0, field 2)
   and channel states (field 6) as wire bytes, and its clock at the sample.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from trainscope.collector.sim.topology import Topology
from trainscope.proto.v1.telemetry_pb2 import ChannelState, CollectiveBatch, CollectiveRecord

#: Step 7: channels per collective (NCCL's nChannels; each carries 1/CHANNELS of every step).
CHANNELS = 2
#: Step 7: bytes of one chunk of a channel (NCCL's Simple protocol: a chunk of its buffer).
CHUNK_BYTES = 512 * 1024
#: Step 7: the state log's period (Mycroft §4.2: every 100 ms while a collective is in flight).
STATE_PERIOD_NS = 100_000_000


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StateSnapshot:
    """Step 7: one channel-state row per (rank, collective) in flight (every channel alike), global ns."""

    rank: np.ndarray          # (R,) global rank
    v: np.ndarray             # (R,) column (iteration * Kc + slot) of the chunk
    at: np.ndarray            # (R,) when sampled (a STATE_PERIOD_NS tick)
    entered: np.ndarray       # (R,) the rank's arrival
    total: np.ndarray         # (R,) chunks per channel
    ready: np.ndarray         # (R,) ① GPU_ready
    transmitted: np.ndarray   # (R,) ② RDMA_transmitted
    done: np.ndarray          # (R,) ③ RDMA_done
    stuck: np.ndarray         # (R,) ns since the counters last moved
    peer: np.ndarray          # (R,) the flow's destination (−1: all-to-all)


def states_at(plan, its: np.ndarray, start: np.ndarray, flying: np.ndarray, until: np.ndarray,
              nic_dead: np.ndarray, end: np.ndarray | None = None) -> StateSnapshot:
    """Step 7, vectorised: the newest state of every (rank, collective) with ``flying`` set ((W, I*Kc),
    rank order, global ns), sampled at the last tick at or before ``until`` ((W, I*Kc)); ``end``
    (optional, (W, I*Kc)): when the collective ends, for snapshots of collectives still moving (the
    transfer then runs from the last member's arrival to ``end``, one chunk at a time)."""
    Kc = len(plan.slots)
    rank, v = np.nonzero(flying)
    col = v % Kc
    a = start[rank, v]
    at = np.maximum(np.floor(until[rank, v] / STATE_PERIOD_NS) * STATE_PERIOD_NS, a)
    n = plan.size[col]
    steps = np.where(plan.ring_steps[rank, col] > 0, plan.ring_steps[rank, col], n - 1)
    per_step = np.maximum(1, -(-plan.nbytes[col] // np.maximum(n * CHANNELS * CHUNK_BYTES, 1)))
    total = np.maximum(steps, 1) * per_step
    nxt = plan.ring_next[rank, col]
    a_next = start[nxt, v]
    with np.errstate(invalid="ignore"):
        next_in = np.isfinite(a_next) & (a_next <= at)
    inter = plan.inter[rank, col]
    d_own, d_next = nic_dead[rank], nic_dead[nxt]
    a2a = plan.ring_steps[rank, col] == 0
    dead_at = np.minimum(d_own, d_next)          # either end of the flow r -> next(r)
    through_dead = inter & (dead_at <= at)
    q = np.minimum(per_step, total)
    ready = np.full(len(rank), 0, dtype=np.int64) + q
    transmitted = np.where(next_in | through_dead, q, 0)
    done = np.where(through_dead | ~next_in, 0, q)
    both = np.maximum(a, np.where(next_in, a_next, a))     # the flow could start: both ends there
    since = np.where(through_dead, np.maximum(both, dead_at), both)
    if end is not None:      # moving: the transfer from the last arrival to the end, chunk by chunk
        e = end[rank, v]
        with np.errstate(invalid="ignore"):
            moving = np.isfinite(e) & next_in & ~through_dead
            t0 = np.where(moving, np.maximum(a, a_next), at)
            frac = np.clip((at - t0) / np.where(moving & (e > t0), e - t0, 1.0), 0.0, 1.0)
        sent = np.floor(frac * total).astype(np.int64)
        ready = np.where(moving, np.minimum(total, np.maximum(sent + 1, q)), ready)
        transmitted = np.where(moving, np.minimum(ready, sent + 1), transmitted)
        done = np.where(moving, np.minimum(transmitted, sent), done)
        chunk = np.where(moving, (e - t0) / np.maximum(total, 1), 0.0)
        since = np.where(moving, t0 + np.floor((at - t0) / np.maximum(chunk, 1.0)) * chunk, since)
    stuck = np.maximum(at - since, 0.0)
    peer = np.where(a2a, -1, nxt)
    return StateSnapshot(rank=rank, v=v, at=at, entered=a, total=total.astype(np.int64), ready=ready.astype(np.int64),
                         transmitted=transmitted.astype(np.int64), done=done.astype(np.int64),
                         stuck=np.rint(stuck).astype(np.int64), peer=peer.astype(np.int64))


def flight_payloads(plan, its: np.ndarray, snap: StateSnapshot, topo: Topology, clocks) -> dict:
    """Step 7: per rank, its in-flight records (field 2), channel states (field 6), abort clock."""
    Kc = len(plan.slots)
    col = snap.v % Kc
    it = its[snap.v // Kc]
    host = topo.host[snap.rank]
    enq = clocks.local(snap.entered, host)
    at = clocks.local(snap.at, host)
    seq = it * plan.per_iteration[snap.rank, col] + plan.seq_index[snap.rank, col] + 1
    group = plan.group_of[snap.rank, col]
    rows: dict[int, tuple[list, list, int]] = {}
    for i, r in enumerate(snap.rank.tolist()):
        k = int(col[i])
        steps = int(plan.ring_steps[r, k])
        rec = CollectiveRecord(group=int(group[i]), seq=int(seq[i]), op=plan.ops[k], bytes=int(plan.nbytes[k]),
                               dtype=plan.dtypes[k], enqueue_ns=int(enq[i]), start_ns=int(enq[i]),
                               iteration=int(it[i]), ring_steps=steps,
                               ring_next=int(plan.ring_next[r, k]) if steps else 0)
        recs, states, now = rows.setdefault(r, ([], [], 0))
        recs.append(rec)
        for c in range(CHANNELS):
            states.append(ChannelState(group=int(group[i]), seq=int(seq[i]), channel=c, time_ns=int(at[i]),
                                       total_chunks=int(snap.total[i]), gpu_ready=int(snap.ready[i]),
                                       rdma_transmitted=int(snap.transmitted[i]), rdma_done=int(snap.done[i]),
                                       stuck_ns=int(snap.stuck[i]), peer=int(snap.peer[i])))
        rows[r] = (recs, states, max(now, int(at[i])))
    return {r: (CollectiveBatch(records=recs).SerializeToString(), CollectiveBatch(states=st).SerializeToString(),
                now, len(st)) for r, (recs, st, now) in rows.items()}



__all__ = ["CHANNELS", "CHUNK_BYTES", "STATE_PERIOD_NS", "StateSnapshot", "flight_payloads", "states_at"]
