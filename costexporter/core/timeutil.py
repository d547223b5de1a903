"""Time as users write it and as the core counts it (pure): the zones a `--tz` names, UTC times
written out, and seconds turned into the core's integer milliseconds (`to_ms`: one rule).

The replay report, calibrate's labels and the CLI's times read a zone the same way; the API, the
watcher's webhook and its Alertmanager alerts write a time the same way (`iso_utc`).
"""

from __future__ import annotations

import datetime as dt
import math
import re
from zoneinfo import ZoneInfo

import numpy as np


def tz_zone(tz: str) -> dt.tzinfo:
    """The zone a --tz names (IANA name, UTC/Z or +HH:MM, as the CLI checks it) as a tzinfo."""
    if tz.upper() in ("UTC", "Z"):
        return dt.timezone.utc
    if m := re.fullmatch(r"([+-])(\d{2}):(\d{2})", tz):
        sign = 1 if m[1] == "+" else -1
        return dt.timezone(sign * dt.timedelta(hours=int(m[2]), minutes=int(m[3])))
    return ZoneInfo(tz)


def iso_utc(ts: float) -> str:
    """Unix seconds as RFC 3339 in UTC with a `Z` (fractions of a second only where there are)."""
    return dt.datetime.fromtimestamp(float(ts), dt.timezone.utc).isoformat().replace("+00:00", "Z")


# RFC 3339's date-time (its lower-case `t` and `z` and a space for the `T` included): the API's
# window pattern is built from it, and `parse_instant` reads it.
RFC3339 = (
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt ]([01][0-9]|2[0-3]):[0-5][0-9]"
    r"(:[0-5][0-9](\.[0-9]{1,6})?)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
)


def parse_instant(text: str, tz: dt.tzinfo | None = None) -> float:
    """A time as users write it -> Unix seconds: Unix seconds, RFC 3339, or ISO 8601. An ISO
    time without an offset is taken in `tz`; without `tz` it is refused (RFC 3339 needs one).
    The one time parser of the API's windows, OpenCost's windows, the FOCUS export and the CLI's
    times; raises ValueError with a one-line message."""
    t = text.strip()
    try:
        unix = float(t)
    except ValueError:
        pass
    else:
        if math.isfinite(unix):
            return unix
    iso = t
    rfc = re.fullmatch(RFC3339, t) is not None
    if rfc:  # RFC 3339 allows a lower-case t and z and a space; fromisoformat wants T and +00:00
        iso = t[:10] + "T" + t[11:]
        iso = iso[:-1] + "+00:00" if iso[-1] in "Zz" else iso
    try:
        d = dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        if rfc:
            raise ValueError(f"{text!r} is not a date in the calendar") from None
        raise ValueError(f"{text!r} is neither an RFC 3339 time nor Unix seconds") from None
    if d.tzinfo is None:
        if tz is None:
            raise ValueError(f"{text!r} has no time zone offset (RFC 3339 needs one, e.g. Z or +08:00)")
        d = d.replace(tzinfo=tz)
    try:
        return d.timestamp()
    except (ValueError, OverflowError):  # year 1 or 9999 with an offset that leaves the calendar
        raise ValueError(f"{text!r} is not a time this API can use") from None


def to_ms(seconds: float) -> int:
    """Seconds (a Unix time or a duration) as integer milliseconds: the nearest millisecond,
    ties to even. The one rounding rule at every edge where time enters in seconds (an event's
    or a registration's `ts`, a sample's time, a trace's column), so an event and a sample at
    the same instant land on the same millisecond, and a time written with three decimals
    reads back as the millisecond it was (truncating turns 1076499726.853 s, a float just
    below, into ...852 ms)."""
    return round(seconds * 1000)


def to_ms_array(seconds: np.ndarray) -> np.ndarray:
    """`to_ms` over an array (a trace's time column): the same rule, element by element."""
    return np.rint(np.asarray(seconds, np.float64) * 1000).astype(np.int64)
