"""The stack grid: every rank of a triggering group dumped at one moment, clustered by stack (Mycroft §5).

Mycroft's RCA ends with evidence a person can read: at a trigger, the stacks of
all ranks of the group side by side, where the odd one out shows what the
stuck or late rank was doing ("rank 2 in ``time.sleep``; ranks 0, 1, 3 in
``all_reduce``"). The processor asks every member for one py-spy dump at a
collective trigger (``processor/stack_grid.py``); the dumps arrive here one per
rank in ``CollectiveWindow.dumps``. Per grid (its id is shared by its dumps):

1. Per rank, the training thread: the thread whose id the collector named
   (``StackDump.training_thread``: the process's main thread), else the
   thread called ``MainThread``, else the first one listed.
2. Its key: the innermost ``frames`` frames, each ``function (file)``, line
   numbers left out (ranks at two lines of one function wait in the same place).
3. Clusters: ranks with equal keys, largest first (ties: lowest rank). The
   largest is where the group is; every other cluster is odd (Mycroft: "the
   rank whose stack differs from the others"). A rank with no dump (py-spy
   missing, ptrace refused, not subscribed to a processor that triggered) is
   listed with why, never clustered.
4. Evidence: the clusters (ranks, the representative's stack, innermost
   first, with files and line numbers) and one line (the innermost frame with
   its line, the next ones by name), e.g. ``rank 2: 1 of 4 ranks in
   `main (train.py:63) <- <module>`; ranks 0,1,3 in
   `all_reduce (torch/distributed/distributed_c10d.py:3252) <- wrapper <- ...```.
5. Attaching (``GridBook.attach``): a stall finding takes the grid of its
   group and seq (a hang grid), a late-start finding one of the group's grids
   of any trigger received within ``max_age_s``: each grid is one moment per
   rank, and a late rank is in its delay for part of each step only, so of
   the recent grids the newest that sets a named rank apart (an odd cluster
   of named ranks only) is shown,
   else the newest; the summary says in how many of them it stood apart
   (``apart_in``, ``recent_grids``: "rank 1 apart in 3 of 6 recent grids").
   A stall finding made before
   its grid was complete is kept (bounded) and issued again once the grid is
   complete or ``wait_s`` passed with some dumps (``GridBook.updates``): one
   re-issue per stall, the same finding id, now with the grid.
6. The Flight Recorder view (``flight_recorder``): each dump also carries the
   rank's PyTorch Flight Recorder per process group (the newest collective seq
   it entered, taken in process by the collector at the same command); the
   ranks at the group's newest seq *entered* it, the others are *behind*:
   ``ranks 0,1,3 entered allreduce seq 11 on group 0 (in flight, torch state
   scheduled); rank 2's newest entry is seq 10 (completed)``. It goes beside
   the grid in the finding's evidence (``flight_recorder``) and each suspect's.
Assumption: ranks of one group run the same code, so their training threads'
innermost frames agree unless one of them is elsewhere.
"""
from __future__ import annotations

import collections
import dataclasses
import re
import time
from typing import Callable, Iterable

from trainscope.analyzer.model import Finding
from trainscope.proto.errors import ConfigError

_LINE = re.compile(r":\d+\)$")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StackGridConfig:
    frames: int = 6
    """Step 2: innermost frames of the training thread that make a cluster's key."""
    shown_frames: int = 4
    """Step 4: frames of a cluster's stack in the one-line summary (the evidence keeps ``frames``)."""
    wait_s: float = 20.0
    """Step 5: analyzer seconds a stall finding waits for its grid's missing dumps before it is issued again."""
    max_age_s: float = 300.0
    """Step 5: oldest grid (analyzer seconds since its first dump) a late-start finding takes."""
    max_grids: int = 64
    """Grids kept per job (oldest forgotten first)."""

    def __post_init__(self) -> None:
        for f in ("frames", "shown_frames", "max_grids"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 1):
                raise ConfigError(f"analyzer.stack_grid.{f}", getattr(self, f), "must be an integer >= 1")
        for f in ("wait_s", "max_age_s"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"analyzer.stack_grid.{f}", getattr(self, f), "must be > 0")


@dataclasses.dataclass
class Grid:
    """The dumps of one grid id received so far."""

    grid_id: str
    group: str
    trigger: str
    seq: int
    first_seen: float                       # analyzer clock
    expected: set[int] = dataclasses.field(default_factory=set)
    dumps: dict[int, object] = dataclasses.field(default_factory=dict)   # rank -> StackDump

    @property
    def complete(self) -> bool:
        return bool(self.expected) and self.expected <= set(self.dumps)


def training_thread(dump) -> object | None:
    """Step 1: the dump's training thread (a ``FoldedStack``), or None when it has no thread."""
    threads = list(dump.threads)
    if not threads:
        return None
    if dump.training_thread:
        for t in threads:
            if t.thread_id == dump.training_thread:
                return t
    for t in threads:
        if t.stack.split(";", 1)[0] == "MainThread":
            return t
    return threads[0]


def _frames(stack: str) -> list[str]:
    """A folded stack's frames innermost first (the thread name, its root, left out)."""
    return stack.split(";")[1:][::-1]


def clusters(dumps: dict[int, object], frames: int = 6) -> tuple[list[dict], dict[int, str]]:
    """Steps 1-3: (clusters largest first, {rank: why it has no stack})."""
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    example: dict[tuple, list[str]] = {}
    thread: dict[tuple, str] = {}
    missing: dict[int, str] = {}
    for rank in sorted(dumps):
        d = dumps[rank]
        t = training_thread(d)
        if d.error or t is None:
            missing[rank] = d.error or "no thread in the dump"
            continue
        inner = _frames(t.stack)[:frames]
        key = tuple(_LINE.sub(")", f) for f in inner)
        groups[key].append(rank)
        example.setdefault(key, inner)
        thread.setdefault(key, t.stack.split(";", 1)[0])
    out = [{"ranks": ranks, "stack": example[k], "thread": thread[k]} for k, ranks in groups.items()]
    out.sort(key=lambda c: (-len(c["ranks"]), c["ranks"][0]))
    return out, missing


def _ranks(rs: Iterable[int]) -> str:
    rs = list(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


def _shown(stack: list[str], n: int) -> str:
    """The innermost frame with its file and line, the next ``n - 1`` by function name."""
    if not stack:
        return "(no Python frame)"
    names = [stack[0]] + [f.rsplit(" (", 1)[0] for f in stack[1:n]]
    return " <- ".join(names) + (" <- ..." if len(stack) > n else "")


def evidence(grid: Grid, members: Iterable[int] = (), cfg: StackGridConfig = StackGridConfig()) -> dict:
    """Step 4: the grid as finding evidence (JSON/Struct-safe: strings, numbers, lists, dicts)."""
    cl, missing = clusters(grid.dumps, cfg.frames)
    for m in sorted(set(members) | grid.expected):
        if m not in grid.dumps:
            missing[m] = "no dump received (no control stream to a processor that triggered, or still on its way)"
    total = sum(len(c["ranks"]) for c in cl)
    parts = [f"{_ranks(c['ranks'])}: {len(c['ranks'])} of {total} ranks in `{_shown(c['stack'], cfg.shown_frames)}`"
             for c in cl[1:]]
    if cl:
        parts.append(f"{_ranks(cl[0]['ranks'])} in `{_shown(cl[0]['stack'], cfg.shown_frames)}`")
    if missing:
        parts.append(f"{_ranks(sorted(missing))}: no stack")
    return {"grid": grid.grid_id, "trigger": grid.trigger, "group": grid.group, "seq": grid.seq,
            "ranks_dumped": total, "complete": grid.complete,
            "odd_ranks": sorted(r for c in cl[1:] for r in c["ranks"]),
            "clusters": [{"ranks": c["ranks"], "thread": c["thread"], "stack": c["stack"]} for c in cl],
            "missing": [{"rank": r, "why": w} for r, w in sorted(missing.items())],
            "summary": "; ".join(parts)}


def rank_line(ev: dict, rank: int) -> str:
    """One rank's place in a grid's evidence, for its suspect entry: ``in `f <- g` (1 of 4 ranks; 0,1,3 in `h`)``."""
    cl = ev.get("clusters", [])
    mine = next((c for c in cl if rank in c["ranks"]), None)
    if mine is None:
        why = next((m["why"] for m in ev.get("missing", []) if m["rank"] == rank), "no dump")
        return f"no stack ({why})"
    total = ev.get("ranks_dumped", 0)
    line = f"in `{_shown(mine['stack'], 3)}` ({len(mine['ranks'])} of {total} ranks"
    others = [c for c in cl if c is not mine][:2]
    return line + "".join(f"; {','.join(map(str, c['ranks']))} in `{_shown(c['stack'], 2)}`" for c in others) + ")"


class GridBook:
    """A job's grids (bounded) and the stall findings waiting for theirs (step 5)."""

    def __init__(self, config: StackGridConfig = StackGridConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.grids: "collections.OrderedDict[str, Grid]" = collections.OrderedDict()
        self._waiting: "collections.OrderedDict[str, tuple[Finding, frozenset[int]]]" = collections.OrderedDict()
        self.dumps = 0

    def absorb(self, rank: int, dumps) -> None:
        for d in dumps:
            g = self.grids.get(d.grid_id)
            if g is None:
                g = self.grids[d.grid_id] = Grid(d.grid_id, d.group, d.trigger, int(d.seq), self._clock())
                while len(self.grids) > self.config.max_grids:
                    self.grids.popitem(last=False)
            g.expected.update(d.expected_ranks)   # several processors of one job: their members add up
            g.dumps[rank] = d
            self.dumps += 1

    def find(self, group: str, seq: int = 0) -> Grid | None:
        """Step 5: the hang grid of (group, seq); with seq 0 the group's newest grid within ``max_age_s``."""
        now = self._clock()
        for g in reversed(self.grids.values()):
            if g.group != group:
                continue
            if seq:
                if g.trigger == "hang" and g.seq == seq:
                    return g
            elif now - g.first_seen <= self.config.max_age_s:
                return g
        return None

    def _late_start_grid(self, group: str, members: Iterable[int],
                         suspects: set[int]) -> tuple[dict, dict | None] | None:
        """Step 5 for a late start: the evidence of the newest recent grid of ``group`` that sets a suspect
        apart (an odd cluster of suspects only: a late rank beside a healthy one at the top of its loop is not
        set apart), else the newest, with how many of the recent grids set a suspect apart."""
        now = self._clock()
        recent = [g for g in reversed(self.grids.values())
                  if g.group == group and now - g.first_seen <= self.config.max_age_s]
        if not recent:
            return None
        evs = [(g, evidence(g, members, self.config)) for g in recent]
        apart = [(g, ev) for g, ev in evs if any(set(c["ranks"]) <= suspects for c in ev["clusters"][1:])]
        g, ev = (apart or evs)[0]
        if len(recent) > 1 and suspects:
            ev["apart_in"], ev["recent_grids"] = len(apart), len(recent)
            ev["summary"] += f" ({_ranks(sorted(suspects))} apart in {len(apart)} of {len(recent)} recent grids)"
        return ev, flight_recorder(g, members)

    def _grid_for(self, f: Finding, group: str, seq: int, members: Iterable[int]) -> tuple[dict, dict | None] | None:
        """Step 5: the grid evidence and Flight Recorder view ``f`` carries (None while no grid is in): a late
        start naming ranks, the recent grid that sets them apart; otherwise ``find``'s grid."""
        if not seq and f.kind == "late_start" and f.suspects:
            return self._late_start_grid(group, members, {x.rank for x in f.suspects})
        g = self.find(group, seq)
        return None if g is None else (evidence(g, members, self.config), flight_recorder(g, members))

    def attach(self, f: Finding, group: str, seq: int = 0, members: Iterable[int] = ()) -> Finding:
        """Step 5: ``f`` with its grid's evidence (finding and suspects); a stall finding without a
        complete grid waits for ``updates``, and so does a late start judged before any grid of its
        group is in (the straggler trigger's dumps can arrive after the window that named the rank:
        the finding is issued again with them rather than never carrying one)."""
        picked = self._grid_for(f, group, seq, members)
        out = f if picked is None else with_grid(f, *picked)
        waits = (seq and f.kind == "stall" and (picked is None or not picked[0]["complete"])) or (
            not seq and f.kind == "late_start" and picked is None and f.suspects)
        if waits:
            self._waiting[f"{group}|{seq}"] = (f, frozenset(members))
            while len(self._waiting) > self.config.max_grids:
                self._waiting.popitem(last=False)
        return out

    def updates(self) -> list[Finding]:
        """Step 5: stall findings issued again with their grid, once complete or after ``wait_s``."""
        out = []
        now = self._clock()
        for key, (f, members) in list(self._waiting.items()):
            group, seq = key.rsplit("|", 1)
            g = self.find(group, int(seq))
            if g is None:
                continue   # a trigger on another processor's ranks, or dumps still on their way
            if g.complete or now - g.first_seen >= self.config.wait_s:
                del self._waiting[key]
                out.append(with_grid(f, *self._grid_for(f, group, int(seq), members)))
        return out


def _state(e) -> str:
    """An entry's state for a person: completed when torch retired it (gloo's only mark), else torch's state."""
    if e is None:
        return "not in the view"
    return "completed" if e.retired or e.state == "completed" else f"in flight, torch state {e.state}"


def flight_recorder(grid: Grid, members: Iterable[int] = ()) -> dict | None:
    """Step 6: the ranks' Flight Recorder views of the grid's group compared (who is behind).

    1. Per rank with a dump, its view of ``grid.group`` (``StackDump.flight_recorder``: the newest
       collective seq it entered there); a rank without one is listed with why (the dump's
       ``flight_recorder_error``, no entry on the group, or no dump at all).
    2. The newest seq of any rank is where the group is; the ranks there *entered* it (its op and
       state from their entries); every other rank is *behind*, its newest seq said, lowest first.
    3. One line: ``ranks 0,1,3 entered allreduce seq 11 on group 0 (in flight, torch state
       scheduled); rank 2's newest entry is seq 10 (completed)``.
    None when no dump of the grid carries a view of any group (recorder off on every rank).
    """
    views, missing = {}, {}
    for rank in sorted(grid.dumps):
        d = grid.dumps[rank]
        v = next((g for g in d.flight_recorder if g.group == grid.group), None)
        if v is None:
            missing[rank] = (f"no entry on group {grid.group}" if len(d.flight_recorder)
                             else d.flight_recorder_error or "no Flight Recorder view")
        else:
            views[rank] = v
    if not views:
        return None
    for m in sorted(set(members) | grid.expected):
        if m not in grid.dumps:
            missing[m] = "no dump received"
    entry = {r: next((e for e in reversed(v.entries) if e.seq == v.newest_seq), None) for r, v in views.items()}
    top = max(v.newest_seq for v in views.values())
    entered = [r for r, v in views.items() if v.newest_seq == top]
    behind = sorted((r for r in views if r not in entered), key=lambda r: (views[r].newest_seq, r))
    first = entry[entered[0]]
    op = first.op if first is not None else "a collective"
    states = {_state(entry[r]) for r in entered}
    parts = [f"{_ranks(entered)} entered {op} seq {top} on group {grid.group} ({'; '.join(sorted(states))})"]
    by_seq: dict[int, list[int]] = collections.defaultdict(list)
    for r in behind:
        by_seq[views[r].newest_seq].append(r)
    for seq, rs in sorted(by_seq.items()):
        e = entry[rs[0]]
        parts.append(f"{_ranks(rs)}'s newest entry is seq {seq}"
                     + (f" ({e.op}, {_state(e)})" if e is not None else ""))
    if missing:
        parts.append(f"{_ranks(sorted(missing))}: no view ({missing[min(missing)]})")
    return {"group": grid.group, "seq": int(top), "op": op, "entered": entered, "behind": behind,
            "ranks": [{"rank": r, "newest_seq": int(v.newest_seq), "last_completed_seq": int(v.last_completed_seq),
                       "op": entry[r].op if entry[r] is not None else "", "state": _state(entry[r])}
                      for r, v in views.items()],
            "missing": [{"rank": r, "why": w} for r, w in sorted(missing.items())],
            "summary": "; ".join(parts)}


def with_grid(f: Finding, ev: dict, fr: dict | None = None) -> Finding:
    """The finding with ``stack_grid`` (and ``flight_recorder``, step 6) in its evidence, and each
    suspect's line of them in theirs."""
    more = {"flight_recorder": fr["summary"]} if fr else {}
    suspects = tuple(dataclasses.replace(s, evidence={**s.evidence, "stack_grid": rank_line(ev, s.rank), **more})
                     for s in f.suspects)
    return dataclasses.replace(f, suspects=suspects, evidence={**f.evidence, "stack_grid": ev,
                                                               **({"flight_recorder": fr} if fr else {})})


__all__ = ["Grid", "GridBook", "StackGridConfig", "clusters", "evidence", "flight_recorder", "rank_line", "training_thread",
           "with_grid"]
