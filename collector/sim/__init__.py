"""Cluster simulator with fault injection (``trainscope sim``).

Simulates a hybrid-parallel (TP/PP/DP/EP/CP) training job of thousands of
ranks, vectorised across ranks with numpy, and emits the telemetry real
collectors emit (columnar kernel batches, CUDA-event phases, iteration marks,
py-spy-like stacks) on per-host clocks, through the real exporter and gRPC to
a processor. Faults from ARGUS Table 6 and Mycroft §7.1 are injected on cue and
recorded in a ground-truth JSON file.

    from trainscope.collector.sim import SimConfig, parse_fault, run_sim
    res = run_sim(SimConfig(ranks=64, tp=4, pp=2, iterations=20,
                            faults=(parse_fault("gpu_throttle:rank=5,factor=1.5"),)),
                  "unix:///tmp/trainscope/processor.sock")   # or sinks=[MemorySink()]
    print(res.ground_truth_path, res.events_per_s)

The simulator only emits, to an address or to the sinks it is given; the
embedded default (an in-process processor and analyzer) is
``trainscope.deploy.embedded.run_sim_embedded``, what ``trainscope sim`` and ``demo`` use.

Modules by role: ``topology`` (groups, hosts, NICs, clocks), ``workload``
(kernel/phase template), ``faults`` (catalogue, parser, activity),
``effects`` (what each fault changes), ``engine`` (one iteration for all
ranks), ``simulate`` (the run loop), ``emit`` (chunks and sinks), ``truth``
(ground truth), ``config`` / ``runner`` (the facade).
"""
from trainscope.collector.sim.config import SimConfig, sim_config
from trainscope.collector.sim.emit import ExporterSink, KinetoSink, MemorySink
from trainscope.collector.sim.faults import FAULT_TYPES, FaultSpec, load_scenario, parse_fault
from trainscope.collector.sim.runner import SimResult, run_sim
from trainscope.collector.sim.simulate import Simulation

__all__ = [
    "FAULT_TYPES", "ExporterSink", "FaultSpec", "KinetoSink", "MemorySink", "SimConfig", "SimResult",
    "Simulation", "load_scenario", "parse_fault", "run_sim", "sim_config",
]
