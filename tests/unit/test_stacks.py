"""The py-spy stack sidecar: raw-output parsing, idle/active merge, rank registry, windows.

The end-to-end run against real rank processes with the real py-spy is in
tests/integration/test_torch_job.py; here py-spy is a stand-in script that
writes recorded py-spy output, so the sidecar's own logic is tested fast.
"""
from __future__ import annotations

import os
import stat
import sys
import textwrap

import pytest

from trainscope.collector.stacks import (
    StackSamplerConfig, StackSidecar, parse_raw, read_rank_files, snapshot, write_rank_file)
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import ParallelCoords, Resource

# Recorded `py-spy record --format raw --threads --idle` output of a training rank.
RAW_ALL = """\
thread (4242): MainThread;<module> (train.py:120);main (train.py:98);backward (torch/_tensor.py:625) 31
thread (4242): MainThread;<module> (train.py:120);main (train.py:93);__next__ (torch/utils/data/dataloader.py:733) 9
thread (4250): trainscope-exporter;_bootstrap (threading.py:1002);_run (exporter.py:259);wait (threading.py:331) 40
thread (0x7F00AB): ;weird (x.py:1) 2
garbage line
"""
# The same window without --idle: only samples where the thread was running.
RAW_ACTIVE = """\
thread (4242): MainThread;<module> (train.py:120);main (train.py:98);backward (torch/_tensor.py:625) 30
thread (4242): MainThread;<module> (train.py:120);main (train.py:93);__next__ (torch/utils/data/dataloader.py:733) 9
"""


def test_raw_lines_become_thread_rooted_folded_stacks():
    got = parse_raw(RAW_ALL)
    assert got[(4242, "MainThread;<module> (train.py:120);main (train.py:98);backward (torch/_tensor.py:625)")] == 31
    assert got[(4250, "trainscope-exporter;_bootstrap (threading.py:1002);_run (exporter.py:259);"
                      "wait (threading.py:331)")] == 40
    assert got[(0x7F00AB, "thread-8323243;weird (x.py:1)")] == 2
    assert sum(got.values()) == 82


def test_idle_is_the_difference_of_the_two_runs():
    snap = snapshot(parse_raw(RAW_ALL), parse_raw(RAW_ACTIVE), 10, 20, max_stacks=10)
    assert (snap.window_start_ns, snap.window_end_ns, snap.samples) == (10, 20, 82)
    rows = {(s.stack.split(";")[0], s.stack.rsplit(";", 1)[1], s.idle): s.count for s in snap.stacks}
    assert rows[("MainThread", "backward (torch/_tensor.py:625)", False)] == 30
    assert rows[("MainThread", "backward (torch/_tensor.py:625)", True)] == 1
    assert rows[("trainscope-exporter", "wait (threading.py:331)", True)] == 40
    assert ("MainThread", "__next__ (torch/utils/data/dataloader.py:733)", True) not in rows
    assert [s.count for s in snap.stacks] == sorted((s.count for s in snap.stacks), reverse=True)


def test_max_stacks_bounds_the_list_not_the_sample_total():
    snap = snapshot(parse_raw(RAW_ALL), parse_raw(RAW_ACTIVE), 0, 1, max_stacks=2)
    assert len(snap.stacks) == 2 and snap.samples == 82


def res(pid: int, rank: int = 3) -> Resource:
    return Resource(job_id="j", rank=rank, world_size=8, pid=pid, host="h", local_rank=rank,
                    coords=ParallelCoords(dp=1, tp=1, dp_size=4, tp_size=2))


def test_rank_registry_round_trips_and_forgets_dead_processes(tmp_path):
    write_rank_file(str(tmp_path), res(os.getpid()))
    write_rank_file(str(tmp_path), res(2**22 + 12345, rank=4))  # no such process
    (tmp_path / "rank-9.json").write_text("{not json")
    got = read_rank_files(str(tmp_path))
    assert got == {os.getpid(): res(os.getpid())}
    assert not (tmp_path / f"rank-{2**22 + 12345}.json").exists()


@pytest.fixture
def fake_py_spy(tmp_path):
    """A py-spy stand-in: writes the recorded output for --idle / active runs and exits."""
    script = tmp_path / "py-spy"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys, time
        a = sys.argv
        out = a[a.index("--output") + 1]
        time.sleep(0.05)
        open(out, "w").write({RAW_ALL!r} if "--idle" in a else {RAW_ACTIVE!r})
        """))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_sidecar_exports_one_snapshot_per_window_with_the_ranks_resource(tmp_path, fake_py_spy):
    run_dir = tmp_path / "run"
    write_rank_file(str(run_dir), res(os.getpid()))
    sent = []

    def submit(batch, nbytes, resource):
        sent.append((batch, resource))
        if len(sent) >= 2:
            car.stop()
        return True

    car = StackSidecar(str(run_dir), submit, StackSamplerConfig(window_s=1, poll_s=0.02, py_spy=fake_py_spy))
    assert car.run() == 0
    assert len(sent) >= 2 and car.stats["errors"] == 0
    batch, r = sent[0]
    (snap,) = batch.snapshots
    assert snap.samples == 82 and snap.window_end_ns > snap.window_start_ns
    assert (r.rank, r.coords.tp_size, r.job_id) == (3, 2, "j")
    assert r.pid == os.getpid() and r.attributes["sampled_pid"] == str(os.getpid())


def test_sidecar_exits_when_no_rank_is_left_and_without_py_spy(tmp_path, fake_py_spy):
    car = StackSidecar(str(tmp_path), lambda *a: True,
                       StackSamplerConfig(idle_exit_s=0.2, poll_s=0.02, py_spy=fake_py_spy))
    assert car.run() == 0
    missing = StackSidecar(str(tmp_path), lambda *a: True, StackSamplerConfig(py_spy="/no/such/py-spy"))
    assert missing.run() == 2


@pytest.mark.parametrize("kw", [dict(window_s=0), dict(rate_hz=0), dict(max_stacks=0), dict(idle_exit_s=-1)])
def test_bad_config_names_the_setting(kw):
    with pytest.raises(ConfigError, match="stacks."):
        StackSamplerConfig(**kw)
