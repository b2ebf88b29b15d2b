"""The per-host stack sidecar: py-spy samples of every rank process in fixed windows (ARGUS §4.1).

    python -m trainscope.collector.stacks --run-dir DIR [--processor ADDR] [--window-s 10]

py-spy reads a process's memory from outside, so the sampling cost stays out
of the training process (and so does a py-spy crash). The sidecar:

1. Finds the rank processes of this host in the run directory: each rank's
   collector writes ``rank-<pid>.json`` holding its ``Resource`` (job, rank,
   coordinates) when it starts and when its coordinates change
   (``write_rank_file``). Files of dead processes are ignored and removed.
2. Per rank, back-to-back windows of ``window_s`` seconds: two
   ``py-spy record --format raw --nonblocking --threads`` runs over the same
   window, one with ``--idle`` (every thread, every sample) and one without
   (only threads that were running). Their difference per stack is the idle
   count: py-spy's raw output has no idle marker of its own.
3. Each window becomes one ``StackSnapshot``: folded stacks (``thread
   name;outermost frame;...;innermost frame``) with counts, thread id and
   idle flag, the ``max_stacks`` most frequent kept, the sample total exact.
4. Snapshots go to the processor through the sidecar's own bounded exporter,
   each batch with the rank's ``Resource`` (``pid`` is the sidecar's, so the
   processor's per-process sequence check does not mix the two exporters; the
   rank's pid is in ``attributes["sampled_pid"]``).
5. The sidecar exits on SIGTERM/SIGINT, or after ``idle_exit_s`` without a
   live rank once it has seen one.

py-spy needs ptrace rights over the ranks (root, CAP_SYS_PTRACE, or
``kernel.yama.ptrace_scope=0``); without them each window fails, is counted in
``stats["errors"]`` and logged once.

The stack grid (Mycroft §5) is the other use of py-spy here: :class:`StackDumper`
takes one ``py-spy dump`` of its own rank when the processor asks (a collective
trigger on one of the rank's groups, ``StackDumpCommand`` on the control stream)
and returns it on the ingest stream; :func:`parse_dump` reads py-spy's JSON.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

from trainscope.collector.flight_recorder import read_view
from trainscope.proto import env
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import ParallelCoords, Resource
from trainscope.proto.securefs import owned_by_me, private_dir, write_private
from trainscope.proto.v1 import telemetry_pb2

log = logging.getLogger(__name__)

_THREAD = re.compile(r"^thread \((0x[0-9a-fA-F]+|\d+)\)(?::\s*(.*))?$")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StackSamplerConfig:
    window_s: float = env.DEFAULT_STACKS_WINDOW_S
    """Length of one sampling window per rank."""
    rate_hz: int = 20
    """py-spy samples per second."""
    max_stacks: int = 200
    """Folded stacks kept per window (most frequent first); the sample total stays exact."""
    py_spy: str = "py-spy"
    """The py-spy executable (a name on PATH or a path)."""
    idle_exit_s: float = 30.0
    """Exit after this long without a live rank, once one was seen."""
    poll_s: float = 0.2
    """How often the sidecar checks for finished windows and new ranks."""

    def __post_init__(self) -> None:
        for name in ("window_s", "idle_exit_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"stacks.{name}", getattr(self, name), "must be > 0")
        if type(self.rate_hz) is not int or not 1 <= self.rate_hz <= 1000:
            raise ConfigError("stacks.rate_hz", self.rate_hz, "must be an integer in [1, 1000]")
        if type(self.max_stacks) is not int or self.max_stacks < 1:
            raise ConfigError("stacks.max_stacks", self.max_stacks, "must be an integer >= 1")


# ------------------------------------------------------------ rank registry
def write_rank_file(run_dir: str, resource: Resource) -> str:
    """Announce a rank process to the host's sidecar: a 0600 file in a private directory,
    written through ``mkstemp`` and an atomic rename (no predictable ``.tmp`` to plant a link at)."""
    private_dir(run_dir, "run_dir")
    path = os.path.join(run_dir, f"rank-{resource.pid}.json")
    write_private(path, json.dumps(dataclasses.asdict(resource)))
    return path


def read_rank_files(run_dir: str) -> dict[int, Resource]:
    """Live rank processes announced in ``run_dir``, by pid; stale files are removed."""
    out: dict[int, Resource] = {}
    try:
        names = os.listdir(run_dir)
    except OSError:
        return out
    for name in names:
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        path = os.path.join(run_dir, name)
        if not owned_by_me(path):
            # another user's file (or a link): never attach py-spy to what it names
            log.warning("ignoring rank file %s: not a regular file of this user", path)
            continue
        try:
            with open(path) as f:
                d = json.load(f)
            res = Resource(**{**d, "coords": ParallelCoords(**d["coords"])})
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if _alive(res.pid):
            out[res.pid] = res
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not a rank any more
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


# ------------------------------------------------------------------ parsing
def parse_raw(text: str) -> collections.Counter:
    """py-spy ``--format raw --threads`` output -> Counter{(thread_id, folded stack): count}.

    A line is ``thread (TID): NAME;frame;...;frame COUNT`` (outermost frame
    first). The folded stack keeps the thread name as its root.
    """
    out: collections.Counter = collections.Counter()
    for line in text.splitlines():
        line = line.strip()
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, _, frames = stack.partition(";")
        m = _THREAD.match(head)
        if m:
            tid = int(m.group(1), 0)
            name = m.group(2) or f"thread-{tid}"
            stack = f"{name};{frames}" if frames else name
        else:
            tid = 0
        out[(tid, stack)] += int(count)
    return out


def snapshot(all_samples: collections.Counter, active: collections.Counter, start_ns: int, end_ns: int,
             max_stacks: int) -> telemetry_pb2.StackSnapshot:
    """Merge the ``--idle`` and the active-only run of one window into a snapshot."""
    rows = []
    for key, n in all_samples.items():
        a = min(active.get(key, 0), n)
        if a:
            rows.append((a, key, False))
        if n - a:
            rows.append((n - a, key, True))
    for key, a in active.items():  # sampled as active but missed by the --idle run
        if key not in all_samples:
            rows.append((a, key, False))
    rows.sort(key=lambda r: -r[0])
    snap = telemetry_pb2.StackSnapshot(window_start_ns=start_ns, window_end_ns=end_ns,
                                       samples=sum(r[0] for r in rows))
    for n, (tid, stack), idle in rows[:max_stacks]:
        snap.stacks.append(telemetry_pb2.FoldedStack(stack=stack, count=n, thread_id=tid & 0xFFFFFFFF,
                                                     idle=idle))
    return snap


# ------------------------------------------------------------------ sidecar
@dataclasses.dataclass
class _Window:
    pid: int
    start_ns: int
    procs: list  # [(Popen, output path)] for the --idle and the active-only run


class StackSidecar:
    """Samples every rank announced in ``run_dir`` and exports StackBatch per window.

    ``submit(batch, nbytes, resource)`` is the exporter's ``submit``; tests may
    pass a list's ``append``-like callable instead of a real exporter.
    """

    def __init__(self, run_dir: str, submit, config: StackSamplerConfig = StackSamplerConfig()) -> None:
        self.run_dir = run_dir
        self.config = config
        self._submit = submit
        self._stop = threading.Event()
        self._windows: dict[int, _Window] = {}
        self._ranks: dict[int, Resource] = {}
        self._tmp = tempfile.mkdtemp(prefix="trainscope-stacks-")
        self.stats: collections.Counter[str] = collections.Counter()
        """windows, samples, errors, submitted, dropped."""
        self._warned = False
        self._closing = False
        self.py_spy = shutil.which(config.py_spy) or (config.py_spy if os.path.exists(config.py_spy) else None)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        """Loop until stopped or idle; returns 0, or 2 when py-spy is missing."""
        if self.py_spy is None:
            log.error("trainscope stacks: py-spy not found (%s); no stacks will be sampled", self.config.py_spy)
            return 2
        seen_at, start = None, time.monotonic()
        try:
            while not self._stop.is_set():
                self._ranks = read_rank_files(self.run_dir)
                now = time.monotonic()
                if self._ranks:
                    seen_at = now
                elif now - (seen_at if seen_at is not None else start) > self.config.idle_exit_s:
                    break
                self.tick()
                self._stop.wait(self.config.poll_s)
        finally:
            self._close_windows()
            shutil.rmtree(self._tmp, ignore_errors=True)
        return 0

    def tick(self) -> None:
        """Collect finished windows and start new ones for ranks without one."""
        for pid, w in list(self._windows.items()):
            if all(p.poll() is not None for p, _ in w.procs):
                del self._windows[pid]
                self._finish(w)
        for pid in self._ranks:
            if pid not in self._windows:
                self._windows[pid] = self._begin(pid)

    def _begin(self, pid: int) -> _Window:
        cfg = self.config
        procs = []
        for tag, extra in (("all", ["--idle"]), ("active", [])):
            out = os.path.join(self._tmp, f"{pid}-{tag}.txt")
            cmd = [self.py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(cfg.window_s))),
                   "--rate", str(cfg.rate_hz), "--format", "raw", "--threads", "--nonblocking",
                   "--output", out, *extra]
            procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                           start_new_session=True), out))
        return _Window(pid, time.time_ns(), procs)

    def _finish(self, w: _Window) -> None:
        end_ns = time.time_ns()
        texts = []
        for p, out in w.procs:
            err = p.stderr.read().decode(errors="replace") if p.stderr else ""
            if p.stderr:
                p.stderr.close()
            try:
                with open(out) as f:
                    texts.append(f.read())
                os.unlink(out)
            except OSError:
                texts.append(None)
            if p.returncode != 0 and not self._closing:
                self.stats["errors"] += 1
                if not self._warned:
                    self._warned = True
                    # one line: py-spy's "Error: ..." line, not the Rust backtrace that follows it
                    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
                    why = next((ln for ln in lines if ln.lower().startswith("error")), lines[0] if lines else "")
                    log.warning("trainscope stacks: py-spy failed on pid %d (rc %s): %s",
                                w.pid, p.returncode, why[:200])
        res = self._ranks.get(w.pid)
        if res is None or texts[0] is None:
            return
        snap = snapshot(parse_raw(texts[0]), parse_raw(texts[1] or ""), w.start_ns, end_ns,
                        self.config.max_stacks)
        if not snap.samples:
            return
        self.stats["windows"] += 1
        self.stats["samples"] += snap.samples
        res = dataclasses.replace(res, pid=os.getpid(),
                                  attributes={**res.attributes, "sampled_pid": str(w.pid),
                                              "source": "py-spy"})
        batch = telemetry_pb2.StackBatch(snapshots=[snap])
        ok = self._submit(batch, batch.ByteSize(), res)
        self.stats["submitted" if ok is not False else "dropped"] += 1

    def _close_windows(self) -> None:
        """Stop the open windows early (py-spy writes what it has on SIGINT) and export them."""
        for w in self._windows.values():
            for p, _ in w.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
        self._closing = True  # py-spy's exit status means nothing after SIGINT
        for w in list(self._windows.values()):
            for p, _ in w.procs:
                try:
                    p.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            self._finish(w)
        self._windows.clear()


# ------------------------------------------------------------- stack grid
def parse_dump(text: str, max_threads: int = 64, max_frames: int = 128) -> list[telemetry_pb2.FoldedStack]:
    """``py-spy dump --json`` output -> one ``FoldedStack`` per thread (count 1), in the sidecar's
    folded form: ``thread name;outermost frame;...;innermost frame``, a frame ``function (file:line)``.

    py-spy lists a thread's frames innermost first; the ``max_frames`` innermost are kept (the
    stack grid clusters on them) and at most ``max_threads`` threads. Raises ``ValueError`` on
    output that is not py-spy's JSON.
    """
    doc = json.loads(text)
    if not isinstance(doc, list):
        raise ValueError("py-spy dump: expected a JSON list of threads")
    out = []
    for t in doc[:max_threads]:
        if not isinstance(t, dict):
            raise ValueError("py-spy dump: a thread is not an object")
        frames = []
        for f in (t.get("frames") or ())[:max_frames]:
            name = str(f.get("name") or "?")
            where = f.get("short_filename") or os.path.basename(str(f.get("filename") or "?"))
            frames.append(f"{name} ({where}:{int(f.get('line') or 0)})")
        tid = int(t.get("os_thread_id") or t.get("thread_id") or 0)
        name = str(t.get("thread_name") or f"thread-{tid}")
        out.append(telemetry_pb2.FoldedStack(stack=";".join([name, *reversed(frames)]), count=1,
                                             thread_id=tid & 0xFFFFFFFF, idle=not t.get("active", False)))
    return out


class StackDumper:
    """The collector's end of a stack-grid request (``StackDumpCommand``, Mycroft §5).

    1. ``request`` (the control stream's thread; O(1), never blocks): one dump at a time: a
       request while one runs is refused and counted (the processor rate-limits grids per group).
    2. A daemon thread runs ``py-spy dump --pid <this process> --json [--nonblocking]`` out of
       process, killed after the command's timeout: the training thread is never stopped by us
       (``--nonblocking``: py-spy reads the stacks without pausing the process either).
    2b. On the same thread, before py-spy: this process's PyTorch Flight Recorder view
       (``flight_recorder.read_view``: per process group the newest seq entered and the last
       entries, bounded), or why there is none (torch not loaded, recorder off), with how the
       read went (outcome ok | off | error, the entries torch's dump held, the read's wall time)
       for the processor's ``flight_recorder_*`` counters.
    2c. A transient py-spy failure (the ``--nonblocking`` read races the interpreter, so py-spy may
       fail to copy a frame; bad output) is run again, at most 3 runs within the command's timeout;
       a permanent one (ptrace refused, no such process, timed out) is not.
    3. The dump (or the reason there is none: py-spy missing, ptrace refused, timeout, bad
       output) goes to the processor as a ``CollectiveBatch`` with one ``StackDump`` through the
       exporter's bounded queue (``submit``), like every other record of this rank.
    py-spy needs ptrace rights over this process (root, CAP_SYS_PTRACE, or
    ``kernel.yama.ptrace_scope`` 0: at 1 a child may not trace its parent).
    """

    def __init__(self, submit, *, py_spy: str = "py-spy", pid: int | None = None, nonblocking: bool = True,
                 run=None, training_thread: int | None = None, flight_recorder=None) -> None:
        self._submit = submit
        self._fr = flight_recorder or read_view   # () -> flight_recorder.FrRead
        self.py_spy = shutil.which(py_spy) or (py_spy if os.path.exists(py_spy) else None)
        self._pid = pid
        self.nonblocking = nonblocking
        self._run = run or _run_py_spy
        self._training = training_thread
        self._busy = threading.Lock()
        self.stats: collections.Counter[str] = collections.Counter()
        """requests, busy, dumps, errors, retries, submitted, dropped; fr_views, fr_missing (Flight Recorder)."""

    def request(self, cmd) -> bool:
        """Start one dump for ``cmd`` (a ``StackDumpCommand``); False when one is running."""
        self.stats["requests"] += 1
        if not self._busy.acquire(blocking=False):
            self.stats["busy"] += 1
            return False
        try:
            threading.Thread(target=self._dump_and_release, args=(cmd,), name="trainscope-stack-dump",
                             daemon=True).start()
        except RuntimeError:   # interpreter shutdown: no new threads
            self._busy.release()
            self.stats["busy"] += 1
            return False
        return True

    def _dump_and_release(self, cmd) -> None:
        try:
            self.submit(self.dump(cmd))
        except Exception:  # the thread must never raise into the process
            log.debug("trainscope stack dump failed", exc_info=True)
        finally:
            self._busy.release()

    def dump(self, cmd) -> telemetry_pb2.StackDump:
        """Step 2 (on the calling thread): one dump of this process for ``cmd``."""
        pid = self._pid or os.getpid()
        training = self._training if self._training is not None else threading.main_thread().native_id
        d = telemetry_pb2.StackDump(grid_id=cmd.grid_id, group=cmd.group, trigger=cmd.trigger, seq=cmd.seq,
                                    expected_ranks=cmd.ranks, taken_unix_ns=time.time_ns(),
                                    training_thread=(training or 0) & 0xFFFFFFFF)
        self._flight_recorder(d)
        if self.py_spy is None:
            d.error = "py-spy not found"
        else:
            cmd_line = [self.py_spy, "dump", "--pid", str(pid), "--json",
                        *(["--nonblocking"] if self.nonblocking else [])]
            t0 = time.monotonic()
            deadline = t0 + min(max(cmd.timeout_s or 5.0, 0.5), 30.0)
            for _ in range(_ATTEMPTS):
                d.error = self._attempt(d, cmd_line, deadline - time.monotonic())
                # 2c. a transient failure (a --nonblocking read racing the interpreter, a busy host)
                # is tried again while the command's time lasts; a permanent one is not
                if not d.error or _permanent(d.error) or deadline - time.monotonic() < _RETRY_MIN_S:
                    break
                self.stats["retries"] += 1
            d.took_s = round(time.monotonic() - t0, 4)
        self.stats["errors" if d.error else "dumps"] += 1
        return d

    def _attempt(self, d: telemetry_pb2.StackDump, cmd_line: list[str], timeout_s: float) -> str:
        """One py-spy run: its threads into ``d`` and "", or why there are none."""
        try:
            rc, out, err = self._run(cmd_line, max(timeout_s, 0.1))
            if rc != 0:
                lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
                return (next((ln for ln in lines if ln.lower().startswith("error")),
                             lines[0] if lines else f"py-spy exit status {rc}"))[:200]
            threads = parse_dump(out)
            if not threads:
                return "py-spy found no Python thread"
        except (subprocess.TimeoutExpired, TimeoutError):
            return "py-spy timed out"
        except (OSError, ValueError, TypeError, AttributeError) as e:
            return f"py-spy dump unreadable: {e}"[:200]
        d.threads.extend(threads)     # only a successful run gets here, and it ends the attempts
        return ""

    def _flight_recorder(self, d: telemetry_pb2.StackDump) -> None:
        """Step 2b: this process's Flight Recorder view (``flight_recorder.read_view``: in process, on this
        thread, bounded per group; why there is none in ``flight_recorder_error``), the read's outcome,
        the entries torch's dump held and the read's wall time. Never raises."""
        t0 = time.monotonic()
        try:
            r = self._fr()
            d.flight_recorder.extend(r.groups)
            d.flight_recorder_error = "" if r.groups else (r.why or "no Flight Recorder view")[:200]
            d.flight_recorder_outcome = r.outcome if r.groups or r.outcome != "ok" else "error"
            d.flight_recorder_entries = max(int(r.entries), 0)
        except Exception as e:
            del d.flight_recorder[:]
            d.flight_recorder_error = f"Flight Recorder view failed: {type(e).__name__}: {e}"[:200]
            d.flight_recorder_outcome = "error"
        d.flight_recorder_read_s = round(time.monotonic() - t0, 6)
        self.stats["fr_views" if len(d.flight_recorder) else "fr_missing"] += 1

    def submit(self, d: telemetry_pb2.StackDump) -> bool:
        """Step 3: the dump on the ingest stream (bounded exporter queue; drop counted)."""
        batch = telemetry_pb2.CollectiveBatch(dumps=[d])
        ok = self._submit(batch, batch.ByteSize())
        self.stats["submitted" if ok is not False else "dropped"] += 1
        return ok is not False


_ATTEMPTS = 3
"""py-spy runs per dump at most (step 2c), all within the command's timeout."""
_RETRY_MIN_S = 0.5
"""No new attempt with less than this left of the command's timeout."""
_PERMANENT = ("permission denied", "operation not permitted", "no such process", "timed out", "not found")


def _permanent(error: str) -> bool:
    """A failure another py-spy run within the same second would repeat (rights, a gone process, time)."""
    e = error.lower()
    return any(p in e for p in _PERMANENT)


def _run_py_spy(cmd: list[str], timeout_s: float) -> tuple[int, str, str]:
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s,
                       start_new_session=True)
    return p.returncode, p.stdout, p.stderr


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainscope.collector.stacks``: run the sidecar for one run directory."""
    from trainscope.collector.exporter import BatchExporter
    from trainscope.collector.exporter_config import ExporterConfig
    from trainscope.collector.exporter_socket import reachable

    ap = argparse.ArgumentParser(prog="trainscope-stacks", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("--run-dir", required=True, help="directory where ranks announce themselves")
    d = StackSamplerConfig()
    ap.add_argument("--processor", default=env.text(env.PROCESSOR) or ExporterConfig().target)
    ap.add_argument("--window-s", type=float, default=d.window_s)
    ap.add_argument("--rate", type=int, default=d.rate_hz)
    ap.add_argument("--idle-exit-s", type=float, default=d.idle_exit_s)
    ap.add_argument("--py-spy", default=d.py_spy)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = StackSamplerConfig(window_s=args.window_s, rate_hz=args.rate, idle_exit_s=args.idle_exit_s,
                                 py_spy=args.py_spy)
        exporter = BatchExporter(Resource(job_id="stacks-sidecar", rank=0, world_size=1, pid=os.getpid()),
                                 ExporterConfig(target=args.processor, shutdown_timeout_s=3.0))
    except ConfigError as e:
        print(f"trainscope-stacks: {e}", file=sys.stderr)
        return 2
    car = StackSidecar(args.run_dir, exporter.submit, cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: car.stop())
    rc = car.run()
    exporter.shutdown(3.0 if reachable(args.processor) else 0.2)  # nobody to flush to: do not linger
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
