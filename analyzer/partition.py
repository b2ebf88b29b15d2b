"""Partitioned analysis: one job's L3 shared by the members of the analyzer's Kafka consumer group.

With ``KafkaSinkConfig.key_by="group"`` the processor keys kernel windows by
(job, data-parallel comparison group), so one job's kernel windows spread over
the partitions of the kernels topic and the consumer group's assignment spreads
those over the analyzer members; every other signal stays keyed by job, so one
member, the job's *owner*, sees its phases, iterations, stacks and collectives.
Kafka's group assignment decides who does what: there is no cluster manager.

1. Group stage (every member, ``GroupStage``): file the kernel windows it is
   assigned by (job, window). A window is analysed once every comparison group
   it holds has all its ranks (a dp group has ``dp_size`` ranks) and
   ``grace_s`` passed without more, or the job's records are
   ``progress_windows`` windows further on, or ``window_timeout_s`` after its
   first record.
2. L3 on those groups (``l3_kernels``, unchanged: ranks are compared only
   within their group, ARGUS §6.2), at the member's own Bonferroni threshold
   z*(M_s) ≤ z*(M), since its M_s comparisons are a part of the window's M:
   it flags a superset of what one process flags.
3. One partial record per (job, window, group) (``partial_records``): the
   group's findings, its comparisons M_g, its ranks and their compute, memory
   and communication kernel sums (a group of more than ``PART_RANKS`` ranks in
   several records: Kafka's default record limit is 1 MB), on
   ``<prefix>.l3partials.v1`` keyed by job. Same key and partition count as the
   job's other records, so the range assignor hands it to the job's owner.
4. Merge at the owner (``merge_partials``): per group the latest entry (a group
   analysed again after a rebalance counts once), M = Σ M_g, and every suspect
   re-tested at z*(M): the flags of one process, except for step 5c of L3 (a
   rank flagged slower must stay significant without its largest call),
   which the member tested at z*(M_s). Impacts are rescaled where the owner
   counts a rank's iterations differently from the member (time windows; in
   iteration windows both count the window's iterations).
5. The owner holds a window until the partials cover its ranks
   (``PartialStore.gate``; at most ``window_timeout_s``), and turns the
   category sums into one small ``KernelWindow`` per rank
   (``PartialStore.fill``) for the levels that compare ranks' kernel sums
   across groups and windows (sibling groups, consistent shifts, own history).
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import time
from typing import Any, Callable, Mapping

import numpy as np
from google.protobuf import json_format

from trainscope.analyzer.impact import WindowScale, window_scale
from trainscope.analyzer.l3_kernels import (
    LATE_ARRIVAL, L3Config, covered_iterations, flatten_kernels, kernel_findings, typical_cells,
)
from trainscope.analyzer.levels import WindowContext
from trainscope.analyzer.model import Finding, JobWindow, Scope, SuspectRank
from trainscope.analyzer.significance import small_group_threshold, z_threshold
from trainscope.analyzer.topology import CATEGORIES, cpu_only, group_index, group_of, has_coords, rank_to_group
from trainscope.processor.kernel_names import fill_names
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2

#: Topic suffix of the partial L3 results (``<prefix>.l3partials.v1``), keyed by job.
PARTIALS = "l3partials"
#: ``Diagnosis.kind`` of a partial record.
PARTIAL_KIND = "group_partial"
#: Ranks per partial record (ids and three sums: ~37 B each in base64 in the record).
PART_RANKS = 8192
_DEGRADED = ("degraded_kernel", "degraded_kernels", LATE_ARRIVAL)


# ------------------------------------------------------------------ encoding
def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_plain(x) for x in v]
    if hasattr(v, "item"):
        return v.item()
    return v


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()


def _arr(s: str, dtype) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype=dtype)


def finding_to_dict(f: Finding) -> dict:
    s = f.scope
    return {"level": f.level, "kind": f.kind, "severity": float(f.severity), "informational": f.informational,
            "comparison": f.comparison, "evidence": _plain(f.evidence),
            "scope": {"phase": s.phase, "kernel": s.kernel, "stream": s.stream, "group": s.group,
                      "group_index": s.group_index},
            "suspects": [{"rank": p.rank, "score": float(p.score), "impact_ns": float(p.impact_ns),
                          "evidence": _plain(p.evidence)} for p in f.suspects]}


def finding_from_dict(d: Mapping, job_id: str, window: records_pb2.Window) -> Finding:
    sc = d["scope"]
    return Finding(level=d["level"], kind=d["kind"], job_id=job_id, window=window,
                   scope=Scope(phase=sc["phase"], kernel=sc["kernel"], stream=int(sc["stream"]),
                               group=sc["group"], group_index=int(sc["group_index"])),
                   suspects=tuple(SuspectRank(int(p["rank"]), float(p["score"]), dict(p["evidence"]),
                                              impact_ns=float(p["impact_ns"])) for p in d["suspects"]),
                   severity=float(d["severity"]), evidence=dict(d["evidence"]),
                   informational=bool(d["informational"]), comparison=d["comparison"])


# ------------------------------------------------------------ steps 2 and 3
def group_comparisons(t, rank_group: np.ndarray, cfg: L3Config, host_timed: bool = False) -> dict[int, int]:
    """Per group, the comparisons L3's Bonferroni M counts for it (``score_kernels``): its ranks in
    every scored (key, group) segment, plus its size per category it runs when it has ``min_ranks``,
    plus its step-5e tests (device kernels only)."""
    out: dict[int, int] = collections.defaultdict(int)
    if t.dist_rank.size == 0:
        return out
    pos = np.searchsorted(t.ranks, t.dist_rank)
    dg = rank_group[pos]
    ok = dg >= 0
    pairs, n = np.unique(np.stack([t.dist_key[ok], dg[ok]]), axis=1, return_counts=True)
    scored = n >= cfg.min_ranks
    if not scored.any():
        return out          # score_kernels counts nothing when no segment is scored
    for g, c in zip(pairs[1][scored].tolist(), n[scored].tolist()):
        out[g] += c
    cat = np.array([cfg.routing.category(k) for k, _ in t.keys], dtype=np.int64)
    typical = None if host_timed else typical_cells(t, rank_group, cfg)
    for g in np.unique(rank_group[rank_group >= 0]).tolist():
        size = int((rank_group == g).sum())
        if size >= cfg.min_ranks:
            out[g] += len(set(cat[t.dist_key[dg == g]].tolist())) * size
            if not host_timed:
                out[g] += int(typical[rank_group == g].sum())
    return out


def analyse_groups(job_id: str, window: records_pb2.Window, kernels: Mapping[int, records_pb2.KernelWindow],
                   resources: Mapping[int, Resource], cfg: L3Config, part_ranks: int | None = None) -> dict:
    """Steps 2-3: L3 on the groups of ``kernels`` and the per-group payload of a partial record."""
    dim = cfg.routing.kernel_group_dim
    jw = JobWindow(job_id, window, dict(resources), dict(kernels))
    scale = window_scale(jw)
    groups = group_of(resources, dim)
    host_timed = cpu_only(resources)
    t = flatten_kernels(kernels)
    found = kernel_findings(job_id, window, t, groups, cfg, dim, scale, host_timed, covered_iterations(kernels))
    rg = rank_to_group(groups)
    rank_group = np.array([rg.get(r, -1) for r in t.ranks.tolist()], dtype=np.int64)
    m_of = group_comparisons(t, rank_group, cfg, host_timed)
    cat = np.array([cfg.routing.category(k) for k, _ in t.keys], dtype=np.int64)
    names = [next((k for (k, _), c in zip(t.keys, cat.tolist()) if c == i), "") for i in range(len(CATEGORIES))]
    sums = np.zeros((t.ranks.size, len(CATEGORIES)))
    if t.dist_rank.size:
        np.add.at(sums, (np.searchsorted(t.ranks, t.dist_rank), cat[t.dist_key]), t.dist_mean_ns * t.dist_count)
    by_group: dict[int, list] = collections.defaultdict(list)
    for f in found:
        by_group[f.scope.group_index].append(finding_to_dict(f))
    entries = []
    step = part_ranks or PART_RANKS
    for g, members in groups.items():
        rows = np.flatnonzero(rank_group == g)
        parts = max(1, -(-rows.size // step))
        for part in range(parts):   # the group's findings and counts in part 0, its ranks spread over parts
            sub = rows[part * step:(part + 1) * step]
            entries.append({"g": g, "part": part, "parts": parts, "M": int(m_of.get(g, 0)) if not part else 0,
                            "ranks": _b64(t.ranks[sub].astype("<i4")), "members": len(members),
                            "sums": _b64(sums[sub].astype("<f8")),
                            "compared": len(rows) if len(rows) >= cfg.min_ranks and not part else 0,
                            "findings": by_group.get(g, []) if not part else []})
    return {"dim": dim, "host_timed": host_timed, "iterations": scale.default_iterations,
            "nominal": scale.nominal_iterations, "names": names, "groups": entries}


def partial_records(job_id: str, window: records_pb2.Window, payload: dict,
                    member: str) -> list[records_pb2.Diagnosis]:
    """Step 3: one ``Diagnosis`` (kind ``group_partial``) per group part, its entry in the evidence."""
    out = []
    for e in payload["groups"]:
        d = records_pb2.Diagnosis(id=f"{job_id}|{window.kind}|{window.index}|{e['g']}|{e.get('part', 0)}",
                                  job_id=job_id, level="L3", kind=PARTIAL_KIND, window=window,
                                  created_unix_ns=time.time_ns(), informational=True)
        d.evidence.update({**payload, "groups": [e], "member": member})
        out.append(d)
    return out


# ------------------------------------------------------------------ step 4
def merge_partials(entries: Mapping[int, Mapping], job_id: str, window: records_pb2.Window, cfg: L3Config,
                   scale: WindowScale | None = None, *, host_timed: bool = False,
                   member_iterations: Mapping[int, float] | None = None) -> tuple[list[Finding], int, int]:
    """Step 4: one window's L3 findings from its groups' entries ({group or (group, part): entry});
    returns (findings, ranks compared, M). ``member_iterations``: per entry key, the iterations
    per rank the member assumed (its ``WindowScale.default_iterations``)."""
    m_total = int(sum(int(e["M"]) for e in entries.values()))
    compared = int(sum(int(e["compared"]) for e in entries.values()))
    degraded, other = [], []
    for g in sorted(entries):
        assumed = (member_iterations or {}).get(g, 1.0)
        for fd in entries[g]["findings"]:
            f = finding_from_dict(fd, job_id, window)
            if f.kind in _DEGRADED:
                f = _retest(f, m_total, cfg, host_timed, assumed, scale)
                if f is not None:
                    degraded.append(f)
            else:
                other.append(f)
    degraded.sort(key=lambda f: -max((abs(float(s.evidence.get("time_per_iteration_ns", 0.0))
                                          - float(s.evidence.get("group_median_ns", 0.0))) for s in f.suspects),
                                         default=0.0))
    return degraded + other, compared, m_total


def _retest(f: Finding, m_total: int, cfg: L3Config, host_timed: bool, assumed: float,
            scale: WindowScale | None) -> Finding | None:
    n = int(f.evidence.get("group_size", 0))
    z_star = (float(small_group_threshold(cfg.false_alarm, m_total, [n])[0]) if host_timed
              else z_threshold(cfg.false_alarm, m_total))
    keep = []
    for s in f.suspects:
        z = float(s.evidence.get("z", 0.0))
        if abs(z) < z_star:
            continue
        ev = dict(s.evidence, z_threshold=z_star)
        if host_timed:   # CPU operators: scheduler bursts span whole windows (sequential.py: k of n)
            ev["host_timed"] = True
        impact = s.impact_ns
        if scale is not None and assumed > 0:
            k = assumed / scale.of(s.rank)
            if abs(k - 1.0) > 1e-9:          # the owner counts this rank's iterations differently
                impact *= k
                for key in ("time_per_iteration_ns", "group_median_ns"):
                    if key in ev:
                        ev[key] = float(ev[key]) * k
        keep.append(dataclasses.replace(s, evidence=ev, impact_ns=impact))
    if not keep:
        return None
    return dataclasses.replace(f, suspects=tuple(keep), severity=max(abs(float(s.evidence["z"])) for s in keep),
                               evidence={**f.evidence, "z_threshold": z_star, "comparisons": m_total})


# ------------------------------------------------------------------ step 5
class PartialStore:
    """The owner's partials per (job, window) and group: the gate, the fill and the L3 level."""

    def __init__(self, cfg: L3Config, *, first_wait_s: float = 10.0, max_windows: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.first_wait_s = first_wait_s
        self._clock = clock
        self._windows: collections.OrderedDict = collections.OrderedDict()  # (job, kind, index) -> {g: entry}
        self._meta: dict[tuple, dict] = {}
        self._jobs_with_kernels: set[str] = set()
        self._jobs_without: set[str] = set()
        self._max = max_windows
        self.duplicates = 0

    def add(self, d: records_pb2.Diagnosis) -> None:
        p = json_format.MessageToDict(d.evidence)
        key = (d.job_id, d.window.kind, d.window.index)
        groups = self._windows.setdefault(key, {})
        meta = self._meta.setdefault(key, {"iterations": {}, "host_timed": False, "names": p.get("names", [])})
        for e in p.get("groups", ()):
            g = (int(e["g"]), int(e.get("part", 0)))
            if g in groups:
                self.duplicates += 1        # analysed again after a rebalance: the latest wins
            e["n"] = len(_arr(e["ranks"], "<i4"))
            groups[g] = e
            meta["iterations"][g] = float(p.get("iterations", 1.0))
        meta["host_timed"] = meta["host_timed"] or bool(p.get("host_timed"))
        self._jobs_with_kernels.add(d.job_id)
        self._jobs_without.discard(d.job_id)
        while len(self._windows) > self._max:
            old, _ = self._windows.popitem(last=False)
            self._meta.pop(old, None)

    def discard(self, job_id: str, kind: int, index: int) -> None:
        """Forget a window's partials (judged without them, or its job moved to another member)."""
        self._windows.pop((job_id, kind, index), None)
        self._meta.pop((job_id, kind, index), None)

    def covered(self, job_id: str, window: records_pb2.Window) -> int:
        groups = self._windows.get((job_id, window.kind, window.index), {})
        return sum(e["n"] for e in groups.values())

    def gate(self, job_id: str, jw: JobWindow, first_seen: float) -> bool:
        """Whether the owner may analyse ``jw``: its partials cover every rank it holds; a job
        with no partial yet is waited for ``first_wait_s`` (then taken as sending no kernels)."""
        if job_id in self._jobs_without:
            return True
        if job_id not in self._jobs_with_kernels:
            if self._clock() - first_seen >= self.first_wait_s:
                self._jobs_without.add(job_id)
                return True
            return False
        return self.covered(job_id, jw.window) >= len(jw.resources)

    def fill(self, jw: JobWindow) -> None:
        """Step 5: the category sums as one ``KernelWindow`` per rank (levels comparing sums)."""
        key = (jw.job_id, jw.window.kind, jw.window.index)
        groups, meta = self._windows.get(key), self._meta.get(key)
        if not groups or jw.kernels:
            return
        names = meta["names"]
        for e in groups.values():
            ranks = _arr(e["ranks"], "<i4")
            sums = _arr(e["sums"], "<f8").reshape(-1, len(CATEGORIES))
            for r, row in zip(ranks.tolist(), sums.tolist()):
                kw = records_pb2.KernelWindow(window=jw.window)
                for c, total in enumerate(row):
                    if total > 0 and names[c]:
                        kw.kernels.add(kernel=names[c], count=1, total_ns=total).clusters.add(
                            count=1, p50_ns=total, p99_ns=total)
                jw.kernels[r] = kw

    def take(self, ctx: WindowContext) -> list[Finding]:
        jw = ctx.jw
        key = (jw.job_id, jw.window.kind, jw.window.index)
        groups = self._windows.pop(key, None)
        meta = self._meta.pop(key, None)
        if not groups:
            return []
        found, compared, _ = merge_partials(groups, jw.job_id, jw.window, self.cfg, ctx.scale,
                                            host_timed=meta["host_timed"], member_iterations=meta["iterations"])
        ctx.comparisons["L3"] = compared
        return found


class L3Partials:
    """The owner's L3 level: the merged partials of the window's groups (step 4)."""

    level, corroborating = "L3", False

    def __init__(self, store: PartialStore) -> None:
        self.store = store

    def analyze(self, ctx: WindowContext) -> list[Finding]:
        return self.store.take(ctx)


# ------------------------------------------------------------------ step 1
@dataclasses.dataclass(slots=True)
class _Shard:
    window: records_pb2.Window
    first_seen: float
    last_seen: float
    kernels: dict = dataclasses.field(default_factory=dict)
    resources: dict = dataclasses.field(default_factory=dict)
    offsets: dict = dataclasses.field(default_factory=dict)   # (topic, partition) -> lowest offset held
    source: dict = dataclasses.field(default_factory=dict)    # rank -> (topic, partition) its record came from
    group: dict = dataclasses.field(default_factory=dict)     # rank -> its comparison group
    count: collections.Counter = dataclasses.field(default_factory=collections.Counter)   # group -> ranks in
    size: dict = dataclasses.field(default_factory=dict)      # group -> ranks it has


def _expected(res: Resource, dim: str) -> int:
    """How many ranks the group of ``res`` along ``dim`` holds."""
    if dim != "job" and has_coords(res):
        return max(getattr(res.coords, f"{dim}_size"), 1)
    return max(res.world_size, 1)


class GroupStage:
    """Step 1: this member's kernel windows by (job, window), analysed when their groups are in."""

    def __init__(self, cfg: L3Config, *, grace_s: float = 0.5, window_timeout_s: float = 60.0,
                 progress_windows: int = 2, max_open: int = 256, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.grace_s, self.window_timeout_s, self.progress_windows = grace_s, window_timeout_s, progress_windows
        self.max_open = max_open
        self._clock = clock
        self.open: dict[tuple[str, int, int], _Shard] = {}
        self._done: dict[tuple[str, int], int] = {}        # (job, kind) -> highest index analysed
        self._latest: dict[tuple[str, int], int] = {}
        self.late = 0
        self.lookup: Callable[[str], Callable[[int], str | None]] | None = None
        """Per job, its kernel-name dictionary's ``get`` (windows that carry kernel ids)."""

    def add(self, rec: records_pb2.KernelWindow, where: tuple[str, int] | None = None, offset: int = -1) -> bool:
        """File one kernel window; False when it came too late (its window was analysed)."""
        w = rec.window
        job = rec.resource.job_id
        if w.index <= self._done.get((job, w.kind), -1) and (job, w.kind, w.index) not in self.open:
            self.late += 1
            return False
        now = self._clock()
        key = (job, w.kind, w.index)
        s = self.open.get(key)
        if s is None:
            s = self.open[key] = _Shard(records_pb2.Window(kind=w.kind, index=w.index), now, now)
        s.last_seen = now
        res = Resource.from_pb(rec.resource)
        if res.rank not in s.kernels:    # completeness kept as records arrive: no pass over the ranks per check
            dim = self.cfg.routing.kernel_group_dim
            g = group_index(res.coords, dim) if has_coords(res) else 0
            s.group[res.rank] = g
            s.count[g] += 1
            s.size[g] = _expected(res, dim)
        s.kernels[res.rank] = rec
        s.resources[res.rank] = res
        if w.start_ns and (not s.window.start_ns or w.start_ns < s.window.start_ns):
            s.window.start_ns = w.start_ns
        s.window.end_ns = max(s.window.end_ns, w.end_ns)
        s.window.first_iteration, s.window.last_iteration = w.first_iteration, w.last_iteration
        if where is not None and offset >= 0:
            s.offsets[where] = min(s.offsets.get(where, offset), offset)
            s.source[res.rank] = where
        self._latest[(job, w.kind)] = max(self._latest.get((job, w.kind), -1), w.index)
        return True

    def ready(self) -> list[tuple[str, int, int]]:
        now = self._clock()
        out = []
        for key, s in self.open.items():
            job, kind, index = key
            if now - s.first_seen >= self.window_timeout_s or len(self.open) > self.max_open:
                out.append(key)
            elif self._latest.get((job, kind), -1) >= index + self.progress_windows:
                out.append(key)
            elif now - s.last_seen >= self.grace_s and self._complete(s):
                out.append(key)
        return sorted(out, key=lambda k: (k[0], k[1], k[2]))

    @staticmethod
    def _complete(s: _Shard) -> bool:
        return all(n >= s.size[g] for g, n in s.count.items())

    def analyse(self, key: tuple[str, int, int], member: str) -> tuple[list[records_pb2.Diagnosis], dict]:
        """Steps 2-3 for one open window; returns its partial records and the offsets it released."""
        s = self.open.pop(key)
        job, kind, index = key
        self._done[(job, kind)] = max(self._done.get((job, kind), -1), index)
        if self.lookup is not None:
            get = self.lookup(job)
            for rec in s.kernels.values():
                fill_names(rec, get, label_unknown=True)
        payload = analyse_groups(job, s.window, s.kernels, s.resources, self.cfg)
        return partial_records(job, s.window, payload, member), s.offsets

    def held(self) -> dict[tuple[str, int], int]:
        """Per (topic, partition), the lowest offset still held by an open window."""
        out: dict[tuple[str, int], int] = {}
        for s in self.open.values():
            for tp, off in s.offsets.items():
                out[tp] = min(out.get(tp, off), off)
        return out

    def drop(self, partitions: set[tuple[str, int]]) -> None:
        """Forget the records of revoked partitions: their new member reads them again from the
        committed offset (never past a record an open window holds). Ranks of this window from
        partitions kept stay."""
        for key in list(self.open):
            s = self.open[key]
            gone = {r for r, tp in s.source.items() if tp in partitions}
            if not gone:
                continue
            for r in gone:
                s.kernels.pop(r, None)
                s.resources.pop(r, None)
                s.source.pop(r, None)
                g = s.group.pop(r, None)
                if g is not None:
                    s.count[g] -= 1
                    if s.count[g] <= 0:
                        del s.count[g]
            for tp in partitions:
                s.offsets.pop(tp, None)
            if not s.kernels:
                del self.open[key]
