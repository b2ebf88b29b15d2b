"""``trainscope sim`` end to end: the CLI, ``--processor``, and ``--traces-out`` → ``trainscope replay``."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from support.pipeline import bus_records, start_processor
from support.sim_homes import sim_home
from trainscope.collector.sim import MemorySink, SimConfig, parse_fault, run_sim
from trainscope.deploy.embedded import run_sim_embedded
from trainscope.deploy.cli import main
from trainscope.deploy.replay import kernel_stats_json
from trainscope.processor.windows import WindowConfig

pytestmark = pytest.mark.integration

ARGS = ["--ranks", "16", "--tp", "2", "--pp", "2", "--ep", "2", "--layers", "1", "--micro-batches", "2",
        "--iterations", "6", "--seed", "7", "--job-id", "simreplay"]
FAULT = "gpu_throttle:rank=3,onset=2it,factor=1.5"


def counts_from_stats(stats: dict) -> dict:
    out: collections.Counter = collections.Counter()
    for row in stats["kernel_stats"]:
        out[(row["rank"], row["kernel"], row["stream"])] += row["count"]
    return dict(out)


def test_traces_out_replays_with_matching_counts(tmp_path, capsys):
    traces, home = tmp_path / "traces", tmp_path / "home"
    assert main(["sim", *ARGS, "--fault", FAULT, "--traces-out", str(traces), "--home", str(home)]) == 0
    out = capsys.readouterr().out
    assert "nothing dropped" in out and "ground truth:" in out
    assert sorted(p.name for p in traces.iterdir()) == sorted([f"rank-{r}.json.gz" for r in range(16)]
                                                               + ["topology.json"])
    topo = json.loads((traces / "topology.json").read_text())
    assert topo == {"world_size": 16, "tp": 2, "pp": 2, "ep": 2, "cp": 1, "order": "tp-cp-ep-dp-pp"}

    # what the simulator generated, per (rank, kernel, stream)
    cfg = SimConfig(ranks=16, tp=2, pp=2, ep=2, layers=1, micro_batches=2, iterations=6, seed=7, noise=None,
                    job_id="simreplay", faults=(parse_fault(FAULT),), home=sim_home())
    mem = MemorySink()
    run_sim(cfg, sinks=[mem])
    generated: collections.Counter = collections.Counter()
    for r in range(16):
        k = mem.kernels(r)
        for nid, st in zip(k.name_id.tolist(), k.stream.tolist()):
            generated[(r, k.names[nid], st)] += 1

    # what the sim's own embedded processor summarised ...
    live = counts_from_stats(kernel_stats_json(str(home / "store.sqlite"), "simreplay"))
    assert live == dict(generated)
    # ... and what `trainscope replay` of the written traces summarises
    stats_out = tmp_path / "replayed.json"
    assert main(["replay", str(traces), "--stats-out", str(stats_out), "--home", str(tmp_path / "rhome")]) == 0
    replayed = counts_from_stats(json.loads(stats_out.read_text()))
    assert replayed == dict(generated)
    assert "16 ranks" in capsys.readouterr().out

    gt = json.loads((home / "sim-ground-truth.json").read_text())
    assert gt["faults"][0]["ranks"] == [3] and gt["faults"][0]["onset_iteration"] == 2
    assert gt["iterations"]["count"] == 6


def test_cli_against_a_given_processor(tmp_path, capsys):
    proc = start_processor(window=WindowConfig(mode="iterations", iterations=3, idle_close_s=3600))
    try:
        summary = tmp_path / "run.json"
        scenario = tmp_path / "scenario.json"
        scenario.write_text(json.dumps({"faults": [{"type": "pcie_degrade", "rank": 9, "factor": 3}]}))
        rc = main(["sim", *ARGS, "--fault", FAULT, "--scenario", str(scenario), "--processor", proc.address,
                   "--home", str(tmp_path), "--json", str(summary)])
        assert rc == 0
        gt = json.loads((tmp_path / "sim-ground-truth.json").read_text())
        assert [f["type"] for f in gt["faults"]] == ["gpu_throttle", "pcie_degrade"]
        assert proc.drain(30.0)
        res = json.loads(summary.read_text())
        kws = bus_records(proc, "kernels")
        assert sum(kw.events for kw in kws) == res["kernel_events"] > 0
        assert {kw.resource.rank for kw in kws} == set(range(16))
        assert res["dropped"] == 0 and res["processor_address"] == proc.address
        # the throttled rank's GEMMs are 1.5x its DP peer's after onset (window 1 = iterations 3-5), give
        # or take the simulator's measured noise (3 % per-rank personality, spikes: docs/noise.md)
        mean = {}
        for kw in kws:
            if kw.window.index == 1 and kw.resource.rank in (3, 7):
                ks = [k for k in kw.kernels if k.kernel.startswith("sm90") and k.stream == 7]
                mean[kw.resource.rank] = sum(k.total_ns for k in ks) / sum(k.count for k in ks)
        assert mean[3] / mean[7] == pytest.approx(1.5, rel=0.08)
        assert f"sent to {proc.address}" in capsys.readouterr().out
    finally:
        proc.stop()


def test_embedded_processor_with_time_windows(tmp_path):
    """The default (embedded) destination also works with windows cut on each rank's own clock."""
    seen = {}

    def grab(proc):
        seen["iterations"] = bus_records(proc, "iterations")
        seen["kernels"] = bus_records(proc, "kernels")

    cfg = SimConfig(ranks=16, tp=2, pp=2, layers=1, micro_batches=2, iterations=8, iteration_s=2.0,
                    window_mode="time", window_length_s=5.0, home=str(tmp_path))
    res = run_sim_embedded(cfg, on_processor=grab)
    assert res.store_path and res.dropped == 0
    assert sum(kw.events for kw in seen["kernels"]) == res.kernel_events
    marks = [m for iw in seen["iterations"] for m in iw.marks]
    assert len(marks) == 16 * 8
    # time windows are aligned on each host's own clock: window indices differ across hosts
    idx = collections.defaultdict(set)
    for iw in seen["iterations"]:
        idx[iw.resource.host].add(iw.window.index)
    assert len(idx) == 2 and all(len(v) >= 3 for v in idx.values())
    assert np.all(np.diff(sorted(m.start_ns for m in marks if m.iteration == 0)) >= 0)
