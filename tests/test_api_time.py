"""Time, windows and money in the API have one home each: a time zone given the way `--tz`
takes it (an IANA name, UTC, Z, +HH:MM) answers every windowed route with a 200 or a 400, never
a 500; `/api/v1` and OpenCost's routes resolve windows with one parser; and OpenCost's cost per
valid step is the core's (`cost.cost_per_valid_step`) for any amounts."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costexporter.api import opencost as oc
from costexporter.api import windows
from costexporter.core.cost import MICRO_PER_UNIT, cost_per_valid_step
from costexporter.store.ledger_read import LedgerStore

from .api_helpers import T0, served, write_job

ROUTES = [  # every route that takes a window (`/api/v1/jobs` lists all-time totals)
    ("/api/v1/jobs/tz-job", {"window": "week"}),
    ("/api/v1/jobs/tz-job/series", {"window": "yesterday", "step": "1h"}),
    ("/api/v1/jobs/tz-job/incidents", {"window": "month"}),
    ("/api/v1/allocation", {"window": "lastmonth", "aggregate": "team"}),
    ("/api/v1/allocation", {"window": "lastweek", "format": "csv"}),
    ("/api/v1/allocation", {"window": "today", "format": "focus"}),
    ("/allocation", {"window": "today"}),
    ("/allocation/compute", {"window": "week", "aggregate": "namespace"}),
    ("/model/allocation", {"window": "lastmonth"}),
]

zones = st.one_of(
    st.sampled_from(
        ["UTC", "Z", "utc", "Europe/Berlin", "Asia/Kolkata", "America/St_Johns", "Pacific/Chatham"]
    ),
    st.builds(
        lambda sign, h, m: f"{sign}{h:02d}:{m:02d}",
        st.sampled_from("+-"),
        st.integers(0, 23),
        st.integers(0, 59),
    ),
    st.sampled_from(["Mars/Olympus", "+25:00", "08:00", "+8", "", "../../etc/passwd"]),  # not zones
)


@pytest.fixture(scope="module")
def store(request):
    import redis

    from .conftest import SHARED_URL, drop_prefix

    r = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    prefix = f"tz-{request.node.name[:20]}"
    write_job(r, prefix, "tz-job", "llm", namespace="ns-a")
    yield LedgerStore(r, prefix)
    drop_prefix(r, prefix)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(tz=zones)
def test_any_time_zone_answers_every_windowed_route_with_a_200_or_a_400_never_a_500(store, tz):
    try:
        usable = windows.zone_of(tz) is not None
    except windows.WindowError:
        usable = False
    with served(store, tz=tz) as (url, _app):
        got = {
            path + str(params): httpx.get(url + path, params=params, timeout=30) for path, params in ROUTES
        }
    assert len(got) == len(ROUTES)
    assert {k: r.status_code for k, r in got.items()} == dict.fromkeys(got, 200 if usable else 400), tz
    assert usable or all("time zone" in r.text for r in got.values())


@given(
    ucost=st.integers(-(10**15), 10**15),
    steps=st.integers(0, 10**9),
)
def test_opencosts_cost_per_valid_step_is_the_cores_for_any_amounts(ucost, steps):
    row = oc.allocation("j", {}, T0, T0 + 3600, oc.Sums(ms=1000, ucost=ucost, valid_steps=steps))
    want = cost_per_valid_step(ucost, steps)
    assert row["costPerValidStep"] == (None if want is None else want / MICRO_PER_UNIT)


def test_the_two_apis_resolve_windows_with_one_parser_and_one_type():
    """OpenCost's parser is the API's with OpenCost's alignment: the same `Window`, the same
    zone rule (a +HH:MM zone works for both), the same refusals."""
    now = T0 + 1234.5
    a = windows.parse_window("yesterday", "+05:30", now)
    b = oc.parse_window("yesterday", "+05:30", now)
    assert type(a) is type(b) is windows.Window
    assert (a.start, a.end) == (b.start, b.end)
    assert a.asked_start == a.start - 0 and a.exact
    with pytest.raises(oc.OpenCostError, match="time zone"):
        oc.parse_window("today", "Mars/Olympus", now)
    with pytest.raises(windows.WindowError, match="time zone"):
        windows.parse_window("today", "+25:00", now)


instants = st.one_of(
    st.text(max_size=40),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**20), 10**20).map(str),
    st.datetimes(
        timezones=st.sampled_from([None, dt.UTC, dt.timezone(dt.timedelta(hours=-23, minutes=-59))])
    ).map(dt.datetime.isoformat),
)


@given(text=instants, tz=st.sampled_from(["UTC", "+14:00", "-12:00"]))
def test_an_at_instant_is_one_the_calendar_holds_or_a_window_error(text, tz):
    """`at=` (the budgets' close): whatever a client sends is an instant between 1970 and 3000
    that every calendar rule downstream can take, or a WindowError (the 400), never another
    exception (a 500)."""
    import datetime as _dt

    try:
        at = windows.parse_at(text, tz)
    except windows.WindowError as e:
        assert str(e)
        return
    assert 0 <= at <= windows.LATEST
    _dt.datetime.fromtimestamp(at, windows.zone_of(tz))  # the budgets' period rule takes it


def test_an_at_instant_without_one_is_now():
    assert windows.parse_at(None, now=T0) == T0
