"""Steadiness (``localize`` step 5, ``patterns`` step 4): a one-off stall of one iteration is not a function's
behaviour; a function slower in every iteration is.

Seen on a real 4-rank gloo deep dive on a shared 2-core host: healthy ranks were named for
``aten::select`` or ``<built-in method stack>`` costing ~4 ms per iteration, all of it one preempted
iteration. Hand-written CPU-only traces, 6 iterations of 1 ms, each rank on its own clock.
"""
from __future__ import annotations

import json

from trainscope.analyzer.deepdive import LocalizeConfig, localize_traces


def write(path, rank: int, select_us) -> None:
    ev, t = [], 7000.0 + 101.0 * rank
    for i, sel in enumerate(select_us):
        ev += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": t, "dur": 1000.0 + sel,
                "pid": 1, "tid": 1},
               {"ph": "X", "cat": "python_function", "name": "train.py(20): step", "ts": t + 1, "dur": 998.0 + sel,
                "pid": 1, "tid": 1},
               {"ph": "X", "cat": "cpu_op", "name": "aten::select", "ts": t + 10, "dur": sel, "pid": 1, "tid": 1},
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t + 20 + sel, "dur": 600.0, "pid": 1, "tid": 1}]
        t += 1000.0 + sel
    path.write_text(json.dumps({"traceEvents": ev}))


def job(tmp_path, slow: dict[int, list[float]]):
    paths = {}
    for r in range(4):
        paths[r] = tmp_path / f"rank-{r}.json"
        write(paths[r], r, slow.get(r, [50.0] * 6))
    return paths


def named(res):
    return {(o.function, r) for o in res.outliers for r, s in zip(o.ranks, o.slower) if s}


def test_one_preempted_iteration_is_not_named_but_a_steady_cost_is(tmp_path):
    stall = job(tmp_path, {0: [50.0, 50.0, 1600.0, 50.0, 50.0, 50.0]})     # one iteration 32x: 26 % of the window
    assert named(localize_traces(stall, cfg=LocalizeConfig(steady=False))) == {("aten::select", 0)}  # without the rule
    assert named(localize_traces(stall)) == set()
    steady = job(tmp_path, {0: [300.0] * 6})                                 # 6x in every iteration
    assert named(localize_traces(steady)) == {("aten::select", 0)}


def test_stalls_in_two_iterations_of_four_are_not_named_but_a_noisy_steady_cost_is(tmp_path):
    """A loaded host preempts a rank at the same point of its step now and then: a 6-rank dive beside a busy
    process had a rank's ``aten::addmm`` at [5.1, 0.6, 0.5, 6.5] ms per iteration (peers 0.5 ms), which the
    median iteration let through. The lower quartile does not; a cost in every iteration, however noisy,
    still moves it."""
    def four(slow):
        return job(tmp_path, {r: v for r, v in slow.items()} | {r: [50.0] * 4 for r in range(4) if r not in slow})
    two = four({1: [1600.0, 50.0, 50.0, 1600.0]})                              # half the iterations, 32x
    assert named(localize_traces(two, cfg=LocalizeConfig(steady=False))) == {("aten::select", 1)}
    assert named(localize_traces(two)) == set()
    noisy = four({1: [300.0, 1600.0, 250.0, 400.0]})                           # every iteration 5-32x
    assert named(localize_traces(noisy)) == {("aten::select", 1)}


def test_a_steady_cost_is_named_beside_a_peer_preempted_in_some_iterations(tmp_path):
    """With 4 ranks, a faulty rank and a healthy one preempted in two iterations of six make half the role:
    the range from β (median and MAD over the ranks) held both, and nobody was named. A 4-rank gloo dive
    beside a busy process: the faulty rank's ``aten::addmm`` at β 0.080, a preempted healthy rank's at 0.074,
    their steady β 0.020 and 0.0065. Step 3 measures D on the steady β and the median execution."""
    paths = job(tmp_path, {0: [50.0, 50.0, 2500.0, 50.0, 50.0, 2500.0],       # preempted twice: 40x
                           1: [250.0] * 6})                                     # 5x in every iteration
    assert named(localize_traces(paths, cfg=LocalizeConfig(steady=False))) == set()   # EROICA's β and μ
    assert named(localize_traces(paths)) == {("aten::select", 1)}


def write_many(path, rank: int, per_iteration: list[list[float]]) -> None:
    """Like ``write``, with several ``aten::select`` executions per iteration (µs each)."""
    ev, t = [], 7000.0 + 101.0 * rank
    for i, sels in enumerate(per_iteration):
        length = 1000.0 + sum(sels)
        ev += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": t, "dur": length,
                "pid": 1, "tid": 1},
               {"ph": "X", "cat": "python_function", "name": "train.py(20): step", "ts": t + 1, "dur": length - 2,
                "pid": 1, "tid": 1}]
        at = t + 10
        for sel in sels:
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::select", "ts": at, "dur": sel, "pid": 1, "tid": 1})
            at += sel + 5
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": at, "dur": 600.0, "pid": 1, "tid": 1})
        t += length
    path.write_text(json.dumps({"traceEvents": ev}))


def test_one_preempted_execution_in_every_iteration_is_not_named_but_every_execution_slower_is(tmp_path):
    """The scheduler on a loaded host can land in some iteration of every one (the steady β moves), but
    in a few executions of a function run many times (its median execution does not): a healthy rank of
    a 4-rank gloo dive beside a busy process was named for a data loader ``<genexpr>`` (β 0.089 against
    0.015; 2 µs per execution at the median, 13 µs on average). A slower function moves every execution."""
    def run(slow):
        paths = {}
        for r in range(4):
            paths[r] = tmp_path / f"rank-{r}.json"
            write_many(paths[r], r, slow.get(r, [[20.0] * 10 for _ in range(6)]))
        return paths
    preempted = run({0: [[20.0] * 9 + [1500.0] for _ in range(6)]})        # one execution in ten 75x, every iteration
    assert named(localize_traces(preempted, cfg=LocalizeConfig(steady=False))) == {("aten::select", 0)}
    assert named(localize_traces(preempted)) == set()
    slower = run({0: [[170.0] * 10 for _ in range(6)]})                     # every execution 8.5x
    assert named(localize_traces(slower)) == {("aten::select", 0)}


def test_a_function_near_the_whole_step_slower_in_every_iteration_is_named(tmp_path):
    """Step 5's steadiness band is the spread of a share: a relative spread r of a function's time moves its
    share β of the step by r·β·(1 − β). A recorded CPU job's helper at β 0.80 on its peers (preempted) and
    0.87 on the rank doing five times the work was out of a band of k·r·β (0.08), and nobody was named
    (a CI run under load). Here: peers' function 2.4 ms of a 3.4 ms step (β 0.71, the old band 0.071), rank 1's
    3.0 ms in every iteration (β 0.75); a healthy job with 1 % of jitter names nobody."""
    slow = job(tmp_path, {0: [2400.0] * 6, 1: [3000.0] * 6, 2: [2400.0] * 6, 3: [2400.0] * 6})
    assert named(localize_traces(slow)) == {("aten::select", 1)}
    jitter = job(tmp_path, {r: [2400.0 * (1 + 0.01 * ((i * 7 + r * 3) % 3 - 1)) for i in range(6)] for r in range(4)})
    assert named(localize_traces(jitter)) == set()
