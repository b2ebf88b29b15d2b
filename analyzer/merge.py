"""Merge the findings of every level about one window into one verdict per job.

Steps (the verdict schema is ARCHITECTURE.md's replay contract):
1. Informational findings (below the impact floor, ``impact.py``; not
   significant; sampled-out kernels) stay in ``Verdict.findings`` as
   evidence and name nobody. L5 findings only corroborate: they add the host
   function to a rank that another level named.
2. The other findings become typed evidence and are attributed
   (``attribution.py``): culprits, waiters pointing at the rank they waited
   for, slow links, missing ranks; scores in seconds per iteration.
3. Persistence (``significance.Persistence``): a culprit flagged against
   its peers in device-timed work (a peer z: L2, L3) becomes a suspect of the
   verdict once the CUSUM of its per-iteration excess at that place crosses
   h (``sequential.py``: one window of overwhelming evidence); every rank,
   these included, once flagged in the same place in k of the last n
   windows; before that it is ``pending``. Stalls are named at once, and so is a culprit whose
   own slow work (not a collective it arrived late to) or measured late
   start, or a link the collectives level named, costs at least
   ``URGENT_SHARE`` of the step in a job of ``URGENT_MIN_RANKS`` or more:
   noise that large is not what persistence guards against there, and
   waiting a window would only delay the page. A partial window (any
   expected rank missing, however few are present) names no suspect but a
   stalled rank: its findings only feed the persistence of the ranks they
   flag, which a later full window may confirm; those ranks are ``pending``.
   A waiter is named only with the rank it waited for.
3b. In a job timed on the host (CPU ranks), what the step's own noise
   explains does not repeat into a suspect. A window's flag counts toward k
   of n only when the rank's cost per iteration is at least ``COUNT_Z``
   standard errors of the window's mean step, COUNT_Z·σ/√n (σ the step's
   per-iteration noise, ``sequential`` step 1b; n the window's
   iterations): the scheduler delays whichever rank it likes for a window
   at a time. Beside a busy process a healthy 4-rank gloo job's steps vary
   by 8 % (σ/√10 = 2.5 %), and the dependency rule named the rank delayed
   in two windows out of three (a forward 2.6 %, a data loader 3.8 % of the
   step), in 2 of 3 runs. On an idle host (σ at its 1 % floor) the bar,
   0.6 % of the step, is under the impact floor. Device-timed jobs keep
   the count as it was: their σ pools ranks whose iterations differ by
   their stage and personality (a replay of a real stream: a 1.3x rank
   costing 5 % of the step sat under the bar in every window), and the
   CUSUM bounds its own input by the noise already (``sequential`` 1b).
   The step's noise bounds a phase's from above, loosely: a rank slow in
   its median occurrence of a phase, against that phase's own spread, also
   counts (``_median_phase_excess``; a 4-rank DDP job's data loader 30 ms
   slower in every iteration sat under a bar of a third of its 133 ms step).
4. Aggregation: when the suspects' impact sits mostly (≥ 2/3) on one host
   and at least two suspects share it, the verdict names the host first
   (a degraded NVLink, NIC or PCIe switch slows every GPU behind it); the
   same rule names the NIC and the network switch they share (the
   Resource's ``nic``/``switch`` attributes; a switch only when the
   suspects span several hosts), and the parallel group: the sibling
   group a group-level finding named when it holds two or more culprits
   or links (one culprit with waiting partners is the rank's fault), else
   the smallest group (tp, ep, cp, pp, dp) holding ≥ 2/3 of the impact in
   at least two suspects and at least half its members (a whole TP pair
   behind one NVLink).
3c. A host-timed job's jitter, or its L1 regression, that no rank carries, with its pace unchanged,
   is not held and makes no state (``_scheduler_noise``).
3d. A host-timed job's warm-up window (its first iterations: processes starting, connections,
   allocators, lazy imports; steps of a 4-rank gloo job twice the later ones) counts toward no
   k of n: its flags are pending. Beside a busy process a healthy two-group job had its rank 3
   late to its TP pair in window 0 and window 1 and was named at window 1. A capture judged as
   one window (``final``) keeps them, and so does a device-timed job, whose CUSUM bounds its
   input by the noise already.
5. State: ``stalled`` (a stall finding), ``degraded`` (a confirmed suspect,
   an L1 regression (not step 3c's), or L1 jitter in k of the last n windows), ``unknown`` (no comparison could be
   made: groups too small and no history yet; or a partial window missing more ranks than it
   holds, such as 2 of 128 ranks replayed), ``suspected`` (ranks flagged but not yet persistent:
   listed in ``pending``, never "healthy"), else ``healthy``.
5b. Impact is what the job loses: where the pace level measured the job's
   mean step against its own healthy pace (before the culprits were first
   flagged), the culprits' and links' impacts are scaled together to that
   loss: down where they exceed it, up where they fall short of a loss the
   pace level measured beyond its noise (``_loss_share``).
6. Confidence in [0, 1]: 0.4 × the margin of the top suspect (or host) over
   the next (1 − next/top impact), + 0.3 × agreement (distinct levels with
   culprit evidence, 2 or more = full), + 0.3 × persistence (share of the
   last n windows in which the top suspect was flagged). A healthy verdict's
   confidence is the share of levels that could compare ranks, lowered when
   ranks are pending.
7. Ordering among suspects uses the impact smoothed over windows, so the top
   suspect of a persistent fault does not flip with one window's noise. The
   verdict's phases and kernels are where its culprits and links are slower
   (its waiters' only when it names neither): a waiter's place is where it
   waited (``_places``).
"""
from __future__ import annotations

import collections
import dataclasses
import re
import statistics
import time
from typing import Collection, Mapping, Sequence

from trainscope.analyzer.attribution import LATE_START, Evidence, RankVerdict, SyncPartners, attribute, evidence_of
from trainscope.analyzer import sequential
from trainscope.analyzer.job_pace import JobLoss
from trainscope.analyzer.model import CULPRIT, LINK, MISSING, WAITER, Finding, JobWindow
from trainscope.analyzer.significance import Persistence
from trainscope.analyzer.topology import cpu_only, group_index
from trainscope.proto.model import NIC_ATTRIBUTE, SWITCH_ATTRIBUTE, Resource
from trainscope.proto.v1 import records_pb2

HEALTHY, DEGRADED, STALLED, UNKNOWN = "healthy", "degraded", "stalled", "unknown"
#: Evidence points at a rank that has not reached the naming threshold yet (never "healthy").
SUSPECTED = "suspected"
#: Persistence key of job-level anomalies (L1 jitter), beside the ranks.
JOB = -1
#: ... and of the job slower than its own pace (``job_pace``) with no rank to blame.
JOB_PACE = -2
#: A flagged rank costing at least this share of the step is named at once (step 3) ...
URGENT_SHARE = 0.15
#: ... in jobs of at least this many ranks: a few ranks sharing a busy host (CPU jobs, tests) are
#: slowed by the scheduler for a window at a time, and their verdicts wait for persistence.
URGENT_MIN_RANKS = 16
#: A flag counts toward k of n only when the rank's cost per iteration reaches this many standard errors
#: of the window's mean step (step 3b).
COUNT_Z = 2.0
#: Step 5b: a job loss this many standard errors above its pace is real, and the named culprits'
#: impacts are scaled up to it (one-sided 0.13 %: a healthy window's mean step rarely moves so far).
SCALE_UP_Z = 3.0


def merge(job_id: str, window: records_pb2.Window, findings: Sequence[Finding],
          resources: Mapping[int, Resource] | None = None, *, jw: JobWindow | None = None,
          step_ns: float = 0.0, iterations: Mapping[int, float] | None = None,
          persistence: Persistence | None = None, comparisons: Mapping[str, int] | None = None,
          partial: bool = False, final: bool = False,
          job_loss: JobLoss | None = None, warmup: bool = False) -> records_pb2.Verdict:
    """One verdict for one window of one job (module steps 1-7).

    ``warmup``: the window holds the job's warm-up iterations (step 3d).

    ``job_loss``: what the job lost this window against its own pace, flagged or not (the pace
    level's ``JobLoss``; step 5b).

    ``comparisons``: per level, how many rank comparisons it could make
    (0 everywhere → ``unknown``); None when not counted (treated as made).
    ``persistence`` is the job's tracker; without one every flagged rank is
    named at once (k = 1).
    """
    resources = resources or {}
    if jw is not None and iterations is None:
        from trainscope.analyzer.impact import window_scale
        iterations = window_scale(jw).iterations
    active = [f for f in findings if not f.informational]
    evidence: list[Evidence] = []
    for f in active:
        if f.level != "L5":
            evidence += evidence_of(f)
    partners = SyncPartners(resources)
    evidence += _host_evidence(active, evidence, partners)
    ranked = attribute(evidence, resources, jw, iterations, partners, step_ns)
    host_fn = {s.rank: s.evidence.get("function") for f in active if f.level == "L5" for s in f.suspects}
    # the stack grid of a collective finding (Mycroft §5, analyzer/stack_grid.py): where the rank was at the trigger
    grid = {s.rank: s.evidence["stack_grid"] for f in active if f.level == "collectives" for s in f.suspects
            if isinstance(s.evidence.get("stack_grid"), str)}
    fr = {s.rank: s.evidence["flight_recorder"] for f in active if f.level == "collectives" for s in f.suspects
          if isinstance(s.evidence.get("flight_recorder"), str)}   # its Flight Recorder line (who is behind)
    stalled_ranks = {s.rank for f in active if f.kind == "stall" for s in f.suspects}

    # step 3: persistence
    flagged = {rv.rank: rv for rv in ranked if rv.role in (CULPRIT, LINK, WAITER)}
    l1 = [f for f in active if f.level == "L1" and f.kind in ("jitter", "regression")]
    places = {r: _places_of(rv) for r, rv in flagged.items()}
    pace = [f for f in active if f.level == "pace"]
    host_noise = {k for k in ("jitter", "regression") if _scheduler_noise(l1, pace, resources, k)}
    if any(f.kind == "jitter" for f in l1) and "jitter" not in host_noise:
        places[JOB] = {"jitter"}          # a job-level jitter must recur too (one spike is not a state)
    if pace:
        places[JOB_PACE] = {"pace"}       # slower than its own pace: must hold too (a checkpoint window)
    if persistence is not None:
        observed: dict[int, float] = {}      # every rank's impact, sub-threshold findings too (onset)
        for f in findings:
            for s in f.suspects:
                if s.impact_ns > observed.get(s.rank, 0.0):
                    observed[s.rank] = float(s.impact_ns)
        for r, rv in flagged.items():
            observed[r] = max(observed.get(r, 0.0), rv.score_ns)
        noise = persistence.step_noise(sequential.step_noise_ns(jw, step_ns, persistence.sequential))
        device_timed = bool(resources) and not cpu_only(resources)
        sums, n_its = _window_sums(flagged, iterations or {}, noise,
                                   [f for f in active if f.kind == LATE_START] if device_timed else ())
        h = sequential.threshold(len(resources) or len(flagged), step_ns / 1e9, persistence.sequential)
        bar = 0.0 if device_timed else COUNT_Z * noise / max(n_its, 1.0) ** 0.5      # step 3b
        counted = {r: p for r, p in places.items()     # JOB keys too
                   if r not in flagged or flagged[r].score_ns >= bar or _median_phase_excess(flagged[r], jw)}
        if warmup and not device_timed and not final:
            counted = {}                                                                  # step 3d
        confirmed = persistence.update(int(window.index), counted,
                                       {r: rv.score_ns for r, rv in flagged.items()}, final=final,
                                       observed=observed, sums=sums, iterations=n_its, h=h)
        # held in the role it has now: its waits do not make a rank's one late arrival a persistent culprit
        confirmed = {r for r in confirmed if r not in flagged or flagged[r].role == WAITER
                     or any(not p.startswith(WAITING) for p in persistence.held_places(r))}
    else:
        confirmed = set(places)
    if final and persistence is not None and persistence.windows < persistence.k:
        # a capture shorter than k windows (one window: a short profiler capture, replay.capture_window)
        # names what its windows flagged; an iteration-time spike there is one transient, not a rank
        # (its other evidence, if any, waiting: a TP partner of a slow GPU carried one step's spike)
        confirmed -= {r for r, rv in flagged.items()
                      if any(e.level == "L1" for e in rv.evidence)
                      and all(e.level == "L1" for e in rv.evidence if e.role == CULPRIT)}
    jitter_held = JOB in confirmed
    pace_held = JOB_PACE in confirmed
    # overwhelming evidence needs no second window: a rank costing a large share of the step
    urgent = {r for r, rv in flagged.items() if step_ns > 0 and len(resources) >= URGENT_MIN_RANKS
              and rv.score_ns >= URGENT_SHARE * step_ns and _urgent_evidence(rv)}
    confirmed = (confirmed & set(flagged)) | ((stalled_ranks | urgent) & set(flagged))
    if partial:
        # ranks missing: the ranks present were compared among a subset of their peers (a window
        # holding 3 of 8 ranks, a time window catching 8 of 256); their findings fed persistence
        # above and wait for a full window to be named. A rank that stopped is named at once.
        confirmed &= stalled_ranks
    smooth = (lambda r: persistence.smoothed_impact(r) or flagged[r].score_ns) if persistence else (
        lambda r: flagged[r].score_ns)
    order = {CULPRIT: 0, LINK: 1, WAITER: 2, MISSING: 3}
    # a waiter is named with the rank it waited for, never alone: until that rank is confirmed the
    # waiter is pending too (a victim does not make a job degraded)
    # (followed along chains, to a fixed point: a two-group job on a busy host named rank 3 "waiter"
    # alone, waiting for rank 1, itself a waiter of a rank that stayed pending)
    while True:
        alone = {r for r in confirmed if flagged[r].role == WAITER and flagged[r].waited_for not in confirmed}
        if not alone:
            break
        confirmed -= alone
    suspects = sorted((flagged[r] for r in confirmed),
                      key=lambda rv: (order[rv.role], -smooth(rv.rank), rv.rank))
    pending = sorted(set(flagged) - confirmed)

    v = records_pb2.Verdict(job_id=job_id, window=window, created_unix_ns=time.time_ns(),
                            step_s=step_ns / 1e9, partial=partial)
    if persistence is not None and suspects:
        since = [persistence.onset(rv.rank) for rv in suspects[:3]]
        since = [s for s in since if s is not None]
        if since:
            v.since_window = min(since)
    elif persistence is not None and pace_held and persistence.since(JOB_PACE) is not None:
        v.since_window = persistence.since(JOB_PACE)
    # step 4: host, NIC, switch, group
    host = _shared(suspects, resources, lambda res: res.host)
    if host:
        v.host = host
    v.nic = _shared(suspects, resources, lambda res: res.attributes.get(NIC_ATTRIBUTE, ""))
    if len({resources[rv.rank].host for rv in suspects if rv.rank in resources}) > 1:
        v.switch_name = _shared(suspects, resources, lambda res: res.attributes.get(SWITCH_ATTRIBUTE, ""))
    v.group = _shared_group(suspects, resources, active)
    first = {rv.rank: persistence.since(rv.rank) for rv in suspects} if persistence is not None else {}
    share = _loss_share(suspects, first, job_loss)
    for rv in suspects:
        res = resources.get(rv.rank)
        # a hung rank costs the whole step (unknown: 0), not its peers' wait (that is in its why)
        cost = step_ns if _hang_wait_ns(rv) > 0 else rv.score_ns * (share if rv.role in (CULPRIT, LINK) else 1.0)
        s = v.ranks.add(rank=rv.rank, score=rv.score_ns / 1e9, role=rv.role, impact_s=cost / 1e9,
                        impact_pct=100.0 * cost / step_ns if step_ns > 0 else 0.0,
                        host=res.host if res else "", waited_for=rv.waited_for,
                        why=_why(rv, step_ns, host_fn.get(rv.rank), cost)
                        + (f"; stack grid: {grid[rv.rank]}" if rv.rank in grid else "")
                        + (f"; flight recorder: {fr[rv.rank]}" if rv.rank in fr else ""))
        s.evidence.update({"levels": sorted(rv.levels), "culprit_levels": sorted(rv.culprit_levels),
                           "where": rv.where[:10], "waiters": rv.waiters[:16],
                           "comparisons": sorted(rv.comparisons),
                           **({"host_function": host_fn[rv.rank]} if host_fn.get(rv.rank) else {}),
                           **({"stack_grid": grid[rv.rank]} if rv.rank in grid else {}),
                           **({"flight_recorder": fr[rv.rank]} if rv.rank in fr else {})})
    v.pending.extend(pending)
    v.phases.extend(_places(suspects, active, "phase"))
    v.kernels.extend(_places(suspects, active, "kernel"))
    v.findings.extend(f.to_pb() for f in _named_only(findings, confirmed | stalled_ranks, pace_held, host_noise))
    # step 5: state; step 6: confidence
    made = None if comparisons is None else sum(comparisons.values())
    present, missing = len(resources), _missing_ranks(findings)
    if any(f.kind == "stall" for f in active):
        v.state = STALLED
    elif suspects or jitter_held or pace_held or any(f.kind == "regression" and f.kind not in host_noise for f in l1):
        v.state = DEGRADED
    elif (made == 0 and not pending) or (partial and missing > present):
        v.state = UNKNOWN           # no comparison, or most of the job absent (2 of 128 ranks)
    elif pending:
        v.state = SUSPECTED         # flagged, not yet persistent: reported with the ranks, never healthy
    else:
        v.state = HEALTHY
    v.comparison = _comparison(comparisons, suspects)
    v.confidence = _confidence(v.state, suspects, resources, host, persistence, comparisons, pending)
    v.summary = summarize(job_id, v, findings, resources)
    return v


def _scheduler_noise(l1: Sequence[Finding], pace: Sequence[Finding], resources: Mapping[int, Resource],
                     kind: str) -> bool:
    """Step 3c: in a job timed on the host (CPU ranks), slow iterations that no rank carries and that
    leave the window's pace where it was are the host's scheduler, not a state of the job.

    1. Jitter: such a job's iteration times are heavy-tailed (a rank descheduled for a few time slices
       adds 20-30 ms to a 36 ms step, 7 robust σ: L1's Gaussian bound), and an idle healthy 4-rank job
       read "degraded" in 1 of 12 runs from two such spikes 20 iterations apart.
    2. Regression: ARGUS §6.1's level shift (μR/μL ≥ 1.1, each side steady) is tested on the job's
       recent points only; an idle healthy two-group job stepped from 30 to 34-36 ms for a stretch of
       iterations with every rank alike, its pace (the whole window against the job's own baseline,
       ``job_pace``) within its noise, and read "degraded, not localized".
    A fault that makes the job lose time shows in its pace or names the rank that carries it."""
    if pace or not resources or not cpu_only(resources):
        return False
    return all(f.kind != kind or not f.suspects for f in l1)


def _urgent_evidence(rv: RankVerdict) -> bool:
    """Step 3: evidence that needs no second window when it costs a large share of the step: a culprit's
    own slow work or the late start the collectives level measured (still its own after attribution;
    L1 jitter is transient by nature), or a link the collectives level named from its records."""
    if rv.role == CULPRIT:
        return any((e.own or e.kind == LATE_START) and e.level != "L1" for e in rv.evidence)
    if rv.role == LINK:
        return any(e.role == LINK and e.level == "collectives" for e in rv.evidence)
    return False


def _host_evidence(active: Sequence[Finding], evidence: list[Evidence],
                   partners: SyncPartners) -> list[Evidence]:
    """L5 corroborates: a rank whose stacks sit in a host function its peers' do not (a GC pause, a
    data-loader wait) while it or its sync partners are flagged did slow work of its own, worth
    what the flagged ones among them lost."""
    impact: dict[int, float] = collections.defaultdict(float)
    for e in evidence:
        impact[e.rank] = max(impact[e.rank], e.impact_ns)
    out = []
    for f in active:
        if f.level != "L5":
            continue
        for s in f.suspects:
            near = [s.rank] + [p for ps in partners.of(s.rank).values() for p in ps]
            worth = max((impact[r] for r in near if r in impact), default=0.0)
            if worth > 0:
                out.append(Evidence(s.rank, "L5", f.kind, str(s.evidence.get("function", f.kind)), False,
                                    True, 1.0, worth, "peers"))
    return out


def _named_only(findings: Sequence[Finding], named: set[int], pace_held: bool = False,
                host_noise: Collection[str] = ()) -> list[Finding]:
    """Findings as published: a suspect the verdict does not name (not yet persistent) is moved to
    the evidence's candidates, and a finding left naming nobody is informational (step 3), as is
    a job slower than its own pace until it held, and an L1 finding of a kind step 3c took for the
    host's scheduler (``host_noise``)."""
    out = []
    for f in findings:
        if f.level == "L1" and f.kind in host_noise and not f.informational:
            out.append(dataclasses.replace(f, informational=True, evidence={
                **f.evidence, "reason": "host scheduler: carried by no rank, the job's pace unchanged"}))
            continue
        if f.level == "pace" and not f.informational and not pace_held:
            out.append(dataclasses.replace(f, informational=True,
                                           evidence={**f.evidence, "reason": "not yet persistent"}))
            continue
        if f.informational or f.kind in ("stall", "missing_rank") or not f.suspects:
            out.append(f)
            continue
        keep = tuple(s for s in f.suspects if s.rank in named)
        if len(keep) == len(f.suspects):
            out.append(f)
        elif keep:
            out.append(dataclasses.replace(f, suspects=keep, evidence={**f.evidence, "not_yet_persistent": [
                s.rank for s in f.suspects if s.rank not in named]}))
        else:
            out.append(dataclasses.replace(f, informational=True,
                                           evidence={**f.evidence, "reason": "not yet persistent"}))
    return out


#: The collective a late start names carries its sequence number, new every window: not part of the place.
_SEQ = re.compile(r", seq \d+\)")


def _window_sums(flagged: Mapping[int, RankVerdict], iterations: Mapping[int, float], noise_ns: float = 0.0,
                 late: Sequence[Finding] = ()) -> tuple[dict[tuple[int, str], float], float]:
    """Step 3's sequential input: {(rank, place): Σ y_i} of each culprit's places flagged with a peer z
    (``sequential.window_sum``: against its peers and against the step's noise, the largest where levels
    agree), and the window's iterations (median over ranks).

    ``late``: the collectives level's late starts of a device-timed job. A late start is measured per
    collective (Mycroft §5): the rank started its collective after every peer had, by more than the
    transfer, in each of ``late_collectives`` collectives of the window. Where that happened at least
    twice (one late arrival is one event), y_i is bounded by its cost alone: Σ y_i = n·excess / noise
    (``sequential.py`` step 1b; no peer z, the comparison is the order of arrival). Host-timed
    lateness (CPU jobs, where the scheduler delays a rank for a whole window) keeps k of n."""
    sums: dict[tuple[int, str], float] = {}
    work: dict[int, float] = {}          # per rank: the largest sum of its own (non-collective) work
    late_sums: list[tuple[tuple[int, str], float]] = []
    its = sorted(float(v) for v in iterations.values() if v > 0)
    typical = its[len(its) // 2] if its else 1.0
    for r, rv in flagged.items():
        n = float(iterations.get(r, 1.0))
        if rv.role != CULPRIT or n < typical:
            # fewer iteration marks than its peers (records lost or late on a loaded host): its values per
            # iteration may divide totals by too few iterations; such a window counts toward k of n only
            continue
        for e in rv.evidence:
            if e.z > 0 and e.rank == r and e.role == CULPRIT:   # its own slow work, not a wait
                key = (r, _SEQ.sub(")", e.where))
                y = sequential.window_sum(e.z, n, e.impact_ns, noise_ns)
                if e.communication:     # a collective the others waited in: it arrived late (L3 step 5)
                    late_sums.append((key, y))
                    continue
                sums[key] = max(sums.get(key, 0.0), y)
                work[r] = max(work.get(r, 0.0), y)
    if noise_ns > 0:
        for f in late:
            for e, s in zip(evidence_of(f), f.suspects):
                rv = flagged.get(e.rank)
                n = float(iterations.get(e.rank, 1.0))
                if (rv is None or rv.role != CULPRIT or e.role != CULPRIT or n < typical
                        or int(s.evidence.get("late_collectives", 0)) < 2):
                    continue
                late_sums.append(((e.rank, _SEQ.sub(")", e.where)), n * e.impact_ns / noise_ns))
    for key, y in late_sums:
        # step 1d: lateness is as strong as what made the rank late, where that is its own device work
        # flagged in this window (a noisy rank's spikes in one kernel made it last in one window)
        y = min(y, work[key[0]]) if key[0] in work else y
        sums[key] = max(sums.get(key, 0.0), y)
    return sums, typical


def _median_phase_excess(rv: RankVerdict, jw: JobWindow | None) -> bool:
    """Step 3b's second test, for a phase the rank itself was slow in (an L2 culprit): its median
    occurrence is over its peers' median by ``COUNT_Z`` standard errors of that phase's own spread.

    The step's noise bounds a phase's noise from above; beside a busy process it is a third of the step
    (steps of 35 to 250 ms around 85 ms), and a data loader 30 ms slower in every iteration sat under
    COUNT_Z·σ/√n in some windows. The scheduler's delays land on a few occurrences of a phase and move
    its mean, not its median; a slow phase moves both. Per phase, from the window's PhaseStats:
    1. excess = p50 of the rank − median over its peers of their p50;
    2. σ of each rank's occurrences from its spread above the median, (max − p50) / E[max of n
       standard normals] (Blom's score Φ⁻¹((n − 0.375)/(n + 0.25))): bursts make it large, never small;
    3. the excess counts when ≥ COUNT_Z · 1.2533·√(σ_rank² + σ_peers²)/√n (1.2533σ/√n: the standard
       error of a median; σ_peers the median of the peers').
    """
    if jw is None or rv.role != CULPRIT:
        return False
    for e in rv.evidence:
        if e.level != "L2" or e.rank != rv.rank or e.role != CULPRIT:
            continue
        own, peers = None, []
        for rank, pw in jw.phases.items():
            st = next((p for p in pw.phases if p.phase == e.where and p.count > 1), None)
            if st is not None:
                if rank == rv.rank:
                    own = st
                else:
                    peers.append(st)
        if own is None or not peers:
            continue
        excess = own.p50_ns - statistics.median(p.p50_ns for p in peers)                     # 1
        spread = statistics.median(_phase_sigma(p) for p in peers)
        se = sequential.MEDIAN_SE * (_phase_sigma(own) ** 2 + spread ** 2) ** 0.5 / own.count ** 0.5   # 3
        if excess > 0 and excess >= COUNT_Z * se:
            return True
    return False


def _phase_sigma(st: records_pb2.PhaseStats) -> float:
    """Step 3b's step 2: σ of one rank's occurrences of a phase from its spread above the median."""
    n = int(st.count)
    return max(st.max_ns - st.p50_ns, 0.0) / statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def _places_of(rv: RankVerdict) -> set[str]:
    """Where a rank was flagged, for persistence: its places, and the waited-for rank of a waiter. A late
    start's place is its group and op: "late start to allgather (group 0, seq 94)" one window and
    "(group 0, seq 184)" the next are the same place (an FSDP2 rank late every step was never named).
    A place counts in the role the rank has now (its evidence of that role; all of it when none is):
    waiting at ``collective_wait`` one window and one late arrival the next is not a culprit flagged
    twice (a real FSDP2 job on a loaded host named healthy rank 2 a culprit beside the late rank 1
    in the window of its one late all-gather: its earlier waits at the same place had counted)."""
    mine = [e for e in rv.evidence if e.role == rv.role] or list(rv.evidence)
    places = {_SEQ.sub(")", e.where) for e in mine}
    if rv.role == WAITER:
        places = {WAITING + p for p in places}
    # one cause seen by two levels is one place: the data loader as the L2 phase one window and as
    # the sampled L3 CPU operator (enumerate(DataLoader)#..._next__) the next (a real 4-rank job's
    # 30 ms loader, each level short of its threshold in turn, was "healthy")
    if any(e.rank == rv.rank and e.role == CULPRIT and _LOADER.search(e.where) for e in rv.evidence):
        places.add("cause: data loader")
    if rv.waited_for >= 0 and rv.role == WAITER:
        places.add(f"{WAITING}waited for {rv.waited_for}")
    return places


#: Step 3: a waiter's places are kept apart from the same places flagged in its own right.
WAITING = "waiter: "


def _shared(suspects: list[RankVerdict], resources: Mapping[int, Resource], of) -> str:
    """Step 4: the value of ``of(resource)`` (a host, NIC, switch, group) holding ≥ 2/3 of the
    culprit and link suspects' impact, with at least two of them ("" when none does)."""
    by: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.Counter()
    total = 0.0
    for rv in suspects:
        if rv.role not in (CULPRIT, LINK):
            continue
        name = of(resources[rv.rank]) if rv.rank in resources else ""
        total += rv.score_ns
        if name:
            by[name] += rv.score_ns
            count[name] += 1
    if not by or total <= 0:
        return ""
    best = max(by, key=by.get)
    return best if count[best] >= 2 and by[best] >= 2 / 3 * total else ""


#: Group dimensions the verdict may name, smallest groups first (step 4).
_GROUP_DIMS = ("tp", "ep", "cp", "pp", "dp")


def _shared_group(suspects: list[RankVerdict], resources: Mapping[int, Resource],
                  active: Sequence[Finding]) -> str:
    """Step 4: "tp 3" when the suspects are one parallel group (see the module docstring)."""
    # a group is named when it holds two or more of the culprits/links: one culprit inside a slower
    # group (its partners waiting) is that rank's fault, not the group's
    named = {rv.rank for rv in suspects if rv.role in (CULPRIT, LINK)}
    for f in active:
        if f.comparison == "sibling_groups" and f.scope.group in _GROUP_DIMS \
                and len(named & {s.rank for s in f.suspects}) >= 2:
            return f"{f.scope.group} {f.scope.group_index}"
    for dim in _GROUP_DIMS:
        def of(res: Resource, dim=dim) -> str:
            return f"{dim} {group_index(res.coords, dim)}" if getattr(res.coords, f"{dim}_size") > 1 else ""
        g = _shared(suspects, resources, of)
        if not g:
            continue
        size = max(getattr(resources[rv.rank].coords, f"{dim}_size") for rv in suspects if rv.rank in resources)
        members = sum(1 for rv in suspects if rv.role in (CULPRIT, LINK) and rv.rank in resources
                      and of(resources[rv.rank]) == g)
        if 2 * members >= size:
            return g
    return ""


def _hang_wait_ns(rv: RankVerdict) -> float:
    """A collective hang's evidence carries the peers' wait (ns), not a cost per iteration; 0 if none."""
    return max((e.impact_ns for e in rv.evidence if e.kind == "stall" and e.level == "collectives"), default=0.0)


def _loss_share(suspects: list[RankVerdict], first: dict[int, int | None] | None = None,
                job_loss: JobLoss | None = None) -> float:
    """Step 5b: the factor that makes the culprits' and links' impacts together what the job lost
    against its own healthy pace (``job_pace.JobLoss``, its mean step now against its baseline's).

    1. The baseline is the pace level's windows before the first window that flagged any of them
       (``first``): a rank already slow there is inside them, and the loss against them is not its
       price (a loaded host slowed a job whose data loader had cost 30 ms since its first window by
       7 ms more). Without such windows (flagged from the job's start) their own excess stands.
    2. More than the loss: scaled down to it. A rank the others wait for is priced by their wait,
       which counts the same lost second once per waiter; a kernel's excess the step absorbs is not
       the job's loss (a degraded NVLink pair priced at 0.4 s/iteration each in a simulated job that
       lost 0.04 s); the eight ranks of a host slow at once cost the job one delay, not eight.
    3. Less than a loss that is real (z ≥ ``SCALE_UP_Z``): scaled up to it. The named excess is what
       the evidence measured of it, and a median-based excess steps over an intermittent fault's
       seconds (a rank's collective 1 s late in one call of a hundred cost its job 11 %; its lateness
       read a fifth of that); the job's loss is the fault's price when the fault is what was named.
    """
    priced = [rv for rv in suspects if rv.role in (CULPRIT, LINK) and _hang_wait_ns(rv) <= 0]
    total = sum(rv.score_ns for rv in priced)
    if job_loss is None or total <= 0:
        return 1.0
    since = [i for i in ((first or {}).get(rv.rank) for rv in priced) if i is not None]
    measured = job_loss.bound(min(since) if since else None)
    if measured is None:
        return 1.0
    loss, z = measured
    if total > loss or z >= SCALE_UP_Z:
        return loss / total
    return 1.0


def _why(rv: RankVerdict, step_ns: float, host_fn: str | None, cost_ns: float) -> str:
    ms = cost_ns / 1e6
    if _hang_wait_ns(rv) > 0:
        where = ", ".join(w[:48] for w in rv.where[:3])
        if rv.role == LINK:     # every member entered; the channel states name the network (step 5b)
            return (f"collective hang in the network (slow transfer, network side): {where}; its peers "
                    f"waited {_hang_wait_ns(rv) / 1e9:.3g} s [{'+'.join(sorted(rv.levels))}]")
        return f"stopped: its peers waited {_hang_wait_ns(rv) / 1e9:.3g} s in {where} [{'+'.join(sorted(rv.levels))}]"
    pct = f" ({100 * cost_ns / step_ns:.1f}% of the step)" if step_ns > 0 else ""
    where = ", ".join(w[:48] for w in rv.where[:3])
    lv = "+".join(sorted(rv.levels))
    if rv.role == WAITER:
        who = f" for rank {rv.waited_for}" if rv.waited_for >= 0 else ""
        return f"waited {ms:.3g} ms/iteration{pct} in {where}{who} [{lv}]"
    if rv.role == LINK:
        return f"collective {where} slower by {ms:.3g} ms/iteration{pct} with no late member: slow link [{lv}]"
    extra = f"; host busy in {host_fn}" if host_fn else ""
    made = f"; made ranks {', '.join(map(str, rv.waiters[:6]))} wait" if rv.waiters else ""
    cause = _cause(rv, host_fn)
    return f"{cause + ' — ' if cause else ''}costs {ms:.3g} ms/iteration{pct} in {where} [{lv}]{made}{extra}"


_LOADER = re.compile(r"data.?load|dataloader|next_data|fetch", re.IGNORECASE)
_CPU_OP = re.compile(r"^(aten|autograd|c10d|gloo|torch|Optimizer)[:.]|^<built-in", re.IGNORECASE)


def _cause(rv: RankVerdict, host_fn: str | None) -> str:
    """The class of evidence that explains a culprit's cost, in plain words, first (issue #22 item 6):
    "GPU compute 1.4x its peers': gemm, flash_bwd", "host: data loader", "Python: train.py:63 hot_loop",
    "late start: reached allreduce (group 0) after its peers". From its own evidence of the largest
    impact; "" when it has none (an L1 spike, inherited lateness)."""
    mine = [e for e in rv.evidence if e.rank == rv.rank and e.role == CULPRIT and e.level not in ("L1", "DEP")]
    # a collective it is faster in is where the others waited for it, not its own work
    own = [e for e in mine if not e.communication or e.level == "collectives"]
    if not own:
        if host_fn:
            return f"Python: {host_fn}"
        return "late arrival: its collectives are the shortest (its peers waited)" if mine else ""
    # its own work first (kernels, phases, its stacks): a late start is lateness, whose cause that work is
    work = [e for e in own if e.level != "collectives"]
    top = max(work or own, key=lambda e: e.impact_ns)
    ratio = f" {top.ratio:.2g}x its {'own recent pace' if top.comparison == 'own_history' else 'peers'}" if (
        top.ratio > 1.0 and top.level != "collectives") else ""
    if top.level == "L5":
        return f"Python: {top.where}"
    if _LOADER.search(top.where):
        return f"host: data loader ({top.where}){ratio}"
    if top.level == "collectives":
        lead = f"late start: reached {_SEQ.sub(')', top.where).removeprefix('late start to ')} after its peers"
        return lead + (f" (host busy in {host_fn})" if host_fn else "")
    if top.level == "L3":
        names = list(dict.fromkeys(e.where for e in sorted(own, key=lambda e: -e.impact_ns) if e.level == "L3"))[:2]
        cpu = all(_CPU_OP.search(n) for n in names)
        memory = "[memory]" in names[0] or "memcpy" in names[0].lower() or "memset" in names[0].lower()
        kind = "memory copies" if memory else ("CPU operators" if cpu else "GPU compute")
        return f"{kind}{ratio}: {', '.join(n[:40] for n in names)}"
    return f"phase {top.where}{ratio}"


def _places(suspects: list[RankVerdict], findings: list[Finding], what: str) -> list[str]:
    """Phases (or kernels) where the top culprits and links are slower, by impact: a waiter's place is
    where it waited for them (a throttled GPU's pipeline neighbours, once persistent too, put their
    ``pp-recv`` ahead of its own ``backward``), so waiters' places count only in a verdict naming no
    culprit or link."""
    causes = [rv for rv in suspects if rv.role in (CULPRIT, LINK)] or suspects
    top = {rv.rank for rv in causes[:8]}
    best: dict[str, float] = {}
    for f in findings:
        name = f.scope.phase if what == "phase" else f.scope.kernel
        if not name or (what == "phase") != (f.level == "L2"):
            continue
        for s in f.suspects:
            # where the rank loses time: a collective it is faster in (it arrived late) is not one
            if s.rank in top and s.evidence.get("direction") != "faster":
                best[name] = max(best.get(name, 0.0), s.impact_ns)
    return sorted(best, key=lambda k: -best[k])[:10]


def _comparison(comparisons: Mapping[str, int] | None, suspects: list[RankVerdict]) -> str:
    if suspects:
        kinds = set().union(*(rv.comparisons for rv in suspects[:3]))
        return "+".join(sorted(kinds))
    if comparisons is None:
        return "peers"
    made = sorted({_COMPARED.get(k, k) for k, n in comparisons.items() if n > 0})
    return "+".join(made) if made else "none"


def _confidence(state: str, suspects: list[RankVerdict], resources, host: str,
                persistence: Persistence | None, comparisons, pending) -> float:
    """Step 6."""
    if state == UNKNOWN:
        return 0.0
    if state == STALLED and not suspects:
        return 0.8       # no progress is a fact; who stopped first could not be told
    if state == SUSPECTED:
        return round(0.5 * (persistence.held(pending[0]) if persistence is not None and pending else 0.5), 2)
    if state in (HEALTHY,) or (state == DEGRADED and not suspects):
        levels = comparisons or {}
        share = (sum(1 for n in levels.values() if n > 0) / len(levels)) if levels else 1.0
        return round(share * (0.7 if pending else 1.0) * (0.5 if state == DEGRADED else 1.0), 2)
    top = suspects[0]
    if host:
        by_host = collections.defaultdict(float)
        for rv in suspects:
            by_host[resources[rv.rank].host if rv.rank in resources else ""] += rv.score_ns
        vals = sorted(by_host.values(), reverse=True)
    else:
        vals = [rv.score_ns for rv in suspects if rv.role in (CULPRIT, LINK)] or [top.score_ns]
    margin = 1.0 - (vals[1] / vals[0] if len(vals) > 1 and vals[0] > 0 else 0.0)
    agreement = min(1.0, len(top.culprit_levels or top.levels) / 2)
    held = persistence.held(top.rank) if persistence is not None else 1.0
    return round(0.4 * margin + 0.3 * agreement + 0.3 * held, 2)


def summarize(job_id: str, v: records_pb2.Verdict, findings: Sequence[Finding],
              resources: Mapping[int, Resource]) -> str:
    """One line a person can act on."""
    step = f", step {v.step_s * 1e3:.4g} ms" if v.step_s > 0 else ""
    head = f"job {job_id}: {v.state or HEALTHY}"
    if v.HasField("since_window"):
        head += f" since window {v.since_window}"
    head += f" (confidence {v.confidence:.2f}{step}"
    head += f", compared with {v.comparison.replace('+', ' and ')})" if v.comparison and v.comparison != "peers" \
        else ")"
    if v.state == UNKNOWN:
        missing = _missing_ranks(findings)
        if v.partial and missing:
            return head + (f" — {missing} of {missing + len(resources)} ranks missing: the ranks present"
                           " cannot be judged against the job" if resources else
                           f" — {missing} rank(s) missing: the ranks present cannot be judged against the job")
        return head + " — no comparison possible (groups too small, no history yet)"
    parts = [head]
    pace = next((d for d in v.findings if d.level == "pace" and not d.informational), None)
    if pace is not None and v.state == DEGRADED:
        ev = pace.evidence
        slower = (f"{pace.impact_s * 1e3:.4g} ms/iteration, +{ev['slowdown_pct']:.0f}% of its own recent pace "
                  f"of {ev['step_baseline_s'] * 1e3:.4g} ms")
        parts.append(f"slower than itself: {slower}" if v.ranks else
                     f"not localized: every rank slower together ({slower}); a link or shared resource?")
    l1 = sorted({f.kind for f in findings if f.level == "L1" and not f.informational})
    if l1:
        parts.append("iteration time: " + "+".join(l1) + (" (once: watching)" if v.state == HEALTHY else ""))
    if v.host:
        on = [s.rank for s in v.ranks if s.host == v.host]
        parts.append(f"host {v.host} (ranks {_ranges(on)})")
    if v.nic:
        parts.append(f"NIC {v.nic}")
    if v.switch_name:
        parts.append(f"switch {v.switch_name}")
    if v.group:
        parts.append(f"{v.group.split()[0].upper()} group {v.group.split()[-1]}")
    if v.ranks:
        top = v.ranks[0]
        res = resources.get(top.rank)
        coords = ""
        if res is not None:
            c = res.coords
            coords = f" (host {res.host or '?'}, dp={c.dp} tp={c.tp} pp={c.pp} ep={c.ep} cp={c.cp})"
        parts.append(f"{top.role} rank {top.rank}{coords}: {top.why}")
        if len(v.ranks) > 1:
            parts.append("also " + ", ".join(f"{s.rank} ({s.role})" for s in v.ranks[1:6]))
    if v.pending:
        parts.append(f"suspected rank(s) {', '.join(map(str, list(v.pending)[:6]))}: flagged, not yet in enough"
                     " windows to be named (more iterations will confirm or clear them)")
    if v.partial:
        missing = _missing_ranks(findings)
        parts.append(f"partial window: {missing} rank(s) missing, nobody named from it" if missing
                     else "ranks missing in some windows (partial: nobody named from those)")
    return " — ".join(parts)


def _missing_ranks(findings: Sequence[Finding]) -> int:
    """How many expected ranks sent nothing for the window (its ``missing_rank`` finding)."""
    return max((len(f.suspects) for f in findings if f.kind == "missing_rank"), default=0)


def _ranges(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}–{ranks[j]}")
        i = j + 1
    return ", ".join(out)


#: What a level's comparisons compared a rank with (``WindowContext.comparisons`` keys).
_COMPARED = {"L1": "iteration_history", "L2": "peers", "L3": "peers", "L4": "peers", "pace": "own_pace"}

#: A job of fewer judged windows than this (persistence's n) ends "suspected" on a suspicion still open.
SHORT_JOB_WINDOWS = 3

_STATE_ORDER = {STALLED: 4, DEGRADED: 3, SUSPECTED: 2, UNKNOWN: 1, HEALTHY: 0}
#: the cost a window's ``_why`` wrote; the job's verdict restates it with the job's figures
_COST = re.compile(r"\S+ ms/iteration(?: \([^)]*% of the step\))?")


def _inherited_lateness(vs: Sequence[records_pb2.Verdict], roles: dict, latest: dict) -> None:
    """:func:`merge_windows` step 2b, in place on ``roles`` (rank -> Counter of roles over windows) and
    ``latest`` (rank -> the suspect whose line the job's verdict shows)."""
    culprit_windows = {r: c[CULPRIT] for r, c in roles.items()}
    lateness_only: dict[int, bool] = {}
    waited: dict[int, set[int]] = collections.defaultdict(set)
    as_waiter: dict[int, records_pb2.Suspect] = {}
    for v in vs:
        for s in v.ranks:
            if s.role == CULPRIT:
                levels = set(s.evidence["culprit_levels"]) if "culprit_levels" in s.evidence else {""}
                lateness_only[s.rank] = lateness_only.get(s.rank, True) and levels <= {"collectives"}
            elif s.role == WAITER and s.waited_for >= 0 and s.waited_for != s.rank:
                waited[s.rank].add(s.waited_for)
                as_waiter[s.rank] = s
    for r, n in culprit_windows.items():
        if n and lateness_only.get(r) and any(culprit_windows.get(c, 0) > n for c in waited.get(r, ())):
            roles[r] = collections.Counter({WAITER: sum(roles[r].values())})
            latest[r] = as_waiter[r]


def merge_windows(verdicts: Sequence[records_pb2.Verdict]) -> records_pb2.Verdict | None:
    """The job's verdict over its windows (the replay contract's ``verdict``; ``query verdict``).

    1. State: the worst state any window had (stalled > degraded > suspected >
       unknown > healthy), except that "unknown" needs every window to be unknown: one
       window that could compare ranks makes the job judgeable; and "suspected" counts
       only when the last judged window still had it (a suspicion a later window cleared
       was noise) in a job of fewer than ``SHORT_JOB_WINDOWS`` judged windows (too short
       to confirm anything), with that window's pending ranks.
    2. Suspects: every rank windows named (at least twice when another rank
       was named more often: one window's noise is not the job's answer),
       scored by the sum over windows of its impact (cost × duration),
       keeping its most frequent role; impact reported is the median over
       the windows that named it (of an even count, the middle two's mean).
    2b. Lateness inherited across windows (attribution step 3 over the job): a
       rank named culprit by lateness alone (its culprit levels only
       ``collectives``) in fewer windows than a culprit it was measured waiting
       for in another window is that culprit's waiter. In a two-group job a
       contended rank made its DP peer wait in their all-reduce; the peer, late
       to its next TP all-reduce for it, was a late starter in one window (its
       wait there under the level's bar) and the contended rank's measured
       waiter in the next: the job's verdict named the peer first (1 of 3
       idle runs).
    3. Host (NIC, switch, group) and onset: the one named by at least half
       the windows that named anyone; the earliest ``since_window`` of the windows naming the
       top suspect.
    4. Confidence: the mean confidence of the windows naming the top suspect,
       × the share of the windows since onset that named it (a top suspect
       that flips between windows is not a confident answer).
    """
    vs = [v for v in verdicts if v.state or v.ranks or v.findings]
    if not vs:
        return None
    last = vs[-1]
    out = records_pb2.Verdict(job_id=last.job_id, created_unix_ns=time.time_ns())
    out.window.CopyFrom(last.window)
    out.window.index = last.window.index
    out.window.start_ns = min(v.window.start_ns for v in vs)
    states = [v.state or (DEGRADED if v.ranks else HEALTHY) for v in vs]
    judged = [s for s in states if s != UNKNOWN]
    # a suspicion a later window cleared was noise, and so is one a job of n windows or more left open at
    # its end (any of its windows could have been; measured: 4 of 6 healthy 20-step replays ended on one);
    # a capture too short to confirm anything (under SHORT_JOB_WINDOWS) is "suspected" when it ended so
    ended_suspected = bool(judged) and judged[-1] == SUSPECTED and len(judged) < SHORT_JOB_WINDOWS
    judged = [s for s in judged if s != SUSPECTED] + ([SUSPECTED] if ended_suspected else [])
    out.state = max(judged, key=_STATE_ORDER.get) if judged else UNKNOWN
    if ended_suspected:
        out.pending.extend(next(v for v in reversed(vs) if (v.state or HEALTHY) != UNKNOWN).pending)
    steps = [v.step_s for v in vs if v.step_s > 0]
    out.step_s = float(sorted(steps)[len(steps) // 2]) if steps else 0.0
    impact: dict[int, list[float]] = collections.defaultdict(list)
    roles: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    latest: dict[int, records_pb2.Suspect] = {}
    for v in vs:
        hung = {s.rank for d in v.findings if d.kind == "stall" and d.level == "collectives" for s in d.suspects}
        for s in v.ranks:
            impact[s.rank].append(s.impact_s or (0.0 if s.rank in hung else s.score))
            roles[s.rank][s.role or CULPRIT] += 1
            latest[s.rank] = s
    _inherited_lateness(vs, roles, latest)      # step 2b
    order = {CULPRIT: 0, LINK: 1, WAITER: 2, MISSING: 3}
    # a rank one window named while others were named window after window is that window's noise
    most = max((len(v) for v in impact.values()), default=0)
    need = min(2, most)
    stalled = {s.rank for v in vs for d in v.findings if d.kind == "stall" for s in d.suspects}
    impact = {r: v for r, v in impact.items() if len(v) >= need or r in stalled}
    ranked = sorted(impact, key=lambda r: (order.get(roles[r].most_common(1)[0][0], 9), -sum(impact[r]), r))
    for r in ranked:
        vals = impact[r]
        med = statistics.median(vals)     # of an even count, the middle two's mean: never the larger alone
        s = out.ranks.add()
        s.CopyFrom(latest[r])
        s.role = roles[r].most_common(1)[0][0]
        s.impact_s = s.score = med
        s.impact_pct = 100.0 * med / out.step_s if out.step_s > 0 else s.impact_pct
        s.why = _COST.sub(f"{med * 1e3:.3g} ms/iteration ({s.impact_pct:.1f}% of the step)", s.why, count=1)
        s.evidence.update({"windows_named": len(vals)})
    named_windows = sum(1 for v in vs if v.ranks)
    for field in ("host", "nic", "switch_name", "group"):
        seen = collections.Counter(getattr(v, field) for v in vs if getattr(v, field))
        if seen and seen.most_common(1)[0][1] * 2 >= named_windows:
            setattr(out, field, seen.most_common(1)[0][0])   # named by at least half the windows naming anyone
    if ranked:
        top = ranked[0]
        naming = [v for v in vs if any(s.rank == top for s in v.ranks)]
        since = [v.since_window for v in naming if v.HasField("since_window")]
        if since:
            out.since_window = min(since)
        onset = out.since_window if out.HasField("since_window") else naming[0].window.index
        after = [v for v in vs if v.window.index >= onset]
        share = len(naming) / max(len(after), 1)
        out.confidence = round(sum(v.confidence for v in naming) / len(naming) * share, 2)
        out.comparison = naming[-1].comparison
    else:
        out.confidence = round(sum(v.confidence for v in vs) / len(vs), 2)
        out.comparison = last.comparison
    out.phases.extend(dict.fromkeys(p for v in vs for p in v.phases).keys())
    out.kernels.extend(dict.fromkeys(k for v in vs for k in v.kernels).keys())
    out.partial = any(v.partial for v in vs)
    last_named = next((v for v in reversed(vs) if v.ranks), None)
    if last_named is not None:      # the evidence behind the verdict: the latest window that named someone
        out.findings.extend(last_named.findings)
    else:                           # or that found the job slower than itself (names nobody)
        slow = [v for v in vs if any(d.level == "pace" and not d.informational for d in v.findings)]
        if slow:
            out.findings.extend(slow[-1].findings)
            since = [v.since_window for v in slow if v.HasField("since_window")]
            out.since_window = min(since) if since else slow[0].window.index
    out.summary = summarize(out.job_id, out, [], {}).replace(
        f"job {out.job_id}:", f"job {out.job_id} ({len(vs)} windows):", 1)
    return out
