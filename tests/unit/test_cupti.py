"""CUPTI kernel source: parsing of activity records, the callback/parser hand-over, bounds, and
staying off without a GPU. The records are cupti-python's own activity classes, built from
raw record structs (numpy arrays of the CUPTI record layouts), i.e. what a completed buffer
yields; a GPU test at the end runs only where a GPU is present."""
from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from trainscope.collector.cupti_source import (
    CuptiConfig, CuptiKernelSource, SlabPool, parse_records, probe)
from trainscope.proto.columnar import KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET
from trainscope.proto.errors import ConfigError

try:
    from cupti import cupti as real_cupti
except ImportError:  # pragma: no cover - cupti-python is a dependency on linux/x86_64
    real_cupti = None


def kernel(name, start, end, stream=7, device=0):
    if real_cupti is None:
        return types.SimpleNamespace(kind=10, name=name, start=start, end=end, stream_id=stream, device_id=device)
    raw = np.zeros(1, dtype=real_cupti.activity_kernel9_dtype)
    raw["kind"], raw["start"], raw["end"], raw["stream_id"], raw["device_id"] = 10, start, end, stream, device
    rec = real_cupti.ActivityKernel9.from_data(raw)
    rec.name = name
    return rec


def memcpy(copy_kind, start, end, stream=7, device=0):
    if real_cupti is None:
        return types.SimpleNamespace(kind=1, copy_kind=copy_kind, start=start, end=end, stream_id=stream,
                                     device_id=device)
    raw = np.zeros(1, dtype=real_cupti.activity_memcpy6_dtype)
    raw["kind"], raw["copy_kind"], raw["start"], raw["end"] = 1, copy_kind, start, end
    raw["stream_id"], raw["device_id"] = stream, device
    return real_cupti.ActivityMemcpy6.from_data(raw)


def memset(start, end, stream=7, device=0):
    if real_cupti is None:
        return types.SimpleNamespace(kind=2, start=start, end=end, stream_id=stream, device_id=device)
    raw = np.zeros(1, dtype=real_cupti.activity_memset4_dtype)
    raw["kind"], raw["start"], raw["end"], raw["stream_id"], raw["device_id"] = 2, start, end, stream, device
    return real_cupti.ActivityMemset4.from_data(raw)


def other(start):
    return types.SimpleNamespace(kind=4, start=start, end=start + 1, stream_id=0, device_id=0)  # DRIVER api


def buffer():
    return [kernel("ampere_sgemm_128x64_nn", 1_000, 1_500), memcpy(1, 900, 990, stream=13),
            kernel("ampere_sgemm_128x64_nn", 2_000, 2_600), memset(800, 810), other(700),
            kernel("void at::native::vectorized_elementwise_kernel<4>", 1_600, 1_650, stream=8),
            kernel("bad clock", 5_000, 4_000)]


def test_records_become_columns_sorted_with_kinds_names_streams():
    (cols,) = parse_records(buffer(), np.zeros(16, dtype=SlabPool(1, 16).take().dtype), offset_ns=10**9)
    got = [(cols.names[i], int(s) - 10**9, int(d), int(st), int(k))
           for i, s, d, st, k in zip(cols.name_id, cols.start_ns, cols.duration_ns, cols.stream, cols.kind)]
    assert got == [
        ("Memset", 800, 10, 7, KIND_MEMSET),
        ("Memcpy HtoD", 900, 90, 13, KIND_MEMCPY),
        ("ampere_sgemm_128x64_nn", 1_000, 500, 7, KIND_KERNEL),
        ("void at::native::vectorized_elementwise_kernel<4>", 1_600, 50, 8, KIND_KERNEL),
        ("ampere_sgemm_128x64_nn", 2_000, 600, 7, KIND_KERNEL),
    ]
    assert len(cols.names) == 4  # one string-table entry per distinct name


def test_one_batch_per_device_and_slabs_smaller_than_the_buffer():
    recs = [kernel(f"k{i % 3}", i * 10, i * 10 + 5, device=i % 2) for i in range(100)]
    pool = SlabPool(1, 16)
    batches = parse_records(recs, pool.take())
    assert sum(len(b) for b in batches) == 100
    assert {b.device for b in batches} == {0, 1}
    for b in batches:
        assert all(b.names[i] in ("k0", "k1", "k2") for i in b.name_id)


class FakeCupti:
    """The slice of ``cupti.cupti`` the source uses; the test plays CUPTI's thread.

    A stand-in because the real CUPTI needs a GPU and a CUDA driver, which these
    machines do not have (the GPU test at the end uses the real one where it can)."""

    def __init__(self, clock_ns=5_000):
        self.enabled, self.flushes, self.period = set(), [], None
        self.callbacks = None
        self.clock_ns = clock_ns

    def activity_register_callbacks(self, requested, completed):
        self.callbacks = (requested, completed)

    def activity_enable(self, kind):
        self.enabled.add(int(kind))

    def activity_disable(self, kind):
        self.enabled.discard(int(kind))

    def activity_flush_period(self, ms):
        self.period = ms

    def activity_flush_all(self, flag):
        self.flushes.append(flag)

    def get_timestamp(self):
        return self.clock_ns


def test_callback_hands_over_and_the_parser_thread_emits_on_the_wall_clock():
    fake, got = FakeCupti(), []
    src = CuptiKernelSource(CuptiConfig(flush_period_ms=500), cupti=fake)
    before = time.time_ns()
    src.start(got.append)
    assert src.running and src.reason == ""
    assert fake.enabled == {10, 1, 2} and fake.period == 500
    requested, completed = fake.callbacks
    assert requested() == (8 << 20, 0)
    completed(buffer())
    assert src.drain(5)
    (cols,) = got
    first = int(cols.start_ns[0])  # Memset at CUPTI time 800 = 4,200 ns before the offset reading
    assert before - 10**7 < first + (5_000 - 800) < time.time_ns() + 10**7
    src.stop()
    assert fake.flushes == [1] and fake.enabled == set() and not src.running
    assert src.stats["buffers"] == 1 and src.stats["records"] == 7 and src.stats["batches"] == 1


def test_a_full_pool_drops_whole_buffers_and_counts_their_records():
    fake, release = FakeCupti(), threading.Event()
    calls = []

    def slow_emit(cols):
        calls.append(len(cols))
        release.wait(10)  # the exporter side is stuck: the parser cannot take more

    src = CuptiKernelSource(CuptiConfig(pool_slots=2, flush_period_ms=0), cupti=fake)
    src.start(slow_emit)
    _, completed = fake.callbacks
    t0 = time.perf_counter()
    for _ in range(10):
        completed(buffer())  # CUPTI's thread never waits
    assert time.perf_counter() - t0 < 0.5
    assert src.stats["dropped_records"] == 8 * 7
    release.set()
    assert src.drain(5)
    assert src.stats["buffers"] == 2
    src.stop()


def test_parse_errors_are_counted_and_the_slot_returns():
    fake = FakeCupti()
    src = CuptiKernelSource(CuptiConfig(pool_slots=1), cupti=fake)
    src.start(lambda c: None)
    _, completed = fake.callbacks
    completed([types.SimpleNamespace(kind=10)])  # no timestamps: a broken record
    assert src.drain(5) and src.stats["parse_errors"] == 1
    completed(buffer())
    assert src.drain(5) and src.stats["buffers"] == 1
    src.stop()


@pytest.mark.skipif(real_cupti is None, reason="cupti-python is not installed")
def test_without_a_driver_the_source_stays_off_and_says_why():
    ok, why = probe()
    if ok:
        pytest.skip("a CUDA driver is present here")
    src = CuptiKernelSource()
    src.start(lambda c: pytest.fail("nothing may be emitted"))
    assert not src.running
    assert "driver" in src.reason.lower() or "cuda" in src.reason.lower()
    src.stop()  # harmless when off


def test_missing_cupti_module_is_reported():
    class NoCupti:
        def __getattr__(self, name):
            raise ImportError("No module named 'cupti'")

    src = CuptiKernelSource(cupti=NoCupti())
    src.start(lambda c: None)
    assert not src.running and "cupti-python is not installed" in src.reason


@pytest.mark.parametrize("kw", [dict(buffer_bytes=10), dict(pool_slots=0), dict(flush_period_ms=-1),
                                dict(resync_s=0)])
def test_bad_config_names_the_setting(kw):
    with pytest.raises(ConfigError, match="cupti."):
        CuptiConfig(**kw)


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    ok, why = probe()
    return None if ok else f"CUPTI unavailable: {why}"


@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_gpu_kernels_and_copies_are_captured():  # pragma: no cover - needs a GPU
    import torch

    got = []
    src = CuptiKernelSource(CuptiConfig(flush_period_ms=100))
    src.start(got.append)
    assert src.running, src.reason
    a = torch.randn(512, 512, device="cuda")
    for _ in range(10):
        a = a @ a
        a /= a.norm()
    a.cpu()
    torch.cuda.synchronize()
    src.stop()
    assert src.drain(10)
    names = {c.names[i] for c in got for i in c.name_id}
    kinds = {int(k) for c in got for k in c.kind}
    assert KIND_KERNEL in kinds and KIND_MEMCPY in kinds
    assert any("gemm" in n.lower() or "sgemm" in n.lower() for n in names), names
    now = time.time_ns()
    assert all(now - 60 * 10**9 < int(c.start_ns.min()) <= now for c in got)


# --- issue #11 item 10: demangled names, the cupti-python floor -----------------------------------
KINETO_NAME = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
               "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)")
MANGLED = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEENS_6detail5ArrayIPcLi1EEEEEviT0_T1_"


def test_cupti_names_are_demangled_as_kineto_shows_them():
    """The expected string is the name this kernel has in a real PyTorch-profiler trace
    (../shared/data/kineto), so CUPTI and replayed traces agree on kernel identity."""
    from trainscope.collector.cupti_source import demangle
    (cols,) = parse_records([kernel(MANGLED, 1_000, 1_500), kernel("ampere_sgemm_128x64_nn", 2_000, 2_100),
                             kernel(MANGLED, 3_000, 3_200)], SlabPool(1, 16).take())
    assert sorted(cols.names) == sorted([KINETO_NAME, "ampere_sgemm_128x64_nn"])
    assert [cols.names[i] for i in cols.name_id] == [KINETO_NAME, "ampere_sgemm_128x64_nn", KINETO_NAME]
    assert demangle("_Znot_a_valid_name") == "_Znot_a_valid_name"  # unparsable: kept as it came
    assert demangle("Memcpy HtoD (Pageable -> Device)") == "Memcpy HtoD (Pageable -> Device)"
    demangle.cache_clear()
    for _ in range(3):
        demangle(MANGLED)
    assert demangle.cache_info().hits == 2  # off the hot path: once per distinct name


@pytest.mark.parametrize("version,ok", [("13.0.1", False), ("13.2.0", False), ("12.8.0", False),
                                        ("13.3.1", True), ("13.4.0", True), ("14.0.0", True)])
def test_the_cupti_python_floor(monkeypatch, version, ok, caplog):
    import importlib.metadata

    from trainscope.collector import cupti_source
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    problem = cupti_source.version_problem()
    assert (problem is None) == ok
    if not ok:
        assert version in problem and ">=13.3.1" in problem
        src = CuptiKernelSource()
        with caplog.at_level("WARNING", logger="trainscope.collector.cupti_source"):
            src.start(lambda cols: None)
        assert not src.running and src.reason == problem
        assert any(version in r.getMessage() for r in caplog.records)
        assert probe() == (False, problem)
