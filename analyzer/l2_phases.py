"""L2: which rank is slow in which phase, within its parallel group (ARGUS §6.1, App. B eq. 5, §9.5).

For each phase and each comparison group (``topology.RoutingConfig.route``,
ARGUS Table 3):

1. x̄_r = the rank's mean phase duration in the window (``PhaseStats.mean_ns``;
   repeated names are merged as total/count). Groups with fewer than
   ``min_group_size`` ranks holding the phase are skipped.
2. μ_G, σ_G (n−1, eq. 5) and CV = σ_G/μ_G: balanced (< ``cv_mild``), mild,
   severe (≥ ``cv_severe``). A balanced group yields nothing.
3. Outliers. ARGUS flags z_r = (x̄_r − μ_G)/σ_G above a threshold (kept as
   evidence). The decision is calibrated instead (``significance.py``): the
   robust z of the rank's phase time per iteration against its group, with
   the personality floor, must reach z* = Φ⁻¹(1 − α/M) over the M (rank,
   phase) comparisons of the window, and the rank must be at least
   ``min_excess`` slower than the median (3b, ``_specific_phases``: a host
   phase of a small group far more out of line than the rank's other host
   phases is judged against its spread pooled over the job's recent
   windows; 3c, ``_typical_phases``: a host phase whose *typical* instance,
   p50 × count per iteration, is that far out of line). The impact of a suspect is its
   extra phase time per iteration (for a late arriver: the time its peers
   waited). Why not z alone: With n ranks
   max |z| ≤ (n−1)/√n (1.15 for 3 ranks, 1.5 for 4), and k equal outliers
   mask each other (z ≈ √((n−1)(n−k)/(nk))), so a robust z is used beside it:
   (x̄_r − median)/scale with scale = max(1.4826·MAD, ``cv_mild``·median) (the
   floor keeps a perfectly homogeneous group from turning noise into huge
   robust z); and a fixed threshold gives a 1,000-rank job far more false
   alarms than a 16-rank one.
4. Compute phases: slow outliers are stragglers (kind ``straggler``);
   MoE/expert phases (``imbalance`` pattern) give kind ``imbalance`` (ARGUS
   Table 6), and under a severe CV every rank ≥ 1 + ``min_excess`` over the
   median counts (load imbalance is a spread, not always one outlier).
5. Communication phases (ARGUS §6.1, §9.5): in a collective the ranks that
   wait show *long* durations and the late arriver the *shortest*. Under a
   severe CV, ranks ≤ (1 − ``comm_min_deficit``) × median that are robust
   low outliers are the culprits (kind ``straggler``, role ``late_arriver``);
   the others are listed as victims in the evidence and never as suspects.
   Cross-check (ARGUS §9.1, §9.5): the culprit's *pure* compute phases
   (``pure_compute``: attention, mlp, experts; not forward/backward, which
   also hold tensor-parallel collectives and so grow when a peer is slow),
   each relative to its own group: ``cause`` is ``own_compute`` when one is
   ≥ 1 + ``min_excess``, else ``delayed_by_dependency`` (the delay reached
   it through a pipeline or tensor-parallel peer). Other slow
   non-collective phases are listed as ``other_phases_slower``. When no
   group of the phase has a late arriver, slow communication outliers are
   reported as kind ``slow_communication`` (own link, or waiting on a peer
   outside the comparison group); when one has, long durations elsewhere
   are taken as waiting and not reported.
"""
from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

from trainscope.analyzer.impact import WindowScale, window_scale
from trainscope.analyzer.model import Finding, JobWindow, Scope, SuspectRank
from trainscope.analyzer.significance import (
    MAD_SIGMA, SMALL_GROUP, robust_z, small_group_threshold, t_isf, z_threshold,
)
from trainscope.analyzer.topology import (
    RoutingConfig, check_number, group_of, rank_to_group, resources_with,
)
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import telemetry_pb2



@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class L2Config:
    """Thresholds of L2 (ARGUS App. B) and the routing table (Table 3)."""

    cv_mild: float = 0.02
    """CV at or above which a group is mildly imbalanced (ARGUS App. B)."""
    cv_severe: float = 0.05
    """CV at or above which a group is severely imbalanced (ARGUS App. B)."""
    min_excess: float = 0.15
    """A straggler is at least this much slower than its group median (x/median ≥ 1 + this)."""
    comm_min_deficit: float = 0.2
    """A late arriver's collective is this much shorter than the median (x/median ≤ 1 − this)."""
    false_alarm: float = 1e-3
    """Family-wise false-alarm probability per window (Bonferroni over every (rank, phase) compared)."""
    rel_floor: float = 0.02
    """Floor of the peers' spread, × their median (per-rank personality, docs/noise.md)."""
    min_group_size: int = 3
    """Fewest ranks with the phase for a group to be compared."""
    imbalance: str = r"moe|expert"
    """Regular expression of compute phases whose outliers are load ``imbalance`` (ARGUS Table 6)."""
    pure_compute: str = r"attention|mla|mlp|moe|expert|ffn|gemm|matmul"
    """Regular expression of compute-only phases (no collective inside) for the late-arriver cross-check."""
    holds_collectives: str = r"forward|backward|fwd|bwd"
    """Regular expression of host phases that can hold a wait inside (a TP all-reduce in the forward,
    DDP's bucket all-reduces and FSDP2's gathers in the backward): never judged by step 3b."""
    specific_factor: float = 5.0
    """Step 3b's effect size: a host phase this many times its peers' median and this many times
    further out of line than the rank's other host phases (a real 4-rank job's healthy data
    loaders spread 0.3-3.6 ms, up to ~4x their median, in one window)."""
    spread_windows: int = 8
    """Step 3b: windows over which a host phase's peer spread is pooled."""
    max_victims: int = 64
    """Longest victim list in a late-arriver finding's evidence (the count is always given)."""
    routing: RoutingConfig = RoutingConfig()
    """Phase -> comparison dimension, and which phases are communication."""

    def __post_init__(self) -> None:
        check_number("l2.cv_mild", self.cv_mild, lambda v: v > 0, "must be > 0")
        check_number("l2.cv_severe", self.cv_severe, lambda v: v >= self.cv_mild, "must be >= cv_mild")
        check_number("l2.min_excess", self.min_excess, lambda v: v > 0, "must be > 0")
        check_number("l2.comm_min_deficit", self.comm_min_deficit, lambda v: 0 < v < 1,
                     "must be in (0, 1)")
        check_number("l2.false_alarm", self.false_alarm, lambda v: 0 < v < 1, "must be in (0, 1)")
        check_number("l2.rel_floor", self.rel_floor, lambda v: v >= 0, "must be >= 0")
        check_number("l2.min_group_size", self.min_group_size, lambda v: v >= 3,
                     "must be an integer >= 3", int)
        check_number("l2.max_victims", self.max_victims, lambda v: v >= 0,
                     "must be an integer >= 0", int)
        check_number("l2.specific_factor", self.specific_factor, lambda v: v > 1, "must be > 1")
        check_number("l2.spread_windows", self.spread_windows, lambda v: v >= 1, "must be an integer >= 1", int)
        for name in ("imbalance", "pure_compute", "holds_collectives"):
            try:
                re.compile(getattr(self, name))
            except (re.error, TypeError) as e:
                raise ConfigError(f"l2.{name}", getattr(self, name),
                                  f"not a regular expression: {e}") from None
        if not isinstance(self.routing, RoutingConfig):
            raise ConfigError("l2.routing", self.routing, "must be a RoutingConfig")


def phase_matrix(jw: JobWindow, totals: bool = False):
    """Ranks, phase names, and (ranks × phases) mean durations in ns, NaN where absent (step 1);
    with ``totals``, also the (ranks × phases) total time in ns."""
    ranks = sorted(jw.phases)
    per_rank: list[dict[str, tuple[float, int]]] = []
    names: set[str] = set()
    for r in ranks:
        acc: dict[str, tuple[float, int]] = {}
        for ph in jw.phases[r].phases:
            if ph.count <= 0:
                continue
            total = ph.total_ns if ph.total_ns > 0 else ph.mean_ns * ph.count
            t, c = acc.get(ph.phase, (0.0, 0))
            acc[ph.phase] = (t + total, c + ph.count)
        per_rank.append(acc)
        names.update(acc)
    phases = sorted(names)
    col = {p: j for j, p in enumerate(phases)}
    m = np.full((len(ranks), len(phases)), np.nan)
    tot = np.full((len(ranks), len(phases)), np.nan)
    for i, acc in enumerate(per_rank):
        for p, (t, c) in acc.items():
            m[i, col[p]] = t / c
            tot[i, col[p]] = t
    return (ranks, phases, m, tot) if totals else (ranks, phases, m)


def host_timed_phases(jw: JobWindow) -> set[str]:
    """Phases timed on the host's clock (``PHASE_CLOCK_CPU``) on any rank."""
    return {p.phase for pw in jw.phases.values() for p in pw.phases if p.clock == telemetry_pb2.PHASE_CLOCK_CPU}


def group_stats(x: np.ndarray, label: np.ndarray) -> dict[str, np.ndarray]:
    """Per element, statistics of its group (vectorised over every group at once, steps 2-3).

    Returns arrays aligned with ``x``: n, mean, std (n−1), median, mad.
    """
    order = np.lexsort((x, label))
    xs, ls = x[order], label[order]
    first = np.flatnonzero(np.r_[True, ls[1:] != ls[:-1]])
    n_seg = np.diff(np.r_[first, xs.size])
    seg = np.repeat(np.arange(first.size), n_seg)
    mean = np.add.reduceat(xs, first) / n_seg
    dev = xs - mean[seg]
    std = np.sqrt(np.add.reduceat(dev * dev, first) / np.maximum(n_seg - 1, 1))
    med = (xs[first + (n_seg - 1) // 2] + xs[first + n_seg // 2]) / 2.0
    ad = np.abs(xs - med[seg])
    ad_sorted = ad[np.lexsort((ad, seg))]
    mad = (ad_sorted[first + (n_seg - 1) // 2] + ad_sorted[first + n_seg // 2]) / 2.0
    out = {}
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    for name, v in (("n", n_seg), ("mean", mean), ("std", std), ("median", med), ("mad", mad)):
        out[name] = v[seg][inv]
    return out


@dataclasses.dataclass(slots=True)
class _Phase:
    name: str
    dim: str
    comm: bool
    rows: np.ndarray          # rank rows holding the phase
    label: np.ndarray         # group index of each row
    x: np.ndarray
    st: dict
    z: np.ndarray
    rz: np.ndarray
    ratio: np.ndarray
    cv: np.ndarray
    eligible: np.ndarray
    per_iter: np.ndarray = None     # phase time per iteration, ns
    sz: np.ndarray = None           # calibrated z of per_iter against the group (step 3)
    per_iter_median: np.ndarray = None
    z_star: np.ndarray = None       # per row: the significance threshold of its group's size
    host_timed: bool = False        # timed on the host's clock (CPU phases), not the device's


def _phase(name, dim, comm, col, label_of_row, cfg, per_iter_col=None) -> _Phase | None:
    rows = np.flatnonzero(np.isfinite(col) & (label_of_row >= 0))
    if rows.size == 0:
        return None
    x, label = col[rows], label_of_row[rows]
    st = group_stats(x, label)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(st["std"] > 0, (x - st["mean"]) / st["std"], 0.0)
        scale = np.maximum(MAD_SIGMA * st["mad"], cfg.cv_mild * st["median"])
        rz = np.where(scale > 0, (x - st["median"]) / scale, 0.0)
        ratio = np.where(st["median"] > 0, x / st["median"], 1.0)
        cv = np.where(st["mean"] > 0, st["std"] / st["mean"], 0.0)
    eligible = (st["n"] >= cfg.min_group_size) & (cv >= cfg.cv_mild)
    pi = x if per_iter_col is None else per_iter_col[rows]
    sz, pmed = _group_z(pi, label, cfg.rel_floor)
    return _Phase(name, dim, comm, rows, label, x, st, z, rz, ratio, cv, eligible, pi, sz, pmed)


def _group_z(x: np.ndarray, label: np.ndarray, rel_floor: float) -> tuple[np.ndarray, np.ndarray]:
    """Per element, the robust z of ``x`` against its group (``label``) and the group's median (step 3)."""
    z, med = np.zeros(x.size), np.zeros(x.size)
    for g in np.unique(label).tolist():
        idx = np.flatnonzero(label == g)
        zz, m, _ = robust_z(x[idx], None, rel_floor)
        z[idx], med[idx] = zz, m.ravel()[0]
    return z, med


class PhaseSpread:
    """Step 3b's memory: per host-timed phase, the peers' relative spread (1.4826·MAD / median) of
    each small group in the job's last ``windows`` windows, with its degrees of freedom (n − 1)."""

    def __init__(self, windows: int) -> None:
        self._seen: dict[str, collections.deque] = {}
        self.windows = windows

    def pooled(self, name: str, rel: np.ndarray, df: np.ndarray) -> tuple[float, float]:
        """Record this window's (rel, df) of ``name``'s groups; return the pooled relative spread
        sqrt(Σ df·rel² / Σ df) and Σ df over the remembered windows, this one included."""
        q = self._seen.setdefault(name, collections.deque(maxlen=self.windows))
        q.append((float(np.sum(df * rel ** 2)), float(np.sum(df))))
        ss, n = sum(a for a, _ in q), sum(b for _, b in q)
        return (float(np.sqrt(ss / n)) if n > 0 else 0.0), n


def analyze_phases(jw: JobWindow, cfg: L2Config = L2Config(), scale: WindowScale | None = None,
                   spread: PhaseSpread | None = None) -> list[Finding]:
    """L2 findings for one window of one job (module steps 1-5). ``spread``: the job's step-3b
    memory (none: a host phase's peers are judged in this window alone)."""
    ranks, names, m, tot = phase_matrix(jw, totals=True)
    if not names:
        return []
    scale = scale if scale is not None else window_scale(jw)
    iterations = scale.iterations_array(ranks)
    per_iter = tot / iterations[:, None]
    resources = resources_with(jw.resources, jw.phases)
    labels: dict[str, np.ndarray] = {}
    imbalance = re.compile(cfg.imbalance, re.IGNORECASE)
    pure = re.compile(cfg.pure_compute, re.IGNORECASE)
    phases = []
    for j, name in enumerate(names):
        dim = cfg.routing.route(name)
        if dim not in labels:
            g = rank_to_group(group_of(resources, dim))
            labels[dim] = np.array([g.get(r, -1) for r in ranks], dtype=np.int64)
        ph = _phase(name, dim, cfg.routing.is_communication(name), m[:, j], labels[dim], cfg, per_iter[:, j])
        if ph is not None:
            phases.append(ph)
    m_cmp = sum(int(ph.eligible.sum()) for ph in phases)
    z_star = z_threshold(cfg.false_alarm, m_cmp)
    host = host_timed_phases(jw)
    for ph in phases:
        # host-clock phases of ranks sharing CPUs carry scheduling noise a handful of peers cannot
        # estimate: Student t below SMALL_GROUP ranks; device-timed phases keep the normal threshold
        ph.host_timed = ph.name in host
        ph.z_star = (small_group_threshold(cfg.false_alarm, m_cmp, ph.st["n"]) if ph.host_timed
                     else np.full(ph.rows.size, z_star))
    # ratio of every rank to its own group median, per compute phase (for the cross-check)
    compute_ratio = {ph.name: dict(zip(ph.rows.tolist(), ph.ratio.tolist()))
                     for ph in phases if not ph.comm}
    specific = _specific_phases(phases, compute_ratio, cfg, m_cmp, spread) if spread is not None else {}
    typical = _typical_phases(jw, phases, ranks, iterations, cfg) if host else {}
    out: list[Finding] = []
    for ph in phases:
        high = ph.eligible & (ph.ratio >= 1 + cfg.min_excess) & (ph.sz >= ph.z_star)
        if ph.name in specific:
            high |= specific[ph.name]
        if ph.name in typical:
            high |= typical[ph.name]
        if not ph.comm:
            kind = "imbalance" if imbalance.search(ph.name) else "straggler"
            if kind == "imbalance":
                high |= ph.eligible & (ph.cv >= cfg.cv_severe) & (ph.ratio >= 1 + cfg.min_excess)
            out += _findings(jw, ph, high, kind, cfg, ranks, z_star)
            continue
        late = ph.eligible & (ph.cv >= cfg.cv_severe) & (ph.ratio <= 1 - cfg.comm_min_deficit) & (
            ph.sz <= -ph.z_star)
        if late.any():
            out += _late_findings(jw, ph, late, cfg, ranks, compute_ratio, pure, z_star)
        else:
            out += _findings(jw, ph, high, "slow_communication", cfg, ranks, z_star)
    return out


def _specific_phases(phases: list[_Phase], compute_ratio: dict, cfg: L2Config, m_cmp: int,
                     spread: PhaseSpread) -> dict[str, np.ndarray]:
    """Step 3b: a host phase's own fault, judged with its peers' spread pooled over windows.

    A host-timed phase of a group under ``SMALL_GROUP`` ranks takes the Student-t threshold of
    n − 1 degrees of freedom (its spread comes from a handful of peers): 22-28 for 4 ranks, which
    a real 4-rank job's data loader 20x its peers (half the step) missed in one window of two
    (z 13-21). Pooling the phase's relative spread over the job's last ``spread_windows`` windows
    gives the threshold Σ(n − 1) degrees of freedom (≈ 5 after 8 windows of 4 ranks). Pooling
    would also lower the bar for a rank whose whole host is slower (a busy core: the healthy
    control of issue #22 must name nobody), so it applies only where the slowness is the phase's
    own: ratio ≥ ``specific_factor`` × the rank's host factor (the median of its ratios in its
    other host compute phases; 1 without any), and never to a phase that can hold a wait inside
    (``holds_collectives``). Returns {phase: rows flagged}."""
    holds = re.compile(cfg.holds_collectives, re.IGNORECASE)
    host = [ph for ph in phases if ph.host_timed and not ph.comm]
    out = {}
    for ph in host:
        small = ph.st["n"] < SMALL_GROUP
        if holds.search(ph.name) or not (small & ph.eligible).any():
            continue
        # 1. this window's relative spread of each small group, pooled with the phase's history
        first = np.unique(ph.label[small & ph.eligible], return_index=True)[1]
        rows = np.flatnonzero(small & ph.eligible)[first]
        med = ph.st["median"][rows]
        rel = np.maximum(MAD_SIGMA * ph.st["mad"][rows] / np.maximum(med, 1e-9), cfg.rel_floor)
        rel_pool, df = spread.pooled(ph.name, rel, ph.st["n"][rows] - 1.0)
        if df <= 0 or rel_pool <= 0:
            continue
        # 2. z against the pooled spread, Student t of the pooled degrees of freedom
        t_star = float(t_isf(cfg.false_alarm / max(m_cmp, 1), df))
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = np.where(ph.st["median"] > 0, (ph.x - ph.st["median"]) / (rel_pool * ph.st["median"]), 0.0)
        # 3. the rank's host factor: its other host compute phases against their groups
        others = [compute_ratio[q.name] for q in host if q.name != ph.name]
        factor = np.array([max(1.0, float(np.median([o[r] for o in others if r in o])))
                           if any(r in o for o in others) else 1.0 for r in ph.rows.tolist()])
        out[ph.name] = (small & ph.eligible & (ph.ratio >= 1 + cfg.min_excess) & (zp >= t_star)
                        & (ph.ratio >= cfg.specific_factor * factor))
    return out


def _typical_phases(jw: JobWindow, phases: list[_Phase], ranks: list[int], iterations: np.ndarray,
                    cfg: L2Config) -> dict[str, np.ndarray]:
    """Step 3c: a host phase's typical instance out of line (an addition, as L3's step 5c for CPU operators).

    A host-timed phase's mean carries the scheduler's preemptions: on a 2-core host beside busy
    processes, a rank whose data loader waited 30 ms every step (peers 0.3 ms) was flagged in some
    windows and not others as its peers' preempted steps widened their spread, and the job read
    "healthy". Its p50 was 30 ms in every window, the peers' 0.3 ms: the typical instance does not
    move with a few preempted steps, on the slow rank or its peers. So the same test (ratio and
    significance against the group, the same threshold) is also run on p50 × count per iteration;
    a rank flagged either way is flagged. Not for phases that can hold a wait inside
    (``holds_collectives``): a waiter waits in every step too. The evidence and the impact stay the
    mean's. ``iterations``: each of ``ranks``' iterations in the window. Returns {phase: rows flagged}."""
    holds = re.compile(cfg.holds_collectives, re.IGNORECASE)
    typ: dict[tuple[int, str], float] = collections.defaultdict(float)
    for r, pw in jw.phases.items():
        for p in pw.phases:
            if p.count > 0 and p.clock == telemetry_pb2.PHASE_CLOCK_CPU:
                typ[(r, p.phase)] += p.p50_ns * p.count
    out = {}
    for ph in phases:
        if not ph.host_timed or ph.comm or holds.search(ph.name):
            continue
        x = np.array([typ.get((ranks[i], ph.name), 0.0) / max(float(iterations[i]), 1.0) for i in ph.rows.tolist()])
        z, med = _group_z(x, ph.label, cfg.rel_floor)
        flag = (ph.st["n"] >= cfg.min_group_size) & (x >= (1 + cfg.min_excess) * med) & (z >= ph.z_star)
        if flag.any():
            out[ph.name] = flag
    return out


def _evidence(ph: _Phase, i: int, z_star: float) -> dict:
    return {"mean_ns": float(ph.x[i]), "group_median_ns": float(ph.st["median"][i]),
            "group_mean_ns": float(ph.st["mean"][i]), "z": float(ph.z[i]),
            "robust_z": float(ph.rz[i]), "cv": float(ph.cv[i]), "ratio": float(ph.ratio[i]),
            "time_per_iteration_ns": float(ph.per_iter[i]),
            "group_median_per_iteration_ns": float(ph.per_iter_median[i]),
            "significance_z": float(ph.sz[i]), "z_threshold": z_star,
            # host clock: scheduler bursts span whole windows (sequential.py keeps it on k of n)
            **({"host_timed": True} if ph.host_timed else {}),
            "direction": "slower" if ph.ratio[i] >= 1 else "faster"}


def _group_evidence(ph: _Phase, i: int, cfg: L2Config) -> dict:
    cv = float(ph.cv[i])
    return {"cv": cv, "cv_level": "severe" if cv >= cfg.cv_severe else "mild",
            "group_size": int(ph.st["n"][i]), "group_mean_ns": float(ph.st["mean"][i]),
            "group_median_ns": float(ph.st["median"][i]), "communication": ph.comm}


def _findings(jw, ph: _Phase, flag: np.ndarray, kind: str, cfg, ranks, z_star: float) -> list[Finding]:
    out = []
    for g in np.unique(ph.label[flag]).tolist():
        idx = np.flatnonzero(flag & (ph.label == g))
        idx = idx[np.argsort(-ph.ratio[idx], kind="stable")]
        suspects = tuple(SuspectRank(ranks[ph.rows[i]], float(ph.ratio[i]), _evidence(ph, i, float(ph.z_star[i])),
                                     impact_ns=max(0.0, float(ph.per_iter[i] - ph.per_iter_median[i])))
                         for i in idx)
        out.append(Finding(
            level="L2", kind=kind, job_id=jw.job_id, window=jw.window,
            scope=Scope(phase=ph.name, group=ph.dim, group_index=int(g)),
            suspects=suspects, severity=float(ph.cv[idx[0]]), evidence=_group_evidence(ph, idx[0], cfg),
        ))
    return out


def _late_findings(jw, ph: _Phase, late: np.ndarray, cfg, ranks, compute_ratio, pure, z_star) -> list[Finding]:
    out = []
    for g in np.unique(ph.label[late]).tolist():
        members = np.flatnonzero(ph.label == g)
        idx = members[late[members]]
        idx = idx[np.argsort(ph.ratio[idx], kind="stable")]          # shortest collective first
        victims = [ranks[ph.rows[i]] for i in members[~late[members]]]
        suspects = []
        for i in idx:
            rank_row = int(ph.rows[i])
            slow = {p: float(r[rank_row]) for p, r in compute_ratio.items()
                    if rank_row in r and r[rank_row] >= 1 + cfg.min_excess}
            slower = {p: v for p, v in slow.items() if pure.search(p)}
            ev = _evidence(ph, i, float(ph.z_star[i])) | {
                "role": "late_arriver",
                "peers_waited_ns": float(ph.st["median"][i] - ph.x[i]),
                "compute_slower": slower,
                "other_phases_slower": {p: v for p, v in slow.items() if p not in slower},
                "cause": "own_compute" if slower else "delayed_by_dependency",
            }
            # its cost: how long its peers waited for it, per iteration
            waited = max(0.0, float(ph.per_iter_median[i] - ph.per_iter[i]))
            suspects.append(SuspectRank(ranks[rank_row], float(1.0 / max(ph.ratio[i], 1e-12)), ev,
                                        impact_ns=waited))
        ev = _group_evidence(ph, idx[0], cfg) | {
            "victims": victims[: cfg.max_victims], "victims_count": len(victims),
            "explanation": ("the peers waited in the collective for the late arriver(s), which "
                            "therefore show the shortest duration (ARGUS §9.5)"),
        }
        out.append(Finding(
            level="L2", kind="straggler", job_id=jw.job_id, window=jw.window,
            scope=Scope(phase=ph.name, group=ph.dim, group_index=int(g)),
            suspects=tuple(suspects), severity=float(ph.cv[idx[0]]), evidence=ev,
        ))
    return out
