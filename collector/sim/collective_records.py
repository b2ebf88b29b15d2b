"""The simulator's collective records: what a real rank's collector would send, plus ring steps.

1. ``CollectivePlan`` (static per job): the collective slots of the template
   (TP/CP/EP/DP/MP groups; PP send/recv are point-to-point and excluded, as
   the torch collector excludes them), per rank the groups it belongs to (id
   ``"<dim>:<lowest member>"``, members in group-rank order), the order in
   which a stage issues them (so ``seq`` counts a group's collectives 1, 2, ...
   on every member alike: the n-th of a group is the same collective
   everywhere), op, bytes and dtype from the NCCL kernel name and the slot's
   nominal size.
2. Ring decomposition (Vedrfolnir §III-B; the engine's step 4 times it): per
   record the rank's outgoing flow, ``ring_next`` (the next member of its
   group's ring) and ``ring_steps`` (2(n−1) for all-reduce, n−1 for
   reduce-scatter and all-gather; all-to-all is not a ring: 0), its busy time
   (the sum of its steps' execution times) and the time its steps waited for
   the previous member's data. One record per collective and rank: the
   volume is that of a real collector (no per-step records).
3. ``CollectiveColumns`` (per chunk, rank order, each host's clock): enqueue
   = start = when the rank's GPU reached the collective (its kernel could
   start: NCCL's view, not the CPU launch), end. A collective that never
   completes (a hang) is not sent: as in-flight state records they made the
   collective hang rule name every group's first-stuck member at once (the
   culprit's TP and MP partners too) and cost the hang scenario's top-1 at
   32 ranks; the iteration stall rule names the culprit.
4. Encoding (``encode_records``): the wire bytes of every record of the chunk,
   all ranks at once, with numpy (base-128 varints as byte columns, one masked
   matrix row per record, the per-slot constants op/bytes/dtype encoded once
   by protobuf itself); ``payload(r)`` is the rank's ``CollectiveBatch`` bytes
   (its groups, its records, ``now_ns``: field order, as protobuf writes them)
   and ``batch(r)`` parses them. bench_sim's 1,024-rank job has ~70,000 records
   per iteration: one Python message per record took 2.3x the simulation's
   time, this 0.7x (most of it the parse and serialisation protobuf does anyway).
5. Step decomposition (Vedrfolnir §III-B, opt-in: ``CollectivePlan.build(steps=True)``;
   tests/support/step_records.py switches a simulated job to it): every collective as the textbook
   steps of its algorithm (``decompose``: ring all-reduce, reduce-scatter,
   all-gather; binary-tree all-reduce; pairwise all-to-all): per step and
   member its flows (dst, bytes).
6. Step times (``step_times``, ``time_steps``): a flow's step lasts its bytes
   at the slower of its two ends' links; a member starts a step once its own
   flows of the previous step ended and the data sent to it then arrived; the
   steps are scaled to fill the engine's transfer. Sent as fields 14-19 of
   each record (start/end offsets from the record's start, the rank's clock).
7. Collectives in flight at the end of the run (``channel_states.py``; Mycroft §4.2
   state log): a collective a rank entered that never ended (the engine's
   step 7: a hang, a failed NIC) is sent as a record with ``end_ns`` 0 plus,
   per channel (``channel_states.CHANNELS``), its newest channel state: the 100 ms tick of
   simulated time at or before the first NCCL watchdog fired (the earliest
   entry into a stuck collective + its timeout; the run ends there), with cumulative
   GPU_ready / RDMA_transmitted / RDMA_done of the channel's
   ``total_chunks`` (its ring steps x the chunks of one step, ``CHUNK_BYTES``),
   the time since they last moved and the flow's peer (the ring's next
   member; −1 for all-to-all). Per flow r → next(r), vectorised over every
   (rank, collective) in flight: through a dead NIC (either end): one step's
   chunks made ready and posted, none delivered (② > ③); to a member that
   never entered: ready, not posted (① > ②, receiver not ready); otherwise
   the step-0 chunks sent and done, the GPU waiting for upstream data
   (① = ② = ③ > 0). Only the newest state of a collective that never
   completed goes out: a collector cutting its batch drops the states its
   completion records supersede (the processor would drop them at its window
   close anyway), so a job without a stuck collective sends none and costs
   nothing more. ``states_at`` builds the same snapshot at any moment of a
   chunk (tests: a healthy job's collectives mid-flight, counters moving).
   The earlier exclusion of in-flight records (step 3) stands for
   collectives that do end: only those the run ends inside are sent.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from trainscope.collector.sim import workload as wl
from trainscope.collector.sim.channel_states import flight_payloads, states_at
from trainscope.collector.sim.topology import Topology
from trainscope.proto.v1.telemetry_pb2 import CollectiveBatch, CollectiveGroup, CollectiveRecord

#: Nominal payload per µs of a slot's median (100 GB/s): bytes only need to order sizes.
BYTES_PER_US = 100_000


def _op(name: str, dim: str) -> tuple[str, str, int]:
    """(op, dtype, steps per member count n as a multiplier of n-1) of an NCCL kernel name."""
    dtype = "bf16" if "bf16" in name else "f32"
    if "AllReduce" in name:
        return "allreduce", dtype, 2
    if "ReduceScatter" in name:
        return "reducescatter", dtype, 1
    if "AllGather" in name:
        return "allgather", "bf16", 1
    return "alltoall", "bf16", 0


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CollectivePlan:
    """Step 1: the static part of every record (arrays in rank order unless said otherwise)."""

    slots: np.ndarray            # (Kc,) template slots of collectives
    ops: tuple[str, ...]         # (Kc,)
    dtypes: tuple[str, ...]
    nbytes: np.ndarray           # (Kc,)
    groups: tuple[tuple[CollectiveGroup, ...], ...]   # per rank: its groups, batch order
    group_of: np.ndarray         # (W, Kc) index into the rank's groups
    seq_index: np.ndarray        # (W, Kc) 0-based position of the slot among its group's per-iteration ones
    per_iteration: np.ndarray    # (W, Kc) the group's collectives per iteration on that rank
    ring_next: np.ndarray        # (W, Kc) global rank
    ring_steps: np.ndarray       # (W, Kc)
    groups_pb: tuple[bytes, ...]  # per rank: its groups as CollectiveBatch field 1 (wire bytes)
    slot_pb: np.ndarray          # (Kc, w) uint8: fields 3-5 (op, bytes, dtype) of each slot, encoded
    slot_len: np.ndarray         # (Kc,) their lengths
    #: Step 5 (``build(steps=True)``): per slot its StepPlan and its groups' members in ring
    #: order (G, n), per rank its row there and position in it (W,) each; None: no step records.
    step_plans: tuple | None = None
    step_groups: tuple | None = None
    #: Step 7: (W, Kc) the slot's group spans hosts (its flows leave through the NICs); (Kc,) group sizes.
    inter: np.ndarray | None = None
    size: np.ndarray | None = None

    @classmethod
    def build(cls, topo: Topology, tmpl: wl.Template, *, steps: bool = False,
              algos: dict[str, str] | None = None) -> "CollectivePlan":
        from trainscope.collector.sim.engine import ring_successor

        with_steps = steps            # (``steps`` is reused below for a program's steps)
        W = topo.world
        slots = np.flatnonzero(tmpl.cat == wl.CAT_COLL)
        dims = [tmpl.dim[k] for k in slots]
        kinds = [_op(tmpl.names[tmpl.name_id[k]], d) for k, d in zip(slots, dims)]
        stage_of_rank = (topo.canon_of // topo.stage_ranks)
        # issue order per stage: the program's collectives, the dp buckets after the last backward, then post
        col = {int(k): i for i, k in enumerate(slots)}
        seq_index = np.zeros((topo.pp, len(slots)), dtype=np.int64)
        per_it = np.zeros((topo.pp, len(slots)), dtype=np.int64)
        for s in range(topo.pp):
            order: list[int] = [st[1] for st in tmpl.pre if st[0] == "coll"]
            for op, m, steps in tmpl.programs[s]:
                order += [st[1] for st in steps if st[0] == "coll"]
                if op == "B" and m == tmpl.micro_batches - 1:
                    order += list(tmpl.buckets)
            order += [st[1] for st in tmpl.post if st[0] == "coll"]
            count: dict[str, int] = {}
            for k in order:
                d = tmpl.dim[k]
                seq_index[s, col[k]] = count.get(d, 0)
                count[d] = count.get(d, 0) + 1
            for i, d in enumerate(dims):
                per_it[s, i] = count.get(d, 0)
        # groups, ring successors (rank order)
        ring_next = np.zeros((W, len(slots)), dtype=np.int64)
        ring_steps = np.zeros((W, len(slots)), dtype=np.int64)
        gid_col: dict[str, np.ndarray] = {}
        members_of: dict[str, dict[int, list[int]]] = {}
        rows_of: dict[str, tuple] = {}
        for d in dict.fromkeys(dims):
            shape = topo.shape
            ax = topo.axes(d, stage=False)
            ranks = topo.rank_of.reshape(shape)
            moved = np.moveaxis(ranks, ax, tuple(range(len(shape) - len(ax), len(shape))))
            flat = moved.reshape(-1, topo.size(d))          # one row per group, canonical ring order
            low = flat.min(axis=1)
            row_of = np.empty(W, dtype=np.int64)
            row_of[flat.ravel()] = np.repeat(np.arange(len(flat)), flat.shape[1])
            gid_col[d] = low[row_of]
            members_of[d] = {int(lo): flat[i].tolist() for i, lo in enumerate(low)}
            pos_of = np.empty(W, dtype=np.int64)
            pos_of[flat.ravel()] = np.tile(np.arange(flat.shape[1]), len(flat))
            rows_of[d] = (flat, row_of, pos_of)
            nxt = topo.rank_of[ring_successor(topo, d)][topo.canon_of]   # rank -> next rank
            for i, dd in enumerate(dims):
                if dd == d:
                    ring_next[:, i] = nxt
                    ring_steps[:, i] = kinds[i][2] * (topo.size(d) - 1)
        uniq = list(dict.fromkeys(dims))
        groups = []
        for r in range(W):
            groups.append(tuple(CollectiveGroup(id=f"{d}:{int(gid_col[d][r])}",
                                                members=members_of[d][int(gid_col[d][r])]) for d in uniq))
        group_of = np.broadcast_to(np.array([uniq.index(d) for d in dims], dtype=np.int64), (W, len(slots)))
        st = stage_of_rank
        nbytes = np.rint(tmpl.base_us[slots] * BYTES_PER_US).astype(np.int64)
        ops, dtypes = tuple(k[0] for k in kinds), tuple(k[1] for k in kinds)
        consts = [CollectiveRecord(op=o, bytes=int(b), dtype=t).SerializeToString()
                  for o, b, t in zip(ops, nbytes.tolist(), dtypes)]
        slot_pb = np.zeros((len(slots), max(map(len, consts), default=0)), dtype=np.uint8)
        for i, c in enumerate(consts):
            slot_pb[i, :len(c)] = np.frombuffer(c, dtype=np.uint8)
        step_plans = step_groups = None
        if with_steps:
            step_plans = tuple(decompose(o, topo.size(d), int(b), (algos or {}).get(o))
                               for o, d, b in zip(ops, dims, nbytes.tolist()))
            step_groups = tuple(rows_of[d] for d in dims)
        inter = np.stack([topo.inter_host(d)[topo.canon_of] for d in dims], axis=1) if dims else \
            np.zeros((W, 0), dtype=bool)
        return cls(slots=slots, ops=ops, dtypes=dtypes, nbytes=nbytes, groups=tuple(groups),
                   inter=inter, size=np.asarray([topo.size(d) for d in dims], dtype=np.int64),
                   step_plans=step_plans, step_groups=step_groups,
                   group_of=group_of, seq_index=seq_index[st], per_iteration=per_it[st],
                   ring_next=ring_next, ring_steps=ring_steps,
                   groups_pb=tuple(CollectiveBatch(groups=g).SerializeToString() for g in groups),
                   slot_pb=slot_pb, slot_len=np.asarray([len(c) for c in consts], dtype=np.int64))


@dataclasses.dataclass(slots=True, eq=False)
class CollectiveColumns:
    """Step 3: one chunk's collective records, rank order, local clocks (int64 ns)."""

    plan: CollectivePlan
    iterations: np.ndarray   # (I,)
    enqueue: np.ndarray      # (W, I*Kc)
    end: np.ndarray          # (W, I*Kc); the watchdog's abort time for in-flight ones
    valid: np.ndarray        # (W, I*Kc) the rank reached it
    done: np.ndarray         # (W, I*Kc) it completed
    busy: np.ndarray         # (W, I*Kc) ns
    wait: np.ndarray         # (W, I*Kc) ns
    #: Step 6 (plans with steps): per slot index, (start, end) offsets from each member's own
    #: start, int64 ns (I, G, S, n, k) in the slot's group rows (``plan.step_groups``); −1: none.
    steps: dict | None = None
    #: Step 7: per rank, (its in-flight records as field-2 bytes, its channel states as field-6 bytes,
    #: its clock at the watchdog's abort); only ranks with a collective in flight.
    flight: dict | None = None
    #: Step 4, made on the first ``payload``: every record's bytes, per-rank offsets, ``now_ns``.
    _wire: tuple[memoryview, np.ndarray, np.ndarray] | None = dataclasses.field(default=None, repr=False)

    @property
    def events(self) -> int:
        return int(self.valid.sum())

    def payload(self, r: int) -> bytes | None:
        """The rank's ``CollectiveBatch``, serialised (None: no record)."""
        if self._wire is None:
            self._wire = encode_records(self)
        buf, off, now = self._wire
        lo, hi = int(off[r]), int(off[r + 1])
        fl = self.flight.get(r) if self.flight else None
        if lo == hi and fl is None:
            return None
        if fl is None:
            data = b"".join((self.plan.groups_pb[r], buf[lo:hi], b"\x18", _varint(int(now[r]))))
        else:   # step 7: fields in number order (records 2, now_ns 3, states 6), as protobuf writes them
            data = b"".join((self.plan.groups_pb[r], buf[lo:hi], fl[0], b"\x18",
                             _varint(max(int(now[r]), fl[2])), fl[1]))
        return data if self.steps is None else self._with_steps(r, data)

    @property
    def state_events(self) -> int:
        """Channel states sent (step 7)."""
        return sum(v[3] for v in self.flight.values()) if self.flight else 0

    def _with_steps(self, r: int, data: bytes) -> bytes:
        """Step 6: the rank's batch with every record's flows (fields 14-19), by protobuf."""
        b = CollectiveBatch.FromString(data)
        Kc = len(self.plan.slots)
        for rec, v in zip(b.records, np.flatnonzero(self.valid[r]).tolist()):
            it, col = divmod(v, Kc)
            got = self.steps.get(col)
            if got is None:
                continue
            sp = self.plan.step_plans[col]
            flat, row_of, pos_of = self.plan.step_groups[col]
            g, i = int(row_of[r]), int(pos_of[r])
            st, en = got[0][it, g, :, i], got[1][it, g, :, i]     # (S, k)
            dst = sp.dst[:, i]
            s_idx, j = np.nonzero(dst >= 0)
            rec.algo = sp.algo
            rec.step_index.extend(s_idx.tolist())
            rec.step_dst.extend(flat[g, dst[s_idx, j]].tolist())
            rec.step_bytes.extend(sp.nbytes[s_idx, i, j].tolist())
            rec.step_start_ns.extend(st[s_idx, j].tolist())
            rec.step_end_ns.extend(en[s_idx, j].tolist())
        return b.SerializeToString()

    def batch(self, r: int) -> CollectiveBatch | None:
        data = self.payload(r)
        return None if data is None else CollectiveBatch.FromString(data)


def _varint(v: int) -> bytes:
    out = bytearray()
    while v > 0x7F:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


#: 2**7, 2**14, ... 2**63: a value at or above the i-th takes more than i+1 varint bytes.
_VARINT_STEPS = np.left_shift(np.uint64(1), np.arange(7, 64, 7, dtype=np.uint64))


def _field(number: int, v: np.ndarray, *, skip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A varint field per record, byte-major: (1 + w, N) uint8, the tag then the w bytes of the
    longest value, and its length per record (0 where the value is 0, which proto3 does not
    write, or where ``skip``). Byte-major so that every numpy loop runs over the records."""
    v = np.ascontiguousarray(v, dtype=np.int64).view(np.uint64)
    n = 1 + np.searchsorted(_VARINT_STEPS, v, side="right")
    w = int(n.max(initial=1))
    out = np.empty((w + 1, len(v)), dtype=np.uint8)
    out[0] = number << 3               # wire type 0 (varint); fields 1-15 take one tag byte
    for j in range(w):
        out[j + 1] = (v >> np.uint64(7 * j)).astype(np.uint8) & 0x7F
        out[j + 1] |= (n > j + 1).view(np.uint8) << 7
    zero = v == 0 if skip is None else (v == 0) | skip
    return out, np.where(zero, 0, n + 1)


#: Records laid out per pass of ``encode_records`` (x ~80 bytes: two ~1 MiB matrices).
_BLOCK = 16384


def encode_records(c: CollectiveColumns) -> tuple[memoryview, np.ndarray, np.ndarray]:
    """Step 4: every valid record of the chunk as ``CollectiveBatch.records`` entries (field 2),
    rank-major (a rank's records in iteration, slot order); per-rank byte offsets (W+1,); per
    rank its latest end (``now_ns``).

    Each record is laid out in a fixed-width row (every field as wide as its longest value)
    with a mask of the bytes it really has; the masked bytes, row after row, are the records."""
    p = c.plan
    W, Kc = c.valid.shape[0], len(p.slots)
    rank, v = np.nonzero(c.valid)
    col = v % Kc
    its = c.iterations[v // Kc]
    steps = p.ring_steps[rank, col]
    no_ring = steps == 0
    enq, end = c.enqueue[rank, v], c.end[rank, v]   # every sent record completed (step 3): end set
    fields = [
        _field(1, p.group_of[rank, col]),
        _field(2, its * p.per_iteration[rank, col] + p.seq_index[rank, col] + 1),
        (np.ascontiguousarray(p.slot_pb.T[:, col]), p.slot_len[col]),     # 3-5: op, bytes, dtype
        _field(6, enq),
        _field(7, enq),
        _field(8, end),
        _field(9, its),
        _field(10, steps),
        _field(11, p.ring_next[rank, col], skip=no_ring),
        _field(12, c.busy[rank, v].astype(np.int64), skip=no_ring),
        _field(13, c.wait[rank, v].astype(np.int64), skip=no_ring),
    ]
    size = sum(n for _, n in fields)
    head, head_n = _field(2, size)                     # field 2, then the length: wire type 2
    head[0] = (2 << 3) | 2
    parts = [(head, np.maximum(head_n, 2))] + fields   # (an empty record would still take 2 bytes)
    width = sum(len(m) for m, _ in parts)
    rows = np.empty((_BLOCK, width), dtype=np.uint8)
    keep = np.empty((_BLOCK, width), dtype=bool)
    out = []
    for lo in range(0, len(rank), _BLOCK):    # blocks that stay in cache: 2.4x faster than one pass
        hi = min(len(rank), lo + _BLOCK)
        k, at = hi - lo, 0
        for m, n in parts:
            nb = n[lo:hi]
            for j in range(len(m)):
                rows[:k, at] = m[j, lo:hi]
                np.greater(nb, j, out=keep[:k, at])
                at += 1
        out.append(rows[:k][keep[:k]].tobytes())
    buf = memoryview(b"".join(out))     # payload() joins slices of it without copying them first
    per_rank = np.bincount(rank, weights=parts[0][1] + size, minlength=W).astype(np.int64)
    off = np.zeros(W + 1, dtype=np.int64)
    np.cumsum(per_rank, out=off[1:])
    now = np.where(c.valid, c.end, np.iinfo(np.int64).min).max(axis=1, initial=np.iinfo(np.int64).min)
    return buf, off, now


def build_columns(plan: CollectivePlan, outs, topo: Topology, clocks) -> CollectiveColumns | None:
    """Step 3 from engine outputs (canonical order, global ns)."""
    if not outs or outs[0].busy is None:
        return None
    W, I, Kc = topo.world, len(outs), len(plan.slots)
    perm = topo.canon_of
    k = plan.slots
    start = np.stack([o.start[:, k] for o in outs], axis=1)[perm].reshape(W, I * Kc)
    dur = np.stack([o.dur[:, k] for o in outs], axis=1)[perm].reshape(W, I * Kc)
    busy = np.stack([o.busy[:, k] for o in outs], axis=1)[perm].reshape(W, I * Kc)
    xfer = np.stack([o.xfer[:, k] for o in outs], axis=1)[perm].reshape(W, I * Kc)
    done = np.isfinite(start) & np.isfinite(dur) & np.isfinite(busy)
    valid = done      # completed collectives only (step 3)
    hosts = topo.host[:, None]
    s = np.where(valid, start, 0.0)
    enq = clocks.local(s, hosts)
    end = np.maximum(clocks.local(np.where(valid, s + dur, 0.0), hosts), enq + 1)
    its = np.asarray([o.it for o in outs], dtype=np.int64)
    steps = None if plan.step_plans is None else step_times(plan, its, start, dur, busy, xfer, valid)
    # step 7: entered, never ended (the watchdog aborted it after its timeout): in flight at the run's end
    with np.errstate(invalid="ignore"):
        flying = np.isfinite(start) & np.isfinite(dur) & ~np.isfinite(busy)
    flight = None
    if flying.any():
        dead = [o.nic_dead for o in outs if o.nic_dead is not None]
        dead = np.min(dead, axis=0)[perm] if dead else np.full(W, np.inf)
        # every collector's last batch is cut when the first watchdog fires (the earliest entry + timeout):
        # the collective stuck longest shows the longest wait, the ones it held up since, shorter ones
        cut = float(np.min(start[flying])) + outs[-1].timeout_ns
        snap = states_at(plan, its, start, flying, np.full(start.shape, cut), dead)
        flight = flight_payloads(plan, its, snap, topo, clocks)
    with np.errstate(invalid="ignore"):
        return CollectiveColumns(plan=plan, iterations=its,
                                 enqueue=enq, end=end, valid=valid, done=done,
                                 busy=np.where(done, np.rint(busy), 0.0),
                                 wait=np.where(done, np.maximum(np.rint(xfer - busy), 0.0), 0.0), steps=steps,
                                 flight=flight)


#: Step 6: log-spread of one flow step's time around its link's (healthy step-to-step jitter).
STEP_NOISE = 0.03


def step_times(plan: CollectivePlan, its: np.ndarray, start, dur, busy, xfer, valid) -> dict:
    """Step 6 from the engine's ring (rank order, global ns, (W, I*Kc) each): every flow's start
    and end, as offsets from its rank's own start (arrival).

    1. Each member's link multiplier: the ring's flow r → next(r) is busy in proportion to
       the slower of its two ends (engine step 4), so member r's own link is the smaller of
       its outgoing and incoming flows' busy times, relative to the group's fastest.
    2. The algorithm's steps timed from when every member has arrived (``time_steps``, with
       ``STEP_NOISE`` per flow step), then scaled so that they fill the engine's transfer.
    """
    W, Kc = valid.shape[0], len(plan.slots)
    I = len(its)
    out = {}
    shape = (W, I, Kc)
    start, dur, busy, xfer, valid = (a.reshape(shape) for a in (start, dur, busy, xfer, valid))
    for col, sp in enumerate(plan.step_plans):
        if sp.steps == 0:
            continue
        flat = plan.step_groups[col][0]                    # (G, n) ranks
        G, n = flat.shape
        ok = valid[flat, :, col].all(axis=1)               # (G, I): complete on every member
        a = start[flat, :, col].transpose(2, 0, 1)          # (I, G, n)
        e = a + dur[flat, :, col].transpose(2, 0, 1)
        x = xfer[flat, :, col].transpose(2, 0, 1)
        b = busy[flat, :, col].transpose(2, 0, 1)
        okc = ok.T.reshape(-1)
        with np.errstate(invalid="ignore"):
            rel = np.minimum(b, np.roll(b, 1, axis=2))                         # 1.
            mult = rel / np.nanmin(rel, axis=2, keepdims=True)
            t0 = np.nanmax(e - x, axis=2, keepdims=True)                       # everyone arrived
        C = I * G
        mult = np.where(np.isfinite(mult), mult, 1.0).reshape(C, n)
        rng = np.random.default_rng([int(its[0]) if I else 0, col, W])
        noise = rng.lognormal(0.0, STEP_NOISE, (C,) + sp.dst.shape)
        st, en = time_steps(sp, np.zeros((C, n)), mult, np.ones(C), noise)    # 2.
        with np.errstate(invalid="ignore"):
            scale = x[..., 0].reshape(C) / np.nanmax(en.reshape(C, -1), axis=1)
            base = (t0 - a).reshape(C, n)[:, None, :, None]
            so = base + st * scale[:, None, None, None]
            eo = base + en * scale[:, None, None, None]
        bad = ~np.isfinite(so) | ~okc[:, None, None, None]
        so = np.where(bad, -1, np.rint(so)).astype(np.int64).reshape((I, G) + sp.dst.shape)
        eo = np.where(bad, -1, np.rint(eo)).astype(np.int64).reshape((I, G) + sp.dst.shape)
        out[col] = (so, eo)
    return out


# ---------------------------------------------------------------- step records (Vedrfolnir §III-B)

#: Algorithms a collective is decomposed with; the default per op is the first that fits.
ALGORITHMS = ("ring", "tree", "pairwise")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StepPlan:
    """Step 5: one collective's algorithm as steps of flows (group-rank indices).

    ``dst[s, i, j]``: the j-th flow member ``i`` sends in step ``s`` (−1: none);
    ``nbytes`` its bytes; ``inc[s, i]``: the flows of step ``s`` that send to
    ``i`` (flat ``i*k + j`` indices, −1 padding), the data its step ``s+1`` waits for."""

    op: str
    algo: str
    n: int
    dst: np.ndarray     # (S, n, k) int64
    nbytes: np.ndarray  # (S, n, k) int64
    inc: np.ndarray     # (S, n, kin) int64

    @property
    def steps(self) -> int:
        return self.dst.shape[0]


def default_algo(op: str) -> str:
    return "pairwise" if op == "alltoall" else "ring"


def decompose(op: str, n: int, nbytes: int, algo: str | None = None) -> StepPlan:
    """Step 5: the textbook decomposition of ``op`` over ``n`` members (``nbytes``: each member's input).

    * ring all-reduce: 2(n−1) steps, each member sends a chunk of nbytes/n to the next
      (reduce-scatter then all-gather phase): 2(n−1)/n·nbytes per member;
    * ring reduce-scatter: n−1 steps of nbytes/n; ring all-gather: n−1 steps of nbytes
      (the input is one member's chunk): (n−1)·nbytes per member;
    * tree all-reduce (binary tree, heap order: parent of i is (i−1)//2, depth d = ⌊log2 n⌋):
      d reduce steps (the deepest level first, each child sends nbytes to its parent) then
      d broadcast steps (each parent sends nbytes to each child): 2d steps, 2(n−1)·nbytes in all;
    * pairwise all-to-all: n−1 steps, in step s (1-based) member i sends nbytes/n to
      (i+s) mod n and receives from (i−s) mod n: (n−1)/n·nbytes per member.
    """
    algo = algo or default_algo(op)
    if n < 2:
        z = np.zeros((0, n, 1), dtype=np.int64)
        return StepPlan(op, algo, n, z, z, z)
    i = np.arange(n)
    if algo == "ring" and op in ("allreduce", "reducescatter", "allgather"):
        S = 2 * (n - 1) if op == "allreduce" else n - 1
        dst = np.broadcast_to(((i + 1) % n)[None, :, None], (S, n, 1)).copy()
        b = nbytes if op == "allgather" else nbytes // n
        nb = np.full((S, n, 1), b, dtype=np.int64)
    elif algo == "pairwise" and op == "alltoall":
        s = np.arange(1, n)
        dst = ((i[None, :] + s[:, None]) % n)[:, :, None]
        nb = np.full(dst.shape, nbytes // n, dtype=np.int64)
    elif algo == "tree" and op == "allreduce":
        depth = np.floor(np.log2(i + 1)).astype(np.int64)
        D = int(depth[-1])
        dst = np.full((2 * D, n, 2), -1, dtype=np.int64)
        for s in range(D):                    # reduce: level D−s sends up
            up = depth == D - s
            dst[s, up, 0] = (i[up] - 1) // 2
        for s in range(D):                    # broadcast: level s sends down
            lvl = depth == s
            for j in (0, 1):
                ch = 2 * i + 1 + j
                ok = lvl & (ch < n)
                dst[D + s, ok, j] = ch[ok]
        nb = np.where(dst >= 0, nbytes, 0).astype(np.int64)
    else:
        raise ValueError(f"no {algo} decomposition of {op}")
    return StepPlan(op, algo, n, dst, np.where(dst >= 0, nb, 0), _incoming(dst))


def _incoming(dst: np.ndarray) -> np.ndarray:
    """(S, n, kin): per step and member the flat indices of the flows sending to it (−1 padding)."""
    S, n, k = dst.shape
    flat = dst.reshape(S, n * k)
    s_idx, f_idx = np.nonzero(flat >= 0)
    d = flat[s_idx, f_idx]
    order = np.lexsort((f_idx, d, s_idx))
    s_idx, f_idx, d = s_idx[order], f_idx[order], d[order]
    key = s_idx * n + d
    first = np.searchsorted(key, key, side="left")
    pos = np.arange(len(key)) - first
    kin = int(pos.max(initial=-1)) + 1
    out = np.full((S, n, max(kin, 1)), -1, dtype=np.int64)
    out[s_idx, d, pos] = f_idx
    return out


def time_steps(sp: StepPlan, t0: np.ndarray, mult: np.ndarray, ns_per_byte: np.ndarray,
               noise: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Step 6: start and end (C, S, n, k) of every flow of C collectives of plan ``sp``.

    A flow's step lasts its bytes × ``ns_per_byte`` (C,) × the slower of its two ends'
    link multipliers ``mult`` (C, n) × ``noise`` (C, S, n, k). Member i starts step s when
    its own flows of step s−1 ended and the data of step s−1 sent to it arrived (Vedrfolnir
    Fig. 4: F2S2 waits for F2S1 and F1S1); step 0 at ``t0`` (C, n). NaN where no flow."""
    S, n, k = sp.dst.shape
    C = t0.shape[0]
    start = np.full((C, S, n, k), np.nan)
    end = np.full((C, S, n, k), np.nan)
    ready = np.asarray(t0, dtype=float).copy()
    rows = np.arange(C)[:, None, None]
    for s in range(S):
        dst = sp.dst[s]
        ok = dst >= 0
        m = np.maximum(mult[:, :, None], mult[rows, np.where(ok, dst, 0)[None]])
        d = sp.nbytes[s][None] * ns_per_byte[:, None, None] * m
        if noise is not None:
            d = d * noise[:, s]
        st = np.broadcast_to(ready[:, :, None], (C, n, k))
        en = st + d
        start[:, s] = np.where(ok, st, np.nan)
        end[:, s] = np.where(ok, en, np.nan)
        sent = np.where(ok, en, -np.inf).max(axis=2)
        inc = sp.inc[s]
        got = np.where(inc >= 0, end[:, s].reshape(C, n * k)[:, np.maximum(inc, 0)], -np.inf)
        ready = np.maximum(ready, np.maximum(sent, np.nan_to_num(got, nan=-np.inf).max(axis=2)))
    return start, end

