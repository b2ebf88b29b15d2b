"""Read one rank's PyTorch profiler (Kineto) Chrome trace into numpy columns.

The deep dive's input (ARGUS §6.3, L4; EROICA §4.1) is what
``torch.profiler.profile(...).export_chrome_trace(path)`` writes, gzipped or
not: ``traceEvents`` of complete events (``ph == "X"``) with ``cat``
``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` / ``cuda_runtime`` / ``cpu_op`` /
``python_function`` / ``user_annotation``, ``ts`` and ``dur`` in microseconds,
``args.stream`` and ``args.correlation`` on device and runtime events.

Steps:
1. Load the JSON (``gzip`` by magic number, not by suffix) from a local path or an
   fsspec URL (a deep-dive bucket: ``processor/dive_upload.py``); anything that is
   not a trace object with a ``traceEvents`` list is a ``TraceError`` that
   names the file and says what to do.
2. Keep the complete events of the known categories; everything else
   (flow arrows, metadata, the profiler's own span) is dropped.
3. Names are made comparable across processes (:func:`function_name`):
   CPython's ``<built-in method wait of Work object at 0x7f...>`` carries the
   object's address, so every rank's (and every list's) ``append`` would be a
   function of its own; a module frame's ``file(N): <module>`` carries the
   line the frame was at when profiling began; an installed file's path
   carries the environment's prefix. Those parts go, what identifies the
   function (its name, its class, the file and definition line) stays.
4. Columns: category code, interned name id, ``ts``/``dur`` (µs, float64),
   ``tid`` (the device stream for device events, the thread otherwise), the
   correlation id (-1 when none), a Python function's ``Python id`` and
   ``Python parent id`` (its caller; what ``patterns.thread_patterns`` needs
   for other threads, whose frames Kineto may put on one pseudo-thread).
   ``ProfilerStep#N`` annotations are kept apart as the iteration marks.
The JSON decode itself is one C call; turning the decoded dicts into columns
is one pass of list comprehensions (the only per-event Python on this path).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import zlib
from typing import Any

import numpy as np

from trainscope.proto.errors import BadInput

#: Category codes (the order is not the critical-path priority: see critical_path.LEVEL_OF).
KERNEL, MEMCPY, MEMSET, RUNTIME, CPU_OP, PYTHON, ANNOTATION = range(7)
CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cpu_op", "python_function",
              "user_annotation")
_CAT_CODE = {c: i for i, c in enumerate(CATEGORIES)}
_CAT_CODE["cuda_driver"] = RUNTIME
_CAT_CODE["gpu_user_annotation"] = -1     # device-side copies of annotations: not work
_DEVICE = (KERNEL, MEMCPY, MEMSET)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")
_MODULE_LINE = re.compile(r"\(\d+\): <module>$")
_INSTALLED = re.compile(r"^[^()<>]*?/(?:site|dist)-packages/")


def function_name(name: str) -> str:
    """One function's name as every process spells it (step 3).

    ``<built-in method wait of torch._C._distributed_c10d.Work object at 0x7f0a>`` ->
    ``<built-in method wait of torch._C._distributed_c10d.Work object>``; other hex addresses
    become ``0x…``; ``train.py(12): <module>`` -> ``train.py: <module>``;
    ``/venv/lib/python3.11/site-packages/torch/nn/modules/module.py(1747): _call_impl`` ->
    ``torch/nn/modules/module.py(1747): _call_impl`` (a function's definition line stays: it
    tells apart functions of one name in one file).
    """
    if "0x" in name:
        name = _ADDRESS.sub(lambda m: "" if m.group(0).startswith(" at ") else "0x…", name)
    if name.endswith("<module>"):
        name = _MODULE_LINE.sub(": <module>", name)
    if "-packages/" in name:
        name = _INSTALLED.sub("", name, count=1)
    return name


class TraceError(BadInput):
    """A trace file that cannot be analysed; the message names the file and what to do."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__("bad_trace", f"{path}: {detail}")
        self.path = path


@dataclasses.dataclass(frozen=True, slots=True)
class TraceColumns:
    """One rank's events as columns (row i is one complete event), sorted by ``ts``."""

    path: str
    cat: np.ndarray          # int8 category code (CATEGORIES)
    name: np.ndarray         # int32 index into ``names``
    names: tuple[str, ...]
    ts: np.ndarray           # float64 µs
    dur: np.ndarray          # float64 µs, >= 0
    tid: np.ndarray          # int64: stream for device events, thread id otherwise
    correlation: np.ndarray  # int64, -1 when none
    steps: np.ndarray        # float64 (n, 2): ProfilerStep spans [start, end) µs, sorted
    rank: int = -1           # distributedInfo.rank when the trace has it
    world_size: int = 0
    step_tid: int = -1       # the thread the ProfilerStep marks are on (the training thread), -1 when none
    step_ids: tuple[int, ...] = ()   # N of each ProfilerStep#N span, in time order
    py_id: np.ndarray | None = None      # int64 ``args["Python id"]`` of Python function events, -1 otherwise
    py_parent: np.ndarray | None = None  # int64 ``args["Python parent id"]``, -1 when none

    def __len__(self) -> int:
        return int(self.ts.size)

    def subset(self, mask: np.ndarray) -> "TraceColumns":
        return dataclasses.replace(self, cat=self.cat[mask], name=self.name[mask], ts=self.ts[mask],
                                   dur=self.dur[mask], tid=self.tid[mask], correlation=self.correlation[mask],
                                   py_id=None if self.py_id is None else self.py_id[mask],
                                   py_parent=None if self.py_parent is None else self.py_parent[mask])


def _open(path: str):
    """A local file, or an object of a deep-dive bucket (``scheme://...``, read through fsspec:
    ``processor/dive_upload.py`` uploads there; credentials from the environment or fsspec's config)."""
    if "://" in path and not path.startswith("file://"):
        import fsspec
        return fsspec.open(path, "rb").open()
    return open(path.removeprefix("file://"), "rb")


def _load(path: str) -> Any:
    try:
        with _open(path) as fh:
            head = fh.read(2)
            fh.seek(0)
            raw = gzip.GzipFile(fileobj=fh).read() if head == b"\x1f\x8b" else fh.read()
    except FileNotFoundError:
        raise TraceError(path, "no such file: pass the path of a torch.profiler trace (.json or .json.gz)") from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory: pass one trace file per rank") from None
    except PermissionError:
        raise TraceError(path, "not readable by this user: check its permissions") from None
    except (ImportError, ValueError) as e:   # an fsspec URL whose filesystem cannot be used here
        raise TraceError(path, f"cannot open the object ({str(e).splitlines()[0][:120]}): check the URL and "
                               "that its fsspec backend is installed") from None
    except OSError as e:
        if "://" in path and not path.startswith("file://") and not isinstance(e, gzip.BadGzipFile):
            raise TraceError(path, f"cannot read the object ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}): "
                                   "check the bucket is reachable and its credentials (environment or fsspec config)") from None
        raise TraceError(path, f"truncated or corrupt gzip ({e}): copy the trace again from the rank "
                               "(it may still have been being written)") from None
    except (EOFError, zlib.error) as e:
        raise TraceError(path, f"truncated or corrupt gzip ({e}): copy the trace again from the rank "
                               "(it may still have been being written)") from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise TraceError(path, f"not valid JSON ({str(e)[:80]}): the file is truncated or not a "
                               "torch.profiler export_chrome_trace file; export it again") from None


def read_trace(path: str | os.PathLike) -> TraceColumns:
    """Steps 1-3 for one file. Raises ``TraceError`` (never a decoder traceback)."""
    p = os.fspath(path)
    doc = _load(p)
    if isinstance(doc, list):      # the bare-array Chrome trace form
        events, info = doc, {}
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        events, info = doc["traceEvents"], doc.get("distributedInfo") or {}
    else:
        raise TraceError(p, "no 'traceEvents' list: not a torch.profiler Chrome trace")
    try:
        xs = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
              and _CAT_CODE.get(e.get("cat"), -1) >= 0 and "ts" in e]
        cat = np.fromiter((_CAT_CODE[e["cat"]] for e in xs), dtype=np.int8, count=len(xs))
        ts = np.fromiter((float(e["ts"]) for e in xs), dtype=np.float64, count=len(xs))
        dur = np.fromiter((float(e.get("dur", 0.0)) for e in xs), dtype=np.float64, count=len(xs))
        args = [e.get("args") or {} for e in xs]
        tid = np.fromiter((_int(a.get("stream", e.get("tid"))) if c in _DEVICE else _int(e.get("tid"))
                           for e, a, c in zip(xs, args, cat.tolist())), dtype=np.int64, count=len(xs))
        corr = np.fromiter((_int(a.get("correlation", -1)) for a in args), dtype=np.int64, count=len(xs))
        py_id = np.fromiter((_int(a.get("Python id", -1)) for a in args), dtype=np.int64, count=len(xs))
        py_parent = np.fromiter((_int(a.get("Python parent id", -1)) for a in args), dtype=np.int64,
                                count=len(xs))
        raw_names = [str(e.get("name", "")) for e in xs]
    except (TypeError, ValueError, AttributeError) as e:
        raise TraceError(p, f"malformed event ({e}): not a torch.profiler Chrome trace") from None
    if not xs:
        raise TraceError(p, "no complete events of a known category (kernel, cpu_op, python_function ...): "
                            "was the profiler active for at least one step?")
    if not (np.isfinite(ts).all() and np.isfinite(dur).all()):
        raise TraceError(p, "non-finite ts or dur in events: the trace is corrupt; export it again")
    names, name_id = np.unique(np.asarray(raw_names, dtype=object), return_inverse=True)
    norm = [function_name(n) for n in names.tolist()]         # step 3, once per distinct name
    if norm != names.tolist():
        names, back = np.unique(np.asarray(norm, dtype=object), return_inverse=True)
        name_id = back.reshape(-1)[name_id]
    is_step = np.fromiter((n.startswith("ProfilerStep#") for n in raw_names), dtype=bool, count=len(xs))
    steps = np.stack([ts[is_step], ts[is_step] + dur[is_step]], axis=1) if is_step.any() else np.zeros((0, 2))
    so = np.argsort(steps[:, 0], kind="stable")
    steps = steps[so]
    step_names = [n for n, st in zip(raw_names, is_step.tolist()) if st]
    step_ids = tuple(_int(step_names[i].rpartition("#")[2]) for i in so.tolist())
    keep = ~is_step
    order = np.argsort(ts[keep], kind="stable")
    sel = np.flatnonzero(keep)[order]
    step_tids = tid[is_step]
    if step_tids.size:
        u, n = np.unique(step_tids, return_counts=True)
        step_tid = int(u[n.argmax()])
    else:
        step_tid = -1
    rank = info.get("rank", -1) if isinstance(info, dict) else -1
    ws = info.get("world_size", 0) if isinstance(info, dict) else 0
    return TraceColumns(path=p, cat=cat[sel], name=name_id.astype(np.int32)[sel], names=tuple(names.tolist()),
                        ts=ts[sel], dur=np.maximum(dur[sel], 0.0), tid=tid[sel], correlation=corr[sel],
                        steps=steps, rank=_int(rank), world_size=_int(ws), step_tid=step_tid,
                        step_ids=step_ids, py_id=py_id[sel], py_parent=py_parent[sel])


def _int(v: Any) -> int:
    """Kineto writes ids as ints, sometimes as strings; anything else is -1."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1
