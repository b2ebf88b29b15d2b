"""Collective root cause from step records: triggers, provenance graph, contributor rating (Vedrfolnir §III-C, §III-D).

Input: ``waiting_graph.StepBlock`` s of one analysed window (the step
records of ``CollectiveRecord`` fields 14-19, the simulator's
``collective_steps`` today; NCCL's profiler plugin would give them; kept per window by
``collectives.CollectiveState``, step 6), with
their waiting graph and critical path (``waiting_graph.critical_path``).
Without switch telemetry, the "ports" of the provenance graph are the ranks'
own: each flow step leaves through its sender's transmit port and enters its
receiver's receive port (the NIC for a group spanning hosts, NVLink inside a
host), over the link between the two; a port's queue depth is replaced by
the time its flows spent beyond their step's baseline.

1. Step-aware triggers (§III-C2): a step's baseline is the median duration,
   in the window, of the flows at the same step position of the same class
   (op, algorithm, members, span, size class): a step is judged against its
   own position, not against the collective's total. A flow step triggers at
   ``slow_factor`` times its baseline; each step of a collective has
   ``triggers_per_step`` opportunities, the critical flow's first (the flows
   that waited hand theirs to the flow they waited for, Fig. 7), then the
   slowest.
2. Provenance graph (§III-D1): vertices are the flow steps and the elements
   they cross: tx port of src, link src → dst, rx port of dst. Edge weights
   e(f, p) = the flow's excess over its baseline; e(p, f) = the flow's share of
   the element's bytes × the element's slow share (pkt_num(f)/pkt_num(p) ×
   qdepth(p) with qdepth read as "how much of its traffic was slow"):
   q(p) = triggered bytes through p / all bytes through p, over the window.
3. Contribution of an element to a triggered flow (eqs. 1-2): the flow's
   slowness is shared by the elements on its path in proportion to q;
   eq. (1)'s port-to-port propagation maps a port to the hardware behind it
   (tx and rx port of rank r → rank r; the link is its own element), eq. (2)
   sums over the flow's path. A step's contribution R(e, cf_i) is the mean
   over the flows that step triggered.
4. Rating (eq. 3): R(e) = Σ_i R(e, cf_i) × (exec(i) − expect(i)) / Σ_k (exec(k) −
   expect(k)) over the critical path's steps i of every collective of the
   window that triggered (exec: the critical flow's duration; expect: its
   baseline).
5. Verdict: elements by rating; one is named when it was slow in
   ``min_slow`` collectives and ``min_share`` of those it took part in, and
   rates ``min_rating``. A rank is named (its NIC or NVLink) when it rates
   ``margin`` times any link at it, unless its slow links all go to one peer
   that rates like it (nothing tells the two ends apart); otherwise the slow
   link(s) at the top rank are named: src → dst, or a ↔ b when both
   directions are slow and the two ends rate alike (a 2-member ring: a
   degraded NVLink of either GPU slows both flows alike; the pair and its
   host are the answer, not one GPU). Each named element carries the steps
   it slowed (group, seq, step) and its impact: the critical excess of those
   steps (shared with any other element named for the same step), in
   seconds per iteration;
   findings of kind ``slow_link``, role ``link``.
"""
from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Iterable, Mapping

import numpy as np

from trainscope.analyzer.model import LINK, Finding, Scope, SuspectRank
from trainscope.analyzer.waiting_graph import KIND, StepBlock, critical_path, step_blocks
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import records_pb2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProvenanceConfig:
    slow_factor: float = 1.6
    """Step 1: a flow step this many times its step position's baseline triggers."""
    triggers_per_step: int = 2
    """Step 1: detection opportunities per step of a collective."""
    min_class_flows: int = 8
    """Step 1: flows at a step position before its median is a baseline."""
    min_rating: float = 0.1
    """Step 5: eq. (3) rating an element needs to be named."""
    margin: float = 1.5
    """Step 5: a rank rates this many times every link at it and every other rank to be named."""
    min_share: float = 0.2
    """Step 5: share of the element's collectives of the window it must be slow in."""
    min_slow: int = 3
    """Step 5: ... and at least this many."""

    def __post_init__(self) -> None:
        for f in ("slow_factor", "margin"):
            if not getattr(self, f) > 1:
                raise ConfigError(f"analyzer.collectives.provenance.{f}", getattr(self, f), "must be > 1")
        if not 0 < self.min_share <= 1:
            raise ConfigError("analyzer.collectives.provenance.min_share", self.min_share, "must be in (0, 1]")
        if not 0 <= self.min_rating <= 1:
            raise ConfigError("analyzer.collectives.provenance.min_rating", self.min_rating, "must be in [0, 1]")
        for f in ("triggers_per_step", "min_class_flows", "min_slow"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"analyzer.collectives.provenance.{f}", v, "must be an integer >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class RootCause:
    """One named element (step 5)."""

    element: str                 # "rank" | "link"
    ranks: tuple[int, ...]       # the rank, or (src, dst) of the link
    hardware: str                # "NIC" | "NVLink"
    both_ways: bool              # a link named a <-> b
    rating: float                # eq. (3), share of the window's critical excess
    impact_s: float              # seconds per iteration
    slow_collectives: int
    judged: int
    steps: tuple[tuple[str, int, int], ...]   # (group, seq, step) it slowed, first ones
    step_positions: tuple[int, ...]            # the step positions it slowed

    @property
    def name(self) -> str:
        if self.element == "rank":
            return f"{self.hardware} of rank {self.ranks[0]}"
        arrow = "<->" if self.both_ways else "->"
        return f"link {self.ranks[0]}{arrow}{self.ranks[1]} ({self.hardware})"


@dataclasses.dataclass(slots=True)
class _Window:
    """The window's flows as the rating needs them (step 1's output).

    ``p_*``: one row per (collective, src → dst pair) with the bytes over all its steps
    (traffic and participation of the tx port, link and rx port); ``t_*``: the flow steps
    that triggered; ``c_*``: the critical path's flow steps (collective, step, excess)."""

    p_coll: np.ndarray
    p_src: np.ndarray
    p_dst: np.ndarray
    p_bytes: np.ndarray
    p_kind: np.ndarray
    t_coll: np.ndarray
    t_s: np.ndarray
    t_src: np.ndarray
    t_dst: np.ndarray
    t_bytes: np.ndarray
    t_kind: np.ndarray
    c_coll: np.ndarray
    c_s: np.ndarray
    c_excess: np.ndarray
    coll_block: np.ndarray     # per collective id: (block, index in block)
    coll_index: np.ndarray


def triggers(blocks: list[StepBlock], cfg: ProvenanceConfig) -> _Window:
    """Step 1 on every block: baselines per (class, step position, flow slot), the flows that
    trigger with each step's budget, the critical path's excess, and per (collective, pair)
    traffic. Vectorised per block; only the triggered and critical flow steps are listed."""
    base_of: dict[tuple, list] = collections.defaultdict(list)
    for b in blocks:
        base_of[b.key].append(b)
    cols = collections.defaultdict(list)
    off = 0
    for bi, b in enumerate(blocks):
        dur = b.dur
        C, S, n, k = dur.shape
        peers = np.concatenate([x.dur for x in base_of[b.key]], axis=0)          # (C', S, n, k)
        cnt = np.isfinite(peers).sum(axis=(0, 2))                                # (S, k)
        with warnings.catch_warnings():         # an all-NaN slot (a tree's unused second child)
            warnings.simplefilter("ignore", RuntimeWarning)
            base = np.nanmedian(peers.transpose(1, 3, 0, 2).reshape(S, k, -1), axis=2)   # (S, k)
        base = np.where(cnt >= cfg.min_class_flows, base, np.nan)
        _, crit = critical_path(b)
        ok = b.dst >= 0
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = dur / base[None, :, None, :]
        slow = ok & np.isfinite(ratio) & (ratio >= cfg.slow_factor)
        # the budget: per (collective, step) the critical flow first, then by ratio
        c, s_, i, j = np.nonzero(slow)
        prio = ratio[c, s_, i, j] + np.where(crit[c, s_, i, j], 1e9, 0.0)
        order = np.lexsort((-prio, s_, c))
        c, s_, i, j = c[order], s_[order], i[order], j[order]
        grp = c.astype(np.int64) * S + s_
        keep = (np.arange(len(grp)) - np.searchsorted(grp, grp, side="left")) < cfg.triggers_per_step
        c, s_, i, j = c[keep], s_[keep], i[keep], j[keep]
        cols["t_coll"].append(off + c)
        cols["t_s"].append(s_)
        cols["t_src"].append(b.members[c, i])
        cols["t_dst"].append(b.dst[c, s_, i, j])
        cols["t_bytes"].append(b.nbytes[c, s_, i, j])
        cols["t_kind"].append(np.full(len(c), int(b.spans)))
        c, s_, i, j = np.nonzero(crit)
        cols["c_coll"].append(off + c)
        cols["c_s"].append(s_)
        cols["c_excess"].append(np.maximum(np.nan_to_num(dur[c, s_, i, j] - base[s_, j]), 0.0))
        # traffic per (collective, pair): the pairs are the block's (its step structure is shared)
        m0 = b.members[0]
        srt = np.argsort(m0)
        d0 = b.dst[0]
        dpos = np.where(d0 >= 0, srt[np.minimum(np.searchsorted(m0[srt], d0), n - 1)], -1)
        v = dpos >= 0
        ii = np.broadcast_to(np.arange(n)[None, :, None], dpos.shape)
        pk, pinv = np.unique(ii[v] * n + dpos[v], return_inverse=True)
        P = len(pk)
        pb = np.bincount((np.arange(C)[:, None] * P + pinv[None, :]).ravel(),
                         weights=b.nbytes[:, v].ravel().astype(float), minlength=C * P).reshape(C, P)
        cols["p_coll"].append(np.repeat(off + np.arange(C), P))
        cols["p_src"].append(b.members[:, pk // n].ravel())
        cols["p_dst"].append(b.members[:, pk % n].ravel())
        cols["p_bytes"].append(pb.ravel())
        cols["p_kind"].append(np.full(C * P, int(b.spans)))
        cols["coll_block"].append(np.full(C, bi))
        cols["coll_index"].append(np.arange(C))
        off += C
    names = [f.name for f in dataclasses.fields(_Window)]
    return _Window(**{f: (np.concatenate(cols[f]) if cols[f] else np.zeros(0, dtype=np.int64)) for f in names})


def rate(blocks: list[StepBlock], cfg: ProvenanceConfig = ProvenanceConfig(),
         iterations: float | None = None) -> list[RootCause]:
    """Steps 1-5 over the window's blocks; the named elements, best first."""
    if not blocks:
        return []
    f = triggers(blocks, cfg)
    if not len(f.t_coll):
        return []
    W = int(max(f.p_src.max(), f.p_dst.max())) + 1
    kind = f.t_kind.astype(np.int64)
    pkind = f.p_kind.astype(np.int64)
    # Step 2: elements. Ports: tx(r) = 4r + 2kind, rx(r) = 4r + 2kind + 1; links: (src*W+dst)*2 + kind.
    tx, rx = 4 * f.t_src + 2 * kind, 4 * f.t_dst + 2 * kind + 1
    ptx, prx = 4 * f.p_src + 2 * pkind, 4 * f.p_dst + 2 * pkind + 1
    tb = f.t_bytes.astype(float)
    q_port = np.bincount(np.concatenate([tx, rx]), weights=np.concatenate([tb, tb]), minlength=4 * W) \
        / np.maximum(np.bincount(np.concatenate([ptx, prx]), weights=np.concatenate([f.p_bytes, f.p_bytes]),
                                 minlength=4 * W), 1)
    plink = (f.p_src * W + f.p_dst) * 2 + pkind
    link = (f.t_src * W + f.t_dst) * 2 + kind
    lk, lk_all = np.unique(np.concatenate([plink, link]), return_inverse=True)
    plk, tlk = lk_all[:len(plink)], lk_all[len(plink):]
    q_link = np.bincount(tlk, weights=tb, minlength=len(lk)) / np.maximum(
        np.bincount(plk, weights=f.p_bytes, minlength=len(lk)), 1)
    # Step 3: per triggered flow, its elements' shares (eq. 2), ports mapped to their ranks (eq. 1)
    qt, qr, ql = q_port[tx], q_port[rx], q_link[tlk]
    tot = np.maximum(qt + qr + ql, 1e-12)
    # the step of a collective each triggered flow belongs to, and how many flows it triggered
    step_key = f.t_coll.astype(np.int64) * (1 << 24) + f.t_s
    uk, uinv, ucnt = np.unique(step_key, return_inverse=True, return_counts=True)
    # Step 4: exec − expect of the critical flow of each (collective, step) that triggered
    crit_key = f.c_coll.astype(np.int64) * (1 << 24) + f.c_s
    step_excess = np.zeros(len(uk))
    at = np.searchsorted(uk, crit_key)
    hit = (at < len(uk)) & (uk[np.minimum(at, len(uk) - 1)] == crit_key)
    step_excess[at[hit]] = f.c_excess[hit]
    total_excess = float(step_excess.sum())      # over the steps that triggered (collected ones)
    w = step_excess[uinv] / ucnt[uinv]              # each triggered flow's weight in eq. (3)
    if total_excess <= 0 or not (w > 0).any():
        return []
    src_t, dst_t = f.t_src, f.t_dst
    elem_rank = np.concatenate([src_t * 2 + kind, dst_t * 2 + kind])        # rank element: 2r + kind
    r_rank = np.bincount(elem_rank, weights=np.concatenate([w * qt / tot, w * qr / tot]), minlength=2 * W)
    r_link = np.bincount(tlk, weights=w * ql / tot, minlength=len(lk))
    norm = total_excess
    it = max(float(iterations or len({(bi, int(x)) for bi, b in enumerate(blocks) for x in np.unique(b.iteration)})
                   / max(len(blocks), 1)), 1.0)
    # Step 5: persistence per element: collectives it was slow in (triggered), and took part in
    part_rank = _distinct(np.concatenate([f.p_src * 2 + pkind, f.p_dst * 2 + pkind]),
                          np.concatenate([f.p_coll, f.p_coll]))
    slow_rank = _distinct(elem_rank, np.concatenate([f.t_coll, f.t_coll]))
    part_link = _distinct(plk, f.p_coll)
    slow_link = _distinct(tlk, f.t_coll)

    def persistent(slow_n: int, n: int) -> bool:
        return slow_n >= max(cfg.min_slow, cfg.min_share * n)

    lk_kind, lk_src, lk_dst = lk % 2, lk // 2 // W, lk // 2 % W
    cand = [("rank", int(e), r_rank[e] / norm) for e in np.flatnonzero(r_rank > 0)]
    cand += [("link", int(e), r_link[e] / norm) for e in np.flatnonzero(r_link > 0)]
    cand.sort(key=lambda x: -x[2])
    named: list[tuple] = []
    used: set[int] = set()
    for what, e, score in cand:
        if score < cfg.min_rating:
            break
        if what == "rank":
            r, kd = divmod(e, 2)
            if r in used or not persistent(slow_rank.get(e, 0), part_rank.get(e, 0)):
                continue
            # links at r (either direction) and other ranks that rate within the margin
            at_r = np.flatnonzero((lk_kind == kd) & ((lk_src == r) | (lk_dst == r)) & (r_link > 0))
            mine = [(int(lk_src[x]), int(lk_dst[x]), r_link[x] / norm, int(x)) for x in at_r]
            rivals = [x for x in mine if x[2] * cfg.margin > score]
            # the ranks at the other end of its persistently slow links: one only, and rating alike,
            # is the symmetric case (a 2-member ring, or one slow link of a rank with one peer)
            ends = {x[0] if x[1] == r else x[1] for x in mine if slow_link.get(x[3], 0) >= cfg.min_slow}
            alike = len(ends) < 2 and any(r_rank[2 * o + kd] / norm * cfg.margin > score for o in ends)
            if not rivals and not alike:
                named.append(("rank", (r,), kd, False, score, slow_rank.get(e, 0), part_rank.get(e, 0),
                              ((src_t == r) | (dst_t == r)) & (kind == kd)))
                used.add(r)
                continue
            # ambiguous: name the slow link(s) at r, the strongest first; both ways -> a <-> b
            mine.sort(key=lambda x: -x[2])
            if not mine:
                continue
            a, b_, _, x = mine[0]
            back = [m for m in mine if (m[0], m[1]) == (b_, a)]
            if a in used or b_ in used:
                continue
            both = bool(back) and back[0][2] * cfg.margin >= mine[0][2]
            if both:
                a, b_ = min(a, b_), max(a, b_)
            sel = (src_t == a) & (dst_t == b_)
            if both:
                sel |= (src_t == b_) & (dst_t == a)
            xs = [x] + ([back[0][3]] if both else [])
            n_slow = sum(slow_link.get(y, 0) for y in xs)
            n_part = sum(part_link.get(y, 0) for y in xs)
            if not persistent(n_slow, n_part):
                continue
            named.append(("link", (a, b_), kd, both, score, n_slow, n_part, sel & (kind == kd)))
            used.update((a, b_))
        else:
            kd = int(lk[e]) % 2
            a, b_ = divmod(int(lk[e]) // 2, W)
            if a in used or b_ in used or not persistent(slow_link.get(e, 0), part_link.get(e, 0)):
                continue
            sel = (src_t == a) & (dst_t == b_) & (kind == kd)
            named.append(("link", (a, b_), kd, False, score, slow_link.get(e, 0), part_link.get(e, 0), sel))
            used.update((a, b_))
    # impact: the excess of the triggered steps an element's flows slowed, shared by the named
    # elements slowing the same step (what removing it gives back, per iteration)
    share = np.zeros(len(uk))
    for x in named:
        share[np.unique(uinv[x[7]])] += 1
    return [_cause(f, what, ranks, kd, both, score,
                   float((step_excess[u] / share[u]).sum()) if len(u := np.unique(uinv[sel])) else 0.0,
                   it, n_slow, n_part, sel, blocks)
            for what, ranks, kd, both, score, n_slow, n_part, sel in named]


def _distinct(elem: np.ndarray, key: np.ndarray) -> dict[int, int]:
    """Per element, the number of distinct keys (collectives) it occurs with."""
    if not len(elem):
        return {}
    _, kid = np.unique(key, return_inverse=True)
    pair = np.unique(elem.astype(np.int64) * (int(kid.max()) + 1) + kid)
    e, n = np.unique(pair // (int(kid.max()) + 1), return_counts=True)
    return dict(zip(e.tolist(), n.tolist()))


def _cause(f: _Window, element: str, ranks: tuple, kd: int, both: bool, score: float,
           impact_ns: float, it: float, slow_n: int, judged: int, sel: np.ndarray, blocks) -> RootCause:
    """A named element with the steps its triggered flows slowed and its impact per iteration.

    ``impact_ns``: the critical excess of the steps it slowed (step 5), over the window."""
    idx = np.flatnonzero(sel)
    steps = sorted({(blocks[int(f.coll_block[c])].gid[int(f.coll_index[c])],
                     int(blocks[int(f.coll_block[c])].seq[int(f.coll_index[c])]), int(s))
                    for c, s in zip(f.t_coll[idx[:4096]].tolist(), f.t_s[idx[:4096]].tolist())})
    return RootCause(element=element, ranks=tuple(int(r) for r in ranks), hardware="NIC" if kd else "NVLink",
                     both_ways=both, rating=round(float(score), 4), impact_s=float(impact_ns) / it / 1e9,
                     slow_collectives=int(slow_n), judged=int(judged), steps=tuple(steps[:16]),
                     step_positions=tuple(sorted({int(x) for x in f.t_s[idx]})))


def root_cause(job_id: str, window: records_pb2.Window, blocks: list[StepBlock], hosts: Mapping[int, str],
               iterations: float | None = None, config: ProvenanceConfig = ProvenanceConfig(),
               step_ns: float = 0.0) -> list[Finding]:
    """Steps 1-5 as findings of level ``collectives``, kind ``slow_link``, role ``link``."""
    out = []
    for rc in rate(blocks, config, iterations):
        hs = [hosts.get(r, "") for r in rc.ranks]
        ev = {"link": rc.name + (f" ({' -> '.join(h for h in hs if h)})" if any(hs) else ""),
              "hardware": rc.hardware, "element": rc.element, "rating": rc.rating,
              "impact_s": rc.impact_s, "slow_collectives": rc.slow_collectives, "judged": rc.judged,
              "steps": [list(s) for s in rc.steps], "step_positions": list(rc.step_positions),
              "function": f"slow {rc.name}", "host": hs[0] if len(set(hs)) == 1 else ""}
        sus = tuple(SuspectRank(r, rc.rating, ev, impact_ns=rc.impact_s * 1e9, role=LINK) for r in rc.ranks)
        out.append(Finding(level="collectives", kind=KIND, job_id=job_id, window=window,
                           scope=Scope(group="collective"), suspects=sus, severity=rc.rating, comparison="peers",
                           step_ns=step_ns,
                           evidence={"communication": True, "links": rc.name, "ranks": list(rc.ranks),
                                     "hosts": hs, "rule": "Vedrfolnir §III-D contributor rating (eqs. 1-3)"}))
    return out


def collect(collectives: Iterable, hosts: Mapping[int, str]) -> list[StepBlock]:
    """The window's joined collectives with step records as blocks (``waiting_graph.step_blocks``)."""
    return step_blocks(collectives, hosts)


__all__ = ["ProvenanceConfig", "RootCause", "collect", "rate", "root_cause", "triggers"]
