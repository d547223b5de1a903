"""Allocation: every visible job's (or team's) cost over a window, as JSON, CSV or FOCUS."""

from __future__ import annotations

import json
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from ...model import CATEGORIES
from ..auth import Principal
from ..deps import Config, Store, Who, Win
from ..export import to_csv, to_focus
from ..format import json_bytes, money, per
from ..schemas import Allocation, AllocationRow, WindowOut
from ..store import JOB_CATS, VALID, WASTED, Amounts, LedgerStore, Warnings
from ..windows import Window

router = APIRouter(prefix="/api/v1/allocation", tags=["allocation"])


@router.get("", response_model=Allocation, responses={200: {"content": {"text/csv": {}}}})
def allocation(
    s: Store,
    who: Who,
    w: Win,
    cfg: Config,
    aggregate: Literal["job", "team"] = "job",
    format: Literal["json", "csv", "focus"] = "json",
):
    warn = Warnings()
    rows = allocation_rows(s, who, w, aggregate, warn)
    if format == "json":  # already validated rows: sent as they are, not validated twice
        result = Allocation(
            currency=cfg.currency,
            window=WindowOut(**w.as_dict()),
            aggregate=aggregate,
            rows=rows,
            warnings=warn,
        )
        return json_bytes(result.model_dump())
    # CSV has no room for them: the warnings travel in a header (JSON list)
    headers = {"X-Costexporter-Warnings": json.dumps(warn, ensure_ascii=True)} if warn else None
    if format == "csv":
        return PlainTextResponse(to_csv(rows, cfg.currency, w), media_type="text/csv", headers=headers)
    return PlainTextResponse(
        to_focus(rows, cfg.currency, w, aggregate, cfg.provider), media_type="text/csv", headers=headers
    )


def allocation_rows(
    s: LedgerStore, who: Principal, w: Window, aggregate: str, warn: Warnings
) -> list[AllocationRow]:
    names = [j for j, _ in s.jobs()]
    metas = s.meta_many(names, warn) if names else {}
    names = [j for j in names if who.sees(metas[j].get("team"))]
    amounts = s.amounts_many(names, w.start, w.end, warn) if names else {}
    steps = s.steps_many(names, w.start, w.end, warn) if names else {}
    groups: dict[str, list[str]] = {}
    for j in sorted(names):
        key = j if aggregate == "job" else (metas[j].get("team") or "(no team)")
        groups.setdefault(key, []).append(j)
    rows = [
        row(key, [amounts[j] for j in js], sum(steps[j].valid for j in js), [metas[j] for j in js])
        for key, js in sorted(groups.items())
    ]
    if who.all_teams:
        u = s.unassigned(w.start, w.end, warn)
        rows.append(
            AllocationRow(
                key="unassigned",
                team=None,
                cost_center=None,
                jobs=0,
                gpu_hours=u.hours(["unassigned"]),
                valid_gpu_hours=0.0,
                overhead_gpu_hours=0.0,
                wasted_gpu_hours=0.0,
                cost=money(u.cost("unassigned")),
                wasted_cost=money(0),
                valid_steps=0,
                cost_per_valid_step=None,
            )
        )
    return rows


def row(key: str, parts: list[Amounts], valid: int, metas: list[dict]) -> AllocationRow:
    """One allocation row: the jobs' amounts summed; team and cost center where they all agree."""
    a = Amounts()
    for p in parts:
        for u in ("ms", "mj", "ucost"):
            for c in CATEGORIES:
                getattr(a, u)[c] += getattr(p, u)[c]
    cost = a.total_cost(JOB_CATS)

    def common(field: str) -> str | None:
        return metas[0].get(field) if len({m.get(field) for m in metas}) == 1 else None

    return AllocationRow(
        key=key,
        team=common("team"),
        cost_center=common("cost_center"),
        jobs=len(parts),
        gpu_hours=a.hours(JOB_CATS),
        valid_gpu_hours=a.hours(VALID),
        overhead_gpu_hours=a.hours(["overhead"]),
        wasted_gpu_hours=a.hours(WASTED),
        cost=money(cost),
        wasted_cost=money(a.total_cost(WASTED)),
        valid_steps=valid,
        cost_per_valid_step=per(cost, valid),
    )
