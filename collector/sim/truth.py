"""The ground-truth file: what was injected, where and when, in machine-readable JSON.

Detectors are scored against it by rank, phase and kernel. Times are global
simulated seconds since the job started (the hosts' clocks are not: see
``hosts[].clock_offset_ns``/``clock_drift_ppm`` to map a rank's local
timestamps back). Per fault:

* ``type``, ``spec`` (as written), ``summary``, ``magnitude`` (factor, prob,
  delay s, ...), ``scope`` and the culprit ``ranks`` and ``hosts``;
* ``configured``: onset/duration/every/for as written; ``onset_s``/``end_s``
  and ``onset_iteration``/``end_iteration``: when it actually acted (first
  and last active iteration), ``active_iterations``, and for probabilistic
  faults ``fired`` (iteration, ranks);
* ``levels``: ARGUS Table 6 levels expected to catch it (L1 iteration time, L2
  phases, L3 kernels, L4 traces, L5 stacks), ``table6`` row, ``source``;
* ``phases``, ``micro_batches``: the phases in which it shows; ``kernels``:
  (name, stream, effect) on the culprits; ``peer_kernels``: on their group
  peers (waiting); ``peer_groups``: the culprits' parallel groups (small scopes).
"""
from __future__ import annotations

import json
import os

import numpy as np

from trainscope.collector.sim.effects import expectations
from trainscope.collector.sim.simulate import Simulation
from trainscope.proto.securefs import write_private

FORMAT = "trainscope-sim-ground-truth/1"
_MAX_GROUP_LISTING = 16


def ground_truth(sim: Simulation) -> dict:
    cfg, topo, tmpl = sim.config, sim.topo, sim.tmpl
    bounds = sim.iteration_bounds
    hosts = []
    for h in range(topo.hosts):
        rs = np.flatnonzero(topo.host == h)
        hosts.append({"host": h, "name": topo.host_name(h), "ranks": [int(rs[0]), int(rs[-1])],
                      "clock_offset_ns": int(sim.clocks.offset_ns[h]),
                      "clock_drift_ppm": float(sim.clocks.drift[h] * 1e6)})
    return {
        "format": FORMAT,
        "job_id": cfg.job_id,
        "seed": cfg.seed,
        "config": _jsonable(cfg.describe()),
        "topology": topo.describe(),
        "kernels_per_iteration_by_stage": tmpl.kernels_per_iteration(),
        "phases": sorted({p.name for p in tmpl.phases}),
        "clock_epoch_ns": sim.clocks.epoch_ns,
        "hosts": hosts,
        "iterations": {
            "count": len(bounds),
            "start_s": [round(a / 1e9, 9) for a, _ in bounds],
            "end_s": [round(b / 1e9, 9) if np.isfinite(b) else None for _, b in bounds],
        },
        "sim_seconds": _finite_s(sim.end_ns),
        "hung": sim.hung,
        "hang_window_s": None if sim.hang_window is None else [x / 1e9 for x in sim.hang_window],
        "faults": [_fault(sim, f) for f in sim.faults],
    }


def _fault(sim: Simulation, f) -> dict:
    sp, topo, kind = f.spec, sim.topo, f.spec.kind
    exp = expectations(sp, sim.tmpl, topo)
    ranks = f.ranks.tolist()
    culprit_hosts = sorted(set(topo.host[f.ranks].tolist()))
    out = {
        "id": f.index,
        "type": sp.type,
        "spec": sp.text,
        "summary": kind.summary,
        "magnitude": dict(sp.params),
        "scope": {
            "all": sp.everywhere, "rank": list(sp.ranks), "host": list(sp.hosts),
            "nic": None if sp.nic is None else {"host": sp.nic[0], "index": sp.nic[1],
                                               "id": sp.nic[0] * topo.nics_per_host + sp.nic[1]},
            "group": None if sp.group is None else {"dim": sp.group[0], "rank": sp.group[1]},
        },
        "ranks": ranks,
        "hosts": culprit_hosts,
        "host_names": [topo.host_name(h) for h in culprit_hosts],
        "configured": {"onset": str(sp.onset), "duration": None if sp.duration is None else str(sp.duration),
                       "every": None if sp.every is None else str(sp.every),
                       "for": None if sp.on_for is None else str(sp.on_for)},
        "intermittent": sp.every is not None or "prob" in sp.params,
        "onset_s": None if f.first_t is None else round(f.first_t / 1e9, 9),
        "end_s": None if f.last_t is None else _finite_s(f.last_t),
        "onset_iteration": f.active_iterations[0] if f.active_iterations else None,
        "end_iteration": f.active_iterations[-1] if f.active_iterations else None,
        "active_iterations": list(f.active_iterations),
        "levels": list(kind.levels),
        "table6": None if kind.table6 is None else {"category": kind.table6[0], "fault_type": kind.table6[1]},
        "source": kind.source,
        "signature": kind.signature,
        "phases": exp["phases"],
        "kernels": exp["kernels"],
        "peer_kernels": exp["peer_kernels"],
    }
    if "micro_batch" in exp:
        out["micro_batches"] = [exp["micro_batch"]]
    if "prob" in sp.params:
        out["fired"] = [{"iteration": it, "ranks": rs} for it, rs in f.fired]
    if len(ranks) <= _MAX_GROUP_LISTING:
        dims = [d for d in ("tp", "cp", "ep", "dp", "pp") if topo.size(d) > 1]
        out["peer_groups"] = {d: sorted({tuple(topo.group_members(d, r)) for r in ranks}) for d in dims}
        out["peer_groups"] = {d: [list(g) for g in gs] for d, gs in out["peer_groups"].items()}
    if sp.type in ("nic_degrade", "nic_fail") or sp.nic is not None:
        out["nics"] = sorted(set(topo.nic[f.ranks].tolist()))
    return out


def _finite_s(ns: float):
    return round(ns / 1e9, 9) if np.isfinite(ns) else None


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    return obj


def write_ground_truth(doc: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_private(path, json.dumps(doc, indent=1))  # 0600, mkstemp + rename: no predictable .tmp to plant
    return path
