"""The chart beside its neighbours (dcgm-exporter's and OpenCost's charts): it installs with its
defaults, offers the same extension points and puts each one where it belongs, creates its own
ServiceAccount with no token mounted unless the agent reads pods, renders the Prometheus
Operator's objects only where the Operator's API exists, and reaches the node-local dcgm-exporter.
(Lint and kubernetes-validate of every value set: tests/test_helm.py.)"""

from __future__ import annotations

import hashlib

import pytest
import yaml

from .test_helm import CHART, DIGEST, TOKENS, VALUE_SETS, _by_kind, _render, helm

EXT = VALUE_SETS["extension-points"]
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def _notes(values: dict) -> str:
    out = helm.Chart.load(str(CHART)).render(values, name="ce", namespace="monitoring", is_install=True)
    return next(v for k, v in out.items() if k.endswith("NOTES.txt"))


def _pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    return [
        (d["metadata"]["name"], d["spec"]["template"])
        for d in docs
        if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet")
    ]


def test_defaults_install_with_a_generated_token_the_api_reads_by_its_hash():
    k = _by_kind(_render({}))
    (sec,) = [s for s in k["Secret"] if s["metadata"]["name"] == "ce-costexporter-api-token"]
    token = sec["stringData"]["token"]
    assert len(token) == 40 and token.isalnum()
    tokens = yaml.safe_load(sec["stringData"]["tokens.yaml"])["tokens"]
    assert tokens == [
        {"name": "generated", "sha256": hashlib.sha256(token.encode()).hexdigest(), "teams": "*"}
    ]
    (api,) = [d for d in k["Deployment"] if d["metadata"]["name"].endswith("-api")]
    vol = next(v for v in api["spec"]["template"]["spec"]["volumes"] if v["name"] == "tokens")
    # The API gets the hash only, never the token itself.
    assert vol["secret"] == {
        "secretName": "ce-costexporter-api-token",
        "items": [{"key": "tokens.yaml", "path": "tokens.yaml"}],
    }
    notes = _notes({})
    assert "get secret ce-costexporter-api-token -o jsonpath='{.data.token}' | base64 -d" in notes
    # The open API stays possible, and says so.
    assert "OPEN, without tokens" in _notes({"api": {"allowOpen": True}})
    k = _by_kind(_render({"api": {"allowOpen": True}}))
    assert not any(s["metadata"]["name"].endswith("api-token") for s in k["Secret"])


@pytest.mark.parametrize(("mode", "rendered"), [("auto", False), ("present", True), ("absent", False)])
def test_operator_objects_only_where_the_operators_api_is(mode, rendered):
    """Offline Helm serves no monitoring.coreos.com/v1, as a cluster without the Operator: `auto`
    renders none of its objects (an install would fail on them) and NOTES says so."""
    values = {**TOKENS, "monitoringCRDs": mode, "podMonitor": {"enabled": True}}
    kinds = set(_by_kind(_render(values)))
    assert (kinds >= OPERATOR_KINDS) is rendered and (not (OPERATOR_KINDS & kinds)) is (not rendered)
    assert ("NOT installed here" in _notes(values)) is (not rendered)


def test_every_extension_point_lands_where_it_belongs():
    docs = _render(EXT)
    k = _by_kind(docs)
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding"}
    namespaces = {d["metadata"]["namespace"] for d in docs if d["kind"] not in cluster_scoped}
    assert namespaces == {"finops", "gpu-operator"}  # gpu-operator: the node-local dcgm Service only
    (sa,) = k["ServiceAccount"]
    assert sa["metadata"]["name"] == "ce-agent" and sa["automountServiceAccountToken"] is False
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:x"}
    pods = _pod_templates(docs)
    assert len(pods) == 4  # agent, watcher, API, Redis
    for name, t in pods:
        spec = t["spec"]
        assert spec["serviceAccountName"] == "ce-agent", name
        assert t["metadata"]["labels"]["cost-center"] == "ml-platform", name
        assert t["metadata"]["annotations"]["example.com/scrape"] == "false", name
        want = "system-node-critical" if name.endswith("-agent") else "system-cluster-critical"
        assert spec["priorityClassName"] == want, name
        # Only the agent reads pods from the API: only it gets a token.
        assert spec["automountServiceAccountToken"] is name.endswith("-agent"), name
        if not name.endswith("-redis"):
            c = spec["containers"][0]
            assert c["image"] == f"registry.example.com/costexporter@{DIGEST}", name
            assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in c["env"], name
    (ds,) = k["DaemonSet"]
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": "10%"},
    }
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--dcgm-url=http://ce-costexporter-dcgm-local.gpu-operator.svc:9400/metrics" in args
    assert "--time-slicing-replicas=4" in args
    assert [a for a in args if a.startswith("--k8s-")] == [
        "--k8s-team-label=example.com/team",
        "--k8s-team-label=team",
        "--k8s-api=on",
    ]
    watcher = next(d for d in k["Deployment"] if d["metadata"]["name"].endswith("-watcher"))
    env = {e["name"]: e.get("value") for e in watcher["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["COSTEXPORTER_ALERTMANAGER_URL"] == "http://alertmanager-operated.monitoring:9093"
    (sm,) = k["ServiceMonitor"]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (ep,) = sm["spec"]["endpoints"]
    assert ep["honorLabels"] is False
    assert ep["relabelings"] == [  # the cluster label first, then the user's
        {"targetLabel": "cluster", "replacement": "eu-west-1", "action": "replace"},
        {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"},
    ]
    assert ep["metricRelabelings"] == [{"sourceLabels": ["__name__"], "regex": "go_.*", "action": "drop"}]
    assert k["PrometheusRule"][0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_agent_reading_pods_gets_exactly_get_list_watch_on_pods():
    k = _by_kind(_render(EXT))
    (role,) = k["ClusterRole"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    (binding,) = k["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ce-agent", "namespace": "finops"}]
    # NVML, or the API switched off: no role, no token anywhere.
    for values in (TOKENS, {**TOKENS, "agent": {"source": "dcgm", "kubernetesJobs": {"api": False}}}):
        k = _by_kind(_render(values))
        assert "ClusterRole" not in k and "ClusterRoleBinding" not in k
        templates = list(_pod_templates(_render(values)))
        assert templates, values
        for name, t in templates:
            assert t["spec"]["automountServiceAccountToken"] is False, name
    off = _by_kind(_render({**TOKENS, "agent": {"source": "dcgm", "kubernetesJobs": {"api": False}}}))
    assert "--k8s-api=off" in off["DaemonSet"][0]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_an_existing_service_account_is_used_and_none_created():
    values = {**TOKENS, "serviceAccount": {"create": False, "name": "platform-sa"}}
    k = _by_kind(_render(values))
    assert "ServiceAccount" not in k
    assert {t["spec"]["serviceAccountName"] for _n, t in _pod_templates(_render(values))} == {"platform-sa"}


def test_the_node_local_dcgm_service_reaches_only_the_agents_node():
    k = _by_kind(_render(EXT))
    (svc,) = [s for s in k["Service"] if s["metadata"]["name"] == "ce-costexporter-dcgm-local"]
    assert svc["metadata"]["namespace"] == "gpu-operator"
    assert svc["spec"]["internalTrafficPolicy"] == "Local"  # each node's agent, its node's exporter
    assert svc["spec"]["selector"] == {"app": "nvidia-dcgm-exporter"}
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9400, "targetPort": 9400, "protocol": "TCP"}]
    # The standalone dcgm-exporter chart's pods by default; a selector given replaces it whole.
    k = _by_kind(_render({**TOKENS, "agent": {"source": "dcgm"}}))
    (svc,) = [s for s in k["Service"] if s["metadata"]["name"] == "ce-costexporter-dcgm-local"]
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "dcgm-exporter"}
    assert svc["metadata"]["namespace"] == "monitoring"
    # A URL of the user's own: no Service.
    k = _by_kind(_render(VALUE_SETS["dcgm+podmonitor+external-redis"]))
    assert not any(s["metadata"]["name"].endswith("dcgm-local") for s in k["Service"])
