"""What the analyzer's detectors take and return.

Detectors are pure functions over one job's records for one window (L2, L3)
or over iteration-time series (L1); they return ``Finding`` objects. The
service (``service.py``) gathers records, calls them, merges findings into
verdicts and publishes them; conversion to the ``trainscope.v1.Diagnosis``
wire message lives here (``Finding.to_pb``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Mapping

from google.protobuf import struct_pb2

from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2

#: Roles a suspect can have in a verdict (``attribution.py``).
CULPRIT, WAITER, LINK, MISSING = "culprit", "waiter", "link", "missing"


@dataclasses.dataclass(frozen=True, slots=True)
class SuspectRank:
    """One rank a detector points at.

    ``score`` is the detector's own statistic (W1, ratio, z); ``impact_ns``
    is what the deviation costs, in nanoseconds per iteration (``impact.py``
    fills it); ``role`` is filled by ``attribution.py``.
    """

    rank: int
    score: float
    evidence: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    impact_ns: float = 0.0
    role: str = ""
    waited_for: int = -1


@dataclasses.dataclass(frozen=True, slots=True)
class Scope:
    phase: str = ""
    kernel: str = ""
    stream: int = -1
    group: str = ""          # dimension compared within: dp/tp/pp/ep/cp, or "job"
    group_index: int = 0     # which group of that dimension (see topology.group_index)


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """One detector result (ARGUS §6): what, where, who, how sure, and why."""

    level: str                     # "L1" | "L2" | "L3"
    kind: str                      # jitter | regression | stall | straggler | degraded_kernel | imbalance
    job_id: str
    window: records_pb2.Window
    scope: Scope = Scope()
    suspects: tuple[SuspectRank, ...] = ()   # best first
    severity: float = 0.0
    evidence: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    informational: bool = False
    """Below the impact floor, not significant, or not persistent: evidence only, never a suspect."""
    comparison: str = "peers"
    """What the ranks were compared with: peers | sibling_groups | own_history | pair | job."""
    step_ns: float = 0.0
    """The window's step time (median iteration time over ranks), ns; 0 when unknown."""
    job_impact_ns: float = 0.0
    """What the finding costs the job, ns per iteration, when it names no rank (L1)."""

    @property
    def impact_ns(self) -> float:
        """The largest impact of its suspects (or of the job-level anomaly), ns per iteration."""
        return max(self.job_impact_ns, max((s.impact_ns for s in self.suspects), default=0.0))

    @property
    def id(self) -> str:
        """Stable id: the same finding about the same window is the same record."""
        s = self.scope
        key = (f"{self.job_id}|{self.level}|{self.kind}|{self.window.kind}|{self.window.index}|"
               f"{s.phase}|{s.kernel}|{s.stream}|{s.group}|{s.group_index}|"
               + ",".join(str(r.rank) for r in self.suspects))
        return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()

    def to_pb(self) -> records_pb2.Diagnosis:
        d = records_pb2.Diagnosis(
            id=self.id, job_id=self.job_id, level=self.level, kind=self.kind,
            window=self.window, severity=float(self.severity), created_unix_ns=time.time_ns(),
            scope=records_pb2.DiagnosisScope(
                phase=self.scope.phase, kernel=self.scope.kernel, stream=self.scope.stream,
                group=self.scope.group, group_index=self.scope.group_index),
        )
        d.informational = self.informational
        d.comparison = self.comparison
        d.impact_s = self.impact_ns / 1e9
        d.impact_pct = 100.0 * self.impact_ns / self.step_ns if self.step_ns > 0 else 0.0
        ev = dict(self.evidence)
        if self.informational and self.suspects:
            # informational findings never list suspects (ARCHITECTURE.md): keep them as evidence
            ev["candidates"] = [{"rank": s.rank, "impact_s": s.impact_ns / 1e9, "score": float(s.score)}
                                for s in self.suspects]
        _fill(d.evidence, ev)
        if self.informational:
            return d
        for s in self.suspects:
            m = d.suspects.add(rank=s.rank, score=float(s.score), role=s.role,
                               impact_s=s.impact_ns / 1e9, waited_for=s.waited_for,
                               impact_pct=100.0 * s.impact_ns / self.step_ns if self.step_ns > 0 else 0.0)
            _fill(m.evidence, s.evidence)
        return d


def _fill(struct: struct_pb2.Struct, values: Mapping[str, Any]) -> None:
    clean = {}
    for k, v in values.items():
        if hasattr(v, "item"):          # numpy scalar
            v = v.item()
        elif isinstance(v, (list, tuple)):
            v = [x.item() if hasattr(x, "item") else x for x in v]
        clean[str(k)] = v
    struct.update(clean)


@dataclasses.dataclass(slots=True)
class JobWindow:
    """Every rank's records of one window of one job (what L2 and L3 compare).

    Maps are keyed by rank. ``resources`` has every rank that sent anything
    for the window, with its parallel coordinates.
    """

    job_id: str
    window: records_pb2.Window
    resources: dict[int, Resource] = dataclasses.field(default_factory=dict)
    kernels: dict[int, records_pb2.KernelWindow] = dataclasses.field(default_factory=dict)
    phases: dict[int, records_pb2.PhaseWindow] = dataclasses.field(default_factory=dict)
    iterations: dict[int, records_pb2.IterationWindow] = dataclasses.field(default_factory=dict)
    stacks: dict[int, records_pb2.StackWindow] = dataclasses.field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.resources)
