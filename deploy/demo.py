"""``trainscope demo``: the main job on the embedded default, no broker or server.

Generates a small multi-rank job (synthetic multimodal kernel streams with
iterations and phases, one rank's compute kernels made slower), writes it as
PyTorch-profiler traces, and replays it through the real pipeline (exporters →
gRPC → processor → embedded bus + SQLite store + Perfetto traces). Prints what
was summarised and where it went.
"""
from __future__ import annotations

import json
import os
from typing import TextIO

from trainscope.collector.sources.kineto_writer import write_kineto_trace
from trainscope.collector.sources.synthetic import SyntheticSpec, synthesize
from trainscope.deploy.replay import kernel_stats_json, run_replay, write_json

SLOW_RANK = 5


def make_demo_job(directory: str, ranks: int = 8, iterations: int = 20, slow_rank: int = SLOW_RANK) -> str:
    """Write ``rank-<N>.json.gz`` for ``ranks`` ranks plus ``topology.json`` (pure DP)."""
    os.makedirs(directory, exist_ok=True)
    keys, modes = 12, 3
    for r in range(ranks):
        spec = SyntheticSpec(
            n_events=iterations * keys * modes, n_keys=keys, modes_per_key=modes, seed=1000, noise_seed=r,
            start_ns=1_700_000_000_000_000_000 + r * 7_919_000,  # unrelated clocks per rank
            slow_factor=1.5 if r == slow_rank else 1.0, slow_keys=(0, 1, 2),
        )
        t = synthesize(spec)
        write_kineto_trace(os.path.join(directory, f"rank-{r}.json.gz"), rank=r, world_size=ranks,
                           kernels=t.kernels, iterations=t.iterations, phases=t.phases)
    with open(os.path.join(directory, "topology.json"), "w") as f:
        json.dump({"world_size": ranks, "tp": 1, "pp": 1, "ep": 1, "cp": 1, "order": "tp-cp-ep-dp-pp"}, f)
    return directory


def run_demo(home: str, ranks: int = 8, out: TextIO | None = None) -> int:
    from trainscope.processor.perfetto_sink import PerfettoConfig

    def say(s: str = "") -> None:
        if out is not None:
            print(s, file=out, flush=True)

    job_dir = make_demo_job(os.path.join(home, "demo-job"), ranks=ranks)
    traces = os.path.join(home, "perfetto")
    say(f"demo job: {ranks} ranks written to {job_dir} (rank {SLOW_RANK} has slower compute kernels)")
    res = run_replay(job_dir, home=home, window_iterations=10, perfetto=PerfettoConfig(url=traces))
    stats = kernel_stats_json(res.store_path, res.job_id)
    stats_path = os.path.join(home, "kernel-stats.json")
    write_json(stats, stats_path)
    total = sum(res.kernel_events_sent.values())
    rows = stats["kernel_stats"]
    clusters = sum(len(s["clusters"]) for s in rows)
    say(f"replayed {total:,} kernel events through gRPC → processor in {res.seconds:.2f} s")
    say(f"summarised into {len(rows):,} (kernel, stream, rank, window) keys with {clusters:,} "
        f"(count, p50, p99) clusters")
    # The same key on every rank: the slow rank's p50 stands out.
    key = rows[0]["kernel"], rows[0]["stream"], rows[0]["window"]["index"]
    say(f"\n{key[0]!r} on stream {key[1]}, window {key[2]}: clusters per rank (p50 µs)")
    for s in sorted((s for s in rows if (s["kernel"], s["stream"], s["window"]["index"]) == key),
                    key=lambda s: s["rank"]):
        p50s = ", ".join(f"{c['p50_ns'] / 1e3:.1f}×{c['count']}" for c in s["clusters"])
        say(f"  rank {s['rank']:>3}: {p50s}")
    m = res.processor
    say(f"\nprocessor: {int(sum(v for k, v in m.items() if k.startswith('events_in'))):,} records in, "
        f"{int(sum(v for k, v in m.items() if k.startswith('windows_closed'))):,} windows closed, "
        f"{int(sum(v for k, v in m.items() if k.startswith('batches_rejected'))):,} batches rejected")
    say(f"store: {res.store_path}\nkernel stats: {stats_path}\nperfetto traces: {traces}")
    return 0
