"""Query windows: `30m`, `24h`, `7d`, calendar words, RFC 3339 or Unix pairs -> [start, end).

Every window is resolved to a half-open interval aligned to the ledger's 5-minute buckets (start
rounded down, end rounded up) and echoed back, so a spreadsheet knows exactly what it summed.
Calendar words are taken in the configured time zone (`timeutil.tz_zone`: an IANA name, UTC or
+HH:MM). One type and one parser for `/api/v1` and OpenCost's API (`OPENCOST`: its alignment of
durations and weeks).
"""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass
from typing import Any

from costexporter.core.buckets import BUCKET_S
from costexporter.core.timeutil import RFC3339, iso_utc, parse_instant, tz_zone

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
    """The window used (`start`, `end`: bucket boundaries) and the one asked (`asked_*`, as the
    text resolves, before alignment); they differ only where the asked one does not fall on
    buckets, which an answer can say (`exact`)."""

    start: int  # Unix seconds, inclusive, a bucket boundary
    end: int  # Unix seconds, exclusive, a bucket boundary
    text: str  # as asked
    asked_start: float = 0.0
    asked_end: float = 0.0

    @property
    def exact(self) -> bool:
        return self.start == self.asked_start and self.end == self.asked_end

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.text,
            "start": iso_utc(self.start),
            "end": iso_utc(self.end),
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


def _instant(text: str, strict: bool = True, tz: dt.tzinfo | None = None) -> float:
    """One end of a window, or an `at`: Unix seconds (`strict`: of 9 to 11 digits) or RFC 3339
    (an ISO time without an offset taken in `tz`, refused without one); WindowError else."""
    if strict and not re.fullmatch(_UNIX, text.strip()) and _is_number(text):  # Unix s: 9 to 11 digits
        raise WindowError(f"{text!r} is neither an RFC 3339 time nor Unix seconds")
    try:
        return parse_instant(text, tz)
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


@dataclass(frozen=True)
class Alignment:
    """How a window's words resolve: durations back from now (`/api/v1`), or OpenCost's (the last
    N units ending at the end of the current unit); the weekday weeks start on; whether `today`
    runs to midnight; whether windows ending now end at the end of the current bucket."""

    durations_to_unit_end: bool = False
    week_start: int = 0  # Monday (6: Sunday)
    whole_today: bool = False
    now_to_bucket_end: bool = False
    unix_digits: bool = True  # Unix seconds of 9 to 11 digits only (OpenCost's: any)


API = Alignment()
OPENCOST = Alignment(
    durations_to_unit_end=True, week_start=6, whole_today=True, now_to_bucket_end=True, unix_digits=False
)


def _ceil_bucket(t: float) -> int:
    return int(-(-t // BUCKET_S)) * BUCKET_S


def zone_of(tz: str) -> dt.tzinfo:
    """The zone of a configured `tz` (WindowError where it names none: a 400, never a 500)."""
    try:
        return tz_zone(tz)
    except (ValueError, KeyError) as e:  # ZoneInfoNotFoundError is a KeyError
        raise WindowError(f"time zone {tz!r} is not an IANA name, UTC or +HH:MM: {e}") from None


def parse_at(text: str | None, tz: str = "UTC", now: float | None = None) -> float:
    """An instant a query names (`at=`; None: now), held to the windows' rules: Unix seconds of 9
    to 11 digits or RFC 3339 (a time without an offset is in `tz`), between 1970 and 3000;
    raises WindowError with a message for the client."""
    if text is None:
        return time.time() if now is None else now
    at = _instant(text, True, zone_of(tz))
    if not 0 <= at <= LATEST:
        raise WindowError(f"{text!r} must lie between 1970-01-01 and 3000-01-01")
    return at


def parse_window(
    text: str | None,
    tz: str = "UTC",
    now: float | None = None,
    default: str | None = "30d",
    align: Alignment = API,
) -> Window:
    """Resolve a window (`default` where none is given; None: one is required); raises
    WindowError with a message for the client."""
    raw = (text or "").strip() or (default or "")
    if not raw:
        raise WindowError("window is required (e.g. window=24h, window=today, window=<start>,<end>)")
    now = time.time() if now is None else now
    zone = zone_of(tz)
    w = raw.lower()
    if m := DURATION.match(w):
        n, unit = int(m.group(1)), m.group(2)
        span = n * UNIT_S[unit]
        if span <= 0 or span > MAX_SPAN_S:
            raise WindowError(f"window {raw!r} must be between 1 minute and 400 days")
        if align.durations_to_unit_end:  # the last N units, ending at the end of the current one
            unit_s = {"m": BUCKET_S, "h": 3600, "d": 86400, "w": 86400}[unit]
            end = float((int(now) // unit_s + 1) * unit_s)
        else:
            end = now
        start = end - span
    elif cal := calendar_span(
        w,
        now,
        zone,
        align.week_start,
        align.whole_today,
        float(_ceil_bucket(now)) if align.now_to_bucket_end else None,
    ):
        start, end = cal
    elif "," in raw:
        a, b = raw.split(",", 1)
        start, end = _instant(a, align.unix_digits), _instant(b, align.unix_digits)
        if end <= start:
            raise WindowError(f"window {raw!r}: the end must come after the start")
        if end - start > MAX_SPAN_S:
            raise WindowError(f"window {raw!r} is longer than 400 days")
    else:
        raise WindowError(f"window {raw!r} is not understood; accepted: {ACCEPTED}")
    if not (start >= 0 and end <= LATEST):
        raise WindowError(f"window {raw!r} must lie between 1970-01-01 and 3000-01-01")
    s, e = _align(start, end)
    return Window(s, e, raw, start, end)
