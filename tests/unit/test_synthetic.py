"""Synthetic kernel source: determinism, multimodality, slowdowns, framing."""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.collector.sources import KernelSource, SyntheticKernelSource
from trainscope.collector.sources.synthetic import (
    SyntheticSpec,
    synthesize,
    synthetic_iterations,
    synthetic_kernels,
    synthetic_phases,
)
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1.telemetry_pb2 import PHASE_CLOCK_CUDA_EVENT

COLUMNS = ("start_ns", "duration_ns", "name_id", "stream", "kind")


def same(a, b) -> bool:
    return a.names == b.names and all(np.array_equal(getattr(a, c), getattr(b, c)) for c in COLUMNS)


def test_deterministic_per_seed():
    a = synthetic_kernels(n_events=5000, seed=3)
    b = synthetic_kernels(n_events=5000, seed=3)
    c = synthetic_kernels(n_events=5000, seed=4)
    assert same(a, b)
    assert not np.array_equal(a.duration_ns, c.duration_ns)
    assert len(a) == 5000 and a.start_ns.dtype == np.uint64


def _modes(log_d: np.ndarray, min_gap: float = np.log(2)) -> list[np.ndarray]:
    """Split sorted log durations at gaps wider than ``min_gap``."""
    s = np.sort(log_d)
    cuts = np.flatnonzero(np.diff(s) > min_gap) + 1
    return np.split(s, cuts)


@pytest.mark.parametrize("modes", [1, 2, 3])
def test_each_key_has_the_requested_modes(modes):
    k = synthetic_kernels(n_events=6000, n_keys=5, modes_per_key=modes, seed=1)
    log_d = np.log(k.duration_ns.astype(float))
    for key in range(5):
        groups = _modes(log_d[(k.name_id == key)])
        assert len(groups) == modes
        assert min(len(g) for g in groups) >= 0.9 * len(log_d) / 5 / modes
        medians = [np.exp(np.median(g)) for g in groups]
        assert all(hi / lo > 3 for lo, hi in zip(medians, medians[1:]))  # several-fold apart


def test_modes_sit_at_different_positions_in_the_iteration():
    t = synthesize(SyntheticSpec(n_events=24 * 10, n_keys=8, modes_per_key=3))
    per_iter = t.mode.reshape(10, 24)
    assert (per_iter == per_iter[0]).all()  # the same sequence every iteration
    first_key0 = np.flatnonzero(t.key[:24] == 0)
    assert t.mode[first_key0].tolist() == [0, 1, 2]


def test_slow_factor_scales_chosen_keys_only():
    base = synthesize(SyntheticSpec(n_events=4000, n_keys=6, seed=7))
    slow = synthesize(SyntheticSpec(n_events=4000, n_keys=6, seed=7, slow_factor=2.5, slow_keys=(1, 4)))
    hit = np.isin(base.key, (1, 4))
    d0 = base.kernels.duration_ns.astype(float)
    d1 = slow.kernels.duration_ns.astype(float)
    assert np.array_equal(d0[~hit], d1[~hit])
    np.testing.assert_allclose(d1[hit] / d0[hit], 2.5, rtol=1e-3)
    assert slow.iterations[-1].end_ns > base.iterations[-1].end_ns  # the timeline stretches


def test_timeline_iterations_and_phases_are_consistent():
    spec = dict(n_events=1000, n_keys=4, modes_per_key=3, seed=2, start_ns=10**12, first_iteration=100)
    k = synthetic_kernels(**spec)
    its = synthetic_iterations(**spec)
    phases = synthetic_phases(**spec)
    start = k.start_ns.astype(np.int64)
    end = start + k.duration_ns.astype(np.int64)
    assert start[0] == 10**12
    assert np.all(start[1:] >= end[:-1])  # back to back, no overlap
    slots = 12
    assert [m.iteration for m in its] == list(range(100, 100 + 1000 // slots))
    for m in its:
        inside = (start >= m.start_ns) & (end <= m.end_ns)
        assert inside.sum() == slots
    by_iter: dict[int, list] = {}
    for p in phases:
        assert p.clock == PHASE_CLOCK_CUDA_EVENT and p.duration_ns > 0
        by_iter.setdefault(p.iteration, []).append(p)
    assert sorted(by_iter) == [m.iteration for m in its]
    for m in its:
        ps = by_iter[m.iteration]
        assert [p.name for p in ps] == ["forward", "backward", "optimizer"]
        assert ps[0].start_ns == m.start_ns and ps[-1].start_ns + ps[-1].duration_ns == m.end_ns
        assert all(a.start_ns + a.duration_ns <= b.start_ns for a, b in zip(ps, ps[1:]))


def test_large_stream_is_vectorised_and_sorted():
    k = synthetic_kernels(n_events=300_000, n_keys=64, seed=0)
    assert len(k) == 300_000 and len(k.names) == 64
    assert np.all(np.diff(k.start_ns.astype(np.int64)) > 0)
    assert set(np.unique(k.stream).tolist()) == {7, 8}


def test_synthetic_source_emits_everything_in_order():
    spec = SyntheticSpec(n_events=1000, seed=5)
    src = SyntheticKernelSource(spec, chunk=300)
    assert isinstance(src, KernelSource) and src.name == "synthetic"
    batches: list = []
    src.start(batches.append)
    assert [len(b) for b in batches] == [300, 300, 300, 100]
    assert np.array_equal(np.concatenate([b.duration_ns for b in batches]),
                          synthetic_kernels(n_events=1000, seed=5).duration_ns)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        (dict(n_events=-1), "synthetic.n_events"),
        (dict(n_events=10, n_keys=0), "synthetic.n_keys"),
        (dict(n_events=10, slow_keys=(8,)), "synthetic.slow_keys"),
        (dict(n_events=10, slow_factor=0.0), "synthetic.slow_factor"),
        (dict(n_events=10, mode_ratio=1.0), "synthetic.mode_ratio"),
        (dict(n_events=10, n_keys=1, modes_per_key=1), "synthetic.phase_names"),
    ],
)
def test_bad_spec_names_the_setting(kwargs, setting):
    with pytest.raises(ConfigError) as e:
        SyntheticSpec(**kwargs)
    assert e.value.setting == setting


def test_empty_and_partial_streams():
    assert len(synthetic_kernels(n_events=0)) == 0
    assert synthetic_iterations(n_events=10, n_keys=4, modes_per_key=3) == ()  # no complete iteration
    assert len(synthetic_iterations(n_events=25, n_keys=4, modes_per_key=3)) == 2
