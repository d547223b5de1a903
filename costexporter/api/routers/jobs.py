"""Jobs: the list, one job's totals over a window, its series and its incidents."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterable
from decimal import Decimal
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import Response

from costexporter.api.deps import Config, Store, Who, Win, visible_job
from costexporter.api.format import by_category, iso, json_bytes, micro, money, per, per_micro
from costexporter.api.schemas import (
    Attributed,
    ByCategory,
    CauseTotal,
    Credit,
    ForecastOut,
    GoodputOut,
    Incident,
    Incidents,
    JobList,
    JobSummary,
    JobTotals,
    ProfileOut,
    Series,
    SlowRankOut,
    WindowOut,
)
from costexporter.api.windows import Window
from costexporter.core import causes, flops, forecast, goodput
from costexporter.core.attribution import SUBMITTED_KEY
from costexporter.core.buckets import BUCKET_S, RESOLUTIONS
from costexporter.core.carbon import GridIntensity
from costexporter.core.cost import MJ_PER_KWH, MS_PER_HOUR
from costexporter.core.figures import exact_at_risk_ms
from costexporter.core.model import CATEGORIES
from costexporter.store import untrusted
from costexporter.store.ledger import notes_of, slow_ranks, unknown_before
from costexporter.store.ledger_read import (
    JOB_CATS,
    VALID,
    WASTED,
    Amounts,
    LedgerStore,
    Warnings,
    decimal,
    number,
    timestamp,
)

# Job names may contain "/" (`team/run-7`): the job is a path parameter, and the sub-resources are
# declared before the job itself so `a/b/series` is the series of `a/b`.
router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])
STEP_S = {r: RESOLUTIONS[r] for r in ("5m", "1h", "1d")}  # a series step
JOB_IDX = [CATEGORIES.index(c) for c in JOB_CATS]  # columns of a series matrix, per unit
WASTED_IDX = [CATEGORIES.index(c) for c in WASTED]
MAX_POINTS = 10_000


@router.get("", response_model=JobList)
def list_jobs(
    s: Store,
    who: Who,
    cfg: Config,
    team: Annotated[str | None, Query(max_length=200)] = None,
    status: Annotated[str | None, Query(max_length=40)] = None,
    cursor: Annotated[str | None, Query(max_length=400)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> JobList:
    after = ""
    if cursor:
        try:
            after = base64.b64decode(cursor.encode(), altchars=b"-_", validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            raise HTTPException(400, "cursor is not one this API returned") from None
    warn = Warnings()
    seen = dict(s.jobs(warn))
    names = sorted(j for j in seen if j > after)
    if team is not None or not who.all_teams:  # one cheap read of every team, then only those
        teams = s.teams_many(names)
        names = [j for j in names if who.sees(teams[j]) and (team is None or teams[j] == team)]
    out: list[JobSummary] = []
    last = None
    for chunk_start in range(0, len(names), 200):
        chunk = names[chunk_start : chunk_start + 200]
        info = s.info_many(chunk, warn)
        visible = [
            j
            for j in chunk
            if who.sees(info[j]["meta"].get("team"))
            and (team is None or info[j]["meta"].get("team") == team)
            and (status is None or info[j]["status"] == status)
        ][: limit - len(out)]  # the rest lies past this page
        totals = s.totals_many(visible, warn) if visible else {}
        first_seen = s.first_seen_many(visible, info)
        for j in visible:
            a, meta, fig = totals[j], info[j]["meta"], info[j]["figures"]
            cost = a.total_cost()
            valid = count(fig, "valid_steps", j, warn)
            out.append(
                JobSummary(
                    job=j,
                    team=meta.get("team"),
                    cost_center=meta.get("cost_center"),
                    gpu_model=meta.get("gpu_model"),
                    status=info[j]["status"],
                    first_seen=iso(first_seen[j]),
                    last_seen=iso(seen[j]),
                    gpu_hours=a.hours(JOB_CATS),
                    cost=money(cost),
                    wasted_gpu_hours=a.hours(WASTED),
                    valid_steps=valid,
                    cost_per_valid_step=per_micro(sum(a.ucost[c] for c in JOB_CATS), valid),
                    attribution=attribution_of(meta),
                )
            )
            last = j
            if len(out) >= limit:
                break
        if len(out) >= limit:
            break
    more = last is not None and len(out) >= limit and last != names[-1]
    nxt = base64.urlsafe_b64encode(last.encode()).decode() if more and last else None
    return JobList(currency=cfg.currency, jobs=out, next_cursor=nxt, warnings=warn)


@router.get("/{job:path}/series", response_model=Series, responses={404: {"description": "no such job"}})
def job_series(
    job: str, s: Store, who: Who, w: Win, cfg: Config, step: Literal["5m", "1h", "1d"] = "1h"
) -> Response:
    visible_job(job, who, s)
    secs = STEP_S[step]
    if (w.end - w.start) / secs > MAX_POINTS:  # refused before it takes a cache slot
        raise HTTPException(
            400, f"window {w.text!r} at step {step} is more than 10,000 points: use a coarser step"
        )
    return cfg.cache.get((job, w.start, w.end, step), lambda: series_body(job, w, step, s, cfg.currency))


def series_body(job: str, w: Window, step: str, s: LedgerStore, currency: str) -> Response:
    secs = STEP_S[step]
    warn = Warnings()
    starts, m = s.series_matrix(job, w.start, w.end, step, warn)
    # Per column for all points at once; the same integer sums and float divisions as `Amounts`.
    ms, mj, u = m[:, 0::3][:, JOB_IDX], m[:, 1::3][:, JOB_IDX], m[:, 2::3][:, JOB_IDX]
    hours = (ms.sum(axis=1) / MS_PER_HOUR).tolist()
    wasted = (m[:, 0::3][:, WASTED_IDX].sum(axis=1) / MS_PER_HOUR).tolist()
    cost = u.sum(axis=1).tolist()
    cat_h, cat_e, cat_u = (ms / MS_PER_HOUR).tolist(), (mj / MJ_PER_KWH).tolist(), u.tolist()
    empty: list[bool] = np.logical_not(m.any(axis=1)).tolist()
    zero = {  # the by_category of a point without amounts: one object, encoded as often as used
        "gpu_hours": dict.fromkeys(JOB_CATS, 0.0),
        "energy_kwh": dict.fromkeys(JOB_CATS, 0.0),
        "cost": dict.fromkeys(JOB_CATS, micro(0)),
    }
    points = [
        {
            "start": iso(b),
            "end": iso(b + secs),
            "gpu_hours": round(hours[k], 6),
            "cost": micro(cost[k]),
            "wasted_gpu_hours": round(wasted[k], 6),
            "by_category": zero
            if empty[k]
            else {
                "gpu_hours": {c: round(x, 6) for c, x in zip(JOB_CATS, cat_h[k], strict=True)},
                "energy_kwh": {c: round(x, 6) for c, x in zip(JOB_CATS, cat_e[k], strict=True)},
                "cost": {c: micro(x) for c, x in zip(JOB_CATS, cat_u[k], strict=True)},
            },
        }
        for k, b in enumerate(starts)
    ]
    # Built as plain data and sent as is: validating thousands of points again would double the time.
    return json_bytes(
        {
            "job": job,
            "currency": currency,
            "window": w.as_dict(),
            "step": step,
            "points": points,
            "warnings": warn,
        }
    )


@router.get(
    "/{job:path}/incidents", response_model=Incidents, responses={404: {"description": "no such job"}}
)
def job_incidents(job: str, s: Store, who: Who, w: Win, cfg: Config) -> Incidents:
    warn = Warnings()
    visible_job(job, who, s)
    raw = s.incidents(job, w.start, w.end, warn=warn)
    incs = [
        Incident(
            category=i["category"],
            start=iso(i["start"]),
            end=iso(i["end"]),
            ranks=i["ranks"],
            zero_util_ranks=i["zero_util_ranks"],
            hosts=i["hosts"],
            gpu_hours=i["gpu_ms"] / MS_PER_HOUR,
            cause=i["cause"],
            cause_why=i["cause_why"],
            cost=None if i["cost_micro"] is None else micro(i["cost_micro"]),
        )
        for i in raw
    ]
    by_cause = causes.window_totals(raw, w.start, w.end)  # each one's part inside the window
    if any(i["cost_micro"] is None for i in raw):
        warn.add(job, "incidents written before their cost was kept: by_cause and credit leave them out")
    credit = None
    if cfg.credit_causes:
        gpu_ms, ucost = causes.credited(by_cause, cfg.credit_causes)
        credit = Credit(causes=list(cfg.credit_causes), gpu_hours=gpu_ms / MS_PER_HOUR, cost=micro(ucost))
    return Incidents(
        job=job,
        currency=cfg.currency,
        window=WindowOut(**w.as_dict()),
        incidents=incs,
        by_cause={
            c: CauseTotal(gpu_hours=ms / MS_PER_HOUR, cost=micro(round(u)))
            for c, (ms, u) in sorted(by_cause.items())
        },
        credit=credit,
        warnings=warn,
    )


@router.get("/{job:path}", response_model=JobTotals, responses={404: {"description": "no such job"}})
def job_totals(job: str, s: Store, who: Who, w: Win, cfg: Config) -> JobTotals:
    warn = Warnings()
    info = visible_job(job, who, s, full=True, warn=warn)
    amounts, steps = s.window_many([job], w.start, w.end, warn)
    a, st = amounts[job], steps[job]
    meta, fig = info["meta"], info["figures"]
    for text in notes_of(fig):  # what the agents said of the job (a claim refused, a key unread)
        warn.add(job, text)
    ignored = getattr(meta, "ignored", ())
    if ignored:
        warn.add(
            job,
            f"its meta sets {', '.join(ignored)}, which only the operator's policy sets: ignored "
            "(counted in costexporter_meta_ignored_total)",
        )
    lost_ms = unknown_before(fig)
    if lost_ms is not None and w.start * 1000 < lost_ms:
        warn.add(
            job,
            f"Redis restarted empty at {iso(lost_ms / 1000)}: the job's amounts, steps and incidents "
            "before then are not in the ledger (run Redis with appendonly yes)",
        )
    cost = a.total_cost()
    ckpt = stored_time(fig, "last_checkpoint_ts", job, warn)
    risk_from = max(int(ckpt) // BUCKET_S * BUCKET_S, w.start) if ckpt else w.start
    # from the window's start (no checkpoint in it) that is the window's amounts, read above
    risk_to = max(w.end, risk_from + BUCKET_S)
    risk = a if risk_from == w.start else s.amounts_many([job], risk_from, risk_to)[job]
    at_risk = risk.hours(JOB_CATS)
    if ckpt:  # the agents' exact count from the checkpoint's own time, when the window holds it
        exact = exact_at_risk_ms(fig, round(ckpt * 1000), w.start * 1000, w.end * 1000)
        if exact is not None:
            at_risk = exact / MS_PER_HOUR
    spend_all = s.totals_many([job], warn)[job].total_cost()
    budget_d = stored_decimal(meta, "budget", job, warn)
    preflight = stored_json(fig, "preflight", job, warn)
    kwh = sum(a.mj[c] for c in JOB_CATS) / MJ_PER_KWH
    kg = job_carbon(s, job, w, kwh, cfg.carbon, warn)
    good = job_goodput(job, a, st.tokens, info, w, warn)
    return JobTotals(
        job=job,
        currency=cfg.currency,
        window=WindowOut(**w.as_dict()),
        price_versions=sorted(a.price_versions),
        team=meta.get("team"),
        cost_center=meta.get("cost_center"),
        gpu_model=meta.get("gpu_model"),
        status=info["status"],
        by_category=ByCategory.model_validate(by_category(a)),
        gpu_hours=a.hours(JOB_CATS),
        cost=money(cost),
        wasted_gpu_hours=a.hours(WASTED),
        wasted_cost=money(a.total_cost(WASTED)),
        steps_completed=st.completed,
        steps_voided=st.voided,
        valid_steps=st.valid,
        tokens=st.tokens,
        cost_per_valid_step=per_micro(sum(a.ucost[c] for c in JOB_CATS), st.valid),
        productive_cost_per_step=per_micro(a.ucost["productive"], st.valid),
        cost_per_million_tokens=per(cost, st.tokens, 10**6),
        goodput=GoodputOut(**good.report()),
        energy_kwh=kwh,
        energy_kwh_per_valid_step=kwh / st.valid if st.valid > 0 else None,
        carbon_kg=kg,
        carbon_kg_per_valid_step=kg / st.valid if kg is not None and st.valid > 0 else None,
        slow_ranks=job_slow_ranks(fig, a),
        forecast=ForecastOut(**job_forecast(s, job, fig, meta, spend_all, warn).report()),
        gpu_hours_at_risk=at_risk,
        budget=money(budget_d) if budget_d is not None else None,
        spend=money(spend_all),
        budget_used=float(spend_all / budget_d) if budget_d else None,
        attribution=attribution_of(meta),
        preflight=preflight,
        unknown_before=iso(lost_ms / 1000) if lost_ms is not None else None,
        warnings=warn,
        profile=ProfileOut(name=fig["profile"], calibrated=fig.get("profile_calibrated") == "1")
        if fig.get("profile")
        else None,
    )


def job_forecast(
    s: LedgerStore, job: str, fig: dict[str, Any], meta: Any, spent: Decimal, warn: Warnings
) -> forecast.Forecast:
    """The job's cost to finish (`core.forecast`), from its last hour of 5-minute buckets up to its
    end (or now), whatever the page's window: what is left does not depend on it."""
    total = forecast.total_steps_of(meta)
    raw_step = fig.get("last_step")
    try:
        last_step = int(float(raw_step)) if raw_step not in (None, "") else -1
    except (TypeError, ValueError):
        warn.add(job, f"last_step {raw_step!r} is not a step: ignored")
        last_step = -1
    buckets: list[tuple[int, float, int]] = []
    if total is not None and total > last_step:
        end = stored_time(fig, "end_ts", job, warn) or time.time()
        newest = int(end) // BUCKET_S * BUCKET_S
        starts = list(range(newest - forecast.WINDOW_S + BUCKET_S, newest + 1, BUCKET_S))
        for t, (a, st) in zip(
            starts, s.spans_of(job, [(t, t + BUCKET_S) for t in starts], warn), strict=True
        ):
            cost = sum(a.ucost[c] for c in JOB_CATS) / 1e6
            if cost or st.valid:
                buckets.append((t, cost, st.valid))
    return forecast.cost_to_finish(buckets, float(spent), last_step, total)


def job_slow_ranks(fig: dict[str, Any], a: Amounts) -> list[SlowRankOut]:
    """The slow ranks the agents priced (`core/straggler.py`), at the job's cost of a valid
    GPU-hour in the window: the steps were valid, they cost more."""
    valid_h = a.hours(VALID)
    rate = Decimal(sum(a.ucost[c] for c in VALID)) / 1_000_000 / Decimal(valid_h) if valid_h > 0 else None
    return [
        SlowRankOut(
            rank=r,
            gpu_hours=gpu_s / 3600,
            cost=money(rate * Decimal(gpu_s / 3600)) if rate is not None else None,
            minutes=blocks,
        )
        for r, (gpu_s, blocks) in sorted(slow_ranks(fig).items(), key=lambda kv: -kv[1][0])
    ]


def job_goodput(
    job: str, a: Amounts, tokens: int, info: dict[str, Any], w: Window, warn: Warnings
) -> goodput.Goodput:
    """The job's goodput layers over the window (`core.goodput`), from its amounts and what dates
    it: the figures' start and end (the agents' timeline), its ranks, its submission time."""
    fig, meta = info["figures"], info["meta"]
    start = stored_time(fig, "start_ts", job, warn) or info.get("first_seen")
    end = stored_time(fig, "end_ts", job, warn)
    attr = getattr(meta, "attribution", None)
    submitted = attr.get(SUBMITTED_KEY) if attr is not None else None
    span = goodput.JobSpan(
        start_ms=None if start is None else round(start * 1000),
        end_ms=round(end * 1000) if end else None,  # 0 (as "0.0" too): running
        width=int(info.get("ranks", 0)),
        submitted_ms=round(float(submitted) * 1000) if isinstance(submitted, float) else None,
    )
    now_ms = round(time.time() * 1000)
    return goodput.job_goodput(
        sum(a.ms[c] for c in VALID),
        sum(a.ms[c] for c in JOB_CATS),
        span,
        (w.start * 1000, min(w.end * 1000, now_ms)),
        flops.work(meta, fig.get("gpu_name") or meta.get("gpu_model"), tokens),
    )


def job_carbon(
    s: LedgerStore, job: str, w: Window, kwh: float, intensity: GridIntensity | None, warn: Warnings
) -> float | None:
    """kgCO2e of the job's energy in the window: at the one constant, or each 5-minute (hourly,
    over long windows) part of it at the series' value then; None where the series leaves a part
    uncovered (said)."""
    if intensity is None:
        return None

    def parts() -> Iterable[tuple[int, float]]:  # read only for a series
        res = "5m" if (w.end - w.start) / STEP_S["5m"] <= MAX_POINTS else "1h"
        starts, m = s.series_matrix(job, w.start, w.end, res, warn)
        kwh_at = (m[:, 1::3][:, JOB_IDX].sum(axis=1) / MJ_PER_KWH).tolist()
        return ((t * 1000, e) for t, e in zip(starts, kwh_at, strict=True))

    kg, uncovered = intensity.kg_of_energy(kwh, parts)
    if uncovered > 0:
        warn.add(
            job, f"carbon_kg: the grid intensity series leaves {uncovered:.3g} kWh of the window uncovered"
        )
        return None
    return kg


def attribution_of(meta: dict[str, Any]) -> dict[str, Attributed]:
    """The `attribution` of a job's row (`ledger_read.JobMeta`)."""
    attr = getattr(meta, "attribution", None)
    if attr is None:
        return {}
    return {k: Attributed(**v) for k, v in attr.report().items()}


# ---- stored values: parsed, or skipped with a warning (never a 500) ---------------------------------
def count(h: dict[str, Any], name: str, job: str, warn: Warnings) -> int:
    raw = h.get(name)
    n = number(raw) if raw not in (None, "") else 0
    if n is None or n < 0:
        warn.add(job, f"{name} {raw!r} is not a count: taken as 0")
        return 0
    return n


def stored_time(h: dict[str, Any], name: str, job: str, warn: Warnings) -> float | None:
    raw = h.get(name)
    if raw in (None, "", "0", 0):
        return None
    t = timestamp(raw)
    if t is None:
        warn.add(job, f"{name} {raw!r} is not a time: ignored")
    return t


def stored_decimal(h: dict[str, Any], name: str, job: str, warn: Warnings) -> Decimal | None:
    raw = h.get(name)
    if raw in (None, ""):
        return None
    d = decimal(raw)
    if d is None:
        warn.add(job, f"{name} {raw!r} is not an amount: ignored")
    return d


def stored_json(h: dict[str, Any], name: str, job: str, warn: Warnings) -> dict[str, Any] | None:
    raw = h.get(name)
    if not raw:
        return None
    try:
        parsed = untrusted.loads(raw)
    except untrusted.UntrustedValue:
        parsed = None
    if not isinstance(parsed, dict):
        warn.add(job, f"{name} is not a JSON object: ignored")
        return None
    return parsed
