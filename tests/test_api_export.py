"""Allocation exports and docs over real HTTP: FOCUS 1.2 conformance on every export shape,
OpenCost-style aggregates and steps, and offline /docs with the errors the API really sends."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
from decimal import Decimal
from html.parser import HTMLParser

import httpx
import numpy as np
import pytest

from costexporter.api.app import FOCUS_COLUMNS, FOCUS_X
from costexporter.api.auth import Tokens, hash_token
from costexporter.api.export import FocusSettings
from costexporter.core.attribution import Attribution
from costexporter.core.model import Category
from costexporter.store import keys, ledger
from costexporter.store.ledger_read import LedgerStore

from .api_helpers import PRICE_VERSION, T0, WINDOW, served, write_job
from .redis_server import free_port

JULY_END = 1_753_999_200  # 2025-07-31T22:00:00Z
ACROSS = "2025-07-31T00:00:00Z,2025-08-02T00:00:00Z"


@pytest.fixture
def ledger_of_four(shared, prefix):
    """Four jobs of two teams and namespaces, one with a project label, one with no meta at all,
    and one job whose time crosses the end of July."""
    write_job(shared, prefix, "llm-1", "llm", namespace="ns-a", cost_center="cc-1", project="atlas")
    write_job(shared, prefix, "llm-2", "llm", namespace="ns-b", cost_center="cc-1")
    write_job(shared, prefix, "vis-1", "vision", namespace="ns-a", cost_center="cc-2", project="atlas")
    write_job(shared, prefix, "bare", None)
    a = np.zeros((len(Category), 3), np.int64)
    a[Category.PRODUCTIVE] = [3_600_000, 10**9, 3_500_000]
    pipe = shared.pipeline()
    pipe.zadd(keys.jobs_key(prefix), {"month-end": JULY_END + 4 * 3600})
    owner = Attribution((("team", "llm"), ("namespace", "ns-a")), (("team", "rule"), ("namespace", "rule")))
    ledger.queue_attribution(pipe, prefix, "month-end", owner)
    ledger.queue_amounts(pipe, prefix, "month-end", {JULY_END + h * 3600: a for h in range(4)}, PRICE_VERSION)
    unassigned = np.zeros((len(Category), 3), np.int64)
    unassigned[Category.UNASSIGNED] = [1_800_000, 0, 1_750_000]
    ledger.queue_amounts(pipe, prefix, ledger.UNASSIGNED_JOB, {T0: unassigned}, PRICE_VERSION)
    pipe.execute()
    return LedgerStore(shared, prefix)


# ---- FOCUS 1.2 conformance: the spec's column rules, checked row by row -------------------------
DECIMALS = [
    "BilledCost", "ConsumedQuantity", "ContractedCost", "ContractedUnitPrice", "EffectiveCost", "ListCost",
    "ListUnitPrice", "PricingQuantity", "PricingCurrencyContractedUnitPrice", "PricingCurrencyEffectiveCost",
    "PricingCurrencyListUnitPrice", "CommitmentDiscountQuantity",
]  # fmt: skip
DATETIMES = ["BillingPeriodStart", "BillingPeriodEnd", "ChargePeriodStart", "ChargePeriodEnd"]
NOT_NULL = [
    "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodEnd",
    "BillingPeriodStart", "ChargeCategory", "ChargeDescription", "ChargeFrequency", "ChargePeriodEnd",
    "ChargePeriodStart", "ContractedCost", "EffectiveCost", "InvoiceId", "InvoiceIssuerName", "ListCost",
    "ProviderName", "PublisherName", "ServiceCategory", "ServiceName", "ServiceSubcategory",
]  # fmt: skip
ALLOWED = {
    "ChargeCategory": {"Usage", "Purchase", "Tax", "Credit", "Adjustment"},
    "ChargeClass": {"", "Correction"},
    "ChargeFrequency": {"One-Time", "Recurring", "Usage-Based"},
    "PricingCategory": {"", "Standard", "Dynamic", "Committed", "Other"},
    "CommitmentDiscountStatus": {"", "Used", "Unused"},
    "CapacityReservationStatus": {"", "Used", "Unused"},
}
ML_SUBCATEGORIES = {
    "AI Platforms", "Bots", "Generative AI", "Machine Learning", "Natural Language Processing",
    "Other (AI and Machine Learning)",
}  # fmt: skip
ISO_DT = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")
PLAIN_DECIMAL = re.compile(r"^-?\d+(\.\d+)?$")


def when(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def focus_violations(row: dict[str, str], user_tags: set[str]) -> list[str]:
    """Every FOCUS 1.2 column rule the row breaks (empty cell = null)."""
    bad = []
    missing = [c for c in FOCUS_COLUMNS if c not in row]
    bad += [f"missing column {c}" for c in missing]
    bad += [
        f"non-spec column {c} lacks the x_ prefix"
        for c in row
        if c not in FOCUS_COLUMNS and not c.startswith("x_")
    ]
    bad += [f"{c} is null" for c in NOT_NULL if not row.get(c)]
    bad += [f"{c}={row[c]!r} not allowed" for c, ok in ALLOWED.items() if row.get(c, "") not in ok]
    bad += [
        f"{c}={row[c]!r} is not a plain decimal"
        for c in DECIMALS
        if row.get(c) and not PLAIN_DECIMAL.match(row[c])
    ]
    bad += [
        f"{c}={row[c]!r} is not UTC ISO 8601" for c in DATETIMES if row.get(c) and not ISO_DT.match(row[c])
    ]
    if bad:
        return bad
    for c in ("BillingCurrency", "PricingCurrency"):
        if row[c] and not re.fullmatch(r"[A-Z]{3}", row[c]):
            bad.append(f"{c} {row[c]!r} is not an ISO 4217 code")
    if (
        row["ServiceCategory"] == "AI and Machine Learning"
        and row["ServiceSubcategory"] not in ML_SUBCATEGORIES
    ):
        bad.append(
            f"ServiceSubcategory {row['ServiceSubcategory']!r} is not a child of {row['ServiceCategory']!r}"
        )
    # billing period: a calendar month; the charge period inside it
    bs, be, cs, ce = (when(row[c]) for c in DATETIMES[:1] + DATETIMES[1:2] + DATETIMES[2:])
    if (
        bs.day != 1
        or bs.hour
        or bs.minute
        or (be.year * 12 + be.month) - (bs.year * 12 + bs.month) != 1
        or be.day != 1
    ):
        bad.append(f"billing period {bs}..{be} is not a calendar month")
    if not (bs <= cs < ce <= be):
        bad.append(f"charge period {cs}..{ce} is not inside the billing period {bs}..{be}")
    usage = row["ChargeCategory"] in ("Usage", "Purchase") and row["ChargeClass"] != "Correction"
    if usage:
        for c in ("SkuId", "SkuPriceId", "ListUnitPrice", "ContractedUnitPrice"):
            if not row[c]:
                bad.append(f"{c} is null on a usage row")
    if (
        row["ChargeCategory"] == "Usage"
        and row["ChargeClass"] != "Correction"
        and not row["ConsumedQuantity"]
    ):
        bad.append("ConsumedQuantity is null on a usage row")
    if row["ChargeCategory"] != "Usage" and row["ConsumedQuantity"]:
        bad.append("ConsumedQuantity set on a non-usage row")
    for q, unit in (("ConsumedQuantity", "ConsumedUnit"), ("PricingQuantity", "PricingUnit")):
        if row[q] and not row[unit]:
            bad.append(f"{unit} is null while {q} is set")
    if bool(row["SubAccountId"]) != bool(row["SubAccountType"]):
        bad.append("SubAccountType must be set exactly when SubAccountId is")
    if row["SubAccountId"] and not row["SubAccountName"]:
        bad.append("SubAccountName is null while SubAccountId is set")
    if not row["ResourceId"] and (row["ResourceType"] or row["ResourceName"]):
        bad.append("ResourceType/ResourceName set without ResourceId")
    if row["BillingAccountId"] and not row["BillingAccountType"]:
        bad.append("BillingAccountType is null while BillingAccountId is set")
    if not row["CommitmentDiscountId"] and (
        row["CommitmentDiscountStatus"] or row["CommitmentDiscountCategory"]
    ):
        bad.append("commitment discount columns set without CommitmentDiscountId")
    for price in ("ListUnitPrice", "ContractedUnitPrice"):
        if row[price] and Decimal(row[price]) < 0:
            bad.append(f"{price} is negative")
    for cost, price in (("ListCost", "ListUnitPrice"), ("ContractedCost", "ContractedUnitPrice")):
        if row[price] and row["PricingQuantity"]:
            expected = Decimal(row[price]) * Decimal(row["PricingQuantity"])
            if abs(Decimal(row[cost]) - expected) > Decimal("0.000001"):
                bad.append(f"{cost} {row[cost]} != {price} x PricingQuantity = {expected}")
    if row["Tags"]:
        tags = json.loads(row["Tags"])
        if not isinstance(tags, dict) or not all(isinstance(v, str | bool) for v in tags.values()):
            bad.append(f"Tags {row['Tags']!r} is not a JSON object of finalized values")
        elif set(tags) - user_tags:
            bad.append(f"Tags has keys nobody set: {sorted(set(tags) - user_tags)}")
    return bad


SHAPES = [
    ({"aggregate": "job"}, WINDOW),
    ({"aggregate": "team"}, WINDOW),
    ({"aggregate": "namespace"}, WINDOW),
    ({"aggregate": "cost_center"}, WINDOW),
    ({"aggregate": "label:project"}, WINDOW),
    ({"aggregate": "team,namespace"}, WINDOW),
    ({"aggregate": "job", "accumulate": "false", "step": "1d"}, WINDOW),
    ({"aggregate": "team", "accumulate": "false", "step": "1h"}, WINDOW),
    ({"aggregate": "job"}, ACROSS),
    ({"aggregate": "namespace", "accumulate": "false", "step": "1w"}, ACROSS),
]


@pytest.mark.parametrize(("params", "window"), SHAPES, ids=[f"{p}-{w[:10]}" for p, w in SHAPES])
def test_every_focus_export_follows_the_column_rules(ledger_of_four, params, window):
    names = FocusSettings(provider="Acme GPU Cloud", publisher="Acme", invoice_issuer="Acme Billing")
    with served(ledger_of_four, focus=names) as (base, _):
        js = httpx.get(f"{base}/api/v1/allocation", params={**params, "window": window}, timeout=30).json()
        got = httpx.get(
            f"{base}/api/v1/allocation", params={**params, "window": window, "format": "focus"}, timeout=30
        )
    assert got.status_code == 200, got.text
    rows = list(csv.DictReader(io.StringIO(got.text)))
    assert rows and list(rows[0]) == FOCUS_COLUMNS + FOCUS_X
    user_tags = {"team", "namespace", "cost_center", "project"}
    problems = {i: v for i, r in enumerate(rows) if (v := focus_violations(r, user_tags))}
    assert not problems, problems
    # the same money as the JSON rows, the names as configured, the price carried
    assert sum(Decimal(r["BilledCost"]) for r in rows) == sum(Decimal(r["cost"]) for r in js["rows"])
    assert {(r["ProviderName"], r["PublisherName"], r["InvoiceIssuerName"]) for r in rows} == {
        ("Acme GPU Cloud", "Acme", "Acme Billing")
    }
    assert {r["ListUnitPrice"] for r in rows} == {"3.5"}
    if window == ACROSS:  # the time across the month end is billed in both months
        assert {r["BillingPeriodStart"] for r in rows if Decimal(r["BilledCost"])} == {
            "2025-07-01T00:00:00Z",
            "2025-08-01T00:00:00Z",
        }


# ---- OpenCost parity: aggregates, combined aggregates, steps ------------------------------------
def allocation(base: str, **params) -> httpx.Response:
    return httpx.get(f"{base}/api/v1/allocation", params={"window": WINDOW, **params}, timeout=30)


def test_aggregates_slice_the_same_money(ledger_of_four):
    with served(ledger_of_four) as (base, _):
        by_job = {r["key"]: r for r in allocation(base).json()["rows"]}
        total = sum(Decimal(r["cost"]) for r in by_job.values())
        for aggregate, keys in (
            ("namespace", {"ns-a", "ns-b", "(no namespace)", "unassigned"}),
            ("cost_center", {"cc-1", "cc-2", "(no cost_center)", "unassigned"}),
            ("label:project", {"atlas", "(no label:project)", "unassigned"}),
            (
                "team,namespace",
                {"llm/ns-a", "llm/ns-b", "vision/ns-a", "(no team)/(no namespace)", "unassigned"},
            ),
        ):
            body = allocation(base, aggregate=aggregate).json()
            rows = {r["key"]: r for r in body["rows"]}
            assert set(rows) == keys, aggregate
            assert sum(Decimal(r["cost"]) for r in rows.values()) == total, aggregate
            assert body["aggregate"] == aggregate
        combined = {r["key"]: r for r in allocation(base, aggregate="team,namespace").json()["rows"]}
        assert combined["llm/ns-a"]["jobs"] == 2  # llm-1 and month-end (no time in this window)
        assert combined["llm/ns-a"]["properties"] == {"team": "llm", "namespace": "ns-a"}
        assert Decimal(combined["llm/ns-b"]["cost"]) == Decimal(by_job["llm-2"]["cost"])
        atlas = {r["key"]: r for r in allocation(base, aggregate="label:project").json()["rows"]}["atlas"]
        assert atlas["jobs"] == 2 and Decimal(atlas["cost"]) == Decimal(by_job["llm-1"]["cost"]) + Decimal(
            by_job["vis-1"]["cost"]
        )


@pytest.mark.parametrize("step", ["1h", "1d"])
def test_accumulate_false_gives_one_row_per_step_that_adds_up(ledger_of_four, step):
    with served(ledger_of_four) as (base, _):
        whole = allocation(base, aggregate="team").json()
        body = allocation(base, aggregate="team", accumulate="false", step=step).json()
        as_csv = list(csv.DictReader(io.StringIO(
            allocation(base, aggregate="team", accumulate="false", step=step, format="csv").text
        )))  # fmt: skip
    n_steps = 48 if step == "1h" else 2
    starts = sorted({r["start"] for r in body["rows"]})
    assert len(starts) == n_steps and body["accumulate"] is False and body["step"] == step
    for r in body["rows"]:
        assert (when(r["end"]) - when(r["start"])).total_seconds() == {"1h": 3600, "1d": 86400}[step]
    assert whole["rows"], whole
    for key in {r["key"] for r in whole["rows"]}:
        assert sum(Decimal(r["cost"]) for r in body["rows"] if r["key"] == key) == Decimal(
            next(r["cost"] for r in whole["rows"] if r["key"] == key)
        ), key
    assert [(r["key"], r["window_start"]) for r in as_csv] == [(r["key"], r["start"]) for r in body["rows"]]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"aggregate": "pod"}, "label:<name>"),
        ({"aggregate": "team,team"}, "distinct"),
        ({"aggregate": "label:"}, "label:<name>"),
        (
            {"accumulate": "false", "step": "5m", "window": "2025-01-01T00:00:00Z,2025-03-01T00:00:00Z"},
            "step",
        ),
        ({"accumulate": "maybe"}, "accumulate"),
        ({"step": "2d"}, "step"),
    ],
)
def test_a_bad_aggregate_or_step_is_a_400(ledger_of_four, params, says):
    with served(ledger_of_four) as (base, _):
        got = allocation(base, **params)
    assert got.status_code == 400 and says in got.json()["detail"], got.text


def test_a_scoped_token_sees_only_its_teams_in_every_aggregate(ledger_of_four, tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text(f"tokens:\n  - sha256: {hash_token('v')}\n    teams: [vision]\n")
    with served(ledger_of_four, Tokens.load(f)) as (base, _):
        for aggregate in ("namespace", "team,namespace", "label:project"):
            rows = httpx.get(
                f"{base}/api/v1/allocation",
                params={"window": WINDOW, "aggregate": aggregate, "format": "json"},
                headers={"Authorization": "Bearer v"},
                timeout=30,
            ).json()["rows"]
            assert sum(r["jobs"] for r in rows) == 1 and "unassigned" not in {r["key"] for r in rows}


# ---- offline docs, bearer scheme, the real error responses -------------------------------------
class Assets(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_load_from_the_package_alone(ledger_of_four, page):
    with served(ledger_of_four) as (base, _):
        html = httpx.get(base + page, timeout=30)
        assert html.status_code == 200
        parser = Assets()
        parser.feed(html.text)
        assert parser.urls and all(u.startswith("/") and not u.startswith("//") for u in parser.urls), (
            parser.urls
        )
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", html.text, re.I), "an external host"
        for url in parser.urls:
            asset = httpx.get(base + url, timeout=30)
            assert asset.status_code == 200 and len(asset.content) > 100, url
        assert "validatorUrl" not in html.text or '"validatorUrl": null' in html.text


def test_openapi_declares_bearer_and_the_errors_it_really_sends(ledger_of_four, tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text(f"tokens:\n  - sha256: {hash_token('x')}\n    teams: '*'\n")
    with served(ledger_of_four, Tokens.load(f)) as (base, _):
        spec = httpx.get(base + "/openapi.json", timeout=30).json()
        auth = {"Authorization": "Bearer x"}
        seen = {
            ("/api/v1/jobs/{job}", "400"): httpx.get(
                base + "/api/v1/jobs/llm-1", params={"window": "x"}, headers=auth
            ),
            ("/api/v1/jobs/{job}", "401"): httpx.get(base + "/api/v1/jobs/llm-1"),
            ("/api/v1/jobs/{job}", "404"): httpx.get(base + "/api/v1/jobs/nope", headers=auth),
            ("/api/v1/allocation", "400"): httpx.get(
                base + "/api/v1/allocation", params={"aggregate": "x"}, headers=auth
            ),
            ("/api/v1/jobs", "400"): httpx.get(base + "/api/v1/jobs", params={"limit": "0"}, headers=auth),
        }
    assert spec["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": spec["components"]["securitySchemes"]["HTTPBearer"]["description"],
    }
    assert "422" not in json.dumps(
        {p: {m: o["responses"] for m, o in ops.items()} for p, ops in spec["paths"].items()}
    )
    for (path, code), got in seen.items():
        assert got.status_code == int(code), (path, code, got.text)
        assert code in spec["paths"][path]["get"]["responses"], (path, code)
        assert set(got.json()) == {"detail"}
    for path in ("/api/v1/jobs", "/api/v1/jobs/{job}", "/api/v1/allocation", "/readyz"):
        assert "503" in spec["paths"][path]["get"]["responses"], path
    store = LedgerStore(__import__("redis").Redis(port=free_port(), socket_connect_timeout=0.2), "x")
    with served(store) as (base, _):
        assert httpx.get(base + "/api/v1/jobs", timeout=30).status_code == 503
