"""Write telemetry as a PyTorch-profiler (Kineto) Chrome trace: ``rank-<N>.json.gz``.

The inverse of ``replay.load_rank_trace`` for the fields trainscope reads
(ARCHITECTURE.md "Replay contract"): kernel/memcpy/memset events with
``ts``/``dur`` in microseconds and ``args.stream``, ``ProfilerStep#N`` spans,
``gpu_user_annotation`` phases and a ``distributedInfo`` block. Used by the
demo job and by the simulator to hand its runs to ``trainscope replay``.
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Iterable

from trainscope.proto.columnar import KIND_MEMCPY, KIND_MEMSET, KernelColumns

try:  # a project dependency; json stays the fallback (6x slower on a 27k-event trace)
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

_CAT = {KIND_MEMCPY: "gpu_memcpy", KIND_MEMSET: "gpu_memset"}


def write_kineto_trace(
    path: str,
    *,
    rank: int,
    world_size: int,
    kernels: KernelColumns,
    iterations: Iterable = (),
    phases: Iterable = (),
    pid: int = 1000,
    compresslevel: int = 6,
) -> str:
    """Write one rank's trace (gzip at ``compresslevel`` if ``path`` ends in .gz); returns the path."""
    ev: list[dict] = []
    start = (kernels.start_ns / 1000.0).tolist()
    dur = (kernels.duration_ns / 1000.0).tolist()
    names = kernels.names
    for s, d, nid, st, k in zip(start, dur, kernels.name_id.tolist(), kernels.stream.tolist(),
                                kernels.kind.tolist()):
        ev.append({"ph": "X", "cat": _CAT.get(k, "kernel"), "name": names[nid], "pid": rank,
                   "tid": st, "ts": s, "dur": d,
                   "args": {"device": rank, "stream": st}})
    for m in iterations:
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{m.iteration}",
                   "pid": pid, "tid": pid, "ts": m.start_ns / 1000.0,
                   "dur": (m.end_ns - m.start_ns) / 1000.0, "args": {}})
    for p in phases:
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": p.name, "pid": rank,
                   "tid": p.stream, "ts": p.start_ns / 1000.0, "dur": p.duration_ns / 1000.0,
                   "args": {}})
    doc = {"schemaVersion": 1,
           "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world_size},
           "traceEvents": ev}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # one C-encoder call: json.dump's streaming encoder is ~2x slower
    data = _orjson.dumps(doc) if _orjson is not None else json.dumps(doc).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as raw:
        if path.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=compresslevel) as g:   # 9 costs 3x of 6 for ~5 %
                g.write(data)
        else:
            raw.write(data)
    return path
