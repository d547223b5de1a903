"""Allocation as OpenCost slices it: aggregate fields (job, team, namespace, cost_center, cluster,
`label:<name>`, comma-combined), and periods (the whole window, or one per step).

Pure: jobs' amounts and meta in, rows out; the router does the reading."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from costexporter.api.format import iso, micro, money, per_micro
from costexporter.api.schemas import AllocationRow, Attributed
from costexporter.core import carbon, goodput
from costexporter.core.buckets import RESOLUTIONS
from costexporter.core.carbon import G_PER_KG
from costexporter.core.cost import MJ_PER_KWH, MS_PER_HOUR
from costexporter.core.model import CATEGORIES
from costexporter.store.ledger_read import JOB_CATS, VALID, WASTED, Amounts, Steps, WindowTable

FIELDS = ("job", "team", "namespace", "cost_center", "cluster")
LABEL = re.compile(r"^label:([A-Za-z0-9_.\-/]{1,100})$")
STEP_S = RESOLUTIONS  # a period of the allocation
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


def value(field: str, job: str, meta: dict[str, Any]) -> str | None:
    """The job's value of an aggregate field: its name, or a field of its meta."""
    if field == "job":
        return job
    return _text(meta.get(field[6:] if field.startswith("label:") else field))


def key_of(fields: list[str], props: dict[str, str | None]) -> str:
    """A row's key: the values joined by '/', a missing one as '(no <field>)'."""
    return "/".join(f"(no {f})" if (v := props[f]) is None else v for f in fields)


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
    meta: dict[str, Any]
    amounts: Amounts
    steps: Steps


def rows(
    parts: list[JobPart], fields: list[str], start: int, end: int, g_per_kwh: float | None = None
) -> list[AllocationRow]:
    """One row per distinct combination of the fields' values, sorted by key; `g_per_kwh`: the
    grid's carbon intensity over the period (None: not known)."""
    groups: dict[str, tuple[dict[str, Any], list[JobPart]]] = {}
    for p in sorted(parts, key=lambda p: p.job):
        props = {f: value(f, p.job, p.meta) for f in fields}
        groups.setdefault(key_of(fields, props), (props, []))[1].append(p)
    s, e = iso(start), iso(end)
    return [row(k, props, js, s, e, g_per_kwh) for k, (props, js) in sorted(groups.items())]


def total(amounts: Iterable[Amounts]) -> Amounts:
    a = Amounts()
    for p in amounts:
        for mine, theirs in ((a.ms, p.ms), (a.mj, p.mj), (a.ucost, p.ucost)):
            for c in CATEGORIES:
                mine[c] += theirs[c]
        a.price_versions |= p.price_versions
    return a


def row(
    key: str,
    props: dict[str, Any],
    parts: list[JobPart],
    start: str | None,
    end: str | None,
    g_per_kwh: float | None = None,
) -> AllocationRow:
    """One allocation row: the jobs' amounts summed; team and cost center where they all agree."""
    a = parts[0].amounts if len(parts) == 1 else total(p.amounts for p in parts)
    # Money in integer micro-units (exact, and 10,000 rows do not pay for Decimal sums).
    cost_u = sum(a.ucost[c] for c in JOB_CATS)
    valid = sum(p.steps.valid for p in parts)

    def common(field: str) -> str | None:
        if len(parts) == 1:
            return value(field, parts[0].job, parts[0].meta)
        vals = {value(field, p.job, p.meta) for p in parts}
        return vals.pop() if len(vals) == 1 else None

    kwh = sum(a.mj[c] for c in JOB_CATS) / MJ_PER_KWH
    return AllocationRow(
        key=key,
        team=common("team"),
        cost_center=common("cost_center"),
        jobs=len(parts),
        gpu_hours=a.hours(JOB_CATS),
        valid_gpu_hours=a.hours(VALID),
        overhead_gpu_hours=a.hours(["overhead"]),
        wasted_gpu_hours=a.hours(WASTED),
        runtime_goodput=goodput.runtime(sum(a.ms[c] for c in VALID), sum(a.ms[c] for c in JOB_CATS)),
        energy_kwh=kwh,
        carbon_kg=carbon.kg_of(kwh, g_per_kwh),
        cost=micro(cost_u),
        wasted_cost=micro(sum(a.ucost[c] for c in WASTED)),
        valid_steps=valid,
        cost_per_valid_step=per_micro(cost_u, valid),
        start=start,
        end=end,
        properties=props,
        price_versions=sorted(a.price_versions),
        attribution=_attributed(parts[0].meta) if len(parts) == 1 else None,
    )


_COL = {c: i for i, c in enumerate(CATEGORIES)}


def _cols(cats: list[str], unit: int) -> list[int]:
    """Matrix columns (ledger.PACKED order) of these categories' unit (0 ms, 1 mJ, 2 micro-cost)."""
    return [3 * _COL[c] + unit for c in cats]


JOB_MS, VALID_MS, OVERHEAD_MS, WASTED_MS = (_cols(c, 0) for c in (JOB_CATS, VALID, ["overhead"], WASTED))
JOB_MJ = _cols(JOB_CATS, 1)
JOB_U, WASTED_U = _cols(JOB_CATS, 2), _cols(WASTED, 2)


def groups_of(
    fields: list[str], jobs: list[str], metas: dict[str, dict[str, Any]], visible: list[int]
) -> dict[str, tuple[dict[str, str | None], list[int]]]:
    """The rows' keys of an aggregate other than by job: each key's properties and its jobs (their
    indices in `jobs`, in name order)."""
    groups: dict[str, tuple[dict[str, str | None], list[int]]] = {}
    for i in sorted(visible, key=lambda i: jobs[i]):
        props = {f: value(f, jobs[i], metas[jobs[i]]) for f in fields}
        groups.setdefault(key_of(fields, props), (props, []))[1].append(i)
    return groups


def table_rows(
    table: WindowTable,
    metas: dict[str, dict[str, Any]],
    visible: list[int],
    fields: list[str],
    start: int,
    end: int,
    g_per_kwh: float | None = None,
    no_carbon: frozenset[int] = frozenset(),
) -> list[dict[str, Any]]:
    """`rows` over a `WindowTable` (the jobs at `visible`), as the rows' dicts: the groups are
    summed by column in one go and the figures computed per column, so 10,000 jobs cost a few
    array operations and one small dict each. Equal to `rows` (the same integer sums, the same
    float divisions). `no_carbon`: jobs (indices) the intensity is not theirs (another cluster's):
    their rows, and the groups that hold them, have no carbon."""
    jobs = table.jobs
    if fields == ["job"]:  # a row per job (the default): the key is the job's name
        order = sorted(visible, key=jobs.__getitem__)
        keys = [jobs[i] for i in order]
        members = [[i] for i in order]
        props_of: list[dict[str, str | None]] = [{"job": k} for k in keys]
    else:
        groups = groups_of(fields, jobs, metas, visible)
        keys = sorted(groups)
        members = [groups[k][1] for k in keys]
        props_of = [groups[k][0] for k in keys]
    if all(len(m) == 1 for m in members):
        g = table.net[[m[0] for m in members]] if members else np.zeros((0, table.net.shape[1]), np.int64)
    else:
        order = [i for m in members for i in m]
        cuts = np.cumsum([0] + [len(m) for m in members[:-1]])
        g = np.add.reduceat(table.net[order], cuts, axis=0)
    ms = [g[:, c].sum(axis=1) for c in (JOB_MS, VALID_MS, OVERHEAD_MS, WASTED_MS)]
    hours = [(x / MS_PER_HOUR).tolist() for x in ms]
    # valid over held, as `goodput.runtime` divides (None where nothing was held)
    runtime: list[float | None] = (ms[1] / np.maximum(ms[0], 1)).tolist()
    for i in np.flatnonzero(ms[0] <= 0).tolist():
        runtime[i] = None
    energy = g[:, JOB_MJ].sum(axis=1) / MJ_PER_KWH
    kwh = energy.tolist()
    kg: list[float | None] = (
        [None] * len(kwh) if g_per_kwh is None else (energy * g_per_kwh / G_PER_KG).tolist()
    )
    if no_carbon:
        for n, m in enumerate(members):
            if not no_carbon.isdisjoint(m):
                kg[n] = None
    cost_u = g[:, JOB_U].sum(axis=1).tolist()
    wasted_u = g[:, WASTED_U].sum(axis=1).tolist()
    s, e = iso(start), iso(end)
    steps = table.steps
    # money as `micro` writes it, made here for the usual non-negative amounts (a call less per figure)
    costs = [f"{u // 1_000_000}.{u % 1_000_000:06d}" if u >= 0 else micro(u) for u in cost_u]
    wasted = [f"{u // 1_000_000}.{u % 1_000_000:06d}" if u >= 0 else micro(u) for u in wasted_u]
    if all(len(m) == 1 for m in members):  # a row per job (aggregate=job): made column by column
        at = [m[0] for m in members]
        names = [jobs[i] for i in at]
        valid = [steps[j].valid for j in names]
        job_metas = [metas[j] for j in names]
        teams = [_text(m.get("team")) for m in job_metas]  # `value`, without a call per field
        ccs = [_text(m.get("cost_center")) for m in job_metas]
        versions = [sorted(table.versions[i]) for i in at]
        per_step = [per_micro(u, v) if v > 0 else None for u, v in zip(cost_u, valid, strict=True)]
        return [
            {
                "key": k,
                "team": team,
                "cost_center": cc,
                "jobs": 1,
                "gpu_hours": h0,
                "valid_gpu_hours": h1,
                "overhead_gpu_hours": h2,
                "wasted_gpu_hours": h3,
                "runtime_goodput": rg,
                "energy_kwh": kwh_j,
                "carbon_kg": kg_j,
                "cost": cost,
                "wasted_cost": waste,
                "valid_steps": v,
                "cost_per_valid_step": ps,
                "start": s,
                "end": e,
                "properties": props,
                "price_versions": pv,
                "attribution": _attribution(m),
            }
            for k, team, cc, h0, h1, h2, h3, rg, kwh_j, kg_j, cost, waste, v, ps, props, pv, m in zip(
                keys,
                teams,
                ccs,
                *hours,
                runtime,
                kwh,
                kg,
                costs,
                wasted,
                valid,
                per_step,
                props_of,
                versions,
                job_metas,
                strict=True,
            )
        ]
    out = []
    for n, (k, m) in enumerate(zip(keys, members, strict=True)):
        props = props_of[n]
        valid_n = sum(steps[jobs[i]].valid for i in m)
        team_set = {value("team", jobs[i], metas[jobs[i]]) for i in m}
        cc_set = {value("cost_center", jobs[i], metas[jobs[i]]) for i in m}
        out.append(
            {
                "key": k,
                "team": team_set.pop() if len(team_set) == 1 else None,
                "cost_center": cc_set.pop() if len(cc_set) == 1 else None,
                "jobs": len(m),
                "gpu_hours": hours[0][n],
                "valid_gpu_hours": hours[1][n],
                "overhead_gpu_hours": hours[2][n],
                "wasted_gpu_hours": hours[3][n],
                "runtime_goodput": runtime[n],
                "energy_kwh": kwh[n],
                "carbon_kg": kg[n],
                "cost": costs[n],
                "wasted_cost": wasted[n],
                "valid_steps": valid_n,
                "cost_per_valid_step": per_micro(cost_u[n], valid_n) if valid_n > 0 else None,
                "start": s,
                "end": e,
                "properties": props,
                "price_versions": sorted(set().union(*(table.versions[i] for i in m))),
                "attribution": _attribution(metas[jobs[m[0]]]) if len(m) == 1 else None,
            }
        )
    return out


def _text(v: object) -> str | None:
    """A meta value as an aggregate field's value: a non-empty string, else None."""
    return v if isinstance(v, str) and v else None


def unassigned_row(u: Amounts, start: int, end: int, g_per_kwh: float | None = None) -> AllocationRow:
    return AllocationRow(
        key="unassigned",
        team=None,
        cost_center=None,
        jobs=0,
        gpu_hours=u.hours(["unassigned"]),
        valid_gpu_hours=0.0,
        overhead_gpu_hours=0.0,
        wasted_gpu_hours=0.0,
        runtime_goodput=None,
        energy_kwh=u.mj["unassigned"] / MJ_PER_KWH,
        carbon_kg=carbon.kg_of(u.mj["unassigned"] / MJ_PER_KWH, g_per_kwh),
        cost=money(u.cost("unassigned")),
        wasted_cost=money(0),
        valid_steps=0,
        cost_per_valid_step=None,
        start=iso(start),
        end=iso(end),
        properties={},
        price_versions=sorted(u.price_versions),
    )


def _attribution(meta: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
    """A job row's `attribution` as the rows built column by column hold it
    (`ledger_read.JobMeta`); None where the meta has none."""
    attr = getattr(meta, "attribution", None)
    return None if attr is None else attr.report()


def _attributed(meta: Mapping[str, Any]) -> dict[str, Attributed] | None:
    """`_attribution` as the row model holds it."""
    got = _attribution(meta)
    return None if got is None else {k: Attributed(**v) for k, v in got.items()}
