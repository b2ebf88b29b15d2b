"""The processor's deep-dive control counters (``ControlHub.stats``) on its /metrics registry.

A real ``Processor`` object (built, not started: no socket, no process) and its real
``ControlHub``: requests refused and accepted, a subscriber, a report of an unknown dive;
the registry the metrics server serves is scraped with prometheus_client's own text format.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainscope.processor.daemon import Processor, ProcessorConfig
from trainscope.processor.control import ControlConfig
from trainscope.processor.selfmetrics import DEEP_DIVE_EVENTS, deep_dive_control_metrics
from trainscope.proto import contracts
from trainscope.proto.model import Resource
from trainscope.proto.v1 import control_pb2

FAMILY = "trainscope_processor_deep_dive_events"


def events(registry) -> dict[str, float]:
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        if fam.name == FAMILY:
            assert fam.type == "counter"
            return {s.labels["event"]: s.value for s in fam.samples if s.name == FAMILY + "_total"}
    raise AssertionError(f"{FAMILY} not exported")


def test_the_processors_registry_exports_the_control_hubs_counters(tmp_path):
    p = Processor(ProcessorConfig(listen="127.0.0.1:0", store_path=None,
                                  control=ControlConfig(directory=str(tmp_path / "dd"))))
    before = events(p.registry)
    assert set(before) >= set(DEEP_DIVE_EVENTS) and not any(before.values())   # all there, at 0
    hub = p.control
    assert not hub.request(control_pb2.DeepDiveRequest(job_id="j")).accepted   # nobody subscribed
    assert not hub.request(control_pb2.DeepDiveRequest(job_id="")).accepted
    hub.subscribe(control_pb2.ControlHello(resource=Resource(job_id="j", rank=0, world_size=1).to_pb(),
                                           protocol=contracts.CONTROL_PROTOCOL, profiler_available=True))
    unknown = control_pb2.DeepDiveReport(dive_id="nope", resource=Resource(job_id="j", rank=0, world_size=1).to_pb())
    assert not hub.report(unknown).ok
    got = events(p.registry)
    assert got["requests_refused"] == 2 and got["subscribed"] == 1 and got["reports_unknown"] == 1
    assert got["requests_accepted"] == 0
    p.stop(0.0)


def test_a_key_the_hub_adds_later_is_exported_and_a_changing_counter_is_read_safely():
    import collections
    stats = collections.Counter()
    reg = CollectorRegistry()
    reg.register(deep_dive_control_metrics(stats))
    stats["stack_dumps"] += 3    # an event this module does not list
    got = events(reg)
    assert got["stack_dumps"] == 3 and got["reports"] == 0
    assert stats == {"stack_dumps": 3}   # read, never written (no key added by the export)
