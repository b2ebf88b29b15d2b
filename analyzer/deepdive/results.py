"""A completed deep dive analysed, its findings stored and merged into the job's verdict (issue #14).

Where it runs: in the analyzer, on the host whose deep-dive directory holds the
traces, or on any host when the processors upload them to object storage
(``--deep-dive-url``, ``processor/dive_upload.py``; :class:`ObjectDives` merges each
dive's per-host manifests, the traces are read from their objects). The processor cannot (stages point one way: it may not import the
analyzer), the ranks must not (a trace read holds a GIL for ~1 s), and the
analyzer of the default deployment runs beside the processor, on its store file
and on the same ``TRAINSCOPE_DEEP_DIVE_DIR`` (``proto/env.deep_dive_dir``). A job on
several hosts needs that directory on a shared file system for one analysis to
see every rank; otherwise each host's ranks are compared among themselves.

Steps (:class:`DeepDiveFollower`, one ``scan`` every ``interval_s`` on its own thread):
1. Find the dives to analyse: ``<root>/<job>/<dive>/manifest.json`` (written by
   ``processor/control.py``) that says ``complete`` (every rank reported, or
   the report timeout passed) and has no ``analysis.json`` yet.
2. Analyse (:func:`analyze_dive`): the ranks whose outcome is ``done`` and whose
   trace lies in the dive's directory go to ``localize_traces`` (EROICA
   §4.2-4.3); ``analysis.json`` (0600) keeps the result: each rank's top
   functions, the outliers, the suspect and a healthy peer of its role for the
   Perfetto view (ARGUS §6.3), with each one's critical path written as
   ``rank-<R>.critical_path.json`` (a Chrome trace, 0600, one track).
3. Store: the L4 findings become diagnoses of the job; the verdict of the
   job's window that covers the dive's first iteration gets the L4 suspects
   and findings merged in (``merge``'s verdict of the L4 findings alone,
   combined with the stored one), so ``query verdict`` and the job's verdict
   (``merge_windows``) carry them. A window not judged yet is waited for
   (``verdict_wait_s``); after that the diagnoses are stored alone and the
   analysis says so. A dive that cannot be analysed (no trace, a bad file)
   gets an ``analysis.json`` with the error and is not tried again.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from trainscope.analyzer.deepdive import DeepDiveResult, LocalizeConfig, localize_traces
from trainscope.analyzer.deepdive.critical_path import LEVEL_NAMES, critical_path
from trainscope.analyzer.deepdive.trace import read_trace
from trainscope.analyzer.merge import DEGRADED, HEALTHY, merge, summarize
from trainscope.proto.errors import BadInput, TrainscopeError, redact_url
from trainscope.proto.securefs import private_dir, write_private
from trainscope.proto.v1 import records_pb2

log = logging.getLogger(__name__)

ANALYSIS = "analysis.json"
MANIFEST = "manifest.json"
#: Spans at most in one critical-path file (a 50-iteration window of a busy CPU job stays far below).
MAX_SPANS = 200_000


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FollowerConfig:
    interval_s: float = 5.0
    """Time between scans of the deep-dive directory."""
    verdict_wait_s: float = 120.0
    """How long a dive's findings wait for the verdict of the window that covers it."""
    max_per_scan: int = 4
    """Dives analysed at most per scan (each reads every rank's trace)."""

    def __post_init__(self) -> None:
        from trainscope.proto.errors import ConfigError
        if not self.interval_s > 0:
            raise ConfigError("deep_dive.interval_s", self.interval_s, "must be > 0")
        if not self.verdict_wait_s >= 0:
            raise ConfigError("deep_dive.verdict_wait_s", self.verdict_wait_s, "must be >= 0")
        if type(self.max_per_scan) is not int or self.max_per_scan < 1:
            raise ConfigError("deep_dive.max_per_scan", self.max_per_scan, "must be an integer >= 1")


def read_manifest(directory: str) -> dict | None:
    """The dive's manifest, None when missing or unreadable (a dive being created)."""
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def dive_traces(directory: str, manifest: dict) -> dict[int, str]:
    """rank -> trace of the ranks that traced their window, the trace inside the dive's directory
    (or, for a dive read from object storage, the rank's object under that dive's prefix)."""
    real = os.path.realpath(directory)
    out = {}
    prefix = manifest.get("objects_prefix") or ""
    for r, rep in (manifest.get("ranks") or {}).items():
        t = rep.get("trace") or ""
        if prefix:   # read from a bucket (ObjectDives): only this dive's own objects
            if rep.get("outcome") in ("done", "truncated") and t.startswith(prefix) and ".." not in t:
                out[int(r)] = t
            continue
        if rep.get("outcome") in ("done", "truncated") and t and os.path.dirname(os.path.realpath(t)) == real \
                and os.path.isfile(t):
            out[int(r)] = t
    return out


class ObjectDives:
    """Deep dives in object storage (``processor/dive_upload.py``): one manifest object per host.

    ``<url>/<job>/<dive>/manifest-<host>.json`` (each processor's ranks, their reports and objects)
    are merged into one manifest per dive, as ``manifest.json`` reads: ``ranks`` of every host,
    ``ranks_expected`` their union, ``complete`` when every host's says so (a host's says so once its
    ranks reported and its uploads settled), each rank's ``trace`` the URL of its object (under the
    reader's own URL: keys are relative, credentials the reader's environment's), ``object`` the URL
    shown to people, ``objects_prefix`` the dive's prefix. One ``glob`` per listing.
    """

    def __init__(self, url: str) -> None:
        from trainscope.processor.dive_upload import open_fs
        self.url = url.rstrip("/")
        self.fs, self.root = open_fs(url, "--deep-dive-url")

    def manifests(self, job: str | None = None,
                  skip: Callable[[str, str], bool] | None = None) -> dict[tuple[str, str], list[dict]]:
        """(job component, dive) -> the host manifests found (unreadable ones skipped; ``skip(job, dive)``
        true: not read, e.g. a dive already analysed)."""
        from trainscope.processor.dive_upload import MANIFEST_PREFIX, job_component
        pattern = f"{self.root}/{job_component(job) if job else '*'}/*/{MANIFEST_PREFIX}*.json"
        out: dict[tuple[str, str], list[dict]] = {}
        try:
            paths = sorted(self.fs.glob(pattern))
        except Exception as e:  # an unreachable bucket: nothing this scan, said once per scan
            log.warning("deep dives at %s: cannot list: %s", redact_url(self.url), str(e).splitlines()[0][:160])
            return out
        for p in paths:
            parts = p.rstrip("/").split("/")
            if skip is not None and skip(parts[-3], parts[-2]):
                continue
            try:
                doc = json.loads(self.fs.cat_file(p))
            except Exception:
                continue
            if isinstance(doc, dict):
                out.setdefault((parts[-3], parts[-2]), []).append(doc)
        return out

    def merged(self, job_dir: str, dive: str, docs: list[dict]) -> dict:
        from trainscope.processor.dive_upload import object_url
        first = min(docs, key=lambda d: d.get("requested_unix_ns") or 0)
        man = {k: first.get(k) for k in ("dive_id", "job", "trigger", "reason", "requested_unix_ns",
                                         "start_iteration", "iterations")}
        man["dive_id"] = man.get("dive_id") or dive
        man["complete"] = all(d.get("complete") for d in docs)
        man["partial"] = any(d.get("partial") for d in docs)
        man["hosts"] = sorted(str(d.get("host_tag", "")) for d in docs)
        man["ranks_expected"] = sorted({int(r) for d in docs for r in d.get("ranks_expected") or ()})
        prefix = f"{self.url}/{job_dir}/{dive}/"
        man["objects_prefix"] = prefix
        ranks, missing = {}, []
        for d in docs:
            objects = d.get("objects") or {}
            for r, rep in (d.get("ranks") or {}).items():
                rep = dict(rep)
                obj = (objects.get(r) or {}).get("trace") or {}
                rep["local_trace"] = rep.get("trace", "")
                key = obj.get("key") or ""
                if obj.get("state") == "uploaded" and key.startswith(f"{job_dir}/{dive}/") and ".." not in key:
                    rep["trace"] = f"{self.url}/{key}"
                    rep["object"] = object_url(self.url, key)
                else:
                    rep["trace"] = ""
                    if rep.get("outcome") in ("done", "truncated"):
                        missing.append(int(r))
                    rep["object_state"] = obj.get("state", "none")
                    if obj.get("detail"):
                        rep["object_detail"] = obj["detail"]
                ranks[str(r)] = rep
        man["ranks"] = ranks
        man["ranks_without_object"] = sorted(missing)
        return man

    def dives(self, job: str | None = None,
              skip: Callable[[str, str], bool] | None = None) -> list[tuple[str, str, dict]]:
        """(job component, dive, merged manifest) of every dive found (but the ones ``skip`` names), oldest first."""
        out = [(j, d, self.merged(j, d, docs)) for (j, d), docs in self.manifests(job, skip).items()]
        out.sort(key=lambda x: (x[2].get("requested_unix_ns") or 0, x[1]))
        return out


def objects_work_root(root: str) -> str:
    """Where the analyzer keeps what it writes for dives read from object storage (``analysis.json``,
    critical paths, the merged manifest): ``<root>/.objects`` (a job directory never starts with a dot)."""
    return os.path.join(root, ".objects")


def critical_path_trace(path: str, rank: int) -> dict:
    """One rank's critical path as a Chrome trace: one track, a span per stretch of one owner.

    Times are the rank's trace's (µs, its clock), so the spans line up with its kineto trace.
    """
    cp = critical_path(read_trace(path))
    tr = cp.trace
    own = cp.seg_owner
    keep = own >= 0
    s, e, o, lv = cp.seg_start[keep], cp.seg_end[keep], own[keep], cp.seg_level[keep]
    if s.size:
        # join neighbouring segments of one owner (touching in time)
        new = np.ones(s.size, dtype=bool)
        new[1:] = (o[1:] != o[:-1]) | (s[1:] > e[:-1])
        start_idx = np.flatnonzero(new)
        end_idx = np.append(start_idx[1:], s.size) - 1
        s, e, o, lv = s[start_idx], e[end_idx], o[start_idx], lv[start_idx]
    n = min(s.size, MAX_SPANS)
    names = tr.names
    ev: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": f"rank {rank}: critical path"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0,
         "args": {"name": "critical path (trainscope, EROICA §4.2)"}}]
    name_of, level_of = tr.name[o[:n]].tolist(), lv[:n].tolist()
    for i, (a, b) in enumerate(zip(s[:n].tolist(), e[:n].tolist())):
        ev.append({"ph": "X", "cat": "critical_path", "name": names[name_of[i]], "pid": 0, "tid": 0,
                   "ts": a, "dur": b - a, "args": {"level": LEVEL_NAMES[level_of[i]]}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"trace": path, "rank": rank, "spans": int(s.size), "spans_written": n}}


def _peer(res: DeepDiveResult, suspect: int, named: set[int]) -> int | None:
    """A healthy rank of the suspect's role: the one whose step time is the median among the unnamed."""
    roles = {}
    for o in res.outliers:
        for r in o.ranks:
            roles[r] = o.role
    role = roles.get(suspect)
    cands = [s for s in res.ranks if s.rank not in named and s.rank != suspect]
    same = [s for s in cands if roles.get(s.rank, role) == role] or cands
    if not same:
        return None
    same.sort(key=lambda s: (s.step_s or 0.0, s.rank))
    return same[len(same) // 2].rank


def analyze_dive(directory: str, *, cfg: LocalizeConfig = LocalizeConfig(),
                 manifest: dict | None = None) -> tuple[dict, DeepDiveResult | None]:
    """Step 2 for one dive: ``(analysis document, result)``; the document is written as ``analysis.json``.

    Raises nothing for a bad dive: the document then carries ``error`` (one line) and no result.
    """
    t0 = time.perf_counter()
    man = manifest if manifest is not None else read_manifest(directory)
    doc: dict[str, Any] = {"dive_id": os.path.basename(directory), "analysed_unix_ns": time.time_ns()}
    if man is None:
        doc["error"] = "no readable manifest.json"
        return doc, None
    doc.update({"dive_id": man.get("dive_id", doc["dive_id"]), "job": man.get("job", ""),
                "trigger": man.get("trigger", ""), "start_iteration": man.get("start_iteration", 0),
                "iterations": man.get("iterations", 0)})
    traces = dive_traces(directory, man)
    doc["ranks_analysed"] = sorted(traces)
    if man.get("objects_prefix"):
        doc["objects"] = man["objects_prefix"]
        if man.get("ranks_without_object"):
            doc["ranks_without_object"] = man["ranks_without_object"]
    if len(traces) < 2:
        doc["error"] = f"{len(traces)} rank(s) traced their window: at least 2 are needed to compare ranks"
        return doc, None
    try:
        res = localize_traces(traces, job_id=doc["job"], cfg=cfg)
    except BadInput as e:
        doc["error"] = str(e)
        return doc, None
    named = sorted({r for o in res.outliers if not (o.common or o.not_cause) for r, s in zip(o.ranks, o.slower) if s})
    doc.update({
        "analysis_s": round(res.analysis_s, 3), "first_iteration": res.first_iteration,
        "last_iteration": res.last_iteration, "warnings": list(res.warnings), "suspects": named,
        "ranks": {str(s.rank): {"trace": s.path, "step_s": s.step_s, "window_s": s.window_s,
                                "iterations": s.iterations, "level_share": dict(s.level_share),
                                "top": [{"function": f, "kind": k, "beta": b, "mu_s": m, "sigma_s": sd}
                                        for f, k, b, m, sd in s.top[:5]]} for s in res.ranks},
        "outliers": [{"function": o.function, "kind": o.kind, "role": o.role, "common": o.common,
                      "ranks": list(o.ranks), "slower": list(o.slower), "beta": list(o.beta),
                      "mu_s": list(o.mu), "impact_s": list(o.impact_s), "D": list(o.d), "Delta": list(o.delta),
                      "expected_beta": o.expected[0], "expected_mu_s": o.expected[1],
                      "launched_by": o.launched_by, "evidence": o.evidence, "not_cause": o.not_cause}
                     for o in res.outliers],
    })
    # the Perfetto view: the suspect (the first named, else the slowest rank) and a healthy peer of its role
    view: dict[str, Any] = {}
    if res.ranks:
        suspect = named[0] if named else max(res.ranks, key=lambda s: (s.step_s or 0.0, -s.rank)).rank
        peer = _peer(res, suspect, set(named))
        for label, r in (("suspect", suspect), ("peer", peer)):
            if r is None:
                continue
            entry = {"rank": r, "trace": traces[r]}
            cp_path = os.path.join(directory, f"rank-{r}.critical_path.json")
            try:
                write_private(cp_path, json.dumps(critical_path_trace(traces[r], r)))
                entry["critical_path"] = cp_path
            except (OSError, BadInput) as e:
                entry["critical_path_error"] = str(e)
            view[label] = entry
    doc["perfetto"] = view
    doc["analysis_s"] = round(time.perf_counter() - t0, 3)
    return doc, res


def merge_into(stored: records_pb2.Verdict, l4: records_pb2.Verdict) -> records_pb2.Verdict:
    """Step 3: the stored window verdict with the L4 verdict's suspects and findings added."""
    out = records_pb2.Verdict()
    out.CopyFrom(stored)
    have = {s.rank: s for s in out.ranks}
    for s in l4.ranks:
        if s.rank in have:
            mine = have[s.rank]
            mine.why = (mine.why + "; " if mine.why else "") + "deep dive (L4): " + s.why
            mine.evidence.update({"deep_dive": s.why})
        else:
            out.ranks.add().CopyFrom(s)
    out.findings.extend(l4.findings)
    out.kernels.extend(k for k in l4.kernels if k not in out.kernels)
    if l4.ranks and (out.state or HEALTHY) == HEALTHY:
        out.state = DEGRADED
        out.confidence = l4.confidence     # a healthy verdict's confidence says nothing about the L4 suspect
    if l4.ranks:
        kinds = set(filter(None, out.comparison.split("+"))) | set(filter(None, l4.comparison.split("+")))
        out.comparison = "+".join(sorted(kinds))
    out.summary = summarize(out.job_id, out, [], {})
    return out


def covering_verdict(store, job: str, iteration: int) -> records_pb2.Verdict | None:
    """The stored verdict of the job's iteration window that holds ``iteration``."""
    for v in reversed(store.verdicts(job)):
        w = v.window
        if w.kind == records_pb2.WINDOW_KIND_ITERATIONS and w.first_iteration <= iteration <= w.last_iteration:
            return v
    return None


def _diagnosis(f) -> records_pb2.Diagnosis:
    """A finding's record, its id told apart by the function: two functions out of line on one rank
    (a hot loop and the shorter collective it made the rank late to) share level, window, scope and
    suspects, and one would replace the other in the store."""
    import hashlib

    d = f.to_pb()
    d.id = hashlib.blake2b(f"{d.id}|{f.evidence.get('function', '')}".encode(), digest_size=8).hexdigest()
    return d


class DeepDiveFollower:
    """Steps 1-3 on a directory of deep dives, publishing into the analyzer's ``DiagnosisStore``."""

    def __init__(self, root: str, store, config: FollowerConfig = FollowerConfig(), *,
                 cfg: LocalizeConfig = LocalizeConfig(), clock: Callable[[], float] = time.monotonic,
                 url: str | None = None) -> None:
        self.root, self.store, self.config, self.cfg = root, store, config, cfg
        # with a URL the dives are read from object storage (every host's ranks), the files written under .objects
        self.objects = ObjectDives(url) if url else None
        self.work_root = objects_work_root(root) if url else root
        self._clock = clock
        self._waiting: dict[str, tuple[float, dict, list]] = {}   # dive dir -> (since, doc, findings)
        self.stats: dict[str, int] = {"analysed": 0, "failed": 0, "merged": 0, "unmerged": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ step 1
    def pending(self) -> list[str]:
        """Complete dives under the root without an analysis, oldest manifest first."""
        if self.objects is not None:
            return self._pending_objects()
        out = []
        try:
            jobs = sorted(os.scandir(self.root), key=lambda e: e.name)
        except OSError:
            return []
        for j in jobs:
            if not j.is_dir(follow_symlinks=False):
                continue
            try:
                dives = list(os.scandir(j.path))
            except OSError:
                continue
            for d in dives:
                if not d.is_dir(follow_symlinks=False) or d.path in self._waiting:
                    continue
                if os.path.exists(os.path.join(d.path, ANALYSIS)):
                    continue
                man = read_manifest(d.path)
                if man is not None and man.get("complete"):
                    out.append((man.get("requested_unix_ns", 0), d.path))
        return [p for _, p in sorted(out)]

    def _pending_objects(self) -> list[str]:
        """Step 1 on a bucket: each complete dive gets a local work directory (0700) holding its merged
        manifest (0600), which ``analyze_dive`` and ``query deep-dive`` read like a local dive's."""
        out = []

        def done(job_dir: str, dive: str) -> bool:   # analysed or being merged: its manifests are not read again
            work = os.path.join(self.work_root, job_dir, dive)
            return work in self._waiting or os.path.exists(os.path.join(work, ANALYSIS))

        for job_dir, dive, man in self.objects.dives(skip=done):
            work = os.path.join(self.work_root, job_dir, dive)
            if not man.get("complete"):
                continue
            try:
                for d in (self.work_root, os.path.dirname(work), work):
                    private_dir(d, "deep_dive.directory")
                write_private(os.path.join(work, MANIFEST), json.dumps(man, indent=1))
            except (OSError, TrainscopeError) as e:
                log.warning("deep dive %s: cannot write its work directory %s: %s", dive, work, e)
                continue
            out.append(work)
        return out

    # --------------------------------------------------------------- steps 2-3
    def scan(self) -> list[dict]:
        """One pass: analyse what completed, publish what can be; returns the analyses written."""
        done = []
        for directory in self.pending()[: self.config.max_per_scan]:
            doc, res = analyze_dive(directory, cfg=self.cfg)
            if res is None:
                self.stats["failed"] += 1
                log.warning("deep dive %s: not analysed: %s", directory, doc.get("error"))
                self._write(directory, doc)
                done.append(doc)
                continue
            self.stats["analysed"] += 1
            findings = res.to_findings()
            for f in findings:   # which iterations the dive covered: the window becomes the job's (step 3)
                f.evidence["deep_dive"] = {"dive_id": doc["dive_id"], "iterations": [
                    res.first_iteration, res.last_iteration], "directory": directory}
            self._waiting[directory] = (self._clock(), doc, findings)
        for directory in list(self._waiting):
            since, doc, findings = self._waiting[directory]
            if self._merge(doc, findings) or self._clock() - since >= self.config.verdict_wait_s:
                if "verdict" not in doc:
                    # stored alone, under the job's newest window (the store ages diagnoses out by window)
                    latest = self.store.latest_verdict(doc["job"])
                    w = latest.window if latest is not None else records_pb2.Window()
                    diagnoses = [_diagnosis(dataclasses.replace(f, window=w)) for f in findings]
                    self.store.put(diagnoses, None)
                    doc["diagnoses"] = [d.id for d in diagnoses]
                    doc["verdict"] = {"merged": False, "why": "no verdict of a window covering iteration "
                                      f"{doc.get('first_iteration')} within {self.config.verdict_wait_s:g} s"}
                    self.stats["unmerged"] += 1
                del self._waiting[directory]
                self._write(directory, doc)
                done.append(doc)
        return done

    def _merge(self, doc: dict, findings: list) -> bool:
        if not findings:
            doc["verdict"] = {"merged": False, "why": "no outlier: nothing to add to the verdict"}
            return True
        stored = covering_verdict(self.store, doc["job"], doc.get("first_iteration", -1))
        if stored is None:
            return False
        findings = [dataclasses.replace(f, window=stored.window) for f in findings]
        l4 = merge(doc["job"], stored.window, findings, {}, step_ns=max(f.step_ns for f in findings))
        out = merge_into(stored, l4)
        diagnoses = [_diagnosis(f) for f in findings]
        self.store.put(diagnoses, out)
        doc["diagnoses"] = [d.id for d in diagnoses]
        self.stats["merged"] += 1
        doc["verdict"] = {"merged": True, "window": int(stored.window.index), "summary": out.summary,
                          "ranks": [s.rank for s in l4.ranks]}
        return True

    def _write(self, directory: str, doc: dict) -> None:
        try:
            write_private(os.path.join(directory, ANALYSIS), json.dumps(doc, indent=1))
        except OSError as e:
            log.warning("deep dive %s: cannot write %s: %s", directory, ANALYSIS, e)

    # ------------------------------------------------------------------ thread
    def start(self) -> "DeepDiveFollower":
        self._thread = threading.Thread(target=self._loop, name="deep-dive-analysis", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.scan()
            except Exception:  # one bad dive must not stop the analysis of the next ones
                log.exception("deep-dive analysis scan failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None


__all__ = ["ANALYSIS", "DeepDiveFollower", "FollowerConfig", "ObjectDives", "analyze_dive", "covering_verdict",
           "critical_path_trace", "dive_traces", "merge_into", "objects_work_root", "read_manifest"]
