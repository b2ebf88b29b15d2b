"""KernelWindow records read from their wire format with numpy (analyzer/kernel_columns.py).

Every case is checked against reading the messages one by one (``flatten_messages``, the reference):
the flat table must be identical, array for array.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from trainscope.analyzer import kernel_columns as kc
from trainscope.analyzer.l3_kernels import flatten_kernels, flatten_messages
from trainscope.proto.v1 import common_pb2, records_pb2


def same(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), f.name
        else:
            assert x == y, f.name


def window(rank: int, rng, names) -> records_pb2.KernelWindow:
    kw = records_pb2.KernelWindow(resource=common_pb2.Resource(job_id="j", rank=rank, host="h"),
                                  window=records_pb2.Window(index=3, start_ns=10**18), events=12345)
    for name in names:
        ks = kw.kernels.add(kernel=name, stream=int(rng.integers(0, 70000)), kind=1,
                            total_ns=float(rng.uniform(0, 1e12)))
        for _ in range(int(rng.integers(0, 4))):          # 0 clusters: no distribution
            p50 = float(rng.uniform(1, 1e9))
            ks.clusters.add(count=int(rng.integers(1, 2**40)), p50_ns=p50, p99_ns=p50 * 1.5,
                            min_ns=p50 / 2, max_ns=float(rng.choice([0.0, p50 * 3])))
        ks.count = sum(c.count for c in ks.clusters)
    return kw


def test_wire_columns_equal_the_messages_on_varied_records():
    rng = np.random.default_rng(5)
    names = ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas", "k", "",
             "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ünïcødé_kernel_✓", "x" * 300, "Memcpy DtoH"]
    kernels = {r: window(r, rng, [names[i] for i in rng.permutation(len(names))]) for r in (9, 0, 4, 2)}
    same(flatten_kernels(kernels), flatten_messages(kernels))
    # a rank without kernels, an empty dict, and invalid clusters (dropped the same way)
    kernels[7] = records_pb2.KernelWindow()
    bad = kernels[0].kernels.add(kernel="bad", stream=1)
    bad.clusters.add(count=5, p50_ns=0.0, p99_ns=10.0)
    bad.clusters.add(count=0, p50_ns=5.0, p99_ns=10.0)
    same(flatten_kernels(kernels), flatten_messages(kernels))
    same(flatten_kernels({}), flatten_messages({}))


def test_unknown_fields_are_skipped_and_a_repeated_scalar_keeps_the_last():
    kw = records_pb2.KernelWindow()
    ks = kw.kernels.add(kernel="a", stream=2, total_ns=5.0)
    ks.clusters.add(count=3, p50_ns=10.0, p99_ns=20.0)
    # field 99 (varint), field 98 (bytes), field 97 (fixed32) appended; then stream sent again
    extra = bytes([0x98, 0x06, 0x05, 0x92, 0x06, 0x02, 0x41, 0x42, 0x8D, 0x06, 1, 2, 3, 4, 0x10, 0x07])
    data = kw.SerializeToString()
    ks_bytes = ks.SerializeToString() + extra
    data = bytes([0x1A, len(ks_bytes)]) + ks_bytes
    parsed = records_pb2.KernelWindow.FromString(data)
    assert parsed.kernels[0].stream == 7                   # protobuf's own reading: the last wins
    c = kc.columns_from_bytes(data, np.array([0]), np.array([0, len(data)]))
    assert c.keys == [("a", 7)] and c.cl_count.tolist() == [3.0] and c.dist_total_ns.tolist() == [5.0]
    same(flatten_kernels({0: parsed}), flatten_messages({0: parsed}))


def test_bytes_it_cannot_read_raise_and_flatten_falls_back(monkeypatch):
    # a varint over 8 bytes (a count of 2^60), a truncated message, a group
    kw = records_pb2.KernelWindow()
    kw.kernels.add(kernel="a", stream=1).clusters.add(count=2**60, p50_ns=10.0, p99_ns=20.0)
    data = kw.SerializeToString()
    with pytest.raises(kc.WireError):
        kc.columns_from_bytes(data, np.array([0]), np.array([0, len(data)]))
    same(flatten_kernels({0: kw}), flatten_messages({0: kw}))
    with pytest.raises(kc.WireError):
        kc.columns_from_bytes(data[:-3], np.array([0]), np.array([0, len(data) - 3]))
    group = bytes([0x1B, 0x1C])                             # start and end group of field 3
    with pytest.raises(kc.WireError):
        kc.columns_from_bytes(group, np.array([0]), np.array([0, 2]))


def test_a_hash_collision_is_caught_not_trusted(monkeypatch):
    # every name hashes alike: the byte-for-byte check must see that "ab" is not "ba"
    monkeypatch.setattr(kc, "_HASH_K", np.zeros(8, dtype=np.uint64))
    kernels = {}
    for r in range(4):
        kw = records_pb2.KernelWindow()
        for name in ("ab", "ba"):
            kw.kernels.add(kernel=name, stream=0).clusters.add(count=1, p50_ns=5.0, p99_ns=6.0)
        kernels[r] = kw
    with pytest.raises(kc.WireError):
        kc.kernel_columns(kernels)
    t = flatten_kernels(kernels)                            # the message path answers
    assert t.keys == (("ab", 0), ("ba", 0))
    same(t, flatten_messages(kernels))
