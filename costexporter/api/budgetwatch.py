"""The policy's budgets watched: evaluated every `interval_s` (the ledger's resolution is five
minutes), exported as gauges on the API's /metrics (the Prometheus rules' PolicyBudget* alerts
read them) and, given an Alertmanager, posted to it as the same alerts (docs/alerts.md).

A snapshot, as prometheus_client's collectors: the scrape renders the last evaluation and never
waits on the ledger; a failed evaluation keeps the last one and is counted."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from costexporter.api.auth import Principal
from costexporter.api.budgeting import Evaluated, evaluate
from costexporter.api.deps import ApiConfig
from costexporter.api.format import iso, money
from costexporter.core import budgets as budgets_mod
from costexporter.core.buckets import BUCKET_S

log = logging.getLogger("costexporter.api")

EVERY_TEAM = Principal("budget-watch", None)
LABELS = ("budget", "period", "currency", *budgets_mod.ROUTE_KEYS)
SOURCE = "api"  # the `source` label of the alerts this path posts (the rules' are "rules")


class BudgetWatch:
    """Evaluates the budgets; `post` (an `AlertSet.update`) gets every firing alert each time;
    `runbook` maps an alert name to its runbook link."""

    def __init__(
        self,
        cfg: ApiConfig,
        interval_s: float = 60.0,
        post: Callable[[list[dict[str, Any]]], Any] | None = None,
        runbook: Callable[[str], str] = lambda name: "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg, self.interval_s, self.post, self.runbook, self.clock = cfg, interval_s, post, runbook, clock
        self.rows: list[Evaluated] = []
        self.evaluated_at: float | None = None
        self.errors = 0
        self._stop = threading.Event()

    def refresh(self) -> list[dict[str, Any]]:
        """Evaluate now; post the alerts (when posting) and return them. A ledger that cannot be
        read keeps the last evaluation (counted, logged) and posts nothing: its alerts neither
        resolve nor fire on an outage; their endsAt lets them expire if it lasts."""
        now = int(self.clock()) // BUCKET_S * BUCKET_S
        try:
            rows, _ = evaluate(self.cfg, EVERY_TEAM, now)
        except Exception as e:  # noqa: BLE001 - any failure of the read keeps the last snapshot
            self.errors += 1
            log.warning("budgets not evaluated: %s: %s", type(e).__name__, e)
            return []
        self.rows, self.evaluated_at = rows, self.clock()
        alerts = self.alerts(rows)
        if self.post is not None:
            self.post(alerts)
        return alerts

    def run(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.interval_s)

    def start(self) -> BudgetWatch:
        threading.Thread(target=self.run, name="costexporter-budgets", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def alerts(self, rows: list[Evaluated]) -> list[dict[str, Any]]:
        """The firing alerts of an evaluation, labelled as the rules label theirs."""
        cur = self.cfg.currency
        out = []
        for r in rows:
            b, st = r.budget, r.status
            for a in budgets_mod.alerts(st):
                labels = {"alertname": a.name, "severity": a.severity, "source": SOURCE, "currency": cur}
                labels |= budgets_mod.route_labels(b)
                if self.cfg.cluster:
                    labels["cluster"] = self.cfg.cluster
                spent = f"{money(st.spent)} of {money(b.amount)} {cur}"
                period = f"its {b.period} from {iso(r.start)} to {iso(r.end)}"
                if a.name == budgets_mod.BURN:
                    assert a.threshold is not None
                    labels["threshold"] = budgets_mod.threshold_label(a.threshold)
                    summary = f"budget {b.name} has spent {st.used:.0%} of its amount"
                    text = f"{spent} spent in {period}, past its {labels['threshold']} threshold."
                elif a.name == budgets_mod.EXCEEDED:
                    summary = f"budget {b.name} is spent"
                    text = f"{spent} spent in {period}."
                else:
                    summary = f"budget {b.name} will be spent before its period ends"
                    text = (
                        f"{spent} spent in {period}; at the last 7 days' daily spend it reaches "
                        f"{money(st.forecast_at_end or 0)} {cur} by the end."
                    )
                annotations = {"summary": summary, "description": text, "runbook_url": self.runbook(a.name)}
                out.append({"labels": labels, "annotations": annotations})
        return out

    def collect(self) -> Iterator[Metric]:
        """The last evaluation as gauges, one series per budget (per threshold for thresholds)."""
        fams = {
            "amount": GaugeMetricFamily(
                "costexporter_budget_amount", "A policy budget's amount for its period.", labels=LABELS
            ),
            "spent": GaugeMetricFamily(
                "costexporter_budget_spent",
                "Net cost of the jobs in a budget's scope from its period's start.",
                labels=LABELS,
            ),
            "used": GaugeMetricFamily(
                "costexporter_budget_used_ratio", "A budget's spent over its amount.", labels=LABELS
            ),
            "forecast": GaugeMetricFamily(
                "costexporter_budget_forecast",
                "A calendar budget's spend at its period's end: spent plus the last 7 days' daily spend "
                "for the days left (none for a rolling window).",
                labels=LABELS,
            ),
            "end": GaugeMetricFamily(
                "costexporter_budget_period_end_timestamp_seconds",
                "When a budget's current period ends (Unix seconds; a rolling window's is now).",
                labels=LABELS,
            ),
            "threshold": GaugeMetricFamily(
                "costexporter_budget_threshold",
                "Each threshold of a budget (a share of its amount), labelled as its alerts are.",
                labels=(*LABELS, "threshold"),
            ),
        }
        for r in self.rows:
            lab = budgets_mod.route_labels(r.budget) | {"currency": self.cfg.currency}
            values = [lab.get(k, "") for k in LABELS]
            fams["amount"].add_metric(values, r.budget.amount)
            fams["spent"].add_metric(values, r.status.spent)
            fams["used"].add_metric(values, r.status.used)
            if r.status.forecast_at_end is not None:
                fams["forecast"].add_metric(values, r.status.forecast_at_end)
            fams["end"].add_metric(values, r.end)
            for t in r.budget.thresholds:
                fams["threshold"].add_metric([*values, budgets_mod.threshold_label(t)], t)
        yield from fams.values()
        at = GaugeMetricFamily(
            "costexporter_budget_evaluated_timestamp_seconds",
            "When the budgets were last evaluated (Unix seconds; absent before the first).",
        )
        if self.evaluated_at is not None:
            at.add_metric([], self.evaluated_at)
        yield at
        errs = CounterMetricFamily(
            "costexporter_budget_evaluation_errors", "Budget evaluations that could not read the ledger."
        )
        errs.add_metric([], self.errors)
        yield errs
