import numpy as np
import pytest

from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import BadInput
from trainscope.proto.model import coords_for_rank
from trainscope.proto.errors import ConfigError


def test_round_trip_preserves_every_column():
    rng = np.random.default_rng(0)
    n = 10_000
    cols = KernelColumns.build(
        ["gemm", "nccl:all_reduce", "memcpy"], rng.integers(0, 2**62, n), rng.integers(1, 2**40, n),
        rng.integers(0, 3, n), rng.integers(0, 64, n), rng.integers(0, 3, n), device=3)
    back = KernelColumns.from_pb(type(cols.to_pb()).FromString(cols.to_pb().SerializeToString()))
    assert back.names == cols.names and back.device == 3
    for name in ("start_ns", "duration_ns", "name_id", "stream", "kind"):
        np.testing.assert_array_equal(getattr(back, name), getattr(cols, name))


def test_empty_batch_round_trips():
    assert len(KernelColumns.from_pb(KernelColumns.empty().to_pb())) == 0


def test_mismatched_column_lengths_are_rejected():
    m = KernelColumns.build(["a"], [1, 2], [5, 6], [0, 0], [7, 7]).to_pb()
    m.stream = np.array([7], "<u4").tobytes()
    with pytest.raises(BadInput) as e:
        KernelColumns.from_pb(m)
    assert e.value.reason == "column_length"


def test_ragged_bytes_are_rejected():
    m = KernelColumns.build(["a"], [1], [5], [0], [7]).to_pb()
    m.duration_ns = m.duration_ns[:-1]
    with pytest.raises(BadInput, match="not a multiple"):
        KernelColumns.from_pb(m)


def test_name_id_outside_string_table_is_rejected():
    m = KernelColumns.build(["a"], [1, 2], [5, 6], [0, 1], [7, 7]).to_pb()
    with pytest.raises(BadInput) as e:
        KernelColumns.from_pb(m)
    assert e.value.reason == "name_id"


def test_megatron_order_coordinates():
    # tp-cp-ep-dp-pp: consecutive ranks differ in tp first, pp is slowest.
    c = coords_for_rank(13, 32, tp=2, pp=2)
    assert (c.tp, c.dp, c.pp) == (1, 6, 0) and c.dp_size == 8
    c = coords_for_rank(31, 32, tp=2, pp=2)
    assert (c.tp, c.dp, c.pp) == (1, 7, 1)
    with pytest.raises(ConfigError, match="topology"):
        coords_for_rank(0, 30, tp=4)
    with pytest.raises(ConfigError, match="order"):
        coords_for_rank(0, 8, order="tp-dp-pp")
