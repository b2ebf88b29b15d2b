"""The processor's own health: counters and gauges every stage updates.

Names are fixed here so dashboards and alert rules (deploy/prometheus/) can
rely on them; each becomes ``trainscope_processor_<name>`` at exposition
(counters get ``_total``). Label values are bounded sets (signal, sink,
reason), never kernels; the only per-rank series is the collectors' own drop
total: made with the rank's first batch (at 0, so alerts see its first drops), expired when idle, and capped at
``max_job_series`` (the ones refused beyond it are counted), since any sender
can name any job.
"""
from __future__ import annotations

import threading
import time
from typing import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

COUNTERS = {
    "events_in": ("Records received, by signal", ("signal",)),
    "bytes_in": ("Serialized bytes received, by signal", ("signal",)),
    "batches_in": ("Batches accepted, by signal", ("signal",)),
    "batches_rejected": ("Batches rejected whole, by reason", ("reason",)),
    "records_rejected": ("Single records rejected, by reason", ("reason",)),
    "records_truncated": ("Names or stacks truncated to the ingest limit, by what", ("what",)),
    "clock_rebased": ("Times a rank's clock was re-based after consecutive agreeing jumps", ()),
    "records_out": ("Records delivered, by sink and signal", ("sink", "signal")),
    "bytes_out": ("Serialized bytes delivered, by sink and signal", ("sink", "signal")),
    "drops": ("Records dropped, by where they were dropped", ("where",)),
    "sink_errors": ("Delivery errors, by sink", ("sink",)),
    "spool_bypassed": ("Records sent to the broker directly because the spool's disk refused them", ("sink",)),
    "windows_closed": ("Windows closed, by how they were closed", ("trigger",)),
    "window_mode_decided": ("Ranks whose window mode auto chose, by mode (iterations: marks arrived)", ("mode",)),
    "window_close_seconds_sum": ("Total time spent closing and summarising windows", ()),
    "streams": ("Ingest streams opened", ()),
    "names_evicted": ("Interned kernel names dropped when a rank's table passed its cap", ()),
    "ranks_expired": ("Ranks forgotten after rank_expire_s without data", ()),
    "streams_idle_closed": ("Ingest streams closed for having no batch accepted for stream_idle_s", ()),
    "streams_cut": ("Ingest streams closed by the processor, by reason (lifetime: open past stream_max_s; "
                    "malformed: stream_max_malformed unparsable messages in a row)", ("reason",)),
    "store_errors": ("Failed store writes, by kind (locked, full, io: retried; invalid: dropped)", ("kind",)),
    "auth_rejected": ("Requests refused for a missing or wrong bearer token, by endpoint", ("endpoint",)),
    "thread_restarts": ("Daemon threads restarted after an unexpected error, by thread", ("thread",)),
    "job_series_refused": ("Per-job series not made because max_job_series were there already", ()),
    "collective_triggers": ("Mycroft triggers on sampled ranks' collective records, by kind (hang, straggler)",
                            ("kind",)),
    "collective_raw_records": ("Raw collective records by fate (kept: emitted with their window; pulled: "
                               "emitted by a trigger; summarised: summaries only)", ("fate",)),
    "channel_states": ("Mycroft channel states of collectives by fate (kept: emitted, the collective in flight at "
                       "its window's close; superseded: a newer state of the same channel; completed: its "
                       "completion arrived; dropped: over max_states_per_window or an unknown group)", ("fate",)),
    "stack_grid_requests": ("Stack grids asked for at a collective trigger, by outcome (sent; cooldown: one per "
                            "group and grid_cooldown_s; unreachable: no member subscribed here; error)", ("outcome",)),
    "stack_grid_dumps": ("py-spy dumps of the stack grid received, by outcome (ok; error: the rank said why none)",
                         ("outcome",)),
    "flight_recorder_views": ("Flight Recorder reads sent with stack-grid dumps, by outcome (ok: a view; off: "
                              "nothing to read, e.g. torch not loaded, recorder off or empty; error: the dump or "
                              "its parse failed, or the view was rejected here as malformed)", ("outcome",)),
    "flight_recorder_entries": ("Entries the ranks' stack dumpers read from their Flight Recorders (torch's dump "
                                "of the whole ring, summed)", ()),
    "flight_recorder_read_seconds_sum": ("Dumper-thread time the ranks spent reading their Flight Recorders "
                                         "(the mean: divide by flight_recorder_views)", ()),
}
GAUGES = {
    "lag_seconds": ("Now minus the send time of the newest batch, by signal", ("signal",)),
    "window_close_seconds_max": ("Longest time to close and summarise one window", ()),
    "flight_recorder_read_seconds_max": ("Longest Flight Recorder read by a rank's stack dumper", ()),
    "open_windows": ("Windows open now", ()),
    "open_streams": ("Ingest streams open now", ()),
    "queue_depth": ("Validated batches waiting for the processing thread", ()),
    "spool_bytes": ("Bytes held in a sink's on-disk spool", ("sink",)),
    "ranks": ("Ranks seen", ()),
    "store_backlog": ("Windows waiting to be retried into the local store", ()),
    "collector_dropped": ("Batches the rank's collector dropped (its own running total)", ("job", "rank")),
}


class SelfMetrics:
    """Thread-safe counters and gauges, exported by a scrape-time collector."""

    def __init__(self, prefix: str = "trainscope_processor", *, max_job_series: int = 1024) -> None:
        self.prefix = prefix
        self.max_job_series = max_job_series
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple[str, ...]], float] = {}
        self._touched: dict[tuple[str, tuple[str, ...]], float] = {}  # per-job series: last update

    def _key(self, name: str, labels: dict[str, str], table: dict) -> tuple[str, tuple[str, ...]]:
        spec = table.get(name)
        if spec is None:
            raise KeyError(f"unknown self-metric {name!r}")
        names = spec[1]
        if set(labels) != set(names):
            raise KeyError(f"{name} takes labels {names}, got {tuple(labels)}")
        return name, tuple(str(labels[n]) for n in names)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = self._key(name, labels, COUNTERS)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        key = self._key(name, labels, GAUGES)
        with self._lock:
            self._values[key] = float(value)

    def set_max(self, name: str, value: float, **labels: str) -> None:
        key = self._key(name, labels, GAUGES)
        with self._lock:
            if "job" in labels and key not in self._touched:
                # made at 0 too: increase() and rate() see a counter's first drops only from a
                # sample before them (a series born at 3 shows no increase to an alert)
                if len(self._touched) >= self.max_job_series:
                    over = ("job_series_refused", ())
                    self._values[over] = self._values.get(over, 0.0) + 1
                    return
            self._values[key] = max(self._values.get(key, 0.0), float(value))
            if "job" in labels:
                self._touched[key] = time.monotonic()

    def expire_jobs(self, idle_s: float, now: float | None = None) -> int:
        """Forget per-job series not updated for ``idle_s`` (a finished job's ranks must not be
        exported forever); returns how many were removed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [k for k, t in self._touched.items() if now - t >= idle_s]
            for k in old:
                del self._touched[k]
                self._values.pop(k, None)
        return len(old)

    def get(self, name: str, **labels: str) -> float:
        """Current value (0 if never set). With no labels, the sum over all label sets."""
        with self._lock:
            if not labels and (COUNTERS.get(name) or GAUGES.get(name, ("", ())))[1]:
                return sum(v for (n, _), v in self._values.items() if n == name)
            table = COUNTERS if name in COUNTERS else GAUGES
            return self._values.get(self._key(name, labels, table), 0.0)

    def snapshot(self) -> dict[str, float]:
        """Flat ``name{label=value}`` -> value, for logs and tests."""
        with self._lock:
            items = list(self._values.items())
        out = {}
        for (name, vals), v in items:
            spec = COUNTERS.get(name) or GAUGES[name]
            labels = ",".join(f"{k}={val}" for k, val in zip(spec[1], vals))
            out[f"{name}{{{labels}}}" if labels else name] = v
        return out

    # prometheus_client custom-collector protocol: built at scrape time.
    def collect(self) -> Iterator[Metric]:
        with self._lock:
            items = list(self._values.items())
        for table, family in ((COUNTERS, CounterMetricFamily), (GAUGES, GaugeMetricFamily)):
            for name, (doc, label_names) in table.items():
                fam = family(f"{self.prefix}_{name}", doc, labels=list(label_names))
                for (n, vals), v in items:
                    if n == name:
                        fam.add_metric(list(vals), v)
                yield fam

    def describe(self) -> Iterable[Metric]:
        return []


#: The deep-dive control path's events (``processor/control.py``, ``ControlHub.stats``), exported at 0
#: before they happen so that ``increase()`` sees the first one; a key the hub adds later is exported too.
DEEP_DIVE_EVENTS = (
    "subscribed", "subscribers_refused", "requests_accepted", "requests_refused", "commands_sent",
    "commands_dropped", "reports", "reports_unknown", "summaries", "summaries_refused", "summaries_dropped",
    "summary_errors", "manifest_errors", "auth_rejected")


class CounterView:
    """A scrape-time collector over a plain ``Counter`` another part keeps (``ControlHub.stats``):
    one family ``<prefix>_<name>_total{<label>}``, a sample per key (``keys`` at 0 before they are counted).
    The counter is read, never written; keys are the code's own event names (a bounded set)."""

    def __init__(self, counts, name: str, doc: str, label: str, *, keys: Iterable[str] = (),
                 prefix: str = "trainscope_processor") -> None:
        self.counts, self.name, self.doc, self.label = counts, f"{prefix}_{name}", doc, label
        self.keys = tuple(keys)

    def collect(self) -> Iterator[Metric]:
        items: list = []
        for _ in range(5):  # the hub increments without a lock: a key added during the copy is retried
            try:
                items = list(self.counts.items())
                break
            except RuntimeError:
                continue
        values = dict.fromkeys(self.keys, 0)
        values.update(items)
        fam = CounterMetricFamily(self.name, self.doc, labels=[self.label])
        for key, v in sorted(values.items()):
            fam.add_metric([str(key)], float(v))
        yield fam

    def describe(self) -> Iterable[Metric]:
        return []


def deep_dive_control_metrics(stats) -> CounterView:
    """``trainscope_processor_deep_dive_events_total{event}`` over a ``ControlHub``'s ``stats``."""
    return CounterView(stats, "deep_dive_events",
                       "Deep-dive control path events on this processor, by event (subscribed, "
                       "subscribers_refused: control streams; requests_accepted, requests_refused; commands_sent, "
                       "commands_dropped: to collectors; reports, reports_unknown; summaries, summaries_refused, "
                       "summaries_dropped, summary_errors; manifest_errors; auth_rejected)",
                       "event", keys=DEEP_DIVE_EVENTS)
