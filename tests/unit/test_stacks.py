"""The py-spy stack sidecar: raw-output parsing, idle/active merge, rank registry, windows.

The sidecar's runs against a py-spy stand-in script (a process) are in
tests/integration/test_stacks_sidecar.py; against real rank processes with
the real py-spy in tests/integration/test_torch_job.py.
"""
from __future__ import annotations

import os

import pytest

from support.pyspy_raw import RAW_ACTIVE, RAW_ALL
from trainscope.collector.stacks import (
    StackSamplerConfig, parse_raw, read_rank_files, snapshot, write_rank_file)
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import ParallelCoords, Resource


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


@pytest.mark.parametrize("kw", [dict(window_s=0), dict(rate_hz=0), dict(max_stacks=0), dict(idle_exit_s=-1)])
def test_bad_config_names_the_setting(kw):
    with pytest.raises(ConfigError, match="stacks."):
        StackSamplerConfig(**kw)
