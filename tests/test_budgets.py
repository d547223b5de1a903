"""Budgets as operator policy: a period's spend of the jobs in scope, the thresholds crossed and
the period's forecast, over the API (real HTTP); a budget the policy gives but cannot be used
stops the API (one line); a team's token sees its team's budgets only."""

from __future__ import annotations

import datetime as dt
import uuid
from zoneinfo import ZoneInfo

import httpx
import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from costexporter.api.auth import Tokens, hash_token, parse_tokens
from costexporter.core import budgets
from costexporter.core.terms import PolicyError, parse_policy_file
from costexporter.store.ledger_read import LedgerStore

from .api_helpers import T0, served, write_job
from .conftest import SHARED_URL, drop_prefix

AT = T0 + 2 * 3600  # 2025-07-26T14:00:00Z: both hours of every job written


def test_periods_are_calendar_months_and_quarters_in_the_zone_or_rolling_days():
    utc, ny = dt.timezone.utc, ZoneInfo("America/New_York")
    b = budgets.Budget("m", 10.0, "month", (("team", "x"),))
    assert b.span(AT, utc) == (
        dt.datetime(2025, 7, 1, tzinfo=utc).timestamp(),
        dt.datetime(2025, 8, 1, tzinfo=utc).timestamp(),
    )
    # 2025-08-01T02:00Z is still July in New York
    early = dt.datetime(2025, 8, 1, 2, tzinfo=utc).timestamp()
    assert b.span(early, ny)[0] == dt.datetime(2025, 7, 1, tzinfo=ny).timestamp()
    q = budgets.Budget("q", 10.0, "quarter", (("team", "x"),))
    assert q.span(dt.datetime(2025, 12, 31, 23, tzinfo=utc).timestamp(), utc) == (
        dt.datetime(2025, 10, 1, tzinfo=utc).timestamp(),
        dt.datetime(2026, 1, 1, tzinfo=utc).timestamp(),
    )
    r = budgets.Budget("r", 10.0, "rolling:30d", (("team", "x"),))
    assert r.span(AT, utc) == (AT - 30 * 86400, AT)


@pytest.mark.parametrize(
    "raw, says",
    [
        ("x", "must be a list"),
        ([{"name": "a", "amount": 5}], "needs a scope"),
        ([{"name": "a", "amount": -5, "team": "x"}], "amount must be a number > 0"),
        ([{"name": "a", "amount": 5, "team": "x", "period": "fortnight"}], "period must be"),
        ([{"name": "a", "amount": 5, "team": "x", "thresholds": [0.5, "half"]}], "thresholds"),
        ([{"name": "a", "amount": 5, "team": "x", "owner": "me"}], "unknown key"),
        ([{"name": "a", "amount": 5, "team": "x"}, {"name": "a", "amount": 6, "team": "y"}], "named twice"),
        ([{"amount": 5, "team": "x"}], "needs a name"),
    ],
)
def test_a_budget_that_cannot_be_used_fails_the_policy_closed(raw, says):
    with pytest.raises(PolicyError, match=says) as e:
        parse_policy_file({"budgets": raw}, "policy.yaml")
    assert "\n" not in str(e.value)


@given(
    st.floats(0, 1e6, allow_nan=False),
    st.floats(0, 1e6, allow_nan=False),
    st.floats(0.01, 7),
    st.floats(0, 40 * 86400),
)
def test_a_forecast_never_goes_below_what_is_spent(spent, trend, days, left):
    b = budgets.Budget("b", 1000.0, "month", (("team", "x"),))
    s = budgets.status(b, spent, trend, days, 0.0, left)
    assert s.forecast_at_end is not None and s.forecast_at_end >= spent
    assert s.crossed == [t for t in b.thresholds if spent / 1000 >= t]
    assert set(s.forecast_crosses).isdisjoint(s.crossed)


POLICY = {
    "budgets": [
        {"name": "llm-month", "team": "llm", "amount": 20, "period": "month"},
        {"name": "everyone-quarter", "job": "*", "amount": 100, "period": "quarter"},
        {"name": "llm-a-day", "job": "llm-a*", "amount": 10, "period": "rolling:1d", "thresholds": [0.5]},
        {"name": "vision-month", "team": "vision", "amount": 5, "period": "month"},
    ]
}


@pytest.fixture(scope="module")
def api():
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    for job, team in (("llm-a", "llm"), ("llm-b", "llm"), ("vision-a", "vision")):
        write_job(r, prefix, job, team)  # two hours from T0 at 3.85 an hour
    tokens = Tokens(
        parse_tokens(
            {
                "tokens": [
                    {"name": "finance", "sha256": hash_token("fin"), "teams": "*"},
                    {"name": "vision", "sha256": hash_token("vis"), "teams": ["vision"]},
                ]
            }
        )
    )
    store = LedgerStore(redis.Redis.from_url(SHARED_URL, decode_responses=True), prefix)
    policy = parse_policy_file(POLICY)
    with served(store, tokens, budgets=policy.budgets) as (base, _):
        yield base
    drop_prefix(r, prefix)


def _get(base: str, token: str | None = "fin", **params) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{base}/api/v1/budgets", params=params, headers=headers, timeout=10)


def test_the_budgets_spend_thresholds_and_forecast(api):
    base = api
    r = _get(base, at=str(AT))
    assert r.status_code == 200, r.text
    body = r.json()
    got = {b["name"]: b for b in body["budgets"]}
    assert body["at"] == "2025-07-26T14:00:00Z" and body["currency"] == "USD"
    m = got["llm-month"]
    assert (m["start"], m["end"]) == ("2025-07-01T00:00:00Z", "2025-08-01T00:00:00Z")
    assert m["spent"] == "15.400000" and m["used"] == pytest.approx(0.77) and m["jobs"] == 2
    assert m["crossed"] == [0.5, 0.75]
    # 15.40 over the last 7 days: 2.20 a day for the 5 days 10 hours left of July
    left_days = (dt.datetime(2025, 8, 1, tzinfo=dt.timezone.utc).timestamp() - AT) / 86400
    assert float(m["forecast_at_end"]) == pytest.approx(15.4 + 2.2 * left_days, abs=1e-6)
    assert m["forecast_crosses"] == [0.9, 1.0]
    assert got["everyone-quarter"]["spent"] == "23.100000" and got["everyone-quarter"]["jobs"] == 3
    day = got["llm-a-day"]  # a rolling window: no end to forecast to
    assert day["spent"] == "7.700000" and day["crossed"] == [0.5] and day["forecast_at_end"] is None
    assert day["notes"] and "rolling" in day["notes"][0]
    # a month later nothing is spent in August yet
    later = {b["name"]: b for b in _get(base, at="2025-08-02T00:00:00Z").json()["budgets"]}
    assert later["llm-month"]["spent"] == "0.000000" and later["llm-month"]["crossed"] == []


def test_a_team_sees_its_teams_budgets_and_bad_input_is_a_400(api):
    base = api
    names = [b["name"] for b in _get(base, token="vis", at=str(AT)).json()["budgets"]]
    assert names == ["vision-month"]
    assert _get(base, token=None, at=str(AT)).status_code == 401
    bad = _get(base, at="next tuesday")
    assert bad.status_code == 400 and "RFC 3339" in bad.json()["detail"]
    # instants a calendar cannot hold, or outside 1970..3000, are a 400 the way a window's are
    for at, says in (
        ("1e300", "Unix seconds"),
        ("-5", "Unix seconds"),
        ("99999999999", "between 1970-01-01 and 3000-01-01"),
        ("9999-12-31T23:59:59-23:59", "between 1970-01-01 and 3000-01-01"),
    ):
        r = _get(base, at=at)
        assert r.status_code == 400 and says in r.json()["detail"], (at, r.text)


def test_an_empty_ledger_answers_every_budget_at_nothing_spent():
    store = LedgerStore(
        redis.Redis.from_url(SHARED_URL, decode_responses=True), f"test-{uuid.uuid4().hex[:12]}"
    )
    with served(store, budgets=parse_policy_file(POLICY).budgets) as (base, _):
        r = _get(base, token=None, at=str(AT))
    assert r.status_code == 200, r.text
    assert {b["name"]: (b["spent"], b["jobs"]) for b in r.json()["budgets"]} == {
        b["name"]: ("0.000000", 0) for b in POLICY["budgets"]
    }
