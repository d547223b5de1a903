"""The compose stack's Alertmanager and Prometheus configs, and the plain Kubernetes manifests,
checked by the real tools (amtool, promtool, kubernetes-validate)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parent.parent / "docker"


@pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool (prometheus-alertmanager) not installed")
def test_amtool_checks_the_compose_alertmanager_config(tmp_path):
    cfg = DOCKER / "alertmanager" / "alertmanager.yml"
    r = subprocess.run(["amtool", "check-config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    # The check has teeth: a route to a receiver that does not exist fails.
    bad = yaml.safe_load(cfg.read_text())
    bad["route"]["receiver"] = "nobody"
    f = tmp_path / "bad.yml"
    f.write_text(yaml.safe_dump(bad))
    r = subprocess.run(["amtool", "check-config", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_checks_the_compose_prometheus_config_and_its_rules():
    r = subprocess.run(
        ["promtool", "check", "config", str(DOCKER / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout and "rules found" in r.stdout  # the rule file was loaded too


def test_plain_kubernetes_manifests_validate():
    kv = pytest.importorskip("kubernetes_validate")
    docs = [d for d in yaml.safe_load_all((DOCKER / "k8s" / "agent-daemonset.yaml").read_text()) if d]
    core = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert core
    for d in core:
        kv.validate(d, "1.33.0", strict=True)
