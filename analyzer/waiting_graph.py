"""Slow links from the ring steps of collectives: Vedrfolnir's waiting graph (§III), Mycroft §5.

Input: the collectives of one analysed window, complete on every member,
joined by (group, seq) (``collectives.CollectiveState``), whose records carry
the ring decomposition (``CollectiveRecord.ring_*``: each member's outgoing
flow to ``ring_next``, its busy time summed over its 2(n−1) or n−1 steps and
the time its steps waited for the previous member's data). Today the
simulator gives them; NCCL's profiler plugin would. Records without it are
left to the late-start rule.

1. The waiting graph of one ring collective (Vedrfolnir §III-B, Fig. 4):
   step s of a flow waits for its own step s−1 and for the previous member's
   step s−1. The flow that never waits (Table I: "non-waiting") is the
   busiest; every other flow waits on it through its predecessors, so the
   critical path runs along the busiest flow and the collective's transfer
   is its busy time. Its excess over what such a flow usually takes is what
   the slow link cost that collective.
2. What a flow usually takes: the median busy time, in this window, of every
   flow of the same class: (op, size class, steps, whether the group spans
   hosts). The class spans groups, so a 2-member ring whose both flows are
   slow (a tensor-parallel pair on a degraded NVLink) is still compared with
   its sibling pairs. Assumption: most links of a class are healthy (a fault
   on every link of a class is the whole job's: ``job_pace``'s, not a link's).
3. A flow is slow in a collective when its busy time is ``slow_factor`` times
   that median; a link (src → dst) is slow in the window when it was slow in
   at least ``min_share`` of its collectives there and in ``min_slow`` of
   them (random spikes of healthy noise are not persistent; an intermittent
   congestion on a fifth of the iterations is).
4. Hardware behind the slow links (Mycroft §5: from the affected ranks to the
   root cause): a rank every link of which is slow, in and out, within groups
   of one kind (spanning hosts: its NIC; inside a host: its NVLink), is the
   culprit: a degraded NIC slows every step its rank sends or receives. Its
   links are judged together: each was slow at least once and, pooled, in
   ``min_share`` and ``min_slow`` of their collectives (a grad-norm ring runs
   once an iteration: a congestion burst of two iterations leaves it two slow
   collectives, too few alone). A slow link neither of whose ends is such a
   rank is named as the link (src → dst ranks and hosts).
5. Impact: the excess (step 1) of every collective, shared by its slow flows
   (a congested host slows several links of one ring: none of them alone is
   the critical path), summed over the element's links, per iteration of the
   rank; findings of
   level ``collectives``, kind ``slow_link``, role ``link`` in the verdict.

Where records carry every step (fields 14-19, ``step_blocks`` stacks them
per shape; ``provenance.py`` rates them):

6. The step waiting graph (§III-B, Fig. 4): a vertex per flow step, its dark
   edge its duration, light edges from the member's own previous step and
   from the flows that sent it data in the previous step (``critical_path``).
7. Its critical path (§III-D1): the longest path, traced back along the
   edges that set each step's start.
8. Waiting status (§III-C1, Table I): who waited for whom at which step, from
   each rank's own clock (``waits``).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Mapping

import numpy as np

from trainscope.analyzer.model import LINK, Finding, Scope, SuspectRank
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import records_pb2

KIND = "slow_link"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WaitingGraphConfig:
    slow_factor: float = 1.6
    """Step 3: a flow this many times its class's median busy time is slow in that collective."""
    min_share: float = 0.2
    """Step 3: share of a link's collectives of the window in which it must be slow."""
    min_slow: int = 3
    """Step 3: ... and at least this many of them."""
    min_class_flows: int = 8
    """Step 2: flows of a class in the window before its median is a baseline."""

    def __post_init__(self) -> None:
        if not self.slow_factor > 1:
            raise ConfigError("analyzer.collectives.waiting_graph.slow_factor", self.slow_factor, "must be > 1")
        if not 0 < self.min_share <= 1:
            raise ConfigError("analyzer.collectives.waiting_graph.min_share", self.min_share, "must be in (0, 1]")
        for f in ("min_slow", "min_class_flows"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"analyzer.collectives.waiting_graph.{f}", v, "must be an integer >= 1")


#: One joined collective: (group id, members, {rank: row}); row as ``collectives._Group.seqs`` keeps it:
#: (op, bytes, enqueue_ns, end_ns, iteration, ring_steps, ring_next, send_busy_ns, recv_wait_ns).
Collective = tuple[str, tuple[int, ...], Mapping[int, tuple]]


@dataclasses.dataclass(slots=True)
class _Link:
    n: int = 0
    slow: int = 0
    ratios: list = dataclasses.field(default_factory=list)
    excess_ns: float = 0.0
    groups: set = dataclasses.field(default_factory=set)
    first: tuple | None = None     # (group, seq, op) of the first collective it was slow in
    iterations: set = dataclasses.field(default_factory=set)   # iterations it was slow in (step 8)


def slow_links(job_id: str, window: records_pb2.Window, collectives: Iterable[tuple[str, tuple[int, ...], int,
               Mapping[int, tuple]]], hosts: Mapping[int, str], iterations: Mapping[int, float] | None = None,
               config: WaitingGraphConfig = WaitingGraphConfig(), step_ns: float = 0.0) -> list[Finding]:
    """Steps 1-5 over ``collectives``: (group id, members, seq, {rank: row}) each."""
    cfg = config
    flows = []          # (class, src, dst, busy, gid, seq, op, critical, iteration), one collective's flows together
    for gid, members, seq, row in collectives:
        if len(members) < 2 or any(m not in row or len(row[m]) < 9 or not row[m][5] or row[m][7] <= 0
                                   for m in members):
            continue
        spans = len({hosts.get(m, "") for m in members}) > 1
        busiest = max(members, key=lambda m: row[m][7])
        iteration = max(int(row[m][4]) for m in members)
        for m in members:
            op, nbytes, _, _, _, steps, nxt, busy, _ = row[m][:9]
            flows.append(((op, int(nbytes).bit_length(), int(steps), spans), m, int(nxt), float(busy), gid, seq, op,
                          m == busiest, iteration))
    if not flows:
        return []
    by_class: dict[tuple, list[float]] = collections.defaultdict(list)   # step 2
    for f in flows:
        by_class[f[0]].append(f[3])
    base = {k: float(np.median(v)) for k, v in by_class.items() if len(v) >= cfg.min_class_flows}
    links: dict[tuple[int, int, bool], _Link] = collections.defaultdict(_Link)   # step 3
    excess: dict[tuple[str, int], float] = {}                 # (group, seq) -> the critical flow's excess
    slow_in: dict[tuple[str, int], list] = collections.defaultdict(list)
    for cls, src, dst, busy, gid, seq, op, critical, iteration in flows:
        b = base.get(cls)
        if not b or b <= 0:
            continue
        ln = links[(src, dst, cls[3])]
        ln.n += 1
        ln.groups.add(gid)
        ratio = busy / b
        if ratio >= cfg.slow_factor:
            ln.slow += 1
            ln.ratios.append(ratio)
            ln.iterations.add(iteration)
            slow_in[(gid, seq)].append(ln)
            if ln.first is None:
                ln.first = (gid, seq, op)
        if critical:
            excess[(gid, seq)] = max(0.0, busy - b)
    for key, lns in slow_in.items():     # step 5: shared by the collective's slow flows
        for ln in lns:
            ln.excess_ns += excess.get(key, 0.0) / len(lns)
    persistent = lambda slow_n, n: slow_n >= max(cfg.min_slow, cfg.min_share * n)  # noqa: E731
    slow = {k for k, ln in links.items() if persistent(ln.slow, ln.n)}
    # step 4: ranks every link of which (of one kind) is slow, judged pooled
    of_rank: dict[tuple[int, bool], set] = collections.defaultdict(set)
    for k in links:
        of_rank[(k[0], k[2])].add(k)
        of_rank[(k[1], k[2])].add(k)
    culprits = {rk: ks for rk, ks in of_rank.items()
                if len(ks) >= 2 and all(links[k].slow for k in ks)
                and persistent(sum(links[k].slow for k in ks), sum(links[k].n for k in ks))}
    if not slow and not culprits:
        return []
    claimed = set().union(*culprits.values()) if culprits else set()
    out: list[Finding] = []
    it = lambda r: max(float((iterations or {}).get(r, 1.0)), 1.0)  # noqa: E731
    for (rank, spans), ks in sorted(culprits.items()):
        excess = sum(links[k].excess_ns for k in ks)
        ratios = [x for k in ks for x in links[k].ratios]
        what = "NIC" if spans else "NVLink"
        host = hosts.get(rank, "")
        desc = ", ".join(f"{s}->{d}" for s, d, _ in sorted(ks))
        ev = {"link": f"{what} of rank {rank}" + (f" ({host})" if host else ""), "hardware": what,
              "links": desc, "host": host, "ratio": round(float(np.median(ratios)), 3),
              # the place persistence follows from window to window: stable while the links vary
              "function": f"slow {what} of rank {rank}" + (f" ({host})" if host else ""),
              "slow_collectives": sum(links[k].slow for k in ks), "judged": sum(links[k].n for k in ks),
              "slow_iterations": sorted(set().union(*(links[k].iterations for k in ks)))}
        out.append(_finding(job_id, window, rank, ev, excess / it(rank), step_ns,
                            {"links": desc, "hardware": what, "rank": rank, "host": host}))
    for k in sorted(slow - claimed):
        src, dst, spans = k
        ln = links[k]
        hs, hd = hosts.get(src, ""), hosts.get(dst, "")
        desc = f"{src}->{dst}"
        ev = {"link": f"rank {src} -> rank {dst}" + (f" ({hs} -> {hd})" if hs or hd else ""), "hardware": "link",
              "links": desc, "ratio": round(float(np.median(ln.ratios)), 3), "slow_collectives": ln.slow,
              "judged": ln.n, "function": f"slow link {desc}",
              "src_host": hs, "dst_host": hd, "slow_iterations": sorted(ln.iterations)}
        if ln.first is not None:
            ev.update(group=ln.first[0], seq=ln.first[1], op=ln.first[2])
        sus = tuple(SuspectRank(r, ev["ratio"], ev, impact_ns=ln.excess_ns / it(r), role=LINK) for r in (src, dst))
        out.append(Finding(level="collectives", kind=KIND, job_id=job_id, window=window,
                           scope=Scope(group="collective"), suspects=sus, severity=ev["ratio"], comparison="peers",
                           step_ns=step_ns, evidence={"communication": True, "links": desc, "src": src, "dst": dst,
                                                      "src_host": hs, "dst_host": hd,
                                                      "rule": "Vedrfolnir §III waiting graph: slow link"}))
    return out


def _finding(job_id, window, rank, ev, impact_ns, step_ns, extra) -> Finding:
    return Finding(level="collectives", kind=KIND, job_id=job_id, window=window, scope=Scope(group="collective"),
                   suspects=(SuspectRank(rank, ev["ratio"], ev, impact_ns=impact_ns, role=LINK),),
                   severity=ev["ratio"], comparison="peers", step_ns=step_ns,
                   evidence={"communication": True, "rule": "Vedrfolnir §III waiting graph: every link of a rank slow",
                             **extra})


# ------------------------------------------------------------ step records (Vedrfolnir §III-B, §III-D1)


@dataclasses.dataclass(slots=True, eq=False)
class StepBlock:
    """Collectives of one shape, their flows stacked (C, S, n, k): same op, algorithm, member
    count, span (inside a host or across hosts), size class and step structure, so that the
    waiting graph of all of them is one array recurrence. Times are offsets on each rank's
    own clock (only durations and one rank's own differences are used: clock-free)."""

    op: str
    algo: str
    spans: bool
    gid: list            # (C,) group ids
    seq: np.ndarray      # (C,)
    iteration: np.ndarray  # (C,)
    members: np.ndarray  # (C, n) global ranks, group order
    dst: np.ndarray      # (C, S, n, k) global rank, −1: no flow
    nbytes: np.ndarray   # (C, S, n, k)
    start: np.ndarray    # (C, S, n, k) ns from the rank's record start (NaN: no flow)
    end: np.ndarray
    inc: np.ndarray      # (S, n, kin) flat (i*k + j) flows of step s sending to member i (−1: none)

    @property
    def dur(self) -> np.ndarray:
        return self.end - self.start

    @property
    def key(self) -> tuple:
        """The class a step's baseline is taken over (``provenance`` step 1)."""
        return (self.op, self.algo, self.members.shape[1], self.spans, int(np.nanmax(self.nbytes)).bit_length())


def step_blocks(collectives: Iterable[tuple[str, tuple[int, ...], int, Mapping[int, object]]],
                hosts: Mapping[int, str]) -> list[StepBlock]:
    """Step records of joined collectives, (group id, members, seq, {rank: CollectiveRecord}) each,
    stacked into ``StepBlock`` s. A collective some member of which sent no steps is left out."""
    groups: dict[tuple, list] = collections.defaultdict(list)
    for gid, members, seq, recs in collectives:
        n = len(members)
        if n < 2 or any(m not in recs or not len(getattr(recs[m], "step_index", ())) for m in members):
            continue
        mem = np.asarray(members, dtype=np.int64)
        srt = np.argsort(mem)
        per = []
        for m in members:
            r = recs[m]
            si = np.asarray(r.step_index, dtype=np.int64)
            g = np.asarray(r.step_dst, dtype=np.int64)
            d = srt[np.minimum(np.searchsorted(mem[srt], g), n - 1)]        # group position of each dst
            if len(d) != len(si) or not (mem[d] == g).all():
                break
            per.append((si, d, np.asarray(r.step_bytes, dtype=np.int64), np.asarray(r.step_start_ns, dtype=float),
                        np.asarray(r.step_end_ns, dtype=float)))
        else:
            S = 1 + max(int(p[0].max()) for p in per)
            slot = []
            for si, *_ in per:        # j: the flow's place among the member's flows of its step
                first = np.searchsorted(si, si, side="left")
                slot.append(np.arange(len(si)) - first)
            k = 1 + max(int(j.max()) for j in slot)
            dst = np.full((S, n, k), -1, dtype=np.int64)
            arr = np.full((4, S, n, k), np.nan)
            for i, ((si, d, b, st, en), j) in enumerate(zip(per, slot)):
                dst[si, i, j] = d
                arr[0, si, i, j], arr[1, si, i, j], arr[2, si, i, j] = b, st, en
            r0 = recs[members[0]]
            spans = len({hosts.get(int(m), "") for m in members}) > 1
            key = (r0.op, r0.algo, n, spans, int(np.nanmax(arr[0])).bit_length(), dst.tobytes())
            groups[key].append((gid, seq, int(r0.iteration), np.asarray(members, dtype=np.int64), dst, arr))
    out = []
    for key, xs in groups.items():
        pd = xs[0][4]
        members = np.stack([x[3] for x in xs])
        dst_pos = np.broadcast_to(pd, (len(xs),) + pd.shape)
        dst = np.where(dst_pos >= 0, np.take_along_axis(
            members[:, None, :, None].repeat(pd.shape[0], 1).repeat(pd.shape[2], 3).reshape(len(xs), -1),
            np.maximum(dst_pos, 0).reshape(len(xs), -1), axis=1).reshape(dst_pos.shape), -1)
        arr = np.stack([x[5] for x in xs], axis=1)
        out.append(StepBlock(op=key[0], algo=key[1], spans=key[3], gid=[x[0] for x in xs],
                             seq=np.asarray([x[1] for x in xs], dtype=np.int64),
                             iteration=np.asarray([x[2] for x in xs], dtype=np.int64), members=members, dst=dst,
                             nbytes=np.nan_to_num(arr[0]).astype(np.int64), start=arr[1], end=arr[2],
                             inc=incoming(pd)))
    return out


def incoming(dst_pos: np.ndarray) -> np.ndarray:
    """(S, n, kin): per step and member the flat indices (i*k + j) of the flows sending to it."""
    S, n, k = dst_pos.shape
    flat = dst_pos.reshape(S, n * k)
    s_idx, f_idx = np.nonzero(flat >= 0)
    d = flat[s_idx, f_idx]
    key = s_idx * n + d
    order = np.argsort(key, kind="stable")
    s_idx, f_idx, d, key = s_idx[order], f_idx[order], d[order], key[order]
    pos = np.arange(len(key)) - np.searchsorted(key, key, side="left")
    out = np.full((S, n, int(pos.max(initial=0)) + 1), -1, dtype=np.int64)
    out[s_idx, d, pos] = f_idx
    return out


def critical_path(b: StepBlock) -> tuple[np.ndarray, np.ndarray]:
    """Steps 6-7 (Vedrfolnir §III-B graph, §III-D1 critical path), every collective of the block at once.

    6. The waiting graph: a vertex per flow step; its dark edge weighs the step's duration
       (its own clock); light edges (weight 0) from the member's own previous flows and
       from the flows of the previous step that sent it data. ``L`` is the longest path
       to each flow step's end, one step at a time over the whole block: member i starts
       step s after ``ready_i``, the longest of its own and its incoming flows so far.
    7. The critical path: from the flow step with the longest ``L``, back along the edge
       that set each step's ``ready`` (pruning the vertices nobody waited on).

    Returns ``L`` (C, S, n, k) and the critical mask (C, S, n, k)."""
    dur = b.dur
    C, S, n, k = dur.shape
    L = np.full(dur.shape, np.nan)
    ready = np.zeros((C, n))
    arg_s = np.full((C, n), -1, dtype=np.int64)        # the flow step that set ready: step, flat flow
    arg_f = np.full((C, n), -1, dtype=np.int64)
    pred_s = np.full((C, S, n), -1, dtype=np.int64)
    pred_f = np.full((C, S, n), -1, dtype=np.int64)
    for s in range(S):
        ok = b.dst[:, s] >= 0
        pred_s[:, s], pred_f[:, s] = arg_s, arg_f
        L[:, s] = np.where(ok, ready[:, :, None] + np.where(ok, dur[:, s], 0.0), np.nan)
        Ls = np.where(ok, L[:, s], -np.inf).reshape(C, n * k)
        own = Ls.reshape(C, n, k)
        j_own = own.argmax(axis=2)
        v_own = own.max(axis=2)
        inc = b.inc[s]
        v_in_all = np.where(inc >= 0, Ls[:, np.maximum(inc, 0)], -np.inf)         # (C, n, kin)
        j_in = np.take_along_axis(np.broadcast_to(inc, v_in_all.shape), v_in_all.argmax(axis=2)[..., None],
                                  axis=2)[..., 0]
        v_in = v_in_all.max(axis=2)
        best = np.maximum(v_own, v_in)
        upd = best > ready
        from_own = v_own >= v_in
        arg_s = np.where(upd, s, arg_s)
        arg_f = np.where(upd, np.where(from_own, np.arange(n)[None] * k + j_own, j_in), arg_f)
        ready = np.where(upd, best, ready)
    crit = np.zeros(dur.shape, dtype=bool)
    flat = np.where(np.isfinite(L), L, -np.inf).reshape(C, -1)
    at = flat.argmax(axis=1)
    cs, cf = at // (n * k), at % (n * k)
    live = np.isfinite(flat[np.arange(C), at])
    for _ in range(S):
        if not live.any():
            break
        c = np.flatnonzero(live)
        crit[c, cs[c], cf[c] // k, cf[c] % k] = True
        ps, pf = pred_s[c, cs[c], cf[c] // k], pred_f[c, cs[c], cf[c] // k]
        cs[c], cf[c] = ps, pf
        live[c] = ps >= 0
    return L, crit


def waits(b: StepBlock, L: np.ndarray, *, tol_ns: float = 0.0) -> list[tuple[str, int, int, int, int, float]]:
    """Step 8 (Vedrfolnir Table I, waiting status): who waited for whom at which step.

    Member i waited before step s when it started s later, on its own clock, than its own
    flows of earlier steps ended (by more than ``tol_ns``); it waited for the member whose
    data of the step before, by the waiting graph's ``L``, came last. Returns
    (group, seq, step, waiter, waited for, wait ns) tuples."""
    C, S, n, k = b.dst.shape
    out = []
    own_end = np.full((C, n), np.nan)
    for s in range(S):
        ok = b.dst[:, s] >= 0
        st = np.where(ok, b.start[:, s], np.inf).min(axis=2)
        w = st - own_end
        if s:
            inc = b.inc[s - 1]
            Lp = np.where(b.dst[:, s - 1] >= 0, L[:, s - 1], -np.inf).reshape(C, n * k)
            v = np.where(inc >= 0, Lp[:, np.maximum(inc, 0)], -np.inf)
            j = np.take_along_axis(np.broadcast_to(inc, v.shape), v.argmax(axis=2)[..., None], axis=2)[..., 0]
            src = np.where(j >= 0, j // k, -1)
            hit = np.isfinite(w) & (w > tol_ns) & (src >= 0)
            for c, i in zip(*np.nonzero(hit)):
                out.append((b.gid[c], int(b.seq[c]), s, int(b.members[c, i]), int(b.members[c, src[c, i]]),
                            float(w[c, i])))
        en = np.where(ok, b.end[:, s], -np.inf).max(axis=2)
        own_end = np.where(ok.any(axis=2), np.fmax(own_end, en), own_end)
    return out


__all__ = ["KIND", "StepBlock", "WaitingGraphConfig", "critical_path", "slow_links", "step_blocks", "waits"]
