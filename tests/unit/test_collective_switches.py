"""The switches of issue 13's collective signal: the simulator's step records
(``SimConfig.collective_steps``, ``trainscope sim --collective-steps``) and the processor's
raw-record policy (``ProcessorConfig.collectives``, ``trainscope processor --collective-raw``).
No process is started: the processor command's ``Processor`` is replaced by a recorder (it would
bind a socket and start threads)."""
import pytest

from trainscope.collector.sim import SimConfig
from trainscope.collector.sim.simulate import Simulation
from trainscope.deploy import cli
from trainscope.processor import daemon
from trainscope.processor.collectives import CollectiveWindowConfig, TriggerConfig
from trainscope.processor.daemon import Processor, ProcessorConfig
from trainscope.proto.errors import ConfigError


def _records(steps: bool):
    sim = Simulation(SimConfig(ranks=8, tp=2, iterations=2, seed=1, collective_steps=steps, stack_every=0))
    recs = []
    for ch in sim.chunks():
        if ch.collectives is None:
            continue
        for r in range(8):
            b = ch.collectives.batch(r)
            if b is not None:
                recs += list(b.records)
    return recs


def test_step_records_only_when_switched_on():
    on, off = _records(True), _records(False)
    assert on and off and len(on) == len(off)
    assert all(len(r.step_index) and r.algo for r in on)
    assert not any(len(r.step_index) or r.algo for r in off)
    # the same collectives either way: the switch adds steps, it changes no timing
    assert [(r.seq, r.op, r.end_ns - r.enqueue_ns) for r in on] == [(r.seq, r.op, r.end_ns - r.enqueue_ns)
                                                                     for r in off]


def test_collective_steps_must_be_a_bool():
    with pytest.raises(ConfigError, match="sim.collective_steps"):
        SimConfig(ranks=8, collective_steps="yes")


def test_cli_flags_parse(capsys):
    from trainscope.deploy.cli_parser import build_parser
    p = build_parser(_Handlers(), "t")
    assert p.parse_args(["sim", "--collective-steps"]).collective_steps is True
    assert p.parse_args(["sim"]).collective_steps is None
    assert p.parse_args(["processor"]).collective_raw == "all"
    assert p.parse_args(["processor", "--collective-raw", "triggered"]).collective_raw == "triggered"
    with pytest.raises(SystemExit) as e:
        p.parse_args(["processor", "--collective-raw", "sometimes"])
    assert e.value.code == 2 and "--collective-raw" in capsys.readouterr().err


class _Handlers(dict):
    def __missing__(self, key):
        return lambda args: 0


@pytest.mark.parametrize("flag,mode", [([], "always"), (["--collective-raw", "triggered"], "triggered")])
def test_processor_command_passes_the_raw_policy(flag, mode, tmp_path, monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, cfg, **_):
            seen.append(cfg)
            raise ConfigError("processor.test", "stop", "recorded")

    monkeypatch.setattr(daemon, "Processor", Recorder)
    assert cli.main(["processor", "--listen", "127.0.0.1:0", "--home", str(tmp_path), *flag]) == 2
    assert seen[0].collectives.trigger.raw_records == mode


def test_processor_config_reaches_the_pipeline():
    cfg = ProcessorConfig(listen="127.0.0.1:0", store_path=None, embedded_bus=False,
                          collectives=CollectiveWindowConfig(trigger=TriggerConfig(raw_records="triggered")))
    assert Processor(cfg).pipeline.collectives._gated
    assert not Processor(ProcessorConfig(listen="127.0.0.1:0", store_path=None,
                                         embedded_bus=False)).pipeline.collectives._gated
