"""Training iterations from ``dataloader.next()`` and ``optimizer.step()`` alone (EROICA §4.1).

A PyTorch training iteration takes one or more batches from a data loader and
then steps one or more optimizers. Watching only those two calls (wrapped by
``torch_hooks``) is enough to find iteration boundaries in unmodified code:

1. Every event is a symbol, ``D`` (a batch was taken from a data loader) or
   ``O`` (an optimizer stepped), with its host start and end times.
2. Learning. The stream is cut into candidate sequences: a candidate starts at
   a ``D`` that follows an ``O`` (or at the first ``D``) and runs to the last
   ``O`` before the next ``D``. After ``m`` (EROICA: 10) consecutive identical
   candidates that candidate is *the training iteration sequence*, e.g.
   ``DDDDO`` for four gradient-accumulation micro-batches, ``DOO`` for two
   optimizers. The ``m`` learning candidates are reported as iterations then.
3. Matching. Each complete match of the learned sequence is one iteration,
   from the start of its first ``D`` to the end of its last ``O`` (EROICA: "the
   duration from the first dataloader.next() to the last optimizer.step()").
   It is reported as soon as its last ``O`` ends.
4. Re-learning. After ``k`` (EROICA: 200) consecutive events without a
   completed match, go back to 2 (the program changed its loop, e.g. an
   evaluation phase that only reads batches).

Assumptions: both calls happen on one thread (the training loop's); a
candidate longer than ``max_sequence`` events is discarded (an evaluation
loop that never steps must not grow memory). Time stamps are the host's wall
clock (``time.time_ns``), like every other host-side signal of the collector.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

from trainscope.proto.errors import ConfigError

DATALOADER = "D"
OPTIMIZER = "O"

OnIteration = Callable[[int, int, int], None]
"""Called with (iteration number, start_ns, end_ns) for each detected iteration."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class IterationDetectorConfig:
    m: int = 10
    """Identical consecutive candidate sequences needed to learn the iteration (EROICA: 10)."""
    k: int = 200
    """Consecutive events without a completed match before re-learning (EROICA: 200)."""
    max_sequence: int = 512
    """Longest candidate sequence kept while learning; longer ones are discarded."""

    def __post_init__(self) -> None:
        if type(self.m) is not int or self.m < 1:
            raise ConfigError("iteration_detector.m", self.m, "must be an integer >= 1")
        if type(self.k) is not int or self.k < 2:
            raise ConfigError("iteration_detector.k", self.k, "must be an integer >= 2")
        if type(self.max_sequence) is not int or self.max_sequence < 2:
            raise ConfigError("iteration_detector.max_sequence", self.max_sequence, "must be an integer >= 2")


class IterationDetector:
    """Feeds on D/O events, calls ``on_iteration`` for every detected iteration.

    O(1) work per event (amortised); all state is bounded by ``m`` and
    ``max_sequence``. Not thread-safe: call it from the training thread.
    """

    def __init__(self, on_iteration: OnIteration,
                 config: IterationDetectorConfig = IterationDetectorConfig()) -> None:
        self.config = config
        self._emit = on_iteration
        self.pattern: str | None = None
        """The learned iteration sequence (e.g. ``"DO"``), None while learning."""
        self.iterations = 0
        """Iterations seen so far; also the number of the iteration in progress."""
        self.relearned = 0
        """How many times the detector went back to learning after k unmatched events."""
        self.discarded = 0
        """Candidate sequences dropped for exceeding ``max_sequence``."""
        self._start_learning()

    # ----------------------------------------------------------------- state
    def _start_learning(self) -> None:
        self.pattern = None
        self._cur: list[tuple[str, int, int]] = []
        self._prev: str | None = None
        self._same = 0
        self._runs: collections.deque[tuple[int, int]] = collections.deque(maxlen=self.config.m)
        self._pos = 0
        self._it_start = 0
        self._since_match = 0

    @property
    def current(self) -> int:
        """Number of the iteration in progress (to tag phases with)."""
        return self.iterations

    def opening(self) -> int | None:
        """The number of the iteration a ``D`` arriving now would open, None when it falls inside one.

        Read just before a ``dataloader.next()`` (the deep-dive boundary, ``collector/deep_dive.py``):
        the same number on every rank that runs the same loop.
        """
        if self.pattern is None:
            if not self._cur:
                return self.iterations
            return self.iterations + 1 if self._cur[-1][0] == OPTIMIZER else None
        return self.iterations if self._pos == 0 else None

    # ------------------------------------------------------------------ input
    def event(self, symbol: str, start_ns: int, end_ns: int) -> None:
        """One ``dataloader.next()`` (``"D"``) or ``optimizer.step()`` (``"O"``)."""
        if self.pattern is None:
            self._learn(symbol, start_ns, end_ns)
        else:
            self._match(symbol, start_ns, end_ns)

    def _learn(self, sym: str, start: int, end: int) -> None:
        cur = self._cur
        if sym == DATALOADER and cur and cur[-1][0] == OPTIMIZER:
            self._close_candidate()
            if self.pattern is not None:  # just learned: this D opens the next match
                self._match(sym, start, end)
                return
            cur = self._cur
        if not cur and sym != DATALOADER:
            return  # a candidate starts with a D
        cur.append((sym, start, end))
        if len(cur) > self.config.max_sequence:
            self.discarded += 1
            self._cur = []
            self._prev, self._same = None, 0
            self._runs.clear()

    def _close_candidate(self) -> None:
        cur, self._cur = self._cur, []
        p = "".join(s for s, _, _ in cur)
        if p == self._prev:
            self._same += 1
        else:
            self._prev, self._same = p, 1
            self._runs.clear()
        self._runs.append((cur[0][1], cur[-1][2]))
        self.iterations += 1
        if self._same >= self.config.m:
            self.pattern = p
            self._pos = 0
            self._since_match = 0
            first = self.iterations - len(self._runs)
            for i, (s, e) in enumerate(self._runs):
                self._emit(first + i, s, e)
            self._runs.clear()

    def _match(self, sym: str, start: int, end: int) -> None:
        pattern = self.pattern
        assert pattern is not None
        self._since_match += 1
        if sym == pattern[self._pos]:
            if self._pos == 0:
                self._it_start = start
            self._pos += 1
            if self._pos == len(pattern):
                n = self.iterations
                self.iterations += 1
                self._pos = 0
                self._since_match = 0
                self._emit(n, self._it_start, end)
                return
        elif sym == pattern[0]:
            self._pos, self._it_start = 1, start
        else:
            self._pos = 0
        if self._since_match >= self.config.k:
            self.relearned += 1
            self._start_learning()
            if sym == DATALOADER:
                self._cur.append((sym, start, end))


__all__ = ["DATALOADER", "OPTIMIZER", "IterationDetector", "IterationDetectorConfig", "OnIteration"]
