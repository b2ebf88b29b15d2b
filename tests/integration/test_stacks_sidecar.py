"""The py-spy stack sidecar's run loop against a py-spy stand-in (a script it starts as a process).

The stand-in writes recorded py-spy output (tests/support/pyspy_raw.py), so
the sidecar's windows, resources and exit rules are tested without ptrace;
the real py-spy against real ranks is in test_torch_job.py.
"""
from __future__ import annotations

import os
import stat
import sys
import textwrap

import pytest

from support.pyspy_raw import RAW_ACTIVE, RAW_ALL
from trainscope.collector.stacks import StackSamplerConfig, StackSidecar, write_rank_file
from trainscope.proto.model import ParallelCoords, Resource


def res(pid: int, rank: int = 3) -> Resource:
    return Resource(job_id="j", rank=rank, world_size=8, pid=pid, host="h", local_rank=rank,
                    coords=ParallelCoords(dp=1, tp=1, dp_size=4, tp_size=2))


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
