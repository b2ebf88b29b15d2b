"""The deep-dive control contract (proto/v1/control.proto, contracts.CONTROL_*) and the processor's hub.

The hub is driven directly (fake clock); one test runs the real gRPC service in
this process (threads, no process) with the collector's ControlClient and a
DeepDiveWindow on a fake profiler, the way a rank receives a command.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import stat
import time
import types

import grpc
import pytest

from trainscope.collector.control import ControlClient
from trainscope.collector.deep_dive import DeepDiveWindow
from trainscope.processor.control import (
    ControlConfig, ControlHub, ControlServicer, deep_dive_status, request_all, summarize_trace)
from trainscope.proto import contracts
from trainscope.proto.contracts import (
    CONTROL_REPORT, CONTROL_REQUEST, CONTROL_SERVICE, CONTROL_STATUS, CONTROL_SUBSCRIBE, Signal, Trigger)
from trainscope.proto.model import Resource
from trainscope.proto.security import ClientSecurity
from trainscope.proto.v1 import control_pb2, telemetry_pb2

O = control_pb2.DeepDiveOutcome


def test_contract_names_match_the_generated_service():
    svc = control_pb2.DESCRIPTOR.services_by_name["Control"]
    assert svc.full_name == CONTROL_SERVICE
    methods = {m.name: m for m in svc.methods}
    assert {f"/{CONTROL_SERVICE}/{n}" for n in methods} == {CONTROL_SUBSCRIBE, CONTROL_REPORT, CONTROL_REQUEST,
                                                            CONTROL_STATUS}
    sub = methods["Subscribe"]
    assert sub.server_streaming and not sub.client_streaming      # the collector opens it and only reads
    assert sub.input_type.name == "ControlHello" and sub.output_type.name == "ControlCommand"
    assert {t.value for t in Trigger} == {"manual", "degradation", "stall", "verdict"}
    # the ingest contract is untouched: its service still has its one method
    assert [m.name for m in telemetry_pb2.DESCRIPTOR.services_by_name["Ingest"].methods] == ["Stream"]


def test_command_round_trips_with_its_target_iteration():
    c = control_pb2.ControlCommand(sent_unix_ns=5, deep_dive=control_pb2.DeepDiveCommand(
        dive_id="x", job_id="j", start_iteration=1234, iterations=5, ranks=[0, 3], trigger="manual"))
    back = control_pb2.ControlCommand.FromString(c.SerializeToString())
    assert back.WhichOneof("command") == "deep_dive"
    assert back.deep_dive.start_iteration == 1234 and list(back.deep_dive.ranks) == [0, 3]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def hello(job="j", rank=0):
    return control_pb2.ControlHello(resource=Resource(job_id=job, rank=rank, world_size=4).to_pb(),
                                    protocol=contracts.CONTROL_PROTOCOL, profiler_available=True)


def marks(job, rank, its, dur_ns=100_000_000):
    return types.SimpleNamespace(signal=Signal.ITERATIONS, resource=Resource(job_id=job, rank=rank, world_size=4),
                                 payload=[telemetry_pb2.IterationMark(iteration=i, start_ns=i * dur_ns,
                                                                      end_ns=(i + 1) * dur_ns) for i in its])


def hub(tmp_path, **kw):
    clock = Clock()
    h = ControlHub(ControlConfig(directory=str(tmp_path / "dd"), **kw), clock=clock)
    return h, clock


def drain(sub):
    out = []
    while not sub.queue.empty():
        out.append(sub.queue.get_nowait())
    return out


def test_request_starts_a_lead_ahead_of_the_latest_iteration_on_every_subscribed_rank(tmp_path):
    h, _ = hub(tmp_path, lead_iterations=3, lead_s=1.0)
    subs = [h.subscribe(hello(rank=r)) for r in range(4)]
    h.subscribe(hello(job="other", rank=0))
    h.observe(marks("j", 0, range(0, 50)))                 # 100 ms iterations: 1 s = 10 iterations
    ack = h.request(control_pb2.DeepDiveRequest(job_id="j", iterations=4))
    assert ack.accepted and ack.latest_iteration == 49
    assert ack.start_iteration == 49 + 10 and ack.iterations == 4 and ack.ranks_reached == 4
    for s in subs:
        (m,) = drain(s)
        assert m.deep_dive.start_iteration == ack.start_iteration and m.deep_dive.dive_id == ack.dive_id
    man = os.path.join(ack.directory, "manifest.json")
    assert stat.S_IMODE(os.stat(man).st_mode) == 0o600
    assert json.load(open(man))["ranks_expected"] == [0, 1, 2, 3]


def test_duration_becomes_iterations_at_the_jobs_pace_and_is_capped(tmp_path):
    h, _ = hub(tmp_path, max_iterations=50)
    h.subscribe(hello())
    h.observe(marks("j", 0, range(20)))
    assert h.request(control_pb2.DeepDiveRequest(job_id="j", duration_s=2.0)).iterations == 20
    h2, _ = hub(tmp_path / "b", max_iterations=50)
    h2.subscribe(hello())
    h2.observe(marks("j", 0, range(20)))
    assert h2.request(control_pb2.DeepDiveRequest(job_id="j", duration_s=1000.0)).iterations == 50


@pytest.mark.parametrize("case", ["no_job", "no_subscriber", "no_iteration", "start_behind", "bad_id", "ranks"])
def test_refusals_say_why(tmp_path, case):
    h, _ = hub(tmp_path)
    if case != "no_subscriber":
        h.subscribe(hello(rank=0))
    if case != "no_iteration":
        h.observe(marks("j", 0, range(30)))
    req = {"no_job": dict(job_id=""), "no_subscriber": dict(job_id="j"), "no_iteration": dict(job_id="j"),
           "start_behind": dict(job_id="j", start_iteration=10), "bad_id": dict(job_id="j", dive_id="../x"),
           "ranks": dict(job_id="j", ranks=[5])}[case]
    ack = h.request(control_pb2.DeepDiveRequest(**req))
    assert not ack.accepted and ack.detail
    assert h.stats["requests_refused"] == 1


def test_one_deep_dive_per_job_then_a_cooldown_then_partial_by_timeout(tmp_path):
    h, clock = hub(tmp_path, cooldown_s=60, report_timeout_s=30)
    subs = [h.subscribe(hello(rank=r)) for r in range(2)]
    h.observe(marks("j", 0, range(30)))
    a = h.request(control_pb2.DeepDiveRequest(job_id="j", iterations=2))
    assert a.accepted
    b = h.request(control_pb2.DeepDiveRequest(job_id="j", iterations=2))
    assert not b.accepted and "one at a time" in b.detail
    for r in range(2):
        rep = control_pb2.DeepDiveReport(resource=Resource(job_id="j", rank=r, world_size=2).to_pb(),
                                         dive_id=a.dive_id, outcome=O.DEEP_DIVE_OUTCOME_DONE,
                                         first_iteration=a.start_iteration,
                                         last_iteration=a.start_iteration + 1, trace_path=f"/t/rank-{r}.json")
        assert h.report(rep).ok
    (rec,) = h.status(control_pb2.DeepDiveQuery(job_id="j")).dives
    assert rec.complete and not rec.partial
    man = json.load(open(os.path.join(a.directory, "manifest.json")))
    assert man["complete"] and man["ranks"]["1"]["outcome"] == "done"
    c = h.request(control_pb2.DeepDiveRequest(job_id="j"))
    assert not c.accepted and "cool-down" in c.detail
    clock.t += 61
    h.observe(marks("j", 0, range(30, 40)))
    d = h.request(control_pb2.DeepDiveRequest(job_id="j", iterations=2))
    assert d.accepted
    h.report(control_pb2.DeepDiveReport(resource=Resource(job_id="j", rank=0, world_size=2).to_pb(),
                                        dive_id=d.dive_id, outcome=O.DEEP_DIVE_OUTCOME_DONE))
    assert not h.status(control_pb2.DeepDiveQuery(dive_id=d.dive_id)).dives[0].complete
    clock.t += 1000                                         # rank 1 never reports
    (rec,) = h.status(control_pb2.DeepDiveQuery(dive_id=d.dive_id)).dives
    assert rec.complete and rec.partial
    # a report of another job's dive id is not filed
    assert not h.report(control_pb2.DeepDiveReport(resource=Resource(job_id="x", rank=0, world_size=1).to_pb(),
                                                   dive_id=d.dive_id)).ok


def test_subscribers_are_bounded_and_a_reconnecting_rank_replaces_its_old_stream(tmp_path):
    h, _ = hub(tmp_path, max_subscribers=2)
    a = h.subscribe(hello(rank=0))
    assert h.subscribe(hello(rank=1)) is not None
    assert h.subscribe(hello(rank=2)) is None               # bound reached
    a2 = h.subscribe(hello(rank=0))                         # the same rank again: replaces, not refused
    assert a2 is not None and a.queue.get_nowait() is None  # the old stream is told to end
    assert h.subscribers("j") == [0, 1]


def test_a_command_reaches_a_collector_through_the_real_stream(tmp_path):
    """Real gRPC server and client in this process: Subscribe -> arm -> window at the iteration -> Report."""
    h = ControlHub(ControlConfig(directory=str(tmp_path / "dd"), lead_iterations=2, lead_s=0.0))
    servicer = ControlServicer(h)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4), handlers=[servicer.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    target = f"127.0.0.1:{port}"
    from test_deep_dive_window import FakeProfiler
    res = Resource(job_id="j", rank=0, world_size=1)
    window = DeepDiveWindow(str(tmp_path / "dd"), res.to_pb(), lambda r: client.report(r),
                            profiler_factory=lambda ws: FakeProfiler(ws))
    client = ControlClient(target, lambda: res, window, security=ClientSecurity()).start()
    try:
        deadline = time.monotonic() + 10
        while not h.subscribers("j") and time.monotonic() < deadline:
            time.sleep(0.05)
        h.observe(marks("j", 0, range(10)))
        (ack,) = request_all([target], control_pb2.DeepDiveRequest(job_id="j", iterations=2),
                             security=ClientSecurity())
        assert ack.accepted and ack.start_iteration == 11
        # each wait on its own condition and deadline (a loaded machine delays the arm command; the
        # batches must not run before the window is armed, or the dive waits for iterations that passed)
        deadline = time.monotonic() + 30
        while not window.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert window.busy, "the arm command never reached the collector"
        for it in range(10, 16):
            window.before_batch(it)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = deep_dive_status(target, "j", ack.dive_id, security=ClientSecurity())
            if st.dives and st.dives[0].complete:
                break
            time.sleep(0.05)
        (rec,) = st.dives
        assert len(rec.reports) == 1, (window.stats, str(rec))   # the collector's counters say why not
        (rep,) = rec.reports
        assert rep.outcome == O.DEEP_DIVE_OUTCOME_DONE and (rep.first_iteration, rep.last_iteration) == (11, 12)
        assert os.path.exists(rep.trace_path)
    finally:
        client.stop(1.0)
        servicer.close()
        server.stop(0)


def test_the_processor_summarizes_each_trace_in_columns_0600_and_only_inside_the_dive(tmp_path):
    h, _ = hub(tmp_path)
    h.subscribe(hello(rank=0))
    h.subscribe(hello(rank=1))
    h.observe(marks("j", 0, range(30)))
    a = h.request(control_pb2.DeepDiveRequest(job_id="j", iterations=2))
    trace = os.path.join(a.directory, "rank-0.json")
    ev = [{"ph": "X", "name": f"ProfilerStep#{i}", "cat": "user_annotation", "dur": 5.0} for i in (40, 41)]
    ev += [{"ph": "X", "name": "aten::mm", "cat": "cpu_op", "dur": 2.0}] * 3 + [{"ph": "i", "name": "x"}]
    with open(trace, "w") as f:
        json.dump({"traceEvents": ev}, f)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"traceEvents": ev}))
    for rank, path in ((0, trace), (1, str(outside))):
        h.report(control_pb2.DeepDiveReport(resource=Resource(job_id="j", rank=rank, world_size=2).to_pb(),
                                            dive_id=a.dive_id, outcome=O.DEEP_DIVE_OUTCOME_DONE, trace_path=path))
    assert h.wait_summaries(10)
    man = json.load(open(os.path.join(a.directory, "manifest.json")))
    out = man["ranks"]["0"]["summary"]
    assert out == os.path.join(a.directory, "rank-0.summary.json")
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    s = json.load(open(out))
    assert s["iterations"] == [40, 41] and s["count"][s["name"].index("aten::mm")] == 3
    assert man["ranks"]["1"]["summary"] == "" and h.stats["summaries_refused"] == 1   # not its file to read


def test_summary_is_bounded(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": f"f{i}", "cat": "cpu_op", "dur": i}
                                             for i in range(100)]}))
    s = summarize_trace(str(p), limit=10)
    assert len(s["name"]) == 10 and s["name"][0] == "f99" and s["rows_total"] == 100
