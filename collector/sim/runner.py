"""``run_sim``: simulate a job and emit its telemetry to what it is given.

1. Validate the config (``SimConfig``), build the simulation.
2. Pick the destinations: a processor at ``processor_address`` (the real
   exporter → gRPC path) and/or the ``sinks`` given (e.g. a ``MemorySink``);
   ``traces_out`` adds a Kineto-trace sink. The simulator never builds a
   processor: the embedded default (a processor and an analyzer in this
   process) is assembled by ``deploy/embedded.py``, which calls this.
3. Stream every chunk to the sinks (``barrier()`` after each chunk lets a
   caller's in-process processor work off its backlog); unless the job hung,
   send every rank's end-of-process marker; close the sinks (exporters flush, all
   of them within ``final_flush_s``; what is left is counted as dropped).
4. Write the ground truth and return a :class:`SimResult` with the volumes and
   the rates (events generated per second of wall time).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any, Callable, Sequence

from trainscope.collector.sim.config import SimConfig
from trainscope.collector.sim.emit import ExporterSink, FanOut, KinetoSink, SimSink
from trainscope.collector.sim.simulate import Simulation
from trainscope.collector.sim.truth import ground_truth, write_ground_truth

#: The bound on the final flush to a processor, all exporters together: a processor that went
#: away must not hold the run (the exporter sink's own timeout is per exporter and per flush).
FINAL_FLUSH_S = 30.0


@dataclasses.dataclass(slots=True)
class SimResult:
    job_id: str
    ranks: int
    iterations: int
    sim_seconds: float
    hung: bool
    kernel_events: int
    phase_events: int
    iteration_events: int
    stack_snapshots: int
    wall_s: float
    """Whole run, set-up to drained processor."""
    generate_s: float
    """Time spent simulating, encoding and handing batches to the sinks, without waiting
    for the processor (it shares the interpreter with the embedded processor's threads)."""
    ground_truth_path: str
    processor_address: str | None = None
    store_path: str | None = None
    traces_out: str | None = None
    exporter: dict = dataclasses.field(default_factory=dict)
    processor: dict = dataclasses.field(default_factory=dict)
    kernels_per_iteration: list = dataclasses.field(default_factory=list)

    @property
    def events(self) -> int:
        return self.kernel_events + self.phase_events + self.iteration_events + self.stack_snapshots

    @property
    def events_per_s(self) -> float:
        """Events through the whole path per second of wall time."""
        return self.events / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def generated_per_s(self) -> float:
        """Events simulated and encoded per second of the simulator's own time."""
        return self.events / self.generate_s if self.generate_s > 0 else 0.0

    @property
    def dropped(self) -> int:
        return int(self.exporter.get("dropped_total", 0)) + int(self.exporter.get("rejected_by_processor", 0))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(events=self.events, events_per_s=self.events_per_s, generated_per_s=self.generated_per_s,
                 dropped=self.dropped)
        return d


def run_sim(
    config: SimConfig,
    processor_address: str | None = None,
    *,
    sinks: Sequence[SimSink] = (),
    barrier: Callable[[], Any] | None = None,
    final_flush_s: float = FINAL_FLUSH_S,
) -> SimResult:
    """Run ``config`` (module docstring steps) to ``processor_address`` and ``sinks``; returns what happened.

    ``barrier()`` is called by the exporter sink after each chunk (the
    embedded processor drains there, so nothing is dropped for backlog).
    """
    t0 = time.perf_counter()
    sim = Simulation(config)  # step 1
    home = config.home or tempfile.mkdtemp(prefix="trainscope-sim-")
    os.makedirs(home, exist_ok=True)
    out: list[SimSink] = list(sinks)  # step 2
    exporter_sink = None
    if processor_address is not None:
        exporter_sink = ExporterSink(processor_address, sim.topo, config.job_id, exporters=config.exporters,
                                     barrier=barrier)
        out.append(exporter_sink)
    if config.traces_out:
        out.append(KinetoSink(config.traces_out, sim.topo))
    fan = FanOut(out)
    counts = dict(k=0, p=0, m=0, s=0)
    t_setup = time.perf_counter() - t0
    t1 = time.perf_counter()
    for chunk in sim.chunks():  # step 3
        fan.write(chunk)
        counts["k"] += chunk.kernel_events
        counts["p"] += chunk.phase_events
        counts["m"] += chunk.mark_events
        counts["s"] += 0 if chunk.stack_s is None else int((chunk.stack_s.sum(axis=1) > 0).sum())
    # simulating + encoding + handing over, without the waits for the processor
    generate_s = time.perf_counter() - t1 - (exporter_sink.wait_s if exporter_sink else 0.0) + t_setup
    if exporter_sink is not None and not sim.hung:
        exporter_sink.finish()
    if exporter_sink is not None:
        # the final flush within final_flush_s in all; what is still unconfirmed then is counted
        # as dropped by the exporters' shutdown in close() (SimResult.dropped)
        deadline = time.monotonic() + final_flush_s
        for e in exporter_sink.exporters:
            e.flush(max(0.0, deadline - time.monotonic()))
        exporter_sink.timeout_s = 0.0
    fan.close()
    truth_path = config.ground_truth_path or os.path.join(home, "sim-ground-truth.json")
    write_ground_truth(ground_truth(sim), truth_path)  # step 4
    wall = time.perf_counter() - t0
    return SimResult(
        job_id=config.job_id, ranks=sim.topo.world, iterations=len(sim.iteration_bounds),
        sim_seconds=sim.end_ns / 1e9, hung=sim.hung,
        kernel_events=counts["k"], phase_events=counts["p"], iteration_events=counts["m"],
        stack_snapshots=counts["s"], wall_s=wall, generate_s=max(generate_s, 1e-9),
        ground_truth_path=truth_path, processor_address=processor_address,
        traces_out=config.traces_out, exporter=exporter_sink.stats() if exporter_sink else {},
        kernels_per_iteration=sim.tmpl.kernels_per_iteration(),
    )

