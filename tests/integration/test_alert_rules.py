"""The alert rules in deploy/prometheus/: promtool checks and unit tests, the
example configs, the runbook links, and the rules evaluated by a real
Prometheus scraping real trainscope collectors (processor and analyzer).

promtool and amtool ship with Debian's prometheus / prometheus-alertmanager
packages; without them these tests skip and say how to install them.
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainscope.analyzer.model import Finding, Scope, SuspectRank
from trainscope.analyzer.metrics import AnalyzerMetrics
from trainscope.deploy.cli import main
from trainscope.processor.prom_exporter import PrometheusConfig, PrometheusSink, start_metrics_server
from trainscope.analyzer.triggers import DeepDiveTriggers
from trainscope.processor.dive_upload import UploadMetrics
from trainscope.processor.selfmetrics import COUNTERS, GAUGES, SelfMetrics, deep_dive_control_metrics
from trainscope.proto.v1 import records_pb2

from support.prometheus_server import PrometheusServer, synthetic_output

pytestmark = pytest.mark.integration

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "trainscope-rules.yml"
RULES_TEST = DEPLOY / "prometheus" / "trainscope-rules.test.yml"
RUNBOOK = DEPLOY / "runbook.md"
HINT = ("is not installed: the alert-rule checks are skipped. Install it with "
        "`apt-get install -y prometheus prometheus-alertmanager` (Debian/Ubuntu).")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} {HINT}")
    return path


def _run(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(argv)} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _rules() -> list[dict]:
    import yaml  # the test extra installs PyYAML
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_check_rules():
    out = _run(_tool("promtool"), "check", "rules", str(RULES))
    assert "SUCCESS" in out


def test_promtool_unit_tests_of_every_alert():
    promtool = _tool("promtool")
    out = _run(promtool, "test", "rules", str(RULES_TEST))
    assert "SUCCESS" in out
    tested = set(re.findall(r"alertname: (\w+)", RULES_TEST.read_text()))
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    assert alerts <= tested, f"alerts without a promtool test: {alerts - tested}"


def test_example_configs_are_valid():
    _run(_tool("promtool"), "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    _run(_tool("amtool"), "check-config", str(DEPLOY / "prometheus" / "alertmanager.yml"))


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_is_labelled_annotated_and_has_a_runbook_section():
    anchors = {_anchor(h) for h in re.findall(r"^#{1,4} (.+)$", RUNBOOK.read_text(), flags=re.M)}
    for rule in _rules():
        if "alert" not in rule:
            continue
        name = rule["alert"]
        assert rule.get("for"), name
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["labels"]["category"] in ("training", "pipeline"), name
        ann = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(ann), name
        url = ann["runbook_url"]
        assert url.startswith("https://runbooks.example.com/trainscope/runbook.md#"), url
        assert url.split("#", 1)[1] == name.lower(), url
        assert name.lower() in anchors, f"runbook.md has no section for {name}"


def _exposed_names() -> set[str]:
    """Every series name the real processor and analyzer collectors expose."""
    metrics = SelfMetrics()
    sink = PrometheusSink(PrometheusConfig(), metrics)
    sink.export(synthetic_output(0, phases={"fwd": 10.0}, kernels={"gemm": 3}))
    analyzer = AnalyzerMetrics()
    registry = CollectorRegistry()
    # the deep dive's collectors too: the processor's control-path events and trace uploads, the
    # analyzer's trigger decisions
    for c in (metrics, sink, analyzer, deep_dive_control_metrics({}), UploadMetrics(), DeepDiveTriggers()):
        registry.register(c)
    names = {s.name for fam in text_string_to_metric_families(generate_latest(registry).decode())
             for s in fam.samples}
    # counter families with no sample yet expose name_total once they have one
    names |= {f"{fam.name}_total" if fam.type == "counter" else fam.name for fam in registry.collect()}
    # families with no sample yet (labelled ones before their first value, the analyzer's)
    names |= {f"trainscope_processor_{n}_total" for n in COUNTERS}
    names |= {f"trainscope_processor_{n}" for n in GAUGES}
    names |= {"trainscope_suspect_score", "trainscope_stall_seconds", "trainscope_rank_missing",
              "trainscope_diagnoses_total", "trainscope_job_iteration_state",
              "trainscope_job_stalled", "trainscope_verdict_state", "trainscope_verdict_confidence",
              "trainscope_verdict_suspect_impact_seconds", "trainscope_analyzer_detector_failures_total"}
    return names


def test_rules_use_only_metrics_trainscope_exposes():
    exposed = _exposed_names() | {"up"}
    rules = _rules()
    recorded = {r["record"] for r in rules if "record" in r}
    text = " ".join(r["expr"] + json.dumps(r.get("annotations", {})) for r in rules)
    used = set(re.findall(r"\b((?:trainscope|job|job_rank|job_kind)[a-z0-9_:]*)\b", text))
    used = {u for u in used if u.startswith("trainscope_") or ":" in u}
    assert used - exposed - recorded == set()
    # the PromQL the runbook gives on-call engineers too
    in_runbook = set(re.findall(r"\b(trainscope_[a-z0-9_]+|job[a-z_]*:[a-z0-9_:]+)", RUNBOOK.read_text()))
    assert in_runbook - exposed - recorded == set()


# ---------------------------------------------------------------- a real Prometheus
class RulesPrometheus(PrometheusServer):
    """The test tier's Prometheus with trainscope-rules.yml loaded (evaluated every second)."""

    def _write_config(self) -> pathlib.Path:
        path = super()._write_config()
        config = json.loads(path.read_text())
        config["rule_files"] = [str(RULES)]
        path.write_text(json.dumps(config, indent=2))
        return path


def _diagnoses(job: str) -> list[records_pb2.Diagnosis]:
    w = records_pb2.Window(index=0)
    return [Finding(level="L2", kind="straggler", job_id=job, window=w,
                    scope=Scope(phase="bwd", group="dp", group_index=0),
                    suspects=(SuspectRank(2, 2.5, impact_ns=25e6),), severity=0.3).to_pb()]


def _hang(job: str) -> list[records_pb2.Diagnosis]:
    """The collective hang's finding shape (analyzer/collectives.py): rank 3 never entered, peers waited 17 s."""
    w = records_pb2.Window(index=0)
    return [Finding(level="collectives", kind="stall", job_id=job, window=w, scope=Scope(group="collective"),
                    suspects=(SuspectRank(3, 17.0, {"waited_s": 17.0}, impact_ns=17e9, role="culprit"),),
                    severity=17.0, job_impact_ns=17e9, comparison="job").to_pb()]


def test_rules_evaluate_on_real_series_and_alerts_go_pending(prometheus_bin, tmp_path, capsys):
    metrics = SelfMetrics()
    sink = PrometheusSink(PrometheusConfig(port=0), metrics)
    analyzer = AnalyzerMetrics()
    registry = CollectorRegistry()
    for c in (metrics, sink, analyzer):
        registry.register(c)
    for r in range(4):  # rank 2 (node1) is slow in bwd
        sink.export(synthetic_output(r, window=0, iter_ms=150.0 if r == 2 else 100.0,
                                     phases={"fwd": 30.0, "bwd": 110.0 if r == 2 else 60.0}))
    analyzer.publish(_diagnoses("j"), None)
    analyzer.set_l1_state("j", "regression")
    analyzer.set_stalled("j2", True)
    analyzer.publish(_hang("j3"), None)
    server = start_metrics_server(registry, "127.0.0.1", 0)
    prom = RulesPrometheus(prometheus_bin, tmp_path / "prom", [f"127.0.0.1:{server.port}"])
    try:
        prom.start()
        prom.wait_for('trainscope_iterations_total{job="j"}', timeout_s=20)
        # progress and repeated flags between scrapes, as a live job and analyzer give
        prom.wait_for('count_over_time(trainscope_diagnoses_total{job="j"}[1m]) >= 2', timeout_s=20)
        for r in range(4):
            sink.export(synthetic_output(r, window=1, iter_ms=150.0 if r == 2 else 100.0))
        analyzer.publish(_diagnoses("j"), None)

        joined = prom.wait_for('job_rank:trainscope_suspect_score:with_rank_info{job="j"}', timeout_s=30)
        assert [(s["metric"]["rank"], s["metric"].get("host"), s["metric"].get("phase")) for s in joined] == [
            ("2", "node1", "bwd")]
        prom.wait_for('job:trainscope_iterations:rate10m{job="j"} > 0', timeout_s=30)

        def pending(result) -> bool:
            names = {a["labels"]["alertname"] for a in prom.api("alerts")["alerts"]}
            return {"TrainscopeJobStalled", "TrainscopeIterationRegression", "TrainscopeStragglerRank",
                    "TrainscopeCollectiveHang"} <= names

        prom.wait_for("vector(1)", pending, timeout_s=30)  # polls with a timeout; the query is a dummy
        alerts = {a["labels"]["alertname"]: a for a in prom.api("alerts")["alerts"]}
        straggler = alerts["TrainscopeStragglerRank"]
        assert straggler["state"] == "pending"
        assert straggler["annotations"]["summary"] == (
            "Job j: rank 2 on node1 (dp=1 tp=0 pp=0) is a straggler in phase bwd (costs 25ms per iteration)")
        assert {a["labels"]["job"] for a in prom.api("alerts")["alerts"]
                if a["labels"]["alertname"] == "TrainscopeJobStalled"} == {"j2", "j3"}
        # the wait in seconds, from trainscope_stall_seconds (not a per-iteration score)
        assert alerts["TrainscopeCollectiveHang"]["annotations"]["summary"] == (
            "Job j3 hangs in a collective: rank 3 never entered it while its peers had waited 17s")
        assert not prom.query('trainscope_suspect_score{job="j3"}')
        (stalled,) = [a for a in prom.api("alerts")["alerts"]
                      if a["labels"] == {**a["labels"], "alertname": "TrainscopeJobStalled", "job": "j3"}]
        assert stalled["annotations"]["summary"].endswith("ranks that stopped first: rank 3 (peers waited 17s)")
        assert alerts["TrainscopeIterationRegression"]["annotations"]["summary"] == (
            "Job j: iteration time regressed to 100ms per iteration; suspects: rank 2")
        for group in prom.api("rules")["groups"]:
            for rule in group["rules"]:
                assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))

        # trainscope query reads the same series
        assert main(["query", "stragglers", "--job", "j", "--since", "10m",
                     "--prometheus", prom.url, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert [(r["rank"], r["host"], r["phases"], r["flagged_now"]) for r in doc["rows"]] == [
            (2, "node1", ["bwd"], True)]
        assert doc["range"] == "600s"
        assert main(["query", "stragglers", "--job", "nope", "--prometheus", prom.url]) == 1
        assert "no trainscope series for job 'nope'" in capsys.readouterr().err
    finally:
        prom.stop()
        server.close()
