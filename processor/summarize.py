"""Turn a closed window into the compact records that leave the processor.

Kernels: one ``KernelStats`` per (kernel, stream) holding its duration
clusters (count, p50, p99, min, max, and ``shape``: p10/p25/p75/p90 packed by
``trainscope.proto.cluster_shape``) from KDE valley clustering (ARGUS §5.2),
computed for all keys of the window in one vectorised call. Phases and
iterations: plain order statistics per name. Stacks: folded stacks merged over
the window's snapshots, most frequent first, bounded.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from trainscope.processor import kde
from trainscope.processor.kernel_names import KernelIds, NameTable
from trainscope.processor.model import ClosedWindow, WindowOutput
from trainscope.proto import cluster_shape
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import records_pb2, telemetry_pb2


_U32 = 2**32 - 1


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SummaryConfig:
    kde: kde.KdeConfig = dataclasses.field(default_factory=kde.KdeConfig)
    """Clustering parameters (ARGUS §5.2 filters)."""
    max_stacks: int = 50
    """Folded stacks kept per window and rank, most frequent first."""
    names_inline: bool = False
    """Keep kernel names in the windows beside their ids (for consumers older than the
    kernel-name dictionary, ``processor/kernel_names.py``); off: ids only."""

    def __post_init__(self) -> None:
        if self.max_stacks < 0:
            raise ConfigError("summary.max_stacks", self.max_stacks, "must be >= 0")


def _keys(name_id: np.ndarray, stream: np.ndarray, n_names: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (name id, stream) keys of a window, sorted, as ``name_id << 32 | stream``
    (uint64), and each record's key index: what ``numpy.unique(composite, return_inverse=True)``
    gives, without its sort of every record.

    1. streams are few and small: number them densely through one bincount of the stream ids;
    2. a dense key ``name_id * streams + stream number`` orders records exactly as the composite
       does; 3. one bincount over the dense keys finds the keys present, a cumulative count
       numbers them. Falls back to ``numpy.unique`` when stream ids or the dense key space are
       too large for a bincount to be cheap.
    """
    n = name_id.shape[0]
    smax = int(stream.max())
    if smax < 1 << 16:
        seen = np.bincount(stream, minlength=smax + 1)
        streams = np.flatnonzero(seen)
        ns = streams.shape[0]
        if n_names * ns <= 4 * n + (1 << 16):
            number = np.zeros(smax + 1, np.int64)
            number[streams] = np.arange(ns)
            dense = name_id.astype(np.int64) * ns + number[stream]
            present = np.flatnonzero(np.bincount(dense, minlength=n_names * ns))
            index = np.zeros(n_names * ns, np.intp)
            index[present] = np.arange(present.shape[0])
            uniq = ((present // ns).astype(np.uint64) << np.uint64(32)) | streams[present % ns].astype(np.uint64)
            return uniq, index[dense]
    composite = (name_id.astype(np.uint64) << np.uint64(32)) | stream.astype(np.uint64)
    return np.unique(composite, return_inverse=True)


class Summarizer:
    def __init__(self, config: SummaryConfig = SummaryConfig()) -> None:
        self.config = config
        self.ids = KernelIds()

    def __call__(self, cw: ClosedWindow) -> WindowOutput:
        res = cw.resource.to_pb()
        names: list[NameTable] = []
        out = WindowOutput(
            raw=cw,
            kernels=self.kernels(cw, res, names),
            kernel_names=names[0] if names else None,
            phases=self.phases(cw, res),
            iterations=self.iterations(cw, res),
            stacks=self.stacks(cw, res),
        )
        # each record names its siblings: a consumer reading the topics at different rates knows what
        # else this rank's window still owes it (Window.signals)
        emitted = [str(signal) for signal, _ in out.records()]
        for _, rec in out.records():
            rec.window.signals[:] = emitted
        return out

    def kernels(self, cw: ClosedWindow, res, names_out: list | None = None) -> records_pb2.KernelWindow | None:
        """1. key = (name id, stream); 2. cluster every key at once; 3. one KernelStats per key,
        with its kernel-name dictionary id (the window's entries appended to ``names_out``)."""
        k = cw.kernels
        n = len(k)
        if not n:
            return None
        uniq, inv = _keys(k.name_id, k.stream, len(k.names))
        dur = k.duration_ns.astype(np.float64)
        table = kde.cluster_keys(dur, inv, len(uniq), self.config.kde)
        total = np.bincount(inv, weights=dur, minlength=len(uniq))
        first = np.full(len(uniq), n, dtype=np.int64)
        np.minimum.at(first, inv, np.arange(n))
        kinds = k.kind[first]
        # rows are grouped by key: offsets of each key's first cluster row
        offsets = np.searchsorted(table.key, np.arange(len(uniq) + 1))
        out = records_pb2.KernelWindow(resource=res, window=cw.window, events=n,
                                       iterations=cw.kernel_iterations)
        cnt, p50, p99, lo, hi = (table.count.tolist(), table.p50.tolist(), table.p99.tolist(),
                                 table.min.tolist(), table.max.tolist())
        shape = cluster_shape.pack(table.min, table.max, table.quantiles).tolist()
        kid, inline = self._names(cw, uniq, names_out)
        for j, key in enumerate(uniq.tolist()):
            a, b = int(offsets[j]), int(offsets[j + 1])
            ks = out.kernels.add(
                kernel_id=kid[j], kernel=inline[j], stream=key & 0xFFFFFFFF, kind=int(kinds[j]),
                count=int(sum(cnt[a:b])), total_ns=float(total[j]),
            )
            for r in range(a, b):
                ks.clusters.add(count=cnt[r], p50_ns=p50[r], p99_ns=p99[r], min_ns=lo[r], max_ns=hi[r],
                                shape=shape[r])
        return out

    def _names(self, cw: ClosedWindow, uniq: np.ndarray, names_out: list | None) -> tuple[list[int], list[str]]:
        """Per key its dictionary id and the name it carries inline ("" unless ``names_inline``
        or its id is taken by another name: ``processor/kernel_names.py`` step 3)."""
        table = cw.kernels.names
        used = [table[i] for i in (uniq >> np.uint64(32)).tolist()]
        kid = self.ids.of(used)
        inline = used if self.config.names_inline else [n if not i else "" for n, i in zip(used, kid)]
        if names_out is not None:
            entries = {i: n for i, n in zip(kid, used) if i}
            names_out.append(NameTable(cw.resource.job_id, tuple(entries), tuple(entries.values())))
        return kid, inline

    def phases(self, cw: ClosedWindow, res) -> records_pb2.PhaseWindow | None:
        if not cw.phases:
            return None
        by_name: dict[str, list[float]] = collections.defaultdict(list)
        clock: dict[str, int] = {}
        for ph in cw.phases:
            by_name[ph.name].append(float(ph.duration_ns))
            clock.setdefault(ph.name, ph.clock)
        out = records_pb2.PhaseWindow(resource=res, window=cw.window)
        for name in sorted(by_name):
            d = np.asarray(by_name[name])
            p50, p99 = np.percentile(d, [50, 99])
            out.phases.add(
                phase=name, count=len(d), mean_ns=float(d.mean()), p50_ns=float(p50),
                p99_ns=float(p99), max_ns=float(d.max()), total_ns=float(d.sum()),
                clock=clock[name],
            )
        return out

    def iterations(self, cw: ClosedWindow, res) -> records_pb2.IterationWindow | None:
        if not cw.iterations:
            if cw.window.final:  # an empty record still tells consumers the rank is done
                return records_pb2.IterationWindow(resource=res, window=cw.window)
            return None
        marks = sorted(cw.iterations, key=lambda m: m.iteration)
        d = np.asarray([m.end_ns - m.start_ns for m in marks], dtype=np.float64)
        return records_pb2.IterationWindow(
            resource=res, window=cw.window, marks=marks,
            mean_ns=float(d.mean()), p50_ns=float(np.median(d)), max_ns=float(d.max()),
        )

    def stacks(self, cw: ClosedWindow, res) -> records_pb2.StackWindow | None:
        if not cw.stacks:
            return None
        counts: collections.Counter[tuple[str, bool]] = collections.Counter()
        samples = idle = 0
        for snap in cw.stacks:
            samples += snap.samples
            for fs in snap.stacks:
                counts[(fs.stack, fs.idle)] += fs.count
                if fs.idle:
                    idle += fs.count
        # Sums of uint32 wire counts can pass 2**32 (ingest bounds each count, not the
        # window's sum): saturate rather than let protobuf raise on the processing thread.
        out = records_pb2.StackWindow(resource=res, window=cw.window, samples=min(samples, _U32),
                                      idle_samples=min(idle, _U32))
        for (stack, is_idle), c in counts.most_common(self.config.max_stacks):
            out.stacks.append(telemetry_pb2.FoldedStack(stack=stack, count=min(c, _U32), idle=is_idle))
        return out
