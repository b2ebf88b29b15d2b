"""``trainscope demo``: the main job on the embedded default, no broker or server.

Simulates a small hybrid-parallel job (TP=2, PP=2, DP=8: 32 ranks on 4 hosts)
with one GPU throttled part-way through, streams its telemetry through the
real path (collector exporters → gRPC → processor → embedded bus → analyzer,
plus the SQLite store and Perfetto traces), prints the verdict, scores it
against the simulator's ground truth, and says where everything was written.
"""
from __future__ import annotations

import os
from typing import TextIO

from trainscope.analyzer.evaluate import evaluate, load_truth
from trainscope.collector.sim import sim_config
from trainscope.deploy.embedded import SimAnalysis, run_sim_embedded
from trainscope.deploy.render import render_evaluation, render_verdicts
from trainscope.proto.errors import ConfigError

FAULT = "gpu_throttle:rank={rank},onset=30s,factor=1.4"
#: The smallest world: TP=2 x PP=2 x DP=2, so the throttled rank has data-parallel peers to be compared with.
MIN_RANKS = 8


def check_ranks(ranks: int) -> int:
    """``--ranks``, or a one-line ConfigError naming the minimum (checked before the home is made)."""
    if ranks < MIN_RANKS or ranks % 4:
        raise ConfigError("--ranks", ranks, f"must be a multiple of 4 (TP=2 x PP=2), at least {MIN_RANKS} "
                                            "so the throttled rank has data-parallel peers")
    return ranks


def demo_fault(ranks: int) -> str:
    """The demo's fault: rank 13 of the default 32, a rank inside any smaller world."""
    return FAULT.format(rank=13 % ranks)


def run_demo(home: str, ranks: int = 32, out: TextIO | None = None, fault: str | None = None,
             replace_store: bool = False) -> int:
    from trainscope.processor.perfetto_sink import PerfettoConfig

    fault = fault or demo_fault(check_ranks(ranks))
    def say(s: str = "") -> None:
        if out is not None:
            print(s, file=out, flush=True)

    traces = os.path.join(home, "perfetto")
    cfg = sim_config(ranks=ranks, tp=2, pp=2, iterations=40, faults=[fault], job_id="demo",
                     home=home, window_iterations=10)
    say(f"demo: writing to {home} (store.sqlite, perfetto/, sim-ground-truth.json)")
    say(f"demo: simulating job 'demo' ({ranks} ranks, tp=2 pp=2, 40 iterations) with {fault}")
    analysis = SimAnalysis()
    res = run_sim_embedded(cfg, processor_options={"perfetto": PerfettoConfig(url=traces, max_pending_windows=1024),
                                          "replace_store": replace_store},
                  **analysis.hooks())
    say(f"streamed {res.kernel_events:,} kernel events, {res.phase_events:,} phases, "
        f"{res.iteration_events:,} iteration marks, {res.stack_snapshots:,} stack snapshots "
        f"through gRPC → processor → analyzer in {res.wall_s:.1f} s"
        + (f" ({res.dropped} dropped)" if res.dropped else ""))
    verdicts = analysis.verdicts
    say(render_verdicts(verdicts))
    say(render_evaluation(evaluate(verdicts, load_truth(res.ground_truth_path), cfg.window_iterations)))
    say(f"\nstore (records, diagnoses, verdicts): {res.store_path}")
    say(f"perfetto traces: {traces}")
    say(f"ground truth: {res.ground_truth_path}")
    say(f"next: trainscope query verdict --home {home}")
    return 0 if not res.dropped else 1
