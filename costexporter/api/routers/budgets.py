"""Budgets: each budget of the operator's policy in its current period, what is spent against it,
the thresholds crossed and the period's forecast (docs/terms.md, budgets)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from costexporter.api.budgeting import evaluate
from costexporter.api.deps import Config, Who
from costexporter.api.format import iso, money
from costexporter.api.schemas import BudgetOut, Budgets
from costexporter.api.windows import WindowError, parse_at
from costexporter.core.buckets import BUCKET_S

router = APIRouter(prefix="/api/v1/budgets", tags=["budgets"])

AT = "The instant the figures are for (RFC 3339 or Unix seconds; default now): a past month's close."


@router.get("", response_model=Budgets, responses={400: {"description": "bad instant"}})
def budgets(
    who: Who, cfg: Config, at: Annotated[str | None, Query(description=AT, max_length=64)] = None
) -> Budgets:
    """Every budget the caller may see: a team's token sees the budgets scoped to its teams; a
    token that sees every team sees them all."""
    try:
        now = int(parse_at(at, cfg.tz)) // BUCKET_S * BUCKET_S  # the ledger's 5-minute resolution
        rows, warn = evaluate(cfg, who, now)
    except WindowError as e:
        raise HTTPException(400, str(e)) from None
    out = [
        BudgetOut(
            name=r.budget.name,
            scope=dict(r.budget.scope),
            period=r.budget.period,
            start=iso(r.start),
            end=iso(r.end),
            amount=money(r.budget.amount),
            spent=money(r.status.spent),
            used=r.status.used,
            thresholds=list(r.budget.thresholds),
            crossed=r.status.crossed,
            forecast_at_end=money(r.status.forecast_at_end) if r.status.forecast_at_end is not None else None,
            forecast_used=r.status.forecast_used,
            forecast_crosses=r.status.forecast_crosses,
            jobs=r.jobs,
            notes=r.status.notes,
        )
        for r in rows
    ]
    return Budgets(currency=cfg.currency, at=iso(now), budgets=out, warnings=list(warn))
