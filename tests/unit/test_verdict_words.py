"""The verdict's why leads with the class of evidence that explains the cost (issue #22 item 6)."""
from trainscope.analyzer.attribution import RankVerdict, evidence_of
from trainscope.analyzer.merge import _cause, merge
from trainscope.analyzer.model import CULPRIT, Finding, Scope, SuspectRank
from trainscope.analyzer.significance import Persistence
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

MS = 1e6
WIN = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=3, first_iteration=30, last_iteration=39)


def f(level, kind, rank, ratio, impact, *, kernel="", phase="", comm=None, comparison="peers", direction="slower"):
    ev = {} if comm is None else {"communication": comm}
    return Finding(level=level, kind=kind, job_id="j", window=WIN, scope=Scope(kernel=kernel, phase=phase),
                   evidence=ev, comparison=comparison,
                   suspects=(SuspectRank(rank, 1.0, {"ratio": ratio, "direction": direction}, impact_ns=impact),))


def rv_of(*findings):
    ev = [e for x in findings for e in evidence_of(x)]
    return RankVerdict(rank=5, role=CULPRIT, impact_ns=1.0, score_ns=1.0, evidence=ev)


def test_gpu_compute_leads_not_the_late_start_it_causes_nor_the_collective_it_was_late_to():
    rv = rv_of(f("collectives", "late_start", 5, 1.0, 40 * MS, phase="late start to allreduce (group 0, seq 91)",
                 comm=False),
               f("L3", "late_arrival", 5, 0.6, 30 * MS, kernel="ncclDevKernel_AllReduce", comm=True, direction="faster"),
               f("L3", "degraded_kernel", 5, 1.4, 20 * MS, kernel="sm90_xmma_gemm_bf16"),
               f("L3", "degraded_kernel", 5, 1.3, 10 * MS, kernel="flash_bwd_kernel"))
    assert _cause(rv, None) == "GPU compute 1.4x its peers: sm90_xmma_gemm_bf16, flash_bwd_kernel"


def test_host_classes_and_lateness_alone():
    assert _cause(rv_of(f("L2", "straggler", 5, 2.0, 30 * MS, phase="dataloader")), None) == \
        "host: data loader (dataloader) 2x its peers"
    assert _cause(rv_of(f("L3", "degraded_kernel", 5, 1.5, 9 * MS, kernel="aten::addmm")), None).startswith(
        "CPU operators 1.5x its peers: aten::addmm")
    late = rv_of(f("collectives", "late_start", 5, 1.0, 40 * MS, phase="late start to allreduce (group 0, seq 9)",
                   comm=False))
    assert _cause(late, None) == "late start: reached allreduce (group 0) after its peers"
    assert _cause(late, "train.py:63 hot_loop").endswith("(host busy in train.py:63 hot_loop)")
    assert _cause(rv_of(f("history", "individual_slowdown", 5, 1.3, 9 * MS, phase="forward",
                          comparison="own_history")), None) == "phase forward 1.3x its own recent pace"
    assert _cause(RankVerdict(rank=5, role=CULPRIT, impact_ns=1.0, score_ns=1.0), None) == ""


def test_the_verdict_line_starts_with_the_cause():
    res = {r: Resource(job_id="j", rank=r, world_size=16, host=f"h{r // 4}", coords=coords_for_rank(r, 16, tp=1))
           for r in range(16)}
    x = f("L3", "degraded_kernel", 5, 1.4, 40 * MS, kernel="sm90_xmma_gemm_bf16")
    v = merge("j", WIN, [x], res, step_ns=400 * MS, iterations={r: 10.0 for r in res}, persistence=Persistence(1, 1))
    assert v.ranks[0].why.startswith("GPU compute 1.4x its peers: sm90_xmma_gemm_bf16 — costs 40 ms/iteration")
