"""The compose stack's Prometheus configuration and the k8s PrometheusRule, checked by promtool.

(No Docker engine or Kubernetes here: the files are checked, not run.)
"""
import pathlib
import shutil
import subprocess

import pytest
import yaml

pytestmark = pytest.mark.integration
DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"


def promtool() -> str:
    p = shutil.which("promtool")
    if p is None:
        pytest.skip("promtool is not installed (apt-get install -y prometheus): deploy configs unchecked")
    return p


def test_compose_prometheus_config_and_rules_pass_promtool(tmp_path):
    shutil.copy(DEPLOY / "compose" / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(DEPLOY / "prometheus" / "trainscope-rules.yml", tmp_path / "trainscope-rules.yml")
    r = subprocess.run([promtool(), "check", "config", str(tmp_path / "prometheus.yml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_prometheusrule_groups_pass_promtool(tmp_path):
    rule = yaml.safe_load((DEPLOY / "k8s" / "prometheusrule.yaml").read_text())
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    r = subprocess.run([promtool(), "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
