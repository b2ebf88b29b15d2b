"""Fault specifications: the catalogue, the ``type:key=value,...`` parser, scopes and activity.

A fault is *what* (type and magnitude), *where* (scope: ranks, hosts, one NIC,
one parallel group, or everything) and *when* (onset, duration, and for an
intermittent fault a period and an on-time, or a per-event probability). How
each type changes kernel durations and collective arrivals lives in
``effects.py``; this module only says what a valid fault is.

The catalogue follows ARGUS Appendix D Table 6 (the fault categories and the
levels expected to catch them) and Mycroft §7.1 (the seven injected fault
types), plus ARGUS §9.4 (JIT compilation stalls).

Syntax (CLI ``--fault``)::

    gpu_throttle:rank=137,onset=60s,factor=1.4
    nic_degrade:nic=3:1,factor=4,onset=20it          # host 3, NIC 1; onset at iteration 20
    nic_fail:rank=5,onset=30s                         # rank 5's NIC stops delivering
    net_congestion:scope=all,every=30s,for=5s,factor=3
    moe_imbalance:group=ep:12,skew=0.4               # the EP group that holds rank 12

Scopes: ``rank=N`` / ``rank=A-B`` / ``rank=A|B|C``, ``host=...`` (same forms),
``nic=HOST:INDEX``, ``group=DIM:RANK`` (DIM in tp, cp, ep, dp, pp, mp),
``scope=all``. Times: ``60s``, ``500ms``, ``2min``, a bare number (seconds) or
``20it`` (iterations).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Mapping

import numpy as np

from trainscope.proto.errors import ConfigError


@dataclasses.dataclass(frozen=True, slots=True)
class FaultKind:
    """Static description of one fault type."""

    name: str
    summary: str
    #: Magnitude parameters with their defaults (``factor``, ``prob``, ``delay`` s, ...).
    params: Mapping[str, float]
    #: Scope used when none is given (None: a scope is required).
    default_scope: str | None
    #: ARGUS Table 6 levels expected to catch it.
    levels: tuple[str, ...]
    #: ARGUS Table 6 row (category, fault type), when there is one.
    table6: tuple[str, str] | None
    #: Mycroft §7.1 injection it corresponds to, or another source.
    source: str
    #: Where the signature shows, in words.
    signature: str
    #: Default activity window keys (e.g. intermittent ``every``/``for``).
    timing: Mapping[str, str] = dataclasses.field(default_factory=dict)


_K = FaultKind
FAULT_TYPES: dict[str, FaultKind] = {k.name: k for k in (
    _K("gpu_throttle", "GPU frequency throttling: compute kernels slower", {"factor": 1.5}, None,
       ("L2", "L3"), ("Compute hardware degradation", "GPU frequency throttling"),
       "Mycroft §7.1 #4 GPU power limit",
       "compute kernels (GEMM, attention, elementwise) slower on the culprit only; its "
       "collectives are the shortest of its groups (peers wait for it, ARGUS §9.5)"),
    _K("pcie_degrade", "PCIe bandwidth degradation: memcpy slower", {"factor": 4.0}, None,
       ("L3",), ("Compute hardware degradation", "PCIe bandwidth degradation"),
       "Mycroft §7.1 #3 PCIe downgrading",
       "Memcpy HtoD/DtoH kernels slower on the culprit; compute kernels unchanged"),
    _K("ecc", "ECC error-correction overhead: intermittent tail latency", {"prob": 0.003, "factor": 8.0},
       None, ("L1", "L3"), ("Compute hardware degradation", "ECC error correction overhead"),
       "ARGUS Table 6",
       "a few compute kernels per iteration on the culprit take factor x longer: p99 (tail) up, "
       "p50 unchanged; intermittent iteration spikes"),
    _K("nvlink_degrade", "NVLink bandwidth degradation: intra-host collectives slower", {"factor": 3.0},
       None, ("L2", "L3"), ("Communication degradation", "NVLink bandwidth degradation"),
       "ARGUS Table 6",
       "intra-host collectives (TP all-reduce) of every group holding the culprit slower on all "
       "its members; that group becomes a straggler of its DP group in forward/backward"),
    _K("net_congestion", "inter-node network congestion (bursty)", {"factor": 2.5}, "all",
       ("L1", "L2"), ("Communication degradation", "Inter-node network congestion"),
       "Mycroft §7.1 #6 background traffic",
       "inter-host collectives slower during bursts: iteration-time jitter, communication "
       "phases (dp-allreduce, ep-alltoall, pp-recv) prolonged",
       {"every": "30s", "for": "6s"}),
    _K("nic_degrade", "RDMA link degradation on one NIC: the rings through it slow", {"factor": 4.0},
       None, ("L3",), ("Communication degradation", "RDMA link quality degradation"),
       "Mycroft §7.1 #2 NIC bandwidth limit",
       "inter-host collectives (ReduceScatter/AllGather/AllReduce) of every group with a member "
       "on the NIC persistently slower for all members, without waiting (ARGUS §9.2)"),
    _K("gc_pause", "Python GC pause on the host thread", {"delay": 0.5, "prob": 0.01}, "all",
       ("L1", "L5"), ("Host-side issues", "Python GC pause"), "ARGUS Table 6",
       "iteration-time spikes on every rank (synchronous training), GPU kernels unchanged, no "
       "compute-phase straggler; the culprit's stacks show garbage collection"),
    _K("dataloader_stall", "data-loader stall: GPU idle before forward", {"delay": 1.0, "prob": 1.0}, None,
       ("L2", "L5"), ("Host-side issues", "Data loading stall"), "ARGUS Table 6",
       "longer dataloader phase (CPU clock) on the culprit, GPU idle gap before forward; "
       "peers wait in their first collectives; stacks show the data-loader queue"),
    _K("cpu_contention", "CPU contention (co-located job) on a host", {"factor": 10.0}, None,
       ("L1", "L2"), ("Host-side issues", "CPU contention (co-location)"), "ARGUS Table 6",
       "kernel launches slower on the host's ranks: GPU gaps between short kernels, so the "
       "dataloader, forward and optimizer phases of those ranks slower (backward, with larger "
       "kernels, barely); kernel durations unchanged; sustained iteration-time regression"),
    _K("moe_imbalance", "MoE expert load imbalance", {"factor": 2.0, "skew": 0.0}, None,
       ("L2",), ("Framework/ configuration", "MoE expert load imbalance"), "ARGUS Table 6",
       "expert GEMMs and the moe_experts phase longer on the hot ranks (varies across the EP "
       "group); their EP peers wait in ep-alltoall"),
    _K("overlap_loss", "loss of gradient-reduce / backward overlap", {}, "all",
       ("L4",), ("Framework/ configuration", "Suboptimal comm-compute overlap"), "ARGUS Table 6",
       "DP ReduceScatter buckets launched only after backward, serialised: the exposed "
       "dp-allreduce phase grows (one bucket -> all buckets) and the iteration with it"),
    _K("hang", "a rank stops entering collectives", {"timeout": 60.0}, None,
       ("L1",), None, "Mycroft §7.1 #1 (NIC shutdown: ranks stop)",
       "iterations stop; the culprit never enters its next collective; its group peers enter "
       "it and are aborted by the NCCL watchdog after timeout (one collective longer than "
       "timeout on each peer, none on the culprit); stacks show the culprit elsewhere"),
    _K("nic_fail", "a NIC stops delivering: the collectives through it never complete", {"timeout": 60.0},
       None, ("L1",), None,
       "Mycroft §7.1 #1 NIC shutdown (the link dies, the ranks stay alive)",
       "from onset every inter-host collective with a member on the NIC stays in flight on all its "
       "members (every one entered); Mycroft's channel states: the flows into and out of the NIC "
       "posted but never delivered (RDMA_transmitted > RDMA_done), every other member's GPU waiting "
       "for upstream data (GPU_ready = RDMA_transmitted = RDMA_done); the NCCL watchdog aborts after "
       "timeout; iterations stop"),
    _K("background_load", "background GPU load sharing the device", {"factor": 1.4}, None,
       ("L2", "L3"), None, "Mycroft §7.1 #5 background computation",
       "compute kernels slower and noisier (wider distribution) on the affected ranks"),
    _K("jit_stall", "JIT compilation stall inside backward", {"delay": 5.0, "prob": 0.05, "mb": -1.0},
       None, ("L1", "L4"), None, "ARGUS §9.4 FlashAttention JIT compilation",
       "rare iteration spikes; one micro-batch's backward phase on the culprit (and through PP "
       "dependencies on its pipeline) tens of times longer, with sparse kernel launches"),
    _K("nccl_delay", "NCCL proxy delay: late collective entry", {"delay": 1.0, "prob": 0.002}, None,
       ("L1", "L3"), None, "Mycroft §7.1 #7 NCCL delay",
       "occasionally the culprit enters a collective late: that collective is long on its peers "
       "and short on the culprit"),
)}

SCOPE_KEYS = ("rank", "host", "nic", "group", "scope")
TIME_KEYS = ("onset", "duration", "every", "for")
GROUP_DIMS = ("tp", "cp", "ep", "dp", "pp", "mp")


@dataclasses.dataclass(frozen=True, slots=True)
class When:
    """A time in seconds (``unit='s'``) or in iterations (``unit='it'``)."""

    value: float
    unit: str = "s"

    def __str__(self) -> str:
        return f"{int(self.value)}it" if self.unit == "it" else f"{self.value:g}s"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FaultSpec:
    """One injected fault, validated for syntax (topology checks come later)."""

    type: str
    """A key of ``FAULT_TYPES``."""
    ranks: tuple[int, ...] = ()
    """Culprit ranks (``rank=``)."""
    hosts: tuple[int, ...] = ()
    """Culprit hosts (``host=``): all their ranks."""
    nic: tuple[int, int] | None = None
    """(host, NIC index) (``nic=``): the ranks using that NIC."""
    group: tuple[str, int] | None = None
    """(dimension, rank) (``group=``): the group of that dimension holding the rank."""
    everywhere: bool = False
    """``scope=all``."""
    onset: When = When(0.0)
    """When it starts (simulated seconds since job start, or an iteration number)."""
    duration: When | None = None
    """How long it lasts once started; None: until the end of the run."""
    every: When | None = None
    """Intermittent: period of the on/off cycle."""
    on_for: When | None = None
    """Intermittent: on-time at the start of each period (``for=``)."""
    params: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Magnitudes, defaults filled in (``factor``, ``prob``, ``delay`` in s, ...)."""
    text: str = ""
    """The spec as written."""

    def __post_init__(self) -> None:
        kind = FAULT_TYPES.get(self.type)
        if kind is None:
            raise ConfigError("sim.fault", self.text or self.type,
                              f"unknown fault type {self.type!r}; known: {', '.join(FAULT_TYPES)}")
        where = sum(bool(x) for x in (self.ranks, self.hosts, self.nic, self.group, self.everywhere))
        if where > 1:
            raise ConfigError("sim.fault", self.text, "give one scope: rank=, host=, nic=, group= or scope=all")
        if (self.every is None) != (self.on_for is None):
            raise ConfigError("sim.fault", self.text, "intermittent faults need both every= and for=")
        if self.every is not None:
            if self.every.unit != self.on_for.unit:
                raise ConfigError("sim.fault", self.text, "every= and for= must use the same unit")
            if not 0 < self.on_for.value <= self.every.value:
                raise ConfigError("sim.fault", self.text, "need 0 < for <= every")
        for k, v in self.params.items():
            if k not in kind.params:
                raise ConfigError("sim.fault", self.text,
                                  f"{self.type} takes no {k}= (it takes: {', '.join(kind.params) or 'no magnitude'})")
            if not math.isfinite(v):
                raise ConfigError("sim.fault", self.text, f"{k} must be finite")
        p = self.params
        if "factor" in p and not p["factor"] >= 1.0:
            raise ConfigError("sim.fault", self.text, "factor must be >= 1 (a slowdown)")
        if "prob" in p and not 0 < p["prob"] <= 1:
            raise ConfigError("sim.fault", self.text, "prob must be in (0, 1]")
        for k in ("delay", "timeout"):
            if k in p and not p[k] > 0:
                raise ConfigError("sim.fault", self.text, f"{k} must be > 0 seconds")
        if "skew" in p and p["skew"] < 0:
            raise ConfigError("sim.fault", self.text, "skew must be >= 0")

    @property
    def kind(self) -> FaultKind:
        return FAULT_TYPES[self.type]

    @property
    def has_scope(self) -> bool:
        return bool(self.ranks or self.hosts or self.nic or self.group or self.everywhere)

    def param(self, name: str) -> float:
        return float(self.params[name])


# ------------------------------------------------------------------ parsing


def parse_time(value: str, setting: str = "sim.fault") -> When:
    """``60s``, ``500ms``, ``2min``, ``1h``, ``20it`` or a bare number of seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*(ms|s|sec|m|min|h|it|iter|iterations)?\s*", str(value))
    if not m:
        raise ConfigError(setting, value, "not a time: use e.g. 60s, 500ms, 2min or 20it")
    num, unit = float(m.group(1)), (m.group(2) or "s")
    if unit in ("it", "iter", "iterations"):
        if num != int(num):
            raise ConfigError(setting, value, "iterations must be a whole number")
        return When(float(int(num)), "it")
    return When(num * {"ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[unit], "s")


def parse_seconds(value, setting: str) -> float:
    w = parse_time(value, setting)
    if w.unit != "s":
        raise ConfigError(setting, value, "must be a time in seconds (e.g. 300s), not iterations")
    return w.value


def _int_set(value: str, setting: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in re.split(r"[|;+]", value):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise ConfigError(setting, value, "expected N, A-B or A|B|C (non-negative integers)")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) else a
        if b < a:
            raise ConfigError(setting, value, f"empty range {a}-{b}")
        out.extend(range(a, b + 1))
    return tuple(sorted(set(out)))


def parse_fault(text: str) -> FaultSpec:
    """Parse ``type:key=value,...``; raises ``ConfigError('sim.fault', text, why)``."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("sim.fault", text, "expected type:key=value,...")
    text = text.strip()
    ftype, _, rest = text.partition(":")
    ftype = ftype.strip()
    if ftype not in FAULT_TYPES:
        raise ConfigError("sim.fault", text,
                          f"unknown fault type {ftype!r}; known: {', '.join(FAULT_TYPES)}")
    kind = FAULT_TYPES[ftype]
    raw: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = item.partition("=")
        k, v = k.strip().lower(), v.strip()
        if not eq or not k or not v:
            raise ConfigError("sim.fault", text, f"malformed item {item!r}: expected key=value")
        if k in raw:
            raise ConfigError("sim.fault", text, f"{k}= given twice")
        raw[k] = v
    kw: dict = {}
    params: dict[str, float] = {}
    for k, v in raw.items():
        if k == "rank" or k == "ranks":
            kw["ranks"] = _int_set(v, f"sim.fault {text!r} rank")
        elif k == "host" or k == "hosts":
            kw["hosts"] = _int_set(v, f"sim.fault {text!r} host")
        elif k == "nic":
            m = re.fullmatch(r"(\d+)[:.](\d+)", v)
            if not m:
                raise ConfigError("sim.fault", text, "nic= must be HOST:INDEX, e.g. nic=3:1")
            kw["nic"] = (int(m.group(1)), int(m.group(2)))
        elif k == "group":
            m = re.fullmatch(r"([a-z]+)[:@](\d+)", v)
            if not m or m.group(1) not in GROUP_DIMS:
                raise ConfigError("sim.fault", text, f"group= must be DIM:RANK with DIM in {', '.join(GROUP_DIMS)}")
            kw["group"] = (m.group(1), int(m.group(2)))
        elif k == "scope":
            if v != "all":
                raise ConfigError("sim.fault", text, "scope= only takes 'all' (use rank=, host=, nic=, group=)")
            kw["everywhere"] = True
        elif k in TIME_KEYS:
            kw["on_for" if k == "for" else k] = parse_time(v, f"sim.fault {text!r} {k}")
        elif k in kind.params:
            try:
                params[k] = parse_seconds(v, "sim.fault") if k in ("delay", "timeout") else float(v)
            except (ValueError, ConfigError):
                raise ConfigError("sim.fault", text, f"{k}={v!r} is not a number") from None
        else:
            allowed = list(SCOPE_KEYS) + list(TIME_KEYS) + list(kind.params)
            raise ConfigError("sim.fault", text, f"unknown key {k!r} for {ftype} (allowed: {', '.join(allowed)})")
    for k, v in kind.timing.items():
        if ("on_for" if k == "for" else k) not in kw and not ({"every", "for"} & raw.keys()):
            kw["on_for" if k == "for" else k] = parse_time(v)
    if not any(k in kw for k in ("ranks", "hosts", "nic", "group", "everywhere")):
        if kind.default_scope == "all":
            kw["everywhere"] = True
        else:
            raise ConfigError("sim.fault", text, f"{ftype} needs a scope: rank=, host=, nic= or group=")
    return FaultSpec(type=ftype, params={**kind.params, **params}, text=text, **kw)


def fault_from_obj(obj, setting: str) -> FaultSpec:
    """A fault from a scenario entry: a spec string or an object with a ``type`` key."""
    if isinstance(obj, FaultSpec):
        return obj
    if isinstance(obj, str):
        return parse_fault(obj)
    if isinstance(obj, Mapping) and isinstance(obj.get("type"), str):
        items = ",".join(f"{k}={v}" for k, v in obj.items() if k != "type")
        return parse_fault(f"{obj['type']}:{items}")
    raise ConfigError(setting, obj, "a fault is a 'type:key=value,...' string or an object with 'type'")


def load_scenario(path: str) -> tuple[FaultSpec, ...]:
    """Faults of a scenario file: JSON, either a list of faults or ``{"faults": [...]}``."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ConfigError("sim.scenario", path, f"cannot read: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError("sim.scenario", path, f"not valid JSON: {e}") from None
    items = doc.get("faults") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise ConfigError("sim.scenario", path, "expected a JSON list of faults or {\"faults\": [...]}")
    return tuple(fault_from_obj(x, f"sim.scenario[{i}]") for i, x in enumerate(items))


# ------------------------------------------------------------------ scope and activity


def resolve_ranks(spec: FaultSpec, topo, setting: str) -> np.ndarray:
    """The culprit ranks of ``spec`` on ``topo`` (sorted), or ConfigError naming the setting."""
    W = topo.world
    if spec.everywhere:
        return np.arange(W)
    if spec.ranks:
        bad = [r for r in spec.ranks if r >= W]
        if bad:
            raise ConfigError(f"{setting}.rank", bad[0], f"outside the world of {W} ranks")
        ranks = np.asarray(spec.ranks, dtype=np.int64)
        if spec.type in ("nic_degrade", "nic_fail"):  # a NIC named by a rank using it: every rank on that NIC
            return np.flatnonzero(np.isin(topo.nic, topo.nic[ranks]))
        return ranks
    if spec.hosts:
        bad = [h for h in spec.hosts if h >= topo.hosts]
        if bad:
            raise ConfigError(f"{setting}.host", bad[0], f"outside the {topo.hosts} hosts")
        return np.flatnonzero(np.isin(topo.host, spec.hosts))
    if spec.nic is not None:
        h, i = spec.nic
        if h >= topo.hosts or i >= topo.nics_per_host:
            raise ConfigError(f"{setting}.nic", f"{h}:{i}",
                              f"hosts are 0..{topo.hosts - 1}, NICs per host 0..{topo.nics_per_host - 1}")
        return np.flatnonzero(topo.nic == h * topo.nics_per_host + i)
    dim, r = spec.group
    if r >= W:
        raise ConfigError(f"{setting}.group", f"{dim}:{r}", f"rank outside the world of {W} ranks")
    return np.asarray(topo.group_members(dim, r), dtype=np.int64)


class Activity:
    """When a fault is on: onset, duration, and the intermittent every/for cycle.

    Evaluated once per iteration at the iteration's start (global simulated
    time), so a fault is on or off for whole iterations; the first iteration
    it is on fixes the reference for ``duration`` and ``every``.
    """

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.started: tuple[float, int] | None = None
        self.ended = False

    def __call__(self, t_s: float, it: int) -> bool:
        sp = self.spec
        if self.ended:
            return False
        if self.started is None:
            now = it if sp.onset.unit == "it" else t_s
            if now < sp.onset.value:
                return False
            self.started = (t_s, it)
        t0, i0 = self.started
        elapsed = lambda w: (it - i0) if w.unit == "it" else (t_s - t0)  # noqa: E731
        if sp.duration is not None and elapsed(sp.duration) >= sp.duration.value:
            self.ended = True
            return False
        if sp.every is not None:
            return (elapsed(sp.every) % sp.every.value) < sp.on_for.value
        return True
