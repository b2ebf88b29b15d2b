"""Score verdicts against a simulator ground truth (``collector/sim/truth.py``).

For each injected fault: was it caught, by which levels, was the top-ranked
suspect of the first verdict that named a culprit one of the fault's ranks
(top-1), did the verdicts name one of the fault's phases and kernels, and how
many windows after onset the first correct verdict came. Healthy windows
(before onset) that still named suspects count as false alarms.
"""
from __future__ import annotations

import dataclasses
import json

from trainscope.proto.v1 import records_pb2


@dataclasses.dataclass(slots=True)
class FaultScore:
    fault: str
    ranks: list[int]
    caught: bool
    top1: bool
    phase: bool
    kernel: bool
    levels: list[str]
    first_window: int | None
    onset_window: int | None
    verdict: str
    host_named: bool = False
    """A verdict after onset named one of the fault's hosts (``Verdict.host``)."""
    right: bool = False
    """Top-1 rank right, or (for faults on a whole host or group) the right host named first, or (for
    an NVLink fault) the tensor-parallel pair holding the culprit named as the group."""
    stable: float = 0.0
    """Share of the verdicts after the first correct one whose top suspect is still a fault rank."""
    windows_to_diagnosis: int | None = None
    onset_error: int | None = None
    """The first right verdict's ``since_window`` minus the true onset window (0: onset located)."""
    confidence: float | None = None
    """The confidence of the first verdict after onset that named anyone (calibration: right vs wrong)."""
    diagnosis_last_iteration: int | None = None
    """The last iteration of the first right verdict's window (onset -> verdict in seconds, with the truth's times)."""


@dataclasses.dataclass(slots=True)
class Evaluation:
    faults: list[FaultScore]
    false_alarm_windows: int
    healthy_windows: int


#: Job-level findings that name no rank but catch a fault (the job's own pace: "not localized").
JOB_KINDS = ("stall", "jitter", "regression", "job_slowdown")
#: Faults on one GPU's NVLink: in a 2-GPU tensor-parallel ring both flows cross both GPUs' ports,
#: so which end is slow cannot be told from the traffic; naming the TP group (the pair) is right.
LINK_FAULTS = ("nvlink_degrade",)


#: Faults that stop the job (the simulator's ``simulate.HANG_TYPES``): scored by the stall they cause.
HANG_TYPES = ("hang", "nic_fail")


def _window_of(iteration: int | None, per_window: int) -> int | None:
    return None if iteration is None else iteration // per_window


def evaluate(verdicts: list[records_pb2.Verdict], truth: dict, window_iterations: int) -> Evaluation:
    """Steps: 1. order verdicts by window; 2. per fault, take verdicts at or
    after its onset window; 3. the first with suspects decides top-1, the
    union of all decides phase/kernel/levels; 4. verdicts with suspects in
    windows before every onset are false alarms."""
    vs = sorted((v for v in verdicts if v.window.kind == records_pb2.WINDOW_KIND_ITERATIONS
                 or not any(x.window.kind == records_pb2.WINDOW_KIND_ITERATIONS for x in verdicts)),
                key=lambda v: v.window.index)
    onsets = [_window_of(f.get("onset_iteration"), window_iterations) for f in truth.get("faults", [])]
    if truth.get("hung") and vs:
        # a hang at a window boundary shows in the last window there is (no later one exists)
        onsets = [None if o is None else min(o, vs[-1].window.index) for o in onsets]
    first_onset = min((o for o in onsets if o is not None), default=None)
    healthy = [v for v in vs if first_onset is None or v.window.index < first_onset]
    hung = {r for f in truth.get("faults", []) if f.get("type") in HANG_TYPES for r in f.get("ranks", [])} \
        if truth.get("hung") else set()

    def false_alarm(v) -> bool:
        # a hang is a state of the job, reported with the last window analysed (the hung window never
        # closes): a stall naming the hung rank, or nobody, in an earlier window is the hang itself
        if hung and v.state == "stalled" and all(s.rank in hung for s in v.ranks):
            return False
        return bool(v.ranks) or v.state in ("degraded", "stalled")
    false_alarms = sum(1 for v in healthy if false_alarm(v))
    scores = []
    stall_vs = [v for v in vs if any(d.kind == "stall" for d in _active(v))]
    # the collectives level's hang verdict is published when the hang is seen, on a time window (the
    # analyzer's hang check, not a window's close): one that names a rank counts with the others
    named_stalls = sorted((v for v in verdicts if v.ranks and any(d.kind == "stall" for d in _active(v))),
                          key=lambda v: v.window.index)
    for f, onset in zip(truth.get("faults", []), onsets):
        ranks = set(f.get("ranks", []))
        if truth.get("hung") and f.get("type") in HANG_TYPES and (named_stalls or stall_vs):
            # a stall is a state of the job, reported with whichever window was analysed when it was seen
            v = (named_stalls or stall_vs)[0]
            scores.append(FaultScore(
                fault=f.get("spec", "hang"), ranks=sorted(ranks), caught=True,
                top1=bool(v.ranks) and v.ranks[0].rank in ranks, phase=False, kernel=False, levels=["L1"],
                first_window=v.window.index, onset_window=onset, verdict=v.summary,
                right=bool(v.ranks) and v.ranks[0].rank in ranks, stable=1.0, windows_to_diagnosis=0))
            continue
        phases = set(f.get("phases", []))
        kernels = {k["name"] for k in f.get("kernels", [])}
        after = [v for v in vs if onset is None or v.window.index >= onset]
        named = [v for v in after if v.ranks or _active(v)]
        first = next((v for v in named if v.ranks), None)
        caught_by = [v for v in named if any(r.rank in ranks for r in v.ranks)
                     or any(fd.kind in JOB_KINDS for fd in _active(v))]
        levels = sorted({fd.level for v in caught_by for fd in _active(v)
                         if fd.kind in JOB_KINDS
                         or any(s.rank in ranks for s in fd.suspects)})
        hosts = set(f.get("host_names", []))
        host_named = any(v.host in hosts for v in after if v.host)
        top1 = first is not None and first.ranks[0].rank in ranks
        group_fault = bool(f.get("scope", {}).get("host") or f.get("scope", {}).get("nic")) and len(ranks) > 1
        first_host = next((v.host for v in after if v.host), "")
        pair = {r for g in f.get("peer_groups", {}).get("tp", []) if ranks & set(g) for r in g} \
            if f.get("type") in LINK_FAULTS else set()

        def on_pair(v) -> bool:
            return bool(pair) and v.group.startswith("tp ") and v.ranks[0].rank in pair
        right = top1 or (group_fault and first_host in hosts) or (first is not None and on_pair(first))
        good = [i for i, v in enumerate(after) if v.ranks and (v.ranks[0].rank in ranks or v.host in hosts
                                                                or on_pair(v))]
        tail = [v for v in after[good[0]:] if v.ranks] if good else []
        stable = (sum(1 for v in tail if v.ranks[0].rank in ranks or (group_fault and v.host in hosts)
                      or on_pair(v)) / len(tail)) if tail else 0.0
        scores.append(FaultScore(
            fault=f.get("spec", f.get("type", "?")), ranks=sorted(ranks), caught=bool(caught_by),
            top1=first is not None and first.ranks[0].rank in ranks,
            phase=any(p in phases for v in caught_by for p in v.phases),
            kernel=any(k in kernels for v in caught_by for k in v.kernels),
            levels=levels, first_window=caught_by[0].window.index if caught_by else None,
            onset_window=onset, verdict=(first or (named[0] if named else None) or records_pb2.Verdict()).summary,
            host_named=host_named, right=right, stable=stable,
            windows_to_diagnosis=(after[good[0]].window.index - onset) if good and onset is not None else None,
            onset_error=(after[good[0]].since_window - onset) if good and onset is not None
            and after[good[0]].HasField("since_window") else None,
            confidence=first.confidence if first is not None else None,
            diagnosis_last_iteration=int(after[good[0]].window.last_iteration) if good else None,
        ))
    return Evaluation(scores, false_alarms, len(healthy))


def _active(v: records_pb2.Verdict) -> list[records_pb2.Diagnosis]:
    """The findings that count: informational ones (below the floor, not persistent) do not."""
    return [d for d in v.findings if not d.informational]


def load_truth(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
