"""The in-process collector: the API training code (or a framework hook) calls.

    import trainscope.collector as ts
    col = ts.init()                      # from the environment; a no-op when disabled
    with col.phase("forward"):
        loss = model(batch)
    col.iteration(step)                  # marks the end of a training iteration
    col.add_kernel_source(source)        # e.g. a replay or CUPTI source

Everything here runs on the training thread and does only list appends and
clock reads; message building and I/O happen on the exporter's worker thread
(see ``exporter.py``). Disabled, ``init`` returns ``NullCollector`` whose
methods do nothing. No method raises into user code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Iterator

from trainscope.collector.exporter import BatchExporter
from trainscope.collector.exporter_config import ExporterConfig
from trainscope.collector.sources import KernelSource
from trainscope.proto import env
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import NIC_ATTRIBUTE, SWITCH_ATTRIBUTE, ParallelCoords, Resource, coords_for_rank
from trainscope.proto.v1 import telemetry_pb2

log = logging.getLogger(__name__)

_CPU = telemetry_pb2.PHASE_CLOCK_CPU


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectorConfig:
    enabled: bool = True
    """False makes ``init`` return a no-op collector."""
    job_id: str = "local"
    """Job identity shared by every rank of the job."""
    rank: int = 0
    """Global rank of this process."""
    world_size: int = 1
    """Number of ranks in the job."""
    local_rank: int = 0
    """Rank within the host."""
    coords: ParallelCoords | None = None
    """Parallel coordinates; derived from ``topology`` when None."""
    topology: dict = dataclasses.field(default_factory=dict)
    """Degrees (tp, pp, ep, cp, order) used to derive coords."""
    exporter: ExporterConfig = dataclasses.field(default_factory=ExporterConfig)
    """Where and how batches are sent."""
    attributes: dict = dataclasses.field(default_factory=dict)
    """Extra ``Resource.attributes``: the NIC and switch the site says this rank uses
    (``TRAINSCOPE_NIC``: one name, or one per local rank separated by commas, qualified with
    the host; ``TRAINSCOPE_SWITCH``), so a verdict can name them."""
    phase_batch: int = 256
    """Phases buffered before they are handed to the exporter (also at every iteration)."""
    max_buffered: int = 65_536
    """Bound on phases/iterations buffered between hand-overs; beyond it they are counted drops."""
    ship_interval_s: float = 0.0
    """At an iteration mark, hand buffered phases and marks over only if this long passed since the
    last hand-over (0: at every mark). Each hand-over is one gRPC message per signal."""

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ConfigError("collector.job_id", self.job_id, "must not be empty")
        if self.world_size < 1:
            raise ConfigError("collector.world_size", self.world_size, "must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError("collector.rank", self.rank, f"must be in [0, {self.world_size})")
        if self.phase_batch < 1 or self.max_buffered < self.phase_batch:
            raise ConfigError("collector.phase_batch", self.phase_batch, "must be >= 1 and <= max_buffered")
        if not self.ship_interval_s >= 0:
            raise ConfigError("collector.ship_interval_s", self.ship_interval_s, "must be >= 0")

    @classmethod
    def from_env(cls, environ=os.environ, **overrides) -> "CollectorConfig":
        """Read the launcher's variables (torchrun's RANK/WORLD_SIZE/LOCAL_RANK) and ours."""
        def num(name: str, default: int) -> int:
            return env.integer(name, default, environ)

        kw: dict = dict(
            enabled=env.switch(env.ENABLED, True, environ),
            job_id=environ.get(env.JOB_ID) or environ.get(env.LAUNCHER_RUN_ID) or "local",
            rank=num(env.RANK, 0), world_size=num(env.WORLD_SIZE, 1), local_rank=num(env.LOCAL_RANK, 0),
            topology=parse_topology(environ.get(env.TOPOLOGY, "")),
            attributes={k: environ[v][:128] for k, v in ((NIC_ATTRIBUTE, env.NIC), (SWITCH_ATTRIBUTE, env.SWITCH))
                        if environ.get(v)},
        )
        if environ.get(env.PROCESSOR):
            kw["exporter"] = ExporterConfig(target=environ[env.PROCESSOR])
        kw.update(overrides)
        return cls(**kw)


def parse_topology(text: str) -> dict:
    """``"tp=2,pp=4,order=tp-cp-ep-dp-pp"`` -> dict; raises ConfigError naming the variable."""
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("tp", "pp", "ep", "cp", "order"):
            raise ConfigError(env.TOPOLOGY, text, f"bad entry {part!r}; expected tp=,pp=,ep=,cp=,order=")
        if key == "order":
            out[key] = value
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise ConfigError(env.TOPOLOGY, text, f"{key} must be an integer") from None
    return out


class Collector:
    """Records phases, iterations and kernel batches of one rank."""

    def __init__(self, config: CollectorConfig, exporter: BatchExporter | None = None) -> None:
        self.config = config
        coords = config.coords or coords_for_rank(config.rank, config.world_size, **config.topology)
        host = socket.gethostname()
        attributes = dict(config.attributes)
        if attributes.get(NIC_ATTRIBUTE):
            nics = [n.strip() for n in attributes[NIC_ATTRIBUTE].split(",") if n.strip()] or [""]
            attributes[NIC_ATTRIBUTE] = f"{host}/{nics[config.local_rank % len(nics)]}"
        self.resource = Resource(
            job_id=config.job_id, rank=config.rank, world_size=config.world_size,
            host=host, pid=os.getpid(), local_rank=config.local_rank,
            device="cpu", coords=coords, attributes=attributes,
        )
        self.exporter = exporter or BatchExporter(self.resource, config.exporter)
        self._lock = threading.Lock()
        self._phases: list[tuple] = []
        self._marks: list[tuple] = []
        self._iteration = 0
        self._iter_start = time.time_ns()
        self._last_ship = 0.0
        self.dropped = 0
        self._sources: list[KernelSource] = []

    # --- phases -----------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, *, micro_batch: int = 0) -> Iterator[None]:
        """Time a block on the host clock (CUDA-event timing comes with the GPU collector)."""
        start = time.time_ns()
        try:
            yield
        finally:
            self.record_phase(name, start, time.time_ns() - start, micro_batch=micro_batch)

    def record_phase(self, name: str, start_ns: int, duration_ns: int, *, stream: int = 0,
                     clock: int = _CPU, micro_batch: int = 0, iteration: int | None = None) -> None:
        try:
            it = self._iteration if iteration is None else iteration
            with self._lock:
                if len(self._phases) >= self.config.max_buffered:
                    self.dropped += 1
                    return
                self._phases.append((name, start_ns, duration_ns, it, stream, clock, micro_batch))
                full = len(self._phases) >= self.config.phase_batch
            if full:
                self._ship_phases()
        except Exception:
            self.dropped += 1

    # --- iterations -------------------------------------------------------
    def iteration(self, number: int | None = None, *, start_ns: int | None = None,
                  end_ns: int | None = None) -> None:
        """Mark the end of an iteration (defaults: the next number, since the last mark)."""
        try:
            end = time.time_ns() if end_ns is None else end_ns
            start = self._iter_start if start_ns is None else start_ns
            n = self._iteration if number is None else number
            with self._lock:
                if len(self._marks) < self.config.max_buffered:
                    self._marks.append((n, start, end))
                else:
                    self.dropped += 1
            self._iteration = n + 1
            self._iter_start = end
            now = time.monotonic()
            if now - self._last_ship >= self.config.ship_interval_s:
                self._last_ship = now
                self._ship_phases()
                self._ship_marks()
        except Exception:
            self.dropped += 1

    # --- kernels ----------------------------------------------------------
    def record_kernels(self, cols: KernelColumns) -> bool:
        """Hand a batch of kernel records to the exporter (columns serialise on the worker)."""
        if not len(cols):
            return True
        nbytes = len(cols) * 25 + sum(len(n) for n in cols.names)
        return self.exporter.submit(cols.to_pb, nbytes)

    def add_kernel_source(self, source: KernelSource) -> None:
        self._sources.append(source)
        source.start(self.record_kernels)

    # --- hand-over ----------------------------------------------------------
    def _ship_phases(self) -> None:
        with self._lock:
            rows, self._phases = self._phases, []
        if rows:
            def build(rows=rows):
                return telemetry_pb2.PhaseBatch(phases=[
                    telemetry_pb2.PhaseTiming(name=n, start_ns=s, duration_ns=d, iteration=i,
                                              stream=st, clock=c, micro_batch=mb)
                    for n, s, d, i, st, c, mb in rows])
            self.exporter.submit(build, 48 * len(rows))

    def _ship_marks(self) -> None:
        with self._lock:
            rows, self._marks = self._marks, []
        if rows:
            def build(rows=rows):
                return telemetry_pb2.IterationBatch(marks=[
                    telemetry_pb2.IterationMark(iteration=i, start_ns=s, end_ns=e) for i, s, e in rows])
            self.exporter.submit(build, 24 * len(rows))

    def flush(self, timeout_s: float | None = None) -> bool:
        self._ship_phases()
        self._ship_marks()
        return self.exporter.flush(timeout_s)

    def shutdown(self, timeout_s: float | None = None) -> bool:
        for s in self._sources:
            try:
                s.stop()
            except Exception:
                log.debug("stopping source failed", exc_info=True)
        self._ship_phases()
        self._ship_marks()
        self.exporter.submit_final()
        return self.exporter.shutdown(timeout_s)

    def stats(self) -> dict:
        out = self.exporter.stats.snapshot()
        out["dropped_in_collector"] = self.dropped
        return out


class NullCollector:
    """What ``init`` returns when collection is disabled: every call is a no-op."""

    resource = None

    @contextlib.contextmanager
    def phase(self, name: str, **_) -> Iterator[None]:
        yield

    def record_phase(self, *a, **k) -> None: ...
    def iteration(self, *a, **k) -> None: ...
    def record_kernels(self, *a, **k) -> bool: return False
    def add_kernel_source(self, *a, **k) -> None: ...
    def flush(self, *a, **k) -> bool: return True
    def shutdown(self, *a, **k) -> bool: return True
    def stats(self) -> dict: return {}


def init(config: CollectorConfig | None = None) -> Collector | NullCollector:
    """Build the collector from ``config`` or the environment; never raises into the caller
    for anything but a wrong configuration (which should fail at start-up)."""
    cfg = config or CollectorConfig.from_env()
    if not cfg.enabled:
        return NullCollector()
    return Collector(cfg)
