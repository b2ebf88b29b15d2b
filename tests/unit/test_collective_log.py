"""The collector's collective records (collector/collective_log.py, torch_collectives.py, torch_ddp.py).

A one-rank gloo process group in this process (a FileStore in tmp_path): no other process starts.
"""
from __future__ import annotations

import time

import pytest

from trainscope.collector.collective_log import CollectiveLog, CollectiveLogConfig
from trainscope.proto.errors import ConfigError


class Exporter:
    def __init__(self, accept: bool = True) -> None:
        self.accept, self.batches = accept, []

    def submit(self, payload, nbytes, resource=None) -> bool:
        if self.accept:
            self.batches.append(payload() if callable(payload) else payload)
        return self.accept


def records(exp: Exporter):
    return [(b.groups[r.group].id, r.seq, r.op, r.end_ns > 0) for b in exp.batches for r in b.records]


def test_sequence_numbers_per_group_and_state_records_for_collectives_in_flight():
    exp = Exporter()
    log = CollectiveLog(exp.submit, CollectiveLogConfig(interval_s=60, inflight_report_s=0.01))
    a = log.begin("0", (0, 1), "allreduce", 4096, "float32")
    log.end(a)
    b = log.begin("1", (0, 2), "allgather", 64, "float32")
    stuck = log.begin("0", (0, 1), "allreduce", 4096, "float32")
    log.end(b)
    time.sleep(0.02)
    assert log.ship()
    assert sorted(records(exp)) == [("0", 1, "allreduce", True), ("0", 2, "allreduce", False),
                                    ("1", 1, "allgather", True)]
    assert exp.batches[-1].now_ns >= stuck.enqueue_ns
    log.end(stuck)
    exp.batches.clear()
    log.ship()
    assert records(exp) == [("0", 2, "allreduce", True)]   # completed once, no state record any more
    log.stop()


def test_bounded_and_counted_never_raises():
    exp = Exporter(accept=False)
    log = CollectiveLog(exp.submit, CollectiveLogConfig(interval_s=60, max_buffered=2, max_inflight=3))
    ps = [log.begin("0", (0,), "allreduce", 1, "f") for _ in range(5)]   # 2 forgotten beyond max_inflight
    for p in ps:
        log.end(p)
    assert log.stats()["inflight"] == 0
    assert log.recorded == 2 and log.dropped == 2 + 1   # 2 forgotten in flight, 1 beyond max_buffered
    assert log.ship() is False                          # the exporter refused: counted, not raised
    assert log.dropped == 5
    log.end(None)                                       # a failed begin: nothing to end
    log.stop()


def test_config_validation():
    with pytest.raises(ConfigError):
        CollectiveLogConfig(interval_s=0)
    with pytest.raises(ConfigError):
        CollectiveLogConfig(max_buffered=0)


@pytest.fixture
def world1(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from trainscope.collector.torch_hooks import TorchHooks, TorchHooksConfig

    class Collector:
        def __init__(self) -> None:
            self.exporter, self.resource = Exporter(), None

        def record_phase(self, *a, **k) -> None: ...

        def iteration(self, *a, **k) -> None: ...

    c = Collector()
    hooks = TorchHooks(c, TorchHooksConfig(collective_log=CollectiveLogConfig(interval_s=60))).install()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield torch, dist, hooks, c.exporter
    finally:
        dist.destroy_process_group()
        hooks.uninstall()


def test_wrapped_collectives_and_ddp_all_reduces_are_recorded(world1):
    torch, dist, hooks, exp = world1
    t = torch.ones(10)
    dist.all_reduce(t)
    dist.all_reduce(t, async_op=True).wait()
    m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    m(torch.randn(3, 4)).sum().backward()
    hooks.collective_log.ship()
    got = records(exp)
    assert [s for _, s, _, _ in got] == [1, 2, 3] and all(done for *_, done in got)
    assert {op for _, _, op, _ in got} == {"allreduce"}
    assert exp.batches[0].records[0].bytes == 40 and exp.batches[0].records[0].dtype == "float32"
    assert list(exp.batches[0].groups[0].members) == [0]


def test_a_user_hook_registered_later_replaces_the_relay_target(world1):
    torch, dist, hooks, exp = world1
    calls = []

    def user_hook(state, bucket):
        calls.append(state)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    m.register_comm_hook("mine", user_hook)          # DDP allows one hook: ours must step aside, not raise
    m(torch.randn(3, 4)).sum().backward()
    assert calls == ["mine"]
    hooks.collective_log.ship()
    assert records(exp) == []                         # the user's hook issued no collective


def test_fsdp2_entry_points_are_wrapped_and_bytes_are_the_input(world1):
    """FSDP2 calls all_gather_single / reduce_scatter_single (torch 2.13): recorded, bytes of the input."""
    torch, dist, hooks, exp = world1
    if not hasattr(dist, "all_gather_single"):
        pytest.skip("this torch has no all_gather_single")
    out, inp = torch.zeros(8), torch.ones(8)
    dist.all_gather_single(out, inp)
    dist.reduce_scatter_single(torch.zeros(8), torch.ones(8))
    dist.all_gather_into_tensor(out, inp)   # calls all_gather_single inside: recorded once
    hooks.collective_log.ship()
    assert [(s, op) for _, s, op, _ in records(exp)] == [(1, "allgather"), (2, "reducescatter"), (3, "allgather")]


def test_payload_takes_the_input_argument_when_the_output_comes_first():
    torch = pytest.importorskip("torch")
    from trainscope.collector.torch_collectives import _payload

    out, inp = torch.zeros(4, 8), torch.ones(8, dtype=torch.float16)
    assert _payload((out, inp), {}, 1, "input_tensor") == (16, "float16")
    assert _payload((out,), {"input_tensor": inp}, 1, "input_tensor") == (16, "float16")
    assert _payload((out, inp), {}) == (128, "float32")            # no input argument known: the first tensor
    assert _payload(([inp, inp],), {}, 0, "tensor") == (32, "float16")   # a list: summed
