"""The API's response models: the OpenAPI schema and what clients may rely on."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

WARNINGS = "Stored values this answer skipped because they do not parse (one line per job and problem)."


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


ATTRIBUTION = (
    "Where the job's price, owner and place came from: per key (team, cost_center, budget, "
    "cluster, namespace, controller, controller_kind, price_per_gpu_hour, node_pool) its value and source "
    "(a policy rule, the price table, the flags, kubernetes, or meta where a policy rule grants it). "
    "Empty until an agent has booked the job."
)


ATTRIBUTION_ROW = ATTRIBUTION + " A row of one job only."


class Attributed(BaseModel):
    value: str | float
    source: str | None


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
    attribution: dict[str, Attributed] = Field(default_factory=dict, description=ATTRIBUTION)


class JobList(BaseModel):
    currency: str
    jobs: list[JobSummary]
    next_cursor: str | None
    warnings: list[str] = Field(default_factory=list, description=WARNINGS)


class ProfileOut(BaseModel):
    """The band profile the agents classify the job's GPUs with; uncalibrated ones are derived
    from the power limit and may misclassify (calibrate one with `costexporter calibrate`)."""

    name: str
    calibrated: bool


RUNTIME_GOODPUT = (
    "Valid GPU-time (productive, communication, starved) over the GPU-time held (every job "
    "category); null when nothing was held. docs/accounting.md, goodput."
)
ENERGY = "Energy of the GPU-time (every job category), kWh."
CARBON = (
    "kgCO2e of that energy at the grid's intensity (the operator's carbon_intensity); null without "
    "one, or where it does not cover the period."
)


class GoodputOut(BaseModel):
    """The job's goodput layers over the window (ratios 0..1; null: not computed, `notes` say why)."""

    runtime: float | None = Field(description=RUNTIME_GOODPUT)
    ettr: float | None = Field(
        description="Effective training time ratio: valid GPU-time over the job's ranks x its wall "
        "time in the window (first registration to its end, or now): time between runs counts against it."
    )
    scheduling: float | None = Field(
        description="Wall time over wall time plus the wait from submission (the pod's creation, or a "
        "granted meta submitted_at) to the first registration."
    )
    program: float | None = Field(
        description="MFU: the valid steps' tokens x model FLOPs per token over the peak FLOPS of the "
        "job's GPUs (model, dtype) x its valid GPU-time."
    )
    notes: list[str] = Field(default_factory=list, description="Why a layer is null.")


class ForecastOut(BaseModel):
    """What the job will cost to finish (money in the currency; null: not computed, `notes` say
    why). docs/accounting.md, cost to finish."""

    total_steps: int | None = Field(description="The trainer's total_steps (meta).")
    steps_left: int | None = Field(description="total_steps minus the job's newest step.")
    recent_cost_per_valid_step: float | None = Field(
        description="Its whole cost over its valid steps in its last hour of 5-minute buckets."
    )
    cost_to_finish: float | None = Field(description="recent_cost_per_valid_step x steps_left.")
    low: float | None = Field(description="The lowest rate of the hour's 10-minute parts x steps_left.")
    high: float | None = Field(description="The highest rate of the hour's 10-minute parts x steps_left.")
    cost_at_finish: float | None = Field(description="Spent so far plus cost_to_finish: never below spent.")
    notes: list[str] = Field(default_factory=list, description="Why a figure is null.")


class SlowRankOut(BaseModel):
    """A rank that held every GPU of the job longer than the next slowest rank would have."""

    rank: int
    gpu_hours: float = Field(
        description="The what-if, over the job's life: its extra compute time x the GPUs the agents "
        "book for the job (docs/accounting.md, stragglers)."
    )
    cost: str | None = Field(
        description="Those GPU-hours at the job's cost of a valid GPU-hour in the window (null: no "
        "valid time in it)."
    )
    minutes: int = Field(description="The minutes in which it was the slow rank.")


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
    goodput: GoodputOut
    energy_kwh: float = Field(description=ENERGY)
    energy_kwh_per_valid_step: float | None
    carbon_kg: float | None = Field(description=CARBON)
    carbon_kg_per_valid_step: float | None
    forecast: ForecastOut
    slow_ranks: list[SlowRankOut] = Field(
        default_factory=list, description="Most costly first (docs/accounting.md, stragglers)."
    )
    gpu_hours_at_risk: float
    budget: str | None
    spend: str
    budget_used: float | None
    attribution: dict[str, Attributed] = Field(default_factory=dict, description=ATTRIBUTION)
    preflight: dict[str, Any] | None
    profile: ProfileOut | None = None
    unknown_before: str | None = Field(
        None,
        description="Redis restarted empty while the job ran (without persistence): its ledger is whole "
        "from this time on; amounts, steps and incidents before it went with Redis. Null: whole.",
    )
    warnings: list[str] = Field(default_factory=list, description=WARNINGS)


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
    warnings: list[str] = Field(default_factory=list, description=WARNINGS)


class Incident(BaseModel):
    category: str
    start: str
    end: str
    ranks: list[int]
    # A deadlock's rank(s) at ~0% utilization (the one that left the collective); else empty.
    zero_util_ranks: list[int] = Field(default_factory=list)
    hosts: list[str]
    gpu_hours: float
    cause: Literal["hardware", "network", "storage", "job", "unknown"] = Field(
        "unknown",
        description="Whose fault the stretch was: a GPU's hardware event on its ranks (an Xid, a hardware "
        "clock slowdown), a checkpoint over its allowance (storage); unknown when nothing said otherwise.",
    )
    cause_why: str = Field("", description="What said so (empty when unknown).")
    cost: str | None = Field(
        None, description="What the stretch cost (null: written before incidents kept their cost)."
    )


class CauseTotal(BaseModel):
    gpu_hours: float
    cost: str


class Credit(BaseModel):
    """The wasted time of the causes the operator's policy credits back (`credit_causes`)."""

    causes: list[str]
    gpu_hours: float
    cost: str = Field(description="To credit back to the job's owner: a negative line on its bill.")


class Incidents(BaseModel):
    job: str
    currency: str
    window: WindowOut
    incidents: list[Incident]
    by_cause: dict[str, CauseTotal] = Field(
        default_factory=dict,
        description="The incidents' GPU time and cost in the window by cause (each incident's part "
        "inside the window, in proportion to its time).",
    )
    credit: Credit | None = Field(
        None, description="The credited causes' share (null: the policy credits no cause)."
    )
    warnings: list[str] = Field(default_factory=list, description=WARNINGS)


class AllocationRow(BaseModel):
    key: str
    team: str | None
    cost_center: str | None
    jobs: int
    gpu_hours: float
    valid_gpu_hours: float
    overhead_gpu_hours: float
    wasted_gpu_hours: float
    runtime_goodput: float | None = Field(None, description=RUNTIME_GOODPUT)
    energy_kwh: float = Field(0.0, description=ENERGY)
    carbon_kg: float | None = Field(None, description=CARBON)
    cost: str
    wasted_cost: str
    valid_steps: int
    cost_per_valid_step: str | None
    start: str | None = Field(None, description="Start of the period this row covers (RFC 3339).")
    end: str | None = Field(None, description="End (exclusive) of the period this row covers.")
    properties: dict[str, str | None] = Field(
        default_factory=dict, description="The value of each aggregate field for this row."
    )
    price_versions: list[str] = Field(
        default_factory=list, description="Price tables the amounts were costed with."
    )
    attribution: dict[str, Attributed] | None = Field(default=None, description=ATTRIBUTION_ROW)


class Allocation(BaseModel):
    currency: str
    window: WindowOut
    aggregate: str
    accumulate: bool = True
    step: str | None = None
    rows: list[AllocationRow]
    warnings: list[str] = Field(default_factory=list, description=WARNINGS)


class Health(BaseModel):
    status: str
    version: str


class BudgetOut(BaseModel):
    """A budget of the operator's policy in its current period (docs/terms.md, budgets)."""

    name: str
    scope: dict[str, str] = Field(description="What counts against it: each key's shell pattern must match.")
    period: str = Field(description="month, quarter (calendar, in the API's time zone) or rolling:<N>d.")
    start: str
    end: str
    amount: str
    spent: str = Field(description="Net cost of the jobs in scope from the period's start to `at`.")
    used: float = Field(description="spent / amount.")
    thresholds: list[float]
    crossed: list[float] = Field(description="The thresholds spent has reached.")
    forecast_at_end: str | None = Field(
        description="spent + the scope's daily spend over the last 7 days x the days left (null: a "
        "rolling window, or no history; notes say why)."
    )
    forecast_used: float | None
    forecast_crosses: list[float] = Field(
        description="Thresholds not reached yet that the forecast reaches by the period's end."
    )
    jobs: int = Field(description="Jobs in scope with cost in the period.")
    notes: list[str] = Field(default_factory=list)


class Budgets(BaseModel):
    currency: str
    at: str
    budgets: list[BudgetOut]
    warnings: list[str] = Field(default_factory=list)
