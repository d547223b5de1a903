"""Query windows: `30m`, `24h`, `7d`, calendar words, RFC 3339 or Unix pairs -> [start, end).

Every window is resolved to a half-open interval aligned to the ledger's 5-minute buckets (start
rounded down, end rounded up) and echoed back, so a spreadsheet knows exactly what it summed.
Calendar words are taken in the configured time zone.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass
from zoneinfo import ZoneInfo

from costexporter.core.buckets import BUCKET_S
from costexporter.core.timeutil import RFC3339, parse_instant

ACCEPTED = (
    "a duration back from now (30m, 24h, 7d, 2w), a calendar word (today, yesterday, week, lastweek, "
    "month, lastmonth), an RFC 3339 pair 'start,end' or a Unix-seconds pair 'start,end'"
)
DURATION = re.compile(r"^(\d{1,6})([mhdw])$")
CALENDAR_WORDS = ("today", "yesterday", "week", "lastweek", "month", "lastmonth")


def _any_case(word: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" for c in word)


# What `parse_window` reads, as a regular expression in the subset JSON Schema (ECMA 262) and
# Python share: the OpenAPI documents it as the parameter's `pattern`. A string that matches it is
# refused only for what a pattern cannot say (a span of 0 or over 400 days, an end before its
# start, a date that is not in the calendar, outside 1970-3000), with a 400 that says which.
_UNIX = r"[0-9]{9,11}(\.[0-9]+)?"
_INSTANT = rf"\s*({_UNIX}|{RFC3339})\s*"
PATTERN = (
    r"^\s*([0-9]{1,6}[mhdwMHDW]|"
    + "|".join(_any_case(w) for w in CALENDAR_WORDS)
    + rf"|{_INSTANT},{_INSTANT})?\s*$"  # (empty: the default window)
)
UNIT_S = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_SPAN_S = 400 * 86400  # a window longer than this is surely a typo
LATEST = 32_503_680_000  # 3000-01-01T00:00:00Z: windows lie between 1970 and 3000


class WindowError(ValueError):
    """A window the API cannot use: the message says what is wrong and what is accepted."""


@dataclass(frozen=True)
class Window:
    start: int  # Unix seconds, inclusive, a bucket boundary
    end: int  # Unix seconds, exclusive, a bucket boundary
    text: str  # as asked

    def as_dict(self) -> dict:
        iso = lambda t: dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")  # noqa: E731
        return {
            "requested": self.text,
            "start": iso(self.start),
            "end": iso(self.end),
            "start_unix": self.start,
            "end_unix": self.end,
            "bucket_seconds": BUCKET_S,
        }


def _align(start: float, end: float) -> tuple[int, int]:
    s = int(start) // BUCKET_S * BUCKET_S
    e = -(-int(end) // BUCKET_S) * BUCKET_S
    return s, max(e, s + BUCKET_S)


def _midnight(d: dt.date, tz: dt.tzinfo) -> float:
    return dt.datetime(d.year, d.month, d.day, tzinfo=tz).timestamp()


def _instant(text: str) -> float:
    if not re.fullmatch(_UNIX, text.strip()) and _is_number(text):  # Unix seconds: 9 to 11 digits
        raise WindowError(f"{text!r} is neither an RFC 3339 time nor Unix seconds")
    try:
        return parse_instant(text)
    except ValueError as e:
        raise WindowError(str(e)) from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def calendar_span(
    word: str,
    now: float,
    zone: dt.tzinfo,
    week_start: int = 0,
    whole_today: bool = False,
    now_end: float | None = None,
) -> tuple[float, float] | None:
    """A calendar word's [start, end) in `zone` (today, yesterday, week, lastweek, month,
    lastmonth), None for another word. Weeks start on `week_start` (0 Monday, 6 Sunday); the
    current week and month end at `now_end` (default `now`), and so does today unless
    `whole_today` (then at its midnight). The API's windows and OpenCost's resolve the words
    here."""
    today = dt.datetime.fromtimestamp(now, zone).date()
    end_now = now if now_end is None else now_end
    if word == "today":
        return _midnight(today, zone), _midnight(
            today + dt.timedelta(days=1), zone
        ) if whole_today else end_now
    if word == "yesterday":
        return _midnight(today - dt.timedelta(days=1), zone), _midnight(today, zone)
    if word in ("week", "lastweek"):
        first = today - dt.timedelta(days=(today.weekday() - week_start) % 7)
        if word == "week":
            return _midnight(first, zone), end_now
        return _midnight(first - dt.timedelta(days=7), zone), _midnight(first, zone)
    if word in ("month", "lastmonth"):
        first = today.replace(day=1)
        if word == "month":
            return _midnight(first, zone), end_now
        prev = (first - dt.timedelta(days=1)).replace(day=1)
        return _midnight(prev, zone), _midnight(first, zone)
    return None


def parse_window(text: str | None, tz: str = "UTC", now: float | None = None, default: str = "30d") -> Window:
    """Resolve a window; raises WindowError with a message for the client."""
    raw = (text or "").strip() or default
    now = time.time() if now is None else now
    zone = ZoneInfo(tz)
    w = raw.lower()
    if m := DURATION.match(w):
        span = int(m.group(1)) * UNIT_S[m.group(2)]
        if span <= 0 or span > MAX_SPAN_S:
            raise WindowError(f"window {raw!r} must be between 1 minute and 400 days")
        start, end = now - span, now
    elif cal := calendar_span(w, now, zone):
        start, end = cal
    elif "," in raw:
        a, b = raw.split(",", 1)
        start, end = _instant(a), _instant(b)
        if end <= start:
            raise WindowError(f"window {raw!r}: the end must come after the start")
        if end - start > MAX_SPAN_S:
            raise WindowError(f"window {raw!r} is longer than 400 days")
    else:
        raise WindowError(f"window {raw!r} is not understood; accepted: {ACCEPTED}")
    if not (start >= 0 and end <= LATEST):
        raise WindowError(f"window {raw!r} must lie between 1970-01-01 and 3000-01-01")
    s, e = _align(start, end)
    return Window(s, e, raw)
