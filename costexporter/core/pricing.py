"""The operator's price table (pure): GPU-hour prices by GPU model and node pool, each from an
effective date, and a job's price schedule on one host's GPUs.

A price change applies from its date. Dates fall on the ledger's 5-minute bucket boundaries, so
every bucket is costed at one price and keeps that price's version (`PriceSchedule.version_at`);
time is cut at a change before it is costed, so the ledger, its rollback index and replay
price the same second alike.

Matching is on what the operator's side reads, never on a trainer's meta: the GPU model as the
agent's source names it (NVML, DCGM, the trace) and the node pool the policy maps the host to.
"""

from __future__ import annotations

import bisect
import dataclasses
import fnmatch
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from costexporter.core.cost import Prices
from costexporter.core.events import bounded_number

BUCKET_MS = 300_000  # the ledger's finest bucket: an effective date falls on one of its bounds
NEG_INF = -(2**62)


@dataclass(frozen=True, slots=True)
class PriceRule:
    """One row of the price table: GPUs whose model matches `gpu_model` (a shell pattern, any
    case) on hosts of `node_pool` (None: any) cost `price_per_gpu_hour` from `from_ms` on."""

    price_per_gpu_hour: float
    gpu_model: str | None = None
    node_pool: str | None = None
    from_ms: int = NEG_INF
    wasted_price_per_gpu_hour: float | None = None
    name: str = ""  # how the table names it in the price version and `attribution`

    def matches(self, gpu_model: str | None, node_pool: str | None) -> bool:
        if self.node_pool is not None and self.node_pool != node_pool:
            return False
        if self.gpu_model is None:
            return True
        return gpu_model is not None and fnmatch.fnmatchcase(gpu_model.lower(), self.gpu_model.lower())


@dataclass(frozen=True, slots=True)
class Pricing:
    """The price side of the operator's policy: the price table, the node pools (pool -> host
    pattern) and the cluster this deployment books."""

    table: tuple[PriceRule, ...] = ()
    node_pools: tuple[tuple[str, str], ...] = ()
    cluster: str | None = None

    def pool_of(self, host: str | None) -> str | None:
        """The node pool of a host: the first pool whose host pattern matches it."""
        if host is None:
            return None
        return next((p for p, pat in self.node_pools if fnmatch.fnmatchcase(host, pat)), None)

    def schedule(
        self, base: Prices, gpu_model: str | None, host: str | None, flat: float | None = None
    ) -> PriceSchedule:
        """The prices of GPUs of `gpu_model` on `host` over time: at each date the latest table row
        that matches and has begun (the first matching row of that date); before any, `base`
        (the flags'). `flat`: a policy rule's own price for the job, which wins at every date."""
        if flat is not None:
            p = dataclasses.replace(base, price_per_gpu_hour=flat)
            return PriceSchedule(((NEG_INF, p, version(p, "rule")),))
        pool = self.pool_of(host)
        rows = [r for r in self.table if r.matches(gpu_model, pool)]
        out: list[tuple[int, Prices, str]] = [(NEG_INF, base, version(base, "flags"))]
        for t in sorted({r.from_ms for r in rows}):
            row = next(r for r in rows if r.from_ms == t)
            p = dataclasses.replace(
                base,
                price_per_gpu_hour=row.price_per_gpu_hour,
                wasted_price_per_gpu_hour=(
                    row.wasted_price_per_gpu_hour
                    if row.wasted_price_per_gpu_hour is not None
                    else base.wasted_price_per_gpu_hour
                ),
            )
            if t == NEG_INF:
                out[0] = (NEG_INF, p, version(p, row.name))
            else:
                out.append((t, p, version(p, row.name)))
        return PriceSchedule(tuple(out))


def version(prices: Prices, source: str = "flags") -> str:
    """A short name of a price, stored with every bucket it costed (the flags' price keeps the
    name it always had, so a ledger booked before the price table keeps one version)."""
    head = "" if source == "flags" else f"{source};"
    return (
        f"{head}gpu_hour={prices.price_per_gpu_hour:g};wasted={prices.wasted_price_per_gpu_hour};"
        f"kwh={prices.price_per_kwh};pue={prices.pue:g};{prices.currency}"
    )


@dataclass(frozen=True, slots=True)
class PriceSchedule:
    """A job's prices over time on one host's GPUs: (from_ms, prices, version) in date order, the
    first from the beginning of time."""

    changes: tuple[tuple[int, Prices, str], ...]

    @classmethod
    def flat(cls, prices: Prices) -> PriceSchedule:
        return cls(((NEG_INF, prices, version(prices, "flags")),))

    def _i(self, t_ms: int) -> int:
        return bisect.bisect_right([c[0] for c in self.changes], t_ms) - 1

    def at(self, t_ms: int) -> Prices:
        return self.changes[self._i(t_ms)][1]

    def version_at(self, t_ms: int) -> str:
        return self.changes[self._i(t_ms)][2]

    @property
    def latest(self) -> Prices:
        return self.changes[-1][1]

    def cuts(self, lo_ms: int, hi_ms: int) -> list[int]:
        """The change dates inside (lo, hi): where time must be cut before it is costed."""
        return [t for t, _, _ in self.changes[1:] if lo_ms < t < hi_ms]

    def spans(self, lo_ms: int, hi_ms: int) -> list[tuple[int, int, Prices]]:
        """[a, b) stretches of one price covering [lo, hi)."""
        bounds = [lo_ms, *self.cuts(lo_ms, hi_ms), hi_ms]
        return [(a, b, self.at(a)) for a, b in itertools.pairwise(bounds)]


def as_schedule(prices: Prices | PriceSchedule) -> PriceSchedule:
    return prices if isinstance(prices, PriceSchedule) else PriceSchedule.flat(prices)


class PricingError(ValueError):
    """A price table that cannot be used (one line: what and where)."""


def price_value(v: object) -> float | None:
    """A price as a policy file gives it: a number (not text) >= 0 and finite, else None."""
    return bounded_number(v, 0, 1e9) if isinstance(v, (int, float)) else None


def parse_pricing(doc: Mapping[str, object], where: str, parse_date: object) -> Pricing:
    """The `prices`, `node_pools` and `cluster` of a policy document (`terms.parse_policy`
    checks the document's shape). `parse_date`: text -> Unix seconds (ValueError if not)."""
    pools_raw = doc.get("node_pools") or {}
    if not isinstance(pools_raw, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in pools_raw.items()
    ):
        raise PricingError(f"{where}: 'node_pools' must map pool names to host patterns")
    pools = tuple((str(k), str(v)) for k, v in pools_raw.items())
    cluster = doc.get("cluster")
    if cluster is not None and not (isinstance(cluster, str) and cluster):
        raise PricingError(f"{where}: 'cluster' must be a non-empty string")
    rows_raw = doc.get("prices") or []
    if not isinstance(rows_raw, list):
        raise PricingError(f"{where}: 'prices' must be a list")
    known = {"gpu_model", "node_pool", "price_per_gpu_hour", "wasted_price_per_gpu_hour", "from"}
    rows = []
    for i, raw in enumerate(rows_raw):
        at = f"{where}: prices row {i + 1}"
        if not isinstance(raw, Mapping):
            raise PricingError(f"{at} is not a mapping")
        unknown = set(raw) - known
        if unknown:
            names = ", ".join(sorted(map(str, unknown)))
            raise PricingError(f"{at}: unknown key(s) {names} (known: {', '.join(sorted(known))})")
        price = price_value(raw.get("price_per_gpu_hour"))
        if price is None:
            raise PricingError(f"{at}: price_per_gpu_hour must be a number >= 0")
        wasted = raw.get("wasted_price_per_gpu_hour")
        if wasted is not None and price_value(wasted) is None:
            raise PricingError(f"{at}: wasted_price_per_gpu_hour must be a number >= 0")
        for k in ("gpu_model", "node_pool"):
            if raw.get(k) is not None and not (isinstance(raw[k], str) and raw[k]):
                raise PricingError(f"{at}: {k} must be a non-empty string")
        pool = raw.get("node_pool")
        if pool is not None and pool not in dict(pools):
            raise PricingError(f"{at}: node_pool {pool!r} is not one of node_pools")
        from_ms = NEG_INF
        if raw.get("from") is not None:
            from_ms = _date_ms(raw["from"], at, parse_date)
        model = raw.get("gpu_model")
        name = (
            "price:"
            + "/".join(str(x) for x in (model or "*", pool or "*"))
            + (f"@{raw['from']}" if raw.get("from") is not None else "")
        )
        rows.append(PriceRule(price, model, pool, from_ms, None if wasted is None else float(wasted), name))
    return Pricing(tuple(rows), pools, cluster)


def _date_ms(value: object, at: str, parse_date: object) -> int:
    import datetime as dt

    if isinstance(value, (dt.datetime, dt.date)):  # YAML reads an unquoted date as one
        if not isinstance(value, dt.datetime):
            value = dt.datetime(value.year, value.month, value.day, tzinfo=dt.timezone.utc)
        elif value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        ms = round(value.timestamp() * 1000)
    else:
        try:
            ms = round(parse_date(str(value)) * 1000)  # type: ignore[operator]
        except ValueError as e:
            raise PricingError(f"{at}: from {value!r} is not a date ({e})") from None
    if ms % BUCKET_MS:
        raise PricingError(
            f"{at}: from {value!r} is not on a 5-minute boundary (a bucket is costed at one price)"
        )
    return ms
