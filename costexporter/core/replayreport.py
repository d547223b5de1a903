"""Replay's report, typed: the JSON `replay --format json` prints (its schema:
costexporter/schemas/replay-output.schema.json). TypedDicts, not dataclasses, because the wire
is a dict: `core/replay.py` builds them, `cli/report.py` renders them (table, CSV, notes) and
mypy checks every key either side reads or writes; tests/test_cli_replay.py holds the built
report to the schema."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from costexporter.core.goodput import GoodputReport


class AttributionField(TypedDict):
    value: str | float
    source: str | None


class ProfileReport(TypedDict):
    """The profile a job was banded with, where it came from, its edges; what it was derived
    from where it was (`profiles.describe`)."""

    name: str
    calibrated: bool
    source: str
    idle_max_w: float
    low_max_w: float
    compute_min_w: float
    derived_from: NotRequired[str]
    learned_idle_w: NotRequired[float]
    compute_level_w: NotRequired[float]
    estimated_power_limit_w: NotRequired[float]
    over_limit: NotRequired[dict[str, Any]]


class Straggler(TypedDict):
    rank: int
    host: str
    gpu: int
    uuid: str | None


class SlowRankReport(TypedDict):
    """A rank that held every GPU of the job longer than the next slowest would have, priced."""

    rank: int
    host: str | None
    gpu: int | None
    uuid: str | None
    gpu_hours: float  # the what-if: its extra compute time x the job's ranks
    cost: float  # those GPU-hours at the job's cost of a valid GPU-hour
    blocks: int  # minutes (core/straggler.BLOCK_MS) in which it was the slow rank
    named_at: float | None  # when it was first named (Unix s), window by window


class GpuPlace(TypedDict):
    host: str
    gpu: int
    uuid: str | None


class GpuReport(GpuPlace):
    rank: int
    band_gpu_hours: dict[str, float]
    gpu_hours: dict[str, float]


class Incident(TypedDict):
    """A stretch of one wasted category: when, the band most of it was in, who, what it cost."""

    start: float
    end: float
    category: str
    band: str | None
    ranks: list[int]
    zero_util_ranks: list[int]
    hosts: list[str]
    gpus: list[GpuPlace]
    gpu_hours: float
    cost: float
    cause: str  # hardware | network | storage | job | unknown (`core/causes.py`)
    cause_why: str  # what said so ("" when unknown)


class TimeRange(TypedDict):
    samples: list[float] | None
    events: list[float] | None


class JobReport(TypedDict):
    """One job's booking: hours, energy and cost by category, hours by band, its steps and
    figures, who pays and how it was priced, per GPU, its incidents."""

    gpu_hours: dict[str, float]
    energy_kwh: dict[str, float]
    cost: dict[str, float]
    band_gpu_hours: dict[str, float]
    cost_total: float
    gpu_hours_total: float
    wasted_gpu_hours: float
    gpu_hours_at_risk: float
    steps_completed: int
    steps_voided: int
    valid_steps: int
    tokens: int
    cost_per_valid_step: float | None
    productive_cost_per_step: float | None
    cost_per_million_tokens: float | None
    goodput: GoodputReport
    energy_kwh_total: float
    energy_kwh_per_valid_step: float | None
    carbon_kg: float | None
    carbon_kg_per_valid_step: float | None
    price_per_gpu_hour: float
    attribution: dict[str, AttributionField]
    meta_ignored: list[str]
    profile: ProfileReport
    booked_by: str
    sampling_interval_s: float
    grid_s: float
    stall_threshold_s: float
    last_checkpoint_step: int | None
    straggler: Straggler | None
    slow_ranks: list[SlowRankReport]
    forecast: dict[str, Any]  # core/forecast.Forecast.report()
    slow_ranks_untold_minutes: int  # steps too short for the sampling: no slow rank told
    meta: dict[str, Any]
    preflight: dict[str, Any] | None
    gpus: list[GpuReport]
    incidents: list[Incident]
    energy_coverage: float | None
    time_range: TimeRange
    clock_offset_hours: int | None


class Unassigned(TypedDict):
    """GPU time no job held."""

    gpu_hours: float
    energy_kwh: float


class ReplayReport(TypedDict):
    currency: str
    jobs: dict[str, JobReport]
    unassigned: Unassigned
    warnings: NotRequired[dict[str, int]]  # the input problems counted (replay's command adds them)
