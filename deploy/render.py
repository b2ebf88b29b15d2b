"""Text for people: verdicts, scores against ground truth, simulator runs, query answers.

The CLI and the demo print through these; every number carries its unit.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, TextIO


def render_verdicts(verdicts) -> str:
    """One line per window that has findings; 'healthy' when none has."""
    lines = [f"  {window_label(v.window)}: {v.summary}" for v in verdicts if v.ranks or v.findings]
    if not lines:
        return "verdict: healthy (no suspects)"
    return "verdict:\n" + "\n".join(lines)


def window_label(w) -> str:
    """``window 4 (iterations 40-49)``: the index with the span a person reads (``analyzer.query.window_span``)."""
    from trainscope.analyzer.query import window_span

    span = window_span(w)
    return f"window {w.index}" + (f" ({span})" if span else "")


def render_evaluation(ev) -> str:
    """Verdicts against the ground truth, one line per injected fault."""
    lines = [f"against the ground truth: {ev.false_alarm_windows} of {ev.healthy_windows} healthy windows "
             "named a suspect"]
    for f in ev.faults:
        mark = "caught" if f.caught else "MISSED"
        lines.append(f"  {f.fault}: {mark}" + (f" at window {f.first_window} (onset {f.onset_window})"
                                                 if f.caught else "")
                     + f"; top-1 rank {'right' if f.top1 else 'wrong'}, phase {'right' if f.phase else '-'}, "
                       f"kernel {'right' if f.kernel else '-'}; levels {'+'.join(f.levels) or '-'}")
    return "\n".join(lines)


def render_sim(res, out) -> None:
    print(f"simulated job {res.job_id!r}: {res.ranks} ranks, {res.iterations} iterations, "
          f"{res.sim_seconds:.1f} simulated s" + (" (hung)" if res.hung else ""), file=out)
    print(f"  {res.kernel_events:,} kernel events, {res.phase_events:,} phases, {res.iteration_events:,} "
          f"iteration marks, {res.stack_snapshots:,} stack snapshots "
          f"({'/'.join(map(str, sorted(set(res.kernels_per_iteration))))} kernels per rank per iteration)", file=out)
    print(f"  wall {res.wall_s:.2f} s: {res.events_per_s:,.0f} events/s end to end, "
          f"{res.generated_per_s:,.0f} events/s generated", file=out)
    where = res.processor_address or "no processor"
    print(f"  sent to {where}" + (f", {res.dropped} dropped" if res.dropped else ", nothing dropped"), file=out)
    if res.store_path:
        print(f"  store: {res.store_path}", file=out)
    if res.traces_out:
        print(f"  traces: {res.traces_out}", file=out)
    print(f"  ground truth: {res.ground_truth_path}", file=out, flush=True)


def render_query(result) -> str:
    """A query answer as text: a verdict as summary + tables, a list answer as one table."""
    from trainscope.analyzer.query_model import VerdictView

    if isinstance(result, VerdictView):
        v = result
        its = f" ({v.iterations})" if v.iterations else ""
        where = f"window {v.window}{its}" if v.window is not None else "all windows"
        head = [f"job {v.job}, {where}", v.summary,
                f"state {v.state}, confidence {v.confidence:.2f}"
                + (f", host {v.host}" if v.host else "")
                + (f", since window {v.since_window}" if v.since_window is not None else "")
                + (f" ({v.since_span})" if v.since_span else "")
                + f", compared with {v.comparison or 'peers'}"] + ([v.stacks] if v.stacks else [])
        if not v.suspects and not v.findings:
            return "\n".join(head + [f"verdict: {v.state} (no suspects)"])
        out = head
        for title, rows in (("suspects (impact = time lost per iteration)", v.suspects), ("findings", v.findings)):
            out += ["", f"{title}:", _table(rows)] if rows else []
        return "\n".join(out)
    if not result.rows:
        since = result.params.get("since")
        return f"no {result.query} for job {result.job}" + (f" since {since}" if since else "")
    return _table(result.rows)


def _table(rows) -> str:
    """Dataclass rows as aligned columns; ``*_s`` fields as durations with their unit (headed without
    the ``_s``), long cells cut (not the last)."""
    def cell(name: str, v) -> str:
        if v is None or v == ():
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, tuple):
            return ",".join(map(str, v))
        if isinstance(v, float) and name.endswith("_pct"):
            return f"{v:.1f} %"
        if isinstance(v, float) and name.endswith("_s"):
            return next(f"{v * k:.3g} {u}" for k, u in ((1, "s"), (1e3, "ms"), (1e6, "us"), (1e9, "ns"))
                        if v * k >= 1 or u == "ns")
        if isinstance(v, float) and (name == "ratio" or name.endswith("_ratio")):
            return f"{v:.2f}x"  # a ratio to the peers: "x" says so (1.00x = like them)
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    names = [f.name for f in dataclasses.fields(rows[0])]
    # a *_s field's cells carry their own unit (781 ms, 3.03 s): its header is not named in seconds
    grid = [[n.removesuffix("_s").upper() for n in names]]
    for r in rows:
        cells = [cell(n, getattr(r, n)) for n in names]
        grid.append([c if len(c) <= 60 or i == len(names) - 1 else c[:59] + "…" for i, c in enumerate(cells)])
    widths = [max(len(row[i]) for row in grid) for i in range(len(names))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in grid)


class Progress:
    """One status line on stderr for a long command (``sim``, ``replay``, a slow ``query``).

    No progress library is a dependency, so: redrawn in place (``\\r``) at most 5 times a second,
    and only on a terminal; piped or redirected stderr (CI logs, ``2>file``, the tests) gets
    nothing, so machine-read output and one-line errors stay as they are. stdout is never
    touched (``--json`` output is not mixed with it). ``close()`` clears the line.
    """

    def __init__(self, what: str, total: int | None = None, unit: str = "", *, stream: TextIO | None = None,
                 interval_s: float = 0.2, clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.on = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s, self.clock = interval_s, clock
        self.t0 = clock()
        self._last = float("-inf")
        self._shown = False

    def update(self, done: int | None = None, note: str = "") -> None:
        """``done`` units so far (None: only the time spent is shown)."""
        if not self.on:
            return
        now = self.clock()
        if now - self._last < self.interval_s:
            return
        self._last = now
        of = f"/{self.total:,}" if self.total else ""
        pct = f" ({100 * done / self.total:.0f} %)" if self.total and done is not None else ""
        count = f"{done:,}{of} {self.unit}{pct}, " if done is not None else ""
        text = f"{self.what}: {count}{now - self.t0:.0f} s" + (f", {note}" if note else "")
        self.stream.write("\r" + text + "\x1b[K")
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    def ticking(self, after_s: float = 1.0) -> "_Ticker":
        """A context in which a thread shows the time spent from ``after_s`` on (a query has no count)."""
        return _Ticker(self, after_s)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Ticker:
    def __init__(self, progress: Progress, after_s: float) -> None:
        import threading

        self.progress, self.after_s = progress, after_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trainscope-progress", daemon=True)

    def _run(self) -> None:
        if self.stop.wait(self.after_s):
            return  # finished quickly: nothing shown
        while not self.stop.wait(self.progress.interval_s):
            self.progress.update()

    def __enter__(self) -> "_Ticker":
        if self.progress.on:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()
        self.progress.close()


class SimProgress:
    """A simulator sink (``collector.sim.emit.SimSink``) that only moves a :class:`Progress` line."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def write(self, chunk) -> None:
        if len(chunk.iterations):
            self.progress.update(int(chunk.iterations[-1]) + 1)

    def close(self) -> None:
        self.progress.close()
