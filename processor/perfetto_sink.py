"""Per-rank, per-window Perfetto traces for deep dives (ARGUS §5.1, §6.3 L4).

L1–L3 name a few suspect ranks and windows; an engineer then opens that
rank's timeline (kernels per CUDA stream, semantic phases, iterations, CPU
stacks) in the Perfetto UI. So every closed window's raw records become one
trace file in a directory or fsspec URL, under a retention bound.

The encoder (track layout, clocks, protobuf wire bytes) is in
``perfetto_encode``; this module holds the config, the file layout and the
writer with its retention.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import threading
import time
from typing import Callable

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from trainscope.processor.model import WindowOutput
from trainscope.processor.perfetto_encode import encode_window
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.errors import ConfigError
from trainscope.proto.securefs import write_private

log = logging.getLogger(__name__)

SINK = "perfetto"
SUFFIX = ".perfetto-trace"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PerfettoConfig:
    """Where traces go and how much of them is kept."""

    url: str
    """A local directory or any fsspec URL (``memory://traces``, ``file:///..``,
    ``s3://bucket/prefix``); files land at ``{job}/rank-{rank:05d}/w{index:012d}.perfetto-trace``."""
    max_bytes: int | None = 10 * 2**30
    """Retention: after each write, delete the oldest traces until the total is
    at most this (the newest is always kept); None: no size bound. It covers
    every trace under ``url``: processors sharing a prefix share the budget."""
    max_age_s: float | None = 7 * 86400.0
    """Retention: after each write, delete traces older than this; None: keep."""
    max_events_per_trace: int = 1_000_000
    """At most this many slices per trace (~45 bytes each): iterations, phases
    and stacks first, then kernels in time order; the rest are counted in
    ``drops{where="perfetto"}`` and an instant marks where the trace was cut."""
    max_stacks_per_snapshot: int = 20
    """Top folded stacks (by sample count) kept per py-spy snapshot."""
    max_pending_windows: int = 16
    """Windows queued for the background writer; beyond it a window is
    dropped and counted. 0 writes synchronously inside ``export()``."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.strip():
            raise ConfigError("perfetto.url", self.url, "must be a directory path or fsspec URL")
        protocol = fsspec.core.split_protocol(self.url)[0]
        if protocol is not None and protocol not in fsspec.available_protocols():
            raise ConfigError("perfetto.url", self.url, f"unknown fsspec protocol {protocol!r}")
        if self.max_bytes is not None and (not isinstance(self.max_bytes, int) or self.max_bytes <= 0):
            raise ConfigError("perfetto.max_bytes", self.max_bytes, "must be a positive int or None")
        if self.max_age_s is not None and not self.max_age_s > 0:
            raise ConfigError("perfetto.max_age_s", self.max_age_s, "must be > 0 or None")
        for name, low in (("max_events_per_trace", 1), ("max_stacks_per_snapshot", 0),
                          ("max_pending_windows", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"perfetto.{name}", value, f"must be an int >= {low}")


def trace_path(job_id: str, rank: int, index: int) -> str:
    """Relative path of one window's trace; the job id is made path-safe."""
    job = re.sub(r"[^A-Za-z0-9._-]", "_", job_id).strip(".") or "unknown"
    return f"{job}/rank-{rank:05d}/w{index:012d}{SUFFIX}"


def _mtime(info: dict, default: float) -> float:
    """A listed file's modification time in epoch seconds, across fsspec backends."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
    return default


class PerfettoSink:
    """Writes one Perfetto trace per closed window and enforces retention.

    ``export`` queues the window for a background writer (bounded, drop
    newest when full) so that a slow object store never stalls the
    summarising thread; encoding and IO happen there. Every failure is logged
    and counted (``sink_errors{sink="perfetto"}``, the lost slices in
    ``drops{where="perfetto"}``), never raised.

    Retention keeps an index of the traces under the URL, oldest first,
    seeded by one listing on the first write and then kept by this sink's own
    writes (an object store is not listed per window). After each write it
    deletes traces older than ``max_age_s``, then the oldest beyond ``max_bytes``.
    """

    name = SINK

    def __init__(self, config: PerfettoConfig, metrics: SelfMetrics | None = None,
                 *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else SelfMetrics()
        self._clock = clock  # wall-clock seconds, comparable with file mtimes
        try:
            self._fs, root = url_to_fs(config.url)
        except (ImportError, ValueError) as exc:
            raise ConfigError("perfetto.url", config.url, f"no usable filesystem: {exc}") from exc
        self._root = root.rstrip("/")
        self._local = isinstance(self._fs, LocalFileSystem)
        self._index: dict[str, tuple[int, float]] | None = None  # path -> (bytes, written at)
        self._total = 0
        self._pending: collections.deque[WindowOutput] = collections.deque()
        self._cv = threading.Condition()
        self._busy = self._closed = False
        self._worker: threading.Thread | None = None
        self._pid = os.getpid()

    def export(self, out: WindowOutput) -> None:
        with self._cv:
            if self._closed:
                return self._drop(out, "sink closed")
            if self.config.max_pending_windows:
                if len(self._pending) >= self.config.max_pending_windows:
                    return self._drop(out, "queue full")
                self._pending.append(out)
                self._ensure_worker()
                self._cv.notify_all()
                return
        self._write(out)

    def flush(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._worker is None or not self._worker.is_alive():
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=10.0)

    def path_for(self, out: WindowOutput) -> str:
        r = out.raw.resource
        return f"{self._root}/{trace_path(r.job_id, r.rank, out.raw.window.index)}"

    def _ensure_worker(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's thread is not ours
            self._pid, self._worker, self._busy = os.getpid(), None, False
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="trainscope-perfetto", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if not self._pending:
                    return
                out = self._pending.popleft()
                self._busy = True
            try:
                self._write(out)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _drop(self, out: WindowOutput, why: str) -> None:
        raw = out.raw
        lost = len(raw.kernels) + len(raw.phases) + len(raw.iterations) + len(raw.stacks)
        self.metrics.inc("drops", lost, where=SINK)
        log.warning("perfetto: dropped window %d of rank %d (%s)", raw.window.index, raw.resource.rank, why)

    def _write(self, out: WindowOutput) -> None:
        path = self.path_for(out)
        cfg = self.config
        try:
            data, written, dropped = encode_window(out.raw, max_events=cfg.max_events_per_trace,
                                                   max_stacks=cfg.max_stacks_per_snapshot)
        except Exception:  # a bug or a record we cannot encode: count it, go on
            log.exception("perfetto: cannot encode %s", path)
            self.metrics.inc("sink_errors", sink=SINK)
            return self._drop(out, "encode error")
        if dropped:
            self.metrics.inc("drops", dropped, where=SINK)
        try:
            self._seed_index()
            self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            if self._local:  # mkstemp then rename (0600, no planted link): readers never see half a file
                write_private(path, data)
            else:  # object stores publish a whole object at once
                self._fs.pipe_file(path, data)
        except Exception as exc:  # fsspec backends raise many types
            log.warning("perfetto: cannot write %s: %s", path, exc)
            self.metrics.inc("sink_errors", sink=SINK)
            return self._drop(out, "write error")
        for signal, n in written.items():
            if n:
                self.metrics.inc("records_out", n, sink=SINK, signal=signal)
        self.metrics.inc("bytes_out", len(data), sink=SINK, signal="trace")
        self._total -= self._index.pop(path, (0, 0.0))[0]
        self._index[path] = (len(data), self._clock())
        self._total += len(data)
        self._retain()

    def _seed_index(self) -> None:
        """List the traces already there once (a previous run's count too), oldest first."""
        if self._index is not None:
            return
        now, found = self._clock(), {}
        try:
            if self._fs.exists(self._root):
                found = self._fs.find(self._root, detail=True)
        except Exception as exc:
            log.warning("perfetto: cannot list %s: %s", self._root, exc)
            self.metrics.inc("sink_errors", sink=SINK)
        files = sorted((_mtime(info, now), path, int(info.get("size") or 0))
                       for path, info in found.items() if path.endswith(SUFFIX))
        self._index = {path: (size, t) for t, path, size in files}
        self._total = sum(size for _, _, size in files)

    def _retain(self) -> None:
        """Delete from the oldest end: past the age bound, then past the size bound."""
        cfg, index = self.config, self._index
        now = self._clock()
        while len(index) > 1:
            oldest = next(iter(index))
            size, t = index[oldest]
            too_old = cfg.max_age_s is not None and now - t > cfg.max_age_s
            if not too_old and (cfg.max_bytes is None or self._total <= cfg.max_bytes):
                break
            del index[oldest]
            self._total -= size
            try:
                self._fs.rm_file(oldest)
            except FileNotFoundError:
                pass
            except Exception as exc:
                log.warning("perfetto: cannot delete %s: %s", oldest, exc)
                self.metrics.inc("sink_errors", sink=SINK)
