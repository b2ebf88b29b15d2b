"""Parallel layout of a simulated job: ranks, parallel groups, hosts, NICs, clocks.

1. Every rank gets its Megatron coordinates from the rank order (``tp-cp-ep-dp-pp``
   by default, fastest-varying first), exactly as ``proto.model.coords_for_rank``
   derives them for one rank; dp is what is left: world / (tp·pp·ep·cp).
2. The engine works on a *canonical* layout in which every per-rank array is
   indexed ``(pp, dp, ep, cp, tp)``. A parallel group is then one axis, a
   group-wise max is ``max(axis)``, and the ranks of one pipeline stage are one
   contiguous slice, whatever the rank order. ``rank_of[c]`` and
   ``canon_of[rank]`` map between the two numberings.
3. Hosts hold ``gpus_per_host`` consecutive ranks (as launchers place them);
   each host has ``nics_per_host`` NICs and GPU ``i`` of a host uses NIC
   ``i // (gpus_per_host / nics_per_host)``, the PCIe-switch affinity NCCL uses.
4. A group's collective is intra-host (NVLink) when all its members share a
   host, else inter-host (RDMA through every member's NIC). A ring runs at the
   speed of its slowest link, which is why one degraded NIC slows the whole
   ring through it (ARGUS §9.2, Mycroft §7.1 #2).
5. Clocks: each host has its own offset and drift; local time of global time
   ``t`` is ``epoch + offset + t·(1 + drift)``. Nothing downstream may compare
   absolute timestamps across hosts (ARCHITECTURE.md "Replay contract").
"""
from __future__ import annotations

import dataclasses

import numpy as np

from trainscope.proto.errors import ConfigError
from trainscope.proto.model import DIMS, NIC_ATTRIBUTE, ParallelCoords, Resource

#: Axis order of the canonical layout (slowest first).
CANON = ("pp", "dp", "ep", "cp", "tp")
#: The model-parallel group (everything but dp): grad-norm all-reduce.
MP = "mp"
GROUP_DIMS = ("tp", "cp", "ep", "dp", "pp", MP)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Topology:
    """Degrees, rank mapping, hosts and NICs of one simulated job (use :meth:`build`)."""

    world: int
    tp: int
    pp: int
    ep: int
    cp: int
    dp: int
    order: str
    gpus_per_host: int
    nics_per_host: int
    #: Per rank: coordinate in each dimension of ``DIMS``.
    coords: dict
    #: canonical index -> rank, and rank -> canonical index.
    rank_of: np.ndarray
    canon_of: np.ndarray
    #: Per rank: host index, local rank (GPU on the host), global NIC index.
    host: np.ndarray
    local_rank: np.ndarray
    nic: np.ndarray

    @classmethod
    def build(cls, world: int, *, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
              order: str = "tp-cp-ep-dp-pp", gpus_per_host: int = 8,
              nics_per_host: int = 4) -> "Topology":
        dims = order.split("-")
        if sorted(dims) != sorted(DIMS):
            raise ConfigError("sim.order", order, f"must be a permutation of {'-'.join(DIMS)}")
        for name, v in (("ranks", world), ("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
            if type(v) is not int or v < 1:
                raise ConfigError(f"sim.{name}", v, "must be an integer >= 1")
        model = tp * pp * ep * cp
        if world % model:
            raise ConfigError("sim.ranks", world,
                              f"must be a multiple of tp*pp*ep*cp = {tp}*{pp}*{ep}*{cp} = {model}")
        if type(gpus_per_host) is not int or gpus_per_host < 1 or world % gpus_per_host:
            raise ConfigError("sim.gpus_per_host", gpus_per_host,
                              f"must be an integer >= 1 that divides ranks ({world})")
        if (type(nics_per_host) is not int or nics_per_host < 1
                or gpus_per_host % nics_per_host):
            raise ConfigError("sim.nics_per_host", nics_per_host,
                              f"must be an integer >= 1 that divides gpus_per_host ({gpus_per_host})")
        sizes = dict(tp=tp, pp=pp, ep=ep, cp=cp, dp=world // model)
        rem = np.arange(world, dtype=np.int64)
        coords = {}
        for d in dims:
            coords[d] = rem % sizes[d]
            rem = rem // sizes[d]
        canon = np.zeros(world, dtype=np.int64)
        for d in CANON:
            canon = canon * sizes[d] + coords[d]
        rank_of = np.empty(world, dtype=np.int64)
        rank_of[canon] = np.arange(world)
        ranks = np.arange(world)
        local = ranks % gpus_per_host
        host = ranks // gpus_per_host
        nic = host * nics_per_host + local // (gpus_per_host // nics_per_host)
        return cls(world=world, tp=tp, pp=pp, ep=ep, cp=cp, dp=sizes["dp"], order=order,
                   gpus_per_host=gpus_per_host, nics_per_host=nics_per_host, coords=coords,
                   rank_of=rank_of, canon_of=canon, host=host, local_rank=local, nic=nic)

    # ----------------------------------------------------------- shapes
    @property
    def shape(self) -> tuple[int, ...]:
        """Canonical shape ``(pp, dp, ep, cp, tp)``."""
        return tuple(self.size(d) for d in CANON)

    @property
    def stage_shape(self) -> tuple[int, ...]:
        """Shape of one pipeline stage ``(dp, ep, cp, tp)``."""
        return self.shape[1:]

    @property
    def stage_ranks(self) -> int:
        return self.world // self.pp

    @property
    def hosts(self) -> int:
        return self.world // self.gpus_per_host

    def size(self, dim: str) -> int:
        if dim == MP:
            return self.world // self.dp
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp, "dp": self.dp}[dim]

    def axes(self, dim: str, *, stage: bool) -> tuple[int, ...]:
        """Axes of the canonical (or per-stage) shape that a group of ``dim`` spans."""
        if dim == MP:
            full = (0, 2, 3, 4)
        else:
            full = (CANON.index(dim),)
        if not stage:
            return full
        if 0 in full and dim != MP:
            raise ValueError("pp groups span stages")
        return tuple(a - 1 for a in full if a > 0)

    def stage_slice(self, s: int) -> slice:
        n = self.stage_ranks
        return slice(s * n, (s + 1) * n)

    # ----------------------------------------------------------- groups
    def group_members(self, dim: str, rank: int) -> list[int]:
        """Ranks of the ``dim`` group that holds ``rank`` (sorted)."""
        idx = np.unravel_index(int(self.canon_of[rank]), self.shape)
        sel: list = list(idx)
        for a in self.axes(dim, stage=False):
            sel[a] = slice(None)
        return sorted(self.rank_of.reshape(self.shape)[tuple(sel)].ravel().tolist())

    def inter_host(self, dim: str) -> np.ndarray:
        """Canonical bool array: does the ``dim`` group of each rank span several hosts?"""
        h = self.host[self.rank_of].reshape(self.shape)
        ax = self.axes(dim, stage=False)
        spans = h.max(axis=ax, keepdims=True) != h.min(axis=ax, keepdims=True)
        return np.broadcast_to(spans, self.shape).ravel().copy()

    def pp_pair_inter_host(self) -> np.ndarray:
        """Canonical bool array: is the link from each rank to the same slot of the
        previous stage inter-host (stage 0: False)?"""
        h = self.host[self.rank_of].reshape(self.pp, -1)
        out = np.zeros_like(h, dtype=bool)
        out[1:] = h[1:] != h[:-1]
        return out.ravel()

    def rank_coords(self, rank: int) -> ParallelCoords:
        c = {d: int(self.coords[d][rank]) for d in DIMS}
        return ParallelCoords(**c, dp_size=self.dp, tp_size=self.tp, pp_size=self.pp,
                              ep_size=self.ep, cp_size=self.cp, order=self.order)

    def host_name(self, h: int) -> str:
        return f"sim-host-{h:04d}"

    def resource(self, rank: int, job_id: str) -> Resource:
        lr = int(self.local_rank[rank])
        return Resource(job_id=job_id, rank=rank, world_size=self.world,
                        host=self.host_name(int(self.host[rank])), pid=10_000 + rank,
                        local_rank=lr, device=f"cuda:{lr}", coords=self.rank_coords(rank),
                        attributes={"source": "trainscope-sim",
                                    NIC_ATTRIBUTE: f"{self.host_name(int(self.host[rank]))}/nic"
                                                   f"{int(self.nic[rank]) % self.nics_per_host}"})

    def describe(self) -> dict:
        return {"world_size": self.world, "tp": self.tp, "pp": self.pp, "ep": self.ep,
                "cp": self.cp, "dp": self.dp, "order": self.order,
                "gpus_per_host": self.gpus_per_host, "nics_per_host": self.nics_per_host,
                "hosts": self.hosts}


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class HostClocks:
    """Per-host clock offset (ns) and drift (fraction), step 5 of the module docstring."""

    epoch_ns: int
    offset_ns: np.ndarray
    drift: np.ndarray

    @classmethod
    def draw(cls, hosts: int, rng: np.random.Generator, *, max_offset_s: float,
             max_drift_ppm: float, epoch_ns: int = 1_700_000_000 * 10**9) -> "HostClocks":
        off = rng.uniform(-max_offset_s, max_offset_s, hosts) * 1e9
        drift = rng.uniform(-max_drift_ppm, max_drift_ppm, hosts) * 1e-6
        # Keep every local time positive even for a negative offset.
        return cls(epoch_ns=epoch_ns, offset_ns=np.rint(off).astype(np.int64), drift=drift)

    def local(self, t_ns: np.ndarray, hosts: np.ndarray) -> np.ndarray:
        """Global simulated ns (float, finite) -> int64 ns on each host's clock."""
        rel = self.offset_ns[hosts] + np.rint(t_ns * (1.0 + self.drift[hosts])).astype(np.int64)
        return np.int64(self.epoch_ns) + rel
