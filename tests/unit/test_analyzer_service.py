"""The analyzer service on the embedded bus: window readiness, late records,
missing ranks, stall rule, verdicts in the store. Records are built here the
way the processor builds them (one per rank, window and signal)."""
import numpy as np
import pytest

from trainscope.analyzer.service import Analyzer, AnalyzerConfig
from trainscope.analyzer.diagnosis_sinks import BusDiagnosisSink, StoreDiagnosisSink
from trainscope.analyzer.sources import BusSource
from trainscope.analyzer.store import DiagnosisStore
from trainscope.processor.bus import EmbeddedBus
from trainscope.proto.contracts import topic_for
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

MS = 1_000_000


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def res(rank, world=8, job="j"):
    return Resource(job_id=job, rank=rank, world_size=world, host=f"h{rank // 4}",
                    coords=coords_for_rank(rank, world)).to_pb()


def publish(bus, rank, index, *, slow=1.0, world=8, job="j", iters_per_window=10, signals=("phases", "iterations", "kernels"),
            owed=None):
    """``owed``: the signals the records say the rank's window has (``Window.signals``, as the processor
    stamps them); default the ones published here; ``()``: unstamped, as from an older producer."""
    rng = np.random.default_rng(rank * 1000 + index)
    w = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=index,
                           first_iteration=index * iters_per_window,
                           last_iteration=(index + 1) * iters_per_window - 1,
                           start_ns=index * 10**9, end_ns=(index + 1) * 10**9,
                           signals=signals if owed is None else owed)
    r = res(rank, world, job)
    if "phases" in signals:
        pw = records_pb2.PhaseWindow(resource=r, window=w)
        for name, base in (("forward", 30), ("backward", 60), ("optimizer", 10)):
            m = base * MS * (slow if name == "forward" else 1.0) * (1 + rng.normal(0, 0.005))
            pw.phases.add(phase=name, count=iters_per_window, mean_ns=m, p50_ns=m, p99_ns=m * 1.01,
                          max_ns=m * 1.02, total_ns=m * iters_per_window)
        bus.publish(topic_for("phases"), job.encode(), pw.SerializeToString())
    if "iterations" in signals:
        iw = records_pb2.IterationWindow(resource=r, window=w)
        t = index * 10**9
        for i in range(w.first_iteration, w.last_iteration + 1):
            d = int(100 * MS * (1 + rng.normal(0, 0.005)))
            iw.marks.add(iteration=i, start_ns=t, end_ns=t + d)
            t += d
        bus.publish(topic_for("iterations"), job.encode(), iw.SerializeToString())
    if "kernels" in signals:
        kw = records_pb2.KernelWindow(resource=r, window=w)
        for k, base in (("gemm", 2_000_000), ("nccl_allreduce", 900_000)):   # gemm: 20 % of the step
            p50 = base * (slow if k == "gemm" else 1.0) * (1 + rng.normal(0, 0.005))
            ks = kw.kernels.add(kernel=k, stream=7, count=100)
            ks.clusters.add(count=100, p50_ns=p50, p99_ns=p50 * 1.05, min_ns=p50 * 0.97, max_ns=p50 * 1.06)
        bus.publish(topic_for("kernels"), job.encode(), kw.SerializeToString())


def settle(a, clock):
    """Ingest what is on the bus, let the grace period pass, analyse what is ready."""
    first = a.step(0)
    clock.t += 1
    return first + a.step(0)


def make(tmp_path, **cfg):
    """An analyzer on the embedded bus. Single-window tests name suspects at once (persist_k=1) from
    their window 0, which a CPU job's warm-up would hold back (merge step 3d, its own test); the
    default persistence (2 of 3 windows) has its own test."""
    cfg.setdefault("persist_k", 1)
    cfg.setdefault("warmup_iterations", 0)
    bus, clock = EmbeddedBus(), Clock()
    store = DiagnosisStore(str(tmp_path / "store.sqlite"))
    a = Analyzer(AnalyzerConfig(**cfg), BusSource(bus), [StoreDiagnosisSink(store), BusDiagnosisSink(bus)],
                 clock=clock)
    return a, bus, clock, store


def test_complete_window_is_analysed_after_grace_and_names_the_slow_rank(tmp_path):
    a, bus, clock, store = make(tmp_path)
    for r in range(8):
        publish(bus, r, 0, slow=1.4 if r == 5 else 1.0)
    assert a.step(0) == []                      # all ranks in, grace not yet passed
    clock.t += 1
    (v,) = a.step(0)
    assert v.ranks[0].rank == 5 and "forward" in v.phases and "gemm" in v.kernels
    assert {f.level for f in v.findings} >= {"L2", "L3"}
    assert store.latest_verdict("j").ranks[0].rank == 5
    diag = [records_pb2.Diagnosis.FromString(r.value) for r in bus.poll(topic_for("diagnoses"), 0)]
    assert diag and all(s.rank == 5 for d in diag for s in d.suspects)


def test_healthy_job_yields_no_suspects(tmp_path):
    a, bus, clock, store = make(tmp_path)
    for idx in range(3):
        for r in range(8):
            publish(bus, r, idx)
    verdicts = settle(a, clock) + a.finish()
    assert len(verdicts) == 3
    assert all(not v.ranks and not v.findings for v in verdicts)
    assert list(store.diagnoses("j")) == []


def test_window_with_a_silent_rank_is_analysed_on_progress_and_names_it(tmp_path):
    a, bus, clock, _ = make(tmp_path)
    for idx in range(4):
        for r in range(8):
            if not (r == 3 and idx >= 1):       # rank 3 stops reporting after window 0
                publish(bus, r, idx)
    verdicts = settle(a, clock)
    by_index = {v.window.index: v for v in verdicts}
    assert 0 in by_index and not by_index[0].ranks
    assert 1 in by_index
    missing = [f for f in by_index[1].findings if f.kind == "missing_rank"]
    assert missing and [s.rank for s in missing[0].suspects] == [3]


def test_progress_waits_while_the_source_still_holds_records(tmp_path):
    """A backlog read from Kafka comes partition by partition: most ranks' later windows can be in before
    a few ranks' first one. While the source says records still wait (``KafkaSource.backlog``), ranks
    further on close no window; once it has caught up they do, and the timeout holds throughout."""
    a, bus, clock, _ = make(tmp_path, window_timeout_s=30)
    for idx in range(4):
        for r in range(8):
            if not (r in (3, 6) and idx == 0):    # ranks 3 and 6's window 0 still in the unread log
                publish(bus, r, idx)
    a.source.backlog = True
    first = a.step(0)
    clock.t += 1
    assert 0 not in {v.window.index for v in first + a.step(0)}      # window 0 waits for 3 and 6
    publish(bus, 3, 0)                                                # read at last
    publish(bus, 6, 0)
    a.source.backlog = False
    clock.t += 1
    got = {v.window.index: v for v in a.step(0)}
    clock.t += 1
    got.update({v.window.index: v for v in a.step(0)})
    assert not got[0].partial and not any(f.kind == "missing_rank" for f in got[0].findings)
    # with the source behind, a rank that never reports is still given up on at the timeout
    a2, bus2, clock2, _ = make(tmp_path / "b", window_timeout_s=30)
    for idx in range(4):
        for r in range(8):
            if not (r == 3 and idx == 0):
                publish(bus2, r, idx, job="k")
    a2.source.backlog = True
    assert 0 not in {v.window.index for v in a2.step(0)}
    clock2.t += 31
    (late,) = [v for v in a2.step(0) if v.window.index == 0]
    assert [s.rank for f in late.findings if f.kind == "missing_rank" for s in f.suspects] == [3]


def test_a_window_read_topic_by_topic_waits_for_every_record_its_ranks_owe(tmp_path):
    """Each topic is read at its own rate: every rank's phases can be in before any kernels or
    iterations (a Kafka backlog beside a busy core). The records say what their window has
    (``Window.signals``), so the window waits for the rest, and its verdict compares the ranks."""
    a, bus, clock, _ = make(tmp_path)
    every = ("phases", "iterations", "kernels")
    for r in range(8):
        publish(bus, r, 0, slow=1.4 if r == 5 else 1.0, signals=("phases",), owed=every)
    assert settle(a, clock) == []                    # the job has sent only phases so far: not complete
    for r in range(8):
        publish(bus, r, 0, slow=1.4 if r == 5 else 1.0, signals=("iterations", "kernels"), owed=every)
    assert a.step(0) == []                           # all in; the grace period still runs
    clock.t += 1
    (v,) = a.step(0)
    assert not v.partial and v.ranks[0].rank == 5 and "gemm" in v.kernels and "forward" in v.phases
    # records of an older producer carry no stamp: a rank then owes what the job has sent so far
    b, bus2, clock2, _ = make(tmp_path / "old")
    for r in range(8):
        publish(bus2, r, 0, owed=(), signals=("phases", "kernels") if r else ("phases",))
    assert settle(b, clock2) == []                   # rank 0 still owes its kernels
    publish(bus2, 0, 0, owed=(), signals=("kernels",))
    assert len(settle(b, clock2)) == 1
    # a stamp naming signals this analyzer does not know (a newer producer, or garbage) owes nothing
    # more: the known ones are waited for, the window is judged, the analyzer keeps running
    c, bus3, clock3, _ = make(tmp_path / "odd")
    for r in range(8):
        publish(bus3, r, 0, slow=1.4 if r == 5 else 1.0, owed=("phases", "iterations", "kernels", "gpu_power", ""))
    (v,) = settle(c, clock3)
    assert not v.partial and v.ranks[0].rank == 5


def test_incomplete_window_is_analysed_after_timeout(tmp_path):
    a, bus, clock, _ = make(tmp_path, window_timeout_s=30)
    for r in range(6):
        publish(bus, r, 0)
    clock.t += 5
    assert a.step(0) == []
    clock.t += 30
    (v,) = a.step(0)
    assert v.window.index == 0


def test_late_records_are_counted_not_reanalysed(tmp_path):
    a, bus, clock, _ = make(tmp_path)
    for r in range(8):
        publish(bus, r, 0)
    assert len(settle(a, clock)) == 1
    publish(bus, 2, 0)
    assert a.step(0) == []
    assert a.metrics.counters["late_records"] == 3


def test_stall_rule_fires_after_five_mean_intervals(tmp_path):
    a, bus, clock, store = make(tmp_path, min_stall_s=1)
    for idx in range(5):
        for r in range(8):
            publish(bus, r, idx, signals=("iterations",))
        a.step(0)
        clock.t += 2.0                      # a new iteration window every 2 s
    clock.t += 5.0                          # 7 s quiet < 5 x 2 s
    a.step(0)
    assert not [d for d in store.diagnoses("j") if d.kind == "stall"]
    clock.t += 4.0                          # 11 s quiet > 10 s
    a.step(0)
    stalls = [d for d in store.diagnoses("j") if d.kind == "stall"]
    assert len(stalls) == 1 and stalls[0].level == "L1"
    a.step(0)                               # reported once, not every step
    assert len([d for d in store.diagnoses("j") if d.kind == "stall"]) == 1


def test_bad_records_on_the_bus_are_counted_and_skipped(tmp_path):
    a, bus, clock, _ = make(tmp_path)
    bus.publish(topic_for("kernels"), b"j", b"\xff\xff garbage")
    for r in range(8):
        publish(bus, r, 0)
    assert len(settle(a, clock)) == 1
    assert a.metrics.counters["bad_records"] == 1


def test_jobs_are_analysed_separately(tmp_path):
    a, bus, clock, _ = make(tmp_path)
    for r in range(4):
        publish(bus, r, 0, world=4, job="a", slow=1.5 if r == 1 else 1.0)
        publish(bus, r, 0, world=4, job="b")
    verdicts = {v.job_id: v for v in settle(a, clock)}
    assert verdicts["a"].ranks[0].rank == 1 and not verdicts["b"].ranks


def test_bad_config_names_the_setting():
    with pytest.raises(ConfigError, match="analyzer.levels"):
        AnalyzerConfig(levels=("L9",))
    with pytest.raises(ConfigError, match="analyzer.grace_s"):
        AnalyzerConfig(grace_s=0)
    with pytest.raises(ConfigError, match="analyzer.collectives_wait_s"):
        AnalyzerConfig(collectives_wait_s=float("nan"))


def test_a_job_that_ended_normally_is_not_a_stall_and_is_forgotten(tmp_path):
    a, bus, clock, store = make(tmp_path, min_stall_s=1, forget_after_s=100)
    for idx in range(5):
        for r in range(8):
            publish(bus, r, idx, signals=("iterations",))
        a.step(0)
        clock.t += 2.0
    for r in range(8):   # every rank's last window carries Window.final
        final = records_pb2.IterationWindow(resource=res(r), window=records_pb2.Window(
            kind=records_pb2.WINDOW_KIND_ITERATIONS, index=5, final=True))
        bus.publish(topic_for("iterations"), b"j", final.SerializeToString())
    settle(a, clock)
    clock.t += 60
    a.step(0)
    assert not [d for d in store.diagnoses("j") if d.kind == "stall"]
    clock.t += 100
    a.step(0)
    assert "j" not in a._jobs


def test_hang_is_a_stall_on_the_ranks_own_clocks_naming_who_stopped_first(tmp_path):
    """A backlog read at once (no wall time passes): the telemetry-clock rule.
    Every rank's last iteration ended at ~1 s; the peers' aborted collectives
    ran on to ~60 s, the culprit's activity stopped at ~1.1 s."""
    a, bus, clock, store = make(tmp_path)
    for r in range(8):
        publish(bus, r, 0, signals=("iterations",))
        end = (1 * 10**9 + 200 * MS) if r == 6 else 60 * 10**9
        kw = records_pb2.KernelWindow(resource=res(r), window=records_pb2.Window(
            kind=records_pb2.WINDOW_KIND_ITERATIONS, index=0, first_iteration=0, last_iteration=9,
            start_ns=0, end_ns=end))
        kw.kernels.add(kernel="nccl_allreduce", stream=7, count=1).clusters.add(
            count=1, p50_ns=1e6, p99_ns=1e6, min_ns=1e6, max_ns=1e6)
        bus.publish(topic_for("kernels"), b"j", kw.SerializeToString())
    (v,) = settle(a, clock)
    stall = [f for f in v.findings if f.kind == "stall"]
    assert stall and stall[0].level == "L1" and stall[0].suspects[0].rank == 6
    assert v.ranks[0].rank == 6


def _windows_with(present: int, *, slow_rank=1, persist_k=1, tmp_path, full_after=False):
    """Windows 0-3 of 8 ranks, rank ``slow_rank`` 1.4x slower in forward and gemm from window 1;
    window 1 holds only ranks 0..present-1 (``partial_probe``: a time window catching some ranks)."""
    a, bus, clock, _ = make(tmp_path, persist_k=persist_k)
    for idx in range(4):
        for r in range(8):
            if idx == 1 and r >= present:
                continue
            publish(bus, r, idx, slow=1.4 if (r == slow_rank and idx >= 1) else 1.0)
    vs = settle(a, clock) + a.finish()
    return {v.window.index: v for v in vs}


@pytest.mark.parametrize("present", [3, 6])
def test_a_window_with_ranks_missing_is_partial_and_names_nobody_present(tmp_path, present):
    """However few ranks a window holds (3 of 8 was not partial when half or more were missing),
    it is partial: the slow rank among those present is watched (pending), not named, and the
    missing ranks are listed as missing, never as culprits. Its state is never "healthy": with
    most of the job absent (3 of 8) nothing could be judged ("unknown"); with a few absent the
    flagged rank makes it "suspected"."""
    by = _windows_with(present, tmp_path=tmp_path)
    v = by[1]
    assert v.partial and list(v.ranks) == [], v.summary
    (missing,) = [f for f in v.findings if f.kind == "missing_rank"]
    assert [s.rank for s in missing.suspects] == list(range(present, 8))
    assert all(s.role == "missing" for s in missing.suspects)
    assert 1 in v.pending                       # flagged on its own evidence: watched
    if 8 - present > present:
        assert v.state == "unknown" and f"{8 - present} of 8 ranks missing" in v.summary, v.summary
    else:
        assert v.state == "suspected", v.summary
        assert "partial window" in v.summary and f"{8 - present} rank(s) missing" in v.summary
    # the full windows around it: window 0 healthy and not partial, windows 2-3 name rank 1
    assert not by[0].partial and not by[0].ranks
    assert all(not by[i].partial and by[i].ranks[0].rank == 1 for i in (2, 3))


def test_a_partial_windows_findings_feed_persistence_only(tmp_path):
    """Default persistence (2 of 3): flagged in partial window 1 and full window 2, the slow rank is
    named in window 2 (the partial window counted toward it) but never in window 1."""
    by = _windows_with(6, persist_k=2, tmp_path=tmp_path)
    assert by[1].partial and not by[1].ranks and 1 in by[1].pending
    assert by[2].ranks and by[2].ranks[0].rank == 1 and by[2].state == "degraded"


def test_a_full_window_names_the_slow_rank_and_a_healthy_full_job_is_not_partial(tmp_path):
    by = _windows_with(8, tmp_path=tmp_path)
    assert all(not v.partial for v in by.values())
    assert by[1].ranks[0].rank == 1 and by[1].state == "degraded"
    healthy = _windows_with(8, slow_rank=-1, tmp_path=tmp_path / "h")
    assert all(not v.partial and not v.ranks and v.state == "healthy" for v in healthy.values())


def test_ranks_that_shut_down_do_not_make_a_window_partial(tmp_path):
    a, bus, clock, _ = make(tmp_path)
    for r in range(8):
        publish(bus, r, 0)
    (v0,) = settle(a, clock)
    a._jobs["j"].ended.update({6, 7})            # as Window.final would
    for r in range(6):
        publish(bus, r, 1)
    vs = settle(a, clock) + a.finish()
    assert vs and all(not v.partial for v in vs)


class _Raises:
    """A detector with a bug: raises on every window."""
    level, corroborating = "broken", False

    def analyze(self, ctx):
        raise ZeroDivisionError("a bug in one level")


def test_a_raising_detector_is_counted_and_the_other_levels_still_name_the_rank(tmp_path):
    """Failure isolation (issue 10 item 10): a level that raises is counted under its name
    (trainscope_analyzer_detector_failures_total{level}) and the levels after it still run."""
    a, bus, clock, _ = make(tmp_path)
    levels = [d.level for d in a.detectors]
    a.detectors.insert(0, _Raises())            # before every real level: nothing after it may be skipped
    for r in range(8):
        publish(bus, r, 0, slow=1.4 if r == 5 else 1.0)
    (v,) = settle(a, clock)
    assert a.metrics.detector_failures["broken"] == 1
    assert sum(a.metrics.detector_failures.values()) == 1       # no real level failed
    assert v.ranks[0].rank == 5 and {f.level for f in v.findings} >= {"L2", "L3"}, v.summary
    assert "L2" in levels and "L3" in levels
    fam = {m.name: m for m in a.metrics.collect()}["trainscope_analyzer_detector_failures"]
    assert [(s.labels, s.value) for s in fam.samples if s.name.endswith("_total")] == [({"level": "broken"}, 1)]
    # a healthy window: the broken level is counted again, nothing is named
    for r in range(8):
        publish(bus, r, 1)
    (v1,) = settle(a, clock)
    assert a.metrics.detector_failures["broken"] == 2 and not v1.ranks


def test_a_window_whose_verdict_named_a_rank_leaves_the_jobs_pace_baseline(tmp_path):
    """job_pace step 2: the service discards from the job's pace baseline a window whose verdict
    named a rank (a rank slower than its peers by less than the pace level's threshold is not the
    job's healthy pace); healthy windows stay in it."""
    a, bus, clock, store = make(tmp_path)
    for idx in range(4):
        for r in range(8):
            publish(bus, r, idx, slow=1.4 if (r == 5 and idx == 2) else 1.0)
    verdicts = settle(a, clock) + a.finish()
    named = sorted(v.window.index for v in verdicts if v.ranks)
    assert named == [2], [v.summary for v in verdicts]
    base = a._jobs["j"].pace_baseline
    assert 2 not in base.indices and {1, 3} <= set(base.indices), list(base.indices)


def test_a_cpu_jobs_warm_up_window_names_nobody_by_persistence_and_its_next_window_does(tmp_path):
    """Merge step 3d: a job timed on the host (no device) flags rank 5 in its window 0, which holds its
    first ``warmup_iterations``: pending, nobody named (beside a busy process a healthy two-group gloo job
    had a rank late to its pair in windows 0 and 1 and was named at window 1). The same evidence in the
    next window is counted as before (persist_k=1 here: named at once)."""
    a, bus, clock, store = make(tmp_path, warmup_iterations=5)
    for index in (0, 1):
        for r in range(8):
            publish(bus, r, index, slow=1.4 if r == 5 else 1.0)
    verdicts = sorted(settle(a, clock) + a.step(0), key=lambda v: v.window.index)
    assert [v.window.index for v in verdicts] == [0, 1]
    assert not verdicts[0].ranks and 5 in verdicts[0].pending and verdicts[0].state == "suspected"
    assert verdicts[1].ranks[0].rank == 5 and verdicts[1].ranks[0].role == "culprit"


def test_a_window_waits_for_its_ranks_collective_records_to_reach_its_end(tmp_path):
    """Step 2: collective records travel in the processor's own short windows, seconds behind the
    phases and iterations. A window whose phases, kernels and iterations are all in waits (past the
    grace period, and while most ranks are further on) until every rank's collective records have
    reached the window's end (its clock ``now_ns``), so that its collectives are judged with it (a live
    analyzer beside a busy process missed an FSDP2 rank's late all-gathers that the same records, all
    in, named). A rank that said it ended owes nothing more."""
    a, bus, clock, store = make(tmp_path)

    def collectives(rank, now_ns, seq):
        cw = records_pb2.CollectiveWindow(resource=res(rank), now_ns=now_ns,
                                          window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_TIME, index=seq))
        cw.groups.add(id="world", members=list(range(8)))
        cw.records.add(group=0, seq=seq, op="allreduce", bytes=1 << 20, enqueue_ns=now_ns - 5 * MS, end_ns=now_ns,
                       iteration=0)
        bus.publish(topic_for("collectives"), b"j", cw.SerializeToString())

    for r in range(8):
        collectives(r, 5 * 10**8, 1)          # half-way through window 0 (it ends at 1 s)
    for index in (0, 1, 2):                   # window 0 complete, and every rank two windows further on
        for r in range(8):
            publish(bus, r, index, slow=1.4 if r == 5 else 1.0)
    assert [v.window.index for v in settle(a, clock)] == []
    clock.t += 5
    assert [v.window.index for v in a.step(0)] == []
    for r in range(8):
        collectives(r, 10**9 + 1, 2)          # every rank's collectives past window 0's end
    clock.t += 1
    got = sorted(v.window.index for v in settle(a, clock))
    assert got and got[0] == 0
    # a job that pauses its collectives (an evaluation pass): the window waits collectives_wait_s, no more
    b, bus2, clock2, _ = make(tmp_path / "b", collectives_wait_s=10.0)
    bus = bus2
    for r in range(8):
        collectives(r, 5 * 10**8, 1)
    for r in range(8):
        publish(bus, r, 0)
    assert settle(b, clock2) == []
    clock2.t += 10
    assert [v.window.index for v in b.step(0)] == [0]
