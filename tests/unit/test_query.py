"""`trainscope query`: the facade and the CLI over a real store written in tmp_path.

The store holds real records: window protobufs through ``SqliteStore.put``,
and diagnoses/verdicts built by the analyzer's own ``merge`` through
``DiagnosisStore.put``. Job ``train-a`` has 4 ranks on 2 hosts (tp=2); rank 2
is slow in ``backward`` and in the ``gemm`` kernel (1.5x its peers) and is
flagged by L2 in windows 0-2 (made 3 h, 30 min and 5 min ago) and by L3 in
window 2. Job ``train-b`` is healthy.
"""
from __future__ import annotations

import json
import time

import pytest

from trainscope.analyzer.merge import merge
from trainscope.analyzer.model import Finding, Scope, SuspectRank
from trainscope.analyzer.query import Query, QueryConfig
from trainscope.analyzer.query_model import QueryError, as_json
from trainscope.analyzer.store import DiagnosisStore
from trainscope.deploy.cli import main, parse_since
from trainscope.processor.store import SqliteStore
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2, telemetry_pb2

MS = 1_000_000
NOW = time.time()
AGO = {0: 3 * 3600, 1: 1800, 2: 300}  # window -> seconds since its diagnoses were made


def _resource(job: str, rank: int, world: int) -> Resource:
    return Resource(job_id=job, rank=rank, world_size=world, host=f"node{rank // 2}", pid=1000 + rank,
                    local_rank=rank % 2, device=f"cuda:{rank % 2}", coords=coords_for_rank(rank, world, tp=2))


def _window(index: int) -> records_pb2.Window:
    return records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=index, start_ns=index * 10_000 * MS,
                              end_ns=(index + 1) * 10_000 * MS, first_iteration=index * 5,
                              last_iteration=index * 5 + 4)


def _write_job(records: SqliteStore, job: str, world: int, slow: int | None, windows: int = 3) -> dict:
    resources = {r: _resource(job, r, world) for r in range(world)}
    for w in range(windows):
        win = _window(w)
        for r, res in resources.items():
            factor = 1.5 if r == slow else 1.0
            d = int(100 * MS * factor)
            marks = [telemetry_pb2.IterationMark(iteration=w * 5 + i, start_ns=win.start_ns + i * d,
                                                 end_ns=win.start_ns + (i + 1) * d) for i in range(5)]
            records.put("iterations", records_pb2.IterationWindow(
                resource=res.to_pb(), window=win, marks=marks, mean_ns=d, p50_ns=d, max_ns=d * 1.2))
            records.put("phases", records_pb2.PhaseWindow(resource=res.to_pb(), window=win, phases=[
                records_pb2.PhaseStats(phase="forward", count=5, mean_ns=30 * MS, total_ns=150 * MS),
                records_pb2.PhaseStats(phase="backward", count=5, mean_ns=60 * MS * factor,
                                       total_ns=300 * MS * factor)]))
            records.put("kernels", records_pb2.KernelWindow(resource=res.to_pb(), window=win, events=300, kernels=[
                records_pb2.KernelStats(kernel="gemm", stream=7, count=200, total_ns=200 * 40_000 * factor),
                records_pb2.KernelStats(kernel="nccl_allreduce", stream=9, count=100, total_ns=100 * 90_000)]))
    return resources


def _diagnose(diagnoses: DiagnosisStore, job: str, resources: dict, flagged: dict[int, list[Finding]]) -> None:
    for w, findings in sorted(flagged.items()):
        v = merge(job, _window(w), findings, resources)
        ds = list(v.findings)
        for d in ds:
            d.created_unix_ns = int((NOW - AGO.get(w, 0)) * 1e9)
        del v.findings[:]
        v.findings.extend(ds)
        diagnoses.put(ds, v)


@pytest.fixture
def store_path(tmp_path):
    path = str(tmp_path / "store.sqlite")
    records, diagnoses = SqliteStore(path), DiagnosisStore(path)
    res_a = _write_job(records, "train-a", 4, slow=2)
    flagged = {}
    for w in range(3):
        fs = [Finding(level="L2", kind="straggler", job_id="train-a", window=_window(w),
                      scope=Scope(phase="backward", group="tp", group_index=1),
                      suspects=(SuspectRank(2, 1.5 + w / 10, {"ratio": 1.5}, impact_ns=(30 + w) * MS),),
                      severity=0.2)]
        if w == 2:
            fs.append(Finding(level="L3", kind="degraded_kernel", job_id="train-a", window=_window(w),
                              scope=Scope(kernel="gemm", stream=7, group="tp", group_index=1),
                              suspects=(SuspectRank(2, 7.5, {"w1_ns": 20000.0}, impact_ns=4 * MS),), severity=0.5))
        flagged[w] = fs
    _diagnose(diagnoses, "train-a", res_a, flagged)
    res_b = _write_job(records, "train-b", 2, slow=None, windows=1)
    _diagnose(diagnoses, "train-b", res_b, {0: []})
    records.close()
    diagnoses.close()
    return path


@pytest.fixture
def query(store_path):
    with Query(QueryConfig(store_path=store_path), now=lambda: NOW) as q:
        yield q


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["query", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------ facade
def test_jobs_lists_every_job_with_ranks_windows_and_latest_verdict(query):
    rows = {r.job: r for r in query.jobs().rows}
    assert set(rows) == {"train-a", "train-b"}
    a = rows["train-a"]
    assert (a.ranks, a.windows, a.diagnoses) == (4, 3, 4)
    assert "culprit rank 2" in a.latest and "node1" in a.latest
    assert rows["train-b"].latest.startswith("job train-b: healthy (confidence ")


def test_verdict_names_the_slow_rank_with_its_host_and_coordinates(query):
    job = query.verdict("train-a")                 # the job's verdict, merged over its 3 windows
    assert job.window is None and job.state == "degraded" and [s.rank for s in job.suspects] == [2]
    assert job.suspects[0].role == "culprit" and job.suspects[0].impact_s == pytest.approx(0.031)   # median
    assert "(3 windows)" in job.summary and 0 < job.confidence <= 1
    doc = as_json(job)
    assert doc["verdict"]["state"] == "degraded" and doc["verdict"]["suspects"][0]["rank"] == 2
    assert doc["verdict"]["suspects"][0]["impact_s"] == pytest.approx(0.031)
    v = query.verdict("train-a", window=2)
    assert v.window == 2 and v.iterations == "iterations 10-14"
    assert [s.rank for s in v.suspects] == [2]
    s = v.suspects[0]
    assert (s.host, s.coords, s.levels) == ("node1", "dp=1 tp=0 pp=0 ep=0 cp=0", ("L2", "L3"))
    assert s.impact_s == pytest.approx(0.032) and s.waited_for is None
    assert v.phases == ("backward",) and v.kernels == ("gemm",)
    assert {(f.level, f.kind, f.suspects) for f in v.findings} == {("L2", "straggler", (2,)),
                                                                   ("L3", "degraded_kernel", (2,))}
    assert query.verdict("train-a", window=0).kernels == ()
    doc = as_json(v)
    assert doc["verdict"]["suspects"][0]["rank"] == 2 and doc["verdict"]["state"] == "degraded"
    assert {d["kind"] for d in doc["findings"]} == {"straggler", "degraded_kernel"}
    assert doc["findings"][0]["scope"]["group"] == "tp"


def test_stragglers_since_filters_by_when_the_analyzer_flagged(query):
    every = query.stragglers("train-a").rows
    assert len(every) == 1
    r = every[0]
    assert (r.rank, r.host, r.phases, r.windows, r.flagged_now) == (2, "node1", ("backward",), 3, True)
    assert r.max_impact_s == pytest.approx(0.032)
    last_hour = query.stragglers("train-a", since_ns=parse_since("1h", NOW)).rows
    assert last_hour[0].windows == 2
    assert query.stragglers("train-a", since_ns=parse_since("1m", NOW)).rows == ()
    assert query.stragglers("train-b").rows == ()


def test_kernels_put_flagged_first_with_the_ratio_to_peers(query):
    rows = query.kernels("train-a", rank=2).rows
    assert [k.kernel for k in rows] == ["gemm", "nccl_allreduce"]
    gemm, nccl = rows
    assert (gemm.kinds, gemm.flagged_windows, gemm.max_impact_s, gemm.calls) == (("degraded_kernel",), 1, 0.004, 600)
    assert gemm.rank_mean_s == pytest.approx(60e-6) and gemm.peer_mean_s == pytest.approx(40e-6)
    assert gemm.ratio == pytest.approx(1.5)
    assert nccl.max_impact_s is None and nccl.ratio == pytest.approx(1.0)
    assert [k.kernel for k in query.kernels("train-a", rank=2, top=1).rows] == ["gemm"]
    # rank 0 is a peer: nothing flagged, its gemm is faster than the median of the others
    assert query.kernels("train-a", rank=0).rows[0].max_impact_s is None


def test_iterations_per_window_job_level_and_one_rank(query):
    rows = query.iterations("train-a").rows
    assert [r.window for r in rows] == [0, 1, 2]
    r = rows[1]
    assert (r.first_iteration, r.last_iteration, r.ranks, r.iterations, r.slowest_rank) == (5, 9, 4, 5, 2)
    assert r.mean_s == pytest.approx((3 * 0.1 + 0.15) / 4)
    assert r.p50_s == pytest.approx(0.1) and r.max_s == pytest.approx(0.18)
    assert [r.window for r in query.iterations("train-a", last=2).rows] == [1, 2]
    one = query.iterations("train-a", rank=2).rows
    assert {(r.ranks, round(r.mean_s, 6)) for r in one} == {(1, 0.15)}


def test_ranks_map_to_hosts_and_parallel_coordinates(query):
    rows = query.ranks("train-a").rows
    assert [(r.rank, r.host, r.tp, r.dp, r.device) for r in rows] == [
        (0, "node0", 0, 0, "cuda:0"), (1, "node0", 1, 0, "cuda:1"),
        (2, "node1", 0, 1, "cuda:0"), (3, "node1", 1, 1, "cuda:1")]
    assert [r.rank for r in query.ranks("train-a", host="node1").rows] == [2, 3]
    assert query.ranks("train-a", rank=3).rows[0].pid == 1003


def test_unanswerable_questions_raise_query_error(query, tmp_path):
    """Wrong input (an unknown job, window, rank or host) is a ConfigError (exit 2); a question the
    data cannot answer yet is a QueryError (exit 1)."""
    with pytest.raises(ConfigError, match="--job: 'nope' .*unknown job.*train-a, train-b"):
        query.verdict("nope")
    with pytest.raises(ConfigError, match="^--job is needed: the store holds 2 jobs: train-a, train-b$"):
        query.stragglers(None)  # two jobs: which one?
    with pytest.raises(ConfigError, match="--window: 9"):
        query.verdict("train-a", window=9)
    with pytest.raises(ConfigError, match="--window: -1"):
        query.verdict("train-a", window=-1)
    with pytest.raises(ConfigError, match="--rank: 42 .*ranks 0-3"):
        query.kernels("train-a", rank=42)
    with pytest.raises(ConfigError, match="--rank: 42"):
        query.iterations("train-a", rank=42)
    with pytest.raises(ConfigError, match="--host: 'node7' .*node0, node1"):
        query.ranks("train-a", host="node7")
    missing = tmp_path / "nothing" / "store.sqlite"
    with pytest.raises(ConfigError, match="no trainscope store"):
        Query(QueryConfig(store_path=str(missing))).jobs()
    assert not missing.parent.exists()  # asking never creates a store
    empty = str(tmp_path / "empty.sqlite")
    SqliteStore(empty).close()
    with pytest.raises(QueryError, match="holds no jobs yet"):
        Query(QueryConfig(store_path=empty)).jobs()


def test_parse_since_durations_and_iso_times():
    now = 1_700_000_000.0
    assert parse_since(None, now) == 0
    assert parse_since("90s", now) == int((now - 90) * 1e9)
    assert parse_since("1h30m", now) == int((now - 5400) * 1e9)
    assert parse_since("2d", now) == int((now - 172800) * 1e9)
    assert parse_since("2023-11-14T22:13:20Z", now) == int(now * 1e9)
    assert parse_since("2023-11-15T00:13:20+02:00", now) == int(now * 1e9)
    for bad in ("yesterday", "2h ago", "-5m", "12"):
        with pytest.raises(ConfigError, match="--since"):
            parse_since(bad, now)


# ------------------------------------------------------------------ Prometheus
class FakeProm:
    """Canned /api/v1/query answers, picked by a substring of the PromQL."""

    def __init__(self, answers: dict[str, list[tuple[dict, float]]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, url: str, timeout_s: float) -> bytes:
        import urllib.parse

        q = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["query"][0]
        self.asked.append(q)
        result = next((v for k, v in self.answers.items() if k in q), [])
        return json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": m, "value": [NOW, str(v)]} for m, v in result]}}).encode()


def test_stragglers_and_kernels_from_prometheus(tmp_path):
    fake = FakeProm({
        "count(last_over_time": [({}, 3.0)],
        "max by (rank, phase, kernel, kind) (max_over_time(trainscope_suspect_score": [
            ({"rank": "5", "phase": "backward", "kind": "straggler"}, 0.032),
            ({"rank": "9", "phase": "dp-allreduce", "kind": "slow_communication"}, 0.018)],
        "max by (rank, phase, kernel, kind) (trainscope_suspect_score": [
            ({"rank": "5", "phase": "backward", "kind": "straggler"}, 0.030)],
        "trainscope_rank_info": [({"rank": "5", "host": "node2"}, 1.0)],
    })
    cfg = QueryConfig(store_path=str(tmp_path / "absent.sqlite"), prometheus_url="http://prom:9090/")
    with Query(cfg, now=lambda: NOW, fetch=fake) as q:
        rows = q.stragglers("train-a", since_ns=parse_since("2h", NOW)).rows
        assert [(r.rank, r.host, r.phases, r.max_impact_s, r.flagged_now, r.windows) for r in rows] == [
            (5, "node2", ("backward",), 0.032, True, None),
            (9, "", ("dp-allreduce",), 0.018, False, None)]
        assert any('job="train-a"' in a and "[7200s]" in a for a in fake.asked)
        fake.answers = {"count(last_over_time": [({}, 1.0)],
                        "max_over_time": [({"kernel": "gemm", "kind": "degraded_kernel"}, 0.004)]}
        k = q.kernels("train-a", rank=2).rows
        assert [(x.kernel, x.max_impact_s) for x in k] == [("gemm", 0.004)]
        assert any('rank="2"' in a and "[3600s]" in a for a in fake.asked)
        fake.answers = {}
        with pytest.raises(QueryError, match="no trainscope series for job 'train-a'"):
            q.stragglers("train-a")
        with pytest.raises(ConfigError, match="--job"):
            q.stragglers(None)


def test_prometheus_errors_are_query_errors(tmp_path):
    def refused(url, timeout_s):
        raise ConnectionRefusedError("connection refused")

    def bad_query(url, timeout_s):
        return json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error"}).encode()

    for fetch, match in ((refused, "did not answer"), (bad_query, "parse error")):
        cfg = QueryConfig(store_path="unused", prometheus_url="http://127.0.0.1:9")
        with pytest.raises(QueryError, match=match):
            Query(cfg, fetch=fetch).stragglers("j")
    with pytest.raises(ConfigError, match="--prometheus"):
        QueryConfig(store_path="unused", prometheus_url="prom:9090")


# ------------------------------------------------------------------ CLI
def test_cli_tables(store_path, capsys):
    rc, out, _ = cli(capsys, "jobs", "--store", store_path)
    assert rc == 0 and out.splitlines()[0].split() == ["JOB", "RANKS", "WINDOWS", "DIAGNOSES", "LATEST"]
    assert "train-b" in out

    rc, out, _ = cli(capsys, "verdict", "--store", store_path, "--job", "train-a", "--window", "2")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == "job train-a, window 2 (iterations 10-14)"
    assert "culprit rank 2 (host node1" in lines[1]
    assert lines[2].startswith("state degraded, confidence ")
    title = "suspects (impact = time lost per iteration):"
    assert lines[lines.index(title) + 1].split()[:4] == ["RANK", "ROLE", "IMPACT", "IMPACT_PCT"]
    suspect = lines[lines.index(title) + 2].split()
    assert suspect[:4] == ["2", "culprit", "32", "ms"] and "node1" in suspect and "L2,L3" in suspect
    assert any(line.startswith("L3") and "degraded_kernel" in line and "kernel gemm" in line for line in lines)

    rc, out, _ = cli(capsys, "verdict", "--store", store_path, "--job", "train-b")
    assert rc == 0 and "verdict: healthy (no suspects)" in out and out.startswith("job train-b, all windows")

    rc, out, _ = cli(capsys, "stragglers", "--store", store_path, "--job", "train-a", "--since", "1h")
    header, row = out.splitlines()
    assert header.split()[:5] == ["RANK", "HOST", "PHASES", "KINDS", "WINDOWS"]
    assert row.split()[:5] == ["2", "node1", "backward", "straggler", "2"] and row.split()[-1] == "yes"

    rc, out, _ = cli(capsys, "stragglers", "--store", store_path, "--job", "train-b", "--since", "2h")
    assert rc == 0 and out.startswith("no stragglers for job train-b since ")

    rc, out, _ = cli(capsys, "kernels", "--store", store_path, "--job", "train-a", "--rank", "2")
    assert out.splitlines()[1].split() == ["gemm", "degraded_kernel", "1", "4", "ms", "600", "60", "us", "40", "us",
                                           "1.50x"]
    assert out.splitlines()[2].split()[:4] == ["nccl_allreduce", "-", "0", "-"]

    rc, out, _ = cli(capsys, "iterations", "--store", store_path, "--job", "train-a", "--last", "1")
    assert out.splitlines()[1].split()[:5] == ["2", "10", "14", "4", "5"] and "112 ms" in out

    rc, out, _ = cli(capsys, "ranks", "--store", store_path, "--job", "train-a", "--host", "node0")
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [["0", "node0"], ["1", "node0"]]


def test_cli_json(store_path, capsys):
    rc, out, _ = cli(capsys, "verdict", "--store", store_path, "--job", "train-a", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["query"] == "verdict" and doc["suspects"][0]["host"] == "node1"
    assert doc["window"] is None and doc["verdict"]["suspects"][0]["role"] == "culprit"
    rc, out, _ = cli(capsys, "stragglers", "--store", store_path, "--job", "train-a", "--json")
    doc = json.loads(out)
    assert doc["since"] is None and doc["source"] == "store"
    assert doc["rows"][0]["rank"] == 2 and doc["rows"][0]["windows"] == 3
    rc, out, _ = cli(capsys, "iterations", "--store", store_path, "--job", "train-a", "--rank", "2", "--json")
    assert [r["mean_s"] for r in json.loads(out)["rows"]] == pytest.approx([0.15] * 3)
    rc, out, _ = cli(capsys, "jobs", "--store", store_path, "--json")
    assert [r["job"] for r in json.loads(out)["rows"]] == ["train-a", "train-b"]


def test_cli_home_and_environment_locate_the_store(store_path, tmp_path, capsys, monkeypatch):
    home = str(tmp_path)  # store_path is tmp_path/store.sqlite
    rc, out, _ = cli(capsys, "ranks", "--home", home, "--job", "train-b")
    assert rc == 0 and len(out.splitlines()) == 3
    monkeypatch.setenv("TRAINSCOPE_HOME", home)
    rc, out, _ = cli(capsys, "stragglers", "--job", "train-a")
    assert rc == 0 and out.splitlines()[1].split()[0] == "2"


def test_cli_bad_input_exit_codes(store_path, tmp_path, capsys):
    rc, _, err = cli(capsys, "verdict", "--store", store_path, "--job", "nope")
    assert rc == 2 and "unknown job" in err and "'nope'" in err and "train-a" in err
    rc, _, err = cli(capsys, "stragglers", "--store", store_path, "--job", "train-a", "--since", "last tuesday")
    assert rc == 2 and "--since" in err
    rc, _, err = cli(capsys, "jobs", "--store", str(tmp_path / "missing.sqlite"))
    assert rc == 2 and "no trainscope store" in err and "--store" in err
    rc, _, err = cli(capsys, "verdict", "--home", str(tmp_path / "void"))
    assert rc == 2 and "--home" in err
    rc, _, err = cli(capsys, "stragglers", "--store", store_path)
    assert rc == 2 and "--job" in err and "train-a, train-b" in err
    rc, _, err = cli(capsys, "kernels", "--store", store_path, "--job", "train-a", "--rank", "2", "--top", "0")
    assert rc == 2 and "--top" in err
    empty = str(tmp_path / "empty.sqlite")
    SqliteStore(empty).close()
    rc, _, err = cli(capsys, "jobs", "--store", empty)
    assert rc == 1 and "holds no jobs yet" in err
    with pytest.raises(SystemExit) as e:  # argparse: missing --rank
        main(["query", "kernels", "--store", store_path])
    assert e.value.code == 2


def test_verdict_says_since_which_iterations_and_whether_stacks_were_sampled(store_path):
    """Window ids a person can read, and L5's input named (issue #12 item 4): no stacks -> said off."""
    from trainscope.deploy.render import render_query

    with Query(QueryConfig(store_path=store_path), now=lambda: NOW) as q:
        v = q.verdict("train-a")
        one = q.verdict("train-a", window=2)
    assert v.since_window is None and v.since_span is None  # this fixture's verdicts carry no onset
    assert "was off" in v.stacks and "py-spy" in v.stacks
    assert "was off" in render_query(v)
    assert render_query(one).startswith("job train-a, window 2 (iterations 10-14)")
    import dataclasses
    text = render_query(dataclasses.replace(v, since_window=1, since_span="iterations 5-9"))
    assert "since window 1 (iterations 5-9)" in text
    assert as_json(v)["stacks"] == v.stacks

    records = SqliteStore(store_path)
    res = _resource("train-a", 1, 4)
    records.put("stacks", records_pb2.StackWindow(resource=res.to_pb(), window=_window(0), samples=10))
    records.close()
    with Query(QueryConfig(store_path=store_path), now=lambda: NOW) as q:
        assert q.verdict("train-a").stacks == "stack sampling (py-spy): 1 rank(s) sampled"


def test_window_span_reads_as_iterations_or_a_utc_time_range():
    from trainscope.analyzer.query import window_span

    assert window_span(_window(3)) == "iterations 15-19"
    wall = records_pb2.Window(kind=records_pb2.WINDOW_KIND_TIME, index=1, start_ns=1_700_000_000 * 10**9,
                              end_ns=1_700_000_010 * 10**9)
    assert window_span(wall) == "2023-11-14 22:13:20-22:13:30 UTC"
    simulated = records_pb2.Window(kind=records_pb2.WINDOW_KIND_TIME, index=3, start_ns=30 * 10**9,
                                   end_ns=40 * 10**9)
    assert window_span(simulated) == "t=30-40 s"


def test_kernels_order_by_the_time_the_rank_loses_not_by_a_late_arrivals_short_collective(tmp_path):
    """Issue #22: the rank the others wait for is *faster* in the collective; that row is listed with
    its kind (late_arrival) but ranks below the kernel it loses time in, however large its gap."""
    path = str(tmp_path / "store.sqlite")
    records, diagnoses = SqliteStore(path), DiagnosisStore(path)
    res = _write_job(records, "train-c", 4, slow=2, windows=1)
    late = Finding(level="L3", kind="late_arrival", job_id="train-c", window=_window(0),
                   scope=Scope(kernel="nccl_allreduce", stream=9, group="tp", group_index=1),
                   suspects=(SuspectRank(2, 9.0, {"direction": "faster", "role": "late_arriver"},
                                         impact_ns=40 * MS),), severity=9.0)
    slow = Finding(level="L3", kind="degraded_kernel", job_id="train-c", window=_window(0),
                   scope=Scope(kernel="gemm", stream=7, group="tp", group_index=1),
                   suspects=(SuspectRank(2, 7.5, {"direction": "slower"}, impact_ns=4 * MS),), severity=0.5)
    _diagnose(diagnoses, "train-c", res, {0: [late, slow]})
    records.close()
    diagnoses.close()
    with Query(QueryConfig(store_path=path), now=lambda: NOW) as q:
        rows = q.kernels("train-c", rank=2).rows
    assert [k.kernel for k in rows] == ["gemm", "nccl_allreduce"]
    assert rows[1].kinds == ("late_arrival",) and rows[1].max_impact_s == 0.0
