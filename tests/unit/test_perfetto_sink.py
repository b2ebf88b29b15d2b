"""Perfetto sink: traces that parse, balance, stay monotonic, and are bounded.

Every trace written here is parsed back with the protos shipped by the
``perfetto`` package (``validate_trace``), so the sink's hand-vectorised
wire encoding is held to the real schema.
"""
from __future__ import annotations

import gzip
import json
import os
import threading
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

from trainscope.processor.model import ClosedWindow, WindowOutput
from trainscope.processor.perfetto_check import validate_trace
from trainscope.processor.perfetto_encode import encode_window
from trainscope.processor.perfetto_sink import PerfettoConfig, PerfettoSink, trace_path
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.sink import Sink
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import ParallelCoords, Resource
from trainscope.proto.v1 import records_pb2, telemetry_pb2 as tpb

KINETO = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"
T0 = 1_700_000_000_000_000_000
KINDS = ("kernel", "memcpy", "memset")


def _window(kernels=None, *, phases=(), iterations=(), stacks=(), rank=3, index=7, job="job-a"):
    resource = Resource(job, rank, 8, host="host-1", pid=4242, device="cuda:3",
                        coords=ParallelCoords(dp=1, tp=1, dp_size=2, tp_size=2))
    window = records_pb2.Window(index=index, start_ns=T0, end_ns=T0 + 10**9)
    raw = ClosedWindow(resource, window, kernels if kernels is not None else KernelColumns.empty(),
                       tuple(phases), tuple(iterations), tuple(stacks))
    return WindowOutput(raw=raw)


def _kernels(n, streams=(7, 13, 21), seed=0):
    """Back-to-back kernels per stream with gaps, like CUPTI reports them."""
    rng = np.random.default_rng(seed)
    stream = rng.choice(np.array(streams), n)
    dur = rng.integers(1_000, 60_000, n)
    start = np.zeros(n, np.int64)
    for s in streams:
        m = stream == s
        step = dur[m] + rng.integers(0, 5_000, m.sum())
        start[m] = T0 + np.cumsum(step) - step
    names = [f"void kernel_{i}<float, {i}>(float const*, float*)" for i in range(40)]
    return KernelColumns.build(names, start, dur, rng.integers(0, 40, n), stream, rng.integers(0, 3, n))


def _expected_kernels(k):
    return sorted((int(s), int(d), k.names[i], KINDS[c])
                  for s, d, i, c in zip(k.start_ns, k.duration_ns, k.name_id, k.kind))


def _slices_on(check, kind):
    return [s for s in check.slices if check.tracks[s.track_uuid].split()[0] == kind]


@pytest.fixture
def memory_url():
    root = f"perfetto-test-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


def _read(sink, out):
    return fsspec.filesystem("memory").cat_file(sink.path_for(out))


def test_synthetic_window_round_trips_through_a_directory(tmp_path):
    k = _kernels(3_000)
    phases = [tpb.PhaseTiming(name="forward", start_ns=T0, duration_ns=40_000_000, iteration=11,
                              stream=7, clock=tpb.PHASE_CLOCK_CUDA_EVENT),
              tpb.PhaseTiming(name="dataloader", start_ns=T0, duration_ns=1_000_000, iteration=11,
                              clock=tpb.PHASE_CLOCK_CPU)]
    iters = [tpb.IterationMark(iteration=11, start_ns=T0, end_ns=T0 + 50_000_000)]
    stacks = [tpb.StackSnapshot(window_start_ns=T0, window_end_ns=T0 + 10**8, samples=100, stacks=[
        tpb.FoldedStack(stack="main;train;step", count=70, thread_id=1),
        tpb.FoldedStack(stack="main;dataloader;wait", count=30, thread_id=2, idle=True)])]
    metrics = SelfMetrics()
    sink = PerfettoSink(PerfettoConfig(url=str(tmp_path)), metrics)
    assert isinstance(sink, Sink) and sink.name == "perfetto"
    out = _window(k, phases=phases, iterations=iters, stacks=stacks)
    sink.export(out)
    assert sink.flush(10.0)
    sink.close()

    path = tmp_path / "job-a" / "rank-00003" / "w000000000007.perfetto-trace"
    check = validate_trace(path.read_bytes(), collect_slices=True)
    assert check.ok, check.errors
    assert check.slices_by_kind == {"stream": 3_000, "phases": 2, "iterations": 1, "stacks": 1}
    got = sorted((s.start_ns, s.dur_ns, s.name, s.args["kind"]) for s in _slices_on(check, "stream"))
    assert got == _expected_kernels(k)
    assert {check.tracks[s.track_uuid] for s in _slices_on(check, "stream")} == {
        "stream 7", "stream 13", "stream 21"}
    assert {check.tracks[s.track_uuid] for s in _slices_on(check, "phases")} == {
        "phases gpu stream 7", "phases cpu"}
    process = [n for n in check.tracks.values() if n.startswith("rank 3")]
    assert process and "host-1" in process[0] and "dp=1 tp=1" in process[0]
    (it,) = _slices_on(check, "iterations")
    assert (it.name, it.dur_ns, it.args) == ("iteration 11", 50_000_000, {"iteration": 11})
    (st,) = _slices_on(check, "stacks")
    assert [e["stack"] for e in st.args["stacks"]] == ["main;train;step", "main;dataloader;wait"]
    assert metrics.get("records_out", sink="perfetto", signal="kernels") == 3_000
    assert metrics.get("bytes_out", sink="perfetto", signal="trace") == path.stat().st_size
    assert metrics.get("sink_errors") == metrics.get("drops") == 0
    assert not list(tmp_path.rglob("*.tmp*"))


def _kineto_window(path):
    trace = json.loads(gzip.open(path).read())
    events = trace["traceEvents"]
    kern = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"]
    names = sorted({e["name"] for e in kern})
    ids = {n: i for i, n in enumerate(names)}
    kind = {"kernel": 0, "gpu_memcpy": 1, "gpu_memset": 2}
    k = KernelColumns.build(
        names, [round(e["ts"] * 1000) for e in kern], [round(e["dur"] * 1000) for e in kern],
        [ids[e["name"]] for e in kern], [e["args"].get("stream", e["tid"]) for e in kern],
        [kind[e["cat"]] for e in kern])
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    iters = [tpb.IterationMark(iteration=int(e["name"].split("#")[1]), start_ns=round(e["ts"] * 1000),
                               end_ns=round((e["ts"] + e["dur"]) * 1000)) for e in steps]

    def step_of(ts_ns):
        return next((m.iteration for m in iters if m.start_ns <= ts_ns < m.end_ns), 0)

    phases = [tpb.PhaseTiming(name=e["name"], start_ns=round(e["ts"] * 1000), duration_ns=round(e["dur"] * 1000),
                              iteration=step_of(round(e["ts"] * 1000)), stream=int(e["tid"]),
                              clock=tpb.PHASE_CLOCK_CUDA_EVENT)
              for e in events if e.get("cat") == "gpu_user_annotation"]
    rank = trace.get("distributedInfo", {}).get("rank", 0)
    return _window(k, phases=phases, iterations=iters, rank=rank, job="job2"), len(kern)


def test_real_kineto_trace_to_memory_url(memory_url):
    path = KINETO / "job2-rank0-nccl.json.gz"
    if not path.exists():
        pytest.skip(f"real trace not present: {path}")
    out, n_kernels = _kineto_window(path)
    metrics = SelfMetrics()
    sink = PerfettoSink(PerfettoConfig(url=memory_url), metrics)
    sink.export(out)
    assert sink.flush(10.0)
    assert sink.path_for(out).endswith("job2/rank-00000/w000000000007.perfetto-trace")
    check = validate_trace(_read(sink, out), collect_slices=True)
    assert check.ok, check.errors
    assert check.slices_by_kind["stream"] == n_kernels == len(out.raw.kernels)
    assert check.slices_by_kind["phases"] == len(out.raw.phases)
    assert check.slices_by_kind["iterations"] == len(out.raw.iterations) == 3
    assert set(out.raw.kernels.names) <= set(check.names)
    assert {p.name for p in out.raw.phases} <= set(check.names)
    got = sorted((s.start_ns, s.dur_ns, s.name, s.args["kind"]) for s in _slices_on(check, "stream"))
    assert got == _expected_kernels(out.raw.kernels)
    assert metrics.get("records_out", sink="perfetto", signal="phases") == len(out.raw.phases)
    sink.close()


def test_overlapping_phases_and_kernels_get_extra_lanes():
    ph = [("outer", 0, 100), ("inner", 10, 20), ("twin", 0, 100), ("crossing", 50, 150), ("late", 150, 10),
          ("zero", 100, 0)]
    phases = [tpb.PhaseTiming(name=n, start_ns=T0 + s, duration_ns=d, stream=7, clock=tpb.PHASE_CLOCK_CUDA_EVENT)
              for n, s, d in ph]
    # Kernels that overlap on one stream (e.g. rounded timestamps): the general layout path.
    k = KernelColumns.build(["a", "b", "c"], [T0, T0 + 5, T0 + 8, T0 + 20], [10, 10, 1, 5], [0, 1, 2, 0],
                            [9, 9, 9, 9])
    data, written, dropped = encode_window(_window(k, phases=phases).raw)
    check = validate_trace(data, collect_slices=True)
    assert check.ok, check.errors
    assert (written["phases"], written["kernels"], dropped) == (6, 4, 0)
    by_name = {s.name: s for s in _slices_on(check, "phases")}
    assert set(by_name) == {n for n, _, _ in ph}
    assert by_name["inner"].track_uuid == by_name["outer"].track_uuid
    assert by_name["crossing"].track_uuid != by_name["outer"].track_uuid
    assert check.tracks[by_name["crossing"].track_uuid] == check.tracks[by_name["outer"].track_uuid]
    assert by_name["inner"].depth >= 1 and by_name["twin"].dur_ns == 100
    assert all(by_name[n].dur_ns == d for n, _, d in ph)
    kernels = sorted((s.start_ns - T0, s.dur_ns, s.name) for s in _slices_on(check, "stream"))
    assert kernels == [(0, 10, "a"), (5, 10, "b"), (8, 1, "c"), (20, 5, "a")]
    assert len({s.track_uuid for s in _slices_on(check, "stream")}) == 2


def test_ranks_concatenate_into_one_valid_trace():
    a, _, _ = encode_window(_window(_kernels(200), rank=0).raw)
    b, _, _ = encode_window(_window(_kernels(300, seed=1), rank=1).raw)
    check = validate_trace(a + b)
    assert check.ok, check.errors
    assert check.slices_by_kind["stream"] == 500


def test_empty_window_is_a_valid_trace():
    data, written, dropped = encode_window(_window().raw)
    check = validate_trace(data)
    assert check.ok and not check.slices_by_kind and dropped == 0 and not any(written.values())


class _Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def test_retention_by_size_deletes_the_oldest(memory_url):
    size = len(encode_window(_window(_kernels(500)).raw)[0])
    clock = _Clock(time.time())
    sink = PerfettoSink(PerfettoConfig(url=memory_url, max_bytes=3 * size + size // 2, max_age_s=None,
                                       max_pending_windows=0), clock=clock)
    outs = [_window(_kernels(500), index=i) for i in range(6)]
    for out in outs:
        sink.export(out)
        clock.t += 1.0
    fs, root = fsspec.core.url_to_fs(memory_url)
    kept = sorted(fs.find(root))
    assert kept == sorted(sink.path_for(o) for o in outs[3:])
    assert sum(fs.size(p) for p in kept) <= 3 * size + size // 2


def test_retention_by_age_deletes_old_files_including_earlier_runs(tmp_path):
    old = tmp_path / trace_path("job-a", 3, 1)
    old.parent.mkdir(parents=True)
    old.write_bytes(b"from a previous run")
    now = time.time()
    os.utime(old, (now - 10_000, now - 10_000))
    clock = _Clock(now)
    sink = PerfettoSink(PerfettoConfig(url=f"file://{tmp_path}", max_age_s=250, max_pending_windows=0),
                        clock=clock)
    outs = [_window(_kernels(50), index=i) for i in range(10, 16)]
    for out in outs:
        sink.export(out)
        clock.t += 100.0
    assert not old.exists()
    left = sorted(p.name for p in tmp_path.rglob("*.perfetto-trace"))
    # written at now, +100 .. +500; the last write ran at +500: older than 250 s goes.
    assert left == [Path(sink.path_for(o)).name for o in outs[3:]]


def test_max_events_truncates_and_counts_drops(memory_url):
    metrics = SelfMetrics()
    sink = PerfettoSink(PerfettoConfig(url=memory_url, max_events_per_trace=100, max_pending_windows=0), metrics)
    iters = [tpb.IterationMark(iteration=i, start_ns=T0 + i * 10**6, end_ns=T0 + (i + 1) * 10**6) for i in range(2)]
    k = _kernels(500)
    out = _window(k, iterations=iters)
    sink.export(out)
    check = validate_trace(_read(sink, out), collect_slices=True)
    assert check.ok, check.errors
    assert check.slices_by_kind == {"iterations": 2, "stream": 98}
    assert metrics.get("drops", where="perfetto") == 402
    assert check.instants == 1 and any("402 events dropped" in n for n in check.names)
    kept_starts = sorted(s.start_ns for s in _slices_on(check, "stream"))
    assert kept_starts == sorted(k.start_ns.tolist())[:98]


def test_unwritable_path_counts_errors_and_never_raises(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    metrics = SelfMetrics()
    sink = PerfettoSink(PerfettoConfig(url=str(blocker / "traces")), metrics)
    out = _window(_kernels(100))
    sink.export(out)
    assert sink.flush(10.0)
    sink.close()
    assert metrics.get("sink_errors", sink="perfetto") == 1
    assert metrics.get("drops", where="perfetto") == 100
    assert metrics.get("records_out") == 0


def test_full_queue_drops_the_newest_window(memory_url):
    started, gate = threading.Event(), threading.Event()

    class Gated(PerfettoSink):
        def _write(self, out):
            started.set()
            gate.wait(10.0)
            super()._write(out)

    metrics = SelfMetrics()
    sink = Gated(PerfettoConfig(url=memory_url, max_pending_windows=1), metrics)
    outs = [_window(_kernels(10), index=i) for i in range(3)]
    sink.export(outs[0])
    assert started.wait(10.0)  # the writer holds window 0
    sink.export(outs[1])  # queued
    sink.export(outs[2])  # queue full: dropped
    assert metrics.get("drops", where="perfetto") == 10
    gate.set()
    assert sink.flush(10.0)
    sink.close()
    fs = fsspec.filesystem("memory")
    assert [fs.exists(sink.path_for(o)) for o in outs] == [True, True, False]
    sink.export(outs[2])  # after close: counted, not written
    assert metrics.get("drops", where="perfetto") == 20


@pytest.mark.parametrize("field,kwargs", [
    ("perfetto.url", dict(url="")),
    ("perfetto.url", dict(url="nosuchproto://x")),
    ("perfetto.max_bytes", dict(url="/tmp/x", max_bytes=0)),
    ("perfetto.max_age_s", dict(url="/tmp/x", max_age_s=-1)),
    ("perfetto.max_events_per_trace", dict(url="/tmp/x", max_events_per_trace=0)),
    ("perfetto.max_pending_windows", dict(url="/tmp/x", max_pending_windows=-1)),
])
def test_bad_config_names_the_setting(field, kwargs):
    with pytest.raises(ConfigError) as err:
        PerfettoConfig(**kwargs)
    assert err.value.setting == field


def test_trace_path_is_safe():
    assert trace_path("../../etc", 5, 3) == "_.._etc/rank-00005/w000000000003.perfetto-trace"
    assert trace_path("job/with spaces", 12, 0).startswith("job_with_spaces/rank-00012/")


def test_validator_catches_broken_traces():
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    t = pb.Trace()
    t.packet.add(track_descriptor=pb.TrackDescriptor(uuid=1, name="stream 1"))
    for ts, typ, uuid_ in ((10, 1, 1), (5, 1, 1), (20, 2, 2), (30, 2, 1)):
        p = t.packet.add(timestamp=ts, trusted_packet_sequence_id=1)
        p.track_event.type, p.track_event.track_uuid, p.track_event.name = typ, uuid_, "x"
    check = validate_trace(t.SerializeToString())
    text = "\n".join(check.errors)
    assert not check.ok
    assert "goes back" in text and "undeclared track 2" in text and "never ended" in text
    assert not validate_trace(b"\x0a\xff\xff").ok
