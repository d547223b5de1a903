"""Allocation rows as CSV and as FinOps FOCUS: pure functions from rows to text."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from costexporter.api.aggregate import month_start, next_month
from costexporter.api.format import PLACES, iso, micro, money
from costexporter.api.schemas import AllocationRow
from costexporter.api.windows import Window
from costexporter.core.timeutil import parse_instant
from costexporter.store.ledger_read import Warnings

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
    "price_source",
    "owner_source",
    "runtime_goodput",
    "energy_kwh",
    "carbon_kg",
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
FOCUS_X = [
    "x_ValidSteps",
    "x_WastedGpuHours",
    "x_CostPerValidStep",
    "x_ValidGpuHours",
    "x_TrainingJob",
    "x_AllocationKey",
    "x_PriceSource",
    "x_OwnerSource",
    "x_RuntimeGoodput",
    "x_EnergyKwh",
    "x_CarbonKg",
]


def to_csv(rows: list[AllocationRow], currency: str, w: Window) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
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
                r.start or iso(w.start),
                r.end or iso(w.end),
                *_sources(r).values(),
                *_goodput_cells(r).values(),
            ]
        )
    return buf.getvalue()


def _goodput_cells(r: AllocationRow) -> dict[str, str]:
    """A row's runtime goodput, energy and carbon as cells (empty where there is no figure)."""
    return {
        "RuntimeGoodput": "" if r.runtime_goodput is None else f"{r.runtime_goodput:.6f}",
        "EnergyKwh": f"{r.energy_kwh:.6f}",
        "CarbonKg": "" if r.carbon_kg is None else f"{r.carbon_kg:.6f}",
    }


@dataclass(frozen=True)
class FocusSettings:
    """Who the FOCUS rows say provided, published and invoiced the GPU time, and the account
    they are billed to (`costexporter api --focus-provider ...`)."""

    provider: str = "costexporter"
    publisher: str | None = None  # default: the provider
    invoice_issuer: str | None = None  # default: the provider
    billing_account_id: str | None = None  # default: the provider
    billing_account_name: str | None = None
    billing_account_type: str = "GPU Cluster"


SKU_ID = "GPU-Hour"  # one SKU: an hour of one training GPU
GPU_PRICE = re.compile(r"(?:^|;)gpu_hour=([0-9.eE+-]+)(?:;|$)")
MAX_TAG_FIELDS = ("team", "cost_center", "namespace")


def gpu_hour_price(versions: list[str]) -> Decimal | None:
    """The GPU-hour list price the amounts were costed with, carried from the ledger's price
    version (never cost / hours, which rounds), or None if the versions disagree or name none."""
    prices = set()
    for v in versions:
        m = GPU_PRICE.search(v)
        if m is None:
            return None
        try:
            d = Decimal(m.group(1))
        except ArithmeticError:
            return None
        if not d.is_finite() or d < 0:
            return None
        prices.add(d.normalize())
    return prices.pop() if len(prices) == 1 else None


def plain(d: Decimal) -> str:
    """A decimal without exponent (FOCUS numeric format)."""
    return format(d.normalize(), "f") if d != 0 else "0"


def to_focus(
    rows: list[AllocationRow],
    currency: str,
    fields: list[str],
    fs: FocusSettings,
    warn: Warnings | None = None,
    credits: Mapping[tuple[str, str], tuple[float, int, tuple[str, ...]]] | None = None,
) -> str:
    """FinOps FOCUS 1.2 cost-and-usage rows: one Usage charge per allocation row that used
    something, its charge period the row's period (inside one calendar month, the billing period);
    `credits` ((key, row start) -> GPU-ms, micro-cost, causes): a Credit charge after it, the
    wasted time of the causes the policy credits back."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(FOCUS_COLUMNS + FOCUS_X)
    for r in rows:
        if r.gpu_hours == 0 and Decimal(r.cost) == 0:
            continue  # no charge: nothing was used in this period
        values = focus_values(r, currency, fields, fs, warn)
        writer.writerow([values.get(c, "") for c in FOCUS_COLUMNS + FOCUS_X])
        credit = (credits or {}).get((r.key, r.start or ""))
        if credit is not None and credit[1] > 0:
            cv = credit_values(values, r, *credit)
            writer.writerow([cv.get(c, "") for c in FOCUS_COLUMNS + FOCUS_X])
    return buf.getvalue()


# A credit charge has no quantity, unit price or SKU of its own (FOCUS: ConsumedQuantity null
# where ChargeCategory is not Usage); its costs are all its billed cost, negative.
_NOT_ON_A_CREDIT = (
    "ConsumedQuantity", "ConsumedUnit", "PricingQuantity", "PricingUnit", "PricingCategory", "ListUnitPrice",
    "ContractedUnitPrice", "PricingCurrencyListUnitPrice", "PricingCurrencyContractedUnitPrice", "SkuId",
    "SkuPriceId", "SkuMeter", "x_ValidSteps", "x_WastedGpuHours", "x_CostPerValidStep", "x_ValidGpuHours",
    "x_RuntimeGoodput", "x_EnergyKwh", "x_CarbonKg",
)  # fmt: skip


def credit_values(
    usage: dict[str, object], r: AllocationRow, gpu_ms: float, ucost: int, causes: tuple[str, ...]
) -> dict[str, object]:
    """The Credit charge beside a job's usage row: its `causes`' wasted GPU time, credited back."""
    amount = "-" + micro(ucost)
    out = {k: v for k, v in usage.items() if k not in _NOT_ON_A_CREDIT}
    return {
        **out,
        "BilledCost": amount,
        "EffectiveCost": amount,
        "ListCost": amount,
        "ContractedCost": amount,
        "PricingCurrencyEffectiveCost": amount,
        "ChargeCategory": "Credit",
        "ChargeClass": "",
        "ChargeFrequency": "One-Time",
        "ChargeDescription": f"Credit: {gpu_ms / 3_600_000:.6f} GPU-hours of {r.key} wasted by "
        f"{' or '.join(causes)} faults",
    }


def _unit_price(r: AllocationRow, warn: Warnings | None) -> Decimal:
    """The row's GPU-hour price; several prices in one row (a price change in the period, or GPU
    models priced apart) give the row's average, the only single unit price it has, said so in
    the warnings (over the unrounded hours: the 6-place ones would move the price, 3.5 to
    3.500011)."""
    price = gpu_hour_price(r.price_versions)
    if price is not None:
        return price
    exact = Decimal(repr(r.gpu_hours))
    if r.price_versions and warn is not None:
        n = len(r.price_versions)
        warn.add(r.key, f"{n} price versions in one FOCUS row: ListUnitPrice is their average")
    return (Decimal(r.cost) / exact).quantize(PLACES).normalize() if exact else Decimal(0)


def _tags(r: AllocationRow) -> str:
    """The row's FOCUS Tags: its meta's tag fields, its labels, its team and cost center (JSON)."""
    tags = {f: r.properties.get(f) for f in MAX_TAG_FIELDS if r.properties.get(f)}
    tags.update({f[6:]: v for f, v in r.properties.items() if f.startswith("label:") and v})
    if r.team and r.key != "unassigned":
        tags.setdefault("team", r.team)
    if r.cost_center:
        tags.setdefault("cost_center", r.cost_center)
    return json.dumps(tags, sort_keys=True) if tags else ""


def _parties(fs: FocusSettings, start: int) -> dict[str, object]:
    """Who bills, publishes and invoices: the FOCUS settings, each falling back to the provider."""
    account = fs.billing_account_id or fs.provider
    return {
        "BillingAccountId": account,
        "BillingAccountName": fs.billing_account_name or account,
        "BillingAccountType": fs.billing_account_type,
        "ProviderName": fs.provider,
        "PublisherName": fs.publisher or fs.provider,
        "InvoiceIssuerName": fs.invoice_issuer or fs.provider,
        # one invoice per billing account and billing period (a calendar month)
        "InvoiceId": f"{account}-{iso(month_start(start))[:7]}",
    }


def _resource(r: AllocationRow, fields: list[str]) -> dict[str, object]:
    """The job a row is (ResourceId, SubAccount...): a job row names it, others leave it blank."""
    is_job = fields == ["job"] and r.key != "unassigned"
    team = r.team if r.key != "unassigned" else None
    name = r.key if is_job else ""
    return {
        "ResourceId": name,
        "ResourceName": name,
        "ResourceType": "Training Job" if is_job else "",
        "SubAccountId": team or "",
        "SubAccountName": team or "",
        "SubAccountType": "Team" if team else "",
        "x_TrainingJob": name,
        **_sources(r),
    }


def _sources(r: AllocationRow) -> dict[str, str]:
    """Where a job row's price and owner came from (its `attribution`); blank for other rows."""
    a: dict[str, Any] = dict(r.attribution or {})

    def source(key: str) -> str:
        v = a.get(key)  # an `Attributed`, or its dict where the row was built without validation
        s = v.get("source") if isinstance(v, dict) else getattr(v, "source", None)
        return s or ""

    return {"x_PriceSource": source("price_per_gpu_hour"), "x_OwnerSource": source("team")}


def focus_values(
    r: AllocationRow, currency: str, fields: list[str], fs: FocusSettings, warn: Warnings | None = None
) -> dict[str, object]:
    start = int(parse_instant(str(r.start)))
    hours = Decimal(f"{r.gpu_hours:.6f}")
    price = _unit_price(r, warn)
    list_cost = (price * hours).quantize(PLACES)
    what = "GPU time no job registered" if r.key == "unassigned" else f"GPU time of {r.key}"
    return {
        **_parties(fs, start),
        **_resource(r, fields),
        "BilledCost": r.cost,
        "EffectiveCost": r.cost,
        "ListCost": money(list_cost),
        "ContractedCost": money(list_cost),
        "ListUnitPrice": plain(price),
        "ContractedUnitPrice": plain(price),
        "PricingCurrencyListUnitPrice": plain(price),
        "PricingCurrencyContractedUnitPrice": plain(price),
        "PricingCurrencyEffectiveCost": r.cost,
        "BillingCurrency": currency,
        "PricingCurrency": currency,
        "BillingPeriodStart": iso(month_start(start)),
        "BillingPeriodEnd": iso(next_month(start)),
        "ChargePeriodStart": r.start,
        "ChargePeriodEnd": r.end,
        "ChargeCategory": "Usage",
        "ChargeFrequency": "Usage-Based",
        "ChargeDescription": f"{what}, {r.valid_steps} valid steps",
        "ConsumedQuantity": str(hours),
        "ConsumedUnit": "GPU-Hours",
        "PricingQuantity": str(hours),
        "PricingUnit": "GPU-Hours",
        "PricingCategory": "Standard",
        "ServiceCategory": "AI and Machine Learning",
        "ServiceSubcategory": "Machine Learning",
        "ServiceName": "GPU training",
        "SkuId": SKU_ID,
        "SkuPriceId": SKU_ID,
        "SkuMeter": "GPU Time",
        "Tags": _tags(r),
        "x_ValidSteps": r.valid_steps,
        "x_WastedGpuHours": f"{r.wasted_gpu_hours:.6f}",
        "x_CostPerValidStep": r.cost_per_valid_step or "",
        "x_ValidGpuHours": f"{r.valid_gpu_hours:.6f}",
        "x_AllocationKey": r.key,
        **{f"x_{k}": v for k, v in _goodput_cells(r).items()},
    }
