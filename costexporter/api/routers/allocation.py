"""Allocation: every visible job's cost over a window, aggregated like OpenCost (job, team,
namespace, cost_center, label:<name>, comma-combined), whole or per step, as JSON, CSV or FOCUS."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import PlainTextResponse, Response

from costexporter.api import aggregate as agg
from costexporter.api.auth import Principal
from costexporter.api.deps import Config, Store, Who, Win
from costexporter.api.export import to_csv, to_focus
from costexporter.api.format import json_bytes
from costexporter.api.schemas import Allocation, AllocationRow
from costexporter.api.windows import Window
from costexporter.core import causes
from costexporter.core.carbon import GridIntensity
from costexporter.core.timeutil import parse_instant
from costexporter.store.ledger_read import LedgerStore, Warnings

router = APIRouter(prefix="/api/v1/allocation", tags=["allocation"])

AGGREGATE = (
    "What a row is: job, team, namespace, cost_center, cluster (this API's, or another cluster's "
    "billed from the archive) or label:<name> (a field of the job's meta), or several "
    "comma-combined (team,namespace): the row's key joins their values with '/'."
)


@router.get(
    "",
    response_model=Allocation,
    responses={200: {"content": {"text/csv": {}}}, 400: {"description": "bad window, aggregate or step"}},
)
def allocation(
    s: Store,
    who: Who,
    w: Win,
    cfg: Config,
    aggregate: Annotated[str, Query(description=AGGREGATE, max_length=300)] = "job",
    format: Literal["json", "csv", "focus"] = "json",
    accumulate: Annotated[
        bool, Query(description="true: one row per key for the window; false: per step")
    ] = True,
    step: Annotated[
        Literal["5m", "1h", "1d", "1w"] | None, Query(description="with accumulate=false")
    ] = None,
) -> Response:
    try:
        fields = agg.parse_aggregate(aggregate)
        spans = agg.periods(w.start, w.end, None if accumulate else (step or "1d"))
        if format == "focus":  # a FOCUS charge lies inside one billing period (a calendar month)
            spans = agg.split_months(spans)
            if len(spans) > agg.MAX_PERIODS:
                raise agg.AggregateError(f"more than {agg.MAX_PERIODS} periods: use a coarser step")
    except agg.AggregateError as e:
        raise HTTPException(400, str(e)) from None
    warn = Warnings()
    members: dict[str, list[str]] = {}  # a group's jobs (an aggregate other than by job)
    rows = allocation_rows(s, who, spans, fields, warn, cfg.cluster, cfg.carbon, members)
    if format == "json":  # rows built to the schema (`Allocation`): sent as they are
        return json_bytes(
            {
                "currency": cfg.currency,
                "window": w.as_dict(),
                "aggregate": ",".join(fields),
                "accumulate": accumulate,
                "step": None if accumulate else (step or "1d"),
                "rows": rows,
                "warnings": list(warn),
            }
        )
    models = [AllocationRow.model_construct(**r) for r in rows]
    if format == "csv":
        body = to_csv(models, cfg.currency, w)
    else:
        credits = focus_credits(s, rows, cfg.credit_causes, w, warn, members)
        body = to_focus(models, cfg.currency, fields, cfg.focus, warn, credits)
    # CSV has no room for them: the warnings travel in a header (a JSON list)
    headers = {"X-Costexporter-Warnings": json.dumps(warn, ensure_ascii=True)} if warn else None
    return PlainTextResponse(body, media_type="text/csv", headers=headers)


def focus_credits(
    s: LedgerStore,
    rows: list[dict[str, Any]],
    credit_causes: tuple[str, ...],
    w: Window,
    warn: Warnings,
    members: dict[str, list[str]],
) -> dict[tuple[str, str], tuple[float, int, tuple[str, ...]]]:
    """Each row's credit (the policy's `credit_causes`' share of its jobs' incidents in the row's
    period: GPU-ms, micro-cost, the causes), read for the rows that wasted time, in two round
    trips for all their jobs; none without credited causes. `members`: a group's jobs (a row
    per job: the row's own)."""
    keys = {r["key"] for r in rows if r["wasted_gpu_hours"] > 0 and r["key"] != "unassigned"}
    if not credit_causes or not keys:
        return {}
    of = {k: members.get(k, [k]) for k in keys}
    incidents = s.incidents_many(sorted({j for js in of.values() for j in js}), w.start, w.end, warn=warn)
    out = {}
    for r in rows:
        theirs = [incidents[j] for j in of.get(r["key"], ()) if j in incidents]
        if not theirs:
            continue
        start, end = parse_instant(r["start"]), parse_instant(r["end"])
        gpu_ms, ucost = 0.0, 0
        for inc in theirs:
            ms, u = causes.credited(causes.window_totals(inc, start, end), credit_causes)
            gpu_ms, ucost = gpu_ms + ms, ucost + u
        out[r["key"], r["start"]] = (gpu_ms, ucost, credit_causes)
    return out


def allocation_rows(
    s: LedgerStore,
    who: Principal,
    spans: list[tuple[int, int]],
    fields: list[str],
    warn: Warnings,
    cluster: str | None = None,
    intensity: GridIntensity | None = None,
    members: dict[str, list[str]] | None = None,
) -> list[dict[str, Any]]:
    """Rows of every period (as `AllocationRow` dicts), in time order; the unassigned pool last in
    each period (only for a caller who sees every team); `members` (given): filled with each
    group's jobs, an aggregate other than by job. One read for every job and period
    (meta and each period's rollup records), then column sums. A row per job depends on its job
    alone: those rows are made chunk by chunk while Redis reads the next chunks, then sorted."""
    names = s.job_names(spans[0][0], spans[-1][1])  # other clusters': those sealed in the window
    grams = [None if intensity is None else intensity.over(a * 1000, b * 1000) for a, b in spans]
    # this API's intensity is its own cluster's grid: another cluster's jobs get no carbon
    foreign = s.foreign(names) if intensity is not None else set()
    if foreign:
        warn.add(
            "carbon_kg", "null for other clusters' jobs: this API's carbon_intensity is its own cluster's"
        )
    if intensity is not None and None in grams:
        warn.add(
            "carbon_kg",
            f"null for periods that one value of the grid's intensity ({intensity.describe()}) does "
            "not cover: ask for step=1h (accumulate=false), or a job's own totals",
        )
    if fields == ["job"]:
        per_span: list[list[dict[str, Any]]] = [[] for _ in spans]
        chunks = 0
        for _jobs, metas, tables in s.table_chunks(names, spans, warn, meta=True):
            chunks += 1
            visible = [i for i, j in enumerate(_jobs) if who.sees(metas[j].get("team"))]
            theirs = frozenset(i for i, j in enumerate(_jobs) if j in foreign)
            for rows, (start, end), table, g in zip(per_span, spans, tables, grams, strict=True):
                rows += agg.table_rows(table, metas, visible, fields, start, end, g, theirs)
        if chunks > 1:
            for rows in per_span:
                rows.sort(key=_key)
    else:
        metas, tables = s.tables(names, spans, warn, meta=True)
        if "cluster" in fields and cluster:  # this cluster's jobs: the API's cluster
            for m in metas.values():
                if not isinstance(m.get("cluster"), str) or not m["cluster"]:
                    m["cluster"] = cluster
        visible = [i for i, j in enumerate(names) if who.sees(metas[j].get("team"))]
        theirs = frozenset(i for i, j in enumerate(names) if j in foreign)
        if members is not None:
            for k, (_, at) in agg.groups_of(fields, names, metas, visible).items():
                members[k] = [names[i] for i in at]
        per_span = [
            agg.table_rows(table, metas, visible, fields, start, end, g, theirs)
            for (start, end), table, g in zip(spans, tables, grams, strict=True)
        ]
    out: list[dict[str, Any]] = []
    for (start, end), rows, g in zip(spans, per_span, grams, strict=True):
        out += rows
        if who.all_teams:
            # (the pool holds other clusters' unassigned time too, at their grids')
            g_pool = None if s.others else g
            out.append(agg.unassigned_row(s.unassigned(start, end, warn), start, end, g_pool).model_dump())
    return out


def _key(row: dict[str, Any]) -> str:
    return str(row["key"])
