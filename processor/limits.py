"""The limits that ingest enforces at the edge, and rate-limited warnings.

Every bound a received batch must respect lives in ``IngestLimits``, so the
processor's arithmetic downstream (window indices, SQLite integers, summary
counts) never sees a value it cannot hold. The defaults and why:

==========================  ===============  =============================================
limit                       default          why
==========================  ===============  =============================================
``max_timestamp_ns``        2**62            end times stay below SQLite's 2**63 and
                                             ``start + duration`` cannot wrap a uint64
                                             (2**62 ns after the epoch is the year 2116)
``max_clock_jump_s``        600 s            a batch whose latest end is further ahead of
                                             its rank's clock than this is refused
                                             (``clock_jump``), so one bad batch cannot make
                                             every later window "late"; after
                                             ``clock_reset_after`` such batches in a row
                                             that agree, the rank's clock is re-based.
                                             Per (job, rank), whichever pid sends; a rank's
                                             first batch is held to the processor's wall
                                             clock (``live_clock``; not in ``replay``,
                                             whose traces keep their own clocks)
``max_world_size``          131,072          larger than any job; rank < world is checked too
``max_iteration``           2**40            one step per microsecond for 12 days
``max_name_chars``          4,096            kernel/phase names are truncated beyond it
``max_names_per_batch``     65,536           a string table larger than this is refused
``max_stack_chars``         65,536           a folded stack is truncated beyond it
                                             (keeping the leaf end, which names the wait)
``max_stack_samples``       10,000,000       a snapshot's sample count and each stack's
``max_seq_gap``             1,000,000        a seq further ahead of its sender's highest is
                                             refused (``seq_jump``); one further behind is
                                             a restarted sender, not a duplicate
``max_batches_remembered``  262,144          digests of recent batches kept to recognise
                                             re-sent ones: only the same bytes are a
                                             ``duplicate``, so no bad seq hides a real batch
==========================  ===============  =============================================
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

from trainscope.proto.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class IngestLimits:
    max_timestamp_ns: int = 2**62
    """Largest start or end time (ns) of any record."""
    max_clock_jump_s: float = 600.0
    """How far ahead of its rank's latest accepted end a batch may reach."""
    clock_reset_after: int = 3
    """Consecutive ``clock_jump`` batches (agreeing with each other) after which the rank's clock is re-based."""
    max_world_size: int = 131_072
    """Largest ``world_size`` accepted."""
    max_iteration: int = 2**40
    """Largest iteration number accepted."""
    max_name_chars: int = 4096
    """Kernel and phase names longer than this are truncated."""
    max_names_per_batch: int = 65_536
    """Largest string table of one kernel batch."""
    max_stack_chars: int = 65_536
    """Folded stacks longer than this are truncated (the leaf end is kept)."""
    max_stack_samples: int = 10_000_000
    """Largest sample count of one snapshot or one stack."""
    max_seq_gap: int = 1_000_000
    """Largest step forward of a stream's sequence number."""
    max_streams_tracked: int = 100_000
    """Bound on the per-stream state kept for de-duplication and clocks (oldest evicted)."""
    max_batches_remembered: int = 262_144
    """Bound on the digests of received batches kept to drop re-sent ones (oldest forgotten;
    a resend comes within seconds: ~26 s of a 10,000 batches/s host)."""
    live_clock: bool = True
    """Senders stamp records with this host's wall clock (live collectors): a rank's first batch
    may not reach more than ``max_clock_jump_s`` past the processor's wall clock. False for
    replayed traces (``trainscope replay``'s private processor), whose clocks are their own."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):
                continue
            if not v > 0:
                raise ConfigError(f"ingest.{f.name}", v, "must be > 0")
        if self.max_timestamp_ns > 2**63 - 1:
            raise ConfigError("ingest.max_timestamp_ns", self.max_timestamp_ns, "must be < 2**63")

    @property
    def max_clock_jump_ns(self) -> int:
        return int(self.max_clock_jump_s * 1e9)


class RateLimitedLog:
    """At most one log line per key every ``interval_s``; the lines held back are counted in the next.

    A flood of bad batches must be visible (WARNING, not DEBUG) without the
    log itself becoming the denial of service.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, *, clock=time.monotonic,
                 max_keys: int = 1024) -> None:
        self._log = logger
        self._interval = interval_s
        self._clock = clock
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._max_keys = max_keys
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args) -> bool:
        """Log ``msg`` at WARNING unless ``key`` was logged within the interval; True when logged."""
        now = self._clock()
        with self._lock:
            if now < self._next.get(key, 0.0):
                self._held[key] = self._held.get(key, 0) + 1
                return False
            if len(self._next) >= self._max_keys and key not in self._next:
                self._next.pop(next(iter(self._next)))
            self._next[key] = now + self._interval
            held = self._held.pop(key, 0)
        if held:
            self._log.warning(msg + " (and %d more like it held back)", *args, held)
        else:
            self._log.warning(msg, *args)
        return True
