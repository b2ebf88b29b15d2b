"""Vectorised simulation of one training iteration for every rank at once.

State per rank (canonical layout, ``topology.py`` step 2): ``g``, the time the
compute stream is free, and ``u``, the time of the host (CPU) thread that
launches kernels. All times are global simulated ns; clocks are applied on
emission. One iteration:

1. Durations: every slot's median (scaled so a healthy iteration lasts
   ``iteration_s``) times the noise measured on real traces (``noise.py``:
   per-slot body, spikes, per-rank personality, a per-step factor), times
   the faults' multipliers (``effects.Mods``). One (W, K) draw per iteration.
2. Host: iteration overhead, GC stalls and the data loader advance ``u``; the
   GPU idles meanwhile (ARGUS Table 6 host-side rows).
3. Compute blocks: a kernel starts when the stream is free and the CPU has
   launched it, ``start_k = max(end_{k-1} + gap, launch_k)``. With
   ``S_k = Σ_{i<k}(d_i + gap)`` this is ``S_k + cummax_j(x_j − S_j)``: one
   cumulative max over the block, no per-kernel Python.
4. Collectives: a rank *arrives* when its stream and CPU reach the kernel; the
   collective ends for every member at ``max(arrivals) + transfer``, the
   transfer running at the slowest member's link (intra-host NVLink or
   inter-host NIC) with one noise draw per group (the members' draws averaged
   in log space). Each rank's kernel lasts ``end − own arrival``: the last
   to arrive (the slow rank) shows the shortest collective, its peers the
   longest (ARGUS §9.5). Group max = ``max`` over one axis.
   Ring decomposition (Vedrfolnir §III-B), for the collective records: a
   group's members form a ring in group-rank order; each member's flow sends
   to the next member in 2(n−1) steps (all-reduce; n−1 for reduce-scatter and
   all-gather). A link's speed is that of both its ends: NVLink for an
   intra-host group, for an inter-host group both members' NICs (multi-rail:
   every GPU's cross-host traffic leaves through its own NIC), so a degraded
   NIC slows every step its rank sends or receives, a degraded NVLink the
   intra-host steps of its GPU. The ring runs at its slowest link: that
   flow's steps fill the transfer (its busy time = ``transfer``), the others
   are busy in proportion to their link's multiplier (and a per-member
   noise of half the members' log-spread) and wait the rest. The totals are
   the ones above (max over links = max over members).
5. Pipeline: per stage the 1F1B program (``workload.one_f_one_b``); a receive
   waits for the matching send of the neighbouring stage, so a slow stage
   leaves bubbles in its neighbours (ARGUS §9.3). Sends do not block the
   sender. Ops are run stage by stage as soon as their receive's send is known
   (a list schedule; a valid 1F1B order never deadlocks). The host thread
   synchronises with the GPU at every op (Megatron's ``batch_p2p_sync``), so a
   host stall inside an op starves the GPU (ARGUS §9.4).
6. Gradient sync: per stage, after the last micro-batch's backward, one
   ReduceScatter per layer bucket on the dp stream, launched when its layer's
   gradients are ready (or after backward when overlap is lost), serial on that
   stream; then every rank waits for them, reduces the grad norm over the
   model-parallel group, steps Adam and all-gathers parameters. dp + mp
   reductions make every rank end the iteration together, which masks
   stragglers in iteration time (ARGUS §9.3).
7. Hangs: a rank past its hang time never arrives (arrival = inf); everything
   that waits on it becomes inf. A rank that did arrive at a collective that
   never completes is aborted by the NCCL watchdog after ``timeout``: that
   kernel is reported with duration ``timeout``; nothing after it is.
   A failed NIC (``nic_fail``): an inter-host collective of a group with a
   member on it, whose transfer would end after the NIC died, never ends
   on any member although every member arrived (end = inf). Point-to-point
   sends carry no records in this simulator and are left running: the
   collectives alone show the failure.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from trainscope.collector.sim import workload as wl
from trainscope.collector.sim.effects import Mods
from trainscope.collector.sim.noise import NoiseModel
from trainscope.collector.sim.topology import Topology

#: Nominal host costs (µs, scaled like kernel medians).
LAUNCH_US = 10.0
GAP_US = 2.0
HOST_US = 600.0
LOADER_US = 300.0
#: Inter-host transfers take this much longer than intra-host ones at nominal size.
INTER_HOST_PENALTY = 2.5
#: Stack categories accounted per iteration (emit.py turns them into folded stacks).
STACK_CATEGORIES = ("launch", "sync", "dataloader", "gc", "jit")


@dataclasses.dataclass(slots=True, eq=False)
class IterationOut:
    """One iteration, canonical rank order, global ns; NaN where nothing ran."""

    it: int
    start: np.ndarray       # (W, K)
    dur: np.ndarray         # (W, K)
    t_begin: np.ndarray     # (W,) iteration mark start
    t_end: np.ndarray       # (W,) iteration mark end (inf: hung)
    ph_start: np.ndarray    # (W, P)
    ph_dur: np.ndarray      # (W, P)
    stacks: np.ndarray      # (W, len(STACK_CATEGORIES)) seconds
    hung: bool
    busy: np.ndarray | None = None  # (W, K) ring flows' busy time of collective slots, ns (NaN: none)
    xfer: np.ndarray | None = None  # (W, K) the collective's transfer (ring) time, ns (NaN: never ended)
    nic_dead: np.ndarray | None = None  # (W,) global ns each rank's NIC died (inf: alive); None: no nic_fail
    timeout_ns: float = 60e9        # the watchdog's timeout (step 7)


@dataclasses.dataclass(slots=True, eq=False)
class _State:
    g: np.ndarray
    u: np.ndarray
    c: np.ndarray
    D: np.ndarray
    start: np.ndarray
    dur: np.ndarray
    mods: Mods
    launches: np.ndarray
    dp_end: np.ndarray
    bwd_end: np.ndarray
    ready: dict
    busy: np.ndarray | None = None
    xfer: np.ndarray | None = None


class Engine:
    def __init__(self, topo: Topology, tmpl: wl.Template, *, iteration_s: float, noise_sigma: float,
                 comm_sigma: float, hang_timeout_s: float = 60.0, noise: NoiseModel | None = None,
                 noise_rng: np.random.Generator | None = None) -> None:
        self.topo, self.tmpl = topo, tmpl
        self.noise_sigma, self.comm_sigma = noise_sigma, comm_sigma
        self.hang_timeout_ns = hang_timeout_s * 1e9
        comm = np.isin(tmpl.cat, [wl.CAT_COLL, wl.CAT_P2P])
        self.sigma = np.where(comm, comm_sigma, noise_sigma)
        self.noise = noise
        self.noise_state = (noise.setup(self.sigma, topo.world, noise_rng or np.random.default_rng(0))
                            if noise is not None else None)
        self.is_comm = comm
        self.inter = {d: topo.inter_host(d) for d in {d for d in tmpl.dim if d not in (None, "pp")}}
        self.pp_inter = topo.pp_pair_inter_host()
        self.ring_next = {d: ring_successor(topo, d) for d in self.inter}
        stage_of = np.repeat(np.arange(topo.pp), topo.stage_ranks)
        self.present = tmpl.present[stage_of]  # (W, K)
        self._phase_masks()
        self.scale = 1000.0  # ns per nominal µs; calibrated below
        self.scale = self._calibrate(iteration_s)

    # ------------------------------------------------------------ set-up
    def _calibrate(self, iteration_s: float) -> float:
        """Step 1: scale medians so that a healthy iteration lasts ``iteration_s``: noise-free, or with
        the noise model the median of a few noisy iterations (spikes stretch collectives: the group
        waits for its slowest member), from a fixed stream so the run's own draws are untouched."""
        W, K = self.topo.world, self.tmpl.K
        neutral = Mods.neutral(W, K, np.full(W, np.inf))
        if self.noise_state is None:
            out = self.run(0, np.zeros(W), neutral, z=np.zeros((W, K)), host_noise=np.zeros((2, W)))
            nominal = float(np.max(out.t_end))
        else:
            rng = np.random.default_rng(20240601)
            nominal = float(np.median([np.max(self.run(0, np.zeros(W), neutral, rng).t_end) for _ in range(3)]))
        return self.scale * iteration_s * 1e9 / nominal

    def _phase_masks(self) -> None:
        t = self.tmpl
        notp2p = t.cat != wl.CAT_P2P
        self.span_masks: dict[int, np.ndarray] = {}
        self.sum_masks: dict[int, np.ndarray] = {}
        tag_of = {"self_attention": wl.TAG_ATTN, "mlp": wl.TAG_MLP, "moe_experts": wl.TAG_EXPERT,
                  "ep-alltoall": wl.TAG_A2A, "pp-recv": wl.TAG_RECV, "pp-send": wl.TAG_SEND}
        for i, ph in enumerate(t.phases):
            if ph.name == "forward":
                self.span_masks[i] = (t.op == wl.OP_F) & (t.mb == ph.micro_batch) & notp2p
            elif ph.name == "backward":
                self.span_masks[i] = (t.op == wl.OP_B) & (t.mb == ph.micro_batch) & notp2p
            elif ph.name == "optimizer":
                self.span_masks[i] = (t.op == wl.OP_POST) & (t.cat != wl.CAT_MEMCPY)
            elif ph.name in tag_of:
                self.sum_masks[i] = t.tag == tag_of[ph.name]
        self.expected = {i: self.present[:, m].sum(axis=1)
                         for i, m in {**self.span_masks, **self.sum_masks}.items()}

    # ------------------------------------------------------------ iteration
    def run(self, it: int, t_prev: np.ndarray, mods: Mods, rng: np.random.Generator | None = None,
            *, z: np.ndarray | None = None, host_noise: np.ndarray | None = None) -> IterationOut:
        """Simulate iteration ``it`` for all ranks, starting at ``t_prev`` (canonical, ns)."""
        topo, tmpl, sc = self.topo, self.tmpl, self.scale
        W, K = topo.world, tmpl.K
        drawn = z is None
        if z is None:
            z = rng.standard_normal((W, K))
        if host_noise is None:
            host_noise = rng.standard_normal((2, W))
        # Step 1: durations (the measured noise model when given; noise-free for calibration).
        if drawn and self.noise_state is not None:
            D = (tmpl.base_us * sc)[None, :] * self.noise.factors(self.noise_state, z, rng)
        else:
            D = (tmpl.base_us * sc)[None, :] * np.exp(self.sigma[None, :] * z)
        D = np.where(self.is_comm[None, :], D, D * mods.kmult)
        st = _State(g=t_prev.copy(), u=t_prev.copy(), c=LAUNCH_US * sc * mods.launch_mult, D=D,
                    start=np.full((W, K), np.nan), dur=np.full((W, K), np.nan), mods=mods,
                    launches=np.zeros(W), dp_end=t_prev.copy(), bwd_end=t_prev.copy(), ready={},
                    busy=np.full((W, K), np.nan), xfer=np.full((W, K), np.nan))
        # Step 2: host work before the first kernel; the GPU idles meanwhile.
        host = HOST_US * sc * mods.launch_mult * np.exp(0.05 * host_noise[0])
        load = LOADER_US * sc * mods.launch_mult * np.exp(0.1 * host_noise[1]) + mods.load_extra
        st.u = st.u + host + mods.pre_stall
        ld_start = st.u.copy()
        st.u = st.u + load
        for step in tmpl.pre:
            self._step(slice(None), step, st, stage=False)
        # Steps 3-5: the 1F1B pipeline (compute blocks, collectives, send/recv).
        self._pipeline(st)
        # Step 6: finish_grad_sync, grad norm, optimizer, loss to host.
        dp_phase_start = st.bwd_end.copy()
        st.g = np.maximum(st.g, st.dp_end)
        dp_phase_end = st.g.copy()
        for step in tmpl.post:
            self._step(slice(None), step, st, stage=False)
            if step[0] == "coll" and step[2] == "mp":
                st.u = np.maximum(st.u, st.g)  # total_norm.item()
        t_end = np.maximum(st.u, st.g)
        # Phases.
        P = len(tmpl.phases)
        ph_start, ph_dur = np.full((W, P), np.nan), np.full((W, P), np.nan)
        start, dur = st.start, st.dur
        bad = ~np.isfinite(start) | ~np.isfinite(dur)
        start[bad] = np.nan
        dur[bad] = np.nan
        end = start + dur
        for i, ph in enumerate(tmpl.phases):
            if ph.name == "dataloader":
                ph_start[:, i], ph_dur[:, i] = ld_start, load
            elif ph.name == "dp-allreduce":
                ph_start[:, i] = dp_phase_start
                with np.errstate(invalid="ignore"):
                    ph_dur[:, i] = np.maximum(dp_phase_end - dp_phase_start, 1000.0)
            elif i in self.span_masks or i in self.sum_masks:
                m = self.span_masks.get(i, self.sum_masks.get(i))
                s, e = start[:, m], end[:, m]
                n_ok = np.isfinite(s).sum(axis=1)
                full = (n_ok == self.expected[i]) & (self.expected[i] > 0)
                with np.errstate(invalid="ignore"), _quiet():
                    first = np.nanmin(np.where(np.isfinite(s), s, np.inf), axis=1)
                    if i in self.span_masks:
                        d = np.nanmax(np.where(np.isfinite(e), e, -np.inf), axis=1) - first
                    else:
                        d = np.nansum(dur[:, m], axis=1)
                ph_start[:, i] = np.where(full, first, np.nan)
                ph_dur[:, i] = np.where(full, d, np.nan)
        ok = np.isfinite(ph_start) & np.isfinite(ph_dur) & np.isfinite(t_end)[:, None]
        ph_start[~ok] = np.nan
        ph_dur[~ok] = np.nan
        # Stacks: where the host thread spent the iteration.
        total = (t_end - t_prev) / 1e9
        cat = np.zeros((W, len(STACK_CATEGORIES)))
        cat[:, 0] = (host + st.launches * st.c) / 1e9
        cat[:, 2] = load / 1e9
        for j, name in enumerate(STACK_CATEGORIES[3:], start=3):
            if name in mods.stall_s:
                cat[:, j] = mods.stall_s[name]
        cat[:, 1] = np.maximum(total - cat[:, [0, 2, 3, 4]].sum(axis=1), 0.0)
        cat[~np.isfinite(cat)] = 0.0
        return IterationOut(it, start, dur, t_prev.copy(), t_end, ph_start, ph_dur, cat,
                            hung=not bool(np.isfinite(t_end).all()), busy=st.busy, xfer=st.xfer,
                            nic_dead=None if mods.nic_dead is None else mods.nic_dead.copy(),
                            timeout_ns=self.hang_timeout_ns)

    # ------------------------------------------------------------ pipeline
    def _pipeline(self, st: _State) -> None:
        topo, progs = self.topo, self.tmpl.programs
        P = topo.pp
        ptr = [0] * P
        sends: dict = {}
        remaining = sum(len(p) for p in progs)
        while remaining:
            progressed = False
            for s in range(P):
                while ptr[s] < len(progs[s]):
                    op, m, steps = progs[s][ptr[s]]
                    if steps and steps[0][0] == "recv" and (steps[0][2], m, s) not in sends:
                        break
                    self._op(s, op, m, steps, st, sends)
                    ptr[s] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:  # pragma: no cover - 1F1B is deadlock-free
                raise RuntimeError("pipeline schedule deadlocked")

    def _op(self, s: int, op: str, m: int, steps, st: _State, sends: dict) -> None:
        sl = self.topo.stage_slice(s)
        if not steps or steps[0][0] != "recv":
            st.u[sl] = np.maximum(st.u[sl], st.g[sl])
        for step in steps:
            kind = step[0]
            if kind == "recv":
                self._recv(s, sl, step[1], sends.pop((step[2], m, s)), st)
                st.u[sl] = np.maximum(st.u[sl], st.g[sl])
            elif kind == "send":
                dest = s + 1 if step[2] == "F" else s - 1
                sends[(step[2], m, dest)] = self._send(s, sl, step[1], st)
            elif kind == "ready":
                if op == "B" and m == self.tmpl.micro_batches - 1:
                    st.ready.setdefault(s, {})[step[1]] = st.g[sl].copy()
            else:
                self._step(sl, step, st, stage=True)
        if op == "B" and m == self.tmpl.micro_batches - 1:
            st.bwd_end[sl] = st.g[sl]
            self._buckets(s, sl, st)

    def _step(self, sl, step, st: _State, *, stage: bool) -> None:
        if step[0] == "comp":
            self._compute(sl, step[1], st)
        else:
            self._collective(sl, step[1], step[2], st, stage=stage)

    # ------------------------------------------------------------ primitives
    def _compute(self, sl, slots: np.ndarray, st: _State) -> None:
        """Step 3 on the ranks ``sl`` for the compute slots ``slots``."""
        Dk = st.D[sl][:, slots]
        lc = np.broadcast_to(st.c[sl][:, None], Dk.shape)
        if st.mods.cpu_delay is not None:
            lc = lc + st.mods.cpu_delay[sl][:, slots]
        launch = st.u[sl][:, None] + np.cumsum(lc, axis=1)
        step = Dk + GAP_US * self.scale
        S = np.zeros_like(Dk)
        np.cumsum(step[:, :-1], axis=1, out=S[:, 1:])
        x = launch.copy()
        x[:, 0] = np.maximum(x[:, 0], st.g[sl])
        with np.errstate(invalid="ignore"):
            s = S + np.maximum.accumulate(x - S, axis=1)
        st.start[sl, slots] = s
        st.dur[sl, slots] = Dk
        st.g[sl] = s[:, -1] + Dk[:, -1]
        st.u[sl] = launch[:, -1]
        st.launches[sl] += len(slots)

    def _arrive(self, sl, slot: int, st: _State, ready: np.ndarray) -> np.ndarray:
        st.u[sl] = st.u[sl] + st.c[sl]
        st.launches[sl] += 1
        a = np.maximum(ready, st.u[sl])
        if st.mods.coll_delay is not None:
            a = a + st.mods.coll_delay[sl, slot]
        return np.where(a >= st.mods.hang_at[sl], np.inf, a)

    def _link(self, sl, inter: np.ndarray, st: _State) -> np.ndarray:
        """Transfer-time multiplier of each rank's link: NVLink, or its NIC for inter-host groups."""
        m = st.mods
        return np.where(inter, m.link_inter[sl] * INTER_HOST_PENALTY, m.link_intra[sl])

    def _record(self, sl, slot: int, a: np.ndarray, end: np.ndarray, st: _State) -> None:
        with np.errstate(invalid="ignore"):
            d = end - a
        aborted = np.isfinite(a) & ~np.isfinite(end)
        st.start[sl, slot] = a
        st.dur[sl, slot] = np.where(aborted, self.hang_timeout_ns, d)

    def _gmean(self, x: np.ndarray, dim: str, stage: bool) -> np.ndarray:
        shape = self.topo.stage_shape if stage else self.topo.shape
        v = x.reshape(shape).mean(axis=self.topo.axes(dim, stage=stage), keepdims=True)
        return np.broadcast_to(v, shape).reshape(-1)

    def _gmax(self, x: np.ndarray, dim: str, stage: bool) -> np.ndarray:
        shape = self.topo.stage_shape if stage else self.topo.shape
        v = x.reshape(shape).max(axis=self.topo.axes(dim, stage=stage), keepdims=True)
        return np.broadcast_to(v, shape).reshape(-1)

    def _collective(self, sl, slot: int, dim: str, st: _State, *, stage: bool,
                    ready: np.ndarray | None = None, blocking: bool = True) -> np.ndarray:
        """Step 4; returns the end time per rank."""
        a = self._arrive(sl, slot, st, st.g[sl] if ready is None else ready)
        link = self._link(sl, self.inter[dim][sl], st)
        # One transfer per group: the members' noise averaged (log space), at the slowest link.
        logd = np.log(st.D[sl, slot])
        mean_log = self._gmean(logd, dim, stage)
        transfer = np.exp(mean_log) * self._gmax(link, dim, stage)
        end = self._gmax(a, dim, stage) + transfer
        if st.mods.nic_dead is not None:   # step 7: a failed NIC of a member: the transfer never ends
            dead = np.where(self.inter[dim][sl], st.mods.nic_dead[sl], np.inf)
            end = np.where(-self._gmax(-dead, dim, stage) < end, np.inf, end)
        self._record(sl, slot, a, end, st)
        # The ring's flows (module docstring, step 4): link r -> next(r) at the slower of its two ends.
        nxt = self.ring_next[dim][sl] - (sl.start or 0)
        lm = np.maximum(link, link[nxt]) * np.exp(0.5 * (logd - mean_log))
        ended = np.isfinite(end)
        with np.errstate(invalid="ignore"):
            st.busy[sl, slot] = np.where(ended, transfer * lm / self._gmax(lm, dim, stage), np.nan)
        st.xfer[sl, slot] = np.where(ended, transfer, np.nan)
        if blocking:
            st.g[sl] = end
        return end

    def _send(self, s: int, sl, slot: int, st: _State):
        a = self._arrive(sl, slot, st, st.g[sl])
        return a, st.D[sl, slot], slot, sl

    def _recv(self, s: int, sl, slot: int, send, st: _State) -> None:
        a_s, T_s, send_slot, send_sl = send
        a_r = self._arrive(sl, slot, st, st.g[sl])
        # The link between the pair: inter-host if the two stages' ranks sit on different hosts.
        hi = max(s, send_sl.start // self.topo.stage_ranks)
        inter = self.pp_inter[self.topo.stage_slice(hi)]
        m = st.mods
        link = np.where(inter, np.maximum(m.link_inter[sl], m.link_inter[send_sl]) * INTER_HOST_PENALTY,
                        np.maximum(m.link_intra[sl], m.link_intra[send_sl]))
        data = np.maximum(a_s, a_r) + np.maximum(T_s, st.D[sl, slot]) * link
        self._record(sl, slot, a_r, data, st)
        self._record(send_sl, send_slot, a_s, data, st)
        st.g[sl] = data

    def _buckets(self, s: int, sl, st: _State) -> None:
        """Step 6: the stage's gradient ReduceScatter buckets on the dp stream."""
        tmpl = self.tmpl
        if not tmpl.buckets:
            return
        lost = st.mods.overlap_lost[sl]
        dp_free = st.dp_end[sl].copy()
        ready = st.ready.get(s, {})
        bwd_end = st.g[sl]
        for slot, layer in zip(tmpl.buckets, tmpl.bucket_layer):
            r = np.where(lost, np.maximum(bwd_end, st.u[sl]), ready.get(layer, bwd_end))
            r = np.maximum(r, dp_free)
            # Launched from a backward hook, not by the (already synchronised) main loop.
            u_saved = st.u[sl].copy()
            st.u[sl] = np.minimum(st.u[sl], r)
            dp_free = self._collective(sl, slot, "dp", st, stage=True, ready=r, blocking=False)
            st.u[sl] = u_saved
        st.dp_end[sl] = dp_free


def ring_successor(topo: Topology, dim: str) -> np.ndarray:
    """Canonical index of each rank's next member in its ``dim`` group's ring (group-rank order,
    the last member's next is the first). A group is the canonical axes of ``dim``, so the ring
    is a roll by one along those axes (flattened)."""
    shape = topo.shape
    ax = topo.axes(dim, stage=False)
    idx = np.arange(topo.world).reshape(shape)
    moved = np.moveaxis(idx, ax, tuple(range(len(shape) - len(ax), len(shape))))
    lead = moved.shape[:len(shape) - len(ax)]
    flat = moved.reshape(lead + (-1,))
    nxt = np.roll(flat, -1, axis=-1).reshape(moved.shape)
    out = np.empty(topo.world, dtype=np.int64)
    out[moved.ravel()] = nxt.ravel()
    return out


class _quiet:
    """Silence numpy's all-NaN warnings inside phase reductions."""

    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)
