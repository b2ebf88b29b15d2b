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


def slow_links(job_id: str, window: records_pb2.Window, collectives: Iterable[tuple[str, tuple[int, ...], int,
               Mapping[int, tuple]]], hosts: Mapping[int, str], iterations: Mapping[int, float] | None = None,
               config: WaitingGraphConfig = WaitingGraphConfig(), step_ns: float = 0.0) -> list[Finding]:
    """Steps 1-5 over ``collectives``: (group id, members, seq, {rank: row}) each."""
    cfg = config
    flows = []          # (class, src, dst, busy, gid, seq, op, critical), one collective's flows together
    for gid, members, seq, row in collectives:
        if len(members) < 2 or any(m not in row or len(row[m]) < 9 or not row[m][5] or row[m][7] <= 0
                                   for m in members):
            continue
        spans = len({hosts.get(m, "") for m in members}) > 1
        busiest = max(members, key=lambda m: row[m][7])
        for m in members:
            op, nbytes, _, _, _, steps, nxt, busy, _ = row[m][:9]
            flows.append(((op, int(nbytes).bit_length(), int(steps), spans), m, int(nxt), float(busy), gid, seq, op,
                          m == busiest))
    if not flows:
        return []
    by_class: dict[tuple, list[float]] = collections.defaultdict(list)   # step 2
    for f in flows:
        by_class[f[0]].append(f[3])
    base = {k: float(np.median(v)) for k, v in by_class.items() if len(v) >= cfg.min_class_flows}
    links: dict[tuple[int, int, bool], _Link] = collections.defaultdict(_Link)   # step 3
    excess: dict[tuple[str, int], float] = {}                 # (group, seq) -> the critical flow's excess
    slow_in: dict[tuple[str, int], list] = collections.defaultdict(list)
    for cls, src, dst, busy, gid, seq, op, critical in flows:
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
              "slow_collectives": sum(links[k].slow for k in ks), "judged": sum(links[k].n for k in ks)}
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
              "src_host": hs, "dst_host": hd}
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


__all__ = ["KIND", "WaitingGraphConfig", "slow_links"]
