"""One stall rule (EROICA §4.1, rule 2), read on two clocks.

The rule: a job has stalled when no iteration has ended for ``factor`` times
its typical iteration interval (and at least ``floor_s`` seconds, so a
fast-stepping job is not called stalled for a scheduler hiccup). Hangs and
stalls are never subject to the impact floor or to persistence: a stopped
job costs every step.

The rule is read on whichever clock can see it:

1. Arrival clock (``arrival_stall``): the analyzer's own monotonic clock,
   between windows of iteration records arriving. Host clock skew and
   simulated clocks change nothing, but a backlog read at once hides a stall.
2. Rank clocks (``telemetry_stall``): per rank, how far its telemetry
   (aborted collectives, stacks) ran past the end of its last complete
   iteration, in units of its median iteration time. Works on backlogs and
   simulated clocks. The job stalls when at least half the ranks do (a hang
   stops everyone: the peers wait in the collective the culprit never
   joins); the culprit stopped first: ranks whose telemetry ends at least
   one iteration earlier than the stalled ranks' median are the suspects.

A job whose ranks said they shut down (``Window.final``) has ended, not
stalled.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from trainscope.analyzer.model import Finding, Scope, SuspectRank
from trainscope.proto.v1 import records_pb2


def stalled(gap: float, typical: float, factor: float, floor: float = 0.0) -> bool:
    """The rule: ``gap`` without an iteration ≥ max(factor × typical, floor); never with no typical."""
    return typical > 0 and gap >= max(factor * typical, floor)


def arrival_stall(job_id: str, window: records_pb2.Window, *, quiet_s: float, mean_gap_s: float,
                  factor: float, floor_s: float) -> Finding | None:
    """Clock 1: seconds since iteration records last arrived, against their mean interval."""
    if not stalled(quiet_s, mean_gap_s, factor, floor_s):
        return None
    return Finding(level="L1", kind="stall", job_id=job_id, window=window, scope=Scope(group="job"),
                   severity=quiet_s / max(mean_gap_s, 1e-9),
                   evidence={"seconds_without_iteration": round(quiet_s, 3),
                             "mean_report_interval_s": round(mean_gap_s, 3), "rule": "arrival clock",
                             "stall_factor": factor})


def telemetry_stall(job_id: str, window: records_pb2.Window, *,
                    last_iter_end: Mapping[int, int], watermark: Mapping[int, int],
                    history: Mapping[int, Sequence[tuple[int, int]]], ended: set[int],
                    factor: float) -> Finding | None:
    """Clock 2: each rank's telemetry beyond its last iteration, in its own median iterations."""
    gaps, marks, iters = {}, {}, {}
    for rank, end in last_iter_end.items():
        hist = history.get(rank)
        if not hist or rank in ended:
            continue
        med = float(np.median([d for _, d in hist]))
        wm = watermark.get(rank, 0)
        if med > 0:
            gaps[rank], marks[rank], iters[rank] = (wm - end) / med, wm, med
    if not gaps:
        return None
    stalled_ranks = [r for r, g in gaps.items() if stalled(g, 1.0, factor)]
    if len(stalled_ranks) * 2 < len(gaps):
        return None
    ref = float(np.median([marks[r] for r in stalled_ranks]))
    med_iter = float(np.median([iters[r] for r in stalled_ranks]))
    early = sorted(((ref - marks[r]) / med_iter, r) for r in gaps if ref - marks[r] >= med_iter)
    # a stopped job loses every step: the suspects' impact is the whole iteration
    suspects = tuple(SuspectRank(r, float(sc), {"stopped_iterations_before_peers": round(sc, 2),
                                                "last_iteration_end_ns": last_iter_end[r]},
                                 impact_ns=med_iter)
                     for sc, r in sorted(early, reverse=True))
    without = float(np.median([gaps[r] for r in stalled_ranks]))
    return Finding(level="L1", kind="stall", job_id=job_id, window=window, scope=Scope(group="job"),
                   suspects=suspects, severity=without, job_impact_ns=med_iter,
                   evidence={"stalled_ranks": len(stalled_ranks), "ranks": len(gaps),
                             "iterations_without_progress": round(without, 1),
                             "rule": "telemetry clock", "stall_factor": factor})
