"""Allocation rows as CSV and as FinOps FOCUS: pure functions from rows to text."""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal

from .format import iso, money
from .schemas import AllocationRow
from .windows import Window

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
                iso(w.start),
                iso(w.end),
            ]
        )
    return buf.getvalue()


def to_focus(rows: list[AllocationRow], currency: str, w: Window, aggregate: str, provider: str) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(FOCUS_COLUMNS + FOCUS_X)
    for r in rows:
        hours = Decimal(f"{r.gpu_hours:.6f}")
        unit = money(Decimal(r.cost) / hours) if hours else ""
        tags = {"team": r.team or "", "cost_center": r.cost_center or "", "aggregate": aggregate}
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
            "ResourceType": "Training job" if aggregate == "job" and r.key != "unassigned" else "GPU pool",
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
    return buf.getvalue()
