"""Link faults localised from the simulator's collective records, through the embedded pipeline.

Simulator (ring decomposition in its ``CollectiveBatch`` records) → real
exporters → gRPC → processor (collective windows, topic
``trainscope.collectives.v1``) → analyzer (``waiting_graph.py`` inside the
collectives level) → verdicts. A 32-rank job (TP=2, PP=2, DP=8 on four
8-GPU hosts), the measured noise model, fault from iteration 10 of 40:

* ``nic_degrade`` on host 1's NIC 0 (ranks 8 and 9): the verdict names those
  ranks with role ``link`` and host 1;
* ``nvlink_degrade`` on rank 13: the NVLink of the TP pair 12-13 on host 1
  (nothing in a 2-GPU ring tells its two ends apart);
* ``net_congestion`` on host 1 at factor 2, in bursts of 6 s every 30 s: each
  of host 1's ranks is under the impact floor alone; their host's network,
  priced by the iterations its links were slow in (``collectives.py`` step 8),
  is named;
* healthy: no verdict names anybody, no slow-link finding is active.

With step records (``collective_steps=True``) the same faults are named by the
provenance rating (``provenance.py``, Vedrfolnir §III-D) inside the
collectives level, with the steps they slowed.
"""
from __future__ import annotations

import pytest

from trainscope.collector.sim import sim_config
from trainscope.deploy.embedded import SimAnalysis, run_sim_embedded

pytestmark = pytest.mark.integration


PROVENANCE = "Vedrfolnir §III-D contributor rating (eqs. 1-3)"


def _run(tmp_path, fault: str | None, seed: int = 7, steps: bool = False):
    cfg = sim_config(ranks=32, tp=2, pp=2, iterations=40, seed=seed, faults=[fault] if fault else [],
                     job_id="links", home=str(tmp_path), window_iterations=10, collective_steps=steps)
    a = SimAnalysis()
    run_sim_embedded(cfg, **a.hooks())
    return sorted(a.verdicts, key=lambda v: v.window.index)


def _slow_links(verdicts):
    return [d for v in verdicts for d in v.findings if d.kind == "slow_link" and not d.informational]


def test_degraded_nic_names_its_ranks_and_host(tmp_path):
    verdicts = _run(tmp_path, "nic_degrade:nic=1:0,onset=10it,factor=2")
    named = [v for v in verdicts if v.ranks]
    assert named, [v.summary for v in verdicts]
    last = named[-1]
    assert last.ranks[0].rank in (8, 9) and last.ranks[0].role == "link", last.summary
    assert last.host == "sim-host-0001", last.summary
    found = _slow_links(verdicts)
    assert {s.rank for d in found for s in d.suspects} == {8, 9}
    assert all(s.evidence["hardware"] == "NIC" for d in found for s in d.suspects)
    assert all(v.window.index >= 1 for v in named)      # nobody before the onset window
    # onset in window 1, named from window 2 (persistence): the collective windows close at the
    # simulator's barrier, so window 1 is judged on its own collectives (on the processor's clock: 3)
    assert named[0].window.index == 2, [(v.window.index, v.summary) for v in verdicts]
    assert {r.rank for r in named[0].ranks[:2]} == {8, 9}, named[0].summary


def test_degraded_nvlink_names_the_pair_on_its_host(tmp_path):
    verdicts = _run(tmp_path, "nvlink_degrade:rank=13,onset=10it,factor=3")
    found = _slow_links(verdicts)
    assert {s.rank for d in found for s in d.suspects} == {12, 13}
    assert all(s.evidence["hardware"] == "NVLink" for d in found for s in d.suspects)
    named = [v for v in verdicts if v.ranks]
    assert named and {r.rank for r in named[-1].ranks[:2]} == {12, 13}, named[-1].summary
    assert named[-1].host == "sim-host-0001"


def test_bursty_congestion_names_the_host(tmp_path):
    verdicts = _run(tmp_path, "net_congestion:host=1,onset=30s,factor=2")
    named = [v for v in verdicts if v.ranks]
    assert named, [v.summary for v in verdicts]
    assert all(v.window.index >= 1 for v in named)      # nobody before the onset window
    assert all(v.host == "sim-host-0001" for v in named), [v.summary for v in named]
    assert all(8 <= r.rank < 16 and r.role == "link" for v in named for r in v.ranks), [v.summary for v in named]
    hw = lambda d: d.evidence["hardware"] if "hardware" in d.evidence else ""    # noqa: E731
    hosts = [d for d in _slow_links(verdicts) if hw(d) == "host network"]
    assert hosts and all(d.evidence["host"] == "sim-host-0001" for d in hosts)
    # each window's finding costs more than the floor, none of its ranks' findings did alone
    assert all(d.impact_pct >= 1.0 for d in hosts)
    per_rank = [d for v in named for d in v.findings
                if d.kind == "slow_link" and hw(d) != "host network"]
    assert per_rank and all(d.informational for d in per_rank)


def test_healthy_run_names_nobody(tmp_path):
    verdicts = _run(tmp_path, None, seed=100)
    assert verdicts
    assert not any(v.ranks for v in verdicts), [v.summary for v in verdicts if v.ranks]
    assert not _slow_links(verdicts)


def test_step_records_name_the_nic_by_provenance(tmp_path):
    """(A healthy job with step records names nobody: tests/unit/test_collectives_steps.py.)"""
    verdicts = _run(tmp_path, "nic_degrade:nic=1:0,onset=10it,factor=2", steps=True)
    found = _slow_links(verdicts)
    assert found and all(d.evidence["rule"] == PROVENANCE for d in found), [d.evidence for d in found]
    assert {s.rank for d in found for s in d.suspects} == {8, 9}
    assert all(s.evidence["hardware"] == "NIC" and s.evidence["steps"] for d in found for s in d.suspects)
    named = [v for v in verdicts if v.ranks]
    assert named and {r.rank for r in named[-1].ranks[:2]} == {8, 9}, named[-1].summary
    assert named[-1].ranks[0].role == "link" and named[-1].host == "sim-host-0001"
    assert all(v.window.index >= 1 for v in named)
