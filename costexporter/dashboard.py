"""The Grafana dashboard (Grafana 10+ JSON), built here so its queries stay next to the metric
and recording-rule names they use; `dashboards/costexporter.json` is `render()`'s output (a test
keeps them equal). `costexporter dashboard -o FILE` writes it.

Layout: REFERENCE R7's four zones first (cumulative cost, current step, cost per valid step,
invalid time), then wasted GPU-hours by category and GPU-hours at risk, the watcher's state, a
state timeline of each GPU's band, power per GPU with the band thresholds drawn next to
utilization per GPU (to show how utilization lies, R1), and the alerts.
"""

from __future__ import annotations

import json

from .model import BANDS
from .profiles import B300

JOB = 'training_job=~"$training_job"'
DS = {"type": "prometheus", "uid": "${datasource}"}
BAND_COLORS = {
    "compute": "green",
    "communication": "blue",
    "starvation": "yellow",
    "checkpoint": "purple",
    "deadlock": "red",
    "idle": "text",
    "unknown": "#808080",
}


def band_code_expr() -> str:
    """Each GPU's band as its code (the Band enum), one series per rank: every band's 0/1
    series kept where 1, mapped to the band's code, and combined."""
    terms = [f'(costexporter_gpu_band{{{JOB},band="{b}"}} == 1) * 0 + {i}' for i, b in enumerate(BANDS)]
    return "max by (training_job, rank) (\n  " + "\n  or ".join(terms) + "\n)"


def _target(expr: str, legend: str = "", instant: bool = False, ref: str = "A") -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t.update(instant=True, range=False)
    return t


def _panel(kind: str, title: str, grid: tuple[int, int, int, int], targets: list[dict], **extra) -> dict:
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


def _defaults(unit: str = "short", **custom) -> dict:
    d = {"fieldConfig": {"defaults": {"unit": unit}, "overrides": []}}
    if custom:
        d["fieldConfig"]["defaults"]["custom"] = custom
    return d


def dashboard() -> dict:
    panels = []
    # Row 1: the four zones of REFERENCE R7.
    panels.append(
        _panel(
            "timeseries",
            "Cumulative cost",
            (0, 0, 6, 8),
            [_target(f"training_job:costexporter_cost:sum{{{JOB}}}", "{{training_job}} ({{currency}})")],
            description="Everything booked to the job (valid, overhead and wasted), net of rollbacks.",
            **_defaults("currencyUSD"),
        )
    )
    panels.append(
        _panel(
            "stat",
            "Current step",
            (6, 0, 6, 8),
            [
                _target(f"max by (training_job) (costexporter_job_last_step{{{JOB}}})", "step"),
                _target(
                    f"max by (training_job) (costexporter_job_valid_steps{{{JOB}}})", "valid steps", ref="B"
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
            [_target(f"training_job:costexporter_cost_per_valid_step:ratio{{{JOB}}}", "{{training_job}}")],
            description="Sum of cost over agents / valid steps (DESIGN section 7). "
            "It climbs while steps do not.",
            **_defaults("currencyUSD"),
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
    # Row 2: where the waste went, what is at risk, what the watcher says.
    panels.append(
        _panel(
            "bargauge",
            "Wasted GPU-hours by category",
            (0, 8, 8, 7),
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
            (8, 8, 5, 7),
            [
                _target(
                    f"sum by (training_job) (costexporter_gpu_time_at_risk_seconds{{{JOB}}}) / 3600",
                    "{{training_job}}",
                )
            ],
            description="Work lost if the job had to restart from its last saved checkpoint now "
            "(R6: ~85 GPU-h).",
            **_defaults("h"),
        )
    )
    panels.append(
        _panel(
            "stat",
            "Watcher: job state",
            (13, 8, 5, 7),
            [_target(f"costexporter_job_state{{{JOB}}} == 1", "{{costexporter_job_state}}", instant=True)],
            options={
                "textMode": "name",
                "colorMode": "background",
                "reduceOptions": {"calcs": ["lastNotNull"]},
            },
            **_defaults("none"),
        )
    )
    panels.append(
        _panel(
            "stat",
            "Seconds since the last step",
            (18, 8, 6, 7),
            [
                _target(
                    f"max by (training_job) (costexporter_job_seconds_since_last_step{{{JOB}}})", "since"
                ),
                _target(
                    f"max by (training_job) (costexporter_job_suspect_rank{{{JOB}}})", "suspect rank", ref="B"
                ),
            ],
            **_defaults("none"),
        )
    )
    # Row 3: each GPU's band over time.
    mappings = [
        {
            "type": "value",
            "options": {
                str(i): {"text": b, "color": BAND_COLORS[b], "index": i} for i, b in enumerate(BANDS)
            },
        }
    ]
    panels.append(
        _panel(
            "state-timeline",
            "Band of each GPU",
            (0, 15, 24, 9),
            [_target(band_code_expr(), "rank {{rank}}")],
            options={"showValue": "never", "mergeValues": True, "rowHeight": 0.9},
            fieldConfig={
                "defaults": {
                    "mappings": mappings,
                    "color": {"mode": "thresholds"},
                    "custom": {"fillOpacity": 80},
                },
                "overrides": [],
            },
        )
    )
    # Row 4: power (with the band thresholds) beside utilization.
    steps = [
        {"color": "text", "value": None},
        {"color": "purple", "value": B300.idle_max_w},
        {"color": "yellow", "value": B300.low_max_w},
        {"color": "green", "value": B300.compute_min_w},
    ]
    panels.append(
        _panel(
            "timeseries",
            "Power per GPU (band thresholds of the B300 profile)",
            (0, 24, 12, 9),
            [_target(f"costexporter_gpu_power_watts{{{JOB}}}", "rank {{rank}}")],
            description=f"Idle <= {B300.idle_max_w:g} W, deadlock/checkpoint waiters < {B300.low_max_w:g} W, "
            f"compute >= {B300.compute_min_w:g} W (REFERENCE R2). Other GPU models have their own profile.",
            fieldConfig={
                "defaults": {
                    "unit": "watt",
                    "thresholds": {"mode": "absolute", "steps": steps},
                    "custom": {"thresholdsStyle": {"mode": "line+area"}},
                },
                "overrides": [],
            },
        )
    )
    panels.append(
        _panel(
            "timeseries",
            "Utilization per GPU (reads 100% in a deadlock)",
            (12, 24, 12, 9),
            [_target(f"costexporter_gpu_utilization_ratio{{{JOB}}}", "rank {{rank}}")],
            description="Utilization only says a kernel is scheduled (REFERENCE R1): compare with power.",
            **_defaults("percentunit"),
        )
    )
    # Row 5: the alerts.
    panels.append(
        _panel(
            "table",
            "Alerts",
            (0, 33, 24, 7),
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
        "annotations": {"list": []},
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
                {
                    "name": "training_job",
                    "type": "query",
                    "label": "Training job",
                    "datasource": DS,
                    "query": {
                        "query": "label_values(costexporter_job_valid_steps, training_job)",
                        "refId": "jobs",
                    },
                    "definition": "label_values(costexporter_job_valid_steps, training_job)",
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                    "current": {},
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def expressions(d: dict | None = None) -> list[str]:
    """Every PromQL expression of the dashboard (panels and variables)."""
    d = d or dashboard()
    out = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    out += [v["query"]["query"] for v in d["templating"]["list"] if v["type"] == "query"]
    return out
