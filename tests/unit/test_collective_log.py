"""The collector's collective records (collector/collective_log.py, torch_collectives.py, torch_ddp.py).

A one-rank gloo process group in this process (a FileStore in tmp_path): no other process starts.
"""
from __future__ import annotations

import os
import time

import numpy as np
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


# ------------------------------------------------ step 4: the NCCL plugin's records joined
class RingFile:
    """A hand-made plugin ring in a 0600 file (the layout of collector/nccl_profiler.py): no plugin,
    no process; the C plugin itself is exercised in tests/integration/test_nccl_plugin.py."""

    COMM = 0xC0FFEE

    def __init__(self, path, capacity: int = 64) -> None:
        from trainscope.collector import nccl_profiler as nc
        self.nc, self.path, self.capacity = nc, str(path), capacity
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, nc.HEADER.itemsize + capacity * nc.SLOT.itemsize)
        os.close(fd)
        self.mm = np.memmap(self.path, dtype=np.uint8, mode="r+")
        h = self.mm[:64].view(nc.HEADER)
        h["magic"], h["version"], h["slot_bytes"], h["capacity"] = nc.MAGIC, nc.VERSION, 64, capacity
        self.head = self.mm[24:32].view("<u8")
        self.slots = self.mm[64:].view(nc.SLOT)

    def put(self, **fields) -> None:
        i = int(self.head[0])
        s = self.slots[i % self.capacity]
        for k, v in fields.items():
            s[k] = v
        s["seq"] = i + 1
        self.head[0] = i + 1
        self.mm.flush()

    def coll(self, nseq: int, func: int, flows: int = 0) -> None:
        t0 = 1_700_000_000_000_000_000
        for step in range(flows):
            self.put(kind=self.nc.FLOW, comm=self.COMM, coll_seq=nseq, a=1_000 * (step + 1), b=1_000 * (step + 1) + 500,
                     c=4096, d=step, e=2)
        self.put(kind=self.nc.COLL, comm=self.COMM, coll_seq=nseq, func=func, algo=2, proto=3, dtype=7,
                 a=t0, b=t0 + 50_000, c=8192, d=0, e=flows)


def test_the_plugins_records_join_the_hooks_by_group_and_seq_and_its_states_ship(tmp_path):
    """Rank 11 of group "0" (10..13) is comm rank 1 of the plugin's 4-rank communicator."""
    from trainscope.collector.nccl_profiler import RingFile as Ring

    ALLREDUCE, ALLGATHER = 5, 3
    ring = RingFile(tmp_path / "ring-1")
    exp = Exporter()
    log = CollectiveLog(exp.submit, CollectiveLogConfig(interval_s=60), nccl=Ring(ring.path), rank=11)
    log.begin("other", (11, 20, 21, 22), "allreduce", 1, "f")     # same size, rank 11 at position 0: not it
    a = log.begin("0", (10, 11, 12, 13), "allreduce", 8192, "float32", iteration=5)
    b = log.begin("0", (10, 11, 12, 13), "alltoall", 8192, "float32")
    ring.put(kind=ring.nc.COMM, comm=ring.COMM, d=1, e=4)
    ring.coll(0, ALLREDUCE, flows=2)          # seq 1: joins a
    ring.coll(1, ALLGATHER)                   # seq 2: the hooks' seq 2 is an all-to-all: not joined, counted
    ring.coll(2, ALLREDUCE)                   # seq 3: the hooks never saw it (issued from C++): its own record
    ring.put(kind=ring.nc.STATE, comm=ring.COMM, coll_seq=3, channel=1, a=1, d=4, e=0, b=0, c=12, flags=3)
    log.end(a)
    log.end(b)
    assert log.ship()
    batch, = exp.batches
    names = [g.id for g in batch.groups]
    recs = {(names[r.group], r.seq): r for r in batch.records}
    assert set(recs) == {("0", 1), ("0", 3)}                       # b waits one ship for its plugin record
    r1 = recs[("0", 1)]
    assert (r1.op, r1.iteration, r1.enqueue_ns, r1.algo) == ("allreduce", 5, a.enqueue_ns, "ring")
    assert list(r1.step_dst) == [12, 12] and r1.end_ns == 1_700_000_000_000_050_000
    assert recs[("0", 3)].op == "allreduce" and recs[("0", 3)].algo == "ring"
    st, = batch.states
    assert (names[st.group], st.seq, st.channel, st.gpu_ready, st.total_chunks, st.peer) == ("0", 4, 1, 4, 12, 12)
    assert log.nccl == {"joined": 1, "unjoined": 1, "own": 1}
    ring.coll(0, ALLREDUCE)                   # the same collective again: its key was shipped
    exp.batches.clear()
    assert log.ship()
    assert [(r.seq, r.op, r.end_ns) for r in exp.batches[0].records] == [(2, "alltoall", b.end_ns)]
    assert log.nccl["late"] == 1 and log.stats()["nccl"]["lost"] == 0
    log.stop()
    assert os.path.exists(ring.path)          # not named after this process: not its plugin's ring, left alone


def test_without_the_opt_in_no_ring_is_read(monkeypatch):
    from trainscope.collector.collective_log import nccl_ring
    from trainscope.proto import env

    monkeypatch.delenv(env.NCCL_PROFILER_PLUGIN, raising=False)
    monkeypatch.delenv(env.NCCL_DIR, raising=False)
    assert nccl_ring() is None and CollectiveLog(Exporter().submit)._nccl is None
    monkeypatch.setenv(env.NCCL_DIR, "/nonexistent")
    ring = nccl_ring()
    assert ring is not None and ring.path == f"/nonexistent/ring-{os.getpid()}" and ring.poll() == ([], [])
