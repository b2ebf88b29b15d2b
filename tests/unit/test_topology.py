"""Comparison groups and routing (ARGUS §6.1, Table 3)."""
from __future__ import annotations

import pytest

from trainscope.analyzer.topology import (
    RoutingConfig, check_number, group_index, group_of, rank_to_group, resources_with,
)
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import ParallelCoords, Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2


def resources(world, **degrees):
    return {r: Resource(job_id="j", rank=r, world_size=world,
                        coords=coords_for_rank(r, world, **degrees)) for r in range(world)}


def test_dp_groups_share_every_other_coordinate():
    res = resources(16, tp=2, pp=2)                       # dp = 4; order tp-cp-ep-dp-pp
    groups = group_of(res, "dp")
    assert groups == {0: [0, 2, 4, 6], 1: [1, 3, 5, 7], 2: [8, 10, 12, 14], 3: [9, 11, 13, 15]}
    for members in groups.values():
        cs = [res[r].coords for r in members]
        assert len({(c.tp, c.pp, c.ep, c.cp) for c in cs}) == 1 and len({c.dp for c in cs}) == 4
    assert group_of(res, "tp") == {g: [2 * g, 2 * g + 1] for g in range(8)}
    assert group_of(res, "pp")[0] == [0, 8]
    assert group_of(res, "job") == {0: list(range(16))}
    for dim in ("dp", "tp", "pp", "ep", "cp", "job"):     # one rank's index = group_of's numbering
        rg = rank_to_group(group_of(res, dim))
        assert all(group_index(res[r].coords, dim) == rg[r] for r in res)


def test_ep_groups_and_other_orders():
    res = resources(16, ep=4)                              # dp = 4
    assert group_of(res, "ep") == {g: list(range(4 * g, 4 * g + 4)) for g in range(4)}
    assert group_of(res, "dp")[0] == [0, 4, 8, 12]
    res = resources(8, tp=2, order="dp-tp-cp-ep-pp")       # dp varies fastest
    assert group_of(res, "dp") == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


def test_group_index_is_stable_when_ranks_are_missing():
    res = resources(16, tp=2, pp=2)
    full = group_of(res, "dp")
    partial = group_of({r: v for r, v in res.items() if r not in (1, 3, 5, 7)}, "dp")
    assert 1 not in partial and all(partial[g] == full[g] for g in partial)
    assert rank_to_group(full)[13] == 3


def test_missing_coordinates_mean_one_group():
    res = resources(8, tp=2)
    res[3] = Resource(job_id="j", rank=3, world_size=8)      # no coordinates
    assert group_of(res, "dp") == {0: list(range(8))}
    assert group_of({}, "dp") == {}
    with pytest.raises(ConfigError):
        group_of(res, "xp")


def test_default_routing_follows_argus_table_3():
    rt = RoutingConfig()
    expect = {
        "self_attention": "dp", "gated_mla_self_attention": "dp", "moe_layer": "ep", "moe_experts": "ep",
        "dp-allreduce": "dp", "dp-reduce-scatter": "dp", "ep-alltoall": "ep", "alltoall": "ep",
        "forward": "dp", "backward-compute-mb7": "dp", "optimizer": "dp", "dataloader": "dp",
        "mlp": "dp", "pp-send": "dp", "pp-recv": "dp", "tp-allreduce": "dp", "ReduceScatter": "dp",
        "all_gather": "dp",
        "something_else": "dp",
    }
    assert {p: rt.route(p) for p in expect} == expect
    comm = {"dp-allreduce", "ep-alltoall", "pp-send", "pp-recv", "tp-allreduce", "ReduceScatter",
            "all_gather", "alltoall", "dp-reduce-scatter"}
    assert {p for p in expect if rt.is_communication(p)} == comm
    assert rt.kernel_group_dim == "dp"


def test_routing_is_configurable_and_validated():
    rt = RoutingConfig(rules=((r"^expert", "ep"), (r".", "tp")), fallback="job")
    assert rt.route("expert_ffn") == "ep" and rt.route("forward") == "tp"
    for kw, setting in [({"rules": ((r"(", "dp"),)}, "routing.rules[0]"),
                        ({"rules": ((r"x", "zz"),)}, "routing.rules[0]"),
                        ({"rules": ("x",)}, "routing.rules[0]"),
                        ({"fallback": "zz"}, "routing.fallback"),
                        ({"communication": "["}, "routing.communication")]:
        with pytest.raises(ConfigError) as e:
            RoutingConfig(**kw)
        assert e.value.setting == setting
    with pytest.raises(ConfigError):
        check_number("x.y", "3", lambda v: True, "a number")


def test_resources_with_fills_ranks_from_their_records():
    res = resources(4, tp=2)
    extra = Resource(job_id="j", rank=9, world_size=4,
                     coords=ParallelCoords(dp=1, tp=1, dp_size=2, tp_size=2))
    out = resources_with({r: res[r] for r in (0, 1)}, {
        2: records_pb2.PhaseWindow(resource=res[2].to_pb()),
        9: records_pb2.PhaseWindow(resource=extra.to_pb())})
    assert sorted(out) == [0, 1, 2, 9] and out[2].coords == res[2].coords and out[9].coords.tp == 1
