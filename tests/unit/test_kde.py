"""KDE valley clustering of kernel durations (ARGUS §5.2): modes, members, statistics."""
from __future__ import annotations

import math

import numpy as np
import pytest

from trainscope.processor.kde import ClusterTable, KdeConfig, cluster_keys
from trainscope.proto.errors import BadInput, ConfigError

LN = math.log


def one_key(d, config=KdeConfig()) -> ClusterTable:
    d = np.asarray(d)
    return cluster_keys(d, np.zeros(d.shape[0], np.int64), 1, config)


def modes(rng, spec, sigma=0.1):
    """Samples of a lognormal mixture: spec = [(median, n), ...]; returns (values, labels)."""
    vals = [rng.lognormal(LN(m), sigma, n) for m, n in spec]
    labels = np.repeat(np.arange(len(spec)), [n for _, n in spec])
    return np.concatenate(vals), labels


def assert_matches_numpy(table: ClusterTable, d, keys=None):
    """Every row's count/p50/p99/min/max equals numpy on the row's members.

    Members of a row are the key's values in [min, max]; the rows of a key
    must tile its sorted values, so this also checks that they partition it.
    """
    d = np.asarray(d, dtype=np.float64)
    keys = np.zeros(d.shape[0], np.int64) if keys is None else np.asarray(keys)
    for k in np.unique(keys):
        vals = np.sort(d[keys == k])
        rows = table.rows(int(k))
        assert table.count[rows].sum() == vals.size
        start = 0
        for i in range(rows.start, rows.stop):
            members = vals[start:start + table.count[i]]
            start += table.count[i]
            assert members[0] == table.min[i] and members[-1] == table.max[i]
            p10, p25, p50, p75, p90, p99 = np.percentile(members, [10, 25, 50, 75, 90, 99])
            assert table.p50[i] == p50 and table.p99[i] == p99
            np.testing.assert_allclose(table.quantiles[i], [p10, p25, p75, p90], rtol=1e-12)
        # Boundaries fall between distinct values: no value is in two clusters.
        assert np.all(table.max[rows][:-1] < table.min[rows][1:])


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field,value",
    [
        ("grid_points", 8),
        ("cells_per_bandwidth", 0.0),
        ("min_cluster_count", 0),
        ("min_cluster_frac", 0.5),
        ("min_spacing", -0.1),
        ("refine_passes", -1),
        ("min_significance", -1.0),
        ("exact_below", 1),
        ("quantum", -1.0),
    ],
)
def test_bad_config_names_the_setting(field, value):
    with pytest.raises(ConfigError) as err:
        KdeConfig(**{field: value})
    assert err.value.setting == f"kde.{field}"
    assert err.value.value == value


def test_default_config_is_valid_and_keyword_only():
    cfg = KdeConfig()
    assert cfg.exact_below >= 2 and cfg.min_spacing > 0
    with pytest.raises(TypeError):
        KdeConfig(1024)  # type: ignore[misc]


# ---------------------------------------------------------------------- modes


@pytest.mark.parametrize(
    "spec",
    [
        [(1000.0, 2000)],
        [(1000.0, 1500), (3000.0, 500)],  # 3x apart, 75/25
        [(1000.0, 1000), (10000.0, 1000)],  # 10x apart
        [(1000.0, 1000), (3000.0, 500), (9000.0, 300)],  # three modes, 3x steps
        [(50.0, 200), (500.0, 100), (5000.0, 100)],  # 10x steps, few samples
        [(1000.0, 1900), (4000.0, 100)],  # a 5% minor mode
    ],
)
def test_finds_modes_and_their_members(spec):
    rng = np.random.default_rng(len(spec) * 7 + spec[-1][1])
    d, labels = modes(rng, spec)
    t = one_key(d)
    assert len(t) == len(spec)
    assert list(t.count) == [n for _, n in spec]
    # Members by value range equal the true labels (modes are >= 3x apart).
    assigned = np.searchsorted(t.max, d, side="left")
    assert np.array_equal(assigned, labels)
    np.testing.assert_allclose(t.p50, [m for m, _ in spec], rtol=0.05)
    assert_matches_numpy(t, d)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 100, 10_000])
def test_one_mode_any_size_is_one_exact_cluster(n):
    rng = np.random.default_rng(n)
    d = rng.lognormal(LN(5000.0), 0.2, n)
    t = one_key(d, KdeConfig(split_small=False))
    assert len(t) == 1 and t.count[0] == n
    assert_matches_numpy(t, d)
    # with split_small (the default) a small key splits only at gaps of >= 1.5x (step 8b)
    t = one_key(d)
    assert_matches_numpy(t, d)
    gaps = np.diff(np.log(np.sort(d)))
    assert len(t) == (1 + int((gaps >= LN(1.5)).sum()) if n < 8 else 1)


def test_a_million_samples_one_mode():
    rng = np.random.default_rng(6)
    d = rng.lognormal(LN(20_000.0), 0.3, 1_000_000)
    t = one_key(d)
    assert len(t) == 1 and t.count[0] == d.size
    p50, p99 = np.percentile(d, [50, 99])
    assert t.p50[0] == p50 and t.p99[0] == p99
    assert t.min[0] == d.min() and t.max[0] == d.max()


@pytest.mark.parametrize(
    "name",
    ["lognormal_sigma1", "lognormal_sigma1.5_1e5", "pareto", "mode_with_pareto_tail", "small_mode_with_tail"],
)
def test_heavy_tails_are_not_split(name):
    rng = np.random.default_rng(11)
    d = {
        "lognormal_sigma1": lambda: rng.lognormal(0.0, 1.0, 10_000),
        "lognormal_sigma1.5_1e5": lambda: rng.lognormal(0.0, 1.5, 100_000),
        "pareto": lambda: (rng.pareto(1.5, 10_000) + 1.0) * 100.0,
        # 90% a tight mode, 10% a Pareto(1.5) tail starting at the mode.
        "mode_with_pareto_tail": lambda: np.concatenate(
            [rng.lognormal(0.0, 0.1, 9000), np.exp(rng.exponential(1 / 1.5, 1000))]
        ),
        "small_mode_with_tail": lambda: np.concatenate(
            [rng.lognormal(0.0, 0.1, 270), np.exp(rng.exponential(1 / 1.5, 30))]
        ),
    }[name]()
    t = one_key(d)
    assert len(t) == 1
    assert_matches_numpy(t, d)


def test_two_modes_with_small_n():
    rng = np.random.default_rng(3)
    d, labels = modes(rng, [(10.0, 10), (50.0, 10)], sigma=0.05)
    t = one_key(d)
    assert list(t.count) == [10, 10]
    assert np.array_equal(np.searchsorted(t.max, d), labels)


def test_below_exact_threshold_is_one_cluster_without_split_small():
    d = np.array([1.0, 1.0, 1.0, 100.0, 100.0, 100.0, 100.0])
    t = one_key(d, KdeConfig(exact_below=8, split_small=False))
    assert len(t) == 1 and t.count[0] == 7
    assert_matches_numpy(t, d)


def test_small_keys_split_at_wide_gaps_only():
    # step 8b: below exact_below, every gap of >= min_spacing (1.5x) is a boundary, narrower ones are not;
    # keys at or above exact_below are left to the KDE (no split between 7 calls near 10 and 1 at 20)
    d = np.array([7.0, 11, 12, 14, 149, 244, 3844, 5, 5, 5, 5, 5, 5, 5, 10, 10, 10, 10, 10, 10, 10, 20])
    k = np.array([0] * 7 + [1] * 7 + [2] * 8)
    t = cluster_keys(d, k, 3)
    assert t.count[t.rows(0)].tolist() == [1, 3, 1, 1, 1]
    assert t.count[t.rows(1)].tolist() == [7]
    assert t.count[t.rows(2)].tolist() == [8]
    assert_matches_numpy(t, d, k)


def test_all_equal_values_are_one_cluster():
    for n in (1, 5, 50, 5000):
        t = one_key(np.full(n, 1234, np.uint64))
        assert len(t) == 1 and t.count[0] == n
        assert t.p50[0] == t.p99[0] == t.min[0] == t.max[0] == 1234.0


# ---------------------------------------------------------------------- filters


def test_cluster_size_filter_drops_small_modes():
    rng = np.random.default_rng(5)
    d, _ = modes(rng, [(1000.0, 9950), (5000.0, 50)])  # a 0.5% mode
    assert len(one_key(d)) == 1  # below min_cluster_frac = 1%
    t = one_key(d, KdeConfig(min_cluster_frac=0.001))
    assert list(t.count) == [9950, 50]
    t = one_key(d, KdeConfig(min_cluster_frac=0.0, min_cluster_count=51))
    assert len(t) == 1


def test_spacing_filter_keeps_one_of_two_close_boundaries():
    rng = np.random.default_rng(9)
    # Three narrow modes 1.25x apart: two valleys only log(1.25) apart.
    d, _ = modes(rng, [(1000.0, 1000), (1250.0, 1000), (1562.5, 1000)], sigma=0.01)
    assert len(one_key(d, KdeConfig(min_spacing=0.1))) == 3
    t = one_key(d, KdeConfig(min_spacing=LN(1.5)))
    assert len(t) == 2
    assert sorted(t.count) == [1000, 2000]
    assert_matches_numpy(t, d)


def test_refinement_resolves_modes_that_scott_merges_across_a_wide_key():
    rng = np.random.default_rng(12)
    # σ of the whole key is dominated by the 30x gap, so Scott's h merges 1000 and 1700.
    d, labels = modes(rng, [(1000.0, 300), (1700.0, 300), (30000.0, 300)], sigma=0.03)
    assert list(one_key(d, KdeConfig(refine_passes=0)).count) == [600, 300]
    t = one_key(d)
    assert list(t.count) == [300, 300, 300]
    assert np.array_equal(np.searchsorted(t.max, d), labels)
    assert_matches_numpy(t, d)


def test_quantised_durations_do_not_split_at_clock_ticks():
    rng = np.random.default_rng(2)
    # Microsecond-resolution durations in ns: only 2000, 3000, ... 9000 occur.
    d = np.maximum(np.round(rng.lognormal(LN(4000.0), 0.25, 5000), -3), 1000).astype(np.uint64)
    assert np.unique(d).size < 12
    t = one_key(d)
    assert len(t) == 1
    # Without spreading ticks over their quantum the spikes become modes.
    assert len(one_key(d, KdeConfig(quantum=0.0, min_significance=0.0))) > 1
    # Genuine modes survive quantisation.
    q, _ = modes(rng, [(5000.0, 1000), (20000.0, 500), (80000.0, 300)])
    q = np.round(q, -3).astype(np.uint64)
    t = one_key(q)
    assert list(t.count) == [1000, 500, 300]
    assert_matches_numpy(t, q)


# ---------------------------------------------------------------------- many keys


def _many_keys(rng, n_keys=40):
    specs = []
    for k in range(n_keys):
        kind = k % 5
        if kind == 0:
            specs.append([(rng.uniform(2e3, 2e5), int(rng.integers(1, 8)))])  # tiny keys
        elif kind == 1:
            specs.append([(rng.uniform(2e3, 2e5), int(rng.integers(20, 3000)))])
        elif kind == 2:
            m = rng.uniform(2e3, 2e4)
            specs.append([(m, int(rng.integers(100, 2000))), (m * rng.uniform(3, 8), int(rng.integers(100, 800)))])
        elif kind == 3:
            m = rng.uniform(2e3, 2e4)
            specs.append([(m, 600), (m * 3, 400), (m * 10, 300)])
        else:
            specs.append([(rng.uniform(2e3, 2e5), 1)])
    parts, keys = [], []
    for k, spec in enumerate(specs):
        v, _ = modes(rng, spec, sigma=0.15)
        parts.append(v)
        keys.append(np.full(v.size, k))
    d, keys = np.concatenate(parts), np.concatenate(keys)
    perm = rng.permutation(d.size)
    return d[perm], keys[perm], specs


@pytest.mark.parametrize("integer", [False, True])
def test_many_keys_at_once_equal_each_key_alone(integer):
    rng = np.random.default_rng(21)
    d, keys, specs = _many_keys(rng)
    n_keys = len(specs) + 3  # keys with no samples are allowed
    cfg = KdeConfig(quantum=1.0) if integer else KdeConfig()
    if integer:
        d = np.round(d).astype(np.uint64)
    t = cluster_keys(d, keys, n_keys, cfg)
    # Rows ordered by key, then ascending p50.
    assert np.all(np.diff(t.key) >= 0)
    same = t.key[1:] == t.key[:-1]
    assert np.all(t.p50[1:][same] > t.p50[:-1][same])
    assert np.array_equal(np.bincount(t.key, t.count, minlength=n_keys), np.bincount(keys, minlength=n_keys))
    off = t.offsets(n_keys)
    assert off[-1] == len(t) and np.all(off[len(specs):] == len(t))
    for k, spec in enumerate(specs):
        alone = one_key(d[keys == k], cfg)
        mine = t.take(t.rows(k))
        for field in ("count", "p50", "p99", "min", "max"):
            assert np.array_equal(getattr(mine, field), getattr(alone, field)), (k, field)
        if sum(n for _, n in spec) >= 300:  # enough samples: the true number of modes
            assert len(mine) == len(spec), (k, spec, mine.count)
    assert_matches_numpy(t, d, keys)


def test_integer_and_float_durations_agree():
    rng = np.random.default_rng(4)
    d, keys, specs = _many_keys(rng, 15)
    d = np.round(d).astype(np.uint64)
    a = cluster_keys(d, keys, len(specs))
    b = cluster_keys(d.astype(np.float64), keys.astype(np.int32), len(specs))
    for f in ("key", "count", "p50", "p99", "min", "max"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
    assert a.count.dtype == np.int64 and a.p50.dtype == np.float64


def test_non_integer_float_durations_use_the_general_path():
    rng = np.random.default_rng(8)
    d, labels = modes(rng, [(1.5e-3, 500), (6e-3, 500)])  # seconds, not integers
    keys = np.arange(d.size) % 3
    t = cluster_keys(d, keys, 3)
    assert np.array_equal(np.bincount(t.key), [2, 2, 2])
    assert_matches_numpy(t, d, keys)


def test_empty_and_bad_input():
    t = cluster_keys(np.zeros(0), np.zeros(0, np.int64), 5)
    assert len(t) == 0 and np.array_equal(t.offsets(5), np.zeros(6))
    for d, k, n_keys, reason in [
        (np.array([1.0, 0.0]), np.array([0, 0]), 1, "duration"),
        (np.array([1.0, np.nan]), np.array([0, 0]), 1, "duration"),
        (np.array([3, 0], np.uint64), np.array([0, 0]), 1, "duration"),
        (np.array([1.0, 2.0]), np.array([0, 2]), 2, "key"),
        (np.array([1.0, 2.0]), np.array([0]), 1, "shape"),
    ]:
        with pytest.raises(BadInput) as err:
            cluster_keys(d, k, n_keys)
        assert err.value.reason == reason
