"""The processor's gRPC ingest on 127.0.0.1:0: bad input is rejected and counted,
the good records in the same stream all arrive, and the daemon keeps serving."""
import grpc
import numpy as np
import pytest

from support.pipeline import batch, kernel_count, raw_stream, start_processor
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource
from trainscope.proto.v1 import telemetry_pb2

RES = Resource(job_id="job", rank=1, world_size=4)
S = 10**9


def cols(n, start=0, dur=1000):
    return KernelColumns.build(["gemm"], np.arange(n) * 10_000 + start, [dur] * n, [0] * n, [7] * n)


@pytest.fixture
def proc():
    p = start_processor()
    yield p
    p.stop()


def test_bad_messages_are_rejected_and_good_ones_in_the_same_stream_survive(proc):
    ragged = telemetry_pb2.TelemetryBatch(resource=RES.to_pb(), seq=3, kernels=cols(5).to_pb())
    ragged.kernels.stream = b"\x07\x00\x00\x00"
    msgs = [
        batch(RES, 1, cols(100)),
        b"\xff\xfe not a protobuf \x00",                                   # malformed
        ragged.SerializeToString(),                                        # column lengths differ
        batch(Resource(job_id="job", rank=9, world_size=4), 4, cols(10)),  # unknown rank
        batch(Resource(job_id="", rank=0, world_size=4), 5, cols(10)),     # no job
        telemetry_pb2.TelemetryBatch(resource=RES.to_pb(), seq=6).SerializeToString(),  # empty
        batch(RES, 1, cols(100)),                                          # duplicate of seq 1
        batch(RES, 7, cols(50, start=5 * S)),
    ]
    s = raw_stream(proc.address, msgs)
    assert s.batches_accepted == 2 and s.records_accepted == 150
    assert dict(s.rejected_by_reason) == {"malformed": 1, "column_length": 1, "unknown_rank": 1,
                                          "resource": 1, "empty": 1, "duplicate": 1}
    assert proc.drain(10)
    assert kernel_count(proc) == 150
    assert proc.metrics.get("batches_rejected", reason="malformed") == 1


def test_zero_and_absurd_durations_are_removed_and_the_rest_kept(proc):
    k = KernelColumns.build(["gemm"], [1, 2, 3, 4], [1000, 0, 2**63, 500], [0] * 4, [7] * 4)
    s = raw_stream(proc.address, [batch(RES, 1, k)])
    assert s.records_accepted == 2
    assert proc.metrics.get("records_rejected", reason="duration") == 2
    proc.drain(10)
    assert kernel_count(proc) == 2


def test_bad_phase_and_iteration_records_are_counted(proc):
    phases = telemetry_pb2.PhaseBatch(phases=[
        telemetry_pb2.PhaseTiming(name="forward", start_ns=1, duration_ns=100),
        telemetry_pb2.PhaseTiming(name="", start_ns=1, duration_ns=100),
        telemetry_pb2.PhaseTiming(name="backward", start_ns=1, duration_ns=0)])
    marks = telemetry_pb2.IterationBatch(marks=[
        telemetry_pb2.IterationMark(iteration=1, start_ns=10, end_ns=5),
        telemetry_pb2.IterationMark(iteration=2, start_ns=10, end_ns=50)])
    s = raw_stream(proc.address, [batch(RES, 1, phases=phases), batch(RES, 2, iterations=marks)])
    assert s.records_accepted == 2
    assert proc.metrics.get("records_rejected", reason="phase_name") == 1
    assert proc.metrics.get("records_rejected", reason="duration") == 2


def test_oversize_message_gets_resource_exhausted_and_daemon_keeps_serving():
    p = start_processor(max_message_bytes=64 * 1024)
    try:
        with pytest.raises(grpc.RpcError) as e:
            raw_stream(p.address, [batch(RES, 1, cols(100)), batch(RES, 2, cols(20_000))])
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        s = raw_stream(p.address, [batch(RES, 3, cols(10, start=S))])
        assert s.batches_accepted == 1
        p.drain(10)
        assert kernel_count(p) == 110   # the good batch before the oversize one was kept
    finally:
        p.stop()


def test_unix_socket_listener(tmp_path):
    p = start_processor(listen=f"unix://{tmp_path}/p.sock")
    try:
        assert raw_stream(p.address, [batch(RES, 1, cols(3))]).batches_accepted == 1
    finally:
        p.stop()


def test_unknown_fields_from_a_newer_collector_are_ignored_not_rejected(proc):
    # field 99 (varint 7) appended to a valid batch: what a newer wire version could send
    raw = batch(RES, 1, cols(10)) + bytes([0x98, 0x06, 0x07])
    s = raw_stream(proc.address, [raw])
    assert s.batches_accepted == 1 and s.records_accepted == 10


def test_each_sender_identity_decodes_to_its_own_resource():
    """The validator builds a sender's Resource once and reuses it: a second process of the
    same rank (another pid) or another rank must still get its own, and every batch the
    one its bytes name."""
    from trainscope.processor.ingest import Validator
    from trainscope.processor.selfmetrics import SelfMetrics

    v = Validator(SelfMetrics())
    a = Resource(job_id="job", rank=1, world_size=4, pid=11)
    b = Resource(job_id="job", rank=1, world_size=4, pid=12)
    c = Resource(job_id="job", rank=2, world_size=4, pid=11)
    got = [v.decode(batch(r, seq, cols(3, start=seq * 100_000))).resource
           for seq, r in enumerate((a, b, a, c, b), start=1)]
    assert got == [a, b, a, c, b]
    assert got[0] is got[2]  # built once per identity
