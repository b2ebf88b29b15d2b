"""The detector seam: every level is an object behind one small Protocol.

The service builds a ``WindowContext`` per analysed window and calls each
detector of its list in order, each in its own ``try`` (a bug in one level
is counted under its name and never skips the others). A detector returns
its findings and how many rank comparisons it could make (``comparisons``),
so the verdict can say "unknown" when no level could compare anything
rather than "healthy".

To add a level: write a module with a pure function over the window (like
``l3_kernels.analyze_kernels``), wrap it in a class with ``level``,
``corroborating`` and ``analyze(ctx)``, and add it to ``default_detectors``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from trainscope.analyzer import (
    collectives, consistent, individual, job_pace, l1_iteration, l2_groups, l2_phases, l3_kernels, l5_stacks,
)
from trainscope.analyzer.impact import WindowScale
from trainscope.analyzer.model import Finding, JobWindow
from trainscope.analyzer.topology import cpu_only, group_of, resources_with
from trainscope.proto.v1 import records_pb2


@dataclasses.dataclass(slots=True)
class WindowContext:
    """What a detector may read about one window of one job."""

    jw: JobWindow
    scale: WindowScale
    history: Mapping[int, Sequence[tuple[int, int]]]   # rank -> (iteration, duration ns), bounded
    findings: list[Finding] = dataclasses.field(default_factory=list)   # found so far this window
    comparisons: dict[str, int] = dataclasses.field(default_factory=dict)
    reported: set = dataclasses.field(default_factory=set)   # the job's L1 anomalies already reported
    job_state: object = None      # the service's per-job state, for detectors that keep history
    job_loss: job_pace.JobLoss | None = None   # JobPace: what the job lost (merge step 5b)


class Detector(Protocol):
    level: str
    corroborating: bool
    """True: runs only when another level found something, and never raises an alarm on its own."""

    def analyze(self, ctx: WindowContext) -> list[Finding]: ...


def _groups_compared(resources, dim: str, min_size: int) -> int:
    return sum(len(m) for m in group_of(resources, dim).values() if len(m) >= min_size)


class L2Phases:
    level, corroborating = "L2", False

    def __init__(self, cfg: l2_phases.L2Config) -> None:
        self.cfg = cfg

    def analyze(self, ctx: WindowContext) -> list[Finding]:
        jw = ctx.jw
        if jw.phases:
            ctx.comparisons[self.level] = _groups_compared(
                resources_with(jw.resources, jw.phases), self.cfg.routing.kernel_group_dim, self.cfg.min_group_size)
        state = ctx.job_state
        spread = getattr(state, "l2_spread", None)
        if spread is None:
            spread = l2_phases.PhaseSpread(self.cfg.spread_windows)
            if state is not None:
                state.l2_spread = spread      # the job's host phases' spread, pooled (step 3b)
        return l2_phases.analyze_phases(jw, self.cfg, ctx.scale, spread)


class L3Kernels:
    level, corroborating = "L3", False

    def __init__(self, cfg: l3_kernels.L3Config) -> None:
        self.cfg = cfg

    def analyze(self, ctx: WindowContext) -> list[Finding]:
        jw = ctx.jw
        if jw.kernels:
            ctx.comparisons[self.level] = _groups_compared(
                resources_with(jw.resources, jw.kernels), self.cfg.routing.kernel_group_dim, self.cfg.min_ranks)
        return l3_kernels.analyze_kernels(jw, self.cfg, ctx.scale)


class L1Iterations:
    """Job-level iteration time (ARGUS §6.1) on the bounded history; ``seen`` keeps each anomaly once."""

    level, corroborating = "L1", False

    def __init__(self, cfg: l1_iteration.L1Config, on_state: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.on_state = on_state

    def analyze(self, ctx: WindowContext) -> list[Finding]:
        series = {}
        for rank, hist in ctx.history.items():
            if len(hist) >= 2:
                a = np.asarray(hist, dtype=np.int64)
                series[rank] = (a[:, 0], a[:, 1])
        if not series:
            return []
        ctx.comparisons[self.level] = len(series)
        w = ctx.jw.window
        found = l1_iteration.l1_findings(ctx.jw.job_id, series, w, self.cfg, report_any_regression=True)
        if self.on_state is not None:
            kinds = {f.kind for f in found} & {"jitter", "regression"}
            self.on_state("both" if len(kinds) == 2 else next(iter(kinds), "stable"))
        new = []
        for f in found:
            # history may run ahead of this window (a backlog read at once):
            # an anomaly that starts after it is reported with its own window
            at = f.evidence.get("start_iteration", f.evidence.get("split_iteration"))
            if (w.kind == records_pb2.WINDOW_KIND_ITERATIONS and w.last_iteration >= w.first_iteration
                    and isinstance(at, (int, float)) and at > w.last_iteration):
                continue
            if f.kind == "regression":
                # one change point, whose estimate moves a little as points arrive: reported once
                split = f.evidence["split_iteration"]
                if any(m[0] == "regression" and abs(m[1] - split) <= self.cfg.min_segment for m in ctx.reported):
                    continue
                ctx.reported.add(("regression", split))
                new.append(f)
                continue
            mark = (f.kind, f.evidence.get("start_iteration"), f.evidence.get("split_iteration"),
                    tuple(s.rank for s in f.suspects))
            if mark not in ctx.reported:
                ctx.reported.add(mark)
                new.append(f)
        return new


class L5Stacks:
    level, corroborating = "L5", True

    def __init__(self, cfg: l5_stacks.L5Config) -> None:
        self.cfg = cfg

    def analyze(self, ctx: WindowContext) -> list[Finding]:
        if not ctx.jw.stacks:
            return []
        return l5_stacks.analyze_stacks(ctx.jw, self.cfg)


class SiblingGroups:
    """A whole group slower than its siblings (``l2_groups``)."""

    level, corroborating = "sibling_groups", False

    def __init__(self, cfg: l2_groups.GroupsConfig) -> None:
        self.cfg = cfg

    def analyze(self, ctx: WindowContext) -> list[Finding]:
        found, n = l2_groups.analyze_groups(ctx.jw, ctx.scale, self.cfg)
        ctx.comparisons[self.level] = n
        return found


class OwnHistory:
    """Small jobs: each rank against its own history, and pairs (``individual``).

    Keeps one ``individual.History`` per job on the job's state.
    """

    level, corroborating = "history", False

    def __init__(self, cfg: individual.IndividualConfig, groups_cfg: l2_groups.GroupsConfig) -> None:
        self.cfg, self.groups_cfg = cfg, groups_cfg

    def analyze(self, ctx: WindowContext) -> list[Finding]:
        state = ctx.job_state
        hist = getattr(state, "own_history", None)
        if hist is None:
            hist = individual.History(self.cfg.history)
            if state is not None:
                state.own_history = hist
        found, made = individual.analyze_individual(ctx.jw, ctx.scale, hist, self.cfg, self.groups_cfg)
        ctx.comparisons.update(made)
        return found


class ConsistentShift:
    """Weak but consistent differences from the peers, accumulated over windows (``consistent``)."""

    level, corroborating = "consistent", False

    def __init__(self, cfg: consistent.ConsistentConfig, groups_cfg: l2_groups.GroupsConfig) -> None:
        self.cfg, self.groups_cfg = cfg, groups_cfg

    def analyze(self, ctx: WindowContext) -> list[Finding]:
        state = ctx.job_state
        ratios = getattr(state, "shift_ratios", None)
        if ratios is None:
            ratios = consistent.Ratios(self.cfg.windows)
            if state is not None:
                state.shift_ratios = ratios
        found, n = consistent.analyze_consistent(ctx.jw, ctx.scale, ratios, self.cfg, self.groups_cfg)
        ctx.comparisons["peers_over_windows"] = n
        return found


class JobPace:
    """The job's step against its own recent pace (``job_pace``): slower than itself, no rank to blame.

    Keeps one ``job_pace.Baseline`` per job on the job's state; skips partial windows (ranks
    missing) and a job's short last window."""

    level, corroborating = job_pace.LEVEL, False

    def __init__(self, cfg: job_pace.PaceConfig, warmup_iterations: int = 5) -> None:
        self.cfg, self.warmup = cfg, warmup_iterations

    def analyze(self, ctx: WindowContext) -> list[Finding]:
        state = ctx.job_state
        base = getattr(state, "pace_baseline", None)
        if base is None:
            base = job_pace.Baseline(self.cfg.baseline_windows)
            if state is not None:
                state.pace_baseline = base
        expected = set(range(getattr(state, "world_size", 0))) - set(getattr(state, "ended", ()))
        if ctx.scale.short or not ctx.jw.iterations or not expected <= set(ctx.jw.iterations):
            return []
        steps = job_pace.job_steps(ctx.jw, getattr(state, "first_iteration", {}), self.warmup)
        found, n, ctx.job_loss = job_pace.analyze_pace(ctx.jw, ctx.scale, base, steps, self.cfg,
                                                       host_timed=cpu_only(ctx.jw.resources))
        if n:     # counted only once judged: a job's first windows build the baseline
            ctx.comparisons[self.level] = n
        return found


class Collectives:
    """Collective root cause from per-collective records joined across ranks (``collectives``):
    late start (Mycroft §5), hang (§4.3) and slow links (Vedrfolnir §III, role ``link``): from
    step records, the provenance rating (``provenance.root_cause``: a rank's NIC/NVLink, a link
    src -> dst or a pair a <-> b, the steps it slowed); from the ring summary of records without
    steps, the waiting graph (``waiting_graph.slow_links``).

    The records arrive on their own topic, faster than the windows; the service files them in
    ``job_state.collectives`` and checks hangs on every step (``CollectiveState.hangs``). Per
    analysed window this level judges the collectives completed since the last one: late starts
    and slow transfers per group, then the waiting graph over all of them."""

    level, corroborating = collectives.LEVEL, False

    def __init__(self, cfg: collectives.CollectivesConfig, floor_pct: float = 1.0) -> None:
        self.cfg = cfg
        self.floor_pct = floor_pct

    def analyze(self, ctx: WindowContext) -> list[Finding]:
        state = getattr(ctx.job_state, "collectives", None)
        if state is None:
            return []
        ctx.comparisons[self.level] = sum(len(g.members) for g in state.groups.values() if len(g.members) > 1)
        out = state.late_starts(ctx.jw.job_id, ctx.jw.window, ctx.scale.iterations, ctx.scale.step_ns)
        if any(f.kind == "slow_link" for f in out):     # step 8: a host's links together
            its, steps = job_pace.job_step_series(ctx.jw, {}, 0)
            out += collectives.host_network(out, state.hosts, its, steps, self.floor_pct / 100 * ctx.scale.step_ns,
                                            self.cfg)
        return out
