"""Hostile input against a real processor on 127.0.0.1:0 (issue #11 item 1).

Each test sends what killed or poisoned the processor before (timestamps near
2**64, counts past 2**32, a world of 2**32-1, a seq of 2**64-1, one batch an
hour ahead, huge names and stacks) and asserts three things: the reason the
collector sees, that the daemon goes on serving good batches, and what was
counted.
"""
import logging

import numpy as np
import pytest

from support.pipeline import batch, bus_records, kernel_count, raw_stream, start_processor
from trainscope.processor.limits import IngestLimits, RateLimitedLog
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.v1 import telemetry_pb2

RES = Resource(job_id="job", rank=1, world_size=4, pid=42)
S = 10**9


def cols(n, start=0, dur=1000, name="gemm"):
    return KernelColumns.build([name], np.arange(n) * 10_000 + start, [dur] * n, [0] * n, [7] * n)


@pytest.fixture
def proc():
    p = start_processor()
    yield p
    p.stop()


def still_serves(proc, res=RES, seq=10**6 // 2, start=100 * S, n=20) -> None:
    """A good batch after the hostile ones is accepted and reaches the windows."""
    before = kernel_count(proc) if proc.drain(10) else -1
    s = raw_stream(proc.address, [batch(res, seq, cols(n, start=start))])
    assert s.batches_accepted == 1, dict(s.rejected_by_reason)
    assert proc.drain(10)
    assert kernel_count(proc) == before + n


def test_timestamps_near_2_64_are_refused_and_the_pipeline_lives(proc):
    huge = KernelColumns.build(["gemm"], [2**64 - 10, 2**63, 5 * S], [1000, 1000, 1000], [0] * 3, [7] * 3)
    s = raw_stream(proc.address, [batch(RES, 1, huge)])
    assert s.batches_accepted == 1 and s.records_accepted == 1
    assert proc.metrics.get("records_rejected", reason="timestamp") == 2
    all_bad = KernelColumns.build(["gemm"], [2**64 - 10], [1000], [0], [7])
    s = raw_stream(proc.address, [batch(RES, 2, all_bad)])
    assert dict(s.rejected_by_reason) == {"timestamp": 1}
    it = telemetry_pb2.IterationBatch(marks=[telemetry_pb2.IterationMark(iteration=1, start_ns=2**63,
                                                                          end_ns=2**63 + 5)])
    s = raw_stream(proc.address, [batch(RES, 3, iterations=it)])
    assert dict(s.rejected_by_reason) == {"empty": 1}
    assert proc.metrics.get("records_rejected", reason="timestamp") == 4
    still_serves(proc, seq=4)


def test_stack_counts_past_2_32_are_refused_and_sums_saturate(proc):
    big = telemetry_pb2.StackBatch(snapshots=[telemetry_pb2.StackSnapshot(
        window_start_ns=S, window_end_ns=2 * S, samples=2**32 - 1,
        stacks=[telemetry_pb2.FoldedStack(stack="a;b", count=2**32 - 1)])])
    s = raw_stream(proc.address, [batch(RES, 1, stacks=big)])
    assert dict(s.rejected_by_reason) == {"empty": 1}
    assert proc.metrics.get("records_rejected", reason="samples") == 1
    # many snapshots whose counts are each within the limit, summed past 2**32 in one window
    snaps = [telemetry_pb2.StackSnapshot(window_start_ns=S + i, window_end_ns=S + i + 1, samples=9_000_000,
                                         stacks=[telemetry_pb2.FoldedStack(stack="a;b", count=9_000_000)])
             for i in range(600)]
    s = raw_stream(proc.address, [batch(RES, 2, stacks=telemetry_pb2.StackBatch(snapshots=snaps))])
    assert s.batches_accepted == 1
    still_serves(proc, seq=3)
    out = bus_records(proc, "stacks")
    assert out and out[0].stacks[0].count == 2**32 - 1 and out[0].samples == 2**32 - 1


@pytest.mark.parametrize("rank,world,reason", [
    (2**31 - 1, 2**32 - 1, "world_size"), (0, 0, "world_size"), (4, 4, "unknown_rank"),
])
def test_rank_and_world_are_bounded(proc, rank, world, reason):
    s = raw_stream(proc.address, [batch(Resource(job_id="job", rank=rank, world_size=world), 1, cols(5))])
    assert dict(s.rejected_by_reason) == {reason: 1}
    assert proc.metrics.get("batches_rejected", reason=reason) == 1
    still_serves(proc, seq=1)


def test_a_poisoned_seq_does_not_swallow_the_real_senders_batches(proc):
    good = [batch(RES, i, cols(10, start=i * S)) for i in range(1, 51)]
    poison = batch(RES, 2**64 - 1, cols(10, start=0))
    s = raw_stream(proc.address, [good[0], poison] + good[1:])
    assert s.batches_accepted == 50, dict(s.rejected_by_reason)
    assert dict(s.rejected_by_reason) == {"seq_jump": 1}
    # a poisoned seq as a stream's *first* batch: the real sender's seq 1 is far behind it,
    # which is a restarted sequence, not a duplicate
    other = Resource(job_id="job", rank=2, world_size=4, pid=7)
    s = raw_stream(proc.address, [batch(other, 2**64 - 1, cols(5))] +
                   [batch(other, i, cols(10, start=i * S)) for i in range(1, 11)])
    assert s.batches_accepted == 11
    # re-sent batches are still dropped once
    s = raw_stream(proc.address, [batch(other, 10, cols(10, start=10 * S))])
    assert dict(s.rejected_by_reason) == {"duplicate": 1}


def test_bad_seqs_interleaved_with_good_batches_hide_none_of_them(proc):
    """Audit: one batch with seq 1000 after seq 1 made 49 of 49 real batches "duplicates". Now only
    the same bytes are a duplicate: a forged seq (within the gap, or the real sender's very next
    one, or a bit-flipped copy's) takes nothing from the real sender, whose resends still drop once."""
    good = [batch(RES, i, cols(10, start=i * S)) for i in range(1, 51)]

    def bad(seq):  # valid, and in the past: it moves no clock and stores no kernel
        ph = telemetry_pb2.PhaseBatch(phases=[telemetry_pb2.PhaseTiming(name="x", start_ns=S // 2, duration_ns=1)])
        return batch(RES, seq, phases=ph)

    msgs, bads = [good[0]], []
    for i, g in enumerate(good[1:], start=2):
        bads += [bad(1000), bad(i), bad(i ^ (1 << (i % 7)))]
        msgs += bads[-3:] + [g]
    s = raw_stream(proc.address, msgs)
    # the bad batches' own repeats (bad(1000) each time...) are the only duplicates
    assert dict(s.rejected_by_reason) == {"duplicate": len(bads) - len(set(bads))}
    assert s.batches_accepted == 50 + len(set(bads))
    assert proc.drain(10)
    assert kernel_count(proc) == 500
    again = raw_stream(proc.address, good)
    assert dict(again.rejected_by_reason) == {"duplicate": 50}


def test_one_batch_an_hour_ahead_is_refused_and_later_events_are_not_late(proc):
    msgs = [batch(RES, i, cols(10, start=i * S)) for i in range(1, 21)]
    msgs.insert(5, batch(RES, 100, cols(10, start=3600 * S)))
    s = raw_stream(proc.address, msgs)
    assert dict(s.rejected_by_reason) == {"clock_jump": 1}
    assert s.batches_accepted == 20
    assert proc.drain(10)
    assert kernel_count(proc) == 200
    assert proc.metrics.get("drops", where="late") == 0


def test_a_ranks_first_batch_an_hour_ahead_of_the_wall_clock_is_refused():
    """Audit: a rank's *first* batch dated an hour ahead (nothing to compare with yet) made 160 of 190
    later events late. A live rank's first batch is held to the processor's wall clock."""
    import time
    now = time.time_ns() // S * S
    p = start_processor()
    try:
        msgs = [batch(RES, 1, cols(10, start=now + 3600 * S))]
        msgs += [batch(RES, i, cols(10, start=now + i * S)) for i in range(2, 21)]
        s = raw_stream(p.address, msgs)
        assert dict(s.rejected_by_reason) == {"clock_jump": 1} and s.batches_accepted == 19
        assert p.drain(10)
        assert kernel_count(p) == 190 and p.metrics.get("drops", where="late") == 0
    finally:
        p.stop()


def test_replayed_traces_keep_their_own_clocks():
    """``replay``'s processor (``live_clock=False``): trace time is not this host's clock."""
    import time
    p = start_processor(limits=IngestLimits(live_clock=False))
    try:
        s = raw_stream(p.address, [batch(RES, 1, cols(10, start=time.time_ns() + 10 * 86400 * S))])
        assert s.batches_accepted == 1
    finally:
        p.stop()


def test_a_new_pid_of_a_rank_is_held_to_that_ranks_clock(proc):
    """Audit: the clock was kept per (job, rank, pid) while windows are per (job, rank): a new pid's
    batch an hour ahead made 130 of 150 later events late."""
    s = raw_stream(proc.address, [batch(RES, i, cols(10, start=i * S)) for i in range(1, 6)])
    assert s.batches_accepted == 5
    other_pid = Resource(job_id="job", rank=1, world_size=4, pid=9999)
    s = raw_stream(proc.address, [batch(other_pid, 1, cols(10, start=3600 * S))])
    assert dict(s.rejected_by_reason) == {"clock_jump": 1}
    s = raw_stream(proc.address, [batch(RES, i, cols(10, start=i * S)) for i in range(6, 21)])
    assert s.batches_accepted == 15
    assert proc.drain(10)
    assert kernel_count(proc) == 200 and proc.metrics.get("drops", where="late") == 0
    # the same rank restarted under a new pid, on time, is taken
    s = raw_stream(proc.address, [batch(other_pid, 1, cols(10, start=30 * S))])
    assert s.batches_accepted == 1


def test_a_clock_that_really_jumped_is_rebased_after_consecutive_batches(proc):
    lim = IngestLimits()
    first = [batch(RES, 1, cols(10, start=S))]
    jumped = [batch(RES, 1 + i, cols(10, start=7200 * S + i * S)) for i in range(1, 6)]
    s = raw_stream(proc.address, first + jumped)
    assert s.rejected_by_reason["clock_jump"] == lim.clock_reset_after - 1
    assert s.batches_accepted == 1 + 5 - (lim.clock_reset_after - 1)
    assert proc.metrics.get("clock_rebased") == 1


def test_long_names_and_stacks_are_truncated_and_counted(proc):
    lim = IngestLimits()
    long_name = "k" * (1 << 20)
    s = raw_stream(proc.address, [batch(RES, 1, cols(5, start=S, name=long_name))])
    assert s.batches_accepted == 1
    assert proc.metrics.get("records_truncated", what="kernel_name") == 1
    stack = ";".join(f"frame{i}" for i in range(200_000)) + ";leaf_wait"
    st = telemetry_pb2.StackBatch(snapshots=[telemetry_pb2.StackSnapshot(
        window_start_ns=S, window_end_ns=2 * S, samples=10,
        stacks=[telemetry_pb2.FoldedStack(stack=stack, count=10)])])
    s = raw_stream(proc.address, [batch(RES, 2, stacks=st)])
    assert s.batches_accepted == 1
    assert proc.metrics.get("records_truncated", what="stack") == 1
    assert proc.drain(10)
    k = bus_records(proc, "kernels")
    assert all(len(ks.kernel) <= lim.max_name_chars for kw in k for ks in kw.kernels)
    stacks = bus_records(proc, "stacks")
    assert stacks[0].stacks[0].stack.endswith(";leaf_wait")
    assert len(stacks[0].stacks[0].stack) == lim.max_stack_chars


def test_a_string_table_over_the_limit_is_refused(proc):
    names = [f"k{i}" for i in range(IngestLimits().max_names_per_batch + 1)]
    k = KernelColumns.build(names, [S], [1000], [0], [7])
    s = raw_stream(proc.address, [batch(RES, 1, k)])
    assert dict(s.rejected_by_reason) == {"names": 1}
    still_serves(proc, seq=2)


def test_flipped_bits_never_reach_the_windows_as_garbage(proc):
    """Every single-bit flip of a good batch is either refused or decodes to values within the limits."""
    good = batch(RES, 1, cols(20, start=S))
    rng = np.random.default_rng(0)
    msgs = []
    for i, bit in enumerate(rng.choice(len(good) * 8, 300, replace=False)):
        b = bytearray(good)
        b[bit // 8] ^= 1 << (bit % 8)
        msgs.append(bytes(b))
    s = raw_stream(proc.address, msgs)
    assert s.batches_accepted + s.batches_rejected == 300
    assert proc.drain(10)
    lim = IngestLimits()
    for kw in bus_records(proc, "kernels"):
        assert kw.resource.world_size <= lim.max_world_size and kw.resource.rank < kw.resource.world_size
        for ks in kw.kernels:
            for c in ks.clusters:
                assert 0 < c.max_ns <= 24 * 3600 * S
    still_serves(proc, res=Resource(job_id="fresh", rank=0, world_size=1), seq=1)


def test_rejections_are_logged_at_warning_with_a_rate_limit(proc, caplog):
    with caplog.at_level(logging.WARNING, logger="trainscope.processor.ingest"):
        raw_stream(proc.address, [b"\xff garbage"] * 30)  # 32 in a row would end the stream
    lines = [r for r in caplog.records if "rejected batch" in r.getMessage()]
    assert len(lines) == 1 and "malformed" in lines[0].getMessage()
    assert proc.metrics.get("batches_rejected", reason="malformed") == 30


def test_rate_limited_log_counts_what_it_held_back(caplog):
    t = [0.0]
    rl = RateLimitedLog(logging.getLogger("x"), 10.0, clock=lambda: t[0])
    with caplog.at_level(logging.WARNING, logger="x"):
        assert rl.warning("a", "bad %s", 1)
        assert not rl.warning("a", "bad %s", 2) and not rl.warning("a", "bad %s", 3)
        assert rl.warning("b", "other")
        t[0] = 11.0
        assert rl.warning("a", "bad %s", 4)
    assert [r.getMessage() for r in caplog.records] == [
        "bad 1", "other", "bad 4 (and 2 more like it held back)"]


def test_limits_are_validated():
    with pytest.raises(ConfigError, match="max_world_size"):
        IngestLimits(max_world_size=0)
    with pytest.raises(ConfigError, match="max_timestamp_ns"):
        IngestLimits(max_timestamp_ns=2**64)
