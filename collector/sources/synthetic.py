"""Deterministic synthetic kernel streams for tests and benchmarks.

A training iteration is modelled as a fixed sequence of kernel launches that
repeats every iteration. Each (kernel, stream) key appears ``modes_per_key``
times per iteration at different positions, and each position has its own
median duration, several-fold apart: the same kernel name is multimodal, as in
ARGUS Figure 5 (a GEMM in attention vs. in the MLP). Durations around each
median are lognormal.

Everything is computed with whole-array numpy operations and is a pure
function of the :class:`SyntheticSpec` (seed included).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from trainscope.proto.columnar import KIND_KERNEL, KernelColumns
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1.telemetry_pb2 import PHASE_CLOCK_CUDA_EVENT, IterationMark, PhaseTiming


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticSpec:
    """Shape of a synthetic kernel stream; validated on construction."""

    #: Number of kernel records to produce.
    n_events: int
    #: Number of distinct (kernel, stream) keys.
    n_keys: int = 8
    #: Positions per iteration of each key, each with its own median duration.
    modes_per_key: int = 3
    #: Seed of every random draw; equal specs give equal streams.
    seed: int = 0
    #: Seed of the per-record noise only (None: ``seed``). Ranks of one job share
    #: ``seed`` (the same kernels and medians) and differ in ``noise_seed``.
    noise_seed: int | None = None
    #: Start of the first kernel, in ns on the rank's clock.
    start_ns: int = 0
    #: Duration multiplier applied to the keys in ``slow_keys`` only.
    slow_factor: float = 1.0
    #: Indices (0..n_keys-1) of the keys that ``slow_factor`` slows down.
    slow_keys: tuple[int, ...] = (0,)
    #: Keys are spread round-robin over this many CUDA streams (7, 8, ...).
    n_streams: int = 2
    #: Ratio between consecutive modes of one key ("several-fold").
    mode_ratio: float = 4.0
    #: Lognormal shape (std. dev. of log duration) around each mode.
    sigma: float = 0.05
    #: Range of the keys' base medians in ns; drawn log-uniformly per key.
    base_ns: tuple[float, float] = (5_000.0, 200_000.0)
    #: Idle time between consecutive kernels, and extra idle time between iterations.
    gap_ns: int = 2_000
    iteration_gap_ns: int = 50_000
    #: Number of the first iteration.
    first_iteration: int = 0
    #: Names of the phases an iteration is split into (contiguous runs of launches).
    phase_names: tuple[str, ...] = ("forward", "backward", "optimizer")

    def __post_init__(self) -> None:
        positive = {"n_events": 0, "n_keys": 1, "modes_per_key": 1, "n_streams": 1}
        for f, lo in positive.items():
            v = getattr(self, f)
            if type(v) is not int or v < lo:
                raise ConfigError(f"synthetic.{f}", v, f"must be an integer >= {lo}")
        if self.noise_seed is not None and (type(self.noise_seed) is not int or self.noise_seed < 0):
            raise ConfigError("synthetic.noise_seed", self.noise_seed, "must be None or a non-negative integer")
        for f in ("start_ns", "gap_ns", "iteration_gap_ns", "first_iteration", "seed"):
            v = getattr(self, f)
            if type(v) is not int or v < 0:
                raise ConfigError(f"synthetic.{f}", v, "must be a non-negative integer")
        if not self.slow_factor > 0:
            raise ConfigError("synthetic.slow_factor", self.slow_factor, "must be > 0")
        if not self.mode_ratio > 1:
            raise ConfigError("synthetic.mode_ratio", self.mode_ratio, "must be > 1")
        if not self.sigma >= 0:
            raise ConfigError("synthetic.sigma", self.sigma, "must be >= 0")
        if any(type(k) is not int or not 0 <= k < self.n_keys for k in self.slow_keys):
            raise ConfigError("synthetic.slow_keys", self.slow_keys, f"must be key indices in [0, {self.n_keys})")
        lo, hi = self.base_ns
        if not 0 < lo <= hi:
            raise ConfigError("synthetic.base_ns", self.base_ns, "must be (low, high) with 0 < low <= high")
        if not 1 <= len(self.phase_names) <= self.slots:
            raise ConfigError("synthetic.phase_names", self.phase_names,
                              f"need 1..{self.slots} phases (launches per iteration)")

    @property
    def slots(self) -> int:
        """Kernel launches per iteration."""
        return self.n_keys * self.modes_per_key


@dataclasses.dataclass(frozen=True, slots=True)
class SyntheticTrace:
    """A synthetic kernel stream with the iterations and phases that frame it."""

    spec: SyntheticSpec
    kernels: KernelColumns
    #: Only complete iterations are marked (a partial last one is not).
    iterations: tuple[IterationMark, ...]
    phases: tuple[PhaseTiming, ...]
    #: Key index of each kernel record (name_id alone is the same here).
    key: np.ndarray
    #: Which of its key's modes each record was drawn from (0 = fastest).
    mode: np.ndarray


def synthesize(spec: SyntheticSpec) -> SyntheticTrace:
    """Build the stream of ``spec``.

    1. Per key: a base median drawn log-uniformly from ``base_ns`` and a stream.
    2. The iteration's launch sequence has ``n_keys * modes_per_key`` slots;
       slot j runs key ``j % n_keys`` in mode ``j // n_keys``, whose median is
       ``base * mode_ratio**mode``, so each key's modes sit at different
       positions of the iteration.
    3. Record i fills slot ``i % slots`` of iteration ``i // slots``; its
       duration is the slot's median times ``exp(sigma * N(0, 1))``, times
       ``slow_factor`` for the slow keys (the noise is drawn first, so other
       keys' durations do not depend on ``slow_factor``).
    4. Kernels run back to back with ``gap_ns`` between them and an extra
       ``iteration_gap_ns`` before each iteration: starts are a cumulative sum.
    """
    rng = np.random.default_rng(spec.seed)
    lo, hi = np.log(spec.base_ns)
    base = np.exp(rng.uniform(lo, hi, size=spec.n_keys))
    noise_rng = rng if spec.noise_seed is None else np.random.default_rng(spec.noise_seed)
    noise = noise_rng.standard_normal(spec.n_events)
    slot_key = np.arange(spec.slots) % spec.n_keys
    slot_mode = np.arange(spec.slots) // spec.n_keys
    slot_median = base[slot_key] * spec.mode_ratio ** slot_mode

    i = np.arange(spec.n_events)
    slot = i % spec.slots
    iteration = i // spec.slots
    key = slot_key[slot]
    dur = slot_median[slot] * np.exp(spec.sigma * noise)
    if spec.slow_factor != 1.0 and spec.slow_keys:
        dur = np.where(np.isin(key, spec.slow_keys), dur * spec.slow_factor, dur)
    dur_ns = np.maximum(1, np.rint(dur)).astype(np.int64)

    step = dur_ns + spec.gap_ns
    start = np.empty(spec.n_events, dtype=np.int64)
    if spec.n_events:
        start[0] = 0
        np.cumsum(step[:-1], out=start[1:])
    start += spec.start_ns + iteration * spec.iteration_gap_ns

    streams = 7 + np.arange(spec.n_keys) % spec.n_streams
    kernels = KernelColumns.build(
        names=[f"synthetic_kernel_{k}" for k in range(spec.n_keys)],
        start_ns=start,
        duration_ns=dur_ns,
        name_id=key,
        stream=streams[key],
        kind=np.full(spec.n_events, KIND_KERNEL, dtype=np.uint8),
    )
    iterations, phases = _frames(spec, start, start + dur_ns, streams)
    return SyntheticTrace(spec, kernels, iterations, phases, key, slot_mode[slot])


def _frames(spec: SyntheticSpec, start: np.ndarray, end: np.ndarray, streams: np.ndarray):
    """Iteration marks and phase ranges over each complete iteration's kernels."""
    n_iter = spec.n_events // spec.slots
    if n_iter == 0:
        return (), ()
    s = start[: n_iter * spec.slots].reshape(n_iter, spec.slots)
    e = end[: n_iter * spec.slots].reshape(n_iter, spec.slots)
    numbers = spec.first_iteration + np.arange(n_iter)
    iterations = tuple(
        IterationMark(iteration=n, start_ns=a, end_ns=b)
        for n, a, b in zip(numbers.tolist(), s[:, 0].tolist(), e[:, -1].tolist())
    )
    # Contiguous, near-equal runs of slots per phase.
    bounds = np.linspace(0, spec.slots, len(spec.phase_names) + 1).round().astype(int)
    phases = []
    for p, name in enumerate(spec.phase_names):
        a, b = bounds[p], bounds[p + 1]
        stream = int(streams[a % spec.n_keys])
        p_start, p_end = s[:, a].tolist(), e[:, b - 1].tolist()
        phases.extend(
            PhaseTiming(name=name, start_ns=x, duration_ns=y - x, iteration=n,
                        stream=stream, clock=PHASE_CLOCK_CUDA_EVENT)
            for n, x, y in zip(numbers.tolist(), p_start, p_end)
        )
    phases.sort(key=lambda ph: (ph.start_ns, ph.name))
    return iterations, tuple(phases)


def synthetic_kernels(**spec) -> KernelColumns:
    """Kernel columns of ``SyntheticSpec(**spec)``, sorted by start."""
    return synthesize(SyntheticSpec(**spec)).kernels


def synthetic_iterations(**spec) -> tuple[IterationMark, ...]:
    """Iteration marks matching ``synthetic_kernels(**spec)`` (complete iterations only)."""
    return synthesize(SyntheticSpec(**spec)).iterations


def synthetic_phases(**spec) -> tuple[PhaseTiming, ...]:
    """Phase ranges matching ``synthetic_kernels(**spec)`` (complete iterations only)."""
    return synthesize(SyntheticSpec(**spec)).phases
