"""Wrong configuration on the command line fails at start-up with exit status 2
and a message naming the setting, before anything is started."""
import pytest

from trainscope.deploy.cli import main


@pytest.mark.parametrize("argv,setting", [
    (["processor", "--window-length-s", "0", "--listen", "127.0.0.1:0"], "window.length_s"),
    (["processor", "--window-iterations", "0", "--window-mode", "iterations", "--listen", "127.0.0.1:0"],
     "window.iterations"),
    (["sim", "--ranks", "30", "--tp", "4", "--iterations", "2"], "sim"),
    (["sim", "--ranks", "8", "--fault", "meteor_strike:rank=1", "--iterations", "2"], "sim.fault"),
    (["replay", ".", "--persist", "3"], "--persist"),
    (["replay", ".", "--persist", "3/2"], "--persist"),
    (["replay", ".", "--impact-floor", "nan"], "--impact-floor"),
    (["analyzer", "--impact-floor", "100"], "--impact-floor"),
])
def test_bad_configuration_exits_2_naming_the_setting(argv, setting, tmp_path, capsys):
    assert main([*argv, "--home", str(tmp_path)]) == 2
    assert setting in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-3"])
def test_replay_refuses_a_bad_window_length_before_feeding_anything(value, tmp_path, capsys):
    """``--window-iterations`` (default: picked from the capture) given wrong: one line naming it, exit 2."""
    import pathlib
    import shutil
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "kineto" / "job2-rank0-nccl.json.gz",
                traces / "rank-0.json.gz")
    assert main(["replay", str(traces), "--window-iterations", value, "--home", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err
    assert "window.iterations" in err and "Traceback" not in err


def test_analyzer_without_broker_or_store_says_what_is_missing(tmp_path, capsys):
    assert main(["analyzer", "--home", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--store" in err and "trainscope processor" in err


def test_prometheus_port_env_must_be_a_number(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRAINSCOPE_PROMETHEUS_PORT", "nine")
    assert main(["replay", str(tmp_path), "--home", str(tmp_path)]) == 2
    assert "TRAINSCOPE_PROMETHEUS_PORT" in capsys.readouterr().err


def test_run_summary_says_no_sequence_instead_of_none():
    """`trainscope run`'s summary printed '0 iterations (sequence None)' for a rank without iterations."""
    from trainscope.deploy.launcher import RunResult, summary_lines

    ranks = [{"resource": {"rank": 0}, "collector": {}, "hooks": {"iterations": 0, "pattern": None}},
             {"resource": {"rank": 1}, "collector": {}, "hooks": {"iterations": 5, "pattern": "step"}}]
    lines = summary_lines(RunResult(0, "j", "unix:///p.sock", False, "/tmp/r", ranks))
    assert "None" not in "\n".join(lines)
    assert "0 iterations;" in lines[1] and "5 iterations (sequence step);" in lines[2]
