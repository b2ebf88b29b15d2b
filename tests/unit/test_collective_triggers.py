"""Mycroft's triggers on the processor's collective records (processor/collectives.py steps 4-6, §4.3).

Records are generated like the collector's: each step every rank computes (noisy), enters the group's
collectives (a bunch of ``per_step`` back to back, FSDP-like), each ends ``transfer`` after the last member
entered; the ranks ship every second. The processor's clock is a fake advanced one second per batch round.
"""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.analyzer.collectives import CollectiveState, CollectivesConfig
from trainscope.processor.collectives import (CollectiveWindowConfig, CollectiveWindows, TriggerConfig, Triggers,
                                              sample, validate)
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2, telemetry_pb2

MS = 1_000_000
S = 1_000_000_000
T0 = 1_700_000_000 * S


class Job:
    """A simulated job: ``steps(seconds)`` yields, per second, each rank's CollectiveBatch."""

    def __init__(self, ranks=8, step_ms=250.0, per_step=4, transfer_ms=2.0, noise=0.3, seed=0) -> None:
        self.ranks, self.step_ms, self.per_step, self.transfer_ms = ranks, step_ms, per_step, transfer_ms
        self.noise, self.rng = noise, np.random.default_rng(seed)
        self.t, self.seq, self.step = T0, 0, 0
        self.slow_compute_from = self.slow_transfer_from = self.late_from = 10**9
        self.compute_x = self.transfer_x = 1.0
        self.late_rank, self.late_ms = -1, 0.0
        self.hang_rank, self.hang_from = -1, 10**9

    def run(self, seconds: int, cw: CollectiveWindows, clock: list, metrics: SelfMetrics) -> None:
        for _ in range(seconds):
            recs = {r: [] for r in range(self.ranks)}
            end_of_second = self.t + S
            hung = False
            while self.t < end_of_second:
                step_s = self.t
                if self.step >= self.hang_from:
                    hung = True
                    break
                x = self.compute_x if self.step >= self.slow_compute_from else 1.0
                # compute: lognormal noise, and a 3x hiccup (GC, data loader) on 2 % of steps
                base = self.step_ms * x * self.rng.lognormal(0, self.noise) * (3 if self.rng.random() < 0.02 else 1)
                enter = {r: step_s + int(base * MS + self.rng.uniform(0, 1) * MS) for r in range(self.ranks)}
                if self.step >= self.late_from:
                    enter[self.late_rank] += int(self.late_ms * MS)
                tx = self.transfer_x if self.step >= self.slow_transfer_from else 1.0
                t = max(enter.values())
                for k in range(self.per_step):
                    self.seq += 1
                    end = t + int(self.transfer_ms * tx * self.rng.lognormal(0, 0.2) * MS)
                    for r in range(self.ranks):
                        enq = enter[r] if k == 0 else t
                        recs[r].append(telemetry_pb2.CollectiveRecord(
                            group=0, seq=self.seq, op="allgather", bytes=1 << 20, dtype="float32", enqueue_ns=enq,
                            start_ns=enq, end_ns=end, iteration=self.step))
                    t = end
                self.t = t
                self.step += 1
            if hung:   # the hung rank never enters seq+1; the others report it in flight every second
                self.t = end_of_second
                for r in range(self.ranks):
                    if r != self.hang_rank:
                        recs[r].append(telemetry_pb2.CollectiveRecord(
                            group=0, seq=self.seq + 1, op="allgather", bytes=1 << 20, dtype="float32",
                            enqueue_ns=self.hang_t0, start_ns=self.hang_t0, end_ns=0, iteration=self.step))
            for r in range(self.ranks):
                if hung and r == self.hang_rank:
                    continue   # it ships nothing (blocked before the collective, no completion)
                b = telemetry_pb2.CollectiveBatch(
                    groups=[telemetry_pb2.CollectiveGroup(id="0", members=range(self.ranks))],
                    records=recs[r], now_ns=self.t)
                if not b.records:
                    continue
                payload, _, _ = validate(b, self.ranks, 2**63, metrics)
                cw.add(Resource(job_id="j", rank=r, world_size=self.ranks), payload)
            clock[0] += 1.0
            cw.tick()

    def hang(self, rank: int) -> None:
        self.hang_rank, self.hang_from, self.hang_t0 = rank, self.step, self.t + int(self.step_ms * MS)


def processor(**trigger):
    clock = [0.0]
    out = []
    m = SelfMetrics()
    cw = CollectiveWindows(CollectiveWindowConfig(length_s=2.0, trigger=TriggerConfig(**trigger)), out.append, m,
                           clock=lambda: clock[0])
    return cw, out, clock, m


def fired(cw, kind=None):
    return [t for t in cw.triggers.recent if kind is None or t.kind == kind]


def test_sample_is_at_most_k_evenly_spaced_members():
    assert sample((3, 1, 2, 0), 10) == {0, 1, 2, 3}
    s = sample(tuple(range(64)), 10)
    assert len(s) == 10 and min(s) == 0 and max(s) >= 57
    assert sample(tuple(range(64)), 10) == s    # the same members on every call


@pytest.mark.parametrize("seed", [0, 1])
def test_a_healthy_noisy_job_fires_nothing(seed):
    """Lognormal compute noise (sigma 0.3), 3x hiccups on 2 % of steps, bunched collectives: 300 s of 4 ranks.
    (Measured once over 4 x 15 min of 8 ranks: the worst evaluation was 1.31x its baseline, against a trigger
    at 2x.)"""
    cw, out, clock, m = processor()
    Job(ranks=4, seed=seed).run(300, cw, clock, m)
    assert fired(cw) == [] and m.get("collective_triggers") == 0
    assert len(cw.triggers._series) == 4 and all(len(s.base_iv) == 30 for s in cw.triggers._series.values())


def test_the_interval_doubling_fires_a_straggler_trigger_on_the_group_and_not_before():
    cw, out, clock, m = processor()
    job = Job()
    job.run(120, cw, clock, m)
    assert fired(cw) == []
    job.slow_compute_from, job.compute_x = job.step, 2.5     # every step 2.5x slower from here
    change = job.t
    job.run(30, cw, clock, m)
    (t, *more) = fired(cw, "straggler")
    assert t.group == "0" and t.job_id == "j" and t.members == tuple(range(8))
    assert t.detail["interval_ms"] >= 2 * t.detail["usual_interval_ms"]
    assert t.at_ns > change                   # not before the change (ranks' clock)
    assert (t.at_ns - change) / S <= 15       # and within about a horizon (10 s) and a window (2 s) of it
    assert m.get("collective_triggers", kind="straggler") == len(fired(cw, "straggler"))
    times = [x.at_ns for x in [t, *more]]
    assert all(b - a >= 30 * S for a, b in zip(times, times[1:]))   # one per group and hot period (30 s)


def test_the_collectives_throughput_halving_fires_even_when_the_interval_barely_moves():
    """Transfers 4x slower (2 -> 8 ms of a 250 ms step): the interval grows by ~10 %, the throughput falls 4x."""
    cw, out, clock, m = processor()
    job = Job(ranks=4, noise=0.1)
    job.run(90, cw, clock, m)
    job.slow_transfer_from, job.transfer_x = job.step, 4.0
    job.run(30, cw, clock, m)
    (t, *_) = fired(cw, "straggler")
    assert t.detail["throughput_Bps"] * 2 <= t.detail["usual_throughput_Bps"]
    assert t.detail["interval_ms"] < 2 * t.detail["usual_interval_ms"]


def test_a_lasting_change_is_relearned():
    cw, out, clock, m = processor(relearn_evals=5, hot_s=4.0)
    job = Job(ranks=4, noise=0.1)
    job.run(90, cw, clock, m)
    job.slow_compute_from, job.compute_x = job.step, 2.5
    change = job.t
    job.run(150, cw, clock, m)
    late = [t for t in fired(cw) if (t.at_ns - change) / S > 60]
    assert fired(cw) and late == []            # fired at the change, quiet once the new pace is the baseline


def test_triggered_mode_keeps_summaries_only_when_healthy():
    cw, out, clock, m = processor(raw_records="triggered")
    Job().run(60, cw, clock, m)
    assert out and all(len(o.collectives.records) == 0 for o in out)
    assert all(len(o.collectives.stats) > 0 for o in out if o.collectives.window.end_ns)
    assert m.get("collective_raw_records", fate="summarised") > 0
    assert m.get("collective_raw_records", fate="kept") == m.get("collective_raw_records", fate="pulled") == 0


def test_always_mode_keeps_every_record():
    cw, out, clock, m = processor()
    Job().run(20, cw, clock, m)
    n = sum(len(o.collectives.records) for o in out)
    assert n > 0 and m.get("collective_raw_records", fate="kept") == n


def test_a_hang_trigger_pulls_every_member_and_the_analyzer_names_the_rank_that_never_entered():
    """Triggered mode end to end: the hung rank's last records come from the pull (its ring), the others'
    state records from the hot group; the analyzer's hang rule names rank 5."""
    cw, out, clock, m = processor(raw_records="triggered", hang_s=5.0)
    job = Job()
    job.run(30, cw, clock, m)
    assert fired(cw) == [] and sum(len(o.collectives.records) for o in out) == 0
    pulled, on_trigger = [], cw._on_trigger

    def spy(t):
        n = len(out)
        on_trigger(t)
        pulled.extend(out[n:])

    cw._on_trigger = spy
    job.hang(5)
    job.run(25, cw, clock, m)
    cw.flush()
    hangs = fired(cw, "hang")
    assert len(hangs) == 1 and hangs[0].group == "0" and hangs[0].detail["seq"] == job.seq + 1
    assert hangs[0].rank != 5 and hangs[0].detail["in_flight_s"] >= 5.0
    assert {o.collectives.resource.rank for o in pulled} == set(range(8))   # every member's ring, the hung one too
    assert all(not o.collectives.stats for o in pulled)                     # summaries went out already
    hung = [o for o in pulled if o.collectives.resource.rank == 5]
    assert max(r.seq for o in hung for r in o.collectives.records) == job.seq   # its last completed collective
    assert m.get("collective_raw_records", fate="pulled") == sum(len(o.collectives.records) for o in pulled)
    state = CollectiveState(CollectivesConfig(hang_timeout_s=15.0))
    for o in out:
        state.absorb(o.collectives.resource.rank, o.collectives)
    (f,) = state.hangs("j", out[-1].collectives.window)
    assert f.suspects[0].rank == 5 and f.evidence["seq"] == job.seq + 1
    assert sorted(f.evidence["waiting_ranks"]) == [0, 1, 2, 3, 4, 6, 7]


def test_a_late_rank_triggers_and_the_records_kept_name_it():
    """Rank 2 enters 400 ms late every step from second 60: every member's interval more than doubles
    (they wait for it), the group turns hot, and the late-start rule names rank 2 from the kept records."""
    cw, out, clock, m = processor(raw_records="triggered")
    job = Job(noise=0.1, per_step=1)   # one collective per step: the late rank is last to each of them
    job.run(60, cw, clock, m)
    first = job.step
    job.late_from, job.late_rank, job.late_ms = first, 2, 400.0
    job.run(20, cw, clock, m)
    cw.flush()
    assert fired(cw, "straggler") and fired(cw, "hang") == []
    kept = [o for o in out if o.collectives.records]
    assert kept and m.get("collective_raw_records", fate="kept") > 0
    state = CollectiveState()
    for o in out:
        state.absorb(o.collectives.resource.rank, o.collectives)
    # judged as the analyzer does, per iteration window: here the iterations since the fault (the pull
    # brought the 10 s before it too, which the analyzer judged with their own window)
    found = state.late_starts("j", records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, first_iteration=first,
                                                      last_iteration=job.step))
    culprits = {s.rank for f in found if f.kind == "late_start" for s in f.suspects}
    assert culprits == {2}


def test_triggers_are_bounded_and_forget_finished_ranks_and_quiet_rings():
    tr = Triggers(TriggerConfig(max_groups=2), SelfMetrics())
    for gid in ("a", "b", "c"):
        g = telemetry_pb2.CollectiveGroup(id=gid, members=[0, 1])
        assert tr.sampled("j", gid, g.members, 0)
        tr.observe("j", 0, g, telemetry_pb2.CollectiveRecord(seq=1, enqueue_ns=1, end_ns=2), 3)
    assert set(tr._samples) == {("j", "b"), ("j", "c")} and set(tr._series) == {("j", "b", 0), ("j", "c", 0)}
    assert tr._by_rank[("j", 0)] == ["b", "c"]            # the oldest group was forgotten, with its series

    cw, out, clock, m = processor(raw_records="triggered")
    Job().run(10, cw, clock, m)
    assert len(cw.triggers._series) == 8 and len(cw._rings) == 8
    for r in range(4):
        cw.finish_rank(Resource(job_id="j", rank=r, world_size=8))
    assert len(cw.triggers._series) == 4 and len(cw._rings) == 4
    clock[0] += 2.0 * (5 + 2)                              # the other ranks went quiet (killed: no final)
    cw.tick()
    assert cw._rings == {} and m.get("collective_raw_records", fate="summarised") > 0
    for r in range(4, 8):
        cw.finish_rank(Resource(job_id="j", rank=r, world_size=8))
    assert cw.triggers._series == {} and cw.triggers._samples == {}


def test_trigger_config_validation():
    for bad in ({"raw_records": "sometimes"}, {"slow_factor": 1.0}, {"sample_ranks": 0}, {"hang_s": 0},
                {"lookback_windows": 0}):
        with pytest.raises(ConfigError):
            TriggerConfig(**bad)
    assert isinstance(Triggers(TriggerConfig(), SelfMetrics()).recent.maxlen, int)
