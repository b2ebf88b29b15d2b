"""Weak but consistent shifts (analyzer/consistent.py): a rank slower than its group window after
window is named once its median over windows stands out; one spiky window of another rank is not;
healthy groups name nobody."""
from __future__ import annotations

import numpy as np
import pytest

from test_groups_individual import job
from trainscope.analyzer.consistent import ConsistentConfig, Ratios, analyze_consistent
from trainscope.analyzer.impact import window_scale
from trainscope.proto.errors import ConfigError


def run(windows: int, slow, *, seed=0, noise=0.01, cfg=ConsistentConfig()):
    ratios, out = Ratios(cfg.windows), []
    for i in range(windows):
        jw = job(32, 4, seed=seed, index=i, noise=noise, slow=lambda r, p, i=i: slow(r, p, i))
        found, n = analyze_consistent(jw, window_scale(jw), ratios, cfg)
        out.append((found, n))
    return out


def named(found):
    return {s.rank for f in found for s in f.suspects}


def test_a_rank_consistently_slower_is_named_once_enough_windows_hold_and_a_single_spike_is_not():
    """Rank 5: mlp 12 % slower in every window; rank 9: mlp 3x in window 1 only (one spike)."""
    def slow(r, p, i):
        if p != "mlp":
            return 1.0
        return 1.12 if r == 5 else (3.0 if (r == 9 and i == 1) else 1.0)
    out = run(6, slow)
    assert all(n == 0 and not f for f, n in out[:2])          # fewer than min_windows: no comparison
    for found, n in out[2:]:
        assert n > 0 and named(found) == {5}, named(found)
    f = next(f for f in out[-1][0] if f.suspects)
    s = f.suspects[0]
    assert f.kind == "consistent_slowdown" and f.scope.phase == "mlp"
    assert s.evidence["mean_shift"] == pytest.approx(0.12, abs=0.02)
    assert s.impact_ns == pytest.approx(0.12 / 1.12 * 40e6 * 1.12, rel=0.1)   # per iteration, ns


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_groups_name_nobody_over_windows(seed):
    out = run(6, lambda r, p, i: 1.0, seed=seed, noise=0.02)
    assert all(not named(f) for f, _ in out)


def test_communication_keys_are_left_to_the_dependency_levels():
    out = run(6, lambda r, p, i: 1.5 if (r == 3 and p == "tp-allreduce") else 1.0)
    assert all(not f for f, _ in out)


def test_the_personality_floor_sets_the_smallest_shift_this_level_can_name():
    """With the default floor (2 %) and α = 1e-3 over the window's comparisons, a 5 % shift is
    below z*: this level alone does not name it (L3's per-category sums do, README)."""
    out = run(6, lambda r, p, i: 1.05 if (r == 5 and p == "mlp") else 1.0)
    assert all(5 not in named(f) for f, _ in out)


def test_config_is_validated():
    with pytest.raises(ConfigError, match="consistent.min_windows"):
        ConsistentConfig(windows=4, min_windows=5)
    with pytest.raises(ConfigError, match="consistent.min_group"):
        ConsistentConfig(min_group=2)
