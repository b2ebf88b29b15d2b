"""A rank's recent iteration durations, columnar (L1's history, the stall rule's median).

The service kept ``(iteration, duration_ns)`` tuples in a ``deque`` per rank: ~120 bytes per
iteration (two ints and a tuple) where 16 do, and L1 converted every rank's deque to an array
on every analysed window. At 100,000 ranks x 100 iterations that is ~1.1 GiB of tuples and
1.6 s of conversion per window (``bench_analyzer_group.py --history``). Here each rank holds
one int64 array of (iteration, duration) rows used as a ring:

1. Capacity starts small and doubles (copying the rows in order) up to ``maxlen``: a rank
   with few iterations costs little; none holds more than ``maxlen`` rows.
2. ``extend`` writes a window's marks at once (at most two slices, around the ring's end);
   past ``maxlen`` the oldest rows are overwritten, as a bounded deque drops them.
3. ``numpy.asarray(history)`` gives the rows oldest first (one copy, no Python per row), so
   readers that converted the deque (``levels.L1Iterations``) need no change; iterating
   still yields ``(iteration, duration)`` tuples for the readers that iterate.
"""
from __future__ import annotations

import numpy as np


class IterationHistory:
    """Bounded (iteration, duration ns) rows of one rank, oldest first (module steps 1-3)."""

    __slots__ = ("maxlen", "_rows", "_start", "_n")

    def __init__(self, maxlen: int, initial: int = 16) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be >= 1")
        self.maxlen = int(maxlen)
        self._rows = np.empty((min(initial, self.maxlen), 2), dtype=np.int64)
        self._start = 0
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, row) -> None:
        it, dur = row
        self.extend(np.array([it], np.int64), np.array([dur], np.int64))

    def extend(self, iterations, durations) -> None:
        """Step 2: append rows (arrays of equal length), dropping the oldest past ``maxlen``."""
        its = np.asarray(iterations, dtype=np.int64).ravel()
        durs = np.asarray(durations, dtype=np.int64).ravel()
        if its.size != durs.size:
            raise ValueError("iterations and durations differ in length")
        if its.size > self.maxlen:
            its, durs = its[-self.maxlen:], durs[-self.maxlen:]
        k = its.size
        if not k:
            return
        cap = self._rows.shape[0]
        if self._n + k > cap and cap < self.maxlen:          # step 1: grow, rows in order
            new = max(cap, 1)
            while new < min(self._n + k, self.maxlen):
                new *= 2
            rows = np.empty((min(new, self.maxlen), 2), dtype=np.int64)
            rows[:self._n] = self._ordered()
            self._rows, self._start, cap = rows, 0, rows.shape[0]
        end = (self._start + self._n) % cap
        first = min(k, cap - end)
        self._rows[end:end + first, 0], self._rows[end:end + first, 1] = its[:first], durs[:first]
        if first < k:
            self._rows[:k - first, 0], self._rows[:k - first, 1] = its[first:], durs[first:]
        over = max(0, self._n + k - cap)
        self._n = min(cap, self._n + k)
        self._start = (self._start + over) % cap

    def _ordered(self) -> np.ndarray:
        cap = self._rows.shape[0]
        if self._start + self._n <= cap:
            return self._rows[self._start:self._start + self._n]
        return np.concatenate([self._rows[self._start:], self._rows[:(self._start + self._n) % cap]])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.array(self._ordered(), copy=True)
        return out if dtype is None else out.astype(dtype, copy=False)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(iterations, durations), oldest first."""
        rows = self._ordered()
        return rows[:, 0].copy(), rows[:, 1].copy()

    def __iter__(self):
        rows = self._ordered()
        return zip(rows[:, 0].tolist(), rows[:, 1].tolist())

    def __getitem__(self, i: int) -> tuple[int, int]:
        if not -self._n <= i < self._n:
            raise IndexError("history index out of range")
        row = self._rows[(self._start + (i % self._n)) % self._rows.shape[0]]
        return int(row[0]), int(row[1])
