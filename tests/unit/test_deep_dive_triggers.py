"""Deep-dive triggers (analyzer/triggers.py, EROICA §4.1): degradation, stall, verdict, gates, metrics."""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.analyzer.triggers import DeepDiveTriggers, TriggerConfig
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import control_pb2, records_pb2


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def verdict(i, step_s, state="healthy", ranks=(), partial=False, job="j"):
    v = records_pb2.Verdict(job_id=job, window=records_pb2.Window(index=i), step_s=step_s, state=state,
                            partial=partial)
    for rank, role in ranks:
        v.ranks.add(rank=rank, role=role)
    return v


def feed(t, steps, **kw):
    fired = []
    for i, s in enumerate(steps):
        fired += t.observe(verdict(i, s, **kw))
    return fired


def test_healthy_noise_never_fires():
    rng = np.random.default_rng(7)
    t = DeepDiveTriggers(TriggerConfig())
    steps = 0.1 * (1 + rng.uniform(-0.02, 0.02, 2000))   # +-2 % around the pace, 2,000 windows
    assert feed(t, steps) == []
    assert t.counts == {}


def test_one_slow_window_is_not_a_degradation():
    t = DeepDiveTriggers(TriggerConfig())
    assert feed(t, [0.1] * 10 + [0.2] + [0.1] * 10 + [0.12, 0.12] + [0.1] * 5) == []


def test_sustained_degradation_fires_once_with_the_numbers():
    t = DeepDiveTriggers(TriggerConfig(sustain_windows=3), clock=Clock())
    fired = feed(t, [0.100] * 10 + [0.106] * 6)
    (d,) = fired
    assert d.trigger == "degradation" and d.window == 12   # the third degraded window
    assert "6.0 %" in d.reason and "100.0 ms" in d.reason
    assert t.counts[("degradation", "fired")] == 1
    assert t.counts[("degradation", "busy")] == 1          # the next 3 degraded windows: suppressed
    assert t.counts[("degradation", "disabled")] == 0       # observe() alone sends nothing


def test_below_the_threshold_is_not_degraded():
    t = DeepDiveTriggers(TriggerConfig())
    assert feed(t, [0.100] * 10 + [0.104] * 50) == []      # +4 % < 5 %


def test_partial_windows_and_warmup_are_not_judged():
    t = DeepDiveTriggers(TriggerConfig(min_windows=5))
    assert feed(t, [0.2, 0.2, 0.1, 0.3]) == []             # under min_windows
    t2 = DeepDiveTriggers(TriggerConfig())
    assert feed(t2, [0.1] * 10) == []
    assert feed(t2, [0.5] * 5, partial=True) == []


def test_stall_fires_on_the_first_stalled_verdict_only():
    t = DeepDiveTriggers(TriggerConfig(busy_s=0, cooldown_s=0), clock=Clock())
    assert t.observe(verdict(1, 0.1)) == []
    (d,) = t.observe(verdict(2, 0.0, state="stalled", ranks=[(3, "culprit")]))
    assert d.trigger == "stall" and d.suspects == (3,)
    assert t.observe(verdict(3, 0.0, state="stalled", ranks=[(3, "culprit")])) == []


def test_verdict_naming_a_culprit_fires_a_waiter_alone_does_not():
    t = DeepDiveTriggers(TriggerConfig(), clock=Clock())
    assert t.observe(verdict(1, 0.1, state="degraded", ranks=[(2, "waiter")])) == []
    (d,) = t.observe(verdict(2, 0.1, state="degraded", ranks=[(5, "culprit"), (2, "waiter")]))
    assert d.trigger == "verdict" and d.suspects == (5,) and "5" in d.reason
    assert t.observe(verdict(3, 0.1, state="degraded", ranks=[(5, "culprit")])) == []   # still the same verdict


def test_cooldown_then_fires_again_and_jobs_are_separate():
    clock = Clock()
    t = DeepDiveTriggers(TriggerConfig(busy_s=10, cooldown_s=100), clock=clock)
    assert len(t.observe(verdict(1, 0.1, state="stalled"))) == 1
    assert len(t.observe(verdict(1, 0.1, state="stalled", job="other"))) == 1   # another job: its own gate
    t.observe(verdict(2, 0.1))
    clock.t = 50
    assert t.observe(verdict(3, 0.1, state="stalled")) == []
    assert t.counts[("stall", "cooldown")] == 1
    t.observe(verdict(4, 0.1))
    clock.t = 101
    assert len(t.observe(verdict(5, 0.1, state="stalled"))) == 1


def test_publish_sends_one_request_on_its_thread_and_counts_the_outcome():
    sent = []

    def sender(req):
        sent.append(req)
        return [control_pb2.DeepDiveAck(accepted=True, dive_id="x", start_iteration=9, iterations=5)]

    t = DeepDiveTriggers(TriggerConfig(iterations=7), sender=sender)
    t.publish([], verdict(1, 0.1, state="stalled"))
    t.close()
    (req,) = sent
    assert req.job_id == "j" and req.trigger == "stall" and req.iterations == 7 and "window 1" in req.reason
    assert t.counts[("stall", "sent")] == 1

    def down(req):
        raise OSError("connection refused")

    t2 = DeepDiveTriggers(TriggerConfig(), sender=down)
    t2.publish([], verdict(1, 0.1, state="stalled"))
    t2.close()
    assert t2.counts[("stall", "unreachable")] == 1
    t3 = DeepDiveTriggers(TriggerConfig(), sender=lambda r: [control_pb2.DeepDiveAck(accepted=False, detail="no")])
    t3.publish([], verdict(1, 0.1, state="stalled"))
    t3.close()
    assert t3.counts[("stall", "refused")] == 1
    t4 = DeepDiveTriggers(TriggerConfig())                  # no control path configured
    t4.publish([], verdict(1, 0.1, state="stalled"))
    assert t4.counts[("stall", "disabled")] == 1


def test_decisions_are_prometheus_counters():
    t = DeepDiveTriggers(TriggerConfig())
    t.publish([], verdict(1, 0.1, state="stalled"))
    (fam,) = list(t.collect())
    got = {(s.labels["trigger"], s.labels["decision"]): s.value for s in fam.samples if s.name.endswith("_total")}
    assert fam.name == "trainscope_deep_dive_triggers"
    assert got == {("stall", "fired"): 1.0, ("stall", "disabled"): 1.0}


@pytest.mark.parametrize("kw", [dict(degradation=0), dict(sustain_windows=0), dict(sustain_windows=40),
                                dict(cooldown_s=-1)])
def test_bad_config_is_a_config_error(kw):
    with pytest.raises(ConfigError):
        TriggerConfig(**kw)
