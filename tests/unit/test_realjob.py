"""The builder of multi-rank replay jobs from a real kernel stream (tests/support/realjob.py).

Each fault is checked against the same job built without it (same seed, so the same noise draws):
the slowed kernels change by exactly the factor on the intended ranks and steps, nothing else does.
The healthy job keeps the real stream's per-call spread (docs/noise.md).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from support.noise_stats import call_sites, site_stats
from support.realjob import ROUTING, SHARED, Fault, JobSpec, build_job, main, parse_fault
from trainscope.collector.sources.replay import load_rank_trace
from trainscope.proto.columnar import KIND_KERNEL

pytestmark = pytest.mark.skipif(not (SHARED / "job16-rank0.json.gz").exists(), reason="real traces not found")

SPEC = JobSpec(ranks=8, tp=2, pp=2, steps=8, ranks_per_host=4, seed=7)


def columns(job, rank):
    """Durations, category (0 compute kernel, 1 copy, 2 collective) and step index of every kernel."""
    t = load_rank_trace(job / f"rank-{rank}.json.gz")
    k = t.kernels
    order = np.argsort(k.start_ns, kind="stable")
    cat = np.array([ROUTING.category(n) for n in k.names])[k.name_id[order]]
    cat = np.where((cat == 0) & (k.kind[order] != KIND_KERNEL), -1, cat)
    starts = np.array(sorted(m.start_ns for m in t.iterations))
    step = np.searchsorted(starts, k.start_ns[order], side="right") - 1
    return k.duration_ns[order].astype(np.float64), cat, step


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    job = tmp_path_factory.mktemp("realjob") / "healthy"
    return job, build_job(job, SPEC)


def build(tmp_path, *faults):
    job = tmp_path / "faulty"
    spec = JobSpec(**{**SPEC.__dict__, "faults": tuple(faults)})
    return job, build_job(job, spec)


def ratio(healthy_job, job, rank):
    d0, cat, step = columns(healthy_job, rank)
    d1, _, _ = columns(job, rank)
    assert d0.size == d1.size
    return d1 / d0, cat, step


def test_topology_counts_and_truth(healthy):
    job, truth = healthy
    assert sorted(p.name for p in job.iterdir()) == sorted(
        [f"rank-{r}.json.gz" for r in range(8)] + ["topology.json", "truth.json"])
    topo = json.loads((job / "topology.json").read_text())
    assert (topo["world_size"], topo["tp"], topo["pp"], topo["ranks_per_host"]) == (8, 2, 2, 4)
    assert truth["dp"] == 2 and truth["faults"] == []
    sizes = set()
    for r in range(8):
        t = load_rank_trace(job / f"rank-{r}.json.gz")
        assert t.rank == r and t.world_size == 8 and len(t.iterations) == SPEC.steps
        sizes.add(len(t.kernels))
    assert len(sizes) == 1                # every rank runs the same real steps


def test_pipeline_stages_are_heterogeneous(healthy):
    """Stage 1 (last) runs compute 1.15 x 1.2 = 1.38x stage 0 (personality and spikes aside)."""
    job, _ = healthy
    d0, cat, _ = columns(job, 0)          # tp-cp-ep-dp-pp order: ranks 0-3 stage 0, 4-7 stage 1
    d4, _, _ = columns(job, 4)
    assert np.median(d4[cat == 0] / d0[cat == 0]) == pytest.approx(1.38, rel=0.03)
    assert np.median(d4[cat == 1] / d0[cat == 1]) == pytest.approx(1.0, abs=0.03)


def test_healthy_job_keeps_the_real_per_call_spread(healthy):
    """The real stream's calls > 1.2x / > 1.5x their site's median, plus at most the model's spikes
    (4 % of calls, most of them > 1.2x): docs/noise.md."""
    job, _ = healthy
    real = site_stats(*call_sites(load_rank_trace(SHARED / "job16-rank0.json.gz")))["all_sites"]
    built = site_stats(*call_sites(load_rank_trace(job / "rank-1.json.gz")))["all_sites"]
    for key in ("over_1_2", "over_1_5"):
        assert real[key] * 0.8 <= built[key] <= real[key] + 2 * SPEC.spike_prob, (key, real, built)
    assert built["under_0_8"] == pytest.approx(real["under_0_8"], abs=0.03)


def test_late_onset_compute_fault_on_its_rank_and_steps_only(healthy, tmp_path):
    job, truth = build(tmp_path, Fault("compute", ranks=(3,), factor=1.5, start=5))
    assert truth["faults"] == [{"kind": "compute", "ranks": [3], "first_step": 5, "hosts": ["host0"]}]
    r, cat, step = ratio(healthy[0], job, 3)
    hit = (cat == 0) & (step >= 5)
    np.testing.assert_allclose(r[hit], 1.5, rtol=2e-3)
    np.testing.assert_allclose(r[~hit], 1.0, rtol=2e-3)
    for other in (2, 7):
        np.testing.assert_allclose(ratio(healthy[0], job, other)[0], 1.0, rtol=2e-3)


def test_copies_fault_slows_memcpy_and_memset_only(healthy, tmp_path):
    job, _ = build(tmp_path, Fault("copies", ranks=(1,), factor=3.0))
    r, cat, _ = ratio(healthy[0], job, 1)
    assert (cat == 1).any()
    np.testing.assert_allclose(r[cat == 1], 3.0, rtol=2e-3)
    np.testing.assert_allclose(r[cat != 1], 1.0, rtol=2e-3)


def test_intermittent_fault_alternates(healthy, tmp_path):
    job, _ = build(tmp_path, Fault("compute", ranks=(0,), factor=1.4, every=2))
    r, cat, step = ratio(healthy[0], job, 0)
    for s in range(SPEC.steps):
        want = 1.4 if (s // 2) % 2 == 0 else 1.0
        np.testing.assert_allclose(r[(cat == 0) & (step == s)], want, rtol=2e-3)


def test_tp_partner_absorbs_the_culprits_delay_in_its_collectives(healthy, tmp_path):
    """ARGUS §9.5: the partner waits in its collectives; the culprit's collectives are the shortest."""
    job, _ = build(tmp_path, Fault("compute", ranks=(2,), factor=1.5, waiters=True))
    culprit, cat, _ = ratio(healthy[0], job, 2)
    partner, pcat, _ = ratio(healthy[0], job, 3)          # same TP group (tp=2)
    assert (pcat == 2).any()
    assert np.all(partner[pcat == 2] > 1.0) and np.allclose(partner[pcat != 2], 1.0, rtol=2e-3)
    np.testing.assert_allclose(culprit[cat == 2], 1.0, rtol=2e-3)
    d3, _, _ = columns(job, 3)
    d2, _, _ = columns(job, 2)
    assert d2[cat == 2].sum() < d3[pcat == 2].sum()
    np.testing.assert_allclose(ratio(healthy[0], job, 1)[0], 1.0, rtol=2e-3)   # another TP group


def test_host_fault_slows_every_rank_of_that_host(healthy, tmp_path):
    job, truth = build(tmp_path, Fault("host", host=1, factor=1.2))
    assert truth["faults"][0]["ranks"] == [4, 5, 6, 7] and truth["faults"][0]["hosts"] == ["host1"]
    for rank in range(8):
        r, cat, _ = ratio(healthy[0], job, rank)
        np.testing.assert_allclose(r[cat == 0], 1.2 if rank >= 4 else 1.0, rtol=2e-3)


def test_parse_fault_and_cli_wrong_input(tmp_path, capsys):
    assert parse_fault("compute:rank=5+9,factor=1.3,from=20,every=5,waiters") == Fault(
        "compute", ranks=(5, 9), factor=1.3, start=20, every=5, waiters=True)
    assert main([str(tmp_path / "x"), "--fault", "compute:speed=2"]) == 2
    assert "unknown fault field" in capsys.readouterr().err
    (tmp_path / "there").mkdir()
    assert main([str(tmp_path / "there"), "--ranks", "2", "--tp", "1"]) == 2     # never overwrites


def test_dataloader_stall_delays_that_ranks_steps(tmp_path):
    """Every rank carries a dataloader phase at the start of each step; the stalled rank's is
    delay_ms longer from its first faulty step on, and its kernels start after it."""
    spec = JobSpec(**{**SPEC.__dict__, "faults": (Fault("dataloader", ranks=(5,), delay_ms=15.0, start=3),)})
    truth = build_job(tmp_path / "job", spec)
    assert truth["faults"][0]["phase"] == "dataloader" and truth["faults"][0]["first_step"] == 3
    for rank in range(8):
        t = load_rank_trace(tmp_path / "job" / f"rank-{rank}.json.gz")
        loader = sorted((p for p in t.phases if p.name == "dataloader"), key=lambda p: p.start_ns)
        assert len(loader) == SPEC.steps
        ms = np.array([p.duration_ns for p in loader]) / 1e6
        stalled = (np.arange(SPEC.steps) >= 3) & (rank == 5)
        assert np.all(ms[stalled] > 15.0) and np.all(ms[~stalled] < 1.0), (rank, ms)
        first = np.array([t.kernels.start_ns[(t.kernels.start_ns >= m.start_ns) & (t.kernels.start_ns < m.end_ns)].min()
                          for m in sorted(t.iterations, key=lambda m: m.start_ns)])
        assert np.all(first >= np.array([p.start_ns + p.duration_ns for p in loader]))


def test_unknown_fault_kind_is_refused():
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_fault("slow:rank=1")


def test_spike_fault_slows_one_kernel_call_of_one_step(healthy, tmp_path):
    """``spike``: the step's longest compute call on that rank, in that step only, × factor."""
    job, truth = build(tmp_path, Fault("spike", ranks=(6,), factor=3.0, start=4))
    assert truth["faults"][0]["first_step"] == 4
    r, cat, step = ratio(healthy[0], job, 6)
    d0, _, _ = columns(healthy[0], 6)
    hit = np.flatnonzero(~np.isclose(r, 1.0, rtol=2e-3))
    assert hit.size == 1 and step[hit[0]] == 4 and cat[hit[0]] == 0
    assert r[hit[0]] == pytest.approx(3.0, rel=2e-3)
    assert d0[hit[0]] == d0[(cat == 0) & (step == 4)].max()
    np.testing.assert_allclose(ratio(healthy[0], job, 7)[0], 1.0, rtol=2e-3)
