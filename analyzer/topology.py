"""Comparison groups: which ranks a detector may compare (ARGUS §6.1, Table 3).

Ranks are compared only with ranks of the same parallel role; a phase or a
kernel is routed to the parallel dimension *along which* its ranks do
identical work.

1. ``group_of(resources, dim)``: the ranks compared "within the DP group" are
   the ranks that share every coordinate except ``dp`` (same tp/pp/ep/cp
   position, so the same layers, the same shard, the same work: they differ
   only in the data they see). Likewise for ep/tp/pp/cp. ``"job"`` is every
   rank. Assumption: a rank whose coordinates are missing (every size 0) has
   an unknown role; then the whole job is one group, as if ``"job"`` were asked.
2. A group's index is the mixed-radix number of the *other* coordinates, read
   in the rank order's dimension sequence (fastest first): stable across
   windows, whichever ranks happen to report.
3. ``RoutingConfig``: an ordered table of (regular expression on the phase
   name -> dimension), first match wins, with a fallback. Defaults follow
   ARGUS Table 3 (self_attention, gated_mla_self_attention -> DP;
   moe_layer, moe_experts -> EP; dp-allreduce, dp-reduce-scatter -> DP;
   ep-alltoall -> EP) extended with common names: pipeline send/recv and
   tensor-parallel collectives are compared across data-parallel replicas
   (same stage, same tp position), i.e. within the DP group.
4. ``is_communication(phase)``: a second regular expression; L2 treats
   communication phases differently (a late arriver has the *shortest*
   collective, ARGUS §9.5).
5. ``kernel_group_dim``: L3 compares kernels within the DP group: ranks with
   the same role run identical kernel sequences (ARGUS §6.2).
6. ``category(kernel)``: compute, memory copy or communication; detectors
   sum a rank's kernels per category (keys ``[compute]``, ``[memory]``,
   ``[communication]``).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

from trainscope.proto.errors import ConfigError
from trainscope.proto.model import DEFAULT_ORDER, DIMS, ParallelCoords, Resource, group_number

#: Dimensions a phase or kernel may be compared along; "job" = every rank.
GROUP_DIMS = (*DIMS, "job")

#: Default routing, first match wins (ARGUS Table 3 plus common names).
DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    # collectives named after their group
    (r"^(dp|fsdp|edp)[-_]", "dp"),
    (r"^ep[-_]|all_?to_?all", "ep"),
    # tensor-parallel collectives and pipeline p2p: same stage and tp
    # position across data-parallel replicas
    (r"^(tp|cp|sp)[-_]", "dp"),
    (r"^pp[-_]|\bsend\b|\brecv\b|send_?recv|p2p", "dp"),
    # MoE compute: experts differ per EP rank (load imbalance shows here)
    (r"moe|expert", "ep"),
    # dense compute and host phases
    (r"attention|mla|mlp|forward|backward|optimizer|dataloader|compute|embedding|loss", "dp"),
    # other collectives
    (r"all_?reduce|reduce_?scatter|all_?gather|broadcast", "dp"),
)

#: Communication phases (collectives and point-to-point transfers).
DEFAULT_COMMUNICATION = (
    r"^(dp|fsdp|edp|ep|tp|cp|sp|pp)[-_]|all_?reduce|reduce_?scatter|all_?gather|"
    r"all_?to_?all|broadcast|barrier|\bsend\b|\brecv\b|send_?recv|p2p|nccl|collective"
)

#: Memory-copy kernels (CUPTI memcpy/memset, the profiler's "Memcpy HtoD ...").
DEFAULT_MEMORY = r"^mem(cpy|set)|memcpy|memset"

#: Kernel categories, in this order (``RoutingConfig.category``); their sums are keys named ``[<category>]``.
CATEGORIES = ("compute", "memory", "communication")

#: L3 compares a kernel within this dimension's groups (ARGUS §6.2).
KERNEL_GROUP_DIM = "dp"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RoutingConfig:
    """Phase -> comparison dimension (ARGUS Table 3), and what counts as communication."""

    rules: tuple[tuple[str, str], ...] = DEFAULT_RULES
    """Ordered (regex, dimension) pairs; ``re.search``, case-insensitive; first match wins."""
    fallback: str = "dp"
    """Dimension of a phase no rule matches."""
    communication: str = DEFAULT_COMMUNICATION
    """Regular expression (``re.search``, case-insensitive) naming communication phases."""
    kernel_group_dim: str = KERNEL_GROUP_DIM
    """Dimension L3 compares kernels within."""
    memory: str = DEFAULT_MEMORY
    """Regular expression naming memory-copy kernels (category ``memory``)."""
    _compiled: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
    _comm: object = dataclasses.field(init=False, repr=False, compare=False, default=None)
    _mem: object = dataclasses.field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        compiled = []
        for i, rule in enumerate(self.rules):
            if not (isinstance(rule, tuple) and len(rule) == 2):
                raise ConfigError(f"routing.rules[{i}]", rule, "must be a (regex, dimension) pair")
            pattern, dim = rule
            if dim not in GROUP_DIMS:
                raise ConfigError(f"routing.rules[{i}]", rule, f"dimension must be one of {GROUP_DIMS}")
            compiled.append((_compile(f"routing.rules[{i}]", pattern), dim))
        for name in ("fallback", "kernel_group_dim"):
            if getattr(self, name) not in GROUP_DIMS:
                raise ConfigError(f"routing.{name}", getattr(self, name), f"must be one of {GROUP_DIMS}")
        object.__setattr__(self, "_compiled", tuple(compiled))
        object.__setattr__(self, "_comm", _compile("routing.communication", self.communication))
        object.__setattr__(self, "_mem", _compile("routing.memory", self.memory))

    def route(self, phase: str) -> str:
        """The dimension whose groups ``phase`` is compared within."""
        for rx, dim in self._compiled:
            if rx.search(phase):
                return dim
        return self.fallback

    def is_communication(self, phase: str) -> bool:
        """Whether ``phase`` (or kernel) is a collective or a point-to-point transfer, or the
        communication category's sum ``[communication]``."""
        return phase == "[communication]" or self._comm.search(phase) is not None

    def category(self, kernel: str) -> int:
        """Index into ``CATEGORIES``: communication, else memory copy, else compute."""
        return 2 if self.is_communication(kernel) else 1 if self._mem.search(kernel) else 0


def _compile(setting: str, pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.IGNORECASE)
    except (re.error, TypeError) as e:
        raise ConfigError(setting, pattern, f"not a regular expression: {e}") from None


def check_number(setting: str, value, ok, why: str, typ: type = float) -> None:
    """Raise ``ConfigError(setting, ...)`` unless ``value`` is a finite number (an int when
    ``typ`` is int; never a bool) with ``ok(value)``. Shared by the detector configs."""
    numeric = type(value) is int if typ is int else (
        isinstance(value, (int, float)) and not isinstance(value, bool))
    if not (numeric and math.isfinite(value) and ok(value)):
        raise ConfigError(setting, value, why)


def has_coords(resource: Resource) -> bool:
    """Whether a rank declared its parallel coordinates (any size > 0)."""
    c = resource.coords
    return any((c.dp_size, c.tp_size, c.pp_size, c.ep_size, c.cp_size))


def cpu_only(resources: Mapping[int, Resource]) -> bool:
    """Every rank's device is the CPU (or unknown): its kernels are CPU operators and its phases and
    collectives are timed by the host's clock, which the scheduler stretches (no device clock)."""
    return bool(resources) and all(r.device in ("cpu", "") for r in resources.values())


def group_of(resources: Mapping[int, Resource], dim: str) -> dict[int, list[int]]:
    """Comparison groups along ``dim``: {group index: sorted ranks} (steps 1-2).

    Ranks in one group share every coordinate except ``dim``. ``"job"``, or
    any rank without coordinates, gives one group ``{0: every rank}``.
    """
    if dim not in GROUP_DIMS:
        raise ConfigError("topology.dim", dim, f"must be one of {GROUP_DIMS}")
    ranks = sorted(resources)
    if not ranks:
        return {}
    if dim == "job" or not all(has_coords(resources[r]) for r in ranks):
        return {0: ranks}
    first = resources[ranks[0]].coords
    order = (first.order or DEFAULT_ORDER).split("-")
    if sorted(order) != sorted(DIMS):
        order = DEFAULT_ORDER.split("-")
    others = [d for d in order if d != dim]
    # radix per dimension: the declared size, widened if a coordinate exceeds it
    radix = {d: 1 for d in others}
    for r in ranks:
        c = resources[r].coords
        for d in others:
            radix[d] = max(radix[d], getattr(c, f"{d}_size"), getattr(c, d) + 1)
    groups: dict[int, list[int]] = {}
    for r in ranks:
        c = resources[r].coords
        index, scale = 0, 1
        for d in others:
            index += getattr(c, d) * scale
            scale *= radix[d]
        groups.setdefault(index, []).append(r)
    return dict(sorted(groups.items()))


def group_index(coords: ParallelCoords, dim: str) -> int:
    """Index of the ``dim`` group holding a rank with ``coords`` (step 2).

    Equals ``group_of``'s numbering when every rank declares the same sizes;
    0 for ``"job"``.
    """
    if dim not in GROUP_DIMS:
        raise ConfigError("topology.dim", dim, f"must be one of {GROUP_DIMS}")
    if dim == "job":
        return 0
    return group_number(coords, dim)


def rank_to_group(groups: Mapping[int, list[int]]) -> dict[int, int]:
    """Invert ``group_of``: {rank: group index}."""
    return {r: g for g, members in groups.items() for r in members}


def resources_with(resources: Mapping[int, Resource],
                   records: Mapping[int, object]) -> dict[int, Resource]:
    """``resources`` plus, for a rank only in ``records``, the ``Resource`` its record carries."""
    out = dict(resources)
    for rank, rec in records.items():
        if rank not in out:
            pb = getattr(rec, "resource", None)
            out[rank] = (Resource.from_pb(pb) if pb is not None
                         else Resource(job_id="", rank=rank, world_size=0))
    return out
