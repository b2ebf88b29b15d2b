"""Replay source: PyTorch profiler (Kineto) Chrome-trace JSON, one file per rank.

Implements the reading half of the replay contract (ARCHITECTURE.md, "Replay
contract"): a directory of ``rank-<N>.json`` / ``rank-<N>.json.gz`` files plus an
optional ``topology.json`` becomes a :class:`ReplayJob` (``replay_dir``); each file
becomes a :class:`RankTrace` of kernel columns, phase timings and iteration marks.

Event time stays trace time (microseconds in the file, nanoseconds here): never
compare absolute timestamps across ranks, their clocks are not synchronised.

Bad records never abort a load; ``RankTrace.skipped`` counts them by
``"<signal>:<reason>"``: signal ``kernel``, ``phase``, ``iteration`` or ``event``;
reason ``not_complete_event`` (ph != "X"), ``missing_|bad_|negative_timestamp``,
``missing_|bad_|nan_|negative_|zero_duration`` (nan: NaN or infinite; zero:
after rounding to ns), ``missing_name``, ``bad_name`` (``ProfilerStep#N`` with no
N, or an N of more than 18 digits), ``duplicate`` (a repeated N),
``not_an_object``; names longer than ``MAX_NAME_CHARS`` are truncated and counted
as ``"<signal>:long_name"``. A file that cannot be read at all raises
``TraceFileError`` with one line that says why, among them the limits that keep a
hostile file from taking the machine (issue #11):

* ``MAX_TRACE_BYTES`` (2 GiB, env ``TRAINSCOPE_REPLAY_MAX_BYTES``): the file, and
  its decompressed content (gzip is read as a stream and stopped at the cap, so
  a gzip bomb costs at most the cap);
* nesting deeper than orjson's 1024 levels (orjson >= 3.9.15, CVE-2024-27454) is
  refused by orjson; text only the stdlib parses (NaN literals, or no orjson) is
  first scanned, and nesting deeper than ``MAX_JSON_DEPTH`` (512) refused before
  the stdlib sees it (it would raise ``RecursionError``);
* a file that is only whitespace is "empty".
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import gzip
import json
import math
import os
import re
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

from trainscope.proto.columnar import KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET, KernelColumns
from trainscope.proto import env
from trainscope.proto.errors import ConfigError, TraceFileError
from trainscope.proto.v1.telemetry_pb2 import (
    PHASE_CLOCK_CPU,
    PHASE_CLOCK_CUDA_EVENT,
    IterationMark,
    PhaseTiming,
)

_GZIP_MAGIC = b"\x1f\x8b"  # the first two bytes of a .gz file
RANK_FILE_RE = re.compile(r"^rank-(\d+)\.json(\.gz)?$")  # rank-<N>.json[.gz]

try:  # optional: about as fast as json here, but cheaper on memory
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

KERNEL_CATS = {"kernel": KIND_KERNEL, "gpu_memcpy": KIND_MEMCPY, "gpu_memset": KIND_MEMSET}
STEP_PREFIX = "ProfilerStep#"
_MAX_NS = 2**62  # start and start + duration stay below int64 (processor/limits.py's bound)
#: Largest trace file, and largest decompressed content, read (bytes).
MAX_TRACE_BYTES = 2 << 30
#: Deeper JSON is refused (Kineto traces nest about 5 levels).
MAX_JSON_DEPTH = 512
#: Longer kernel and phase names are truncated (as the processor's ingest does).
MAX_NAME_CHARS = 4096


# --------------------------------------------------------------------- one file


@dataclasses.dataclass(frozen=True, slots=True)
class RankTrace:
    """Everything the replay source takes from one rank's trace file."""

    rank: int
    #: ``distributedInfo.world_size`` of the file; None when the file has none.
    world_size: int | None
    path: str
    #: Kernel, memcpy and memset activity sorted by start; empty (len 0) when the
    #: file holds no GPU activity, which is valid but worth telling the user.
    kernels: KernelColumns
    #: ``gpu_user_annotation`` ranges (CUDA-event clock), or failing those the
    #: ``user_annotation`` ranges other than ``ProfilerStep#N`` (CPU clock).
    phases: tuple[PhaseTiming, ...]
    #: One mark per ``ProfilerStep#N`` span, sorted by start.
    iterations: tuple[IterationMark, ...]
    #: Dropped events by ``"<signal>:<reason>"`` (module docstring).
    skipped: dict[str, int]
    job_id: str
    #: Where ``rank`` came from: ``distributedInfo``, ``filename`` or ``argument``.
    rank_source: str = "distributedInfo"


def load_rank_trace(path: str | os.PathLike, rank: int | None = None, *, job_id: str | None = None) -> RankTrace:
    """Load one Kineto trace (``.json`` or ``.json.gz``, detected by content).

    1. Read and parse the whole file at once (the fastest path in CPython).
    2. One pass over ``traceEvents`` collects kernels, annotations and
       ``ProfilerStep#N`` spans as plain Python lists, counting bad records.
    3. Convert the columns to numpy and sort kernels by start.
    4. Give each phase the N of the step containing its start, else of the
       nearest step (GPU ranges may run after their CPU step span ends).

    The rank comes from ``distributedInfo.rank``, else from a ``rank-<N>``
    file name, else from ``rank``; ``TraceFileError`` when none gives one.
    ``job_id`` defaults to the name of the file's directory.
    """
    path = str(path)
    # A trace parses into millions of containers, none of them garbage: the
    # cyclic collector would make repeated full passes over them (about half
    # the load time), so it is held off until the document is released.
    with _gc_paused():
        events, info = _events_and_info(path, _read_json(path))
        rank, rank_source, world_size = _rank_of(path, info, rank)
        kern_raw, phases, iterations, skipped = _scan_events(events)
        del events
    kernels = _kernel_columns(*kern_raw)
    phases = _assign_iterations(phases, iterations)
    return RankTrace(
        rank=rank, world_size=world_size, path=path, kernels=kernels, phases=phases,
        iterations=iterations, skipped=dict(skipped), rank_source=rank_source,
        job_id=job_id or Path(path).resolve().parent.name or "replay")


def max_trace_bytes() -> int:
    """``MAX_TRACE_BYTES`` unless ``TRAINSCOPE_REPLAY_MAX_BYTES`` says otherwise."""
    n = env.integer(env.REPLAY_MAX_BYTES, MAX_TRACE_BYTES)
    if n <= 0:
        raise ConfigError(env.REPLAY_MAX_BYTES, n, "must be a positive integer (bytes)")
    return n


def _read_json(path: str, cap: int | None = None):
    cap = max_trace_bytes() if cap is None else cap
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head == _GZIP_MAGIC:
                raw = _gunzip_capped(path, f, cap)
            else:
                raw = f.read(cap + 1)
                if len(raw) > cap:
                    raise TraceFileError(path, f"larger than the {_gib(cap)} limit "
                                               "(TRAINSCOPE_REPLAY_MAX_BYTES)")
    except OSError as e:
        raise TraceFileError(path, f"cannot read: {e.strerror or e}") from e
    if not raw.strip():
        raise TraceFileError(path, "empty file (or only whitespace), expected Chrome-trace JSON")
    deep = TraceFileError(path, f"JSON nested more than {MAX_JSON_DEPTH} levels deep (not a Chrome/Kineto trace)")
    if _orjson is not None:
        try:
            return _orjson.loads(raw)
        except _orjson.JSONDecodeError as e:
            # orjson >= 3.9.15 stops at 1024 levels (CVE-2024-27454); anything else (e.g. NaN
            # literals, which only the stdlib accepts) is retried there
            if "depth limit" in str(e):
                raise deep from None
    # the stdlib path (no orjson, or orjson refused the text): refuse deep nesting before parsing
    # (the stdlib raises RecursionError, after a deep Python stack); a scan as long as orjson's parse
    if _json_depth(raw, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise deep
    try:
        return json.loads(raw)
    except RecursionError:
        raise TraceFileError(path, "JSON nested too deeply (not a Chrome/Kineto trace)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise TraceFileError(path, f"not valid JSON: {str(e)[:200]}") from e


_BRACKET = np.zeros(256, np.int8)
_BRACKET[ord("[")] = _BRACKET[ord("{")] = 1
_BRACKET[ord("]")] = _BRACKET[ord("}")] = -1


def _json_depth(raw: bytes, limit: int, step: int = 1 << 26) -> int:
    """Deepest nesting of ``raw``'s brackets outside strings, or a value > ``limit`` as soon
    as it passes it. Vectorised over the sparse quote and bracket positions, in chunks
    (about a third of orjson's parse time on a real trace).

    1. Drop pairs of backslashes (escaped backslashes): a backslash left before a quote escapes it.
    2. Per chunk: real quotes (not after a backslash); brackets, and for each the parity of
       the real quotes before it (odd: inside a string, ignored).
    3. Running depth over the brackets that count, carried across chunks.
    """
    raw = raw.replace(b"\\\\", b"")
    n = len(raw)
    depth, in_str, prev = 0, 0, 0
    for i in range(0, n, step):
        a = np.frombuffer(raw, np.uint8, count=min(step, n - i), offset=i)
        q = np.flatnonzero(a == 34)
        if q.size:
            before = np.where(q > 0, a[np.maximum(q - 1, 0)], prev)
            q = q[before != 92]
        d = _BRACKET[a]
        b = np.flatnonzero(d)
        outside = ((np.searchsorted(q, b) + in_str) & 1) == 0
        c = np.cumsum(d[b[outside]], dtype=np.int64)
        if c.size:
            top = int(c.max()) + depth
            if top > limit:
                return top
            depth += int(c[-1])
        in_str = (in_str + q.size) & 1
        prev = int(a[-1])
    return depth


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _gunzip_capped(path: str, f, cap: int) -> bytes:
    """Decompress as a stream, stopping once more than ``cap`` bytes came out (a gzip bomb
    costs at most ``cap``, not what it expands to)."""
    try:
        with gzip.GzipFile(fileobj=f) as g:
            raw = g.read(cap + 1)
    except EOFError as e:
        raise TraceFileError(path, "truncated gzip stream (file ends before the end-of-stream marker)") from e
    except (gzip.BadGzipFile, zlib.error) as e:
        raise TraceFileError(path, f"corrupt gzip data: {e}") from e
    if len(raw) > cap:
        raise TraceFileError(path, f"decompresses to more than the {_gib(cap)} limit "
                                   "(TRAINSCOPE_REPLAY_MAX_BYTES)")
    return raw


@contextlib.contextmanager
def _gc_paused():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _events_and_info(path: str, doc) -> tuple[list, dict]:
    if isinstance(doc, list):  # the Chrome-trace "JSON array" form
        return doc, {}
    if not isinstance(doc, dict):
        raise TraceFileError(path, f"top-level JSON is a {type(doc).__name__}, expected an object with traceEvents")
    events = doc.get("traceEvents")
    if events is None:
        raise TraceFileError(path, "JSON object has no 'traceEvents' (not a Chrome/Kineto trace)")
    if not isinstance(events, list):
        raise TraceFileError(path, f"'traceEvents' is a {type(events).__name__}, expected a list")
    info = doc.get("distributedInfo")
    return events, info if isinstance(info, dict) else {}


def _as_count(v) -> int | None:
    """A non-negative int from JSON (ints or digit strings; never bools)."""
    if type(v) is int:
        return v if v >= 0 else None
    if type(v) is str and v.isdecimal():
        return int(v)
    return None


def _rank_of(path: str, info: dict, rank: int | None) -> tuple[int, str, int | None]:
    world = _as_count(info.get("world_size"))
    world = world if world else None
    r = _as_count(info.get("rank"))
    source = "distributedInfo"
    if r is None:
        m = RANK_FILE_RE.match(os.path.basename(path))
        r, source = (int(m.group(1)), "filename") if m else (rank, "argument")
    if r is None or type(r) is not int or r < 0:
        raise TraceFileError(
            path, "cannot determine the rank: no distributedInfo.rank, the file name is not "
            "rank-<N>.json[.gz], and no rank was given")
    if world is not None and r >= world:
        raise TraceFileError(path, f"rank {r} is outside distributedInfo.world_size {world}")
    return r, source, world


def _to_ns(v, what: str) -> int | str:
    """Microseconds (int, float or numeric string) to integer ns, or a reason code."""
    t = type(v)
    if t is str:
        try:
            v, t = float(v), float
        except ValueError:
            return f"bad_{what}"
    if t is not int and t is not float:
        return f"bad_{what}"
    if v != v or v in (math.inf, -math.inf):
        return "nan_duration" if what == "duration" else "bad_timestamp"
    if v < 0:  # before rounding: -0.0001 us is negative, not zero
        return f"negative_{what}"
    if t is int:
        return v * 1000
    # Split so large epoch-based timestamps keep every digit the float holds.
    whole = math.floor(v)
    return int(whole) * 1000 + round((v - whole) * 1000)


def _span(ev: dict) -> tuple[int, int] | str:
    """(start_ns, duration_ns) of a complete event, or why it is dropped."""
    return _span_of(ev.get("ph"), ev.get("ts"), ev.get("dur"))


def _span_of(ph, ts, dur) -> tuple[int, int] | str:
    """``_span`` of an event's ``ph``, ``ts`` and ``dur``."""
    if ph != "X":
        return "not_complete_event"
    if ts is None:
        return "missing_timestamp"
    if dur is None:
        return "missing_duration"
    start = _to_ns(ts, "timestamp")
    if type(start) is str:
        return start
    if start > _MAX_NS:
        return "bad_timestamp"
    d = _to_ns(dur, "duration")
    if type(d) is str:
        return d
    if start + d > _MAX_NS:
        return "bad_duration"
    return (start, d) if d else "zero_duration"


def _stream_of(args, fallback) -> int:
    s = args.get("stream") if type(args) is dict else None
    if s is None:
        s = fallback
    return s if type(s) is int and 0 <= s < 2**32 else 0


def _scan_events(events: list):
    """One pass over the events (step 2 of ``load_rank_trace``)."""
    skipped: Counter = Counter()
    kev, k_kind = [], []  # the kernel events and their kinds
    gpu_phases, cpu_phases = [], []  # (name, start_ns, duration_ns, stream)
    steps: dict[int, tuple[int, int]] = {}
    for ev in events:
        if type(ev) is not dict:
            skipped["event:not_an_object"] += 1
            continue
        cat = ev.get("cat")
        if type(cat) is not str:
            continue
        kind = KERNEL_CATS.get(cat)
        if kind is not None:
            kev.append(ev)          # checked and converted together after the pass (_kernel_rows)
            k_kind.append(kind)
            continue
        if cat not in ("user_annotation", "gpu_user_annotation", "cpu_op"):
            continue
        name = ev.get("name")
        if type(name) is str and name.startswith(STEP_PREFIX):
            if cat == "gpu_user_annotation":
                continue  # GPU-side copies of the step span: not a phase
            span = _span(ev)
            if type(span) is str:
                skipped["iteration:" + span] += 1
                continue
            digits = name[len(STEP_PREFIX):]
            # more than 18 digits is no step number (and int() of a huge one raises)
            if not digits.isdecimal() or len(digits) > 18 or int(digits) in steps:
                bad = not digits.isdecimal() or len(digits) > 18
                skipped["iteration:bad_name" if bad else "iteration:duplicate"] += 1
                continue
            steps[int(digits)] = span
            continue
        if cat == "cpu_op":
            continue
        span = _span(ev)
        if type(span) is str:
            skipped["phase:" + span] += 1
            continue
        if type(name) is not str:
            skipped["phase:missing_name"] += 1
            continue
        if len(name) > MAX_NAME_CHARS:
            name = name[:MAX_NAME_CHARS]
            skipped["phase:long_name"] += 1
        if cat == "gpu_user_annotation":
            gpu_phases.append((name, span[0], span[1], _stream_of(ev.get("args"), ev.get("tid"))))
        else:
            cpu_phases.append((name, span[0], span[1], 0))
    iterations = tuple(
        IterationMark(iteration=n, start_ns=s, end_ns=s + d)
        for n, (s, d) in sorted(steps.items(), key=lambda kv: (kv[1][0], kv[0]))
    )
    clock, raw_phases = (PHASE_CLOCK_CUDA_EVENT, gpu_phases) if gpu_phases else (PHASE_CLOCK_CPU, cpu_phases)
    phases = sorted(raw_phases, key=lambda p: (p[1], p[0]))
    kern_raw = _kernel_rows(kev, k_kind, skipped)
    return kern_raw, (clock, phases), iterations, skipped


#: Kernel-span reasons by code (``_spans``); 0: kept.
_SPAN_WHY = ("", "not_complete_event", "bad_timestamp", "negative_timestamp", "nan_duration", "negative_duration",
             "bad_duration", "zero_duration")


def _spans(ph: list, ts: list, dur: list) -> tuple[np.ndarray, np.ndarray, list]:
    """``_span_of`` over many events at once: (start_ns, duration_ns, why) with why "" where kept.

    Vectorised when every ``ts`` and ``dur`` is a JSON number below 2**53 µs (every real trace: float64
    then holds each exactly, and floor + round of the fraction is ``_to_ns``'s own split); otherwise one
    event at a time (strings, nulls, huge integers: hostile or odd input keeps its exact reasons).
    """
    n = len(ts)
    types = set(map(type, ts)) | set(map(type, dur))
    if types <= {int, float} and set(ph) == {"X"}:
        a, b = np.array(ts, dtype=np.float64), np.array(dur, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            fine = not n or max(np.nanmax(np.abs(np.where(np.isinf(a), 0, a)), initial=0),
                                np.nanmax(np.abs(np.where(np.isinf(b), 0, b)), initial=0)) < 2.0 ** 53
        if fine:
            ok_a = np.isfinite(a) & (a >= 0)
            ok_b = np.isfinite(b) & (b >= 0)
            wa, wb = np.floor(np.where(ok_a, a, 0)), np.floor(np.where(ok_b, b, 0))
            start = wa.astype(np.int64) * 1000 + np.round((np.where(ok_a, a, 0) - wa) * 1000).astype(np.int64)
            d = wb.astype(np.int64) * 1000 + np.round((np.where(ok_b, b, 0) - wb) * 1000).astype(np.int64)
            # _span_of's order: the timestamp's reasons, then the duration's, then zero
            conds = [~np.isfinite(a), a < 0, start > _MAX_NS, np.isnan(b) | np.isinf(b), b < 0,
                     start + d > _MAX_NS, d == 0]
            code = np.select(conds, [2, 3, 2, 4, 5, 6, 7], 0).astype(np.int8)
            why = [_SPAN_WHY[c] for c in code.tolist()] if code.any() else [""] * n
            return start, d, why
    start, d, why = np.zeros(n, np.int64), np.zeros(n, np.int64), [""] * n
    for i, (p, t, u) in enumerate(zip(ph, ts, dur)):
        span = _span_of(p, t, u)
        if type(span) is str:
            why[i] = span
        else:
            start[i], d[i] = span
    return start, d, why


def _kernel_rows(kev: list, kinds: list, skipped: Counter) -> tuple:
    """The kernel events' columns (step 2, after the pass): spans checked and converted at once
    (``_spans``), then names, streams and devices of the kept ones; each dropped one counted.

    Every span kept, every name a string within ``MAX_NAME_CHARS`` and every ``args`` an object (a
    real trace): list comprehensions over the columns (~2x the loop below, which keeps the exact
    reasons of odd input)."""
    start, dur, why = _spans([e.get("ph") for e in kev], [e.get("ts") for e in kev], [e.get("dur") for e in kev])
    raw_names = [e.get("name") for e in kev]
    raw_args = [e.get("args") for e in kev]
    if (not any(why) and set(map(type, raw_names)) <= {str} and set(map(type, raw_args)) <= {dict}
            and max(map(len, raw_names), default=0) <= MAX_NAME_CHARS):
        names: dict[str, int] = {}
        k_name = [names.setdefault(n, len(names)) for n in raw_names]
        k_stream = [s if type(s) is int and 0 <= s < 2**32 else 0 for s in (a.get("stream") for a in raw_args)]
        devices = Counter(d for d in (a.get("device") for a in raw_args) if type(d) is int and d >= 0)
        device = devices.most_common(1)[0][0] if devices else 0
        return tuple(names), start, dur, k_name, k_stream, list(kinds), device
    names = {}
    devices: Counter = Counter()
    keep, k_name, k_stream, k_kind = [], [], [], []
    for i, (name, args, w) in enumerate(zip(raw_names, raw_args, why)):
        if w:
            skipped["kernel:" + w] += 1
            continue
        if name is None:
            skipped["kernel:missing_name"] += 1
            continue
        if type(name) is not str:
            name = str(name)
        if len(name) > MAX_NAME_CHARS:
            name = name[:MAX_NAME_CHARS]
            skipped["kernel:long_name"] += 1
        keep.append(i)
        k_name.append(names.setdefault(name, len(names)))
        k_stream.append(_stream_of(args, None))
        k_kind.append(kinds[i])
        dev = args.get("device") if type(args) is dict else None
        if type(dev) is int and dev >= 0:
            devices[dev] += 1
    device = devices.most_common(1)[0][0] if devices else 0
    idx = np.array(keep, dtype=np.int64)
    return tuple(names), start[idx], dur[idx], k_name, k_stream, k_kind, device


def _kernel_columns(names, start, dur, name_id, stream, kind, device) -> KernelColumns:
    """Step 3: Python lists to numpy, sorted by start (stable, so ties keep file order)."""
    if not len(start):
        return dataclasses.replace(KernelColumns.empty(), device=device)
    cols = KernelColumns.build(names, start, dur, name_id, stream, kind, device=device)
    order = np.argsort(cols.start_ns, kind="stable")
    if np.all(order[1:] > order[:-1]):
        return cols
    return cols.take(order)


def _assign_iterations(phases, iterations: tuple[IterationMark, ...]) -> tuple[PhaseTiming, ...]:
    """Step 4: the step containing each phase's start, else the nearest one."""
    clock, rows = phases
    if not rows:
        return ()
    starts = np.fromiter((p[1] for p in rows), dtype=np.int64, count=len(rows))
    if iterations:
        it_start = np.array([m.start_ns for m in iterations], dtype=np.int64)
        it_end = np.array([m.end_ns for m in iterations], dtype=np.int64)
        it_n = np.array([m.iteration for m in iterations], dtype=np.int64)
        before = np.clip(np.searchsorted(it_start, starts, side="right") - 1, 0, None)
        after = np.clip(before + 1, None, len(it_start) - 1)
        # Distance to a span is 0 inside it; pick the closer of the two neighbours.
        d_before = np.maximum(0, np.maximum(it_start[before] - starts, starts - it_end[before]))
        d_after = np.maximum(0, it_start[after] - starts)
        which = np.where(d_after < d_before, after, before)
        numbers = it_n[which].tolist()
    else:
        numbers = [0] * len(rows)
    return tuple(
        PhaseTiming(name=name, start_ns=s, duration_ns=d, iteration=n, stream=stream, clock=clock)
        for (name, s, d, stream), n in zip(rows, numbers)
    )
