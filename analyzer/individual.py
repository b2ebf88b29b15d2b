"""Small jobs: a rank against its own history, and the two ranks of a pair.

Peers cannot be compared when a rank's comparison group is too small (two
ranks, or one per role). Two comparisons still can be made, and the
verdict says which one was used (``Finding.comparison``):

1. Own history (NVRx's "individual" score, own best against now): per rank
   and key (phases, compute/memory/communication kernel sums; time per
   iteration, ``l2_groups.rank_times``) the last ``history`` windows are
   kept. A rank is slower than itself when now ≥ (1 + ``min_excess``) × its
   best recent window, and the robust z of now against its own history
   (spread = 1.4826·MAD of the history, with the personality floor) reaches
   z* = Φ⁻¹(1 − α/M) over the window's comparisons. Needs ``min_history``
   windows first; the impact is now − the history's median.
2. Dependency split (ARGUS §9.5 without a majority): in every synchronising
   group, sort the members by their time in communication; the widest gap
   splits those that arrived late (short collectives) from those that
   waited. When the gap is at least ``pair_min_excess`` of the step, wider
   than twice the spread inside either side, and the late side was busy
   outside communication for at least ``pair_busy_share`` of it, the late
   side are the culprits and their impact is what they kept the others
   waiting (at most their own extra work). The dependency, not a majority,
   says who is slow, so it works on two ranks (kind ``pair_straggler``) and
   on a group split by a slow host (``late_arrivers``: at least a third of
   the group late), where the median of the peers is meaningless; a few
   late ranks in a larger group are L2's business. Persistence keeps noise
   out.

Own history judges the ranks whose peer group is too small for L2/L3 (fewer
than ``min_peers``), and the ranks of groups under ``SMALL_GROUP`` peers, where
one noisy peer inflates the MAD enough to hide a rank 20 % slower: there a
rank is named when it is significantly slower than its own history *and*
slower than its peers now (robust z ≥ ``peer_z`` and ``min_excess`` above
their median: a rank that changed while its peers did not; a job-wide
change is L1's); its impact is the smaller of the two excesses.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from trainscope.analyzer.impact import WindowScale
from trainscope.analyzer.l2_groups import GroupsConfig, rank_times
from trainscope.analyzer.model import Finding, JobWindow, Scope, SuspectRank
from trainscope.analyzer.significance import MAD_SIGMA, SMALL_GROUP, robust_z, z_threshold
from trainscope.analyzer.topology import check_number, group_of, resources_with


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class IndividualConfig:
    history: int = 16
    """Windows of each rank's own history kept per key."""
    min_history: int = 3
    """Windows of history before a rank is compared with itself."""
    min_excess: float = 0.10
    """Slower than its own best recent window by at least this much."""
    min_peers: int = 3
    """Ranks with a comparison group (same role) of fewer ranks are judged here."""
    peer_z: float = 2.0
    """Ranks of groups under SMALL_GROUP peers: own history, confirmed by a robust z against the peers now
    (and ``min_excess`` above their median)."""
    false_alarm: float = 1e-3
    rel_floor: float = 0.02
    pair_min_excess: float = 0.03
    """Dependency rule: the waiters' extra communication time is at least this share of the step ..."""
    pair_busy_share: float = 0.3
    """... and the late arrivers were busy outside communication for at least this share of it."""
    dim: str = "dp"
    """Dimension of the comparison group (the one L2/L3 use)."""

    def __post_init__(self) -> None:
        check_number("individual.history", self.history, lambda v: v >= 2, "must be an integer >= 2", int)
        check_number("individual.min_history", self.min_history, lambda v: 2 <= v <= self.history,
                     "must be an integer in [2, history]", int)
        check_number("individual.min_excess", self.min_excess, lambda v: v > 0, "must be > 0")
        check_number("individual.min_peers", self.min_peers, lambda v: v >= 2, "must be an integer >= 2", int)
        check_number("individual.peer_z", self.peer_z, lambda v: v >= 0, "must be >= 0")
        check_number("individual.false_alarm", self.false_alarm, lambda v: 0 < v < 1, "must be in (0, 1)")
        check_number("individual.rel_floor", self.rel_floor, lambda v: v >= 0, "must be >= 0")
        check_number("individual.pair_min_excess", self.pair_min_excess, lambda v: v > 0, "must be > 0")
        check_number("individual.pair_busy_share", self.pair_busy_share, lambda v: 0 < v <= 1, "must be in (0, 1]")


class History:
    """Per (rank, key): time per iteration in the last ``n`` windows (bounded)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.values: dict[tuple[int, str], collections.deque] = {}

    def get(self, rank: int, key: str) -> np.ndarray:
        d = self.values.get((rank, key))
        return np.asarray(d, dtype=np.float64) if d else np.empty(0)

    def add(self, rank: int, key: str, value: float) -> None:
        d = self.values.get((rank, key))
        if d is None:
            d = self.values[(rank, key)] = collections.deque(maxlen=self.n)
        d.append(value)


def small_ranks(jw: JobWindow, cfg: IndividualConfig) -> list[int]:
    """Ranks whose comparison group has fewer than ``min_peers`` ranks."""
    res = resources_with(jw.resources, {**jw.phases, **jw.kernels})
    return sorted(r for members in group_of(res, cfg.dim).values() if len(members) < cfg.min_peers
                  for r in members)


def peer_z_of_small_groups(jw: JobWindow, ranks: list[int], m: np.ndarray,
                           cfg: IndividualConfig) -> dict[int, np.ndarray]:
    """Rows of ranks in groups of ``min_peers`` to ``SMALL_GROUP`` - 1 ranks: (2, keys) arrays of their
    robust z against their group now (personality floor) and the group's median."""
    res = resources_with(jw.resources, {**jw.phases, **jw.kernels})
    row = {r: i for i, r in enumerate(ranks)}
    out: dict[int, np.ndarray] = {}
    for members in group_of(res, cfg.dim).values():
        rows = [row[r] for r in members if r in row]
        if not cfg.min_peers <= len(rows) < SMALL_GROUP:
            continue
        with np.errstate(all="ignore"):
            z, med, _ = robust_z(np.nan_to_num(m[rows].T, nan=0.0), None, cfg.rel_floor)   # keys x members
        for n, i in enumerate(rows):
            out[i] = np.stack([z[:, n], med[:, 0]])     # (2, keys): z and the peers' median
    return out


def analyze_individual(jw: JobWindow, scale: WindowScale, history: History,
                       cfg: IndividualConfig = IndividualConfig(),
                       groups_cfg: GroupsConfig = GroupsConfig()) -> tuple[list[Finding], dict[str, int]]:
    """Steps 1-2 for the ranks peers cannot judge; records this window into ``history``.

    Returns the findings and the comparisons made: {"own_history": n, "dependency": n}."""
    ranks, keys, m = rank_times(jw, scale, groups_cfg)
    if not keys:
        return [], {"own_history": 0, "dependency": 0}
    small = set(small_ranks(jw, cfg))
    peer_z = peer_z_of_small_groups(jw, ranks, m, cfg)
    rows = sorted({i for i, r in enumerate(ranks) if r in small} | set(peer_z))
    out: list[Finding] = []
    # step 1: own history (ranks of small groups: confirmed by their peers now)
    tests = []
    for i in rows:
        for k, key in enumerate(keys):
            now = m[i, k]
            past = history.get(ranks[i], key)
            if (np.isfinite(now) and now > 0 and past.size >= cfg.min_history
                    and (i not in peer_z or (peer_z[i][0, k] >= cfg.peer_z
                                             and now >= (1 + cfg.min_excess) * peer_z[i][1, k]))):
                tests.append((i, k, now, past))
    comparisons = len(tests)
    if tests:
        z_star = z_threshold(cfg.false_alarm, comparisons)
        for i, k, now, past in tests:
            med = float(np.median(past))
            spread = np.hypot(MAD_SIGMA * float(np.median(np.abs(past - med))), cfg.rel_floor * med)
            z = (now - med) / spread if spread > 0 else 0.0
            best = float(past.min())
            if z >= z_star and now >= (1 + cfg.min_excess) * best:
                key = keys[k]
                scope = Scope(kernel=key, group="self") if key.startswith("[") else Scope(phase=key, group="self")
                out.append(Finding(
                    level="L3" if key.startswith("[") else "L2", kind="individual_slowdown",
                    job_id=jw.job_id, window=jw.window, scope=scope, comparison="own_history",
                    suspects=(SuspectRank(ranks[i], float(now / best), {
                        "time_per_iteration_ns": float(now), "own_best_ns": best, "own_median_ns": med,
                        "ratio": float(now / med), "z": float(z), "z_threshold": z_star,
                        "direction": "slower", "history_windows": int(past.size),
                        **({"peers_z": float(peer_z[i][0, k]), "peers_median_ns": float(peer_z[i][1, k])}
                           if i in peer_z else {})},
                        impact_ns=max(0.0, float(now - med) if i not in peer_z
                                      else min(float(now - med), float(now - peer_z[i][1, k])))),),
                    severity=float(z), evidence={"history_windows": int(past.size),
                                                 "communication": key == "[communication]"}))
    # step 2: pairs
    pairs, pair_cmp = _pairs(jw, ranks, keys, m, scale, cfg, groups_cfg)
    out += pairs
    for i in rows:
        for k, key in enumerate(keys):
            if np.isfinite(m[i, k]):
                history.add(ranks[i], key, float(m[i, k]))
    return out, {"own_history": comparisons, "dependency": pair_cmp}


def _pairs(jw, ranks, keys, m, scale: WindowScale, cfg: IndividualConfig,
           groups_cfg: GroupsConfig) -> tuple[list[Finding], int]:
    """Step 2 on every synchronising group (two ranks, or a group split in two: half of a DP group
    on a slow host makes the peers' median useless, but not the dependency)."""
    res = resources_with(jw.resources, {**jw.phases, **jw.kernels})
    comm = np.array([groups_cfg.routing.is_communication(k) for k in keys])
    # phases and kernel sums overlap (a forward phase holds kernels): use phases when a rank has any
    phase_cols = np.array([not k.startswith("[") for k in keys])
    out, n = [], 0
    row = {r: i for i, r in enumerate(ranks)}
    if scale.step_ns <= 0:
        return out, 0
    for members in group_of(res, cfg.dim).values():
        members = [r for r in members if r in row]
        if len(members) < 2:
            continue
        rows = np.array([row[r] for r in members])
        cols = phase_cols if np.isfinite(m[rows][:, phase_cols]).any() else ~phase_cols
        other = np.nan_to_num(m[rows][:, cols & ~comm]).sum(axis=1)
        wait = np.nan_to_num(m[rows][:, cols & comm]).sum(axis=1)
        n += 1
        order = np.argsort(wait, kind="stable")
        w = wait[order]
        j = int(np.argmax(np.diff(w)))                 # the widest gap splits late arrivers from waiters
        gap = float(w[j + 1] - w[j])
        late, waiters = order[: j + 1], order[j + 1:]
        if len(members) > 2 and 3 * late.size < len(members):
            continue    # a few late ranks in a group are L2's (majority) business; this rule is for splits
        spread = max(float(np.ptp(w[: j + 1])), float(np.ptp(w[j + 1:])))
        busy = float(other[late].mean() - other[waiters].mean())
        if (gap < cfg.pair_min_excess * scale.step_ns or gap < 2 * spread
                or busy < cfg.pair_busy_share * gap):
            continue
        excess = np.where(cols & ~comm, np.nan_to_num(m[rows[late]].mean(axis=0) - m[rows[waiters]].mean(axis=0)),
                          -np.inf)
        where = keys[int(np.argmax(excess))]
        scope = Scope(kernel=where, group=cfg.dim) if where.startswith("[") else Scope(phase=where, group=cfg.dim)
        pair = len(members) == 2
        suspects = tuple(SuspectRank(members[i], float(gap / scale.step_ns), {
            "extra_time_outside_communication_ns": float(other[i] - other[waiters].mean()),
            "peers_waited_ns": gap, "waiters": [members[k] for k in waiters.tolist()][:16],
            "direction": "slower",
            "ratio": float(other[i] / other[waiters].mean()) if other[waiters].mean() > 0 else 0.0},
            impact_ns=float(max(0.0, min(other[i] - other[waiters].mean(), gap))))
            for i in late.tolist())
        out.append(Finding(
            level="L2", kind="pair_straggler" if pair else "late_arrivers", job_id=jw.job_id,
            window=jw.window, scope=scope, comparison="pair" if pair else "dependency",
            suspects=tuple(sorted(suspects, key=lambda x: -x.impact_ns)), severity=float(gap / scale.step_ns),
            evidence={"communication": False, "group_size": len(members), "late": len(late),
                      "explanation": "the others waited in communication while these were busy elsewhere"}))
    return out, n
