"""Kernel-duration noise measured from real traces (docs/noise.md, tests/benchmarks/measure_noise.py).

The same call (the j-th call of a kernel in a step) varies across steps in
real PyTorch-profiler traces of A100 jobs this way:

* a narrow body: the median call site's spread is below the traces' 1 µs
  resolution, the 90th percentile's ~2-30 %; so each kernel slot gets its
  own body sigma, lognormally spread around ``SimConfig.noise_sigma``;
* spikes: 1.3-9.6 % of the calls of a kernel that runs once per step are
  more than 1.2x their median, 0-3.6 % more than 1.5x; spike sizes have a
  median of 1.64x (ln 0.5) and a heavy tail;
* a per-step factor shared by every kernel (step-time CV 1.0-2.4 %);
* per-rank personality: two ranks of one job differ per kernel by a median
  |ln ratio| of 0.065 (job128, which mixes role differences in: an upper
  bound); the default per (rank, kernel) offset is 0.03;
* some healthy ranks are noisier than others (``noisy_ranks``: a wider
  body, the same spike rate).

1. ``NoiseModel.setup`` draws what is persistent, once per run: each slot's
   body sigma, each (rank, slot)'s personality, which ranks are noisy.
2. ``NoiseModel.factors`` draws each iteration's multipliers for every
   (rank, slot) at once: body, spikes, the step factor.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from trainscope.proto.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NoiseModel:
    spike_prob: float = 0.04
    """Probability that one call is a spike (measured: 1.3-9.6 % of once-per-step calls > 1.2x)."""
    spike_log_median: float = 0.5
    """Median ln(spike / median call) (measured: 0.29-0.62, pooled 0.5 = 1.64x)."""
    spike_log_sigma: float = 0.5
    """Spread of ln(spike size) around its median (heavy tail: a few calls 3-5x)."""
    slot_spread: float = 1.0
    """Lognormal spread of the body sigma across kernel slots (a few slots are much noisier)."""
    personality_sigma: float = 0.03
    """Persistent ln offset per (rank, slot): rank-to-rank personality (measured upper bound 0.068)."""
    step_sigma: float = 0.015
    """ln of a per-step factor shared by every kernel of the step (measured step CV 1.0-2.4 %)."""
    noisy_ranks: int = 0
    """Healthy ranks that are noisier than the others: body sigma × ``noisy_factor``, spike rate
    unchanged. (More spikes would make the rank slower on average: every collective waits for its
    spikes, so it would cost the job time and not be healthy.)"""
    noisy_factor: float = 3.0

    def __post_init__(self) -> None:
        for name in ("spike_prob", "spike_log_median", "spike_log_sigma", "slot_spread",
                     "personality_sigma", "step_sigma"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"sim.noise.{name}", v, "must be a finite number >= 0")
        if self.spike_prob >= 1:
            raise ConfigError("sim.noise.spike_prob", self.spike_prob, "must be < 1")
        if type(self.noisy_ranks) is not int or self.noisy_ranks < 0:
            raise ConfigError("sim.noise.noisy_ranks", self.noisy_ranks, "must be an integer >= 0")
        if not (math.isfinite(self.noisy_factor) and self.noisy_factor >= 1):
            raise ConfigError("sim.noise.noisy_factor", self.noisy_factor, "must be >= 1")

    def setup(self, sigma: np.ndarray, world: int, rng: np.random.Generator) -> "NoiseState":
        """Step 1: ``sigma`` (K,) is each slot's nominal body sigma."""
        K = sigma.size
        slot = sigma * np.exp(self.slot_spread * rng.standard_normal(K) - self.slot_spread ** 2 / 2)
        slot = np.clip(slot, 0.2 * sigma, 10 * sigma)
        pers = self.personality_sigma * rng.standard_normal((world, K))
        noisy = np.zeros(world, dtype=bool)
        if self.noisy_ranks:
            noisy[rng.choice(world, size=min(self.noisy_ranks, world), replace=False)] = True
        mult = np.where(noisy, self.noisy_factor, 1.0)
        return NoiseState(slot[None, :] * mult[:, None], pers, np.full(world, self.spike_prob), noisy)

    def factors(self, st: "NoiseState", z: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Step 2: (W, K) multipliers of the slots' medians for one iteration (``z`` standard normal)."""
        W, K = z.shape
        spike = rng.random((W, K)) < st.spike_prob[:, None]
        size = np.exp(self.spike_log_median + self.spike_log_sigma * rng.standard_normal((W, K)))
        step = math.exp(self.step_sigma * rng.standard_normal())
        # the body is mean-preserving (e^(σz − σ²/2)): a wider spread is noise, not a slower rank
        return np.exp(st.sigma * z - st.sigma ** 2 / 2 + st.personality) * np.where(spike, np.maximum(size, 1.2), 1.0) * step


@dataclasses.dataclass(slots=True)
class NoiseState:
    sigma: np.ndarray            # (W, K) body sigma per rank and slot
    personality: np.ndarray      # (W, K) persistent ln offset
    spike_prob: np.ndarray       # (W,)
    noisy: np.ndarray            # (W,) the noisier healthy ranks
