"""dashboards/: the checked-in JSON is what the code builds, and names only series that exist."""
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "dashboards"))
import series  # noqa: E402


def test_regenerating_gives_the_checked_in_files():
    pytest.importorskip("grafana_foundation_sdk", reason="install the test extra: pip install -e '.[test]'")
    import build  # dashboards/build.py, in-process (the unit tier starts no processes)

    for name, text in build.render().items():
        assert (ROOT / "dashboards" / "json" / name).read_text() == text, \
            f"dashboards/json/{name} is out of date: run python dashboards/build.py"
    assert sorted(p.name for p in (ROOT / "dashboards" / "json").glob("*.json")) == [
        "trainscope-fleet.json", "trainscope-job.json", "trainscope-pipeline.json"]


def test_dashboards_use_only_the_listed_series_and_those_exist_in_the_code():
    used = set()
    for path in (ROOT / "dashboards" / "json").glob("*.json"):
        text = path.read_text()
        used |= set(re.findall(r"\btrainscope_[a-z0-9_]+", text))
        board = json.loads(text)
        assert {v["name"] for v in board["templating"]["list"]} >= {"datasource"}
    used = {u for u in used if not u.startswith("trainscope_suspect_score") or u == series.SUSPECT_SCORE}
    assert used <= set(series.ALL), used - set(series.ALL)
    source = "".join(p.read_text() for d in ("processor", "analyzer") for p in (ROOT / d).glob("*.py"))
    for name in series.ALL:
        stem = name.removesuffix("_total")
        prefix, _, tail = stem.partition("trainscope_processor_")
        probe = f'"{tail}"' if tail else f'"{stem}"'  # selfmetrics names drop the prefix
        if stem.startswith("trainscope_analyzer_") and stem not in source:
            probe = f'"{stem.removeprefix("trainscope_analyzer_")}"'
        if stem == "trainscope_rank_info":
            probe = '"trainscope_rank"'  # InfoMetricFamily adds _info
        assert probe in source, f"{name} is not exported by processor/ or analyzer/"


def test_job_dashboard_has_job_rank_host_variables_and_runbook_link():
    board = json.loads((ROOT / "dashboards" / "json" / "trainscope-job.json").read_text())
    names = {v["name"] for v in board["templating"]["list"]}
    assert {"job", "rank", "host"} <= names
    assert any("runbook" in link.get("url", "") for link in board["links"])
    for path in (ROOT / "dashboards" / "json").glob("*.json"):
        panels = json.loads(path.read_text())["panels"]
        units = [p["fieldConfig"]["defaults"].get("unit") for p in panels if p["type"] != "row"]
        assert units and all(units), f"every panel of {path.name} states its unit"


def _job_panels() -> dict:
    board = json.loads((ROOT / "dashboards" / "json" / "trainscope-job.json").read_text())
    return {p["title"]: p for p in board["panels"] if p["type"] != "row"}


def test_runbook_link_is_a_variable_not_a_placeholder_host():
    """The link pointed at runbooks.example.com; now ${runbook_base}, by default the repository path."""
    for path in (ROOT / "dashboards" / "json").glob("*.json"):
        text = path.read_text()
        assert "example.com" not in text, path.name
        board = json.loads(text)
        link = next(x for x in board["links"] if x["title"] == "Runbook")
        assert link["url"] == "${runbook_base}"
        var = next(v for v in board["templating"]["list"] if v["name"] == "runbook_base")
        assert var["type"] == "textbox" and var["query"] == "deploy/runbook.md"
        assert (ROOT / var["query"]).is_file()


def test_dp_pp_matrix_colours_its_cells_and_the_heatmap_has_a_tooltip():
    panels = _job_panels()
    dp_pp = next(p for t, p in panels.items() if "DP x PP" in t)
    overrides = dp_pp["fieldConfig"]["overrides"]
    assert any(prop["id"] == "custom.cellOptions" and prop["value"]["type"] == "color-background"
               for o in overrides for prop in o["properties"])
    assert dp_pp["fieldConfig"]["defaults"]["color"]["mode"].startswith("continuous")
    heat = next(p for p in panels.values() if p["type"] == "heatmap")
    assert heat["options"]["tooltip"]["show"] is True


def test_rank_and_host_filters_reach_the_matrix_phase_and_kernel_panels():
    panels = _job_panels()
    for key in ("DP x PP", "Phase spread", "Kernels furthest"):
        expr = next(p for t, p in panels.items() if key in t)["targets"][0]["expr"]
        assert 'host=~"$host"' in expr and 'rank=~"$rank"' in expr, (key, expr)
