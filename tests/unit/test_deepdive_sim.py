"""L4 deep dive on jobs replayed from the simulator's Kineto traces (``rank-<N>.json.gz``, the replay
contract's layout, written by ``collector/sim``'s KinetoSink in this process: no processor, no
subprocess). Unlike jobs built from one real trace, these ranks are coupled: a slow rank makes its
peers wait in their collectives, and every rank has its own GPU personality (3 %, docs/noise.md).
The traces hold kernels only (no host events), as a GPU-only profile would.
"""
from __future__ import annotations

import pytest

from trainscope.analyzer.deepdive import TraceError, localize_traces, trace_paths
from trainscope.analyzer.deepdive.patterns import IDLE
from trainscope.analyzer.merge import merge
from trainscope.collector.sim import SimConfig, parse_fault, run_sim


def _job(tmp_path_factory, name: str, fault: str | None, seed: int = 0) -> dict[int, str]:
    d = tmp_path_factory.mktemp(name)
    run_sim(SimConfig(ranks=8, iterations=12, seed=seed, traces_out=str(d), home=str(d),
                      faults=(parse_fault(fault),) if fault else ()))
    return trace_paths(d)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _job(tmp_path_factory, "healthy", None)


def _verdict(res):
    fs = res.to_findings()
    return merge("sim", fs[0].window, fs, step_ns=fs[0].step_ns) if fs else None


def test_healthy_simulated_job_has_no_outlier(healthy):
    assert sorted(healthy) == list(range(8))
    res = localize_traces(healthy, job_id="sim")
    assert res.outliers == (), [o.evidence for o in res.outliers]
    assert _verdict(res) is None


def test_throttled_gpu_is_named_and_its_peers_are_not(tmp_path_factory):
    res = localize_traces(_job(tmp_path_factory, "throttle", "gpu_throttle:rank=5,factor=1.3"), job_id="sim")
    assert res.outliers and res.outliers[0].kind == "compute" and res.outliers[0].ranks == (5,)
    slower = {r for o in res.outliers for r, s in zip(o.ranks, o.slower) if s}
    assert slower == {5}, [o.evidence for o in res.outliers]
    v = _verdict(res)
    assert v.state == "degraded" and [s.rank for s in v.ranks if s.role == "culprit"] == [5]


def test_a_stall_with_no_traced_function_is_named_as_idle_time(tmp_path_factory):
    """A data-loader stall in a kernels-only trace: the GPU idles and nothing traced runs; the idle
    pseudo-function is where it shows, on the stalled rank only."""
    res = localize_traces(_job(tmp_path_factory, "stall", "dataloader_stall:rank=6"), job_id="sim")
    assert res.outliers and res.outliers[0].function == IDLE and res.outliers[0].ranks == (6,)
    v = _verdict(res)
    assert [s.rank for s in v.ranks if s.role == "culprit"] == [6]


def test_trace_paths_errors(tmp_path):
    with pytest.raises(TraceError, match="no rank-<N>.json"):
        trace_paths(tmp_path)
    with pytest.raises(TraceError, match="cannot list"):
        trace_paths(tmp_path / "nope")
