"""The embedded default: an analyzer running beside an in-process processor.

Used by ``trainscope replay``, ``trainscope sim`` and ``trainscope demo``: the
analyzer consumes the processor's embedded bus continuously on its own thread
(the same code path as the Kafka service) and writes diagnoses and verdicts
to the local store next to the processor's records. :func:`run_sim_embedded` is the
simulator on that default (the simulator itself only emits to an address).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from trainscope.collector.sim import SimConfig, SimResult
from trainscope.collector.sim import run_sim as _emit_sim
from trainscope.collector.sim.emit import SimSink
from trainscope.processor.daemon import Processor, ProcessorConfig
from trainscope.processor.store import store_in_use
from trainscope.processor.windows import WindowConfig
from trainscope.proto import env
from trainscope.proto.errors import ConfigError


class EmbeddedAnalysis:
    def __init__(self, proc: Processor, store_path: str, config: Any = None) -> None:
        from trainscope.analyzer.service import Analyzer, AnalyzerConfig
        from trainscope.analyzer.diagnosis_sinks import BusDiagnosisSink, StoreDiagnosisSink
        from trainscope.analyzer.sources import BusSource
        from trainscope.analyzer.store import DiagnosisStore

        self.analyzer = Analyzer(config or AnalyzerConfig(), BusSource(proc.bus),
                                 [StoreDiagnosisSink(DiagnosisStore(store_path)), BusDiagnosisSink(proc.bus)])
        if proc.config.prometheus is not None:
            proc.registry.register(self.analyzer.metrics)  # flagged suspects on the same /metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.analyzer.run, args=(self._stop,),
                                        name="trainscope-analyzer", daemon=True)
        self._thread.start()

    def finish(self) -> list:
        """Stop the loop, analyse what is left, close the sinks; returns every verdict."""
        self._stop.set()
        self._thread.join(30)
        self.analyzer.finish()
        for s in self.analyzer.sinks:
            s.close()
        return list(self.analyzer.verdicts)


class SimAnalysis:
    """Attaches an ``EmbeddedAnalysis`` to ``run_sim_embedded``'s embedded processor.

        a = SimAnalysis()
        res = run_sim_embedded(cfg, **a.hooks())
        a.verdicts  # every verdict of the run
    """

    def __init__(self, config: Any = None) -> None:
        self.config = config
        self._run: EmbeddedAnalysis | None = None
        self.verdicts: list = []

    def on_start(self, proc: Processor, store_path: str) -> None:
        self._run = EmbeddedAnalysis(proc, store_path, self.config)

    def on_processor(self, proc: Processor) -> None:
        if self._run is not None:
            self.verdicts = self._run.finish()

    def hooks(self) -> dict:
        return {"on_start": self.on_start, "on_processor": self.on_processor}


def run_sim_embedded(
    config: SimConfig,
    processor_address: str | None = None,
    *,
    embedded: bool = True,
    sinks: Sequence[SimSink] = (),
    processor_options: dict[str, Any] | None = None,
    on_processor: Callable | None = None,
    on_start: Callable | None = None,
) -> SimResult:
    """The simulator on the embedded default.

    1. With no ``processor_address`` and ``embedded`` (the default), start an
       in-process processor on a unix socket with its store under ``home``
       (``processor_options``: ``kafka``, ``prometheus``, ``perfetto`` sink
       configs, ``replace_store`` to replace an earlier run's store); ``on_start(proc, store_path)`` right after (an embedded
       analyzer attaches there).
    2. Emit the simulation to it (``collector.sim.run_sim``), draining its
       pipeline after every chunk so nothing is dropped for backlog, and
       closing its collective windows there (not on its wall clock).
    3. Drain it so every window is closed and published; call
       ``on_processor(proc)`` before it stops (tests read its bus there).
    """
    if processor_address is not None or not embedded:
        return _emit_sim(config, processor_address, sinks=sinks)
    t0 = time.perf_counter()
    home = config.home or tempfile.mkdtemp(prefix="trainscope-sim-")
    os.makedirs(home, exist_ok=True)
    config = dataclasses.replace(config, home=home)
    proc, store_path = _start_sim_processor(config, home, processor_options or {})  # step 1
    try:
        if on_start is not None:
            on_start(proc, store_path)
        # collective windows close at each barrier: on the processor's 2 s clock a fast simulated
        # job's collectives would reach the analyzer after their iteration window was judged
        res = _emit_sim(config, proc.address, sinks=sinks,  # step 2
                        barrier=lambda: proc.pipeline.drain(600.0, close_windows=False, close_collectives=True))
        final_drain(proc, 600.0)  # step 3
        metrics = proc.metrics.snapshot()
        if on_processor is not None:
            on_processor(proc)
    finally:
        proc.stop()
        remove_socket_dir(proc.config)
    return dataclasses.replace(res, store_path=store_path, processor=metrics, wall_s=time.perf_counter() - t0)


def embedded_processor_config(home: str, window: WindowConfig, *, replace_store: bool = False,
                              **sinks: Any) -> ProcessorConfig:
    """The embedded default's processor: a private unix socket, the store at ``home/store.sqlite``.

    One assembly for ``replay``, ``sim`` and ``demo``. A store already there
    may hold a real job's data (``trainscope run`` and the processor use the
    same default home), so it is replaced only when asked (``replace_store``,
    the CLI's ``--force``); otherwise a ConfigError says how to go on. The
    socket's private directory is removed by :func:`remove_socket_dir`.
    """
    store_path = os.path.join(home, "store.sqlite")
    if os.path.exists(store_path):
        if not replace_store:
            raise ConfigError("--home", home, "it already holds store.sqlite (an earlier run's data); "
                                              "pass another --home, or --force to replace that store")
        if store_in_use(store_path):  # never pull the store from under a live processor, even forced
            raise ConfigError("--home", home, "its store.sqlite is open in a running trainscope process "
                                              "(a processor, replay, sim or demo); stop it or pass another --home")
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(store_path + suffix):
                os.unlink(store_path + suffix)
    sock = os.path.join(tempfile.mkdtemp(prefix="ts-"), "processor.sock")
    return ProcessorConfig(listen=f"unix://{sock}", window=window, store_path=store_path, **sinks)


def final_drain(proc: Processor, timeout_s: float = 600.0) -> bool:
    """Process everything received, then close every window and flush the sinks, within a bound.

    The flush to Kafka gets its ``close_timeout_s`` plus 5 s to close the
    windows: a broker that never answers must not hold a run for minutes
    (librdkafka would retry for ``delivery_timeout_s`` per batch). What it did
    not take stays in the Kafka spool (:func:`undelivered_kafka_bytes`), sent
    by the next processor on the same home. True when everything was flushed.
    """
    proc.pipeline.drain(timeout_s, close_windows=False)
    kafka = proc.config.kafka
    return proc.drain(kafka.close_timeout_s + 5.0 if kafka is not None else timeout_s)


def undelivered_kafka_bytes(processor_metrics: dict) -> int:
    """Bytes of records still in the Kafka spool, from a processor metrics snapshot (0 without Kafka)."""
    return int(processor_metrics.get("spool_bytes{sink=kafka}", 0))


def remove_socket_dir(cfg: ProcessorConfig) -> None:
    """Remove the private socket directory :func:`embedded_processor_config` made (after the processor stopped)."""
    path = env.unix_path(cfg.listen)
    for p in (path, os.path.dirname(path)):
        try:
            os.unlink(p) if p == path else os.rmdir(p)
        except OSError:
            pass  # already gone


def _start_sim_processor(config: SimConfig, home: str, options: dict) -> tuple[Processor, str]:
    # Telemetry arrives a chunk (emit_every iterations) at a time: time windows must
    # wait that long before closing, or the chunk's tail would be dropped as late.
    cfg = embedded_processor_config(home, WindowConfig(
        mode=config.window_mode, iterations=config.window_iterations, length_s=config.window_length_s,
        idle_close_s=3600, lateness_s=max(2.0, 2.0 * config.emit_every * config.iteration_s)), **options)
    try:
        return Processor(cfg).start(), cfg.store_path
    except BaseException:
        remove_socket_dir(cfg)
        raise
