"""Merge the findings of L1–L3 about one window into one verdict per job.

Steps:
1. Every suspect of every finding votes for its rank with its finding's
   level. The vote is *culprit* evidence when the rank is slower than its
   peers in computation, or faster in communication (a late arriver's
   collectives are its shortest, ARGUS §9.5); it is *victim* evidence when
   the rank is slower in communication (it waited). Ranks are ordered by the
   number of distinct levels with culprit evidence (agreement across
   independent signals is the strongest evidence, ARGUS §6), then by all
   levels, then by culprit minus victim score.
2. Phases come from L2 findings, kernels from L3 findings. Those where the
   top suspect itself is slower than its peers come first; then those where
   it is *faster* (a late arriver's collectives are its shortest while its
   peers wait, ARGUS §9.5: evidence, not the degraded part); each by score.
3. The summary sentence names the top rank with its coordinates, the phase
   and the kernel, and the L1 state of the job when L1 found something.
"""
from __future__ import annotations

import collections
import math
import time

from trainscope.analyzer.model import Finding
from trainscope.analyzer.topology import RoutingConfig

_ROUTING = RoutingConfig()
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2


def merge(job_id: str, window: records_pb2.Window, findings: list[Finding],
          resources: dict[int, Resource] | None = None) -> records_pb2.Verdict:
    levels: dict[int, set[str]] = collections.defaultdict(set)
    culprit_levels: dict[int, set[str]] = collections.defaultdict(set)
    score: dict[int, float] = collections.defaultdict(float)
    balance: dict[int, float] = collections.defaultdict(float)
    where: dict[int, list[str]] = collections.defaultdict(list)
    named: list[tuple[Finding, object]] = []
    for f in findings:
        top = max((s.score for s in f.suspects), default=0.0) or 1.0
        comm = _ROUTING.is_communication(f.scope.phase or f.scope.kernel) if (f.scope.phase or f.scope.kernel) else False
        for s in f.suspects:
            levels[s.rank].add(f.level)
            score[s.rank] += s.score / top
            ratio = s.evidence.get("ratio", 1.0)
            has_ratio = isinstance(ratio, (int, float)) and ratio > 0
            direction = s.evidence.get("direction")  # L3: from the exact mean, more reliable than p50
            slower = direction == "slower" if direction else (not has_ratio or ratio >= 1.0)
            # strength: how many-fold the rank differs from its peers (|ln ratio|)
            weight = abs(math.log(ratio)) if has_ratio else s.score / top
            if comm and slower:
                balance[s.rank] -= weight
            else:
                culprit_levels[s.rank].add(f.level)
                balance[s.rank] += weight
            label = f.scope.phase or f.scope.kernel or s.evidence.get("function") or f.kind
            if label not in where[s.rank]:
                where[s.rank].append(label)
            named.append((f, s))
    ranked = sorted(levels, key=lambda r: (-len(culprit_levels[r]), -balance[r], -score[r], r))
    top = ranked[0] if ranked else None
    phases: dict[str, tuple] = {}
    kernels: dict[str, tuple] = {}
    for f, s in named:
        ratio = s.evidence.get("ratio", 1.0)
        direction = s.evidence.get("direction")
        slower = direction == "slower" if direction else (isinstance(ratio, (int, float)) and ratio >= 1.0)
        key = (s.rank != top, not slower, -s.score)
        if f.level == "L2" and f.scope.phase:
            phases[f.scope.phase] = min(phases.get(f.scope.phase, key), key)
        if f.level == "L3" and f.scope.kernel:
            kernels[f.scope.kernel] = min(kernels.get(f.scope.kernel, key), key)
    v = records_pb2.Verdict(job_id=job_id, window=window, created_unix_ns=time.time_ns())
    for r in ranked:
        s = v.ranks.add(rank=r, score=len(culprit_levels[r]) + len(levels[r]) / 4 + balance[r] / (1.0 + abs(balance[r])) / 8)
        s.evidence.update({"levels": sorted(levels[r]), "culprit_levels": sorted(culprit_levels[r]),
                           "where": where[r][:10]})
    v.phases.extend(sorted(phases, key=lambda p: phases[p]))
    v.kernels.extend(sorted(kernels, key=lambda k: kernels[k]))
    v.findings.extend(f.to_pb() for f in findings)
    v.summary = summarize(job_id, v, findings, resources or {})
    return v


def summarize(job_id: str, v: records_pb2.Verdict, findings: list[Finding],
              resources: dict[int, Resource]) -> str:
    l1 = sorted({f.kind for f in findings if f.level == "L1"})
    if not v.ranks and not l1:
        return f"job {job_id}: healthy"
    parts = [f"job {job_id}"]
    if l1:
        parts.append("iteration time: " + "+".join(l1))
    if v.ranks:
        top = v.ranks[0].rank
        res = resources.get(top)
        coords = ""
        if res is not None:
            c = res.coords
            coords = f" (host {res.host or '?'}, dp={c.dp} tp={c.tp} pp={c.pp} ep={c.ep} cp={c.cp})"
        what = []
        if v.phases:
            what.append("phase " + ", ".join(v.phases[:3]))
        if v.kernels:
            what.append("kernel " + ", ".join(k[:60] for k in v.kernels[:2]))
        host = [s.evidence.get("function") for f in findings if f.level == "L5"
                for s in f.suspects if s.rank == top]
        if host:
            what.append(f"host busy in {host[0]}")
        lv = ",".join(sorted(set(v.ranks[0].evidence["levels"])))
        parts.append(f"suspect rank {top}{coords} [{lv}]" + (": " + "; ".join(what) if what else ""))
        if len(v.ranks) > 1:
            parts.append("also " + ", ".join(str(s.rank) for s in v.ranks[1:6]))
    return " — ".join(parts)
