"""L5, host side: the Python function a rank was busy in that its peers were not.

ARGUS keeps L5 (CPU call stacks, §4.1, §6.3) for manual deep dives once L1–L3
have narrowed the scope. Here it runs automatically, but only as
corroboration: the service calls it for a window only when another level
already found something, so a rank that routinely does extra host work
(logging, checkpointing on rank 0) never raises an alarm on its own.

Steps, per window and comparison group (ranks of one parallel role):
1. For each rank, count its *active* (non-idle) py-spy samples by leaf
   function (the last frame of each folded stack).
2. For each (rank, function): the rank's share of its active samples in that
   function, and the share among all its peers' active samples.
3. A rank is a suspect when one function takes at least ``min_share`` of its
   active samples while its peers spend at most ``max_peer_share`` there
   (e.g. ``<gc>:collect``, a data-loader ``queues.py:get``, a JIT compile).
Assumption: ranks of one role run the same code, so their active stacks
match unless something host-side differs (ARGUS Table 6: GC, data loading,
CPU contention, JIT compilation).
"""
from __future__ import annotations

import collections
import dataclasses

from trainscope.analyzer.model import Finding, JobWindow, Scope, SuspectRank
from trainscope.analyzer.topology import group_of, resources_with
from trainscope.proto.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class L5Config:
    min_share: float = 0.2
    """Share of a rank's active samples one function must take."""
    max_peer_share: float = 0.05
    """Largest share the peers may spend in that function."""
    min_samples: int = 20
    """Active samples a rank needs before its stacks are judged."""
    min_group: int = 3
    """Smallest comparison group (two ranks cannot tell who differs)."""
    dim: str = "dp"
    """Dimension whose groups are compared (ranks with the same role)."""

    def __post_init__(self) -> None:
        if not 0 < self.min_share <= 1:
            raise ConfigError("l5.min_share", self.min_share, "must be in (0, 1]")
        if not 0 <= self.max_peer_share < self.min_share:
            raise ConfigError("l5.max_peer_share", self.max_peer_share, "must be in [0, min_share)")
        if self.min_samples < 1:
            raise ConfigError("l5.min_samples", self.min_samples, "must be >= 1")
        if self.min_group < 3:
            raise ConfigError("l5.min_group", self.min_group, "must be >= 3")


def _leaf(stack: str) -> str:
    return stack.rsplit(";", 1)[-1]


def analyze_stacks(jw: JobWindow, cfg: L5Config = L5Config()) -> list[Finding]:
    active: dict[int, collections.Counter[str]] = {}
    example: dict[tuple[int, str], str] = {}
    for rank, sw in jw.stacks.items():
        c: collections.Counter[str] = collections.Counter()
        for fs in sw.stacks:
            if not fs.idle:
                c[_leaf(fs.stack)] += fs.count
                example.setdefault((rank, _leaf(fs.stack)), fs.stack)
        active[rank] = c
    out: list[Finding] = []
    for gidx, ranks in sorted(group_of(resources_with(jw.resources, jw.stacks), cfg.dim).items()):
        ranks = [r for r in ranks if r in active]
        if len(ranks) < cfg.min_group:
            continue
        group: collections.Counter[str] = collections.Counter()
        for r in ranks:
            group.update(active[r])
        total = sum(group.values())
        suspects = []
        for r in ranks:
            mine = sum(active[r].values())
            peers = total - mine
            if mine < cfg.min_samples or peers <= 0:
                continue
            for fn, n in active[r].most_common(3):
                share, peer_share = n / mine, (group[fn] - n) / peers
                if share >= cfg.min_share and peer_share <= cfg.max_peer_share:
                    ratio = min(share / max(peer_share, 1.0 / peers), 1e3)
                    suspects.append(SuspectRank(r, share, {
                        "function": fn, "stack": example[(r, fn)], "share": round(share, 4),
                        "peer_share": round(peer_share, 4), "ratio": ratio, "active_samples": mine}))
                    break
        if suspects:
            suspects.sort(key=lambda s: -s.score)
            out.append(Finding(level="L5", kind="host_stall", job_id=jw.job_id, window=jw.window,
                               scope=Scope(group=cfg.dim, group_index=gidx), suspects=tuple(suspects),
                               severity=suspects[0].score,
                               evidence={"function": suspects[0].evidence["function"], "group_size": len(ranks)}))
    return out
