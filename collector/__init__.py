"""trainscope collector: the in-process side (bounded, non-blocking, never raises)."""
from trainscope.collector.sdk import Collector, CollectorConfig, NullCollector, init

__all__ = ["Collector", "CollectorConfig", "NullCollector", "init"]
