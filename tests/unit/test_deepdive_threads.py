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


def test_a_slower_rank_that_made_nobody_wait_is_absorbed_beside_one_that_did():
    """localize step 8: beside a busy process, a 4-rank dive of a hot loop on rank 2 (23 ms per iteration,
    24 ms less waiting at the collectives than the median rank) also named healthy rank 0 for
    ``aten::gelu`` (0.8 ms), which waited as long as its peers: it cost the job nothing."""
    from trainscope.analyzer.deepdive.localize import Outlier, absorbed as _absorbed

    def o(func, kind, ranks, impact):
        n = len(ranks)
        return Outlier(function=func, kind=kind, role="job", ranks=tuple(ranks), d=(0.1,) * n, delta=(0.5,) * n,
                       beta=(0.2,) * n, mu=(0.01,) * n, sigma=(0.0,) * n, impact_s=tuple(impact),
                       slower=(True,) * n, expected=(0.1, 0.01, 0.0), delta_threshold=0.2, common=False)

    hot = o("train_faults.py(15): hot_loop", "python", [2], [0.0234])
    gelu = o("aten::gelu", "cpu", [0], [0.0008])
    waits = {0: ("job", 0.0573), 1: ("job", 0.0575), 2: ("job", 0.0336), 3: ("job", 0.0578)}
    out = _absorbed([hot, gelu], waits)
    assert out[0] == hot
    assert out[1].not_cause == "absorbed" and out[1].ranks == (0,) and "for rank(s) 2" in out[1].evidence
    # rank 0 late too (it waited 5 ms less than the median): both are causes
    assert _absorbed([hot, gelu], {**waits, 0: ("job", 0.0525)}) == [hot, gelu]
    # nobody late (a small fault lost in the waits' noise): nothing is taken away
    flat = {r: ("job", 0.0573) for r in range(4)}
    assert _absorbed([hot, gelu], flat) == [hot, gelu]
    # another role's late rank absorbs nobody here
    assert _absorbed([hot, gelu], {**waits, 2: ("stage1", 0.0336)}) == [hot, gelu]
