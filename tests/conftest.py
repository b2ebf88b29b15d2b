"""Test tiers (STYLE.md point 7, after confluent-kafka-python):

* ``tests/unit``: no processes, no sockets beyond in-process gRPC on port 0.
* ``tests/integration``: real servers on 127.0.0.1 (gRPC processor, the Tansu
  Kafka-protocol broker or ``KAFKA_BOOTSTRAP``, Prometheus); each fixture
  starts what it needs and always stops it.
* ``tests/benchmarks``: scripts that print figures; not collected by default.

Every collected test carries one tier marker, set here from where it lives
(issue #23): ``unit`` (tests/unit), ``fuzz`` (tests/unit/test_fuzz.py),
``integration`` (tests/integration) and ``realjob`` (the integration files in
``REALJOB_FILES``, which run real multi-process PyTorch jobs). The README's
test command runs them all; ``-m "not realjob"`` is the fast local run.
"""
import os
import resource
import time
from pathlib import Path

import pytest

pytest_plugins = [
    "support.kafka_broker",
    "support.prometheus_server",
]

#: Integration files that start real torchrun / multi-process gloo jobs (the suite's slowest tier).
REALJOB_FILES = frozenset({
    "test_collective_rca.py", "test_collective_sources.py", "test_cpu_source_fork.py", "test_deep_dive.py",
    "test_deep_dive_faults.py", "test_deep_dive_objects.py", "test_deep_dive_trigger.py",
    "test_torch_job.py", "test_torch_job_launch.py",
})
# A test elsewhere that runs a real job carries ``@pytest.mark.realjob`` itself (the README's torchrun command):
# the rest of its file stays off the real-job worker.


@pytest.hookimpl(tryfirst=True)      # before pytest-xdist's own hook, which reads xdist_group into the nodeid
def pytest_collection_modifyitems(config, items):
    """Tier markers, and how pytest-xdist (``tests/run.sh``: ``--dist loadgroup --no-loadscope-reorder``)
    lays the suite out: the real-job files are one scope (their jobs one at a time on one worker, beside
    the other workers' tests: each job shares the machine with other tests as a job shares a host, never
    with a second job) and come first, as the longest; every other integration file is a scope of its own,
    so its module fixtures (nine 32-rank simulations through Kafka, a real job's records) run once, not
    once per worker that got one of its tests; unit tests are scopes of one test each and fill in last."""
    realjob, integration, unit = [], [], []
    for item in items:
        path = Path(str(item.fspath))
        tier = path.parent.name
        if tier == "unit":
            item.add_marker(pytest.mark.fuzz if path.name == "test_fuzz.py" else pytest.mark.unit)
            unit.append(item)
        elif tier == "integration":
            item.add_marker(pytest.mark.integration)
            if path.name in REALJOB_FILES or item.get_closest_marker("realjob") is not None:
                item.add_marker(pytest.mark.realjob)
                item.add_marker(pytest.mark.xdist_group("realjob"))
                realjob.append(item)
            else:
                item.add_marker(pytest.mark.xdist_group(path.stem))
                integration.append(item)
        else:
            unit.append(item)
    items[:] = realjob + integration + unit


#: ``TRAINSCOPE_TEST_TIMELINE=FILE``: each test's worker, start and end (epoch seconds) and CPU seconds (this
#: process and the child processes it reaped meanwhile) appended to FILE, one tab-separated line a test: how
#: pytest-xdist laid the suite out over its workers and where the machine's CPU went (issue #23).
_TIMELINE = os.environ.get("TRAINSCOPE_TEST_TIMELINE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _TIMELINE:
        yield
        return
    start, cpu = time.time(), _cpu_s()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(_TIMELINE, "a") as f:
        f.write(f"{worker}\t{start:.2f}\t{time.time():.2f}\t{_cpu_s() - cpu:.2f}\t{item.nodeid}\n")


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
