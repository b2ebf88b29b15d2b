"""The deep-dive window in a rank: torch.profiler over the same iterations on every rank (issue #14, L4).

A ``DeepDiveCommand`` (``proto/v1/control.proto``) arrives on the control stream
(``collector/control.py``) and is *armed* here; the window itself opens and
closes only on the training thread, at iteration boundaries (EROICA §4.1
"Global synchronized profiling": profiling must run in the training thread, and
every worker starts and stops at the same iteration ids, not the same wall time):

1. Boundary. The torch hooks call :meth:`DeepDiveWindow.before_batch` just
   before a ``dataloader.next()`` that opens an iteration (EROICA's iteration
   starts at its first ``dataloader.next()``), with that iteration's number
   (``IterationDetector.opening``). No torch operator of ours is open there,
   so a profiler started or stopped at it cuts no operator in two.
2. Arm. :meth:`arm` (control thread) keeps one command per process: a second
   while one is armed or open is refused. Its ``start_iteration`` is checked
   at each boundary: equal → the window opens; already passed → the rank
   reports ``MISSED`` (a late start would profile other iterations than its
   peers; never started late).
3. Window. ``torch.profiler`` with CPU activity and ``with_stack`` (and CUDA
   activity when CUDA is available), one ``ProfilerStep#<iteration>``
   annotation per iteration with the job's own iteration numbers. It closes at
   the boundary of ``start + iterations`` (``DONE``), at the first boundary
   past ``max_duration_s`` (``TRUNCATED``, the iterations it covered are
   reported), or at exit (``TRUNCATED``).
4. Hand-off. Stopping the profiler is the one cost on the training thread
   besides the profiler's own (measured: ``profiler_stop_s`` in the report;
   ``tests/benchmarks/bench_deep_dive.py``). The result is saved by a worker
   thread into ``<root>/<job>/<dive>/rank-<R>.json`` (directories 0700, the
   file 0600 before it gets its name); a trace over ``max_bytes`` is removed
   (``OVERSIZE``). The report is handed to the control client; the columnar
   summary of the trace is made by the processor (``processor/control.py``),
   out of the training process: parsing a 5 MB trace holds the GIL ~0.2 s.
Never raises into the training job; without ``torch.profiler`` every command is
answered ``UNAVAILABLE`` and that is said once in the log.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import re
import threading
import time
from typing import Callable

from trainscope.proto.contracts import DIVE_ID_PATTERN
from trainscope.proto.env import deep_dive_trace_dir
from trainscope.proto.errors import ConfigError
from trainscope.proto.securefs import private_dir
from trainscope.proto.v1 import control_pb2

log = logging.getLogger(__name__)

Outcome = control_pb2.DeepDiveOutcome
_DIVE_ID = re.compile(DIVE_ID_PATTERN)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DeepDiveLimits:
    """What a rank accepts from a command, whatever the command says."""

    max_iterations: int = 200
    """Iterations of one window."""
    max_duration_s: float = 120.0
    """Wall time of one window; it closes at the first boundary past it."""
    max_bytes: int = 1 << 30
    """Largest trace kept (the smaller of this and the command's)."""

    def __post_init__(self) -> None:
        if type(self.max_iterations) is not int or self.max_iterations < 1:
            raise ConfigError("deep_dive.max_iterations", self.max_iterations, "must be an integer >= 1")
        if not self.max_duration_s > 0:
            raise ConfigError("deep_dive.max_duration_s", self.max_duration_s, "must be > 0")
        if type(self.max_bytes) is not int or self.max_bytes < 1:
            raise ConfigError("deep_dive.max_bytes", self.max_bytes, "must be an integer >= 1")


def trace_dir(root: str, job_id: str, dive_id: str) -> str:
    """``<root>/<job>/<dive>``: where every rank of the host writes its trace of one deep dive."""
    return deep_dive_trace_dir(root, job_id, dive_id)


class TorchProfiler:
    """``torch.profiler`` for one window: CPU (+ CUDA when available) activity, stacks, ProfilerStep marks."""

    def __init__(self, with_stack: bool = True) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():  # not on the machines of this repository: untested here
            acts.append(ProfilerActivity.CUDA)
        self._torch = torch
        self._prof = profile(activities=acts, with_stack=with_stack, record_shapes=False)
        self._step = None

    def start(self, iteration: int) -> None:
        self._prof.start()
        self.step(iteration)

    def step(self, iteration: int) -> None:
        """Close the previous ``ProfilerStep#`` mark, open one for ``iteration``."""
        self._end_step()
        rf = self._torch.autograd.profiler.record_function(f"ProfilerStep#{iteration}")
        rf.__enter__()
        self._step = rf

    def _end_step(self) -> None:
        rf, self._step = self._step, None
        if rf is not None:
            rf.__exit__(None, None, None)

    def stop(self) -> None:
        self._end_step()
        self._prof.stop()

    def save(self, path: str) -> None:
        """Write the Chrome-trace JSON (kineto's own writer; called on the worker thread)."""
        self._prof.profiler.kineto_results.save(path)


def probe_profiler() -> tuple[bool, str]:
    """Can this process run ``torch.profiler``? (False, why) when not."""
    try:
        from torch.profiler import ProfilerActivity, profile  # noqa: F401
        from torch.autograd.profiler import record_function  # noqa: F401
        return True, ""
    except ImportError as e:
        return False, f"torch.profiler cannot be imported: {e}"
    except Exception as e:  # a broken torch install
        return False, f"torch.profiler unusable: {e}"


@dataclasses.dataclass
class _Open:
    cmd: control_pb2.DeepDiveCommand
    profiler: object
    first: int
    t0: float
    wall0: int
    directory: str
    last: int = 0   # the iteration in progress (the last ProfilerStep opened)


class DeepDiveWindow:
    """One rank's deep-dive state: armed command, open window, the writer thread."""

    def __init__(self, root: str, resource_pb, report: Callable[[control_pb2.DeepDiveReport], None], *,
                 limits: DeepDiveLimits = DeepDiveLimits(),
                 profiler_factory: Callable[[bool], object] | None = None,
                 available: tuple[bool, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.resource_pb = resource_pb
        self.limits = limits
        self._report = report
        self._factory = profiler_factory or TorchProfiler
        self.available, self.reason = available if available is not None else (
            (True, "") if profiler_factory is not None else probe_profiler())
        self._clock = clock
        self._lock = threading.Lock()
        self._armed: control_pb2.DeepDiveCommand | None = None
        self._open: _Open | None = None
        self._writing = 0
        self._jobs: queue.Queue = queue.Queue(maxsize=2)
        self._worker: threading.Thread | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        self._said_unavailable = False

    # ------------------------------------------------------------- control thread
    def arm(self, cmd: control_pb2.DeepDiveCommand) -> str | None:
        """Arm a command; returns why it was refused, or None. Never raises."""
        try:
            if not _DIVE_ID.fullmatch(cmd.dive_id or ""):
                return self._refuse(cmd, "bad dive id", Outcome.DEEP_DIVE_OUTCOME_FAILED)
            if cmd.ranks and self.resource_pb.rank not in cmd.ranks:
                self.stats["not_for_me"] += 1
                return "not for this rank"
            if not self.available:
                if not self._said_unavailable:
                    self._said_unavailable = True
                    log.warning("trainscope: deep dive asked for, but %s; no trace from this rank", self.reason)
                return self._refuse(cmd, self.reason, Outcome.DEEP_DIVE_OUTCOME_UNAVAILABLE)
            if cmd.iterations < 1:
                return self._refuse(cmd, "iterations must be >= 1", Outcome.DEEP_DIVE_OUTCOME_FAILED)
            with self._lock:
                busy = self._armed is not None or self._open is not None or self._writing
                if not busy:
                    self._armed = cmd
            if busy:  # one window at a time per process
                return self._refuse(cmd, "a deep dive is already armed or open",
                                    Outcome.DEEP_DIVE_OUTCOME_BUSY)
            self.stats["armed"] += 1
            return None
        except Exception as e:
            self.stats["errors"] += 1
            log.debug("deep dive arm failed", exc_info=True)
            return str(e)

    def _refuse(self, cmd, why: str, outcome) -> str:
        self.stats["refused"] += 1
        self._send(self._make_report(cmd, outcome, detail=why))
        return why

    @property
    def busy(self) -> bool:
        return self._armed is not None or self._open is not None

    # ------------------------------------------------------------ training thread
    def before_batch(self, iteration: int | None) -> None:
        """A ``dataloader.next()`` is about to run; ``iteration``: the one it opens, None inside one.

        Costs two attribute reads when nothing is armed or open; never raises.
        """
        if iteration is None or (self._armed is None and self._open is None):
            return
        try:
            self._boundary(iteration)
        except Exception:
            self.stats["errors"] += 1
            log.debug("deep dive boundary failed", exc_info=True)

    def _boundary(self, it: int) -> None:
        w = self._open
        if w is not None:
            end = w.first + min(w.cmd.iterations, self.limits.max_iterations)
            if it >= end:
                self._close(Outcome.DEEP_DIVE_OUTCOME_DONE, it - 1)
            elif self._clock() - w.t0 >= self._max_duration(w.cmd):
                self._close(Outcome.DEEP_DIVE_OUTCOME_TRUNCATED, it - 1, "duration cap")
            elif it > w.last:
                # at an epoch's end the exhausted loader's last __next__ and the next epoch's first both
                # open the same iteration: one ProfilerStep for it (a second made a 0.3 ms step)
                w.profiler.step(it)
                w.last = it
            return
        cmd = self._armed
        if cmd is None or it < cmd.start_iteration:
            return
        with self._lock:
            self._armed = None
        if it > cmd.start_iteration:
            self.stats["missed"] += 1
            self._send(self._make_report(cmd, Outcome.DEEP_DIVE_OUTCOME_MISSED,
                                         detail=f"iteration {it} began before the command's "
                                                f"start iteration {cmd.start_iteration} was seen"))
            return
        self._start(cmd, it)

    def _max_duration(self, cmd) -> float:
        d = cmd.max_duration_s
        return min(d, self.limits.max_duration_s) if d > 0 else self.limits.max_duration_s

    def _start(self, cmd, it: int) -> None:
        from torch import autograd

        if autograd._profiler_enabled():  # the job's own profiler, or the CPU operator source's window
            self.stats["busy"] += 1
            self._send(self._make_report(cmd, Outcome.DEEP_DIVE_OUTCOME_BUSY, detail="another profiler is on"))
            return
        self._start_with(cmd, it)

    def _start_with(self, cmd, it: int) -> None:
        """Open the window (split from ``_start`` so tests without torch can drive it)."""
        try:
            directory = trace_dir(self.root, cmd.job_id or self.resource_pb.job_id, cmd.dive_id)
            for d in (self.root, os.path.dirname(directory), directory):  # every level 0700, ours
                private_dir(d, "deep_dive.dir")
            prof = self._factory(cmd.with_stack)
            prof.start(it)
        except Exception as e:
            self.stats["errors"] += 1
            self._send(self._make_report(cmd, Outcome.DEEP_DIVE_OUTCOME_FAILED, detail=f"could not start: {e}"))
            return
        self.stats["windows"] += 1
        self._open = _Open(cmd, prof, it, self._clock(), time.time_ns(), directory, it)

    def _close(self, outcome, last: int, detail: str = "") -> None:
        w, self._open = self._open, None
        if w is None:
            return
        t = time.perf_counter()
        try:
            w.profiler.stop()
        except Exception as e:
            self.stats["errors"] += 1
            self._send(self._make_report(w.cmd, Outcome.DEEP_DIVE_OUTCOME_FAILED, detail=f"stop failed: {e}"))
            return
        stop_s = time.perf_counter() - t
        rep = self._make_report(w.cmd, outcome, first=w.first, last=last, detail=detail)
        rep.start_unix_ns, rep.end_unix_ns, rep.profiler_stop_s = w.wall0, time.time_ns(), stop_s
        with self._lock:
            self._writing += 1
        try:
            self._ensure_worker()
            self._jobs.put_nowait((w, rep))
        except Exception:  # queue full cannot happen with one window at a time; be safe anyway
            with self._lock:
                self._writing -= 1
            rep.outcome, rep.detail = Outcome.DEEP_DIVE_OUTCOME_FAILED, "writer busy"
            self._send(rep)

    def close_at_exit(self) -> None:
        """The process ends: an open window closes (TRUNCATED) and is written; bounded wait."""
        w = self._open
        if w is not None:
            try:
                self._close(Outcome.DEEP_DIVE_OUTCOME_TRUNCATED, w.last, "the job ended")
            except Exception:
                log.debug("deep dive close at exit failed", exc_info=True)
        self.wait_written(10.0)

    def wait_written(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._writing and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._writing

    # -------------------------------------------------------------- writer thread
    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._drain, name="trainscope-deep-dive", daemon=True)
            self._worker.start()

    def _drain(self) -> None:
        while True:
            w, rep = self._jobs.get()
            try:
                self._write(w, rep)
            except Exception as e:
                self.stats["errors"] += 1
                rep.outcome, rep.detail = Outcome.DEEP_DIVE_OUTCOME_FAILED, f"write failed: {e}"
                log.debug("deep dive write failed", exc_info=True)
            finally:
                with self._lock:
                    self._writing -= 1
            self._send(rep)

    def _write(self, w: _Open, rep) -> None:
        rank = self.resource_pb.rank
        path = os.path.join(w.directory, f"rank-{rank}.json")
        part = path + f".{os.getpid()}.part"
        w.profiler.save(part)  # in our 0700 directory: nobody else can open it before the chmod
        os.chmod(part, 0o600)
        size = os.path.getsize(part)
        cap = min(w.cmd.max_bytes or self.limits.max_bytes, self.limits.max_bytes)
        rep.trace_bytes = size
        if size > cap:
            os.unlink(part)
            self.stats["oversize"] += 1
            rep.outcome = Outcome.DEEP_DIVE_OUTCOME_OVERSIZE
            rep.detail = f"trace of {size} B over the cap of {cap} B: removed"
            return
        os.replace(part, path)
        rep.trace_path = path
        self.stats["traces"] += 1
        self.stats["trace_bytes"] += size

    # ------------------------------------------------------------------ reports
    def _make_report(self, cmd, outcome, *, first: int = 0, last: int = 0, detail: str = ""):
        rep = control_pb2.DeepDiveReport(resource=self.resource_pb, dive_id=cmd.dive_id, outcome=outcome,
                                         detail=detail)
        rep.first_iteration, rep.last_iteration = first, last
        return rep

    def _send(self, rep) -> None:
        self.stats[f"outcome_{Outcome.Name(rep.outcome).removeprefix('DEEP_DIVE_OUTCOME_').lower()}"] += 1
        try:
            self._report(rep)
        except Exception:
            self.stats["report_errors"] += 1
            log.debug("deep dive report failed", exc_info=True)


__all__ = ["DeepDiveLimits", "DeepDiveWindow", "TorchProfiler", "probe_profiler", "trace_dir"]
