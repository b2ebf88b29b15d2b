"""``SimConfig``: everything a simulated run depends on, validated at construction.

Bad values raise ``ConfigError("sim.<field>", value, why)`` before anything
runs; faults are checked against the topology (a rank outside the world, a
host that does not exist, a fault that cannot apply to this layout).
:func:`sim_config` builds one from CLI-style strings (``"300s"``,
``"gpu_throttle:rank=3,factor=1.4"``, a scenario file).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

from trainscope.collector.sim.faults import FaultSpec, fault_from_obj, load_scenario, parse_seconds, resolve_ranks
from trainscope.collector.sim.topology import Topology
from trainscope.collector.sim.noise import NoiseModel
from trainscope.proto.contracts import FIXED_WINDOW_MODES, WindowMode, one_of
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import DEFAULT_ORDER

DEFAULT_ITERATIONS = 20


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    ranks: int = 64
    """World size (number of simulated GPUs)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    ep: int = 1
    """Expert-parallel degree; > 1 makes every layer a MoE layer."""
    cp: int = 1
    """Context-parallel degree."""
    order: str = DEFAULT_ORDER
    """Megatron rank order, fastest-varying dimension first."""
    gpus_per_host: int | None = None
    """GPUs per host (default: 8, or the world size when smaller); must divide ``ranks``."""
    nics_per_host: int | None = None
    """RDMA NICs per host (default: 4, at most ``gpus_per_host``); must divide ``gpus_per_host``."""
    micro_batches: int = 4
    """Micro-batches per iteration (1F1B schedule)."""
    layers: int = 2
    """Transformer layers per pipeline stage; kernels per iteration grow linearly with it."""
    iteration_s: float = 3.0
    """Healthy iteration time in simulated seconds; kernel medians are scaled to match."""
    iterations: int | None = None
    """Stop after this many iterations (default 20 when ``duration_s`` is not set either)."""
    duration_s: float | None = None
    """Stop once this much simulated time has passed."""
    faults: tuple[FaultSpec, ...] = ()
    """Injected faults (``faults.parse_fault``)."""
    seed: int = 0
    """Seed of every random draw; equal configs give byte-identical telemetry."""
    job_id: str = "sim"
    """Job id carried in every batch's resource."""
    noise_sigma: float = 0.03
    """Lognormal sigma of compute kernel durations (same position, same rank)."""
    comm_sigma: float = 0.05
    """Lognormal sigma of collective transfer times."""
    noise: NoiseModel | None = dataclasses.field(default_factory=NoiseModel)
    """Noise measured on real traces (spikes, per-slot spread, personality, step factor; ``noise.py``);
    None: plain lognormal with the sigmas above."""
    clock_offset_s: float = 2.0
    """Host clock offsets are drawn uniformly in ± this many seconds."""
    clock_drift_ppm: float = 50.0
    """Host clock drifts are drawn uniformly in ± this many parts per million."""
    emit_every: int = 5
    """Iterations per emitted batch (per rank and signal)."""
    stack_every: int = 5
    """Iterations per py-spy-like stack snapshot (0: no stacks)."""
    stack_hz: float = 100.0
    """Stack sampling rate the snapshots pretend to have (py-spy's default)."""
    exporters: int = 4
    """Collector exporters (gRPC streams); hosts are spread over them."""
    home: str | None = None
    """State directory: embedded processor store, ground truth (default: a temporary directory)."""
    ground_truth_path: str | None = None
    """Where the ground-truth JSON goes (default ``<home>/sim-ground-truth.json``)."""
    traces_out: str | None = None
    """Also write PyTorch-profiler traces (``rank-<N>.json.gz`` + ``topology.json``) here."""
    window_mode: str = WindowMode.ITERATIONS
    """Embedded processor windows: ``iterations`` (clock-free) or ``time``."""
    window_iterations: int = 10
    """Iterations per window of the embedded processor (``iterations`` mode)."""
    window_length_s: float = 30.0
    """Window length of the embedded processor (``time`` mode), rank-clock seconds."""
    collective_steps: bool = False
    """Collective records carry every step of the algorithm (Vedrfolnir step records,
    ``CollectiveRecord`` fields 14-19: each flow's destination, bytes, start and end); off: the ring
    summary only (fields 10-13)."""

    def __post_init__(self) -> None:
        ints = {"ranks": 1, "tp": 1, "pp": 1, "ep": 1, "cp": 1, "micro_batches": 1, "layers": 1,
                "seed": 0, "emit_every": 1, "stack_every": 0, "exporters": 1, "window_iterations": 1}
        for name, lo in ints.items():
            v = getattr(self, name)
            if type(v) is not int or v < lo:
                raise ConfigError(f"sim.{name}", v, f"must be an integer >= {lo}")
        gph = self.gpus_per_host if self.gpus_per_host is not None else min(8, self.ranks)
        nph = self.nics_per_host if self.nics_per_host is not None else min(4, gph)
        if self.gpus_per_host is None and self.ranks % gph:
            gph = math.gcd(gph, self.ranks)
            nph = math.gcd(nph, gph) if self.nics_per_host is None else nph
        object.__setattr__(self, "gpus_per_host", gph)
        object.__setattr__(self, "nics_per_host", nph)
        if self.micro_batches < self.pp:
            raise ConfigError("sim.micro_batches", self.micro_batches, f"must be >= pp ({self.pp}) for 1F1B")
        pos = ("iteration_s", "stack_hz", "window_length_s")
        for name in pos:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"sim.{name}", v, "must be a finite number > 0")
        for name in ("noise_sigma", "comm_sigma", "clock_offset_s", "clock_drift_ppm"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"sim.{name}", v, "must be a finite number >= 0")
        if self.iterations is not None and (type(self.iterations) is not int or self.iterations < 1):
            raise ConfigError("sim.iterations", self.iterations, "must be an integer >= 1")
        if self.duration_s is not None and not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ConfigError("sim.duration_s", self.duration_s, "must be a number of seconds > 0")
        if self.window_mode not in FIXED_WINDOW_MODES:
            raise ConfigError("sim.window_mode", self.window_mode, f"must be {one_of(FIXED_WINDOW_MODES)}")
        if not isinstance(self.collective_steps, bool):
            raise ConfigError("sim.collective_steps", self.collective_steps, "must be true or false")
        if not self.job_id:
            raise ConfigError("sim.job_id", self.job_id, "must not be empty")
        if self.noise is not None and not isinstance(self.noise, NoiseModel):
            raise ConfigError("sim.noise", self.noise, "must be a NoiseModel or None")
        object.__setattr__(self, "faults", tuple(self.faults))
        topo = self.topology()
        for i, f in enumerate(self.faults):
            if not isinstance(f, FaultSpec):
                raise ConfigError(f"sim.faults[{i}]", f, "must be a FaultSpec (see faults.parse_fault)")
            _check_fault(f, topo, self, f"sim.faults[{i}]")

    def topology(self) -> Topology:
        return Topology.build(self.ranks, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp, order=self.order,
                              gpus_per_host=self.gpus_per_host, nics_per_host=self.nics_per_host)

    @property
    def max_iterations(self) -> int | None:
        if self.iterations is None and self.duration_s is None:
            return DEFAULT_ITERATIONS
        return self.iterations

    def describe(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["faults"] = [f.text or f.type for f in self.faults]
        out["noise"] = dataclasses.asdict(self.noise) if self.noise is not None else None
        return out


def _check_fault(f: FaultSpec, topo: Topology, cfg: SimConfig, setting: str) -> None:
    ranks = resolve_ranks(f, topo, setting)
    if not len(ranks):
        raise ConfigError(setting, f.text, "its scope holds no rank")
    t = f.type
    if t == "moe_imbalance" and topo.ep < 2:
        raise ConfigError(setting, f.text, "moe_imbalance needs ep > 1 (MoE layers)")
    if t == "overlap_loss" and topo.dp < 2:
        raise ConfigError(setting, f.text, "overlap_loss needs dp > 1 (gradient buckets to overlap)")
    if t in ("nic_degrade", "net_congestion") and topo.hosts < 2:
        raise ConfigError(setting, f.text, f"{t} needs more than one host (inter-host traffic)")
    if t == "nvlink_degrade" and topo.gpus_per_host < 2:
        raise ConfigError(setting, f.text, "nvlink_degrade needs more than one GPU per host")
    if t == "hang" and topo.world < 2:
        raise ConfigError(setting, f.text, "hang needs more than one rank")
    if t == "jit_stall" and not -cfg.micro_batches <= f.params["mb"] < cfg.micro_batches:
        raise ConfigError(setting, f.text, f"mb must be in [-{cfg.micro_batches}, {cfg.micro_batches})")


def sim_config(*, faults: Iterable = (), scenario: str | None = None, duration=None, iteration_s=None,
               **fields) -> SimConfig:
    """A ``SimConfig`` from CLI-style values: fault strings, a scenario file, times like ``300s``.

    ``None`` values fall back to the dataclass defaults.
    """
    specs = [fault_from_obj(f, f"sim.fault[{i}]") for i, f in enumerate(faults or ())]
    if scenario:
        specs += list(load_scenario(scenario))
    kw = {k: v for k, v in fields.items() if v is not None}
    if duration is not None:
        kw["duration_s"] = parse_seconds(duration, "sim.duration")
    if iteration_s is not None:
        kw["iteration_s"] = parse_seconds(iteration_s, "sim.iteration_s")
    return SimConfig(faults=tuple(specs), **kw)
