"""One real 6-rank gloo job, four kinds of fault on four ranks, two healthy ranks: one deep dive names each.

A real processor on 127.0.0.1:0 (in this process) and a real torch job (CPU, gloo) under
``trainscope run`` (``tests/support/deepdive_job.py``, shared with ``bench_realdives.py``); nothing in
the training script knows trainscope. Every rank runs the same
loop (data loader, a small MLP, ``time.sleep`` for the rest of a step, all-reduce of the
gradients); four ranks carry one problem each that only a function-level view explains
(issue #14's list; L1-L3 can only say which rank is late):

- rank 1, slow collate: the data loader's ``collate_fn`` does ~20 ms of Python per batch;
- rank 2, ``gc.collect()`` every step: every rank froze its startup objects (``gc.freeze()``,
  as long-running trainers do) and holds 200k tracked objects; only rank 2 collects them each step
  (a full collection of torch's ~180k startup objects alone takes ~160 ms, which would dwarf the
  other faults of this one job);
- rank 3, a busy thread: a helper thread spinning in pure Python takes the CPU and the GIL; the
  training thread's functions take longer at every GIL hand-off, and the thread's own function
  is on no critical path (``patterns.thread_patterns``);
- rank 4, unfused ops: its model's activation is tanh-GELU written as ~8 elementwise ops, six
  times over, where its peers run the one fused ``gelu`` op.

Once the processor has seen the job's iterations, ``trainscope profile`` asks for a 4-iteration
deep dive; the analyzer's follower (``analyzer/deepdive/results.py``) analyses it. Asserted: each
faulty rank is named for its fault's function (the collate function; ``gc.collect``'s built-in,
called from the loop; the spinning thread's function; the elementwise ops called from the
unfused ``forward``), the healthy ranks 0 and 5 for nothing, and the stored L4 diagnoses name the
four faulty ranks only. The job ~25-40 s on this shared 2-core host.
"""
from __future__ import annotations

import json
import re

import pytest

from support.deepdive_job import line_of, run_once

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration

WORLD = 6
FAULTS = {1: "slow_collate", 2: "gc", 3: "busy_thread", 4: "unfused"}
HEALTHY = sorted(set(range(WORLD)) - set(FAULTS))


@pytest.fixture(scope="module")
def dive(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deep_dive_faults")
    return run_once(tmp / "a1", FAULTS, WORLD)


def test_one_dive_names_each_fault_on_its_rank_and_no_healthy_rank(dive, tmp_path):
    from trainscope.analyzer.deepdive.results import DeepDiveFollower, FollowerConfig
    from trainscope.analyzer.store import DiagnosisStore

    rc, out, p, deep = dive
    assert p.returncode == 0, (p.stdout, p.stderr, out[-2000:])
    assert json.loads(p.stdout)["complete"] is True
    store = DiagnosisStore(str(tmp_path / "store.sqlite"))
    (doc,) = DeepDiveFollower(str(deep), store, FollowerConfig(verdict_wait_s=0)).scan()
    assert doc["ranks_analysed"] == list(range(WORLD)), doc
    print("\n" + "\n".join(f"outlier {o['kind']} {o['function'][:70]} ranks {o['ranks']} slower {o['slower']} "
                            f"impact {o['impact_s']} called from {o['launched_by'][:50]!r} "
                            f"{o['not_cause'] or ''}" for o in doc["outliers"]))
    named: dict[int, list[dict]] = {}
    for o in doc["outliers"]:
        assert not o["common"], o
        if o["not_cause"]:          # ranks that waited, or slower at no cost to the job (localize steps 7-8)
            assert not set(o["ranks"]) & set(FAULTS) or o["not_cause"] == "waited", o
            continue
        for r, slower in zip(o["ranks"], o["slower"]):
            if slower:
                named.setdefault(r, []).append(o)
    assert set(named) == set(FAULTS), {r: [o["function"] for o in os] for r, os in named.items()}  # 0 and 5: nothing
    assert doc["suspects"] == sorted(FAULTS)
    fn = {r: {o["function"] for o in os} for r, os in named.items()}
    # rank 1: the collate function itself
    assert f"train_faults.py({line_of('def slow_collate')}): slow_collate" in fn[1], fn[1]
    # rank 2: gc.collect's built-in, called from the training loop
    (gc_out,) = [o for o in named[2] if o["function"] == "<built-in function collect>"]
    # (a frame already running when profiling began is named at its line then, not its definition's)
    assert re.fullmatch(r"train_faults\.py\(\d+\): main", gc_out["launched_by"]), gc_out
    # rank 3: the spinning thread's function (off the critical path), with the training thread slower
    # (the spinning thread's function; another frame of that thread may be named beside it)
    threads = [o for o in named[3] if o["kind"] == "thread"]
    spin = [o for o in threads if re.fullmatch(r"train_faults\.py\(\d+\): spin", o["function"])]
    assert spin and spin[0]["beta"][0] > 0.5, threads
    # its symptoms on the training thread's path (GIL hand-offs) land on a different function each iteration on
    # a loaded host, so whether one of them is steady enough to be named beside the thread varies with the load:
    # the fault's own function is the thread's; any path symptom named is on rank 3 (the set of ranks above)
    print(f"rank 3 path symptoms named beside the thread: {[o['function'] for o in named[3] if o['kind'] != 'thread']}")
    # rank 4: elementwise ops of the unfused forward, called from it or from the autograd engine running
    # their backward (which of the two holds most of an op's critical time varies with the load)
    unfused_fwd = f"train_faults.py({line_of('def forward', after='class Unfused')}): forward"
    ops = [o for o in named[4] if o["function"] in ("aten::mul", "aten::add", "aten::tanh", "aten::pow")]
    assert ops and any(o["launched_by"] == unfused_fwd or o["launched_by"].endswith(": _engine_run_backward")
                       for o in ops), named[4]
    # stored as L4 diagnoses naming the four faulty ranks only
    diags = list(store.diagnoses("faults", level="L4"))
    assert {s.rank for d in diags for s in d.suspects} == set(FAULTS)
    store.close()
    assert rc == 0, out[-3000:]
