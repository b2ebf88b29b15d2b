"""In-memory types shared by every stage, and their protobuf conversion.

Protobuf is the wire format; inside a stage records are frozen dataclasses or
numpy columns (STYLE.md, point 2). Conversion to and from ``trainscope.v1``
messages lives here and nowhere else.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from trainscope.proto.v1 import common_pb2

#: Megatron-LM rank order, fastest-varying dimension first (ARCHITECTURE.md).
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
DIMS = ("tp", "cp", "ep", "dp", "pp")


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelCoords:
    """A rank's coordinates in each parallel dimension, with the dimension sizes."""

    dp: int = 0
    tp: int = 0
    pp: int = 0
    ep: int = 0
    cp: int = 0
    dp_size: int = 0
    tp_size: int = 0
    pp_size: int = 0
    ep_size: int = 0
    cp_size: int = 0
    order: str = DEFAULT_ORDER

    def to_pb(self) -> common_pb2.ParallelCoords:
        return common_pb2.ParallelCoords(**dataclasses.asdict(self))

    @classmethod
    def from_pb(cls, m: common_pb2.ParallelCoords) -> "ParallelCoords":
        return cls(
            dp=m.dp, tp=m.tp, pp=m.pp, ep=m.ep, cp=m.cp,
            dp_size=m.dp_size, tp_size=m.tp_size, pp_size=m.pp_size,
            ep_size=m.ep_size, cp_size=m.cp_size, order=m.order or DEFAULT_ORDER,
        )


#: ``Resource.attributes`` keys naming what a rank shares with others beyond its host: the NIC
#: its collectives leave by and the network switch its host hangs off (set by the site through
#: ``TRAINSCOPE_NIC``/``TRAINSCOPE_SWITCH``, by replay's ``topology.json``, by the simulator).
#: The verdict names one when its suspects share it (issue #10 item 6).
NIC_ATTRIBUTE, SWITCH_ATTRIBUTE = "nic", "switch"


@dataclasses.dataclass(frozen=True, slots=True)
class Resource:
    """Who a batch comes from: job, host, process, rank, device, coordinates."""

    job_id: str
    rank: int
    world_size: int
    host: str = ""
    pid: int = 0
    local_rank: int = 0
    device: str = ""
    coords: ParallelCoords = dataclasses.field(default_factory=ParallelCoords)
    attributes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_pb(self) -> common_pb2.Resource:
        return common_pb2.Resource(
            job_id=self.job_id, host=self.host, pid=self.pid, rank=self.rank,
            local_rank=self.local_rank, world_size=self.world_size,
            device=self.device, coords=self.coords.to_pb(),
            attributes=dict(self.attributes),
        )

    @classmethod
    def from_pb(cls, m: common_pb2.Resource) -> "Resource":
        return cls(
            job_id=m.job_id, rank=m.rank, world_size=m.world_size, host=m.host,
            pid=m.pid, local_rank=m.local_rank, device=m.device,
            coords=ParallelCoords.from_pb(m.coords), attributes=dict(m.attributes),
        )


def group_number(coords, dim: str) -> int:
    """The mixed-radix number of every coordinate but ``dim``, in the job's order: ranks with the
    same number share every other coordinate, i.e. sit in one ``dim`` group. Used by the analyzer
    (``topology.group_index``) and by the processor's Kafka keys (``kafka_sink.group_key``); works
    on ``ParallelCoords`` and on the wire message alike."""
    order = (coords.order or DEFAULT_ORDER).split("-")
    if sorted(order) != sorted(DIMS):
        order = DEFAULT_ORDER.split("-")
    index, scale = 0, 1
    for d in order:
        if d != dim:
            c = getattr(coords, d)
            index += c * scale
            scale *= max(getattr(coords, f"{d}_size"), c + 1, 1)
    return index


def coords_for_rank(
    rank: int,
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    order: str = DEFAULT_ORDER,
) -> ParallelCoords:
    """Derive a rank's parallel coordinates from the degrees and the rank order.

    ``order`` lists the dimensions from fastest- to slowest-varying, as
    Megatron-LM's ``RankGenerator`` does (``tp-cp-ep-dp-pp``: consecutive ranks
    differ in tp first). dp is whatever is left: world / (tp·pp·cp·ep).
    Raises ``ConfigError`` when the degrees do not divide the world size.
    """
    from trainscope.proto.errors import ConfigError

    dims = order.split("-")
    if sorted(dims) != sorted(DIMS):
        raise ConfigError("topology.order", order, f"must be a permutation of {'-'.join(DIMS)}")
    model = tp * pp * cp * ep
    if min(tp, pp, ep, cp) < 1 or world_size % model:
        raise ConfigError(
            "topology", dict(world_size=world_size, tp=tp, pp=pp, ep=ep, cp=cp),
            "tp*pp*ep*cp must divide world_size",
        )
    if not 0 <= rank < world_size:
        raise ConfigError("rank", rank, f"must be in [0, {world_size})")
    sizes = dict(tp=tp, pp=pp, ep=ep, cp=cp, dp=world_size // model)
    coord: dict[str, int] = {}
    rem = rank
    for d in dims:
        coord[d] = rem % sizes[d]
        rem //= sizes[d]
    return ParallelCoords(
        **coord, **{f"{d}_size": s for d, s in sizes.items()}, order=order
    )
