"""What the processor's stages hand each other: a closed window and its records."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterator

from google.protobuf.message import Message

from trainscope.proto.columnar import KernelColumns
from trainscope.proto.contracts import SIGNALS
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2, telemetry_pb2

if TYPE_CHECKING:
    from trainscope.processor.kernel_names import NameTable



@dataclasses.dataclass(frozen=True, slots=True)
class ClosedWindow:
    """Every raw record of one rank that fell into one window.

    ``phases``, ``iterations`` and ``stacks`` are the received protobuf
    messages (tens per iteration, not worth columnising); kernels are columns.
    """

    resource: Resource
    window: records_pb2.Window
    kernels: KernelColumns
    phases: tuple[telemetry_pb2.PhaseTiming, ...] = ()
    iterations: tuple[telemetry_pb2.IterationMark, ...] = ()
    stacks: tuple[telemetry_pb2.StackSnapshot, ...] = ()
    kernel_iterations: int = 0
    """Iterations the kernel events fell in (iterations windows; 0: not known)."""


@dataclasses.dataclass(frozen=True, slots=True)
class WindowOutput:
    """A closed window and the per-signal summaries made from it.

    A summary is ``None`` when the window had no records of that signal.
    Sinks that keep summaries (Kafka, Prometheus, the embedded bus) read the
    records; the Perfetto sink reads ``raw``.
    """

    raw: ClosedWindow
    kernels: records_pb2.KernelWindow | None = None
    phases: records_pb2.PhaseWindow | None = None
    iterations: records_pb2.IterationWindow | None = None
    stacks: records_pb2.StackWindow | None = None
    collectives: records_pb2.CollectiveWindow | None = None   # processor/collectives.py
    kernel_names: "NameTable | None" = None   # the kernel window's dictionary entries (processor/kernel_names.py)

    def records(self) -> Iterator[tuple[str, Message]]:
        """(signal, record) for each signal that has one."""
        for signal in SIGNALS:
            rec = getattr(self, signal)
            if rec is not None:
                yield signal, rec
