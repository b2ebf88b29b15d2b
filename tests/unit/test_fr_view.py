"""The Flight Recorder view of the stack grid (issue #13 item 3, Mycroft §5): built by the collector from its
own recorder (collector/flight_recorder.view, take_view) and sent with its stack dump (collector/stacks.py),
bounded by the processor (processor/stack_grid.valid_dump) and compared across ranks by the analyzer
(analyzer/stack_grid.flight_recorder) into the stall finding and the culprit's why (analyzer/merge.py).
Dumps are built by hand to torch 2.13's layout (as in test_flight_recorder.py); one test reads the real
recorder of a single-rank gloo group made in this process (no process started). The real 4-rank hang is
tests/integration/test_collective_rca.py."""
from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from test_collectives import W, job_batches, state_of
from test_flight_recorder import dump as fr_dump, entry
from trainscope.analyzer import stack_grid
from trainscope.analyzer.merge import merge
from trainscope.collector import flight_recorder as fr
from trainscope.collector.stacks import StackDumper
from trainscope.processor.collectives import validate
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.stack_grid import valid_dump
from trainscope.proto.model import Resource
from trainscope.proto.v1 import control_pb2, telemetry_pb2

CMD = control_pb2.StackDumpCommand(grid_id="0-hang-13", job_id="j", group="0", trigger="hang", seq=13,
                                   ranks=[0, 1, 2, 3], timeout_s=2.0)


def parsed(entries, status=None):
    return fr.parse(json.dumps(fr_dump(entries, status)).encode())


# ----------------------------------------------------------------- collector
def test_the_view_keeps_per_group_the_newest_seq_and_the_last_entries_as_torch_wrote_them():
    entries = [entry(s, retired=s < 20, sizes=((1000,),)) for s in range(1, 21)]
    entries += [entry(s, "gloo:all_gather", pg=("1", "undefined"), pg_id=1, sizes=((2, 3), (4,)),
                     dtypes=("Float", "Float")) for s in (1, 2)]
    entries.append(entry(0, "gloo:send", p2p=True))
    status = {"0": {"last_enqueued_collective": "20", "last_started_collective": "-1",
                    "last_completed_collective": "19"}}
    g0, g1 = fr.view(parsed(entries, status), entries=4)
    assert (g0.group, g0.desc, g0.newest_seq, g0.last_completed_seq) == ("0", "default_pg", 20, 19)
    assert [e.seq for e in g0.entries] == [17, 18, 19, 20]            # the newest 4, oldest first
    last = g0.entries[-1]
    # torch's state as written (gloo: 'scheduled' even when retired), not the parser's reading of it
    assert (last.op, last.state, last.retired, last.bytes, last.sizes) == ("allreduce", "scheduled", False, 4000,
                                                                           "[1000]")
    assert g0.entries[0].retired and g0.entries[0].created_unix_ns == 10**18 + 17 * 1000
    assert (g1.group, g1.newest_seq, g1.last_completed_seq) == ("1", 2, -1)    # no status for pg 1
    assert g1.entries[-1].op == "allgather" and g1.entries[-1].sizes == "[2,3] [4]"
    assert g1.entries[-1].bytes == (6 + 4) * 4


def test_the_view_is_bounded_and_survives_a_wrapped_ring_and_a_group_made_again():
    status = {"0": {"last_enqueued_collective": 25, "last_started_collective": -1, "last_completed_collective": 24}}
    (g,) = fr.view(parsed([entry(s) for s in (19, 20)], status))
    assert g.newest_seq == 25 and len(g.entries) == 2          # entries 21-25 already left torch's ring
    many = [entry(1, pg=(str(i), "undefined"), pg_id=i, time_created_ns=i) for i in range(40)]
    out = fr.view(parsed(many), groups=3)
    assert [v.group for v in out] == ["37", "38", "39"]        # the most recently active groups, by name
    assert fr.view(parsed(many), entries=0)[0].entries == [] and fr.view(parsed(many), groups=0) == []
    big = entry(1, sizes=tuple((7,) * 10 for _ in range(20)))
    assert len(fr.view(parsed([big]))[0].entries[0].sizes) == fr.MAX_SIZES_CHARS
    # the default group destroyed and made again: same name, new pg_id, seqs from 1 again
    again = [entry(s, pg_id=0) for s in range(1, 31)] + [entry(s, pg_id=2) for s in (1, 2, 3)]
    (g,) = fr.view(parsed(again, {"2": {"last_enqueued_collective": 3, "last_started_collective": -1,
                                        "last_completed_collective": 2}}))
    assert g.newest_seq == 3 and [e.seq for e in g.entries] == [1, 2, 3] and g.last_completed_seq == 2


def test_reading_only_each_groups_newest_entries_gives_the_same_view():
    entries = [entry(s, pg=(str(s % 3), "undefined"), pg_id=s % 3) for s in range(1, 200)]
    entries += [entry(s, pg_id=5) for s in (1, 2)]               # the default group made again
    data = json.dumps(fr_dump(entries)).encode()
    assert fr.view(fr.parse(data, last_per_group=4), entries=4) == fr.view(fr.parse(data), entries=4)
    assert len(fr.parse(data, last_per_group=4).entries) == 4 * 3 + 2
    bad = json.dumps(fr_dump(entries + [entry(300, state="exploded")])).encode()
    with pytest.raises(fr.FlightRecorderError, match="'state' must be one of"):    # still said
        fr.parse(bad, last_per_group=4)


def test_take_view_fails_soft_and_says_why(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert fr.take_view() == ([], "torch is not loaded in this process")
    assert fr.read_view() == fr.FrRead([], "torch is not loaded in this process", "off", 0)


def test_take_view_reads_this_processs_real_recorder():
    """A single-rank gloo group in this process (torch 2.13's recorder holds 2,000 entries by default)."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    assert fr.take_view()[1] == "torch.distributed is not initialised in this process"
    assert fr.read_view().outcome == "off"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(10)
        for _ in range(5):
            dist.all_reduce(t)
        groups, why = fr.take_view(entries=3)
        if not groups and "off" in why:
            pytest.skip(f"the recorder is off in this process: {why}")
        (g,) = groups
        assert (g.group, g.newest_seq, why) == ("0", 5, "") and [e.seq for e in g.entries] == [3, 4, 5]
        assert all(e.op == "allreduce" and e.bytes == 40 and e.sizes == "[10]" for e in g.entries)
        # torch retires a gloo entry from the work's completion callback, which can run just after
        # all_reduce returned (1 read in 6 saw one of the three not yet retired): a stall lasts seconds,
        # so the view may lag by that callback; within 2 s every entry is retired
        deadline = time.monotonic() + 2.0
        while not all(e.retired for e in g.entries) and time.monotonic() < deadline:
            time.sleep(0.01)
            (g,) = groups = fr.take_view(entries=3)[0]
        assert all(e.retired for e in g.entries), g.entries
        # the read's figures for the processor's counters: every entry of torch's dump was read, 3 kept
        r = fr.read_view(entries=3)
        assert (r.outcome, r.why, r.groups) == ("ok", "", groups)
        assert r.entries >= 5      # this process's recorder (other tests' groups may have left entries too)
    finally:
        dist.destroy_process_group()


class Runner:
    def __call__(self, cmd, timeout_s):
        return 0, json.dumps([{"thread_name": "MainThread", "os_thread_id": 1, "active": True,
                               "frames": [{"name": "main", "short_filename": "t.py", "line": 3}]}]), ""


def test_the_dumper_sends_the_view_with_its_stack_dump_from_its_own_thread():
    seen, sent = [], []

    def view():
        seen.append(threading.current_thread().name)
        threading.Event().wait(0.01)
        return fr.FrRead([telemetry_pb2.FlightRecorderGroup(group="0", newest_seq=13)], "", "ok", 64)

    dumper = StackDumper(lambda b, n: sent.append(b) or True, py_spy=__file__, run=Runner(), flight_recorder=view)
    assert dumper.request(CMD)
    for _ in range(500):
        if sent:
            break
        threading.Event().wait(0.01)
    (batch,) = sent
    (d,) = batch.dumps
    assert [g.newest_seq for g in d.flight_recorder] == [13] and not d.flight_recorder_error and len(d.threads) == 1
    assert seen == ["trainscope-stack-dump"] and dumper.stats["fr_views"] == 1    # never the caller's thread
    # how the read went, for the processor's counters: outcome, entries torch's dump held, the read's time
    assert (d.flight_recorder_outcome, d.flight_recorder_entries) == ("ok", 64) and d.flight_recorder_read_s >= 0.01

    def broken():
        raise RuntimeError("boom")

    for source, why, outcome in (
            (lambda: fr.FrRead([], "torch is not loaded in this process", "off"), "torch is not loaded in this process",
             "off"),
            (lambda: fr.FrRead([], "bad dump", "error"), "bad dump", "error"),
            (lambda: fr.FrRead([], "", "ok"), "no Flight Recorder view", "error"),      # 'ok' with no view
            (broken, "Flight Recorder view failed: RuntimeError: boom", "error")):
        d = StackDumper(lambda b, n: True, py_spy=__file__, run=Runner(), flight_recorder=source).dump(CMD)
        assert not d.flight_recorder and d.flight_recorder_error == why and len(d.threads) == 1   # the stack stays
        assert d.flight_recorder_outcome == outcome and d.flight_recorder_entries == 0, why


# ----------------------------------------------------------------- processor
def sd(groups, **kw) -> telemetry_pb2.StackDump:
    fields = dict(grid_id="0-hang-13", group="0", trigger="hang", seq=13, expected_ranks=[0, 1])
    return telemetry_pb2.StackDump(flight_recorder=groups, **{**fields, **kw})


def grp(name="0", newest=13, n=3, **entry_kw):
    e = dict(op="allreduce", state="scheduled", bytes=4, sizes="[1]")
    e.update(entry_kw)
    return telemetry_pb2.FlightRecorderGroup(group=name, newest_seq=newest, last_completed_seq=newest - 1, entries=[
        telemetry_pb2.FlightRecorderEntry(seq=newest - n + 1 + i, **e) for i in range(n)])


def test_the_processor_bounds_the_view_and_drops_a_malformed_one_keeping_the_stack():
    m = SelfMetrics()
    many = sd([grp(str(i)) for i in range(40)])
    long = sd([grp(newest=200, n=100)])
    above = grp()
    above.newest_seq = 10                                       # an entry newer than the group's newest seq
    bad = [sd([grp(state="exploded")]), sd([grp(newest=5, n=3), grp(name="")]), sd([above]),
           sd([grp(op="x" * 100)]), sd([grp(sizes="9" * 1000)])]
    assert all(valid_dump(d, 8, m) for d in (many, long, *bad))          # every dump kept
    assert m.get("records_rejected", reason="stack_dump") == 0
    payload, n, _ = validate(telemetry_pb2.CollectiveBatch(dumps=[many, long]), 8, 2**62, m)   # the ingest path
    d_many, d_long = payload[4]
    d_bad = bad
    assert len(d_many.flight_recorder) == 16 and [g.group for g in d_many.flight_recorder][-1] == "15"
    (g,) = d_long.flight_recorder
    assert len(g.entries) == 32 and g.entries[-1].seq == 200                  # the newest kept
    assert m.get("records_truncated", what="flight_recorder") == 2
    for d in d_bad:
        assert not d.flight_recorder and d.flight_recorder_error.startswith("Flight Recorder view rejected")
    assert m.get("records_rejected", reason="flight_recorder") == 5


def test_the_processor_counts_each_ranks_flight_recorder_read_by_outcome_with_entries_and_time():
    m = SelfMetrics()
    dumps = [sd([grp()], flight_recorder_outcome="ok", flight_recorder_entries=2000, flight_recorder_read_s=0.04),
             sd([grp()], flight_recorder_outcome="ok", flight_recorder_entries=64, flight_recorder_read_s=0.01),
             sd([], flight_recorder_outcome="off", flight_recorder_error="Flight Recorder off (TORCH_FR_BUFFER_SIZE=0)",
                flight_recorder_read_s=0.001),
             sd([], flight_recorder_outcome="error", flight_recorder_error="Flight Recorder dump failed: X"),
             sd([grp(state="exploded")], flight_recorder_outcome="ok", flight_recorder_entries=10),  # rejected here
             sd([], flight_recorder_outcome="ok"),                      # says ok, sent no view
             sd([], flight_recorder_outcome="weird", flight_recorder_read_s=float("nan")),
             sd([grp()]), sd([]),                                       # a collector older than the fields
             sd([], flight_recorder_read_s=1e9)]                        # a read time no clock gives
    assert all(valid_dump(d, 8, m) for d in dumps)
    assert {o: m.get("flight_recorder_views", outcome=o) for o in ("ok", "off", "error")} == \
        {"ok": 3, "off": 3, "error": 4}
    assert [d.flight_recorder_outcome for d in dumps] == ["ok", "ok", "off", "error", "error", "error", "error",
                                                          "ok", "off", "off"]   # what the analyzer reads too
    assert m.get("flight_recorder_entries") == 2000 + 64 + 10
    assert m.get("flight_recorder_read_seconds_sum") == pytest.approx(0.051)
    assert m.get("flight_recorder_read_seconds_max") == pytest.approx(0.04)
    assert m.get("records_rejected", reason="flight_recorder") == 1
    # a dump rejected whole is not counted as a read
    assert not valid_dump(sd([grp()], grid_id="", flight_recorder_outcome="ok"), 8, m)
    assert m.get("flight_recorder_views") == len(dumps)
    # exported like the other self-metrics
    from prometheus_client import CollectorRegistry, generate_latest
    reg = CollectorRegistry()
    reg.register(m)
    text = generate_latest(reg).decode()
    assert 'trainscope_processor_flight_recorder_views_total{outcome="error"} 4.0' in text
    assert "trainscope_processor_flight_recorder_entries_total 2074.0" in text
    assert "trainscope_processor_flight_recorder_read_seconds_max 0.04" in text


# ------------------------------------------------------------------ analyzer
def book_with(views: dict, members=(0, 1, 2, 3)) -> stack_grid.Grid:
    book = stack_grid.GridBook()
    for r, v in views.items():
        d = sd(v if isinstance(v, list) else [], expected_ranks=list(members),
               flight_recorder_error=v if isinstance(v, str) else "")
        d.threads.add(stack="MainThread;main (t.py:1)", count=1, thread_id=1)
        book.absorb(r, [d])
    return book.grids["0-hang-13"]


def hang_view(seq, retired):
    g = grp(newest=seq, n=2)
    g.entries[-1].retired = retired
    return [grp(name="1", newest=40), g]


def test_the_ranks_views_name_who_is_behind_on_the_grids_group():
    g = book_with({0: hang_view(13, False), 1: hang_view(13, False), 2: hang_view(12, True), 3: hang_view(13, False)})
    ev = stack_grid.flight_recorder(g)
    assert ev["summary"] == ("ranks 0,1,3 entered allreduce seq 13 on group 0 (in flight, torch state scheduled); "
                             "rank 2's newest entry is seq 12 (allreduce, completed)")
    assert (ev["seq"], ev["entered"], ev["behind"], ev["missing"]) == (13, [0, 1, 3], [2], [])
    assert {r["rank"]: r["newest_seq"] for r in ev["ranks"]} == {0: 13, 1: 13, 2: 12, 3: 13}
    assert {r["op"] for r in ev["ranks"]} == {"allreduce"} and ev["ranks"][2]["state"] == "completed"
    # two ranks behind at different seqs, lowest first; a rank without a view says why; one not dumped
    g = book_with({0: hang_view(13, False), 1: hang_view(11, True), 2: hang_view(12, True),
                   3: "torch is not loaded in this process"}, members=(0, 1, 2, 3, 4))
    ev = stack_grid.flight_recorder(g, members=(0, 1, 2, 3, 4))
    assert ev["behind"] == [1, 2] and ev["summary"].split("; ")[1:] == [
        "rank 1's newest entry is seq 11 (allreduce, completed)", "rank 2's newest entry is seq 12 (allreduce, completed)",
        "ranks 3,4: no view (torch is not loaded in this process)"]


def test_a_healthy_group_has_nobody_behind_and_no_view_gives_no_line():
    ev = stack_grid.flight_recorder(book_with({r: hang_view(13, True) for r in range(4)}))
    assert ev["behind"] == [] and ev["summary"] == "ranks 0,1,2,3 entered allreduce seq 13 on group 0 (completed)"
    assert stack_grid.flight_recorder(book_with({r: "Flight Recorder off (TORCH_FR_BUFFER_SIZE=0)"
                                                 for r in range(4)})) is None
    other = book_with({0: [grp(name="7")], 1: [grp(name="7")]})      # views of other groups only
    assert stack_grid.flight_recorder(other) is None


def test_the_stall_finding_and_the_culprits_why_carry_the_flight_recorder_line():
    st = state_of(job_batches(steps=30, hang_rank=2, hang_at=12))
    st.late_starts("j", W)
    (f,) = st.hangs("j", W)
    assert f.evidence["seq"] == 13 and "flight_recorder" not in f.evidence
    for r in range(4):
        d = sd(hang_view(12 if r == 2 else 13, r == 2), expected_ranks=[0, 1, 2, 3])
        d.threads.add(stack="MainThread;main (t.py:1)", count=1, thread_id=1)
        st.grids.absorb(r, [d])
    (again,) = st.hangs("j", W)
    line = "ranks 0,1,3 entered allreduce seq 13 on group 0 (in flight, torch state scheduled); rank 2's newest"
    assert again.evidence["flight_recorder"]["summary"].startswith(line)
    assert again.evidence["flight_recorder"]["behind"] == [2]
    v = merge("j", W, [again], {r: Resource(job_id="j", rank=r, world_size=4) for r in range(4)})
    (s,) = [s for s in v.ranks if s.rank == 2]
    assert f"; flight recorder: {line} entry is seq 12" in s.why and s.evidence["flight_recorder"].startswith(line)
    # the stall finding without its grid: no line in anybody's why
    v = merge("j", W, [f], {r: Resource(job_id="j", rank=r, world_size=4) for r in range(4)})
    assert all("flight recorder" not in x.why for x in v.ranks)
