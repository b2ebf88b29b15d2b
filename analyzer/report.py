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
        "suspects": [{"rank": x.rank, "score": x.score, "role": x.role, "impact_s": x.impact_s,
                      "impact_pct": x.impact_pct, "evidence": MessageToDict(x.evidence)}
                     for x in d.suspects],
        "impact_s": d.impact_s, "impact_pct": d.impact_pct,
        "informational": d.informational, "comparison": d.comparison,
        "evidence": MessageToDict(d.evidence),
    }


def verdict_json(v: records_pb2.Verdict) -> dict:
    """One window's verdict; ``ranks[].score`` is the impact in seconds per iteration."""
    return {"window": [v.window.start_ns, v.window.end_ns], "window_index": v.window.index,
            "state": v.state, "confidence": v.confidence,
            "ranks": [{"rank": r.rank, "score": r.score, "role": r.role, "impact_s": r.impact_s,
                       "impact_pct": r.impact_pct, "host": r.host, "why": r.why,
                       "evidence": MessageToDict(r.evidence)} for r in v.ranks],
            "pending": list(v.pending), "phases": list(v.phases), "kernels": list(v.kernels),
            "summary": v.summary}


def contract_verdict_json(v: records_pb2.Verdict | None) -> dict:
    """A verdict in the replay contract's shape (ARCHITECTURE.md): what runbooks, tests and the report read."""
    if v is None:
        return {"state": "unknown", "confidence": 0.0, "suspects": [],
                "why": "no window of this job was analysed"}
    out = {"state": v.state or "healthy", "confidence": round(v.confidence, 3), "summary": v.summary,
           "comparison": v.comparison or "peers", "step_s": v.step_s,
           "window": [v.window.start_ns, v.window.end_ns], "window_index": v.window.index,
           "suspects": [{"rank": s.rank, "host": s.host, "role": s.role or "culprit",
                         "impact_s": s.impact_s, "impact_pct": round(s.impact_pct, 3), "why": s.why,
                         "waited_for": s.waited_for if s.waited_for >= 0 else None,
                         "evidence": MessageToDict(s.evidence)} for s in v.ranks]}
    if v.host:
        out["host"] = v.host
    if v.nic:
        out["nic"] = v.nic
    if v.switch_name:
        out["switch"] = v.switch_name
    if v.group:
        out["group"] = v.group
    if v.HasField("since_window"):
        out["since_window"] = v.since_window
    if v.pending:
        out["pending"] = list(v.pending)
    if v.partial:
        out["partial"] = True
    if v.phases:
        out["phases"] = list(v.phases)
    if v.kernels:
        out["kernels"] = list(v.kernels)
    return out


def report(store_path: str, job_id: str) -> dict:
    """The replay contract: the job's merged verdict, every diagnosis that names someone or
    explains something, and each window's verdict, oldest window first."""
    from trainscope.analyzer.merge import merge_windows

    store = DiagnosisStore(store_path)
    try:
        diags = [diagnosis_json(d) for d in store.diagnoses(job_id)]
        all_verdicts = list(store.verdicts(job_id))
    finally:
        store.close()
    return {"job": job_id, "verdict": contract_verdict_json(merge_windows(all_verdicts)),
            "diagnoses": diags,
            "verdicts": [verdict_json(v) for v in all_verdicts if v.ranks or v.findings]}
