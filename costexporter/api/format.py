"""How numbers and times leave the API: money as decimal strings with 6 places, times as RFC 3339."""

from __future__ import annotations

from decimal import Decimal
from typing import Any, overload

import orjson
from fastapi.responses import Response

from costexporter.core.cost import MJ_PER_KWH, MS_PER_HOUR, cost_per_valid_step
from costexporter.core.timeutil import iso_utc
from costexporter.store.ledger_read import JOB_CATS, Amounts

PLACES = Decimal("0.000001")


def money(x: Decimal | int | float) -> str:
    return str(Decimal(x).quantize(PLACES))


def micro(u: int) -> str:
    """Micro-units as a decimal string with 6 places, by integer arithmetic (exact and fast)."""
    sign, u = ("-", -u) if u < 0 else ("", u)
    return f"{sign}{u // 1_000_000}.{u % 1_000_000:06d}"


@overload
def iso(ts: float) -> str: ...


@overload
def iso(ts: None) -> None: ...


def iso(ts: float | None) -> str | None:
    return None if ts is None else iso_utc(ts)


def per(cost: Decimal, n: int, scale: int = 1) -> str | None:
    return money(cost * scale / n) if n > 0 else None


def per_micro(u: int, n: int) -> str | None:
    """Micro-units over a count of valid steps (`cost.cost_per_valid_step`: half-even, exact), as
    the API writes money; a negative quotient that rounds to zero keeps its sign ("-0.000000"),
    as Decimal writes it."""
    q = cost_per_valid_step(u, n)
    if q is None:
        return None
    if u < 0 and q == 0:
        return "-" + micro(0)
    return micro(q)


def by_category(a: Amounts) -> dict[str, Any]:
    # 6 decimals: a micro-GPU-hour is 3.6 ms, finer than anything the ledger resolves.
    return {
        "gpu_hours": {c: round(a.ms[c] / MS_PER_HOUR, 6) for c in JOB_CATS},
        "energy_kwh": {c: round(a.mj[c] / MJ_PER_KWH, 6) for c in JOB_CATS},
        "cost": {c: micro(a.ucost[c]) for c in JOB_CATS},
    }


def json_bytes(body: object) -> Response:
    """Large, already-shaped bodies (series, allocation) encoded by orjson and sent as they are."""
    return Response(orjson.dumps(body), media_type="application/json")
