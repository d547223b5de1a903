"""The shipped Prometheus rules: promtool checks them, and unit-tests every alert with
`promtool test rules`: it fires in its scenario and stays silent in a healthy run, after a clean
end, across a resume and on a one-sample blip."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.tools.rules import RuleWindows, render, runbook_url

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "dashboards" / "costexporter-rules.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (.ci/run installs it)")

J = 'training_job="j"'


def _series(name: str, labels: str, values: str) -> dict:
    return {"series": f"{name}{{{labels}}}", "values": values}


def _run(tmp_path: Path, rule_file: Path, tests: list[dict], interval: str = "1m") -> None:
    for t in tests:  # every alert links its runbook: expected wherever annotations are
        for check in t.get("alert_rule_test", []):
            for exp in check["exp_alerts"]:
                if "exp_labels" in exp:  # every alert of the rules says it is theirs
                    exp["exp_labels"].setdefault("source", "rules")
                if "exp_annotations" in exp:
                    exp["exp_annotations"].setdefault("runbook_url", runbook_url(check["alertname"]))
    doc = {"rule_files": [str(rule_file)], "evaluation_interval": interval, "tests": tests}
    f = tmp_path / "rules_test.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([PROMTOOL, "test", "rules", str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _case(series: list[dict], checks: list[tuple[str, str, list[dict]]], interval: str = "1m") -> dict:
    return {
        "interval": interval,
        "input_series": series,
        "alert_rule_test": [{"eval_time": t, "alertname": a, "exp_alerts": exp} for t, a, exp in checks],
    }


def test_shipped_file_is_the_rendered_source():
    assert SHIPPED.read_text() == render(RuleWindows()), (
        "run: costexporter rules -o dashboards/costexporter-rules.yaml"
    )


@needs_promtool
def test_promtool_check_rules_default_and_short(tmp_path):
    short = tmp_path / "short.yaml"
    short.write_text(render(RuleWindows.short()))
    for f in (SHIPPED, short):
        r = subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


# ---- CostSlopeWithoutSteps (10m window, for 5m) --------------------------------------------
def _slope_series(
    progress: str,
    cost: str = "0+1x60",
    in_allowance: str = "0x60",
    ended: str = "0x60",
    since: str = "0+0.5x60",
) -> list[dict]:
    # Two agents: booked series sum, job-level series are identical on both and taken with max.
    out = []
    for a in ("a1", "a2"):
        lab = f'{J},instance="{a}"'
        out += [
            _series("costexporter_cost_total", f'{lab},category="productive",currency="USD"', cost),
            _series("costexporter_cost_since_last_step", f'{lab},currency="USD"', since),
            _series("costexporter_job_in_allowance", lab, in_allowance),
            _series("costexporter_job_ended", lab, ended),
        ]
        if progress:
            out.append(_series("costexporter_job_last_progress_timestamp_seconds", lab, progress))
    return out


SLOPE_FIRING = {
    "exp_labels": {"severity": "critical", "training_job": "j", "currency": "USD"},
    "exp_annotations": {
        "summary": "j: cost keeps rising while steps do not",
        "description": "{v} USD burned since the last step; no progress in 10m and no declared phase "
        "within its allowance (R7 in docs/background.md).",
    },
}


def _slope_alert(value: str) -> list[dict]:
    a = {"exp_labels": SLOPE_FIRING["exp_labels"], "exp_annotations": dict(SLOPE_FIRING["exp_annotations"])}
    a["exp_annotations"]["description"] = a["exp_annotations"]["description"].format(v=value)
    return [a]


@needs_promtool
def test_cost_slope_without_steps(tmp_path):
    stuck = "1000+60x20 2200x40"  # progress stops at minute 20
    n = "CostSlopeWithoutSteps"
    tests = [
        # Fires: 10 minutes without progress (minute 30), then 5 more (35). Cost since the last
        # step at minute 40, summed over both agents: 2 x 0.5 x 40.
        _case(_slope_series(stuck), [("25m", n, []), ("33m", n, []), ("40m", n, _slope_alert("40.00"))]),
        # Healthy: progress every minute.
        _case(_slope_series("1000+60x60"), [("40m", n, []), ("59m", n, [])]),
        # Clean end at minute 20: cost stops, the job ended.
        _case(_slope_series(stuck, cost="0+1x20 20x40", ended="0x20 1x40"), [("40m", n, []), ("59m", n, [])]),
        # A resume: the step number drops but the progress timestamp only moves forward.
        _case(
            [
                *_slope_series("1000+60x60"),
                _series("costexporter_job_last_step", J, "100+10x20 50+10x40"),
            ],
            [("25m", n, []), ("45m", n, [])],
        ),
        # A one-sample blip: the progress series misses one scrape.
        _case(_slope_series("1000+60x29 _ 2800+60x30"), [("30m", n, []), ("40m", n, [])]),
        # A checkpoint within its allowance (minutes 21-36) is silent; once it overruns, it fires
        # again after the window's `for`.
        _case(
            _slope_series(stuck, in_allowance="0x20 1x15 0x25"),
            [("34m", n, []), ("40m", n, []), ("43m", n, _slope_alert("43.00"))],
        ),
        # The progress series vanishes (the agent stopped exporting it) while cost still rises.
        _case(
            _slope_series("1000+60x20"),
            [("20m", n, []), ("45m", n, _slope_alert("45.00"))],
        ),
    ]
    _run(tmp_path, SHIPPED, tests)


# ---- DeadlockSignature (two samples: for 30s at 15s scrapes) --------------------------------
def _gpus(bands: dict[int, str], utils: dict[int, str], ended: str = "0x40") -> list[dict]:
    out = [_series("costexporter_job_ended", J, ended)]
    for r in range(4):
        lab = f'{J},host="n{r // 2}",gpu="{r % 2}",rank="{r}"'
        for b in ("compute", "deadlock", "communication", "starvation"):
            out.append(_series("costexporter_gpu_band", f'{lab},band="{b}"', bands.get(r, {}).get(b, "0x40")))
        out.append(_series("costexporter_gpu_utilization_ratio", lab, utils[r]))
    return out


def _all(band: str, values: str, others: str | None = None) -> dict[int, dict[str, str]]:
    d = {r: {band: values} for r in range(4)}
    if others:
        for r in range(4):
            d[r]["compute"] = others
    return d


DEADLOCK_UTIL = {0: "1x40", 1: "1x40", 2: "1x40", 3: "1x4 0x36"}


@needs_promtool
def test_deadlock_signature(tmp_path):
    n = "DeadlockSignature"
    firing = [
        {
            "exp_labels": {
                "severity": "critical",
                "training_job": "j",
                "rank": "3",
                "host": "n1",
                "gpu": "1",
            },
            "exp_annotations": {
                "summary": "j: deadlock signature, rank 3 at 0%",
                "description": "Rank 3 (n1 GPU 1) is at 0% while the others spin at ~100% utilization and "
                "low power (R2, R3 in docs/background.md).",
            },
        }
    ]
    tests = [
        _case(_gpus(_all("deadlock", "0x4 1x36"), DEADLOCK_UTIL), [("75s", n, []), ("2m", n, firing)], "15s"),
        _case(_gpus(_all("compute", "1x40"), {r: "1x40" for r in range(4)}), [("5m", n, [])], "15s"),
        # One sample of the signature: not two.
        _case(_gpus(_all("deadlock", "0x4 1 0x35"), DEADLOCK_UTIL), [("75s", n, []), ("90s", n, [])], "15s"),
        # After a clean end the last band may still read deadlock until the series expire.
        _case(_gpus(_all("deadlock", "0x4 1x36"), DEADLOCK_UTIL, ended="0x3 1x37"), [("2m", n, [])], "15s"),
        # Resumed: the band is compute again.
        _case(
            _gpus(_all("deadlock", "0x4 1x8 0x28", others="1x4 0x8 1x28"), DEADLOCK_UTIL),
            [("2m", n, firing), ("5m", n, [])],
            "15s",
        ),
    ]
    _run(tmp_path, SHIPPED, tests, "15s")


# ---- JobHung / JobCrashed (the watcher's stateset) -------------------------------------------
def _states(values: dict[str, str], suspect: str = "3x40") -> list[dict]:
    out = [_series("costexporter_job_suspect_rank", J, suspect)]
    for s in ("running", "done", "crashed", "hung", "starving", "unknown"):
        out.append(
            _series("costexporter_job_state", f'{J},costexporter_job_state="{s}"', values.get(s, "0x40"))
        )
    return out


@pytest.mark.parametrize(
    ("alert", "state", "severity", "description"),
    [
        ("JobHung", "hung", "critical", "The watcher reports hung; suspect rank 3 (-1: none named)."),
        (
            "JobCrashed",
            "crashed",
            "critical",
            "The watcher reports crashed: heartbeats gone and no run end; suspect rank 3.",
        ),
    ],
)
@needs_promtool
def test_watcher_state_alerts(tmp_path, alert, state, severity, description):
    summary = "j is hung" if state == "hung" else "j crashed"
    firing = [
        {
            "exp_labels": {"severity": severity, "training_job": "j"},
            "exp_annotations": {"summary": summary, "description": description},
        }
    ]
    tests = [
        _case(
            _states({"running": "1x5 0x35", state: "0x5 1x35"}), [("5m", alert, []), ("10m", alert, firing)]
        ),
        _case(_states({"running": "1x40"}, "-1x40"), [("30m", alert, [])]),
        _case(_states({"running": "1x10 0x30", "done": "0x10 1x30"}), [("30m", alert, [])]),
        # One poll in the state, then running again.
        _case(
            _states({"running": "1x5 0 1x34", state: "0x5 1 0x34"}), [("6m", alert, []), ("8m", alert, [])]
        ),
        # Resolves once the job resumes.
        _case(
            _states({"running": "1x5 0x10 1x25", state: "0x5 1x10 0x25"}),
            [("10m", alert, firing), ("20m", alert, [])],
        ),
    ]
    _run(tmp_path, SHIPPED, tests)


# ---- CommunicationBound, DataStarvation -----------------------------------------------------
@needs_promtool
def test_communication_bound(tmp_path):
    n = "CommunicationBound"
    firing = [
        {
            "exp_labels": {"severity": "warning", "training_job": "j"},
            "exp_annotations": {
                "summary": "j: communication-bound",
                "description": "75% of the GPUs sit in the communication band: compute/communication overlap "
                "failed (R2 in docs/background.md).",
            },
        }
    ]
    three = {r: {"communication": "0x5 1x35" if r < 3 else "0x40"} for r in range(4)}
    util = {r: "1x40" for r in range(4)}
    tests = [
        _case(_gpus(three, util), [("15m", n, []), ("25m", n, firing)]),
        _case(_gpus(_all("compute", "1x40"), util), [("30m", n, [])]),
        _case(
            _gpus({r: {"communication": "0x5 1 0x34"} for r in range(4)}, util),
            [("6m", n, []), ("30m", n, [])],
        ),
        _case(_gpus(three, util, ended="0x10 1x30"), [("25m", n, [])]),
        # Overlap restored (e.g. after a restart with a fixed bucket size).
        _case(
            _gpus({r: {"communication": "0x5 1x20 0x15"} for r in range(4)}, util),
            [
                (
                    "22m",
                    n,
                    [
                        {
                            **firing[0],
                            "exp_annotations": {
                                **firing[0]["exp_annotations"],
                                "description": firing[0]["exp_annotations"]["description"].replace(
                                    "75%", "100%"
                                ),
                            },
                        }
                    ],
                ),
                ("35m", n, []),
            ],
        ),
    ]
    _run(tmp_path, SHIPPED, tests)


@needs_promtool
def test_data_starvation_names_the_straggler(tmp_path):
    n = "DataStarvation"
    util = {0: "0.95x40", 1: "0.97x40", 2: "0.6x40", 3: "0.93x40"}
    firing = [
        {
            "exp_labels": {"severity": "warning", "training_job": "j", "rank": "2", "host": "n1", "gpu": "0"},
            "exp_annotations": {
                "summary": "j: data starvation, straggler rank 2",
                "description": "Rank 2 (n1 GPU 0) averages 60% utilization while the job starves for input.",
            },
        }
    ]
    tests = [
        _case(_gpus(_all("starvation", "0x5 1x35"), util), [("10m", n, []), ("20m", n, firing)]),
        _case(_gpus(_all("compute", "1x40"), util), [("30m", n, [])]),
        _case(_gpus(_all("starvation", "0x5 1 0x34"), util), [("6m", n, []), ("20m", n, [])]),
        _case(_gpus(_all("starvation", "0x5 1x35"), util, ended="0x8 1x32"), [("20m", n, [])]),
        _case(
            _gpus(_all("starvation", "0x5 1x15 0x20", others="1x5 0x15 1x20"), util),
            [("20m", n, firing), ("35m", n, [])],
        ),
    ]
    _run(tmp_path, SHIPPED, tests)


@needs_promtool
def test_slow_rank_fires_for_a_persistent_straggler_named_with_its_host(tmp_path):
    n = "SlowRank"
    bands = _gpus(_all("compute", "1x40"), {r: "0.95x40" for r in range(4)})
    firing = [
        {
            "exp_labels": {"severity": "warning", "training_job": "j", "rank": "2", "host": "n1", "gpu": "0"},
            "exp_annotations": {
                "summary": "j: rank 2 slows every step",
                "description": "Rank 2 (n1 GPU 0) computes longer than the others: it held the job's GPUs "
                "600 GPU-seconds longer over 10m (the what-if, priced on the job page).",
            },
        }
    ]

    def slow(*per_agent: str) -> list[dict]:
        return [
            _series("costexporter_straggler_gpu_seconds_total", f'{J},rank="2",instance="a{i}"', v)
            for i, v in enumerate(per_agent)
        ]

    tests = [
        # both agents price it, 30 GPU-s a minute each: fires once it has lasted `for`
        _case(bands + slow("0+30x40", "0+30x40"), [("10m", n, []), ("20m", n, firing)]),
        # one slow spell of 5 minutes: not persistent
        _case(bands + slow("0+30x5 150x35", "0+30x5 150x35"), [("8m", n, []), ("20m", n, [])]),
        # nor once the job has ended
        _case(
            _gpus(_all("compute", "1x40"), {r: "0.95x40" for r in range(4)}, ended="0x8 1x32")
            + slow("0+30x40", "0+30x40"),
            [("20m", n, [])],
        ),
    ]
    _run(tmp_path, SHIPPED, tests)


# ---- HighWasteRatio, BudgetExceeded ---------------------------------------------------------
def _time(wasted: str, productive: str) -> list[dict]:
    return [
        _series("costexporter_gpu_time_seconds_total", f'{J},category="stalled",instance="a1"', wasted),
        _series(
            "costexporter_gpu_time_seconds_total", f'{J},category="productive",instance="a1"', productive
        ),
        _series(
            "costexporter_gpu_time_seconds_total", f'{J},category="productive",instance="a2"', productive
        ),
    ]


@needs_promtool
def test_high_waste_ratio(tmp_path):
    n = "HighWasteRatio"

    def firing(pct: str) -> list[dict]:
        return [
            {
                "exp_labels": {"severity": "warning", "training_job": "j"},
                "exp_annotations": {
                    "summary": f"j: {pct} of GPU time wasted",
                    "description": "Stalled, idle, no-progress and rolled-back time over 1h exceeds 15%.",
                },
            }
        ]

    tests = [
        # 60 s wasted per minute next to 2 x 60 s productive: a third.
        _case(_time("0+60x120", "0+60x120"), [("10m", n, []), ("90m", n, firing("33.33%"))]),
        _case(_time("0x120", "0+60x120"), [("90m", n, [])]),
        # A clean end: nothing more is booked, the ratio has no denominator.
        _case(_time("0+60x30 1800x90", "0+60x30 1800x90"), [("100m", n, [])]),
        # One minute of waste (a short stall) in an hour of work: 60 / 7260.
        _case(_time("0x60 60x60", "0+60x120"), [("70m", n, []), ("110m", n, [])]),
        # A resume after a stalled hour: waste falls out of the window.
        _case(_time("0+60x60 3600x60", "0+60x120"), [("60m", n, firing("33.33%")), ("119m", n, [])]),
    ]
    _run(tmp_path, SHIPPED, tests)


@needs_promtool
def test_budget_exceeded(tmp_path):
    n = "BudgetExceeded"

    def series(cost: str, budget: str | None) -> list[dict]:
        out = [
            _series(
                "costexporter_cost_total", f'{J},category="productive",currency="USD",instance="a1"', cost
            ),
            _series("costexporter_cost_total", f'{J},category="stalled",currency="USD",instance="a2"', cost),
        ]
        if budget:
            for a in ("a1", "a2"):
                out.append(_series("costexporter_job_budget", f'{J},currency="USD",instance="{a}"', budget))
        return out

    firing = [
        {
            "exp_labels": {"severity": "warning", "training_job": "j", "currency": "USD"},
            "exp_annotations": {
                "summary": "j is over budget",
                "description": "1060.00 USD spent, more than its budget (the operator's policy).",
            },
        }
    ]
    tests = [
        # 2 agents x 5 per minute: 1,000 at minute 100; the budget is 1,000; for 5m.
        _case(series("0+5x120", "1000x120"), [("100m", n, []), ("104m", n, []), ("106m", n, firing)]),
        _case(series("0+1x120", "1000x120"), [("119m", n, [])]),
        _case(series("0+5x120", None), [("119m", n, [])]),  # no budget in the meta
        # A one-sample spike (a bad scrape) is not an overrun.
        _case(series("0+1x50 2000 51+1x68", "1000x120"), [("51m", n, []), ("57m", n, [])]),
        # A resume moves valid cost to rolled_back: the total, and so the alert, is unchanged.
        _case(series("0+5x120", "1000x120"), [("106m", n, firing)]),
    ]
    _run(tmp_path, SHIPPED, tests)


@needs_promtool
def test_budget_burn_pages_once_per_band_with_the_currency(tmp_path):
    n = "BudgetBurn"
    cost = [
        _series(
            "costexporter_cost_total", f'{J},category="productive",currency="USD",instance="{a}"', "0+5x120"
        )
        for a in ("a1", "a2")
    ]
    budget = [
        _series("costexporter_job_budget", f'{J},currency="USD",instance="{a}"', "1000x120")
        for a in ("a1", "a2")
    ]

    def firing(band: str, pct: str) -> list[dict]:
        return [
            {
                "exp_labels": {"severity": "info", "training_job": "j", "currency": "USD", "threshold": band},
                "exp_annotations": {
                    "summary": f"j has spent {pct} of its budget",
                    "description": f"The job's net cost passed {band} of its budget "
                    "(the operator's policy), in USD.",
                },
            }
        ]

    # 2 agents x 5 a minute against 1,000: 50% at minute 50, 75% at 75, 90% at 90, 100% at 100
    checks = [
        ("45m", n, []),
        ("60m", n, firing("50%", "60%")),
        ("85m", n, firing("75%", "85%")),
        ("97m", n, firing("90%", "97%")),
        ("110m", n, []),  # past its budget: BudgetExceeded pages instead
    ]
    _run(tmp_path, SHIPPED, [_case(cost + budget, checks), _case(cost, [("60m", n, [])])])


@needs_promtool
def test_cost_to_finish_and_a_forecast_over_the_budget(tmp_path):
    """2 agents x 5 a minute, a step a unit of cost: the record is the last hour's cost per valid
    step x the steps left; the alert fires while spent plus that passes the budget and the spend
    itself does not (past it, BudgetExceeded pages)."""
    n = "BudgetForecastExceeded"

    def job(total: str | None) -> list[dict]:
        out = [
            _series(
                "costexporter_cost_total",
                f'{J},category="productive",currency="USD",instance="{a}"',
                "0+5x130",
            )
            for a in ("a1", "a2")
        ]
        out += [_series("costexporter_job_budget", f'{J},currency="USD",instance="a1"', "1000x130")]
        out += [_series("costexporter_job_valid_steps", f'{J},instance="a1"', "0+10x130")]
        out += [_series("costexporter_job_last_step", f'{J},instance="a1"', "0+10x130")]
        if total:
            out += [_series("costexporter_job_total_steps", f'{J},instance="a1"', total)]
        return out

    firing = [
        {
            "exp_labels": {"severity": "warning", "training_job": "j", "currency": "USD"},
            "exp_annotations": {
                "summary": "j will finish over its budget",
                "description": "2000.00 USD at its finish: what it spent plus its last 1h's cost per valid "
                "step for the steps left of its total_steps, more than its budget (the operator's policy).",
            },
        }
    ]
    tests = [
        {
            **_case(job("2000x130"), [("10m", n, []), ("75m", n, firing), ("110m", n, [])]),
            "promql_expr_test": [
                {
                    "expr": "training_job:costexporter_cost_to_finish:estimate",
                    "eval_time": "75m",
                    "exp_samples": [
                        {
                            "labels": 'training_job:costexporter_cost_to_finish:estimate{training_job="j"}',
                            "value": 1250,
                        }
                    ],
                }
            ],
        },
        _case(job("800x130"), [("75m", n, [])]),  # it finishes at 800 spent
        _case(job(None), [("75m", n, [])]),  # no total_steps: no forecast
    ]
    _run(tmp_path, SHIPPED, tests)


@needs_promtool
def test_cost_per_step_jump_against_the_jobs_own_baseline(tmp_path):
    n = "CostPerStepJump"

    def job(steps: str) -> list[dict]:
        return [
            _series(
                "costexporter_cost_total",
                f'{J},category="productive",currency="USD",instance="a1"',
                "0+10x460",
            ),
            _series("costexporter_job_valid_steps", f'{J},instance="a1"', steps),
        ]

    firing = [
        {
            "exp_labels": {"severity": "warning", "training_job": "j"},
            "exp_annotations": {
                "summary": "j: cost per valid step 1.9x its own",
                "description": "Over 15m each valid step cost 1.9 times what it cost over the last 6h "
                "(over 1.5x): a straggler, failing hardware, a changed config or input pipeline.",
            },
        }
    ]
    tests = [
        # a step a unit of cost for 400 minutes, then half the steps for the same cost
        _case(job("0+10x400 4000+5x60"), [("400m", n, []), ("440m", n, firing)]),
        _case(job("0+10x460"), [("440m", n, [])]),  # steady
        _case(job("0+10x400 4000x60"), [("440m", n, [])]),  # no steps: CostSlopeWithoutSteps's
        _case(job("0+10x400 2000+10x60"), [("440m", n, [])]),  # a resume voided steps
    ]
    _run(tmp_path, SHIPPED, tests)


# ---- recording rules --------------------------------------------------------------------------
@needs_promtool
def test_recording_rules_cost_per_valid_step_and_wasted_hours(tmp_path):
    series = [
        # Two agents' booked cost (sum) and the job-level valid steps (max; identical on both).
        _series(
            "costexporter_cost_total", f'{J},category="productive",currency="USD",instance="a1"', "0+3.5x10"
        ),
        _series(
            "costexporter_cost_total", f'{J},category="stalled",currency="USD",instance="a2"', "0+3.5x10"
        ),
        _series("costexporter_job_valid_steps", f'{J},instance="a1"', "0+100x10"),
        _series("costexporter_job_valid_steps", f'{J},instance="a2"', "0+100x10"),
        _series("costexporter_gpu_time_seconds_total", f'{J},category="stalled",instance="a2"', "0+3600x10"),
        _series(
            "costexporter_gpu_time_seconds_total", f'{J},category="rolled_back",instance="a1"', "0+1800x10"
        ),
        _series(
            "costexporter_gpu_time_seconds_total", f'{J},category="productive",instance="a1"', "0+1800x10"
        ),
    ]
    # A resume voided 900 s of productive time (now also in rolled_back) and 0.7 of cost.
    series += [
        _series(
            "costexporter_voided_gpu_time_seconds_total",
            f'{J},category="productive",instance="a1"',
            "0+90x10",
        ),
        _series(
            "costexporter_voided_cost_total",
            f'{J},category="productive",currency="USD",instance="a1"',
            "0+0.07x10",
        ),
    ]
    test = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [
            {
                "expr": "training_job:costexporter_cost_per_valid_step:ratio",
                "eval_time": "10m",
                "exp_samples": [
                    {
                        "labels": "training_job:costexporter_cost_per_valid_step:ratio"
                        '{training_job="j",currency="USD"}',
                        "value": 0.0693,  # (2 x 35 - 0.7 voided) / 1000 valid steps
                    }
                ],
            },
            {
                # Valid: 1800 x 10 productive - 900 voided = 17100 s.
                "expr": "training_job:costexporter_valid_gpu_hours:sum",
                "eval_time": "10m",
                "exp_samples": [
                    {
                        "labels": 'training_job:costexporter_valid_gpu_hours:sum{training_job="j"}',
                        "value": 4.75,
                    }
                ],
            },
            {
                "expr": "training_job:costexporter_wasted_gpu_hours:sum",
                "eval_time": "10m",
                "exp_samples": [
                    {
                        "labels": 'training_job:costexporter_wasted_gpu_hours:sum{training_job="j"}',
                        "value": 15,
                    }
                ],
            },
        ],
    }
    _run(tmp_path, SHIPPED, [test])


# ---- windows scaled to the demo's --speed ----------------------------------------------------------
def test_for_speed_divides_every_window_with_floors():
    from costexporter.tools.rules import SPEED_INTERVAL_S, duration, for_speed, seconds

    w = for_speed(RuleWindows(), 160)
    assert seconds(w.comm_for) == pytest.approx(15 * 60 / 160, abs=0.001)
    assert seconds(w.starvation_for) == pytest.approx(600 / 160, abs=0.001)
    assert seconds(w.slope_window) == 3.75 and seconds(w.hung_for) == 0.375
    assert seconds(w.group_interval) == SPEED_INTERVAL_S == 0.25  # 15 s / 160, floored
    assert w.crashed_for == "0s"  # a crash of the crash loop is shorter than any scaled minute
    assert w.comm_share == RuleWindows().comm_share and w.waste_ratio == RuleWindows().waste_ratio
    # Floors: a window holds ten scrapes, a group evaluates at most every scrape.
    slow = for_speed(RuleWindows(), 160, interval_s=1.0)
    assert seconds(slow.slope_window) == 10.0 and seconds(slow.group_interval) == 1.0
    assert seconds(for_speed(RuleWindows(), 10_000).slope_window) == 2.5
    assert for_speed(RuleWindows(), 1) == RuleWindows(
        **{k: duration(seconds(v)) if isinstance(v, str) else v for k, v in RuleWindows().__dict__.items()}
    )
    for bad in ("10", "5x", "1h 2m", ""):
        with pytest.raises(ValueError):
            seconds(bad)
    with pytest.raises(ValueError):
        for_speed(RuleWindows(), 0)
    with pytest.raises(ValueError):
        for_speed(RuleWindows(), 160, interval_s=0)


@needs_promtool
def test_at_160x_a_crash_seen_by_one_evaluation_fires_job_crashed(tmp_path):
    """At 160x a crash of the demo's crash loop reads `crashed` for about half a second of wall
    time: the rules for that speed fire JobCrashed on the first 250-ms evaluation that sees it;
    the shipped ones (`for` 1m) never do, nor do they on the same half-second of `hung`."""
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(render(for_speed_160()))
    crash = _states({"running": "1x8 0x2 1x30", "crashed": "0x8 1x2 0x30"})
    crashed = {
        "exp_labels": {"severity": "critical", "training_job": "j"},
        "exp_annotations": {
            "summary": "j crashed",
            "description": "The watcher reports crashed: heartbeats gone and no run end; suspect rank 3.",
        },
    }
    case = _case(crash, [("2250ms", "JobCrashed", [crashed]), ("3s", "JobCrashed", [])], "250ms")
    _run(tmp_path, scaled, [case], "250ms")
    case["alert_rule_test"][0]["exp_alerts"] = []
    _run(tmp_path, SHIPPED, [case], "250ms")
    # JobHung keeps its scaled `for` (375 ms): one evaluation of `hung` does not page.
    blip = _states({"running": "1x8 0 1x31", "hung": "0x8 1 0x31"})
    _run(tmp_path, scaled, [_case(blip, [("2250ms", "JobHung", []), ("2500ms", "JobHung", [])], "250ms")])


@needs_promtool
def test_at_160x_a_20_minute_stretch_fires_communication_bound_and_data_starvation(tmp_path):
    """At 160x a 20-minute stretch of the story lasts 7.5 s of wall time, shorter than the
    shipped 15-minute `for`: the rules rendered for the speed fire on it, the default ones not."""
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(render(for_speed_160()))
    r = subprocess.run([PROMTOOL, "check", "rules", str(scaled)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    comm = {r: {"communication": "0x5 1x8 0x27"} for r in range(4)}  # 8 s of the band, 1-s samples
    util = {r: "1x40" for r in range(4)}
    starving = {r: {"starvation": "0x5 1x8 0x27"} for r in range(4)}
    s_util = {0: "0.97x40", 1: "0.95x40", 2: "0.58x40", 3: "0.96x40"}
    comm_alert = {
        "exp_labels": {"severity": "warning", "training_job": "j"},
        "exp_annotations": {
            "summary": "j: communication-bound",
            "description": "100% of the GPUs sit in the communication band: compute/communication "
            "overlap failed (R2 in docs/background.md).",
        },
    }
    starving_alert = {
        "exp_labels": {"severity": "warning", "training_job": "j", "rank": "2", "host": "n1", "gpu": "0"},
        "exp_annotations": {
            "summary": "j: data starvation, straggler rank 2",
            "description": "Rank 2 (n1 GPU 0) averages 58% utilization while the job starves for input.",
        },
    }
    cases = [
        _case(_gpus(comm, util), [("12s", "CommunicationBound", [comm_alert])], "1s"),
        _case(_gpus(starving, s_util), [("12s", "DataStarvation", [starving_alert])], "1s"),
    ]
    _run(tmp_path, scaled, cases, "1s")
    # The shipped windows stay silent on the same 8 seconds.
    for case in cases:
        case["alert_rule_test"][0]["exp_alerts"] = []
    _run(tmp_path, SHIPPED, cases, "1s")


def for_speed_160() -> RuleWindows:
    from costexporter.tools.rules import for_speed

    return for_speed(RuleWindows(), 160)


def test_set_takes_each_field_of_its_own_type(cli):
    """`rules --set`: a number field given text is one line and exit 2 (it was an internal
    error); a number is rendered into the rules."""
    bad = cli("rules", "--set", "waste_ratio=lots")
    assert bad.returncode == 2 and "waste_ratio takes a number" in bad.stderr
    assert "Traceback" not in bad.stderr and "internal error" not in bad.stderr
    good = cli("rules", "--set", "waste_ratio=0.25")
    assert good.returncode == 0 and "0.25" in good.stdout and "0.15" not in good.stdout
    # the budget's bands: shares, comma-separated
    bands = cli("rules", "--set", "budget_burn=0.6,0.8")
    assert bands.returncode == 0 and "threshold: 60%" in bands.stdout and "threshold: 80%" in bands.stdout
    assert "threshold: 50%" not in bands.stdout
    for bad in ("budget_burn=lots", "budget_burn=0.5,1.5"):
        r = cli("rules", "--set", bad)
        assert r.returncode == 2 and "budget_burn takes" in r.stderr and "Traceback" not in r.stderr


def test_every_alert_links_its_section_of_the_alerts_page():
    """Each alert's runbook_url names a section docs/alerts.md has (GitHub's anchor of its
    heading), the rules' alerts and every alert the watcher posts itself (JobHung, JobCrashed,
    JobStarving, JobUnknown), and the page has no section for an alert that does not exist."""
    import re

    from costexporter.services.alertmanager import postable
    from costexporter.services.notify import ALERTING, WATCHER_ALERTS, Status
    from costexporter.tools.rules import RUNBOOKS, rules

    page = (ROOT / "docs" / "alerts.md").read_text()
    anchors = {h.strip().lower() for h in re.findall(r"^## (.+)$", page, flags=re.M)}
    alerts = [r for g in rules(RuleWindows())["groups"] for r in g["rules"] if "alert" in r]
    watched = [postable("j", Status(s, "why", 0.0, 0.0), 0.0, 60.0) for s in sorted(ALERTING)]
    assert alerts and len(watched) == len(ALERTING) == 4
    assert {a["labels"]["alertname"] for a in watched} == set(WATCHER_ALERTS)
    linked = [(r["alert"], r["annotations"]["runbook_url"]) for r in alerts]
    linked += [(a["labels"]["alertname"], a["annotations"]["runbook_url"]) for a in watched]
    for name, url in linked:
        base, _, anchor = url.partition("#")
        assert base == RUNBOOKS and anchor == name.lower() and anchor in anchors, url
    assert anchors == {name.lower() for name, _ in linked}


def test_runbook_url_option_links_every_alert_to_your_own_page(cli):
    from costexporter.tools.rules import rules

    r = cli("rules", "--runbook-url", "https://wiki.example.com/runbooks")
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(r.stdout)
    alerts = [x for g in doc["groups"] for x in g["rules"] if "alert" in x]
    assert alerts and all(
        a["annotations"]["runbook_url"] == f"https://wiki.example.com/runbooks#{a['alert'].lower()}"
        for a in alerts
    )
    assert doc == rules(RuleWindows(), "https://wiki.example.com/runbooks")
    for bad in ("wiki/runbooks", "https://wiki.example.com/runbooks#top", "ftp://x/y"):
        r = cli("rules", "--runbook-url", bad)
        assert r.returncode == 2 and "--runbook-url" in r.stderr and "Traceback" not in r.stderr, r.stderr


def _money_text(u: int) -> str:
    """Micro-units as the decimal the exporter's counter shows."""
    return f"{u // 1_000_000}.{u % 1_000_000:06d}"


@needs_promtool
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    agents=st.lists(st.integers(0, 10**9), min_size=1, max_size=3),
    voided=st.integers(0, 10**6),
    valid=st.integers(1, 10**6),
)
def test_the_cost_per_valid_step_rule_is_the_one_function(tmp_path, agents, voided, valid):
    """The recording rule gives what `cost.cost_per_valid_step` gives for the same figures (to
    the half micro-unit the function rounds to): each agent's booked cost summed, the voided cost
    taken off, over the job's valid steps (the same on every agent, not summed)."""
    from costexporter.core.cost import cost_per_valid_step

    voided = min(voided, sum(agents))
    series = [
        _series(
            "costexporter_cost_total",
            f'{J},category="productive",currency="USD",instance="a{i}"',
            f"{_money_text(u)}x10",
        )
        for i, u in enumerate(agents)
    ]
    series += [
        _series("costexporter_job_valid_steps", f'{J},instance="a{i}"', f"{valid}x10")
        for i in range(len(agents))
    ]
    series.append(
        _series(
            "costexporter_voided_cost_total",
            f'{J},category="productive",currency="USD",instance="a0"',
            f"{_money_text(voided)}x10",
        )
    )
    want = cost_per_valid_step(sum(agents) - voided, valid)
    assert want is not None
    rule = "training_job:costexporter_cost_per_valid_step:ratio"
    test = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [
            {
                # 1 where the rule's figure rounds to the function's micro-units (a tie: either side)
                "expr": f"abs({rule} - {want / 1_000_000!r}) <= bool 0.000000501",
                "eval_time": "5m",
                "exp_samples": [{"labels": '{training_job="j",currency="USD"}', "value": 1}],
            }
        ],
    }
    _run(tmp_path, SHIPPED, [test])


# ---- goodput (docs/accounting.md): runtime per job, team and cluster; ETTR; MFU; per valid step ----
def test_goodput_rules_runtime_ettr_mfu_and_per_valid_step(tmp_path):
    """Job j (team llm) on two agents, 3 ranks registered (one host's agent down: its rank books
    nothing); job k (team llm) on a third, 1 rank. Per minute: j books 48 + 30 s valid of 120 s
    held, k 60 of 60. A resume voided 6 s a minute of j's productive time (now rolled_back too)."""
    per_min = {
        ("j", "a1", "productive"): 48,
        ("j", "a1", "rolled_back"): 6,  # the voided time, moved (counted again here)
        ("j", "a1", "stalled"): 12,
        ("j", "a2", "productive"): 30,
        ("j", "a2", "idle"): 30,
        ("k", "a3", "productive"): 60,
    }
    series = [
        _series(
            "costexporter_gpu_time_seconds_total",
            f'training_job="{job}",category="{cat}",instance="{a}"',
            f"0+{v}x130",
        )
        for (job, a, cat), v in per_min.items()
    ]
    series += [
        _series(
            "costexporter_voided_gpu_time_seconds_total",
            'training_job="j",category="productive",instance="a1"',
            "0+6x130",
        ),
        _series(
            "costexporter_energy_joules_total",
            'training_job="j",category="productive",instance="a1"',
            "0+36000x130",
        ),
        _series(
            "costexporter_energy_joules_total",
            'training_job="j",category="idle",instance="a2"',
            "0+36000x130",
        ),
        _series("costexporter_carbon_kg_total", 'training_job="j",instance="a1"', "0+0.5x130"),
        _series("costexporter_carbon_kg_total", 'training_job="j",instance="a2"', "0+0.5x130"),
    ]
    for a, job, team, ranks in (("a1", "j", "llm", 3), ("a2", "j", "llm", 3), ("a3", "k", "llm", 1)):
        lab = f'training_job="{job}",instance="{a}"'
        series += [
            _series(
                "costexporter_job_info",
                f'{lab},team="{team}",namespace="",cost_center="",progress=""',
                "1x130",
            ),
            _series("costexporter_job_ranks", lab, f"{ranks}x130"),
        ]
    for a in ("a1", "a2"):  # job-level: the same on both agents
        lab = f'training_job="j",instance="{a}"'
        series += [
            _series("costexporter_job_tokens", lab, "0+1000x130"),
            _series("costexporter_job_valid_steps", lab, "0+10x130"),
            _series("costexporter_job_model_flops_per_token", lab, "6e9x130"),
            _series("costexporter_job_peak_flops", lab, "1e15x130"),
        ]
    j_valid, j_held = 48 + 30 - 6, 48 + 6 + 12 + 30 + 30 - 6  # per minute, net of the voided
    k_valid = k_held = 60

    def sample(expr: str, labels: str, value: float) -> dict:
        return {"expr": expr, "eval_time": "2h", "exp_samples": [{"labels": labels, "value": value}]}

    layer = 'layer="runtime"'
    checks = [
        sample(
            'training_job:costexporter_goodput_ratio:ratio_1h{training_job="j"}',
            f'training_job:costexporter_goodput_ratio:ratio_1h{{training_job="j",{layer}}}',
            j_valid / j_held,
        ),
        sample(
            "team:costexporter_goodput_ratio:ratio_24h",
            f'team:costexporter_goodput_ratio:ratio_24h{{team="llm",{layer}}}',
            (j_valid + k_valid) / (j_held + k_held),
        ),
        sample(
            "cluster:costexporter_goodput_ratio:ratio_1h",
            f"cluster:costexporter_goodput_ratio:ratio_1h{{{layer}}}",
            (j_valid + k_valid) / (j_held + k_held),
        ),
        # 3 ranks x 60 s a minute is more than the 120 s held: the capacity; k held all along
        sample(
            'training_job:costexporter_ettr:ratio_1h{training_job="j"}',
            'training_job:costexporter_ettr:ratio_1h{training_job="j"}',
            j_valid / (3 * 60),
        ),
        sample(
            'training_job:costexporter_ettr:ratio_1h{training_job="k"}',
            'training_job:costexporter_ettr:ratio_1h{training_job="k"}',
            1.0,
        ),
        # 1000 tokens x 6e9 FLOPs a minute over 72 valid GPU-seconds at 1e15 FLOPS
        sample(
            "training_job:costexporter_mfu:ratio_1h",
            'training_job:costexporter_mfu:ratio_1h{training_job="j"}',
            1000 * 6e9 / (j_valid * 1e15),
        ),
        sample(
            "training_job:costexporter_energy_kwh_per_valid_step:ratio",
            'training_job:costexporter_energy_kwh_per_valid_step:ratio{training_job="j"}',
            2 * 36000 / 3.6e6 / 10,
        ),
        sample(
            "training_job:costexporter_carbon_kg_per_valid_step:ratio",
            'training_job:costexporter_carbon_kg_per_valid_step:ratio{training_job="j"}',
            2 * 0.5 / 10,
        ),
    ]
    _run(tmp_path, SHIPPED, [{"interval": "1m", "input_series": series, "promql_expr_test": checks}])
