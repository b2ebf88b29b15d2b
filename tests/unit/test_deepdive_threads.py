"""Other threads and op callers in the L4 analysis (``patterns.thread_patterns``, ``critical_path`` step 7b).

Seen on a real 6-rank gloo deep dive (tests/integration/test_deep_dive_faults.py): a rank whose helper
thread spins in Python was named only for its training thread's symptoms (``ones_like``, ``sleep``,
``AddmmBackward0`` slower at every GIL hand-off), never for the thread; and a rank running tanh-GELU as
elementwise ops was named for ``aten::mul`` with no word of where the ops came from (the launcher was
rank 0's, an optimizer's). Hand-written CPU-only Kineto traces, 6 ranks, 6 iterations of 10 ms, each
rank on its own clock; the threads that were running when profiling began are chained on one
pseudo-thread (tid 0) as Kineto writes them: each thread's root ``_bootstrap`` given the previous
thread's leaf as its caller.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from trainscope.analyzer.deepdive import localize_traces, read_trace
from trainscope.analyzer.deepdive.critical_path import critical_path
from trainscope.analyzer.deepdive.patterns import thread_patterns

RANKS = 6
STEP = 10_000.0
SPIN = "train.py(17): spin"
OURS = "/venv/lib/python3.11/site-packages/trainscope/collector/exporter.py(391): requests"


def x(cat, name, ts, dur, tid, pid=None, parent=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if pid is not None:
        e["args"] = {"Python id": pid, "Python parent id": parent}
    return e


def write(path, rank: int, *, spin=False, mul_us=300.0, unfused=False, parked=1.0, ours=False, pollers=1,
          lock_wait=False, scattered=False):
    t0 = 50_000.0 + 777.0 * rank
    end = t0 + 6 * STEP
    ev = [x("python_function", "train.py(40): main", t0 - 5, 6 * STEP + 10, 1, 1, None)]
    for i in range(6):
        t = t0 + i * STEP
        ev.append(x("user_annotation", f"ProfilerStep#{i}", t, STEP, 1))
        if unfused:   # tanh-GELU as elementwise ops, called from the model's forward
            ev.append(x("python_function", "train.py(27): forward", t + 10, 3000, 1))
            ev.append(x("python_function", "<built-in method tanh of type object>", t + 20, 800, 1))
            ev.append(x("cpu_op", "aten::tanh", t + 30, 700, 1))
            ev += [x("cpu_op", "aten::mul", t + 900 + 400 * k, 300, 1) for k in range(5)]
        else:
            ev.append(x("python_function", "train.py(22): forward", t + 10, 1500, 1))
            ev.append(x("cpu_op", "aten::gelu", t + 20, 1400, 1))
        ev.append(x("python_function", "torch/optim/sgd.py(322): _single_tensor_sgd", t + 4000, 1000, 1))
        # scattered: the GIL hand-offs land on the optimizer's mul in even iterations, on the mm in odd ones
        ev.append(x("cpu_op", "aten::mul", t + 4010, 1800.0 if scattered and i % 2 == 0 else mul_us, 1))
        ev.append(x("cpu_op", "aten::mm", t + 5200, 3500.0 if scattered and i % 2 else 2000, 1))
    # threads running before profiling began, chained on tid 0 (each root's caller: the previous leaf)
    pid, prev = 100, None
    threads = []
    if spin:
        threads.append([SPIN])
    threads.append(["threading.py(982): run", "threading.py(327): wait"])     # parked on every rank ...
    if ours:
        threads.append(["threading.py(982): run", OURS])                      # trainscope's own exporter
    for frames in threads:
        for j, name in enumerate(["threading.py(1002): _bootstrap"] + frames):
            ev.append(x("python_function", name, t0 - 3, 6 * STEP + 6, 0, pid, prev))
            prev, pid = pid, pid + 1
    ev[-1]["dur"] = (6 * STEP + 6) * parked            # ... for a share of the window that differs by rank
    # threads every rank runs (gRPC pollers, one per channel), parked; some ranks have more channels
    for k in range(pollers):
        ev.append(x("python_function", "threading.py(1002): _bootstrap", t0 - 2, 6 * STEP + 4, 9 + k, 500 + 2 * k,
                    None))
        ev.append(x("python_function", "grpc/_channel.py(1725): channel_spin", t0 - 1, 6 * STEP + 2, 9 + k,
                    501 + 2 * k, 500 + 2 * k))
    if lock_wait:   # a thread started in the window that waits 2 ms for a lock, in one iteration only
        t = t0 + 2 * STEP + 100
        ev.append(x("python_function", "threading.py(1002): _bootstrap", t, 2100, 12, 600, None))
        ev.append(x("python_function", "worker.py(5): run_once", t + 10, 2080, 12, 601, 600))
        ev.append(x("python_function", "<built-in method __enter__ of _thread.RLock object>", t + 20, 2000, 12, 602,
                    601))
    assert end > t0
    path.write_text(json.dumps({"traceEvents": ev}))


def job(tmp_path, per_rank: dict):
    paths = {}
    for r in range(RANKS):
        paths[r] = tmp_path / f"rank-{r}.json"
        write(paths[r], r, **per_rank.get(r, {}))
    return paths


def named(res):
    return {(o.function, o.kind, r) for o in res.outliers for r, s in zip(o.ranks, o.slower) if s}


# noise every job below carries: parked frames of 55-100 % of the window, trainscope's exporter on two
# ranks, a gRPC poller on every rank
NOISE = {0: {"parked": 0.55}, 1: {"ours": True}, 2: {"parked": 0.8}, 4: {"ours": True}}


def test_a_spinning_thread_is_named_on_its_rank_beside_its_symptoms_and_no_peer(tmp_path):
    per = {r: dict(v) for r, v in NOISE.items()}
    per.setdefault(3, {}).update(spin=True, mul_us=1800.0,   # the GIL hand-offs: its training thread's mul 6x
                                 pollers=2,                   # and a second gRPC poller parked (not evidence)
                                 lock_wait=True)              # and a one-off 2 ms lock wait (not steady)
    per.setdefault(5, {}).update(spin=True)                  # a spinning thread that costs its rank nothing
    res = localize_traces(job(tmp_path, per))
    got = named(res)
    assert (SPIN, "thread", 3) in got and ("aten::mul", "cpu", 3) in got, got
    assert {r for _, _, r in got} == {3}, got               # rank 5's idle spinner, the parked frames: nothing
    (th,) = [o for o in res.outliers if o.kind == "thread"]
    assert th.ranks == (3,) and th.impact_s == (None,) and "aten::mul" in th.evidence, th
    # the chain cut at the next thread's root: the spinning frame is its own leaf for the whole window
    tp = thread_patterns(critical_path(read_trace(tmp_path / "rank-3.json")))
    assert tp.as_dict()[SPIN][0] > 0.99
    assert not any("trainscope/collector" in f for f in tp.functions)   # our own threads left out


def test_a_spinning_thread_is_named_when_its_symptoms_move_from_function_to_function(tmp_path):
    """A thread holding the GIL slows whichever function the training thread runs at each hand-off: beside a
    busy process, a 6-rank gloo dive's spinning-thread rank had no training-thread function slower in three
    iterations of four, and the rank was named for nothing. The symptoms are the path's outliers before the
    steadiness rule; none of them is named itself (each is slower in half the iterations)."""
    per = {r: dict(v) for r, v in NOISE.items()}
    per.setdefault(3, {}).update(spin=True, scattered=True)
    res = localize_traces(job(tmp_path, per))
    assert named(res) == {(SPIN, "thread", 3)}, named(res)
    (th,) = res.outliers
    assert "aten::mul" in th.evidence and "aten::mm" in th.evidence, th.evidence
    # a spinning thread with no symptom at all still costs its rank nothing
    per[3].update(scattered=False)
    assert localize_traces(job(tmp_path, per)).outliers == ()


def test_a_healthy_job_with_thread_noise_names_no_one(tmp_path):
    assert localize_traces(job(tmp_path, NOISE)).outliers == ()


def test_unfused_ops_are_named_with_the_forward_that_called_them_on_their_rank(tmp_path):
    per = {r: dict(v) for r, v in NOISE.items()}
    per.setdefault(4, {}).update(unfused=True)
    res = localize_traces(job(tmp_path, per))
    assert {r for _, _, r in named(res)} == {4}, named(res)
    assert not [o for o in res.outliers if o.kind == "thread"]     # trainscope's exporter on rank 4 is ours
    mul = next(o for o in res.outliers if o.function == "aten::mul")
    assert mul.ranks == (4,) and mul.launched_by == "train.py(27): forward", mul   # rank 4's caller, not rank 0's
    tanh = next(o for o in res.outliers if o.function == "aten::tanh")
    assert tanh.launched_by == "train.py(27): forward"                           # through the built-in call


def test_a_collective_longer_on_a_rank_waiting_for_a_slower_rank_is_not_a_cause():
    """localize step 7: rank 0's longer c10d::allreduce_ (it waited) is taken off the outlier when rank
    2 is slower in a function of its own; alone, the ranks longer in it still waited (they arrived
    first): the outlier is kept, marked waiting, and names nobody. Beside a busy process, healthy 4-rank
    gloo dives named a rank for ``c10d::allreduce_`` in 5 of 7 runs."""
    from trainscope.analyzer.deepdive.localize import Outlier, _waiting_is_not_a_cause

    def o(func, kind, ranks, slower):
        n = len(ranks)
        return Outlier(function=func, kind=kind, role="0", ranks=tuple(ranks), d=(0.1,) * n, delta=(0.5,) * n,
                       beta=(0.2,) * n, mu=(0.01,) * n, sigma=(0.0,) * n, impact_s=(0.01,) * n,
                       slower=tuple(slower), expected=(0.1, 0.01, 0.0), delta_threshold=0.2, common=False)

    hot = o("train.py(8): hot_loop", "python", [2], [True])
    wait = o("c10d::allreduce_", "communication", [0, 2], [True, True])
    out = _waiting_is_not_a_cause([hot, wait])
    named = {r for x in out for r, s in zip(x.ranks, x.slower) if s}
    assert named == {2}
    (w,) = [x for x in out if x.kind == "communication"]
    assert w.ranks == (2,) and w.slower == (True,) and "rank(s) 0 waited in it for rank(s) 2" in w.evidence
    # a collective outlier of waiting ranks only is dropped
    assert _waiting_is_not_a_cause([hot, o("c10d::allreduce_", "communication", [0], [True])]) == [hot]
    # no rank slower in anything else: they waited all the same, for a rank late for another reason
    (alone,) = _waiting_is_not_a_cause([wait])
    assert alone.not_cause == "waited" and alone.ranks == (0, 2) and "no rank of this dive is slower" in alone.evidence
    # a collective longer on most ranks is the job's (EROICA's type 1), not waiting
    common = dataclasses.replace(wait, common=True)
    assert _waiting_is_not_a_cause([common]) == [common]


def test_a_rank_longer_in_sleep_woke_up_late_and_is_not_named_beside_the_hot_loop():
    """localize step 7 for blocking host waits: a 6-rank dive of a hot loop on rank 1 also named healthy
    rank 2 for ``<built-in function sleep>`` (2.5 ms per iteration, the scheduler's late wake-up on a loaded
    host). A sleep never makes its rank a cause of another's wait either; alone it is still reported."""
    from trainscope.analyzer.deepdive.localize import Outlier, _waiting_is_not_a_cause

    def o(func, kind, ranks):
        n = len(ranks)
        return Outlier(function=func, kind=kind, role="0", ranks=tuple(ranks), d=(0.1,) * n, delta=(0.5,) * n,
                       beta=(0.2,) * n, mu=(0.01,) * n, sigma=(0.0,) * n, impact_s=(0.01,) * n,
                       slower=(True,) * n, expected=(0.1, 0.01, 0.0), delta_threshold=0.2, common=False)

    hot = o("train_slowdown.py(8): hot_loop", "python", [1])
    sleep = o("<built-in function sleep>", "python", [2])
    allreduce = o("c10d::allreduce_", "communication", [0])
    out = _waiting_is_not_a_cause([hot, sleep, allreduce])
    assert out == [hot]
    # without a rank slower in work of its own, the sleep and the collective are reported as waiting
    out = _waiting_is_not_a_cause([sleep, allreduce])
    assert [(x.function, x.ranks, x.not_cause) for x in out] == [(sleep.function, (2,), "waited"),
                                                                 (allreduce.function, (0,), "waited")]
    # c10d's Work.wait under a gloo all-reduce, as Kineto names it (a 4-rank slower-matmul dive named
    # healthy rank 1 for it beside rank 2's aten::addmm): a wait, not work
    work_wait = o("<built-in method wait of pybind11_builtins.pybind11_detail_function_record_v1_system_"
                  "libstdcpp_gxx_abi_1xxx_use_cxx11_abi_1 object at 0x7f>", "python", [1])
    addmm = o("aten::addmm", "cpu", [2])
    assert _waiting_is_not_a_cause([addmm, work_wait]) == [addmm]


def _o(func, kind, ranks, impact):
    from trainscope.analyzer.deepdive.localize import Outlier
    n = len(ranks)
    return Outlier(function=func, kind=kind, role="job", ranks=tuple(ranks), d=(0.1,) * n, delta=(0.5,) * n,
                   beta=(0.2,) * n, mu=(0.01,) * n, sigma=(0.0,) * n, impact_s=tuple(impact),
                   slower=(True,) * n, expected=(0.1, 0.01, 0.0), delta_threshold=0.2, common=False)


def _waits(ms: dict, role: str = "job", step_ms: float = 100.0) -> dict:
    """rank -> (role, s waiting for peers per iteration, mean iteration s), from ms."""
    return {r: (role, np.array(v) * 1e-3, step_ms * 1e-3) for r, v in ms.items()}


def test_a_slower_rank_that_made_nobody_wait_is_absorbed_beside_one_that_did():
    """localize step 8: beside a busy process, a 4-rank dive of a hot loop on rank 2 (23 ms per iteration,
    24 ms less waiting at the collectives than the median rank) also named healthy rank 0 for
    ``aten::gelu`` (0.8 ms), which waited as long as its peers: it cost the job nothing."""
    from trainscope.analyzer.deepdive.localize import absorbed as _absorbed

    hot = _o("train_faults.py(15): hot_loop", "python", [2], [0.0234])
    gelu = _o("aten::gelu", "cpu", [0], [0.0008])
    ms = {0: [57.4, 57.2, 57.5, 57.3], 1: [57.5, 57.4, 57.6, 57.5], 2: [33.6, 33.9, 33.2, 33.7],
          3: [57.8, 57.7, 57.9, 57.6]}
    out = _absorbed([hot, gelu], _waits(ms))
    assert out[0] == hot
    assert out[1].not_cause == "absorbed" and out[1].ranks == (0,) and "rank(s) 2 made" in out[1].evidence
    # rank 0 late too (it waited 5 ms less than the unnamed ranks in every iteration): both are causes
    assert _absorbed([hot, gelu], _waits({**ms, 0: [52.5, 52.4, 52.7, 52.3]})) == [hot, gelu]
    # nobody late (a small fault lost in the waits' noise): nothing is taken away
    flat = _waits({r: [57.3, 57.5, 57.2, 57.4] for r in range(4)})
    assert _absorbed([hot, gelu], flat) == [hot, gelu]
    # another role's late rank absorbs nobody here
    assert _absorbed([hot, gelu], {**_waits(ms), 2: ("stage1", np.array(ms[2]) * 1e-3, 0.1)}) == [hot, gelu]
    # without iteration marks: one mean figure per rank, judged the same way (no noise to weigh)
    means = {r: (role, np.array([w.mean()]), it) for r, (role, w, it) in _waits(ms).items()}
    assert [x.not_cause for x in _absorbed([hot, gelu], means)] == ["", "absorbed"]


def test_a_small_cost_within_its_arrivals_noise_is_absorbed_a_real_fault_in_between_is_not():
    """localize step 8 on figures of a real 6-rank dive beside a busy process (four faults: a slow collate on
    rank 1, GC on rank 2, a spinning thread on rank 3, unfused ops on rank 4): healthy rank 0 was named for
    1.5 ms per iteration of ``aten::gelu``. Against the one rank left unnamed (5) its arrival moved by
    22 ms per iteration, 20 ms later on average: a share of its cost alone called it a cause. Its cost
    is within its arrival's noise while ranks 1, 2, 4 clearly made the others wait: absorbed. Rank 3,
    named for its thread (its cost is the contention's, unknown), is never judged here, and a fault
    whose lateness falls short of the share but not clearly (GC 37.5 ms, late 19 ± 17 ms), or that is
    clearly late by less than the share (a slow collate, 37 ms, late 13 ± 3 ms), stays named."""
    from trainscope.analyzer.deepdive.localize import absorbed as _absorbed

    gelu = _o("aten::gelu", "cpu", [0], [0.0015])
    collate = _o("train_faults.py(8): slow_collate", "python", [1], [0.0395])
    gc = _o("<built-in function collect>", "python", [2], [0.0403])
    unfused = _o("aten::mul", "cpu", [4], [0.0798])
    spin = _o("train_faults.py(24): spin", "thread", [3], [None])
    symptom = _o("autograd::engine::evaluate_function: GeluBackward0", "cpu", [3], [0.0054])
    ref = np.array([120.0, 160.0, 140.0, 110.0])
    late = {0: [17.3, 52.1, 3.6, 7.3], 1: [33.3, 21.8, 51.4, 23.2], 2: [36.1, 40.4, 30.1, 21.5],
            3: [-7.2, 1.6, 28.6, -17.8], 4: [31.4, 91.9, 103.9, 51.7], 5: [0.0] * 4}
    waits = _waits({r: ref - np.array(d) for r, d in late.items()})
    out = _absorbed([unfused, gc, collate, symptom, gelu, spin], waits)
    by = {(x.function, x.ranks): x.not_cause for x in out}
    assert by[("aten::gelu", (0,))] == "absorbed", out
    assert {k: v for k, v in by.items() if k[0] != "aten::gelu"} == {
        (x.function, x.ranks): "" for x in (unfused, gc, collate, symptom, spin)}
    # the same healthy rank with no fault beside it: nothing to compare with, it stays named (step 5's call)
    assert _absorbed([gelu], waits) == [gelu]
    # GC whose lateness falls short of half its cost, but within its noise: still a cause
    late2 = {**late, 0: [0.0] * 4, 2: [47.0, 47.5, 0.5, -18.0]}
    gc2 = _o("<built-in function collect>", "python", [2], [0.0375])
    out2 = _absorbed([unfused, gc2, collate], _waits({r: ref - np.array(d) for r, d in late2.items()}))
    assert [x.not_cause for x in out2] == ["", "", ""]
    # a slow collate late by less than half its cost (13 ms of 37 ms per iteration: on a 2-core host its CPU
    # time slowed the unnamed ranks too) but clearly late (± 3 ms): still a cause (an idle CI run's dive)
    late4 = {**late2, 1: [5.9, 15.5, 10.5, 20.6]}
    collate4 = _o("train_faults.py(8): slow_collate", "python", [1], [0.0368])
    out4 = _absorbed([unfused, gc2, collate4], _waits({r: ref - np.array(d) for r, d in late4.items()}))
    assert [x.not_cause for x in out4] == ["", "", ""]
    # ... and one that clearly waited as long as the unnamed ranks is absorbed
    late3 = {**late2, 2: [1.0, -0.5, 0.5, 0.2]}
    out3 = _absorbed([unfused, gc2, collate], _waits({r: ref - np.array(d) for r, d in late3.items()}))
    assert [(x.ranks, x.not_cause) for x in out3] == [((4,), ""), ((2,), "absorbed"), ((1,), "")]


def test_peer_waits_count_collectives_and_their_wait_not_a_sleep(tmp_path):
    """``patterns`` step 7: per iteration, the path's time in a collective and in c10d's ``Work.wait``; a
    ``time.sleep`` is the rank's own (a rank whose thread held the GIL woke up 12 ms late from it in a
    6-rank dive and was taken for one that waited for its peers)."""
    from trainscope.analyzer.deepdive.patterns import behaviour_patterns

    ev, t = [], 5000.0
    for i, (sleep, wait) in enumerate([(2000.0, 300.0), (2600.0, 900.0), (2000.0, 500.0)]):
        length = 1000.0 + sleep + wait
        ev += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": t, "dur": length,
                "pid": 1, "tid": 1},
               {"ph": "X", "cat": "python_function", "name": "train.py(20): step", "ts": t + 1, "dur": length - 2,
                "pid": 1, "tid": 1},
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t + 10, "dur": 900.0, "pid": 1, "tid": 1},
               {"ph": "X", "cat": "python_function", "name": "<built-in function sleep>", "ts": t + 920,
                "dur": sleep, "pid": 1, "tid": 1},
               {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": t + 930 + sleep, "dur": 40.0,
                "pid": 1, "tid": 1},
               {"ph": "X", "cat": "python_function", "name": "<built-in method wait of PyCapsule object at 0x1>",
                "ts": t + 975 + sleep, "dur": wait, "pid": 1, "tid": 1}]
        t += length
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    p = behaviour_patterns(critical_path(read_trace(path)))
    assert p.peer_waits is not None and p.peer_waits.shape == (3,)
    np.testing.assert_allclose(p.peer_waits * 1e6, [340.0, 940.0, 540.0], atol=1.0)
