"""Simulated iterations → the telemetry real collectors emit, and the sinks that take it.

1. A :class:`Chunk` holds a few consecutive iterations of every rank, already
   in rank order and on each host's clock (``topology.HostClocks``), as
   (rank, record) numpy arrays; per-rank payloads are cut out of them with a
   handful of vectorised operations (no Python per kernel).
2. Per rank and chunk the payloads are: one ``KernelBatch`` (columnar), the
   ``IterationMark``s, the ``PhaseTiming``s (CUDA-event clock, the data loader on
   the CPU clock) and, every ``stack_every`` iterations, one py-spy-like
   ``StackSnapshot`` whose folded stacks are weighted by where the host thread
   spent its time (launching, synchronising, data loading, GC, JIT, hung),
   and one ``CollectiveBatch`` (``collective_records.py``: one record per
   collective, with the ring decomposition's flow of the rank).
3. Sinks (a one-method-plus-close Protocol, STYLE.md point 3):
   :class:`ExporterSink` sends through the real collector exporter (one
   ``BatchExporter`` per group of hosts, carrying many ranks with a per-batch
   ``resource=``) to a processor over gRPC, with flow control so nothing is
   dropped; :class:`MemorySink` keeps everything (tests, determinism digests);
   :class:`KinetoSink` writes PyTorch-profiler traces for ``trainscope replay``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from trainscope.collector.exporter import BatchExporter
from trainscope.collector.exporter_config import ExporterConfig
from trainscope.collector.sim.collective_records import CollectiveColumns, CollectivePlan, build_columns
from trainscope.collector.sim.topology import Topology
from trainscope.collector.sim.workload import PhaseDef
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.v1.telemetry_pb2 import (
    CollectiveBatch,
    FoldedStack,
    IterationBatch,
    IterationMark,
    PhaseBatch,
    PhaseTiming,
    StackBatch,
    StackSnapshot,
)

_ROOT = ("train.py:main;megatron/training/training.py:pretrain;"
         "megatron/training/training.py:train;megatron/training/training.py:train_step")
_SCHED = _ROOT + ";megatron/core/pipeline_parallel/schedules.py:forward_backward_pipelining_without_interleaving"
#: Stack category -> (folded stack, idle). Order matters: it is the column order of stack arrays.
FOLDED: dict[str, tuple[str, bool]] = {
    "launch": (_SCHED + ";megatron/core/pipeline_parallel/schedules.py:forward_step;"
               "torch/nn/modules/module.py:_call_impl;megatron/core/transformer/transformer_block.py:forward", False),
    "sync": (_SCHED + ";megatron/core/pipeline_parallel/p2p_communication.py:_communicate;"
             "torch/cuda/__init__.py:synchronize", True),
    "dataloader": (_SCHED + ";megatron/training/utils.py:get_batch_on_this_tp_rank;"
                   "torch/utils/data/dataloader.py:__next__;torch/utils/data/dataloader.py:_next_data;"
                   "torch/utils/data/dataloader.py:_get_data;multiprocessing/queues.py:get", True),
    "gc": (_ROOT + ";megatron/training/training.py:train_step;<gc>:collect", False),
    "jit": (_SCHED + ";megatron/core/pipeline_parallel/schedules.py:backward_step;torch/autograd/__init__.py:backward;"
            "flash_attn/cute/interface.py:_flash_attn_bwd;cutlass/cute/compile.py:compile;"
            "cutlass/base_dsl/jit_executor.py:jit_compile", False),
    "hang": (_ROOT + ";megatron/core/dist_checkpointing/strategies/async_utils.py:maybe_finalize_async_calls;"
             "threading.py:wait", True),
    "nccl_wait": (_SCHED + ";megatron/core/pipeline_parallel/p2p_communication.py:_communicate;"
                  "torch/distributed/distributed_c10d.py:wait;torch/cuda/__init__.py:synchronize", True),
}
STACK_COLUMNS = tuple(FOLDED)


@dataclasses.dataclass(slots=True, eq=False)
class Chunk:
    """Consecutive iterations of every rank, rank order, local clocks (int64 ns)."""

    topo: Topology
    iterations: np.ndarray    # (I,)
    names: tuple[str, ...]
    name_id: np.ndarray       # (I*K,) slot columns, tiled per iteration
    stream: np.ndarray
    kind: np.ndarray
    k_start: np.ndarray       # (W, I*K)
    k_dur: np.ndarray
    k_valid: np.ndarray
    m_begin: np.ndarray       # (W, I)
    m_end: np.ndarray
    m_valid: np.ndarray
    phases: tuple[PhaseDef, ...]
    p_start: np.ndarray       # (W, I*P)
    p_dur: np.ndarray
    p_valid: np.ndarray
    #: Stack snapshot per rank, or None: (W, len(STACK_COLUMNS)) seconds and its local window.
    stack_s: np.ndarray | None = None
    stack_window: tuple[np.ndarray, np.ndarray] | None = None
    stack_hz: float = 100.0
    #: Collective records of these iterations (None: none simulated).
    collectives: CollectiveColumns | None = None

    @property
    def collective_events(self) -> int:
        return self.collectives.events if self.collectives is not None else 0

    def collective_batch(self, r: int):
        return self.collectives.batch(r) if self.collectives is not None else None

    def collective_payload(self, r: int) -> bytes | None:
        """The rank's ``CollectiveBatch`` already serialised (encoded for all ranks at once)."""
        return self.collectives.payload(r) if self.collectives is not None else None

    @property
    def kernel_events(self) -> int:
        return int(self.k_valid.sum())

    @property
    def phase_events(self) -> int:
        return int(self.p_valid.sum())

    @property
    def mark_events(self) -> int:
        return int(self.m_valid.sum())

    def kernels(self, r: int) -> KernelColumns:
        v = self.k_valid[r]
        if v.all():  # the common case: no boolean gathers
            return KernelColumns(names=self.names, start_ns=self.k_start[r].astype(np.uint64),
                                 duration_ns=self.k_dur[r].astype(np.uint64), name_id=self.name_id,
                                 stream=self.stream, kind=self.kind)
        return KernelColumns(names=self.names, start_ns=self.k_start[r][v].astype(np.uint64),
                             duration_ns=self.k_dur[r][v].astype(np.uint64), name_id=self.name_id[v],
                             stream=self.stream[v], kind=self.kind[v])

    def marks(self, r: int) -> list:
        v = self.m_valid[r]
        return [IterationMark(iteration=i, start_ns=a, end_ns=b) for i, a, b in
                zip(self.iterations[v].tolist(), self.m_begin[r][v].tolist(), self.m_end[r][v].tolist())]

    def phase_timings(self, r: int) -> list:
        v = np.flatnonzero(self.p_valid[r])
        if not len(v):
            return []
        P = len(self.phases)
        its = self.iterations[v // P].tolist()
        defs = [self.phases[j] for j in (v % P).tolist()]
        return [PhaseTiming(name=d.name, start_ns=s, duration_ns=du, iteration=i, stream=d.stream,
                            clock=d.clock, micro_batch=d.micro_batch)
                for d, s, du, i in zip(defs, self.p_start[r][v].tolist(), self.p_dur[r][v].tolist(), its)]

    def stack(self, r: int) -> StackSnapshot | None:
        if self.stack_s is None:
            return None
        counts = np.rint(self.stack_s[r] * self.stack_hz).astype(np.int64)
        if counts.sum() <= 0:
            return None
        lo, hi = self.stack_window
        snap = StackSnapshot(window_start_ns=int(lo[r]), window_end_ns=int(hi[r]), samples=int(counts.sum()))
        tid = 1000 + r
        for cat, n in zip(STACK_COLUMNS, counts.tolist()):
            if n > 0:
                stack, idle = FOLDED[cat]
                snap.stacks.append(FoldedStack(stack=stack, count=n, thread_id=tid, idle=idle))
        return snap


class SimSink(Protocol):
    """Where simulated telemetry goes."""

    def write(self, chunk: Chunk) -> None: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------ exporter


class ExporterSink:
    """Through the real collector exporter and gRPC to a processor.

    One ``BatchExporter`` per group of hosts (``exporters`` of them), so a
    1,024-rank job needs a handful of streams, not 1,024; each batch carries
    its rank's ``Resource``.

    Order per rank and chunk: kernels, phases, stacks, collectives, then the
    iteration marks. A processor cutting windows by iterations closes a window when it
    sees a later iteration's mark, so the chunk's other records must be there
    first; one cutting by time needs a lateness of at least one chunk
    (``emit_every`` iterations). Stacks are attributed by their start time.

    Flow control: when an exporter holds more than ``max_pending`` unconfirmed
    batches the sink waits for confirmation instead of letting the bounded
    queue drop. ``barrier`` (embedded processor only) is called after each
    chunk once it is confirmed, and waits until the processor has *processed*
    its backlog. A remote processor does not let a client see its backlog: when
    its own bounded queue stays full it refuses batches (counted in
    ``rejected_by_processor``, not re-sent) and the sink backs off.
    """

    def __init__(self, target: str, topo: Topology, job_id: str, *, exporters: int = 4,
                 max_pending: int = 256, timeout_s: float = 300.0,
                 barrier: Callable[[], object] | None = None) -> None:
        self.topo = topo
        n = max(1, min(exporters, topo.hosts))
        self._res = [topo.resource(r, job_id) for r in range(topo.world)]
        cfg = ExporterConfig(target=target, max_queue_batches=max(4 * max_pending, 1024),
                             max_queue_bytes=512 << 20, drop_policy="newest", confirm_interval_s=0.5,
                             shutdown_timeout_s=timeout_s)
        self.exporters = [BatchExporter(self._res[0], cfg) for _ in range(n)]
        self._of_rank = (topo.host % n).tolist()
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self.barrier = barrier
        self.wait_s = 0.0
        self._rejected = 0
        self._backoff = 0.0

    def write(self, chunk: Chunk) -> None:
        for r in range(self.topo.world):
            exp, res = self.exporters[self._of_rank[r]], self._res[r]
            cols = chunk.kernels(r)
            if len(cols):
                exp.submit(cols.to_pb(), 25 * len(cols) + 64 * len(cols.names), resource=res)
            ph = chunk.phase_timings(r)
            if ph:
                exp.submit(PhaseBatch(phases=ph), 48 * len(ph), resource=res)
            snap = chunk.stack(r)
            if snap is not None:
                exp.submit(StackBatch(snapshots=[snap]), 64 + 256 * len(snap.stacks), resource=res)
            coll = chunk.collective_payload(r)
            if coll is not None:
                exp.submit(CollectiveBatch.FromString(coll), len(coll), resource=res)
            marks = chunk.marks(r)
            if marks:
                exp.submit(IterationBatch(marks=marks), 32 * len(marks), resource=res)
            if exp.pending > self.max_pending:
                t0 = time.perf_counter()
                exp.flush(self.timeout_s)
                self.wait_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.barrier is not None:
            for e in self.exporters:
                e.flush(self.timeout_s)
            self.barrier()
        else:
            # A remote processor that refused batches (overloaded) is given time to catch up.
            rejected = sum(e.stats.rejected_by_processor for e in self.exporters)
            if rejected > self._rejected:
                self._backoff = min(max(2 * self._backoff, 0.5), 10.0)
                time.sleep(self._backoff)
            else:
                self._backoff = 0.0
            self._rejected = rejected
        self.wait_s += time.perf_counter() - t0

    def finish(self) -> None:
        """Every rank's process ended normally: send its end-of-process marker
        (``TelemetryBatch.final``), so a finished job is not taken for a hung one.
        Not called after a hang: hung processes never send it."""
        for r in range(self.topo.world):
            self.exporters[self._of_rank[r]].submit_final(self._res[r])

    def close(self) -> None:
        for e in self.exporters:
            e.shutdown(self.timeout_s)

    def stats(self) -> dict:
        total: dict = {}
        for e in self.exporters:
            for k, v in e.stats.snapshot().items():
                if isinstance(v, dict):
                    d = total.setdefault(k, {})
                    for kk, vv in v.items():
                        d[kk] = d.get(kk, 0) + vv
                else:
                    total[k] = total.get(k, 0) + v
        return total


# ------------------------------------------------------------------ memory / kineto


class MemorySink:
    """Keeps every rank's payloads; ``digest`` hashes their serialised bytes in order."""

    def __init__(self) -> None:
        self._kernels: dict[int, list[KernelColumns]] = {}
        self._marks: dict[int, list] = {}
        self._phases: dict[int, list] = {}
        self._stacks: dict[int, list] = {}
        self._collectives: dict[int, list] = {}
        self._hash = hashlib.sha256()
        self.ranks = 0

    def write(self, chunk: Chunk) -> None:
        h = self._hash
        self.ranks = chunk.topo.world
        for r in range(chunk.topo.world):
            cols = chunk.kernels(r)
            marks, ph, snap = chunk.marks(r), chunk.phase_timings(r), chunk.stack(r)
            self._kernels.setdefault(r, []).append(cols)
            self._marks.setdefault(r, []).extend(marks)
            self._phases.setdefault(r, []).extend(ph)
            if snap is not None:
                self._stacks.setdefault(r, []).append(snap)
            h.update(cols.to_pb().SerializeToString())
            h.update(IterationBatch(marks=marks).SerializeToString())
            h.update(PhaseBatch(phases=ph).SerializeToString())
            if snap is not None:
                h.update(snap.SerializeToString())
            coll = chunk.collective_payload(r)
            if coll is not None:
                self._collectives.setdefault(r, []).append(CollectiveBatch.FromString(coll))
                h.update(coll)    # the bytes protobuf writes (test_sim_collective_records)

    def close(self) -> None:
        pass

    def digest(self) -> str:
        return self._hash.copy().hexdigest()

    def kernels(self, r: int) -> KernelColumns:
        parts = [c for c in self._kernels.get(r, []) if len(c)]
        if not parts:
            return KernelColumns.empty()
        cat = np.concatenate
        return KernelColumns(names=parts[0].names, start_ns=cat([c.start_ns for c in parts]),
                             duration_ns=cat([c.duration_ns for c in parts]),
                             name_id=cat([c.name_id for c in parts]), stream=cat([c.stream for c in parts]),
                             kind=cat([c.kind for c in parts]))

    def marks(self, r: int) -> list:
        return list(self._marks.get(r, []))

    def phases(self, r: int) -> list:
        return list(self._phases.get(r, []))

    def stacks(self, r: int) -> list:
        return list(self._stacks.get(r, []))

    def collectives(self, r: int) -> list:
        """The rank's ``CollectiveBatch`` messages, one per chunk."""
        return list(self._collectives.get(r, []))


class KinetoSink(MemorySink):
    """Writes ``rank-<N>.json.gz`` (PyTorch-profiler Chrome trace) + ``topology.json`` on close.

    Keeps the run in memory until then: meant for runs small enough to profile
    (tens of ranks, tens of iterations), like a real ``torch.profiler`` capture.
    """

    def __init__(self, directory: str, topo: Topology) -> None:
        super().__init__()
        self.directory = directory
        self.topo = topo

    def close(self) -> None:
        from trainscope.collector.sources.kineto_writer import write_kineto_trace

        os.makedirs(self.directory, exist_ok=True)
        for r in range(self.topo.world):
            write_kineto_trace(os.path.join(self.directory, f"rank-{r}.json.gz"), rank=r,
                               world_size=self.topo.world, kernels=self.kernels(r),
                               iterations=self.marks(r), phases=self.phases(r), pid=10_000 + r)
        t = self.topo
        with open(os.path.join(self.directory, "topology.json"), "w") as f:
            json.dump({"world_size": t.world, "tp": t.tp, "pp": t.pp, "ep": t.ep, "cp": t.cp,
                       "order": t.order}, f)


class FanOut:
    """Several sinks as one."""

    def __init__(self, sinks: Sequence[SimSink]) -> None:
        self.sinks = list(sinks)

    def write(self, chunk: Chunk) -> None:
        for s in self.sinks:
            s.write(chunk)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


_PLANS: list = []   # (topo, tmpl, steps, plan) of the latest jobs: a plan is static per job


def _plan(topo: Topology, tmpl, steps: bool = False) -> CollectivePlan:
    for t, m, st, p in _PLANS:
        if t is topo and m is tmpl and st == steps:
            return p
    p = CollectivePlan.build(topo, tmpl, steps=steps)
    _PLANS[:] = [(topo, tmpl, steps, p)] + _PLANS[:3]
    return p


def build_chunk(outs: Sequence, topo: Topology, tmpl, clocks, *, stack_s: np.ndarray | None = None,
                stack_window: tuple[np.ndarray, np.ndarray] | None = None, stack_hz: float = 100.0,
                collective_steps: bool = False) -> Chunk:
    """Step 1: engine outputs (canonical, global ns) → a rank-ordered, local-clock :class:`Chunk`.

    ``stack_s`` (rank order, seconds per ``STACK_COLUMNS``) and ``stack_window``
    (global ns, rank order) add a stack snapshot per rank; ``collective_steps``: the collective
    records carry step records (``SimConfig.collective_steps``).
    """
    W, K, P, I = topo.world, tmpl.K, len(tmpl.phases), len(outs)
    perm = topo.canon_of
    hosts = topo.host

    def local_pair(start, dur, h):
        valid = np.isfinite(start) & np.isfinite(dur)
        s = np.where(valid, start, 0.0)
        e = np.where(valid, start + np.where(valid, dur, 0.0), 0.0)
        ls, le = clocks.local(s, h), clocks.local(e, h)
        return ls, np.maximum(le - ls, 1), valid

    if I:
        start = np.stack([o.start for o in outs], axis=1)[perm].reshape(W, I * K)
        dur = np.stack([o.dur for o in outs], axis=1)[perm].reshape(W, I * K)
        ks, kd, kv = local_pair(start, dur, hosts[:, None])
        tb = np.stack([o.t_begin for o in outs], axis=1)[perm]
        te = np.stack([o.t_end for o in outs], axis=1)[perm]
        mb, md, mv = local_pair(tb, te - tb, hosts[:, None])
        ps = np.stack([o.ph_start for o in outs], axis=1)[perm].reshape(W, I * P)
        pd = np.stack([o.ph_dur for o in outs], axis=1)[perm].reshape(W, I * P)
        qs, qd, qv = local_pair(ps, pd, hosts[:, None])
        its = np.asarray([o.it for o in outs], dtype=np.int64)
    else:
        ks = kd = np.zeros((W, 0), np.int64)
        kv = np.zeros((W, 0), bool)
        mb = md = np.zeros((W, 0), np.int64)
        mv = np.zeros((W, 0), bool)
        qs = qd = np.zeros((W, 0), np.int64)
        qv = np.zeros((W, 0), bool)
        its = np.zeros(0, np.int64)
    window = None
    if stack_s is not None:
        lo, hi = stack_window
        lo_l = clocks.local(lo, hosts)
        window = (lo_l, np.maximum(clocks.local(hi, hosts), lo_l + 1))
    return Chunk(
        collectives=build_columns(_plan(topo, tmpl, collective_steps), outs, topo, clocks) if I else None,
        topo=topo, iterations=its, names=tmpl.names, name_id=np.tile(tmpl.name_id, I),
        stream=np.tile(tmpl.stream, I), kind=np.tile(tmpl.kind, I), k_start=ks, k_dur=kd, k_valid=kv,
        m_begin=mb, m_end=mb + md, m_valid=mv, phases=tmpl.phases, p_start=qs, p_dur=qd, p_valid=qv,
        stack_s=stack_s, stack_window=window, stack_hz=stack_hz,
    )
