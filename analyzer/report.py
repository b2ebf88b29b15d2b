"""Diagnoses as the replay contract's JSON (ARCHITECTURE.md "Replay contract")."""
from __future__ import annotations

from google.protobuf.json_format import MessageToDict

from trainscope.analyzer.store import DiagnosisStore
from trainscope.proto.v1 import records_pb2


def diagnosis_json(d: records_pb2.Diagnosis) -> dict:
    s = d.scope
    scope: dict = {}
    if s.phase:
        scope["phase"] = s.phase
    if s.kernel:
        scope["kernel"] = s.kernel
    if s.kernel or s.stream >= 0 and s.stream != 0:
        scope["stream"] = s.stream
    if s.group:
        scope["group"] = s.group
        scope["group_index"] = s.group_index
    return {
        "id": d.id, "level": d.level, "kind": d.kind,
        "window": [d.window.start_ns, d.window.end_ns],
        "window_index": d.window.index,
        "iterations": [d.window.first_iteration, d.window.last_iteration]
        if d.window.kind == records_pb2.WINDOW_KIND_ITERATIONS else None,
        "scope": scope,
        "severity": d.severity,
        "suspects": [{"rank": x.rank, "score": x.score, "evidence": MessageToDict(x.evidence)}
                     for x in d.suspects],
        "evidence": MessageToDict(d.evidence),
    }


def verdict_json(v: records_pb2.Verdict) -> dict:
    return {"window": [v.window.start_ns, v.window.end_ns], "window_index": v.window.index,
            "ranks": [{"rank": r.rank, "score": r.score, "evidence": MessageToDict(r.evidence)} for r in v.ranks],
            "phases": list(v.phases), "kernels": list(v.kernels), "summary": v.summary}


def report(store_path: str, job_id: str) -> dict:
    """Every diagnosis and verdict of one job, best-first suspects, oldest window first."""
    store = DiagnosisStore(store_path)
    try:
        diags = [diagnosis_json(d) for d in store.diagnoses(job_id)]
        verdicts = [verdict_json(v) for v in store.verdicts(job_id) if v.ranks or v.findings]
    finally:
        store.close()
    return {"job": job_id, "diagnoses": diags, "verdicts": verdicts}
