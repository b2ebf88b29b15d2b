"""Kernel and telemetry sources for the collector.

A source produces :class:`KernelColumns` batches and hands them to ``emit``;
the collector's ``emit`` enqueues into a bounded queue and never blocks
(ARCHITECTURE.md, "Collector -> processor guarantees"). CUPTI, the CPU
fallback, replay and the simulator all fit the one :class:`KernelSource` seam.
"""
from __future__ import annotations

import threading
from typing import Callable, Protocol, runtime_checkable

from trainscope.collector.sources.replay import RankTrace
from trainscope.collector.sources.synthetic import SyntheticSpec, synthesize
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import ConfigError

Emit = Callable[[KernelColumns], None]


@runtime_checkable
class KernelSource(Protocol):
    """Something that produces kernel activity for one rank."""

    name: str

    def start(self, emit: Emit) -> None:
        """Begin producing; ``emit`` never blocks. Finite sources return when done."""
        ...

    def stop(self) -> None:
        """Stop producing; safe to call more than once and from another thread."""
        ...


class _ChunkedSource:
    """Emits fixed columns in time-ordered chunks; ``stop()`` ends it for good."""

    name = "chunked"

    def __init__(self, columns: KernelColumns, chunk: int) -> None:
        if type(chunk) is not int or chunk < 1:
            raise ConfigError(f"{self.name}.chunk", chunk, "must be a positive integer")
        self._columns = columns
        self._chunk = chunk
        self._stopped = threading.Event()
        self.emitted = 0
        """Records handed to ``emit`` so far."""

    def start(self, emit: Emit) -> None:
        cols = self._columns
        for lo in range(0, len(cols), self._chunk):
            if self._stopped.is_set():
                return
            batch = cols.take(slice(lo, lo + self._chunk))
            emit(batch)
            self.emitted += len(batch)

    def stop(self) -> None:
        self._stopped.set()


class ReplayKernelSource(_ChunkedSource):
    """Replays one rank's recorded kernels (a :class:`RankTrace`), in start order."""

    name = "replay"

    def __init__(self, trace: RankTrace, chunk: int = 65536) -> None:
        super().__init__(trace.kernels, chunk)
        self.trace = trace


class SyntheticKernelSource(_ChunkedSource):
    """Emits the deterministic stream of a :class:`SyntheticSpec`."""

    name = "synthetic"

    def __init__(self, spec: SyntheticSpec, chunk: int = 65536) -> None:
        self.trace = synthesize(spec)
        super().__init__(self.trace.kernels, chunk)
        self.spec = spec


__all__ = ["Emit", "KernelSource", "ReplayKernelSource", "SyntheticKernelSource"]
