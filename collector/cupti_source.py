"""GPU kernel activity from CUPTI (``cupti-python``), parsed off the hot path (ARGUS §4.3, App. A).

Three decoupled paths, as ARGUS lays them out:

1. Control: ``start`` enables the activity kinds (concurrent kernels, memcpy,
   memset), registers the buffer callbacks and sets a flush period; ``stop``
   flushes and disables them. Nothing else crosses between the paths.
2. Collection: CUPTI asks for buffers of ``buffer_bytes`` and calls back with
   the filled ones on its own thread. The completion callback does one thing:
   it takes a free slot (at most ``pool_slots`` filled buffers wait) and hands
   the buffer's records to the parser queue. No parsing, no allocation, no
   I/O. With no free slot the buffer is dropped and its records counted
   (bounded resources, back-pressure by dropping: App. A). cupti-python owns
   the raw buffers (it allocates them at our requested size and turns their
   records into Python objects before calling back), so the pool of
   pre-allocated, reused memory is applied where we own memory: the slots and
   the parser's column slabs.
3. Processing: one parser thread turns each buffer into a ``KernelColumns``
   batch (kernel name or ``Memcpy HtoD``/``Memset``, start, duration, stream,
   kind, per device) through pre-allocated, reused column arrays, returns the
   slot to the pool and hands the batch to ``emit`` (the collector's bounded,
   non-blocking exporter queue).

Timestamps: CUPTI's clock is mapped to the host's wall clock
(``time.time_ns``, the clock of phases and iterations) by an offset measured
at start and re-measured every ``resync_s``.

Without ``cupti-python``, a CUDA driver or a supported GPU, ``start`` records
why in ``reason`` and returns: the source stays off and the rest of the
collector runs (``launch`` then falls back to the CPU operator source).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Any, Iterable

import numpy as np

from trainscope.collector.sources import Emit
from trainscope.proto.columnar import KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET, KernelColumns
from trainscope.proto.errors import ConfigError

log = logging.getLogger(__name__)

# CUpti_ActivityKind values (stable across CUPTI versions).
KIND_ID_MEMCPY, KIND_ID_MEMSET, KIND_ID_KERNEL, KIND_ID_CONCURRENT_KERNEL = 1, 2, 3, 10
#: CUpti_ActivityMemcpyKind -> the name Kineto uses for the copy.
MEMCPY_NAMES = {0: "Memcpy Unknown", 1: "Memcpy HtoD", 2: "Memcpy DtoH", 3: "Memcpy HtoA",
                4: "Memcpy AtoH", 5: "Memcpy AtoA", 6: "Memcpy AtoD", 7: "Memcpy DtoA",
                8: "Memcpy DtoD", 9: "Memcpy HtoH", 10: "Memcpy PtoP"}
_SLAB = np.dtype([("start", "<u8"), ("end", "<u8"), ("stream", "<u4"), ("device", "<u4"),
                  ("name", "<u4"), ("kind", "u1")])


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CuptiConfig:
    buffer_bytes: int = 8 << 20
    """Size of each activity buffer CUPTI fills (CUPTI recommends 1-10 MB)."""
    pool_slots: int = 16
    """Filled buffers that may wait for the parser; more are dropped and counted."""
    slab_records: int = 65_536
    """Capacity of each pre-allocated column slab; larger buffers are parsed in pieces."""
    flush_period_ms: int = 1000
    """CUPTI delivers partially filled buffers at least this often (0: only when full)."""
    resync_s: float = 60.0
    """How often the CUPTI-to-wall-clock offset is re-measured."""
    memcpy: bool = True
    """Collect memory copies."""
    memset: bool = True
    """Collect memory sets."""

    def __post_init__(self) -> None:
        for name, lo in (("buffer_bytes", 64 << 10), ("pool_slots", 1), ("slab_records", 16)):
            v = getattr(self, name)
            if type(v) is not int or v < lo:
                raise ConfigError(f"cupti.{name}", v, f"must be an integer >= {lo}")
        if type(self.flush_period_ms) is not int or self.flush_period_ms < 0:
            raise ConfigError("cupti.flush_period_ms", self.flush_period_ms, "must be an integer >= 0")
        if not self.resync_s > 0:
            raise ConfigError("cupti.resync_s", self.resync_s, "must be > 0")


class SlabPool:
    """A fixed set of pre-allocated column arrays, taken and returned, never grown (App. A)."""

    def __init__(self, slots: int, records: int) -> None:
        self._free: "queue.SimpleQueue[np.ndarray]" = queue.SimpleQueue()
        for _ in range(slots):
            self._free.put(np.zeros(records, dtype=_SLAB))
        self.records = records

    def take(self) -> np.ndarray | None:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def give(self, slab: np.ndarray) -> None:
        self._free.put(slab)


def parse_records(records: Iterable[Any], slab: np.ndarray, offset_ns: int = 0) -> list[KernelColumns]:
    """Activity records (``cupti.cupti.Activity*`` objects or look-alikes) -> one batch per device.

    Reads ``kind``, ``start``, ``end``, ``stream_id``, ``device_id`` and the
    name (``name`` for kernels, ``copy_kind`` for memcpy). Unknown kinds and
    records with end < start are skipped. ``slab`` is reused scratch space;
    the returned columns are compact copies. Records beyond the slab's
    capacity are parsed in further passes.
    """
    out: list[KernelColumns] = []
    it = iter(records)
    names: dict[str, int] = {}
    while True:
        n = _fill(it, slab, names)
        if n == 0:
            break
        out.extend(_columns(slab[:n], names, offset_ns))
        if n < slab.shape[0]:
            break
        names = {}
    return out


def _fill(it, slab: np.ndarray, names: dict[str, int]) -> int:
    cap, n = slab.shape[0], 0
    for r in it:
        kind = int(r.kind)
        if kind in (KIND_ID_CONCURRENT_KERNEL, KIND_ID_KERNEL):
            name, k = r.name or "<unnamed kernel>", KIND_KERNEL
        elif kind == KIND_ID_MEMCPY:
            name, k = MEMCPY_NAMES.get(int(r.copy_kind), "Memcpy"), KIND_MEMCPY
        elif kind == KIND_ID_MEMSET:
            name, k = "Memset", KIND_MEMSET
        else:
            continue
        start, end = int(r.start), int(r.end)
        if end < start:
            continue
        nid = names.get(name)
        if nid is None:
            nid = names[name] = len(names)
        slab[n] = (start, end, int(r.stream_id) & 0xFFFFFFFF, int(r.device_id) & 0xFFFFFFFF, nid, k)
        n += 1
        if n == cap:
            break
    return n


@functools.lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """A CUPTI kernel name as Kineto (the PyTorch profiler) shows it: Itanium C++ names (``_Z...``)
    demangled by libstdc++'s ``abi::__cxa_demangle`` (through ``cxxfilt``, as Kineto calls it), so the
    same kernel has one name whether it came from CUPTI or a replayed trace. Others unchanged;
    unchanged too when ``cxxfilt`` or libstdc++ is missing or the name does not parse.

    Cached: a job has hundreds to thousands of distinct kernels, and each parsed buffer asks
    for its whole string table, so after warm-up this is a dictionary hit (~2.6 us per miss).
    """
    if not name.startswith("_Z"):
        return name
    try:
        import cxxfilt
        return cxxfilt.demangle(name, external_only=True)
    except Exception:  # ImportError, cxxfilt.InvalidName, no libstdc++
        return name


def _columns(rows: np.ndarray, names: dict[str, int], offset_ns: int) -> list[KernelColumns]:
    table = [demangle(n) for n in names]  # per buffer's string table, never per record
    order = np.argsort(rows["start"], kind="stable")
    rows = rows[order]
    out = []
    devices = np.unique(rows["device"])
    for dev in devices:
        r = rows if len(devices) == 1 else rows[rows["device"] == dev]
        start = r["start"].astype(np.int64) + offset_ns
        out.append(KernelColumns.build(table, start, r["end"] - r["start"], r["name"], r["stream"],
                                       r["kind"], device=int(dev)))
    return out


class CuptiKernelSource:
    """A :class:`~trainscope.collector.sources.KernelSource` backed by the CUPTI Activity API.

    ``cupti`` is the ``cupti.cupti`` module; tests pass a stand-in. ``reason``
    says why the source is off when ``running`` is False.
    """

    name = "cupti"

    def __init__(self, config: CuptiConfig = CuptiConfig(), *, cupti: Any = None) -> None:
        self.config = config
        self._cupti = cupti
        self.running = False
        self.reason = "not started"
        self.pool = SlabPool(config.pool_slots, config.slab_records)
        self._lock = threading.Lock()
        self._inflight = 0
        self._queue: "queue.SimpleQueue[list | None]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._emit: Emit | None = None
        self._offset_ns = 0
        self._synced_at = 0.0
        self._kinds: list[int] = []
        self.stats: collections.Counter[str] = collections.Counter()
        """buffers, records, batches, dropped_records (pool full), parse_errors."""

    # ------------------------------------------------------------- control
    def start(self, emit: Emit) -> None:
        """Enable CUPTI and the parser thread; on any failure stay off and say why."""
        if self.running:
            return
        try:
            cupti = self._cupti
            if cupti is None:
                problem = version_problem()
                if problem:
                    log.warning("trainscope: CUPTI kernel source off: %s", problem)
                    return self._off(problem)
                from cupti import cupti  # lazy: optional, and needs a CUDA driver to do anything
                self._cupti = cupti
            self._emit = emit
            self._resync()
            cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
            kinds = [KIND_ID_CONCURRENT_KERNEL]
            kinds += [KIND_ID_MEMCPY] if self.config.memcpy else []
            kinds += [KIND_ID_MEMSET] if self.config.memset else []
            for k in kinds:
                cupti.activity_enable(cupti.ActivityKind(k) if hasattr(cupti, "ActivityKind") else k)
                self._kinds.append(k)
            if self.config.flush_period_ms:
                cupti.activity_flush_period(self.config.flush_period_ms)
        except ImportError as e:
            return self._off(f"cupti-python is not installed ({e})")
        except Exception as e:  # no driver, no GPU, CUPTI in use by another profiler...
            return self._off(f"CUPTI unavailable: {type(e).__name__}: {e}")
        self._thread = threading.Thread(target=self._run, name="trainscope-cupti", daemon=True)
        self._thread.start()
        self.running, self.reason = True, ""

    def _off(self, why: str) -> None:
        self.reason = why
        log.info("trainscope: CUPTI kernel source off: %s", why)
        for k in self._kinds:
            try:
                self._cupti.activity_disable(k)
            except Exception:
                pass
        self._kinds.clear()

    def stop(self, timeout_s: float = 5.0) -> None:
        if not self.running:
            return
        self.running = False
        try:
            self._cupti.activity_flush_all(1)  # forced: deliver partially filled buffers now
        except Exception:
            log.debug("CUPTI flush failed", exc_info=True)
        self._off("stopped")
        self._queue.put(None)
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)

    def _resync(self) -> None:
        """Offset from CUPTI's clock to wall-clock ns, from the closest of a few paired reads."""
        best = None
        for _ in range(3):
            a = time.time_ns()
            c = int(self._cupti.get_timestamp())
            b = time.time_ns()
            if best is None or b - a < best[0]:
                best = (b - a, (a + b) // 2 - c)
        self._offset_ns = best[1]
        self._synced_at = time.monotonic()

    # ---------------------------------------------------------- collection
    def _buffer_requested(self):
        return self.config.buffer_bytes, 0  # cupti-python allocates; 0 = no record limit

    def _buffer_completed(self, activities) -> None:
        """CUPTI's thread: hand the records over or drop them. Never parses, never blocks."""
        with self._lock:
            full = self._inflight >= self.config.pool_slots
            if not full:
                self._inflight += 1
        if full:
            self.stats["dropped_records"] += len(activities)
            return
        self._queue.put(activities)

    # ---------------------------------------------------------- processing
    def _run(self) -> None:
        while True:
            activities = self._queue.get()
            if activities is None:
                return
            try:
                self._parse(activities)
            except Exception:
                self.stats["parse_errors"] += 1
                log.debug("CUPTI buffer parse failed", exc_info=True)
            finally:
                with self._lock:
                    self._inflight -= 1

    def _parse(self, activities) -> None:
        if time.monotonic() - self._synced_at > self.config.resync_s:
            self._resync()
        slab = self.pool.take()
        if slab is None:  # cannot happen while slots == slabs; kept as a guard
            self.stats["dropped_records"] += len(activities)
            return
        try:
            batches = parse_records(activities, slab, self._offset_ns)
        finally:
            self.pool.give(slab)
        self.stats["buffers"] += 1
        self.stats["records"] += len(activities)
        for cols in batches:
            self.stats["batches"] += 1
            self._emit(cols)

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until every handed-over buffer is parsed (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._inflight == 0:
                    return True
            time.sleep(0.005)
        return False


#: Oldest cupti-python the source accepts. Checked on this machine (no GPU: records built from
#: numpy like tests/unit/test_cupti.py): 13.0.1 has no ``activity_kernel9_dtype`` (the issue: 5 of
#: 12 unit tests fail, ~37 us to build one record, x1.92 emulated overhead), 13.2.0 has neither
#: ActivityKernel9 nor ActivityKernel10, 12.8.0 does not import without cuda-python; 13.3.1 has
#: them (1.63 us per record built and read here), 13.4.0 1.28 us (the issue: 0.44 us on its
#: machine, x1.05). cupti-python 13 needs a CUDA 13 capable driver (R580+); a torch built for
#: CUDA 12 on an older driver runs with the kernel source off, saying so at start.
MIN_CUPTI_PYTHON = (13, 3, 1)


def version_problem() -> str | None:
    """Why the installed cupti-python cannot be used (too old, unknown version), or None."""
    import importlib.metadata
    import re
    try:
        v = importlib.metadata.version("cupti-python")
    except importlib.metadata.PackageNotFoundError:
        return None  # not installed: the import says so
    nums = tuple(int(x) for x in re.findall(r"\d+", v)[:3])
    if nums < MIN_CUPTI_PYTHON:
        need = ".".join(map(str, MIN_CUPTI_PYTHON))
        return (f"cupti-python {v} is older than {need} (it lacks the kernel record types this source "
                f"reads and builds records ~80x slower); pip install 'cupti-python>={need}' "
                "(needs a CUDA 13 capable driver)")
    return None


def probe(cupti: Any = None) -> tuple[bool, str]:
    """Whether CUPTI can trace here, and why not; enables nothing."""
    try:
        if cupti is None:
            problem = version_problem()
            if problem:
                return False, problem
            from cupti import cupti
        cupti.get_timestamp()  # needs the CUDA driver
        return True, ""
    except ImportError as e:
        return False, f"cupti-python is not installed ({e})"
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"


__all__ = ["CuptiConfig", "CuptiKernelSource", "MEMCPY_NAMES", "SlabPool", "parse_records", "probe"]
