"""Every PromQL expression of every dashboard panel, against a real Prometheus.

No Grafana server can run here, so the dashboards' JSON is read the way
Grafana would use it: each target's ``expr`` with the template variables
substituted (job = the simulated job, host and rank = All), run against a
real Prometheus scraping a real processor whose /metrics also carries the
embedded analyzer's series (deploy/embedded.py's wiring), fed by a simulated
16-rank job with one GPU throttled. Every expression must return data, with
every label its ``legendFormat`` shows; the variables' ``label_values``
queries must list values.
"""
from __future__ import annotations

import json
import pathlib
import re
import time

import pytest

from support.prometheus_server import PrometheusServer, find_prometheus
from trainscope.collector.sim import SimConfig, parse_fault
from trainscope.deploy.embedded import EmbeddedAnalysis, run_sim_embedded
from trainscope.processor.prom_exporter import PrometheusConfig

pytestmark = pytest.mark.integration

BOARDS = pathlib.Path(__file__).resolve().parents[2] / "dashboards" / "json"
JOB = "dashjob"
SUSPECT = 5
VARS = {"$__rate_interval": "1m", "${trace_base}": "", "$job": JOB, "$host": ".*", "$rank": ".*"}


def substitute(expr: str) -> str:
    for k, v in VARS.items():
        expr = expr.replace(k, v)
    assert "$" not in expr.replace("$1", ""), f"unsubstituted variable in {expr}"
    return expr


def targets() -> list[tuple[str, str, str, str]]:
    """(dashboard, panel title, expr, legendFormat) of every target."""
    out = []
    for path in sorted(BOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for t in panel.get("targets", []):
                out.append((path.stem, panel["title"], t["expr"], t.get("legendFormat", "")))
    return out


def test_every_panel_expression_returns_the_labels_it_shows(tmp_path):
    binary = find_prometheus()
    if binary is None:
        pytest.skip("Prometheus is not installed (apt-get install -y prometheus): the dashboards' PromQL is untested")
    all_targets = targets()
    assert len(all_targets) >= 30 and {b for b, *_ in all_targets} == {
        "trainscope-fleet", "trainscope-job", "trainscope-pipeline"}
    failures: list[str] = []
    checked: dict[str, list] = {}
    state: dict = {}

    def on_start(proc, store_path):
        state["analysis"] = EmbeddedAnalysis(proc, store_path)

    def on_processor(proc):
        state["analysis"].finish()  # every window analysed: suspects and verdict on /metrics
        with PrometheusServer(binary, tmp_path / "prom", [f"127.0.0.1:{proc.metrics_server.port}"]) as prom:
            # rate() over 1m needs two scrapes (1 s apart) of every counter
            assert prom.wait_for(f'rate(trainscope_iterations_total{{job="{JOB}"}}[1m])', bool, timeout_s=30)
            assert prom.wait_for(f'trainscope_verdict_confidence{{job="{JOB}"}}', bool, timeout_s=30)
            for board, title, expr, legend in all_targets:
                res = prom.query(substitute(expr))
                labels = re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)
                if not res:
                    failures.append(f"{board} / {title}: no data for {expr}")
                    continue
                for r in res:
                    if "or on() vector(0)" in expr and not r["metric"]:
                        continue  # the explicit "none happened" zero of an error counter
                    missing = [lb for lb in labels if lb not in r["metric"]]
                    if missing:
                        failures.append(f"{board} / {title}: labels {missing} missing in {r['metric']}")
                checked[title] = res
            # the host variable filters: one host's four ranks only
            expr = next(e for _, t, e, _ in all_targets if t == "Iteration time per rank")
            one = prom.query(substitute(expr).replace('host=~".*"', 'host=~"sim-host-0001"'))
            checked["one host"] = one
            for path in sorted(BOARDS.glob("*.json")):
                for v in json.loads(path.read_text())["templating"]["list"]:
                    m = re.fullmatch(r"label_values\((.*), (\w+)\)", v.get("query") or "")
                    if v["type"] == "query":
                        assert m, v
                        vals = prom.api(f"label/{m.group(2)}/values", **{"match[]": substitute(m.group(1))})
                        if not vals:
                            failures.append(f"{path.stem}: variable {v['name']} lists no values")

    cfg = SimConfig(ranks=16, tp=2, pp=2, gpus_per_host=4, iterations=60, iteration_s=1.0, job_id=JOB,
                    faults=(parse_fault(f"gpu_throttle:rank={SUSPECT},onset=10s,factor=1.6"),),
                    home=str(tmp_path / "home"))
    run_sim_embedded(cfg, processor_options={"prometheus": PrometheusConfig(port=0)},
            on_start=on_start, on_processor=on_processor)
    assert not failures, "\n".join(failures)
    # the panels show the injected fault, not just any data
    culprits = [r["metric"]["rank"] for r in checked["Named suspects (impact, s/iteration)"]
                if r["metric"]["role"] == "culprit"]
    assert culprits == [str(SUSPECT)]
    heat = checked["Suspect impact, rank x time, grouped by host (s/iteration)"]
    assert len(heat) == 16  # every rank has a row, flagged or not
    top = max(heat, key=lambda r: float(r["value"][1]))
    assert top["metric"]["rank"] == str(SUSPECT) and top["metric"]["host"] == "sim-host-0001"
    peers = checked["Healthy peers (one per pipeline stage, not flagged)"]
    assert {r["metric"]["pp"] for r in peers} == {"0", "1"}
    assert all(r["metric"]["trace_rank"] == f"{int(r['metric']['rank']):05d}" for r in peers)
    assert str(SUSPECT) not in {r["metric"]["rank"] for r in peers}
    assert sorted(int(r["metric"]["rank"]) for r in checked["one host"]) == [4, 5, 6, 7]
    assert {r["metric"]["host"] for r in checked["one host"]} == {"sim-host-0001"}
    grid = checked["Suspect impact by DP x PP (s/iteration)"]
    assert len(grid) == 8  # dp 0..3 x pp 0..1
