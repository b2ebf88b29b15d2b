"""A two-host deep dive through object storage (issue #14 item 3; ``processor/dive_upload.py``).

Two real ``trainscope processor`` daemons stand for two hosts: each its own home and its own
local deep-dive directory (``TRAINSCOPE_DEEP_DIVE_DIR``), both run with ``--deep-dive-url`` naming
one ``file://`` directory in ``tmp_path`` that stands in for a bucket (no S3 server runs here; the
code path is fsspec's, as for ``s3://``). Four collectors' control legs (the real ``ControlClient``
and ``DeepDiveWindow``, in this process) subscribe, ranks 0-1 to host A and 2-3 to host B. The
profiler is a stand-in (no torch job runs: ``test_deep_dive.py`` covers the real profiler) that
saves a CPU-only Kineto trace of the window's steps: a step, a hot loop, a gloo wait; rank 3's
loop is 6x its peers'. One request over both processors (``request_all``: same id, same start);
each processor uploads its ranks' traces; one analyzer, whose own deep-dive directory holds no
trace, reads the bucket, names ``hot_loop`` on rank 3 and no other rank, and ``trainscope query
deep-dive --deep-dive-url`` lists every rank's object URL. ~5-10 s on this host.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from trainscope.analyzer.deepdive.results import DeepDiveFollower, FollowerConfig
from trainscope.analyzer.store import DiagnosisStore
from trainscope.collector.control import ControlClient
from trainscope.collector.deep_dive import DeepDiveWindow
from trainscope.processor.control import request_all
from trainscope.proto.model import Resource
from trainscope.proto.security import ClientSecurity
from trainscope.proto.v1 import control_pb2

WAIT = "<built-in method wait of torch._C._distributed_c10d.Work object at 0x{:x}>"
HOT_RANK = 3


class TraceProfiler:
    """Stands in for torch.profiler: records the steps it was given, saves a CPU-only Kineto trace."""

    def __init__(self, rank: int) -> None:
        self.rank, self.steps = rank, []

    def start(self, it):
        self.steps.append(it)

    def step(self, it):
        self.steps.append(it)

    def stop(self):
        pass

    def save(self, path):
        hot = 600.0 if self.rank == HOT_RANK else 100.0
        ev, t = [], 5000.0 + 333.0 * self.rank
        for i in sorted(set(self.steps)):
            ev += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": t, "dur": 1000.0,
                    "pid": 1, "tid": 1},
                   {"ph": "X", "cat": "python_function", "name": "train.py(20): step", "ts": t + 1, "dur": 998.0,
                    "pid": 1, "tid": 1},
                   {"ph": "X", "cat": "python_function", "name": "train.py(31): hot_loop", "ts": t + 10,
                    "dur": hot, "pid": 1, "tid": 1},
                   {"ph": "X", "cat": "python_function", "name": WAIT.format(0x7F0000000000 + 0x1000 * self.rank + i),
                    "ts": t + 20 + hot, "dur": 900.0 - hot, "pid": 1, "tid": 1}]
            t += 1000.0
        with open(path, "w") as f:
            json.dump({"traceEvents": ev}, f)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_two_hosts_upload_to_one_bucket_and_one_analyzer_names_the_rank(tmp_path):
    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    procs, targets, metrics = [], [], []
    try:
        for host in ("a", "b"):
            home = tmp_path / host
            home.mkdir(mode=0o700)
            sock = f"unix://{home}/p.sock"
            env = dict(os.environ, TRAINSCOPE_DEEP_DIVE_DIR=str(home / "dd"), TRAINSCOPE_HOME=str(home))
            p = subprocess.Popen([sys.executable, "-m", "trainscope.deploy.cli", "processor", "--listen", sock,
                                  "--home", str(home), "--deep-dive-url", url, "--prometheus-port", "0"],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(p)
            targets.append(sock)
        for p in procs:   # "listening on ...", then "metrics on URL"
            lines = [p.stdout.readline() for _ in range(2)]
            assert any("metrics on" in x for x in lines), lines
            metrics.append(next(x for x in lines if "metrics on" in x).split("metrics on ", 1)[1].strip())

        clients = []
        for rank in range(4):
            host = rank // 2
            res = Resource(job_id="job-x", rank=rank, world_size=4)
            window = DeepDiveWindow(str(tmp_path / "ab"[host] / "dd"), res.to_pb(), lambda r, i=rank: clients[i].report(r),
                                    profiler_factory=lambda ws, rank=rank: TraceProfiler(rank))
            clients.append(ControlClient(targets[host], lambda res=res: res, window,
                                         security=ClientSecurity()).start())
        subscribed = "trainscope_processor_deep_dive_events_total{event=\"subscribed\"}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_metric(m, subscribed) >= 2 for m in metrics):
            time.sleep(0.1)
        acks = request_all(targets, control_pb2.DeepDiveRequest(job_id="job-x", iterations=4, start_iteration=10),
                           security=ClientSecurity())
        assert [a.accepted for a in acks] == [True, True] and [a.ranks_reached for a in acks] == [2, 2], acks
        assert acks[0].dive_id == acks[1].dive_id
        dive = acks[0].dive_id
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(c.window.busy for c in clients):
            time.sleep(0.05)
        for it in range(8, 16):   # every rank runs the same iterations
            for c in clients:
                c.window.before_batch(it)

        # one analyzer, elsewhere: its deep-dive directory holds nothing; it reads the bucket
        an_root = tmp_path / "analyzer"
        store = DiagnosisStore(str(tmp_path / "an.sqlite"))
        follower = DeepDiveFollower(str(an_root), store, FollowerConfig(verdict_wait_s=0), url=url)
        docs, deadline = [], time.monotonic() + 30
        while time.monotonic() < deadline and not docs:
            docs = follower.scan()
            time.sleep(0.1)
        (doc,) = docs
        assert doc["dive_id"] == dive and doc["ranks_analysed"] == [0, 1, 2, 3], doc
        assert doc["suspects"] == [HOT_RANK]
        named = [(o["function"], [r for r, s in zip(o["ranks"], o["slower"]) if s]) for o in doc["outliers"]]
        assert ("train.py(31): hot_loop", [HOT_RANK]) in named, named
        assert all(ranks == [HOT_RANK] for _, ranks in named), named    # no healthy rank named
        for r in range(4):   # one object per rank, under the dive's prefix; each host's local copy kept
            assert (bucket / "job-x" / dive / f"rank-{r}.json.gz").is_file()
            assert (tmp_path / "ab"[r // 2] / "dd" / "job-x" / dive / f"rank-{r}.json").is_file()
        assert len(list((bucket / "job-x" / dive).glob("manifest-*.json"))) == 2   # one per host
        for m in metrics:
            ok = 'trainscope_processor_deep_dive_uploads_total{outcome="ok",what="trace"}'
            assert _metric(m, ok) == 2.0
        store.close()

        out = subprocess.run([sys.executable, "-m", "trainscope.deploy.cli", "query", "deep-dive", "--job", "job-x",
                              "--deep-dive-url", url, "--deep-dive-dir", str(an_root)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        for r in range(4):
            assert f"object {url}/job-x/{dive}/rank-{r}.json.gz" in out.stdout or \
                f"{url}/job-x/{dive}/rank-{r}.json.gz" in out.stdout, out.stdout
        assert "hot_loop" in out.stdout and "rank(s) 3" in out.stdout, out.stdout
    finally:
        for c in locals().get("clients", []):
            c.stop(1.0)
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
