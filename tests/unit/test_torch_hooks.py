"""Automatic PyTorch instrumentation on a real (CPU) training loop, in-process."""
from __future__ import annotations

import collections
import dataclasses

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from trainscope.collector import launch  # noqa: E402
from trainscope.collector.cuda_phases import phase  # noqa: E402
from trainscope.collector.torch_hooks import TorchHooks, TorchHooksConfig  # noqa: E402
from trainscope.collector.iteration_detector import IterationDetectorConfig  # noqa: E402
from trainscope.proto.model import Resource, coords_for_rank  # noqa: E402


class Rec:
    """Stands in for the Collector: keeps what the hooks hand over."""

    def __init__(self, world: int = 1) -> None:
        self.phases: list[tuple] = []
        self.marks: list[tuple] = []
        self.resource = Resource(job_id="j", rank=0, world_size=world, coords=coords_for_rank(0, world))
        self.exporter = None

    def record_phase(self, name, start_ns, duration_ns, **kw):
        self.phases.append((name, start_ns, duration_ns, kw.get("iteration"), kw.get("clock")))

    def iteration(self, n, start_ns=None, end_ns=None):
        self.marks.append((n, start_ns, end_ns))

    def names(self):
        return collections.Counter(p[0] for p in self.phases)


@pytest.fixture
def hooks():
    rec = Rec()
    h = TorchHooks(rec, TorchHooksConfig(detector=IterationDetectorConfig(m=3))).install()
    yield h
    h.uninstall()


def small_job(steps: int = 8, batch: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(steps * batch, 8), torch.randn(steps * batch, 1))
    return model, opt, torch.utils.data.DataLoader(data, batch_size=batch), nn.MSELoss()


def train(model, opt, loader, loss_fn, epochs: int = 1):
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
    return loss.item()


def test_unmodified_loop_yields_phases_and_iterations(hooks):
    rec = hooks.collector
    train(*small_job(steps=8), epochs=2)
    assert rec.names() == {"dataloader": 16, "forward": 16, "backward": 16, "optimizer": 16}
    assert hooks.detector.pattern == "DO"
    assert [m[0] for m in rec.marks] == list(range(16))  # the epoch boundary (StopIteration) is no event
    for _, s, e in rec.marks:
        assert e > s
    # phases carry the number of the iteration they belong to
    by_iter = collections.defaultdict(set)
    for name, _, _, it, _ in rec.phases:
        by_iter[it].add(name)
    assert all(v == {"dataloader", "forward", "backward", "optimizer"} for v in by_iter.values())
    assert hooks.errors == 0


def test_forward_is_timed_on_the_model_not_the_loss_and_global_hooks_go_away(hooks):
    model, opt, loader, loss_fn = small_job(steps=6)
    train(model, opt, loader, loss_fn)
    assert not hooks._global_module_hooks          # moved onto the model after learning
    assert list(hooks._top) == [model]
    assert len(model._forward_pre_hooks) == 1 and len(loss_fn._forward_pre_hooks) == 0
    assert hooks.collector.names()["forward"] == 6


def test_nested_optimizer_steps_are_timed_once(hooks):
    model, opt, loader, loss_fn = small_job(steps=4)

    class Wrapper(torch.optim.SGD):
        def step(self, closure=None):
            return opt.step()

    outer = Wrapper(model.parameters(), lr=0.1)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        outer.step()
    assert hooks.collector.names()["optimizer"] == 4


def test_user_exceptions_pass_through_and_hooks_keep_working(hooks):
    model, opt, loader, loss_fn = small_job(steps=4)

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        Boom()(torch.zeros(1, 2))
    bad = torch.utils.data.DataLoader([1, 2], batch_size=1, collate_fn=lambda b: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        next(iter(bad))
    train(model, opt, loader, loss_fn)
    assert hooks.collector.names()["optimizer"] == 4 and hooks.errors == 0


def test_disabled_hooks_record_nothing_and_uninstall_restores_torch():
    rec = Rec()
    orig_next = torch.utils.data.dataloader._BaseDataLoaderIter.__next__
    orig_backward = torch.autograd.backward
    orig_allreduce = dist.all_reduce
    h = TorchHooks(rec).install()
    assert torch.autograd.backward is not orig_backward
    h.active = False  # what a forked data-loader worker gets
    train(*small_job(steps=3))
    assert rec.phases == []
    h.uninstall()
    assert torch.utils.data.dataloader._BaseDataLoaderIter.__next__ is orig_next
    assert torch.autograd.backward is orig_backward and dist.all_reduce is orig_allreduce


def test_user_phase_context_manager_and_decorator(hooks):
    with phase("attention"):
        torch.ones(3).sum()

    @phase("sampling")
    def sample():
        return 1

    assert sample() == 1 and sample() == 1
    assert hooks.collector.names() == {"attention": 1, "sampling": 2}


def test_phase_without_hooks_is_a_no_op():
    with phase("x"):
        pass

    @phase("y")
    def f():
        return 2

    assert f() == 2


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collectives_are_named_by_group_role_and_timed_to_completion(hooks, gloo):
    t = torch.ones(4)
    dist.all_reduce(t)                            # the world group of a pure data-parallel job
    work = dist.all_reduce(t, async_op=True)      # timed when the work completes, not when called
    work.wait()
    dist.all_gather_object([None], {"a": 1})      # calls all_gather inside: timed once
    tp = dist.new_group([0])
    coords = hooks.declare_groups(tp=tp)
    assert (coords.tp, coords.tp_size) == (0, 1)
    dist.broadcast(t, src=0, group=tp)
    names = hooks.collector.names()
    assert names["dp-allreduce"] == 2 and names["dp-allgather"] == 1 and names["tp-broadcast"] == 1


def test_declared_coordinates_reach_the_exporter_and_the_listener():
    from trainscope.collector.exporter import BatchExporter

    rec = Rec(world=8)
    rec.exporter = BatchExporter(rec.resource)
    seen = []
    h = TorchHooks(rec, on_resource=seen.append)
    coords = h.declare_coords(tp=1, tp_size=2, dp=3, dp_size=4)
    assert (coords.tp, coords.tp_size, coords.dp, coords.dp_size) == (1, 2, 3, 4)
    assert rec.exporter._resource_pb.coords.tp_size == 2
    assert seen and seen[0].coords == coords
    assert dataclasses.replace(rec.resource, coords=coords) == rec.resource
    rec.exporter.shutdown(0.1)


def test_recv_like_results_that_are_not_handles_end_the_phase(hooks, gloo):
    dist.barrier()
    work = dist.barrier(async_op=True)
    work.wait()
    assert hooks.collector.names()["dp-barrier"] == 2 and hooks.errors == 0


def test_rank_and_world_follow_init_process_group(hooks):
    rec = hooks.collector
    rec.resource = launch.dataclasses.replace(rec.resource, rank=0, world_size=3)  # the environment was wrong
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert (rec.resource.rank, rec.resource.world_size, rec.resource.coords.dp_size) == (0, 1, 1)
    finally:
        dist.destroy_process_group()


def test_megatron_and_device_mesh_conventions(hooks, gloo, monkeypatch):
    import sys
    import types

    world = dist.group.WORLD
    ps = types.SimpleNamespace(get_data_parallel_group=lambda: world, get_tensor_model_parallel_group=lambda: world,
                               get_context_parallel_group=lambda: (_ for _ in ()).throw(AssertionError("no cp")))
    mcore = types.ModuleType("megatron.core")
    mcore.parallel_state = ps
    monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
    monkeypatch.setitem(sys.modules, "megatron.core", mcore)
    coords = launch.declare_megatron(hooks)
    assert (coords.dp_size, coords.tp_size) == (1, 1)


def test_device_mesh_dimension_names_map_to_roles(hooks, gloo):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    coords = launch.declare_device_mesh(mesh, hooks)
    assert (coords.dp_size, coords.tp_size) == (1, 1)
    dist.all_reduce(torch.ones(2), group=mesh.get_group("tp"))
    assert hooks.collector.names()["tp-allreduce"] == 1


class FakeEvent:
    def __init__(self):
        self.stream = None

    def record(self, stream=None):
        self.stream = stream

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.25


class FakeCuda:
    """torch.cuda as the phase timer sees it on a GPU (CUDA initialised)."""

    class stream:
        stream_id = 3

    def Event(self, enable_timing=False):
        return FakeEvent()

    def current_stream(self):
        return self.stream

    def is_current_stream_capturing(self):
        return False


class NcclWork:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1
        return True

    def is_completed(self):
        return True

    def _get_duration(self):
        return 1.5  # ms, from the process group's own events on the NCCL stream


def nccl_hooks(monkeypatch, timing: str):
    from trainscope.collector.cuda_phases import CLOCK_CUDA, PhaseTimerConfig

    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", timing)
    h = TorchHooks(Rec(), TorchHooksConfig(phases=PhaseTimerConfig(poll_interval_s=0.01)))
    h.phases._cuda = FakeCuda()
    monkeypatch.setattr(h, "_backend", lambda group: "nccl")
    h.active = True
    return h, CLOCK_CUDA


def test_nccl_collectives_are_timed_by_the_process_group_on_the_nccl_stream(monkeypatch):
    h, clock = nccl_hooks(monkeypatch, "1")
    works, seen = [], []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(async_op)
        works.append(NcclWork())
        return works[-1]

    wrapped = h._wrap_collective(all_reduce, "allreduce", ["tensor", "op", "group", "async_op"])
    assert wrapped("t") is None and works[0].waited == 1     # sync for the caller, async underneath
    handle = wrapped("t", None, None, True)                  # the caller's own async handle, positional
    assert handle is works[1] and handle.waited == 0
    assert seen == [True, True]
    assert h.phases.flush(2)
    assert [(p[0], p[2], p[4]) for p in h.collector.phases] == [("dp-allreduce", 1_500_000, clock)] * 2
    h.phases.stop()


def test_without_nccl_timing_events_on_the_current_stream_time_sync_collectives(monkeypatch):
    h, clock = nccl_hooks(monkeypatch, "0")
    wrapped = h._wrap_collective(lambda tensor, group=None, async_op=False: None, "broadcast",
                                 ["tensor", "group", "async_op"])
    assert wrapped("t") is None
    assert h.phases.flush(2)
    assert [(p[0], p[2], p[4]) for p in h.collector.phases] == [("dp-broadcast", 250_000, clock)]
    h.phases.stop()
