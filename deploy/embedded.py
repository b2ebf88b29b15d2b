"""The embedded default: an analyzer running beside an in-process processor.

Used by ``trainscope replay``, ``trainscope sim`` and ``trainscope demo``: the
analyzer consumes the processor's embedded bus continuously on its own thread
(the same code path as the Kafka service) and writes diagnoses and verdicts
to the local store next to the processor's records.
"""
from __future__ import annotations

import threading
from typing import Any

from trainscope.processor.daemon import Processor


class EmbeddedAnalysis:
    def __init__(self, proc: Processor, store_path: str, config: Any = None) -> None:
        from trainscope.analyzer.service import Analyzer, AnalyzerConfig
        from trainscope.analyzer.sinks import BusDiagnosisSink, StoreDiagnosisSink
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
    """Attaches an ``EmbeddedAnalysis`` to ``run_sim``'s embedded processor.

        a = SimAnalysis()
        res = run_sim(cfg, **a.hooks())
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
