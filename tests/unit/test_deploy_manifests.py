"""deploy/compose, deploy/k8s and deploy/Dockerfile, validated offline.

No Docker engine or Kubernetes API server runs here, so nothing is started or
built: the compose file is validated against the compose specification's
JSON schema (as vendored by check-jsonschema: vendor.compose-spec), the
built-in Kubernetes kinds against their OpenAPI schemas (kubernetes-validate,
strict: unknown fields fail), and the Prometheus Operator kinds (PodMonitor,
PrometheusRule; no schema ships offline) by what they must say: the selector
finds the pods, the port exists, the rules are the tested rule file's.
``docker build`` cannot run here: the Dockerfile is checked by reading it.
"""
from __future__ import annotations

import importlib.resources
import json
import pathlib
import re
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"


def compose_schema_errors(doc: dict) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema", reason="install the test extra (check-jsonschema ships the schema)")
    schema = json.loads(importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in cls(schema).iter_errors(doc)]


def load_compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())


def test_compose_file_follows_the_compose_specification():
    assert compose_schema_errors(load_compose()) == []
    broken = load_compose()
    broken["services"]["processor"]["restart"] = ["always"]  # the validator does reject
    assert compose_schema_errors(broken)


def test_compose_runs_the_whole_stack_and_publishes_only_loopback_ports():
    services = load_compose()["services"]
    assert {"kafka", "processor", "analyzer", "prometheus", "alertmanager", "grafana"} <= set(services)
    kafka = services["kafka"]["environment"]
    assert "controller" in kafka["KAFKA_PROCESS_ROLES"] and "ZOOKEEPER" not in json.dumps(kafka).upper()
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    # the rules, dashboards and provisioning the compose file mounts exist
    for svc in services.values():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / "compose" / src).resolve().exists(), src
    assert "--web.enable-remote-write-receiver" in services["prometheus"]["command"]
    assert "unix:///tmp/trainscope/processor.sock" in services["processor"]["command"]
    # training containers are told the shared socket: the collector's own default is per user now
    doc = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    client = doc["x-training-client"]
    assert client["environment"]["TRAINSCOPE_PROCESSOR"] == "unix:///tmp/trainscope/processor.sock"
    assert "trainscope-uds:/tmp/trainscope" in client["volumes"] and client["user"] == "10001"
    prom = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in prom["scrape_configs"]} == {"trainscope-processor", "trainscope-analyzer"}
    assert all(j["honor_labels"] for j in prom["scrape_configs"])
    prov = DEPLOY / "compose" / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    dash = yaml.safe_load((prov / "dashboards" / "trainscope.yml").read_text())["providers"][0]
    assert any(v.endswith(":" + dash["options"]["path"] + ":ro") for v in services["grafana"]["volumes"])


def k8s_docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def test_builtin_kubernetes_kinds_validate_strictly():
    kv = pytest.importorskip("kubernetes_validate", reason="install the test extra")
    builtin = [(n, d) for n, d in k8s_docs() if not d["apiVersion"].startswith(("monitoring.coreos.com",
                                                                                  "kustomize.config"))]
    assert {d["kind"] for _, d in builtin} == {"Namespace", "DaemonSet", "Deployment"}
    for name, doc in builtin:
        kv.validate(doc, K8S_VERSION, strict=True)
    bad = dict(builtin[0][1], spce={})  # a misspelt field is refused
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_processor_shares_the_socket_by_hostpath_and_analyzer_replicas_share_a_group():
    docs = {d["kind"]: d for _, d in k8s_docs() if d["kind"] in ("DaemonSet", "Deployment")}
    ds = docs["DaemonSet"]["spec"]["template"]["spec"]
    uds = next(v for v in ds["volumes"] if v["name"] == "uds")
    assert uds["hostPath"]["path"] == "/run/trainscope"
    proc = next(c for c in ds["containers"] if c["name"] == "processor")
    assert {"name": "uds", "mountPath": "/tmp/trainscope"} in proc["volumeMounts"]
    assert proc["args"][proc["args"].index("--listen") + 1] == "unix:///tmp/trainscope/processor.sock"
    assert not any("containerPort" in p for p in proc.get("ports", []))  # gRPC never on the network
    dep = docs["Deployment"]["spec"]
    assert dep["replicas"] > 1
    an = dep["template"]["spec"]["containers"][0]["args"]
    assert an[0] == "analyzer" and "--kafka-bootstrap" in an and "--group-id" in an


def test_podmonitors_find_the_pods_and_their_metrics_port():
    workloads = {d["metadata"]["name"]: d for _, d in k8s_docs() if d["kind"] in ("DaemonSet", "Deployment")}
    monitors = [d for _, d in k8s_docs() if d["kind"] == "PodMonitor"]
    assert len(monitors) == 2
    for m in monitors:
        target = workloads[m["metadata"]["name"]]["spec"]["template"]
        assert m["spec"]["selector"]["matchLabels"].items() <= target["metadata"]["labels"].items()
        ports = {p["name"] for c in target["spec"]["containers"] for p in c.get("ports", [])}
        for ep in m["spec"]["podMetricsEndpoints"]:
            assert ep["port"] in ports and ep["honorLabels"] is True


def test_prometheusrule_is_the_tested_rule_file():
    sys.path.insert(0, str(DEPLOY / "k8s"))
    import sync_rules
    assert (DEPLOY / "k8s" / "prometheusrule.yaml").read_text() == sync_rules.render(), \
        "run python deploy/k8s/sync_rules.py"
    rule = next(d for _, d in k8s_docs() if d["kind"] == "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load((DEPLOY / "prometheus" / "trainscope-rules.yml").read_text())["groups"]
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in (DEPLOY / "k8s").glob("*.yaml")
                                               if p.name != "kustomization.yaml")


def test_dockerfile_installs_trainscope_and_runs_unprivileged():
    """Read, not built: no Docker engine runs here."""
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert lines[0].startswith("FROM python:3.1")
    copied = set(re.findall(r"^COPY (\w+)/", text, re.M))
    pkg_dirs = set(__import__("tomllib").loads((ROOT / "pyproject.toml").read_text())
                   ["tool"]["setuptools"]["package-dir"].values())
    assert pkg_dirs <= copied, f"the image misses {pkg_dirs - copied}"
    assert re.search(r"^USER 10001$", text, re.M) and 'ENTRYPOINT ["trainscope"]' in text
    assert "socat" in text  # the metrics sidecars' command
