"""Windowing edges: boundaries, lateness, idle close, iteration windows, bounds."""
import numpy as np
import pytest

from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.windows import WindowConfig, Windower
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2, telemetry_pb2

S = 1_000_000_000
RES = Resource(job_id="j", rank=0, world_size=2)


def kernels(starts, dur=1000, name="k"):
    n = len(starts)
    return KernelColumns.build([name], starts, [dur] * n, [0] * n, [7] * n)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(**kw):
    """A windower; tests of time windows say so (the default mode is ``auto``)."""
    kw.setdefault("mode", "time")
    closed, metrics, clock = [], SelfMetrics(), Clock()
    w = Windower(WindowConfig(**kw), closed.append, metrics, clock=clock)
    return w, closed, metrics, clock


def test_boundary_event_belongs_to_next_window():
    w, closed, _, _ = make(length_s=10, lateness_s=0)
    w.add_kernels(RES, kernels([10 * S - 1, 10 * S, 10 * S + 1]))
    w.flush()
    by_index = {c.window.index: len(c.kernels) for c in closed}
    assert by_index == {0: 1, 1: 2}
    assert closed[0].window.start_ns == 0 and closed[0].window.end_ns == 10 * S


def test_window_closes_when_watermark_passes_end_plus_lateness():
    w, closed, _, _ = make(length_s=10, lateness_s=2)
    w.add_kernels(RES, kernels([1 * S, 9 * S]))
    w.add_kernels(RES, kernels([11 * S]))          # watermark 11 s < 10 + 2: still open
    assert closed == []
    w.add_kernels(RES, kernels([12 * S + 1]))      # past 12 s: window 0 closes
    assert [c.window.index for c in closed] == [0]
    assert len(closed[0].kernels) == 2
    assert closed[0].window.kind == records_pb2.WINDOW_KIND_TIME


def test_late_events_are_dropped_and_counted_without_losing_others():
    w, closed, m, _ = make(length_s=10, lateness_s=0)
    w.add_kernels(RES, kernels([1 * S]))
    w.add_kernels(RES, kernels([25 * S]))          # closes windows 0 and 1
    w.add_kernels(RES, kernels([2 * S, 26 * S]))   # 2 s is late, 26 s is fine
    w.flush()
    assert m.get("drops", where="late") == 1
    assert sum(len(c.kernels) for c in closed) == 3


def test_idle_rank_is_closed_after_idle_timeout():
    w, closed, m, clock = make(length_s=10, idle_close_s=30)
    w.add_kernels(RES, kernels([1 * S]))
    clock.t = 29
    w.close_idle()
    assert closed == []
    clock.t = 31
    w.close_idle()
    assert len(closed) == 1 and m.get("windows_closed", trigger="idle") == 1


def test_ranks_are_windowed_independently():
    w, closed, _, _ = make(length_s=10, lateness_s=0)
    other = Resource(job_id="j", rank=1, world_size=2)
    w.add_kernels(RES, kernels([1 * S]))
    w.add_kernels(other, kernels([1 * S, 2 * S]))
    w.flush()
    assert sorted((c.resource.rank, len(c.kernels)) for c in closed) == [(0, 1), (1, 2)]


def test_string_tables_of_different_batches_are_merged():
    w, closed, _, _ = make(length_s=10)
    w.add_kernels(RES, KernelColumns.build(["a", "b"], [1, 2], [5, 5], [0, 1], [7, 7]))
    w.add_kernels(RES, KernelColumns.build(["b", "c"], [3, 4], [5, 5], [0, 1], [7, 7]))
    w.flush()
    k = closed[0].kernels
    assert [k.names[i] for i in k.name_id] == ["a", "b", "b", "c"]


def marks(iters, period=100 * S // 1000):
    return [telemetry_pb2.IterationMark(iteration=i, start_ns=i * period, end_ns=(i + 1) * period - 1000)
            for i in iters]


def test_iteration_windows_assign_kernels_by_marks():
    w, closed, _, _ = make(mode="iterations", iterations=2, lateness_s=0)
    p = 100 * S // 1000
    # kernels of iterations 0..5, incl. one in the gap after iteration 1's end
    w.add_kernels(RES, kernels([5, p + 5, 2 * p - 500, 2 * p + 5, 3 * p + 5, 4 * p + 5, 5 * p + 5]))
    w.add_iterations(RES, marks(range(6)))
    w.flush()
    got = {c.window.index: len(c.kernels) for c in closed}
    assert got == {0: 3, 1: 2, 2: 2}
    c0 = [c for c in closed if c.window.index == 0][0]
    assert (c0.window.first_iteration, c0.window.last_iteration) == (0, 1)
    assert c0.window.kind == records_pb2.WINDOW_KIND_ITERATIONS
    assert len(c0.iterations) == 2


def test_an_iteration_window_says_how_many_of_its_iterations_its_kernels_fell_in():
    """A duty-cycled kernel source (the CPU-operator sampler records whole steps now and then)
    covers some of a window's iterations: the window says which count (``kernel_iterations``,
    ``KernelWindow.iterations``), so a per-iteration cost is over those. Time windows: 0."""
    w, closed, _, _ = make(mode="iterations", iterations=10, lateness_s=0)
    p = 100 * S // 1000
    w.add_kernels(RES, kernels([3 * p + 5, 3 * p + 50, 7 * p + 5]))     # sampled steps 3 and 7
    w.add_kernels(RES, kernels([12 * p + 5]))                           # window 1: step 12
    w.add_iterations(RES, marks(range(20)))
    w.flush()
    got = {c.window.index: (len(c.kernels), c.kernel_iterations) for c in closed}
    assert got == {0: (3, 2), 1: (1, 1)}
    from trainscope.processor.summarize import Summarizer
    kw = Summarizer().kernels([c for c in closed if c.window.index == 0][0], RES.to_pb())
    assert kw.iterations == 2 and kw.events == 3
    t, tclosed, _, _ = make(length_s=10, lateness_s=0)
    t.add_kernels(RES, kernels([1 * S]))
    t.flush()
    assert tclosed[0].kernel_iterations == 0


def test_each_record_of_a_window_names_every_signal_the_window_has():
    """``Window.signals`` on every record of a closed window: a consumer reading the topics at
    different rates knows what else the rank's window still owes it (``Analyzer._complete``)."""
    from trainscope.processor.summarize import Summarizer
    w, closed, _, _ = make(mode="iterations", iterations=2, lateness_s=0)
    p = 100 * S // 1000
    w.add_kernels(RES, kernels([5, p + 5]))               # window 1 (iterations 2-3) has no kernels
    w.add_kernels(RES, kernels([4 * p + 5]))
    w.add_iterations(RES, marks(range(6)))
    w.flush()
    out = {c.window.index: Summarizer()(c) for c in sorted(closed, key=lambda c: c.window.index)}
    for index, wo in out.items():
        recs = list(wo.records())
        have = sorted(str(sig) for sig, _ in recs)
        assert recs and all(sorted(rec.window.signals) == have for _, rec in recs)
    assert sorted(out[0].iterations.window.signals) == ["iterations", "kernels"]
    assert list(out[1].iterations.window.signals) == ["iterations"] and out[1].kernels is None


def test_iteration_window_waits_for_the_next_window_to_start():
    w, closed, _, _ = make(mode="iterations", iterations=2, lateness_s=0)
    p = 100 * S // 1000
    w.add_iterations(RES, marks([0, 1]))
    w.add_kernels(RES, kernels([5, p + 5]))
    assert closed == []                              # iteration 2 not seen yet
    w.add_iterations(RES, marks([2]))
    w.add_kernels(RES, kernels([2 * p + 10]))        # watermark passes iteration 2's start
    assert [c.window.index for c in closed] == [0]
    assert len(closed[0].kernels) == 2


def test_events_before_first_mark_are_kept_in_first_window():
    w, closed, _, _ = make(mode="iterations", iterations=10)
    w.add_kernels(RES, kernels([1, 2]))
    w.add_iterations(RES, [telemetry_pb2.IterationMark(iteration=1009, start_ns=100, end_ns=200)])
    w.flush()
    assert len(closed) == 1 and len(closed[0].kernels) == 2 and closed[0].window.index == 100


def test_auto_mode_cuts_by_iterations_when_marks_arrive_and_keeps_what_came_first():
    w, closed, m, _ = make(mode="auto", iterations=2, lateness_s=0)
    p = 100 * S // 1000
    # kernels and a phase arrive before the first iteration mark: they wait, nothing is lost
    w.add_kernels(RES, kernels([5, p + 5, 2 * p + 5, 3 * p + 5]))
    w.add_phases(RES, [telemetry_pb2.PhaseTiming(name="forward", iteration=1, start_ns=p + 1, duration_ns=10)])
    assert closed == []
    w.add_iterations(RES, marks(range(4)))
    w.flush()
    assert {c.window.index: len(c.kernels) for c in closed} == {0: 2, 1: 2}
    assert all(c.window.kind == records_pb2.WINDOW_KIND_ITERATIONS for c in closed)
    assert [len(c.phases) for c in sorted(closed, key=lambda c: c.window.index)] == [1, 0]
    assert m.get("window_mode_decided", mode="iterations") == 1


def test_auto_mode_falls_back_to_time_windows_for_a_rank_without_marks():
    w, closed, m, _ = make(mode="auto", length_s=1, lateness_s=0, auto_wait_s=3)
    w.add_kernels(RES, kernels(np.arange(3) * S + 5))
    assert closed == [] and m.get("window_mode_decided", mode="time") == 0    # still waiting for a mark
    w.add_kernels(RES, kernels([4 * S + 5]))                                   # 4 s of its clock: time windows
    assert m.get("window_mode_decided", mode="time") == 1
    assert [c.window.index for c in closed] == [0, 1, 2]       # the watermark passed their ends
    w.flush()
    assert sum(len(c.kernels) for c in closed) == 4
    assert all(c.window.kind == records_pb2.WINDOW_KIND_TIME for c in closed)
    # a rank flushed before it was decided never sent a mark: time windows too
    w2, closed2, _, _ = make(mode="auto", length_s=1, auto_wait_s=60)
    w2.add_kernels(RES, kernels([5, S + 5]))
    w2.flush()
    assert sorted(c.window.index for c in closed2) == [0, 1]


def test_open_window_bound_force_closes_oldest():
    w, closed, m, _ = make(length_s=1, lateness_s=1000, max_open_windows_per_rank=3)
    w.add_kernels(RES, kernels(np.arange(5) * S))
    assert [c.window.index for c in closed] == [0, 1]
    assert m.get("windows_closed", trigger="bound") == 2


def test_pending_bound_drops_and_counts():
    w, closed, m, _ = make(mode="iterations", max_pending_events=3)
    w.add_kernels(RES, kernels([1, 2, 3, 4]))
    assert m.get("drops", where="pending") == 4


@pytest.mark.parametrize("field,value", [("mode", "daily"), ("length_s", 0), ("iterations", 0),
                                         ("lateness_s", -1), ("idle_close_s", 0)])
def test_bad_config_names_the_setting(field, value):
    with pytest.raises(ConfigError, match=f"window.{field}"):
        WindowConfig(**{field: value})


def stack(t0, t1):
    return telemetry_pb2.StackSnapshot(window_start_ns=t0, window_end_ns=t1, samples=10, stacks=[
        telemetry_pb2.FoldedStack(stack="main;train;allreduce", count=10)])


def test_a_hung_rank_that_only_sends_stacks_still_gets_its_windows_closed():
    w, closed, m, clock = make(mode="iterations", iterations=2, idle_close_s=30)
    w.add_iterations(RES, marks([0, 1]))
    w.add_kernels(RES, kernels([5, 7]))
    # the rank hangs: no more kernels or iterations, but py-spy keeps sampling it
    for k in range(4):
        clock.t += 10
        w.add_stacks(RES, [stack(S + k * S, 2 * S + k * S)])
        w.close_idle()
    assert [c.window.index for c in closed] == [0]
    assert m.get("windows_closed", trigger="idle") == 1
    assert len(closed[0].stacks) == 3          # sampled before the idle close
    assert m.get("drops", where="late") == 1   # the one after it


def test_stacks_per_window_are_bounded():
    w, closed, m, _ = make(length_s=100, max_stacks_per_window=3)
    w.add_stacks(RES, [stack(i, i + 1) for i in range(5)])
    w.flush()
    assert len(closed[0].stacks) == 3 and m.get("drops", where="stacks") == 2


def test_stacks_from_the_sidecar_do_not_replace_the_ranks_identity():
    w, closed, _, _ = make(length_s=10)
    rank_proc = Resource(job_id="j", rank=0, world_size=2, pid=111)
    sidecar = Resource(job_id="j", rank=0, world_size=2, pid=999)
    w.add_kernels(rank_proc, kernels([1 * S]))
    w.add_stacks(sidecar, [stack(1 * S, 2 * S)])
    w.flush()
    assert closed[0].resource.pid == 111 and len(closed[0].stacks) == 1


def test_final_marker_of_a_rank_that_never_marked_an_iteration_keeps_its_kernels():
    w, closed, _, _ = make(mode="iterations")
    w.add_kernels(RES, kernels([1, 2, 3]))
    w.finish_rank(RES)
    assert len(closed) == 1 and len(closed[0].kernels) == 3 and closed[0].window.final


def test_repeated_and_changed_string_tables_map_every_record_to_its_own_name():
    """The per-rank cache of the last string table: a repeated table, a reordered one, one with
    new names and one repeating a name must all give each record its own name, before and
    after the name table is compacted."""
    w, closed, _, _ = make(length_s=10, lateness_s=0, max_names_per_rank=3)

    def batch(names, ids, t):
        n = len(ids)
        return KernelColumns.build(names, [t + i for i in range(n)], [1000] * n, ids, [0] * n)

    sent = []
    for names, ids in ((("a", "b"), [0, 1, 1]), (("a", "b"), [1, 0]), (("b", "a"), [0, 1]),
                       (("c", "a", "c"), [0, 1, 2]), (("d", "e"), [1, 0]), (("d", "e"), [0])):
        w.add_kernels(RES, batch(names, ids, len(sent)))
        sent += [names[i] for i in ids]
    w.flush()
    got = [c.kernels.names[i] for c in closed for i in c.kernels.name_id[np.argsort(c.kernels.start_ns)]]
    assert got == sent


def test_a_batch_within_one_window_and_one_across_two_land_in_the_right_windows():
    w, closed, _, _ = make(length_s=10, lateness_s=0)
    w.add_kernels(RES, kernels([1 * S, 2 * S, 3 * S]))           # one window
    w.add_kernels(RES, kernels([9 * S, 12 * S, 5 * S]))           # across two, out of order
    w.flush()
    by_index = {c.window.index: sorted(c.kernels.start_ns.tolist()) for c in closed}
    assert by_index == {0: [1 * S, 2 * S, 3 * S, 5 * S, 9 * S], 1: [12 * S]}
    assert closed[0].window.end_ns == 10 * S
