"""The stack grid (Mycroft §5 evidence) without processes: py-spy's dump JSON parsed, the collector's
dumper on a stand-in runner (py-spy itself cannot be started in a unit test: the real one runs in
tests/integration/test_collective_rca.py), the processor's request and return legs on a real
ControlHub, the analyzer's clusters and their attachment to stall and late-start findings, and one
command through the real control stream (gRPC in this process: threads, no process)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time

import grpc
import pytest

from test_collectives import MS, W, job_batches, state_of
from trainscope.analyzer import stack_grid
from trainscope.analyzer.merge import merge
from trainscope.collector.control import ControlClient
from trainscope.collector.stacks import StackDumper, parse_dump
from trainscope.processor.collectives import CollectiveWindowConfig, CollectiveWindows, TriggerConfig, validate
from trainscope.processor.control import ControlConfig, ControlHub, ControlServicer
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.security import ClientSecurity
from trainscope.proto.v1 import control_pb2, telemetry_pb2

#: ``py-spy dump --json`` of a two-thread script (py-spy 0.4.3), trimmed to the fields it is read for.
DUMP = json.dumps([
    {"thread_name": "worker", "os_thread_id": 30209, "active": False, "owns_gil": False, "frames": [
        {"name": "<lambda>", "filename": "/tmp/pyspy_t.py", "short_filename": "pyspy_t.py", "line": 4},
        {"name": "Thread.run", "filename": "/usr/lib/python3.11/threading.py", "short_filename": "threading.py",
         "line": 982}]},
    {"thread_name": "MainThread", "os_thread_id": 30167, "active": True, "owns_gil": True, "frames": [
        {"name": "slow_step", "filename": "/tmp/pyspy_t.py", "short_filename": "pyspy_t.py", "line": 2},
        {"name": "train", "filename": "/tmp/pyspy_t.py", "short_filename": "pyspy_t.py", "line": 3},
        {"name": "<module>", "filename": "/tmp/pyspy_t.py", "short_filename": "pyspy_t.py", "line": 5}]}])

CMD = control_pb2.StackDumpCommand(grid_id="0-hang-13", job_id="j", group="0", trigger="hang", seq=13,
                                   ranks=[0, 1, 2, 3], timeout_s=2.0)


# ----------------------------------------------------------------- collector
def test_a_py_spy_dump_becomes_one_thread_rooted_folded_stack_per_thread():
    worker, main = parse_dump(DUMP)
    assert main.stack == "MainThread;<module> (pyspy_t.py:5);train (pyspy_t.py:3);slow_step (pyspy_t.py:2)"
    assert (main.thread_id, main.count, main.idle) == (30167, 1, False)
    assert worker.stack == "worker;Thread.run (threading.py:982);<lambda> (pyspy_t.py:4)" and worker.idle
    assert len(parse_dump(DUMP, max_frames=1)[1].stack.split(";")) == 2      # the innermost frame kept
    for bad in ("not json", "{}", "[1]"):
        with pytest.raises(ValueError):
            parse_dump(bad)


class Runner:
    """Stands in for running py-spy: records the command line, answers as told."""

    def __init__(self, rc=0, out=DUMP, err="", exc=None, gate: threading.Event | None = None) -> None:
        self.rc, self.out, self.err, self.exc, self.gate = rc, out, err, exc, gate
        self.calls: list = []

    def __call__(self, cmd, timeout_s):
        self.calls.append((cmd, timeout_s))
        if self.gate is not None:
            self.gate.wait(5)
        if self.exc is not None:
            raise self.exc
        return self.rc, self.out, self.err


def test_the_dumper_dumps_its_own_process_without_pausing_it_and_submits_one_batch():
    sent = []
    dumper = StackDumper(lambda b, n: sent.append((b, n)) or True, py_spy=__file__, run=(runner := Runner()))
    d = dumper.dump(CMD)
    (cmd, timeout), = runner.calls
    assert cmd[1:] == ["dump", "--pid", str(os.getpid()), "--json", "--nonblocking"] and 1.5 < timeout <= 2.0
    assert (d.grid_id, d.group, d.trigger, d.seq, list(d.expected_ranks)) == ("0-hang-13", "0", "hang", 13,
                                                                               [0, 1, 2, 3])
    assert d.training_thread == threading.main_thread().native_id and not d.error and len(d.threads) == 2
    assert dumper.submit(d)
    (batch, n), = sent
    assert isinstance(batch, telemetry_pb2.CollectiveBatch) and list(batch.dumps) == [d] and n == batch.ByteSize()
    assert not batch.records and dumper.stats["dumps"] == 1 and dumper.stats["submitted"] == 1


@pytest.mark.parametrize("runner,why", [
    (Runner(rc=1, out="", err="Error: Permission denied (os error 13)\n\nStack backtrace:\n  0: x"),
     "Error: Permission denied (os error 13)"),
    (Runner(exc=TimeoutError()), "py-spy timed out"),
    (Runner(out="garbage"), "py-spy dump unreadable"),
])
def test_a_failed_dump_says_why_and_is_still_sent(runner, why):
    dumper = StackDumper(lambda b, n: True, py_spy=__file__, run=runner)
    d = dumper.dump(CMD)
    assert d.error.startswith(why) and not d.threads and dumper.stats["errors"] == 1
    missing = StackDumper(lambda b, n: True, py_spy="/nonexistent/py-spy", run=runner).dump(CMD)
    assert missing.error == "py-spy not found"


def test_a_transient_py_spy_failure_is_run_again_within_the_timeout_and_a_permanent_one_is_not():
    """--nonblocking reads race the interpreter: py-spy can fail to copy a frame once and succeed next."""
    class Flaky(Runner):
        def __call__(self, cmd, timeout_s):
            super().__call__(cmd, timeout_s)
            if len(self.calls) == 1:
                return 1, "", "Error: Failed to copy PyCodeObject\n"
            return 0, DUMP, ""

    dumper = StackDumper(lambda b, n: True, py_spy=__file__, run=(flaky := Flaky()))
    d = dumper.dump(CMD)
    assert not d.error and len(d.threads) == 2 and len(flaky.calls) == 2 and dumper.stats["retries"] == 1
    assert all(0 < t <= CMD.timeout_s for _, t in flaky.calls)          # both within the command's 2 s
    # always transient: three runs, then the last reason; permanent: one run
    dumper = StackDumper(lambda b, n: True, py_spy=__file__, run=(bad := Runner(out="garbage")))
    assert dumper.dump(CMD).error.startswith("py-spy dump unreadable") and len(bad.calls) == 3
    denied = Runner(rc=1, out="", err="Error: Permission denied (os error 13)\n")
    assert StackDumper(lambda b, n: True, py_spy=__file__, run=denied).dump(CMD).error and len(denied.calls) == 1


def test_one_dump_at_a_time_off_the_calling_thread():
    gate, sent = threading.Event(), []
    dumper = StackDumper(lambda b, n: sent.append(b) or True, py_spy=__file__, run=Runner(gate=gate))
    assert dumper.request(CMD)            # returns at once: py-spy runs on the dumper's thread
    assert not dumper.request(CMD)        # a second while the first runs: refused, counted
    assert dumper.stats["busy"] == 1 and not sent
    gate.set()
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(sent) == 1
    while not dumper.request(CMD) and time.monotonic() < deadline:   # free again once it was sent
        time.sleep(0.01)
    assert dumper.stats["requests"] >= 3


# ----------------------------------------------------------------- processor
def hub_with(ranks, job="j") -> ControlHub:
    hub = ControlHub(ControlConfig(directory="/nonexistent"))
    for r in ranks:
        hub.subscribe(control_pb2.ControlHello(resource=Resource(job_id=job, rank=r, world_size=8).to_pb()))
    return hub


def hang_batches(cw: CollectiveWindows, ranks=(0, 1, 3)):
    """Ranks 0, 1, 3 of group 0 report seq 13 in flight for 20 s: the processor's hang trigger."""
    for r in ranks:
        b = telemetry_pb2.CollectiveBatch(
            groups=[telemetry_pb2.CollectiveGroup(id="0", members=[0, 1, 2, 3])], now_ns=21_000 * MS,
            records=[telemetry_pb2.CollectiveRecord(group=0, seq=13, op="allreduce", bytes=64, enqueue_ns=1000 * MS)])
        payload, _, _ = validate(b, 8, 2**62, cw.metrics)
        cw.add(Resource(job_id="j", rank=r, world_size=8), payload)


def test_a_hang_trigger_sends_one_dump_command_to_every_subscribed_member_once_per_cooldown():
    now = [0.0]
    m = SelfMetrics()
    cw = CollectiveWindows(CollectiveWindowConfig(trigger=TriggerConfig(grid_cooldown_s=60)), lambda o: None, m,
                           clock=lambda: now[0])
    hub = hub_with([0, 1, 2, 5])          # rank 3 holds no control stream here; rank 5 is not in the group
    cw.grids.control = hub
    hang_batches(cw)
    assert m.get("collective_triggers", kind="hang") == 1
    assert m.get("stack_grid_requests", outcome="sent") == 1
    for r in (0, 1, 2):
        msg = hub._subs["j"][r].queue.get_nowait()
        cmd = msg.stack_dump
        assert (cmd.grid_id, cmd.group, cmd.trigger, cmd.seq, list(cmd.ranks)) == ("0-hang-13", "0", "hang", 13,
                                                                                     [0, 1, 2])
    assert hub._subs["j"][5].queue.empty()
    t = cw.triggers.recent[-1]
    assert cw.grids.request(t) == [] and m.get("stack_grid_requests", outcome="cooldown") == 1
    now[0] = 61.0
    assert cw.grids.request(t) == [0, 1, 2]
    cw.grids.control = hub_with([7])      # nobody of the group subscribed
    now[0] = 200.0
    assert cw.grids.request(t) == [] and m.get("stack_grid_requests", outcome="unreachable") == 1


def test_grids_can_be_turned_off_and_bad_settings_name_themselves():
    m = SelfMetrics()
    cw = CollectiveWindows(CollectiveWindowConfig(trigger=TriggerConfig(stack_grid=False)), lambda o: None, m)
    cw.grids.control = hub = hub_with([0, 1, 2, 3])
    hang_batches(cw)
    assert m.get("collective_triggers", kind="hang") == 1 and hub._subs["j"][0].queue.empty()
    for kw in (dict(grid_cooldown_s=-1), dict(grid_timeout_s=0)):
        with pytest.raises(ConfigError, match="grid_"):
            TriggerConfig(**kw)


def dump(rank_stack: str, grid="0-hang-13", error="", **kw) -> telemetry_pb2.StackDump:
    threads = [telemetry_pb2.FoldedStack(stack=s, count=1, thread_id=i + 1) for i, s in enumerate(
        ["trainscope-control;_bootstrap (threading.py:1002);_run (control.py:140)", rank_stack])] if rank_stack else []
    fields = dict(group="0", trigger="hang", seq=13, expected_ranks=[0, 1, 2, 3], training_thread=2)
    return telemetry_pb2.StackDump(grid_id=grid, threads=threads, error=error, **{**fields, **kw})


def test_dumps_are_validated_at_ingest_and_emitted_at_once_without_moving_the_rank_clock():
    m = SelfMetrics()
    out = []
    cw = CollectiveWindows(CollectiveWindowConfig(), out.append, m)
    long = "MainThread;" + ";".join(f"f{i} (x.py:{i})" for i in range(2000)) + ";innermost (y.py:1)"
    good = dump(long)
    bad = [dump("MainThread;a (b.py:1)", grid="../etc"), dump("MainThread;a (b.py:1)", expected_ranks=[9]),
           dump("MainThread;a (b.py:1)", trigger="whim")]
    payload, n, end = validate(telemetry_pb2.CollectiveBatch(dumps=[good, *bad]), 8, 2**62, m)
    assert n == 1 and end == 0 and m.get("records_rejected", reason="stack_dump") == 3
    (d,) = payload[4]
    assert len(d.threads[1].stack) == 8192 and d.threads[1].stack.endswith(";innermost (y.py:1)")
    assert m.get("records_truncated", what="stack") == 1
    cw.add(Resource(job_id="j", rank=2, world_size=8), payload)
    (o,) = out                            # at once: no window close awaited
    rec = o.collectives
    assert list(rec.dumps) == [d] and not rec.records and not rec.stats and rec.now_ns == 0
    assert cw.open_windows == 0 and m.get("stack_grid_dumps", outcome="ok") == 1
    with pytest.raises(ValueError):       # neither records nor a valid dump
        validate(telemetry_pb2.CollectiveBatch(dumps=bad), 8, 2**62, m)


# ------------------------------------------------------------------ analyzer
WAIT = "MainThread;<module> (train.py:80);main (train.py:72);wrapper (torch_collectives.py:116);" \
       "all_reduce (distributed_c10d.py:3252)"
SLEEP = "MainThread;<module> (train.py:80);main (train.py:63)"


def grid_of(stacks: dict) -> stack_grid.Grid:
    book = stack_grid.GridBook()
    for r, s in stacks.items():
        book.absorb(r, [s if isinstance(s, telemetry_pb2.StackDump) else dump(s)])
    return book.grids["0-hang-13"]


def test_the_grid_sets_the_rank_elsewhere_apart():
    ev = stack_grid.evidence(grid_of({0: WAIT, 1: WAIT, 2: SLEEP, 3: WAIT}))
    assert ev["odd_ranks"] == [2] and ev["complete"] and ev["ranks_dumped"] == 4 and ev["missing"] == []
    big, odd = ev["clusters"]
    assert big["ranks"] == [0, 1, 3] and big["thread"] == "MainThread"
    assert big["stack"][0] == "all_reduce (distributed_c10d.py:3252)" and odd["stack"] == [
        "main (train.py:63)", "<module> (train.py:80)"]
    assert ev["summary"] == ("rank 2: 1 of 4 ranks in `main (train.py:63) <- <module>`; ranks 0,1,3 in "
                             "`all_reduce (distributed_c10d.py:3252) <- wrapper <- main <- <module>`")
    assert stack_grid.rank_line(ev, 2) == ("in `main (train.py:63) <- <module>` (1 of 4 ranks; "
                                           "0,1,3 in `all_reduce (distributed_c10d.py:3252) <- wrapper <- ...`)")


def test_a_healthy_grid_has_one_cluster_and_line_numbers_do_not_split_it():
    other_line = WAIT.replace("main (train.py:72)", "main (train.py:74)")
    ev = stack_grid.evidence(grid_of({0: WAIT, 1: other_line, 2: WAIT, 3: WAIT}))
    assert ev["odd_ranks"] == [] and [c["ranks"] for c in ev["clusters"]] == [[0, 1, 2, 3]]


def test_the_training_thread_is_the_one_the_collector_named_else_main_and_missing_ranks_say_why():
    d = dump(WAIT)                                        # thread 2 named: the second thread listed
    assert stack_grid.training_thread(d).stack == WAIT
    d.training_thread = 0
    d.threads[1].stack = d.threads[1].stack.replace("MainThread", "train-loop")
    assert stack_grid.training_thread(d).stack.startswith("trainscope-control")   # no name, no id: the first
    ev = stack_grid.evidence(grid_of({0: WAIT, 1: dump("", error="py-spy not found"), 3: WAIT}), members=[0, 1, 2, 3])
    assert ev["missing"][0] == {"rank": 1, "why": "py-spy not found"} and ev["missing"][1]["rank"] == 2
    assert not ev["complete"] and ev["summary"].endswith("ranks 1,2: no stack")


def test_a_stall_found_before_its_grid_is_complete_is_issued_again_with_it_once():
    st = state_of(job_batches(steps=30, hang_rank=2, hang_at=12))
    st.late_starts("j", W)
    (f,) = st.hangs("j", W)
    assert f.evidence["seq"] == 13 and "stack_grid" not in f.evidence      # no dump yet
    for r, s in ((0, WAIT), (1, WAIT), (3, WAIT)):
        st.grids.absorb(r, [dump(s)])
    assert st.hangs("j", W) == []                         # incomplete, wait_s not passed
    st.grids.absorb(2, [dump(SLEEP)])
    (again,) = st.hangs("j", W)
    assert again.id == f.id and again.evidence["stack_grid"]["odd_ranks"] == [2]
    assert again.suspects[0].evidence["stack_grid"].startswith("in `main (train.py:63)")
    assert st.hangs("j", W) == []                         # once
    v = merge("j", W, [again], {r: Resource(job_id="j", rank=r, world_size=4) for r in range(4)})
    (s,) = [s for s in v.ranks if s.rank == 2]
    assert "; stack grid: in `main (train.py:63) <- <module>` (1 of 4 ranks" in s.why
    assert s.evidence["stack_grid"].startswith("in `main")


def test_a_partial_grid_is_attached_after_wait_s_and_a_grid_present_at_once():
    st = state_of(job_batches(steps=30, hang_rank=2, hang_at=12))
    t = [0.0]
    st.grids._clock = lambda: t[0]
    for r, s in ((0, WAIT), (1, WAIT), (2, SLEEP)):       # rank 3's dump never comes
        st.grids.absorb(r, [dump(s)])
    (f,) = st.hangs("j", W)
    assert f.evidence["stack_grid"]["odd_ranks"] == [2] and not f.evidence["stack_grid"]["complete"]
    t[0] = st.grids.config.wait_s + 1
    (again,) = st.hangs("j", W)
    assert again.evidence["stack_grid"]["missing"][0]["rank"] == 3


def test_a_late_start_carries_the_groups_newest_grid_and_none_without_one():
    st = state_of(job_batches(late_rank=2, late_ms=30, late_from=5))
    (late,) = [f for f in st.late_starts("j", W, {r: 20.0 for r in range(4)}) if f.kind == "late_start"]
    assert "stack_grid" not in late.evidence
    st = state_of(job_batches(late_rank=2, late_ms=30, late_from=5))
    for r, s in ((0, WAIT), (1, WAIT), (2, SLEEP), (3, WAIT)):
        st.grids.absorb(r, [dump(s, grid="0-straggler-1", trigger="straggler")])
    (late,) = [f for f in st.late_starts("j", W, {r: 20.0 for r in range(4)}) if f.kind == "late_start"]
    ev = late.evidence["stack_grid"]
    assert ev["trigger"] == "straggler" and ev["odd_ranks"] == [2]
    assert late.suspects[0].rank == 2 and late.suspects[0].evidence["stack_grid"].startswith("in `main")


def test_a_late_start_shows_the_recent_grid_that_caught_its_rank_apart_and_says_in_how_many():
    """Each grid is one moment per rank and a late rank is in its delay for part of each step: on a real
    plain job beside load the one grid a late start carried (the newest) caught rank 1 in its backward and
    another rank at the top of its loop, while older grids of the same group had it alone in its delay."""
    st = state_of(job_batches(late_rank=2, late_ms=30, late_from=5))
    loop_top = "MainThread;<module> (train.py:80);main (train.py:70)"
    for grid, late_rank_stack, rank_3 in (("0-straggler-1", SLEEP, WAIT), ("0-straggler-2", WAIT, WAIT),
                                          ("0-straggler-3", loop_top, loop_top)):   # odd, not alone: not apart
        for r, s in ((0, WAIT), (1, WAIT), (2, late_rank_stack), (3, rank_3)):
            st.grids.absorb(r, [dump(s, grid=grid, trigger="straggler")])
    (late,) = [f for f in st.late_starts("j", W, {r: 20.0 for r in range(4)}) if f.kind == "late_start"]
    ev = late.evidence["stack_grid"]
    assert ev["grid"] == "0-straggler-1" and ev["odd_ranks"] == [2]
    assert ev["apart_in"] == 1 and ev["recent_grids"] == 3
    assert ev["summary"].endswith(" (rank 2 apart in 1 of 3 recent grids)"), ev["summary"]
    assert late.suspects[0].evidence["stack_grid"].startswith("in `main")
    # none of them sets it apart: the newest is shown, and the count says so
    st = state_of(job_batches(late_rank=2, late_ms=30, late_from=5))
    for grid in ("0-straggler-1", "0-straggler-2"):
        for r in range(4):
            st.grids.absorb(r, [dump(WAIT, grid=grid, trigger="straggler")])
    (late,) = [f for f in st.late_starts("j", W, {r: 20.0 for r in range(4)}) if f.kind == "late_start"]
    ev = late.evidence["stack_grid"]
    assert ev["grid"] == "0-straggler-2" and ev["odd_ranks"] == [] and ev["apart_in"] == 0
    assert ev["summary"].endswith(" (rank 2 apart in 0 of 2 recent grids)"), ev["summary"]


def test_a_late_start_named_before_its_grid_arrived_is_issued_again_with_it():
    """The straggler trigger's dumps can reach the analyzer after the window that named the late rank
    (a real plain job once ended with no late start carrying its grid): the finding waits for them."""
    st = state_of(job_batches(late_rank=2, late_ms=30, late_from=5))
    (late,) = [f for f in st.late_starts("j", W, {r: 20.0 for r in range(4)}) if f.kind == "late_start"]
    assert "stack_grid" not in late.evidence
    assert [f for f in st.hangs("j", W) if f.kind == "late_start"] == []      # nothing in yet
    for r, s in ((0, WAIT), (1, WAIT), (2, SLEEP), (3, WAIT)):
        st.grids.absorb(r, [dump(s, grid="0-straggler-1", trigger="straggler")])
    (again,) = [f for f in st.hangs("j", W) if f.kind == "late_start"]
    assert again.id == late.id and again.evidence["stack_grid"]["odd_ranks"] == [2]
    assert again.suspects[0].rank == 2 and again.suspects[0].evidence["stack_grid"].startswith("in `main")
    assert [f for f in st.hangs("j", W) if f.kind == "late_start"] == []      # once


def test_grid_config_names_bad_settings():
    for kw in (dict(frames=0), dict(wait_s=0), dict(max_grids=0)):
        with pytest.raises(ConfigError, match="stack_grid"):
            stack_grid.StackGridConfig(**kw)


# -------------------------------------------------------- the control stream
def test_a_dump_command_reaches_the_collectors_dumper_through_the_real_stream(tmp_path):
    hub = ControlHub(ControlConfig(directory=str(tmp_path / "dd")))
    servicer = ControlServicer(hub)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4), handlers=[servicer.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    got = threading.Event()

    class Dumper:
        def request(self, cmd) -> bool:
            self.cmd = cmd
            got.set()
            return True

    from test_deep_dive_control import DeepDiveWindow   # the deep-dive window a collector always has
    res = Resource(job_id="j", rank=2, world_size=4)
    window = DeepDiveWindow(str(tmp_path / "dd"), res.to_pb(), lambda r: None)
    client = ControlClient(f"127.0.0.1:{port}", lambda: res, window, security=ClientSecurity(),
                           dumper=(dumper := Dumper())).start()
    try:
        deadline = time.monotonic() + 10
        while not hub.subscribers("j") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hub.send("j", [1, 2], control_pb2.ControlCommand(stack_dump=CMD)) == [2]
        assert got.wait(10) and dumper.cmd == CMD and client.stats["stack_dumps"] == 1
    finally:
        client.stop(1.0)
        servicer.close()
        server.stop(0)
