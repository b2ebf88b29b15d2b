"""The run loop: iterations → faults → engine → chunks, with what was injected recorded.

1. Build the topology, the template, the engine (which calibrates kernel
   medians to ``iteration_s``) and each host's clock.
2. Each iteration starts where the previous one ended on each rank. Its
   start in global simulated time (the earliest rank) decides which faults are
   on (``faults.Activity``); each active fault edits the iteration's ``Mods``
   with its own random stream, so adding a fault never changes the healthy
   noise of the others (a faulty run differs from its healthy twin only where
   the fault acts).
3. Every ``emit_every`` iterations (and at the end) the buffered iterations
   become one :class:`emit.Chunk`; stack snapshots are cut every
   ``stack_every`` iterations.
4. A hang ends the run: the hung iteration's completed kernels are emitted,
   then one last stack snapshot per rank covers the watchdog timeout (the
   culprit in its hang site, everyone else waiting in NCCL).
5. The loop stops at ``iterations`` or once ``duration_s`` of simulated time has
   passed, whichever comes first.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from trainscope.collector.sim import effects
from trainscope.collector.sim.config import SimConfig
from trainscope.collector.sim.emit import STACK_COLUMNS, Chunk, build_chunk
from trainscope.collector.sim.engine import STACK_CATEGORIES, Engine, IterationOut
from trainscope.collector.sim.faults import Activity, FaultSpec, resolve_ranks
from trainscope.collector.sim.topology import HostClocks
from trainscope.collector.sim.workload import build_template

#: Faults that stop the job (the NCCL watchdog's timeout applies): a rank stops, a NIC fails.
HANG_TYPES = ("hang", "nic_fail")
#: Cap on per-iteration firing records kept per fault in the ground truth.
MAX_FIRED_RECORDS = 10_000
# The engine's host-time categories are the first stack columns, in the same order.
assert STACK_COLUMNS[:len(STACK_CATEGORIES)] == STACK_CATEGORIES


@dataclasses.dataclass(slots=True, eq=False)
class FaultRun:
    """One fault during a run: who, its activity, its random stream, what it did."""

    index: int
    spec: FaultSpec
    ranks: np.ndarray          # rank ids
    canon: np.ndarray          # canonical indices
    active: Activity
    rng: np.random.Generator
    active_iterations: list = dataclasses.field(default_factory=list)
    fired: list = dataclasses.field(default_factory=list)  # (iteration, [ranks])
    first_t: float | None = None
    last_t: float | None = None


class Simulation:
    def __init__(self, config: SimConfig) -> None:
        self.config = cfg = config
        self.topo = topo = cfg.topology()
        self.tmpl = build_template(topo, layers=cfg.layers, micro_batches=cfg.micro_batches)
        hang_timeouts = [f.params["timeout"] for f in cfg.faults if f.type in HANG_TYPES]
        self.engine = Engine(topo, self.tmpl, iteration_s=cfg.iteration_s, noise_sigma=cfg.noise_sigma,
                             comm_sigma=cfg.comm_sigma, hang_timeout_s=min(hang_timeouts, default=60.0),
                             noise=cfg.noise, noise_rng=np.random.default_rng([cfg.seed, 3]))
        self.rng = np.random.default_rng([cfg.seed, 0])
        self.clocks = HostClocks.draw(topo.hosts, np.random.default_rng([cfg.seed, 2]),
                                      max_offset_s=cfg.clock_offset_s, max_drift_ppm=cfg.clock_drift_ppm)
        self.faults = []
        for i, f in enumerate(cfg.faults):
            ranks = resolve_ranks(f, topo, f"sim.faults[{i}]")
            self.faults.append(FaultRun(i, f, ranks, topo.canon_of[ranks], Activity(f),
                                        np.random.default_rng([cfg.seed, 1, i])))
        self.masks = effects.masks(self.tmpl)
        self.iteration_bounds: list[tuple[float, float]] = []  # global (start, end) ns per iteration
        self.hung = False
        self.hang_window: tuple[float, float] | None = None

    @property
    def end_ns(self) -> float:
        """Global end of the run: the last iteration, or the watchdog's firing after a hang."""
        if self.hang_window is not None:
            return self.hang_window[1]
        return self.iteration_bounds[-1][1] if self.iteration_bounds else 0.0

    def chunks(self) -> Iterator[Chunk]:
        """Run the whole job, yielding chunks to emit (steps 2-5)."""
        cfg, topo, tmpl = self.config, self.topo, self.tmpl
        W, K = topo.world, tmpl.K
        t_prev = np.zeros(W)
        buf: list[IterationOut] = []
        stack_acc = np.zeros((W, len(STACK_COLUMNS)))
        stack_lo = np.zeros(W)
        stack_n = 0
        limit = cfg.max_iterations
        it = 0
        while limit is None or it < limit:
            t0 = float(t_prev.min())
            if cfg.duration_s is not None and t0 >= cfg.duration_s * 1e9:
                break
            mods = effects.Mods.neutral(W, K, np.full(W, np.inf))
            for f in self.faults:
                if not f.active(t0 / 1e9, it):
                    continue
                ctx = effects.Ctx(topo, tmpl, it, t0, f.rng, **self.masks)
                fired = effects.apply(f.spec, f.canon, mods, ctx)
                f.active_iterations.append(it)
                if len(fired) and len(f.fired) < MAX_FIRED_RECORDS:
                    f.fired.append((it, sorted(topo.rank_of[fired].tolist())))
            out = self.engine.run(it, t_prev, mods, self.rng)
            end = out.t_end[np.isfinite(out.t_end)]
            self.iteration_bounds.append((t0, float(end.max()) if len(end) else np.inf))
            for f in self.faults:
                if f.active_iterations and f.active_iterations[-1] == it:
                    f.first_t = t0 if f.first_t is None else f.first_t
                    f.last_t = self.iteration_bounds[-1][1]
            buf.append(out)
            if cfg.stack_every:
                if stack_n == 0:
                    stack_lo = t_prev.copy()
                stack_acc[:, :len(STACK_CATEGORIES)] += out.stacks[topo.canon_of]
                stack_n += 1
            it += 1
            if out.hung:
                self.hung = True
                break
            t_prev = out.t_end
            snap = cfg.stack_every and stack_n >= cfg.stack_every
            if len(buf) >= cfg.emit_every or snap:
                yield self._chunk(buf, stack_acc if snap else None, stack_lo, t_prev)
                buf = []
                if snap:
                    stack_acc = np.zeros_like(stack_acc)
                    stack_n = 0
        if self.hung:
            yield self._chunk(buf, stack_acc if stack_n else None, stack_lo, t_prev)
            buf = []
            yield self._hang_chunk(buf_end=t_prev)
        elif buf or stack_n:
            yield self._chunk(buf, stack_acc if stack_n else None, stack_lo, t_prev)

    def _chunk(self, buf, stack_acc, stack_lo, t_end) -> Chunk:
        topo = self.topo
        kw = {}
        if stack_acc is not None and self.config.stack_every:
            hi = t_end[topo.canon_of]
            kw = dict(stack_s=stack_acc.copy(), stack_window=(stack_lo[topo.canon_of], hi))
        return build_chunk(buf, topo, self.tmpl, self.clocks, stack_hz=self.config.stack_hz,
                           collective_steps=self.config.collective_steps, **kw)

    def _hang_chunk(self, buf_end: np.ndarray) -> Chunk:
        """Step 4: one stack snapshot per rank over the watchdog timeout after the hang."""
        topo = self.topo
        W = topo.world
        hangs = [f for f in self.faults if f.spec.type in HANG_TYPES and f.active_iterations]
        t0 = float(np.min(buf_end))
        timeout = min(f.spec.params["timeout"] for f in hangs) if hangs else 60.0
        culprits = np.zeros(W, dtype=bool)
        for f in hangs:
            if f.spec.type == "hang":    # a failed NIC leaves every rank waiting in NCCL
                culprits[f.ranks] = True
        s = np.zeros((W, len(STACK_COLUMNS)))
        s[culprits, STACK_COLUMNS.index("hang")] = timeout
        s[~culprits, STACK_COLUMNS.index("nccl_wait")] = timeout
        lo = buf_end[topo.canon_of]
        self.hang_window = (t0, t0 + timeout * 1e9)
        if not self.config.stack_every:
            return build_chunk([], topo, self.tmpl, self.clocks)
        return build_chunk([], topo, self.tmpl, self.clocks, stack_s=s,
                           stack_window=(lo, lo + timeout * 1e9), stack_hz=self.config.stack_hz)
