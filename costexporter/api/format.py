"""How numbers and times leave the API: money as decimal strings with 6 places, times as RFC 3339."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import orjson
from fastapi.responses import Response

from .store import JOB_CATS, Amounts

PLACES = Decimal("0.000001")


def money(x: Decimal | int | float) -> str:
    return str(Decimal(x).quantize(PLACES))


def micro(u: int) -> str:
    """Micro-units as a decimal string with 6 places, by integer arithmetic (exact and fast)."""
    sign, u = ("-", -u) if u < 0 else ("", u)
    return f"{sign}{u // 1_000_000}.{u % 1_000_000:06d}"


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(float(ts), dt.timezone.utc).isoformat().replace("+00:00", "Z")


def per(cost: Decimal, n: int, scale: int = 1) -> str | None:
    return money(cost * scale / n) if n > 0 else None


def by_category(a: Amounts) -> dict:
    # 6 decimals: a micro-GPU-hour is 3.6 ms, finer than anything the ledger resolves.
    return {
        "gpu_hours": {c: round(a.ms[c] / 3.6e6, 6) for c in JOB_CATS},
        "energy_kwh": {c: round(a.mj[c] / 3.6e9, 6) for c in JOB_CATS},
        "cost": {c: micro(a.ucost[c]) for c in JOB_CATS},
    }


def json_bytes(body: object) -> Response:
    """Large, already-shaped bodies (series, allocation) encoded by orjson and sent as they are."""
    return Response(orjson.dumps(body), media_type="application/json")
