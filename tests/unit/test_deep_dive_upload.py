"""Deep-dive traces to object storage (``processor/dive_upload.py``, issue #14 item 3).

No S3 or GCS server runs here: fsspec's ``memory://`` filesystem and a ``file://`` URL in
``tmp_path`` stand in for a bucket (the code path is fsspec's, the same for ``s3://``). A
failing bucket is a ``memory://`` filesystem subclass whose writes raise (what a refused or
unreachable bucket does to ``pipe_file``). The hub is the real ``ControlHub``; ranks'
reports are made by hand (no collector runs).
"""
from __future__ import annotations

import gzip
import json
import os
import stat

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from prometheus_client import CollectorRegistry, generate_latest

from trainscope.processor.control import ControlConfig, ControlHub
from trainscope.processor.dive_upload import DiveUploadConfig, DiveUploader, check_url, trace_key
from trainscope.processor.model import Resource
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import control_pb2

O = control_pb2.DeepDiveOutcome
TRACE = {"traceEvents": [{"ph": "X", "name": f"ProfilerStep#{i}", "cat": "user_annotation", "ts": i * 10.0,
                          "dur": 5.0, "pid": 1, "tid": 1} for i in (40, 41)]}


class FailingFS(MemoryFileSystem):
    """A bucket that refuses the first ``fail`` writes (then accepts)."""

    protocol = "failmem"
    fail = 0

    def pipe_file(self, path, value, **kw):
        if type(self).fail > 0:
            type(self).fail -= 1
            raise PermissionError("AccessDenied")
        return super().pipe_file(path, value, **kw)


fsspec.register_implementation("failmem", FailingFS, clobber=True)


def setup(tmp_path, url, **kw):
    up = DiveUploader(DiveUploadConfig(url=url, host_tag="hostA", backoff_s=0.0, **kw))
    h = ControlHub(ControlConfig(directory=str(tmp_path / "dd"), lead_iterations=2, lead_s=0.0), uploader=up)
    for r in (0, 1):
        h.subscribe(control_pb2.ControlHello(resource=Resource(job_id="j/1", rank=r, world_size=2).to_pb(),
                                             profiler_available=True))
    from types import SimpleNamespace
    from trainscope.proto.contracts import Signal
    from trainscope.proto.v1 import telemetry_pb2
    h.observe(SimpleNamespace(signal=Signal.ITERATIONS, resource=Resource(job_id="j/1", rank=0, world_size=2),
                              payload=[telemetry_pb2.IterationMark(iteration=i, start_ns=i, end_ns=i + 1)
                                       for i in range(30)]))
    ack = h.request(control_pb2.DeepDiveRequest(job_id="j/1", iterations=2))
    assert ack.accepted, ack.detail
    return h, up, ack


def report(h, ack, rank, size_pad=0):
    path = os.path.join(ack.directory, f"rank-{rank}.json")
    doc = dict(TRACE, pad="x" * size_pad)
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, 0o600)
    h.report(control_pb2.DeepDiveReport(resource=Resource(job_id="j/1", rank=rank, world_size=2).to_pb(),
                                        dive_id=ack.dive_id, outcome=O.DEEP_DIVE_OUTCOME_DONE, trace_path=path))
    return path


def metric(up, name, **labels):
    reg = CollectorRegistry()
    reg.register(up.metrics)
    return reg.get_sample_value(name, labels)


def test_each_rank_is_uploaded_gzipped_with_a_manifest_that_completes_after_the_uploads(tmp_path):
    bucket = tmp_path / "bucket"
    h, up, ack = setup(tmp_path, f"file://{bucket}")
    paths = [report(h, ack, r) for r in (0, 1)]
    assert h.wait_summaries(10) and up.flush(10)
    for r in (0, 1):
        obj = bucket / trace_key("j/1", ack.dive_id, r)
        assert obj.name == f"rank-{r}.json.gz" and obj.parent.parent.name == "j_1"
        assert json.loads(gzip.decompress(obj.read_bytes())) == json.load(open(paths[r]))
        assert stat.S_IMODE(os.stat(obj).st_mode) == 0o600             # a local bucket: private files
        assert (obj.parent / f"rank-{r}.summary.json").exists()
        assert os.path.exists(paths[r])                                 # keep_local by default
    (man_path,) = list((bucket / "j_1" / ack.dive_id).glob("manifest-*.json"))
    man = json.loads(man_path.read_text())
    assert man_path.name == "manifest-hostA.json" and man["complete"] and man["uploads_pending"] == 0
    assert man["objects"]["1"]["trace"]["state"] == "uploaded"
    assert man["objects"]["1"]["trace"]["key"] == trace_key("j/1", ack.dive_id, 1)
    local = json.load(open(os.path.join(ack.directory, "manifest.json")))   # what `query deep-dive` reads
    assert local["objects"]["0"]["trace"]["url"].startswith(f"file://{bucket}/j_1/")
    assert metric(up, "trainscope_processor_deep_dive_uploads_total", what="trace", outcome="ok") == 2
    assert metric(up, "trainscope_processor_deep_dive_uploads_total", what="trace", outcome="failed") == 0
    assert metric(up, "trainscope_processor_deep_dive_upload_bytes_total", what="trace") > 0
    up.close()


def test_retries_then_failure_are_counted(tmp_path):
    FailingFS.store.clear()
    h, up, ack = setup(tmp_path, "failmem://b1", retries=3)
    assert up.flush(10)                                      # the manifest written at the request
    FailingFS.fail = 2                                       # two refusals: the third attempt writes
    report(h, ack, 0)
    assert h.wait_summaries(10) and up.flush(10)
    retries = lambda: sum(metric(up, "trainscope_processor_deep_dive_upload_retries_total", what=w)   # noqa: E731
                          for w in ("trace", "summary", "manifest"))
    assert metric(up, "trainscope_processor_deep_dive_uploads_total", what="trace", outcome="ok") == 1
    assert metric(up, "trainscope_processor_deep_dive_uploads_total", what="summary", outcome="ok") == 1
    assert retries() == 2   # whichever object (trace or summary: two threads queue them) met the refusals
    FailingFS.fail = 10**6                                   # a bucket that refuses everything
    report(h, ack, 1)
    assert h.wait_summaries(10) and up.flush(10)
    assert metric(up, "trainscope_processor_deep_dive_uploads_total", what="trace", outcome="failed") == 1
    assert metric(up, "trainscope_processor_deep_dive_upload_retries_total", what="trace") >= 3
    st = up.objects(ack.dive_id)["1"]["trace"]
    assert st["state"] == "failed" and "AccessDenied" in st["detail"]
    assert "failed" in generate_latest(_reg(up)).decode()
    up.close()


def _reg(up):
    reg = CollectorRegistry()
    reg.register(up.metrics)
    return reg


def test_size_cap_keeps_the_trace_local_and_counts_it(tmp_path):
    MemoryFileSystem.store.clear()
    h, up, ack = setup(tmp_path, "memory://cap", max_bytes=2000)
    small = report(h, ack, 0)
    big = report(h, ack, 1, size_pad=5000)
    assert up.flush(10)
    fs = fsspec.filesystem("memory")
    assert fs.exists("/cap/" + trace_key("j/1", ack.dive_id, 0))
    assert not fs.exists("/cap/" + trace_key("j/1", ack.dive_id, 1))
    st = up.objects(ack.dive_id)["1"]["trace"]
    assert st["state"] == "too_large" and "cap of 2000 B" in st["detail"]
    assert metric(up, "trainscope_processor_deep_dive_uploads_total", what="trace", outcome="too_large") == 1
    assert os.path.exists(small) and os.path.exists(big)
    up.close()


def test_remove_local_deletes_only_the_dives_own_trace(tmp_path):
    MemoryFileSystem.store.clear()
    h, up, ack = setup(tmp_path, "memory://rm", keep_local=False)
    path = report(h, ack, 0)
    outside = tmp_path / "mine.json"                         # a rank reporting a file outside the dive
    outside.write_text(json.dumps(TRACE))
    h.report(control_pb2.DeepDiveReport(resource=Resource(job_id="j/1", rank=1, world_size=2).to_pb(),
                                        dive_id=ack.dive_id, outcome=O.DEEP_DIVE_OUTCOME_DONE,
                                        trace_path=str(outside)))
    assert up.flush(10)
    assert not os.path.exists(path) and up.objects(ack.dive_id)["0"]["trace"]["local"] == "removed"
    assert outside.exists() and h.stats["uploads_refused"] == 1 and "1" not in up.objects(ack.dive_id)
    up.close()


@pytest.mark.parametrize("url, why", [
    ("", "must be a directory path or an fsspec URL"),
    ("nosuchproto://x", "unknown fsspec protocol"),
    ("s3://AKIA:secretkey@bucket/x", "credentials in the URL"),
])
def test_bad_urls_name_the_setting_and_hide_credentials(url, why):
    with pytest.raises(ConfigError) as e:
        check_url(url, "--deep-dive-url")
    assert "--deep-dive-url" in str(e.value) and why in str(e.value)
    assert "secretkey" not in str(e.value)


def test_bad_settings_are_refused():
    for kw in ({"max_bytes": 0}, {"retries": -1}, {"backoff_s": -1.0}, {"host_tag": "a/b"}):
        with pytest.raises(ConfigError):
            DiveUploadConfig(url="memory://x", **kw)


# ------------------------------------------------------------------ reading back for analysis
def two_host_dive(tmp_path, url, hot_rank=3, hot_us=600.0):
    """Ranks 0-1 on host A, 2-3 on host B (separate local trace dirs), one bucket; traces as in
    test_deepdive_results (a step, a hot loop, a gloo wait), rank ``hot_rank``'s loop ``hot_us``."""
    from tests.unit.test_deepdive_results import write_trace
    from types import SimpleNamespace
    from trainscope.proto.contracts import Signal
    from trainscope.proto.v1 import telemetry_pb2
    hubs, ups, acks = [], [], []
    for host, ranks in (("hostA", (0, 1)), ("hostB", (2, 3))):
        up = DiveUploader(DiveUploadConfig(url=url, host_tag=host, backoff_s=0.0))
        h = ControlHub(ControlConfig(directory=str(tmp_path / host), lead_iterations=2, lead_s=0.0), uploader=up)
        for r in ranks:
            h.subscribe(control_pb2.ControlHello(resource=Resource(job_id="j", rank=r, world_size=4).to_pb(),
                                                 profiler_available=True))
            h.observe(SimpleNamespace(signal=Signal.ITERATIONS, resource=Resource(job_id="j", rank=r, world_size=4),
                                      payload=[telemetry_pb2.IterationMark(iteration=i, start_ns=i, end_ns=i + 1)
                                               for i in range(8)]))
        req = control_pb2.DeepDiveRequest(job_id="j", iterations=4)
        if acks:   # request_all: the second host is given the first one's id and start
            req.dive_id, req.start_iteration = acks[0].dive_id, acks[0].start_iteration
        ack = h.request(req)
        assert ack.accepted, ack.detail
        hubs.append(h), ups.append(up), acks.append(ack)
    for h, up, ack, ranks in zip(hubs, ups, acks, ((0, 1), (2, 3))):
        for r in ranks:
            path = os.path.join(ack.directory, f"rank-{r}.json")
            write_trace(__import__("pathlib").Path(path), r, hot_us if r == hot_rank else 100.0)
            h.report(control_pb2.DeepDiveReport(resource=Resource(job_id="j", rank=r, world_size=4).to_pb(),
                                                dive_id=ack.dive_id, outcome=O.DEEP_DIVE_OUTCOME_DONE,
                                                first_iteration=10, last_iteration=13, trace_path=path))
        assert h.wait_summaries(10) and up.flush(10)
    return hubs, ups, acks


def test_an_analyzer_elsewhere_reads_a_two_host_dive_back_from_the_bucket(tmp_path):
    from trainscope.analyzer.deepdive.results import DeepDiveFollower, FollowerConfig, ObjectDives
    from trainscope.analyzer.store import DiagnosisStore
    MemoryFileSystem.store.clear()
    hubs, ups, acks = two_host_dive(tmp_path, "memory://dives")
    ((job_dir, dive, man),) = ObjectDives("memory://dives").dives("j")
    assert man["complete"] and man["hosts"] == ["hostA", "hostB"] and man["ranks_expected"] == [0, 1, 2, 3]
    assert man["ranks"]["2"]["trace"] == f"memory://dives/j/{dive}/rank-2.json.gz"
    store = DiagnosisStore(str(tmp_path / "an.sqlite"))
    f = DeepDiveFollower(str(tmp_path / "analyzer-host"), store, FollowerConfig(verdict_wait_s=0),
                         url="memory://dives")  # no local trace there
    (doc,) = f.scan()
    assert doc["ranks_analysed"] == [0, 1, 2, 3] and doc["suspects"] == [3], doc
    assert any(o["function"] == "train.py(31): hot_loop" and o["ranks"] == [3] for o in doc["outliers"])
    assert doc["perfetto"]["suspect"]["trace"].startswith("memory://dives/j/")
    work = tmp_path / "analyzer-host" / ".objects" / "j" / dive
    assert stat.S_IMODE(os.stat(work / "analysis.json").st_mode) == 0o600
    assert f.scan() == []                                      # analysed once
    from trainscope.analyzer.query import deep_dives
    (q,) = deep_dives(str(tmp_path / "analyzer-host"), "j", url="memory://dives")
    assert q["ranks"]["3"]["object"] == f"memory://dives/j/{dive}/rank-3.json.gz" and q["suspects"] == [3]
    store.close()
    for up in ups:
        up.close()


def test_a_healthy_two_host_dive_names_nobody_and_a_host_not_done_waits(tmp_path):
    from trainscope.analyzer.deepdive.results import DeepDiveFollower, FollowerConfig
    from trainscope.analyzer.store import DiagnosisStore
    MemoryFileSystem.store.clear()
    hubs, ups, acks = two_host_dive(tmp_path, "memory://ok", hot_us=100.0)
    store = DiagnosisStore(str(tmp_path / "an.sqlite"))
    f = DeepDiveFollower(str(tmp_path / "an"), store, FollowerConfig(verdict_wait_s=0), url="memory://ok")
    (doc,) = f.scan()
    assert doc["ranks_analysed"] == [0, 1, 2, 3] and doc["suspects"] == [] and doc["outliers"] == []
    # a host whose manifest is not complete holds the dive back
    fs = fsspec.filesystem("memory")
    key = f"/ok/j/{acks[0].dive_id}/manifest-hostB.json"
    m = json.loads(fs.cat_file(key))
    m["complete"] = False
    fs.pipe_file(key, json.dumps(m).encode())
    f2 = DeepDiveFollower(str(tmp_path / "an2"), store, FollowerConfig(verdict_wait_s=0), url="memory://ok")
    assert f2.scan() == [] and f2.pending() == []
    store.close()
    for up in ups:
        up.close()


def test_a_missing_or_corrupt_object_is_one_line_naming_it(tmp_path):
    from trainscope.analyzer.deepdive.trace import TraceError, read_trace
    MemoryFileSystem.store.clear()
    with pytest.raises(TraceError, match="memory://nothing/x.json.gz: no such file"):
        read_trace("memory://nothing/x.json.gz")
    fsspec.filesystem("memory").pipe_file("/bad/r.json.gz", b"\x1f\x8b\x08garbage")
    with pytest.raises(TraceError, match="truncated or corrupt gzip"):
        read_trace("memory://bad/r.json.gz")

    class Unreachable(MemoryFileSystem):   # a bucket that cannot be reached
        protocol = "downmem"

        def _open(self, path, mode="rb", **kw):
            raise ConnectionError("endpoint unreachable")

    fsspec.register_implementation("downmem", Unreachable, clobber=True)
    with pytest.raises(TraceError, match="cannot read the object .ConnectionError: endpoint unreachable"):
        read_trace("downmem://b/r.json.gz")


@pytest.mark.parametrize("argv, flag", [
    (["processor", "--deep-dive-url", "nosuch://x"], "--deep-dive-url"),
    (["processor", "--deep-dive-url", "memory://x", "--deep-dive-upload-max-mib", "0"], "--deep-dive-upload-max-mib"),
    (["analyzer", "--deep-dive-url", "s3://AKIA:secretkey@b/p"], "--deep-dive-url"),
    (["query", "deep-dive", "--job", "j", "--deep-dive-url", ""], "--deep-dive-url"),
])
def test_cli_refuses_a_bad_value_in_one_line_naming_the_flag(argv, flag, capsys, tmp_path, monkeypatch):
    from trainscope.deploy.cli import main
    monkeypatch.setenv("TRAINSCOPE_HOME", str(tmp_path))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "secretkey" not in err and "Traceback" not in err
