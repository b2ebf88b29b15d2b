"""The seam between the processor and wherever its output goes."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from trainscope.processor.model import WindowOutput


@runtime_checkable
class Sink(Protocol):
    """Receives every closed window's output.

    ``export`` is called from the processor's summarising thread and must not
    block on the network: a sink that cannot deliver now buffers (bounded),
    spools or drops, and counts what it dropped in the self-metrics. It never
    raises for delivery failures.
    """

    name: str

    def export(self, out: WindowOutput) -> None: ...

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Deliver what is buffered; True when nothing is left pending."""
        ...

    def close(self) -> None: ...
