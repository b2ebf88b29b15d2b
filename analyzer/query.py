"""``trainscope query``: answers about a job as typed results (the CLI renders them).

A facade over the local store (the processor's window records,
``processor/store.py``, and the analyzer's diagnoses and verdicts,
``analyzer/store.py``: one SQLite file by default) and, for what is flagged
now, Prometheus' HTTP API. Questions: ``jobs``, ``verdict`` (latest or one
window), ``stragglers`` since a time, a rank's ``kernels`` (L3-flagged
first, with its mean duration per call against the other ranks'),
``iterations`` per window, ``ranks`` (host, device, parallel coordinates).
The answer types are in ``query_model.py``, the Prometheus client in
``prom_client.py``.

Errors: a question the data cannot answer (unknown job, empty store,
Prometheus unreachable) raises ``QueryError`` (CLI exit 1); a bad setting
raises ``ConfigError`` naming it (exit 2). Window times are on each rank's
own clock and never compared across ranks, so ``since`` filters diagnoses
(stamped by the analyzer's wall clock) and ``last`` counts windows.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import statistics
import time
import urllib.parse
from types import SimpleNamespace
from typing import Any, Callable, Mapping

import numpy as np
from google.protobuf.json_format import MessageToDict

from trainscope.analyzer.prom_client import PrometheusClient
from trainscope.analyzer.query_model import (
    FindingRow, IterationRow, JobRow, KernelRow, QueryError, RankInfo, Rows, StragglerRow, SuspectRow, VerdictView)
from trainscope.proto.contracts import Signal
from trainscope.proto.errors import ConfigError, MissingSetting
from trainscope.proto.v1 import records_pb2

STRAGGLER_KINDS = ("straggler", "slow_communication", "imbalance", "slow_group", "late_arrivers",
                   "pair_straggler", "individual_slowdown", "consistent_slowdown")
KERNEL_KINDS = ("degraded_kernel", "degraded_kernels", "missing_kernel", "late_arrival")
#: ``kernels``: peers read for the comparison, evenly spaced over the rank's group (store.MAX_RANKS_FILTER bounds it).
MAX_KERNEL_PEERS = 256


# ---------------------------------------------------------------- facade
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QueryConfig:
    store_path: str
    """The SQLite store (``<home>/store.sqlite``)."""
    store_setting: str = "--store"
    """Which setting chose ``store_path``, named when the file is missing."""
    prometheus_url: str | None = None
    """Prometheus base URL (``http://prom:9090``) for what is flagged now; None: the store."""
    timeout_s: float = 10.0
    """Deadline of one Prometheus request."""

    def __post_init__(self) -> None:
        if self.prometheus_url is not None:
            u = urllib.parse.urlsplit(self.prometheus_url)
            if u.scheme not in ("http", "https") or not u.netloc:
                raise ConfigError("--prometheus", self.prometheus_url, "must be an http:// or https:// URL")
        if not self.timeout_s > 0:
            raise ConfigError("query.timeout_s", self.timeout_s, "must be > 0")


class Query:
    """Opens the stores lazily (Prometheus answers need none); ``close()`` closes them."""

    def __init__(self, config: QueryConfig, *, now: Callable[[], float] = time.time,
                 fetch: Callable[[str, float], bytes] | None = None) -> None:
        self.config = config
        self.now = now
        self._records = self._diagnoses = None
        self.prometheus = (PrometheusClient(config.prometheus_url, config.timeout_s, fetch)
                           if config.prometheus_url else None)

    def __enter__(self) -> "Query":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for s in filter(None, (self._records, self._diagnoses)):
            s.close()

    def _open(self):
        if self._records is None:
            from trainscope.analyzer import store as analyzer_store
            from trainscope.processor import store as processor_store

            path = self.config.store_path
            if not os.path.isfile(path):  # the store classes would create an empty one
                raise ConfigError(self.config.store_setting, path,
                                  "no trainscope store there: run `trainscope demo`, `replay` or a "
                                  "processor with this --home, or pass --store PATH")
            if not processor_store.tables_in(path) & (processor_store.TABLES | analyzer_store.TABLES):
                raise ConfigError(self.config.store_setting, path, "not a trainscope store (an SQLite file "
                                  "without trainscope's tables; left as it was)")
            # read-only: a question never changes the file (no WAL switch, no tables added)
            self._records = processor_store.SqliteStore(path, read_only=True)
            self._diagnoses = analyzer_store.DiagnosisStore(path, read_only=True)
        return self._records, self._diagnoses

    def job_ids(self) -> list[str]:
        records, diagnoses = self._open()
        return sorted(set(records.jobs()) | set(diagnoses.jobs()))

    def resolve_job(self, job: str | None) -> str:
        """The job asked for, or the store's only job; QueryError when unknown."""
        known = self.job_ids()
        if not known:
            raise QueryError(f"the store {self.config.store_path} holds no jobs yet")
        if job is None:
            if len(known) == 1:
                return known[0]
            raise MissingSetting("--job", f"the store holds {len(known)} jobs: " + _listed(known))
        if job not in known:  # wrong input (exit 2), not missing data
            raise ConfigError("--job", job, f"unknown job; the store holds {len(known)}: " + _listed(known))
        return job

    def _check_rank(self, job: str, rank: int | None) -> None:
        """A rank the job has, or a ConfigError (wrong input, exit 2); a rank of the job without the
        records asked for is a QueryError (no data yet, exit 1), raised by the question."""
        if rank is None:
            return
        records, _ = self._open()
        ranks: list[int] = []
        for signals in ((Signal.ITERATIONS, Signal.PHASES), (Signal.KERNELS, Signal.STACKS)):
            ranks = sorted(set().union(*(records.ranks(s, job) for s in signals)))   # the index alone
            if ranks:
                break
        if rank < 0 or (ranks and rank not in ranks):
            span = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else _listed(ranks)
            raise ConfigError("--rank", rank, f"job {job!r} has ranks {span}" if ranks else "must be >= 0")

    # ------------------------------------------------------------ questions
    def jobs(self) -> Rows:
        records, diagnoses = self._open()
        rows = []
        for job in self.job_ids():
            latest = diagnoses.latest_verdict(job)
            rows.append(JobRow(job=job, ranks=len(records.ranks(Signal.ITERATIONS, job)),
                               windows=len(records.windows(Signal.ITERATIONS, job)),
                               diagnoses=diagnoses.count_diagnoses(job),
                               latest=latest.summary if latest is not None else ""))
        if not rows:
            raise QueryError(f"the store {self.config.store_path} holds no jobs yet")
        return Rows(query="jobs", job=None, rows=tuple(rows))

    def verdict(self, job: str | None, window: int | None = None) -> VerdictView:
        """The job's verdict merged over its windows (the replay contract's ``verdict``), or one window's."""
        from trainscope.analyzer.merge import merge_windows

        job = self.resolve_job(job)
        _, diagnoses = self._open()
        if window is not None and window < 0:
            raise ConfigError("--window", window, "must be >= 0 (the window index that query iterations shows)")
        stored = diagnoses.verdicts(job)
        if window is None:
            v = merge_windows(list(stored))
        else:
            held = sorted({x.window.index for x in stored})
            v = next((x for x in stored if x.window.index == window), None)
            if v is None and held:  # the job has verdicts, not this one: wrong input
                raise ConfigError("--window", window, f"job {job!r} has verdicts for windows {held[0]}-{held[-1]}")
        if v is None:
            raise QueryError(f"job {job!r} has no verdict" + (f" for window {window}" if window is not None
                                                              else " yet (the analyzer has not run on it)"))
        info = {r.rank: r for r in self._rank_infos(job)}
        suspects = []
        for s in v.ranks:
            ev, ri = MessageToDict(s.evidence), info.get(s.rank)
            suspects.append(SuspectRow(
                rank=s.rank, role=s.role or "culprit", impact_s=s.impact_s, impact_pct=round(s.impact_pct, 2),
                host=(ri.host if ri else "") or s.host, coords=ri.coords if ri else "",
                waited_for=s.waited_for if s.waited_for >= 0 else None,
                levels=tuple(ev.get("levels", ())), where=tuple(ev.get("where", ()))))
        its = window_span(v.window) if window is not None else None
        since = v.since_window if v.HasField("since_window") else None
        since_span = next((window_span(x.window) for x in stored if x.window.index == since),
                          None) if since is not None else None
        return VerdictView(job=job, window=window, iterations=its, summary=v.summary, state=v.state or "healthy",
                           confidence=v.confidence, host=v.host, since_window=since, since_span=since_span,
                           stacks=self._stack_note(job),
                           comparison=v.comparison, suspects=tuple(suspects),
                           phases=tuple(v.phases), kernels=tuple(v.kernels),
                           findings=tuple(_finding_row(d) for d in v.findings if not d.informational), verdict=v)

    def _stack_note(self, job: str) -> str:
        """Whether L5 had py-spy stacks to read for the job: ranks sampled, or why none (issue #12 item 4)."""
        records, _ = self._open()
        sampled = records.ranks(Signal.STACKS, job)
        if sampled:
            return f"stack sampling (py-spy): {len(sampled)} rank(s) sampled"
        return ("stack sampling (py-spy) was off for this job: no stacks recorded (py-spy not found, "
                "--no-stacks, or a simulator run without them), so L5 could not corroborate")

    def stragglers(self, job: str | None, since_ns: int = 0) -> Rows:
        """Ranks flagged as stragglers by diagnoses made at or after ``since_ns`` (unix ns; 0: all)."""
        if self.prometheus is not None:
            return self._prom_stragglers(job, since_ns)
        job = self.resolve_job(job)
        _, diagnoses = self._open()
        latest = diagnoses.latest_verdict(job)
        now = {s.rank for d in (latest.findings if latest else ()) if d.kind in STRAGGLER_KINDS for s in d.suspects}
        tally = _Tally()
        for d in diagnoses.diagnoses(job, since_ns=since_ns, kinds=STRAGGLER_KINDS):
            for s in d.suspects:
                tally.add(s.rank, s.impact_s, d.kind, d.scope.phase, d.window, d.created_unix_ns, s.rank in now)
        hosts = {r.rank: r.host for r in self._rank_infos(job)}
        rows = sorted(_straggler_rows(tally, hosts), key=lambda x: (-x.windows, -x.max_impact_s, x.rank))
        return Rows(query="stragglers", job=job, rows=tuple(rows),
                    params={"since": _iso(since_ns) if since_ns else None, "source": "store"})

    def kernels(self, job: str | None, rank: int, top: int = 10, since_ns: int = 0, last: int = 0) -> Rows:
        """A rank's kernels, flagged by L3 since ``since_ns`` first, then by its ratio to its peers
        (calls and busy time summed over the job's last ``last`` kernel windows; 0: every window)."""
        if top < 1:
            raise ConfigError("--top", top, "must be >= 1")
        if last < 0:
            raise ConfigError("--last", last, "must be >= 0 (0 = every window)")
        if self.prometheus is not None:
            return self._prom_kernels(job, rank, since_ns, top)
        job = self.resolve_job(job)
        self._check_rank(job, rank)
        records, diagnoses = self._open()
        flagged = _Tally()
        for d in diagnoses.diagnoses(job, since_ns=since_ns, kinds=KERNEL_KINDS):
            for s in d.suspects:
                if s.rank == rank and d.scope.kernel:
                    # rows are ordered by the time the rank loses there: a late arrival's short
                    # collective (the others waited) loses it nothing
                    flagged.add(d.scope.kernel, 0.0 if d.kind == "late_arrival" else s.impact_s, d.kind,
                                window=d.window)
        first = None
        if last:
            held = records.windows(Signal.KERNELS, job)
            first = held[-last][1] if len(held) >= last else None
        peers = self._kernel_peers(job, rank)
        busy = _kernel_busy(records.raw(Signal.KERNELS, job, first_window=first, ranks=peers),
                            records.kernel_names(job))
        if rank not in busy.ranks and not flagged.by:
            raise QueryError(f"job {job!r} has no kernel records or kernel findings for rank {rank}")
        rows = []
        for kernel in set(flagged.by) | busy.kernels_of(rank):
            n, t = busy.per_rank(kernel)
            own = busy.rank_index.get(rank)
            has_own = own is not None and n is not None and n[own] > 0
            mean = float(t[own] / n[own] / 1e9) if has_own else None
            peers = None
            if n is not None:
                sel = n > 0
                if own is not None:
                    sel[own] = False
                peers = t[sel] / n[sel] / 1e9
            peer = float(np.median(peers)) if peers is not None and peers.size else None
            f = flagged.by.get(kernel)
            calls = int(n[own]) if own is not None and n is not None else 0
            rows.append(KernelRow(kernel=kernel, kinds=tuple(sorted(f.kinds)) if f else (),
                                  flagged_windows=len(f.windows) if f else 0, max_impact_s=f.score if f else None,
                                  calls=calls, rank_mean_s=mean, peer_mean_s=peer,
                                  ratio=mean / peer if mean and peer else None))
        # by the time the rank loses there: flagged impact, then its excess over its peers' busy time
        rows.sort(key=lambda x: (-(x.max_impact_s or 0.0), -x.flagged_windows, -_time_lost(x), x.kernel))
        return Rows(query="kernels", job=job, rows=tuple(rows[:top]),
                    params={"rank": rank, "since": _iso(since_ns) if since_ns else None, "source": "store",
                            "peers": len(busy.ranks - {rank}), **({"last": last} if last else {})})

    def iterations(self, job: str | None, rank: int | None = None, last: int = 20) -> Rows:
        if last < 0:
            raise ConfigError("--last", last, "must be >= 0 (0 = every window)")
        job = self.resolve_job(job)
        self._check_rank(job, rank)
        records, _ = self._open()
        by_window: dict[tuple[int, int], dict[int, records_pb2.IterationWindow]] = {}
        for rec in records.records(Signal.ITERATIONS, job):
            if rank is None or rec.resource.rank == rank:
                by_window.setdefault((rec.window.kind, rec.window.index), {})[rec.resource.rank] = rec
        # a window with no iteration in it (time windows before the first mark) is no row of zeros
        by_window = {k: recs for k, recs in by_window.items()
                     if any(r.marks or r.mean_ns for r in recs.values())}
        if not by_window:
            raise QueryError(f"job {job!r} has no iterations recorded" + (f" for rank {rank}" if rank is not None else "")
                             + " (no iteration marks reached the processor yet)")
        rows = [_iteration_row(key[1], recs) for key, recs in sorted(by_window.items())]
        rows = rows[-last:] if last else rows
        return Rows(query="iterations", job=job, rows=tuple(rows), params={"rank": rank, "last": last})

    def ranks(self, job: str | None, rank: int | None = None, host: str | None = None) -> Rows:
        job = self.resolve_job(job)
        self._check_rank(job, rank)
        infos = self._rank_infos(job)
        hosts = sorted({r.host for r in infos})
        if host is not None and infos and host not in hosts:
            raise ConfigError("--host", host, f"job {job!r} has hosts " + _listed(hosts))
        rows = [r for r in infos
                if (rank is None or r.rank == rank) and (host is None or r.host == host)]
        if not rows:
            what = " and ".join(x for x in (f"rank {rank}" if rank is not None else "",
                                            f"host {host!r}" if host else "") if x)
            raise QueryError(f"job {job!r} has no records" + (f" for {what}" if what else " with a resource"))
        return Rows(query="ranks", job=job, rows=tuple(rows), params={"rank": rank, "host": host})

    # ------------------------------------------------------------ helpers
    def _kernel_peers(self, job: str, rank: int) -> list[int] | None:
        """The ranks ``kernels`` compares ``rank`` with, itself included: the members of its
        data-parallel group (the ranks L3 compares it with: same tp, pp, ep and cp coordinates),
        at most ``MAX_KERNEL_PEERS`` of them evenly spaced (a median of a few hundred peers is
        the median of thousands to within their spread); None: every rank (no resources known,
        or a group that small)."""
        infos = self._rank_infos(job)
        me = next((r for r in infos if r.rank == rank), None)
        key = (lambda r: (r.tp, r.pp, r.ep, r.cp)) if me is not None else None
        group = [r.rank for r in infos if key is not None and key(r) == key(me)]
        if len(group) <= MAX_KERNEL_PEERS:
            return group if key is not None and len(group) < len(infos) else None
        others = [r for r in group if r != rank]
        pick = np.unique(np.linspace(0, len(others) - 1, MAX_KERNEL_PEERS).round().astype(np.int64))
        return [rank] + [others[i] for i in pick]

    def _rank_infos(self, job: str) -> list[RankInfo]:
        """Each rank's newest resource: from iteration and phase records, else kernel records."""
        records, _ = self._open()
        newest: dict[int, Any] = {}
        for signals in ((Signal.ITERATIONS, Signal.PHASES), (Signal.KERNELS, Signal.STACKS)):
            newest = records.newest_per_rank(signals, job)   # one indexed query, not every record
            if newest:
                break
        out = []
        for rank, rec in sorted(newest.items()):
            r = rec.resource
            c = r.coords
            out.append(RankInfo(rank=rank, host=r.host, pid=r.pid, local_rank=r.local_rank, device=r.device,
                                dp=c.dp, tp=c.tp, pp=c.pp, ep=c.ep, cp=c.cp))
        return out

    def _prom_suspects(self, job: str | None, since_ns: int, kinds: tuple[str, ...],
                       rank: int | None = None) -> tuple[list[tuple[dict, float, bool]], dict]:
        """Flagged suspect series of ``kinds``: (labels, max score over the range, flagged now)."""
        if job is None:
            raise ConfigError("--job", None, "required with --prometheus")
        prom, sel = self.prometheus, json.dumps(job)
        secs = max(60, int(self.now() - since_ns / 1e9)) if since_ns else 3600
        if not prom.query(f'count(last_over_time({{__name__=~"trainscope_rank_info|trainscope_suspect_score|'
                          f'trainscope_job_iteration_state",job={sel}}}[{secs}s]))'):
            raise QueryError(f"Prometheus at {prom.url} has no trainscope series for job {job!r} in the "
                             f"last {secs}s (are the targets scraped with honor_labels: true?)")
        m = f'trainscope_suspect_score{{job={sel},kind=~"{"|".join(kinds)}"' + (
            f',rank="{rank}"}}' if rank is not None else "}")
        by = "rank, phase, kernel, kind"
        now = {tuple(sorted(x.items())) for x, _ in prom.query(f"max by ({by}) ({m})")}
        best = [(x, v, tuple(sorted(x.items())) in now)
                for x, v in prom.query(f"max by ({by}) (max_over_time({m}[{secs}s]))")]
        params = {"since": _iso(since_ns) if since_ns else None, "source": prom.url, "range": f"{secs}s"}
        return best, params

    def _prom_stragglers(self, job: str | None, since_ns: int) -> Rows:
        best, params = self._prom_suspects(job, since_ns, STRAGGLER_KINDS)
        hosts = {x["rank"]: x.get("host", "") for x, _ in self.prometheus.query(
            f"max by (rank, host) (trainscope_rank_info{{job={json.dumps(job)}}})")}
        tally = _Tally()
        for labels, score, now in best:
            tally.add(int(labels["rank"]), score, labels.get("kind", ""), labels.get("phase", ""), now=now)
        rows = sorted(_straggler_rows(tally, {int(r): h for r, h in hosts.items()}, windows=False),
                      key=lambda x: (not x.flagged_now, -x.max_impact_s, x.rank))
        return Rows(query="stragglers", job=job, rows=tuple(rows), params=params)

    def _prom_kernels(self, job: str | None, rank: int, since_ns: int, top: int) -> Rows:
        best, params = self._prom_suspects(job, since_ns, KERNEL_KINDS, rank)
        tally = _Tally()
        for labels, score, _ in best:
            tally.add(labels.get("kernel", ""), score, labels.get("kind", ""))
        rows = sorted((KernelRow(kernel=k, kinds=tuple(sorted(a.kinds)), flagged_windows=0, max_impact_s=a.score,
                                 calls=0, rank_mean_s=None, peer_mean_s=None, ratio=None)
                       for k, a in tally.by.items()), key=lambda x: (-(x.max_impact_s or 0.0), x.kernel))
        return Rows(query="kernels", job=job, rows=tuple(rows[:top]), params={"rank": rank, **params})


class _Busy:
    """Per (kernel, rank): calls and busy ns summed over the records, in record order (so the sums
    are the ones adding the records one by one gives), read from the wire format at once
    (``kernel_columns.totals_from_bytes``)."""

    def __init__(self, rows, names=None) -> None:
        from trainscope.analyzer.kernel_columns import totals_from_bytes

        ranks = np.array([r[0] for r in rows], dtype=np.int64)
        bounds = np.cumsum([0] + [len(r[3]) for r in rows])
        self.ranks = set(ranks.tolist())
        order = sorted(self.ranks)
        self.rank_index = {r: i for i, r in enumerate(order)}
        tot = totals_from_bytes(bytearray().join(r[3] for r in rows), bounds, names)  # ids named by the job's dictionary
        self.names = {name: i for i, name in enumerate(tot.names)}
        R = len(order)
        pos = np.searchsorted(np.asarray(order, dtype=np.int64), ranks[tot.message]) if order else tot.message
        cell = tot.name_id * R + pos
        size = len(tot.names) * R
        self.calls = np.bincount(cell, weights=tot.count, minlength=size).reshape(-1, R) if R else None
        self.busy = np.bincount(cell, weights=tot.total_ns, minlength=size).reshape(-1, R) if R else None
        present = np.zeros(size, dtype=bool)
        present[cell] = True
        self.present = present.reshape(-1, R) if R else None

    def kernels_of(self, rank: int) -> set[str]:
        i = self.rank_index.get(rank)
        if i is None:
            return set()
        return {name for name, k in self.names.items() if self.present[k, i]}

    def per_rank(self, kernel: str):
        """(calls, busy ns) of every rank for ``kernel``, or (None, None) when no record has it."""
        k = self.names.get(kernel)
        if k is None:
            return None, None
        return self.calls[k], self.busy[k]


def _kernel_busy(rows, names=None) -> _Busy:
    return _Busy(rows, names)


def _time_lost(row: KernelRow) -> float:
    """Seconds the rank spent in the kernel beyond its peers' per-call median (0 when faster)."""
    if row.rank_mean_s is None or row.peer_mean_s is None:
        return 0.0
    return max(0.0, (row.rank_mean_s - row.peer_mean_s) * row.calls)


class _Tally:
    """What the findings say about each key (a rank or a kernel)."""

    def __init__(self) -> None:
        self.by: dict[Any, SimpleNamespace] = {}

    def add(self, key, score: float, kind: str = "", phase: str = "", window=None, at_ns: int = 0,
            now: bool = False) -> None:
        a = self.by.get(key) or self.by.setdefault(key, SimpleNamespace(
            phases=set(), kinds=set(), windows=set(), score=0.0, first_ns=at_ns, last_ns=0, now=False))
        a.phases.update([phase] if phase else [])
        a.kinds.update([kind] if kind else [])
        if window is not None:
            a.windows.add((window.kind, window.index))
        a.score, a.now = max(a.score, score), a.now or now
        a.first_ns, a.last_ns = min(a.first_ns, at_ns), max(a.last_ns, at_ns)


def _straggler_rows(tally: _Tally, hosts: Mapping[int, str], windows: bool = True) -> list[StragglerRow]:
    return [StragglerRow(rank=r, host=hosts.get(r, ""), phases=tuple(sorted(a.phases)), kinds=tuple(sorted(a.kinds)),
                         windows=len(a.windows) if windows else None, max_impact_s=a.score, first_seen=_iso(a.first_ns),
                         last_seen=_iso(a.last_ns), flagged_now=a.now) for r, a in tally.by.items()]


def _finding_row(d: records_pb2.Diagnosis) -> FindingRow:
    s = d.scope
    scope = [f"phase {s.phase}" if s.phase else "", f"kernel {s.kernel}" if s.kernel else "",
             f"{s.group} group {s.group_index}" if s.group and s.group != "job" else ""]
    return FindingRow(level=d.level, kind=d.kind, scope=", ".join(x for x in scope if x) or "job",
                      suspects=tuple(x.rank for x in d.suspects), impact_s=d.impact_s,
                      comparison=d.comparison or "peers")


def _iteration_row(window: int, recs: Mapping[int, records_pb2.IterationWindow]) -> IterationRow:
    marks = [m for r in recs.values() for m in r.marks]
    iters = [m.iteration for m in marks]
    n = {rank: max(len(r.marks), 1) for rank, r in recs.items()}
    total = sum(n.values())
    slowest = max(recs, key=lambda rank: (recs[rank].mean_ns, -rank))
    return IterationRow(
        window=window, first_iteration=min(iters, default=0), last_iteration=max(iters, default=0),
        ranks=len(recs), iterations=len(set(iters)),
        mean_s=sum(r.mean_ns * n[k] for k, r in recs.items()) / total / 1e9,
        p50_s=statistics.median(r.p50_ns for r in recs.values()) / 1e9,
        max_s=max(r.max_ns for r in recs.values()) / 1e9, slowest_rank=slowest)


def _listed(items, most: int = 20) -> str:
    """``a, b, c`` (and how many more past ``most``)."""
    items = [str(x) for x in items]
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _iso(ns: int) -> str | None:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if ns else None


def window_span(w) -> str:
    """A window as a person reads it: ``iterations 40-44``, else its time range on the rank's clock.

    Time windows carry rank-clock nanoseconds: shown as a UTC time range when they look like wall-clock
    time (after 2001), else as seconds from the clock's zero (a simulated clock)."""
    if w.kind == records_pb2.WINDOW_KIND_ITERATIONS:
        return f"iterations {w.first_iteration}-{w.last_iteration}"
    if not w.end_ns:
        return ""
    if w.start_ns >= 10**18:
        a = dt.datetime.fromtimestamp(w.start_ns / 1e9, dt.timezone.utc)
        b = dt.datetime.fromtimestamp(w.end_ns / 1e9, dt.timezone.utc)
        return f"{a:%Y-%m-%d %H:%M:%S}-{b:%H:%M:%S} UTC"
    return f"t={w.start_ns / 1e9:.0f}-{w.end_ns / 1e9:.0f} s"


# ------------------------------------------------------------ deep dives (L4)
def deep_dives(root: str, job: str, url: str | None = None) -> list[dict]:
    """``trainscope query deep-dive``: the job's deep dives under ``root``, oldest first.

    Read from the files the processor and the analyzer leave per dive (``<root>/<job>/<dive>/``:
    ``manifest.json``, ``analysis.json``; ``analyzer/deepdive/results.py``), not from the store:
    a dive that is running or not analysed yet is listed too. Each entry: when, trigger, ranks and
    their outcomes, iterations, trace paths, the functions the analysis found (or each rank's top
    functions on its critical path), and the Perfetto view (the suspect's trace, a healthy peer's,
    each with its critical-path file). Unknown job or no dive: ``ConfigError`` naming ``--job``.
    With ``url`` (``--deep-dive-url``) the dives are the bucket's (``ObjectDives``: every host's
    manifests merged), their analyses the analyzer's under ``<root>/.objects``; each rank shows its
    object's URL (``object``) either way.
    """
    from trainscope.analyzer.deepdive.results import ANALYSIS, ObjectDives, objects_work_root, read_manifest
    from trainscope.proto import env

    if url:
        work = objects_work_root(root)
        entries = [(os.path.join(work, j, d), man) for j, d, man in ObjectDives(url).dives(job)]
        if not entries:
            from trainscope.proto.errors import redact_url
            raise ConfigError("--job", job, f"no deep dive of this job at {redact_url(url)} (no manifest object "
                                            "there: is --deep-dive-url the processors' URL?)")
        return _deep_dive_entries(entries, job, ANALYSIS)
    jdir = os.path.dirname(env.deep_dive_trace_dir(root, job, "x"))
    if not os.path.isdir(jdir):
        try:
            known = sorted(e.name for e in os.scandir(root) if e.is_dir())
        except OSError:
            known = []
        raise ConfigError("--job", job, f"no deep dive of this job under {root}" + (
            f"; jobs with deep dives there: {_listed(known)}" if known else
            " (none there: run `trainscope profile --job J`, or pass --deep-dive-dir)"))
    entries = []
    for e in os.scandir(jdir):
        man = read_manifest(e.path) if e.is_dir(follow_symlinks=False) else None
        if man is not None:
            entries.append((e.path, man))
    out = _deep_dive_entries(entries, job, ANALYSIS)
    if not out:
        raise ConfigError("--job", job, f"no deep dive of this job under {jdir} (no manifest.json there)")
    return out


def _deep_dive_entries(entries: list, job: str, ANALYSIS: str) -> list[dict]:
    """:func:`deep_dives`' entries from (dive directory, manifest) pairs, oldest first."""
    out = []
    for path, man in entries:
        e = SimpleNamespace(path=path, name=os.path.basename(path))
        try:
            with open(os.path.join(e.path, ANALYSIS), encoding="utf-8") as f:
                ana = json.load(f)
        except (OSError, ValueError):
            ana = None
        ranks = man.get("ranks") or {}
        found, not_cause = [], []
        if ana and not ana.get("error"):
            for o in ana.get("outliers") or ():
                who = [r for r, s in zip(o["ranks"], o["slower"]) if s] if not o.get("common") else []
                imp = [x for x, s in zip(o["impact_s"], o["slower"]) if s and x is not None]
                if o.get("not_cause"):          # ranks that waited or were absorbed (localize steps 7-8)
                    not_cause.append({"function": o["function"], "ranks": o["ranks"], "why": o["not_cause"]})
                    continue
                found.append({"function": o["function"], "kind": o["kind"], "ranks": who, "common": o.get("common"),
                              "impact_s": max(imp) if imp else None, "evidence": o.get("evidence", "")})
        state = ("analysed" if ana and not ana.get("error") else "not analysed: " + ana["error"] if ana
                 else "complete, analysis pending" if man.get("complete") else "running")
        start = int(man.get("start_iteration") or 0)
        out.append({
            "dive_id": man.get("dive_id", e.name), "job": man.get("job", job), "directory": e.path,
            "requested": _iso(int(man.get("requested_unix_ns") or 0)), "trigger": man.get("trigger", ""),
            "reason": man.get("reason", ""), "state": state, "partial": bool(man.get("partial")),
            "iterations": [start, start + int(man.get("iterations") or 0) - 1],
            "ranks_expected": man.get("ranks_expected", []),
            "ranks": {r: {"outcome": v.get("outcome"), "iterations": [v.get("first_iteration"), v.get("last_iteration")],
                          "trace": v.get("trace") or None, "trace_bytes": v.get("trace_bytes", 0),
                          "object": v.get("object") or ((((man.get("objects") or {}).get(r) or {}).get("trace")
                                                         or {}).get("url"))}
                      for r, v in sorted(ranks.items(), key=lambda kv: int(kv[0]))},
            "found": found, "not_a_cause": not_cause, "suspects": (ana or {}).get("suspects", []),
            "top": {r: [t["function"] for t in v.get("top", [])[:3]] for r, v in ((ana or {}).get("ranks") or {}).items()},
            "perfetto": (ana or {}).get("perfetto", {}), "verdict": (ana or {}).get("verdict"),
            "_sort": int(man.get("requested_unix_ns") or 0)})
    out.sort(key=lambda d: (d.pop("_sort"), d["dive_id"]))
    return out


def render_deep_dives(dives: list[dict]) -> str:
    """The text form of :func:`deep_dives`."""
    lines = []
    for d in dives:
        a, b = d["iterations"]
        done = sum(1 for v in d["ranks"].values() if v["outcome"] == "done")
        lines.append(f"deep dive {d['dive_id']} of job {d['job']} ({d['trigger'] or 'manual'}, requested "
                     f"{d['requested'] or '?'}): iterations {a}-{b}, {done}/{len(d['ranks_expected'])} ranks traced"
                     f"{' (partial)' if d['partial'] else ''}; {d['state']}")
        if d["reason"]:
            lines.append(f"  reason: {d['reason']}")
        for r, v in d["ranks"].items():
            where = f"{v['trace']} ({(v['trace_bytes'] or 0) / 1e6:.1f} MB)" if v["trace"] else "no trace"
            if v.get("object") and v["object"] != v["trace"]:
                where += f"; object {v['object']}"
            lines.append(f"  rank {r}: {v['outcome']}, {where}")
        for f in d["found"][:10]:
            who = "every rank (common)" if f["common"] else "rank(s) " + _listed(f["ranks"])
            cost = f", {f['impact_s'] * 1e3:.3g} ms/iteration" if f["impact_s"] else ""
            lines.append(f"  found: {f['function']} ({f['kind']}) on {who}{cost}")
        for w in d.get("not_a_cause", [])[:5]:
            how = ("longer in" if w["why"] == "waited" else "slower in") + f" {w['function']}"
            lines.append(f"  not a cause: rank(s) {_listed(w['ranks'])} {how} ({w['why']}: "
                         + ("it waited for others" if w["why"] == "waited" else "it made nobody wait") + ")")
        if d["state"] == "analysed" and not d["found"]:
            lines.append("  found: no function out of line on any rank (healthy)")
            for r, top in list(d["top"].items())[:4]:
                lines.append(f"  rank {r} top of its critical path: {'; '.join(top)}")
        for who in ("suspect", "peer"):
            v = d["perfetto"].get(who)
            if v:
                label = "suspect" if who == "suspect" else "healthy peer"
                cp = f" + critical path {v['critical_path']}" if v.get("critical_path") else ""
                lines.append(f"  Perfetto ({label}, rank {v['rank']}): {v['trace']}{cp}")
        if d["perfetto"]:
            lines.append("  open each file in https://ui.perfetto.dev (Open trace file)")
        if d.get("verdict"):
            lines.append("  verdict: " + (f"merged into window {d['verdict']['window']}" if d["verdict"].get("merged")
                                          else d["verdict"].get("why", "")))
    return "\n".join(lines)
