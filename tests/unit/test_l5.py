"""L5: the rank whose active Python stacks sit in a function its peers are not in."""
import pytest

from trainscope.analyzer.l5_stacks import L5Config, analyze_stacks
from trainscope.analyzer.model import JobWindow
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2, telemetry_pb2

TRAIN = "train.py:main;megatron/training.py:train_step;transformer_block.py:forward"
WAIT = "p2p_communication.py:_communicate;torch/cuda/__init__.py:synchronize"


def window(extra: dict[int, tuple[str, int]], world=8):
    jw = JobWindow("j", records_pb2.Window(index=3))
    for r in range(world):
        res = Resource(job_id="j", rank=r, world_size=world, coords=coords_for_rank(r, world))
        jw.resources[r] = res
        sw = records_pb2.StackWindow(resource=res.to_pb(), window=jw.window, samples=1000)
        sw.stacks.append(telemetry_pb2.FoldedStack(stack=WAIT, count=800, idle=True))
        sw.stacks.append(telemetry_pb2.FoldedStack(stack=TRAIN, count=200, idle=False))
        if r in extra:
            stack, n = extra[r]
            sw.stacks.append(telemetry_pb2.FoldedStack(stack=stack, count=n, idle=False))
        jw.stacks[r] = sw
    return jw


def test_gc_on_one_rank_is_named_with_its_function():
    (f,) = analyze_stacks(window({5: ("train.py:train_step;<gc>:collect", 150)}))
    assert f.level == "L5" and f.kind == "host_stall"
    assert [s.rank for s in f.suspects] == [5]
    ev = f.suspects[0].evidence
    assert ev["function"] == "<gc>:collect" and ev["share"] == pytest.approx(150 / 350, abs=1e-3)
    assert ev["peer_share"] == 0


def test_same_stacks_everywhere_name_no_one():
    assert analyze_stacks(window({})) == []


def test_a_function_many_peers_share_is_not_singled_out():
    common = {r: ("dataloader.py:_get_data;queues.py:get", 150) for r in range(8)}
    assert analyze_stacks(window(common)) == []


def test_idle_samples_do_not_count():
    jw = window({})
    jw.stacks[2].stacks.append(telemetry_pb2.FoldedStack(stack="x.py:sleep", count=5000, idle=True))
    assert analyze_stacks(jw) == []


def test_bad_config_names_the_setting():
    with pytest.raises(ConfigError, match="l5.max_peer_share"):
        L5Config(min_share=0.1, max_peer_share=0.2)
