"""Budgets as operator policy: an amount per team, cost centre, cluster, namespace or job pattern,
per calendar month or quarter (in the API's time zone) or a rolling window of days; what is spent
in the period, the share used, the thresholds crossed, and the period's forecast (docs/terms.md,
"Budgets"; docs/accounting.md, "Cost to finish").

The forecast of a calendar period is what is spent plus the scope's trend (its daily spend over
the last `TREND_DAYS` days) for the days left; a rolling window has no end to forecast to.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SCOPE_KEYS = ("team", "cost_center", "cluster", "namespace", "job")
BUDGET_KEYS = ("name", "amount", "period", "thresholds", *SCOPE_KEYS)
DEFAULT_THRESHOLDS = (0.5, 0.75, 0.9, 1.0)
TREND_DAYS = 7
_ROLLING = re.compile(r"^rolling:(\d{1,4})d$")


class BudgetError(ValueError):
    """A budget the policy gives that cannot be used (one line)."""


@dataclass(frozen=True, slots=True)
class Budget:
    name: str
    amount: float
    period: str  # month | quarter | rolling:<N>d
    scope: tuple[tuple[str, str], ...]  # (key, shell pattern): every one must match
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS

    def matches(self, job: str, meta: Mapping[str, Any]) -> bool:
        """Whether the job counts against this budget: each scope key's pattern matches its job
        name (`job`) or its owner and place (the operator's attribution, overlaid on meta)."""
        for key, pattern in self.scope:
            value = job if key == "job" else meta.get(key)
            if not isinstance(value, str) or not fnmatch.fnmatchcase(value, pattern):
                return False
        return True

    def span(self, now: float, zone: dt.tzinfo) -> tuple[float, float]:
        """The period holding `now`: [start, end) in Unix seconds (a rolling window ends now)."""
        m = _ROLLING.match(self.period)
        if m:
            return now - int(m.group(1)) * 86400.0, now
        local = dt.datetime.fromtimestamp(now, zone)
        first_month = local.month if self.period == "month" else 3 * ((local.month - 1) // 3) + 1
        start = dt.datetime(local.year, first_month, 1, tzinfo=zone)
        months = 1 if self.period == "month" else 3
        y, mo = divmod(first_month - 1 + months, 12)
        end = dt.datetime(local.year + y, mo + 1, 1, tzinfo=zone)
        return start.timestamp(), end.timestamp()


def parse_budgets(raw: object, where: str = "the policy") -> tuple[Budget, ...]:
    """The policy's `budgets` list (BudgetError, one line, for anything it cannot use)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise BudgetError(f"{where}: 'budgets' must be a list")
    out: list[Budget] = []
    for i, b in enumerate(raw):
        at = f"{where}: budget {i + 1}"
        if not isinstance(b, Mapping):
            raise BudgetError(f"{at} is not a mapping")
        unknown = set(b) - set(BUDGET_KEYS)
        if unknown:
            raise BudgetError(f"{at}: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
        name = b.get("name")
        if not isinstance(name, str) or not name.strip():
            raise BudgetError(f"{at}: needs a name")
        at = f"{where}: budget {name!r}"
        amount = b.get("amount")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not (0 < amount < math.inf):
            raise BudgetError(f"{at}: amount must be a number > 0, got {amount!r}")
        period = b.get("period", "month")
        if period not in ("month", "quarter") and not (isinstance(period, str) and _ROLLING.match(period)):
            raise BudgetError(f"{at}: period must be month, quarter or rolling:<N>d, got {period!r}")
        if isinstance(period, str) and period.startswith("rolling:") and int(period[8:-1]) < 1:
            raise BudgetError(f"{at}: a rolling window needs at least 1 day")
        scope = []
        for key in SCOPE_KEYS:
            v = b.get(key)
            if v is None:
                continue
            if not isinstance(v, str) or not v:
                raise BudgetError(f"{at}: {key} must be a non-empty string (a shell pattern)")
            scope.append((key, v))
        if not scope:
            raise BudgetError(f"{at}: needs a scope ({', '.join(SCOPE_KEYS)})")
        ths = b.get("thresholds", list(DEFAULT_THRESHOLDS))
        if (
            not isinstance(ths, list)
            or not ths
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 10 for t in ths)
        ):
            raise BudgetError(f"{at}: thresholds must be a list of shares (0.5 is 50%)")
        if any(x.name == name for x in out):
            raise BudgetError(f"{at}: named twice")
        out.append(
            Budget(name, float(amount), str(period), tuple(scope), tuple(sorted(float(t) for t in ths)))
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class BudgetStatus:
    """A budget in its current period: spent, its share, the thresholds crossed, the forecast."""

    spent: float
    used: float
    crossed: list[float]
    forecast_at_end: float | None
    forecast_used: float | None
    forecast_crosses: list[float]  # thresholds not crossed yet that the forecast crosses by the end
    notes: list[str] = field(default_factory=list)


def status(
    b: Budget, spent: float, trend_spent: float, trend_days: float, now: float, end: float
) -> BudgetStatus:
    """`spent` in the period so far; `trend_spent` over the last `trend_days` days (the scope's
    daily spend, for the days left of a calendar period)."""
    used = spent / b.amount
    crossed = [t for t in b.thresholds if used >= t]
    notes = []
    forecast = None
    if b.period.startswith("rolling:"):
        notes.append("a rolling window has no end to forecast to")
    elif trend_days <= 0:
        notes.append("no spend history to take a trend from")
    else:
        forecast = spent + max(trend_spent, 0.0) / trend_days * max(end - now, 0.0) / 86400
    f_used = forecast / b.amount if forecast is not None else None
    crosses = [t for t in b.thresholds if t not in crossed and f_used is not None and f_used >= t]
    return BudgetStatus(spent, used, crossed, forecast, f_used, crosses, notes)


# The alerts a budget raises, on both paths (the API's Alertmanager posts and the Prometheus
# rules over the API's budget gauges): one for the highest band crossed under 100%, one past
# 100%, one when the period's forecast reaches 100% first.
BURN = "PolicyBudgetBurn"
EXCEEDED = "PolicyBudgetExceeded"
FORECAST = "PolicyBudgetForecastExceeded"
ALERT_SEVERITY = {BURN: "info", EXCEEDED: "warning", FORECAST: "warning"}
# Scope keys whose literal value (no shell wildcard) becomes a label Alertmanager routes on (not
# `cluster`: the alerts' own cluster label is the API's, or Prometheus's external label).
ROUTE_KEYS = ("team", "cost_center", "namespace")
_WILDCARD = re.compile(r"[*?\[]")


@dataclass(frozen=True, slots=True)
class BudgetAlert:
    name: str
    threshold: float | None = None  # the band's lower edge (BURN only)

    @property
    def severity(self) -> str:
        return ALERT_SEVERITY[self.name]


def alerts(st: BudgetStatus) -> list[BudgetAlert]:
    """What a budget's status raises: the highest threshold under 100% that is crossed (a team
    hears at each band once, not at every band it has passed), or past 100% the overrun; and
    the forecast reaching 100% while the spend has not."""
    if st.used >= 1:
        return [BudgetAlert(EXCEEDED)]
    out = []
    below = [t for t in st.crossed if t < 1]
    if below:
        out.append(BudgetAlert(BURN, max(below)))
    if st.forecast_used is not None and st.forecast_used >= 1:
        out.append(BudgetAlert(FORECAST))
    return out


def threshold_label(t: float) -> str:
    """A threshold as the `threshold` label shows it: 0.75 -> "75%", 0.875 -> "87.5%"."""
    return f"{t * 100:g}%"


def route_labels(b: Budget) -> dict[str, str]:
    """The labels Alertmanager routes a budget's alerts on: `budget`, `period`, and each scope
    key of ROUTE_KEYS given as a literal (a team's budget pages that team)."""
    out = {"budget": b.name, "period": b.period}
    for key, pattern in b.scope:
        if key in ROUTE_KEYS and not _WILDCARD.search(pattern):
            out[key] = pattern
    return out
