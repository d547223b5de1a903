"""The Grafana dashboard against Grafana's dashboard schema (the models
grafana-foundation-sdk generates from it), and its promises: the watcher's state coloured, the
team/Hostname/gpu variables, thresholds from the job's profile, money in its label's currency,
a burn rate, annotations. With a real Prometheus: joins with dcgm-exporter's series and every query."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from costexporter.services.notify import STATES
from costexporter.tools import dashboard as dash

ROOT = Path(__file__).resolve().parent.parent

# Grafana's AnnotationQuery keeps a datasource's own fields beside the common ones; these are
# Prometheus's (what Grafana's annotation editor saves for a Prometheus query).
PROMETHEUS_ANNOTATION_FIELDS = {"step", "titleFormat", "textFormat", "tagKeys", "useValueForTime"}
LEGACY_VARIABLE_FIELDS = {"definition"}  # what Grafana shows as the query's text; still saved


def _dropped(given, back, path="") -> list[str]:
    """Keys of `given` that a schema model did not keep (fields its schema does not have: Grafana's
    here, the prometheus-operator CRDs' in test_helm), and lists it shortened."""
    out = []
    if isinstance(given, dict):
        for k, v in given.items():
            if not isinstance(back, dict) or k not in back:
                out.append(f"{path}.{k}")
            else:
                out += _dropped(v, back[k], f"{path}.{k}")
    elif isinstance(given, list) and isinstance(back, list):
        if len(given) != len(back):
            out.append(f"{path}: {len(given)} items, {len(back)} kept")
        for i, (a, b) in enumerate(zip(given, back, strict=False)):
            out += _dropped(a, b, f"{path}[{i}]")
    return out


def schema_problems(d: dict) -> list[str]:
    """Round-trip the dashboard through the schema models (the panel plugins' options and field
    configs included) and list what they dropped."""
    sdk = pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk (test extra)")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    assert sdk
    register_default_plugins()
    back = json.loads(json.dumps(Dashboard.from_json(d), cls=JSONEncoder))
    allowed = []
    for i, a in enumerate(d["annotations"]["list"]):
        allowed += [f".annotations.list[{i}].{k}" for k in PROMETHEUS_ANNOTATION_FIELDS & set(a)]
    for i, v in enumerate(d["templating"]["list"]):
        allowed += [f".templating.list[{i}].{k}" for k in LEGACY_VARIABLE_FIELDS & set(v)]
    return [p for p in _dropped(d, back) if p not in allowed]


def test_dashboard_matches_grafanas_schema():
    d = json.loads((ROOT / "dashboards" / "costexporter.json").read_text())
    assert d == dash.dashboard()
    assert schema_problems(d) == []
    # The check has teeth: a misspelt panel option, field config and panel key are all caught.
    bad = dash.dashboard()
    bad["panels"][0]["fieldConfig"]["defaults"]["custom"] = {"fillOpacityy": 10}
    bad["panels"][1]["options"] = {"colourMode": "background"}
    bad["panels"][2]["gridpos"] = {}
    assert sorted(schema_problems(bad)) == [
        ".panels[0].fieldConfig.defaults.custom.fillOpacityy",
        ".panels[1].options.colourMode",
        ".panels[2].gridpos",
    ]


def _panel(title: str) -> dict:
    return next(p for p in dash.dashboard()["panels"] if p["title"].startswith(title))


def test_watcher_state_is_mapped_to_colours_hung_red():
    p = _panel("Watcher: job state")
    (m,) = p["fieldConfig"]["defaults"]["mappings"]
    by_text = {o["text"]: (int(code), o["color"]) for code, o in m["options"].items()}
    assert set(by_text) == set(STATES)  # every state the watcher can report
    assert by_text["hung"][1] == "red" and by_text["crashed"][1] == "dark-red"
    assert by_text["running"][1] == "green"
    # The query yields each state's code: the n-th term adds n for the n-th state.
    expr = p["targets"][0]["expr"]
    for state, (code, _) in by_text.items():
        assert f'costexporter_job_state="{state}"}} == 1) * 0 + {code}\n' in expr + "\n"


def test_variables_cluster_team_job_hostname_gpu_chain():
    v = {x["name"]: x for x in dash.dashboard()["templating"]["list"]}
    assert list(v) == [
        "datasource",
        "cluster",
        "team",
        "namespace",
        "training_job",
        "instance",
        "Hostname",
        "gpu",
    ]
    assert "$team" in v["namespace"]["query"]["query"] and "$namespace" in v["training_job"]["query"]["query"]
    assert v["namespace"]["allValue"] == ".*"  # a job without a namespace stays listed
    assert (
        "$training_job" in v["instance"]["query"]["query"] and "$instance" in v["Hostname"]["query"]["query"]
    )
    assert v["cluster"]["query"]["query"] == "label_values(costexporter_job_info, cluster)"
    assert v["cluster"]["includeAll"] and v["cluster"]["allValue"] == ".*"  # matches no label too
    assert "$cluster" in v["team"]["query"]["query"] and "$cluster" in v["training_job"]["query"]["query"]
    assert "$team" in v["training_job"]["query"]["query"]  # team narrows the jobs
    assert "$training_job" in v["Hostname"]["query"]["query"] and "$Hostname" in v["gpu"]["query"]["query"]
    exprs = [t["expr"] for p in dash.dashboard()["panels"] for t in p["targets"]]
    per_gpu = [e for e in exprs if "costexporter_gpu_" in e and "costexporter_gpu_time" not in e]
    assert per_gpu, exprs
    for e in per_gpu:
        assert 'Hostname=~"$Hostname"' in e and 'gpu=~"$gpu"' in e, e


def test_every_job_query_keeps_clusters_apart_as_the_rules_do():
    """Jobs of one name in two clusters stay two series: every selector of a job narrows to the
    chosen cluster, and every aggregation that keeps the job keeps the cluster."""
    d = dash.dashboard()
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in d["annotations"]["list"]]
    assert len(exprs) > 15
    for e in exprs:
        assert e.count('training_job=~"$training_job"') == e.count('cluster=~"$cluster",training_job=~'), e
    groupings = [(e, by) for e in exprs for by in re.findall(r"by \(([^)]*)\)", e)]
    assert len(groupings) >= 8, groupings
    for e, by in groupings:
        labels = [x.strip() for x in by.split(",")]
        assert "training_job" not in labels or labels[:2] == ["cluster", "training_job"], e
    assert sum("by (cluster, training_job" in e for e in exprs) >= 8


def test_power_thresholds_come_from_the_jobs_profile_not_b300():
    from costexporter.core.profiles import B300

    p = _panel("Power per GPU")
    text = json.dumps(p)
    for w in (B300.idle_max_w, B300.low_max_w, B300.compute_min_w):
        assert f"{w:g}" not in text  # no B300 number baked in
    edges = next(t for t in p["targets"] if t["refId"] == "B")
    assert "costexporter_job_band_edge_watts" in edges["expr"]
    (tr,) = [t for t in p["transformations"] if t["id"] == "configFromData"]
    assert tr["options"]["configRefId"] == "B"
    assert {m["fieldName"] for m in tr["options"]["mappings"]} == {"idle_max", "low_max", "compute_min"}
    assert {m["handlerKey"] for m in tr["options"]["mappings"]} == {"threshold1"}


def test_money_is_shown_in_the_currency_of_its_label():
    for title in ("Cumulative cost", "Cost per valid step", "Burn rate"):
        p = _panel(title)
        assert p["fieldConfig"]["defaults"]["unit"] == "short"  # not a fixed USD
        for t in p["targets"]:
            assert "({{currency}})" in t["legendFormat"]
        units = {o["properties"][0]["value"] for o in p["fieldConfig"]["overrides"]}
        assert {"currencyUSD", "currencyEUR", "currencyGBP", "currencyJPY"} <= units
    assert "currencyUSD" not in json.dumps([p["fieldConfig"]["defaults"] for p in dash.dashboard()["panels"]])


def test_burn_rate_and_annotations():
    p = _panel("Burn rate")
    assert "rate(costexporter_cost_total" in p["targets"][0]["expr"] and "* 3600" in p["targets"][0]["expr"]
    names = {a["name"]: a for a in dash.dashboard()["annotations"]["list"]}
    assert "ALERTS" in names["Incidents"]["expr"]
    assert "hung|crashed" in names["Watcher: hung or crashed"]["expr"]
    assert "costexporter_job_in_allowance" in names["Declared phases"]["expr"]


# ---- a real Prometheus: DCGM joins and every dashboard query -----------------------------------

PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (.ci/run installs it)")
def test_a_real_prometheus_joins_costexporter_and_dcgm_series_on_uuid(shared, prefix, tmp_path):
    from .redis_server import free_port
    from .test_k8s import HOST, FakeDcgmExporter, _serve, uuid
    from .test_stack import _prometheus, _query

    exp = FakeDcgmExporter(
        [
            {"power": 1000.0, "util": 100, "pod": "llama-ft-worker-0", "ns": "ml",
             "labels": {"training_kubeflow_org_job_name": "llama-ft", "team": "llm"}},
            {"power": 135.0, "util": 0},
        ]
    )  # fmt: skip
    port, prom_port = free_port(), free_port()
    dcgm_target = exp.url.removeprefix("http://").removesuffix("/metrics")
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "dcgm", "static_configs": [{"targets": [dcgm_target]}]},
                    # As the chart's ServiceMonitor: the exporter's pod/namespace labels win, and
                    # the chart's `cluster` value becomes every series' `cluster` label.
                    {
                        "job_name": "costexporter",
                        "honor_labels": True,
                        "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
                        "relabel_configs": [{"target_label": "cluster", "replacement": "east"}],
                    },
                ],
            }
        )
    )
    agent = _serve(exp.url, prefix, port)
    prom = _prometheus(tmp_path / "prometheus.yml", prom_port)
    base = f"http://127.0.0.1:{prom_port}"
    join = (
        "costexporter_gpu_power_watts * on (UUID) group_left (modelName, pci_bus_id) "
        "(DCGM_FI_DEV_GPU_UTIL / 100)"
    )
    try:
        deadline = time.monotonic() + 90
        res: list = []
        while time.monotonic() < deadline:
            try:
                res = _query(base, join)
                edges = _query(base, "costexporter_job_band_edge_watts")
                rated = _query(base, "rate(costexporter_cost_total[5m])")  # two scrapes of it
            except OSError:
                res, edges, rated = [], [], []
            if len(res) == 2 and edges and rated:
                break
            time.sleep(1)
        # No label_replace: both sides carry DCGM's UUID.
        by_uuid = {r["metric"]["UUID"]: r for r in res}
        assert set(by_uuid) == {uuid(0), uuid(1)}
        got = by_uuid[uuid(0)]
        assert float(got["value"][1]) == pytest.approx(1000.0)  # 1000 W x 100 %
        assert got["metric"]["modelName"] == "NVIDIA B300 SXM6 AC" and got["metric"]["Hostname"] == HOST
        assert got["metric"]["namespace"] == "ml" and got["metric"]["pod"] == "llama-ft-worker-0"
        # The other direction, DCGM's series filtered by the jobs costexporter knows.
        mine = 'costexporter_gpu_power_watts{training_job!=""}'
        dcgm = _query(base, f"DCGM_FI_DEV_POWER_USAGE * on (UUID) group_left (training_job) {mine}")
        assert [r["metric"]["training_job"] for r in dcgm] == ["ml:llama-ft"]
        # The profile's edges for the dashboard's thresholds (B300 here), and the team variable.
        assert {r["metric"]["edge"]: float(r["value"][1]) for r in edges} == {
            "idle_max": 165.0,
            "low_max": 320.0,
            "compute_min": 850.0,
        }
        info = _query(base, "costexporter_job_info")
        assert [(r["metric"]["team"], r["metric"]["namespace"]) for r in info] == [("llm", "ml")]
        # Every dashboard query (annotations too) is valid PromQL here; the per-job ones answer.
        # (a pod's job posts no steps: no energy per valid step)
        expected_empty = ("ALERTS", "costexporter_job_state", "seconds_since_last_step", "suspect_rank",
                          "training_job:", "training_job_category:", "in_allowance",
                          "costexporter_energy_joules_total",
                          "costexporter_straggler_wait_ratio")  # (nor a rank named slow)  # fmt: skip
        empty, other = [], []
        for cluster in (".*", "east", "west"):
            for expr in dash.expressions(annotations_too=True, cluster=cluster):
                for var, value in (
                    ("$training_job", "ml:llama-ft"),
                    ("$namespace", ".*"),
                    ("$instance", ".*"),
                ):
                    expr = expr.replace(var, value)
                out = _query(base, expr)
                if cluster == "west" and out and 'cluster=~"west"' in expr:
                    other.append(expr)  # another cluster's selection shows none of this one's
                elif cluster != "west" and not out and not any(k in expr for k in expected_empty):
                    empty.append((cluster, expr))
        assert not empty, empty
        assert not other, other
        assert {r["metric"].get("cluster") for r in info} == {"east"}
    finally:
        prom.terminate()
        agent.terminate()
        agent.communicate(timeout=30)
        prom.wait(30)
        exp.close()
