"""Weak but consistent: a rank a few percent slower than its peers window after window.

One window cannot tell a rank 5 % slower on every compute kernel from its
peers when a window's spikes move each rank's total by 2-4 % (real kernel
streams, docs/noise.md). Averaged over windows, the spikes (which land on a
different rank each time) shrink by √windows and the persistent shift does
not. So, per comparison group (the L3/L2 groups, ``RoutingConfig.
kernel_group_dim``) and key (compute, memory and communication kernel sums;
phases):

1. Each window, every rank's ln(time per iteration / its group's median)
   is recorded (bounded: the last ``windows`` windows per (rank, key)).
2. With at least ``min_windows`` windows, a rank's median log ratio m_r
   over them (one spiky window does not move it; a persistent shift does)
   is compared with its peers': z = (m_r − median m) / s, s = 1.4826·MAD
   of the peers' values with a floor of ``rel_floor`` (a persistent
   difference smaller than the floor is personality, docs/noise.md), and
   flagged at z* = Φ⁻¹(1 − α/M) over the (rank, key) comparisons, when
   e^(m_r − median m) − 1 ≥ ``min_shift``.
3. The impact is the shift times the rank's current time per iteration;
   the finding says over how many windows it held. Collective keys are left
   to the levels that know who waited for whom.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from trainscope.analyzer.impact import WindowScale
from trainscope.analyzer.l2_groups import GroupsConfig, rank_times
from trainscope.analyzer.model import Finding, JobWindow, Scope, SuspectRank
from trainscope.analyzer.significance import MAD_SIGMA, SMALL_GROUP, z_threshold
from trainscope.analyzer.topology import check_number, group_of, resources_with


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ConsistentConfig:
    windows: int = 6
    """Windows of each rank's log ratio kept per key."""
    min_windows: int = 3
    """Windows needed before a shift counts."""
    min_shift: float = 0.05
    """Smallest persistent shift reported (5 %): below, rank-to-rank personality (docs/noise.md,
    up to ~7 % per kernel on GPUs, more on CPU ranks sharing cores) explains it."""
    rel_floor: float = 0.02
    """Floor of the peers' spread of median log ratios (the personality floor of L2/L3)."""
    min_group: int = SMALL_GROUP
    """Fewest ranks in a comparison group: below, the MAD of a handful of medians cannot tell a
    persistent shift from personality (``significance.SMALL_GROUP``)."""
    false_alarm: float = 1e-3

    def __post_init__(self) -> None:
        check_number("consistent.windows", self.windows, lambda v: v >= 2, "must be an integer >= 2", int)
        check_number("consistent.min_windows", self.min_windows, lambda v: 2 <= v <= self.windows,
                     "must be an integer in [2, windows]", int)
        check_number("consistent.min_shift", self.min_shift, lambda v: v > 0, "must be > 0")
        check_number("consistent.rel_floor", self.rel_floor, lambda v: v >= 0, "must be >= 0")
        check_number("consistent.min_group", self.min_group, lambda v: v >= 3, "must be an integer >= 3", int)
        check_number("consistent.false_alarm", self.false_alarm, lambda v: 0 < v < 1, "must be in (0, 1)")


class Ratios:
    """Per (rank, key): ln(time / group median) of the last ``n`` windows (step 1)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.values: dict[tuple[int, str], collections.deque] = {}

    def add(self, rank: int, key: str, v: float) -> None:
        d = self.values.get((rank, key))
        if d is None:
            d = self.values[(rank, key)] = collections.deque(maxlen=self.n)
        d.append(v)

    def get(self, rank: int, key: str) -> np.ndarray:
        d = self.values.get((rank, key))
        return np.asarray(d, dtype=np.float64) if d else np.empty(0)


def analyze_consistent(jw: JobWindow, scale: WindowScale, ratios: Ratios,
                       cfg: ConsistentConfig = ConsistentConfig(),
                       groups_cfg: GroupsConfig = GroupsConfig()) -> tuple[list[Finding], int]:
    """Steps 1-3; records this window into ``ratios``. Returns (findings, comparisons made)."""
    ranks, keys, m = rank_times(jw, scale, groups_cfg)
    if not keys:
        return [], 0
    row = {r: i for i, r in enumerate(ranks)}
    res = resources_with(jw.resources, {**jw.phases, **jw.kernels})
    dim = groups_cfg.routing.kernel_group_dim
    groups = [[r for r in members if r in row] for members in group_of(res, dim).values()]
    groups = [g for g in groups if len(g) >= cfg.min_group]
    keep = [k for k, key in enumerate(keys) if not groups_cfg.routing.is_communication(key)]
    tests = []
    with np.errstate(all="ignore"):
        for g in groups:
            rows = np.array([row[r] for r in g])
            for k in keep:
                x = m[rows, k]
                if not np.all(np.isfinite(x) & (x > 0)):
                    continue
                lr = np.log(x / np.median(x))
                for r, v in zip(g, lr.tolist()):
                    ratios.add(r, keys[k], v)
                hist = [ratios.get(r, keys[k]) for r in g]
                if min(h.size for h in hist) >= cfg.min_windows:
                    tests.append((g, rows, k, np.array([np.median(h) for h in hist]), min(h.size for h in hist)))
    comparisons = sum(len(t[0]) for t in tests)
    if not comparisons:
        return [], 0
    z_star = z_threshold(cfg.false_alarm, comparisons)
    out = []
    for g, rows, k, means, held in tests:
        med = float(np.median(means))
        spread = np.hypot(MAD_SIGMA * float(np.median(np.abs(means - med))), cfg.rel_floor)
        z = (means - med) / spread
        hit = np.flatnonzero((z >= z_star) & (np.expm1(means - med) >= cfg.min_shift))
        if not hit.size:
            continue
        key = keys[k]
        suspects = []
        for i in hit.tolist():
            shift = float(np.expm1(means[i] - med))
            now = float(m[rows[i], k])
            suspects.append(SuspectRank(g[i], float(z[i]), {
                "mean_shift": shift, "ratio": 1 + shift, "z": float(z[i]), "z_threshold": z_star,
                "windows": int(held), "direction": "slower"}, impact_ns=shift / (1 + shift) * now))
        scope = Scope(kernel=key, group=dim) if key.startswith("[") else Scope(phase=key, group=dim)
        out.append(Finding(
            level="L3" if key.startswith("[") else "L2", kind="consistent_slowdown", job_id=jw.job_id,
            window=jw.window, scope=scope, comparison="peers_over_windows",
            suspects=tuple(sorted(suspects, key=lambda s: -s.impact_ns)),
            severity=float(z[hit].max()), evidence={"windows": int(held), "communication": False,
                                                    "group_size": len(g)}))
    return out, comparisons
