"""Replay source: real Kineto traces, bad input, replay directories."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

from trainscope.collector.sources import KernelSource, ReplayKernelSource
from trainscope.collector.sources.replay import load_rank_trace
from trainscope.collector.sources.replay_dir import ReplayTopology, resource_for, scan_replay_dir
from trainscope.proto.columnar import KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET
from trainscope.proto.errors import ConfigError, TraceFileError
from trainscope.proto.v1.telemetry_pb2 import PHASE_CLOCK_CPU, PHASE_CLOCK_CUDA_EVENT

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"
REAL = sorted(SHARED.glob("*.json.gz")) if SHARED.is_dir() else []
needs_real = pytest.mark.skipif(not REAL, reason=f"real Kineto traces not found under {SHARED}")
GPU_CATS = {"kernel": KIND_KERNEL, "gpu_memcpy": KIND_MEMCPY, "gpu_memset": KIND_MEMSET}


# ------------------------------------------------------------------ helpers


def write_trace(path: Path, events: list, info: dict | None = None, *, gz: bool | None = None) -> Path:
    doc = {"schemaVersion": 1, "traceEvents": events}
    if info is not None:
        doc = {"schemaVersion": 1, "distributedInfo": info, "traceEvents": events}
    data = json.dumps(doc).encode()  # allow_nan: NaN literals, as buggy exporters write them
    if gz if gz is not None else path.name.endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def kernel(ts, dur, name="gemm", cat="kernel", stream=7, ph="X", device=0):
    ev = {"ph": ph, "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts,
          "args": {"device": device, "stream": stream}}
    if dur is not None:
        ev["dur"] = dur
    return ev


def span(name, ts, dur, cat="user_annotation", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur}


# ------------------------------------------------------------- real traces


@pytest.fixture(scope="module", params=REAL, ids=[p.name for p in REAL])
def real(request):
    """(raw document parsed independently with json, loaded RankTrace)."""
    raw = json.loads(gzip.decompress(request.param.read_bytes()))
    return raw, load_rank_trace(request.param)


@needs_real
def test_real_kernel_rows_match_gpu_events(real):
    raw, trace = real
    gpu = [e for e in raw["traceEvents"] if e.get("cat") in GPU_CATS]
    assert len(trace.kernels) == len(gpu) > 0
    for cat, kind in GPU_CATS.items():
        assert int((trace.kernels.kind == kind).sum()) == sum(e["cat"] == cat for e in gpu)
    assert np.all(np.diff(trace.kernels.start_ns.astype(np.int64)) >= 0)
    # Same multiset of (start, duration, name) as the file, in ns.
    want = sorted((round(e["ts"] * 1000), round(e["dur"] * 1000), e["name"]) for e in gpu)
    names = trace.kernels.names
    got = sorted(zip(trace.kernels.start_ns.tolist(), trace.kernels.duration_ns.tolist(),
                     (names[i] for i in trace.kernels.name_id.tolist())))
    assert [g[2] for g in got] == [w[2] for w in want]
    assert max(abs(g[0] - w[0]) + abs(g[1] - w[1]) for g, w in zip(got, want)) <= 1
    assert set(trace.kernels.stream.tolist()) == {e["args"]["stream"] for e in gpu}
    assert trace.kernels.device == gpu[0]["args"]["device"]
    assert trace.skipped == {}


@needs_real
def test_real_kernel_rows_fast_path_equals_the_event_loop(real):
    """``_kernel_rows`` on a real trace's kernels: its comprehension fast path (every event well formed)
    gives the same columns as its per-event loop, which one odd event sends it to."""
    from collections import Counter

    from trainscope.collector.sources.replay import KERNEL_CATS, _kernel_rows

    raw, _ = real
    kev = [e for e in raw["traceEvents"] if isinstance(e, dict) and e.get("cat") in KERNEL_CATS]
    kinds = [KERNEL_CATS[e["cat"]] for e in kev]
    fast_skipped, slow_skipped = Counter(), Counter()
    fast = _kernel_rows(kev, kinds, fast_skipped)
    odd = {"ph": "X", "cat": "kernel", "name": "odd", "ts": "not a number", "dur": 1, "args": {}}
    slow = _kernel_rows(kev + [odd], kinds + [KIND_KERNEL], slow_skipped)
    assert fast_skipped == Counter() and slow_skipped == Counter({"kernel:bad_timestamp": 1})
    assert fast[0] == slow[0] and fast[6] == slow[6]                      # names, device
    for a, b in zip(fast[1:6], slow[1:6]):                                 # start, dur, name ids, streams, kinds
        assert np.array_equal(np.asarray(a), np.asarray(b))


@needs_real
def test_real_rank_and_iterations(real):
    raw, trace = real
    info = raw["distributedInfo"]
    assert (trace.rank, trace.world_size, trace.rank_source) == (info["rank"], info["world_size"], "distributedInfo")
    steps = sorted(
        (int(e["name"].split("#")[1]), round(e["ts"] * 1000), round(e["ts"] * 1000) + round(e["dur"] * 1000))
        for e in raw["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")
    )
    got = [(m.iteration, m.start_ns, m.end_ns) for m in trace.iterations]
    assert [g[0] for g in got] == [s[0] for s in steps]
    assert all(abs(g[1] - s[1]) <= 1 and abs(g[2] - s[2]) <= 1 for g, s in zip(got, steps))


@needs_real
def test_real_phases(real):
    raw, trace = real
    events = raw["traceEvents"]
    gpu_ann = [e for e in events if e.get("cat") == "gpu_user_annotation"]
    numbers = {m.iteration for m in trace.iterations}
    assert trace.phases and {p.iteration for p in trace.phases} <= numbers
    if gpu_ann:
        assert len(trace.phases) == len(gpu_ann)
        assert {p.clock for p in trace.phases} == {PHASE_CLOCK_CUDA_EVENT}
        assert {p.stream for p in trace.phases} == {e["tid"] for e in gpu_ann}
    else:
        cpu = [e for e in events if e.get("cat") == "user_annotation"
               and not e["name"].startswith("ProfilerStep#")]
        assert len(trace.phases) == len(cpu)
        assert {p.clock for p in trace.phases} == {PHASE_CLOCK_CPU}
    assert not any(p.name.startswith("ProfilerStep#") for p in trace.phases)


@needs_real
def test_job2_has_gpu_phases_in_its_three_steps():
    trace = load_rank_trace(SHARED / "job2-rank0-nccl.json.gz")
    assert len(trace.phases) == 30
    assert {p.clock for p in trace.phases} == {PHASE_CLOCK_CUDA_EVENT}
    per_iter = {n: sorted(p.name for p in trace.phases if p.iteration == n) for n in (4, 5, 6)}
    assert all(names.count("## backward ##") == 1 for names in per_iter.values()), per_iter


# --------------------------------------------------------------- bad input


def test_bad_durations_are_counted_and_good_events_survive(tmp_path):
    events = [
        kernel(100, 5, name="good_a"),
        kernel(110, float("nan"), name="nan"),
        kernel(120, -3, name="neg"),
        kernel(125, -0.0001, name="tiny_neg"),
        kernel(-5, 1, name="neg_ts"),
        kernel(130, 0, name="zero"),
        kernel(140, None, name="missing"),
        kernel(150, 0.0001, name="rounds_to_zero"),
        kernel(160, 2, name="begin", ph="B"),
        kernel("oops", 2, name="bad_ts"),
        "not an event",
        kernel(105, 1.5, name="Memcpy HtoD", cat="gpu_memcpy"),
        kernel(200, 2, name="Memset", cat="gpu_memset", stream=9),
        kernel(90.25, 4, name="good_b"),
    ]
    trace = load_rank_trace(write_trace(tmp_path / "rank-0.json", events))
    names = [trace.kernels.names[i] for i in trace.kernels.name_id.tolist()]
    assert names == ["good_b", "good_a", "Memcpy HtoD", "Memset"]
    assert trace.kernels.start_ns.tolist() == [90250, 100000, 105000, 200000]
    assert trace.kernels.duration_ns.tolist() == [4000, 5000, 1500, 2000]
    assert trace.kernels.kind.tolist() == [KIND_KERNEL, KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET]
    assert trace.kernels.stream.tolist() == [7, 7, 7, 9]
    assert trace.skipped == {
        "kernel:nan_duration": 1, "kernel:negative_duration": 2, "kernel:negative_timestamp": 1, "kernel:zero_duration": 2,
        "kernel:missing_duration": 1, "kernel:not_complete_event": 1, "kernel:bad_timestamp": 1,
        "event:not_an_object": 1,
    }


def test_float_timestamps_keep_their_digits(tmp_path):
    big = 1661203463029566  # epoch microseconds: ns exceed float64's exact range
    events = [kernel(big, 7), kernel(4458676983543.183, 41.407)]
    trace = load_rank_trace(write_trace(tmp_path / "rank-0.json", events))
    assert trace.kernels.start_ns.tolist() == [4458676983543183, big * 1000]
    assert trace.kernels.duration_ns.tolist() == [41407, 7000]


def test_truncated_gzip(tmp_path):
    good = write_trace(tmp_path / "rank-0.json.gz", [kernel(i, 1) for i in range(2000)])
    bad = tmp_path / "rank-1.json.gz"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert len(load_rank_trace(good).kernels) == 2000
    with pytest.raises(TraceFileError, match="truncated gzip") as e:
        load_rank_trace(bad)
    assert e.value.path == str(bad)


def test_not_json(tmp_path):
    p = tmp_path / "rank-0.json"
    p.write_text('{"traceEvents": [ {"ph": "X", ')
    with pytest.raises(TraceFileError, match="not valid JSON"):
        load_rank_trace(p)
    p.write_text("")
    with pytest.raises(TraceFileError, match="empty file"):
        load_rank_trace(p)


def test_json_without_trace_events(tmp_path):
    p = tmp_path / "rank-0.json"
    p.write_text(json.dumps({"schemaVersion": 1, "events": []}))
    with pytest.raises(TraceFileError, match="traceEvents"):
        load_rank_trace(p)
    p.write_text(json.dumps({"traceEvents": {"not": "a list"}}))
    with pytest.raises(TraceFileError, match="expected a list"):
        load_rank_trace(p)


def test_rank_sources(tmp_path):
    events = [kernel(1, 1)]
    with_info = write_trace(tmp_path / "rank-5.json", events, {"rank": 2, "world_size": 4})
    assert (load_rank_trace(with_info).rank, load_rank_trace(with_info).rank_source) == (2, "distributedInfo")
    by_name = write_trace(tmp_path / "rank-5.json.gz", events)
    t = load_rank_trace(by_name)
    assert (t.rank, t.rank_source, t.world_size) == (5, "filename", None)
    anon = write_trace(tmp_path / "trace.json", events)
    assert load_rank_trace(anon, rank=3).rank == 3
    with pytest.raises(TraceFileError, match="cannot determine the rank"):
        load_rank_trace(anon)
    outside = write_trace(tmp_path / "x.json", events, {"rank": 4, "world_size": 4})
    with pytest.raises(TraceFileError, match="outside"):
        load_rank_trace(outside)


def test_trace_without_kernels_is_valid_but_empty(tmp_path):
    trace = load_rank_trace(write_trace(tmp_path / "rank-0.json", [span("ProfilerStep#3", 0, 10)]))
    assert len(trace.kernels) == 0
    assert [m.iteration for m in trace.iterations] == [3]
    assert trace.phases == ()


def test_phase_iterations_contained_else_nearest(tmp_path):
    events = [
        span("ProfilerStep#7", 100, 100), span("ProfilerStep#8", 300, 100),
        span("fwd", 120, 10, cat="gpu_user_annotation", tid=7),   # inside step 7
        span("bwd", 230, 10, cat="gpu_user_annotation", tid=7),   # gap, nearer 7's end
        span("opt", 290, 5, cat="gpu_user_annotation", tid=7),    # gap, nearer step 8
        span("late", 900, 5, cat="gpu_user_annotation", tid=7),   # after all steps
        span("early", 10, 5, cat="gpu_user_annotation", tid=7),   # before all steps
        span("cpu_only", 150, 5),                                 # ignored: GPU phases exist
        span("ProfilerStep#8", 500, 10),                          # duplicate step number
        span("ProfilerStep#x²", 600, 10),                         # no step number
    ]
    trace = load_rank_trace(write_trace(tmp_path / "rank-0.json", events))
    assert {p.name: p.iteration for p in trace.phases} == {"fwd": 7, "bwd": 7, "opt": 8, "late": 8, "early": 7}
    assert {p.stream for p in trace.phases} == {7}
    assert trace.skipped == {"iteration:duplicate": 1, "iteration:bad_name": 1}
    assert [m.iteration for m in trace.iterations] == [7, 8]


# ------------------------------------------------------- replay directories


def test_scan_dir_with_topology_and_resource(tmp_path):
    for r in range(4):
        write_trace(tmp_path / f"rank-{r}.json.gz", [kernel(r, 1, device=r % 2)], {"rank": r, "world_size": 4})
    (tmp_path / "topology.json").write_text(json.dumps({"world_size": 4, "tp": 2}))
    (tmp_path / "notes.txt").write_text("ignored")
    job = scan_replay_dir(tmp_path)
    assert sorted(job.files) == [0, 1, 2, 3]
    assert (job.topology.world_size, job.topology.tp, job.topology.dp) == (4, 2, 2)
    assert job.job_id == tmp_path.name and job.world_size_source == "topology.json"
    trace = job.load(3)
    res = resource_for(trace, job)
    assert (res.rank, res.world_size, res.job_id, res.device) == (3, 4, tmp_path.name, "cuda:1")
    assert (res.coords.tp, res.coords.dp, res.coords.tp_size, res.coords.dp_size) == (1, 1, 2, 2)


def test_scan_dir_infers_world_size_and_resolves_copied_ranks(tmp_path):
    # Copies of one rank's trace (same distributedInfo.rank): file names decide.
    for r in range(3):
        write_trace(tmp_path / f"rank-{r}.json", [kernel(1, 1)], {"rank": 0, "world_size": 128})
    job = scan_replay_dir(tmp_path)
    assert job.rank_source == "filename" and job.notes
    assert (job.topology.world_size, job.world_size_source) == (128, "distributedInfo")
    assert [t.rank for t in job.load_all()] == [0, 1, 2]


def test_scan_dir_uses_distributed_info_ranks(tmp_path):
    write_trace(tmp_path / "rank-0.json", [kernel(1, 1)], {"rank": 1, "world_size": 2})
    write_trace(tmp_path / "rank-1.json.gz", [kernel(1, 1)], {"rank": 0, "world_size": 2})
    job = scan_replay_dir(tmp_path)
    assert job.files == {1: str(tmp_path / "rank-0.json"), 0: str(tmp_path / "rank-1.json.gz")}
    assert job.load(1).rank == 1


@needs_real
def test_scan_dir_of_real_traces(tmp_path):
    for r, name in enumerate(["job128-rank0.json.gz", "job128-rank1.json.gz"]):
        (tmp_path / f"rank-{r}.json.gz").write_bytes((SHARED / name).read_bytes())
    job = scan_replay_dir(tmp_path)
    assert (job.rank_source, job.topology.world_size) == ("distributedInfo", 128)
    traces = job.load_all()
    assert [len(t.kernels) for t in traces] == [1204, 1154]
    src = ReplayKernelSource(traces[1], chunk=500)
    batches: list = []
    src.start(batches.append)
    assert [len(b) for b in batches] == [500, 500, 154]
    assert np.array_equal(np.concatenate([b.start_ns for b in batches]), traces[1].kernels.start_ns)


def test_scan_dir_errors(tmp_path):
    with pytest.raises(TraceFileError, match="not a directory"):
        scan_replay_dir(tmp_path / "missing")
    with pytest.raises(TraceFileError, match="no rank-"):
        scan_replay_dir(tmp_path)
    write_trace(tmp_path / "rank-1.json", [kernel(1, 1)])
    write_trace(tmp_path / "rank-1.json.gz", [kernel(1, 1)])
    with pytest.raises(TraceFileError, match="rank 1 already comes from"):
        scan_replay_dir(tmp_path)
    (tmp_path / "rank-1.json.gz").unlink()
    write_trace(tmp_path / "rank-9.json", [kernel(1, 1)])
    with pytest.raises(TraceFileError, match="rank 9"):
        scan_replay_dir(tmp_path)  # world size 2 inferred from two files


@pytest.mark.parametrize(
    ("topology", "field"),
    [
        ({"world_size": 4, "tp": "two"}, "topology.tp"),
        ({"world_size": 4, "tp": 3}, "topology.world_size"),
        ({"world_size": 0}, "topology.world_size"),
        ({"world_size": 4, "order": "tp-dp-pp"}, "topology.order"),
        ({"world_size": 4, "tensor_parallel": 2}, "topology.tensor_parallel"),
        ({"world_size": 4, "tp": 2, "dp": 4}, "topology.dp"),
        ({"world_size": 1}, "topology.world_size"),  # rank 1 does not fit
        ([4, 2], "topology.json"),
        ({"world_size": 4, "ranks_per_nic": 1}, "topology.ranks_per_host"),
        ({"world_size": 4, "ranks_per_host": 4, "ranks_per_nic": 3}, "topology.ranks_per_nic"),
        ({"world_size": 4, "ranks_per_host": 2, "hosts_per_switch": -1}, "topology.hosts_per_switch"),
    ],
)
def test_bad_topology_names_the_field(tmp_path, topology, field):
    write_trace(tmp_path / "rank-0.json", [kernel(1, 1)])
    write_trace(tmp_path / "rank-1.json", [kernel(1, 1)])
    (tmp_path / "topology.json").write_text(json.dumps(topology))
    with pytest.raises(ConfigError) as e:
        scan_replay_dir(tmp_path)
    assert e.value.setting == field


def test_topology_defaults_and_coords(tmp_path):
    p = tmp_path / "topology.json"
    p.write_text(json.dumps({"tp": 2, "pp": 2}))
    topo = ReplayTopology.from_json(p, world_size=8)
    assert (topo.world_size, topo.dp, topo.order) == (8, 2, "tp-cp-ep-dp-pp")
    c = topo.coords(5)  # tp fastest, then dp, then pp
    assert (c.tp, c.dp, c.pp) == (1, 0, 1)
    with pytest.raises(ConfigError, match="missing"):
        ReplayTopology.from_json(p)


def test_topology_names_the_nic_and_switch_a_rank_shares(tmp_path):
    topo = ReplayTopology(world_size=16, tp=2, ranks_per_host=4, ranks_per_nic=2, hosts_per_switch=2)
    assert topo.shared(6) == {"nic": "host1/nic1", "switch": "switch0"}
    assert topo.shared(9) == {"nic": "host2/nic0", "switch": "switch1"}
    assert ReplayTopology(world_size=16, ranks_per_host=4).shared(6) == {}


def test_replay_source_is_a_kernel_source_and_stops(tmp_path):
    trace = load_rank_trace(write_trace(tmp_path / "rank-0.json", [kernel(i, 1) for i in range(10)]))
    src = ReplayKernelSource(trace, chunk=3)
    assert isinstance(src, KernelSource) and src.name == "replay"
    seen: list[int] = []

    def emit(batch):
        seen.append(len(batch))
        src.stop()  # e.g. shutdown from the collector while replaying

    src.start(emit)
    assert seen == [3] and src.emitted == 3
    with pytest.raises(ConfigError):
        ReplayKernelSource(trace, chunk=0)
    assert math.isclose(float(trace.kernels.duration_ns.sum()), 10_000)


def test_kernel_spans_at_once_equal_one_event_at_a_time():
    """``_spans`` converts a trace's kernel spans with numpy when every value is a JSON number below 2**53 µs;
    each event's (start, duration) or reason must be what ``_span_of`` says for it alone: fractions rounded
    to the ns, negative, NaN, infinite, past the int64 bound, zero."""
    import math

    import numpy as np

    from trainscope.collector.sources.replay import _MAX_NS, _span_of, _spans

    rng = np.random.default_rng(7)
    special = [0, 0.0, -0.0, -1e-4, -3, math.nan, math.inf, -math.inf, 0.0005, 0.0015, 2.5e-3, 1.7e15 + 0.123,
               _MAX_NS / 1000, _MAX_NS / 1000 + 1, 2 ** 52, 12, 7.25]
    ts = [float(x) for x in rng.uniform(0, 2e12, 400)] + [int(x) for x in rng.integers(0, 2 ** 40, 100)]
    dur = [float(x) for x in rng.exponential(50.0, 400)] + [int(x) for x in rng.integers(0, 5000, 100)]
    ts += [special[i % len(special)] for i in range(200)]
    dur += [special[(i * 7 + 3) % len(special)] for i in range(200)]
    ph = ["X"] * len(ts)
    start, d, why = _spans(ph, ts, dur)
    for i, (t, u) in enumerate(zip(ts, dur)):
        one = _span_of("X", t, u)
        got = why[i] if why[i] else (int(start[i]), int(d[i]))
        assert got == one, (i, t, u, got, one)
    assert {w for w in why if w} >= {"negative_timestamp", "bad_timestamp", "nan_duration", "negative_duration",
                                      "zero_duration", "bad_duration"}
    # anything else (a string, a null, a phase that is not X) goes one event at a time, same answers
    odd_ts, odd_dur, odd_ph = ts[:50] + ["12.5", None, True], dur[:50] + [3, 4, 5], ph[:50] + ["X", "X", "B"]
    start, d, why = _spans(odd_ph, odd_ts, odd_dur)
    assert [w if w else (int(s), int(x)) for s, x, w in zip(start, d, why)] == \
        [_span_of(p, t, u) for p, t, u in zip(odd_ph, odd_ts, odd_dur)]
