"""The local store at scale (issue #15 item 5): rank and window filters, the newest record per rank,
retention of old windows (only when asked, counted), and ``query kernels --last``.

Real SQLite files in tmp_path; records are real protobufs.
"""
from __future__ import annotations

import pytest

from trainscope.analyzer.merge import merge
from trainscope.analyzer.query import Query, QueryConfig
from trainscope.analyzer.store import DiagnosisStore
from trainscope.processor.store import SqliteStore
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2


def _win(i: int, kind=records_pb2.WINDOW_KIND_ITERATIONS) -> records_pb2.Window:
    return records_pb2.Window(kind=kind, index=i, first_iteration=5 * i, last_iteration=5 * i + 4)


def _fill(path: str, job="j", ranks=4, windows=5, slow_from=3, **kw) -> SqliteStore:
    """``ranks`` ranks, ``windows`` windows; rank 1's gemm is 2x slower from window ``slow_from`` on."""
    st = SqliteStore(path, **kw)
    for w in range(windows):
        for r in range(ranks):
            res = Resource(job_id=job, rank=r, world_size=ranks, host=f"h{r // 2}-w{w}").to_pb()
            f = 2.0 if (r == 1 and w >= slow_from) else 1.0
            st.put("kernels", records_pb2.KernelWindow(resource=res, window=_win(w), kernels=[
                records_pb2.KernelStats(kernel="gemm", stream=7, count=10, total_ns=10 * 1000.0 * f),
                records_pb2.KernelStats(kernel="gemm", stream=8, count=5, total_ns=5 * 1000.0 * f),
                records_pb2.KernelStats(kernel="copy", stream=7, count=1, total_ns=50.0)]))
            st.put("iterations", records_pb2.IterationWindow(resource=res, window=_win(w), mean_ns=1e6))
    return st


def test_rank_and_window_filters_read_only_those_rows(tmp_path):
    st = _fill(str(tmp_path / "s.sqlite"))
    assert len(list(st.records("kernels", "j"))) == 20
    one = list(st.records("kernels", "j", rank=2))
    assert [r.window.index for r in one] == [0, 1, 2, 3, 4] and {r.resource.rank for r in one} == {2}
    late = list(st.records("kernels", "j", first_window=3))
    assert {(r.resource.rank, r.window.index) for r in late} == {(r, w) for r in range(4) for w in (3, 4)}
    assert [x[:3] for x in st.raw("kernels", "j", rank=0, first_window=4)] == [(0, 1, 4)]
    assert st.ranks("kernels", "j") == [0, 1, 2, 3] and st.ranks("stacks", "j") == []
    assert st.windows("iterations", "j") == [(1, w) for w in range(5)]
    newest = st.newest_per_rank(("iterations", "phases"), "j")
    assert sorted(newest) == [0, 1, 2, 3] and {r.resource.host[-2:] for r in newest.values()} == {"w4"}
    st.close()


def test_retention_deletes_only_when_asked_and_counts_it(tmp_path):
    # default: nothing is aged out, however many windows
    st = _fill(str(tmp_path / "keep.sqlite"), windows=6)
    assert st.keep_windows is None and st.aged_out == 0
    assert len(st.windows("kernels", "j")) == 6
    st.close()
    # keep the newest 2 windows per job and window kind; a time-window job is judged on its own indices
    st = _fill(str(tmp_path / "age.sqlite"), windows=6, keep_windows=2)
    st.put("kernels", records_pb2.KernelWindow(resource=Resource(job_id="t", rank=0, world_size=1).to_pb(),
                                               window=_win(10**6, records_pb2.WINDOW_KIND_TIME)))
    assert st.age_out(2) == 4 * 4 * 2          # windows 0-3 of 4 ranks, kernels and iterations
    assert st.aged_out == 32
    assert st.windows("kernels", "j") == [(1, 4), (1, 5)] and st.windows("kernels", "t") == [(0, 10**6)]
    assert st.age_out(2) == 0 and st.aged_out == 32
    with pytest.raises(ConfigError):
        st.age_out(0)
    st.close()
    with pytest.raises(ConfigError):
        SqliteStore(str(tmp_path / "x.sqlite"), keep_windows=0)
    # the automatic trim (every 10,000 rows written) applies keep_windows too
    st = SqliteStore(str(tmp_path / "auto.sqlite"), keep_windows=3)
    res = Resource(job_id="a", rank=0, world_size=1).to_pb()
    st.put_many([("iterations", records_pb2.IterationWindow(resource=res, window=_win(i // 1000)))
                 for i in range(10_000)])
    assert st.windows("iterations", "a") == [(1, 7), (1, 8), (1, 9)] and st.aged_out == 7000
    st.close()


def test_diagnosis_retention_per_job(tmp_path):
    path = str(tmp_path / "d.sqlite")
    ds = DiagnosisStore(path, keep_windows=2)
    for job in ("a", "b"):
        for w in range(4 if job == "a" else 2):
            v = merge(job, _win(w), [], {})
            ds.put([], v)
    assert ds.age_out(2) == (0, 2) and ds.aged_out == {"diagnoses": 0, "verdicts": 2}
    assert [v.window.index for v in ds.verdicts("a")] == [2, 3] and len(ds.verdicts("b")) == 2
    ds.close()
    with pytest.raises(ConfigError):
        DiagnosisStore(path, keep_windows=-1)


def test_kernels_query_over_the_last_windows_and_streams_merged(tmp_path):
    path = str(tmp_path / "q.sqlite")
    _fill(path).close()
    DiagnosisStore(path).close()
    with Query(QueryConfig(store_path=path)) as q:
        every = {r.kernel: r for r in q.kernels("j", rank=1).rows}
        assert every["gemm"].calls == 5 * 15 and every["gemm"].ratio == pytest.approx(7 / 5)
        last = q.kernels("j", rank=1, last=2)
        gemm = {r.kernel: r for r in last.rows}["gemm"]
        assert gemm.calls == 2 * 15 and gemm.ratio == pytest.approx(2.0) and last.params["last"] == 2
        assert gemm.rank_mean_s == pytest.approx(2e-6) and gemm.peer_mean_s == pytest.approx(1e-6)
        assert {r.kernel: r.ratio for r in last.rows}["copy"] == pytest.approx(1.0)
        with pytest.raises(ConfigError):
            q.kernels("j", rank=1, last=-1)
        assert [r.rank for r in q.ranks("j").rows] == [0, 1, 2, 3]
        assert {r.host for r in q.ranks("j").rows} == {"h0-w4", "h1-w4"}     # each rank's newest record


def test_keep_windows_is_a_processor_and_analyzer_setting():
    import collections

    from trainscope.deploy.analyzer_daemon import AnalyzerDaemonConfig
    from trainscope.deploy.cli_parser import build_parser
    from trainscope.processor.daemon import ProcessorConfig

    handlers = collections.defaultdict(lambda: None)
    p = build_parser(handlers, "t")
    assert p.parse_args(["processor", "--keep-windows", "50"]).keep_windows == 50
    assert p.parse_args(["analyzer", "--keep-windows", "7"]).keep_windows == 7
    assert p.parse_args(["processor"]).keep_windows is None          # default: keep every window
    assert ProcessorConfig().store_keep_windows is None
    assert AnalyzerDaemonConfig.__dataclass_fields__["keep_windows"].default is None


def test_kernels_compares_a_rank_with_its_data_parallel_group_only(tmp_path, monkeypatch):
    """``query kernels`` reads the rank's dp group (same tp/pp coordinates, as L3 compares), at most
    MAX_KERNEL_PEERS of them evenly spaced, through the store's rank filter."""
    import trainscope.analyzer.query as query_mod
    from trainscope.proto.model import coords_for_rank

    path = str(tmp_path / "g.sqlite")
    st = SqliteStore(path)
    ranks = 16                                   # tp=2: dp groups {even ranks} and {odd ranks}
    for r in range(ranks):
        res = Resource(job_id="j", rank=r, world_size=ranks, coords=coords_for_rank(r, ranks, tp=2)).to_pb()
        per_call = 3000.0 if r % 2 else 1000.0   # the odd group's gemm is 3x the even group's
        st.put("kernels", records_pb2.KernelWindow(resource=res, window=_win(0), kernels=[
            records_pb2.KernelStats(kernel="gemm", stream=7, count=10, total_ns=10 * per_call)]))
        st.put("iterations", records_pb2.IterationWindow(resource=res, window=_win(0), mean_ns=1e6))
    with pytest.raises(ValueError):
        st.raw("kernels", "j", ranks=range(10**4))           # over MAX_RANKS_FILTER: refused
    assert {x[0] for x in st.raw("kernels", "j", ranks=[3, 5, 99])} == {3, 5}
    st.close()
    with Query(QueryConfig(store_path=path)) as q:
        row = q.kernels("j", rank=4)
        (gemm,) = row.rows
        assert row.params["peers"] == 7                  # the other 7 even ranks, not all 15
        assert gemm.peer_mean_s == pytest.approx(1e-6) and gemm.ratio == pytest.approx(1.0)
        monkeypatch.setattr(query_mod, "MAX_KERNEL_PEERS", 3)
        row = q.kernels("j", rank=4)
        assert row.params["peers"] == 3 and row.rows[0].peer_mean_s == pytest.approx(1e-6)
