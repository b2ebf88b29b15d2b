"""The NCCL profiler plugin's C side, driven as NCCL drives it, read back by the collector's reader.

No GPU and no NCCL here: ``tests/support/nccl_driver.c`` dlopens the plugin built by
``trainscope nccl-plugin build`` and calls ``ncclProfiler_v4/v5/v6`` in NCCL 2.30's
order (user thread: Coll start, proxy ops appended, Coll stop; proxy threads: send steps
SendGPUWait -> SendPeerWait -> SendWait -> stop on one thread, receive steps RecvWait ->
RecvGPUWait -> stop and the kernel channel events on another). What is verified is the
plugin's logic and its ring against ``collector/nccl_profiler.py``; real NCCL timing and
event order on a GPU are not.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import stat
import subprocess

import numpy as np
import pytest

from trainscope.collector import nccl_profiler as nc
from trainscope.collector.collective_log import CollectiveLog, CollectiveLogConfig
from trainscope.deploy import nccl_plugin
from trainscope.deploy.cli import main as cli
from trainscope.proto import env

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMM = 0x5EED0000C0FFEE01
MEMBERS = (10, 11, 12, 13)          # the group's global ranks; the driver is comm rank 1 (global 11)
CC = nccl_plugin.find_compiler()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if CC is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH: the NCCL plugin cannot be built here")
    d = tmp_path_factory.mktemp("nccl")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["nccl-plugin", "build", "--out", str(d)]) == 0
    lib = d / nccl_plugin.LIBRARY
    assert f"{env.NCCL_PROFILER_PLUGIN}={lib.resolve()}" in out.getvalue()
    driver = d / "nccl_driver"
    subprocess.run([CC, "-std=c11", "-O1", "-Wall", "-I", str(nccl_plugin.source_dir()), "-o", str(driver),
                    os.path.join(ROOT, "tests", "support", "nccl_driver.c"), "-ldl", "-lpthread"], check=True)
    return lib, driver


def drive(built, version: int, scenario: str, ring_dir, **extra_env) -> tuple[dict, str]:
    lib, driver = built
    e = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_NCCL")}
    e.update({env.NCCL_DIR: str(ring_dir)}, **extra_env)
    proc = subprocess.run([str(driver), str(lib), str(version), scenario], env=e, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines() if " " in ln)
    assert "done" in proc.stdout and "error" not in proc.stdout
    return lines, os.path.join(str(ring_dir), f"ring-{lines['pid']}")


def test_build_refuses_to_replace_a_library_without_force(built, capsys):
    lib, _ = built
    assert cli(["nccl-plugin", "build", "--out", str(lib.parent)]) == 2
    assert "exists (pass --force" in capsys.readouterr().err


@pytest.mark.parametrize("version", [4, 5, 6])
def test_the_plugin_driven_as_nccl_does_gives_records_with_steps_and_mycroft_states(built, tmp_path, version):
    lines, path = drive(built, version, "main", tmp_path / "nccl")
    assert int(lines["mask"]) == (1 << 1) | (1 << 3) | (1 << 4) | (1 << 6)    # Coll|ProxyOp|ProxyStep|KernelCh
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and stat.S_IMODE(os.stat(tmp_path / "nccl").st_mode) == 0o700
    with open(path, "rb") as f:
        reader = nc.RingReader(bytearray(f.read()))
    slots = reader.poll()
    assert reader.lost == 0 and reader.counters() == dict.fromkeys(nc.COUNTERS, 0)
    asm = nc.Assembler({COMM: MEMBERS})
    records, states = asm.feed(slots)

    assert asm.comms == {COMM: (1, 4)}                                   # the COMM slot: rank 1 of 4
    (comm, rec), = records                                               # the stalled one never completed
    assert comm == COMM and asm.dropped == 0
    assert (rec.seq, rec.op, rec.dtype, rec.bytes, rec.algo) == (1, "allreduce", "float32", 4 << 20, "ring")
    # ring all-reduce on 4 ranks: 2(n-1) = 6 algorithm steps, each 2 transfers of 256 KiB on 2 channels,
    # all sent to the ring successor (comm rank 2 = global 12)
    assert list(rec.step_index) == [0, 1, 2, 3, 4, 5]
    assert list(rec.step_dst) == [12] * 6
    assert list(rec.step_bytes) == [4 * 262144] * 6
    starts, ends = np.array(rec.step_start_ns), np.array(rec.step_end_ns)
    assert (ends > starts).all() and (np.diff(starts) > 0).all()         # steps in order, each took time
    assert rec.enqueue_ns <= rec.start_ns < rec.end_ns and rec.recv_wait_ns > 0 and rec.send_busy_ns > 0

    # the stalled collective (seq 2): Mycroft's state log, every 100 ms while in flight (the driver held
    # the stall until it saw 3 reports of channel 1; on a loaded host seq 1 may have some too)
    assert int(lines["states"]) == 3
    settled = int(lines["settled"])                                     # the driver's threads were done
    stalled = [s for s in states if s.seq == 2 and s.t_ns >= settled]
    assert len(stalled) >= 6                                             # 2 channels x >= 3 reports
    ch1 = [s for s in stalled if s.channel == 1]
    ch0 = [s for s in stalled if s.channel == 0]
    assert {s.state for s in ch1} == {"not transmitted"}                 # GPU-ready, never on the wire
    assert {(s.gpu_ready, s.rdma_transmitted, s.rdma_done, s.total_chunks) for s in ch1} == {(4, 0, 0, 12)}
    assert {s.state for s in ch0} == {"done"} and {s.rdma_done for s in ch0} == {12}
    assert {s.peer for s in stalled} == {12}
    assert ch1[0].stuck_ns == 0 and ch1[-1].stuck_ns == ch1[-1].t_ns - ch1[0].t_ns > 0   # still since the 1st
    row = ch1[-1].to_proto(group=3)
    assert (row.group, row.seq, row.channel, row.gpu_ready, row.peer) == (3, 2, 1, 4, 12)


def test_no_runtime_directory_leaves_the_plugin_a_no_op(built, tmp_path):
    lines, path = drive(built, 4, "nodir", tmp_path / "missing" / "deeper")
    assert int(lines["mask"]) == 0 and not os.path.exists(tmp_path / "missing")
    # the default place: <XDG_RUNTIME_DIR>/trainscope/nccl, refused while trainscope/ does not exist
    e = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_NCCL")}
    e["XDG_RUNTIME_DIR"] = str(tmp_path / "xdg")
    os.mkdir(tmp_path / "xdg", 0o700)
    lib, driver = built
    proc = subprocess.run([str(driver), str(lib), "6", "nodir"], env=e, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "mask 0" in proc.stdout and os.listdir(tmp_path / "xdg") == []


def test_an_exhausted_handle_pool_drops_and_counts(built, tmp_path):
    lines, path = drive(built, 5, "exhaust", tmp_path / "nccl", **{env.NCCL_POOL_COLLS: "2"})
    assert lines["null"] == "handles 2"
    with open(path, "rb") as f:
        reader = nc.RingReader(bytearray(f.read()))
    c = reader.counters()
    assert c["dropped"] == 2 and c["detached"] == 2                      # 2 collectives; an op and a step orphaned
    assert list(reader.poll()["kind"]) == [nc.COMM]                      # nothing completed


def test_the_collector_joins_the_plugins_record_to_the_hooks_and_ships_the_states(built, tmp_path):
    _, path = drive(built, 4, "main", tmp_path / "nccl")

    class Exporter:
        def __init__(self) -> None:
            self.batches = []

        def submit(self, payload, nbytes, resource=None) -> bool:
            self.batches.append(payload())
            return True

    exp = Exporter()
    log = CollectiveLog(exp.submit, CollectiveLogConfig(interval_s=60), nccl=nc.RingFile(path), rank=11)
    for _ in range(2):                                                    # what the torch hooks saw
        log.end(log.begin("0", MEMBERS, "allreduce", 4 << 20, "float32", iteration=7))
    assert log.ship()
    log.stop()
    recs = [(b.groups[r.group].id, r) for b in exp.batches for r in b.records]
    by_seq = {r.seq: (g, r) for g, r in recs}
    assert sorted(by_seq) == [1, 2] and len(recs) == 2                    # one record per (group, seq)
    g, r1 = by_seq[1]
    assert g == "0" and r1.iteration == 7 and r1.algo == "ring" and list(r1.step_dst) == [12] * 6
    assert not by_seq[2][1].step_index                                    # never completed in the plugin
    states = [(b.groups[s.group].id, s) for b in exp.batches for s in b.states]
    assert {g for g, _ in states} == {"0"} and sum(s.seq == 2 and s.channel == 1 for _, s in states) >= 3
    assert log.stats()["nccl"]["joined"] == 1
    assert os.path.exists(path)               # the driver's ring, not this process's: left alone at stop
    shutil.rmtree(tmp_path / "nccl")


def test_a_plugin_loaded_again_in_the_same_process_makes_its_ring_again(built, tmp_path):
    """The last communicator finalized (NCCL may unload the plugin), then a new one: a new ring file
    of this pid, not the old one appended to (the collector maps the new inode)."""
    lines, path = drive(built, 4, "reinit", tmp_path / "nccl")
    assert int(lines["mask2"]) == int(lines["mask"]) == 90
    with open(path, "rb") as f:
        reader = nc.RingReader(bytearray(f.read()))
    s = reader.poll()
    assert list(s["kind"]) == [nc.COMM] and int(s["comm"][0]) == COMM + 1 and int(s["e"][0]) == 2
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
