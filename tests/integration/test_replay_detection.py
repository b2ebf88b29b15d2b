"""The replay path on real kernel streams: one real rank's trace from
../shared/data/kineto/ resampled into a 16-rank job (per-rank lognormal noise
on every duration), one rank's compute kernels slowed. `trainscope replay
--json` must name that rank and compute kernels, and stay silent on the same
job without the slowdown."""
import json
from pathlib import Path

import numpy as np
import pytest

from trainscope.collector.sources.kineto_writer import write_kineto_trace
from trainscope.collector.sources.replay import load_rank_trace
from trainscope.deploy.cli import main
from trainscope.proto.columnar import KIND_KERNEL

pytestmark = pytest.mark.integration

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"
SOURCE = SHARED / "job16-rank0.json.gz"
RANKS, SLOW_RANK, FACTOR = 16, 11, 1.3


def is_compute(name: str) -> bool:
    return "nccl" not in name.lower()


def build_job(directory: Path, slow: bool) -> set[str]:
    """Write the 16-rank job; returns the names of the kernels that were slowed."""
    base = load_rank_trace(SOURCE)
    k = base.kernels
    compute = np.array([is_compute(k.names[i]) for i in k.name_id]) & (k.kind == KIND_KERNEL)
    directory.mkdir()
    for r in range(RANKS):
        rng = np.random.default_rng(r)
        dur = k.duration_ns * np.exp(rng.normal(0, 0.02, len(k)))
        if slow and r == SLOW_RANK:
            dur = np.where(compute, dur * FACTOR, dur)
        cols = type(k)(k.names, k.start_ns, np.maximum(1, dur).astype(np.uint64), k.name_id, k.stream, k.kind)
        write_kineto_trace(str(directory / f"rank-{r}.json.gz"), rank=r, world_size=RANKS, kernels=cols,
                           iterations=base.iterations)
    (directory / "topology.json").write_text(json.dumps({"world_size": RANKS}))
    return {k.names[i] for i in np.unique(k.name_id[compute])}


@pytest.mark.skipif(not SOURCE.exists(), reason=f"real trace not found: {SOURCE}")
def test_replay_names_the_slowed_rank_and_its_compute_kernels(tmp_path):
    slowed = build_job(tmp_path / "job", slow=True)
    out = tmp_path / "diag.json"
    assert main(["replay", str(tmp_path / "job"), "--json", str(out), "--home", str(tmp_path / "h")]) == 0
    report = json.loads(out.read_text())
    v = report["verdict"]                                        # the replay contract's merged verdict
    assert v["state"] == "degraded" and v["suspects"][0]["rank"] == SLOW_RANK
    assert v["suspects"][0]["role"] == "culprit" and v["suspects"][0]["impact_pct"] > 1.0
    assert [s["rank"] for s in v["suspects"]] == [SLOW_RANK]     # nobody else
    assert "since_window" in v and 0 < v["confidence"] <= 1
    l3 = [d for d in report["diagnoses"] if d["level"] == "L3" and d["suspects"]]
    assert l3, "kernel-level findings expected"
    assert all(d["suspects"][0]["rank"] == SLOW_RANK for d in l3)
    named = {d["scope"]["kernel"] for d in l3 if not d["scope"]["kernel"].startswith("[")}
    assert named and named <= slowed          # only slowed compute kernels are blamed
    assert {d["scope"]["kernel"] for d in l3 if d["scope"]["kernel"].startswith("[")} <= {"[compute]"}


@pytest.mark.skipif(not SOURCE.exists(), reason=f"real trace not found: {SOURCE}")
def test_replay_of_the_unmodified_job_is_silent(tmp_path):
    build_job(tmp_path / "job", slow=False)
    out = tmp_path / "diag.json"
    assert main(["replay", str(tmp_path / "job"), "--json", str(out), "--home", str(tmp_path / "h")]) == 0
    report = json.loads(out.read_text())
    assert report["verdict"]["state"] == "healthy" and report["verdict"]["suspects"] == []
    # a healthy job names nobody anywhere (informational findings may explain, never accuse)
    assert all(d["suspects"] == [] for d in report["diagnoses"])
    assert all(v["ranks"] == [] for v in report["verdicts"])
