"""The kernel-name dictionary (issue #15 item 1): windows carry ids, each name travels once per
sink, every reader resolves ids (processor/kernel_names.py, analyzer/kernel_names.py).

Real objects throughout: the summariser on kernel columns, the embedded bus, a SQLite store in
tmp_path, the wire-format reader. Kafka is in tests/integration/test_kernel_names_kafka.py.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from trainscope.analyzer import kernel_columns as kc
from trainscope.analyzer.kernel_names import NameResolver
from trainscope.analyzer.query import Query, QueryConfig
from trainscope.analyzer.sources import BusSource, StoreSource
from trainscope.processor import kernel_names as kn
from trainscope.processor.bus import BusSink, EmbeddedBus
from trainscope.processor.model import ClosedWindow
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.store import SqliteStore, StoreSink
from trainscope.processor.summarize import SummaryConfig, Summarizer
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.contracts import Signal
from trainscope.proto.model import Resource
from trainscope.proto.v1 import common_pb2, records_pb2

NAMES = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
         "Memcpy DtoH (Device -> Pinned)")


def closed(job: str, rank: int, index: int, names=NAMES, slow: float = 1.0) -> ClosedWindow:
    """One rank's window: 40 launches of each kernel on two streams (the last name 10x slower)."""
    rng = np.random.default_rng(rank * 100 + index)
    n = 40 * len(names)
    nid = np.repeat(np.arange(len(names)), 40)
    dur = (rng.normal(40_000, 400, n) * np.where(nid == 0, slow, 1.0) * np.where(nid == 2, 10, 1)).astype(np.uint64)
    k = KernelColumns.build(tuple(names), np.arange(n) * 100_000 + 1, dur, nid, np.where(nid == 1, 13, 7))
    return ClosedWindow(resource=Resource(job_id=job, rank=rank, world_size=4, host=f"h{rank}"),
                        window=records_pb2.Window(index=index, kind=records_pb2.WINDOW_KIND_ITERATIONS),
                        kernels=k)


def resolved(kw) -> list[tuple[str, int, int]]:
    return sorted((ks.kernel, ks.stream, ks.count) for ks in kw.kernels)


# -- processor -------------------------------------------------------------------------------
def test_ids_are_stable_hashes_never_zero_and_windows_carry_no_names():
    assert kn.kernel_id("gemm") == kn.kernel_id("gemm") != kn.kernel_id("gemm2")
    assert all(kn.kernel_id(n) != 0 for n in NAMES)
    out = Summarizer()(closed("j", 0, 0))
    ids = {kn.kernel_id(n) for n in NAMES}
    assert all(ks.kernel == "" and ks.kernel_id in ids for ks in out.kernels.kernels)
    assert dict(zip(out.kernel_names.ids, out.kernel_names.names)) == {kn.kernel_id(n): n for n in NAMES}
    # the old format for consumers older than the dictionary: names and ids
    inline = Summarizer(SummaryConfig(names_inline=True))(closed("j", 0, 0))
    assert sorted(ks.kernel for ks in inline.kernels.kernels) == sorted(NAMES)
    assert all(ks.kernel_id for ks in inline.kernels.kernels)
    # ids cost bytes per KernelStats; names cost more
    assert out.kernels.ByteSize() < inline.kernels.ByteSize()


def test_a_name_whose_id_another_name_took_goes_inline_and_is_counted(monkeypatch):
    monkeypatch.setattr(kn, "kernel_id", lambda name: 42)   # every name hashes alike: collisions
    s = Summarizer()
    out = s(closed("j", 0, 0))
    first = [ks for ks in out.kernels.kernels if ks.kernel_id == 42]
    inline = [ks for ks in out.kernels.kernels if ks.kernel_id == 0]
    assert len(first) == 1 and first[0].kernel == ""          # the first name keeps the id
    assert sorted(ks.kernel for ks in inline) == sorted(set(NAMES) - {out.kernel_names.names[0]})
    assert out.kernel_names.ids == (42,) and s.ids.collisions == 2
    assert {ks.kernel or out.kernel_names.names[0] for ks in out.kernels.kernels} == set(NAMES)


def test_sent_gives_only_new_entries_once_marked_and_again_after_forget():
    sent = kn.Sent(max_jobs=2)
    t = kn.NameTable("j", (1, 2), ("a", "b"))
    rec = sent.new(t)
    assert [(e.id, e.name) for e in rec.names] == [(1, "a"), (2, "b")] and rec.scheme == kn.SCHEME
    assert sent.new(t) is not None            # not marked (e.g. the write failed): sent again
    sent.mark(rec)
    assert sent.new(t) is None
    assert [e.id for e in sent.new(kn.NameTable("j", (2, 3), ("b", "c"))).names] == [3]
    sent.mark(sent.new(kn.NameTable("k", (1,), ("a",))))
    sent.mark(sent.new(kn.NameTable("l", (1,), ("a",))))       # third job: "j" forgotten (bound)
    assert sent.new(t) is not None
    sent.forget()
    assert sent.new(kn.NameTable("k", (1,), ("a",))) is not None
    assert [k for k, _ in kn.split(rec)] == ["j/0000000000000001", "j/0000000000000002"]


# -- embedded bus ----------------------------------------------------------------------------
def test_bus_sends_each_entry_once_per_job_and_the_source_resolves_names():
    bus, metrics = EmbeddedBus(), SelfMetrics()
    sink, s = BusSink(bus, metrics), Summarizer()
    for index in range(3):
        for rank in range(2):
            sink.export(s(closed("j", rank, index)))
    sink.export(s(closed("other", 0, 0, names=NAMES[:1])))
    names = bus.poll("trainscope.kernel_names.v1", 0)
    assert len(names) == 2 and metrics.get("records_out", sink="bus", signal="kernel_names") == 2
    src = BusSource(bus)
    got = src.poll()
    kernels = [rec for sig, rec in got if sig == Signal.KERNELS]
    assert len(kernels) == 7
    assert resolved(kernels[0]) == sorted([(NAMES[0], 7, 40), (NAMES[1], 13, 40), (NAMES[2], 7, 40)])
    assert resolved(kernels[-1]) == [(NAMES[0], 7, 40)]
    assert src.names.counters["names_unknown"] == 0 and src.names.held == 0


# -- the analyzer's resolver -----------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def id_window(job: str, rank: int, index: int, *names: str) -> records_pb2.KernelWindow:
    kw = records_pb2.KernelWindow(resource=common_pb2.Resource(job_id=job, rank=rank),
                                  window=records_pb2.Window(index=index))
    for n in names:
        kw.kernels.add(kernel_id=kn.kernel_id(n), stream=7, count=1)
    return kw


def phase_window(job: str, rank: int, index: int) -> records_pb2.PhaseWindow:
    return records_pb2.PhaseWindow(resource=common_pb2.Resource(job_id=job, rank=rank),
                                   window=records_pb2.Window(index=index))


def entries(job: str, *names: str, **ids) -> records_pb2.KernelNames:
    rec = records_pb2.KernelNames(job_id=job)
    for n in names:
        rec.names.add(id=ids.get("kid", kn.kernel_id(n)), name=n)
    return rec


def test_a_window_before_its_names_waits_with_its_job_and_other_jobs_go_on():
    clock = Clock()
    r = NameResolver(hold_s=5.0, clock=clock)
    out = r.resolve([(Signal.KERNELS, id_window("a", 0, 0, "gemm")), (Signal.PHASES, phase_window("a", 0, 0)),
                     (Signal.KERNELS, id_window("b", 0, 0)), (Signal.PHASES, phase_window("b", 0, 0))])
    assert [(s, rec.resource.job_id) for s, rec in out] == [(Signal.KERNELS, "b"), (Signal.PHASES, "b")]
    assert r.held == 2 and r.counters["windows_held"] == 1
    clock.t = 1.0
    assert r.resolve([]) == []                                # still no names, not yet too long
    r.add(entries("a", "gemm"))
    out = r.resolve([(Signal.PHASES, phase_window("a", 0, 1))])
    assert [s for s, _ in out] == [Signal.KERNELS, Signal.PHASES, Signal.PHASES]   # the job's order
    assert out[0][1].kernels[0].kernel == "gemm" and r.held == 0
    assert r.counters["names_unknown"] == 0


def test_an_id_never_named_is_labelled_after_hold_s_and_counted():
    clock = Clock()
    r = NameResolver(hold_s=5.0, clock=clock)
    r.add(entries("a", "gemm"))
    assert r.resolve([(Signal.KERNELS, id_window("a", 0, 0, "gemm", "mystery"))]) == []
    clock.t = 5.0
    (sig, kw), = r.resolve([])
    kid = kn.kernel_id("mystery")
    assert [ks.kernel for ks in kw.kernels] == ["gemm", f"kernel#{kid:016x}"]
    assert r.counters["names_unknown"] == 1 and r.counters["windows_labelled"] == 1 and r.held == 0
    # the bound on held records lets the oldest through at once
    r2 = NameResolver(hold_s=60.0, max_held=2, clock=clock)
    out = r2.resolve([(Signal.KERNELS, id_window("a", 0, i, "x")) for i in range(3)])
    assert len(out) == 1 and r2.held == 2 and out[0][1].kernels[0].kernel.startswith("kernel#")
    assert len(r2.flush()) == 2 and r2.held == 0


def test_bad_and_conflicting_entries_are_counted_and_the_first_name_kept(caplog):
    r = NameResolver()
    r.add(entries("a", "gemm"))
    r.add(entries("a", "not_gemm", kid=kn.kernel_id("gemm")))   # the same id, another name
    r.add(entries("a", "gemm"))                                 # a re-sent entry: no conflict
    r.add_raw(b"\xff\xff\xff")                                  # not a KernelNames
    r.add(records_pb2.KernelNames(names=[records_pb2.KernelName(id=1, name="x")]))   # no job
    r.add(entries("a", "", kid=7))
    r.add(records_pb2.KernelNames(job_id="a", names=[records_pb2.KernelName(id=0, name="zero")]))
    assert r.counters["names_conflicts"] == 1 and r.counters["names_bad"] == 4 and r.counters["names_in"] == 1
    assert "keeping the first" in caplog.text
    (_, kw), = r.resolve([(Signal.KERNELS, id_window("a", 0, 0, "gemm"))])
    assert kw.kernels[0].kernel == "gemm"
    r3 = NameResolver(max_names_per_job=1)
    r3.add(entries("a", "one", "two"))
    assert r3.counters["names_refused"] == 1 and r3.name("a", kn.kernel_id("two")) is None


# -- store, store source, query -------------------------------------------------------------
def test_store_keeps_the_dictionary_and_every_reader_gets_names(tmp_path):
    path = str(tmp_path / "store.sqlite")
    store, metrics, s = SqliteStore(path), SelfMetrics(), Summarizer()
    sink = StoreSink(store, metrics)
    for index in range(2):
        for rank in range(4):
            sink.export(s(closed("j", rank, index, slow=1.5 if rank == 2 else 1.0)))
    assert store.kernel_names("j") == {kn.kernel_id(n): n for n in NAMES}
    assert metrics.get("records_out", sink="store", signal="kernel_names") == 1   # once per job
    raw = store.raw(Signal.KERNELS, "j")
    assert b"gemm" not in b"".join(r[3] for r in raw)                          # rows hold ids only
    assert all(resolved(kw) == sorted([(NAMES[0], 7, 40), (NAMES[1], 13, 40), (NAMES[2], 7, 40)])
               for kw in store.records(Signal.KERNELS, "j"))
    got = StoreSource(path).poll()
    assert len([1 for sig, rec in got if sig == Signal.KERNELS and resolved(rec)[0][0] == NAMES[2]]) == 8
    store.close()
    with Query(QueryConfig(store_path=path)) as q:
        rows = q.kernels("j", rank=2).rows
    by = {r.kernel: r for r in rows}
    assert set(by) == set(NAMES) and by[NAMES[0]].ratio == pytest.approx(1.5, rel=0.02)


def test_wire_reader_keys_id_only_records_like_named_ones():
    """kernel_columns on id-only windows, named by the dictionary, equals the same windows with names;
    a mix of both is one key per (name, stream); an id without an entry reads as its label."""
    s = Summarizer()
    outs = {r: s(closed("j", r, 0)) for r in range(3)}
    book = dict(zip(outs[0].kernel_names.ids, outs[0].kernel_names.names))
    ids_only = {r: o.kernels for r, o in outs.items()}
    named = {}
    for r, kw in ids_only.items():
        named[r] = records_pb2.KernelWindow()
        named[r].CopyFrom(kw)
        kn.fill_names(named[r], book.get)
    mixed = {0: named[0], 1: ids_only[1], 2: named[2]}
    want = kc.kernel_columns(named)
    for got in (kc.kernel_columns(ids_only, book), kc.kernel_columns(mixed, book)):
        for f in dataclasses.fields(want):
            x, y = getattr(want, f.name), getattr(got, f.name)
            assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y), f.name
    labelled = kc.kernel_columns(ids_only)
    assert sorted(k for k, _ in labelled.keys) == sorted(kn.label(i) for i in book)
    tot = kc.totals_from_bytes(b"".join(ids_only[r].SerializeToString() for r in range(3)),
                               np.cumsum([0] + [ids_only[r].ByteSize() for r in range(3)]), book)
    assert sorted(tot.names) == sorted(NAMES)


def test_the_analyzer_exports_the_dictionary_counts_to_prometheus():
    from prometheus_client import CollectorRegistry, generate_latest

    from trainscope.analyzer.service import Analyzer, AnalyzerConfig
    bus = EmbeddedBus()
    BusSink(bus, SelfMetrics()).export(Summarizer()(closed("j", 0, 0)))
    bus.publish("trainscope.kernel_names.v1", b"j", b"\xff\xff")       # garbage on the dictionary topic
    analyzer = Analyzer(AnalyzerConfig(), BusSource(bus))
    analyzer.step(0)
    reg = CollectorRegistry()
    reg.register(analyzer.metrics)
    text = generate_latest(reg).decode()
    assert 'trainscope_analyzer_kernel_names_total{event="names_in"} 3.0' in text
    assert 'trainscope_analyzer_kernel_names_total{event="names_bad"} 1.0' in text
