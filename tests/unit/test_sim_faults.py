"""Simulator configuration: the fault parser, scopes, scenario files, and bad arguments."""
from __future__ import annotations

import json

import numpy as np
import pytest

from trainscope.collector.sim import FAULT_TYPES, SimConfig, load_scenario, parse_fault, sim_config
from trainscope.collector.sim.faults import Activity, When, parse_time, resolve_ranks
from trainscope.deploy.cli import main
from trainscope.proto.errors import ConfigError


def test_parse_fault_full_syntax():
    f = parse_fault("gpu_throttle:rank=137,onset=60s,factor=1.4,duration=2min")
    assert f.type == "gpu_throttle" and f.ranks == (137,)
    assert f.onset == When(60.0, "s") and f.duration == When(120.0, "s")
    assert f.params == {"factor": 1.4}
    g = parse_fault("nic_degrade:nic=3:1,onset=20it")
    assert g.nic == (3, 1) and g.onset == When(20, "it") and g.params["factor"] == 4.0
    h = parse_fault("moe_imbalance:group=ep:12,skew=0.4")
    assert h.group == ("ep", 12) and h.params["skew"] == 0.4 and h.params["factor"] == 2.0
    r = parse_fault("ecc:rank=8-11|20,prob=0.01")
    assert r.ranks == (8, 9, 10, 11, 20)
    d = parse_fault("gc_pause:delay=250ms")
    assert d.everywhere and d.params["delay"] == pytest.approx(0.25)


def test_defaults_and_intermittent_timing():
    c = parse_fault("net_congestion:factor=3")
    assert c.everywhere and c.every == When(30.0) and c.on_for == When(6.0)
    c2 = parse_fault("net_congestion:host=1,every=10s,for=10s")
    assert c2.hosts == (1,) and c2.every == c2.on_for == When(10.0)
    assert parse_time("1.5min") == When(90.0) and parse_time("7") == When(7.0) and parse_time("3it") == When(3, "it")


@pytest.mark.parametrize("text, fragment", [
    ("bogus:rank=1", "unknown fault type"),
    ("gpu_throttle", "needs a scope"),
    ("gpu_throttle:rank", "malformed item"),
    ("gpu_throttle:rank=1,speed=2", "unknown key"),
    ("gpu_throttle:rank=1,factor=0.5", "factor must be >= 1"),
    ("gpu_throttle:rank=1,factor=fast", "not a number"),
    ("gpu_throttle:rank=1,onset=soon", "not a time"),
    ("gpu_throttle:rank=1,host=2", "one scope"),
    ("net_congestion:every=10s", "both every= and for="),
    ("net_congestion:every=10s,for=20s", "0 < for <= every"),
    ("ecc:rank=1,prob=2", "prob must be in"),
    ("nic_degrade:nic=3", "HOST:INDEX"),
    ("moe_imbalance:group=xx:3", "DIM:RANK"),
    ("gpu_throttle:rank=5-2", "empty range"),
    ("gpu_throttle:rank=1,rank=2", "given twice"),
    ("", "expected type"),
])
def test_malformed_faults_name_the_setting(text, fragment):
    with pytest.raises(ConfigError) as e:
        parse_fault(text)
    assert e.value.setting.startswith("sim.fault") and fragment in str(e.value)


@pytest.mark.parametrize("kw, setting, fragment", [
    (dict(ranks=64, tp=3), "sim.ranks", "multiple of tp*pp*ep*cp"),
    (dict(ranks=64, pp=4, micro_batches=2), "sim.micro_batches", ">= pp"),
    (dict(ranks=64, order="tp-dp-pp"), "sim.order", "permutation"),
    (dict(ranks=64, gpus_per_host=12), "sim.gpus_per_host", "divides"),
    (dict(ranks=64, nics_per_host=3), "sim.nics_per_host", "divides"),
    (dict(ranks=0), "sim.ranks", ">= 1"),
    (dict(ranks=8, iteration_s=0), "sim.iteration_s", "> 0"),
    (dict(ranks=8, window_mode="rank"), "sim.window_mode", "iterations"),
    (dict(ranks=8, iterations=0), "sim.iterations", ">= 1"),
])
def test_bad_config_names_the_setting(kw, setting, fragment):
    with pytest.raises(ConfigError) as e:
        SimConfig(**kw)
    assert e.value.setting == setting and fragment in str(e.value)


@pytest.mark.parametrize("fault, setting, fragment", [
    ("gpu_throttle:rank=64", "sim.faults[0].rank", "outside the world"),
    ("cpu_contention:host=8", "sim.faults[0].host", "outside the 8 hosts"),
    ("nic_degrade:nic=0:4", "sim.faults[0].nic", "NICs per host"),
    ("moe_imbalance:rank=3", "sim.faults[0]", "needs ep > 1"),
    ("jit_stall:rank=1,mb=9", "sim.faults[0]", "mb must be"),
])
def test_faults_checked_against_topology(fault, setting, fragment):
    with pytest.raises(ConfigError) as e:
        SimConfig(ranks=64, tp=8, faults=(parse_fault(fault),))
    assert e.value.setting == setting and fragment in str(e.value)


def test_scopes_resolve_to_ranks():
    cfg = SimConfig(ranks=64, tp=4, pp=2)
    topo = cfg.topology()
    assert resolve_ranks(parse_fault("cpu_contention:host=1"), topo, "x").tolist() == list(range(8, 16))
    # 4 NICs per host: 2 GPUs per NIC; naming a rank names its NIC
    assert resolve_ranks(parse_fault("nic_degrade:nic=1:2"), topo, "x").tolist() == [12, 13]
    assert resolve_ranks(parse_fault("nic_degrade:rank=13"), topo, "x").tolist() == [12, 13]
    assert resolve_ranks(parse_fault("gpu_throttle:group=tp:5"), topo, "x").tolist() == [4, 5, 6, 7]
    assert resolve_ranks(parse_fault("gpu_throttle:group=pp:5"), topo, "x").tolist() == [5, 37]
    assert len(resolve_ranks(parse_fault("gc_pause:scope=all"), topo, "x")) == 64


def test_activity_onset_duration_and_cycle():
    a = Activity(parse_fault("gpu_throttle:rank=1,onset=10s,duration=20s"))
    assert [a(t, i) for i, t in enumerate([0, 5, 10, 15, 29, 31, 40])] == [False, False, True, True, True, False, False]
    b = Activity(parse_fault("net_congestion:every=10s,for=4s,onset=2it"))
    on = [b(3.0 * i, i) for i in range(10)]  # iterations of 3 s; starts at iteration 2 (t=6)
    assert on[:2] == [False, False] and on[2] and on[3] and not on[4] and not on[5] and on[6]


def test_scenario_file(tmp_path):
    p = tmp_path / "scenario.json"
    p.write_text(json.dumps({"faults": ["gpu_throttle:rank=3,factor=1.3",
                                        {"type": "pcie_degrade", "rank": 5, "onset": "10s"}]}))
    faults = load_scenario(str(p))
    assert [f.type for f in faults] == ["gpu_throttle", "pcie_degrade"] and faults[1].ranks == (5,)
    cfg = sim_config(ranks=16, scenario=str(p), faults=["ecc:rank=1"], duration="40s")
    assert len(cfg.faults) == 3 and cfg.duration_s == 40.0
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="sim.scenario"):
        load_scenario(str(tmp_path / "bad.json"))
    (tmp_path / "bad2.json").write_text(json.dumps({"faults": [{"rank": 1}]}))
    with pytest.raises(ConfigError, match=r"sim.scenario\[0\]"):
        load_scenario(str(tmp_path / "bad2.json"))


def test_every_fault_type_documented():
    for k in FAULT_TYPES.values():
        assert k.levels and k.signature and k.source
        assert set(k.levels) <= {"L1", "L2", "L3", "L4", "L5"}


@pytest.mark.parametrize("argv, fragment", [
    (["sim", "--fault", "bogus:rank=1"], "unknown fault type"),
    (["sim", "--ranks", "64", "--fault", "gpu_throttle:rank=64"], "outside the world"),
    (["sim", "--ranks", "64", "--tp", "8", "--pp", "3"], "multiple of"),
    (["sim", "--fault", "gpu_throttle:rank"], "malformed"),
    (["sim", "--duration", "5it"], "sim.duration"),
])
def test_cli_bad_arguments_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_cli_lists_faults(capsys):
    assert main(["sim", "--list-faults"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in FAULT_TYPES)


def test_default_hosts_for_small_worlds():
    assert SimConfig(ranks=4).gpus_per_host == 4
    cfg = SimConfig(ranks=12)
    assert cfg.gpus_per_host == 4 and cfg.topology().hosts == 3
    assert np.array_equal(cfg.topology().host, np.repeat(np.arange(3), 4))
