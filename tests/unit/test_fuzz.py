"""Fuzz tier (issue #11): hypothesis over the ingest batch and the replay format.

Bounded: a fixed number of examples and a per-example deadline, so the tier adds
seconds to the default run. What must hold for *any* input: ingest either raises
``BadInput`` (counted, the daemon goes on) or returns values inside the limits;
replay either raises ``TraceFileError`` or returns a trace whose columns hold.
"""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from trainscope.collector.sources.replay import load_rank_trace
from trainscope.processor.ingest import MAX_RECORD_NS, Validator
from trainscope.processor.limits import IngestLimits
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import BadInput, TraceFileError
from trainscope.proto.model import Resource
from trainscope.proto.v1 import telemetry_pb2

FUZZ = settings(max_examples=300, deadline=500, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
U64 = st.integers(0, 2**64 - 1)


def good_batch(n=8) -> bytes:
    k = KernelColumns.build(["gemm", "nccl"], np.arange(n) * 1000 + 10**9, [500] * n, [0, 1] * (n // 2), [7] * n)
    return telemetry_pb2.TelemetryBatch(resource=Resource(job_id="j", rank=1, world_size=4).to_pb(), seq=1,
                                        kernels=k.to_pb()).SerializeToString()


def check_decoded(d, lim: IngestLimits) -> None:
    assert 0 <= d.resource.rank < d.resource.world_size <= lim.max_world_size
    if d.signal == "kernels":
        c = d.payload
        assert len(c) and int(c.name_id.max()) < len(c.names)
        assert int(c.duration_ns.min()) > 0 and int(c.duration_ns.max()) <= MAX_RECORD_NS
        assert int((c.start_ns + c.duration_ns).max()) <= lim.max_timestamp_ns
        assert all(len(n) <= lim.max_name_chars for n in c.names)


@FUZZ
@given(st.data())
def test_any_mutation_of_a_batch_is_rejected_or_within_limits(data):
    raw = bytearray(good_batch())
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        i = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and raw:
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del raw[i:]
        else:
            raw[i:i] = data.draw(st.binary(max_size=16))
    v, lim = Validator(SelfMetrics()), IngestLimits()
    try:
        d = v.decode(bytes(raw))
    except BadInput as e:
        assert e.reason
        return
    check_decoded(d, lim)


@FUZZ
@given(rank=st.integers(0, 2**31 - 1), world=st.integers(0, 2**31 - 1), seq=U64,
       starts=st.lists(U64, min_size=1, max_size=8), durs=st.lists(U64, min_size=1, max_size=8),
       name=st.text(max_size=50))
def test_any_field_values_are_rejected_or_within_limits(rank, world, seq, starts, durs, name):
    n = min(len(starts), len(durs))
    k = KernelColumns.build([name], starts[:n], durs[:n], [0] * n, [0] * n)
    raw = telemetry_pb2.TelemetryBatch(resource=Resource(job_id="j", rank=rank, world_size=world).to_pb(),
                                       seq=seq, kernels=k.to_pb()).SerializeToString()
    try:
        d = Validator(SelfMetrics()).decode(raw)
    except BadInput:
        return
    check_decoded(d, IngestLimits())


JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30))
EVENT = st.fixed_dictionaries(
    {"ph": st.sampled_from(["X", "B", "i", 3]), "cat": st.sampled_from(["kernel", "gpu_memcpy", "user_annotation",
                                                                        "gpu_user_annotation", "cpu_op", None]),
     "name": st.one_of(st.sampled_from(["gemm", "ProfilerStep#1", "ProfilerStep#x", "forward"]), JSON_SCALAR),
     "ts": JSON_SCALAR, "dur": JSON_SCALAR},
    optional={"args": st.dictionaries(st.sampled_from(["stream", "device"]), JSON_SCALAR, max_size=2)})


@settings(max_examples=200, deadline=1000, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(st.one_of(EVENT, JSON_SCALAR), max_size=30))
def test_any_trace_events_load_or_fail_with_one_clear_error(tmp_path_factory, events):
    p = tmp_path_factory.mktemp("fz") / "rank-0.json"
    p.write_text(json.dumps({"traceEvents": events}, allow_nan=True))
    try:
        t = load_rank_trace(p)
    except TraceFileError:
        return
    k = t.kernels
    assert len(k.start_ns) == len(k.duration_ns) == len(k.name_id)
    if len(k):
        assert int(k.name_id.max()) < len(k.names) and int(k.duration_ns.min()) > 0
    assert all(m.end_ns >= m.start_ns for m in t.iterations)


def _sender_batch(seq: int, start_s: int, name: str = "gemm", pid: int = 42) -> bytes:
    k = KernelColumns.build([name], [start_s * 10**9], [500], [0], [7])
    return telemetry_pb2.TelemetryBatch(resource=Resource(job_id="j", rank=1, world_size=4, pid=pid).to_pb(),
                                        seq=seq, kernels=k.to_pb()).SerializeToString()


class SeqPoisoning(RuleBasedStateMachine):
    """A real sender (seq 1, 2, ... and resends of what it sent) interleaved with bad batches under
    its identity: any seq (past, its next, far ahead, 2**64-1) or a real batch with bits flipped.
    Invariant: every real batch is taken the first time, and every resend is a duplicate."""

    def __init__(self) -> None:
        super().__init__()
        self.v = Validator(SelfMetrics())
        self.sent: list[bytes] = []

    @rule()
    def real(self) -> None:
        raw = _sender_batch(len(self.sent) + 1, 100 + len(self.sent))
        self.v.decode(raw)  # must not raise
        self.sent.append(raw)

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def resend(self, data) -> None:
        raw = data.draw(st.sampled_from(self.sent))
        with pytest.raises(BadInput) as e:
            self.v.decode(raw)
        assert e.value.reason == "duplicate"

    @rule(seq=st.one_of(st.integers(1, 200), U64), start_s=st.integers(0, 200))
    def forged(self, seq, start_s) -> None:
        try:
            self.v.decode(_sender_batch(seq, start_s, name="forged"))
        except BadInput:
            pass

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def flipped(self, data) -> None:
        raw = bytearray(data.draw(st.sampled_from(self.sent)))
        bit = data.draw(st.integers(0, len(raw) * 8 - 1))
        raw[bit // 8] ^= 1 << (bit % 8)
        try:
            self.v.decode(bytes(raw))
        except BadInput:
            pass


SeqPoisoning.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=2000, database=None)
test_no_bad_batch_hides_a_real_one = SeqPoisoning.TestCase
