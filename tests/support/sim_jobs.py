"""Independent simulated jobs run side by side in worker processes (fixtures that need many).

Each job is ``run_sim_embedded`` with its own embedded processor (its own private socket,
home and Kafka spool), exactly as when the jobs run one after the other; only the wall
time changes: a sim spends much of its time waiting on its processor's threads, and
the CI machine has 2 cores. Workers are spawned, not forked: the test process may
already hold gRPC and librdkafka threads.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os


@dataclasses.dataclass(frozen=True)
class SimJob:
    """One job: ``sim_config`` keyword arguments, and the Kafka sink's (None: no Kafka sink)."""

    sim: dict
    kafka: dict | None = None


@dataclasses.dataclass(frozen=True)
class SimOutcome:
    job_id: str
    dropped: int
    hung: bool
    ground_truth_path: str
    undelivered_bytes: int = 0      # left in the Kafka spool when the run ended (never sent)


def _run(job: SimJob) -> SimOutcome:
    from trainscope.collector.sim import sim_config
    from trainscope.deploy.embedded import run_sim_embedded, undelivered_kafka_bytes
    from trainscope.processor.kafka_config import KafkaSinkConfig

    options = {"kafka": KafkaSinkConfig(**job.kafka)} if job.kafka is not None else {}
    res = run_sim_embedded(sim_config(**job.sim), processor_options=options)
    return SimOutcome(job.sim.get("job_id", ""), res.dropped, res.hung, res.ground_truth_path,
                      undelivered_kafka_bytes(res.processor or {}))


def run_sims(jobs: list[SimJob], workers: int | None = None) -> list[SimOutcome]:
    """Run ``jobs`` in up to ``workers`` spawned processes (default: the cores, at most 4); results in order."""
    workers = max(1, min(len(jobs), workers or min(os.cpu_count() or 1, 4)))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_run, jobs))
