"""The finance API (FastAPI) under /api/v1: cost per valid step and wasted GPU-hours, per job, team
and window. Read-only. Money is a decimal string with 6 places; every response carries its
currency and the window it resolved to.
"""

import base64
import csv
import datetime as dt
import io
from decimal import Decimal
from typing import Annotated, Literal

import orjson
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from .. import __version__
from ..model import CATEGORIES
from .auth import Principal, Tokens
from .store import JOB_CATS, VALID, WASTED, Amounts, LedgerStore, Steps
from .windows import ACCEPTED, Window, WindowError, parse_window

PLACES = Decimal("0.000001")


def money(x: Decimal | int | float) -> str:
    return str(Decimal(x).quantize(PLACES))


def json_bytes(body: object) -> Response:
    """Large, already-shaped bodies (series, allocation) encoded by orjson and sent as they are."""
    return Response(orjson.dumps(body), media_type="application/json")


def micro(u: int) -> str:
    """Micro-units as a decimal string with 6 places, by integer arithmetic (exact and fast)."""
    sign, u = ("-", -u) if u < 0 else ("", u)
    return f"{sign}{u // 1_000_000}.{u % 1_000_000:06d}"


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(float(ts), dt.timezone.utc).isoformat().replace("+00:00", "Z")


# ---- response models ---------------------------------------------------------------------------
class WindowOut(BaseModel):
    requested: str
    start: str
    end: str
    start_unix: int
    end_unix: int
    bucket_seconds: int


class ByCategory(BaseModel):
    gpu_hours: dict[str, float]
    energy_kwh: dict[str, float]
    cost: dict[str, str]


class JobSummary(BaseModel):
    job: str
    team: str | None
    cost_center: str | None
    gpu_model: str | None
    status: str
    first_seen: str | None
    last_seen: str | None
    gpu_hours: float
    cost: str
    wasted_gpu_hours: float
    valid_steps: int
    cost_per_valid_step: str | None


class JobList(BaseModel):
    currency: str
    jobs: list[JobSummary]
    next_cursor: str | None


class ProfileOut(BaseModel):
    """The band profile the agents classify the job's GPUs with; uncalibrated ones are derived
    from the power limit and may misclassify (calibrate one with `costexporter calibrate`)."""

    name: str
    calibrated: bool


class JobTotals(BaseModel):
    job: str
    currency: str
    window: WindowOut
    price_versions: list[str]
    team: str | None
    cost_center: str | None
    gpu_model: str | None
    status: str
    by_category: ByCategory
    gpu_hours: float
    cost: str
    wasted_gpu_hours: float
    wasted_cost: str
    steps_completed: int
    steps_voided: int
    valid_steps: int
    tokens: int
    cost_per_valid_step: str | None
    productive_cost_per_step: str | None
    cost_per_million_tokens: str | None
    gpu_hours_at_risk: float
    budget: str | None
    spend: str
    budget_used: float | None
    preflight: dict | None
    profile: ProfileOut | None = None


class SeriesPoint(BaseModel):
    start: str
    end: str
    gpu_hours: float
    cost: str
    wasted_gpu_hours: float
    by_category: ByCategory


class Series(BaseModel):
    job: str
    currency: str
    window: WindowOut
    step: str
    points: list[SeriesPoint]


class Incident(BaseModel):
    category: str
    start: str
    end: str
    ranks: list[int]
    hosts: list[str]
    gpu_hours: float


class Incidents(BaseModel):
    job: str
    currency: str
    window: WindowOut
    incidents: list[Incident]


class AllocationRow(BaseModel):
    key: str
    team: str | None
    cost_center: str | None
    jobs: int
    gpu_hours: float
    valid_gpu_hours: float
    overhead_gpu_hours: float
    wasted_gpu_hours: float
    cost: str
    wasted_cost: str
    valid_steps: int
    cost_per_valid_step: str | None


class Allocation(BaseModel):
    currency: str
    window: WindowOut
    aggregate: str
    rows: list[AllocationRow]


class Health(BaseModel):
    status: str
    version: str


# ---- helpers ---------------------------------------------------------------------------------
def by_category(a: Amounts) -> dict:
    # 6 decimals: a micro-GPU-hour is 3.6 ms, finer than anything the ledger resolves.
    return {
        "gpu_hours": {c: round(a.ms[c] / 3.6e6, 6) for c in JOB_CATS},
        "energy_kwh": {c: round(a.mj[c] / 3.6e9, 6) for c in JOB_CATS},
        "cost": {c: micro(a.ucost[c]) for c in JOB_CATS},
    }


def per(cost: Decimal, n: int, scale: int = 1) -> str | None:
    return money(cost * scale / n) if n > 0 else None


CSV_COLUMNS = [
    "key",
    "team",
    "cost_center",
    "jobs",
    "gpu_hours",
    "valid_gpu_hours",
    "overhead_gpu_hours",
    "wasted_gpu_hours",
    "cost",
    "wasted_cost",
    "valid_steps",
    "cost_per_valid_step",
    "currency",
    "window_start",
    "window_end",
]

# FinOps FOCUS 1.2: every column of the specification (the mandatory ones filled), then x_ columns.
FOCUS_COLUMNS = [
    "AvailabilityZone",
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingAccountType",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "CapacityReservationId",
    "CapacityReservationStatus",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "CommitmentDiscountCategory",
    "CommitmentDiscountId",
    "CommitmentDiscountName",
    "CommitmentDiscountQuantity",
    "CommitmentDiscountStatus",
    "CommitmentDiscountType",
    "CommitmentDiscountUnit",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceId",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingCurrency",
    "PricingCurrencyContractedUnitPrice",
    "PricingCurrencyEffectiveCost",
    "PricingCurrencyListUnitPrice",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "RegionId",
    "RegionName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "ServiceSubcategory",
    "SkuId",
    "SkuMeter",
    "SkuPriceDetails",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "SubAccountType",
    "Tags",
]
FOCUS_X = ["x_ValidSteps", "x_WastedGpuHours", "x_CostPerValidStep", "x_ValidGpuHours", "x_TrainingJob"]


def create_app(
    store: LedgerStore,
    tokens: Tokens | None = None,
    currency: str = "USD",
    tz: str = "UTC",
    provider: str = "costexporter",
    cache_s: float = 5.0,
) -> FastAPI:
    """The app. `cache_s`: series responses are reused this long (dashboards poll the same
    ranges; 0 turns it off)."""
    tokens = tokens or Tokens([])
    import threading
    import time as _time

    series_cache: dict[tuple, tuple[float, Response]] = {}
    cache_lock = threading.Lock()
    key_locks: dict[tuple, threading.Lock] = {}  # one computation per key at a time (no stampede)
    app = FastAPI(
        title="costexporter finance API",
        version=__version__,
        description="Cost per valid step and wasted GPU-hours of training jobs, per window, job and team.",
    )

    # ---- dependencies ------------------------------------------------------------------------
    def get_store() -> LedgerStore:
        return store

    def principal(authorization: Annotated[str | None, Header()] = None) -> Principal:
        who = tokens.check(authorization)
        if who is None:
            raise HTTPException(
                401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"}
            )
        return who

    def window(window: Annotated[str | None, Query(description=ACCEPTED, max_length=120)] = None) -> Window:
        try:
            return parse_window(window, tz)
        except WindowError as e:
            raise HTTPException(400, str(e)) from None

    Store = Annotated[LedgerStore, Depends(get_store)]
    Who = Annotated[Principal, Depends(principal)]
    Win = Annotated[Window, Depends(window)]

    def visible_job(job: str, who: Principal, s: LedgerStore, full: bool = False) -> dict:
        """The job's info (all of it with `full`, else just its team), or 404: unknown, or
        outside the token's scope (as if absent)."""
        exists, team = s.job_team(job)
        if not exists or not who.sees(team):
            raise HTTPException(404, f"no job {job!r}")
        return s.info_many([job])[job] if full else {"meta": {"team": team}}

    # ---- errors: bad input is a 400, a Redis outage a 503, never a 500 ------------------------
    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        msgs = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"detail": f"bad parameter: {msgs}"}, status_code=400)

    import redis

    @app.exception_handler(redis.RedisError)
    async def redis_down(_request: Request, exc: redis.RedisError) -> JSONResponse:
        return JSONResponse(
            {"detail": f"the ledger (Redis) is unreachable: {type(exc).__name__}"}, status_code=503
        )

    # ---- health ------------------------------------------------------------------------------
    health = APIRouter(tags=["health"])

    @health.get("/healthz", response_model=Health)
    def healthz() -> Health:
        return Health(status="ok", version=__version__)

    @health.get("/readyz", response_model=Health, responses={503: {"description": "Redis unreachable"}})
    def readyz(s: Store) -> Health:
        try:
            s.ping()
        except redis.RedisError:
            raise HTTPException(503, "Redis is unreachable") from None
        return Health(status="ready", version=__version__)

    # ---- jobs --------------------------------------------------------------------------------
    jobs = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])

    @jobs.get("", response_model=JobList)
    def list_jobs(
        s: Store,
        who: Who,
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
        seen = dict(s.jobs())
        names = sorted(j for j in seen if j > after)
        out: list[JobSummary] = []
        last = None
        for chunk_start in range(0, len(names), 200):
            chunk = names[chunk_start : chunk_start + 200]
            info = s.info_many(chunk)
            visible = [
                j
                for j in chunk
                if who.sees(info[j]["meta"].get("team"))
                and (team is None or info[j]["meta"].get("team") == team)
                and (status is None or info[j]["status"] == status)
            ]
            totals = s.totals_many(visible) if visible else {}
            for j in visible:
                a, meta, fig = totals[j], info[j]["meta"], info[j]["figures"]
                cost = a.total_cost()
                valid = int(fig.get("valid_steps", 0) or 0)
                out.append(
                    JobSummary(
                        job=j,
                        team=meta.get("team"),
                        cost_center=meta.get("cost_center"),
                        gpu_model=meta.get("gpu_model"),
                        status=info[j]["status"],
                        first_seen=iso(info[j]["first_seen"]),
                        last_seen=iso(seen[j]),
                        gpu_hours=a.hours(JOB_CATS),
                        cost=money(cost),
                        wasted_gpu_hours=a.hours(WASTED),
                        valid_steps=valid,
                        cost_per_valid_step=per(cost, valid),
                    )
                )
                last = j
                if len(out) >= limit:
                    break
            if len(out) >= limit:
                break
        more = last is not None and len(out) >= limit and last != names[-1]
        nxt = base64.urlsafe_b64encode(last.encode()).decode() if more and last else None
        return JobList(currency=currency, jobs=out, next_cursor=nxt)

    def totals_of(job: str, info: dict, w: Window, s: LedgerStore) -> tuple[Amounts, Steps]:
        return s.amounts_many([job], w.start, w.end)[job], s.steps_many([job], w.start, w.end)[job]

    @jobs.get("/{job}", response_model=JobTotals, responses={404: {"description": "no such job"}})
    def job_totals(job: str, s: Store, who: Who, w: Win) -> JobTotals:
        info = visible_job(job, who, s, full=True)
        a, st = totals_of(job, info, w, s)
        meta, fig = info["meta"], info["figures"]
        cost = a.total_cost()
        ckpt = float(fig.get("last_checkpoint_ts", 0) or 0)
        risk_from = max(int(ckpt) // 300 * 300, w.start) if ckpt > 0 else w.start
        at_risk = s.amounts_many([job], risk_from, max(w.end, risk_from + 300))[job].hours(JOB_CATS)
        spend_all = s.totals_many([job])[job].total_cost()
        budget = meta.get("budget")
        budget_d = Decimal(budget) if budget not in (None, "") else None
        preflight = None
        if fig.get("preflight"):
            import json

            preflight = json.loads(fig["preflight"])
        return JobTotals(
            job=job,
            currency=currency,
            window=WindowOut(**w.as_dict()),
            price_versions=sorted(a.price_versions),
            team=meta.get("team"),
            cost_center=meta.get("cost_center"),
            gpu_model=meta.get("gpu_model"),
            status=info["status"],
            by_category=by_category(a),
            gpu_hours=a.hours(JOB_CATS),
            cost=money(cost),
            wasted_gpu_hours=a.hours(WASTED),
            wasted_cost=money(a.total_cost(WASTED)),
            steps_completed=st.completed,
            steps_voided=st.voided,
            valid_steps=st.valid,
            tokens=st.tokens,
            cost_per_valid_step=per(cost, st.valid),
            productive_cost_per_step=per(a.cost("productive"), st.valid),
            cost_per_million_tokens=per(cost, st.tokens, 10**6),
            gpu_hours_at_risk=at_risk,
            budget=money(budget_d) if budget_d is not None else None,
            spend=money(spend_all),
            budget_used=float(spend_all / budget_d) if budget_d else None,
            preflight=preflight,
            profile=ProfileOut(name=fig["profile"], calibrated=fig.get("profile_calibrated") == "1")
            if fig.get("profile")
            else None,
        )

    @jobs.get("/{job}/series", response_model=Series, responses={404: {"description": "no such job"}})
    def job_series(job: str, s: Store, who: Who, w: Win, step: Literal["5m", "1h", "1d"] = "1h") -> Series:
        visible_job(job, who, s)
        key = (job, w.start, w.end, step)
        with cache_lock:
            key_lock = key_locks.setdefault(key, threading.Lock())
            hit = series_cache.get(key)
        if hit is not None and _time.monotonic() - hit[0] < cache_s:
            return hit[1]
        if hit is not None:  # stale: one request refreshes it, the others get the previous answer
            if not key_lock.acquire(blocking=False):
                return hit[1]
            try:
                return compute_series(job, w, step, s, key)
            finally:
                key_lock.release()
        with key_lock:  # nothing yet: one computes, the others wait for it (no stampede)
            with cache_lock:
                hit = series_cache.get(key)
            if hit is not None:
                return hit[1]
            return compute_series(job, w, step, s, key)

    def compute_series(job: str, w: Window, step: str, s: LedgerStore, key: tuple) -> Response:
        now = _time.monotonic()
        secs = {"5m": 300, "1h": 3600, "1d": 86400}[step]
        if (w.end - w.start) / secs > 10_000:
            raise HTTPException(
                400, f"window {w.text!r} at step {step} is more than 10,000 points: use a coarser step"
            )
        points = [
            {
                "start": iso(b),
                "end": iso(b + secs),
                "gpu_hours": round(a.hours(JOB_CATS), 6),
                "cost": micro(sum(a.ucost[c] for c in JOB_CATS)),
                "wasted_gpu_hours": round(a.hours(WASTED), 6),
                "by_category": by_category(a),
            }
            for b, a in s.series(job, w.start, w.end, step)
        ]
        # Built as plain data and sent as is: validating thousands of points again would double the time.
        body = {"job": job, "currency": currency, "window": w.as_dict(), "step": step, "points": points}
        response = json_bytes(body)
        if cache_s > 0:
            with cache_lock:
                if len(series_cache) > 256:
                    series_cache.clear()
                    key_locks.clear()
                series_cache[key] = (now, response)
        return response

    @jobs.get("/{job}/incidents", response_model=Incidents, responses={404: {"description": "no such job"}})
    def job_incidents(job: str, s: Store, who: Who, w: Win) -> Incidents:
        visible_job(job, who, s)
        incs = [
            Incident(
                category=i["category"],
                start=iso(i["start"]),
                end=iso(i["end"]),
                ranks=i["ranks"],
                hosts=i["hosts"],
                gpu_hours=i["gpu_ms"] / 3.6e6,
            )
            for i in s.incidents(job, w.start, w.end)
        ]
        return Incidents(job=job, currency=currency, window=WindowOut(**w.as_dict()), incidents=incs)

    # ---- allocation ---------------------------------------------------------------------------
    alloc = APIRouter(prefix="/api/v1/allocation", tags=["allocation"])

    @alloc.get("", response_model=Allocation, responses={200: {"content": {"text/csv": {}}}})
    def allocation(
        s: Store,
        who: Who,
        w: Win,
        aggregate: Literal["job", "team"] = "job",
        format: Literal["json", "csv", "focus"] = "json",
    ):
        names = [j for j, _ in s.jobs()]
        info = {j: {"meta": m} for j, m in s.meta_many(names).items()} if names else {}
        names = [j for j in names if who.sees(info[j]["meta"].get("team"))]
        amounts = s.amounts_many(names, w.start, w.end) if names else {}
        steps = s.steps_many(names, w.start, w.end) if names else {}
        groups: dict[str, list[str]] = {}
        for j in sorted(names):
            key = j if aggregate == "job" else (info[j]["meta"].get("team") or "(no team)")
            groups.setdefault(key, []).append(j)
        rows = []
        for key, js in sorted(groups.items()):
            a = Amounts()
            for j in js:
                for u in ("ms", "mj", "ucost"):
                    for c in CATEGORIES:
                        getattr(a, u)[c] += getattr(amounts[j], u)[c]
            valid = sum(steps[j].valid for j in js)
            metas = [info[j]["meta"] for j in js]
            cost = a.total_cost()
            rows.append(
                AllocationRow(
                    key=key,
                    team=metas[0].get("team") if len({m.get("team") for m in metas}) == 1 else None,
                    cost_center=metas[0].get("cost_center")
                    if len({m.get("cost_center") for m in metas}) == 1
                    else None,
                    jobs=len(js),
                    gpu_hours=a.hours(JOB_CATS),
                    valid_gpu_hours=a.hours(VALID),
                    overhead_gpu_hours=a.hours(["overhead"]),
                    wasted_gpu_hours=a.hours(WASTED),
                    cost=money(cost),
                    wasted_cost=money(a.total_cost(WASTED)),
                    valid_steps=valid,
                    cost_per_valid_step=per(cost, valid),
                )
            )
        if who.all_teams:
            u = s.unassigned(w.start, w.end)
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
        result = Allocation(
            currency=currency, window=WindowOut(**w.as_dict()), aggregate=aggregate, rows=rows
        )
        if format == "json":  # already validated rows: sent as they are, not validated twice
            return json_bytes(result.model_dump())
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        if format == "csv":
            writer.writerow(CSV_COLUMNS)
            for r in rows:
                writer.writerow(
                    [
                        r.key,
                        r.team or "",
                        r.cost_center or "",
                        r.jobs,
                        f"{r.gpu_hours:.6f}",
                        f"{r.valid_gpu_hours:.6f}",
                        f"{r.overhead_gpu_hours:.6f}",
                        f"{r.wasted_gpu_hours:.6f}",
                        r.cost,
                        r.wasted_cost,
                        r.valid_steps,
                        r.cost_per_valid_step or "",
                        currency,
                        iso(w.start),
                        iso(w.end),
                    ]
                )
        else:
            writer.writerow(FOCUS_COLUMNS + FOCUS_X)
            for r in rows:
                hours = Decimal(f"{r.gpu_hours:.6f}")
                unit = money(Decimal(r.cost) / hours) if hours else ""
                tags = {"team": r.team or "", "cost_center": r.cost_center or "", "aggregate": aggregate}
                import json

                values = {
                    "BilledCost": r.cost,
                    "EffectiveCost": r.cost,
                    "ListCost": r.cost,
                    "ContractedCost": r.cost,
                    "BillingAccountId": provider,
                    "BillingAccountName": provider,
                    "BillingAccountType": "Cluster",
                    "BillingCurrency": currency,
                    "PricingCurrency": currency,
                    "BillingPeriodStart": iso(w.start),
                    "BillingPeriodEnd": iso(w.end),
                    "ChargePeriodStart": iso(w.start),
                    "ChargePeriodEnd": iso(w.end),
                    "ChargeCategory": "Usage",
                    "ChargeFrequency": "Usage-Based",
                    "ChargeDescription": f"GPU time of {r.key} ({aggregate}), {r.valid_steps} valid steps",
                    "ConsumedQuantity": f"{hours}",
                    "ConsumedUnit": "GPU-Hours",
                    "PricingQuantity": f"{hours}",
                    "PricingUnit": "GPU-Hours",
                    "PricingCategory": "Standard",
                    "ContractedUnitPrice": unit,
                    "ListUnitPrice": unit,
                    "ServiceCategory": "AI and Machine Learning",
                    "ServiceName": "GPU training",
                    "ProviderName": provider,
                    "PublisherName": provider,
                    "InvoiceIssuerName": provider,
                    "ResourceId": r.key,
                    "ResourceName": r.key,
                    "ResourceType": "Training job"
                    if aggregate == "job" and r.key != "unassigned"
                    else "GPU pool",
                    "SubAccountId": r.team or "",
                    "SubAccountName": r.team or "",
                    "Tags": json.dumps(tags),
                    "x_ValidSteps": r.valid_steps,
                    "x_WastedGpuHours": f"{r.wasted_gpu_hours:.6f}",
                    "x_CostPerValidStep": r.cost_per_valid_step or "",
                    "x_ValidGpuHours": f"{r.valid_gpu_hours:.6f}",
                    "x_TrainingJob": r.key if aggregate == "job" else "",
                }
                writer.writerow([values.get(c, "") for c in FOCUS_COLUMNS + FOCUS_X])
        return PlainTextResponse(buf.getvalue(), media_type="text/csv")

    for router in (health, jobs, alloc):
        app.include_router(router)
    return app
