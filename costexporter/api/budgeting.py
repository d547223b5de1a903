"""Each budget of the policy in its period at an instant: what the budgets route answers, and
what the API's budget gauges and Alertmanager posts are made of (one evaluation for all three)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costexporter.api.auth import Principal
from costexporter.api.deps import ApiConfig
from costexporter.api.windows import zone_of
from costexporter.core import budgets as budgets_mod
from costexporter.core.buckets import BUCKET_S
from costexporter.core.budgets import Budget, BudgetStatus
from costexporter.core.model import CATEGORIES
from costexporter.store.ledger_read import JOB_CATS, Warnings

# The cost column of every job category in a `WindowTable` row (`ledger.PACKED`: ms, mJ, cost).
COST_COLUMNS = [CATEGORIES.index(c) * 3 + 2 for c in JOB_CATS]


@dataclass(frozen=True, slots=True)
class Evaluated:
    budget: Budget
    start: float
    end: float
    status: BudgetStatus
    jobs: int  # jobs in scope with cost in the period


def evaluate(cfg: ApiConfig, who: Principal, now: int) -> tuple[list[Evaluated], Warnings]:
    """The budgets `who` may see (a team's principal: those scoped to its teams), each in its
    period holding `now` (a bucket edge), over the jobs `who` sees; WindowError for a time zone
    that names none."""
    zone = zone_of(cfg.tz)
    s = cfg.store
    visible = [
        b for b in cfg.budgets if who.all_teams or any(k == "team" and who.sees(v) for k, v in b.scope)
    ]
    warn = Warnings()
    if not visible:
        return [], warn
    trend_from = now - budgets_mod.TREND_DAYS * 86400
    periods = [b.span(now, zone) for b in visible]
    starts = [int(a) // BUCKET_S * BUCKET_S for a, _ in periods]
    # the trend: the last 7 days' daily spend, or the period's so far when it is younger
    trends = [max(trend_from, a) for a in starts]
    names = s.job_names(min([trend_from, *starts]), now)
    spans = [(a, max(now, a + BUCKET_S)) for a in starts] + [(t, max(now, t + BUCKET_S)) for t in trends]
    metas, tables = s.tables(names, spans, warn, meta=True)
    # each job's net cost (every job category, micro-units) per span
    costs = [t.net[:, COST_COLUMNS].sum(1) if names else np.zeros(0) for t in tables]
    n = len(visible)
    out = []
    for b, (start, end), cost, trend_cost, t0 in zip(
        visible, periods, costs[:n], costs[n:], trends, strict=True
    ):
        mine = np.asarray(
            [
                b.matches(j, {"cluster": cfg.cluster, **metas[j]}) and who.sees(metas[j].get("team"))
                for j in names
            ],
            bool,
        )
        spent = float(cost[mine].sum()) / 1e6
        trend = float(trend_cost[mine].sum()) / 1e6
        st = budgets_mod.status(b, spent, trend, (now - t0) / 86400, now, end)
        out.append(Evaluated(b, start, end, st, int((mine & (cost != 0)).sum())))
    return out, warn
