"""The columnar iteration history (``analyzer/history.py``) holds what a bounded deque of
(iteration, duration) tuples held, in the same order, for every reader."""
import collections

import numpy as np
import pytest

from trainscope.analyzer.history import IterationHistory


@pytest.mark.parametrize("maxlen", [1, 5, 16, 100])
def test_history_keeps_what_a_bounded_deque_keeps(maxlen):
    rng = np.random.default_rng(maxlen)
    ref = collections.deque(maxlen=maxlen)
    h = IterationHistory(maxlen, initial=2)
    it = 0
    for _ in range(60):
        k = int(rng.integers(0, 2 * maxlen + 3))
        its = np.arange(it, it + k)
        durs = rng.integers(1, 10**9, k)
        it += k
        ref.extend(zip(its.tolist(), durs.tolist()))
        h.extend(its, durs)
        assert len(h) == len(ref) and list(h) == list(ref)
        assert np.array_equal(np.asarray(h, dtype=np.int64), np.array(list(ref), dtype=np.int64).reshape(-1, 2))
        if ref:
            assert h[-1] == ref[-1] and h[0] == ref[0]
            its_a, durs_a = h.arrays()
            assert its_a.tolist() == [a for a, _ in ref] and durs_a.tolist() == [b for _, b in ref]
    assert h._rows.shape[0] <= maxlen                    # never more rows than the bound


def test_append_and_empty_history():
    h = IterationHistory(3)
    assert not h and list(h) == [] and np.asarray(h).shape == (0, 2)
    for i in range(5):
        h.append((i, 10 * i))
    assert list(h) == [(2, 20), (3, 30), (4, 40)]
    with pytest.raises(IndexError):
        h[3]
