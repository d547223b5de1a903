"""The Prometheus alert and recording rules, from one parameterized source.

`render(RuleWindows())` is the shipped `dashboards/costexporter-rules.yaml` (a test keeps the
two equal); tests render the same rules with short windows (`RuleWindows.short()`), the demo
with windows divided by its speed (`for_speed`), so what they check is what ships.

Aggregation: per-GPU and booked series (`costexporter_gpu_*`,
`costexporter_cost_total`, ...) are summed over agents; job-level series
(`costexporter_job_*`) are the same on every agent of a job and are taken with `max`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import yaml

from costexporter.core import bandtable
from costexporter.core.model import VALID_NAMES, WASTED_NAMES
from costexporter.services.notify import RUNBOOKS, runbook_url  # the rule the watcher's alerts link by

# PromQL regexes of the category label (stalled|idle|no_progress|rolled_back, productive|...).
WASTED = "|".join(WASTED_NAMES)
VALID = "|".join(VALID_NAMES)
# The booked GPU time the records sum: a job's (every category but unassigned), its valid part,
# and the valid time a resume voided (counted again in rolled_back: `_net` takes it off).
TIME_HELD = 'costexporter_gpu_time_seconds_total{category!="unassigned"}'
TIME_VALID = f'costexporter_gpu_time_seconds_total{{category=~"{VALID}"}}'
TIME_VOIDED = "costexporter_voided_gpu_time_seconds_total"


@dataclass(frozen=True)
class RuleWindows:
    """Windows and thresholds of the rules (Prometheus durations)."""

    slope_window: str = "10m"  # CostSlopeWithoutSteps: cost rising, progress still, over this window
    slope_for: str = "5m"
    deadlock_for: str = "30s"  # two scrapes at 15 s: the signature on two consecutive samples
    hung_for: str = "1m"
    crashed_for: str = "1m"
    comm_share: float = 0.5  # CommunicationBound: this share of the job's GPUs in the band ...
    comm_for: str = "15m"  # ... for this long (compute/communication overlap failed, R2)
    starvation_window: str = "10m"  # the straggler: lowest mean utilization over this window
    starvation_for: str = "10m"
    # SlowRank: the rank held the job's GPUs longer in some minute of this window ...
    slow_window: str = "10m"
    slow_for: str = "15m"  # ... for this long (a persistent straggler, not one bad minute)
    waste_window: str = "1h"
    waste_ratio: float = 0.15  # R7: at least 15% invalid spend a month
    waste_for: str = "15m"
    budget_for: str = "5m"
    # BudgetBurn: the share of its budget a job has spent, one alert per band [this, the next)
    budget_burn: tuple[float, ...] = (0.5, 0.75, 0.9)
    # CostPerStepJump: the job's cost per valid step over `jump_window` this many times its own
    # over `jump_baseline`, for `jump_for` (a straggler, failing hardware, a bad config)
    jump_factor: float = 1.5
    jump_window: str = "15m"
    jump_baseline: str = "6h"
    jump_for: str = "15m"
    forecast_for: str = "15m"  # BudgetForecastExceeded: the forecast over the budget this long
    # Goodput's rolling windows: runtime goodput (job, team, cluster), ETTR and MFU (job).
    goodput_short: str = "1h"
    goodput_long: str = "24h"
    # CostSlopeWithoutSteps stands aside this long after the watcher's hung verdict clears: the
    # agents' progress series follows the watcher's state a scrape and a booking round later, and
    # in that gap JobHung (which inhibits it in Alertmanager) has already cleared.
    recovery_hold: str = "2m"
    group_interval: str = "15s"

    @classmethod
    def short(cls) -> RuleWindows:
        """Windows for tests and the demo's time-compressed story (seconds, not minutes)."""
        return cls(
            slope_window="30s",
            slope_for="10s",
            deadlock_for="4s",
            hung_for="4s",
            crashed_for="4s",
            comm_for="20s",
            starvation_window="20s",
            starvation_for="10s",
            slow_window="2m",
            slow_for="20s",
            waste_window="2m",
            waste_for="20s",
            budget_for="10s",
            jump_window="30s",
            jump_baseline="10m",
            jump_for="10s",
            forecast_for="10s",
            goodput_short="2m",
            goodput_long="10m",
            recovery_hold="6s",
            group_interval="2s",
        )


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
# A Prometheus that watches a sped-up story (the demo's compose stack, its tests) scrapes and
# evaluates this often: at 160x a scrape every 15 s of the story is 0.1 s of wall time, and the
# story's shortest alerting stretch, a crash of the crash loop, lasts about a second.
SPEED_INTERVAL_S = 0.25
# A window holds at least this many scrapes: a rate needs a few samples in its window.
MIN_WINDOW_SCRAPES = 10


def seconds(duration: str) -> float:
    """A Prometheus duration ('1h30m', '15s', '500ms') in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"{duration!r} is not a Prometheus duration")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def duration(s: float) -> str:
    """Seconds as a Prometheus duration (whole milliseconds)."""
    ms = max(round(s * 1000), 1)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _net(total: str, voided: str) -> str:
    """`total` less the rollback corrections. Counters only go up: a resume
    adds the voided valid amounts to `rolled_back` and to the `..._voided_...` counters, so a
    total subtracts the latter; a job without resumes has no voided series (`or ... * 0`)."""
    return f"{total}\n- ({voided} or {total} * 0)"


def for_speed(w: RuleWindows, speed: float, interval_s: float = SPEED_INTERVAL_S) -> RuleWindows:
    """`w` for a story played `speed` times faster than real time (the demo at --speed), watched
    by a Prometheus that scrapes and evaluates every `interval_s`: every window and `for`
    divided by the speed, so a stretch that lasts 20 minutes of the story (7.5 s of wall time
    at 160x) still fires the alert it would fire in real time. Floors keep the rules evaluable:
    windows hold >= MIN_WINDOW_SCRAPES scrapes, groups evaluate every `interval_s` at most.

    JobCrashed gets no `for` at all: the watcher already held the silence past its heartbeat
    timeout, in the story's time, and a crash of the demo's crash loop (three minutes down, one
    of them the timeout) reads `crashed` for about half a second of wall time at 160x: a scaled
    minute behind the watcher's poll, a scrape and an evaluation would rarely fire."""
    if speed <= 0:
        raise ValueError("speed must be > 0")
    if interval_s <= 0:
        raise ValueError("interval_s must be > 0")
    # Field name -> its new duration (str fields only); Any: replace() checks each keyword against
    # its field's type, which a field named at run time cannot show.
    kw: dict[str, Any] = {}
    for f in fields(RuleWindows):
        value = getattr(w, f.name)
        if not isinstance(value, str):
            continue  # thresholds and shares do not scale
        if f.name == "crashed_for" and speed > 1:
            kw[f.name] = "0s"
            continue
        if f.name == "group_interval":
            floor = interval_s
        elif f.name.endswith("_for"):
            floor = 0.001
        else:
            floor = MIN_WINDOW_SCRAPES * interval_s
        kw[f.name] = duration(max(seconds(value) / speed, min(floor, seconds(value))))
    return replace(w, **kw)


# The `source` label of every alert here: the watcher posts its own (JobHung, JobCrashed, ...)
# to Alertmanager as `source="watcher"`, and the two paths stay two alerts.
SOURCE = "rules"


def with_cluster(expr: str) -> str:
    """`expr` aggregated and matched per cluster as well: jobs of the same name in two clusters
    that one Prometheus scrapes (the `cluster` label its scrape gives them: the chart's monitors'
    relabelings) stay apart. Where no series has a `cluster` label, the results are the same as
    without it."""
    for a, b in (
        ("by (training_job", "by (cluster, training_job"),
        ("on (training_job", "on (cluster, training_job"),
        ("on (host, gpu)", "on (cluster, host, gpu)"),
    ):
        expr = expr.replace(a, b)
    return expr


# A job's money alerts go to its team: they carry the `team` label of `costexporter_job_info`
# (the operator's attribution), for Alertmanager's routes.
TEAM_ROUTED = ("HighWasteRatio", "CostPerStepJump", "BudgetBurn", "BudgetForecastExceeded", "BudgetExceeded")


def with_team(expr: str) -> str:
    """`expr`'s series with their job's `team` label (its value unchanged: the info series is 1);
    a job without an info series keeps its alert, without the label."""
    # one team a job (topk: never a many-to-many match that would stop the rule)
    info = "topk by (training_job) (1, max by (training_job, team) (costexporter_job_info))"
    return (
        f"(\n{expr}\n) * on (training_job) group_left (team) {info}\n"
        f"or (\n{expr}\n) unless on (training_job) {info}"
    )


def alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity, "source": SOURCE},
        "annotations": {"summary": summary, "description": description},
    }


def rules(w: RuleWindows, runbooks: str = RUNBOOKS) -> dict[str, Any]:
    """The rule file's groups; each alert's `runbook_url` is its section of `runbooks`."""
    not_ended = "unless on (training_job) (max by (training_job) (costexporter_job_ended) == 1)"
    cost_rising = f"(sum by (training_job) (increase(costexporter_cost_total[{w.slope_window}])) > 0)"
    since_step = (
        "(sum by (training_job, currency) (costexporter_cost_since_last_step)"
        f" or sum by (training_job, currency) (increase(costexporter_cost_total[{w.slope_window}])))"
    )
    progress = "costexporter_job_last_progress_timestamp_seconds"
    slope = (
        f"(\n  {since_step}\n  and on (training_job) {cost_rising}\n  and on (training_job) (\n"
        f"    (max by (training_job) (changes({progress}[{w.slope_window}])) == 0)\n"
        f"    or on (training_job)\n"
        f"    ({cost_rising} unless on (training_job) max by (training_job) ({progress}))\n"
        "  )\n"
        "  unless on (training_job) (max by (training_job) (costexporter_job_in_allowance) == 1)\n"
        f"  {not_ended}\n)\n"
        f"or\n({since_step}\n  and on (training_job) {cost_rising}\n"
        f"  and on () absent_over_time({progress}[{w.slope_window}])\n)"
    )
    # A job without steps (a Kubernetes pod booked by band) never makes step progress.
    stepless = 'max by (training_job) (costexporter_job_info{progress="none"})'
    slope = f"({slope})\nunless on (training_job) {stepless}"
    # A job the watcher finds crashed pages as JobCrashed: not a second critical page for the same
    # stop, also not while JobCrashed waits out its `for` after a hang (JobHung, which inhibits
    # this alert in Alertmanager, has cleared by then: nothing would hold this page back).
    stopped = 'max by (training_job) (costexporter_job_state{costexporter_job_state="crashed"})'
    slope = f"({slope})\nunless on (training_job) ({stopped} == 1)"
    # Nor as a hung job recovers: the watcher reads it running again before the agents' progress
    # series has moved, and for those evaluations nothing would inhibit this page.
    hung = 'costexporter_job_state{costexporter_job_state="hung"}'
    recovering = (
        f"(max by (training_job) (max_over_time({hung}[{w.recovery_hold}])) == 1)\n"
        f"  and on (training_job) (max by (training_job) ({hung}) == 0)"
    )
    slope = f"({slope})\nunless on (training_job) (\n  {recovering}\n)"

    deadlock = (
        "max by (training_job, rank, host, gpu) (\n"
        '  (costexporter_gpu_band{band="deadlock"} == 1)\n'
        "  and on (host, gpu) (costexporter_gpu_utilization_ratio < 0.1)\n"
        f")\n{not_ended}"
    )

    def state(s: str) -> str:
        return (
            "max by (training_job) (costexporter_job_suspect_rank)\n"
            f'and on (training_job) (costexporter_job_state{{costexporter_job_state="{s}"}} == 1)'
        )

    comm = (
        f'avg by (training_job) (costexporter_gpu_band{{band="communication"}}) > {w.comm_share}\n{not_ended}'
    )
    starving = (
        "bottomk by (training_job) (1,\n"
        f"  avg_over_time(costexporter_gpu_utilization_ratio[{w.starvation_window}])\n"
        '  and on (host, gpu) (costexporter_gpu_band{band="starvation"} == 1)\n'
        f")\n{not_ended}"
    )
    waste = f"training_job:costexporter_waste_ratio:ratio_{w.waste_window} > {w.waste_ratio}"
    time_all = TIME_HELD
    time_wasted = f'costexporter_gpu_time_seconds_total{{category=~"{WASTED}"}}'
    by_job, by_cur = "sum by (training_job)", "sum by (training_job, currency)"
    cost_net = _net(f"{by_cur} (costexporter_cost_total)", f"{by_cur} (costexporter_voided_cost_total)")

    # The job's cost per valid step over a window (voided steps lower the gauge: no rate then).
    def per_step(win: str) -> str:
        return (
            f"sum by (training_job) (increase(costexporter_cost_total[{win}]))\n"
            f"/ on (training_job) (max by (training_job) (delta(costexporter_job_valid_steps[{win}])) > 0)"
        )

    time_voided = TIME_VOIDED
    voided_h = f"{by_job} ({time_voided})"
    records = [
        {"record": "training_job:costexporter_cost:sum", "expr": cost_net},
        {
            "record": "training_job:costexporter_valid_steps:max",
            "expr": "max by (training_job) (costexporter_job_valid_steps)",
        },
        {
            # Sum of cost over agents / max of valid steps (job-level).
            "record": "training_job:costexporter_cost_per_valid_step:ratio",
            "expr": "training_job:costexporter_cost:sum\n"
            "/ on (training_job) group_left () (max by (training_job) (costexporter_job_valid_steps) > 0)",
        },
        {
            "record": "training_job:costexporter_gpu_hours:sum",
            "expr": f"({_net(f'{by_job} ({time_all})', voided_h)}) / 3600",
        },
        {
            "record": "training_job:costexporter_valid_gpu_hours:sum",
            "expr": "(" + _net(f"{by_job} ({TIME_VALID})", voided_h) + ") / 3600",
        },
        {
            # Booked wasted time (rolled_back includes the valid time later voided by resumes).
            "record": "training_job:costexporter_wasted_gpu_hours:sum",
            "expr": f"sum by (training_job) ({time_wasted}) / 3600",
        },
        {
            "record": "training_job_category:costexporter_wasted_gpu_hours:sum",
            "expr": f"sum by (training_job, category) ({time_wasted}) / 3600",
        },
        {
            "record": f"training_job:costexporter_waste_ratio:ratio_{w.waste_window}",
            "expr": f"{by_job} (increase({time_wasted}[{w.waste_window}]))\n/ ("
            + _net(
                f"{by_job} (increase({time_all}[{w.waste_window}]))",
                f"{by_job} (increase({time_voided}[{w.waste_window}]))",
            )
            + ")",
        },
    ]

    records += goodput_records(w)
    # What a job will cost to finish (docs/accounting.md): its cost per valid step over the last
    # `goodput_short` x the steps left of its total_steps (meta); none without them.
    records.append(
        {
            "record": "training_job:costexporter_cost_to_finish:estimate",
            "expr": f"(\n{per_step(w.goodput_short)}\n)\n* on (training_job) clamp_min(\n"
            "  max by (training_job) (costexporter_job_total_steps)\n"
            "  - on (training_job) max by (training_job) (costexporter_job_last_step),\n  0\n)",
        }
    )

    budget = (
        f"({cost_net})\n"
        "> on (training_job, currency) max by (training_job, currency) (costexporter_job_budget)"
    )

    # A persistent straggler, named with its host and GPU (any band series of the rank says them).
    slow_rank = (
        "(\n  sum by (training_job, rank) (\n"
        f"    increase(costexporter_straggler_gpu_seconds_total[{w.slow_window}])\n  ) > 0\n)\n"
        "* on (training_job, rank) group_left (host, gpu) "
        "group by (training_job, rank, host, gpu) (costexporter_gpu_band)\n"
        f"{not_ended}"
    )

    recent, baseline = per_step(w.jump_window), per_step(w.jump_baseline)
    jump = f"(\n{recent}\n)\n/ on (training_job) (\n{baseline}\n)\n> {w.jump_factor:g}"
    at_finish = (
        "training_job:costexporter_cost:sum\n"
        "+ on (training_job) group_left () training_job:costexporter_cost_to_finish:estimate"
    )
    forecast_over = (
        f"({at_finish})\n"
        "> on (training_job, currency) max by (training_job, currency) (costexporter_job_budget)\n"
        "unless on (training_job, currency) (\n  training_job:costexporter_cost:sum\n"
        "  > on (training_job, currency) max by (training_job, currency) (costexporter_job_budget)\n)"
    )
    spent_share = (
        f"({cost_net})\n"
        "/ on (training_job, currency) (max by (training_job, currency) (costexporter_job_budget) > 0)"
    )

    alerts = [
        alert(
            "CostSlopeWithoutSteps",
            slope,
            w.slope_for,
            "critical",
            "{{ $labels.training_job }}: cost keeps rising while steps do not",
            '{{ $value | printf "%.2f" }} {{ $labels.currency }} burned since the last step; no progress in '
            f"{w.slope_window} and no declared phase within its allowance (R7 in docs/background.md).",
        ),
        alert(
            "DeadlockSignature",
            deadlock,
            w.deadlock_for,
            "critical",
            "{{ $labels.training_job }}: deadlock signature, rank {{ $labels.rank }} at 0%",
            "Rank {{ $labels.rank }} ({{ $labels.host }} GPU {{ $labels.gpu }}) is at 0% "
            "while the others spin at ~100% utilization and low power (R2, R3 in docs/background.md).",
        ),
        alert(
            "JobHung",
            state("hung"),
            w.hung_for,
            "critical",
            "{{ $labels.training_job }} is hung",
            "The watcher reports hung; suspect rank {{ $value }} (-1: none named).",
        ),
        alert(
            "JobCrashed",
            state("crashed"),
            w.crashed_for,
            "critical",
            "{{ $labels.training_job }} crashed",
            "The watcher reports crashed: heartbeats gone and no run end; suspect rank {{ $value }}.",
        ),
        alert(
            "CommunicationBound",
            comm,
            w.comm_for,
            "warning",
            "{{ $labels.training_job }}: communication-bound",
            "{{ $value | humanizePercentage }} of the GPUs sit in the communication band: "
            "compute/communication overlap failed (R2 in docs/background.md).",
        ),
        alert(
            "DataStarvation",
            starving,
            w.starvation_for,
            "warning",
            "{{ $labels.training_job }}: data starvation, straggler rank {{ $labels.rank }}",
            "Rank {{ $labels.rank }} ({{ $labels.host }} GPU {{ $labels.gpu }}) averages "
            "{{ $value | humanizePercentage }} utilization while the job starves for input.",
        ),
        alert(
            "SlowRank",
            slow_rank,
            w.slow_for,
            "warning",
            "{{ $labels.training_job }}: rank {{ $labels.rank }} slows every step",
            "Rank {{ $labels.rank }} ({{ $labels.host }} GPU {{ $labels.gpu }}) computes longer than the "
            'others: it held the job\'s GPUs {{ $value | printf "%.0f" }} GPU-seconds longer over '
            f"{w.slow_window} (the what-if, priced on the job page).",
        ),
        alert(
            "CostPerStepJump",
            jump,
            w.jump_for,
            "warning",
            '{{ $labels.training_job }}: cost per valid step {{ $value | printf "%.1f" }}x its own',
            f"Over {w.jump_window} each valid step cost "
            '{{ $value | printf "%.1f" }} times what it cost over '
            f"the last {w.jump_baseline} (over {w.jump_factor:g}x): a straggler, failing hardware, a "
            "changed config or input pipeline.",
        ),
        alert(
            "HighWasteRatio",
            waste,
            w.waste_for,
            "warning",
            "{{ $labels.training_job }}: {{ $value | humanizePercentage }} of GPU time wasted",
            f"Stalled, idle, no-progress and rolled-back time over {w.waste_window} "
            f"exceeds {w.waste_ratio:.0%}.",
        ),
        alert(
            "BudgetForecastExceeded",
            forecast_over,
            w.forecast_for,
            "warning",
            "{{ $labels.training_job }} will finish over its budget",
            '{{ $value | printf "%.2f" }} {{ $labels.currency }} at its finish: what it spent plus its last '
            f"{w.goodput_short}'s cost per valid step for the steps left of its total_steps, more than its "
            "budget (the operator's policy).",
        ),
        alert(
            "BudgetExceeded",
            budget,
            w.budget_for,
            "warning",
            "{{ $labels.training_job }} is over budget",
            '{{ $value | printf "%.2f" }} {{ $labels.currency }} spent, '
            "more than its budget (the operator's policy).",
        ),
    ]
    alerts += burn_alerts(spent_share, w)
    for a in alerts:
        if a["alert"] in TEAM_ROUTED:
            a["expr"] = with_team(a["expr"])
    alerts += policy_budget_alerts(w)
    alerts = _band_alerts(alerts, w, not_ended)
    for a in alerts:
        a["annotations"]["runbook_url"] = runbook_url(a["alert"], runbooks)
    for r in records + alerts:
        r["expr"] = with_cluster(r["expr"])
    return {
        "groups": [
            {"name": "costexporter.records", "interval": w.group_interval, "rules": records},
            {"name": "costexporter.alerts", "interval": w.group_interval, "rules": alerts},
        ]
    }


def goodput_records(w: RuleWindows) -> list[dict[str, Any]]:
    """Rolling goodput (docs/accounting.md, goodput), each window's job-level valid and held GPU
    time first (net of the voided time, as the ledger books it), then the ratios over them:
    runtime goodput per job, team (`costexporter_job_info`'s) and cluster; ETTR and MFU per job;
    energy and carbon per valid step."""
    by_job = "sum by (training_job)"
    job_info = "max by (training_job, team) (costexporter_job_info)"
    out: list[dict[str, Any]] = []
    for win in (w.goodput_short, w.goodput_long):
        valid = f"training_job:costexporter_valid_gpu_seconds:increase_{win}"
        held = f"training_job:costexporter_held_gpu_seconds:increase_{win}"
        ranks = f"max by (training_job) (max_over_time(costexporter_job_ranks[{win}]))"
        out += [
            {
                "record": valid,
                "expr": _net(
                    f"{by_job} (increase({TIME_VALID}[{win}]))", f"{by_job} (increase({TIME_VOIDED}[{win}]))"
                ),
            },
            {
                "record": held,
                "expr": _net(
                    f"{by_job} (increase({TIME_HELD}[{win}]))", f"{by_job} (increase({TIME_VOIDED}[{win}]))"
                ),
            },
            {
                "record": f"training_job:costexporter_goodput_ratio:ratio_{win}",
                "expr": f"{valid}\n/ ({held} > 0)",
                "labels": {"layer": "runtime"},
            },
            {
                "record": f"team:costexporter_goodput_ratio:ratio_{win}",
                "expr": f"sum by (cluster, team) ({valid} * on (training_job) group_left (team) {job_info})\n"
                f"/ (sum by (cluster, team) ({held} * on (training_job) group_left (team) {job_info}) > 0)",
                "labels": {"layer": "runtime"},
            },
            {
                "record": f"cluster:costexporter_goodput_ratio:ratio_{win}",
                "expr": f"sum by (cluster) ({valid})\n/ (sum by (cluster) ({held}) > 0)",
                "labels": {"layer": "runtime"},
            },
            {
                # Valid GPU time over the job's ranks x the window, never over less than it held.
                "record": f"training_job:costexporter_ettr:ratio_{win}",
                "expr": f"{valid}\n/ (\n  (\n    ({ranks} * {seconds(win):g} > {held})\n"
                f"    or {held}\n  ) > 0\n)",
            },
            {
                "record": f"training_job:costexporter_mfu:ratio_{win}",
                "expr": f"max by (training_job) (delta(costexporter_job_tokens[{win}]))\n"
                "* on (training_job) max by (training_job) (costexporter_job_model_flops_per_token)\n"
                f"/ on (training_job) ({valid} > 0)\n"
                "/ on (training_job) max by (training_job) (costexporter_job_peak_flops)",
            },
        ]
    steps = "on (training_job) group_left () (max by (training_job) (costexporter_job_valid_steps) > 0)"
    out += [
        {
            "record": "training_job:costexporter_energy_kwh_per_valid_step:ratio",
            "expr": f"{by_job} (costexporter_energy_joules_total) / 3.6e6\n/ {steps}",
        },
        {
            "record": "training_job:costexporter_carbon_kg_per_valid_step:ratio",
            "expr": f"{by_job} (costexporter_carbon_kg_total)\n/ {steps}",
        },
    ]
    return out


def burn_alerts(spent_share: str, w: RuleWindows) -> list[dict[str, Any]]:
    """BudgetBurn, one alert per band of the budget spent ([50%, 75%), [75%, 90%), [90%, 100%) by
    default; past 100% BudgetExceeded pages): a team hears at each band once, not at every one it
    has passed."""
    edges = sorted(t for t in w.budget_burn if 0 < t < 1)
    out = []
    for lo, hi in zip(edges, [*edges[1:], 1.0], strict=True):
        a = alert(
            "BudgetBurn",
            f"({spent_share})\n>= {lo:g} < {hi:g}",
            w.budget_for,
            "info",
            "{{ $labels.training_job }} has spent {{ $value | humanizePercentage }} of its budget",
            f"The job's net cost passed {lo:.0%} of its budget (the operator's policy), in "
            "{{ $labels.currency }}.",
        )
        a["labels"]["threshold"] = f"{lo:.0%}"
        out.append(a)
    return out


# The labels a policy budget's alerts carry (`core/budgets.route_labels`, and the currency), the
# API replicas' series merged.
BUDGET_BY = "cluster, budget, period, currency, team, cost_center, namespace"


def policy_budget_alerts(w: RuleWindows) -> list[dict[str, Any]]:
    """The policy's budgets (per team, cost centre, month, ...; the API's budget gauges), as the
    API posts them itself (`core/budgets.alerts`): the highest band crossed under 100%, past 100%
    the overrun, and the period's forecast reaching 100% first."""
    used = f"max by ({BUDGET_BY}) (costexporter_budget_used_ratio)"
    burn = (
        "topk by (cluster, budget) (\n  1,\n"
        f"  max by ({BUDGET_BY}, threshold) (costexporter_budget_threshold)\n"
        f"  <= on (cluster, budget) group_left ()\n  {used}\n)\n< 1"
    )
    forecast = (
        f"max by ({BUDGET_BY}) (costexporter_budget_forecast)\n"
        ">= on (cluster, budget) group_left () max by (cluster, budget) (costexporter_budget_amount)\n"
        f"unless on (cluster, budget) ({used} >= 1)"
    )
    return [
        alert(
            "PolicyBudgetBurn",
            burn,
            w.budget_for,
            "info",
            "budget {{ $labels.budget }} has passed {{ $labels.threshold }} of its amount",
            "The net cost of the jobs in the budget's scope this {{ $labels.period }} passed "
            "{{ $labels.threshold }} of its amount, in {{ $labels.currency }} (the operator's policy).",
        ),
        alert(
            "PolicyBudgetExceeded",
            f"{used}\n>= 1",
            w.budget_for,
            "warning",
            "budget {{ $labels.budget }} is spent",
            "{{ $value | humanizePercentage }} of its amount spent this {{ $labels.period }} "
            "(the operator's policy).",
        ),
        alert(
            "PolicyBudgetForecastExceeded",
            forecast,
            w.forecast_for,
            "warning",
            "budget {{ $labels.budget }} will be spent before its period ends",
            '{{ $value | printf "%.2f" }} {{ $labels.currency }} by the end of this {{ $labels.period }}, at '
            "the last 7 days' daily spend: more than its amount (the operator's policy).",
        ),
    ]


def _band_alerts(alerts: list[dict[str, Any]], w: RuleWindows, not_ended: str) -> list[dict[str, Any]]:
    """The band table's say: DeadlockSignature while the deadlock band alerts, and one
    GpuInAlertingBand over every other band that alerts (a band added as a table row)."""
    table = bandtable.current()
    if "deadlock" not in table.alerting:
        alerts = [a for a in alerts if a["alert"] != "DeadlockSignature"]
    others = [r.name for r in table.rows if r.alerts and r.signature != "deadlock"]
    if others:
        expr = (
            "max by (training_job, rank, host, gpu) (\n"
            f'  costexporter_gpu_band{{band=~"{"|".join(others)}"}} == 1\n'
            f")\n{not_ended}"
        )
        alerts.append(
            alert(
                "GpuInAlertingBand",
                expr,
                w.deadlock_for,
                "warning",
                "{{ $labels.training_job }}: rank {{ $labels.rank }} in an alerting band",
                "Rank {{ $labels.rank }} ({{ $labels.host }} GPU {{ $labels.gpu }}) reads a band the "
                f"operator's band table marks as alerting ({', '.join(others)}).",
            )
        )
    return alerts


class _Literal(str):
    pass


def _literal(dumper: yaml.SafeDumper, s: _Literal) -> Any:
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


def render(w: RuleWindows | None = None, runbooks: str = RUNBOOKS) -> str:
    """The rule file as YAML text (multi-line expressions as block literals, for review)."""
    w = w or RuleWindows()
    doc = rules(w, runbooks)
    for g in doc["groups"]:
        for r in g["rules"]:
            r["expr"] = _Literal(r["expr"])

    class Dumper(yaml.SafeDumper):  # type: ignore[misc, unused-ignore]  # (PyYAML untyped) its own representers: SafeDumper's stay as they are
        pass

    Dumper.add_representer(_Literal, _literal)
    head = (
        "# Generated by `costexporter rules` from costexporter/tools/rules.py: "
        "edit the source, not this file.\n"
        f"# Windows: {asdict(w)}\n"
    )
    return head + str(yaml.dump(doc, Dumper=Dumper, sort_keys=False, width=120))


PROMETHEUS_RULE_API = "monitoring.coreos.com/v1"


def prometheus_rule(
    w: RuleWindows | None = None,
    name: str = "costexporter",
    labels: dict[str, str] | None = None,
    runbooks: str = RUNBOOKS,
) -> dict[str, Any]:
    """The same rules as a prometheus-operator `PrometheusRule` object (its `spec` is the rule
    file's groups), for clusters where the operator loads rules from the API, not from files."""
    return {
        "apiVersion": PROMETHEUS_RULE_API,
        "kind": "PrometheusRule",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "costexporter", **(labels or {})}},
        "spec": rules(w or RuleWindows(), runbooks),
    }


def render_prometheus_rule(
    w: RuleWindows | None = None,
    name: str = "costexporter",
    labels: dict[str, str] | None = None,
    runbooks: str = RUNBOOKS,
) -> str:
    """`prometheus_rule()` as YAML, formatted like `render()`."""
    w = w or RuleWindows()
    body = render(w, runbooks).split("\n", 2)[2]  # the groups, without render()'s two header lines
    head = {k: v for k, v in prometheus_rule(w, name, labels, runbooks).items() if k != "spec"}
    return (
        "# Generated by `costexporter rules --format prometheusrule` from costexporter/tools/rules.py.\n"
        f"# Windows: {asdict(w)}\n"
        + str(yaml.safe_dump(head, sort_keys=False))
        + "spec:\n"
        + "".join(f"  {line}\n" if line else "\n" for line in body.rstrip("\n").split("\n"))
    )
