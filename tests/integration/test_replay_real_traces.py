"""``trainscope replay`` on the real Kineto traces in ../shared/data/kineto/:
replay source → exporter → gRPC → processor → store, through the CLI."""
import collections
import gzip
import json
import os
import shutil
from pathlib import Path

import pytest

from trainscope.deploy.cli import main

pytestmark = pytest.mark.integration

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"
TRACES = sorted(SHARED.glob("*.json.gz")) if SHARED.is_dir() else []
KERNEL_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def raw_counts(path: Path) -> collections.Counter:
    doc = json.load(gzip.open(path))
    return collections.Counter((e["name"], int(e.get("args", {}).get("stream", 0)))
                               for e in doc["traceEvents"] if e.get("cat") in KERNEL_CATS)


@pytest.mark.skipif(not TRACES, reason=f"real traces not found under {SHARED}")
@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name)
def test_replay_stats_count_every_kernel_event(trace, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(trace, job / "rank-0.json.gz")
    out = tmp_path / "stats.json"
    assert main(["replay", str(job), "--stats-out", str(out), "--home", str(tmp_path / "home")]) == 0
    stats = json.loads(out.read_text())
    got = collections.Counter()
    for s in stats["kernel_stats"]:
        assert s["count"] == sum(c["count"] for c in s["clusters"])
        for c in s["clusters"]:
            assert 0 < c["min_ns"] <= c["p50_ns"] <= c["p99_ns"] <= c["max_ns"]
        got[(s["kernel"], s["stream"])] += s["count"]
    assert got == raw_counts(trace)


@pytest.mark.skipif(not TRACES, reason=f"real traces not found under {SHARED}")
def test_replay_of_a_multi_rank_job_keeps_ranks_apart(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    for r, name in enumerate(["job128-rank0.json.gz", "job128-rank1.json.gz"]):
        shutil.copy(SHARED / name, job / f"rank-{r}.json.gz")
    (job / "topology.json").write_text(json.dumps({"world_size": 128, "tp": 1, "pp": 1}))
    out = tmp_path / "stats.json"
    assert main(["replay", str(job), "--stats-out", str(out), "--home", str(tmp_path / "h")]) == 0
    stats = json.loads(out.read_text())
    per_rank = collections.Counter()
    for s in stats["kernel_stats"]:
        per_rank[s["rank"]] += s["count"]
    assert per_rank == {0: sum(raw_counts(SHARED / "job128-rank0.json.gz").values()),
                        1: sum(raw_counts(SHARED / "job128-rank1.json.gz").values())}


def test_replay_of_a_bad_directory_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "rank-0.json.gz").write_bytes(b"\x1f\x8b\x08truncated")
    assert main(["replay", str(tmp_path), "--home", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err
    assert "rank-0.json.gz" in err
    assert main(["replay", str(tmp_path / "missing"), "--home", str(tmp_path / "h")]) == 2


def test_replay_of_a_trace_without_kernels_reports_zero_and_loses_nothing_else(tmp_path, capsys):
    job = tmp_path / "job"
    job.mkdir()
    (job / "rank-0.json").write_text(json.dumps({"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 100}]}))
    (job / "rank-1.json").write_text(json.dumps({"distributedInfo": {"rank": 1, "world_size": 2}, "traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 1, "tid": 7, "ts": 10, "dur": 5, "args": {"stream": 7}}]}))
    out = tmp_path / "stats.json"
    assert main(["replay", str(job), "--stats-out", str(out), "--home", str(tmp_path / "h")]) == 0
    printed = capsys.readouterr().out
    assert "rank 0: 0 kernel events" in printed and "rank 1: 1 kernel events" in printed
    stats = json.loads(out.read_text())
    assert [(s["rank"], s["kernel"], s["count"]) for s in stats["kernel_stats"]] == [(1, "gemm", 1)]
