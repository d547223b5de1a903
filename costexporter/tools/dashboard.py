"""The Grafana dashboard (Grafana 10+ JSON), built here so its queries stay next to the metric
and recording-rule names they use; `dashboards/costexporter.json` is `render()`'s output (a test
keeps them equal, and checks it against Grafana's dashboard schema). `costexporter dashboard -o
FILE` writes it.

Layout: the four zones of R7 (docs/background.md) first (cumulative cost, current step, cost per valid step,
invalid time), then the burn rate, wasted GPU-hours by category and GPU-hours at risk, the
watcher's state (coloured: hung red), a state timeline of each GPU's band, power per GPU with the
band edges of the job's own profile drawn next to utilization per GPU (to show how utilization
lies, R1), and the alerts. Variables: cluster -> team -> training job, Hostname -> gpu (DCGM's
label names); every query keeps clusters apart (`by (cluster, training_job)`, as the rules).
Money is shown in the currency of its `currency` label. Annotations mark incidents (firing
alerts, the watcher's hung/crashed) and declared phases.
"""

from __future__ import annotations

import json
import re
from typing import Any

from costexporter.core import bandtable
from costexporter.core.model import VALID_NAMES, WASTED_NAMES

# The cluster's and job's selectors. `cluster` is the label the monitors' relabelings give every
# series (one Prometheus, many clusters); where no series has it, the variable has only its All
# value, `.*`, which also matches a series without the label.
CLUSTER = 'cluster=~"$cluster"'
JOB = f'{CLUSTER},training_job=~"$training_job"'
GPU = f'{JOB},Hostname=~"$Hostname",gpu=~"$gpu"'  # per-GPU series (DCGM's label names)
ALL = ".*"  # the All value of the cluster/team/Hostname/gpu variables
# The `category` label's regex of wasted time, joined from the one list as tools/rules.py joins it.
WASTED = "|".join(WASTED_NAMES)
# Watcher states (services/notify.py STATES) as codes with their colours: hung must be red.
STATE_COLORS = {
    "running": "green",
    "done": "blue",
    "crashed": "dark-red",
    "hung": "red",
    "starving": "orange",
    "unknown": "#808080",
}
# Grafana's currency units; a currency outside this list is shown as a plain number with its
# code in the legend.
CURRENCY_UNITS = ("USD", "EUR", "GBP", "JPY", "CHF", "INR", "KRW", "BRL", "SEK", "NOK", "DKK", "PLN", "ZAR")
DS = {"type": "prometheus", "uid": "${datasource}"}


def band_code_expr() -> str:
    """Each GPU's band as its code (the Band enum), one series per rank: every band's 0/1
    series kept where 1, mapped to the band's code, and combined."""
    names = bandtable.current().names
    terms = [f'(costexporter_gpu_band{{{GPU},band="{b}"}} == 1) * 0 + {i}' for i, b in enumerate(names)]
    return "max by (cluster, training_job, rank, Hostname, gpu) (\n  " + "\n  or ".join(terms) + "\n)"


def state_code_expr() -> str:
    """The watcher's state of each job as a code (position in STATE_COLORS), for value mappings."""
    terms = [
        f'(costexporter_job_state{{{JOB},costexporter_job_state="{st}"}} == 1) * 0 + {i}'
        for i, st in enumerate(STATE_COLORS)
    ]
    return "max by (cluster, training_job) (\n  " + "\n  or ".join(terms) + "\n)"


def _money(**custom: Any) -> dict[str, Any]:
    """Field config of a money panel: the unit follows the series' currency label (shown in the
    legend as `(EUR)`), not a fixed USD."""
    d: dict[str, object] = {"unit": "short"}
    if custom:
        d["custom"] = custom
    overrides = [
        {
            "matcher": {"id": "byRegexp", "options": f".*\\({c}\\).*"},
            "properties": [{"id": "unit", "value": f"currency{c}"}],
        }
        for c in CURRENCY_UNITS
    ]
    return {"fieldConfig": {"defaults": d, "overrides": overrides}}


def _mappings(codes: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {
            "type": "value",
            "options": {
                str(i): {"text": n, "color": color, "index": i} for i, (n, color) in enumerate(codes.items())
            },
        }
    ]


def _target(expr: str, legend: str = "", instant: bool = False, ref: str = "A") -> dict[str, Any]:
    t: dict[str, object] = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t.update(instant=True, range=False)
    return t


def _panel(
    kind: str, title: str, grid: tuple[int, int, int, int], targets: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    x, y, w, h = grid
    p = {
        "type": kind,
        "title": title,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": targets,
    }
    p.update(extra)
    return p


def _defaults(unit: str = "short", **custom: Any) -> dict[str, Any]:
    defaults: dict[str, object] = {"unit": unit}
    if custom:
        defaults["custom"] = custom
    return {"fieldConfig": {"defaults": defaults, "overrides": []}}


def _variable(name: str, label: str, metric: str, of: str, **extra: Any) -> dict[str, Any]:
    q = f"label_values({metric}, {of})"
    v = {
        "name": name,
        "type": "query",
        "label": label,
        "datasource": DS,
        "query": {"query": q, "refId": name},
        "definition": q,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "current": {},
        "hide": 0,
        "sort": 1,
    }
    v.update(extra)
    return v


def dashboard() -> dict[str, Any]:
    panels = []
    # Row 1: the four zones of R7 (docs/background.md).
    panels.append(
        _panel(
            "timeseries",
            "Cumulative cost",
            (0, 0, 6, 8),
            [_target(f"training_job:costexporter_cost:sum{{{JOB}}}", "{{training_job}} ({{currency}})")],
            description="Everything booked to the job (valid, overhead and wasted), net of rollbacks, "
            "in the currency of its label.",
            **_money(),
        )
    )
    panels.append(
        _panel(
            "stat",
            "Current step",
            (6, 0, 6, 8),
            [
                _target(f"max by (cluster, training_job) (costexporter_job_last_step{{{JOB}}})", "step"),
                _target(
                    f"max by (cluster, training_job) (costexporter_job_valid_steps{{{JOB}}})",
                    "valid steps",
                    ref="B",
                ),
            ],
            description="The newest step; it can drop after a resume. Valid steps exclude voided ones.",
            **_defaults("none"),
        )
    )
    panels.append(
        _panel(
            "timeseries",
            "Cost per valid step",
            (12, 0, 6, 8),
            [
                _target(
                    f"training_job:costexporter_cost_per_valid_step:ratio{{{JOB}}}",
                    "{{training_job}} ({{currency}})",
                )
            ],
            description="Sum of cost over agents / valid steps. It climbs while steps do not.",
            **_money(),
        )
    )
    panels.append(
        _panel(
            "timeseries",
            "Invalid time (wasted GPU-hours)",
            (18, 0, 6, 8),
            [
                _target(
                    f"training_job_category:costexporter_wasted_gpu_hours:sum{{{JOB}}}",
                    "{{category}}",
                )
            ],
            **_defaults("h", stacking={"mode": "normal"}, fillOpacity=40),
        )
    )
    # Row 2: the burn rate, where the waste went, what is at risk, what the watcher says.
    panels.append(
        _panel(
            "timeseries",
            "Burn rate (per hour)",
            (0, 8, 6, 7),
            [
                _target(
                    "sum by (cluster, training_job, currency) "
                    f"(rate(costexporter_cost_total{{{JOB}}}[5m])) * 3600",
                    "{{training_job}} ({{currency}})",
                ),
                _target(
                    "sum by (cluster, training_job, currency) "
                    f'(rate(costexporter_cost_total{{{JOB},category=~"{WASTED}"}}[5m]))'
                    " * 3600",
                    "{{training_job}} wasted ({{currency}})",
                    ref="B",
                ),
            ],
            description="Money spent per hour over the last 5 minutes, and the part of it wasted.",
            **_money(),
        )
    )
    panels.append(
        _panel(
            "bargauge",
            "Wasted GPU-hours by category",
            (6, 8, 6, 7),
            [
                _target(
                    f"sum by (category) (training_job_category:costexporter_wasted_gpu_hours:sum{{{JOB}}})",
                    "{{category}}",
                    instant=True,
                )
            ],
            options={"displayMode": "gradient", "orientation": "horizontal"},
            **_defaults("h"),
        )
    )
    panels.append(
        _panel(
            "stat",
            "GPU-hours at risk since the last checkpoint",
            (12, 8, 4, 7),
            [
                _target(
                    f"sum by (cluster, training_job) (costexporter_gpu_time_at_risk_seconds{{{JOB}}}) / 3600",
                    "{{training_job}}",
                )
            ],
            description="Work lost if the job had to restart from its last saved checkpoint now.",
            **_defaults("h"),
        )
    )
    panels.append(
        _panel(
            "stat",
            "Watcher: job state",
            (16, 8, 4, 7),
            [_target(state_code_expr(), "{{training_job}}", instant=True)],
            description="running green, done blue, starving orange, hung red, crashed dark red.",
            options={
                "textMode": "value_and_name",
                "colorMode": "background",
                "graphMode": "none",
                "reduceOptions": {"calcs": ["lastNotNull"]},
            },
            fieldConfig={
                "defaults": {
                    "unit": "none",
                    "mappings": _mappings(STATE_COLORS),
                    "color": {"mode": "thresholds"},
                    "thresholds": {"mode": "absolute", "steps": [{"color": "#808080", "value": None}]},
                },
                "overrides": [],
            },
        )
    )
    panels.append(
        _panel(
            "stat",
            "Seconds since the last step",
            (20, 8, 4, 7),
            [
                _target(
                    f"max by (cluster, training_job) (costexporter_job_seconds_since_last_step{{{JOB}}})",
                    "since",
                ),
                _target(
                    f"max by (cluster, training_job) (costexporter_job_suspect_rank{{{JOB}}})",
                    "suspect rank",
                    ref="B",
                ),
            ],
            **_defaults("none"),
        )
    )
    # Row 3: each GPU's band over time.
    panels.append(
        _panel(
            "state-timeline",
            "Band of each GPU",
            (0, 15, 24, 9),
            [_target(band_code_expr(), "{{Hostname}} GPU {{gpu}} rank {{rank}}")],
            options={"showValue": "never", "mergeValues": True, "rowHeight": 0.9},
            fieldConfig={
                "defaults": {
                    "mappings": _mappings({r.name: r.colour for r in bandtable.current().rows}),
                    "color": {"mode": "thresholds"},
                    "custom": {"fillOpacity": 80},
                },
                "overrides": [],
            },
        )
    )
    # Row 4: power (with the band edges of the job's profile) beside utilization.
    edges = ("idle_max", "low_max", "compute_min")
    panels.append(
        _panel(
            "timeseries",
            "Power per GPU (band edges of the job's profile)",
            (0, 24, 12, 9),
            [
                _target(f"costexporter_gpu_power_watts{{{GPU}}}", "{{Hostname}} GPU {{gpu}} rank {{rank}}"),
                _target(
                    f"max by (edge) (costexporter_job_band_edge_watts{{{JOB}}})",
                    "{{edge}}",
                    instant=True,
                    ref="B",
                ),
            ],
            description="Threshold lines: idle at or below idle_max, deadlock/checkpoint waiters below "
            "low_max, compute at or above compute_min, from the band profile the agents classify the "
            "job's GPUs with (B300's by default; a calibrated or derived one for other models).",
            fieldConfig={
                "defaults": {
                    "unit": "watt",
                    "thresholds": {"mode": "absolute", "steps": [{"color": "text", "value": None}]},
                    "custom": {"thresholdsStyle": {"mode": "line+area"}},
                },
                "overrides": [],
            },
            # The profile's edges (query B) become the thresholds of the power series (query A).
            transformations=[
                {
                    "id": "configFromData",
                    "options": {
                        "configRefId": "B",
                        "mappings": [
                            {"fieldName": e, "handlerKey": "threshold1", "reducerId": "lastNotNull"}
                            for e in edges
                        ],
                        "applyTo": {"id": "byFrameRefID", "options": "A"},
                    },
                }
            ],
        )
    )
    panels.append(
        _panel(
            "timeseries",
            "Utilization per GPU (reads 100% in a deadlock)",
            (12, 24, 12, 9),
            [
                _target(
                    f"costexporter_gpu_utilization_ratio{{{GPU}}}", "{{Hostname}} GPU {{gpu}} rank {{rank}}"
                )
            ],
            description="Utilization only says a kernel is scheduled, not that it does useful work: "
            "compare with power.",
            **_defaults("percentunit"),
        )
    )
    # Row 5: goodput over the job's life (the rolling 1 h and 24 h figures are recording rules).
    valid = f'costexporter_gpu_time_seconds_total{{{JOB},category=~"{"|".join(VALID_NAMES)}"}}'
    held = f'costexporter_gpu_time_seconds_total{{{JOB},category!="unassigned"}}'
    voided = f"sum by (cluster, training_job) (costexporter_voided_gpu_time_seconds_total{{{JOB}}})"

    def net(expr: str) -> str:
        total = f"sum by (cluster, training_job) ({expr})"
        return f"({total} - ({voided} or {total} * 0))"

    panels.append(
        _panel(
            "timeseries",
            "Runtime goodput: valid over held GPU time",
            (0, 33, 12, 8),
            [_target(f"{net(valid)}\n/ ({net(held)} > 0)", "{{training_job}}")],
            description="Productive, communication and starved GPU time over every GPU-second the job "
            "held, since it started (docs/accounting.md, goodput; the 1 h and 24 h figures, ETTR and "
            "MFU are recording rules).",
            **_defaults("percentunit"),
        )
    )
    panels.append(
        _panel(
            "timeseries",
            "Energy per valid step",
            (12, 33, 12, 8),
            [
                _target(
                    f"sum by (cluster, training_job) (costexporter_energy_joules_total{{{JOB}}}) / 3.6e6\n"
                    f"/ (max by (cluster, training_job) (costexporter_job_valid_steps{{{JOB}}}) > 0)",
                    "{{training_job}}",
                )
            ],
            description="kWh of the job's GPUs per valid step (carbon per valid step: the recording "
            "rule training_job:costexporter_carbon_kg_per_valid_step:ratio, with a carbon_intensity).",
            **_defaults("kwatth"),
        )
    )
    # Row 6: what the job will cost to finish, against its budget; the rank slowing it now.
    panels.append(
        _panel(
            "timeseries",
            "Cost to finish",
            (0, 41, 12, 8),
            [
                _target(
                    f"training_job:costexporter_cost_to_finish:estimate{{{JOB}}}",
                    "{{training_job}} to finish",
                ),
                _target(
                    f"max by (cluster, training_job) (costexporter_job_budget{{{JOB}}})\n"
                    f"- on (cluster, training_job) group_left () sum by (cluster, training_job) "
                    f"(training_job:costexporter_cost:sum{{{JOB}}})",
                    "{{training_job}} budget left",
                ),
            ],
            description="The last hour's cost per valid step x the steps left of the trainer's total_steps "
            "(docs/accounting.md, cost to finish), beside what is left of the job's budget.",
            **_defaults("none"),
        )
    )
    panels.append(
        _panel(
            "timeseries",
            "Slow rank: the others wait on it",
            (12, 41, 12, 8),
            [
                _target(
                    f"max by (cluster, training_job, rank) (costexporter_straggler_wait_ratio{{{JOB}}})",
                    "{{training_job}} rank {{rank}}",
                )
            ],
            description="The rank named slow on its latest steps (five or more), as the share of the job's "
            "time every other rank waits on it; priced minute by minute on the job page (docs/accounting.md, "
            "stragglers). The SlowRank alert names a persistent one with its host and GPU.",
            **_defaults("percentunit"),
        )
    )
    # Row 7: the alerts.
    panels.append(
        _panel(
            "table",
            "Alerts",
            (0, 49, 24, 7),
            [_target(f'ALERTS{{{JOB},alertstate="firing"}}', "", instant=True)],
            transformations=[{"id": "labelsToFields", "options": {}}],
            **_defaults("none"),
        )
    )
    panels = [{"id": i, **p} for i, p in enumerate(panels, 1)]
    return {
        "uid": "costexporter",
        "title": "costexporter: cost per valid step",
        "tags": ["costexporter", "gpu", "training"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "utc",
        "annotations": {"list": annotation_list()},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                    "current": {},
                    "hide": 0,
                },
                _variable("cluster", "Cluster", "costexporter_job_info", "cluster", allValue=ALL),
                _variable("team", "Team", f"costexporter_job_info{{{CLUSTER}}}", "team", allValue=ALL),
                # Kubernetes jobs are namespaced: the namespace narrows the jobs as the team does.
                _variable(
                    "namespace",
                    "Namespace",
                    f'costexporter_job_info{{{CLUSTER},team=~"$team"}}',
                    "namespace",
                    allValue=ALL,
                ),
                _variable(
                    "training_job",
                    "Training job",
                    f'costexporter_job_info{{{CLUSTER},team=~"$team",namespace=~"$namespace"}}',
                    "training_job",
                ),
                # The agent (scrape target) a host's series come from.
                _variable(
                    "instance", "Agent", f"costexporter_gpu_power_watts{{{JOB}}}", "instance", allValue=ALL
                ),
                _variable(
                    "Hostname",
                    "Host",
                    f'costexporter_gpu_power_watts{{{JOB},instance=~"$instance"}}',
                    "Hostname",
                    allValue=ALL,
                ),
                _variable(
                    "gpu",
                    "GPU",
                    f'costexporter_gpu_power_watts{{{JOB},Hostname=~"$Hostname"}}',
                    "gpu",
                    allValue=ALL,
                ),
            ]
        },
        "panels": panels,
    }


def annotation_list() -> list[dict[str, Any]]:
    """Incidents (firing alerts; the watcher's hung or crashed) and declared phases, as
    Prometheus annotations: a marker for every step where the expression has a series."""

    def ann(name: str, expr: str, color: str, title: str, text: str, tags: str) -> dict[str, Any]:
        return {
            "name": name,
            "datasource": DS,
            "enable": True,
            "iconColor": color,
            "expr": expr,
            "step": "1m",
            "titleFormat": title,
            "textFormat": text,
            "tagKeys": tags,
            "useValueForTime": False,
        }

    return [
        ann(
            "Incidents",
            f'ALERTS{{{JOB},alertstate="firing"}}',
            "red",
            "{{alertname}}",
            "{{training_job}} rank {{rank}}",
            "training_job,alertname,severity",
        ),
        ann(
            "Watcher: hung or crashed",
            f'costexporter_job_state{{{JOB},costexporter_job_state=~"hung|crashed"}} == 1',
            "dark-red",
            "{{costexporter_job_state}}",
            "{{training_job}}: the watcher says {{costexporter_job_state}}",
            "training_job,costexporter_job_state",
        ),
        ann(
            "Declared phases",
            f"max by (cluster, training_job) (costexporter_job_in_allowance{{{JOB}}}) == 1",
            "purple",
            "phase",
            "{{training_job}}: inside a declared phase or its startup, within the allowance",
            "training_job",
        ),
    ]


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def expressions(
    d: dict[str, Any] | None = None, *, annotations_too: bool = False, cluster: str = ALL
) -> list[str]:
    """Every PromQL expression of the dashboard (panels, and the series each variable reads its
    values from), with the team/Hostname/gpu variables at their All value and `$cluster` at
    `cluster` (All by default); `$training_job` is left for the caller. Annotations only with
    `annotations_too`: they are empty when nothing happened."""
    d = d or dashboard()
    out = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]["query"], re.S)
            out.append(m.group(1) if m else v["query"]["query"])
    if annotations_too:
        out += [a["expr"] for a in d["annotations"]["list"] if "expr" in a]
    return [re.sub(r"\$(team|Hostname|gpu)\b", ALL, e).replace("$cluster", cluster) for e in out]
