"""``trainscope query deep-dive --job J`` (``analyzer/query.deep_dives``), in process through ``cli.main``.

The dives are laid out as the processor and the analyzer leave them (``tests/unit/test_deepdive_results``
builds them: hand-written CPU-only traces, one rank with a 5x hot loop).
"""
from __future__ import annotations

import json

import pytest

from test_deepdive_results import make_dive, window_verdict
from trainscope.analyzer.deepdive.results import DeepDiveFollower
from trainscope.analyzer.query import deep_dives, render_deep_dives
from trainscope.analyzer.store import DiagnosisStore
from trainscope.deploy.cli import main
from trainscope.proto.errors import ConfigError


@pytest.fixture()
def root(tmp_path):
    r = tmp_path / "deep"
    store = DiagnosisStore(str(tmp_path / "store.sqlite"))
    store.put([], window_verdict("j"))
    make_dive(r, "j", "20261124T180000-aaaaaa", {3: 500.0})
    DeepDiveFollower(str(r), store).scan()
    make_dive(r, "j", "20261124T181000-bbbbbb", {}, complete=False)   # still running: listed, not analysed
    store.close()
    return r


def test_lists_dives_with_what_was_found_and_the_perfetto_view(root, capsys):
    (a, b) = deep_dives(str(root), "j")
    assert a["state"] == "analysed" and a["iterations"] == [10, 13] and a["trigger"] == "manual"
    assert [f["function"] for f in a["found"]] == ["train.py(31): hot_loop"] and a["found"][0]["ranks"] == [3]
    assert a["perfetto"]["suspect"]["rank"] == 3 and a["perfetto"]["peer"]["rank"] in (0, 1, 2)
    assert a["perfetto"]["suspect"]["critical_path"].endswith("rank-3.critical_path.json")
    assert set(a["ranks"]) == {"0", "1", "2", "3"} and all(v["trace"] for v in a["ranks"].values())
    assert b["state"] == "running" and b["found"] == []
    text = render_deep_dives([a, b])
    assert "found: train.py(31): hot_loop (python) on rank(s) 3" in text
    assert "Perfetto (suspect, rank 3)" in text and "healthy peer" in text and "ui.perfetto.dev" in text
    assert main(["query", "deep-dive", "--job", "j", "--deep-dive-dir", str(root), "--json"]) == 0
    assert [d["dive_id"] for d in json.loads(capsys.readouterr().out)] == [a["dive_id"], b["dive_id"]]


def test_wrong_input_is_one_line_and_exit_2(root, tmp_path, capsys):
    with pytest.raises(ConfigError, match="jobs with deep dives there: j"):
        deep_dives(str(root), "other")
    assert main(["query", "deep-dive", "--job", "other", "--deep-dive-dir", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--job" in err
    (root / "empty").mkdir()
    assert main(["query", "deep-dive", "--job", "empty", "--deep-dive-dir", str(root)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert main(["query", "deep-dive", "--job", "j", "--deep-dive-dir", str(tmp_path / "none")]) == 2


def test_ranks_that_waited_are_listed_as_waiting_not_found(tmp_path):
    """``localize`` step 7 marks an outlier of ranks that only waited (a longer all-reduce, no rank slower
    in work of its own): the listing says they waited and that the dive found nothing out of line."""
    from trainscope.analyzer.query import _deep_dive_entries
    d = tmp_path / "20261207T000000-cccccc"
    d.mkdir()
    (d / "analysis.json").write_text(json.dumps({"suspects": [], "outliers": [
        {"function": "c10d::allreduce_", "kind": "communication", "common": False, "ranks": [1], "slower": [True],
         "impact_s": [0.003], "evidence": "rank(s) 1 waited in it longer than their peers", "not_cause": "waited"}]}))
    (e,) = _deep_dive_entries([(str(d), {"dive_id": d.name, "job": "j", "complete": True})], "j", "analysis.json")
    assert e["found"] == [] and e["not_a_cause"] == [{"function": "c10d::allreduce_", "ranks": [1], "why": "waited"}]
    text = render_deep_dives([e])
    assert "not a cause: rank(s) 1 longer in c10d::allreduce_ (waited: it waited for others)" in text
    assert "found: no function out of line on any rank (healthy)" in text
