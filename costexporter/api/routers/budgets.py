"""Budgets: each budget of the operator's policy in its current period, what is spent against it,
the thresholds crossed and the period's forecast (docs/terms.md, budgets)."""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, HTTPException, Query

from costexporter.api.deps import Config, Store, Who
from costexporter.api.format import iso, money
from costexporter.api.schemas import BudgetOut, Budgets
from costexporter.api.windows import WindowError, parse_at, zone_of
from costexporter.core import budgets as budgets_mod
from costexporter.core.buckets import BUCKET_S
from costexporter.core.model import CATEGORIES
from costexporter.store.ledger_read import JOB_CATS, Warnings

router = APIRouter(prefix="/api/v1/budgets", tags=["budgets"])

AT = "The instant the figures are for (RFC 3339 or Unix seconds; default now): a past month's close."


@router.get("", response_model=Budgets, responses={400: {"description": "bad instant"}})
def budgets(
    s: Store, who: Who, cfg: Config, at: Annotated[str | None, Query(description=AT, max_length=64)] = None
) -> Budgets:
    """Every budget the caller may see: a team's token sees the budgets scoped to its teams; a
    token that sees every team sees them all."""
    try:
        zone = zone_of(cfg.tz)
        now = parse_at(at, cfg.tz)
    except WindowError as e:
        raise HTTPException(400, str(e)) from None
    now = int(now) // BUCKET_S * BUCKET_S  # the ledger's 5-minute resolution
    visible = [
        b for b in cfg.budgets if who.all_teams or any(k == "team" and who.sees(v) for k, v in b.scope)
    ]
    warn = Warnings()
    trend_from = now - budgets_mod.TREND_DAYS * 86400
    periods = [b.span(now, zone) for b in visible]
    out = []
    if visible:
        starts = [int(a) // BUCKET_S * BUCKET_S for a, _ in periods]
        # the trend: the last 7 days' daily spend, or the period's so far when it is younger
        trends = [max(trend_from, a) for a in starts]
        names = s.job_names(min([trend_from, *starts]), now)
        spans = [(a, max(now, a + BUCKET_S)) for a in starts] + [(t, max(now, t + BUCKET_S)) for t in trends]
        metas, tables = s.tables(names, spans, warn, meta=True)
        # each job's net cost (every job category, micro-units) per span
        costs = [t.net[:, COST_COLUMNS].sum(1) if names else np.zeros(0) for t in tables]
        n = len(visible)
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
            trend_days = (now - t0) / 86400
            st = budgets_mod.status(b, spent, trend, trend_days, now, end)
            out.append(
                BudgetOut(
                    name=b.name,
                    scope=dict(b.scope),
                    period=b.period,
                    start=iso(start),
                    end=iso(end),
                    amount=money(b.amount),
                    spent=money(st.spent),
                    used=st.used,
                    thresholds=list(b.thresholds),
                    crossed=st.crossed,
                    forecast_at_end=money(st.forecast_at_end) if st.forecast_at_end is not None else None,
                    forecast_used=st.forecast_used,
                    forecast_crosses=st.forecast_crosses,
                    jobs=int((mine & (cost != 0)).sum()),
                    notes=st.notes,
                )
            )
    return Budgets(currency=cfg.currency, at=iso(now), budgets=out, warnings=list(warn))


# The cost column of every job category in a `WindowTable` row (`ledger.PACKED`: ms, mJ, cost).
COST_COLUMNS = [CATEGORIES.index(c) * 3 + 2 for c in JOB_CATS]
