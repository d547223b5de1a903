"""The Helm chart (deploy/helm/costexporter), checked by Helm's own Go engine (helm-python-sdk
binds the official SDK: lint and offline render, no cluster), every rendered manifest validated
with kubernetes-validate against a current Kubernetes, the prometheus-operator objects against
the operator's CRD models, and the PrometheusRule's rules through promtool."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from costexporter.tools.dashboard import render as render_dashboard
from costexporter.tools.rules import prometheus_rule, render, render_prometheus_rule

from .test_dashboard import _dropped

helm = pytest.importorskip("helm_python.chart", reason="helm-python-sdk (test extra) is not installed")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (test extra) is not installed")

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "costexporter"
KUBE = "1.33.0"  # a current release: Deployment/DaemonSet/StatefulSet apps/v1 as served today
TOKEN = {"name": "finance", "sha256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"}
TOKENS = {
    "api": {"tokens": [{**TOKEN, "teams": "*"}, {"name": "llm", "sha256": "ab" * 32, "teams": ["llm"]}]},
    # Offline, Helm's capabilities lack the Operator's API: render its objects as on a cluster with it.
    "monitoringCRDs": "present",
}
DIGEST = "sha256:" + "0123456789abcdef" * 4

# Value sets a user would install with; every one must lint, render and validate.
POLICY = {
    "cluster": "prod-east",
    "node_pools": {"spot": "gpu-spot-*"},
    "prices": [{"gpu_model": "*H100*", "node_pool": "spot", "price_per_gpu_hour": 1.4}],
    "rules": [{"namespace": "llm-*", "owner": {"team": "llm"}}],
}
VALUE_SETS = {
    "defaults": {},  # installs as is: a generated API token, no Operator objects without its API
    "defaults+tokens": TOKENS,
    "dcgm+podmonitor+external-redis": {
        **TOKENS,
        "policy": POLICY,
        "redis": {"enabled": False, "existingSecret": "my-redis", "existingSecretKey": "sentinel-url"},
        "agent": {
            "source": "dcgm",
            "dcgmUrl": "http://$(HOST_IP):9400/metrics",
            "kubernetesJobs": {"jobLabels": ["jobset.sigs.k8s.io/jobset-name"]},
        },
        "serviceMonitor": {"enabled": False},
        "podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "prices": {"currency": "EUR", "pricePerGpuHour": 2.9, "pricePerKwh": 0.21, "pue": 1.3},
        "watcher": {"shards": 3},
    },
    "redis-acl": {
        **TOKENS,
        "redis": {"acl": {"enabled": True, "trainers": [{"team": "llm"}, {"job": "j-1"}]}},
        "archive": {
            "enabled": True,
            "url": "s3://ledger-archive/prod",
            "cluster": "prod-east",
            "credentialsSecret": "archive-s3",
            "otherClusters": ["prod-west", "lab"],
        },
        "networkPolicy": {
            "enabled": True,
            "trainers": [
                {"namespaceSelector": {}, "podSelector": {"matchLabels": {"costexporter.io/trainer": "true"}}}
            ],
            "apiFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
        },
    },
    "own-redis+acl-secrets": {
        **TOKENS,
        "redis": {
            "enabled": False,
            "existingSecret": "admin-url",
            "acl": {"secrets": {"agent": "agent-url", "watcher": "watcher-url", "api": "api-url"}},
        },
    },
    "archive-on-a-volume": {
        **TOKENS,
        "cluster": "c1",
        "archive": {
            "enabled": True,
            "url": "/srv/archive",
            "existingClaim": "archive",
            "retention": {"enabled": False},
        },
    },
    "open-api+redis-url+no-watcher": {
        "api": {"allowOpen": True, "service": {"type": "LoadBalancer"}},
        "redis": {"enabled": False, "url": "rediss://costexporter:pw@redis.example:6380/0"},
        "watcher": {"enabled": False, "webhookUrl": "http://hooks/x"},
        "dashboard": {"namespace": "grafana", "labels": {"grafana_dashboard": "1", "team": "ml"}},
    },
    # Every extension point dcgm-exporter's and OpenCost's charts offer, at once.
    "extension-points": {
        "monitoringCRDs": "present",
        "namespaceOverride": "finops",
        "cluster": "eu-west-1",
        "image": {"repository": "registry.example.com/costexporter", "digest": DIGEST},
        "serviceAccount": {
            "create": True,
            "name": "ce-agent",
            "annotations": {"eks.amazonaws.com/role-arn": "arn:x"},
        },
        "podAnnotations": {"example.com/scrape": "false"},
        "podLabels": {"cost-center": "ml-platform"},
        "priorityClassName": "system-cluster-critical",
        "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}},
        "agent": {
            "source": "dcgm",
            "priorityClassName": "system-node-critical",
            "dcgm": {
                "localService": {"namespace": "gpu-operator", "selector": {"app": "nvidia-dcgm-exporter"}},
                "timeSlicingReplicas": 4,
            },
            "kubernetesJobs": {"teamLabels": ["example.com/team", "team"]},
        },
        "watcher": {"alertmanagerUrl": "http://alertmanager-operated.monitoring:9093"},
        "serviceMonitor": {
            "additionalLabels": {"release": "kube-prometheus-stack"},
            "honorLabels": False,
            "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}],
            "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "go_.*", "action": "drop"}],
        },
        "prometheusRule": {
            "additionalLabels": {"release": "kube-prometheus-stack"},
            "runbookUrl": "https://wiki.example.com/ml/costexporter-runbooks",
        },
    },
}


def _render(values: dict, name: str = "ce") -> list[dict]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values, name=name, namespace="monitoring", is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _chart_meta(chart: Path = CHART) -> dict:
    return yaml.safe_load((chart / "Chart.yaml").read_text())


def _by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_helm_lint_is_clean_in_strict_mode(values):
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE}")
    assert report["total_charts_linted"] == 1
    bad = [m for m in report["messages"] if m["severity"] >= 2]
    assert not bad and not report["errors"], report


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_every_rendered_manifest_validates_against_kubernetes(values):
    docs = _render(values)
    core = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert core
    for d in core:
        # strict: unknown fields are errors (a typo in a template is not silently dropped).
        kv.validate(d, KUBE, strict=True)


def test_operator_objects_match_the_prometheus_operator_crds():
    """ServiceMonitor, PodMonitor and PrometheusRule against the models generated from the
    prometheus-operator CRD schemas (types checked, unknown fields refused)."""
    models = pytest.importorskip("cloudcoil.models.prometheus_operator.v1")
    seen = set()
    for values in VALUE_SETS.values():
        for d in _render(values):
            if not d["apiVersion"].startswith("monitoring.coreos.com/"):
                continue
            model = getattr(models, d["kind"])
            obj = model.model_validate(d)
            dumped = obj.model_dump(by_alias=True, exclude_unset=True, mode="json")
            assert not _dropped(d, dumped), (d["kind"], _dropped(d, dumped))
            seen.add(d["kind"])
    assert seen == {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    # The check itself: a misspelt field is caught.
    bad = {**_by_kind(_render(TOKENS))["ServiceMonitor"][0]}
    bad["spec"] = {**bad["spec"], "endpoints": [{"port": "metrics", "intervall": "15s"}]}
    dumped = models.ServiceMonitor.model_validate(bad).model_dump(
        by_alias=True, exclude_unset=True, mode="json"
    )
    assert _dropped(bad, dumped) == [".spec.endpoints[0].intervall"]


def test_chart_copies_of_rules_and_dashboard_are_generated_from_the_source():
    assert (CHART / "files" / "costexporter-rules.yaml").read_text() == render()
    assert (CHART / "files" / "costexporter.json").read_text() == render_dashboard()
    rule = _by_kind(_render(TOKENS))["PrometheusRule"][0]
    assert rule["spec"] == prometheus_rule()["spec"]
    assert yaml.safe_load(render_prometheus_rule())["spec"] == rule["spec"]


def test_runbook_url_and_cluster_values_reach_the_rules_the_watcher_and_the_api():
    """`prometheusRule.runbookUrl` gives the rules `costexporter rules --runbook-url`'s links;
    `cluster` is the watcher's alert label and the API's OpenCost cluster, as the monitors'
    relabelings give it to every series."""
    values = VALUE_SETS["extension-points"]
    base = values["prometheusRule"]["runbookUrl"]
    k = _by_kind(_render(values))
    (rule,) = k["PrometheusRule"]
    assert rule["spec"] == prometheus_rule(runbooks=base)["spec"]
    links = [
        r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r
    ]
    assert links and all(u.startswith(base + "#") for u in links)
    watchers = 0
    for d in k["Deployment"]:
        env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env.get("COSTEXPORTER_CLUSTER") == "eu-west-1", d["metadata"]["name"]
        # The watcher's own alerts (JobHung, ...) link the same runbooks as the rules' alerts.
        name = d["metadata"]["name"]
        assert env.get("COSTEXPORTER_WATCH_RUNBOOK_URL") == (base if "-watcher" in name else None), name
        watchers += "-watcher" in name
    assert watchers >= 1
    assert {d["metadata"]["name"].rsplit("-", 1)[1] for d in k["Deployment"]} >= {"api", "watcher"}
    # Without the values: the project's runbooks, and no cluster.
    plain = _by_kind(_render(TOKENS))
    assert plain["PrometheusRule"][0]["spec"] == prometheus_rule()["spec"]
    assert plain["Deployment"]
    for d in plain["Deployment"]:
        names = {e["name"] for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert "COSTEXPORTER_CLUSTER" not in names and "COSTEXPORTER_WATCH_RUNBOOK_URL" not in names
    with pytest.raises(Exception, match="runbookUrl"):
        _render({**TOKENS, "prometheusRule": {"runbookUrl": "https://x/y#z"}})


CLI = (sys.executable, "-m", "costexporter.cli")


def test_cli_renders_the_prometheusrule(tmp_path):
    out = tmp_path / "pr.yaml"
    r = subprocess.run(
        [*CLI, "rules", "--format", "prometheusrule", "--name", "ce", "--short", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == "PrometheusRule" and doc["metadata"]["name"] == "ce"
    from costexporter.tools.rules import RuleWindows, rules

    assert doc["spec"] == rules(RuleWindows.short())


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_checks_the_rendered_prometheusrule(tmp_path):
    rule = _by_kind(_render(TOKENS))["PrometheusRule"][0]
    f = tmp_path / "rules.yaml"
    f.write_text(yaml.safe_dump(rule["spec"]))
    r = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    n = sum(len(g["rules"]) for g in rule["spec"]["groups"])
    assert f"SUCCESS: {n} rules found" in r.stdout


def test_rendered_workloads_carry_what_the_values_say():
    values = VALUE_SETS["dcgm+podmonitor+external-redis"]
    k = _by_kind(_render(values))
    (ds,) = k["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert "runtimeClassName" not in spec  # dcgm: no NVML inside the agent
    assert "--source=dcgm" in c["args"] and "--dcgm-url=http://$(HOST_IP):9400/metrics" in c["args"]
    assert "--k8s-job-label=jobset.sigs.k8s.io/jobset-name" in c["args"]
    assert {"--currency=EUR", "--price-per-gpu-hour=2.9", "--price-per-kwh=0.21", "--pue=1.3"} <= set(
        c["args"]
    )
    url = next(e for e in c["env"] if e["name"] == "COSTEXPORTER_REDIS_URL")
    assert url["valueFrom"]["secretKeyRef"] == {"name": "my-redis", "key": "sentinel-url"}
    assert "StatefulSet" not in k  # an existing Redis: none in the release
    assert (
        "ServiceMonitor" not in k
        and k["PodMonitor"][0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    )
    # The tokens Secret holds the hashes in the API's tokens-file format, mounted where the env says.
    (sec,) = [s for s in k["Secret"] if s["metadata"]["name"].endswith("api-tokens")]
    tokens = yaml.safe_load(sec["stringData"]["tokens.yaml"])
    assert tokens == {"tokens": VALUE_SETS["dcgm+podmonitor+external-redis"]["api"]["tokens"]}
    (api,) = [d for d in k["Deployment"] if d["metadata"]["name"].endswith("-api")]
    ac = api["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in ac["env"]}
    assert env["COSTEXPORTER_API_TOKENS_FILE"] == "/etc/costexporter/tokens/tokens.yaml"
    mount = next(m for m in ac["volumeMounts"] if m["name"] == "tokens")
    assert mount["mountPath"] == "/etc/costexporter/tokens"


def test_the_apis_budget_gauges_are_scraped_and_its_budget_alerts_posted():
    """api.metricsPort: a `metrics` port on the API's pod and Service, which the ServiceMonitor
    selects and the NetworkPolicy opens to the scrapers; api.alertmanagerUrl reaches the API."""
    budgets = {"budgets": [{"name": "llm", "team": "llm", "amount": 1000}]}
    values = {
        **TOKENS,
        "policy": budgets,
        "api": {**TOKENS["api"], "alertmanagerUrl": "http://am:9093"},
        "networkPolicy": {
            "enabled": True,
            "metricsFrom": [{"podSelector": {"matchLabels": {"app": "prom"}}}],
        },
    }
    k = _by_kind(_render(values))
    (api,) = [d for d in k["Deployment"] if d["metadata"]["name"].endswith("-api")]
    c = api["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-port=9405" in c["args"] and {"name": "metrics", "containerPort": 9405} in c["ports"]
    assert {"name": "COSTEXPORTER_ALERTMANAGER_URL", "value": "http://am:9093"} in c["env"]
    (svc,) = [d for d in k["Service"] if d["metadata"]["name"].endswith("-api")]
    assert {"name": "metrics", "port": 9405, "targetPort": "metrics"} in svc["spec"]["ports"]
    (sm,) = k["ServiceMonitor"]
    (sel,) = sm["spec"]["selector"]["matchExpressions"]
    assert "api" in sel["values"] and svc["metadata"]["labels"]["app.kubernetes.io/component"] == "api"
    (np_,) = [d for d in k["NetworkPolicy"] if d["metadata"]["name"].endswith("-api")]
    metrics = [r for r in np_["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": "metrics"}]]
    assert metrics and metrics[0]["from"] == values["networkPolicy"]["metricsFrom"]
    # 0: no port, no Service port, no rule
    k = _by_kind(_render({**TOKENS, "api": {**TOKENS["api"], "metricsPort": 0}}))
    (api,) = [d for d in k["Deployment"] if d["metadata"]["name"].endswith("-api")]
    c = api["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--metrics-port") for a in c["args"]) and len(c["ports"]) == 1


def test_the_charts_policy_schema_takes_every_key_the_policy_file_does():
    """A key the programs read but the schema refuses cannot be set through the chart."""
    import json

    from costexporter.core.budgets import BUDGET_KEYS
    from costexporter.core.terms import POLICY_KEYS

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["policy"]["properties"]
    assert set(schema) == set(POLICY_KEYS)
    assert set(schema["budgets"]["items"]["properties"]) == set(BUDGET_KEYS)


def test_policy_profiles_and_extra_volumes_reach_the_programs_as_files_they_read(tmp_path):
    """Who pays is the operator's and so is a GPU's profile: the chart's `policy` and `profiles`
    are ConfigMaps (or existing ones), mounted read-only into every agent and watcher and named
    by --policy / --profile; the files are ones the programs accept; extra volumes reach every
    costexporter pod."""
    from costexporter.core import profiles
    from costexporter.core.terms import parse_policy_file

    h200 = yaml.safe_load(profiles.save(profiles.derive(700.0, "H200"), tmp_path / "h200.yaml").read_text())
    extra = {
        "extraVolumes": [{"name": "ca", "secret": {"secretName": "corp-ca"}}],
        "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}],
    }
    values = {**VALUE_SETS["dcgm+podmonitor+external-redis"], "profiles": {"h200": h200}, **extra}
    k = _by_kind(_render(values))
    for d in k["ConfigMap"]:
        kv.validate(d, KUBE, strict=True)
    (cm,) = [c for c in k["ConfigMap"] if c["metadata"]["name"].endswith("-policy")]
    parsed = parse_policy_file(json.loads(cm["data"]["policy.json"]))
    assert parsed.pricing.cluster == "prod-east" and parsed.rules[0].owner == (("team", "llm"),)
    (pm,) = [c for c in k["ConfigMap"] if c["metadata"]["name"].endswith("-profiles")]
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "h200.json").write_text(pm["data"]["h200.json"])
    found = profiles.find("NVIDIA H200", tmp_path / "dir")  # as the agent finds it by model
    assert found is not None and found == profiles.derive(700.0, "H200")
    workloads = [*k["DaemonSet"], *(d for d in k["Deployment"] if "-watcher" in d["metadata"]["name"])]
    assert len(workloads) >= 2
    for d in workloads:
        spec = d["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert {
            "--policy=/etc/costexporter/policy/policy.json",
            "--profile=/etc/costexporter/profiles",
        } <= set(c["args"])
        mount = {"name": "policy", "mountPath": "/etc/costexporter/policy", "readOnly": True}
        assert mount in c["volumeMounts"]
        assert {"name": "profiles", "configMap": {"name": pm["metadata"]["name"]}} in spec["volumes"]
    # the API reads the policy's carbon_intensity (no profiles: it bands nothing)
    (api,) = [d for d in k["Deployment"] if d["metadata"]["name"].endswith("-api")]
    spec = api["spec"]["template"]["spec"]
    assert "--policy=/etc/costexporter/policy/policy.json" in spec["containers"][0]["args"]
    assert not any(a.startswith("--profile") for a in spec["containers"][0]["args"])
    assert {"name": "policy", "mountPath": "/etc/costexporter/policy", "readOnly": True} in spec[
        "containers"
    ][0]["volumeMounts"]
    assert {"name": "policy", "configMap": {"name": cm["metadata"]["name"]}} in spec["volumes"]
    for d in [*k["DaemonSet"], *k["Deployment"]]:
        spec = d["spec"]["template"]["spec"]
        if d["metadata"]["name"].endswith("-redis"):
            continue
        assert extra["extraVolumes"][0] in spec["volumes"], d["metadata"]["name"]
        assert extra["extraVolumeMounts"][0] in spec["containers"][0]["volumeMounts"]
    # an existing ConfigMap instead: none rendered, that one mounted
    own = _by_kind(_render({**values, "policyConfigMap": "my-policy", "profilesConfigMap": "my-profiles"}))
    assert not [
        c for c in own.get("ConfigMap", []) if c["metadata"]["name"].endswith(("-policy", "-profiles"))
    ]
    spec = own["DaemonSet"][0]["spec"]["template"]["spec"]
    assert {"name": "policy", "configMap": {"name": "my-policy"}} in spec["volumes"]
    assert {"name": "profiles", "configMap": {"name": "my-profiles"}} in spec["volumes"]
    plain = _by_kind(_render(TOKENS))
    assert not [
        c for c in plain.get("ConfigMap", []) if c["metadata"]["name"].endswith(("-policy", "-profiles"))
    ]
    args = [
        " ".join(d["spec"]["template"]["spec"]["containers"][0]["args"])
        for d in [*plain["DaemonSet"], *plain["Deployment"]]
    ]
    assert args and all("--policy" not in a and "--profile" not in a for a in args)


def test_registry_pull_secrets_monitor_and_ingress_knobs_render_valid_objects():
    """What neighbouring charts take: global.imageRegistry honoured on every image (never
    accepted and ignored), imagePullSecrets as names or {name}, the ServiceMonitor's
    scrapeTimeout and namespace, the API Service's annotations and an Ingress; every object
    valid for Kubernetes (strict)."""
    values = {
        **TOKENS,
        "global": {"imageRegistry": "mirror.corp:5000"},
        "imagePullSecrets": ["regcred", {"name": "other"}],
        "serviceMonitor": {"enabled": True, "scrapeTimeout": "10s", "namespace": "monitoring-system"},
        "api": {
            **TOKENS["api"],
            "service": {"annotations": {"cloud.example/internal": "true"}},
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "hosts": [{"host": "cost.corp", "paths": [{"path": "/api", "pathType": "Prefix"}]}],
                "tls": [{"hosts": ["cost.corp"], "secretName": "cost-tls"}],
            },
        },
    }
    docs = _render({**values, "monitoringCRDs": "present"})
    k = _by_kind(docs)
    for d in docs:
        if not d["apiVersion"].startswith("monitoring.coreos.com/"):
            kv.validate(d, KUBE, strict=True)
    pods = [
        d["spec"]["template"]["spec"]
        for kind in ("DaemonSet", "Deployment", "StatefulSet")
        for d in k.get(kind, [])
    ]
    assert pods
    for spec in pods:
        assert spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "other"}]
        for c in spec["containers"]:
            assert c["image"].startswith("mirror.corp:5000/"), c["image"]
    images = {c["image"] for spec in pods for c in spec["containers"]}
    assert (
        f"mirror.corp:5000/costexporter/costexporter:{_chart_meta()['appVersion']}" in images
        and "mirror.corp:5000/redis:7.4" in images
    )
    (sm,) = k["ServiceMonitor"]
    assert sm["metadata"]["namespace"] == "monitoring-system"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["monitoring"]}
    assert sm["spec"]["endpoints"][0]["scrapeTimeout"] == "10s"
    (svc,) = [d for d in k["Service"] if d["metadata"]["name"].endswith("-api")]
    assert svc["metadata"]["annotations"] == {"cloud.example/internal": "true"}
    (ing,) = k["Ingress"]
    assert ing["spec"]["ingressClassName"] == "nginx" and ing["spec"]["tls"][0]["secretName"] == "cost-tls"
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": svc["metadata"]["name"], "port": {"name": "http"}}
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE}")
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report


def test_watcher_shards_are_one_deployment_each_behind_one_service():
    one = [d for d in _by_kind(_render(TOKENS))["Deployment"] if "-watcher" in d["metadata"]["name"]]
    assert [d["metadata"]["name"] for d in one] == ["ce-costexporter-watcher"]  # the name users have
    args = one[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--shard") for a in args)
    k = _by_kind(_render(VALUE_SETS["dcgm+podmonitor+external-redis"]))
    shards = sorted(
        (d for d in k["Deployment"] if "-watcher" in d["metadata"]["name"]),
        key=lambda d: d["metadata"]["name"],
    )
    assert [d["metadata"]["name"] for d in shards] == [f"ce-costexporter-watcher-{i}" for i in range(3)]
    selectors = []
    for i, d in enumerate(shards):
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        assert [a for a in args if a.startswith("--shard")] == [f"--shard={i}/3"]
        sel = d["spec"]["selector"]["matchLabels"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= labels.items()  # each Deployment owns its pods
        selectors.append(sel)
    # No Deployment's selector matches another shard's pods.
    assert len(selectors) == len(shards) == 3
    for i, sel in enumerate(selectors):
        for j, d in enumerate(shards):
            pod = d["spec"]["template"]["metadata"]["labels"]
            assert (sel.items() <= pod.items()) == (i == j)
    (svc,) = [s for s in k["Service"] if s["metadata"]["name"].endswith("-watcher")]
    for d in shards:  # the one Service (and so the monitors) covers every shard
        assert svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()


def test_the_in_chart_redis_acl_file_is_what_costexporter_acl_prints_and_each_part_logs_in(tmp_path):
    """redis.acl: the init container's script (run here, with the real CLI) writes an ACL file a
    real redis-server loads; each part's URL names its own user, and a trainer's user is refused
    the ledger."""
    import os
    import uuid

    import redis

    from costexporter.store import keys

    from .redis_server import free_port

    docs = _by_kind(_render(VALUE_SETS["redis-acl"]))
    [sts] = docs["StatefulSet"]
    [init] = sts["spec"]["template"]["spec"]["initContainers"]
    [server] = sts["spec"]["template"]["spec"]["containers"]
    assert server["args"][-2:] == ["--aclfile", "/acl/users.acl"]
    [secret] = [d for d in docs["Secret"] if d["metadata"]["name"].endswith("-redis-acl")]
    pw = secret["stringData"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for e in init["env"]:
        env[e["name"]] = e.get("value") or pw[e["valueFrom"]["secretKeyRef"]["key"]]
    script = init["args"][0].replace("/acl/", f"{tmp_path}/")
    r = subprocess.run([*init["command"], script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--aclfile", str(tmp_path / "users.acl")],
        stdout=subprocess.DEVNULL,
    )
    try:
        anon = redis.Redis(port=port, decode_responses=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert anon.ping()  # the readiness probe, as the default user
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with pytest.raises(redis.exceptions.NoPermissionError):
            anon.get("x")
        users = set(redis.Redis(port=port, username="admin", password=pw["admin"]).acl_users())
        assert users >= {"costexporter-agent", "costexporter-trainer-llm", "costexporter-trainer-j-1"}
        assert users >= {"costexporter-sealer", "costexporter-retention"}
        assert docs["DaemonSet"] and docs["Deployment"] and docs["CronJob"], docs.keys()
        for kind in ("DaemonSet", "Deployment", "CronJob"):
            for d in docs[kind]:
                c = _containers(d)[0]
                url = next(e["value"] for e in c["env"] if e["name"] == "COSTEXPORTER_REDIS_URL")
                key = next(e for e in c["env"] if e["name"] == "REDIS_ACL_PASSWORD")["valueFrom"]
                user = url.split("//")[1].split(":")[0]
                as_part = redis.Redis(port=port, username=user, password=pw[key["secretKeyRef"]["key"]])
                assert as_part.ping(), user
        t = redis.Redis(port=port, username="costexporter-trainer-llm", password=pw["trainer-llm"])
        assert t.xadd(keys.stream_key("costexporter", "llm/run-1"), {"v": "1"})
        for k in (keys.total_key("costexporter", "llm/run-1"), keys.stream_key("costexporter", "other")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                t.hset(k, "f", uuid.uuid4().hex)
    finally:
        proc.terminate()
        proc.wait(10)


def test_in_chart_redis_keeps_an_aof_on_a_volume_and_is_the_default_url():
    k = _by_kind(_render(TOKENS))
    (sts,) = k["StatefulSet"]
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--dir") + 1] == "/data"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    (sec,) = [s for s in k["Secret"] if s["metadata"]["name"].endswith("redis-url")]
    assert sec["stringData"]["url"] == "redis://ce-costexporter-redis:6379/0"
    assert any(s["metadata"]["name"] == "ce-costexporter-redis" for s in k["Service"])
    (ds,) = k["DaemonSet"]
    assert ds["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    (cm,) = k["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["costexporter.json"]) == json.loads(render_dashboard())


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {**TOKENS, "agent": {"source": "dcgm", "dcgm": {"localService": {"enabled": False}}}},
            "agent.dcgmUrl",
        ),
        ({**TOKENS, "image": {"repository": "x", "digest": "latest"}}, "/image/digest"),
        ({**TOKENS, "monitoringCRDs": "yes"}, "/monitoringCRDs"),
        ({**TOKENS, "redis": {"enabled": False}}, "redis.existingSecret"),
        ({**TOKENS, "agent": {"source": "smi"}}, "/agent/source"),  # values.schema.json
        ({**TOKENS, "agent": {"sourc": "dcgm"}}, "'sourc' not allowed"),  # a typo is not ignored
        ({"api": {"tokens": [{"name": "f", "sha256": "hunter2", "teams": "*"}]}}, "/api/tokens/0/sha256"),
        # The API refuses these at start (a token that sees no team, or "*" inside a list):
        # the chart refuses them first.
        ({"api": {"tokens": [{**TOKEN, "teams": []}]}}, "/api/tokens/0/teams"),
        ({"api": {"tokens": [{**TOKEN, "teams": [""]}]}}, "/api/tokens/0/teams"),
        ({"api": {"tokens": [{**TOKEN, "teams": ["llm", "*"]}]}}, "/api/tokens/0/teams"),
        ({**TOKENS, "prices": {"currency": "usd"}}, "/prices/currency"),
        ({**TOKENS, "watcher": {"shards": 0}}, "/watcher/shards"),
        (
            {**TOKENS, "redis": {"enabled": False, "url": "redis://r:6379/0", "acl": {"enabled": True}}},
            "redis.acl.enabled writes the users of the in-chart Redis",
        ),
        (
            {**TOKENS, "redis": {"acl": {"enabled": True, "trainers": [{"team": "a/b"}]}}},
            "/redis/acl/trainers/0",
        ),
        (
            {
                **TOKENS,
                "api": {**TOKENS["api"], "alertmanagerUrl": "http://am:9093"},
                "policy": {"cluster": "c"},
            },
            "policy.budgets names none",
        ),
        ({**TOKENS, "api": {**TOKENS["api"], "alertmanagerUrl": "am:9093"}}, "/api/alertmanagerUrl"),
        ({**TOKENS, "archive": {"enabled": True, "cluster": "c"}}, "archive.enabled needs archive.url"),
        ({**TOKENS, "archive": {"enabled": True, "url": "s3://b/r"}}, "archive.enabled needs a cluster name"),
        ({**TOKENS, "archive": {"enabled": True, "url": "/srv/a", "cluster": "c"}}, "archive.existingClaim"),
        ({**TOKENS, "archive": {"enabled": True, "url": "ftp://x", "cluster": "c"}}, "/archive/url"),
        (
            {**TOKENS, "cluster": "a", "archive": {"enabled": True, "url": "s3://b/r", "cluster": "b"}},
            "archive.cluster and cluster differ",
        ),
    ],
)
def test_chart_fails_closed_with_a_one_line_reason(values, message):
    with pytest.raises(Exception) as e:
        _render(values)
    assert message in str(e.value)
    assert "Traceback" not in str(e.value)


def _containers(d: dict) -> list[dict]:
    """A workload's containers (a CronJob's are in its job template)."""
    if d["kind"] in ("DaemonSet", "Deployment"):
        return d["spec"]["template"]["spec"]["containers"]
    if d["kind"] == "CronJob":
        return d["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return []


def test_the_archive_cronjobs_seal_and_expire_and_the_api_reads_the_archive():
    docs = _by_kind(_render(VALUE_SETS["redis-acl"]))
    jobs = {d["metadata"]["name"]: d for d in docs["CronJob"]}
    assert set(jobs) == {"ce-costexporter-archive-seal", "ce-costexporter-archive-expire"}
    for name, d in jobs.items():
        assert d["spec"]["concurrencyPolicy"] == "Forbid"
        (c,) = _containers(d)
        assert c["args"][:2] == ["archive", name.rsplit("-", 1)[1]]
        assert "--archive=s3://ledger-archive/prod" in c["args"] and "--cluster=prod-east" in c["args"]
        assert c["envFrom"] == [{"secretRef": {"name": "archive-s3"}}]
        url = next(e["value"] for e in c["env"] if e["name"] == "COSTEXPORTER_REDIS_URL")
        role = {"seal": "sealer", "expire": "retention"}[c["args"][1]]
        assert url.startswith(f"redis://costexporter-{role}:")  # its own Redis user
    (api,) = [d for d in docs["Deployment"] if d["metadata"]["name"].endswith("-api")]
    (c,) = _containers(api)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert (
        env["COSTEXPORTER_ARCHIVE"] == "s3://ledger-archive/prod"
        and env["COSTEXPORTER_CLUSTER"] == "prod-east"
    )
    assert [a for a in c["args"] if a.startswith("--archive-cluster")] == [
        "--archive-cluster=prod-west",
        "--archive-cluster=lab",
    ]
    vol = _by_kind(_render(VALUE_SETS["archive-on-a-volume"]))
    (seal,) = vol["CronJob"]  # no retention: no expire job
    (c,) = _containers(seal)
    assert {"name": "archive", "mountPath": "/srv/archive"} in c["volumeMounts"]
    claims = [
        v
        for v in seal["spec"]["jobTemplate"]["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "archive"
    ]
    assert claims == [{"name": "archive", "persistentVolumeClaim": {"claimName": "archive"}}]


def test_every_container_command_is_one_the_cli_accepts():
    """The chart's args against the real `costexporter` CLI: an option the CLI does not have
    fails here, not in the cluster."""
    import sys

    checked = set()
    for values in VALUE_SETS.values():
        for d in _render(values):
            for c in _containers(d):
                checked.add(c["args"][0])
                r = subprocess.run(
                    [sys.executable, "-m", "costexporter.cli", *c["args"], "--help"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert r.returncode == 0, (d["metadata"]["name"], c["args"], r.stderr)
    assert checked >= {"serve", "watch", "api", "archive"}, checked  # every part ran


# --- NetworkPolicies, evaluated as the API server's semantics define them -----------------------


def _selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); {} selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_admits(peer: dict, policy_ns: str, src: dict, namespaces: dict) -> bool:
    if "ipBlock" in peer:
        return False  # a pod's address is never in these tests' blocks
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], namespaces[src["ns"]]):
            return False
    elif src["ns"] != policy_ns:
        return False
    return _selects(peer.get("podSelector"), src["labels"])


def _reaches(policies: list[dict], src: dict, dst: dict, port_name: str, namespaces: dict) -> bool:
    """Whether `src` may open a TCP connection to `dst`'s named port (ingress side only)."""
    number = dst["ports"][port_name]
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == dst["ns"]
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], dst["labels"])
    ]
    if not selecting:
        return True  # a pod no policy selects is not isolated
    for p in selecting:
        for rule in p["spec"].get("ingress") or []:
            ports = rule.get("ports") or [{}]
            if not any(q.get("port") in (None, number, port_name) for q in ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_admits(peer, dst["ns"], src, namespaces) for peer in peers):
                return True
    return False


def _pods(docs: list[dict]) -> dict[str, dict]:
    """One pod per workload of a render: its namespace, labels and named container ports."""
    out = {}
    for d in docs:
        if d["kind"] not in ("DaemonSet", "Deployment", "StatefulSet"):
            continue
        tpl = d["spec"]["template"]
        ports = {p["name"]: p["containerPort"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
        name = f"{d['metadata']['labels']['app.kubernetes.io/instance']}/{d['metadata']['name']}"
        out[name] = {"ns": d["metadata"]["namespace"], "labels": tpl["metadata"]["labels"], "ports": ports}
    return out


def test_network_policies_let_only_the_parts_and_the_trainers_reach_redis():
    """With networkPolicy.enabled, the in-chart Redis takes connections from this release's
    agents, watcher shards and API and from the trainer pods the values name, and from no one
    else (another release's agent, a trainer-labelled pod in another namespace, Prometheus); the
    metrics ports only from the scrapers named; the API from anyone when apiFrom is empty."""
    ns_of = lambda n: {"kubernetes.io/metadata.name": n}  # noqa: E731
    values = {
        **TOKENS,
        "redis": {"acl": {"enabled": True, "trainers": [{"team": "llm"}]}},
        "watcher": {"shards": 2},
        "networkPolicy": {
            "enabled": True,
            "trainers": [
                {
                    "namespaceSelector": {"matchLabels": ns_of("training")},
                    "podSelector": {"matchLabels": {"costexporter.io/trainer": "true"}},
                }
            ],
            "metricsFrom": [
                {
                    "namespaceSelector": {"matchLabels": ns_of("monitoring")},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                }
            ],
        },
    }
    docs = _render(values)
    policies = _by_kind(docs)["NetworkPolicy"]
    for p in policies:
        kv.validate(p, KUBE, strict=True)
    pods = _pods(docs) | {f"other/{k}": v for k, v in _pods(_render(values, name="other")).items()}
    namespaces = {n: ns_of(n) for n in ("monitoring", "training", "research")}
    trainer = {"costexporter.io/trainer": "true"}
    pods |= {
        "trainer": {"ns": "training", "labels": trainer, "ports": {}},
        "trainer-elsewhere": {"ns": "research", "labels": trainer, "ports": {}},
        "stranger": {"ns": "monitoring", "labels": {"app": "debug"}, "ports": {}},
        "prometheus": {"ns": "monitoring", "labels": {"app.kubernetes.io/name": "prometheus"}, "ports": {}},
    }
    [redis_pod] = [k for k in pods if k.startswith("ce/") and k.endswith("-redis")]
    reach_redis = {
        k
        for k in pods
        if k != redis_pod and _reaches(policies, pods[k], pods[redis_pod], "redis", namespaces)
    }
    parts = {k for k in pods if k.startswith("ce/") and not k.endswith("-redis")}
    assert len([k for k in parts if "watcher" in k]) == 2 and any("agent" in k for k in parts)
    assert reach_redis == parts | {"trainer"}
    agent = next(pods[k] for k in parts if k.endswith("-agent"))
    api = next(pods[k] for k in parts if k.endswith("-api"))
    assert {k for k in pods if _reaches(policies, pods[k], agent, "metrics", namespaces)} == {"prometheus"}
    assert all(_reaches(policies, pods[k], api, "http", namespaces) for k in pods)
    # The evaluator itself: without the policies every pod reaches Redis.
    open_docs = _render({**values, "networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in _by_kind(open_docs)
    assert all(_reaches([], pods[k], pods[redis_pod], "redis", namespaces) for k in pods)


# --- helm upgrade from the released chart ---------------------------------------------------------

PREVIOUS = ROOT / "tests" / "data" / "helm" / "costexporter-0.1.0.tgz"  # the chart as released


def _semver(v: str) -> tuple:
    """A SemVer precedence key: 0.2.0-dev.0 < 0.2.0, numbers before pre-releases compare."""
    core, _, pre = v.partition("-")
    parts = tuple(int(x) for x in core.split("."))
    return (
        *parts,
        0 if pre else 1,
        tuple(int(x) if x.isdigit() else x for x in pre.split(".")) if pre else (),
    )


def _render_chart(chart, values: dict, *, upgrade: bool) -> dict[tuple[str, str], dict]:
    out = chart.render(values, name="ce", namespace="monitoring", is_install=not upgrade, is_upgrade=upgrade)
    docs = [
        d
        for path, text in sorted(out.items())
        if not path.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d
    ]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


# What Kubernetes refuses to change in place (an upgrade that changes it fails, or loses data).
IMMUTABLE = {
    "DaemonSet": [("spec", "selector")],
    "Deployment": [("spec", "selector")],
    "StatefulSet": [("spec", "selector"), ("spec", "serviceName"), ("spec", "volumeClaimTemplates")],
    "Secret": [("type",)],
    "Service": [("spec", "clusterIP")],
}


def _at(doc: dict, path: tuple) -> object:
    for k in path:
        doc = (doc or {}).get(k)
    return doc


@pytest.mark.parametrize(
    "name", ["defaults+tokens", "dcgm+podmonitor+external-redis", "open-api+redis-url+no-watcher"]
)
def test_helm_upgrade_from_the_released_chart_keeps_what_kubernetes_cannot_change(name):
    """`helm upgrade` from 0.1.0 with the same values, rendered by both charts and diffed: the
    chart's version moved on; no workload's selector, no StatefulSet's service or volume claims,
    no Secret's type changes (Kubernetes refuses those in place); nothing that holds state (the
    Redis StatefulSet and its volume, the generated token and passwords' Secrets) is renamed or
    dropped; every new Service still selects the pods it selected."""
    values = VALUE_SETS[name]
    old_chart = helm.Chart.load(str(PREVIOUS))
    old_version = yaml.safe_load(_untar(PREVIOUS, "costexporter/Chart.yaml"))["version"]
    assert _semver(_chart_meta()["version"]) > _semver(old_version)
    old = _render_chart(old_chart, _values_for(values, PREVIOUS), upgrade=False)
    new = _render_chart(helm.Chart.load(str(CHART)), values, upgrade=True)
    dropped = sorted(set(old) - set(new))
    assert not [k for k in dropped if k[0] in ("StatefulSet", "Secret", "PersistentVolumeClaim")], dropped
    changed = []
    for key in sorted(set(old) & set(new)):
        for path in IMMUTABLE.get(key[0], []):
            if _at(old[key], path) != _at(new[key], path):
                changed.append((key, path, _at(old[key], path), _at(new[key], path)))
    assert not changed, changed
    pods = [d for d in new.values() if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet")]
    services = [key for key in set(old) & set(new) if key[0] == "Service"]
    assert services
    for key in services:
        sel = new[key]["spec"]["selector"]
        before = [
            p
            for p in pods
            if _selects(
                {"matchLabels": old[key]["spec"]["selector"]}, p["spec"]["template"]["metadata"]["labels"]
            )
        ]
        after = [
            p for p in pods if _selects({"matchLabels": sel}, p["spec"]["template"]["metadata"]["labels"])
        ]
        assert after == before and after, key
    # The diff a reviewer reads (pytest -s prints it): what the upgrade adds, drops and changes.
    diff = _object_diff(old, new)
    print(f"helm upgrade {old_version} -> {_chart_meta()['version']} ({name}):\n{diff}")
    assert diff


def _untar(archive: Path, member: str) -> str:
    import tarfile

    with tarfile.open(archive) as t:
        f = t.extractfile(member)
        assert f is not None
        return f.read().decode()


def _values_for(values: dict, archive: Path) -> dict:
    """The same values, less the keys the older chart's schema does not know (it refuses them)."""
    known = json.loads(_untar(archive, "costexporter/values.schema.json"))["properties"]
    return {k: v for k, v in values.items() if k in known}


def _object_diff(old: dict, new: dict) -> str:
    import difflib

    lines = [f"+ {k}/{n}" for k, n in sorted(set(new) - set(old))]
    lines += [f"- {k}/{n}" for k, n in sorted(set(old) - set(new))]
    volatile = ("helm.sh/chart", "app.kubernetes.io/version", "checksum/")
    for key in sorted(set(old) & set(new)):
        a, b = (yaml.safe_dump(d, sort_keys=True).splitlines() for d in (old[key], new[key]))
        body = [
            line
            for line in difflib.unified_diff(a, b, lineterm="", n=0)
            if line[:1] in "+-"
            and not line.startswith(("+++", "---"))
            and not any(v in line for v in volatile)
        ]
        if body:
            lines.append(f"~ {key[0]}/{key[1]}: {len(body)} lines")
    return "\n".join(lines)


def test_the_charts_app_version_is_the_packages_version():
    """The chart's default image tag (appVersion) names the release its templates were written
    for: the package's version, SemVer-spelt (0.2.0.dev0 is 0.2.0-dev.0)."""
    from packaging.version import Version

    import costexporter

    assert Version(_chart_meta()["appVersion"]) == Version(costexporter.__version__)
