"""A whole group slower than its siblings (ARGUS §9.2 case 2).

L2 and L3 compare a rank with the ranks of the same role; when a degraded
link or switch slows *every* member of one group alike, nothing stands out
inside it. Sibling groups of the same role do the same work, so they can be
compared with each other:

1. Groups along ``dims`` (default tensor-parallel groups — usually one host
   — and data-parallel groups — usually one ring across hosts). Siblings
   are the groups of the same pipeline stage (stages differ in work; tensor
   shards and data replicas do not).
2. Per rank and key, the time per iteration: every phase, and the sums of
   compute, memory and communication kernels (``l3_kernels`` categories).
   A group's value is its members' median.
3. Within each sibling class of at least ``min_groups`` groups: robust z of
   the group values (``significance.robust_z``) at z* = Φ⁻¹(1 − α/M), M =
   every (group, key) compared in the window, at least ``min_excess`` above
   the siblings' median, and *uniform*: at least ``uniform`` of the group's
   members are themselves above the siblings' median by ``min_excess``
   (one slow member is an intra-group finding, not a group one).
   3b. A class split in two (a slow host holding a third to a half of the
   groups, where the siblings' median is meaningless): sort the group values;
   at the widest gap leaving ``split_min``–½ of the groups above it, the
   upper side is slow when the gap is z* × the spread inside the sides
   (personality floor) and the upper median ``min_excess`` above the lower.
   Siblings do the same work, so the slower side is the slow one.
4. Suspects are the members, each with its own excess per iteration as
   impact; the evidence says which hosts they share. A slow group in a
   communication key with no late member is a slow link (``attribution``).
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from trainscope.analyzer.impact import WindowScale
from trainscope.analyzer.l2_phases import phase_matrix
from trainscope.analyzer.model import Finding, JobWindow, Scope, SuspectRank
from trainscope.analyzer.significance import MAD_SIGMA, robust_z, z_threshold
from trainscope.analyzer.topology import CATEGORIES, RoutingConfig, check_number, group_of, has_coords
from trainscope.proto.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GroupsConfig:
    dims: tuple[str, ...] = ("tp", "dp")
    """Dimensions whose groups are compared with their siblings."""
    min_groups: int = 3
    """Fewest sibling groups for a comparison."""
    min_excess: float = 0.05
    """A slow group is at least this much slower than its siblings' median."""
    uniform: float = 0.66
    """...and at least this share of its members are, each on its own."""
    false_alarm: float = 1e-3
    """Family-wise false-alarm probability per window (Bonferroni over the (group, key) comparisons)."""
    rel_floor: float = 0.02
    """Floor of the siblings' spread, × their median."""
    split_min: float = 1 / 3
    """Step 3b: the slow side of a split class holds at least this share of the groups (at most half)."""
    routing: RoutingConfig = RoutingConfig()
    """Which phases and kernels are communication, and the kernel categories."""

    def __post_init__(self) -> None:
        for d in self.dims:
            if d not in ("tp", "dp", "ep", "cp", "pp"):
                raise ConfigError("groups.dims", self.dims, "dimensions among tp, dp, ep, cp, pp")
        check_number("groups.min_groups", self.min_groups, lambda v: v >= 3, "must be an integer >= 3", int)
        check_number("groups.min_excess", self.min_excess, lambda v: v > 0, "must be > 0")
        check_number("groups.uniform", self.uniform, lambda v: 0 < v <= 1, "must be in (0, 1]")
        check_number("groups.false_alarm", self.false_alarm, lambda v: 0 < v < 1, "must be in (0, 1)")
        check_number("groups.rel_floor", self.rel_floor, lambda v: v >= 0, "must be >= 0")
        check_number("groups.split_min", self.split_min, lambda v: 0 < v <= 0.5, "must be in (0, 0.5]")


def rank_times(jw: JobWindow, scale: WindowScale, cfg: GroupsConfig) -> tuple[list[int], list[str], np.ndarray]:
    """Step 2: ranks, keys and (ranks × keys) time per iteration in ns (NaN where absent)."""
    ranks = sorted(set(jw.phases) | set(jw.kernels))
    p_ranks, p_names, _, p_tot = phase_matrix(jw, totals=True)
    keys = list(p_names) + [f"[{c}]" for c in CATEGORIES]
    m = np.full((len(ranks), len(keys)), np.nan)
    row = {r: i for i, r in enumerate(ranks)}
    iters = scale.iterations_array(ranks)
    for i, r in enumerate(p_ranks):
        m[row[r], :len(p_names)] = p_tot[i]
    category: dict[str, int] = {}       # per name, not per record: 100 names over 10,000 ranks
    for r, kw in jw.kernels.items():
        sums = [0.0, 0.0, 0.0]
        for ks in kw.kernels:
            name = ks.kernel
            c = category.get(name)
            if c is None:
                c = category[name] = cfg.routing.category(name)
            sums[c] += ks.total_ns or sum(x.count * x.p50_ns for x in ks.clusters)
        v = np.array(sums)
        m[row[r], len(p_names):] = np.where(v > 0, v, np.nan)
    return ranks, keys, m / iters[:, None]


def _split(v: np.ndarray, idx: np.ndarray, cfg: GroupsConfig, z_star: float) -> list[tuple[int, float, float]]:
    """Step 3b: the upper side of a class split in two, as (group index, z, lower side's median)."""
    n = v.size
    order = np.argsort(v)
    s = v[order]
    lo_n = n - int(np.floor(n / 2))                  # the slow side holds at most half ...
    hi_n = n - int(np.ceil(cfg.split_min * n))       # ... and at least split_min of the groups
    if n < cfg.min_groups or hi_n < lo_n:
        return []
    cut = lo_n + int(np.argmax(np.diff(s)[lo_n - 1:hi_n]))   # upper side starts at s[cut]
    lower, upper = s[:cut], s[cut:]
    lmed = float(np.median(lower))
    inside = max(MAD_SIGMA * float(np.median(np.abs(lower - lmed))),
                 MAD_SIGMA * float(np.median(np.abs(upper - np.median(upper)))))
    spread = float(np.hypot(inside, cfg.rel_floor * lmed))
    gap = float(s[cut] - s[cut - 1])
    if spread <= 0 or gap < z_star * spread or float(np.median(upper)) < (1 + cfg.min_excess) * lmed:
        return []
    z = gap / spread
    return [(int(idx[order[i]]), z, lmed) for i in range(cut, n)]


def analyze_groups(jw: JobWindow, scale: WindowScale, cfg: GroupsConfig = GroupsConfig()) -> tuple[list[Finding], int]:
    """Steps 1-4. Returns (findings, number of (group, key) comparisons made)."""
    resources = {r: jw.resources[r] for r in set(jw.phases) | set(jw.kernels) if r in jw.resources}
    if len(resources) < 2 * cfg.min_groups or not all(has_coords(x) for x in resources.values()):
        return [], 0
    ranks, keys, m = rank_times(jw, scale, cfg)
    if not keys:
        return [], 0
    row = {r: i for i, r in enumerate(ranks)}
    plans = []   # (dim, sibling class members: [(group index, rows)])
    for dim in cfg.dims:
        classes: dict[int, list[tuple[int, np.ndarray]]] = {}
        for g, members in group_of(resources, dim).items():
            if len(members) < 2:
                continue
            stage = resources[members[0]].coords.pp if dim != "pp" else 0
            classes.setdefault(stage, []).append((g, np.array([row[r] for r in members])))
        for sib in classes.values():
            if len(sib) >= cfg.min_groups:
                plans.append((dim, sib))
    comparisons = sum(len(sib) * len(keys) for _, sib in plans)
    if not comparisons:
        return [], 0
    z_star = z_threshold(cfg.false_alarm, comparisons)
    out = []
    for dim, sib in plans:
        with warnings.catch_warnings():      # a key no member has: NaN, skipped below
            warnings.simplefilter("ignore", RuntimeWarning)
            gv = np.stack([np.nanmedian(m[rows], axis=0) for _, rows in sib])      # groups × keys
        for k, key in enumerate(keys):
            v = gv[:, k]
            ok = np.isfinite(v) & (v > 0)
            if ok.sum() < cfg.min_groups:
                continue
            z, med, _ = robust_z(v[ok], None, cfg.rel_floor)
            med = float(med.ravel()[0])
            idx = np.flatnonzero(ok)
            hits = [(j, zz, med) for j, zz in zip(idx.tolist(), z.tolist())
                    if zz >= z_star and v[j] >= (1 + cfg.min_excess) * med]
            if not hits:
                hits = _split(v[ok], idx, cfg, z_star)
            for j, zz, med in hits:
                g, rows = sib[j]
                own = m[rows, k]
                slow = own >= (1 + cfg.min_excess) * med
                if slow.sum() < cfg.uniform * rows.size:
                    continue
                hosts = sorted({resources[ranks[i]].host for i in rows if resources[ranks[i]].host})
                comm = cfg.routing.is_communication(key)
                suspects = tuple(
                    SuspectRank(ranks[i], float(own[n] / med), {
                        "time_per_iteration_ns": float(own[n]), "siblings_median_ns": med,
                        "ratio": float(own[n] / med), "direction": "slower"},
                        impact_ns=max(0.0, float(own[n] - med)))
                    for n, i in enumerate(rows.tolist()) if np.isfinite(own[n]) and slow[n])
                scope = Scope(kernel=key, group=dim, group_index=int(g)) if key.startswith("[") else \
                    Scope(phase=key, group=dim, group_index=int(g))
                out.append(Finding(
                    level="L2", kind="slow_group", job_id=jw.job_id, window=jw.window, scope=scope,
                    suspects=tuple(sorted(suspects, key=lambda s: -s.impact_ns)), severity=float(zz),
                    comparison="sibling_groups",
                    evidence={"group_dim": dim, "group_index": int(g), "group_ratio": float(v[j] / med),
                              "z": float(zz), "z_threshold": z_star, "siblings": int(ok.sum()),
                              "members": [ranks[i] for i in rows.tolist()], "hosts": hosts,
                              "shared_host": hosts[0] if len(hosts) == 1 else "",
                              "communication": comm}))
    return out, comparisons
