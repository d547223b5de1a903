"""One time parser (`core/timeutil.parse_instant`) behind the API's windows, OpenCost's windows,
the FOCUS export and the CLI's times, and one calendar resolver (`api/windows.calendar_span`)
behind both kinds of window: the same text is the same instant everywhere."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costexporter.api import opencost, windows
from costexporter.cli.options import parse_time
from costexporter.core.timeutil import parse_instant

INSTANTS = st.datetimes(
    min_value=dt.datetime(1974, 1, 1), max_value=dt.datetime(2999, 1, 1), timezones=st.just(dt.timezone.utc)
).map(lambda d: d.replace(microsecond=0))
ZONES = st.sampled_from(["UTC", "Asia/Kathmandu", "America/New_York", "Pacific/Chatham"])


@given(INSTANTS, st.sampled_from(["T", "t", " "]), st.sampled_from(["Z", "z", "+00:00"]))
def test_every_reader_reads_an_rfc3339_time_as_the_same_instant(d, sep, zulu):
    text = d.strftime(f"%Y-%m-%d{sep}%H:%M:%S") + zulu
    want = d.timestamp()
    assert parse_instant(text) == want
    assert parse_time("UTC")(text) == int(want * 1000)
    pair = f"{text},{int(want) + 3600}"
    assert windows.parse_window(pair, now=want).start == int(want) // 300 * 300
    assert opencost.parse_window(pair, now=want).asked_start == want


@given(st.integers(min_value=100_000_000, max_value=32_000_000_000), ZONES)
def test_unix_seconds_are_the_same_instant_in_every_zone(t, tz):
    assert parse_instant(str(t)) == t
    assert parse_time(tz)(str(t)) == t * 1000


def test_a_time_without_an_offset_is_taken_in_the_zone_given_and_refused_without_one():
    assert parse_instant("2025-01-01T00:00", ZoneInfo("Asia/Kathmandu")) == 1735668900
    with pytest.raises(ValueError, match="no time zone offset"):
        parse_instant("2025-01-01T00:00")
    with pytest.raises(ValueError, match="not a date in the calendar"):
        parse_instant("2025-02-30T00:00Z")
    with pytest.raises(ValueError, match="neither an RFC 3339 time nor Unix seconds"):
        parse_instant("nan")


@given(st.floats(min_value=1.6e9, max_value=1.9e9), ZONES)
def test_weeks_start_on_monday_for_the_api_and_on_sunday_for_opencost(now, tz):
    zone = ZoneInfo(tz)
    for week_start, weekday in ((0, 0), (6, 6)):
        span = windows.calendar_span("week", now, zone, week_start=week_start)
        assert span is not None
        start = dt.datetime.fromtimestamp(span[0], zone)
        assert start.weekday() == weekday and (start.hour, start.minute) == (0, 0)
        assert 0 <= now - span[0] < 7 * 86400 + 3600 and span[1] == now
    api, oc = windows.parse_window("lastweek", tz, now), opencost.parse_window("lastweek", tz, now)
    assert dt.datetime.fromtimestamp(api.start, zone).weekday() == 0
    assert dt.datetime.fromtimestamp(oc.asked_start, zone).weekday() == 6
    assert windows.calendar_span("fortnight", now, zone) is None
