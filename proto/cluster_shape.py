"""The shape of a kernel-duration cluster: four inner quantiles in one 64-bit word.

``KernelCluster`` (ARGUS §5.2) carries count, p50, p99, min and max; its
``shape`` field adds p10, p25, p75 and p90 so the analyzer can rebuild the
cluster's quantile function piecewise (``trainscope.analyzer.cdf``) instead
of assuming a lognormal (ARGUS §6.2). Each quantile q is stored as its
position between the cluster's ends in log-duration,

    t = (ln q - ln min) / (ln max - ln min),  rounded to 16 bits,

so the four fit one ``fixed64`` (9 bytes on the wire with its tag) with a
relative error of at most ln(max/min) / 131,070 (0.005 % for max = 1000·min).
A word of 0 means "not sent" (or min == max): readers then interpolate the
inner quantiles from min, p50, p99 and max. Vectorised over clusters.
"""
from __future__ import annotations

import numpy as np

#: The quantile levels the word holds, low bits first.
LEVELS = (0.10, 0.25, 0.75, 0.90)
_SCALE = 65535.0
_SHIFTS = np.array([0, 16, 32, 48], dtype=np.uint64)


def pack(lo, hi, quantiles) -> np.ndarray:
    """uint64 words for clusters with ends ``lo``/``hi`` (> 0) and ``quantiles`` (n, 4) at ``LEVELS``.

    1. t = (ln q - ln lo) / (ln hi - ln lo), clipped to [0, 1];
    2. rounded to 16 bits and packed low level first; a cluster with hi <= lo gets 0,
       and a sent word that would be 0 (p10..p90 all at min) becomes 1 (t10 = 1/65535).
    """
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    q = np.asarray(quantiles, dtype=np.float64).reshape(lo.shape[0], len(LEVELS))
    span = np.log(hi) - np.log(lo) if lo.size else np.zeros(0)
    ok = span > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (np.log(q) - np.log(lo)[:, None]) / np.where(ok, span, 1.0)[:, None]
    t = np.rint(np.clip(np.nan_to_num(t), 0.0, 1.0) * _SCALE).astype(np.uint64)
    word = np.bitwise_or.reduce(t << _SHIFTS, axis=1) if lo.size else np.zeros(0, np.uint64)
    return np.where(ok, np.maximum(word, np.uint64(1)), np.uint64(0))


def unpack(lo, hi, word) -> np.ndarray:
    """Quantiles (n, 4) at ``LEVELS`` from ``pack``'s words: lo·(hi/lo)^t per 16-bit t.

    Rows whose word is 0 come back NaN (not sent: the caller interpolates).
    """
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    w = np.asarray(word, dtype=np.uint64)
    t = ((w[:, None] >> _SHIFTS) & np.uint64(0xFFFF)).astype(np.float64) / _SCALE
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.exp(np.log(lo)[:, None] + t * (np.log(hi) - np.log(lo))[:, None])
    out[w == 0] = np.nan
    return out
