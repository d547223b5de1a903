"""OpenCost's allocation API (`/allocation`, `/allocation/compute`, and `/model/allocation` as
OpenCost's UI proxies it): GPU cost per training job in the shape OpenCost clients read.

Every parameter is checked before the ledger is read: one this API does not honour, or a value
it cannot use, is a 400 with OpenCost's error body (`{"code": 400, "status": "error",
"message": ...}`), never a 200 that quietly ignores it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from costexporter.api import opencost as oc
from costexporter.api.auth import Principal
from costexporter.api.deps import Config, Store, Who
from costexporter.api.format import json_bytes
from costexporter.core.model import CATEGORIES
from costexporter.core.timeutil import iso_utc
from costexporter.store.ledger_read import JOB_CATS, VALID, WASTED, LedgerStore, Warnings, WindowTable

router = APIRouter(tags=["opencost"])
_COL = {c: n for n, c in enumerate(CATEGORIES)}

DESCRIPTION = (
    "OpenCost's allocation API over the ledger. Parameters: `window` (required: today, yesterday, "
    "week, lastweek, month, lastmonth, 45m, 24h, 7d, 2w, or an RFC 3339 / Unix-seconds pair), "
    "`aggregate` (all, cluster, namespace, controller, controllerKind, team, label:<name>; "
    "comma-combined; default controller, the training job), `step` (any multiple of 5m: 1h, 2h, "
    "24h, 1d, 1w), `accumulate` (default false), `filter` (OpenCost's filter language: "
    'namespace:"a", controllerName:"job", label[team]:"llm", joined by + or |), `includeIdle` '
    "(adds `__idle__`: GPU time no job registered; `idle` is its older name), `filterNamespaces` "
    "(OpenCost's v1 namespace filter). A parameter whose value changes nothing here (idleByNode=false, "
    "an empty filterClusters, a resolution up to 5m, ...) is accepted and said in `warning`; any "
    "other parameter or value is a 400 naming it."
)


def _run(request: Request, s: LedgerStore, who: Principal, cluster: str | None, tz: str) -> Response:
    notes: list[str] = []
    try:
        q = oc.check_params(list(request.query_params.multi_items()), notes)
        w = oc.parse_window(q.get("window"), tz)
        fields = oc.parse_aggregate(q.get("aggregate"))
        step = oc.parse_step(q["step"]) if q.get("step") else None
        accumulate = oc.parse_bool("accumulate", q.get("accumulate"), False)
        include_idle = oc.include_idle(q)
        if oc.parse_bool("shareIdle", q.get("shareIdle"), False):
            raise oc.OpenCostError("shareIdle=true is not supported: idle GPU time is not shared out")
        pred = oc.parse_filter(q.get("filter"))
        by_ns = oc.namespaces_filter(q.get("filterNamespaces"))
        spans = oc.periods(w, step, accumulate)
    except oc.OpenCostError as e:
        return JSONResponse(oc.error(400, str(e)), status_code=400)
    if by_ns is not None:
        pred = by_ns if pred is None else (lambda p, a=pred, b=by_ns: a(p) and b(p))
    for f in fields:
        if f in oc.FINER_FIELDS:
            notes.append(f"aggregate {f}: {oc.FINER_FIELDS[f]}: every allocation's {f} is {oc.UNALLOCATED}")
    if include_idle and not who.all_teams:
        include_idle = False
        notes.append(
            "__idle__ is left out: GPU time no job registered is shown to tokens that see every team"
        )
    if not w.exact:
        notes.append(
            f"window {w.text!r} ({iso_utc(w.asked_start)} to {iso_utc(w.asked_end)}) does not fall on "
            f"the ledger's 5-minute buckets: used {iso_utc(w.start)} to {iso_utc(w.end)}"
        )
    if include_idle and pred is not None:
        notes.append("__idle__ is left out: a filter selects jobs, and idle GPU time belongs to none")
    warn = Warnings()
    names = s.job_names(spans[0][0], spans[-1][1])  # other clusters': those sealed in the window
    metas, tables = s.tables(names, spans, warn, meta=True)
    props = [oc.job_props(j, metas.get(j, {}), cluster) for j in names]
    keep = [
        i
        for i, j in enumerate(names)
        if who.sees(_team(metas.get(j, {}))) and (pred is None or pred(props[i]))
    ]
    data = []
    for (start, end), table in zip(spans, tables, strict=True):
        jobs = [(props[i], _sums(table, i)) for i in keep]
        idle = None
        if include_idle and pred is None:
            u = s.unassigned(start, end, warn)
            idle = oc.Sums(ms=u.ms["unassigned"], ucost=u.ucost["unassigned"])
        data.append(oc.allocation_set(jobs, fields, start, end, idle))
    return json_bytes(oc.envelope(data, notes + list(warn)))


def _team(meta: dict[str, Any]) -> str | None:
    t = meta.get("team")
    return t if isinstance(t, str) and t else None


def _sums(table: WindowTable, i: int) -> oc.Sums:
    """Job `i`'s integer amounts in one set (its row of the table: ms, mJ, micro-cost per category)."""
    row = table.net[i].tolist()

    def ms(cats: list[str]) -> int:
        return sum(row[3 * _COL[c]] for c in cats)

    def uc(cats: list[str]) -> int:
        return sum(row[3 * _COL[c] + 2] for c in cats)

    return oc.Sums(
        ms=ms(JOB_CATS),
        valid_ms=ms(VALID),
        wasted_ms=ms(WASTED),
        ucost=uc(JOB_CATS),
        wasted_ucost=uc(WASTED),
        valid_steps=table.steps[table.jobs[i]].valid,
    )


def opencost_allocation(request: Request, s: Store, who: Who, cfg: Config) -> Response:
    return _run(request, s, who, cfg.cluster, cfg.tz)


@router.get(
    "/model/getConfigs",
    summary="OpenCost's configuration (its currency)",
    description="What OpenCost clients read of OpenCost's configuration: `currencyCode` (kubectl-cost "
    "labels its table with it).",
)
def opencost_configs(cfg: Config) -> Response:
    return json_bytes({"code": 200, "status": "success", "data": {"currencyCode": cfg.currency}})


for path in ("/allocation", "/allocation/compute", "/model/allocation", "/model/allocation/compute"):
    router.add_api_route(
        path,
        opencost_allocation,
        methods=["GET"],
        summary="OpenCost allocation" + (" (OpenCost UI path)" if path.startswith("/model") else ""),
        description=DESCRIPTION,
        name=f"opencost{path.replace('/', '_')}",
        responses={400: {"description": "a parameter this API does not honour, or a bad value"}},
    )
