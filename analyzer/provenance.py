"""Collective root cause from step records: triggers, provenance graph, contributor rating (Vedrfolnir §III-C, §III-D).

Input: ``waiting_graph.StepBlock`` s of one analysed window (the step
records of ``CollectiveRecord`` fields 14-19, the simulator's
``use_step_records`` today; NCCL's profiler plugin would give them), with
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
from trainscope.analyzer.waiting_graph import KIND, StepBlock, critical_path
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
class _Flows:
    """Every flow step of the window, flat (one array per column)."""

    block: np.ndarray
    c: np.ndarray
    s: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    excess: np.ndarray
    trig: np.ndarray
    crit: np.ndarray
    spans: np.ndarray


def triggers(blocks: list[StepBlock], cfg: ProvenanceConfig) -> tuple[_Flows, list[np.ndarray]]:
    """Step 1 on every block: baselines per (class, step position, flow slot), triggers with
    their per-step budget. Returns the flat flow table and each block's critical mask."""
    base_of: dict[tuple, list] = collections.defaultdict(list)
    for b in blocks:
        base_of[b.key].append(b)
    cols = collections.defaultdict(list)
    crits = []
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
        crits.append(crit)
        ok = b.dst >= 0
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = dur / base[None, :, None, :]
        slow = ok & np.isfinite(ratio) & (ratio >= cfg.slow_factor)
        # the budget: critical flow first, then by ratio, per (collective, step)
        prio = np.where(slow, np.nan_to_num(ratio) + np.where(crit, 1e9, 0.0), -np.inf).reshape(C, S, n * k)
        order = np.argsort(-prio, axis=2, kind="stable")
        rank_in = np.empty_like(order)
        np.put_along_axis(rank_in, order, np.arange(n * k)[None, None], axis=2)
        trig = slow & (rank_in.reshape(dur.shape) < cfg.triggers_per_step)
        c, s, i, j = np.nonzero(ok)
        cols["block"].append(np.full(len(c), bi))
        cols["c"].append(c)
        cols["s"].append(s)
        cols["src"].append(b.members[c, i])
        cols["dst"].append(b.dst[c, s, i, j])
        cols["nbytes"].append(b.nbytes[c, s, i, j])
        cols["excess"].append(np.maximum(np.nan_to_num(dur[c, s, i, j] - base[s, j]), 0.0))
        cols["trig"].append(trig[c, s, i, j])
        cols["crit"].append(crit[c, s, i, j])
        cols["spans"].append(np.full(len(c), b.spans))
    cat = {f: (np.concatenate(v) if v else np.zeros(0)) for f, v in cols.items()}
    if not cat:
        z = np.zeros(0, dtype=np.int64)
        return _Flows(z, z, z, z, z, z, z.astype(float), z.astype(bool), z.astype(bool), z.astype(bool)), crits
    return _Flows(**cat), crits


def rate(blocks: list[StepBlock], cfg: ProvenanceConfig = ProvenanceConfig(),
         iterations: float | None = None) -> list[RootCause]:
    """Steps 1-5 over the window's blocks; the named elements, best first."""
    if not blocks:
        return []
    f, _ = triggers(blocks, cfg)
    if not f.trig.any():
        return []
    W = int(max(f.src.max(), f.dst.max())) + 1
    kind = f.spans.astype(np.int64)
    # Step 2: elements. Ports: tx(r) = 4r + 2kind, rx(r) = 4r + 2kind + 1; links: src*W+dst, per kind.
    tx, rx = 4 * f.src + 2 * kind, 4 * f.dst + 2 * kind + 1
    link = (f.src * W + f.dst) * 2 + kind
    trig_b = np.where(f.trig, f.nbytes, 0)
    q_port = np.bincount(np.concatenate([tx, rx]), weights=np.concatenate([trig_b, trig_b]), minlength=4 * W) \
        / np.maximum(np.bincount(np.concatenate([tx, rx]), weights=np.concatenate([f.nbytes, f.nbytes]),
                                 minlength=4 * W), 1)
    lk, lk_inv = np.unique(link, return_inverse=True)
    q_link = np.bincount(lk_inv, weights=trig_b) / np.maximum(np.bincount(lk_inv, weights=f.nbytes), 1)
    # Step 3: per triggered flow, its elements' shares (eq. 2), ports mapped to their ranks (eq. 1)
    t = np.flatnonzero(f.trig)
    qt, qr, ql = q_port[tx[t]], q_port[rx[t]], q_link[lk_inv[t]]
    tot = np.maximum(qt + qr + ql, 1e-12)
    # the step of a collective each triggered flow belongs to, and how many flows it triggered
    step_key = (f.block[t].astype(np.int64) * (1 << 40)) + f.c[t].astype(np.int64) * (1 << 20) + f.s[t]
    uk, uinv, ucnt = np.unique(step_key, return_inverse=True, return_counts=True)
    # Step 4: exec − expect of the critical flow of each (collective, step) that triggered
    cr = np.flatnonzero(f.crit)
    crit_key = (f.block[cr].astype(np.int64) * (1 << 40)) + f.c[cr].astype(np.int64) * (1 << 20) + f.s[cr]
    step_excess = np.zeros(len(uk))
    at = np.searchsorted(uk, crit_key)
    hit = (at < len(uk)) & (uk[np.minimum(at, len(uk) - 1)] == crit_key)
    step_excess[at[hit]] = f.excess[cr[hit]]
    total_excess = float(step_excess.sum())      # over the steps that triggered (collected ones)
    w = step_excess[uinv] / ucnt[uinv]              # each triggered flow's weight in eq. (3)
    if total_excess <= 0 or not (w > 0).any():
        return []
    src_t, dst_t = f.src[t], f.dst[t]
    elem_rank = np.concatenate([src_t * 2 + kind[t], dst_t * 2 + kind[t]])        # rank element: 2r + kind
    r_rank = np.bincount(elem_rank, weights=np.concatenate([w * qt / tot, w * qr / tot]), minlength=2 * W)
    r_link = np.bincount(lk_inv[t], weights=w * ql / tot, minlength=len(lk))
    norm = total_excess
    it = max(float(iterations or len({(bi, int(x)) for bi, b in enumerate(blocks) for x in np.unique(b.iteration)})
                   / max(len(blocks), 1)), 1.0)
    # Step 5: persistence per element: collectives it was slow in (triggered), and took part in
    coll_key = f.block.astype(np.int64) * (1 << 40) + f.c.astype(np.int64) * (1 << 20)
    part_rank = _distinct(np.concatenate([f.src * 2 + kind, f.dst * 2 + kind]), np.concatenate([coll_key, coll_key]))
    slow_rank = _distinct(elem_rank, np.concatenate([coll_key[t], coll_key[t]]))
    part_link = _distinct(lk_inv, coll_key)
    slow_link = _distinct(lk_inv[t], coll_key[t])

    def persistent(slow_n: int, n: int) -> bool:
        return slow_n >= max(cfg.min_slow, cfg.min_share * n)

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
            mine = [(int(lk[x]) // 2 // W, int(lk[x]) // 2 % W, r_link[x] / norm, x) for x in range(len(lk))
                    if int(lk[x]) % 2 == kd and r in (int(lk[x]) // 2 // W, int(lk[x]) // 2 % W)
                    and r_link[x] > 0]
            rivals = [x for x in mine if x[2] * cfg.margin > score]
            # the ranks at the other end of its persistently slow links: one only, and rating alike,
            # is the symmetric case (a 2-member ring, or one slow link of a rank with one peer)
            ends = {x[0] if x[1] == r else x[1] for x in mine if slow_link.get(x[3], 0) >= cfg.min_slow}
            alike = len(ends) < 2 and any(r_rank[2 * o + kd] / norm * cfg.margin > score for o in ends)
            if not rivals and not alike:
                named.append(("rank", (r,), kd, False, score, slow_rank.get(e, 0), part_rank.get(e, 0),
                              ((src_t == r) | (dst_t == r)) & (kind[t] == kd)))
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
            named.append(("link", (a, b_), kd, both, score, n_slow, n_part, sel & (kind[t] == kd)))
            used.update((a, b_))
        else:
            kd = int(lk[e]) % 2
            a, b_ = divmod(int(lk[e]) // 2, W)
            if a in used or b_ in used or not persistent(slow_link.get(e, 0), part_link.get(e, 0)):
                continue
            sel = (src_t == a) & (dst_t == b_) & (kind[t] == kd)
            named.append(("link", (a, b_), kd, False, score, slow_link.get(e, 0), part_link.get(e, 0), sel))
            used.update((a, b_))
    # impact: the excess of the triggered steps an element's flows slowed, shared by the named
    # elements slowing the same step (what removing it gives back, per iteration)
    share = np.zeros(len(uk))
    for x in named:
        share[np.unique(uinv[x[7]])] += 1
    return [_cause(f, t, what, ranks, kd, both, score,
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


def _cause(f: _Flows, t: np.ndarray, element: str, ranks: tuple, kd: int, both: bool, score: float,
           impact_ns: float, it: float, slow_n: int, judged: int, sel: np.ndarray, blocks) -> RootCause:
    """A named element with the steps its triggered flows slowed and its impact per iteration.

    ``impact_ns``: the critical excess of the steps it slowed (step 5), over the window."""
    idx = t[sel]
    steps = sorted({(blocks[int(f.block[x])].gid[int(f.c[x])], int(blocks[int(f.block[x])].seq[int(f.c[x])]),
                     int(f.s[x])) for x in idx[:4096]})
    return RootCause(element=element, ranks=tuple(int(r) for r in ranks), hardware="NIC" if kd else "NVLink",
                     both_ways=both, rating=round(float(score), 4), impact_s=float(impact_ns) / it / 1e9,
                     slow_collectives=int(slow_n), judged=int(judged), steps=tuple(steps[:16]),
                     step_positions=tuple(sorted({int(x) for x in f.s[idx]})))


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
    from trainscope.analyzer.waiting_graph import step_blocks

    return step_blocks(collectives, hosts)


__all__ = ["ProvenanceConfig", "RootCause", "collect", "rate", "root_cause", "triggers"]
