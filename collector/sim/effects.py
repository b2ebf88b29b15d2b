"""How each fault type changes one iteration, and what it should look like.

Every iteration the engine starts from neutral :class:`Mods` (multipliers of
1, no delays) and each active fault edits them for its culprit ranks. The
engine then applies them in its dependency model, so secondary effects come
out of the model rather than being painted on: peers of a slow rank wait in
their collectives, PP neighbours inherit bubbles, the final gradient sync
aligns iteration times (ARGUS §9.3, §9.5; Mycroft §7.1).

All arrays are in the engine's canonical rank layout (``topology.py`` step 2).
``expectations`` gives, per fault, the phases and kernels in which a detector
should see it, for the ground-truth file.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from trainscope.collector.sim import workload as wl
from trainscope.collector.sim.faults import FaultSpec
from trainscope.collector.sim.topology import Topology
from trainscope.proto.columnar import KIND_KERNEL


@dataclasses.dataclass(slots=True, eq=False)
class Mods:
    """Per-iteration modifiers, canonical order; neutral when built with :meth:`neutral`."""

    kmult: np.ndarray        # (W, K) multiplier of compute / memcpy durations
    link_intra: np.ndarray   # (W,) multiplier of intra-host (NVLink) transfer time
    link_inter: np.ndarray   # (W,) multiplier of inter-host (RDMA) transfer time
    launch_mult: np.ndarray  # (W,) CPU cost of launching a kernel and of host work
    load_extra: np.ndarray   # (W,) extra data-loader time, ns
    pre_stall: np.ndarray    # (W,) CPU stall at the iteration start (GC), ns
    overlap_lost: np.ndarray  # (W,) bool: grad buckets not overlapped with backward
    hang_at: np.ndarray      # (W,) global ns after which the rank enters no collective
    cpu_delay: np.ndarray | None = None   # (W, K) CPU stall before launching a slot, ns
    coll_delay: np.ndarray | None = None  # (W, K) late entry into a collective, ns
    nic_dead: np.ndarray | None = None    # (W,) global ns from which the rank's NIC delivers nothing (nic_fail)
    stall_s: dict = dataclasses.field(default_factory=dict)  # stack category -> (W,) seconds

    @classmethod
    def neutral(cls, W: int, K: int, hang_at: np.ndarray) -> "Mods":
        one = np.ones(W)
        return cls(kmult=np.ones((W, K)), link_intra=one.copy(), link_inter=one.copy(),
                   launch_mult=one.copy(), load_extra=np.zeros(W), pre_stall=np.zeros(W),
                   overlap_lost=np.zeros(W, dtype=bool), hang_at=hang_at.copy())

    def delays(self, name: str) -> np.ndarray:
        arr = getattr(self, name)
        if arr is None:
            arr = np.zeros_like(self.kmult)
            setattr(self, name, arr)
        return arr

    def stall(self, category: str) -> np.ndarray:
        return self.stall_s.setdefault(category, np.zeros(self.kmult.shape[0]))


@dataclasses.dataclass(slots=True, eq=False)
class Ctx:
    """What an effect may read: the job, the iteration, the fault's own random stream."""

    topo: Topology
    tmpl: wl.Template
    it: int
    t0_ns: float
    rng: np.random.Generator
    compute: np.ndarray  # (K,) compute kernels
    memcpy: np.ndarray   # (K,) memcpy kinds
    expert: np.ndarray   # (K,) MoE expert slots
    comm: np.ndarray     # (K,) collectives and p2p


def masks(tmpl: wl.Template) -> dict[str, np.ndarray]:
    return {
        "compute": (tmpl.cat == wl.CAT_COMPUTE) & (tmpl.kind == KIND_KERNEL),
        "memcpy": tmpl.cat == wl.CAT_MEMCPY,
        "expert": tmpl.tag == wl.TAG_EXPERT,
        "comm": np.isin(tmpl.cat, [wl.CAT_COLL, wl.CAT_P2P]),
    }


def apply(spec: FaultSpec, c: np.ndarray, mods: Mods, ctx: Ctx) -> np.ndarray:
    """Apply one active fault to its culprits ``c`` (canonical indices).

    Returns the canonical indices on which it actually fired this iteration
    (all of ``c`` for persistent faults; the drawn ones for probabilistic ones).
    """
    t, p, rng = spec.type, spec.params, ctx.rng
    n = len(c)
    if t == "gpu_throttle":
        mods.kmult[np.ix_(c, np.flatnonzero(ctx.compute))] *= p["factor"]
    elif t == "background_load":
        cols = np.flatnonzero(ctx.compute)
        # Time-slicing with another process: mean slowdown ``factor``, exponential spread.
        jitter = rng.exponential(1.0, (n, len(cols)))
        mods.kmult[np.ix_(c, cols)] *= 1.0 + (p["factor"] - 1.0) * jitter
    elif t == "pcie_degrade":
        mods.kmult[np.ix_(c, np.flatnonzero(ctx.memcpy))] *= p["factor"]
    elif t == "ecc":
        cols = np.flatnonzero(ctx.compute)
        hit = rng.random((n, len(cols))) < p["prob"]
        mods.kmult[np.ix_(c, cols)] *= np.where(hit, p["factor"], 1.0)
        return c[hit.any(axis=1)]
    elif t == "nvlink_degrade":
        mods.link_intra[c] *= p["factor"]
    elif t in ("nic_degrade", "net_congestion"):
        mods.link_inter[c] *= p["factor"]
    elif t == "cpu_contention":
        mods.launch_mult[c] *= p["factor"]
    elif t == "gc_pause":
        fire = c[rng.random(n) < p["prob"]]
        d = p["delay"] * 1e9 * rng.uniform(0.8, 1.2, len(fire))
        mods.pre_stall[fire] += d
        mods.stall("gc")[fire] += d / 1e9
        return fire
    elif t == "dataloader_stall":
        fire = c[rng.random(n) < p["prob"]]
        mods.load_extra[fire] += p["delay"] * 1e9
        return fire
    elif t == "jit_stall":
        fire = c[rng.random(n) < p["prob"]]
        if len(fire):
            slot = jit_slot(ctx.tmpl, int(p["mb"]))
            mods.delays("cpu_delay")[fire, slot] += p["delay"] * 1e9
            mods.stall("jit")[fire] += p["delay"]
        return fire
    elif t == "nccl_delay":
        cols = np.flatnonzero(ctx.comm)
        hit = rng.random((n, len(cols))) < p["prob"]
        mods.delays("coll_delay")[np.ix_(c, cols)] += np.where(hit, p["delay"] * 1e9, 0.0)
        return c[hit.any(axis=1)]
    elif t == "moe_imbalance":
        cols = np.flatnonzero(ctx.expert)
        f = np.full(n, p["factor"]) if spec.group is None else np.ones(n)
        if p["skew"] > 0:
            f = f * np.exp(p["skew"] * rng.standard_normal(n))
            f = np.maximum(f, 0.2)
        mods.kmult[np.ix_(c, cols)] *= f[:, None]
    elif t == "overlap_loss":
        mods.overlap_lost[c] = True
    elif t == "hang":
        # The onset may fall inside this iteration: collectives entered after it never are.
        mods.hang_at[c] = np.minimum(mods.hang_at[c], ctx.t0_ns)
    elif t == "nic_fail":
        # From the iteration's start the NIC delivers nothing: the collectives through it never end.
        if mods.nic_dead is None:
            mods.nic_dead = np.full(mods.kmult.shape[0], np.inf)
        mods.nic_dead[c] = np.minimum(mods.nic_dead[c], ctx.t0_ns)
    else:  # pragma: no cover - FaultSpec validated the type
        raise AssertionError(t)
    return c


def jit_slot(tmpl: wl.Template, mb: int) -> int:
    """The flash-attention backward launch of the first layer of B(mb): where the JIT stalls."""
    mb = mb % tmpl.micro_batches
    name = tmpl.names.index(wl.FLASH_BWD)
    cand = np.flatnonzero((tmpl.op == wl.OP_B) & (tmpl.mb == mb) & (tmpl.name_id == name))
    return int(cand[0])


# ------------------------------------------------------------------ ground truth


def expectations(spec: FaultSpec, tmpl: wl.Template, topo: Topology) -> dict:
    """Phases and kernels expected to show ``spec``, and how (for the ground-truth file)."""
    m = masks(tmpl)
    M = tmpl.micro_batches
    fb = ["forward", "backward"]
    mlp = "moe_experts" if tmpl.moe else "mlp"
    comm_keys = tmpl.kernel_keys(m["comm"])
    t = spec.type
    phases: list[str] = []
    culprit: list[dict] = []
    peers: list[dict] = []
    extra: dict = {}
    if t in ("gpu_throttle", "background_load"):
        phases = fb + ["self_attention", mlp, "optimizer"]
        culprit = _tagged(tmpl.kernel_keys(m["compute"]), "slower")
        peers = _tagged(comm_keys, "longer on group peers (waiting); shortest on the culprit")
    elif t == "ecc":
        phases = fb
        culprit = _tagged(tmpl.kernel_keys(m["compute"]), "tail (p99/max up, p50 unchanged)")
    elif t == "pcie_degrade":
        culprit = _tagged(tmpl.kernel_keys(m["memcpy"]), "slower")
    elif t == "nvlink_degrade":
        phases = fb
        culprit = _tagged(_link_keys(tmpl, topo, inter=False), "slower on every member of the group")
    elif t in ("nic_degrade", "net_congestion"):
        phases = ["dp-allreduce", "optimizer", "ep-alltoall", "pp-recv"] if t == "net_congestion" else ["dp-allreduce"]
        culprit = _tagged(_link_keys(tmpl, topo, inter=True), "slower on every member of the ring")
    elif t == "gc_pause":
        peers = _tagged(comm_keys, "longer on peers in spiking iterations")
    elif t == "dataloader_stall":
        phases = ["dataloader"]
        peers = _tagged(comm_keys, "longer on group peers (waiting)")
    elif t == "cpu_contention":
        # Launch-bound where kernels are short (forward, optimizer); backward's larger
        # kernels keep it mostly GPU-bound. Kernel-time sums (self_attention...) unchanged.
        phases = ["dataloader", "forward", "optimizer"]
        peers = _tagged(comm_keys, "longer on group peers (waiting)")
    elif t == "moe_imbalance":
        phases = ["moe_experts", "ep-alltoall"]
        culprit = _tagged(tmpl.kernel_keys(m["expert"] & m["compute"]), "slower on the hot ranks")
        peers = _tagged(tmpl.kernel_keys(tmpl.tag == wl.TAG_A2A), "longer on EP peers (waiting)")
    elif t == "overlap_loss":
        phases = ["dp-allreduce"]
        culprit = _tagged(tmpl.kernel_keys(tmpl.op == wl.OP_BUCKET), "start after backward (not overlapped)")
    elif t == "hang":
        peers = _tagged(comm_keys, "one collective aborted after timeout on peers; none on the culprit")
    elif t == "nic_fail":
        peers = _tagged(_link_keys(tmpl, topo, inter=True),
                        "one inter-host collective aborted after timeout on every member, the culprit too")
    elif t == "jit_stall":
        phases = ["backward"]
        extra["micro_batch"] = int(spec.params["mb"]) % M
    elif t == "nccl_delay":
        peers = _tagged(comm_keys, "occasionally much longer on peers, short on the culprit")
    return {"phases": phases, "kernels": culprit, "peer_kernels": peers, **extra}


def _tagged(keys: list[dict], effect: str) -> list[dict]:
    return [{**k, "effect": effect} for k in keys]


def _link_keys(tmpl: wl.Template, topo: Topology, *, inter: bool) -> list[dict]:
    """Collective kernels whose group is inter-host (``inter``) or intra-host somewhere."""
    dims = {d for d in tmpl.dim if d is not None}
    keep = set()
    for d in dims:
        if d == "pp":
            spans = topo.pp_pair_inter_host()[topo.stage_ranks:]
            spans = spans if spans.size else np.zeros(1, dtype=bool)
        else:
            spans = topo.inter_host(d)
        if (spans.any() if inter else (~spans).any()):
            keep.add(d)
    mask = np.array([d in keep for d in tmpl.dim])
    return tmpl.kernel_keys(mask)
