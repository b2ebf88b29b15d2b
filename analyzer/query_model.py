"""The answers of ``trainscope query``: typed rows and views (``deploy/render.py`` turns them into text).

Kept apart from the facade (``query.py``) and the Prometheus client
(``prom_client.py``) so a renderer needs neither a store nor HTTP.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from trainscope.proto.errors import TrainscopeError
from trainscope.proto.v1 import records_pb2


class QueryError(TrainscopeError):
    """A question the data cannot answer (unknown job, nothing recorded)."""


# ---------------------------------------------------------------- results
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankInfo:
    rank: int
    host: str
    pid: int
    local_rank: int
    device: str
    dp: int
    tp: int
    pp: int
    ep: int
    cp: int

    @property
    def coords(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp} ep={self.ep} cp={self.cp}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobRow:
    job: str
    ranks: int
    windows: int
    diagnoses: int
    latest: str
    """Summary sentence of the latest verdict ("" when none)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SuspectRow:
    rank: int
    role: str
    """culprit, waiter (it waited for ``waited_for``), link (a slow link among its group) or missing."""
    impact_s: float
    """Seconds lost per iteration attributable to the rank."""
    impact_pct: float
    """...as a percentage of the step."""
    host: str
    coords: str
    waited_for: int | None
    levels: tuple[str, ...]
    where: tuple[str, ...]
    """Phases, kernels or kinds the rank was named for."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FindingRow:
    level: str
    kind: str
    scope: str
    suspects: tuple[int, ...]
    impact_s: float
    """The finding's largest suspect impact, seconds per iteration."""
    comparison: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VerdictView:
    job: str
    window: int | None
    """The window of a one-window verdict; None for the job's verdict merged over its windows."""
    iterations: str | None
    """The one-window verdict's span (``iterations 40-44`` or a UTC time range); None over all windows."""
    summary: str
    state: str
    confidence: float
    host: str
    since_window: int | None
    since_span: str | None = None
    """``since_window`` as a person reads it (``iterations 10-19`` or a UTC time range)."""
    stacks: str = ""
    """Whether py-spy stacks were recorded for the job (L5's input), one sentence."""
    comparison: str
    suspects: tuple[SuspectRow, ...]
    phases: tuple[str, ...]
    kernels: tuple[str, ...]
    findings: tuple[FindingRow, ...]
    verdict: records_pb2.Verdict = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StragglerRow:
    rank: int
    host: str
    phases: tuple[str, ...]
    kinds: tuple[str, ...]
    windows: int | None
    """Windows that flagged the rank (None from Prometheus, which has no windows)."""
    max_impact_s: float
    """Largest impact the rank was named with, seconds per iteration."""
    first_seen: str | None
    last_seen: str | None
    flagged_now: bool
    """Named by the latest verdict (store) or flagged now (Prometheus)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KernelRow:
    kernel: str
    kinds: tuple[str, ...]
    flagged_windows: int
    max_impact_s: float | None
    """Largest impact of the kernel's findings on the rank, seconds per iteration."""
    calls: int
    rank_mean_s: float | None
    peer_mean_s: float | None
    """Median over the rank's peers that ran the kernel of their mean duration per call: the other
    members of its data-parallel group (as L3 compares), at most 256 evenly spaced."""
    ratio: float | None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class IterationRow:
    window: int
    first_iteration: int
    last_iteration: int
    ranks: int
    iterations: int
    mean_s: float
    p50_s: float
    max_s: float
    slowest_rank: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Rows:
    """A list answer: which question, about which job, with which parameters."""

    query: str
    job: str | None
    rows: tuple
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def as_json(result: Rows | VerdictView) -> dict:
    """The JSON form of an answer (verdicts reuse the replay contract's shapes)."""
    from trainscope.analyzer.report import contract_verdict_json, diagnosis_json

    if isinstance(result, VerdictView):
        # "verdict" is the replay contract's object (ARCHITECTURE.md): runbooks and tests read one schema
        return {"query": "verdict", "job": result.job, "window": result.window, "window_span": result.iterations,
                "since_span": result.since_span, "stacks": result.stacks,
                "verdict": contract_verdict_json(result.verdict),
                "suspects": [dataclasses.asdict(s) for s in result.suspects],
                "findings": [diagnosis_json(d) for d in result.verdict.findings if not d.informational]}
    return {"query": result.query, "job": result.job, **result.params,
            "rows": [dataclasses.asdict(r) for r in result.rows]}
