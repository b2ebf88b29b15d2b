"""Another local user cannot plant, redirect or read our files (issue #11 item 7).

A second user is simulated by ``chown`` to an unused uid (the tests run as root here; as
another user they are skipped where chown is not allowed) and by planted symlinks.
"""
import json
import os
import stat

import pytest

from support.pipeline import start_processor
from trainscope.collector.stacks import read_rank_files, write_rank_file
from trainscope.processor.spool import DiskSpool
from trainscope.proto import env
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.securefs import check_private_dir, owned_by_me, private_dir, write_private

OTHER_UID = 54321


def chown_other(path):
    try:
        os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
    except PermissionError:
        pytest.skip("cannot simulate another user without root")


def mode(p):
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_default_socket_is_per_user():
    assert env.runtime_dir({"XDG_RUNTIME_DIR": "/run/user/1000"}) == "/run/user/1000/trainscope"
    d = env.runtime_dir({})
    assert d.endswith(f"trainscope-{os.geteuid()}") and d != "/tmp/trainscope"
    assert env.DEFAULT_PROCESSOR_TARGET.startswith("unix://") and "/tmp/trainscope/" not in env.DEFAULT_PROCESSOR_TARGET


def test_private_dir_is_0700_and_refuses_other_users_and_open_dirs(tmp_path):
    d = private_dir(str(tmp_path / "a" / "b"))
    assert mode(d) == 0o700
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    chown_other(theirs)
    with pytest.raises(ConfigError, match="owned by uid 54321"):
        private_dir(str(theirs))
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        check_private_dir(str(open_dir))
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(ConfigError, match="symlink"):
        private_dir(str(tmp_path / "link"))


def test_processor_refuses_a_socket_directory_created_by_another_user(tmp_path):
    theirs = tmp_path / "trainscope"
    theirs.mkdir(mode=0o755)
    chown_other(theirs)
    with pytest.raises(ConfigError, match="owned by uid"):
        start_processor(listen=f"unix://{theirs}/processor.sock")
    assert not (theirs / "processor.sock").exists()


def test_processor_never_removes_what_is_not_its_own_socket(tmp_path):
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    (d / "processor.sock").write_text("someone's file")
    with pytest.raises(ConfigError, match="not a socket of this user"):
        start_processor(listen=f"unix://{d}/processor.sock")
    assert (d / "processor.sock").read_text() == "someone's file"
    proc = start_processor(listen=f"unix://{tmp_path}/ok/processor.sock")
    try:
        assert mode(tmp_path / "ok") == 0o700
    finally:
        proc.stop()


def test_rank_files_are_private_written_without_a_predictable_tmp_and_others_ignored(tmp_path):
    run = tmp_path / "run"
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    run.mkdir(mode=0o700)
    me = Resource(job_id="j", rank=0, world_size=2, pid=os.getpid())
    # the old code wrote rank-<pid>.json.tmp: a link planted there must not be followed
    (run / f"rank-{me.pid}.json.tmp").symlink_to(victim)
    path = write_rank_file(str(run), me)
    assert victim.read_text() == "keep me"
    assert mode(path) == 0o600 and owned_by_me(path)
    # another user's rank file naming a live process (ours) is ignored, and so is a link
    other = dict(json.loads(open(path).read()), rank=1)
    planted = run / "rank-1.json"
    planted.write_text(json.dumps({**other, "pid": 1}))
    chown_other(planted)
    (run / "rank-2.json").symlink_to(path)
    found = read_rank_files(str(run))
    assert list(found) == [me.pid]


def test_write_private_replaces_a_link_not_its_target(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep me")
    (tmp_path / "f").symlink_to(target)
    write_private(str(tmp_path / "f"), "new")
    assert target.read_text() == "keep me"
    assert not os.path.islink(tmp_path / "f") and mode(tmp_path / "f") == 0o600


def test_spool_is_private_and_never_follows_a_planted_link(tmp_path):
    with DiskSpool(tmp_path / "spool", 1 << 20) as spool:
        spool.append("t", None, b"x" * 100)
    assert mode(tmp_path / "spool") == 0o700
    for f in os.listdir(tmp_path / "spool"):
        p = tmp_path / "spool" / f
        assert mode(p) == 0o600, f
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    d = tmp_path / "spool2"
    d.mkdir(mode=0o700)
    (d / "LOCK").symlink_to(victim)
    with pytest.raises(OSError):
        DiskSpool(d, 1 << 20)
    assert victim.read_text() == "keep me"


def test_the_exporter_never_sends_to_a_socket_in_another_users_directory(tmp_path, caplog):
    from support.pipeline import kernel_count
    from trainscope.collector.exporter import BatchExporter
    from trainscope.collector.exporter_config import ExporterConfig
    from trainscope.proto.columnar import KernelColumns

    d = tmp_path / "sock"
    proc = start_processor(listen=f"unix://{d}/processor.sock")
    chown_other(d)  # as if another user had created the directory and put a socket there
    res = Resource(job_id="j", rank=0, world_size=1)
    exp = BatchExporter(res, ExporterConfig(target=proc.address, confirm_interval_s=0.2,
                                            backoff_initial_s=0.01, backoff_max_s=0.1))
    try:
        k = KernelColumns.build(["gemm"], [1, 2], [500, 500], [0, 0], [7, 7]).to_pb()
        with caplog.at_level("WARNING", logger="trainscope.collector.exporter"):
            assert exp.submit(k, 100)
            assert not exp.flush(1.0)
        assert exp.stats.confirmed == 0
        assert any("owned by uid 54321" in r.getMessage() for r in caplog.records)
        os.chown(d, os.geteuid(), os.getegid())  # the directory is ours again: delivery resumes
        assert exp.flush(10) and exp.stats.confirmed == 1
        assert proc.drain(10) and kernel_count(proc) == 2
    finally:
        exp.shutdown(1)
        proc.stop()


def test_perfetto_traces_replay_json_and_sim_truth_are_private_and_never_follow_a_planted_link(tmp_path):
    """Audit: the Perfetto sink wrote ``<trace>.tmp<pid>`` (predictable) with the default umask, and
    ``replay --json/--stats-out`` and the simulator's ground truth wrote ``<path>.tmp`` the same way.
    All three now go through ``write_private`` (mkstemp + rename, 0600)."""
    from trainscope.collector.sim.truth import write_ground_truth
    from trainscope.deploy.replay import write_json
    from trainscope.processor.model import ClosedWindow, WindowOutput
    from trainscope.processor.perfetto_sink import PerfettoConfig, PerfettoSink, trace_path
    from trainscope.proto.columnar import KernelColumns
    from trainscope.proto.v1 import records_pb2

    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.umask(old := os.umask(0o022))  # the usual umask: files would be 0644 without write_private
    try:
        out_json, truth = tmp_path / "stats.json", tmp_path / "sim" / "truth.json"
        for p in (out_json, truth):
            p.parent.mkdir(exist_ok=True)
            os.symlink(victim, str(p) + ".tmp")  # the old predictable temporary name
        write_json({"a": 1}, str(out_json))
        write_ground_truth({"b": 2}, str(truth))
        assert json.loads(out_json.read_text()) == {"a": 1} and json.loads(truth.read_text()) == {"b": 2}
        assert mode(out_json) == mode(truth) == 0o600

        res = Resource(job_id="job", rank=0, world_size=1)
        k = KernelColumns.build(["gemm"], [10**9], [500], [0], [7])
        window = ClosedWindow(res, records_pb2.Window(index=3, start_ns=10**9, end_ns=2 * 10**9), k)
        trace = tmp_path / "traces" / trace_path("job", 0, 3)
        trace.parent.mkdir(parents=True)
        os.symlink(victim, f"{trace}.tmp{os.getpid()}")
        sink = PerfettoSink(PerfettoConfig(url=str(tmp_path / "traces")))
        sink.export(WindowOutput(raw=window))
        assert sink.flush(10.0)
        sink.close()
        assert trace.exists() and mode(trace) == 0o600
        assert victim.read_text() == "keep"
        assert not [p for p in trace.parent.iterdir() if p.name.startswith(".")]  # no temporary left
    finally:
        os.umask(old)


def test_a_store_open_for_writing_is_seen_as_in_use_until_it_is_closed(tmp_path):
    from trainscope.deploy.embedded import embedded_processor_config, remove_socket_dir
    from trainscope.processor.store import SqliteStore, store_in_use
    from trainscope.processor.windows import WindowConfig

    path = str(tmp_path / "store.sqlite")
    s = SqliteStore(path)
    assert store_in_use(path) and mode(path + "-lock") == 0o600
    reader = SqliteStore(path, read_only=True)  # query and report hold no lock
    with pytest.raises(ConfigError, match="running trainscope process"):
        embedded_processor_config(str(tmp_path), WindowConfig(), replace_store=True)
    assert os.path.exists(path)
    s.close()
    reader.close()
    assert not store_in_use(path)     # another process that dies holding it: tests/integration/test_replay_force.py
    cfg = embedded_processor_config(str(tmp_path), WindowConfig(), replace_store=True)
    remove_socket_dir(cfg)
    assert not os.path.exists(path) and cfg.store_path == path
