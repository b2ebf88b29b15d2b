"""Enablement: selective injection, the job's environment, the import hook, the .pth hook."""
from __future__ import annotations

import os
import socket
import sys

import pytest

from trainscope.collector import launch
from trainscope.collector.exporter_socket import reachable
from trainscope.deploy import launcher
from trainscope.collector.bootstrap import DIR as BOOTSTRAP_DIR, AfterImport, install_autostart_pth
from trainscope.collector.bootstrap._trainscope_boot import identity, select
from trainscope.proto.errors import ConfigError

PY = "/usr/bin/python3"
TORCHRUN_WORKER = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "TRAINSCOPE_AUTOSTART": "1"}


def sel(environ, *argv, pid=100, ppid=50):
    return select(environ, [PY, *argv], pid=pid, ppid=ppid)


def test_a_torchrun_worker_is_a_rank():
    assert sel(TORCHRUN_WORKER, "-u", "train.py", "--lr", "3") == (True, "rank process")
    assert sel(TORCHRUN_WORKER, "-m", "my.trainer")[0]


@pytest.mark.parametrize("argv,why", [
    (["/venv/bin/torchrun", "--nproc-per-node", "8", "train.py"], "launcher"),
    (["-m", "torch.distributed.run", "train.py"], "launcher"),
    (["/venv/bin/deepspeed", "train.py"], "launcher"),
    (["-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
      "--multiprocessing-fork"], "helper"),
    (["-m", "torch._inductor.compile_worker", "--workers=4"], "helper"),
    (["-m", "pip", "install", "x"], "helper"),
    (["-m", "trainscope.collector.stacks", "--run-dir", "/tmp/x"], "helper"),
])
def test_launchers_and_helpers_are_skipped_even_with_a_rank_identity(argv, why):
    ok, reason = sel(TORCHRUN_WORKER, *argv)
    assert not ok and reason.startswith(why)


def test_children_of_a_rank_are_skipped():
    env = dict(TORCHRUN_WORKER, TRAINSCOPE_RANK_PID="77")
    assert sel(env, "train.py", pid=78) == (False, "child of rank process 77")
    assert sel(env, "train.py", pid=77)[0]  # the rank itself (e.g. start_in_process called twice)


def test_identity_from_other_launchers_and_single_process_jobs():
    assert identity({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16",
                     "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == (5, 16, 1)
    assert identity({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "2"}) == (2, 4, 2)
    assert identity({"RANK": "x", "WORLD_SIZE": "2"}) is None
    assert sel({}, "train.py") == (False, "no distributed worker identity")
    ok, why = sel({"TRAINSCOPE_RUN_PID": "50"}, "train.py", ppid=50)
    assert ok and "single-process" in why


def test_disabled_and_non_matching_processes_are_skipped():
    assert not sel(dict(TORCHRUN_WORKER, TRAINSCOPE_AUTOSTART="0"), "train.py")[0]
    assert not sel(dict(TORCHRUN_WORKER, TRAINSCOPE_ENABLED="off"), "train.py")[0]
    env = dict(TORCHRUN_WORKER, TRAINSCOPE_MATCH=r"train\.py")
    assert sel(env, "-u", "/src/train.py")[0]
    assert sel(env, "eval.py") == (False, "command line does not match 'train\\\\.py'")
    assert not sel(dict(TORCHRUN_WORKER, TRAINSCOPE_MATCH="("), "train.py")[0]


def test_default_match_finds_the_script_or_module():
    assert launcher.default_match(["torchrun", "--nproc-per-node", "8", "/src/train.py", "--x"]) == r"train\.py"
    assert launcher.default_match(["python", "-m", "torch.distributed.run", "-m", "pkg.main"]) == r"pkg\.main"
    assert launcher.default_match(["deepspeed", "run_clm"]) is None


def test_child_env_puts_the_hook_first_and_names_the_run():
    cfg = launcher.RunConfig(command=("torchrun", "train.py"), extra_env=(("TRAINSCOPE_CPU_OPS", "0"),))
    e = launcher.child_env(cfg, job_id="j1", processor="127.0.0.1:5", run_dir="/tmp/r",
                         base={"PYTHONPATH": "/a:/b", "TRAINSCOPE_RANK_PID": "9", "PATH": "/bin"})
    assert e["PYTHONPATH"].split(os.pathsep) == [BOOTSTRAP_DIR, "/a", "/b"]
    assert (e["TRAINSCOPE_JOB_ID"], e["TRAINSCOPE_PROCESSOR"], e["TRAINSCOPE_RUN_DIR"]) == ("j1", "127.0.0.1:5", "/tmp/r")
    assert e["TRAINSCOPE_AUTOSTART"] == "1" and e["TRAINSCOPE_STACKS"] == "external"
    assert e["TRAINSCOPE_MATCH"] == r"train\.py" and e["TORCH_NCCL_ENABLE_TIMING"] == "1"
    assert e["TRAINSCOPE_RUN_PID"] == str(os.getpid()) and "TRAINSCOPE_RANK_PID" not in e
    assert e["TRAINSCOPE_CPU_OPS"] == "0" and e["PATH"] == "/bin"
    assert os.path.exists(os.path.join(BOOTSTRAP_DIR, "sitecustomize.py"))


def test_print_env_for_launchers_that_cannot_be_wrapped(capsys):
    launcher.print_env(launcher.RunConfig(command=("x",), processor="10.0.0.1:7070"))
    out = capsys.readouterr().out
    assert f"export PYTHONPATH={BOOTSTRAP_DIR}:$PYTHONPATH" in out
    assert "export TRAINSCOPE_PROCESSOR=10.0.0.1:7070" in out and "TRAINSCOPE_RUN_PID" not in out
    assert "export TRAINSCOPE_STACKS=1" in out  # local rank 0 of each host starts the sidecar


def test_run_config_is_validated():
    with pytest.raises(ConfigError, match="run.command"):
        launcher.RunConfig(command=())
    with pytest.raises(ConfigError, match="stacks_window_s"):
        launcher.RunConfig(command=("x",), stacks_window_s=0.5)


def test_after_import_hook_fires_once_after_the_module_ran(tmp_path, monkeypatch):
    (tmp_path / "ts_fake_torch.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    finder = AfterImport("ts_fake_torch", lambda m: seen.append(m.VALUE))
    sys.meta_path.insert(0, finder)
    try:
        import ts_fake_torch  # noqa: F401
        assert seen == [42] and finder not in sys.meta_path
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        sys.modules.pop("ts_fake_torch", None)


def test_reachable_for_tcp_and_unix_targets(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert reachable(f"127.0.0.1:{s.getsockname()[1]}")
    path = str(tmp_path / "p.sock")
    with socket.socket(socket.AF_UNIX) as u:
        u.bind(path)
        u.listen()
        assert reachable(f"unix://{path}")
    assert not reachable(f"unix://{tmp_path}/none.sock") and not reachable("bad-target")


def test_autostart_pth_runs_the_hook_only_when_asked(tmp_path, monkeypatch, capsys):
    path = install_autostart_pth(str(tmp_path))
    line = open(path).read()
    assert line.startswith("import ") and line.count("\n") == 1  # site runs one-line "import" entries
    monkeypatch.setenv("TRAINSCOPE_AUTOSTART", "0")
    exec(line, {"__name__": "pth"})  # off: nothing is loaded
    monkeypatch.setenv("TRAINSCOPE_AUTOSTART", "1")
    monkeypatch.setenv("TRAINSCOPE_DEBUG_BOOT", "1")
    for name in ("RANK", "WORLD_SIZE", "TRAINSCOPE_RUN_PID", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    exec(line, {"__name__": "pth"})  # on, but this process is no rank: selected out, never raises
    assert "skip (no distributed worker identity)" in capsys.readouterr().err


def test_in_process_stats_and_shutdown_never_raise(tmp_path, monkeypatch):
    class Col:
        resource = launch.dataclasses.make_dataclass("R", [("rank", int)])(rank=0)
        exporter = None

        def stats(self):
            return {"submitted": 1}

        def shutdown(self, timeout):
            raise RuntimeError("boom")

    monkeypatch.setenv("TRAINSCOPE_SHUTDOWN_TIMEOUT_S", "0.1")
    st = launch.InProcess(Col(), run_dir=str(tmp_path))
    st.shutdown()
    assert launcher.read_stats(str(tmp_path))[0]["collector"] == {"submitted": 1}


def test_run_summary_says_how_to_get_the_diagnosis():
    started = launcher.RunResult(0, "j1", "unix:/x.sock", True, "/tmp/r", [], "/home/u/.trainscope")
    text = "\n".join(launcher.summary_lines(started))
    assert "trainscope analyzer --home /home/u/.trainscope" in text
    assert "trainscope query verdict --job j1 --home /home/u/.trainscope" in text
    joined = "\n".join(launcher.summary_lines(launcher.RunResult(0, "j2", "127.0.0.1:9", False, "/tmp/r")))
    assert "analyzer beside processor 127.0.0.1:9" in joined and "--job j2" in joined


def test_py_spy_is_found_beside_the_interpreter_when_not_on_path(tmp_path, monkeypatch):
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o700)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert launcher.find_py_spy() == str(fake)
    fake.chmod(0o600)  # not executable: not found
    assert launcher.find_py_spy() is None
