"""Function names made comparable across processes (``analyzer/deepdive/trace.function_name``).

On a real 4-rank gloo deep dive every rank was named: CPython's names of built-in methods carry
the bound object's address (``<built-in method wait of ...Work object at 0x7f...>``), different in
every process, so each rank's functions looked unique to it. The names below are the forms
``torch.profiler`` (``with_stack``) writes, seen in this repository's recorded traces.
"""
from __future__ import annotations

import json

from trainscope.analyzer.deepdive import localize_traces, read_trace
from trainscope.analyzer.deepdive.trace import function_name

WAIT = "<built-in method wait of torch._C._distributed_c10d.Work object at 0x{:x}>"


def test_addresses_go_and_what_names_the_function_stays():
    assert function_name(WAIT.format(0x7F0A2C3B1230)) == \
        "<built-in method wait of torch._C._distributed_c10d.Work object>"
    assert function_name("<built-in method append of list object at 0x7feddc970e40>") == \
        "<built-in method append of list object>"
    assert function_name("<function main.<locals>.step at 0x7f00aa>") == "<function main.<locals>.step>"
    assert function_name("handle 0x7f00aa11bb22 done") == "handle 0x… done"
    # a module frame's line is where it was when profiling began: dropped; a function's definition line stays
    assert function_name("train.py(57): <module>") == "train.py: <module>"
    assert function_name("train.py(31): hot_loop") == "train.py(31): hot_loop"
    assert function_name("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py(1747): _call_impl") \
        == "torch/nn/modules/module.py(1747): _call_impl"
    assert function_name("/usr/lib/python3/dist-packages/numpy/core/fromnumeric.py(71): _wrapreduction") \
        == "numpy/core/fromnumeric.py(71): _wrapreduction"
    for same in ("aten::mm", "ProfilerStep#12", "<built-in function len>", "nn.Module: Linear_0",
                 "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"):
        assert function_name(same) == same


def _trace(path, rank: int, address: int, hot_us: float) -> None:
    """A CPU-only trace of 4 steps: a step span, the wait (with this process's address), a hot loop."""
    ev = []
    t = 1000.0 + rank * 777.0            # each rank's own clock
    for i in range(4):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{10 + i}", "ts": t, "dur": 1000.0,
                   "pid": 1, "tid": 1})
        ev.append({"ph": "X", "cat": "python_function", "name": "train.py(20): step", "ts": t + 1, "dur": 998.0,
                   "pid": 1, "tid": 1})
        ev.append({"ph": "X", "cat": "python_function", "name": "train.py(31): hot_loop", "ts": t + 10,
                   "dur": hot_us, "pid": 1, "tid": 1})
        ev.append({"ph": "X", "cat": "python_function", "name": WAIT.format(address + 16 * i),
                   "ts": t + 20 + hot_us, "dur": 900.0 - hot_us, "pid": 1, "tid": 1})
        t += 1000.0
    path.write_text(json.dumps({"traceEvents": ev, "distributedInfo": {"rank": rank, "world_size": 4}}))


def test_ranks_with_their_own_addresses_read_as_one_function(tmp_path):
    paths = {}
    for r in range(4):
        paths[r] = tmp_path / f"rank-{r}.json"
        _trace(paths[r], r, 0x7F0000000000 + 0x100000 * r, 100.0)
    tr = read_trace(paths[2])
    assert sum(n.startswith("<built-in method wait") for n in tr.names) == 1   # 4 addresses in the file, one name
    res = localize_traces(paths, job_id="j")
    assert res.healthy, [(o.function, o.ranks) for o in res.outliers]          # without it: every rank named
    _trace(paths[1], 1, 0x7F5555000000, 500.0)                                  # rank 1: five times the hot loop
    res = localize_traces(paths, job_id="j")
    named = {(o.function, r) for o in res.outliers for r, s in zip(o.ranks, o.slower) if s}
    assert ("train.py(31): hot_loop", 1) in named, named
    assert {r for _, r in named} == {1}, named
