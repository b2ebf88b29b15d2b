"""Verdicts on multi-rank jobs built from a real kernel stream (tests/support/realjob.py), through
`trainscope replay` (real gRPC, processor, analyzer).

The failure modes of the issue "Verdicts an on-call engineer can trust", on the real stream of
job16-rank0 with the measured noise (personality, spikes; docs/noise.md) and heterogeneous pipeline
stages: a healthy job names nobody anywhere; a late-onset slowdown is named with its onset; the
tensor-parallel partners that waited never outrank the rank they waited for; a slower host is named
as the host.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.realjob import SHARED, Fault, JobSpec, build_job
from trainscope.deploy.cli import main

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (SHARED / "job16-rank0.json.gz").exists(), reason="real traces not found")]


def replay(tmp_path: Path, spec: JobSpec) -> tuple[dict, dict]:
    job = tmp_path / "job"
    truth = build_job(job, spec)
    out = tmp_path / "diag.json"
    assert main(["replay", str(job), "--json", str(out), "--home", str(tmp_path / "h")]) == 0
    return json.loads(out.read_text()), truth


def test_a_healthy_heterogeneous_job_with_noisy_ranks_names_nobody(tmp_path):
    doc, _ = replay(tmp_path, JobSpec(ranks=16, tp=2, pp=2, steps=20, seed=3, noisy=(4, 11)))
    v = doc["verdict"]
    assert v["state"] == "healthy" and v["suspects"] == [], v["summary"]
    assert all(d["suspects"] == [] for d in doc["diagnoses"])
    assert all(w["ranks"] == [] for w in doc["verdicts"])


def test_a_late_onset_slowdown_is_named_with_its_onset(tmp_path):
    spec = JobSpec(ranks=16, tp=2, pp=2, steps=20, seed=4, faults=(Fault("compute", ranks=(6,), factor=1.3, start=10),))
    doc, _ = replay(tmp_path, spec)
    v = doc["verdict"]
    assert v["state"] == "degraded" and v["suspects"][0]["rank"] == 6, v["summary"]
    assert v["suspects"][0]["role"] == "culprit" and v["suspects"][0]["impact_pct"] > 1
    assert v["since_window"] >= 2          # windows of 5 steps: the slowdown began in window 2
    # nothing was named before it began
    assert all(w["ranks"] == [] for w in doc["verdicts"] if w["window_index"] < 2)


def test_waiting_partners_never_outrank_the_rank_they_waited_for(tmp_path):
    spec = JobSpec(ranks=16, tp=2, pp=1, steps=20, seed=5,
                   faults=(Fault("compute", ranks=(9,), factor=1.5, waiters=True),))
    doc, _ = replay(tmp_path, spec)
    v = doc["verdict"]
    ranks = [s["rank"] for s in v["suspects"]]
    assert ranks and ranks[0] == 9 and v["suspects"][0]["role"] == "culprit", v["summary"]
    for s in v["suspects"][1:]:
        assert s["role"] != "culprit" or s["impact_s"] <= v["suspects"][0]["impact_s"]
        if s["rank"] == 8:                                   # its tensor-parallel partner waited
            assert s["role"] == "waiter" and s["waited_for"] == 9


def test_a_slower_host_is_named_as_the_host(tmp_path):
    spec = JobSpec(ranks=32, tp=2, pp=1, steps=20, seed=6, ranks_per_host=8,
                   faults=(Fault("host", host=1, factor=1.3),))
    doc, truth = replay(tmp_path, spec)
    v = doc["verdict"]
    assert v["state"] == "degraded" and v.get("host") == "host1", v["summary"]
    on_host = set(truth["faults"][0]["ranks"])
    assert {s["rank"] for s in v["suspects"] if s["role"] in ("culprit", "link")} <= on_host


def test_a_host_holding_half_of_every_group_is_named(tmp_path):
    """16 ranks on two hosts of 8, TP groups of 2: host 1 holds half of the TP groups and half of
    every DP group, so no median of peers is healthy; the split of the sibling class names it."""
    spec = JobSpec(ranks=16, tp=2, pp=1, steps=20, seed=24, faults=(Fault("host", host=1, factor=1.2),))
    doc, truth = replay(tmp_path, spec)
    v = doc["verdict"]
    assert v["state"] == "degraded" and v.get("host") == "host1", v["summary"]
    assert {s["rank"] for s in v["suspects"]} <= set(truth["faults"][0]["ranks"])


def test_a_rank_hidden_by_a_noisy_peer_of_a_small_group_is_named_from_its_own_history(tmp_path):
    """DP groups of 4: rank 9's compute turns 1.2x from step 12 while the real stream's spikes make
    a peer noisy; its own history, confirmed by its peers now, names it, from the window it began."""
    spec = JobSpec(ranks=16, tp=2, pp=2, steps=20, seed=22, faults=(Fault("compute", ranks=(9,), factor=1.2, start=12),))
    doc, _ = replay(tmp_path, spec)
    v = doc["verdict"]
    assert v["state"] == "degraded" and v["suspects"][0]["rank"] == 9, v["summary"]
    assert v["since_window"] == 2
    assert all(w["ranks"] == [] for w in doc["verdicts"] if w["window_index"] < 2)


# Issue 10 item 4 on the real stream: rank 5 is 5 % slower on every compute kernel for the whole run,
# rank 2 has one 3x spike of the longest compute call of one step (step 7, window 1). Measured on
# seed 11 (job16-rank0): compute kernels are 16.8 % of the 241 ms step, so 5 % of compute is ~1.9 ms,
# 0.8 % of the step, under the 1 % impact floor; per window rank 5's compute sum is 1.8-5.6 % over its
# DP group's median (groups of 4) while healthy peers range 0.95-1.03x and rank 2's spike window is
# +4.4 %. L3's category sums and the consistent level do not separate it, so nobody is named.
WEAK_AND_SPIKE = JobSpec(ranks=16, tp=2, pp=2, steps=20, seed=11,
                         faults=(Fault("compute", ranks=(5,), factor=1.05), Fault("spike", ranks=(2,), factor=3.0, start=7)))


@pytest.fixture(scope="module")
def weak_and_spike(tmp_path_factory) -> tuple[dict, dict]:
    """One replay of WEAK_AND_SPIKE serves both tests about it."""
    return replay(tmp_path_factory.mktemp("weak_and_spike"), WEAK_AND_SPIKE)


def test_a_single_spike_is_never_named_beside_a_weak_consistent_slowdown(weak_and_spike):
    doc, truth = weak_and_spike
    assert [f["kind"] for f in truth["faults"]] == ["compute", "spike"]
    named = {s["rank"] for s in doc["verdict"]["suspects"]} | {r["rank"] for w in doc["verdicts"] for r in w["ranks"]}
    assert 2 not in named, doc["verdict"]["summary"]
    assert all(2 not in [s["rank"] for s in d["suspects"]] for d in doc["diagnoses"])


def test_a_single_spike_alone_names_nobody(tmp_path):
    """The control: the same job without the slow rank, the spike alone."""
    spec = JobSpec(**{**WEAK_AND_SPIKE.__dict__, "faults": WEAK_AND_SPIKE.faults[1:]})
    doc, _ = replay(tmp_path, spec)
    v = doc["verdict"]
    assert v["state"] == "healthy" and v["suspects"] == [], v["summary"]
    assert all(w["ranks"] == [] for w in doc["verdicts"])


@pytest.mark.xfail(strict=True, reason="5 % of compute is 0.8 % of this stream's step (under the 1 % impact "
                   "floor) and within the 4-rank groups' per-window spread (see the figures above): not caught")
def test_a_weak_consistent_slowdown_is_named_top_1_over_a_single_spike(weak_and_spike):
    doc, _ = weak_and_spike
    v = doc["verdict"]
    assert v["suspects"] and v["suspects"][0]["rank"] == 5 and v["suspects"][0]["role"] == "culprit", v["summary"]


def test_an_embedding_heavy_stream_names_nobody_when_healthy_and_the_slow_rank_when_not(tmp_path):
    """The diff-control stream (a recommendation model): its once-per-step embedding kernels are
    ~3 % of the step each and spike (docs/noise.md: 9.6 % of such calls > 1.2x). One spiked call
    named a healthy rank here before L3's one-call rule (step 5c); a rank 1.3x slower on every
    compute kernel is still named."""
    healthy = JobSpec(source="diff-control-rank3of8", ranks=8, tp=2, pp=1, steps=20, seed=0, noisy=(3,))
    doc, _ = replay(tmp_path / "healthy", healthy)
    assert doc["verdict"]["state"] == "healthy" and doc["verdict"]["suspects"] == [], doc["verdict"]["summary"]
    assert all(w["ranks"] == [] for w in doc["verdicts"])
    slow = JobSpec(source="diff-control-rank3of8", ranks=8, tp=2, pp=1, steps=20, seed=30,
                   faults=(Fault("compute", ranks=(6,), factor=1.3),))
    doc, _ = replay(tmp_path / "slow", slow)
    assert doc["verdict"]["suspects"][0]["rank"] == 6, doc["verdict"]["summary"]
