"""Allocation as OpenCost slices it: aggregate fields (job, team, namespace, cost_center,
`label:<name>`, comma-combined), and periods (the whole window, or one per step).

Pure: jobs' amounts and meta in, rows out; the router does the reading."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..model import CATEGORIES
from .format import iso, money, per
from .schemas import AllocationRow
from .store import JOB_CATS, VALID, WASTED, Amounts, Steps

FIELDS = ("job", "team", "namespace", "cost_center")
LABEL = re.compile(r"^label:([A-Za-z0-9_.\-/]{1,100})$")
STEP_S = {"5m": 300, "1h": 3600, "1d": 86400, "1w": 7 * 86400}
MAX_PERIODS = 1000
MONTH_MAX = 12 * 3000


class AggregateError(ValueError):
    """An aggregate or step the API cannot use; the message says what is accepted."""


def parse_aggregate(text: str) -> list[str]:
    """`team,namespace` -> ["team", "namespace"]; each a field or `label:<name>` (a meta field)."""
    fields = [f.strip() for f in text.split(",")]
    for f in fields:
        if f not in FIELDS and not LABEL.match(f):
            raise AggregateError(
                f"aggregate {f!r} is not one of {', '.join(FIELDS)} or label:<name> (comma-combined)"
            )
    if len(set(fields)) != len(fields) or len(fields) > 5:
        raise AggregateError(f"aggregate {text!r}: at most 5 distinct fields")
    return fields


def value(field: str, job: str, meta: dict) -> str | None:
    """The job's value of an aggregate field: its name, or a field of its meta."""
    if field == "job":
        return job
    name = field[6:] if field.startswith("label:") else field
    v = meta.get(name)
    return v if isinstance(v, str) and v != "" else None


def key_of(fields: list[str], props: dict[str, str | None]) -> str:
    """A row's key: the values joined by '/', a missing one as '(no <field>)'."""
    return "/".join(props[f] if props[f] is not None else f"(no {f})" for f in fields)


def periods(start: int, end: int, step: str | None) -> list[tuple[int, int]]:
    """[start, end) whole (step None) or cut every `step` from the start."""
    if step is None:
        return [(start, end)]
    secs = STEP_S[step]
    if (end - start) / secs > MAX_PERIODS:
        raise AggregateError(
            f"step {step} over this window is more than {MAX_PERIODS} rows: use a coarser step"
        )
    return [(t, min(t + secs, end)) for t in range(start, end, secs)]


def month_start(t: int) -> int:
    import datetime as dt

    d = dt.datetime.fromtimestamp(t, dt.timezone.utc)
    return int(dt.datetime(d.year, d.month, 1, tzinfo=dt.timezone.utc).timestamp())


def next_month(t: int) -> int:
    import datetime as dt

    d = dt.datetime.fromtimestamp(t, dt.timezone.utc)
    y, m = (d.year + 1, 1) if d.month == 12 else (d.year, d.month + 1)
    return int(dt.datetime(y, m, 1, tzinfo=dt.timezone.utc).timestamp())


def split_months(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each span cut at calendar-month boundaries (UTC): a FOCUS charge lies in one billing period."""
    out = []
    for a, b in spans:
        t = a
        while t < b:
            e = min(next_month(t), b)
            out.append((t, e))
            t = e
    return out


@dataclass
class JobPart:
    """One job's amounts and steps over one period."""

    job: str
    meta: dict
    amounts: Amounts
    steps: Steps


def rows(parts: list[JobPart], fields: list[str], start: int, end: int) -> list[AllocationRow]:
    """One row per distinct combination of the fields' values, sorted by key."""
    groups: dict[str, tuple[dict, list[JobPart]]] = {}
    for p in sorted(parts, key=lambda p: p.job):
        props = {f: value(f, p.job, p.meta) for f in fields}
        groups.setdefault(key_of(fields, props), (props, []))[1].append(p)
    s, e = iso(start), iso(end)
    return [row(k, props, js, s, e) for k, (props, js) in sorted(groups.items())]


def total(amounts) -> Amounts:
    a = Amounts()
    for p in amounts:
        for mine, theirs in ((a.ms, p.ms), (a.mj, p.mj), (a.ucost, p.ucost)):
            for c in CATEGORIES:
                mine[c] += theirs[c]
        a.price_versions |= p.price_versions
    return a


def row(key: str, props: dict, parts: list[JobPart], start: str | None, end: str | None) -> AllocationRow:
    """One allocation row: the jobs' amounts summed; team and cost center where they all agree."""
    a = parts[0].amounts if len(parts) == 1 else total(p.amounts for p in parts)
    cost = a.total_cost(JOB_CATS)
    valid = sum(p.steps.valid for p in parts)

    def common(field: str) -> str | None:
        vals = {value(field, p.job, p.meta) for p in parts}
        return vals.pop() if len(vals) == 1 else None

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
        start=start,
        end=end,
        properties=props,
        price_versions=sorted(a.price_versions),
    )


def unassigned_row(u: Amounts, start: int, end: int) -> AllocationRow:
    return AllocationRow(
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
        start=iso(start),
        end=iso(end),
        properties={},
        price_versions=sorted(u.price_versions),
    )
