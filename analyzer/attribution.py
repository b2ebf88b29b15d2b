"""Culprit versus waiter: whose time is it? (ARGUS §9.5; Mycroft §5 dependency reasoning)

Ranks that synchronise (a tensor-parallel group, pipeline neighbours, a
data-parallel group, an expert-parallel group) wait for each other inside
collectives: when one member is late, *every other member's* collective
grows by the delay and the late member's is the shortest. A detector that
compares ranks with their peers sees the waiters as "slower in
communication" — often with a larger number than the culprit's own excess,
because several of them waited. This module turns findings into typed
evidence and attributes the waiting to the member that made the others wait.

1. ``evidence_of``: one rule for direction. A suspect is *slower* when its
   detector says so (``evidence.direction``), else when its ratio to its
   peers is ≥ 1. Culprit evidence: slower outside communication, or faster
   inside it (a late arriver's collectives are its shortest). Waiter
   evidence: slower inside communication.
2. Sync partners of a rank: the ranks it shares a TP, CP, EP or DP group
   with, and its PP neighbours (same dp/tp/ep/cp, stage ± 1).
3. Inherited lateness: a rank whose only culprit evidence is arriving late
   to a collective (or being slower in forward/backward, which hold
   tensor-parallel collectives) while a sync partner has slow work of its
   own (compute, memory, a host phase, or a host function its stacks show; a late start
   found by the collectives level is lateness, not work of its own)
   worth at least ``INHERIT_SHARE`` of it, was late because of that partner
   (a TP partner of a slow GPU arrives late to the data-parallel all-reduce
   too; so does that partner's pipeline neighbour: followed transitively):
   it is a waiter pointing at the partner, and the owner's score takes the
   lateness' impact.
   A waiter whose finding measured whom it waited for (the collectives
   level's late start lists each waiter with the late member) points at
   that rank, even when it is a waiter itself: a rank late to its DP
   all-reduce because it waited in its TP one passes the wait on, and step
   5 follows the chain to the culprit (issue #22: lateness followed across
   groups; before, the DP peers of a slow GPU's TP partner were named as
   slow links). Otherwise each waiter points at the partner with culprit
   evidence whose impact is largest (``waited_for``); without one, at a
   partner that is a waiter whose chain ends at a culprit (followed to a
   fixed point: a host's slow ranks make their next pipeline stage late,
   and that stage's DP peers wait for it in their all-reduce). The other way round
   too: a rank whose only culprit evidence is lateness, measured waiting
   for a culprit in another group by at least ``INHERIT_SHARE`` of that
   lateness, passed the wait on (rank 3 waits for its DP peer 1 and then
   starts its TP all-reduce late): it is a waiter of that culprit.
   When no partner was flagged, the records of the window decide: in the
   waiter's tensor-parallel group (the most tightly synchronised), the member with the shortest time in the same collective
   arrived last; if it is shorter than the waiter by at least half the
   waiter's excess, it is the culprit by dependency (evidence level
   ``DEP``), with the waiter's excess as its impact.
   3b. Late arrivers linked to each other with no flagged work of their
   own, and no partner with any: the one with clearly (``TIEBREAK_MARGIN``) the most extra work
   outside communication against its DP peers is where the lateness starts (a slightly
   slower GPU that makes its TP partner and their pipeline neighbours late), when that
   excess stands out of the peers' spread on one test (``TIEBREAK_Z``, with the
   personality floor: below it, it is healthy GPU-to-GPU variation, not a cause).
   3c. Lateness nobody's work explains: a culprit whose only evidence is arriving late
   (its collectives the shortest) with no owner found is named only when the
   lateness exceeds what healthy personality gives the last of its group to arrive:
   ``LATE_Z`` × ``PERSONALITY`` × sqrt(2 ln n) of the step (the expected maximum of n
   normal draws, n its largest sync group). Some replica is always the last; a
   healthy one is last by a few per cent.
   3d. Late arrivers with no work of their own (a rank whose NCCL proxy delays its
   collectives, its TP partner, their pipeline neighbours): one that waited, where no finding
   measured whom for, in a collective a late partner did not wait in, passed that partner's
   lateness on and is its waiter (``_passed_on``).
4. Waiters left without a culprit: one whose work outside collectives is
   short against its DP peers by at least ``EARLY_SHARE`` of its wait was
   early, not slowed (a rank's step is its work plus its wait, and a fast
   rank waits for everyone), and one that waited less than step 3c's bound
   at ``WAIT_Z`` may have waited for healthy personality: both are dropped. The
   rest waited in collectives with no late member: the collective itself was
   slow for them, their link (role ``link``; several sharing a host: the link
   between them, a degraded NVLink/NIC slows every member's collective alike,
   ARGUS §9.2; one alone: its own NIC or NVLink). A waiter is always named
   with the rank it waited for, never for nobody.
5. Scores: a culprit's score is the largest of its own impact and the
   impacts of the waiters that point at it, so a waiter can never outrank
   the rank it waited for; roles order the verdict (culprit, link, waiter).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Iterable, Mapping

import numpy as np

from trainscope.analyzer.model import CULPRIT, LINK, MISSING, WAITER, Finding, JobWindow
from trainscope.analyzer.sequential import PEER_LEVELS
from trainscope.analyzer.topology import RoutingConfig, group_of, has_coords
from trainscope.proto.model import DIMS, Resource

#: Step 3b: the late rank with the most own work must have this many times the next one's ...
TIEBREAK_MARGIN = 1.5
#: ... and stand this many spreads (robust, with the personality floor) above its DP peers.
TIEBREAK_Z = 2.0
#: Healthy GPU-to-GPU personality as a share of a rank's work: the floor of the peers' spread
#: used by every level (docs/noise.md: per-kernel offsets of 3 % averaged over a window's kernels).
PERSONALITY = 0.02
#: Step 3c: lateness with no owner is named beyond this many personality maxima of its group.
LATE_Z = 2.0
#: Step 4: a waiter whose own work is short by this share of its wait (or more) arrived early.
EARLY_SHARE = 0.5
#: Step 4: waiting with no late member is kept beyond this many personality maxima (the expected
#: extreme itself: unlike a late arriver, a waiter is never named a culprit on it).
WAIT_Z = 1.0
#: A partner's own slow work explains a rank's lateness when it is at least this share of it.
INHERIT_SHARE = 0.2
#: Phases that hold collectives inside them (forward/backward of tensor-parallel layers): being
#: slower there is culprit evidence, but not proof of slow work of the rank's own.
AMBIGUOUS = re.compile(r"^(forward|backward)$|^fwd$|^bwd$", re.IGNORECASE)

#: The collectives level's finding of a rank late to a group's collectives (analyzer/collectives.py step 3).
LATE_START = "late_start"
#: Verdict order of roles.
ROLE_ORDER = {CULPRIT: 0, LINK: 1, WAITER: 2, MISSING: 3}

_ROUTING = RoutingConfig()


@dataclasses.dataclass(frozen=True, slots=True)
class Evidence:
    """One suspect of one finding, typed (step 1)."""

    rank: int
    level: str
    kind: str
    where: str               # phase, kernel, host function, or the finding's kind
    communication: bool
    slower: bool
    ratio: float
    impact_ns: float
    comparison: str = "peers"
    link: bool = False       # a stall whose root is a NIC or link, not a rank (collectives step 5b)
    waited_for: int = -1     # the rank it waited for, where the finding measured it (a late start's waiters)
    z: float = 0.0           # device-timed peer z of a window mean (sequential.py); 0: none

    @property
    def role(self) -> str:
        if self.kind in ("missing_rank",):
            return MISSING
        if self.kind == "stall":
            return LINK if self.link else CULPRIT
        if self.kind == "slow_link":      # the waiting graph named the link or the NIC/NVLink (waiting_graph.py)
            return LINK
        return WAITER if (self.communication and self.slower) else CULPRIT

    @property
    def own(self) -> bool:
        """Slow work of its own (not a collective it arrived late to, not a phase holding collectives).
        The collectives level's late start is lateness too (Mycroft §5: the lateness is measured, not its
        cause): a slow GPU's TP partner and that pair's pipeline neighbours start late every step with
        no work of their own, and step 3 follows them to the partner whose work is slow."""
        return (self.role == CULPRIT and not self.communication and not AMBIGUOUS.search(self.where)
                and self.kind != LATE_START)

    @property
    def strength(self) -> float:
        """How many-fold the rank differs from its peers (|ln ratio|), 0 when unknown."""
        return abs(math.log(self.ratio)) if self.ratio > 0 else 0.0


def evidence_of(f: Finding, routing: RoutingConfig = _ROUTING) -> list[Evidence]:
    """Step 1 for every suspect of one finding."""
    label = f.scope.phase or f.scope.kernel
    comm = bool(f.evidence.get("communication")) if "communication" in f.evidence else (
        routing.is_communication(label) if label else False)
    out = []
    for s in f.suspects:
        ratio = s.evidence.get("ratio", s.evidence.get("own_ratio", 1.0))
        ratio = float(ratio) if isinstance(ratio, (int, float)) and math.isfinite(ratio) else 1.0
        direction = s.evidence.get("direction")
        slower = direction == "slower" if direction in ("slower", "faster") else ratio >= 1.0
        where = label or s.evidence.get("function") or f.kind
        out.append(Evidence(s.rank, f.level, f.kind, str(where), comm, slower, ratio,
                            float(s.impact_ns), f.comparison, link=f.kind == "stall" and s.role == LINK,
                            waited_for=int(s.waited_for) if s.role == WAITER else -1, z=_peer_z(f, s)))
    return out


def _peer_z(f: Finding, s) -> float:
    """|z| of a rank's window mean against its peers (``sequential.py`` step 3); 0 where the level has
    no such statistic, or where the value is host-timed (its iterations are not independent)."""
    ev = s.evidence
    if f.level not in PEER_LEVELS or f.comparison != "peers" or ev.get("host_timed"):
        return 0.0
    z = ev.get("significance_z", ev.get("z", 0.0))
    z = abs(float(z)) if isinstance(z, (int, float)) and math.isfinite(z) else 0.0
    own = ev.get("own_z")      # L3 step 5f: against its own calls' sampling error where that is larger
    return min(z, abs(float(own))) if isinstance(own, (int, float)) and math.isfinite(own) else z


def _strongest_partner(out: Mapping[int, "RankVerdict"], parts: Mapping[str, list[int]], keep) -> int | None:
    """Step 3: of the partners in ``out`` that ``keep(p)`` accepts, the one with the largest impact
    (the lowest rank on a tie), or None."""
    cands = [p for ps in parts.values() for p in ps if p in out and keep(p)]
    return max(cands, key=lambda p: (out[p].impact_ns, -p)) if cands else None


def _chain_culprit(out: Mapping[int, "RankVerdict"], rank: int, ends: tuple[str, ...] = (CULPRIT,)) -> int | None:
    """The culprit (or another role in ``ends``) a waiter's chain of ``waited_for`` ends at, or None
    (no such end, or a cycle)."""
    seen = set()
    while rank in out and rank not in seen:
        rv = out[rank]
        if rv.role in ends:
            return rank
        if rv.role != WAITER or rv.waited_for < 0:
            return None
        seen.add(rank)
        rank = rv.waited_for
    return None


class SyncPartners:
    """Step 2 for every rank at once: {dimension: partners} ("pp" = the neighbouring stages).

    Built once per window from ``topology.group_of`` (linear in the ranks), so
    looking a rank's partners up costs its groups' sizes, not the job's.
    """

    def __init__(self, resources: Mapping[int, Resource]) -> None:
        self.resources = resources
        with_coords = {r: x for r, x in resources.items() if has_coords(x)}
        self._member: dict[str, dict[int, list[int]]] = {}
        for d in DIMS:
            by_rank: dict[int, list[int]] = {}
            for members in group_of(with_coords, d).values():
                for r in members:
                    by_rank[r] = members
            self._member[d] = by_rank

    def of(self, rank: int) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        me = self.resources.get(rank)
        if me is None or not has_coords(me):
            return out
        for d, by_rank in self._member.items():
            members = by_rank.get(rank, ())
            if d == "pp":
                ps = [r for r in members if abs(self.resources[r].coords.pp - me.coords.pp) == 1]
            else:
                ps = [r for r in members if r != rank]
            if ps:
                out[d] = ps
        return out


def sync_partners(rank: int, resources: Mapping[int, Resource]) -> dict[str, list[int]]:
    """Step 2 for one rank (``SyncPartners`` for many)."""
    return SyncPartners(resources).of(rank)


@dataclasses.dataclass(slots=True)
class RankVerdict:
    """What the evidence says about one rank (steps 3-5)."""

    rank: int
    role: str
    impact_ns: float                 # own impact (culprit or waiting), ns per iteration
    score_ns: float                  # impact including waiters that point at it
    levels: set[str] = dataclasses.field(default_factory=set)
    culprit_levels: set[str] = dataclasses.field(default_factory=set)
    where: list[str] = dataclasses.field(default_factory=list)
    waited_for: int = -1
    waiters: list[int] = dataclasses.field(default_factory=list)
    comparisons: set[str] = dataclasses.field(default_factory=set)
    evidence: list[Evidence] = dataclasses.field(default_factory=list)


def _tp_last_arriver(jw: JobWindow | None, waiter: Evidence, partners: list[int],
                     iterations: Mapping[int, float]) -> int | None:
    """Step 3's data-driven rule: the TP partner with the shortest time in the same collective."""
    if jw is None or not partners:
        return None

    def time_in(rank: int) -> float | None:
        it = iterations.get(rank, 1.0)
        pw = jw.phases.get(rank)
        if pw is not None:
            tot = [p.total_ns or p.mean_ns * p.count for p in pw.phases if p.phase == waiter.where]
            if tot:
                return sum(tot) / it
        kw = jw.kernels.get(rank)
        if kw is not None:
            tot = [k.total_ns for k in kw.kernels if k.kernel == waiter.where]
            if tot:
                return sum(tot) / it
        return None

    mine = time_in(waiter.rank)
    if mine is None:
        return None
    times = {p: t for p in partners if (t := time_in(p)) is not None}
    if not times:
        return None
    best = min(times, key=times.get)
    return best if times[best] <= mine - 0.5 * waiter.impact_ns else None


def own_work_vs_dp(jw: JobWindow, resources: Mapping[int, Resource],
                   wanted: Iterable[int]) -> dict[int, tuple[float, float]]:
    """Each wanted rank's work outside collectives per iteration against its DP peers' median:
    {rank: (excess ns, robust z with the personality floor)} (steps 3b and 4)."""
    from trainscope.analyzer.impact import window_scale
    from trainscope.analyzer.l2_groups import GroupsConfig, rank_times
    from trainscope.analyzer.significance import robust_z
    from trainscope.analyzer.topology import group_of

    wanted = set(wanted)
    cfg = GroupsConfig()
    ranks, keys, m = rank_times(jw, window_scale(jw), cfg)
    if not keys or not wanted:
        return {}
    row = {r: i for i, r in enumerate(ranks)}
    own_cols = np.array([not (cfg.routing.is_communication(k) or AMBIGUOUS.search(k)) for k in keys])
    out: dict[int, tuple[float, float]] = {}
    for members in group_of({r: resources[r] for r in ranks if r in resources}, "dp").values():
        if len(members) < 2 or not wanted.intersection(members):
            continue
        own = np.nansum(m[[row[r] for r in members]][:, own_cols], axis=1)
        zs, med, _ = robust_z(own, None, PERSONALITY)
        for i, r in enumerate(members):
            if r in wanted:
                out[r] = (float(own[i] - med.item()), float(zs[i]))
    return out


def _own_work_tiebreak(out: dict[int, "RankVerdict"], owners: set[int], resources: Mapping[int, Resource],
                       jw: JobWindow, partners: SyncPartners) -> set[int]:
    """Step 3b: late arrivers connected to each other with no flagged work of their own (a TP pair
    and its pipeline neighbours, all late): the one with clearly the most extra work outside
    communication against its own DP peers, standing out of their spread, is where the lateness starts."""
    late = [r for r, rv in out.items() if rv.role == CULPRIT and r not in owners]
    if len(late) < 2:
        return set()
    vs_dp = own_work_vs_dp(jw, resources, late)
    excess = {r: e for r, (e, _) in vs_dp.items()}
    z = {r: zz for r, (_, zz) in vs_dp.items()}
    # components of late ranks linked by sync partnership
    left, found = set(late), set()
    while left:
        comp, todo = set(), [left.pop()]
        while todo:
            r = todo.pop()
            comp.add(r)
            for ps in partners.of(r).values():
                for p in ps:
                    if p in left:
                        left.discard(p)
                        todo.append(p)
        if len(comp) < 2 or any(p in owners for r in comp for ps in partners.of(r).values() for p in ps):
            continue    # linked to a rank with flagged work of its own: step 3 follows it there
        best = sorted(comp, key=lambda r: -excess.get(r, 0.0))
        top, second = excess.get(best[0], 0.0), excess.get(best[1], 0.0)
        if top > 0 and top >= TIEBREAK_MARGIN * max(second, 0.0) and z.get(best[0], 0.0) >= TIEBREAK_Z:
            rv = out[best[0]]
            rv.evidence.append(Evidence(best[0], "DEP", "own_work", "own work outside communication", False,
                                        True, 1.0, rv.impact_ns, "dependency"))
            rv.levels.add("DEP")
            found.add(best[0])
    return found


def _culprit_only(rv: RankVerdict, kind) -> bool:
    """The rank has culprit evidence and every piece of it is of ``kind`` (a predicate on Evidence)."""
    cul = [e for e in rv.evidence if e.role == CULPRIT]
    return bool(cul) and all(kind(e) for e in cul)


def _measured_waiters(out: Mapping[int, RankVerdict]) -> dict[int, set[int]]:
    """{rank: the ranks a finding measured waiting for it} (the collectives level's late start lists
    each waiter with the late member, Mycroft §5)."""
    measured: dict[int, set[int]] = collections.defaultdict(set)
    for rv in out.values():
        for e in rv.evidence:
            if e.role == WAITER and e.waited_for >= 0 and e.waited_for != rv.rank:
                measured[e.waited_for].add(rv.rank)
    return measured


def _passed_on(out: dict[int, RankVerdict], root: Mapping[int, int], partners: SyncPartners,
               measured: Mapping[int, set[int]]) -> None:
    """Step 3d: a rank late with no work of its own that waited in a collective its partner did not
    wait in passed that partner's lateness on.

    A rank whose NCCL proxy delays its entry into collectives has no slow work for step 3 to follow:
    its TP partner waits in the TP all-reduce inside the forward, then arrives late to the DP
    reduce-scatter; its pipeline neighbours wait in their send/recv and arrive late too. All of them
    are "late arrivals" with forward slower; only the waits tell them apart (Mycroft §5: the rank
    that waited did not cause the wait). Per rank, to a fixed point:
    1. the subject is a culprit whose culprit evidence is all lateness (late starts, shortened
       collectives, forward/backward that hold TP collectives), which no finding measured anyone
       waiting for (a measured wait says whom the others waited for; such a rank is followed by the
       measured waits of step 3, never by a guess from unmeasured ones), and which waited, where no
       finding measured whom for, at least ``INHERIT_SHARE`` of its lateness;
    2. the candidates are its sync partners late to a collective, or waiters whose chain ends at a
       culprit, that did not wait at any place where it waited, and its partners named a slow link
       (a degraded NIC slows their send/recv; the pipeline neighbour on the other side waits there
       and arrives late to its DP reduce-scatter: a simulated 32-rank job named both neighbours
       culprits beside the NIC's ranks);
    3. it becomes a waiter of the strongest candidate, unless that closes a loop of waits.
    """
    changed = True
    while changed:
        changed = False
        for rv in sorted(out.values(), key=lambda v: (v.impact_ns, v.rank)):
            if (rv.role != CULPRIT or rv.rank in root or measured.get(rv.rank)
                    or any(e.own for e in rv.evidence)):
                continue
            late = max((e.impact_ns for e in rv.evidence if e.role == CULPRIT), default=0.0)        # 1
            places = {e.where for e in rv.evidence if e.role == WAITER and e.waited_for < 0
                      and e.impact_ns >= INHERIT_SHARE * late}
            if not places:
                continue

            def did_not_wait_there(p: int) -> bool:                                                  # 2
                c = out[p]
                if c.role == LINK:
                    return True
                if c.role == WAITER and _chain_culprit(out, p, (CULPRIT, LINK)) in (None, rv.rank):
                    return False
                return (any(e.role == CULPRIT and (e.kind == LATE_START or e.communication) for e in c.evidence)
                        and not any(e.role == WAITER and e.where in places for e in c.evidence))

            best = _strongest_partner(out, partners.of(rv.rank), did_not_wait_there)
            if best is None:
                continue
            rv.role, rv.waited_for = WAITER, best                                                   # 3
            if _chain_culprit(out, rv.rank, (CULPRIT, LINK)) is None:
                rv.role, rv.waited_for = CULPRIT, -1
                continue
            changed = True


def _late_only(rv: RankVerdict) -> bool:
    """Step 3c's subject: every piece of culprit evidence is a shortened collective (a late arrival)."""
    return _culprit_only(rv, lambda e: e.communication and not e.slower)


def _late_start_only(rv: RankVerdict) -> bool:
    """Every piece of the rank's culprit evidence is lateness to collectives (the collectives level's late
    start, or a shortened collective), or a slower iteration its measured waits explain; none of it work
    of its own."""
    return _culprit_only(rv, lambda e: e.kind == LATE_START or (e.communication and not e.slower)
                         or _wait_in_iteration(rv, e))


def _wait_in_iteration(rv: RankVerdict, e: Evidence) -> bool:
    """An L1 finding carried by the rank (its iterations slower than the others'), or an L2 phase of its own
    slower, is no work of its own where a finding measured it waiting for another rank at least as long: a
    rank's iteration holds its waits (a real 4-rank job on a busy host: the rank that waited 21 ms for the
    late one carried that iteration's spike, and was named its owner and a culprit), and so does a phase
    that holds a collective (a real two-group job: rank 0 waited 12.6 ms for its TP partner 1's slower
    forward in the TP all-reduce inside its own forward, its forward read 0.6 ms an iteration slower than
    its own history, and that made it the owner of its late arrival to its DP pair and a culprit beside 1).
    Kernels (L3) are not: a rank's kernels do not hold its waits in another rank's collective."""
    return e.level in ("L1", "L2") and any(w.role == WAITER and 0 <= w.waited_for != rv.rank
                                           and w.impact_ns >= e.impact_ns for w in rv.evidence)


def _most_waited_for(waits: list[Evidence]) -> int:
    """The rank a waiter waited for longest among its measured waits (ties: the lower rank)."""
    return max(waits, key=lambda e: (e.impact_ns, -e.waited_for)).waited_for


def _group_size(partners: SyncPartners, rank: int) -> int:
    """The rank's largest synchronising group (pipeline neighbours aside)."""
    return max((len(ps) + 1 for d, ps in partners.of(rank).items() if d != "pp"), default=2)


def healthy_lateness_ns(group_size: int, step_ns: float, z: float = LATE_Z) -> float:
    """Step 3c: how late the last of ``group_size`` healthy members may be, per iteration."""
    n = max(int(group_size), 2)
    return z * PERSONALITY * math.sqrt(2.0 * math.log(n)) * step_ns


def attribute(evidence: Iterable[Evidence], resources: Mapping[int, Resource],
              jw: JobWindow | None = None, iterations: Mapping[int, float] | None = None,
              partners: SyncPartners | None = None, step_ns: float = 0.0) -> list[RankVerdict]:
    """Steps 2-5: one ``RankVerdict`` per rank named by any evidence, best first."""
    partners = partners or SyncPartners(resources)
    by_rank: dict[int, list[Evidence]] = collections.defaultdict(list)
    for e in evidence:
        by_rank[e.rank].append(e)
    out: dict[int, RankVerdict] = {}
    for r, evs in by_rank.items():
        cul = [e for e in evs if e.role == CULPRIT]
        wai = [e for e in evs if e.role == WAITER]
        lnk = [e for e in evs if e.role == LINK]
        if lnk and not any(not e.communication for e in cul):
            cul = []    # a slow link explains its own collectives being shorter or longer than its peers'
        role = CULPRIT if cul else (LINK if lnk else (WAITER if wai else MISSING))
        imp = max((e.impact_ns for e in (cul or lnk or wai or evs)), default=0.0)
        rv = RankVerdict(r, role, imp, imp, levels={e.level for e in evs},
                         culprit_levels={e.level for e in cul}, comparisons={e.comparison for e in evs},
                         evidence=sorted(evs, key=lambda e: -e.impact_ns))
        for e in rv.evidence:
            if e.where not in rv.where:
                rv.where.append(e.where)
        out[r] = rv
    # step 3: lateness inherited from a partner that was slow on its own, transitively (a pipeline
    # neighbour of a TP partner of the slow rank is late too): follow partners to the owner
    owners = {r for r, rv in out.items() if any(e.own and not _wait_in_iteration(rv, e) for e in rv.evidence)}
    if jw is not None:
        owners |= _own_work_tiebreak(out, owners, resources, jw, partners)
    root: dict[int, int] = {r: r for r in owners}
    measured = _measured_waiters(out)
    changed = True
    while changed:
        changed = False
        for rv in out.values():
            if rv.role != CULPRIT or rv.rank in root:
                continue
            parts = partners.of(rv.rank)
            # never a partner measured waiting for this rank (a real 4-rank job on a busy host: the rank
            # that waited for the late one spiked an iteration, and that spike was made its lateness' owner)
            cands = [p for ps in parts.values() for p in ps if p in root and p not in measured.get(rv.rank, ())
                     and out[root[p]].impact_ns >= INHERIT_SHARE * rv.impact_ns]
            if cands:
                best = max(cands, key=lambda p: (out[root[p]].impact_ns, -p))
                root[rv.rank] = root[best]
                rv.role, rv.waited_for = WAITER, best
                changed = True
    # step 3: a culprit only by lateness that was measured waiting for another culprit in another group
    # passed that wait on (two kinds of groups: rank 3 waits for its DP peer 1, then starts its TP
    # all-reduce late and makes its partner wait): a waiter of that rank, the smaller lateness first
    for rv in sorted(out.values(), key=lambda v: (v.impact_ns, v.rank)):
        if rv.role != CULPRIT or rv.rank in root or not _late_start_only(rv):
            continue
        late = max((e.impact_ns for e in rv.evidence if e.role == CULPRIT), default=0.0)
        waited = [e for e in rv.evidence if e.role == WAITER and e.waited_for in out and e.waited_for != rv.rank
                  and out[e.waited_for].role == CULPRIT and out[e.waited_for].waited_for != rv.rank
                  and e.impact_ns >= INHERIT_SHARE * late]
        if waited:
            rv.role, rv.waited_for = WAITER, _most_waited_for(waited)
    _passed_on(out, root, partners, measured)
    # step 3: waiters point at the rank a finding measured them waiting for (the collectives level's
    # late start: in a data-parallel all-reduce, the member that came late because it waited in its
    # tensor-parallel one; step 5 follows that chain to the culprit), else at a culprit partner
    iterations = iterations or {}
    unresolved = []
    for rv in list(out.values()):
        if rv.role != WAITER or rv.waited_for >= 0:
            continue
        measured = [e for e in rv.evidence if e.role == WAITER and e.waited_for in out and e.waited_for != rv.rank]
        if measured:
            rv.waited_for = _most_waited_for(measured)
            continue
        best = _strongest_partner(out, partners.of(rv.rank), lambda p: out[p].role == CULPRIT)
        if best is not None:
            rv.waited_for = best
            continue
        unresolved.append(rv)
    # step 3: a partner that waited for a culprit passes the wait on (a host's slow ranks make their next
    # pipeline stage late, and that stage's DP peers wait for it in their all-reduce: a simulated 32-rank
    # job named those peers, on another host, slow links); followed to a fixed point, chains to a culprit
    # only; then the same for a partner named a slow link (its send/recv partner across a degraded NIC
    # waited on that link: a simulated 64-rank job named the pipeline neighbours of a NIC's ranks links)
    for ends in ((CULPRIT,), (CULPRIT, LINK)):
        changed = True
        while changed:
            changed = False
            for rv in unresolved:
                if rv.waited_for >= 0:
                    continue
                best = _strongest_partner(out, partners.of(rv.rank), lambda p: (
                    (LINK in ends and out[p].role == LINK)
                    or (out[p].role == WAITER and _chain_culprit(out, p, ends) is not None)))
                if best is not None:
                    rv.waited_for = best
                    changed = True
    for rv in unresolved:
        if rv.waited_for >= 0:
            continue
        parts = partners.of(rv.rank)
        best = _strongest_partner(out, parts, lambda p: out[p].role == CULPRIT)
        if best is not None:       # a culprit by dependency found for an earlier waiter
            rv.waited_for = best
            continue
        w = max((e for e in rv.evidence if e.role == WAITER), key=lambda e: e.impact_ns)
        late = _tp_last_arriver(jw, w, parts.get("tp", []) + parts.get("cp", []), iterations)
        if late is not None:
            dep = Evidence(late, "DEP", "late_arriver", w.where, True, False, 0.0, w.impact_ns, "dependency")
            c = out.get(late)
            if c is None or c.role != CULPRIT:
                c = out[late] = RankVerdict(late, CULPRIT, w.impact_ns, w.impact_ns, {"DEP"}, {"DEP"},
                                            [w.where], comparisons={"dependency"}, evidence=[dep])
            else:
                c.levels.add("DEP")
                c.culprit_levels.add("DEP")
                c.evidence.append(dep)
            rv.waited_for = late
    # step 3c: lateness no one's work explains, within what healthy personality gives the last arriver
    if step_ns > 0:
        for rv in list(out.values()):
            if rv.role == CULPRIT and rv.rank not in root and _late_only(rv):
                if rv.impact_ns < healthy_lateness_ns(_group_size(partners, rv.rank), step_ns):
                    del out[rv.rank]        # its waiters keep pointing at it and are not named alone
    # step 4: a waiter with no culprit whose own work is short by about what it waited arrived early
    # (a fast rank waits for everyone), and one that waited less than healthy lateness of the others
    # gives (step 3c's bound) has no culprit to name; what is left, when sharing a host, is the link between them
    alone = [rv.rank for rv in out.values() if rv.role == WAITER and rv.waited_for < 0]
    vs_dp = own_work_vs_dp(jw, resources, alone) if jw is not None and alone else {}
    for r in alone:
        early = r in vs_dp and -vs_dp[r][0] >= EARLY_SHARE * out[r].impact_ns
        if early or (step_ns > 0 and out[r].impact_ns < healthy_lateness_ns(_group_size(partners, r), step_ns, WAIT_Z)):
            del out[r]
    # step 4: what is left waited in its collectives with no late member and no early arrival: the
    # collective itself was slow for it, its link (several sharing a host: the link between them;
    # one alone: its own NIC or NVLink), never a "waiter" for nobody
    for rv in out.values():
        if rv.role == WAITER and rv.waited_for < 0:
            rv.role = LINK
    # step 5: culprits score at least what their waiters lost (followed along chains of waiters)
    for rv in out.values():
        if rv.role != WAITER or rv.waited_for not in out:
            continue
        out[rv.waited_for].waiters.append(rv.rank)
        c, seen = out[rv.waited_for], {rv.rank}
        while c.role == WAITER and c.waited_for in out and c.rank not in seen:
            seen.add(c.rank)
            c = out[c.waited_for]
        c.score_ns = max(c.score_ns, rv.impact_ns)
    return sorted(out.values(), key=lambda v: (ROLE_ORDER.get(v.role, 9), -v.score_ns,
                                               -len(v.culprit_levels), v.rank))
